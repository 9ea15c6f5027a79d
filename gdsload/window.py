"""Window buffers: where each field's data lies in one, and what carries a window's blocks into it.

A window is the set of blocks read together (``window_blocks`` of them, see the plan), a block being K
samples (``samples_per_block``). A window buffer holds, per fixed-size field, one *slot* per block of the
window, back to back: the whole chunks of that field that cover the block's samples. A field whose chunks
of c rows divide K has slots of exactly K rows, and sample j of the window's i-th block sits at row
``i * K + j``, its plan position (the plan's positions gather it, one copy per run of consecutive ones).
Otherwise (a foreign store, K = the largest chunk) a slot holds :func:`slot_rows` rows, the most chunks a
block can touch, and sample j of block b sits at row ``i * slot + (b * K) % c + j`` (:meth:`WindowLayout.
stream_rows`); a chunk straddling two blocks is read for each. Per variable-length field, the values of the
window's blocks lie back to back, in a region sized for the largest ``window_blocks`` blocks of the dataset.
Each field's region starts on the 4 KiB alignment. Pure layout: no I/O, no device code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._units import align_up
from .backends.base import FillRequest, ReadRequest, Request
from .format import DatasetLayout, FieldMeta, RaggedMeta
from .plan import EpochPlan
from .ragged import block_value_rows
from .verify import Checks, concat


@dataclass
class WindowBuffer:
    """One window buffer and the event after which its previous contents are no longer read."""

    buffer: Any
    released: Any = None
    _views: dict[str, Any] | None = None

    def views(self, layout: WindowLayout) -> dict[str, Any]:
        """Each field's (rows, *sample_shape) view of the buffer, made once."""
        if self._views is None:
            self._views = {name: layout.view(self.buffer, name) for name in layout.rows}
        return self._views


def slot_rows(samples_per_block: int, chunk_rows: int) -> int:
    """Rows of a block's slot for a field in chunks of ``chunk_rows``: the most whole chunks that rows
    ``[b*K, (b+1)*K)`` touch over every block b (K when ``chunk_rows`` divides K)."""
    k, c = samples_per_block, chunk_rows
    return ((c - math.gcd(k, c) + k - 1) // c + 1) * c


class WindowLayout:
    """Where each field's region lies in a window buffer (``starts``, in bytes) and how many rows it holds."""

    def __init__(self, fields: Sequence[FieldMeta], window_blocks: int,
                 ragged: dict[str, tuple[RaggedMeta, int]] | None = None, samples_per_block: int | None = None):
        """``ragged``: variable-length field -> (its metadata, the value rows a window must hold);
        ``samples_per_block``: K, the plan's block (default: the fields' largest rows per chunk)."""
        self.fields = {f.name: f for f in fields}
        self.ragged = {name: r for name, (r, _) in (ragged or {}).items()}
        self.window_blocks = window_blocks
        self.samples_per_block = samples_per_block or max((f.samples_per_block for f in fields), default=1)
        self.slot_rows = {f.name: slot_rows(self.samples_per_block, f.samples_per_block) for f in fields}
        self.rows: dict[str, int] = {name: rows * window_blocks for name, rows in self.slot_rows.items()}
        self.rows.update({name: rows for name, (_, rows) in (ragged or {}).items()})
        self.starts: dict[str, int] = {}
        pos = 0
        for name in self.rows:
            self.starts[name] = pos
            pos += align_up(self.row_meta(name).sample_bytes * self.rows[name])
        self.nbytes = pos

    def row_meta(self, name: str) -> FieldMeta:
        """The metadata of a region's rows: a fixed field's samples, or a variable-length field's values."""
        return self.ragged[name].values if name in self.ragged else self.fields[name]

    def direct(self, name: str) -> bool:
        """Whether a fixed field's samples sit at their plan positions (its chunks divide K)."""
        return self.samples_per_block % self.fields[name].samples_per_block == 0

    def stream_rows(self, plan: EpochPlan, name: str) -> np.ndarray | None:
        """Each stream entry's row in its window's region of field ``name``: None when it is its plan
        position (:meth:`direct`), else ``i * slot + (b * K) % c + j`` for sample j of block b, the
        window's i-th block."""
        if self.direct(name):
            return None
        k, c = plan.config.samples_per_block, self.fields[name].samples_per_block
        if k != self.samples_per_block:
            raise ValueError(f"plan of {k} samples per block for a window layout of {self.samples_per_block}")
        pos = plan.positions
        return (pos // k) * self.slot_rows[name] + (plan.stream_blocks() * k) % c + pos % k

    def _chunk_slots(self, f: FieldMeta, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunks of field ``f`` that carry ``blocks`` (in window order), and the chunk slot of its region
        each goes to (None: chunk i to slot i, when the blocks are the chunks)."""
        k, c = self.samples_per_block, f.samples_per_block
        if k == c:
            return blocks, None
        lo = blocks * k // c
        hi = np.minimum(((blocks + 1) * k - 1) // c, f.num_chunks - 1)
        counts = hi - lo + 1
        first = np.cumsum(counts) - counts
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
        slots = np.repeat(np.arange(len(blocks), dtype=np.int64) * (self.slot_rows[f.name] // c), counts) + within
        return np.repeat(lo, counts) + within, slots

    def requests(self, layout: DatasetLayout, blocks: np.ndarray) -> list[Request]:
        """What carries ``blocks`` into this layout: one read per run of consecutive bytes of a file into
        consecutive slots, one fill per chunk never written."""
        reqs: list[Request] = []
        blocks = np.asarray(blocks, dtype=np.int64)
        for name, f in self.fields.items():
            base = self.starts[name]
            for path, offset, nbytes, first in layout.block_runs(name, *self._chunk_slots(f, blocks)):
                dest = base + first * f.block_bytes
                if path is None:
                    reqs.append(FillRequest(dest, nbytes, f.fill_bytes()))
                else:
                    reqs.append(ReadRequest(path, offset, nbytes, dest))
        for name, r in self.ragged.items():
            base, vf = self.starts[name], r.values
            first, end = block_value_rows(layout.offsets[name], np.asarray(blocks), layout.meta.samples_per_block)
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
        per block and field (a variable-length field's block is its samples' values). Only datasets the
        converter wrote have checksums, and there every block is one chunk."""
        blocks = np.asarray(blocks, dtype=np.int64)
        parts = []
        for name, f in self.fields.items():
            lo = self.starts[name] + np.arange(len(blocks), dtype=np.int64) * f.block_bytes
            parts.append(Checks(lo, lo + f.block_bytes, layout.checksums[name][blocks], (name,) * len(blocks),
                                blocks))
        for name, r in self.ragged.items():
            first, end = block_value_rows(layout.offsets[name], blocks, layout.meta.samples_per_block)
            sizes = (end - first) * r.values.sample_bytes
            lo = self.starts[name] + np.cumsum(sizes) - sizes
            parts.append(Checks(lo, lo + sizes, layout.checksums[name][blocks], (f"{name}/values",) * len(blocks),
                                blocks))
        return concat(parts)

    def view(self, buffer: Any, name: str) -> Any:
        """Field ``name``'s region of ``buffer`` as (rows, *sample_shape)."""
        f = self.row_meta(name)
        off = self.starts[name]
        raw = buffer[off:off + f.sample_bytes * self.rows[name]]
        return raw.view(f.dtype).reshape(self.rows[name], *f.sample_shape)
