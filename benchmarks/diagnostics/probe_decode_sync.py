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
  decode call takes: about the spin (or more) means the call waited for the stream. ``blocks_other``: the
  same with the spin on another stream: about the spin means the call waited for the whole device (a
  ``cudaFree`` in nvCOMP's own allocator does);
- ``host_ms`` and ``gbps``: the call alone (stream idle before it), and decoded GB/s over ``--repeats`` calls
  queued back to back, then one synchronisation;
- ``exact``: every chunk's decoded bytes equal the CPU's;
- ``truncated`` / ``corrupted``: chunk 1 of the batch cut to half its length, or 64 bytes in its middle
  inverted, its cell filled with 0xAB first: an error raised, or no error and the cell untouched, exact, or
  wrong (a silent wrong sample), with what nvCOMP reports as its size;
- ``gil_free_pct``: what a Python thread counts while the call runs, against as long a sleep: about 0 means
  the call holds the GIL, and every other thread (the consumer's, the assembler's) stops meanwhile;
- ``pinned_allocs`` / ``device_allocs``: calls nvCOMP made to its allocators per decode call (counted by
  allocators that hand out CuPy memory; ``set_*_allocator``).

Cases: ``plain`` (gdsload's call today), ``config-from-sizes`` (the sync-free config, built once per batch
size and reused), ``latency`` (``execution_policy=LATENCY``, plain call), ``default-allocators`` and
``config-default-allocators`` (the first two with nvCOMP's own allocators, nothing counted). A config parsed
from the buffers (``codec.decompression_config(batch)``) is left out: it syncs as the plain call does, and the
run that tried it crashed (while codecs were still destroyed after their streams). GPU and nvCOMP only.
Each case runs in a child process of its own (a decode that never returns is reported as hung after
``--timeout``); the damaged chunks are decoded at the first batch size. Prints a line per case and batch
size; ``--json FILE`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

CASES = ("plain", "config-from-sizes", "latency", "default-allocators", "config-default-allocators")
DAMAGED = ("plain", "config-from-sizes")  # the cases a damaged chunk is decoded by


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


def run_case(name: str, n: int, chunk_bytes: int, spin_ms: float, repeats: int,
             damage: str | None = None) -> dict[str, Any]:
    import cupy
    from nvidia import nvcomp

    from ..common import Spin

    plain, frames = frames_of(n, chunk_bytes)
    stream = cupy.cuda.Stream(non_blocking=True)
    pinned, device = Counting(cupy.cuda.alloc_pinned_memory), Counting(cupy.cuda.alloc)
    if "default-allocators" not in name:
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
    if name.startswith("config"):
        config = codec.decompression_config(codec.compression_config([chunk_bytes] * n))
    kw = {} if config is None else {"decompression_config": config}

    def call() -> Any:
        return codec.decode(nvcomp.as_arrays(views), out=nvcomp.as_arrays(cells), **kw)

    row: dict[str, Any] = {"case": name, "chunks": n, "chunk_bytes": chunk_bytes}
    call()
    if damage is not None:
        stream.synchronize()
        row[damage] = damaged(codec, nvcomp, cupy, damage, views, cells, plain[1], kw, stream)
        codec = None  # before its stream: nvCOMP uses the stream when the codec is destroyed
        return row
    stream.synchronize()
    row["exact"] = bool(np.array_equal(out.get(), np.concatenate(plain)))
    pinned.calls = device.calls = 0
    t0 = time.perf_counter()
    call()
    row["host_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    stream.synchronize()
    row["pinned_allocs"], row["device_allocs"] = pinned.calls, device.calls
    row["gil_free_pct"] = gil_free_pct(call, stream)
    row["blocks"] = behind_spin(call, Spin(spin_ms), stream, stream)
    row["blocks_other"] = behind_spin(call, Spin(spin_ms), cupy.cuda.Stream(non_blocking=True), stream)
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    stream.synchronize()
    row["gbps"] = round(repeats * n * chunk_bytes / (time.perf_counter() - t0) / 1e9, 2)
    codec = None  # before its stream: nvCOMP uses the stream when the codec is destroyed
    nvcomp.set_pinned_allocator(None)
    nvcomp.set_device_allocator(None)
    return row


def behind_spin(call: Any, spin: Any, on: Any, stream: Any) -> float:
    """Host milliseconds ``call`` takes with ``spin`` queued first on stream ``on`` (both streams drained after)."""
    with on:
        spin.launch()
    t0 = time.perf_counter()
    call()
    took = round((time.perf_counter() - t0) * 1e3, 3)
    on.synchronize()
    stream.synchronize()
    return took


def gil_free_pct(call: Any, stream: Any) -> float:
    """How much a Python thread gets done while ``call`` runs, against as long a sleep (100: the call lets the
    GIL go throughout; about 0: it holds it, and every other thread of the process, the training loop's
    included, stops for as long as it runs)."""
    import threading

    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    call()
    took, during = time.perf_counter() - t0, count[0] - c0
    stream.synchronize()
    c0 = count[0]
    time.sleep(took)
    idle = count[0] - c0
    stop.set()
    worker.join()
    return round(100 * during / max(idle, 1), 1)


def damaged(codec: Any, nvcomp: Any, cupy: Any, how: str, views: list, cells: list, expected: np.ndarray,
            kw: dict[str, Any], stream: Any) -> str:
    """What happens when chunk 1 of the batch is cut to half its length (``truncated``) or has 64 bytes in its
    middle inverted (``corrupted``), its cell filled with 0xAB first: an error raised, the cell left untouched,
    the right bytes (a damage nvCOMP cannot see), or wrong bytes with no error (a silent wrong sample)."""
    bad = list(views)
    if how == "truncated":
        bad[1] = views[1][:len(views[1]) // 2]
    else:
        bad[1] = views[1].copy()
        mid = len(bad[1]) // 2
        bad[1][mid:mid + 64] ^= 0xFF
    cells[1].fill(0xAB)
    try:
        outs = codec.decode(nvcomp.as_arrays(bad), out=nvcomp.as_arrays(cells), **kw)
        stream.synchronize()
    except Exception as e:  # noqa: BLE001 - what nvCOMP raises is the finding
        return f"raised {type(e).__name__}: {str(e)[:160]}"
    sizes = getattr(outs, "buffer_sizes", None)
    got = cells[1].get()
    what = ("untouched" if (got == 0xAB).all() else "exact" if np.array_equal(got, expected)
            else f"wrong ({int((got != expected).sum())} bytes differ)")
    return f"no error: cell {what}; buffer_sizes[1] {None if sizes is None else list(sizes)[1]}"


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One case in this process (``--one CASE:N[:DAMAGE]``), its row printed as the last line of JSON."""
    name, n, *damage = args.one.split(":")
    return run_case(name, int(n), args.chunk_kib << 10, args.spin_ms, args.repeats, damage[0] if damage else None)


def in_child(argv: list[str], spec: str, timeout_s: float) -> dict[str, Any]:
    """Run one case in a child process: a decode that never returns (a kernel spinning on a damaged frame)
    is reported as hung after ``timeout_s`` instead of stopping the probe."""
    name, n, *damage = spec.split(":")
    head: dict[str, Any] = {"case": name, "chunks": int(n)}
    try:
        done = subprocess.run([sys.executable, "-m", __spec__.name, *argv, "--one", spec], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**head, damage[0] if damage else "error": f"hung: no answer within {timeout_s:g} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    return {**head, damage[0] if damage else "error": f"exit {done.returncode}: {tail[:300]}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="128,512,2048")
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--spin-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take in its child process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)), flush=True)
        return 0
    from nvidia import nvcomp

    passed = ["--chunk-kib", str(args.chunk_kib), "--spin-ms", str(args.spin_ms), "--repeats", str(args.repeats)]
    specs = [f"{name}:{n}" for n in (int(c) for c in args.chunks.split(",")) for name in CASES]
    specs += [f"{name}:{args.chunks.split(',')[0]}:{how}" for name in DAMAGED for how in ("truncated", "corrupted")]
    rows = []
    for spec in specs:
        row = in_child(passed, spec, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nvcomp": nvcomp.__version__, "spin_ms": args.spin_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
