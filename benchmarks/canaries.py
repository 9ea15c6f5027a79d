"""Canaries beside a training-step row: processes pinned to a core each, timing units of pure Python, sharing
nothing with the loader. A pass in which even the least slowed canary ran ``threshold`` times slower than its
median is the machine's, and left out of ``wait_fraction_unslowed``.

    python -m benchmarks.canaries SECONDS OUT    # one canary (the suite starts them itself)"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gdsload.tools.steps import Step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANARY_UNIT = 20000  # additions per unit: about a millisecond of Python
#: A pass is the machine's when every canary's units ran this much longer than their median.
CANARY_THRESHOLD = 1.15


def canary(seconds: float, out: str) -> None:
    """Fixed units of pure Python work for ``seconds``; each unit's start and length to ``out`` (JSON).
    ``out + ".ready"`` appears as the first unit starts."""
    end, units = time.perf_counter() + seconds, []
    open(out + ".ready", "w").close()
    while time.perf_counter() < end:
        t0, s = time.perf_counter(), 0
        for i in range(CANARY_UNIT):
            s += i
        units.append((t0, time.perf_counter() - t0))
    with open(out, "w") as f:
        json.dump(units, f)


class Canaries:
    """Canary processes, one pinned to each of ``cores``, timing pure-Python units for ``seconds``;
    :meth:`units` waits for them and returns each one's (start, length)."""

    def __init__(self, cores: list[int], seconds: float):
        self.tmp = tempfile.mkdtemp()
        self.outs = [os.path.join(self.tmp, f"{c}.json") for c in cores]
        self.procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.canaries", str(seconds), out], cwd=ROOT,
                                       preexec_fn=lambda c=c: os.sched_setaffinity(0, {c}))
                      for c, out in zip(cores, self.outs)]
        waited = time.perf_counter()
        while not all(os.path.exists(out + ".ready") for out in self.outs):
            if time.perf_counter() - waited > 60 or any(p.poll() is not None for p in self.procs):
                self.close()
                raise RuntimeError(f"the canaries did not start (exit codes {[p.poll() for p in self.procs]})")
            time.sleep(0.02)

    def units(self) -> list[np.ndarray]:
        for p in self.procs:
            p.wait()
        out = []
        for path in self.outs:
            with open(path) as f:
                out.append(np.array(json.load(f)))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def canary_cores(spec: str) -> list[int]:
    """The cores to pin canaries on: ``auto`` gives three spread over this process's cores where it has at
    least 8 (3, 9 and 15 of 16), none with fewer; else a comma list ('' none)."""
    if spec != "auto":
        return [int(c) for c in spec.split(",") if c.strip()]
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    return [cores[n * 3 // 16], cores[n * 9 // 16], cores[n * 15 // 16]] if n >= 8 else []


def stamp_finishes(step: Step) -> list[float]:
    """The times (perf_counter) at which ``step.finish()`` returns from now on: :func:`time_passes` finishes
    its steps at the end of each pass, and the steps alone twice each time they are timed."""
    stamps: list[float] = []
    finish = step.finish

    def stamped() -> None:
        finish()
        stamps.append(time.perf_counter())

    step.finish = stamped  # type: ignore[method-assign]
    return stamps


def pass_windows(stamps: list[float], passes: int) -> list[tuple[float, float]] | None:
    """Each pass's (start, end) from :func:`stamp_finishes`'s stamps over ``time_passes(ds, step, passes)``
    (two finishes of the steps alone, one per pass, two again); None when the stamps are not that shape."""
    if len(stamps) != 1 + passes + 4:
        return None
    bounds = stamps[1:3 + passes]
    return list(zip(bounds[:-1], bounds[1:]))


def unslowed(waits: list[float], windows: list[tuple[float, float]], units: list[np.ndarray],
             threshold: float = CANARY_THRESHOLD) -> tuple[float | None, list[float | None]]:
    """The median of ``waits`` over the passes the machine did not slow down (None: none left), and every
    pass's least canary slowdown: the least over the canaries of their units' mean length in the pass over their
    median unit (None: no unit in it, unjudged, left out)."""
    least: list[float | None] = []
    for t0, t1 in windows:
        inside = [(u[:, 0] >= t0) & (u[:, 0] < t1) for u in units]
        known = [round(float(u[m, 1].mean() / np.median(u[:, 1])), 2) for u, m in zip(units, inside) if m.any()]
        least.append(min(known) if known else None)
    kept = [w for w, s in zip(waits, least) if s is not None and s <= threshold]
    return (round(float(np.median(kept)), 4) if kept else None), least


@contextlib.contextmanager
def judged_by_canaries(cores: list[int], seconds: float, step: Step, passes: int,
                       threshold: float = CANARY_THRESHOLD) -> Iterator[Callable[[list[float]], dict[str, Any]] | None]:
    """Canaries on ``cores`` around ``time_passes(ds, step, passes)``: yields :meth:`Recorder.steps`'s ``judge``,
    or None without cores or where they do not start."""
    canaries = None
    if cores:
        stamps = stamp_finishes(step)
        try:
            canaries = Canaries(cores, seconds)
        except (OSError, RuntimeError) as e:
            print(f"no canaries: {e}", flush=True)

    def judge(waits: list[float]) -> dict[str, Any]:
        assert canaries is not None
        windows = pass_windows(stamps, passes)
        out: dict[str, Any] = {"canary_cores": cores, "canary_threshold": threshold}
        if windows is None:
            return {**out, "wait_fraction_unslowed": None, "canary_note": "the passes' ends were not stamped"}
        median, least = unslowed(waits, windows[1:], canaries.units(), threshold)
        return {**out, "wait_fraction_unslowed": median, "canary_least_slowdown_runs": least}

    try:
        yield judge if canaries is not None else None
    finally:
        if canaries is not None:
            canaries.close()


if __name__ == "__main__":
    canary(float(sys.argv[1]), sys.argv[2])
