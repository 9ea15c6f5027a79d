"""A mixture of three datasets against one dataset of the same total bytes, warm, in one run.

    python -m benchmarks.mixture [--size-gib 4] [--backends mmap,pinned,kvikio] [--rounds 3]

The three sources hold 1/2, 1/3 and 1/6 of ``--size-gib`` of the suite's images and are mixed in those
proportions (every source with the same backend); the single dataset holds ``--size-gib``. Each is timed as
a stretch of back-to-back batches for at least ``--min-seconds`` from rest (the suite's warm method; the
mixture's stretch is whole passes of ``num_batches`` = the single dataset's batches per epoch), the two in
alternating order round by round, the device synchronised at the end of each stretch. GB/s counts the bytes
of the batches delivered. Then each waits beside a simulated step of ``--step-factor`` times a batch's read
time (the suite's method, ``time_passes``: steps timed alone, passes with a step per batch, the median of
the later passes' time beyond them).

Rows (``results``, one per backend, and per ``--read-ahead`` value where given: ``Mixture(read_ahead=...)``):
``gdsload <backend>`` with its io mode, the GB/s of one dataset and of the mixture (every round kept, the best
reported), the mixture's share of one, and the waiting beside the step; a backend that cannot run here is a row
without figures whose ``note`` says why (``not run: ...``).

Ceilings (``ceilings``, measured in the same run on the single dataset's files, before the backends, each the best of
``--rounds`` stretches of at least ``--min-seconds``), with their io mode:

- ``ceiling: page cache -> host memory``: ``read_files`` (16 threads, 8 MiB pieces) of the warm files: the cpu
  backend's ceiling, and the host side of the others'.
- ``ceiling: raw KvikIO (blocks, shuffled)``: ``raw_kvikio_blocks`` of every block a reader of the single dataset
  reads (``block_locations``), one ``pread`` each in a shuffled order, into one device buffer (GPU and KvikIO).
- ``ceiling: pinned H2D copy``: ``pinned_h2d_gbps`` of 256 MiB, best of 5 copies (GPU).

A ceiling that cannot run here says ``not run: <reason>``, one that fails ``error: ...``; the run goes on. Writes
``results/<machine>/mixture[-TAG].json``, a markdown table of both beside it and ``mixture[-TAG].png`` (GB/s per
backend, one dataset and mixture as bars, the ceilings as lines; where matplotlib imports)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from gdsload import GDSDataset, Mixture
from gdsload.errors import BackendUnavailable
from gdsload.system.env import gpu_available, kvikio_installed
from gdsload.tools.measure import (THREADS, PassResult, block_locations, device_sync, pinned_h2d_gbps,
                                   raw_kvikio_blocks, read_files, shard_paths, time_pass, time_passes)
from gdsload.tools.steps import Step, make_step

from .common import BATCH, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, write_probe_table
from .plots import gbps_plot, line_label

SHARES = {"half": 3, "third": 2, "sixth": 1}  # sixths of the total
PAGE_CACHE = "ceiling: page cache -> host memory"
RAW_KVIKIO = "ceiling: raw KvikIO (blocks, shuffled)"
H2D = "ceiling: pinned H2D copy"


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
            batch_size: int, step_factor: float = 0.0, read_ahead: int | None = None) -> dict[str, Any]:
    options = {"backend": backend, "shuffle": True, "seed": 0}
    single = GDSDataset(single_path, batch_size, **options)
    mix = Mixture(sources, {name: SHARES[name] for name in sources}, batch_size=batch_size,
                  num_batches=len(single), read_ahead=read_ahead, **options)
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
        return {"what": f"gdsload {backend}" + ("" if read_ahead is None else f", read_ahead={read_ahead}"),
                "read_ahead": mix.read_ahead, "io_mode": single.io_mode, "regime": "warm", "shuffle": True,
                "gb_per_s_single": [round(x, 2) for x in rates["single"]],
                "gb_per_s_mixture": [round(x, 2) for x in rates["mixture"]],
                "best_single": round(best["single"], 2), "best_mixture": round(best["mixture"], 2),
                "mixture_of_single_pct": round(100 * best["mixture"] / best["single"], 1),
                "step_factor": step_factor, "waiting_pct_single": waiting["single"],
                "waiting_pct_mixture": waiting["mixture"]}
    finally:
        mix.close()
        single.close()


def ceiling_row(what: str, config: str, runs: list[PassResult]) -> dict[str, Any]:
    """A measured ceiling: the best of ``runs`` (its io mode and GB/s), every run's GB/s kept."""
    top = max(runs, key=lambda r: r.gb_per_s)
    per_gb = top.cpu_core_s_per_gb if top.cpu_s else None
    return {"what": what, "kind": "ceiling", "regime": "warm", "config": config, "io_mode": top.io_mode,
            "gbps": round(top.gb_per_s, 3), "runs": [round(r.gb_per_s, 3) for r in runs],
            "cpu_s_per_gb": None if per_gb is None else round(per_gb, 3), "note": ""}


def not_run(what: str, config: str, why: str, prefix: str = "not run") -> dict[str, Any]:
    """A ceiling that did not run here (or failed: ``prefix`` "error"): no figures, the reason."""
    return {"what": what, "kind": "ceiling", "regime": "warm", "config": config, "io_mode": None, "gbps": None,
            "runs": [], "cpu_s_per_gb": None, "note": f"{prefix}: {why}"}


def _raw_kvikio(single_path: str, rounds: int, min_seconds: float) -> list[PassResult]:
    import cupy

    blocks = block_locations(single_path)
    dest = cupy.empty(sum(b.nbytes for b in blocks), dtype=cupy.uint8)
    try:
        return [raw_kvikio_blocks(blocks, dest, min_seconds=min_seconds) for _ in range(rounds)]
    finally:
        del dest
        free_device_memory()


