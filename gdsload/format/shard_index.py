"""The shard index: where each inner chunk of one shard file lies, as the sharding codec writes it.

An index is ``n_chunks x (offset, nbytes)``, uint64 little endian, then (optionally, in foreign stores) the
crc32c of those bytes, at the end or the start of the file; a chunk never written has both values all ones
(:data:`MAX_UINT_64`). This module encodes an index, parses and checks one (:func:`parse_shard_index`,
:func:`read_shard_index`) and checks its entries against the file (:func:`chunk_table`: for a converted dataset,
that the chunks tile it exactly: docs/format.md, "Shard files"). Errors: a FormatError starting with the shard's
path and ``': '``; an I/O failure is a ReadError (:func:`gdsload.format.files.read_error`).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c
import numpy as np

from ..errors import ChecksumError, FormatError
from .arrays import CRC_BYTES, INDEX_ENTRY_BYTES, FieldMeta
from .files import ShardFile, pread_exact


#: Both values of a never-written chunk's index entry.
MAX_UINT_64 = 2**64 - 1


class ShardIndex(NamedTuple):
    """Offsets and lengths of the chunks of one shard; a chunk never written is all ones. ``checksum``: the
    crc32c stored after the entries (None for an index without one), kept for the resume fingerprint."""

    offsets_and_lengths: np.ndarray  # (n_chunks, 2) uint64
    checksum: int | None = None

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
        raise ChecksumError(
            f"{path}: shard index checksum mismatch (expected crc32c {stored:#010x}, found {actual:#010x})"
        )
    table = np.frombuffer(body, dtype="<u8").reshape(n_chunks, 2).astype(np.uint64)
    return ShardIndex(table, int(stored))


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


def chunk_table(path: str, table: np.ndarray, size: int, field: FieldMeta, allow_empty: bool = False,
                n_chunks: int | None = None, tiled: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Check the index entries of one shard (``table``: (n, 2) uint64, of which the first ``n_chunks``,
    default all, are chunks of the array: the last shard's index is full-length) against a file of ``size``
    bytes, and return each of those chunks' offset (-1: never written) and stored length (0: never written).

    A written chunk of a raw array must be exactly one raw chunk as stored (``field.stored_bytes``); a
    compressed array's chunks may have any length from 1 byte. Every written chunk must lie inside the file
    and outside the index, and overlap no other; unless ``allow_empty`` (a foreign store), a shard must hold
    at least one written chunk (zarr deletes a shard with none instead of writing it).

    ``tiled`` (a dataset with the ``gdsload`` attribute, arrays read strictly): the shard must also be laid
    out as the converter (and zarr's sharding codec) writes it, so that bytes inserted or removed anywhere
    are caught from the index alone, without reading or verifying data. The written chunks, in chunk order,
    tile the data region (the file without its index): the first starts it, each next one starts where
    the previous one ends, no gap, and the last ends it, so the file is exactly its chunks plus its index.
    A chunk never written (zarr writes none equal to the fill value; the converter writes every one) is
    skipped; the entries past the array's last chunk must all be never written. Without ``tiled`` (a
    foreign store) chunks may lie in any order, with gaps, and those entries are ignored.
    """
    count = len(table) if n_chunks is None else n_chunks
    table, unused = table[:count], table[count:]
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
    if tiled:
        _check_tiling(path, written, s, n, (lo, hi), size)
        _check_unused(path, unused, count)
    offsets = np.full(len(table), -1, dtype=np.int64)
    offsets[written] = s
    out_lengths = np.zeros(len(table), dtype=np.int64)
    out_lengths[written] = n
    return offsets, out_lengths


def _check_unused(path: str, entries: np.ndarray, first: int) -> None:
    """Index entries past the array's last chunk (``first`` is the first one's number) must be never written."""
    used = np.flatnonzero((entries[:, 0] != np.uint64(MAX_UINT_64)) | (entries[:, 1] != np.uint64(MAX_UINT_64)))
    if len(used):
        k = int(used[0])
        raise FormatError(f"{path}: index entry {first + k} lies past the array's last chunk (expected never "
                          f"written, found offset {int(entries[k, 0])}, nbytes {int(entries[k, 1])})")


def _check_tiling(path: str, written: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  region: tuple[int, int], size: int) -> None:
    """The written chunks (numbers ``written``, ascending, at ``starts`` with ``lengths``, each already seen
    inside the data region ``region`` and overlapping no other) tile that region in chunk order."""
    lo, hi = region
    ends = starts + lengths
    if int(starts[0]) != lo:
        raise FormatError(f"{path}: chunk {int(written[0])}, the first written, does not start the data region "
                          f"(expected byte {lo}, found byte {int(starts[0])})")
    gaps = np.flatnonzero(starts[1:] != ends[:-1])
    if len(gaps):
        k = int(gaps[0])
        raise FormatError(f"{path}: chunk {int(written[k + 1])} does not start where chunk {int(written[k])} ends "
                          f"(expected byte {int(ends[k])}, found byte {int(starts[k + 1])})")
    end = int(ends[-1])
    if end != hi:  # the others' checks leave end < hi: bytes in no chunk, before the index or after it
        expected = size - (hi - end)
        raise FormatError(f"{path}: file is {size} bytes, more than its chunks and index (expected {expected} "
                          f"bytes: chunk {int(written[-1])}, the last written, ends at byte {end}, the index "
                          f"{'follows it' if lo == 0 else 'precedes the chunks'})")
