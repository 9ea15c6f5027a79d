"""The suite's training-step waiting taken apart: how much of it is the stretch's start, the passes' starts,
and each batch's own turn in ``next()``.

    python -m benchmarks.diagnostics.probe_waiting [--backends mmap,pinned,mmap:prefetch=4] [--factor 1.5]
        [--seconds 0.5,3] [--repeats 3]

Per backend, on the suite's warm image dataset: the step row as the suite measures it (a GPU step of
``--factor`` x a batch's read time, sync after every step, back-to-back passes from rest filling each of
``--seconds``, ``--repeats`` times), then one such stretch with every batch timed on the host (``next()``) and
on the consumer's stream (from before ``next()`` to after it: the host's turn plus any device-side wait for
the batch). The stretch's time beyond the steps alone is split into its first batch, the first batch of each
later pass, and the rest (per batch: p50, p90, mean); a second such stretch is traced: the host times at
which the pipeline's threads submitted each window, received it filled, and handed each batch on, around
the stretch's first batch and each pass's first batches (patched in by wrapping those methods: this probe
observes, it changes nothing), and the garbage collector's runs. Writes ``results/<machine>/probe-waiting[-TAG].json``.
GPU only.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload import pipeline as pipeline_module
from gdsload.assembler import Assembler
from gdsload.device import CudaOps
from gdsload.handoff import Handoff
from gdsload.window import WindowLayout
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import BATCH, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, step_ms, write_probe


def _us(xs: np.ndarray) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    if a.size == 0:
        return {}
    return {"p50": round(float(np.median(a)), 1), "p90": round(float(np.percentile(a, 90)), 1),
            "mean": round(float(a.mean()), 1), "max": round(float(a.max()), 1)}


def stretch(ds: GDSDataset, step: Spin, seconds: float, trace: Tracer | None = None) -> dict[str, Any]:
    """One stretch as ``time_pass(ds, step, seconds)`` times it, every batch timed (and traced when given)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    n_per_pass = len(ds)
    alone = step.alone(n_per_pass)
    ds.stop()
    host, events, first = [], [], []
    t0 = time.perf_counter()
    passes = 0
    while passes == 0 or time.perf_counter() - t0 < seconds:
        it = iter(ds)
        k = 0
        while True:
            e0 = cupy.cuda.Event(disable_timing=False)
            e0.record(stream)
            h0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            h1 = time.perf_counter()
            e1 = cupy.cuda.Event(disable_timing=False)
            e1.record(stream)
            step()
            host.append(h1 - h0)
            if trace is not None:
                trace.log.append((h0, "consumer", "next", k))
                trace.log.append((h1, "consumer", "got", k))
                trace.device(f"consumer may use batch {k}", e1)
            events.append((e0, e1))
            first.append(k == 0)
            k += 1
        passes += 1
    stream.synchronize()
    wall = time.perf_counter() - t0
    dev = np.asarray([cupy.cuda.get_elapsed_time(a, b) / 1e3 for a, b in events])
    host_a = np.asarray(host)
    first_a = np.asarray(first)
    per_step_alone = alone / n_per_pass
    step_s = step.ms / 1e3
    turn_alone = per_step_alone - step_s  # the host's own turn between two steps, with nothing to take
    steady = dev[~first_a]
    return {"passes": passes, "batches": len(events), "wall_s": round(wall, 4),
            "alone_s": round(alone * passes, 4), "wait_fraction": round(max(0.0, wall - alone * passes) / wall, 4),
            "turn_alone_us": round(turn_alone * 1e6, 1),
            "first_batch_ms": round(float(dev[0]) * 1e3, 3),
            "pass_starts_ms": [round(float(x) * 1e3, 3) for x in dev[first_a][1:]],
            "steady_device_next_us": _us(steady), "steady_host_next_us": _us(host_a[~first_a]),
            "share_first_batch": round(float(dev[0]) / wall, 4),
            "share_pass_starts": round(float(dev[first_a][1:].sum()) / wall, 4),
            "share_steady": round(float(steady.sum()) / wall, 4),
            "first_host_next_ms": [round(float(x) * 1e3, 3) for x in host_a[first_a]]}


