"""Window buffers: where each field's data lies in one, and what carries a window's blocks into it.

A window is the set of blocks read together (``window_blocks`` of them, see the plan). A window buffer
holds, per fixed-size field, those blocks back to back; per variable-length field, the values of those
blocks back to back, in a region sized for the largest ``window_blocks`` blocks of the dataset. Each
field's region starts on the 4 KiB alignment. Pure layout: no I/O, no device code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._units import align_up
from .backends.base import FillRequest, ReadRequest, Request
from .format import DatasetLayout, FieldMeta, RaggedMeta
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


class WindowLayout:
    """Where each field's region lies in a window buffer (``starts``, in bytes) and how many rows it holds."""

    def __init__(self, fields: Sequence[FieldMeta], window_blocks: int,
                 ragged: dict[str, tuple[RaggedMeta, int]] | None = None):
        """``ragged``: variable-length field -> (its metadata, the value rows a window must hold)."""
        self.fields = {f.name: f for f in fields}
        self.ragged = {name: r for name, (r, _) in (ragged or {}).items()}
        self.window_blocks = window_blocks
        self.rows: dict[str, int] = {f.name: f.samples_per_block * window_blocks for f in fields}
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

    def requests(self, layout: DatasetLayout, blocks: np.ndarray) -> list[Request]:
        """What carries ``blocks`` into this layout: one read per run of consecutive bytes of a file, one
        fill per block never written."""
        reqs: list[Request] = []
        for name, f in self.fields.items():
            base = self.starts[name]
            for path, offset, nbytes, first in layout.block_runs(name, blocks):
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
        per block and field (a variable-length field's block is its samples' values)."""
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
