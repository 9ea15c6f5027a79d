#!/usr/bin/env python3
"""What ``verify`` (crc32c of every block read, on the GPU) costs each backend, in one run on the same data.

    python benchmarks/verify_cost.py --data /path/on/nvme --size-gib 8 --out benchmarks/results

Warm, shuffled passes with verify off and on, interleaved round by round, per backend; beside them the
device kernel's own rate on one window buffer and the pinned H2D ceiling. Writes
``verify-cost-<date>-<gpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_read import bench_dataset, gdsload_epoch, result_name  # noqa: E402

from gdsload import GDSDataset  # noqa: E402
from gdsload.sysinfo import pinned_h2d_gbps, system_info  # noqa: E402


def kernel_gbps(nbytes: int = 256 << 20, block_bytes: int = 4 << 20, repeats: int = 5) -> float:
    """The crc32c kernel alone: a window buffer of 4 MiB blocks, best of ``repeats``."""
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", default="mmap,pinned,kvikio")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = system_info()
    path, _, nbytes = bench_dataset(args.data, f"verify-{args.size_gib:g}g.gds", args.size_gib)
    rows = [{"what": "ceiling: pinned H2D copy", "gbps": round(pinned_h2d_gbps(), 2)},
            {"what": "crc32c kernel alone, 256 MiB of 4 MiB blocks", "gbps": round(kernel_gbps(), 2)}]
    for row in rows:
        print(json.dumps(row), flush=True)
    for backend in args.backends.split(","):
        datasets = {v: GDSDataset(path, 256, backend=backend, shuffle=True, verify=v) for v in (False, True)}
        passes: dict[bool, list[float]] = {False: [], True: []}
        for ds in datasets.values():
            gdsload_epoch(ds)  # warm up: page cache, kernels compiled, buffers allocated
        for r in range(args.rounds):
            for v, ds in datasets.items():
                ds.set_epoch(r + 1)
                got, dt = gdsload_epoch(ds)
                ds.stop()  # no reading ahead while the other one is measured
                passes[v].append(got / dt / 1e9)
        io_mode = datasets[False].io_mode
        for ds in datasets.values():
            ds.close()
        best = {v: max(x) for v, x in passes.items()}
        row = {"what": f"gdsload {backend}", "io_mode": io_mode, "regime": "warm", "shuffle": True,
               "gbps_verify_off": [round(x, 2) for x in passes[False]],
               "gbps_verify_on": [round(x, 2) for x in passes[True]],
               "best_off": round(best[False], 2), "best_on": round(best[True], 2),
               "cost_pct": round(100 * (1 - best[True] / best[False]), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = result_name(info, "verify-cost-")
    result = {"info": info, "dataset_bytes": nbytes, "rounds": args.rounds, "rows": rows,
              "method": "warm shuffled passes, batch 256, 3x224x224 uint8 + int64 labels; verify off and on "
                        "interleaved per round; cost = 1 - best(on) / best(off)"}
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# verify cost ({info.get('gpu')}, {nbytes / 1e9:.1f} GB, warm, shuffled)", "",
             "| what | io mode | GB/s verify off | GB/s verify on | cost |", "|---|---|---:|---:|---:|"]
    for r in rows:
        if "best_off" in r:
            lines.append(f"| {r['what']} | {r['io_mode']} | {r['best_off']} | {r['best_on']} | {r['cost_pct']} % |")
        else:
            lines.append(f"| {r['what']} | | {r['gbps']} | | |")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
