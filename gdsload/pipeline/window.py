"""Window buffers: where each field's data lies in one, and what carries a window's blocks into it.

Pure layout: no I/O, no device code. Per fixed field a window buffer holds one *cell* per block (the whole
chunks covering its samples; :func:`cell_rows` rows where chunks do not divide the block), per variable-length
field the blocks' value rows, and per compressed field a region for its compressed chunks
(:func:`compressed_capacity`), in the device buffer or the window's host buffer (``host_fields``); each region
starts 4 KiB aligned. :meth:`WindowMap.work` lists what carries a window in: the backend's requests, the host
reads and the decode jobs. docs/design.md, "Window buffers"; docs/format.md, "Blocks over chunks of different
sizes" and "Compressed chunks".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .._units import align_up
from ..backends.base import FillRequest, ReadRequest, Request
from ..format.layout import DatasetLayout
from ..format.arrays import FieldMeta
from ..format.meta import RaggedMeta
from .plan import EpochPlan
from .ragged import block_value_rows
from ..codecs.checksum import Checks, concat


@dataclass
class WindowBuffer:
    """One window buffer and the event after which its previous contents are no longer read."""

    buffer: Any
    released: Any = None
    _views: dict[str, Any] | None = None
    host: Any = None  # host buffer of compressed fields decoded by CPU threads (GPU backends; made on first use)
    #: The requests whose data it holds, read before any pipeline wrote it (the dataset's open, which
    #: waited for them).
    loaded: list[Request] | None = None

    def take_loaded(self, requests: Sequence[Request]) -> bool:
        """Called as ``requests`` are about to be submitted into the buffer: whether it already holds exactly
        them (then nothing need be read). Either way it holds nothing known after this call."""
        loaded, self.loaded = self.loaded, None
        return loaded is not None and loaded == list(requests)

    def views(self, layout: WindowMap) -> dict[str, Any]:
        """Each field's (rows, *sample_shape) view of the buffer, made once."""
        if self._views is None:
            self._views = {name: layout.view(self.buffer, name) for name in layout.rows}
        return self._views


class DecodeJob(NamedTuple):
    """The compressed chunks of one field in one window: chunk ``chunks[i]`` lies at ``src[i]`` of its buffer,
    ``nbytes[i]`` long, and decodes into ``dest[i]``. ``host``: both offsets are in the window's host buffer
    (then ``copy`` = (host offset, window buffer offset, bytes) of the decoded cells to move to the device);
    else in the window buffer. Cells of chunks never written are fill requests among the window's reads."""

    name: str
    chunks: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    dest: np.ndarray
    host: bool = False
    copy: tuple[int, int, int] | None = None


@dataclass
class Work:
    """What carries one window in: ``requests`` into the window buffer (the backend's), ``host_requests``
    into its host buffer (``host_nbytes`` long), then ``jobs`` to decode."""

    requests: list[Request]
    host_requests: list[Request] = field(default_factory=list)
    jobs: list[DecodeJob] = field(default_factory=list)
    host_nbytes: int = 0

    @property
    def read_bytes(self) -> int:
        """Bytes read from files (compressed bytes as stored)."""
        return sum(r.nbytes for r in [*self.requests, *self.host_requests] if isinstance(r, ReadRequest))


def compressed_capacity(lengths: np.ndarray, samples_per_block: int, chunk_rows: int, num_blocks: int,
                        window_blocks: int) -> int:
    """Bytes a window's compressed region of a field must hold: the ``window_blocks`` largest totals, over the
    blocks, of the stored lengths of the chunks covering each block (``lengths[c]``: chunk c's, 0 if never
    written). A chunk covering two blocks counts for each: it is read for each."""
    k, c = samples_per_block, chunk_rows
    b = np.arange(num_blocks, dtype=np.int64)
    lo, hi = b * k // c, np.minimum(((b + 1) * k - 1) // c, len(lengths) - 1)
    cum = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    totals = np.sort(cum[hi + 1] - cum[lo])[::-1]
    return max(1, int(totals[:window_blocks].sum()))


