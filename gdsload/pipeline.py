"""The double-buffered iterator: reader threads fill window buffers while the consumer gathers batches.

A window buffer has one owner at a time. The submitter takes a free buffer, waits on the event recorded
after the consumer's last gather from it, and submits the window's reads; the completer waits for those
reads in order and hands the buffer to the consumer through the ``ready`` queue with the event that says
its data has landed; the consumer's stream waits on that event before its first gather, and gives the
buffer back through the ``free`` queue after its last. Because submission runs ahead of completion, the
next window's reads queue behind the current one's and the readers never idle at a window boundary.

Batches are assembled ahead, too: the assembler thread gathers the next ``ahead`` batches into fresh arrays
on a stream of its own while the consumer trains on the current one, so the consumer's ``next()`` only
takes a finished batch and makes its stream wait on the batch's "ready" event. (Gathering in ``next()``
cost 0.2 ms of the consumer's time per batch on the H100, in series with every training step.) Before it
writes a batch, the assembler's stream waits on an event recorded on the consumer's stream, so memory the
consumer freed is never overwritten while the consumer's queued work may still read it.

And epochs are read ahead: when a pass has begun, the threads go on into the next epoch's plan once this
one's reads are submitted, so a new pass does not start by waiting for its first window (5-44 ms per pass
on the H100, in the probe-step timelines).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import Backend, FillRequest, ReadRequest, Request
from .errors import GDSLoadError, ReadError
from .format import DatasetLayout, FieldMeta, RaggedMeta
from .plan import EpochPlan
from .ragged import block_value_rows, epoch_value_index, gather
from .ragged import pad as pad_values
from .verify import Checks, concat

ALIGN = 4096
_POLL_S = 0.05


@dataclass
class WindowSlot:
    """One window buffer and the event after which its previous contents are no longer read."""

    buffer: Any
    released: Any = None
    _views: dict[str, Any] | None = None

    def views(self, layout: WindowLayout) -> dict[str, Any]:
        """Each field's (rows, *sample_shape) view of the buffer, made once."""
        if self._views is None:
            self._views = {name: layout.view(self.buffer, name) for name in layout.rows}
        return self._views


