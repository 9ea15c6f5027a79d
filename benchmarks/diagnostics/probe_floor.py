"""How close a training step that syncs every batch can come to running back to back, and what keeps the
pipeline from it: the GPU's own clock between consecutive steps, per variant.

    python -m benchmarks.diagnostics.probe_floor [--backend mmap] [--factor 1.5] [--passes 5] [--repeats 2]

On the suite's warm image dataset, a GPU step of ``--factor`` x a batch's read time (the suite's ``Spin``)
writes its start and end (the GPU's nanosecond timer) for every batch; the gap from one step's end to the
next one's start is the host's turn between them as the GPU sees it (the sync's wake-up, ``next()``, the
launch). Per variant, a pass from rest then ``--passes`` passes, each pass's waiting as the suite counts it
(wall time beyond the same steps alone) and the gaps of the later passes (p50, p90, p99, max, mean µs),
with the host's time in ``next()`` and in the step's launch:

- ``alone``: the steps with no data (the floor every other variant is compared with);
- ``list``: a pass's batches read beforehand into a Python list, each taken with one stream wait on a
  finished event (what ``next()`` cannot do with less);
- ``list-xstream``: the same, each batch's event recorded on another stream (as the assembler's are);
- ``list-busy``: ``list`` beside a thread shaped like the assembler (every 0.5 ms some Python work and a
  few launches on another stream): what another Python thread costs the consumer by itself;
- ``list-busy-py``: ``list`` beside a thread doing only Python (ten 15 µs pieces, the GIL given up between
  them, every 0.5 ms): the GIL alone;
- ``list-busy-native``: ``list`` beside a thread whose work is one native call queueing 16 small copies
  (the GIL given up for the whole call, every 0.5 ms): the driver's own locks alone;
- ``base``: the library as it is;
- ``base-holdgil``: the consumer's stream wait made through a ctypes call that keeps the GIL (a thread
  waiting for it cannot take it in the middle of ``next()``);
- ``switch-100us``: the same with ``sys.setswitchinterval(1e-4)`` (a thread waiting for the GIL asks its
  holder to drop it after 100 µs instead of 5 ms);
- ``gc-off``: the same with the garbage collector disabled;
- ``ahead-32``: ``batches_ahead=32`` (the assembler finishes far ahead and is idle more often);
- ``pause-100us``: the assembler, woken for room, sleeps 100 µs before it goes on (off the GIL while the
  consumer launches its step);
- ``pause-200us``: the same, 200 µs;
- ``gated``: ``pause-100us``, and the submitter starts each window's work 100 µs after the consumer's next
  hand-back (its Python inside the consumer's step, not across its turn);
- ``group-4``: room given back four batches at a time (``Handoff.GROUP = 4``);
- ``poll-room``: the consumer wakes nobody; the assembler polls for room every 100 µs;
- ``cupy-take``: gathers by CuPy's ``take`` (one thread per word, as many blocks as that takes) instead of
  the bounded-grid kernels of ``gdsload.gather_cuda``.

The variants are patched in for the run only; nothing in the library changes. GPU only. Writes
``results/<machine>/probe-floor[-TAG].json``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload import pipeline as pipeline_module
from gdsload.device import CudaOps, _as_words
from gdsload.handoff import Handoff, get
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from .probe_next import PollRoomHandoff
from ..common import (BATCH, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, step_ms, timed,
                      write_probe)

VARIANTS = ["alone", "list", "list-xstream", "list-busy", "list-busy-py", "list-busy-native", "base",
            "base-holdgil", "switch-100us", "gc-off", "ahead-32",
            "pause-100us", "pause-200us", "gated", "group-4", "poll-room", "cupy-take"]


class Stamped:
    """Steps that write their GPU start and end times, one slot pair per step."""

    def __init__(self, spin: Spin, capacity: int):
        import cupy

        self.spin, self.cupy = spin, cupy
        self.stamps = cupy.zeros(2 * capacity, dtype=cupy.uint64)
        self.base, self.n = int(self.stamps.data.ptr), 0

        self.launch_s: list[float] = []

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self.spin.launch(np.uint64(self.base + 16 * self.n))
        self.launch_s.append(time.perf_counter() - t0)
        self.n += 1
        self.spin.synchronize()

    def gaps_us(self) -> np.ndarray:
        """Each step's start minus the previous step's end, µs; the slots are then reused."""
        t = self.stamps[: 2 * self.n].get().reshape(-1, 2).astype(np.int64)
        self.n = 0
        return (t[1:, 0] - t[:-1, 1]) / 1e3


def passes(batches: Callable[[], Iterable[Any]], step: Stamped, n: int, per_pass_s: float) -> dict[str, Any]:
    """A pass from rest and ``n`` passes: each pass's waiting beyond ``per_pass_s`` of steps alone, and the
    gaps between steps of the later passes."""
    waits, gaps, nexts, launches = [], [], [], []
    t_prev = time.perf_counter()
    for k in range(1 + n):
        step.launch_s = []
        took: list[float] = []
        for _batch in timed(batches(), took):
            step()
        t = time.perf_counter()
        g = step.gaps_us()
        if k:
            gaps.append(g)
            nexts += took
            launches += step.launch_s
            waits.append(round(max(0.0, (t - t_prev) - per_pass_s) / (t - t_prev), 4))
        t_prev = t
    g = np.concatenate(gaps)
    return {"wait_fraction": round(float(np.median(waits)), 4), "wait_fraction_passes": waits,
            "gap_us": {"p50": round(float(np.median(g)), 1), "p90": round(float(np.percentile(g, 90)), 1),
                       "p99": round(float(np.percentile(g, 99)), 1), "max": round(float(g.max()), 1),
                       "mean": round(float(g.mean()), 2)},
            "host_next_us": _us(nexts), "host_launch_us": _us(launches)}


def time_alone(step: Stamped, n: int) -> float:
    """Seconds ``n`` steps take with no data (the floor a pass's waiting is counted from); their gaps dropped."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    step.spin.synchronize()
    alone_s = time.perf_counter() - t0
    step.gaps_us()
    return alone_s


def _us(seconds: list[float]) -> dict[str, float]:
    a = np.array(seconds) * 1e6
    return {"p50": round(float(np.median(a)), 1), "p90": round(float(np.percentile(a, 90)), 1),
            "mean": round(float(a.mean()), 2)}


class PauseHandoff(Handoff):
    """The hand-off whose producer, once woken for room, sleeps ``PAUSE_S`` before going on (off the GIL
    while the consumer launches its step)."""

    PAUSE_S = 100e-6

    def put(self, item: Any, stop: Any) -> bool:
        if self._free == 0:
            try:
                n = self._room.get_nowait()
            except queue.Empty:  # woken by a release: the consumer is about to launch its step
                n = get(self._room, stop)
                if n is None:
                    return False
                time.sleep(self.PAUSE_S)
            self._free = n
        return super().put(item, stop)


class Pause200Handoff(PauseHandoff):
    PAUSE_S = 200e-6


class GatedHandoff(PauseHandoff):
    """PauseHandoff that also counts the consumer's releases: the submitter (patched) starts a window's work
    only ``PAUSE_S`` after the next one, inside the consumer's step rather than across its turn."""

    turns = 0

    def release(self) -> None:
        GatedHandoff.turns += 1
        super().release()


def _gated_next_free(self: Any) -> Any:
    buf = _next_free(self)
    seen, give_up = GatedHandoff.turns, time.perf_counter() + 2e-3  # no turn comes while the consumer waits
    while GatedHandoff.turns == seen and time.perf_counter() < give_up:
        time.sleep(50e-6)
    if GatedHandoff.turns != seen:
        time.sleep(GatedHandoff.PAUSE_S)
    return buf


_next_free = pipeline_module.Pipeline._next_free


class Group4Handoff(Handoff):
    GROUP = 4


_wait_holding_gil: Any = None


def _hand_over_holding_gil(self: CudaOps, ready: Any) -> None:
    """CudaOps.hand_over with the stream wait through ``ctypes.PyDLL`` (the GIL kept across the call)."""
    global _wait_holding_gil
    if _wait_holding_gil is None:
        import ctypes

        _wait_holding_gil = ctypes.PyDLL("libcuda.so.1").cuStreamWaitEvent
        _wait_holding_gil.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    stream = self._current_stream()
    if stream.ptr != self.stream.ptr:
        self._switched(stream)
        self.stream = stream
    if ready is not None and _wait_holding_gil(stream.ptr, ready.ptr, 0) != 0:
        raise RuntimeError("cuStreamWaitEvent failed")


@contextlib.contextmanager
def patched(name: str) -> Iterator[None]:
    old_interval, was_enabled = sys.getswitchinterval(), gc.isenabled()
    handoffs = {"pause-100us": PauseHandoff, "pause-200us": Pause200Handoff, "gated": GatedHandoff,
                "group-4": Group4Handoff, "poll-room": PollRoomHandoff}
    pipeline_module.Handoff = handoffs.get(name, Handoff)  # type: ignore[misc]
    take = CudaOps.take
    if name == "cupy-take":
        CudaOps.take = lambda self, src, idx, out: self.cupy.take(  # type: ignore[method-assign]
            _as_words(src), idx, axis=0, out=_as_words(out))
    hand_over = CudaOps.hand_over
    if name == "gated":
        pipeline_module.Pipeline._next_free = _gated_next_free  # type: ignore[method-assign]
    if name == "base-holdgil":
        CudaOps.hand_over = _hand_over_holding_gil  # type: ignore[method-assign]
    if name == "switch-100us":
        sys.setswitchinterval(1e-4)
    if name == "gc-off":
        gc.disable()
    try:
        yield
    finally:
        pipeline_module.Handoff = Handoff  # type: ignore[misc]
        CudaOps.take = take  # type: ignore[method-assign]
        CudaOps.hand_over = hand_over  # type: ignore[method-assign]
        pipeline_module.Pipeline._next_free = _next_free  # type: ignore[method-assign]
        sys.setswitchinterval(old_interval)
        if was_enabled:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    import cupy

    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backend-options", type=json.loads, default=None, help="GDSDataset(backend_options=), JSON")
    args = parse_probe_args(ap, argv)
    rows = Rows()
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    opened: dict[int, GDSDataset] = {}

    def dataset(ahead: int | None) -> GDSDataset:
        key = ahead or 0
        if key not in opened:
            opened[key] = GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True, batches_ahead=ahead,
                                     backend_options=args.backend_options)
            time_pass(opened[key])
        return opened[key]

    ds = dataset(None)
    r = time_pass(ds, min_seconds=0.5)
    nb = len(ds)
    ms = step_ms(r, args.factor)
    step = Stamped(Spin(ms, 1), nb + 1)
    for _ in range(3 * nb):  # warm the step's launch path
        step.spin()
    ready = cupy.cuda.Event(disable_timing=True)
    ready.record()
    held = [dict(b) for b in ds]  # one pass, kept on the device for the list variant
    cupy.cuda.get_current_stream().synchronize()

    side = cupy.cuda.Stream(non_blocking=True)
    side_events = []
    for _ in held:  # one event per batch, recorded on another stream (as the assembler's "ready" events are)
        side_events.append(cupy.cuda.Event(disable_timing=True))
        side_events[-1].record(side)
    side.synchronize()

    def from_list(events: list[Any] | None = None) -> Iterator[Any]:
        stream = cupy.cuda.get_current_stream()
        for i, b in enumerate(held):
            stream.wait_event(ready if events is None else events[i])
            yield b

    def busy_py(stop: threading.Event) -> None:
        """Only Python: ten 15 µs pieces, the GIL given up between them, every 0.5 ms."""
        clock = time.perf_counter
        while not stop.is_set():
            for _ in range(10):
                end = clock() + 15e-6
                while clock() < end:
                    pass
                time.sleep(0)
            time.sleep(0.5e-3)

    def busy_native(stop: threading.Event) -> None:
        """One native call queueing 16 small copies (the GIL given up for all of it), every 0.5 ms."""
        from gdsload.copier import Copier

        host = cupy.cuda.alloc_pinned_memory(16 << 12)
        dev = cupy.empty(16 << 12, dtype=cupy.uint8)
        copier = Copier("cuda", dev.device.id, [side.ptr])
        dst = np.array([dev.data.ptr + (i << 12) for i in range(16)], np.uint64)
        src = np.array([host.ptr + (i << 12) for i in range(16)], np.uint64)
        sizes = np.full(16, 4096, np.int64)
        try:
            while not stop.is_set():
                copier.copy(dst, src, sizes, side.ptr)
                time.sleep(0.5e-3)
        finally:
            side.synchronize()
            copier.close()

    def busy(stop: threading.Event) -> None:
        """A thread shaped like the assembler: every 0.5 ms, Python work and a few launches on a side stream."""
        scratch = cupy.zeros(1 << 20, dtype=cupy.uint8)
        with side:
            while not stop.is_set():
                for _ in range(4):
                    scratch.fill(1)
                    cupy.cuda.Event(disable_timing=True).record(side)
                    sum(range(300))
                time.sleep(0.5e-3)

    for rep in range(args.repeats):
        alone_s = time_alone(step, nb)
        names = args.variants.split(",")
        for name in names if rep % 2 == 0 else names[::-1]:  # no variant always last (drift within a repeat)
            with patched(name):
                if name == "alone":
                    got = passes(lambda: range(nb), step, args.passes, alone_s)
                elif name == "list":
                    got = passes(from_list, step, args.passes, alone_s)
                elif name == "list-xstream":
                    got = passes(lambda: from_list(side_events), step, args.passes, alone_s)
                elif name.startswith("list-busy"):
                    stop = threading.Event()
                    target = {"list-busy": busy, "list-busy-py": busy_py, "list-busy-native": busy_native}[name]
                    t = threading.Thread(target=target, args=(stop,), daemon=True)
                    t.start()
                    try:
                        got = passes(from_list, step, args.passes, alone_s)
                    finally:
                        stop.set()
                        t.join()
                else:
                    d = dataset(32 if name == "ahead-32" else None)
                    d.stop()  # every variant starts from rest
                    got = passes(lambda: d, step, args.passes, alone_s)
            rows.emit({"variant": name, "repeat": rep, "backend": args.backend, "step_ms": round(ms, 3),
                       "batches": nb, "alone_s": round(alone_s, 4), **got})
            print(name, got, flush=True)
    for d in opened.values():
        d.close()
    print("wrote", write_probe(args, "probe-floor", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
