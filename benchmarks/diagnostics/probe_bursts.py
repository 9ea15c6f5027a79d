"""Passes that wait far more than their neighbours (bursts): where each long gap between two steps went, and
whether the machine itself slowed down at that moment.

    python -m benchmarks.diagnostics.probe_bursts [--backend mmap] [--factor 1.5] [--passes 40]
        [--canaries 3,9,15] [--hold]

Per pass (each after as many steps alone, timed the same way): its waiting, and for every gap over 1 ms
between two synchronised steps (the GPU's nanosecond timer) its split on the host's clock: the sync's return
after the GPU finished the step, the host's turn (``next()``, then the launch), and the GPU starting the
next step after its launch returned (negative: it started before the launch call came back). Beside them:
the garbage collector's runs over 0.3 ms, each thread's CPU time and run-queue wait (/proc schedstat), the
cgroup's CPU throttling (cpu.stat), and **canaries**: one process per core in ``--canaries``, pinned there,
timing fixed units of pure Python work back to back (no GIL, GPU or memory shared with this process); a
pass's canary slowdown is its units' mean length over the canary's median. Steps the host returns to late
while every canary slows down at once are the machine's, not the loader's. ``--hold`` keeps one pass of
batches on the device throughout. GPU only. Writes
``results/<machine>/probe-bursts[-TAG].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset

from ..common import (BATCH, GcRuns, Rows, Spin, add_step_options, make_dataset, parse_probe_args, probe_parser,
                      read_files, shard_paths, stamped_steps, step_ms, time_pass, write_probe)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_GAP_US = 1000.0
CANARY_UNIT = 20000  # additions per unit: about a millisecond of Python


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


def thread_cpu_ns(field: int = 0) -> dict[str, int]:
    """CPU time (ns) of each thread of this process so far (/proc schedstat), by Python thread name where it
    has one, else by its kernel name and id; ``field`` 1: the time each waited on a run queue instead."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[field])
            if tid not in names:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[tid] = f"{f.read().strip()}-{tid}"
        except (OSError, ValueError):
            continue
        out[names[tid]] = out.get(names[tid], 0) + ns
    return out


def cgroup_cpu() -> dict[str, int]:
    """The cgroup's CPU counters (cgroup v2 cpu.stat): throttled periods and time; {} where not mounted."""
    try:
        with open("/sys/fs/cgroup/cpu.stat") as f:
            return {k: int(v) for k, v in (line.split() for line in f)}
    except (OSError, ValueError):
        return {}


def split(host: np.ndarray, gpu: np.ndarray, offset: int) -> dict[str, Any]:
    """The gaps between steps (us) and, for each over LONG_GAP_US, its parts on the host's clock (the
    arrays of :func:`~benchmarks.common.stamped_steps`; ``offset``: host minus GPU clock, ns)."""
    host, gpu = host / 1e3, (gpu + offset) / 1e3
    gaps = gpu[1:, 0] - gpu[:-1, 1]
    late = host[:-1, 3] - gpu[:-1, 1]
    nxt, launch = host[1:, 1] - host[1:, 0], host[1:, 2] - host[1:, 1]
    gpu_late = gpu[1:, 0] - host[1:, 2]
    long = np.nonzero(gaps > LONG_GAP_US)[0]
    return {"gap_p50_us": round(float(np.median(gaps)), 1), "gap_max_us": round(float(gaps.max()), 1),
            "long_gaps": [{"step": int(i), "at": float(host[i, 3] / 1e6), "gap_us": round(float(gaps[i]), 1),
                           "sync_return_late_us": round(float(late[i]), 1), "next_us": round(float(nxt[i]), 1),
                           "launch_us": round(float(launch[i]), 1), "gpu_start_late_us": round(float(gpu_late[i]), 1)}
                          for i in long]}


def slowdowns(units: list[np.ndarray], t0: float, t1: float) -> list[float | None]:
    """Per canary: its units' mean length between ``t0`` and ``t1`` over its median unit (None: no unit)."""
    out: list[float | None] = []
    for u in units:
        m = (u[:, 0] >= t0) & (u[:, 0] < t1)
        out.append(round(float(u[m, 1].mean() / np.median(u[:, 1])), 2) if m.any() else None)
    return out