class WindowLayout:
    """Where each field's data lies inside a window buffer: per fixed field, W blocks back to back; per
    variable-length field, the values of those blocks back to back, in a region sized for the largest W
    blocks of the dataset."""

    def __init__(self, fields: Sequence[FieldMeta], window_blocks: int,
                 ragged: dict[str, tuple[RaggedMeta, int]] | None = None):
        self.fields = {f.name: f for f in fields}
        self.ragged = {name: r for name, (r, _) in (ragged or {}).items()}
        self.window_blocks = window_blocks
        self.rows: dict[str, int] = {f.name: f.samples_per_block * window_blocks for f in fields}
        self.rows.update({name: rows for name, (_, rows) in (ragged or {}).items()})
        self.offsets: dict[str, int] = {}
        pos = 0
        for name in self.rows:
            self.offsets[name] = pos
            pos += -(-(self.row_meta(name).sample_bytes * self.rows[name]) // ALIGN) * ALIGN
        self.nbytes = pos

    def row_meta(self, name: str) -> FieldMeta:
        return self.ragged[name].values if name in self.ragged else self.fields[name]

    def requests(self, layout: DatasetLayout, blocks: np.ndarray) -> list[Request]:
        """What carries ``blocks`` into this layout: one read per run of consecutive bytes of a file, one
        fill per block never written."""
        reqs: list[Request] = []
        for name, f in self.fields.items():
            base = self.offsets[name]
            for path, offset, nbytes, first in layout.block_runs(name, blocks):
                dest = base + first * f.block_bytes
                if path is None:
                    reqs.append(FillRequest(dest, nbytes, f.fill_bytes()))
                else:
                    reqs.append(ReadRequest(path, offset, nbytes, dest))
        for name, r in self.ragged.items():
            base, vf = self.offsets[name], r.values
            offsets = layout.offsets[name]
            first, end = block_value_rows(offsets, np.asarray(blocks), layout.meta.samples_per_block)
            dest_row = 0
            for a, b in zip(first.tolist(), end.tolist()):
                for piece in layout.locate_rows(f"{name}/values", a, b):
                    dest = base + (dest_row + piece.row_start - a) * vf.sample_bytes
                    nbytes = (piece.row_stop - piece.row_start) * vf.sample_bytes
                    if piece.location is None:
                        reqs.append(FillRequest(dest, nbytes, vf.fill_bytes()))
                    else:
                        reqs.append(ReadRequest(piece.location.path, piece.location.offset, nbytes, dest))
                dest_row += b - a
        return reqs

    def checks(self, layout: DatasetLayout, blocks: np.ndarray) -> Checks:
        """Where each block of ``blocks`` lands in this layout, with the crc32c stored for it: one segment
        per block and field (a variable-length field's block is its samples' values)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        parts = []
        for name, f in self.fields.items():
            lo = self.offsets[name] + np.arange(len(blocks), dtype=np.int64) * f.block_bytes
            parts.append(Checks(lo, lo + f.block_bytes, layout.checksums[name][blocks], (name,) * len(blocks),
                                blocks))
        for name, r in self.ragged.items():
            first, end = block_value_rows(layout.offsets[name], blocks, layout.meta.samples_per_block)
            sizes = (end - first) * r.values.sample_bytes
            lo = self.offsets[name] + np.cumsum(sizes) - sizes
            parts.append(Checks(lo, lo + sizes, layout.checksums[name][blocks], (f"{name}/values",) * len(blocks),
                                blocks))
        return concat(parts)

    def view(self, buffer: Any, name: str) -> Any:
        f = self.row_meta(name)
        off = self.offsets[name]
        raw = buffer[off:off + f.sample_bytes * self.rows[name]]
        return raw.view(f.dtype).reshape(self.rows[name], *f.sample_shape)


@dataclass
class EpochStats:
    """What one pass over the data cost: bytes read, wall time, and time the consumer waited for data."""

    io_mode: str
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    first_batch_s: float = 0.0  # part of stall_s: waiting for the first window of the pass

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"io_mode": self.io_mode, "batches": self.batches, "samples": self.samples,
                "bytes_read": self.bytes_read, "wall_s": self.wall_s, "stall_s": self.stall_s,
                "first_batch_s": self.first_batch_s,
                "gb_per_s": self.gb_per_s}


@dataclass
class ResidentField:
    """A small field read once and kept whole: gathered by global sample index."""

    meta: FieldMeta
    array: Any  # (num_blocks * samples_per_block, *sample_shape)


class _Handoff:
    """Assembled batches, from the assembler to the consumer, at most ``capacity`` waiting.

    Unlike ``queue.Queue``, taking a batch wakes nobody: the consumer gives its room back with
    :meth:`release` once its own calls for the batch are made. The assembler, woken there, then does the
    next batch's Python work while the consumer's step runs, not between the consumer's wake-up from its
    previous step and its next launch. (Woken by the take itself, the assembler's work overlapped that
    turnaround in 1-24 % of the steps, against under 1 % now: H100, all fields resident,
    ``benchmarks/probe_overhead.py``.) Items and room tokens go through C-level ``SimpleQueue``s: this is
    on the consumer's path for every batch.
    """

    def __init__(self, capacity: int):
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[bool] = queue.SimpleQueue()  # one token per free place
        for _ in range(capacity):
            self._room.put(True)

    def __len__(self) -> int:
        return self._items.qsize()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Queue ``item`` once there is room; False once ``stop`` is set first."""
        if _get(self._room, stop) is None:
            return False
        self._items.put(item)
        return True

    def get(self, stop: threading.Event) -> Any:
        """The next item (items queued before a stop are still taken), or None once ``stop`` is set and
        none is left. The caller owes a :meth:`release`."""
        return _get(self._items, stop)

    def release(self) -> None:
        """Room for one more item: wakes the producer if it waits."""
        self._room.put(True)

    def clear(self) -> None:
        """Drop what is queued and make room for the producer (stopping)."""
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                break
            self._room.put(True)
        self._room.put(True)


_END = object()
_CLOSED = "this iterator was closed (the dataset was closed or a new pass over it started)"


@dataclass
class _Failure:
    error: BaseException
    where: str = ""


@dataclass
class _Pass:
    """One pass over an epoch's plan, from ``start_batch``: what the three threads and the consumer share."""

    index: int  # 0 for the pass the pipeline was started for, then 1, 2, ... (the epochs after it)
    epoch: int
    plan: EpochPlan
    start_batch: int
    first_window: int
    last_batch: np.ndarray  # per window: the last batch that draws from it
    stats: EpochStats

    def describe(self, w: int) -> str:
        blocks = [int(b) for b in self.plan.windows[w]]
        return f"window {w} of epoch {self.epoch} (blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''})"


class Pipeline:
    """Runs epoch plans: reader threads ahead, batches assembled ahead, the consumer takes one per ``next()``.

    A pipeline starts at ``start_batch`` of ``epoch`` (whose plan is ``plan``). Given ``plans`` (epoch ->
    plan), once the consumer has begun a pass the readers go on into the plan of the next pass (epoch
    ``epoch + epoch_step``: the next one, or the same again with a step of 0), so the next
    pass starts with its first windows read and its first batches assembled instead of waiting for them;
    the consumer takes each pass with one call of :meth:`batches`, and the threads run until :meth:`close`.
    Reading stays at most one pass ahead of the consumer, bounded as within a pass by the window buffers.
    """

    def __init__(self, backend: Backend, ops: Any, layout: DatasetLayout, window_layout: WindowLayout,
                 slots: Sequence[WindowSlot], plan: EpochPlan, epoch: int, start_batch: int,
                 output_fields: Sequence[str], resident: dict[str, ResidentField] | None = None,
                 pad: dict[str, tuple[int | None, Any]] | None = None, ahead: int = 2,
                 plans: Callable[[int], EpochPlan] | None = None, epoch_step: int = 1, bytes_before: int = 0,
                 verifier: Any = None):
        self.backend, self.ops, self.layout, self.wl = backend, ops, layout, window_layout
        self.output_fields = tuple(output_fields)
        self._plans = plans  # epoch -> plan, for the passes after the first; None: one pass only
        self._epoch_step = epoch_step  # pass k reads epoch + k * epoch_step
        self.verifier = verifier  # checks each window against its stored crc32c before it is handed on
        self.resident = dict(resident or {})  # a copy: the dataset empties its own on close
        self.pad = pad or {}  # variable-length field -> (width, or None for the batch's longest; value)
        self.slots = list(slots)
        self.follow = plans is not None
        self._stop = threading.Event()  # set by close(): everything stops
        self._halt = threading.Event()  # set by close() or a reader error: reading stops
        self._free: queue.Queue[WindowSlot] = queue.Queue()
        self._inflight: queue.Queue[Any] = queue.Queue()
        self._ready: queue.Queue[Any] = queue.Queue()
        self._assembled = _Handoff(max(1, ahead))
        for s in self.slots:
            self._free.put(s)
        self._passes: dict[int, _Pass] = {}
        self._passes_lock = threading.Lock()
        self._epoch0, self._start0, self._plan0 = epoch, start_batch, plan
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
        """Pass ``k``, its plan made by whichever thread asks first (the readers, ahead of the consumer)."""
        with self._passes_lock:
            p = self._passes.get(k)
            if p is None:
                epoch, start = (self._epoch0, self._start0) if k == 0 else (self._epoch0 + k * self._epoch_step, 0)
                plan = self._plan0 if k == 0 else self._plans(epoch)  # type: ignore[misc]
                running = start < plan.num_batches
                first = int(plan.window_of[plan.batch_bounds(start)[0]]) if running else len(plan.windows)
                p = _Pass(k, epoch, plan, start, first, plan.last_batch_of_window(),
                          EpochStats(io_mode=self.backend.io_mode))
                # Only passes the consumer is done with are dropped: every other thread may still ask for
                # the others, and must get the same object (its stats are shared).
                self._passes = {j: q for j, q in self._passes.items() if j >= self._consumer_pass}
                self._passes[k] = p
            return p

    @property
    def closed(self) -> bool:
        return self._closed

    def continues_with(self, epoch: int, start_batch: int, any_epoch: bool = False) -> bool:
        """Whether the next :meth:`batches` call yields the pass a consumer now asks for: from batch
        ``start_batch`` of ``epoch`` (of any epoch with ``any_epoch``: every epoch has the same order)."""
        if self._closed or self._taken or self._consumer_pass == 0 or not self._may_follow(self._consumer_pass):
            return False
        p = self._pass(self._consumer_pass)
        return p.start_batch == start_batch and (any_epoch or p.epoch == epoch)

    def _may_follow(self, k: int) -> bool:
        """Whether the pipeline can go on into pass ``k``: it follows on, and the window buffers can hold
        that epoch's widest batch (else the dataset starts a new pipeline with more)."""
        return k == 0 or (self.follow and self._pass(k).plan.max_windows_per_batch() <= len(self.slots))

    @property
    def stats(self) -> EpochStats:
        """The statistics of the pass the consumer is in, or takes next."""
        return self._pass(self._consumer_pass).stats

    # -- reader threads ------------------------------------------------------------------------------
    def _next_free(self) -> WindowSlot | None:
        """A free window buffer, or None once reading stops (close() also queues a None to wake this)."""
        while not self._halt.is_set():
            try:
                return self._free.get(timeout=_POLL_S)
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
                self._begun.wait(_POLL_S)
        return not self._halt.is_set() and self._may_follow(k)  # pass k's plan is made only now

    def _submit_loop(self) -> None:
        k, p, w = 0, None, -1
        try:
            while self._may_read(k):
                p, w = self._pass(k), -1
                for w in range(p.first_window, len(p.plan.windows)):
                    slot = self._next_free()
                    if slot is None:
                        return
                    self.ops.synchronize(slot.released)  # the consumer's last gather from it is done
                    blocks = p.plan.windows[w]
                    reqs = self.wl.requests(self.layout, blocks)
                    nbytes = sum(r.nbytes for r in reqs if isinstance(r, ReadRequest))
                    checks = self.wl.checks(self.layout, blocks) if self.verifier is not None else None
                    self._inflight.put((p, w, slot, nbytes, checks,
                                        self.backend.submit(slot.buffer, reqs, self._halt)))
                k, p = k + 1, None
        except BaseException as e:
            where = p.describe(w) if p is not None and w >= 0 else f"epoch {self._epoch0 + k * self._epoch_step}"
            self._inflight.put(_Failure(e, where))
        finally:
            self._inflight.put(_END)

    def _complete_loop(self) -> None:
        """Wait for submitted windows in order; after an error or a stop, keep draining until the
        submitter is done, so no read still writes into a buffer once this thread has ended."""
        while True:
            item = self._inflight.get()
            if item is _END:
                if not self._halt.is_set():
                    self._ready.put(_END)
                return
            if isinstance(item, _Failure):
                self._halt.set()
                self._ready.put(item)
                continue
            p, w, slot, nbytes, checks, pending = item
            try:
                filled = pending.wait()
                if checks is not None and not self._halt.is_set():
                    filled = self.verifier.check(slot.buffer, checks, filled)
            except BaseException as e:
                if not self._halt.is_set():
                    self._halt.set()
                    self._ready.put(_Failure(e, p.describe(w)))
                continue
            if not self._halt.is_set():
                p.stats.bytes_read += nbytes
                self._ready.put((p.index, w, slot, filled))

    # -- assembler -----------------------------------------------------------------------------------
    def _take_ready(self) -> tuple[int, int, WindowSlot, Any] | None:
        """The next filled window, or None once the pipeline stops."""
        item = _get(self._ready, self._stop)
        if item is None:
            return None
        if item is _END:
            raise ReadError("internal error: the reader finished before the plan did")
        if isinstance(item, _Failure):
            e = item.error
            if isinstance(e, GDSLoadError):  # its message starts with the file it is about
                raise type(e)(f"{e} (reading {item.where})") from e
            raise ReadError(f"{self.layout.meta.path}: reading {item.where} failed ({type(e).__name__}: {e})") from e
        return item

    def _hand(self, item: Any) -> bool:
        """Queue an assembled batch (or an error) for the consumer; False once the pipeline stops."""
        return self._assembled.put(item, self._stop)

    def _assemble_loop(self) -> None:
        """Gather each batch into fresh arrays on the assembler's stream, ``ahead`` batches before the
        consumer, pass after pass; a reader's error (or this thread's own) is handed on for the consumer."""
        held: dict[tuple[int, int], WindowSlot] = {}
        try:
            k = 0
            while k == 0 or self._may_read(k):
                for i, batch, samples in self._assemble(self._pass(k), held):
                    if not self._hand((k, i, batch, samples, self.ops.record())):
                        return
                k += 1
        except BaseException as e:
            self._halt.set()
            self._hand(_Failure(e))

    def _assemble(self, p: _Pass, held: dict[tuple[int, int], WindowSlot]) -> Iterator[tuple[int, dict[str, Any], int]]:
        plan, ops, wl, k = p.plan, self.ops, self.wl, p.index
        table = plan.segment_table()
        slots_dev = None  # the epoch's slot array on the device, uploaded once
        ids_dev = None  # the epoch's global sample ids, for resident fields
        ragged = [n for n in self.output_fields if n in wl.ragged]
        windowed = [n for n in self.output_fields if n not in self.resident and n not in wl.ragged]
        shapes = {n: (self.resident[n].meta if n in self.resident else wl.fields[n]) for n in self.output_fields
                  if n not in wl.ragged}
        value_index = {n: epoch_value_index(plan, self.layout.offsets[n]) for n in ragged}  # host: sizes
        value_index_dev: dict[str, tuple[Any, Any]] = {}
        for i in range(p.start_batch, plan.num_batches):
            if self._stop.is_set():
                return
            rows = table[i]
            for w, _, _, _ in rows:
                while (k, w) not in held:
                    got = self._take_ready()
                    if got is None:
                        return
                    k_got, w_got, slot, filled = got
                    ops.wait(filled)
                    held[(k_got, w_got)] = slot
            views = {w: held[(k, w)].views(wl) for w, _, _, _ in rows}
            lo, hi = rows[0][1], rows[-1][2]
            with ops.scope():
                # Every array the consumer gets is allocated first, then the fence: memory it freed is
                # rewritten only after the work it had queued (see CudaOps).
                out = {n: ops.empty((hi - lo, *f.sample_shape), f.dtype) for n, f in shapes.items()}
                for name in ragged:
                    self._ragged_outputs(name, lo, hi, value_index[name][1], out)
                ops.fence()
                if self.resident:
                    if ids_dev is None:
                        ids_dev = ops.index_array(_compact(plan.sample_ids()))
                    for name, r in self.resident.items():
                        if name in out:
                            ops.take(r.array, ids_dev[lo:hi], out[name])
                for w, start, stop, first in rows:
                    part = slice(start - lo, stop - lo)
                    if first >= 0:
                        for name in windowed:
                            ops.copy_rows(views[w][name], first, out[name][part])
                    else:
                        if slots_dev is None:
                            slots_dev = ops.index_array(_compact(plan.slots))
                        for name in windowed:
                            ops.take(views[w][name], slots_dev[start:stop], out[name][part])
                for name in ragged:
                    if name not in value_index_dev:
                        value_index_dev[name] = tuple(ops.index_array(a) for a in value_index[name])
                    self._gather_ragged(name, rows, views, value_index[name][1], value_index_dev[name], out)
                for w, _, _, _ in rows:
                    if p.last_batch[w] == i:
                        slot = held.pop((k, w))
                        slot.released = ops.record()
                        self._free.put(slot)
            yield i, out, hi - lo

    # -- consumer ------------------------------------------------------------------------------------
    def _take_assembled(self, stats: EpochStats) -> tuple[int, int, dict[str, Any], int, Any]:
        t0 = time.perf_counter()
        item = self._assembled.get(self._stop)
        if item is None or self._closed:  # close() drops queued batches: what comes after is not due
            raise GDSLoadError(_CLOSED)
        waited = time.perf_counter() - t0
        stats.stall_s += waited
        if stats.batches == 0:
            stats.first_batch_s += waited
        if isinstance(item, _Failure):
            raise item.error
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
        ops, k, stats = self.ops, p.index, p.stats
        started = time.perf_counter()
        done = False
        try:
            for i in range(p.start_batch, p.plan.num_batches):
                if self._closed:
                    raise GDSLoadError(_CLOSED)
                ops.begin()
                got_k, got, out, samples, ready = self._take_assembled(stats)
                if (got_k, got) != (k, i):
                    raise GDSLoadError(f"internal error: batch {got} of pass {got_k} assembled where {i} of pass "
                                       f"{k} was due")
                ops.hand_over(ready)
                batch = {name: ops.export(a) for name, a in out.items()}
                stats.batches += 1
                stats.samples += samples
                stats.wall_s = time.perf_counter() - started
                self._assembled.release()  # last: the assembler wakes as the consumer's step starts
                yield batch
            done = True
            self._consumer_pass, self._taken = k + 1, False
        finally:
            stats.wall_s = time.perf_counter() - started
            if not (done and self.follow):
                self.close()

    def _ragged_outputs(self, name: str, lo: int, hi: int, lengths_host: np.ndarray, out: dict[str, Any]) -> None:
        """Allocate a variable-length field's outputs: values back to back plus (B + 1) offsets, or
        (B, width, ...) padded values plus (B,) lengths."""
        ops, f = self.ops, self.wl.ragged[name].values
        lengths = lengths_host[lo:hi]
        if name in self.pad:
            width, _ = self.pad[name]
            width = int(lengths.max(initial=0)) if width is None else width
            out[name] = ops.empty((hi - lo, width, *f.sample_shape), f.dtype)
            out[f"{name}/lengths"] = ops.empty((hi - lo,), np.dtype(np.int64))
        else:
            out[name] = ops.empty((int(lengths.sum()), *f.sample_shape), f.dtype)
            out[f"{name}/offsets"] = ops.empty((hi - lo + 1,), np.dtype(np.int64))

    def _gather_ragged(self, name: str, rows: list[tuple[int, int, int, int]], views: dict[int, dict[str, Any]],
                       lengths_host: np.ndarray, index_dev: tuple[Any, Any], out: dict[str, Any]) -> None:
        """Fill a variable-length field's outputs (see _ragged_outputs). Runs inside the assembler's scope;
        the concatenated values of a padded field are scratch of the assembler's own."""
        ops, xp = self.ops, self.ops.xp
        f = self.wl.ragged[name].values
        starts, lengths = index_dev
        lo, hi = rows[0][1], rows[-1][2]
        padded = name in self.pad
        total = int(lengths_host[lo:hi].sum())
        flat = xp.empty((total, *f.sample_shape), f.dtype) if padded else out[name]
        pos = 0
        for w, start, stop, _ in rows:
            n = int(lengths_host[start:stop].sum())
            gather(xp, ops.take, views[w][name], starts[start:stop], lengths[start:stop],
                   flat[pos:pos + n])
            pos += n
        batch_lengths = lengths[lo:hi]
        if padded:
            pad_values(xp, flat, batch_lengths, self.pad[name][1], out[name])
            # The lengths of the rows returned: a sample longer than the width was cut to it.
            xp.minimum(batch_lengths, out[name].shape[1], out=out[f"{name}/lengths"])
        else:
            offsets = out[f"{name}/offsets"]
            offsets[:1] = 0
            xp.cumsum(batch_lengths, out=offsets[1:])

    def close(self) -> None:
        """Stop the readers and wait for them; idempotent, safe from any thread but the readers'."""
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
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join()
        try:
            # Gathers the assembler queued may still read any buffer: whoever fills it next waits for them.
            released = self.ops.record()
        except Exception:  # interpreter or CUDA context shutting down: nothing left to order against
            return
        for slot in self.slots:
            slot.released = released


def _get(q: queue.Queue[Any] | queue.SimpleQueue[Any], stop: threading.Event) -> Any:
    """The next item of ``q`` (items queued before a stop are still taken), or None once ``stop`` is set
    and the queue is empty."""
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if stop.is_set():
                return None


def _compact(a: np.ndarray) -> np.ndarray:
    """int32 when it fits: half the bytes to upload and to read in each gather."""
    return a.astype(np.int32) if a.max(initial=0) < 2**31 else a
