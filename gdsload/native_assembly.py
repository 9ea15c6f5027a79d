"""A pipeline's batches assembled by the native batcher (gdsload/batcher.py) instead of a Python thread: the
programs it runs, the output slots it writes, and the consumer's side of the hand-over.

Output slots. Each slot holds one full batch of every field; its arrays are made once and handed out in a
fresh dict per batch (views for a short last batch). A slot goes back to the batcher only once nothing
outside this object refers to its memory, its arrays or their memory pointers (reference counts back to
what they were when the slot was made): whatever the consumer kept of a batch, a view, a torch tensor
sharing it, keeps that slot from being written. The check runs in ``next()`` over the slots handed out,
usually two (a training loop still holds the batch before the one it asks for). When the consumer holds
so many that the batcher would run short, a slot is added: slots are freed with the pipeline, never
before, so the memory held is the most batches held at once plus ``ahead`` and two.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .assembler import Assembler, EpochIndex
from .batch_program import FieldSource, slot_layout, build_program
from .batcher import FAILED, NONE_LEFT, READER_FAILED, WINDOW_END, WINDOW_FAILED, Batcher
from .errors import GDSLoadError, ReadError
from .handoff import POLL_S
from .stats import EpochStats
from .window import WindowBuffer, WindowLayout


def eligible(ops: Any, assembler: Assembler) -> bool:
    """Whether this pipeline's batches can be assembled natively: ops that support it (``native_mode``) and
    fixed-size fields only (variable-length ones are gathered in Python)."""
    return getattr(ops, "native_mode", None) is not None and not assembler.ragged


@dataclass
class _Slot:
    index: int
    keep: Any  # the slot's memory
    arrays: dict[str, Any]  # one full batch of every field, over that memory
    event: Any  # "ready", recorded by the batcher after the slot's batch is written
    tracked: list[Any]  # what the consumer's references to the slot show up in
    base: tuple[int, ...]  # their reference counts with nothing handed out


def _counts(tracked: list[Any]) -> tuple[int, ...]:
    return tuple(sys.getrefcount(o) for o in tracked)


class NativeAssembly:
    """The native batcher of one pipeline, its programs and output slots (see the module docstring)."""

    def __init__(self, ops: Any, assembler: Assembler, window_layout: WindowLayout, buffers: Sequence[WindowBuffer],
                 batch_size: int, ahead: int, path: str, closed_message: str):
        """BackendUnavailable when the native library cannot be used (the caller assembles in Python)."""
        self.ops, self.assembler, self.wl = ops, assembler, window_layout
        self.layout = slot_layout(batch_size, [(n, f.sample_shape, f.dtype) for n, f in assembler.shapes.items()])
        self.sample_bytes = sum(f.row_bytes for f in self.layout.fields)
        self.batcher = Batcher(ops.native_mode, ops.device_id, ops.work_handle,
                               [ops.address(b.buffer) for b in buffers], ahead)
        self.take: Callable[[], int] = self.batcher.take
        self._buffer_index = {id(b): i for i, b in enumerate(buffers)}
        self._filled: list[Any] = [None] * len(buffers)  # each buffer's latest "filled" event, kept alive for C
        self._sizes: dict[int, np.ndarray] = {}
        self._path, self._closed_message = path, closed_message
        self.failure: tuple[BaseException, str] | None = None  # a reader's error, raised where the batcher stopped
        self.slots: list[_Slot] = []
        self.held: list[int] = []
        self.ahead = ahead
        self._stream = ops.stream_handle()
        self.batcher.set_stream(self._stream)
        for _ in range(ahead + 3):
            self._add_slot()

    def _add_slot(self) -> None:
        keep, base = self.ops.new_slot(self.layout.nbytes)
        arrays = self.ops.slot_arrays(keep, self.layout)
        event, handle = self.ops.new_ready_event()
        s = self.batcher.add_slot(base, handle)
        slot = _Slot(s, keep, arrays, event, [keep, *arrays.values(), *self.ops.pointers(arrays)], ())
        del keep, arrays  # counted with only the slot's own references
        slot.base = _counts(slot.tracked)
        self.slots.append(slot)
        self.batcher.free_slot(s)

    # -- programs and windows (pipeline threads) --
    def add_pass(self, k: int, index: EpochIndex, first: int, pace: Callable[[], None] | None) -> None:
        """Pass ``k``'s program (passes in order) from its index arrays, run from batch ``first``."""
        ops, asm, dev = self.ops, self.assembler, index.dev
        sources = []
        for f in self.layout.fields:
            if f.name in asm.resident:
                ids = dev["ids"]
                sources.append(FieldSource(f, None, (ops.address(ids), ids.itemsize),
                                           ops.address(asm.resident[f.name].array)))
            elif f.name in asm.direct:
                sources.append(FieldSource(f, self.wl.starts[f.name]))
            else:
                rows = dev["rows", f.name]
                sources.append(FieldSource(f, self.wl.starts[f.name], (ops.address(rows), rows.itemsize)))
        positions = dev.get("positions")
        where = None if positions is None else (ops.address(positions), positions.itemsize)
        program = build_program(index.plan, index.table, index.last_batch, sources, where, ops.chooser(), pace)
        self._sizes[k] = program.sizes
        self.batcher.add_pass(k, program, first, ops.event_handle(index.ready))

    def announce(self, k: int, w: int, buf: WindowBuffer, filled: Any) -> None:
        """Window ``w`` of pass ``k`` is in ``buf`` after ``filled`` (completer thread)."""
        i = self._buffer_index[id(buf)]
        self._filled[i] = filled
        self.batcher.announce(k, w, i, self.ops.event_handle(filled))

    def fail(self, error: BaseException, where: str) -> None:
        """A read failed (completer thread): batches of the windows before it still go out, then this."""
        if self.failure is None:
            self.failure = (error, where)
        self.batcher.announce(-1, -1, WINDOW_FAILED)

    def end(self) -> None:
        """The readers are done (they stop only at a stop or an error)."""
        self.batcher.announce(-1, -1, WINDOW_END)

    def free_buffer(self, halted: Callable[[], bool], buffers: Sequence[WindowBuffer]) -> WindowBuffer | None:
        """A window buffer whose last gathers are done (submitter thread); None once reading stops."""
        while not halted():
            b = self.batcher.free_buffer(POLL_S)
            if b >= 0:
                return buffers[b]
            if b == NONE_LEFT:
                return None
        return None

    # -- the consumer --
    def hand_out(self, k: int, i: int, stats: EpochStats) -> tuple[dict[str, Any], int, int]:
        """Batch ``i`` of pass ``k`` on the consumer's stream: (batch as exported, samples, bytes)."""
        s = self.take()
        if s < 0:
            s = self._wait(stats)
        slot = self.slots[s]
        ops = self.ops
        ops.hand_over(slot.event)
        stream = ops.stream_handle()
        if stream != self._stream:
            self.batcher.set_stream(stream)
            self._stream = stream
        n = int(self._sizes[k][i])
        batch = (dict(slot.arrays) if n == self.layout.batch_size
                 else {name: a[:n] for name, a in slot.arrays.items()})
        if self.held:
            kept = []
            for t in self.held:
                held = self.slots[t]
                if _counts(held.tracked) == held.base:
                    self.batcher.free_slot(t)
                else:
                    kept.append(t)
            self.held = kept
        self.held.append(s)
        if len(self.slots) - len(self.held) <= self.ahead:
            self._add_slot()
        return ops.export(batch), n, n * self.sample_bytes

    def _wait(self, stats: EpochStats) -> int:
        t0 = time.perf_counter()
        while (s := self.batcher.wait(POLL_S)) < 0:
            if s == NONE_LEFT:
                self._stopped()
        stats.stalled(time.perf_counter() - t0)
        return s

    def _stopped(self) -> None:
        """Raise why the batcher publishes no more."""
        state, message = self.batcher.state()
        if state == READER_FAILED and self.failure is not None:
            raise failure_error(*self.failure, self._path)
        if state == FAILED:
            raise ReadError(f"{self._path}: assembling batches failed ({message})")
        raise GDSLoadError(self._closed_message)

    def stop(self) -> None:
        self.batcher.stop()

    def close(self) -> None:
        """Join the batcher's thread (after stop() and the pipeline threads' end)."""
        self.batcher.close()

    def retire(self, k: int) -> None:
        self._sizes.pop(k, None)


def failure_error(e: BaseException, where: str, path: str) -> GDSLoadError:
    """A reader's error as the consumer gets it: its message names the file, and the window it was reading."""
    if isinstance(e, GDSLoadError):  # its message starts with the file it is about
        out = type(e)(f"{e} (reading {where})")
    else:
        out = ReadError(f"{path}: reading {where} failed ({type(e).__name__}: {e})")
    out.__cause__ = e
    return out
