#!/usr/bin/env python3
"""Check that ranks together read every sample of an epoch exactly once, every byte checked on the device.

    torchrun --nproc_per_node=2 -m benchmarks.check_ranks --data /tmp/ranks --out results/
    python -m benchmarks.check_ranks --elastic 3,2,4 --cut 5 --backend cpu --data /tmp/ranks --out results/

Elastic: one epoch in legs of 3, 2, then 4 ranks (processes launched here, no torch.distributed), each resuming
from the merged state of the last; the legs' union must be the epoch, and epoch 1 what a fresh run reads."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np

from gdsload import GDSDataset
from gdsload.pipeline.plan import epoch_plan
from gdsload.pipeline.resume import merge_states
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset

from .common import ROOT as _ROOT, Generated, add_options, write_json  # ROOT: where ``-m benchmarks...`` resolves

SAMPLE = (64, 1024)  # 64 KiB of uint8 per sample


def pattern(idx: np.ndarray) -> np.ndarray:
    j = np.arange(int(np.prod(SAMPLE)), dtype=np.int64)
    return ((idx[:, None] * 13 + j[None, :]) % 253).astype(np.uint8).reshape(len(idx), *SAMPLE)


def make_data(data: str, samples: int) -> str:
    path = os.path.join(data, "ranks.gds" if samples == 30011 else f"ranks-{samples}.gds")
    if not os.path.exists(path):
        x = Generated("<pattern>", np.uint8, (samples, *SAMPLE), lambda a, b: pattern(np.arange(a, b, dtype=np.int64)))
        write_dataset(path, {"x": x, "idx": ArraySource("idx", np.arange(samples))}, block_bytes=1 << 20,
                      progress=False)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    add_options(ap, samples=30011, batch_size=("128", "samples per batch (elastic: one per leg, e.g. 16,24,12)"),
                backend="auto", out=None, elastic=(None, "world sizes of the legs of an epoch, e.g. 3,2,4"),
                cut=("5", "elastic: batches each leg but the last reads before its checkpoint (one value, or one per "
                     "leg)"), gpus=(0, "elastic: devices to spread ranks over (LOCAL_RANK = rank %% gpus; default: "
                                   "one per rank)"))  # samples: a prime, an uneven split on purpose
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # elastic: one rank of a leg (JSON args)
    args = ap.parse_args()
    if args.worker:
        return elastic_rank(args, json.loads(args.worker))
    if args.elastic:
        return elastic(args)
    return distributed(args)


def distributed(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        make_data(args.data, args.samples)
    dist.barrier()
    path = make_data(args.data, args.samples)
    batch_size = int(args.batch_size)

    summary = {"world_size": world, "epochs": []}
    with GDSDataset(path, batch_size=batch_size, backend=args.backend, shuffle=True, seed=7,
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
    code = 0
    if rank == 0:
        e = summary["epochs"]
        ok = all(r["every_sample_read"] and r["mismatched_bytes"] == 0 and len(set(r["per_rank_batches"])) == 1
                 and r["repeated_for_padding"] < world * 2 * batch_size for r in e)
        ok = ok and e[0]["per_rank_samples"] == e[1]["per_rank_samples"]
        code = finish(args, f"ranks-{world}gpu-{args.backend}.json", summary, ok, "ranks cover each epoch")
    dist.destroy_process_group()
    return code


def finish(args: argparse.Namespace, name: str, summary: dict, ok: bool, what: str) -> int:
    """Say whether ``what`` holds, write ``summary`` with ``ok`` to ``OUT/name`` (with --out); the exit status."""
    summary["ok"] = ok
    print(f"{what} exactly once: {ok}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, name), summary)
    return 0 if ok else 1


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a.cpu() if hasattr(a, "cpu") else a)


def elastic_rank(args: argparse.Namespace, job: dict) -> int:
    """One rank of one leg: resume from the merged state (or start epoch 0), read ``job["cut"]`` batches
    (all: -1), check every byte, write ids and state; the last leg also reads the next epoch whole."""
    with GDSDataset(job["path"], batch_size=job["batch_size"], backend=args.backend, shuffle=True, seed=7) as ds:
        if job["state"]:
            with open(job["state"]) as f:
                ds.load_state_dict(json.load(f))
        else:
            ds.set_epoch(0)

        def read(limit: int) -> tuple[list[int], int, int]:
            ids, bad, n = [], 0, 0
            for batch in ds:
                i = host(batch["idx"]).astype(np.int64)
                bad += int((host(batch["x"]) != pattern(i)).sum())
                ids.extend(i.tolist())
                n += 1
                if n == limit:
                    break
            return ids, bad, n

        t0 = time.perf_counter()
        ids, bad, batches = read(job["cut"])
        result = {"rank": ds.config.rank, "world_size": ds.config.world_size, "ids": ids, "batches": batches,
                  "mismatched_bytes": bad, "state": ds.state_dict(), "io_mode": ds.io_mode,
                  "window_blocks": ds.config.window_blocks, "wall_s": round(time.perf_counter() - t0, 3)}
        if job["cut"] < 0:
            epoch = result["state"]["epoch"] + 1
            ds.set_epoch(epoch)
            later, later_bad, _ = read(-1)
            result["next_epoch_is_fresh"] = later == epoch_plan(ds.config, epoch).sample_ids().tolist()
            result["mismatched_bytes"] += later_bad
    with open(job["result"], "w") as f:
        json.dump(result, f)
    return 0


def per_leg(text: str, legs: int, what: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if len(values) == 1:
        values *= legs
    if len(values) != legs:
        raise SystemExit(f"--{what}: expected one value or {legs}, found {text!r}")
    return values


def run_legs(args: argparse.Namespace, path: str, worlds: list[int], cuts: list[int], batch_sizes: list[int],
             work: str) -> list[tuple[dict, list[dict]]] | None:
    """Each leg's ranks as processes, their states merged between legs; per leg a summary row and the ranks'
    results (None if a rank failed)."""
    state, legs = "", []
    for leg, world in enumerate(worlds):
        procs = []
        for r in range(world):
            job = {"path": path, "batch_size": batch_sizes[leg], "state": state,
                   "cut": cuts[leg] if leg < len(cuts) else -1,
                   "result": os.path.join(work, f"leg{leg}-rank{r}.json")}
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(r % args.gpus if args.gpus else r)}
            cmd = [sys.executable, "-m", "benchmarks.check_ranks", "--data", args.data, "--backend", args.backend,
                   "--worker", json.dumps(job)]
            procs.append((job, subprocess.Popen(cmd, env=env, cwd=_ROOT)))
        failed = [r for r, (_, p) in enumerate(procs) if p.wait() != 0]
        if failed:
            print(f"leg {leg}: ranks {failed} of {world} failed", flush=True)
            return None
        results = []
        for job, _ in procs:
            with open(job["result"]) as f:
                results.append(json.load(f))
        merged = merge_states([r["state"] for r in results])
        state = os.path.join(work, f"state{leg}.json")
        with open(state, "w") as f:
            json.dump(merged, f)
        row = {"leg": leg, "world_size": world, "batch_size": batch_sizes[leg],
               "window_blocks": [r["window_blocks"] for r in results],
               "per_rank_batches": [r["batches"] for r in results],
               "per_rank_samples": [len(r["ids"]) for r in results],
               "mismatched_bytes": sum(r["mismatched_bytes"] for r in results), "io_mode": results[0]["io_mode"],
               "state": {k: merged[k] for k in ("epoch", "batches_yielded", "hops")}}
        print(json.dumps(row), flush=True)
        legs.append((row, results))
    return legs


def elastic(args: argparse.Namespace) -> int:
    """Launch every leg's ranks as processes, merge their states between legs, check the union."""
    worlds = per_leg(args.elastic, len(args.elastic.split(",")), "elastic")
    cuts = per_leg(args.cut, len(worlds) - 1, "cut") if len(worlds) > 1 else []
    batch_sizes = per_leg(args.batch_size, len(worlds), "batch-size")
    os.makedirs(args.data, exist_ok=True)
    path = make_data(args.data, args.samples)
    with tempfile.TemporaryDirectory(prefix="check-ranks-") as work:  # ranks' ids and states
        legs = run_legs(args, path, worlds, cuts, batch_sizes, work)
    if legs is None:
        return 1
    counts = Counter(i for _, results in legs for r in results for i in r["ids"])
    repeated = sum(counts.values()) - len(counts)
    last = legs[-1][1]
    summary = {
        "samples": args.samples, "legs": [row for row, _ in legs], "backend": args.backend,
        "every_sample_read": sorted(counts) == list(range(args.samples)),
        "repeated_for_padding": repeated,
        "mismatched_bytes": sum(row["mismatched_bytes"] for row, _ in legs),
        "equal_batches_per_leg": all(len(set(row["per_rank_batches"])) == 1 for row, _ in legs),
        "next_epoch_is_fresh": all(r["next_epoch_is_fresh"] for r in last),
    }
    # Padding: the first leg's (under a block per rank) plus at most one sample per rank in each later leg.
    spb = max(1, (1 << 20) // int(np.prod(SAMPLE)))
    ok = (summary["every_sample_read"] and summary["mismatched_bytes"] == 0 and summary["equal_batches_per_leg"]
          and summary["next_epoch_is_fresh"] and repeated < worlds[0] * spb + sum(worlds[1:]))
    return finish(args, f"elastic-{'-'.join(map(str, worlds))}-{args.backend}.json", summary, ok,
                  f"legs {args.elastic} cover the epoch")


if __name__ == "__main__":
    sys.exit(main())
