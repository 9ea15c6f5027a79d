"""The consumer's turn, split: host time of ``next()`` and of the training step (launch and sync) per batch,
beside the waiting share of each pass (wall time beyond the same steps alone), for one backend, shuffled,
a step of ``--factor`` times a batch's read time synced every step. A step longer on the host than alone
is one the GPU started late (it waits on the batch's "ready" event, or its launch came late).

    python -m benchmarks.diagnostics.probe_turn [--backend mmap] [--factor 1.5] [--passes 5] [--repeats 2]

GPU only. Writes ``results/<machine>/probe-turn[-TAG].json``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import (BATCH, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, timed,
                      write_probe)


def turns(ds: GDSDataset, step: Spin, alone_s: float) -> dict[str, float]:
    """One pass: its waiting share and the host times (us) of next() and of the step."""
    nexts: list[float] = []
    steps: list[float] = []
    start = time.perf_counter()
    for _batch in timed(ds, nexts):
        t0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    us = lambda a, q: round(1e6 * float(np.percentile(a, q)), 1)  # noqa: E731
    return {"wait_fraction": round((wall - len(steps) * alone_s) / wall, 4), "next_p50_us": us(nexts, 50),
            "next_p90_us": us(nexts, 90), "next_mean_us": round(1e6 * statistics.mean(nexts), 1),
            "step_p50_us": us(steps, 50), "step_mean_us": round(1e6 * statistics.mean(steps), 1),
            "step_alone_us": round(1e6 * alone_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    add_step_options(ap)
    ap.add_argument("--batches-ahead", type=int, default=None)
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    rows = Rows()
    with GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True,
                    batches_ahead=args.batches_ahead) as ds:
        for _ in range(2):  # the pipeline's start, and mmap's background load, out of the way
            time_pass(ds)
        r = time_pass(ds, min_seconds=0.5)
        step = Spin(r.seconds / -(-r.samples // BATCH) * 1e3 * args.factor, 1)
        for repeat in range(args.repeats):
            alone = step.alone(200) / 200  # again each repeat: launch latency drifts within a run
            for p in range(args.passes):
                rows.emit({"repeat": repeat, "pass": p, "backend": args.backend, **turns(ds, step, alone)})
    print("wrote", write_probe(args, "probe-turn", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
