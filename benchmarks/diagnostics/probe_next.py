"""The consumer's turn in ``next()`` with a training step that syncs every batch: what its calls cost here,
and how the steady waiting moves when parts of that turn are changed in place.

    python -m benchmarks.diagnostics.probe_next [--backend mmap] [--factor 1.5] [--passes 5] [--repeats 2]

First the unit costs on this machine (median of many calls, µs): CuPy's current stream, a stream waiting on
a finished event, an event query, a perf_counter call, and a SimpleQueue put that wakes a thread blocked on
it (the waker's side). Then, on the suite's warm image dataset, a step of ``--factor`` x a batch's read time
with a sync after every step, timed as the suite's training-step rows are (``time_passes``: a pass from rest,
then ``--passes`` passes, median of those), for variants patched in for the run only:

- ``base``: the library as it is;
- ``ready-query``: ``hand_over`` skips the stream wait when the batch's ready event has already completed;
- ``poll-room``: the assembler polls for room (100 µs sleeps) instead of being woken by the consumer's
  ``release()``, so the consumer's turn makes no wake-up call;
- ``both``.

Each variant also reports the host time of ``next()`` per batch and a breakdown of it by the pipeline's calls
(wrapped with timers, which add about a quarter µs each). GPU only. Writes
``results/<machine>/probe-next[-TAG].json``.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload import pipeline as pipeline_module
from gdsload.device import CudaOps
from gdsload.handoff import Handoff
from gdsload.measure import read_files, shard_paths, time_pass, time_passes
from gdsload.steps import Spin

from ..common import (BATCH, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, step_ms, timed,
                      write_probe)


def unit_us(fn: Callable[[], Any], n: int = 20000) -> float:
    """Median µs of one call of ``fn``, timed in groups of 100."""
    per = []
    for _ in range(n // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        per.append((time.perf_counter() - t0) / 100)
    return round(statistics.median(per) * 1e6, 3)


def wake_us(n: int = 2000) -> float:
    """Median µs the waker spends in ``SimpleQueue.put`` when a thread is blocked in ``get`` on it."""
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()
    ack: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def sleeper() -> None:
        while q.get(timeout=1.0) is not None:
            ack.put(1)

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    took = []
    for i in range(n):
        time.sleep(200e-6)  # the other thread is blocked in get() by now
        t0 = time.perf_counter()
        q.put(i)
        took.append(time.perf_counter() - t0)
        ack.get()
    q.put(None)
    t.join()
    return round(statistics.median(took) * 1e6, 3)


class PollRoomHandoff(Handoff):
    """The hand-off with room counted, not queued: the consumer's ``release()`` bumps a counter only it
    writes, the assembler polls for room every 100 µs (the variant ``poll-room``)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._capacity, self._put_count, self._released = capacity, 0, 0

    def put(self, item: Any, stop: threading.Event) -> bool:
        while self._put_count - self._released >= self._capacity:
            if stop.is_set():
                return False
            time.sleep(100e-6)
        self._put_count += 1
        self._items.put(item)
        return True

    def release(self) -> None:
        self._released += 1

    def clear(self) -> None:
        self._drop_items()  # no room to give back: it is counted, not queued


def _ready_query(old: Callable[..., Any]) -> Callable[..., Any]:
    def hand_over(self: CudaOps, ready: Any) -> None:
        old(self, None if ready is not None and ready.done else ready)
    return hand_over


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    undo = []
    if name in ("ready-query", "both"):
        undo.append((CudaOps, "hand_over", CudaOps.hand_over))
        CudaOps.hand_over = _ready_query(CudaOps.hand_over)  # type: ignore[method-assign]
    if name in ("poll-room", "both"):
        undo.append((pipeline_module, "Handoff", pipeline_module.Handoff))
        pipeline_module.Handoff = PollRoomHandoff  # type: ignore[misc]
    try:
        yield
    finally:
        for owner, attr, old in reversed(undo):
            setattr(owner, attr, old)


