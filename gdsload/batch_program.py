"""A pass's batches as a program for the native batcher (gdsload/batcher.py): flat int64 arrays, made once per
pass, so that the batcher's thread runs the whole pass without asking Python anything. Pure logic: addresses
are numbers here, and the kernel choice is the caller's.

Per batch: the windows it reads (in order; ``win_rel``: it is their last reader, so the buffer is released
after it) and its operations, ``OP_WORDS`` int64 each: ``kind`` (gather or copy), ``fn`` (the gather kernel's
handle, 0 for a copy or in host mode), ``src_window`` (index into the batch's windows whose buffer address
is added to ``src``, or -1: ``src`` is absolute), ``src``, ``idx`` (address of the row indices), ``idx_bytes``
(4 or 8), ``out_off`` (bytes into the output slot), ``rows``, ``row_bytes``, ``words`` and ``blocks`` (the
kernel's launch). The output slot holds one full batch of every field, each at an aligned offset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ._units import align_up
from .plan import EpochPlan

OP_WORDS = 11
GATHER, COPY = 0, 1
#: (rows, row_bytes, idx_bytes, alignment of the source and destination addresses) -> (fn, words, blocks)
Chooser = Callable[[int, int, int, int], tuple[int, int, int]]


@dataclass(frozen=True)
class SlotField:
    """One fixed-size field's place in an output slot."""

    name: str
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class SlotLayout:
    """Where each field of a full batch lies in an output slot of ``nbytes``."""

    batch_size: int
    fields: tuple[SlotField, ...]
    nbytes: int


def slot_layout(batch_size: int, fields: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> SlotLayout:
    """Fields ``(name, sample_shape, dtype)`` of a batch of ``batch_size``, each at an aligned offset."""
    out, pos = [], 0
    for name, shape, dtype in fields:
        f = SlotField(name, tuple(shape), np.dtype(dtype), pos)
        out.append(f)
        pos += align_up(max(1, f.row_bytes * batch_size))
    return SlotLayout(batch_size, tuple(out), pos)


@dataclass(frozen=True)
class FieldSource:
    """Where a field's rows come from: ``window_offset`` (its region in every window buffer) with the rows
    given by the plan's positions (``index`` None, consecutive runs copied) or by an index of its own
    (``index``: (address, itemsize), by stream entry); or a resident array at ``base`` gathered by the
    global sample ids at ``index``."""

    slot: SlotField
    window_offset: int | None
    index: tuple[int, int] | None = None
    base: int = 0


@dataclass
class Program:
    """One pass's program (see the module docstring); ``sizes``: samples per batch."""

    op_start: np.ndarray
    ops: np.ndarray
    win_start: np.ndarray
    win_w: np.ndarray
    win_rel: np.ndarray
    sizes: np.ndarray

    @property
    def num_batches(self) -> int:
        return len(self.sizes)


def _alignment(*values: int) -> int:
    """The largest power of two up to 16 dividing every value."""
    a = 16
    while a > 1 and any(v % a for v in values):
        a //= 2
    return a


def build_program(plan: EpochPlan, table: Sequence[Sequence[tuple[int, int, int, int]]], last_batch: np.ndarray,
                  sources: Sequence[FieldSource], positions: tuple[int, int] | None, choose: Chooser,
                  pace: Callable[[], None] | None = None) -> Program:
    """The program of every batch of ``plan`` (``table``: its segments, ``last_batch``: each window's last
    batch, as :class:`gdsload.assembler.EpochIndex` holds them; ``positions``: (address, itemsize) of the
    plan's positions on the device). ``pace`` is called every few hundred batches."""
    n = plan.num_batches
    op_start, win_start = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    ops: list[tuple[int, ...]] = []
    win_w: list[int] = []
    win_rel: list[int] = []

    def gather(src_window: int, src: int, idx: int, idx_bytes: int, out: int, rows: int, row_bytes: int) -> None:
        fn, words, blocks = choose(rows, row_bytes, idx_bytes, _alignment(src, out, row_bytes))
        ops.append((GATHER, fn, src_window, src, idx, idx_bytes, out, rows, row_bytes, words, blocks))

    for i in range(n):
        lo, hi = plan.batch_bounds(i)
        sizes[i] = hi - lo
        windows: list[int] = []
        for w, start, stop, first in table[i]:
            if w not in windows:
                windows.append(w)
            j = windows.index(w)
            for s in sources:
                f = s.slot
                if s.window_offset is None:
                    continue
                out = f.offset + (start - lo) * f.row_bytes
                if s.index is not None:
                    addr, size = s.index
                    gather(j, s.window_offset, addr + start * size, size, out, stop - start, f.row_bytes)
                elif first >= 0:
                    ops.append((COPY, 0, j, s.window_offset + first * f.row_bytes, 0, 0, out, stop - start,
                                f.row_bytes, 0, 0))
                else:
                    if positions is None:
                        raise ValueError(f"field {f.name!r} needs the plan's positions on the device")
                    addr, size = positions
                    gather(j, s.window_offset, addr + start * size, size, out, stop - start, f.row_bytes)
        for s in sources:
            if s.window_offset is None and s.index is not None and hi > lo:
                addr, size = s.index
                gather(-1, s.base, addr + lo * size, size, s.slot.offset, hi - lo, s.slot.row_bytes)
        win_w.extend(windows)
        win_rel.extend(int(last_batch[w] == i) for w in windows)
        op_start[i + 1], win_start[i + 1] = len(ops), len(win_w)
        if pace is not None and i % 256 == 255:
            pace()
    return Program(op_start, np.asarray(ops, dtype=np.int64).reshape(-1, OP_WORDS), win_start,
                   np.asarray(win_w, dtype=np.int64), np.asarray(win_rel, dtype=np.int64), sizes)
