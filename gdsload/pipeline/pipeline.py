"""The read-ahead pipeline: three threads (submitter, completer, assembler) between the files and the consumer.

Every window buffer has one owner at a time, handed on with its events: ``released`` (its last gather done),
``filled`` (its data there) and the check's ``Verdict``; batches reach the consumer through a bounded hand-off
with their ``ready`` event. ``close()`` (from any thread but the pipeline's own) sets ``stop`` and ``halt``,
wakes every waiter, joins the threads, then waits for the device work the pipeline queued; a reader's error sets
``halt`` and reaches the consumer with its window. The protocol and why: docs/design.md, "Threads and events".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..backends.handoff import POLL_S, Handoff
from ..codecs.verify import Verdict
from ..cuda.ops import Ops
from ..errors import GDSLoadError, with_context
from .complete import complete, raise_failure, settle, take_ready
from .assembler import Assembler, BatchStep, EpochIndex, ResidentField
from .once import MadeOnce
from .position import Cursor
from .pacing import Pacer
from .plan import EpochPlan
from .reader import InFlight, Reader
from .stats import EpochStats
from .window import WindowBuffer

_END = object()
_CLOSED = "this iterator was closed (the dataset was closed or a new pass over it started)"


@dataclass
class _Failure:
    error: BaseException
    where: str = ""


class _Submitted(NamedTuple):
    """Submitter -> completer: a window whose reads are in flight."""

    pass_: _Pass
    window: int
    buffer: WindowBuffer
    inflight: InFlight


class _Filled(NamedTuple):
    """Completer -> assembler: a window whose data is there after ``event``, its check's ``verdict`` pending."""

    pass_index: int
    window: int
    buffer: WindowBuffer
    event: Any
    verdict: Verdict | None


class _Assembled(NamedTuple):
    """Assembler -> consumer: batch ``batch`` of pass ``pass_index``, written once ``ready`` has passed."""

    pass_index: int
    batch: int
    arrays: dict[str, Any]
    samples: int
    nbytes: int
    ready: Any


@dataclass
class _Pass:
    """One pass over an epoch's plan: what the three threads and the consumer share."""

    index: int  # 0 for the pass the pipeline was started for, then 1, 2, ... (the epochs after it)
    epoch: int
    plan: EpochPlan
    start_batch: int
    first_window: int
    stats: EpochStats
    epoch_index: EpochIndex  # the plan's index arrays, uploaded when the pass was made

    def describe(self, w: int) -> str:
        blocks = [int(b) for b in self.plan.windows[w]]
        return f"window {w} of epoch {self.epoch} (blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''})"