@contextlib.contextmanager
def breakdown(times: dict[str, list[float]]) -> Iterator[None]:
    """Time the consumer-side calls of every batch (host µs per call) while the context is open."""
    targets = [(CudaOps, "hand_over"), (CudaOps, "export"), (pipeline_module.Pipeline, "_wait_assembled"),
               (pipeline_module.Handoff, "release")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in targets]

    def wrap(label: str, old: Callable[..., Any]) -> Callable[..., Any]:
        def f(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return old(*a, **k)
            finally:
                times.setdefault(label, []).append(time.perf_counter() - t0)
        return f

    for owner, attr, old in saved:
        setattr(owner, attr, wrap(f"{owner.__name__}.{attr}", old))
    try:
        yield
    finally:
        for owner, attr, old in saved:
            setattr(owner, attr, old)


def host_next(ds: GDSDataset, step: Spin) -> list[float]:
    """One pass after a pass from rest, every ``next()`` timed on the host (seconds each)."""
    ds.stop()
    took: list[float] = []
    for k in range(2):
        for _batch in timed(ds, took if k else []):
            step()
    return took


def h2d_after_rest(rest: Callable[[], None], nbytes: int = 296 << 20) -> dict[str, float]:
    """GB/s of one host-to-device copy of ``nbytes`` from pinned memory right after ``rest()``, and of the
    same copy again at once: whether a copy engine (or the link) idle for a while starts slower."""
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    dev = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    out = {}
    for label in ("after_rest", "again", "after_rest_2", "again_2"):
        if label.startswith("after_rest"):
            rest()
        t0 = time.perf_counter()
        dev.data.copy_from_host_async(mem.ptr, nbytes, stream)
        stream.synchronize()
        out[label] = round(nbytes / (time.perf_counter() - t0) / 1e9, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    import cupy

    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    args = parse_probe_args(ap, argv)
    rows = Rows()
    s = cupy.cuda.get_current_stream()
    e = cupy.cuda.Event(disable_timing=True)
    e.record(s)
    e.synchronize()
    rows.emit({"unit_costs_us": {
        "cupy.cuda.get_current_stream(0)": unit_us(lambda: cupy.cuda.get_current_stream(0)),
        "stream.wait_event(finished event)": unit_us(lambda: s.wait_event(e)),
        "event.done (finished)": unit_us(lambda: e.done),
        "time.perf_counter()": unit_us(time.perf_counter),
        "SimpleQueue.put waking a blocked thread": wake_us()}})
    spin = Spin(1.0, 1)
    rows.emit({"h2d_gb_per_s": {"idle 0.5 s": h2d_after_rest(lambda: time.sleep(0.5)),
                                "0.5 s of 1 ms steps": h2d_after_rest(lambda: [spin() for _ in range(500)])}})
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    with GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True) as ds:
        time_pass(ds)
        r = time_pass(ds, min_seconds=0.5)
        ms = step_ms(r, args.factor)
        step = Spin(ms, 1)
        time_pass(ds, step)
        for name in ["base", "ready-query", "poll-room", "both"] * args.repeats:
            with variant(name):
                runs = time_passes(ds, step, args.passes)
                took = np.array(host_next(ds, step)) * 1e6
                parts: dict[str, list[float]] = {}
                with breakdown(parts):
                    host_next(ds, step)
            waits = [round(x.wait_fraction or 0.0, 4) for x in runs[1:]]
            rows.emit({"variant": name, "backend": args.backend, "step_ms": round(ms, 3),
                       "wait_fraction": round(float(np.median(waits)), 4), "wait_fraction_passes": waits,
                       "first_pass_wait_fraction": round(runs[0].wait_fraction or 0.0, 4),
                       "first_batch_ms": round((runs[0].first_batch_s or 0.0) * 1e3, 3),
                       "host_next_us": {"p50": round(float(np.median(took)), 1),
                                        "p90": round(float(np.percentile(took, 90)), 1),
                                        "mean": round(float(took.mean()), 1)},
                       "breakdown_p50_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in parts.items()}})
    print("wrote", write_probe(args, "probe-next", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
