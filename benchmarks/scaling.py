"""Aggregate read rate of N processes (one per GPU) against one, warm page cache.

    torchrun --nproc_per_node=1 -m benchmarks.scaling --backend kvikio
    torchrun --nproc_per_node=2 -m benchmarks.scaling --backend kvikio
    torchrun --nproc_per_node=2 -m benchmarks.scaling --backend raw

Each rank reads its share of every epoch with gdsload into its own GPU; aggregate GB/s is all ranks'
bytes over the slowest rank's wall time, best of ``--epochs`` epochs (3) after a warm-up epoch, the median
beside it. An "epoch" here is a stretch of back-to-back passes of at least ``--min-seconds`` (0.5) from
rest, as the suite's warm rows time them (the pipeline's start amortized, as in training, where each pass
is read ahead during the one before); raw KvikIO is timed the same way. ``--min-seconds 0``: one pass from
rest (the method of the rows written before the option). ``--backend raw`` is the ceiling beside them: raw
KvikIO reads of the image blocks (one ``pread`` per block, shuffled, handles open), each rank every
``world``-th block. Rank 0 prints the row and writes ``results/<machine>/scaling-<N>proc-<backend>.json``
with ``--write``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload.system.env import kvikio_info
from gdsload.tools.measure import PassResult, block_locations, raw_kvikio_blocks, time_pass

from .common import BATCH, DATA_DIR, RESULTS_DIR, describe_machine, make_dataset, results_dir, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA_DIR)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--backend", default="kvikio", help="a gdsload backend, or 'raw' (raw KvikIO, the ceiling)")
    ap.add_argument("--threads", type=int, default=None, help="the backend's reader threads (default: its own)")
    ap.add_argument("--options", type=json.loads, default={}, help="more backend_options, as JSON")
    ap.add_argument("--dataset-options", type=json.loads, default={},
                    help="more GDSDataset arguments (prefetch, window_blocks, ...), as JSON")
    ap.add_argument("--epochs", type=int, default=3, help="epochs timed after the warm-up one")
    ap.add_argument("--min-seconds", type=float, default=0.5,
                    help="each epoch: back-to-back passes for at least this long, from rest (0: one pass)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
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
    reader = _reader(path, args.backend, args.threads, args.options, args.dataset_options, rank, world,
                     args.min_seconds)
    with reader as (one_pass, io_mode, settings):
        best, rates = None, []
        for epoch in range(1 + args.epochs):
            dist.barrier()
            r = one_pass(epoch)
            stats = torch.tensor([r.bytes, r.seconds], dtype=torch.float64, device="cuda")
            everyone = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            total = sum(float(s[0]) for s in everyone)
            slowest = max(float(s[1]) for s in everyone)
            if epoch > 0:
                rates.append(total / slowest / 1e9)
            if epoch > 0 and (best is None or slowest < best[1]):
                best = (total, slowest, [round(float(s[0]) / float(s[1]) / 1e9, 2) for s in everyone])
    if rank == 0 and best is not None:
        row = {"world_size": world, "backend": args.backend, "threads": args.threads, "options": args.options,
               "dataset_options": args.dataset_options,
               "io_mode": io_mode, "backend_settings": settings,
               "aggregate_gb_per_s": round(best[0] / best[1] / 1e9, 2), "per_rank_gb_per_s": best[2],
               "median_aggregate_gb_per_s": round(float(np.median(rates)), 2), "epochs_timed": len(rates),
               "min_seconds": args.min_seconds,
               "bytes": int(best[0]), "seconds": round(best[1], 4)}
        print(row, flush=True)
        if args.write:
            info = describe_machine(args.data)
            out = os.path.join(results_dir(args.out, info), f"scaling-{world}proc-{args.backend}"
                               f"{f'-{args.threads}threads' if args.threads else ''}{args.tag}.json")
            write_json(out, {**row, "machine": info})
    dist.destroy_process_group()
    return 0


def back_to_back(one: Callable[[int], PassResult], min_seconds: float) -> PassResult:
    """``one(0)``, ``one(1)``, ... until their times add up to ``min_seconds`` (at least one), as one stretch."""
    total, i = PassResult(bytes=0, seconds=0.0, io_mode=""), 0
    while i == 0 or total.seconds < min_seconds:
        r = one(i)
        total.bytes, total.seconds, total.io_mode = total.bytes + r.bytes, total.seconds + r.seconds, r.io_mode
        i += 1
    return total


@contextlib.contextmanager
def _reader(path: str, backend: str, threads: int | None, options: dict[str, Any], dataset_options: dict[str, Any],
            rank: int, world: int, min_seconds: float
            ) -> Iterator[tuple[Callable[[int], PassResult], str, dict[str, Any]]]:
    """One epoch's reading for this rank (given the epoch), the io mode it runs in and the reader's
    settings (the backend's own, as :meth:`GDSDataset.describe` gives them)."""
    if backend == "raw":
        import cupy

        blocks = block_locations(path, ("image",))[rank::world]
        dest = cupy.empty(sum(b.nbytes for b in blocks), dtype=cupy.uint8)
        kw = {"threads": threads} if threads else {}

        def raw(epoch: int) -> PassResult:
            return back_to_back(lambda i: raw_kvikio_blocks(blocks, dest, seed=1000 * epoch + i, **kw), min_seconds)

        yield raw, kvikio_info()["io_mode"], kw
        return
    options = {**options, **({"num_threads": threads} if threads else {})}
    with GDSDataset(path, batch_size=BATCH, backend=backend, backend_options=options or None,
                    **dataset_options) as ds:
        def one_pass(epoch: int) -> PassResult:
            ds.set_epoch(epoch)
            return time_pass(ds, min_seconds=min_seconds)

        d = ds.describe()
        yield one_pass, d["io_mode"], {"backend": d["backend"], **d["backend_stats"]}


if __name__ == "__main__":
    sys.exit(main())
