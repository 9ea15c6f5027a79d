"""Where the long gaps between synchronised training steps come from: the consumer's turn and the pipeline's
threads on one timeline.

    python -m benchmarks.diagnostics.probe_gaps [--backend mmap] [--factor 1.5] [--passes 5] [--repeats 2]
        [--variants base,switch-100us] [--raw FILE.npz]

On the suite's warm image dataset, a GPU step of ``--factor`` x a batch's read time writes its start and end
(the GPU's nanosecond timer) for every batch, and the host notes four times per step: before ``next()``,
after it, after the launch and after the sync. The pipeline's calls (plan and index of a pass, waits for a
window, for room, for a free buffer, submissions, gathers, allocations) and the garbage collector's runs are
timed on their own threads. Each step's gap (from the last step's end to its start, GPU clock) is split
into the host's parts: the sync's wake-up (its return beyond the fastest of the pass), the loop, ``next()``
and the launch; a gap over ``--long-us`` is listed with the pipeline calls and collections that overlap it.
The waiting the suite would count is the sum of the gaps beyond the steps-alone median: per variant, that
excess is reported whole and by the host part that was largest in each gap.

Variants (patched in for the run only): ``base``; ``switch-100us`` (``sys.setswitchinterval(1e-4)``: a long
gap that shrinks with it is a thread holding the GIL); ``group-NMiB`` (``assembler.GROUP_BYTES``: batches
gathered N MiB at a time, so the assembler's Python work is paid once per group); ``cupy-copies`` (mmap: a
window's copies queued one CuPy call each, not by the native copier); ``nap-Nus`` (the assembler, woken by
the room the consumer gives back just before launching its step, sleeps N us before its next batch: a
launch part that shrinks with it was the assembler's Python beside the launch); ``no-fence`` (the
assembler's stream does not wait for the consumer's queued work before writing a batch, so its gathers, and
the window releases after them, no longer start as each step ends; unsafe in general, harmless here, where
no step reads its batch). Variants combine with ``+`` (``no-fence+nap-100us``). GPU only. Writes
``results/<machine>/probe-gaps[-TAG].json``.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload import assembler as assembler_module
from gdsload import handoff as handoff_module
from gdsload import pipeline as pipeline_module
from gdsload.assembler import Assembler
from gdsload.device import CudaOps
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import BATCH, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, step_ms, write_probe

#: (class, method, label) timed on whichever thread calls them.
TIMED = [(pipeline_module.Pipeline, "_pass", "pass plan + index (or lookup)"),
         (pipeline_module.Pipeline, "_take_ready", "assembler: wait for a window"),
         (pipeline_module.Pipeline, "_next_free", "submitter: wait for a free buffer"),
         (handoff_module.Handoff, "put", "assembler: hand over (waits for room)"),
         (Assembler, "_gather", "assembler: gather launches"),
         (CudaOps, "empty", "assembler: allocate"),
         (CudaOps, "synchronize", "submitter: wait for released"),
         (CudaOps, "upload", "index upload")]
#: Calls shorter than this are not kept (lookups, a put with room).
KEEP_S = 20e-6


class Timeline:
    """Timed calls of every thread: (label, thread name, start, end), perf_counter seconds."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []

    def wrap(self, f: Callable[..., Any], label: str) -> Callable[..., Any]:
        events = self.events

        def timed_call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                t1 = time.perf_counter()
                if t1 - t0 >= KEEP_S:
                    events.append((label, threading.current_thread().name, t0, t1))
        return timed_call

    @contextlib.contextmanager
    def patched(self, backend: Any, variant: str) -> Iterator[None]:
        parts = variant.split("+")
        saved = [(cls, name, getattr(cls, name)) for cls, name, _ in TIMED]
        saved += [(type(backend), "submit", type(backend).submit), (CudaOps, "fence", CudaOps.fence)]
        for part in parts:
            if part.startswith("nap-"):  # wrapped by the timing below, restored with it
                handoff_module.Handoff.put = napping(handoff_module.Handoff.put,  # type: ignore[method-assign]
                                                     float(part[4:].removesuffix("us")) * 1e-6)
        if "no-fence" in parts:  # safe here only: the steps read no batch, and each one is synced
            CudaOps.fence = lambda self: None  # type: ignore[method-assign]
        for cls, name, label in TIMED:
            setattr(cls, name, self.wrap(getattr(cls, name), label))
        type(backend).submit = self.wrap(type(backend).submit, "submitter: submit")  # type: ignore[method-assign]
        gc_start: dict[int, float] = {}

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_start[threading.get_ident()] = time.perf_counter()
            else:
                t0 = gc_start.pop(threading.get_ident(), None)
                if t0 is not None:
                    self.events.append((f"gc gen {info['generation']}", threading.current_thread().name, t0,
                                        time.perf_counter()))
        gc.callbacks.append(on_gc)
        interval, group = sys.getswitchinterval(), assembler_module.GROUP_BYTES
        copier = getattr(backend, "_copier", None)
        if "cupy-copies" in parts:
            backend._copier = None
        if "switch-100us" in parts:
            sys.setswitchinterval(1e-4)
        for part in parts:
            if part.startswith("group-"):  # read by each pipeline's assembler as it starts
                assembler_module.GROUP_BYTES = int(part[6:].removesuffix("MiB")) << 20
        try:
            yield
        finally:
            sys.setswitchinterval(interval)
            assembler_module.GROUP_BYTES = group
            if copier is not None:
                backend._copier = copier
            gc.callbacks.remove(on_gc)
            for cls, name, f in saved:
                setattr(cls, name, f)

    def overlapping(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [{"call": e[0], "thread": e[1], "start_us": round((e[2] - t0) * 1e6, 1),
                 "took_us": round((e[3] - e[2]) * 1e6, 1)} for e in self.events if e[3] > t0 and e[2] < t1]


def napping(put: Callable[..., bool], nap_s: float) -> Callable[..., bool]:
    """``Handoff.put`` that, when it had to wait for room, sleeps ``nap_s`` before the assembler goes on: the
    consumer, which gave the room back just before launching its step, has launched it by then."""

    def put_then_nap(self: Any, item: Any, stop: threading.Event) -> bool:
        waited = self._free == 0
        ok = put(self, item, stop)
        if waited:
            time.sleep(nap_s)
        return ok
    return put_then_nap


class Stepper:
    """A pass of steps, each with its GPU start/end and four host times."""

    def __init__(self, spin: Spin, capacity: int):
        import cupy

        self.spin = spin
        self.stamps = cupy.zeros(2 * capacity, dtype=cupy.uint64)
        self.host = np.zeros((capacity, 4))

    def run(self, batches: Any) -> int:
        it, n, base, host = iter(batches), 0, int(self.stamps.data.ptr), self.host
        perf, launch, sync = time.perf_counter, self.spin.launch, self.spin.synchronize
        while True:
            t0 = perf()
            try:
                next(it)
            except StopIteration:
                return n
            t1 = perf()
            launch(np.uint64(base + 16 * n))
            t2 = perf()
            sync()
            host[n] = (t0, t1, t2, perf())
            n += 1

    def split(self, n: int) -> dict[str, np.ndarray]:
        """Per gap (step i-1's end to step i's start, i >= 1): its µs and the host's parts of it."""
        g = self.stamps[: 2 * n].get().reshape(-1, 2).astype(np.int64)
        h = self.host[:n]
        lag = h[:, 3] - g[:, 1] / 1e9  # host sync return minus GPU end (plus an unknown offset)
        return {"gap": (g[1:, 0] - g[:-1, 1]) / 1e3, "wake": (lag[:-1] - lag.min()) * 1e6,
                "loop": (h[1:, 0] - h[:-1, 3]) * 1e6, "next": (h[1:, 1] - h[1:, 0]) * 1e6,
                "launch": (h[1:, 2] - h[1:, 1]) * 1e6, "returned": h[:-1, 3], "launched": h[1:, 2]}


PARTS = ("wake", "loop", "next", "launch")


def attribute(parts: list[dict[str, np.ndarray]], floor_us: float, long_us: float, timeline: Timeline
              ) -> dict[str, Any]:
    """The excess of every gap over ``floor_us``, by the host part largest beyond its own median, and the
    long gaps with what overlapped them."""
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    medians = {k: float(np.median(cat[k])) for k in PARTS}
    excess = np.maximum(0.0, cat["gap"] - floor_us)
    by = {k: 0.0 for k in PARTS}
    long = []
    for i in np.argsort(-excess):
        over = {k: cat[k][i] - medians[k] for k in PARTS}
        by[max(over, key=over.get)] += excess[i]  # type: ignore[arg-type]
        if cat["gap"][i] >= long_us and len(long) < 25:
            long.append({"gap_us": round(float(cat["gap"][i]), 1),
                         **{f"{k}_us": round(float(cat[k][i]), 1) for k in PARTS},
                         "overlapping": timeline.overlapping(cat["returned"][i] - 2e-3, cat["launched"][i])})
    return {"steps": int(len(cat["gap"])), "gap_us_p50": round(float(np.median(cat["gap"])), 1),
            "gap_us_mean": round(float(cat["gap"].mean()), 2), "excess_us_total": round(float(excess.sum()), 1),
            "excess_us_by_part": {k: round(v, 1) for k, v in by.items()},
            "part_medians_us": {k: round(v, 1) for k, v in medians.items()},
            "gaps_over_long": int((cat["gap"] >= long_us).sum()), "long": long}


def main(argv: list[str] | None = None) -> int:
    import cupy

    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    ap.add_argument("--variants", default="base,switch-100us")
    ap.add_argument("--long-us", type=float, default=200.0)
    ap.add_argument("--interleave", type=int, default=1, help="run the list of variants this many times per repeat")
    ap.add_argument("--raw", default=None, help="also save every gap's parts to this .npz")
    args = parse_probe_args(ap, argv)
    rows = Rows()
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    ds = GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True)
    time_pass(ds)  # the first pass after opening (mmap: while the files are locked) sizes nothing
    r = time_pass(ds, min_seconds=0.5)
    nb = len(ds)
    ms = step_ms(r, args.factor)
    spin = Spin(ms, 1)
    stepper = Stepper(spin, nb + 1)
    raw: dict[str, np.ndarray] = {}
    for rep in range(args.repeats):
        for _ in range(3):  # the steps alone, warmed: their gaps are the floor
            stepper.run(range(nb))
        alone = stepper.split(stepper.run(range(nb)))["gap"]
        floor = float(np.median(alone))
        for turn, variant in enumerate(args.variants.split(",") * args.interleave):
            timeline = Timeline()
            with timeline.patched(ds._backend, variant):
                ds.stop()
                parts, walls = [], []
                for k in range(1 + args.passes):
                    t0 = time.perf_counter()
                    n = stepper.run(ds)
                    walls.append(time.perf_counter() - t0)
                    if k:
                        parts.append(stepper.split(n))
            got = attribute(parts, floor, args.long_us, timeline)
            for key in PARTS + ("gap",):
                raw[f"{variant}-{rep}-{turn}-{key}"] = np.concatenate([p[key] for p in parts])
            rows.emit({"variant": variant, "repeat": rep, "turn": turn, "backend": args.backend,
                       "step_ms": round(ms, 3), "batches": nb, "alone_gap_us_p50": round(floor, 1),
                       "pass_s": [round(w, 4) for w in walls[1:]],
                       "timeline_calls": len(timeline.events), **got})
            cupy.cuda.get_current_stream().synchronize()
    ds.close()
    if args.raw:
        np.savez_compressed(args.raw, **raw)
    print("wrote", write_probe(args, "probe-gaps", rows, median_long=statistics.median(
        [r["gaps_over_long"] for r in rows]) if rows else None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
