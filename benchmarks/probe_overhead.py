#!/usr/bin/env python3
"""What a training step pays per batch for taking it from a loader, taken apart piece by piece.

Each variant runs N simulated steps (one GPU kernel of fixed duration, then a sync, as ``loss.item()``)
and times every step on both sides: the kernel writes when it started and ended (the GPU's global
timer), the host when ``next()`` began and returned, when the launch returned and when the sync did.
Per batch that gives the GPU's idle gap between two steps and where it goes: the host's time from the
sync's return to the next launch (``next()`` included), and the launch's own latency. The excess is the
mean gap beyond that of the steps alone. Variants: the steps alone; the consumer's own hand-off (a
Python iterator, a queue and a stream wait); a producer thread doing Python or CUDA work per batch,
woken by the take (``queue.Queue``) or after the consumer's calls (gdsload's hand-off); then gdsload.
For gdsload the background threads' busy spans are timed too, and each step's host turnaround is
split by whether such a span overlapped it. Writes probe-overhead-*.json.

    python benchmarks/probe_overhead.py --data /path/on/nvme --out benchmarks/results
"""

from __future__ import annotations

import functools
import gc
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import (Rows, bench_dataset, parse_step_probe_args, posix_read, step_probe_parser,  # noqa: E402
                        write_probe)
from run import BATCH, Spin  # noqa: E402

from gdsload import GDSDataset  # noqa: E402
from gdsload import pool as slot_pool  # noqa: E402
from gdsload.pipeline import Pipeline  # noqa: E402

WARMUP = 20  # steps left out of every summary


def _summary(us: np.ndarray) -> dict[str, float]:
    if us.size == 0:
        return {}
    return {"mean": round(float(us.mean()), 1), "p50": round(float(np.percentile(us, 50)), 1),
            "p90": round(float(np.percentile(us, 90)), 1), "p99": round(float(np.percentile(us, 99)), 1)}


