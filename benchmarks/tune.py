#!/usr/bin/env python3
"""Sweep gdsload's knobs (window size, prefetch depth, threads) on a warm page cache, beside raw KvikIO.

    python benchmarks/tune.py --data /path/on/nvme --out benchmarks/results

Writes ``tune-<date>-<gpu>.json``: best-of-N GB/s and consumer stall per configuration. Used to choose the
defaults; run.py is the benchmark of record. (tune-2026-11-23-*.json predates the current meaning of
``prefetch``: there it counted window buffers, which are now ``prefetch`` + the windows one batch spans;
it also compared ways of handing the GIL to reader threads, which made no difference and were dropped.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import THREADS, gdsload_epoch, make_dataset, posix_read, raw_kvikio, write_probe  # noqa: E402

from gdsload import GDSDataset, read_metadata  # noqa: E402
from gdsload.format import DatasetLayout  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="kvikio,pinned")
    args = ap.parse_args()
    import cupy

    path = os.path.join(args.data, "bench.gds")
    make_dataset(path, args.size_gib)
    paths = DatasetLayout(read_metadata(path)).shard_paths()
    nbytes = sum(os.path.getsize(p) for p in paths)
    rows = []

    def best_of(fn) -> tuple[float, float]:
        runs = [fn() for _ in range(args.repeats)]
        b = max(runs, key=lambda r: r[0] / r[1])
        return round(b[0] / b[1] / 1e9, 2), b[1]

    posix_read(paths, False, True)  # warm the page cache
    rows.append({"config": "pagecache-ceiling", "gb_per_s": best_of(lambda: posix_read(paths, False, True))[0]})
    dest = cupy.empty(nbytes, dtype=cupy.uint8)
    for threads in (16, 32):
        rows.append({"config": f"raw-kvikio threads={threads}",
                     "gb_per_s": best_of(lambda: raw_kvikio(paths, dest, threads))[0]})
    dest = None  # free the device copy before the next contender
    cupy.get_default_memory_pool().free_all_blocks()
    print(json.dumps(rows), flush=True)

    for backend, window_mib, prefetch, threads in itertools.product(
            args.backends.split(","), (128, 256), (1, 2, 4), (16,)):
        ds = GDSDataset(path, batch_size=256, backend=backend, prefetch=prefetch,
                        window_blocks=max(1, (window_mib << 20) // read_metadata(path).fields["image"].block_bytes),
                        backend_options={"num_threads": threads})
        gdsload_epoch(ds)
        stall = []

        def run():
            r = gdsload_epoch(ds)
            stall.append(ds.stats.stall_s / max(r[1], 1e-9))
            return r

        gbps, secs = best_of(run)
        row = {"config": f"{backend} window={window_mib}MiB prefetch={prefetch} threads={threads}",
               "backend": backend, "window_mib": window_mib, "prefetch": prefetch, "buffers": len(ds._slots),
               "threads": threads,
               "gb_per_s": gbps, "stall_fraction": round(min(stall), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        ds.close()
        cupy.get_default_memory_pool().free_all_blocks()
        time.sleep(0.2)

    print("wrote", write_probe(args.out, "tune-", "", rows, dataset_bytes=nbytes, threads_default=THREADS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
