"""The pieces of a remote dataset's shard files: the unit the node's shard cache fetches, pins, marks and evicts.

Pure: no I/O. A shard's data (all but its index) is cut at its chunks' starts, runs of chunks smaller than
:data:`MIN_PIECE_BYTES` joined into one piece; the cut depends on the shard's index alone, so every process cuts
a shard alike and pieces never overlap. A shard whose chunks are not known is one piece (docs/remote.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .mirror import Entry

#: The least bytes of a piece (but the last of a range of data): smaller chunks are joined until it is reached.
MIN_PIECE_BYTES = 64 << 10


class Piece(NamedTuple):
    """Bytes ``lo .. hi`` of a shard file (its :class:`~gdsload.remote.mirror.Entry`), fetched whole."""

    entry: Entry
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def name(self) -> str:
        """What names the piece among its shard's (in file names and markers)."""
        return f"{self.lo}-{self.hi}"


def data_ranges(entry: Entry) -> list[tuple[int, int]]:
    """The byte ranges of a shard file that are its data: all but what the skeleton kept (its index)."""
    return [(a, b) for a, b in ((0, entry.keep_lo), (entry.keep_hi, entry.info.size)) if b > a]


def cut(entry: Entry, starts: Iterable[int] | None, min_bytes: int = MIN_PIECE_BYTES) -> tuple[int, ...]:
    """The starts of ``entry``'s pieces and, last, the end of its data (sorted): its data ranges cut at
    ``starts`` (its chunks' offsets; None: not cut), runs shorter than ``min_bytes`` joined to the next."""
    bounds: list[int] = []
    given = sorted({int(s) for s in starts}) if starts is not None else []
    for lo, hi in data_ranges(entry):
        inner = given[bisect.bisect_right(given, lo):bisect.bisect_left(given, hi)]
        piece_lo = lo
        bounds.append(lo)
        for s in inner:
            if s - piece_lo >= min_bytes and hi - s >= min_bytes:  # neither this piece nor the rest too small
                bounds.append(s)
                piece_lo = s
        bounds.append(hi)
    return tuple(bounds)


def pieces_of(entry: Entry, bounds: Sequence[int]) -> list[Piece]:
    """The pieces ``bounds`` (from :func:`cut`) makes of ``entry``: consecutive bounds, less the kept range."""
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo and not (entry.keep_lo <= lo and hi <= entry.keep_hi):
            out.append(Piece(entry, lo, hi))
    return out


def covering(pieces: Sequence[Piece], offset: int, nbytes: int) -> list[Piece]:
    """The pieces among ``pieces`` (one shard's, in order: :func:`pieces_of`) that bytes ``offset .. offset +
    nbytes`` touch."""
    if nbytes <= 0:
        return []
    first = max(0, bisect.bisect_right(pieces, offset, key=lambda p: p.lo) - 1)
    out = []
    for p in pieces[first:]:
        if p.lo >= offset + nbytes:
            break
        if p.hi > offset:
            out.append(p)
    return out


def chunk_starts(offsets: Mapping[str, np.ndarray], files: Mapping[str, np.ndarray],
                 paths: Mapping[str, Sequence[str]]) -> dict[str, np.ndarray]:
    """Each shard file's chunk offsets, from a layout's tables (per array key: every chunk's offset, -1 where
    never written, and the index of its file in ``paths[key]``)."""
    out: dict[str, np.ndarray] = {}
    for key, offs in offsets.items():
        written = offs >= 0
        offs, which = offs[written], files[key][written]
        order = np.lexsort((offs, which))
        offs, which = offs[order], which[order]
        cuts = np.flatnonzero(np.diff(which)) + 1
        for part_offsets, part_files in zip(np.split(offs, cuts), np.split(which, cuts)):
            if len(part_files):
                out[paths[key][int(part_files[0])]] = part_offsets
    return out