class Pipeline:
    """Runs passes from ``first`` (whose plan is ``plan``): reader threads ahead, batches assembled ahead,
    the consumer takes each pass with one call of :meth:`batches`.

    Given ``plans`` ((epoch, pace) -> plan, as :func:`gdsload.pipeline.plan.epoch_plan`), the pipeline follows on:
    once the consumer has begun a pass, it reads the next epoch from its start, and the threads run until
    :meth:`close`; without it, there is one pass.
    """

    def __init__(self, reader: Reader, ops: Ops, buffers: Sequence[WindowBuffer], first: Cursor, plan: EpochPlan,
                 output_fields: Sequence[str], resident: dict[str, ResidentField] | None = None,
                 pad: dict[str, tuple[int | None, Any]] | None = None, ahead: int = 2, step: BatchStep | None = None,
                 plans: Callable[[int, Pacer | None], EpochPlan] | None = None, bytes_before: int = 0):
        self.reader, self.ops, self.layout, self.wl = reader, ops, reader.layout, reader.window_map
        # A copy of the resident fields: the dataset empties its own on close.
        self.assembler = Assembler(ops, self.wl, self.layout.offsets, output_fields, dict(resident or {}),
                                   pad or {}, step=step)
        self.buffers = list(buffers)
        self._first, self._plan0, self._plans = first, plan, plans
        self.follow = plans is not None
        self._stop = threading.Event()  # set by close(): everything stops
        self._halt = threading.Event()  # set by close() or a reader error: reading stops
        self._free: queue.Queue[WindowBuffer] = queue.Queue()
        self._inflight: queue.Queue[Any] = queue.Queue()
        self._ready: queue.Queue[Any] = queue.Queue()
        self._assembled = Handoff(max(1, ahead))
        # Set once the first batch is assembled, or once it needs a window the open did not read: until then
        # no other window is submitted, so that batch's work shares no core, lock or driver call with reads.
        self._first_out = threading.Event()
        for b in self.buffers:
            self._free.put(b)
        self._passes: MadeOnce[_Pass] = MadeOnce()
        self._begun = threading.Condition()
        self._begun_pass = 0  # the last pass the consumer began (the first counts as begun: it was asked for)
        self._consumer_pass = 0  # the pass the consumer is in, or takes next
        self._taken = False  # a pass is being taken (batches() called, its end not reached)
        self._threads = [threading.Thread(target=self._submit_loop, name="gdsload-reader-submit", daemon=True),
                         threading.Thread(target=self._complete_loop, name="gdsload-reader-complete", daemon=True),
                         threading.Thread(target=self._assemble_loop, name="gdsload-reader-assemble", daemon=True)]
        self._closed = False
        ops.begin()  # the consumer's stream as the pass starts (the assembler orders its writes after it)
        # Bytes read for the first pass before it started (resident fields): counted before the completer
        # thread adds to the same figure.
        self._pass(0).stats.bytes_read = bytes_before
        if self.follow or self._pass(0).first_window < len(plan.windows):
            for t in self._threads:
                t.start()

    def _pass(self, k: int) -> _Pass:
        """Pass ``k``, its plan made by whichever thread asks first (the readers, ahead of the consumer).
        On a pipeline thread that work is paced (gdsload.pipeline.pacing): it runs while the consumer's steps do.
        Only askers for pass ``k`` wait while it is made: the consumer and the assembler, asking for the pass
        they are in, never wait for the readers making the next one."""
        # Only passes the consumer is done with are dropped: every other thread may still ask for the others,
        # and must get the same object (its stats are shared).
        return self._passes.get(k, lambda: self._make_pass(k), keep=lambda j: j >= self._consumer_pass)

    def _make_pass(self, k: int) -> _Pass:
        pace = Pacer() if threading.current_thread() in self._threads else None
        epoch, start = (self._first.epoch, self._first.batch) if k == 0 else (self._first.epoch + k, 0)
        plan = self._plan0 if k == 0 else self._plans(epoch, pace)  # type: ignore[misc]
        first = plan.first_window(start)
        # The index arrays go up now, before any read of this pass is submitted (Assembler.index).
        return _Pass(k, epoch, plan, start, first, EpochStats(io_mode=self.reader.io_mode),
                     self.assembler.index(plan, pace))

    @property
    def closed(self) -> bool:
        return self._closed

    def upcoming(self) -> Cursor | None:
        """Where the pass a :meth:`batches` call would take now starts, if the pipeline read it ahead (None
        when it did not and cannot: closed, not following on, or a pass still being taken)."""
        k = self._consumer_pass
        if self._closed or self._taken or k == 0 or not self._may_follow(k):
            return None
        p = self._pass(k)
        return Cursor(p.epoch, p.start_batch)

    def _may_follow(self, k: int) -> bool:
        """Whether the pipeline can go on into pass ``k``: it follows on, and the window buffers can hold
        that epoch's widest batch (else the dataset starts a new pipeline with more)."""
        return k == 0 or (self.follow and self._pass(k).plan.max_windows_per_batch() <= len(self.buffers))

    @property
    def stats(self) -> EpochStats:
        """The statistics of the pass the consumer is in, or takes next."""
        return self._pass(self._consumer_pass).stats

    # -- reader threads ------------------------------------------------------------------------------
    def _next_free(self) -> WindowBuffer | None:
        """A free window buffer, or None once reading stops (close() also queues a None to wake this)."""
        while not self._halt.is_set():
            try:
                return self._free.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def _may_read(self, k: int) -> bool:
        """Wait until pass ``k`` may be read: the consumer has begun the pass before it (reading stays at most
        one pass ahead), and the window buffers can hold its widest batch. False once reading stops, or
        when the pipeline cannot go on into pass ``k``."""
        if k == 0:
            return True
        with self._begun:
            while self._begun_pass < k - 1:
                if self._halt.is_set():
                    return False
                self._begun.wait(POLL_S)
        return not self._halt.is_set() and self._may_follow(k)  # pass k's plan is made only now

    def _submit_loop(self) -> None:
        k, p, w = 0, None, -1
        pace, opened = Pacer(), False
        try:
            while self._may_read(k):
                p, w = self._pass(k), -1
                self.reader.expect(p.plan.windows[p.first_window:])  # e.g. a remote dataset's shards: fetched ahead
                for w in range(p.first_window, len(p.plan.windows)):
                    if w > p.first_window and opened and not self._wait_first_out():
                        return
                    buf = self._next_free()
                    if buf is None:
                        return
                    self.ops.synchronize(buf.released)  # the last gather from it is done
                    pace.start()
                    inflight = self.reader.submit(buf, p.plan.windows[w], self._halt, pace)
                    opened = k == 0 and inflight.opened
                    self._inflight.put(_Submitted(p, w, buf, inflight))
                k, p = k + 1, None
        except BaseException as e:
            where = p.describe(w) if p is not None and w >= 0 else f"epoch {self._first.epoch + k}"
            self._inflight.put(_Failure(e, where))
        finally:
            self._inflight.put(_END)

    def _wait_first_out(self) -> bool:
        """Wait until the first batch is out, or needs more than the window read in the open; False once
        reading stops."""
        while not self._first_out.wait(POLL_S):
            if self._halt.is_set():
                return False
        return True

    def _complete_loop(self) -> None:
        """Finish submitted windows in order, draining after an error or a stop (gdsload.pipeline.complete)."""
        def filled(item: _Submitted, done: Any) -> _Filled:
            item.pass_.stats.bytes_read += item.inflight.read_bytes
            return _Filled(item.pass_.index, item.window, item.buffer, done.event, done.verdict)
        complete(self._inflight, self._ready, self._halt, _END, _Failure,
                 lambda item, e: _Failure(e, item.pass_.describe(item.window)), filled)

    # -- assembler thread ----------------------------------------------------------------------------
    def _take_ready(self) -> _Filled | None:
        """The next filled window, or None once the pipeline stops."""
        return take_ready(self._ready, self._stop, _END, _Failure, "reader",
                          lambda item: raise_failure(item.error, self.layout.meta.path, item.where))

    def _assemble_loop(self) -> None:
        """Assemble pass after pass, ``ahead`` batches before the consumer; a reader's error (or this
        thread's own) is handed on for the consumer."""
        held: dict[tuple[int, int], WindowBuffer] = {}
        # Checks still running (device verifier) of the windows taken: each is confirmed before the next
        # batch is handed on and before its window buffer is released.
        verdicts: dict[tuple[int, int], Verdict] = {}
        stopped = self._stop.is_set

        def confirm(key: tuple[int, int]) -> None:
            verdict = verdicts.pop(key, None)
            if verdict is None:
                return
            try:
                verdict.confirm()
            except GDSLoadError as e:
                raise with_context(e, f"reading {self._pass(key[0]).describe(key[1])}") from e
        first = True
        try:
            k = 0
            while k == 0 or self._may_read(k):
                p = self._pass(k)

                def window(w: int, k: int = k) -> dict[str, Any] | None:
                    while (k, w) not in held:  # windows arrive in order: take them until this one is in
                        if held or k or w != p.first_window:
                            self._first_out.set()  # the batch needs a window the open did not read
                        got = self._take_ready()
                        if got is None:
                            return None
                        self.ops.wait(got.event)
                        held[(got.pass_index, got.window)] = got.buffer
                        if got.verdict is not None and not got.verdict.confirmed:
                            verdicts[(got.pass_index, got.window)] = got.verdict
                    return held[(k, w)].views(self.wl)

                def release(w: int, k: int = k) -> None:
                    confirm((k, w))  # the check's reads of the buffer are over before it is reused
                    buf = held.pop((k, w))
                    buf.released = self.ops.record()
                    self._free.put(buf)

                for i, batch, samples in self.assembler.batches(p.epoch_index, p.start_batch, window, release,
                                                                stopped):
                    nbytes = sum(a.nbytes for a in batch.values())
                    for key in list(verdicts):
                        confirm(key)
                    if not self._assembled.put(_Assembled(k, i, batch, samples, nbytes, self.ops.record()), self._stop):
                        return
                    if first:  # what the backend kept back (mmap's bulk load) no longer competes with it
                        self._first_out.set()
                        self.reader.started()
                        first = False
                self._first_out.set()  # a pass that gave no batch holds nothing back either
                k += 1
        except BaseException as e:
            self._halt.set()
            self._assembled.put(_Failure(e), self._stop)

    # -- consumer ------------------------------------------------------------------------------------
    def _wait_assembled(self, stats: EpochStats) -> Any:
        """The next assembled batch when none was ready: the wait is the consumer's stall."""
        t0 = time.perf_counter()
        item = self._assembled.get(self._stop)
        waited = time.perf_counter() - t0
        stats.stall_s += waited
        if stats.batches == 0:
            stats.first_batch_s += waited
        return item

    def batches(self) -> Iterator[dict[str, Any]]:
        """Take the next pass: its batches as dicts of fresh arrays, ready on the consumer's current stream.
        Leaving a pass early (or an error) stops the background threads; a pass run to its end leaves them
        reading the next one when the pipeline follows on."""
        if self._taken:
            raise GDSLoadError("internal error: a pass of this pipeline is already being taken")
        self._taken = True
        k = self._consumer_pass
        with self._begun:
            self._begun_pass = k
            self._begun.notify_all()  # pass k + 1 may be read now
        return self._yield_pass(self._pass(k))

    def _yield_pass(self, p: _Pass) -> Iterator[dict[str, Any]]:
        # Each turn of this loop lies between two of the consumer's training steps: a batch already
        # assembled is taken without a clock or a blocking call, and the calls are looked up once.
        k, stats = p.index, p.stats
        take, release = self._assembled.take_ready, self._assembled.release
        hand_over, export, clock = self.ops.hand_over, self.ops.export, time.perf_counter
        started = clock()
        done = False
        try:
            for i in range(p.start_batch, p.plan.num_batches):
                if self._closed:
                    raise GDSLoadError(_CLOSED)
                try:
                    item = take()
                except queue.Empty:
                    item = self._wait_assembled(stats)
                if item is None or self._closed:  # close() drops queued batches: what comes after is not due
                    raise GDSLoadError(_CLOSED)
                if isinstance(item, _Failure):
                    raise item.error
                if item.batch != i or item.pass_index != k:
                    raise GDSLoadError(f"internal error: batch {item.batch} of pass {item.pass_index} assembled "
                                       f"where {i} of pass {k} was due")
                hand_over(item.ready)
                batch = export(item.arrays)
                stats.batches += 1
                stats.samples += item.samples
                stats.bytes_delivered += item.nbytes
                stats.wall_s = clock() - started
                release()  # last: the assembler wakes as the consumer's step starts
                yield batch
            done = True
            self._consumer_pass, self._taken = k + 1, False
        finally:
            stats.wall_s = clock() - started
            if not (done and self.follow):
                self.close()

    def close(self) -> None:
        """Stop the threads and wait for them; idempotent, safe from any thread but the pipeline's own."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._halt.set()
        # Wake every thread now rather than at its next poll: reading ahead, they wait in all these places.
        self._free.put(None)  # type: ignore[arg-type]  # the submitter, for a window buffer
        self._ready.put(None)  # the assembler, for a window
        with self._begun:
            self._begun.notify_all()  # either, for the consumer to begin a pass
        self._assembled.clear()  # the assembler, to hand a batch to a full queue
        settle(self._threads, self.ops, [self.reader], self.buffers)
