"""What a training step pays per batch for taking it from a loader, taken apart piece by piece.

    python -m benchmarks.diagnostics.probe_overhead [--what alone,own,gdsload,kvikio,ahead,pinned-options]

Each case runs N simulated steps (one GPU kernel of fixed duration, then a sync, as ``loss.item()``) and
times every step on both sides: the kernel writes when it started and ended (the GPU's global timer), the
host when ``next()`` began and returned, when the launch returned and when the sync did. Per batch that
gives the GPU's idle gap between two steps and where it goes: the host's time from the sync's return to the
next launch (``next()`` included), and the launch's own latency. Cases: the steps alone; the consumer's own
hand-off (a Python iterator, a queue and a stream wait); then gdsload per backend and with other settings
(``batches_ahead``, ``prefetch``, pinned ``slot_bytes`` / ``pool_bytes`` / ``spin_events`` through
``backend_options``). The garbage collector's runs are timed too, and each step's host turnaround split by
whether one overlapped it.
Also: how much of their duration common CUDA calls release the GIL. Writes
``results/<machine>/probe-overhead[-TAG].json``. GPU only.

(Gone from the former probe: timing gdsload's own threads and variants of its hand-off, which patched its
private methods, and producer threads handing off through its private queue or ``queue.Queue``.)
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths
from gdsload.steps import Spin

from ..common import (BATCH, GcRuns, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser,
                      stamped_steps, write_probe)

WARMUP = 20  # steps left out of every summary
Batches = Callable[[], Iterator[object]]


def _summary(us: np.ndarray) -> dict[str, float]:
    if us.size == 0:
        return {}
    return {"mean": round(float(us.mean()), 1), "p50": round(float(np.percentile(us, 50)), 1),
            "p90": round(float(np.percentile(us, 90)), 1), "p99": round(float(np.percentile(us, 99)), 1)}


def turnaround(step: Spin, batches: Batches, n: int, gc_runs: list[tuple[int, int, int]] | None = None) -> dict:
    """``n`` steps over ``batches()``, each timed on the host and on the GPU; per-batch summaries in us."""
    host, dev = stamped_steps(step, batches(), n)
    done = len(host)
    off = int((host[:, 3] - dev[:, 1]).min())  # GPU timer -> host clock, assuming one sync returned at once
    s = slice(WARMUP, None)
    between = (host[1:, 1] - host[:-1, 3])[s] / 1e3  # host: sync returned -> next launch called
    out = {"steps": done, "gap_us": _summary((dev[1:, 0] - dev[:-1, 1])[s] / 1e3),
           "host_turnaround_us": _summary(between), "next_us": _summary((host[1:, 1] - host[1:, 0])[s] / 1e3),
           "launch_call_us": _summary((host[1:, 2] - host[1:, 1])[s] / 1e3),
           "sync_return_late_us": _summary((host[:, 3] - dev[:, 1] - off)[WARMUP:] / 1e3),
           "launch_to_start_us": _summary((dev[1:, 0] + off - host[1:, 1])[s] / 1e3),
           "kernel_us": _summary((dev[:, 1] - dev[:, 0])[WARMUP:] / 1e3)}
    if gc_runs:
        sp = np.array([(a, b) for _, a, b in gc_runs], dtype=np.int64)
        lo, hi = host[:-1, 3][WARMUP:], host[1:, 1][WARMUP:]  # each step's host turnaround
        hit = np.array([bool(((sp[:, 0] < b) & (sp[:, 1] > a)).any()) for a, b in zip(lo, hi)])
        out["gc"] = {"spans_per_step": round(len(sp) / max(1, done), 2),
                     "span_us": _summary((sp[:, 1] - sp[:, 0]) / 1e3),
                     "steps_overlapped": round(float(hit.mean()), 3) if hit.size else None,
                     "host_turnaround_us_overlapped": _summary(between[hit]),
                     "host_turnaround_us_clear": _summary(between[~hit])}
    return out


def gil_released(call: Callable[[], None], calls: int = 200) -> float:
    """Share of the wall time of ``calls`` calls in which a Python thread counting in a loop ran: near 0
    when ``call`` holds the GIL, near 1 when it releases it for most of its duration."""
    counts = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counts[0] += 1

    t = threading.Thread(target=count, daemon=True)
    t.start()
    time.sleep(0.05)
    c0, t0 = counts[0], time.perf_counter()
    time.sleep(0.1)  # the counter alone: its rate
    rate = (counts[0] - c0) / (time.perf_counter() - t0)
    c0, t0 = counts[0], time.perf_counter()
    for _ in range(calls):
        call()
    share = (counts[0] - c0) / (time.perf_counter() - t0) / rate
    stop.set()
    t.join()
    return round(share, 3)


def gdsload_cases(what: set[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, backend, GDSDataset options) of the gdsload cases asked for."""
    cases = []
    if "gdsload" in what:
        cases += [("gdsload, all fields resident (no I/O)", "kvikio", {"resident_bytes": 1 << 40}),
                  ("gdsload mmap", "mmap", {}), ("gdsload pinned", "pinned", {})]
    if "kvikio" in what:
        cases += [("gdsload kvikio", "kvikio", {})]
    if "ahead" in what:  # batches assembled ahead of the consumer, both counts named (defaults differ)
        cases += [(f"gdsload {b}, batches_ahead={a}", b, {"batches_ahead": a}) for b in ("mmap", "pinned")
                  for a in (2, 4)]
    if "pinned-options" in what:  # deeper read-ahead, fewer slot loads, sleeping slot events
        cases += [("gdsload pinned, prefetch=4", "pinned", {"prefetch": 4}),
                  ("gdsload pinned, 32 MiB slots, 1 GiB pool", "pinned",
                   {"backend_options": {"slot_bytes": 32 << 20, "pool_bytes": 1 << 30}}),
                  ("gdsload pinned, slot events sleep", "pinned", {"backend_options": {"spin_events": False}})]
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--steps-ms", default="1.0,2.5")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--what", default="alone,own,gdsload",
                    help="comma list of: alone, own, gdsload, kvikio, ahead, pinned-options")
    args = parse_probe_args(ap, argv)
    import cupy

    what = set(args.what.split(","))
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    rows = Rows()
    n = args.n
    stream = cupy.cuda.get_current_stream()
    one_ms, tiny = Spin(1.0), Spin(0.001)
    ev = cupy.cuda.Event()
    rows.emit({"probe": "gil", "released_by": {
        "stream.synchronize (1 ms kernel)": gil_released(one_ms),
        "kernel launch (1 us kernel)": gil_released(tiny.launch, 2000),
        "stream.wait_event": gil_released(lambda: stream.wait_event(ev), 2000),
        "time.sleep(0.001)": gil_released(lambda: time.sleep(0.001))}})
    stream.synchronize()

    def queue_and_wait() -> Iterator[object]:
        q: queue.Queue[object] = queue.Queue()
        done = cupy.cuda.Event()
        done.record(stream)
        for _ in range(n):
            q.put(1)
            yield q.get(timeout=0.05)
            stream.wait_event(done)

    def endless(ds: GDSDataset) -> Batches:
        def batches() -> Iterator[object]:
            while True:  # pass after pass: each one read ahead by the one before
                yield from ds
        return batches

    for step_ms in [float(s) for s in args.steps_ms.split(",")]:
        step = Spin(step_ms)

        def emit(label: str, batches: Batches, gc_runs: list[tuple[int, int, int]] | None = None, **extra: Any) -> None:
            rows.emit({"probe": "overhead", "step_ms": step_ms, "what": label,
                       "switch_interval_s": sys.getswitchinterval(), **extra, **turnaround(step, batches, n, gc_runs)})

        turnaround(step, lambda: iter(range(n)), n)  # warm-up
        if "alone" in what:
            emit("steps alone", lambda: iter(range(n)))
            emit("steps alone, again (noise)", lambda: iter(range(n)))
        if "own" in what:
            emit("Python iterator", lambda: (x for x in range(n)))
            emit("queue.get + stream.wait_event", queue_and_wait)
        for label, backend, opts in gdsload_cases(what):
            with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
                for _ in ds:  # one pass first: buffers allocated, the next pass read ahead
                    pass
                with GcRuns() as gcs:
                    emit(label, endless(ds), gcs.runs, describe={k: v for k, v in ds.describe().items()
                                                                 if k != "backend_reason"})
            free_device_memory()
    print("wrote", write_probe(args, "probe-overhead", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
