"""The on-disk format: a Zarr v3 group of arrays sharded along the sample axis.

zarr parses and validates the metadata; the shard index (``n_chunks x (offset, nbytes)`` uint64 little
endian plus a crc32c, as the sharding codec writes it) is parsed here, once per shard, so the hot path
can turn (field, block) into (file, offset, nbytes) without zarr's decode pipeline.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np

from .errors import FormatError

FORMAT_VERSION = 1
ATTRS_KEY = "gdsload"
MAX_UINT_64 = 2**64 - 1
INDEX_ENTRY_BYTES = 16
CRC_BYTES = 4


@dataclass(frozen=True)
class FieldMeta:
    """One fixed-size field: an array of shape (num_samples, *sample_shape)."""

    name: str
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    fill_value: Any
    samples_per_block: int
    blocks_per_shard: int
    index_location: str  # "end" or "start", as the sharding codec names it
    key_separator: str

    @property
    def sample_bytes(self) -> int:
        return int(self.dtype.itemsize * int(np.prod(self.sample_shape, dtype=np.int64)))

    @property
    def block_bytes(self) -> int:
        return self.sample_bytes * self.samples_per_block

    @property
    def index_bytes(self) -> int:
        return self.blocks_per_shard * INDEX_ENTRY_BYTES + CRC_BYTES

    def shard_key(self, shard: int) -> str:
        """Chunk key of a shard under the default key encoding: ``c/<shard>/0/...``."""
        parts = ["c", str(shard)] + ["0"] * len(self.sample_shape)
        return self.key_separator.join(parts)

    def fill_bytes(self) -> bytes:
        return np.full(1, self.fill_value, dtype=self.dtype).tobytes()


@dataclass(frozen=True)
class DatasetMeta:
    """Group-level facts of a dataset, validated against every field's array metadata."""

    path: str
    num_samples: int
    samples_per_block: int
    fields: dict[str, FieldMeta]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)

    def shard_path(self, field: str, shard: int) -> str:
        return os.path.join(self.path, field, self.fields[field].shard_key(shard))

    def num_shards(self, field: str) -> int:
        return -(-self.num_blocks // self.fields[field].blocks_per_shard)


class ShardIndex(NamedTuple):
    """Offsets and lengths of the chunks of one shard; a chunk never written is all ones."""

    offsets_and_lengths: np.ndarray  # (n_chunks, 2) uint64

    def get_chunk_slice(self, chunk: int) -> tuple[int, int] | None:
        offset, nbytes = (int(v) for v in self.offsets_and_lengths[chunk])
        if offset == MAX_UINT_64 and nbytes == MAX_UINT_64:
            return None
        return offset, offset + nbytes


class BlockLocation(NamedTuple):
    """Where the raw bytes of one block of one field lie."""

    path: str
    offset: int
    nbytes: int


def parse_shard_index(buf: bytes, n_chunks: int, path: str) -> ShardIndex:
    """Parse and checksum a shard index as the ``bytes`` + ``crc32c`` index codecs write it."""
    expected = n_chunks * INDEX_ENTRY_BYTES + CRC_BYTES
    if len(buf) != expected:
        raise FormatError(f"{path}: shard index is {len(buf)} bytes (expected {expected})")
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


def read_shard_index(path: str, field: FieldMeta) -> tuple[ShardIndex, int]:
    """Read one shard's index from its file; returns the index and the file size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = field.index_bytes
            if size < n:
                raise FormatError(f"{path}: shard file is {size} bytes, smaller than its index ({n} bytes)")
            f.seek(size - n if field.index_location == "end" else 0)
            buf = f.read(n)
    except FileNotFoundError:
        raise FormatError(f"{path}: shard file is missing") from None
    return parse_shard_index(buf, field.blocks_per_shard, path), size


def _fail(path: str, what: str) -> FormatError:
    return FormatError(f"{path}: {what}")


def _field_meta(path: str, name: str, arr: Any, num_samples: int, spb: int) -> FieldMeta:
    """Validate one array's metadata and reduce it to a FieldMeta."""
    meta = arr.metadata.to_dict()
    where = os.path.join(path, name, "zarr.json")
    codecs = meta.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        raise _fail(where, f"expected one sharding_indexed codec, found {[c.get('name') for c in codecs]}")
    cfg = codecs[0]["configuration"]
    inner = cfg.get("codecs", [])
    if len(inner) != 1 or inner[0].get("name") != "bytes":
        raise _fail(where, f"inner chunks must be raw ('bytes' codec only), found {[c.get('name') for c in inner]}")
    endian = (inner[0].get("configuration") or {}).get("endian", "little")
    if endian != "little" and arr.dtype.itemsize > 1:
        raise _fail(where, f"inner chunks must be little endian, found {endian}")
    index_codecs = [c.get("name") for c in cfg.get("index_codecs", [])]
    if index_codecs != ["bytes", "crc32c"]:
        raise _fail(where, f"shard index codecs must be ['bytes', 'crc32c'], found {index_codecs}")
    shape = tuple(int(s) for s in meta["shape"])
    chunk = tuple(int(s) for s in cfg["chunk_shape"])
    shard = tuple(int(s) for s in meta["chunk_grid"]["configuration"]["chunk_shape"])
    if len(shape) < 1 or shape[0] != num_samples:
        raise _fail(where, f"expected {num_samples} samples on axis 0, found shape {shape}")
    if chunk != (spb, *shape[1:]):
        raise _fail(where, f"inner chunk shape must be {(spb, *shape[1:])}, found {chunk}")
    if shard[1:] != shape[1:] or shard[0] % spb:
        raise _fail(where, f"shards must split axis 0 only, in whole blocks of {spb}; found shard shape {shard}")
    enc = meta.get("chunk_key_encoding", {})
    if enc.get("name") != "default":
        raise _fail(where, f"expected the default chunk key encoding, found {enc.get('name')}")
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in "biufc" or dtype.fields is not None:
        raise _fail(where, f"unsupported dtype {dtype}")
    return FieldMeta(
        name=name,
        dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
        sample_shape=shape[1:],
        fill_value=arr.fill_value,
        samples_per_block=spb,
        blocks_per_shard=shard[0] // spb,
        index_location=cfg.get("index_location", "end"),
        key_separator=(enc.get("configuration") or {}).get("separator", "/"),
    )


def read_metadata(path: str | os.PathLike[str]) -> DatasetMeta:
    """Open a dataset's metadata with zarr and check it is a gdsload dataset."""
    import zarr

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FormatError(f"{path}: no such dataset directory")
    try:
        group = zarr.open_group(path, mode="r")
    except Exception as e:  # zarr raises several types for "not a group"
        raise FormatError(f"{path}: not a Zarr v3 group ({type(e).__name__}: {e})") from e
    attrs = dict(group.attrs).get(ATTRS_KEY)
    if not isinstance(attrs, dict):
        raise FormatError(f"{path}: group attributes lack the '{ATTRS_KEY}' entry (not a gdsload dataset)")
    if attrs.get("format") != FORMAT_VERSION:
        raise FormatError(f"{path}: unsupported format version (expected {FORMAT_VERSION}, found {attrs.get('format')})")
    try:
        num_samples = int(attrs["num_samples"])
        spb = int(attrs["samples_per_block"])
        names = list(attrs["fields"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{path}: malformed '{ATTRS_KEY}' attributes ({e})") from e
    if num_samples < 1 or spb < 1 or not names:
        raise FormatError(f"{path}: empty dataset (num_samples={num_samples}, samples_per_block={spb}, fields={names})")
    fields = {}
    for name in names:
        try:
            arr = group[name]
        except KeyError:
            raise FormatError(f"{path}: field '{name}' is listed in the attributes but has no array") from None
        fields[name] = _field_meta(path, name, arr, num_samples, spb)
    return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=spb, fields=fields)


class DatasetLayout:
    """Block locations of every field, from each shard index read once at open."""

    def __init__(self, meta: DatasetMeta, fields: tuple[str, ...] | None = None):
        self.meta = meta
        self.fields = tuple(fields) if fields is not None else tuple(meta.fields)
        unknown = [f for f in self.fields if f not in meta.fields]
        if unknown:
            raise FormatError(f"{meta.path}: no field {unknown} (fields: {list(meta.fields)})")
        # block_offsets[field][b] is the byte offset of block b in its shard file, -1 if never written.
        self.block_offsets: dict[str, np.ndarray] = {f: self._scan(meta.fields[f]) for f in self.fields}

    def _scan(self, field: FieldMeta) -> np.ndarray:
        meta, bps = self.meta, field.blocks_per_shard
        offsets = np.full(meta.num_blocks, -1, dtype=np.int64)
        for shard in range(meta.num_shards(field.name)):
            path = meta.shard_path(field.name, shard)
            index, size = read_shard_index(path, field)
            first = shard * bps
            for i in range(min(bps, meta.num_blocks - first)):
                span = index.get_chunk_slice(i)
                if span is None:
                    continue
                start, stop = span
                if stop - start != field.block_bytes:
                    raise FormatError(
                        f"{path}: chunk {i} is {stop - start} bytes (expected {field.block_bytes}: raw, uncompressed)"
                    )
                if stop > size:
                    raise FormatError(f"{path}: chunk {i} ends at byte {stop}, past the end of the file ({size} bytes)")
                offsets[first + i] = start
        return offsets

    def locate(self, field: str, block: int) -> BlockLocation | None:
        """File, offset and size of a block, or None if it was never written (reads as fill value)."""
        offset = int(self.block_offsets[field][block])
        if offset < 0:
            return None
        fm = self.meta.fields[field]
        return BlockLocation(self.meta.shard_path(field, block // fm.blocks_per_shard), offset, fm.block_bytes)

    def shard_paths(self) -> list[str]:
        return [self.meta.shard_path(f, s) for f in self.fields for s in range(self.meta.num_shards(f))]
