"""The consumer's turn, split: host time of ``next()`` and of the training step (launch and sync) per batch,
beside the waiting share of each pass (wall time beyond the same steps alone), for one backend, shuffled,
a step of ``--step-factor`` times a batch's read time synced every step. A step longer on the host than
alone is one the GPU started late (it waits on the batch's "ready" event, or its launch came late).

    python -m benchmarks.diagnostics.probe_turn --backend mmap --size-gib 8 --passes 4 --label library
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import BATCH, DATA_DIR, make_dataset


def turns(ds: GDSDataset, step: Spin, alone_s: float) -> dict[str, float]:
    """One pass: its waiting share and the host times (us) of next() and of the step."""
    clock = time.perf_counter
    nexts, steps = [], []
    it = iter(ds)
    start = clock()
    while True:
        t0 = clock()
        try:
            next(it)
        except StopIteration:
            break
        t1 = clock()
        step()
        nexts.append(t1 - t0)
        steps.append(clock() - t1)
    wall = clock() - start
    us = lambda a, q: round(1e6 * float(np.percentile(a, q)), 1)  # noqa: E731
    return {"wait_fraction": round((wall - len(steps) * alone_s) / wall, 4), "next_p50_us": us(nexts, 50),
            "next_p90_us": us(nexts, 90), "next_mean_us": round(1e6 * statistics.mean(nexts), 1),
            "step_p50_us": us(steps, 50), "step_mean_us": round(1e6 * statistics.mean(steps), 1),
            "step_alone_us": round(1e6 * alone_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=DATA_DIR)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--backend", default="mmap")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--step-factor", type=float, default=1.5)
    ap.add_argument("--batches-ahead", type=int, default=None)
    ap.add_argument("--label", default="library", help="printed before each pass (the variant under test)")
    args = ap.parse_args(argv)
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    with GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True,
                    batches_ahead=args.batches_ahead) as ds:
        for _ in range(2):  # the pipeline's start, and mmap's background load, out of the way
            time_pass(ds)
        r = time_pass(ds, min_seconds=0.5)
        step = Spin(r.seconds / -(-r.samples // BATCH) * 1e3 * args.step_factor, 1)
        alone = step.alone(200) / 200
        for p in range(args.passes):
            print(f"{args.label} pass {p}: {turns(ds, step, alone)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
