#!/usr/bin/env python3
"""Aggregate read rate of N processes (one per GPU) against one, warm page cache.

    torchrun --nproc_per_node=1 benchmarks/scaling.py --data DIR --out benchmarks/results
    torchrun --nproc_per_node=2 benchmarks/scaling.py --data DIR --out benchmarks/results

Each rank reads its share of every epoch with gdsload (``--backend``, default kvikio) into its own GPU; aggregate GB/s is
all ranks' bytes over the slowest rank's wall time, best of three epochs after a warm-up epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_read import make_dataset  # noqa: E402

from gdsload import GDSDataset  # noqa: E402
from gdsload.sysinfo import system_info  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--backend", default="kvikio")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.data, "scaling.gds")
    if rank == 0:
        make_dataset(path, args.size_gib)
    dist.barrier()
    with GDSDataset(path, batch_size=256, backend=args.backend) as ds:
        best = None
        for epoch in range(4):
            ds.set_epoch(epoch)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in ds:
                pass
            cupy.cuda.get_current_stream().synchronize()
            wall = time.perf_counter() - t0
            stats = torch.tensor([ds.stats.bytes_read, wall], dtype=torch.float64, device="cuda")
            everyone = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            total = sum(float(s[0]) for s in everyone)
            slowest = max(float(s[1]) for s in everyone)
            if epoch > 0 and (best is None or slowest < best[1]):
                best = (total, slowest, [round(float(s[0]) / float(s[1]) / 1e9, 2) for s in everyone])
        if rank == 0:
            row = {"world_size": world, "backend": args.backend, "io_mode": ds.io_mode,
                   "aggregate_gb_per_s": round(best[0] / best[1] / 1e9, 2), "per_rank_gb_per_s": best[2],
                   "bytes": int(best[0]), "seconds": round(best[1], 4), "machine": system_info()}
            print(json.dumps({k: v for k, v in row.items() if k != "machine"}), flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"scaling-{world}proc-{args.backend}.json"), "w") as f:
                    json.dump(row, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
