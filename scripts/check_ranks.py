#!/usr/bin/env python3
"""Check that ranks together read every sample of an epoch exactly once (multi-GPU, one process per GPU).

    torchrun --nproc_per_node=2 scripts/check_ranks.py --data /tmp/ranks --out results/

Each rank reads its share into its LOCAL_RANK device (rank and world size come from torch.distributed),
checks every sample's content on the GPU, and the ranks' sample ids are gathered on rank 0, which checks
coverage, duplicates and batch counts for two epochs and writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gdsload import GDSDataset  # noqa: E402
from gdsload.sources import ArraySource  # noqa: E402
from gdsload.writer import write_dataset  # noqa: E402

SAMPLE = (64, 1024)  # 64 KiB of uint8 per sample


def pattern(idx: np.ndarray) -> np.ndarray:
    j = np.arange(int(np.prod(SAMPLE)), dtype=np.int64)
    return ((idx[:, None] * 13 + j[None, :]) % 253).astype(np.uint8).reshape(len(idx), *SAMPLE)


class Pattern:
    origin = "<pattern>"
    dtype = np.dtype(np.uint8)

    def __init__(self, n: int):
        self.shape = (n, *SAMPLE)

    def read(self, start: int, stop: int) -> np.ndarray:
        return pattern(np.arange(start, stop, dtype=np.int64))

    def close(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--samples", type=int, default=30011)  # prime: uneven split on purpose
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.data, "ranks.gds")
    if rank == 0 and not os.path.exists(path):
        write_dataset(path, {"x": Pattern(args.samples), "idx": ArraySource("idx", np.arange(args.samples))},
                      block_bytes=1 << 20, progress=False)
    dist.barrier()

    summary = {"world_size": world, "epochs": []}
    with GDSDataset(path, batch_size=args.batch_size, backend=args.backend, shuffle=True, seed=7,
                    output="torch") as ds:
        assert (ds.config.rank, ds.config.world_size, ds.device) == (rank, world, local)
        j = torch.arange(int(np.prod(SAMPLE)), device=f"cuda:{local}", dtype=torch.int64)
        for epoch in range(2):
            ds.set_epoch(epoch)
            ids, bad, t0 = [], torch.zeros((), dtype=torch.int64, device=f"cuda:{local}"), time.perf_counter()
            for batch in ds:
                assert batch["x"].device.index == local
                i = batch["idx"].to(torch.int64)
                want = ((i[:, None] * 13 + j[None, :]) % 253).to(torch.uint8)
                bad += (batch["x"].reshape(len(i), -1) != want).sum()
                ids.append(i)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            mine = torch.cat(ids)
            counts = [torch.zeros((), dtype=torch.int64, device=mine.device) for _ in range(world)]
            dist.all_gather(counts, torch.tensor(len(mine), device=mine.device))
            size = int(max(c.item() for c in counts))
            padded = torch.full((size,), -1, dtype=torch.int64, device=mine.device)
            padded[:len(mine)] = mine
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded)
            batches = [torch.zeros((), dtype=torch.int64, device=mine.device) for _ in range(world)]
            dist.all_gather(batches, torch.tensor(ds.stats.batches, device=mine.device))
            dist.all_reduce(bad)
            if rank == 0:
                per_rank = [g[:int(c.item())].cpu().numpy() for g, c in zip(gathered, counts)]
                allids = np.concatenate(per_rank)
                unique = np.unique(allids)
                row = {"epoch": epoch, "samples": args.samples, "per_rank_samples": [len(p) for p in per_rank],
                       "per_rank_batches": [int(b.item()) for b in batches],
                       "distinct_samples_read": int(len(unique)),
                       "every_sample_read": bool(np.array_equal(unique, np.arange(args.samples))),
                       "repeated_for_padding": int(len(allids) - len(unique)),
                       "mismatched_bytes": int(bad.item()), "io_mode": ds.io_mode,
                       "rank0_gb_per_s": round(ds.stats.bytes_read / wall / 1e9, 2)}
                summary["epochs"].append(row)
                print(json.dumps(row), flush=True)
    ok = True
    if rank == 0:
        e = summary["epochs"]
        ok = all(r["every_sample_read"] and r["mismatched_bytes"] == 0 and len(set(r["per_rank_batches"])) == 1
                 and r["repeated_for_padding"] < world * 2 * args.batch_size for r in e)
        ok = ok and e[0]["per_rank_samples"] == e[1]["per_rank_samples"]
        summary["ok"] = ok
        print(f"ranks cover each epoch exactly once: {ok}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"ranks-{world}gpu-{args.backend}.json"), "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
