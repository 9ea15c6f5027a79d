"""Timed passes into result rows: flat JSON objects of ``kind`` (ceiling, gdsload, contender, step, startup),
``dataset``, ``regime``, ``name``, ``config``, ``io_mode`` and the figures; a row that could not be measured
has ``error`` (or ``skipped``: a package missing) instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload.tools.measure import PassResult, best, device_sync, drop_page_cache, time_pass, time_passes
from gdsload.tools.steps import Step

from .common import Rows

Run = Callable[[], PassResult]


def lazy(build: Callable[[], Run]) -> Run:
    """A run set up on its first call (so that a contender failing to set up is recorded, not raised)."""
    made: list[Run] = []

    def run() -> PassResult:
        if not made:
            made.append(build())
        return made[0]()

    return run


class GdsRun:
    """A GDSDataset kept open across passes; each call times one pass (:func:`gdsload.tools.measure.time_pass`),
    with a simulated training step per batch when ``step`` is given."""

    def __init__(self, path: str, backend: str, batch_size: int, shuffle: bool = False, threads: int | None = None,
                 step: Step | None = None, backend_options: dict[str, Any] | None = None,
                 min_seconds: float = 0.0, **dataset_options: Any):
        options = dict(backend_options or {})
        if threads:
            options["num_threads"] = threads
        self.ds = GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=shuffle,
                             backend_options=options or None, **dataset_options)
        self.step = step
        self.min_seconds = min_seconds  # a warm call's back-to-back passes, from rest
        self._cold = False

    def __call__(self) -> PassResult:
        if self._cold:  # one pass from the dropped cache, nothing read ahead
            self._cold = False
            return time_pass(self.ds, self.step)
        return time_pass(self.ds, self.step, self.min_seconds)

    def passes(self, n: int) -> list[PassResult]:
        """The pass from rest and ``n`` passes after it, each timed on its own (:func:`time_passes`)."""
        return time_passes(self.ds, self.step, n)

    def stop(self) -> None:
        """Before a cold pass: nothing read ahead from the warm cache, and the next call times one pass."""
        self.ds.stop()
        self._cold = True

    def extra(self) -> dict[str, Any]:
        """What the row adds from ``describe()``: window, open time, backend settings, pinned memory held."""
        d = self.ds.describe()
        stats = d["backend_stats"]
        pinned = (stats.get("locked_bytes") or (stats.get("peak_slots_in_use", 0) * stats.get("slot_bytes", 0))
                  or (stats.get("pool_bytes") if stats.get("reader") == "native" else 0))
        return {"window_blocks": d["window_blocks"], "window_buffers": d["window_buffers"],
                "batches_ahead": d["batches_ahead"], "open_s": round(d["open_s"], 4),
                **({"peak_pinned_bytes": pinned} if pinned else {}), "backend_stats": stats}

    def close(self) -> None:
        self.ds.close()


def rnd(v: float | None, n: int = 3) -> float | None:
    return None if v is None else round(v, n)


def figures(r: PassResult, waits: list[float]) -> dict[str, Any]:
    """A pass's figures, rounded as the results show them."""
    return {"io_mode": r.io_mode, "gb_per_s": round(r.gb_per_s, 2),
            "samples_per_s": round(r.samples_per_s) if r.samples_per_s else None,
            "cpu_core_s_per_gb": rnd(r.cpu_core_s_per_gb, 3), "seconds": round(r.seconds, 3),
            "stall_fraction": rnd(r.stall_fraction, 4), "steady_stall_fraction": rnd(r.steady_stall_fraction, 4),
            "first_batch_s": rnd(r.first_batch_s, 6), "wait_fraction": rnd(r.wait_fraction, 4),
            **({"wait_fraction_runs": waits} if len(waits) > 1 else {})}


def summed(passes: list[PassResult]) -> PassResult:
    """Passes as one stretch: their bytes, seconds, samples, CPU, stall and waiting added up."""
    return PassResult(bytes=sum(r.bytes for r in passes), seconds=sum(r.seconds for r in passes),
                      io_mode=passes[0].io_mode, samples=sum(r.samples or 0 for r in passes),
                      cpu_s=sum(r.cpu_s for r in passes), stall_s=sum(r.stall_s or 0.0 for r in passes),
                      wait_s=sum(r.wait_s or 0.0 for r in passes))


