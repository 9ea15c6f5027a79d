"""A mixture of three datasets against one dataset of the same total bytes, warm, each run a fresh process.

    python -m benchmarks.mixture [--size-gib 4] [--backends mmap,pinned,kvikio] [--rounds 3]

Three sources of 1/2, 1/3 and 1/6 of ``--size-gib`` (the suite's images, one backend) mixed in those shares,
against one dataset of ``--size-gib``: ``--rounds`` fresh processes each, alternating (A B, B A, ...), data warm.
A process opens, reads a pass, times back-to-back batches for at least ``--min-seconds`` (the mixture: whole
passes of the single dataset's batches per epoch; GB/s of the batches delivered, device synchronised), then waits
beside a step of ``--step-factor`` times a batch's read time at the single dataset's first-round rate
(``time_passes``) and reports the device memory it holds (``memGetInfo``).

Rows: per backend, each run's GB/s, their medians and ratio, the waiting and device memory; ``--first-epoch``
adds a fresh open's first epochs and a continuous 10 ms step (``summary``). Ceilings on the single dataset's
files: page cache -> host memory, raw KvikIO of its blocks shuffled, pinned H2D. What cannot run is a row saying why."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from gdsload import GDSDataset, Mixture
from gdsload.backends import info
from gdsload.backends.registry import NAMES
from gdsload.errors import BackendUnavailable
from gdsload.system.env import gpu_available, kvikio_installed
from gdsload.tools.measure import (THREADS, PassResult, block_locations, device_sync, pinned_h2d_gbps,
                                   raw_kvikio_blocks, read_files, shard_paths, time_pass, time_passes)
from gdsload.tools.steps import Step, make_step

from .common import (BATCH, SAMPLE_BYTES, Rows, device_used_bytes, free_device_memory, gbps_plot, line_label,
                     make_dataset, probe_args, run_child, write_probe_table)
from .report import fresh_tables

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


def device_used() -> int:
    """Bytes of device memory in use (0 without a GPU)."""
    return device_used_bytes(gpu_available()) or 0


def child(kind: str, backend: str, single_path: str, sources: dict[str, str], batch_size: int, min_seconds: float,
          step_ms: float) -> dict[str, Any]:
    """One measurement, in a fresh process (module docstring): ``kind`` is ``single``, ``mixture``, ``first``
    (a fresh open's first two epochs) or ``continuous``."""
    if kind == "continuous":
        from .summary_rows import continuous_child

        return continuous_child(single_path, backend, batch_size, {}, backend != "cpu" and gpu_available(), 3)
    base = device_used()
    options = {"backend": backend, "shuffle": True, "seed": 0}
    started = time.perf_counter()
    single = GDSDataset(single_path, batch_size, **options)
    out: dict[str, Any] = {"io_mode": single.io_mode, "backend": single.backend_name,
                           "open_s": round(time.perf_counter() - started, 3)}
    sync = device_sync(single)
    if kind == "first":
        with single:
            out["epochs_gbps"] = [round(time_pass(single, from_rest=False).gb_per_s, 3) for _ in range(2)]
        return out
    if kind == "single":
        with single:
            time_pass(single)
            out["memory_bytes"] = device_used() - base
            out["gbps"] = time_pass(single, min_seconds=min_seconds).gb_per_s
            if step_ms:  # as mixture_waiting, for one dataset (time_passes)
                later = time_passes(single, make_step(step_ms, gpu=backend != "cpu"), 3)[1:]
                alone = later[0].alone_s or 0.0  # set by time_passes, as every pass's wait_s
                out["waiting_pct"] = 100 * statistics.median(r.wait_s or 0.0 for r in later) / alone
        return out
    num_batches = len(single)
    single.close()
    with Mixture(sources, {name: SHARES[name] for name in sources}, batch_size=batch_size, num_batches=num_batches,
                 **options) as mix:
        time_mixture(mix, sync, 0.0)
        out["memory_bytes"] = device_used() - base
        out["gbps"] = time_mixture(mix, sync, min_seconds)
        if step_ms:
            out["waiting_pct"] = 100 * mixture_waiting(mix, make_step(step_ms, gpu=backend != "cpu"), sync)
    return out


def fresh(kind: str, backend: str, single: str, sources: dict[str, str], batch_size: int, min_seconds: float,
          step_ms: float = 0.0) -> dict[str, Any]:
    return run_child(f"{kind} run of {backend} in a fresh process", "benchmarks.mixture", "child", kind, backend,
                     single, sources, batch_size, min_seconds, step_ms)


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)] if values else []


