"""The shard index: where each inner chunk of one shard file lies, as the sharding codec writes it.

An index is ``n_chunks x (offset, nbytes)``, uint64 little endian, followed by the crc32c of those bytes
(the ``bytes`` + ``crc32c`` index codecs; a foreign store's index may lack the crc32c), at the end or the
start of the shard file. A chunk never written
has both values all ones (:data:`MAX_UINT_64`). This module encodes an index (the writer), parses and
checksums one (:func:`parse_shard_index`), reads it through an open shard file (:func:`read_shard_index`)
and checks its entries against that file (:func:`chunk_table`).

Error contract: a malformed index is a FormatError whose one-line message starts with the shard's path and
``': '``; an I/O failure reading it is a ReadError (:func:`gdsload.files.read_error`).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

import crc32c
import numpy as np

from .errors import FormatError
from .files import ShardFile, pread_exact

if TYPE_CHECKING:
    from .format import FieldMeta

#: Both values of a never-written chunk's index entry.
MAX_UINT_64 = 2**64 - 1
#: One index entry: offset and nbytes, two uint64.
INDEX_ENTRY_BYTES = 16
#: The crc32c after the entries, uint32 little endian.
CRC_BYTES = 4


class ShardIndex(NamedTuple):
    """Offsets and lengths of the chunks of one shard; a chunk never written is all ones."""

    offsets_and_lengths: np.ndarray  # (n_chunks, 2) uint64

    def get_chunk_slice(self, chunk: int) -> tuple[int, int] | None:
        offset, nbytes = (int(v) for v in self.offsets_and_lengths[chunk])
        if offset == MAX_UINT_64 and nbytes == MAX_UINT_64:
            return None
        return offset, offset + nbytes


def parse_shard_index(buf: bytes, n_chunks: int, path: str, checksum: bool = True) -> ShardIndex:
    """Parse and checksum a shard index as the ``bytes`` + ``crc32c`` index codecs write it (``checksum``
    False: the ``bytes`` codec alone, no crc32c)."""
    expected = n_chunks * INDEX_ENTRY_BYTES + (CRC_BYTES if checksum else 0)
    if len(buf) != expected:
        raise FormatError(f"{path}: shard index is {len(buf)} bytes (expected {expected})")
    if not checksum:
        return ShardIndex(np.frombuffer(buf, dtype="<u8").reshape(n_chunks, 2).astype(np.uint64))
    body, (stored,) = buf[:-CRC_BYTES], struct.unpack("<I", buf[-CRC_BYTES:])
    actual = crc32c.crc32c(body)
    if actual != stored:
        raise FormatError(
            f"{path}: shard index checksum mismatch (expected crc32c {stored:#010x}, found {actual:#010x})"
        )
    table = np.frombuffer(body, dtype="<u8").reshape(n_chunks, 2).astype(np.uint64)
    return ShardIndex(table)


def encode_shard_index(table: np.ndarray) -> bytes:
    """Bytes of a shard index (inverse of :func:`parse_shard_index`)."""
    body = np.ascontiguousarray(table, dtype="<u8").tobytes()
    return body + struct.pack("<I", crc32c.crc32c(body))


def read_shard_index(shard: ShardFile, field: FieldMeta) -> tuple[ShardIndex, int]:
    """Read one shard's index through its open file; returns the index and the file size seen when it was
    opened."""
    path, size, n = shard.path, shard.size, field.index_bytes
    if size < n:
        raise FormatError(f"{path}: shard file is {size} bytes, smaller than its index ({n} bytes)")
    buf = pread_exact(shard, size - n if field.index_location == "end" else 0, n)
    return parse_shard_index(buf, field.blocks_per_shard, path, field.index_checksum), size


def chunk_table(path: str, table: np.ndarray, size: int, field: FieldMeta,
                allow_empty: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Check the index entries of one shard's chunks (``table``: (n, 2) uint64, the chunks of the array in
    this shard) against a file of ``size`` bytes, and return each chunk's offset (-1: never written) and
    stored length (0: never written).

    A written chunk of a raw array must be exactly one raw chunk as stored (``field.stored_bytes``); a
    compressed array's chunks may have any length from 1 byte. Every written chunk must lie inside the file
    and outside the index, and overlap no other; unless ``allow_empty`` (a foreign store), a shard must hold
    at least one written chunk (zarr deletes a shard with none instead of writing it).
    """
    ib = field.index_bytes
    starts, lengths = table[:, 0], table[:, 1]
    missing = (starts == MAX_UINT_64) & (lengths == MAX_UINT_64)
    written = np.flatnonzero(~missing)
    if len(written) == 0:
        if allow_empty:
            return np.full(len(table), -1, dtype=np.int64), np.zeros(len(table), dtype=np.int64)
        raise FormatError(f"{path}: shard index marks all {len(table)} chunks as never written (expected at "
                          f"least one: zarr does not write an empty shard)")
    if field.compressed:
        wrong = written[(lengths[written] == 0) | (lengths[written] > np.uint64(size))]
        if len(wrong):
            i = int(wrong[0])
            raise FormatError(f"{path}: chunk {i} is {int(lengths[i])} bytes (expected 1 to {size}: the file's size)")
    else:
        bb = field.stored_bytes
        wrong = written if bb > MAX_UINT_64 else written[lengths[written] != np.uint64(bb)]  # no uint64 holds bb
        if len(wrong):
            i = int(wrong[0])
            raise FormatError(f"{path}: chunk {i} is {int(lengths[i])} bytes (expected {bb}: raw, uncompressed)")
    # Every length is now at most the file's size: int64 arithmetic cannot overflow once starts are checked.
    lo, hi = (0, size - ib) if field.index_location == "end" else (ib, size)
    s, n = starts[written], lengths[written].astype(np.int64)
    outside = (s < np.uint64(lo)) | (s > np.uint64(max(hi, 0))) | (s.astype(np.float64) + n > max(hi, 0))
    if outside.any():
        k = int(np.flatnonzero(outside)[0])
        i, start, bb = int(written[k]), int(s[k]), int(n[k])
        if start + bb > size:
            raise FormatError(f"{path}: chunk {i} ends at byte {start + bb}, past the end of the file ({size} bytes)")
        region = (size - ib, size) if field.index_location == "end" else (0, ib)
        raise FormatError(f"{path}: chunk {i} (bytes {start}..{start + bb}) overlaps the shard index "
                          f"(bytes {region[0]}..{region[1]})")
    s = s.astype(np.int64)
    order = np.argsort(s, kind="stable")
    sorted_starts, sorted_ends = s[order], (s + n)[order]
    clash = np.flatnonzero(sorted_starts[1:] < sorted_ends[:-1])
    if len(clash):
        k = int(clash[0])
        a, b = int(written[order[k]]), int(written[order[k + 1]])
        raise FormatError(f"{path}: chunks {a} and {b} overlap (chunk {b} starts at byte {int(sorted_starts[k + 1])}, "
                          f"before chunk {a} ends at byte {int(sorted_ends[k])})")
    offsets = np.full(len(table), -1, dtype=np.int64)
    offsets[written] = s
    out_lengths = np.zeros(len(table), dtype=np.int64)
    out_lengths[written] = n
    return offsets, out_lengths