class Recorder:
    """Runs a measurement the requested number of times in a regime and emits its row (the best pass;
    with a training step, every pass's waiting share too). A failure becomes a row saying why."""

    def __init__(self, can_drop: bool, batch_size: int):
        self.can_drop = can_drop
        self.batch_size = batch_size
        self.rows = Rows()

    def emit(self, row: dict[str, Any]) -> dict[str, Any]:
        return self.rows.emit(row)

    def failed(self, where: dict[str, Any], e: BaseException) -> None:
        why = f"{type(e).__name__}: {e}"[:300]
        self.emit({**where, ("skipped" if isinstance(e, ImportError) else "error"): why})

    def attempt(self, dataset: str, name: str, config: str, build: Callable[[], Any]) -> Any:
        """``build()``, or None with an error row when it fails (a backend that cannot open here)."""
        try:
            return build()
        except Exception as e:
            self.failed({"kind": "gdsload", "dataset": dataset, "regime": "-", "name": name, "config": config}, e)
            return None

    def record(self, dataset: str, regime: str, name: str, config: str, fn: Run, repeats: int = 1,
               kind: str = "gdsload", **labels: Any) -> dict[str, Any] | None:
        where = {"kind": kind, "dataset": dataset, "regime": regime, "name": name, "config": config}
        if regime == "cold":
            if not self.can_drop:
                return None
            if hasattr(fn, "stop"):
                fn.stop()  # gdsload reads the next epoch ahead: that must not come from the warm cache
            drop_page_cache()
        runs: list[PassResult] = []
        try:
            for _ in range(repeats):
                runs.append(fn())
        except Exception as e:  # a contender that cannot run here is reported, not hidden
            self.failed({**where, **labels}, e)
            return None
        waits = [round(r.wait_fraction, 4) for r in runs if r.wait_fraction is not None]
        extra = fn.extra() if hasattr(fn, "extra") else {}
        return self.emit({**where, **labels, **figures(best(runs), waits), **extra})

    def steps(self, dataset: str, name: str, config: str, run: GdsRun, passes: int,
              judge: Callable[[list[float]], dict[str, Any]] | None = None, **labels: Any) -> dict[str, Any] | None:
        """A training-step row from ``run.passes(passes)``: the passes after the one from rest (waiting: their
        median), the pass from rest beside them, the steps alone's drift (``alone_drift_fraction``); ``judge``'s
        fields (the canaries' verdict) where given."""
        where = {"kind": "step", "dataset": dataset, "regime": "warm", "name": name, "config": config}
        try:
            first, *steady = run.passes(passes)
        except Exception as e:
            self.failed({**where, **labels}, e)
            return None
        total = summed(steady)
        waits = [round(r.wait_fraction or 0.0, 4) for r in steady]
        row = {**figures(total, waits), "wait_fraction": round(float(np.median(waits)), 4), "wait_fraction_runs": waits,
               "first_pass_wait_fraction": round(first.wait_fraction or 0.0, 4),
               "first_pass_seconds": round(first.seconds, 4), "first_batch_s": round(first.first_batch_s or 0.0, 6)}
        if first.alone_s and first.alone_again_s:  # the steps alone against themselves: this row's noise floor
            row["alone_drift_fraction"] = round(first.alone_again_s / first.alone_s - 1, 4)
        if judge is not None:
            row.update(judge(waits))
        return self.emit({**where, **labels, **row, **run.extra()})

    def startup(self, dataset: str, regime: str, backend: str, path: str, batch_size: int, **options: Any) -> None:
        """Open a fresh dataset and take its first batch: ``open_s``, ``first_batch_s`` and ``seconds`` in all."""
        where = {"kind": "startup", "dataset": dataset, "regime": regime, "name": f"gdsload {backend} startup",
                 "config": "open + first batch", "backend": backend}
        if regime == "cold" and not drop_page_cache():
            return
        try:
            t0 = time.perf_counter()
            with GDSDataset(path, batch_size=batch_size, backend=backend, **options) as ds:
                it = iter(ds)
                next(it)
                device_sync(ds)()
                took = time.perf_counter() - t0
                d = ds.describe()
                first = ds.stats.first_batch_s
                del it
        except Exception as e:
            self.failed(where, e)
            return
        self.emit({**where, "io_mode": d["io_mode"], "open_s": round(d["open_s"], 4),
                   "first_batch_s": round(first, 6), "seconds": round(took, 4), "backend_stats": d["backend_stats"]})
