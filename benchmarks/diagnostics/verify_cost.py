"""What ``verify`` (crc32c of every block read, on the GPU) costs each backend, in one run on the same data.

    python -m benchmarks.diagnostics.verify_cost [--size-gib 8] [--backends mmap,pinned,kvikio]

Warm, shuffled passes with verify off and on, interleaved round by round, per backend (each dataset stopped
after its pass, so neither reads ahead while the other is measured); beside them the device kernel's own
rate on one window buffer and the pinned H2D ceiling. Cost = 1 - best(on) / best(off). Writes
``results/<machine>/verify-cost[-TAG].json``. GPU only.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import pinned_h2d_gbps, time_pass

from ..common import BATCH, Rows, make_dataset, parse_probe_args, probe_parser, write_probe


def kernel_gbps(nbytes: int = 256 << 20, block_bytes: int = 4 << 20, repeats: int = 5) -> float:
    """The library's crc32c kernel alone: a window buffer of 4 MiB blocks, best of ``repeats``."""
    import cupy

    from gdsload.checksum_cuda import DeviceCrc

    crc = DeviceCrc(0)
    buf = cupy.random.randint(0, 256, nbytes, dtype=cupy.uint8)
    lo = np.arange(0, nbytes, block_bytes, dtype=np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    best = float("inf")
    for _ in range(repeats):
        stream.synchronize()
        t0 = time.perf_counter()
        crc.launch(buf, lo, lo + block_bytes, stream)
        stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", default="mmap,pinned,kvikio")
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    rows = Rows()
    rows.emit({"what": "ceiling: pinned H2D copy", "gb_per_s": round(pinned_h2d_gbps(), 2)})
    try:
        rows.emit({"what": "crc32c kernel alone, 256 MiB of 4 MiB blocks", "gb_per_s": round(kernel_gbps(), 2)})
    except (ImportError, AttributeError, TypeError) as e:  # the kernel's module is library-internal
        rows.emit({"what": "crc32c kernel alone", "error": f"{type(e).__name__}: {e}"})
    for backend in args.backends.split(","):
        datasets = {v: GDSDataset(path, BATCH, backend=backend, shuffle=True, verify=v) for v in (False, True)}
        passes: dict[bool, list[float]] = {False: [], True: []}
        for ds in datasets.values():
            time_pass(ds)  # warm up: page cache, kernels compiled, buffers allocated
        for r in range(args.rounds):
            for v, ds in datasets.items():
                ds.set_epoch(r + 1)
                passes[v].append(time_pass(ds).gb_per_s)
                ds.stop()  # no reading ahead while the other one is measured
        io_mode = datasets[False].describe()["io_mode"]
        for ds in datasets.values():
            ds.close()
        top = {v: max(x) for v, x in passes.items()}
        rows.emit({"what": f"gdsload {backend}", "io_mode": io_mode, "regime": "warm", "shuffle": True,
                   "gb_per_s_verify_off": [round(x, 2) for x in passes[False]],
                   "gb_per_s_verify_on": [round(x, 2) for x in passes[True]],
                   "best_off": round(top[False], 2), "best_on": round(top[True], 2),
                   "cost_pct": round(100 * (1 - top[True] / top[False]), 1)})
    print("wrote", write_probe(args, "verify-cost", rows, rounds=args.rounds, method=__doc__.split("\n\n")[2]),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
