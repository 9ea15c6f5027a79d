"""Aggregate read rate of N processes (one per GPU) against one, warm page cache.

    torchrun --nproc_per_node=1 -m benchmarks.scaling --backend kvikio
    torchrun --nproc_per_node=2 -m benchmarks.scaling --backend kvikio

Each rank reads its share of every epoch with gdsload into its own GPU; aggregate GB/s is all ranks'
bytes over the slowest rank's wall time, best of three epochs after a warm-up epoch. Rank 0 prints the row
and writes ``results/<machine>/scaling-<N>proc-<backend>.json`` with ``--write``.
"""

from __future__ import annotations

import argparse
import os
import sys

from gdsload import GDSDataset
from gdsload.measure import time_pass

from .common import BATCH, DATA_DIR, RESULTS_DIR, describe_machine, make_dataset, results_dir, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA_DIR)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--backend", default="kvikio")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--write", action="store_true", help="write the row under --out (else print it only)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        make_dataset(args.data, args.size_gib)
    dist.barrier()
    path = make_dataset(args.data, args.size_gib)  # written by rank 0: only its path here
    with GDSDataset(path, batch_size=BATCH, backend=args.backend) as ds:
        best = None
        for epoch in range(4):
            ds.set_epoch(epoch)
            dist.barrier()
            r = time_pass(ds)
            stats = torch.tensor([r.bytes, r.seconds], dtype=torch.float64, device="cuda")
            everyone = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            total = sum(float(s[0]) for s in everyone)
            slowest = max(float(s[1]) for s in everyone)
            if epoch > 0 and (best is None or slowest < best[1]):
                best = (total, slowest, [round(float(s[0]) / float(s[1]) / 1e9, 2) for s in everyone])
        io_mode = ds.describe()["io_mode"]
    if rank == 0 and best is not None:
        row = {"world_size": world, "backend": args.backend, "io_mode": io_mode,
               "aggregate_gb_per_s": round(best[0] / best[1] / 1e9, 2), "per_rank_gb_per_s": best[2],
               "bytes": int(best[0]), "seconds": round(best[1], 4)}
        print(row, flush=True)
        if args.write:
            info = describe_machine(args.data)
            out = os.path.join(results_dir(args.out, info), f"scaling-{world}proc-{args.backend}.json")
            write_json(out, {**row, "machine": info})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