class Tracer:
    """Host timestamps of the pipeline's hand-offs, by wrapping its methods for the life of the context, and
    device times of a few events (when a window's data was there, when the consumer's stream could use a
    batch), placed on the host's clock from a reference event recorded on an idle stream."""

    def __init__(self, ds: GDSDataset):
        import cupy

        self.cupy = cupy
        self.ds, self.log, self._undo = ds, [], []
        self._marks: list[tuple[str, Any]] = []
        self._side = cupy.cuda.Stream(non_blocking=True)

    def device(self, label: str, event: Any) -> None:
        """Note when ``event`` completes on the device (resolved at exit)."""
        self._marks.append((label, event))

    def _filled_mark(self, label: str, filled: Any) -> None:
        if filled is None:
            return
        e = self.cupy.cuda.Event()
        self._side.wait_event(filled)
        e.record(self._side)
        self.device(label, e)

    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        old = getattr(owner, name)
        self._undo.append((owner, name, old, name in vars(owner)))
        setattr(owner, name, make(old))

    def __enter__(self) -> Tracer:
        log = self.log
        stream = self.cupy.cuda.get_current_stream()
        stream.synchronize()
        self._ref = self.cupy.cuda.Event()
        self._ref.record(stream)
        self._ref.synchronize()
        self._t_ref = time.perf_counter()
        tracer = self

        def note(what: str, detail: Any) -> None:
            log.append((time.perf_counter(), threading.current_thread().name.removeprefix("gdsload-reader-"), what,
                        detail))

        def submit(old: Any) -> Any:
            @functools.wraps(old)
            def f(dest: Any, requests: Any, stop: Any) -> Any:
                note("submit", len(requests))
                out = old(dest, requests, stop)
                note("submitted", len(requests))
                stream = getattr(self.ds._backend, "stream", None)
                if stream is not None:
                    e = tracer.cupy.cuda.Event()
                    e.record(stream)
                    tracer.device("backend stream passed a submit", e)
                return out
            return f

        def take_ready(old: Any) -> Any:
            @functools.wraps(old)
            def f(self_: Any) -> Any:
                got = old(self_)
                note("window in", None if got is None else got[:2])
                if got is not None:
                    tracer._filled_mark(f"window {got[:2]} filled", got[3])
                return got
            return f

        def work(old: Any) -> Any:
            @functools.wraps(old)
            def f(self_: Any, layout: Any, blocks: Any) -> Any:
                note("window of blocks from", int(blocks[0]) if len(blocks) else None)
                return old(self_, layout, blocks)
            return f

        def timed(what: str) -> Any:
            def make(old: Any) -> Any:
                @functools.wraps(old)
                def f(*a: Any, **kw: Any) -> Any:
                    note(what, "start")
                    try:
                        return old(*a, **kw)
                    finally:
                        note(what, "end")
                return f
            return make

        def put(old: Any) -> Any:
            @functools.wraps(old)
            def f(self_: Any, item: Any, stop: Any) -> Any:
                note("batch made", item[:2] if isinstance(item, tuple) else None)
                return old(self_, item, stop)
            return f

        def batches(old: Any) -> Any:
            @functools.wraps(old)
            def f(self_: Any, plan: Any, start: int, *a: Any) -> Iterator[Any]:
                note("pass setup", start)
                yield from old(self_, plan, start, *a)
            return f

        self._wrap(self.ds._backend, "submit", submit)
        self._wrap(pipeline_module.Pipeline, "_take_ready", take_ready)
        self._wrap(Handoff, "put", put)
        self._wrap(Assembler, "batches", batches)
        self._wrap(WindowLayout, "work", work)
        self._wrap(CudaOps, "synchronize", timed("host waits for a released buffer"))
        self._wrap(CudaOps, "upload", timed("index upload"))

        def collected(phase: str, info: dict) -> None:
            note(f"gc {phase}", info.get("generation"))

        self._gc = collected
        gc.callbacks.append(collected)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._gc)
        for owner, name, old, own in reversed(self._undo):
            if own:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.cupy.cuda.Device().synchronize()
        for label, e in self._marks:
            ms = self.cupy.cuda.get_elapsed_time(self._ref, e)
            self.log.append((self._t_ref + ms / 1e3, "device", label, None))


def around(log: list, t0: float, marks: list[float], before_ms: float = 12.0, after_ms: float = 3.0) -> list[list]:
    """The events within ``before_ms`` before and ``after_ms`` after each mark, in ms from the stretch's start."""
    out = []
    for m in marks:
        out.append([[round((t - t0) * 1e3, 3), who, what, str(d)] for t, who, what, d in sorted(log, key=lambda e: e[0])
                    if m - before_ms / 1e3 <= t <= m + after_ms / 1e3])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--backends", default="mmap,pinned")
    ap.add_argument("--factor", type=float, default=1.5)
    ap.add_argument("--seconds", default="0.5,3")
    ap.add_argument("--repeats", type=int, default=3)
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    rows = Rows()
    for spec in args.backends.split(","):
        backend, _, rest = spec.partition(":")  # e.g. mmap:prefetch=4
        opts = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(":") if kv)}
        with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
            time_pass(ds)
            r = time_pass(ds, min_seconds=0.5)
            ms = step_ms(r, args.factor)
            step = Spin(ms, 1)
            time_pass(ds, step)
            row: dict[str, Any] = {"backend": backend, "options": opts, "step_ms": round(ms, 3),
                                   "read_gb_per_s": round(r.gb_per_s, 2),
                                   "describe": {k: ds.describe()[k] for k in ("window_blocks", "batches_ahead")}}
            for s in [float(x) for x in args.seconds.split(",")]:
                runs = [time_pass(ds, step, min_seconds=s) for _ in range(args.repeats)]
                row[f"wait_fraction_{s:g}s"] = sorted(round(x.wait_s / x.seconds, 4) for x in runs)
            row["timed_stretch"] = stretch(ds, step, float(args.seconds.split(",")[0]))
            with Tracer(ds) as tracer:
                traced = stretch(ds, step, float(args.seconds.split(",")[0]), tracer)
            log = tracer.log
            starts = [t for t, who, what, k in log if who == "consumer" and what == "next" and k == 0]
            row["traced_stretch"] = {"wait_fraction": traced["wait_fraction"],
                                     "first_batch_ms": traced["first_batch_ms"],
                                     "pass_starts_ms": traced["pass_starts_ms"],
                                     "first_host_next_ms": traced["first_host_next_ms"],
                                     "events": around(log, min(t for t, *_ in log), starts[:1], 25.0, 30.0)
                                     + around(log, min(t for t, *_ in log), starts[1:3], 25.0)}
            rows.emit(row)
        free_device_memory()
    print("wrote", write_probe(args, "probe-waiting", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
