"""A mixture of three datasets against one dataset of the same total bytes, warm, in one run.

    python -m benchmarks.mixture [--size-gib 4] [--backends mmap,pinned,kvikio] [--rounds 3]

The three sources hold 1/2, 1/3 and 1/6 of ``--size-gib`` of the suite's images and are mixed in those
proportions (every source with the same backend); the single dataset holds ``--size-gib``. Each is timed as
a stretch of back-to-back batches for at least ``--min-seconds`` from rest (the suite's warm method; the
mixture's stretch is whole passes of ``num_batches`` = the single dataset's batches per epoch), the two in
alternating order round by round, the device synchronised at the end of each stretch. GB/s counts the bytes
of the batches delivered. Then each waits beside a simulated step of ``--step-factor`` times a batch's read
time (the suite's method, ``time_passes``: steps timed alone, passes with a step per batch, the median of
the later passes' time beyond them). Writes ``results/<machine>/mixture[-TAG].json`` and a markdown table.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from gdsload import GDSDataset, Mixture
from gdsload.tools.measure import device_sync, time_pass, time_passes
from gdsload.tools.steps import Step, make_step

from .common import BATCH, Rows, make_dataset, parse_probe_args, probe_parser, write_probe_table

SHARES = {"half": 3, "third": 2, "sixth": 1}  # sixths of the total


def time_mixture(mix: Mixture, sync: Any, min_seconds: float) -> float:
    """GB/s of whole passes over ``mix`` for at least ``min_seconds``, from rest."""
    mix.stop()
    nbytes, t0 = 0, time.perf_counter()
    while True:
        for batch in mix:
            nbytes += sum(a.nbytes for a in batch.values())
        sync()
        took = time.perf_counter() - t0
        if took >= min_seconds:
            return nbytes / took / 1e9


def mixture_waiting(mix: Mixture, step: Step, sync: Any, passes: int = 3) -> float:
    """Waiting beside ``step`` as :func:`gdsload.tools.measure.time_passes` times it for one dataset: steps
    alone first (reading stopped), then ``1 + passes`` passes back to back from rest, each with a step per
    batch; a pass's wait is its time beyond the steps alone. The median of the later passes, as a share of
    the steps alone."""
    mix.stop()
    alone = step.alone(len(mix))
    waits, t_prev = [], time.perf_counter()
    for _ in range(1 + passes):
        for _batch in mix:
            step()
        step.finish()
        sync()
        t = time.perf_counter()
        waits.append(max(0.0, t - t_prev - alone))
        t_prev = t
    mix.stop()
    return statistics.median(waits[1:]) / alone


def single_waiting(ds: GDSDataset, step: Step, passes: int = 3) -> float:
    """The same for one dataset (:func:`time_passes`)."""
    later = time_passes(ds, step, passes)[1:]
    return statistics.median(r.wait_s for r in later) / later[0].alone_s  # type: ignore[operator]


def measure(backend: str, single_path: str, sources: dict[str, str], rounds: int, min_seconds: float,
            batch_size: int, step_factor: float = 0.0) -> dict[str, Any]:
    options = {"backend": backend, "shuffle": True, "seed": 0}
    single = GDSDataset(single_path, batch_size, **options)
    mix = Mixture(sources, {name: SHARES[name] for name in sources}, batch_size=batch_size,
                  num_batches=len(single), **options)
    try:
        sync = device_sync(single)
        time_pass(single)  # warm-up: page cache, kernels, buffers
        single.stop()
        time_mixture(mix, sync, 0.0)
        rates: dict[str, list[float]] = {"single": [], "mixture": []}
        for r in range(rounds):
            for what in ("single", "mixture") if r % 2 == 0 else ("mixture", "single"):
                if what == "single":
                    rates[what].append(time_pass(single, min_seconds=min_seconds).gb_per_s)
                    single.stop()
                else:
                    rates[what].append(time_mixture(mix, sync, min_seconds))
        best = {k: max(v) for k, v in rates.items()}
        waiting: dict[str, float | None] = {"single": None, "mixture": None}
        if step_factor > 0:
            batch_bytes = sum(a.nbytes for a in next(iter(single)).values())
            single.stop()
            step = make_step(step_factor * batch_bytes / (best["single"] * 1e9) * 1e3,
                             gpu=single.describe()["backend"] != "cpu")
            waiting = {"single": round(100 * single_waiting(single, step), 2),
                       "mixture": round(100 * mixture_waiting(mix, step, sync), 2)}
        return {"what": f"gdsload {backend}", "io_mode": single.io_mode, "regime": "warm", "shuffle": True,
                "gb_per_s_single": [round(x, 2) for x in rates["single"]],
                "gb_per_s_mixture": [round(x, 2) for x in rates["mixture"]],
                "best_single": round(best["single"], 2), "best_mixture": round(best["mixture"], 2),
                "mixture_of_single_pct": round(100 * best["mixture"] / best["single"], 1),
                "step_factor": step_factor, "waiting_pct_single": waiting["single"],
                "waiting_pct_mixture": waiting["mixture"]}
    finally:
        mix.close()
        single.close()


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| backend | io mode | GB/s one dataset | GB/s mixture of 3 | mixture / one | waiting, one | "
             "waiting, mixture |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['what']} | {r['io_mode']} | {r['best_single']} | {r['best_mixture']} | "
              f"{r['mixture_of_single_pct']} % | {_pct(r['waiting_pct_single'])} | {_pct(r['waiting_pct_mixture'])} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value} %"


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=4.0)
    ap.add_argument("--backends", default="mmap,pinned,kvikio")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--step-factor", type=float, default=1.5,
                    help="waiting beside a simulated step of this many times a batch's read time at the single "
                         "dataset's rate (0: not measured)")
    args = parse_probe_args(ap, argv)
    single = make_dataset(args.data, args.size_gib)
    sources = {name: make_dataset(args.data, args.size_gib * n / 6) for name, n in SHARES.items()}
    rows = Rows()
    for backend in args.backends.split(","):
        rows.emit(measure(backend, single, sources, args.rounds, args.min_seconds, args.batch_size,
                          args.step_factor))
    write_probe_table(args, "mixture", rows, markdown(rows), rounds=args.rounds, method=__doc__.split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