def measure(backend: str, single_path: str, sources: dict[str, str], rounds: int, min_seconds: float,
            batch_size: int, step_factor: float = 0.0) -> dict[str, Any]:
    """The backend's row: ``rounds`` fresh processes each of one dataset and of the mixture, alternating."""
    ok, why = info(backend).available() if backend in NAMES else (True, "")
    if not ok:
        raise BackendUnavailable(f"backend {backend!r} cannot run here: {why}")
    runs: dict[str, list[dict[str, Any]]] = {"single": [], "mixture": []}
    step_ms = 0.0
    for r in range(rounds):
        for what in ("single", "mixture") if r % 2 == 0 else ("mixture", "single"):
            got = fresh(what, backend, single_path, sources, batch_size, min_seconds, step_ms)
            runs[what].append(got)
            if what == "single" and not step_ms and step_factor > 0:
                batch = batch_size * SAMPLE_BYTES
                step_ms = step_factor * batch / (got["gbps"] * 1e9) * 1e3
                runs[what][-1]["waiting_pct"] = None  # timed without the step: the step was not yet known
    gb = {k: [x["gbps"] for x in v] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in gb.items()}
    shares = [100 * m / s for s, m in zip(gb["single"], gb["mixture"])]

    def median_of(what: str, key: str) -> float | None:
        values = [x[key] for x in runs[what] if x.get(key) is not None]
        return round(statistics.median(values), 2) if values else None
    return {"what": f"gdsload {backend}", "io_mode": runs["single"][0]["io_mode"], "regime": "warm-fresh",
            "shuffle": True, "runs": rounds, **{f"gb_per_s_{k}": [round(x, 2) for x in v] for k, v in gb.items()},
            **{f"best_{k}": round(m, 2) for k, m in med.items()},
            "mixture_of_single_pct": round(100 * med["mixture"] / med["single"], 1), "spread_pct": spread(shares),
            "step_factor": step_factor, **{f"{key}_{what}": median_of(what, key)
                                           for key in ("waiting_pct", "memory_bytes") for what in runs}}


def alternating(kind: str, backends: list[str], single: str, rounds: int, batch_size: int) -> dict[str, list[Any]]:
    """Per backend, ``rounds`` fresh runs of :func:`child` ``kind`` on ``single``, the order reversed every round."""
    got: dict[str, list[Any]] = {b: [] for b in backends}
    for r in range(rounds):
        for b in backends if r % 2 == 0 else backends[::-1]:
            got[b].append(fresh(kind, b, single, {}, batch_size, 0.0))
    return got


def first_epochs(backends: list[str], single: str, rounds: int, batch_size: int) -> dict[str, dict[str, Any]]:
    """Per backend (``pinned`` among them), a fresh open's epochs 1 and 2 over ``rounds`` alternating runs."""
    out = {}
    for b, runs in alternating("first", backends, single, rounds, batch_size).items():
        first = [x["epochs_gbps"][0] for x in runs]
        out[b] = {"io_mode": runs[0]["io_mode"], "chose": runs[0]["backend"],
                  "gbps": round(statistics.median(first), 2), "runs": first, "spread": spread(first),
                  "epoch2_gbps": round(statistics.median(x["epochs_gbps"][1] for x in runs), 2),
                  "open_s": round(statistics.median(x["open_s"] for x in runs), 3)}
    for b in out:
        out[b]["pinned_gbps"] = out.get("pinned", {}).get("gbps")
    return out


def continuous(backends: list[str], single: str, rounds: int, batch_size: int) -> dict[str, dict[str, Any]]:
    """Per backend, waiting beside a 10 ms step over 3 epochs without a sync, fresh processes, alternating."""
    got = {b: [100 * x["wait_fraction"] for x in runs]
           for b, runs in alternating("continuous", backends, single, rounds, batch_size).items()}
    return {b: {"waiting_pct": round(statistics.median(v), 3), "runs": [round(x, 3) for x in v],
                "spread": spread(v)} for b, v in got.items()}


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
        (H2D, "256 MiB, best of 5 copies each run", why_not,
         lambda: [PassResult(bytes=256 << 20, seconds=(256 << 20) / (pinned_h2d_gbps(256 << 20) * 1e9),
                             io_mode="cuda-memcpy") for _ in range(rounds)])]
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
    lines = ["| backend | io mode | GB/s one dataset | GB/s mixture of 3 | mixture / one (spread) | waiting, one | "
             "waiting, mixture | device GB, one / mixture | note |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    lines += [f"| {r['what']} | {_v(r['io_mode'])} | {_v(r['best_single'])} | {_v(r['best_mixture'])} | "
              f"{_v(r['mixture_of_single_pct'], '{} %', '')} {r.get('spread_pct') or ''} | "
              f"{_v(r['waiting_pct_single'], '{} %', '')} | {_v(r['waiting_pct_mixture'], '{} %', '')} | "
              f"{_gb(r.get('memory_bytes_single'))} / {_gb(r.get('memory_bytes_mixture'))} | "
              f"{r.get('note', '')} |" for r in rows]
    if ceiling_rows:
        lines += ["", "Ceilings, same run, on the single dataset's files (warm, best of the runs):", "",
                  "| ceiling | io mode | config | GB/s | runs | CPU s/GB | note |", "|---|---|---|---:|---|---:|---|"]
        lines += [f"| {c['what']} | {_v(c['io_mode'])} | {c['config']} | {_v(c['gbps'])} | "
                  f"{' '.join(str(x) for x in c['runs']) or '-'} | {_v(c['cpu_s_per_gb'])} | {c['note']} |"
                  for c in ceiling_rows]
    return "\n".join(lines) + "\n"