def cell_rows(samples_per_block: int, chunk_rows: int) -> int:
    """Rows of a block's cell for a field in chunks of ``chunk_rows``: the most whole chunks that rows
    ``[b*K, (b+1)*K)`` touch over every block b (K when ``chunk_rows`` divides K)."""
    k, c = samples_per_block, chunk_rows
    return ((c - math.gcd(k, c) + k - 1) // c + 1) * c


class WindowMap:
    """Where each field's region lies in a window buffer (``starts``, in bytes) and how many rows it holds."""

    def __init__(self, fields: Sequence[FieldMeta], window_blocks: int,
                 ragged: dict[str, tuple[RaggedMeta, int]] | None = None, samples_per_block: int | None = None,
                 chunk_lengths: dict[str, np.ndarray] | None = None, host_fields: Sequence[str] = ()):
        """``ragged``: variable-length field -> (its metadata, the value rows a window must hold);
        ``samples_per_block``: K, the plan's block (default: the fields' largest rows per chunk);
        ``chunk_lengths``: each compressed field's stored chunk lengths (the chunk table's); ``host_fields``:
        the compressed fields whose chunks are read into the host buffer and decoded there."""
        self.fields = {f.name: f for f in fields}
        self.ragged = {name: r for name, (r, _) in (ragged or {}).items()}
        self.window_blocks = window_blocks
        self.samples_per_block = samples_per_block or max((f.samples_per_block for f in fields), default=1)
        self.cell_rows = {f.name: cell_rows(self.samples_per_block, f.samples_per_block) for f in fields}
        self.rows: dict[str, int] = {name: rows * window_blocks for name, rows in self.cell_rows.items()}
        self.rows.update({name: rows for name, (_, rows) in (ragged or {}).items()})
        self.starts: dict[str, int] = {}
        pos = 0
        for name in self.rows:
            self.starts[name] = pos
            pos += align_up(self.row_meta(name).sample_bytes * self.rows[name])
        self.host_fields = tuple(host_fields)
        # Compressed regions: zstarts[name] in the window buffer, or in the host buffer for host fields, which
        # also hold a mirror of their cells at mirror[name].
        self.zbytes: dict[str, int] = {}
        self.zstarts: dict[str, int] = {}
        self.mirror: dict[str, int] = {}
        hpos = 0
        for f in fields:
            if not f.compressed:
                continue
            nblocks = -(-f.num_rows // self.samples_per_block)
            self.zbytes[f.name] = compressed_capacity((chunk_lengths or {})[f.name], self.samples_per_block,
                                                      f.samples_per_block, nblocks, window_blocks)
            if f.name in self.host_fields:
                self.zstarts[f.name], self.mirror[f.name] = hpos, hpos + align_up(self.zbytes[f.name])
                hpos = self.mirror[f.name] + align_up(f.sample_bytes * self.rows[f.name])
            else:
                self.zstarts[f.name] = pos
                pos += align_up(self.zbytes[f.name])
        self.nbytes = pos
        self.host_nbytes = hpos

    def row_meta(self, name: str) -> FieldMeta:
        """The metadata of a region's rows: a fixed field's samples, or a variable-length field's values."""
        return self.ragged[name].values if name in self.ragged else self.fields[name]

    def direct(self, name: str) -> bool:
        """Whether a fixed field's samples sit at their plan positions (its chunks divide K)."""
        return self.samples_per_block % self.fields[name].samples_per_block == 0

    def stream_rows(self, plan: EpochPlan, name: str) -> np.ndarray | None:
        """Each stream entry's row in its window's region of field ``name``: None when it is its plan
        position (:meth:`direct`), else ``i * cell + (b * K) % c + j`` for sample j of block b, the
        window's i-th block."""
        if self.direct(name):
            return None
        k, c = plan.config.samples_per_block, self.fields[name].samples_per_block
        if k != self.samples_per_block:
            raise ValueError(f"plan of {k} samples per block for a window map of {self.samples_per_block}")
        pos = plan.positions
        return (pos // k) * self.cell_rows[name] + (plan.stream_blocks() * k) % c + pos % k

    def _chunk_cells(self, f: FieldMeta, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunks of field ``f`` that carry ``blocks`` (in window order), and the chunk cell of its region
        each goes to (None: chunk i to cell i, when the blocks are the chunks)."""
        k, c = self.samples_per_block, f.samples_per_block
        if k == c:
            return blocks, None
        lo = blocks * k // c
        hi = np.minimum(((blocks + 1) * k - 1) // c, f.num_chunks - 1)
        counts = hi - lo + 1
        first = np.cumsum(counts) - counts
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
        cells = np.repeat(np.arange(len(blocks), dtype=np.int64) * (self.cell_rows[f.name] // c), counts) + within
        return np.repeat(lo, counts) + within, cells

    def chunk_starts(self, layout: DatasetLayout, name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The written chunks of raw field ``name`` that carry ``blocks`` into this layout, and the byte offset
        in the window buffer where each lands (a chunk read for two blocks appears twice)."""
        f = self.fields[name]
        chunks, cells = self._chunk_cells(f, np.asarray(blocks, dtype=np.int64))
        cells = np.arange(len(chunks), dtype=np.int64) if cells is None else cells
        written = layout.block_offsets[name][chunks] >= 0
        return chunks[written], self.starts[name] + cells[written] * f.block_bytes

    def work(self, layout: DatasetLayout, blocks: np.ndarray) -> Work:
        """What carries ``blocks`` into this layout: for raw fields one read per run of consecutive bytes of a
        file into consecutive cells; for compressed ones a read per chunk into the compressed region, in file
        order, and a decode job; one fill per chunk never written."""
        reqs: list[Request] = []
        blocks = np.asarray(blocks, dtype=np.int64)
        work = Work(reqs, host_nbytes=self.host_nbytes)
        for name, f in self.fields.items():
            if f.compressed:
                self._compressed(layout, f, blocks, work)
                continue
            base = self.starts[name]
            for path, offset, nbytes, first in layout.block_runs(name, *self._chunk_cells(f, blocks)):
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
        return work

    def first_requests(self, layout: DatasetLayout, plan: EpochPlan, batch: int = 0) -> list[Request]:
        """The backend's requests for the window that batch ``batch`` of ``plan`` draws from first (none past
        the plan's end): what a pass from there submits before anything else."""
        w = plan.first_window(batch)
        return self.work(layout, plan.windows[w]).requests if w < len(plan.windows) else []

    def _compressed(self, layout: DatasetLayout, f: FieldMeta, blocks: np.ndarray, work: Work) -> None:
        """A compressed field's reads (one per chunk), fills and decode job (see :class:`DecodeJob`). The
        written chunks lie back to back in its compressed region in the order of their files and offsets, so
        chunks next to each other in a file are next to each other in the buffer too, and the backend merges
        their reads into one (:func:`gdsload.backends.base.coalesce`)."""
        chunks, cells = self._chunk_cells(f, blocks)
        cells = np.arange(len(chunks), dtype=np.int64) if cells is None else cells
        offsets, files = layout.block_offsets[f.name][chunks], layout.chunk_files[f.name][chunks]
        present = offsets >= 0
        host = f.name in self.host_fields
        base = self.mirror[f.name] if host else self.starts[f.name]
        dest = base + cells * f.block_bytes
        reads = work.host_requests if host else work.requests
        at = np.flatnonzero(present)
        at = at[np.lexsort((offsets[at], files[at]))]
        lengths = layout.chunk_lengths[f.name][chunks[at]]
        src = self.zstarts[f.name] + np.cumsum(lengths) - lengths
        paths = layout.paths(f.name)
        for file, off, n, s in zip(files[at].tolist(), offsets[at].tolist(), lengths.tolist(), src.tolist()):
            reads.append(ReadRequest(paths[file], off, n, s))
        fill = f.fill_bytes()
        reads.extend(FillRequest(d, f.block_bytes, fill) for d in dest[~present].tolist())
        used = (int(cells.max()) + 1) * f.block_bytes if len(cells) else 0
        work.jobs.append(DecodeJob(f.name, chunks[at], src, lengths, dest[at], host,
                                   (self.mirror[f.name], self.starts[f.name], used) if host else None))

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
