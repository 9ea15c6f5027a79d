"""Does nvCOMP's batched zstd decode block the host, and what makes it not: the question behind a compressed
store's swinging warm rate (issue 46).

    python -m benchmarks.diagnostics.probe_decode_sync [--chunks 128,512,2048] [--chunk-kib 256] [--json FILE]

nvCOMP 6's Python ``Codec.decode`` documents that without ``decompression_config`` it "internally calls
``configure_decompression`` on ``src``, forcing a stream synchronization", and that a config built from a
``CompressConfig`` (``codec.decompression_config(codec.compression_config(sizes))``) is "fully sync-free".
gdsload's decode step (gdsload/codecs/nvcomp.py) passes no config. Per batch size (chunks of int32 Zipf tokens
compressed by numcodecs' zstd level 3 on the CPU, back to back in one device buffer, as a window holds them;
outputs into views of one device buffer, as the window's cells), each case:

- ``blocks``: a spin kernel of ``--spin-ms`` is queued on the codec's stream first; the host seconds the
  decode call takes: about the spin (or more) means the call waited for the stream;
- ``host_ms`` and ``gbps``: the call alone (stream idle before it), and decoded GB/s over ``--repeats`` calls
  queued back to back, then one synchronisation;
- ``exact``: every chunk's decoded bytes equal the CPU's;
- ``sizes``: what ``outs[i]`` reports as its size (the check gdsload makes), for one chunk truncated by half
  in the batch (``truncated``): an error raised, a size other than the chunk's, or silence (the stale bytes
  of the cell would be a wrong sample);
- ``pinned_allocs`` / ``device_allocs``: calls nvCOMP made to its allocators per decode call (counted by
  allocators that hand out CuPy memory; ``set_*_allocator``).

Cases: ``plain`` (gdsload's call today), ``config-from-sizes`` (the sync-free config, built once per batch
size and reused), ``config-from-buffers`` (a config parsed from the first batch, reused for others of the
same shape), ``latency`` (``execution_policy=LATENCY``, plain call). GPU and ``nvidia-nvcomp-cu13`` only.
Prints a line per case and batch size; ``--json FILE`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

import numpy as np

CASES = ("plain", "config-from-sizes", "config-from-buffers", "latency")


class Counting:
    """An nvCOMP allocator handing out CuPy memory, counting its calls."""

    def __init__(self, alloc: Any):
        self.alloc, self.calls = alloc, 0

    def __call__(self, nbytes: int, stream: Any) -> Any:
        self.calls += 1
        return self.alloc(max(int(nbytes), 1))


def frames_of(n: int, chunk_bytes: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    import numcodecs

    rng = np.random.default_rng(0)
    zstd = numcodecs.Zstd(level=3)
    base = [rng.zipf(1.3, chunk_bytes // 4).clip(0, 50_000).astype(np.int32).view(np.uint8) for _ in range(8)]
    frames = [np.frombuffer(zstd.encode(c), np.uint8) for c in base]
    return [base[i % 8] for i in range(n)], [frames[i % 8] for i in range(n)]


def run_case(name: str, n: int, chunk_bytes: int, spin_ms: float, repeats: int) -> dict[str, Any]:
    import cupy
    from nvidia import nvcomp

    from ..common import Spin

    plain, frames = frames_of(n, chunk_bytes)
    stream = cupy.cuda.Stream(non_blocking=True)
    pinned, device = Counting(cupy.cuda.alloc_pinned_memory), Counting(cupy.cuda.alloc)
    nvcomp.set_pinned_allocator(pinned)
    nvcomp.set_device_allocator(device)
    policy = {"execution_policy": nvcomp.ExecutionPolicy.LATENCY} if name == "latency" else {}
    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=0,
                         cuda_stream=stream.ptr, **policy)
    ends = np.cumsum([len(f) for f in frames])
    src = cupy.asarray(np.concatenate(frames))
    out = cupy.zeros(n * chunk_bytes, np.uint8)
    views = [src[int(e - len(f)):int(e)] for f, e in zip(frames, ends)]
    cells = [out[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(n)]
    config = None
    if name == "config-from-sizes":
        config = codec.decompression_config(codec.compression_config([chunk_bytes] * n))
    elif name == "config-from-buffers":
        config = codec.decompression_config(nvcomp.as_arrays(views))
    kw = {} if config is None else {"decompression_config": config}

    def call() -> Any:
        return codec.decode(nvcomp.as_arrays(views), out=nvcomp.as_arrays(cells), **kw)

    row: dict[str, Any] = {"case": name, "chunks": n, "chunk_bytes": chunk_bytes}
    call()
    stream.synchronize()
    row["exact"] = bool(np.array_equal(out.get(), np.concatenate(plain)))
    pinned.calls = device.calls = 0
    t0 = time.perf_counter()
    call()
    row["host_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    stream.synchronize()
    row["pinned_allocs"], row["device_allocs"] = pinned.calls, device.calls
    with stream:
        Spin(spin_ms).launch()
    t0 = time.perf_counter()
    call()
    row["blocks"] = round((time.perf_counter() - t0) * 1e3, 3)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    stream.synchronize()
    row["gbps"] = round(repeats * n * chunk_bytes / (time.perf_counter() - t0) / 1e9, 2)
    row["truncated"] = truncated(codec, nvcomp, cupy, frames, views, cells, chunk_bytes, kw, stream)
    nvcomp.set_pinned_allocator(None)
    nvcomp.set_device_allocator(None)
    return row


def truncated(codec: Any, nvcomp: Any, cupy: Any, frames: list, views: list, cells: list, chunk_bytes: int,
              kw: dict[str, Any], stream: Any) -> str:
    """What happens when chunk 1 of the batch is cut to half its length."""
    cut = list(views)
    cut[1] = views[1][:len(frames[1]) // 2]
    try:
        outs = codec.decode(nvcomp.as_arrays(cut), out=nvcomp.as_arrays(cells), **kw)
        stream.synchronize()
        cai = outs[1].__cuda_array_interface__
        size = int(np.prod(cai["shape"])) * np.dtype(cai["typestr"]).itemsize
        return "silent (size reported as the chunk's)" if size == chunk_bytes else f"size reported {size}"
    except Exception as e:  # noqa: BLE001 - what nvCOMP raises is the finding
        return f"raised {type(e).__name__}: {str(e)[:160]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="128,512,2048")
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--spin-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from nvidia import nvcomp

    rows = []
    for n in (int(c) for c in args.chunks.split(",")):
        for name in CASES:
            try:
                row = run_case(name, n, args.chunk_kib << 10, args.spin_ms, args.repeats)
            except Exception as e:  # noqa: BLE001 - a case nvCOMP refuses is a finding, the others still run
                row = {"case": name, "chunks": n, "error": f"{type(e).__name__}: {e}",
                       "trace": traceback.format_exc(limit=3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nvcomp": nvcomp.__version__, "spin_ms": args.spin_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
