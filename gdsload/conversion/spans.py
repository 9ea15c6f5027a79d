"""Block checksums of a dataset written in parts: the crc32c of each part's spans, joined into each block's.

A fixed field's block is one span; a variable-length field's may straddle shard files written by different
processes, its spans joined by :func:`crc32c_combine` (zlib's ``crc32_combine`` for the Castagnoli polynomial)
from their checksums and lengths alone. The result equals, bit for bit, a single conversion's crc32c.
"""

from __future__ import annotations

from collections.abc import Iterable

import crc32c
import numpy as np

from ..errors import ConversionError

#: The reflected Castagnoli polynomial (crc32c).
_POLY = 0x82F63B78


class SpanCrc:
    """crc32c of the spans of blocks that one shard's bytes cover. The shard's bytes start at byte ``start``
    of its array's stream, where block ``b`` covers ``[bounds[b], bounds[b + 1])``; bytes past the last block
    (a variable-length field's padding) are ignored. Fed in order through :meth:`update`, as the writer's
    block checksums are."""

    def __init__(self, bounds: np.ndarray, start: int):
        self.bounds, self.pos = bounds, start
        self.spans: dict[int, list[int]] = {}  # block -> [first byte, bytes, crc32c]

    def update(self, buf: memoryview) -> None:
        start, end = self.pos, self.pos + len(buf)
        b = int(np.searchsorted(self.bounds, start, side="right")) - 1  # the last block starting at or before
        while 0 <= b < len(self.bounds) - 1 and int(self.bounds[b]) < end:
            lo, hi = max(start, int(self.bounds[b])), min(end, int(self.bounds[b + 1]))
            if hi > lo:
                span = self.spans.setdefault(b, [lo, 0, 0])
                span[2] = crc32c.crc32c(buf[lo - start:hi - start], span[2])
                span[1] += hi - lo
            b += 1
        self.pos = end

    def rows(self) -> list[list[int]]:
        """The spans as rows ``[block, first byte, bytes, crc32c]``."""
        return [[b, *p] for b, p in sorted(self.spans.items())]


def _times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc1`` = crc32c(A), ``crc2`` = crc32c(B) and ``len2`` = len(B): B's
    length in zero bits applied to ``crc1`` by squaring the one-zero-bit operator (log2(len2) steps)."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # the operator of one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    while True:
        even = _square(odd)  # the first pass: one zero byte
        if len2 & 1:
            crc1 = _times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _square(even)
        if len2 & 1:
            crc1 = _times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def join_spans(where: str, field: str, spans: Iterable[np.ndarray], num_blocks: int, stream_bytes: int
                ) -> np.ndarray:
    """The crc32c of every block of ``field`` from the spans every part recorded (rows ``[block, first byte,
    bytes, crc32c]``): they must tile the field's stream, 0 to ``stream_bytes``, with no gap or overlap, else a
    ConversionError naming ``where`` and the block. A block of no bytes (samples of no elements) is 0."""
    rows = [p.reshape(-1, 4) for p in spans]
    table = np.concatenate(rows) if rows else np.zeros((0, 4), np.uint64)
    table = table[np.lexsort((table[:, 1], table[:, 0]))] if len(table) else table
    crcs = np.zeros(num_blocks, dtype=np.uint32)
    end, last = 0, -1
    for block, first, nbytes, crc in table.tolist():
        if first != end or block < last or block >= num_blocks:
            raise ConversionError(f"{where}: checksum spans of field {field!r} do not tile its bytes at block "
                                  f"{block} (byte {first}, expected {end}): a part is damaged or from another "
                                  f"conversion")
        crcs[block] = crc if block != last else crc32c_combine(int(crcs[block]), crc, nbytes)
        end, last = first + nbytes, block
    if end != stream_bytes:
        raise ConversionError(f"{where}: checksum spans of field {field!r} cover {end} bytes (expected "
                              f"{stream_bytes}): a part is missing some")
    return crcs