def _h2d(rounds: int) -> list[PassResult]:
    nbytes = 256 << 20
    return [PassResult(bytes=nbytes, seconds=nbytes / (pinned_h2d_gbps(nbytes) * 1e9), io_mode="cuda-memcpy")
            for _ in range(rounds)]


def ceilings(single_path: str, rounds: int, min_seconds: float) -> Rows:
    """The ceilings of the module docstring on ``single_path``'s files (read into the page cache first), in the
    order page cache, raw KvikIO, pinned H2D; each the best of ``rounds``, or a row saying why it did not run
    (``not run: ...``) or failed (``error: ...``)."""
    out = Rows()
    paths = shard_paths(single_path)
    read_files(paths)  # warm the page cache: every later reader finds it warm
    rounds = max(1, rounds)
    gpu = gpu_available()
    why_not = None if gpu else "no GPU here"
    cases: list[tuple[str, str, str | None, Callable[[], list[PassResult]]]] = [
        (PAGE_CACHE, f"{THREADS} threads, 8 MiB", None,
         lambda: [read_files(paths, min_seconds=min_seconds) for _ in range(rounds)]),
        (RAW_KVIKIO, f"{THREADS} threads, one read per block",
         why_not or (None if kvikio_installed() else "KvikIO is not installed"),
         lambda: _raw_kvikio(single_path, rounds, min_seconds)),
        (H2D, "256 MiB, best of 5 copies each run", why_not, lambda: _h2d(rounds)),
    ]
    for what, config, why, measure_it in cases:
        if why is not None:
            out.emit(not_run(what, config, why))
            continue
        try:
            out.emit(ceiling_row(what, config, measure_it()))
        except Exception as e:  # noqa: BLE001 - the row says why; the run goes on
            out.emit(not_run(what, config, " ".join(f"{type(e).__name__}: {e}".split())[:400], "error"))
    return out


def markdown(rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]] | None = None) -> str:
    """The backends' table, then the ceilings' (same run, same data) where given."""
    lines = ["| backend | io mode | GB/s one dataset | GB/s mixture of 3 | mixture / one | waiting, one | "
             "waiting, mixture | note |", "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['what']} | {r['io_mode'] or '-'} | {_v(r['best_single'])} | {_v(r['best_mixture'])} | "
              f"{_pct(r['mixture_of_single_pct'])} | {_pct(r['waiting_pct_single'])} | "
              f"{_pct(r['waiting_pct_mixture'])} | {r.get('note', '')} |" for r in rows]
    if ceiling_rows:
        lines += ["", "Ceilings, same run, on the single dataset's files (warm, best of the runs):", "",
                  "| ceiling | io mode | config | GB/s | runs | CPU s/GB | note |", "|---|---|---|---:|---|---:|---|"]
        lines += [f"| {c['what']} | {c['io_mode'] or '-'} | {c['config']} | "
                  f"{'-' if c['gbps'] is None else c['gbps']} | {' '.join(str(x) for x in c['runs']) or '-'} | "
                  f"{'-' if c['cpu_s_per_gb'] is None else c['cpu_s_per_gb']} | {c['note']} |" for c in ceiling_rows]
    return "\n".join(lines) + "\n"


def plot(json_path: str, rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]]) -> str | None:
    """GB/s per backend (one dataset, mixture) with the ceilings as lines, beside ``json_path``."""
    groups = {f"{r['what']} ({r['io_mode']})": {"one dataset": r["best_single"], "mixture of 3": r["best_mixture"]}
              for r in rows if r["best_single"] is not None}
    lines = {line_label(c["what"], c["io_mode"]): c["gbps"] for c in ceiling_rows}
    return gbps_plot(json_path, "mixture of 3 datasets vs one dataset, warm, shuffled", groups, lines)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value} %"


def _v(value: float | None) -> str:
    return "-" if value is None else str(value)


def backend_not_run(backend: str, read_ahead: int | None, why: str) -> dict[str, Any]:
    """A backend that cannot run here: the row, without figures, says why."""
    return {"what": f"gdsload {backend}" + ("" if read_ahead is None else f", read_ahead={read_ahead}"),
            "read_ahead": read_ahead, "io_mode": None, "best_single": None, "best_mixture": None,
            "mixture_of_single_pct": None, "waiting_pct_single": None, "waiting_pct_mixture": None,
            "note": f"not run: {why}"}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=4.0)
    ap.add_argument("--backends", default="mmap,pinned,kvikio")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--step-factor", type=float, default=1.5,
                    help="waiting beside a simulated step of this many times a batch's read time at the single "
                         "dataset's rate (0: not measured)")
    ap.add_argument("--read-ahead", default="",
                    help="comma list of Mixture(read_ahead=...) values, a row each per backend (default: the "
                         "library's default alone)")
    args = parse_probe_args(ap, argv)
    single = make_dataset(args.data, args.size_gib)
    sources = {name: make_dataset(args.data, args.size_gib * n / 6) for name, n in SHARES.items()}
    limits = ceilings(single, args.rounds, args.min_seconds)
    rows = Rows()
    aheads = [int(a) for a in args.read_ahead.split(",") if a.strip()] or [None]
    for backend in args.backends.split(","):
        for ahead in aheads:
            try:
                row = measure(backend, single, sources, args.rounds, args.min_seconds, args.batch_size,
                              args.step_factor, ahead)
            except BackendUnavailable as e:
                row = backend_not_run(backend, ahead, " ".join(str(e).split())[:300])
            rows.emit(row)
    out = write_probe_table(args, "mixture", rows, markdown(rows, limits), rounds=args.rounds,
                            method=__doc__.split("\n\n")[2], ceilings=limits)
    plot(out, rows, limits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