def plot(json_path: str, rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]]) -> str | None:
    """GB/s per backend (one dataset, mixture) with the ceilings as lines, beside ``json_path``."""
    groups = {f"{r['what']} ({r['io_mode']})": {"one dataset": r["best_single"], "mixture of 3": r["best_mixture"]}
              for r in rows if r["best_single"] is not None}
    lines = {line_label(c["what"], c["io_mode"]): c["gbps"] for c in ceiling_rows}
    return gbps_plot(json_path, "mixture of 3 datasets vs one dataset, warm, shuffled", groups, lines)


def _v(value: Any, form: str = "{}", none: str = "-") -> str:
    return none if value is None else form.format(value)


def _gb(nbytes: float | None) -> str:
    return _v(None if nbytes is None else nbytes / 1e9, "{:.2f}")


def make_sources(data_dir: str, size_gib: float) -> tuple[str, dict[str, str]]:
    """The single dataset of ``size_gib`` GiB and the sources of its shares (:data:`SHARES`), made unless there."""
    return make_dataset(data_dir, size_gib), {n: make_dataset(data_dir, size_gib * k / 6) for n, k in SHARES.items()}


def fresh_figures(backends: list[str], single: str, sources: dict[str, str], rounds: int, min_seconds: float,
                  batch_size: int, step_factor: float, first_epoch: bool = True) -> tuple[Rows, dict[str, Any]]:
    """Each backend's row (:func:`measure`, or why it did not run) and the summary: ``mixture`` per backend that
    ran, and with ``first_epoch`` :func:`first_epochs` of those that run here, ``pinned`` and ``auto`` among them."""
    rows, summary = Rows(), {"mixture": {}}
    for backend in backends:
        try:
            row = measure(backend, single, sources, rounds, min_seconds, batch_size, step_factor)
            summary["mixture"][backend] = {k: row[k] for k in (
                "mixture_of_single_pct", "spread_pct", "runs", "best_single", "best_mixture", "waiting_pct_single",
                "waiting_pct_mixture", "memory_bytes_single", "memory_bytes_mixture", "io_mode")}
        except (BackendUnavailable, RuntimeError) as e:
            row = {"what": f"gdsload {backend}", "io_mode": None, "best_single": None, "best_mixture": None,
                   "mixture_of_single_pct": None, "waiting_pct_single": None, "waiting_pct_mixture": None,
                   "note": "not run: " + " ".join(str(e).split())[:300]}
        rows.emit(row)
    if first_epoch:
        here = [b for b in sorted({*backends, "pinned", "auto"}) if b not in NAMES or info(b).available()[0]]
        summary["first_epoch"] = first_epochs(here, single, rounds, batch_size)
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    args = probe_args(__doc__.splitlines()[0], argv, 4.0, backends="mmap,pinned,kvikio", rounds=3,
                      min_seconds=0.5, batch_size=BATCH, step_factor=(1.5, "waiting beside a simulated step of this "
                      "many times a batch's read time at the single dataset's rate (0: not measured)"),
                      first_epoch=(False, "also the first-epoch and continuous rows"))
    single, sources = make_sources(args.data, args.size_gib)
    limits = ceilings(single, args.rounds, args.min_seconds)
    rows, summary = fresh_figures(args.backends.split(","), single, sources, args.rounds, args.min_seconds,
                                  args.batch_size, args.step_factor, args.first_epoch)
    if args.first_epoch:
        summary["stall_10ms_continuous"] = continuous(list(summary["first_epoch"]), single, args.rounds,
                                                      args.batch_size)
        print(json.dumps(summary, indent=1), flush=True)
    tables = "\n".join(fresh_tables(summary, ("first_epoch", "stall_10ms_continuous")) + [""])
    out = write_probe_table(args, "mixture", rows, markdown(rows, limits) + tables, rounds=args.rounds,
                            method=__doc__.split("\n\n")[2], ceilings=limits, summary=summary)
    plot(out, rows, limits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
