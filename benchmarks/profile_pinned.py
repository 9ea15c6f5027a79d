#!/usr/bin/env python3
"""Several warm passes of gdsload's pinned backend, to be sampled by py-spy (where does the time go?).

    py-spy record --idle --threads --format raw -o pinned.txt -- python3 benchmarks/profile_pinned.py --data DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_read import make_dataset, posix_read  # noqa: E402

from gdsload import GDSDataset  # noqa: E402
from gdsload.format import DatasetLayout, read_metadata  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--backend", default="pinned")
    args = ap.parse_args()
    import cupy

    path = os.path.join(args.data, "profile.gds")
    make_dataset(path, args.size_gib)
    posix_read(DatasetLayout(read_metadata(path)).shard_paths(), False, True)
    with GDSDataset(path, batch_size=256, backend=args.backend) as ds:
        for i in range(args.passes):
            t0 = time.perf_counter()
            for _ in ds:
                pass
            cupy.cuda.get_current_stream().synchronize()
            dt = time.perf_counter() - t0
            print(f"pass {i}: {ds.stats.bytes_read / dt / 1e9:.2f} GB/s, stall {ds.stats.stall_s / dt:.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