class Spans:
    """Busy spans of background threads (perf_counter_ns pairs), collected by wrapping their methods."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.calls: dict[str, list[int]] = {}
        self.gc: list[tuple[int, int]] = []
        self._undo: list[Callable[[], None]] = []

    def _timed(self, cls: type, name: str, record: Callable[[int, int], None]) -> None:
        """Wrap ``cls.name`` so each call reports its start and end (perf_counter_ns) to ``record``."""
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(obj: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return original(obj, *a, **k)
            finally:
                record(t0, time.perf_counter_ns())

        self.patch(cls, name, timed)

    def wrap(self, cls: type, name: str, gap: bool = False) -> None:
        """Time each call of ``cls.name`` as a busy span; with ``gap``, the span is instead from one call's
        return to the next call (the work a thread does between two hand-offs)."""
        last: dict[int, int] = {}

        def record(t0: int, t1: int) -> None:
            tid = threading.get_ident()
            if not gap:
                self.spans.append((t0, t1))
            elif tid in last:
                self.spans.append((last[tid], t0))
            last[tid] = t1

        self._timed(cls, name, record)

    def time_calls(self, cls: type, name: str) -> None:
        """Time each call of ``cls.name`` (reported per method, not as a busy span)."""
        times = self.calls.setdefault(f"{cls.__name__}.{name}", [])
        self._timed(cls, name, lambda t0, t1: times.append(t1 - t0))

    def watch_gc(self) -> None:
        """Record the garbage collector's runs (any thread) as spans of their own."""
        started: list[int] = []

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter_ns())
            elif started:
                self.gc.append((started.pop(), time.perf_counter_ns()))

        gc.callbacks.append(callback)
        self._undo.append(lambda: gc.callbacks.remove(callback))

    def patch(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def undo(self) -> None:
        for u in reversed(self._undo):  # last patched, first restored
            u()
        self._undo.clear()


def turnaround(step: Spin, batches: Callable[[], Iterator[object]], n: int, spans: Spans | None = None) -> dict:
    """``n`` steps over ``batches()``, each timed on the host and on the GPU; per-batch summaries in us."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    stamps = cupy.zeros(2 * n, dtype=cupy.uint64)
    base = stamps.data.ptr
    host = np.zeros((n, 4), dtype=np.int64)  # next() called, next() returned, launch returned, sync returned
    stream.synchronize()
    pc = time.perf_counter_ns
    it = batches()
    done = 0
    for i in range(n):
        t0 = pc()
        try:
            next(it)
        except StopIteration:
            break
        t1 = pc()
        step.launch(np.uint64(base + 16 * i))
        t2 = pc()
        stream.synchronize()
        host[i] = t0, t1, t2, pc()
        done += 1
    getattr(it, "close", lambda: None)()
    dev = stamps.get().astype(np.int64).reshape(n, 2)[:done]
    host = host[:done]
    off = int((host[:, 3] - dev[:, 1]).min())  # GPU timer -> host clock, assuming one sync returned at once
    s = slice(WARMUP, None)
    gap = (dev[1:, 0] - dev[:-1, 1])[s] / 1e3  # the GPU idle between two steps
    between = (host[1:, 1] - host[:-1, 3])[s] / 1e3  # host: sync returned -> next launch called
    out = {"steps": done, "gap_us": _summary(gap), "host_turnaround_us": _summary(between),
           "next_us": _summary((host[1:, 1] - host[1:, 0])[s] / 1e3),
           "launch_call_us": _summary((host[1:, 2] - host[1:, 1])[s] / 1e3),
           "sync_return_late_us": _summary((host[:, 3] - dev[:, 1] - off)[WARMUP:] / 1e3),
           "launch_to_start_us": _summary((dev[1:, 0] + off - host[1:, 1])[s] / 1e3),
           "kernel_us": _summary((dev[:, 1] - dev[:, 0])[WARMUP:] / 1e3)}
    lo, hi = host[:-1, 3][WARMUP:], host[1:, 1][WARMUP:]  # each step's host turnaround

    def overlap(pairs: list[tuple[int, int]], key: str) -> None:
        sp = np.array(pairs, dtype=np.int64)
        hit = np.array([bool(((sp[:, 0] < b) & (sp[:, 1] > a)).any()) for a, b in zip(lo, hi)])
        out[key] = {"spans_per_step": round(len(sp) / max(1, done), 2),
                    "span_us": _summary((sp[:, 1] - sp[:, 0]) / 1e3),
                    "steps_overlapped": round(float(hit.mean()), 3) if hit.size else None,
                    "host_turnaround_us_overlapped": _summary(between[hit]),
                    "host_turnaround_us_clear": _summary(between[~hit])}

    if spans is not None:
        if spans.spans:
            overlap(spans.spans, "background")
        if spans.gc:
            overlap(spans.gc, "gc")
        # per call, and in all per step (the calls of the background threads' waits are not one per step)
        out["calls_us"] = {name: {**_summary(np.array(t[WARMUP:], dtype=np.float64) / 1e3),
                                  "per_step": round(sum(t) / 1e3 / max(1, done), 1), "calls": len(t)}
                           for name, t in spans.calls.items()}
    return out


VARIANTS = ("stream waits only for a batch not yet written", "assembler waits for each batch",
            "assembler sleeps 50 us after a hand-off", "assembler sleeps 200 us after a hand-off")


def patch_handoff(spans: Spans, variant: str, ops: type, handoff: type | None) -> None:
    """Change gdsload's hand-off for one variant (undone with ``spans``)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {VARIANTS})")
    if variant.startswith("stream waits only"):  # no stream wait for a batch already written
        spans.patch(ops, "hand_over", lambda self, ready: ready is None or ready.done or self.stream.wait_event(ready))
    elif variant.startswith("assembler waits"):  # the batch handed over written: the consumer waits on nothing
        hand = Pipeline._hand

        def synced(self: Any, item: Any) -> bool:
            if isinstance(item, tuple):
                self.ops.synchronize(item[4])
                item = (*item[:4], None)
            return hand(self, item)

        spans.patch(Pipeline, "_hand", synced)
    elif variant.startswith("assembler sleeps") and handoff is not None:  # the consumer's launch goes first
        pause = float(variant.split()[2]) * 1e-6
        put = handoff.put

        def put_then_sleep(self: Any, item: Any, stop: threading.Event) -> bool:
            ok = put(self, item, stop)
            time.sleep(pause)
            return ok

        spans.patch(handoff, "put", put_then_sleep)


def producer(work: Callable[[], None], n: int, handoff: bool, spans: Spans, ahead: int = 2,
             ) -> Callable[[], Iterator[object]]:
    """``n`` items from a thread that runs ``work`` for each, ``ahead`` items before the consumer; the
    consumer's stream waits on an event per item, as gdsload's does. ``handoff``: gdsload's hand-off (the
    producer wakes once the consumer's calls are made), else a ``queue.Queue`` (woken by the take)."""
    import cupy

    from gdsload.pipeline import _Handoff

    stream = cupy.cuda.get_current_stream()
    done = cupy.cuda.Event()
    done.record(stream)

    def batches() -> Iterator[object]:
        stop = threading.Event()
        q: Any = _Handoff(ahead) if handoff else queue.Queue(maxsize=ahead)

        def put(item: object) -> bool:
            if handoff:
                return q.put(item, stop)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def run() -> None:
            while not stop.is_set():
                t0 = time.perf_counter_ns()
                work()
                spans.spans.append((t0, time.perf_counter_ns()))
                if not put(1):
                    return

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            for _ in range(n):
                item = q.get(stop) if handoff else q.get()
                stream.wait_event(done)
                if handoff:
                    q.release()
                yield item
        finally:
            stop.set()
            if handoff:
                q.clear()
            t.join()

    return batches


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


def main() -> int:
    ap = step_probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--steps-ms", default="1.0,2.5")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--what", default="alone,own,producers,gdsload",
                    help="comma list of: alone, own, producers, gdsload, variants, kvikio, ahead, pinned-options")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"with --what variants: a comma list of {VARIANTS}")
    ap.add_argument("--backends", default="mmap,pinned", help="the backends the variants run on")
    args = parse_step_probe_args(ap)
    import cupy

    what = set(args.what.split(","))
    path, paths, nbytes = bench_dataset(args.data, "step.gds", args.size_gib)
    posix_read(paths, False, True)
    rows = Rows()
    n = args.n
    stream = cupy.cuda.get_current_stream()
    side = cupy.cuda.Stream(non_blocking=True)
    scratch = cupy.zeros(1 << 20, dtype=cupy.uint8)

    one_ms, tiny = Spin(1.0), Spin(0.001)
    ev = cupy.cuda.Event()
    rows.emit({"probe": "gil", "released_by": {
        "stream.synchronize (1 ms kernel)": gil_released(one_ms),
        "kernel launch (1 us kernel)": gil_released(tiny.launch, 2000),
        "stream.wait_event": gil_released(lambda: stream.wait_event(ev), 2000),
        "time.sleep(0.001)": gil_released(lambda: time.sleep(0.001))}})
    stream.synchronize()

    def python_work(us: float) -> Callable[[], None]:
        def work() -> None:
            end = time.perf_counter() + us / 1e6
            while time.perf_counter() < end:
                pass
        return work

    def cuda_work() -> None:  # about what the assembler issues per batch: allocations, copies, events
        with side:
            a = cupy.empty(1 << 20, dtype=cupy.uint8)
            for _ in range(4):
                a[...] = scratch
            side.wait_event(stream.record())
            side.record()

    def queue_and_wait() -> Iterator[object]:
        q: queue.Queue[object] = queue.Queue()
        done = cupy.cuda.Event()
        done.record(stream)
        for _ in range(n):
            q.put(1)
            yield q.get(timeout=0.05)
            stream.wait_event(done)

    def endless(ds: GDSDataset) -> Callable[[], Iterator[object]]:
        def batches() -> Iterator[object]:
            while True:  # pass after pass: each one read ahead by the one before
                yield from ds
        return batches

    for step_ms in [float(s) for s in args.steps_ms.split(",")]:
        step = Spin(step_ms)

        def emit(label: str, batches: Callable[[], Iterator[object]], spans: Spans | None = None,
                 **extra: Any) -> None:
            r = turnaround(step, batches, n, spans)
            rows.emit({"probe": "overhead", "step_ms": step_ms, "what": label,
                       "switch_interval_s": sys.getswitchinterval(), **extra, **r})

        turnaround(step, lambda: iter(range(n)), n)  # warm-up
        if "alone" in what:
            emit("steps alone", lambda: iter(range(n)))
            emit("steps alone, again (noise)", lambda: iter(range(n)))
        if "own" in what:
            emit("Python iterator", lambda: (x for x in range(n)))
            emit("queue.get + stream.wait_event", queue_and_wait)
        if "producers" in what:
            for handoff in (False, True):
                kind = "gdsload hand-off" if handoff else "queue.Queue"
                for label, work in [("50 us of Python", python_work(50)), ("300 us of Python", python_work(300)),
                                    ("CUDA calls", cuda_work), ("sleep 50 us", lambda: time.sleep(50e-6))]:
                    sp = Spans()
                    emit(f"producer thread, {label} per batch, {kind}", producer(work, n, handoff, sp), sp)
        cases = []
        resident = {"resident_bytes": 1 << 40}
        if "gdsload" in what:
            cases += [("gdsload, all fields resident (no I/O)", "kvikio", resident, None),
                      ("gdsload mmap", "mmap", {}, None), ("gdsload pinned", "pinned", {}, None)]
        if "variants" in what:  # experiments: the hand-off changed by patching, to compare in one run
            cases += [(f"gdsload {b}, {v}", b, {}, v) for b in args.backends.split(",")
                      for v in args.variants.split(",")]
        if "kvikio" in what:
            cases += [("gdsload kvikio", "kvikio", {}, None)]
        if "ahead" in what:  # batches assembled ahead of the consumer, both counts named (defaults differ)
            cases += [(f"gdsload {b}, batches_ahead={a}", b, {"batches_ahead": a}, None) for b in ("mmap", "pinned")
                      for a in (2, 4)]
        if "pinned-options" in what:  # deeper read-ahead, fewer slot loads, sleeping slot events
            cases += [("gdsload pinned, prefetch=4", "pinned", {"prefetch": 4}, None),
                      ("gdsload pinned, 32 MiB slots, 1 GiB pool", "pinned",
                       {"backend_options": {"slot_bytes": 32 << 20, "pool_bytes": 1 << 30}}, None),
                      ("gdsload pinned, slot events sleep", "pinned", {}, "slot events sleep")]
        for label, backend, opts, variant in cases:
            sp = Spans()
            if variant == "slot events sleep":  # before the pool makes its events
                sp.patch(slot_pool, "SLOT_EVENTS_SPIN", False)
            with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
                for _ in ds:  # one pass first: buffers allocated, the next pass read ahead
                    pass
                ops = type(ds._active[0].ops)
                handoff = getattr(sys.modules[Pipeline.__module__], "_Handoff", None)
                if variant is not None and variant != "slot events sleep":
                    patch_handoff(sp, variant, ops, handoff)
                sp.wrap(Pipeline, "_hand", gap=True)  # the assembler's work between two hand-offs
                if backend == "pinned" and ds.backend._driver is not None:
                    sp.wrap(type(ds.backend._driver), "_finish")
                    sp.wrap(type(ds.backend._driver), "_issue")
                    sp.time_calls(slot_pool.PinnedPool, "acquire")  # the driver waiting on a slot's copy
                for name in ("begin", "hand_over"):  # the consumer's calls in next(), each timed
                    sp.time_calls(ops, name)
                sp.time_calls(Pipeline, "_take_assembled")
                # Where the readers wait: the assembler for a filled window, the submitter for a free
                # buffer and for its "released" event (which follows the consumer's queued steps).
                sp.time_calls(Pipeline, "_take_ready")
                sp.time_calls(Pipeline, "_next_free")
                sp.time_calls(ops, "synchronize")
                if handoff is not None:
                    sp.time_calls(handoff, "release")
                sp.watch_gc()
                try:
                    emit(label, endless(ds), sp)
                finally:
                    sp.undo()
            cupy.get_default_memory_pool().free_all_blocks()

    print("wrote", write_probe(args.out, "probe-overhead-", args.tag, rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
