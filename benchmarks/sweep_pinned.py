#!/usr/bin/env python3
"""The pinned backend's warm GB/s across slot sizes, pool sizes and reader threads (one run, same data).

    python benchmarks/sweep_pinned.py --data /path/on/nvme --out benchmarks/results

Each configuration: best of four passes over a 4 GiB dataset after one warm-up pass. Behind the default
of 16 MiB slots in a 512 MiB pool.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import Rows, bench_dataset, best_pass_seconds, posix_read, write_probe  # noqa: E402

from gdsload import GDSDataset  # noqa: E402

CONFIGS = [(8, 256, 16), (16, 512, 16), (32, 1024, 16), (8, 1024, 16), (16, 512, 32), (4, 256, 16)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import cupy

    path, paths, nbytes = bench_dataset(args.data, "step.gds", args.size_gib)
    posix_read(paths, False, True)
    rows = Rows()
    for slot, pool, threads in CONFIGS:
        opts = {"slot_bytes": slot << 20, "pool_bytes": pool << 20, "num_threads": threads}
        with GDSDataset(path, batch_size=256, backend="pinned", backend_options=opts) as ds:
            best = best_pass_seconds(ds, 5)
            rows.emit({"slot_mib": slot, "pool_mib": pool, "threads": threads, "reader": ds.backend.reader,
                       "gb_per_s": round(ds.stats.bytes_read / best / 1e9, 2)})
        cupy.get_default_memory_pool().free_all_blocks()
    print("wrote", write_probe(args.out, "sweep-pinned-", "", rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