def timed_passes(spin: Spin, ds: GDSDataset, nb: int, offset: int, n: int) -> list[dict[str, Any]]:
    """``n`` passes of ``ds``, each after ``nb`` steps alone; per pass what the module notes list, but the
    canaries (their units are read once they are done)."""
    passes: list[dict[str, Any]] = []
    with GcRuns() as runs:
        for p in range(n):
            t0 = time.perf_counter()
            stamped_steps(spin, range(nb), nb)
            alone = time.perf_counter() - t0
            cpu, waits, cg = thread_cpu_ns(), thread_cpu_ns(1), cgroup_cpu()
            t0 = time.perf_counter()
            host, gpu = stamped_steps(spin, ds, nb + 1)
            t1 = time.perf_counter()
            cpu1, waits1, cg1 = thread_cpu_ns(), thread_cpu_ns(1), cgroup_cpu()
            passes.append({"pass": p, "t0": t0, "t1": t1, "wait_fraction": round((t1 - t0 - alone) / (t1 - t0), 4),
                           **split(host, gpu, offset),
                           "gc_ms": [round((b - a) / 1e6, 2) for _, a, b in runs.runs if b > t0 * 1e9
                                     and a < t1 * 1e9 and b - a > 300_000],
                           "thread_cpu_ms": {k: round((v - cpu.get(k, 0)) / 1e6, 1) for k, v in cpu1.items()
                                             if v - cpu.get(k, 0) > 1e6},
                           "thread_queue_wait_ms": {k: round((v - waits.get(k, 0)) / 1e6, 2)
                                                    for k, v in waits1.items() if v - waits.get(k, 0) > 1e4},
                           "cgroup_throttled": {k: cg1[k] - cg.get(k, 0) for k in ("nr_throttled", "throttled_usec")
                                                if k in cg1}})
    return passes


class Canaries:
    """probe_bursts' canary processes (its ``--canary-out`` mode), one pinned to each of ``cores``, timing
    pure-Python units for ``seconds``; :meth:`units` waits for them and returns each one's (start, length)."""

    def __init__(self, cores: list[int], seconds: float):
        self.tmp = tempfile.mkdtemp()
        self.outs = [os.path.join(self.tmp, f"{c}.json") for c in cores]
        self.procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.diagnostics.probe_bursts",
                                        "--canary-seconds", str(seconds), "--canary-out", out], cwd=ROOT,
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


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--canary-seconds", type=float)
    pre.add_argument("--canary-out")
    known, _ = pre.parse_known_args(argv)
    if known.canary_out:  # this module run as a canary by the probe below
        canary(known.canary_seconds, known.canary_out)
        return 0
    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    ap.set_defaults(passes=40)
    ap.add_argument("--canaries", default="3,9,15", help="cores to pin one canary process each on ('': none)")
    ap.add_argument("--hold", action="store_true", help="keep one pass of batches on the device throughout")
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    ds = GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True)
    time_pass(ds)
    ms = step_ms(time_pass(ds, min_seconds=0.5), args.factor)
    nb = len(ds)
    held = [dict(b) for b in ds] if args.hold else []
    spin = Spin(ms, 1)
    for _ in range(3):
        stamped_steps(spin, range(nb), nb)
    # The host's clock minus the GPU's, plus the least wake-up: the best return of a sync after its step.
    offset = int(np.median([np.min(h[:, 3] - g[:, 1]) for h, g in (stamped_steps(spin, range(nb), nb)
                                                                    for _ in range(3))]))
    cores = [int(c) for c in args.canaries.split(",") if c.strip()]
    seconds = args.passes * nb * ms / 1e3 * 2.6 + 5  # the passes and their steps alone, with room
    canaries = Canaries(cores, seconds)
    try:
        passes = timed_passes(spin, ds, nb, offset, args.passes)
        ds.close()
        units = canaries.units()
    finally:
        ds.close()  # idempotent
        canaries.close()  # the canaries' files, read or abandoned
    del held
    rows = Rows()
    for row in passes:
        row["canary_slowdown"] = slowdowns(units, row["t0"], row["t1"])
        rows.emit(row)
    bursts = [r for r in passes if r["long_gaps"]]
    summary = {"step_ms": round(ms, 3), "batches": nb, "canary_cores": cores, "passes": len(passes),
               "passes_with_long_gaps": len(bursts),
               "median_wait": round(float(np.median([r["wait_fraction"] for r in passes])), 4)}
    for name, group in (("with", bursts), ("without", [r for r in passes if not r["long_gaps"]])):
        slow = [min(s for s in r["canary_slowdown"] if s is not None) for r in group if any(r["canary_slowdown"])]
        summary[f"least_canary_slowdown_median_{name}_long_gaps"] = round(float(np.median(slow)), 2) if slow else None
    print(json.dumps(summary), flush=True)
    print("wrote", write_probe(args, "probe-bursts", rows, summary=summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
