"""The on-disk format: a Zarr v3 group of arrays sharded along the sample axis.

zarr parses and validates the metadata; the shard index (``n_chunks x (offset, nbytes)`` uint64 little
endian plus a crc32c, as the sharding codec writes it) is parsed here, once per shard, so the hot path
can turn (field, block) into (file, offset, nbytes) without zarr's decode pipeline.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from dataclasses import field as dataclass_field
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
    """One sharded array of shape (num_rows, *sample_shape): a fixed-size field (a row is a sample), or
    the values of a variable-length field (a row is one element of a sample's sequence)."""

    name: str  # the array's path in the group: "image", or "tokens/values"
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    fill_value: Any
    samples_per_block: int  # rows per inner chunk
    blocks_per_shard: int
    index_location: str  # "end" or "start", as the sharding codec names it
    key_separator: str
    num_rows: int

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.samples_per_block)

    @property
    def num_shards(self) -> int:
        return -(-self.num_chunks // self.blocks_per_shard)

    @property
    def sample_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.sample_shape)  # on the reader's hot path: no numpy call

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
class RaggedMeta:
    """A variable-length field: ``NAME/values`` (all samples' elements back to back, sharded like any
    field) and ``NAME/offsets`` (int64, num_samples + 1: sample i is values[offsets[i]:offsets[i+1]])."""

    name: str
    values: FieldMeta

    @property
    def offsets_key(self) -> str:
        return f"{self.name}/offsets"


@dataclass(frozen=True)
class DatasetMeta:
    """Group-level facts of a dataset, validated against every field's array metadata."""

    path: str
    num_samples: int
    samples_per_block: int
    fields: dict[str, FieldMeta]
    ragged: dict[str, RaggedMeta] = dataclass_field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)

    @property
    def names(self) -> list[str]:
        """Every field, fixed and variable-length, in the order the attributes list them."""
        return list(self.fields) + list(self.ragged)

    def array(self, key: str) -> FieldMeta:
        """The sharded array at ``key``: a fixed field's name, or ``NAME/values``."""
        if key in self.fields:
            return self.fields[key]
        return self.ragged[key.rsplit("/", 1)[0]].values

    def shard_path(self, key: str, shard: int) -> str:
        return os.path.join(self.path, *key.split("/"), self.array(key).shard_key(shard))

    def num_shards(self, key: str) -> int:
        return self.array(key).num_shards


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


def _field_meta(path: str, name: str, arr: Any, num_samples: int | None, spb: int | None) -> FieldMeta:
    """Validate one array's metadata and reduce it to a FieldMeta (``None``: take rows / rows per chunk
    from the array itself, as for the values of a variable-length field)."""
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
    if num_samples is None and len(shape) >= 1:
        num_samples, spb = shape[0], chunk[0]
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
        num_rows=num_samples,
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
        kinds = {str(n): (d or {}).get("kind", "fixed") for n, d in dict(attrs["fields"]).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{path}: malformed '{ATTRS_KEY}' attributes ({e})") from e
    if num_samples < 1 or spb < 1 or not kinds:
        raise FormatError(f"{path}: empty dataset (num_samples={num_samples}, samples_per_block={spb}, "
                          f"fields={list(kinds)})")
    fields, ragged = {}, {}
    for name, kind in kinds.items():
        if kind not in ("fixed", "ragged"):
            raise FormatError(f"{path}: field '{name}' has unknown kind {kind!r} (expected 'fixed' or 'ragged')")
        key = f"{name}/values" if kind == "ragged" else name
        try:
            arr = group[key]
        except KeyError:
            raise FormatError(f"{path}: field '{name}' is listed in the attributes but has no array {key}") from None
        if kind == "fixed":
            fields[name] = _field_meta(path, name, arr, num_samples, spb)
            continue
        ragged[name] = RaggedMeta(name, _field_meta(path, key, arr, None, None))
        try:
            offsets = group[f"{name}/offsets"]
        except KeyError:
            raise FormatError(f"{path}: variable-length field '{name}' has no offsets array") from None
        if tuple(offsets.shape) != (num_samples + 1,) or np.dtype(offsets.dtype).kind not in "iu":
            raise FormatError(f"{os.path.join(path, name, 'offsets')}: expected {num_samples + 1} integer "
                              f"offsets, found shape {tuple(offsets.shape)} {offsets.dtype}")
    return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=spb, fields=fields, ragged=ragged)


class RowPiece(NamedTuple):
    """Rows [row_start, row_stop) of an array that lie in one chunk: where to read them (None: never
    written, fill value)."""

    location: BlockLocation | None
    row_start: int
    row_stop: int


class DatasetLayout:
    """Block locations of every selected array, from each shard index read once at open, and the offsets
    of variable-length fields."""

    def __init__(self, meta: DatasetMeta, fields: tuple[str, ...] | None = None):
        self.meta = meta
        self.fields = tuple(fields) if fields is not None else tuple(meta.names)
        unknown = [f for f in self.fields if f not in meta.fields and f not in meta.ragged]
        if unknown:
            raise FormatError(f"{meta.path}: no field {unknown} (fields: {meta.names})")
        self.keys = tuple(f"{f}/values" if f in meta.ragged else f for f in self.fields)
        # block_offsets[key][c] is the byte offset of chunk c in its shard file, -1 if never written.
        self.block_offsets: dict[str, np.ndarray] = {k: self._scan(meta.array(k)) for k in self.keys}
        self.offsets: dict[str, np.ndarray] = {f: self._read_offsets(meta.ragged[f]) for f in self.fields
                                               if f in meta.ragged}
        self._paths = {k: [meta.shard_path(k, s) for s in range(meta.num_shards(k))] for k in self.keys}

    def _scan(self, field: FieldMeta) -> np.ndarray:
        meta, bps = self.meta, field.blocks_per_shard
        offsets = np.full(field.num_chunks, -1, dtype=np.int64)
        for shard in range(field.num_shards):
            path = meta.shard_path(field.name, shard)
            index, size = read_shard_index(path, field)
            first = shard * bps
            for i in range(min(bps, field.num_chunks - first)):
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

    def _read_offsets(self, r: RaggedMeta) -> np.ndarray:
        import zarr

        where = os.path.join(self.meta.path, r.name, "offsets")
        offsets = np.asarray(zarr.open_array(where, mode="r")[:], dtype=np.int64)
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != r.values.num_rows:
            raise FormatError(f"{where}: offsets must start at 0, never decrease and end at the number of "
                              f"values ({r.values.num_rows}); found {offsets[0]}..{offsets[-1]}")
        return offsets

    def locate(self, key: str, block: int) -> BlockLocation | None:
        """File, offset and size of a chunk, or None if it was never written (reads as fill value)."""
        offset = int(self.block_offsets[key][block])
        if offset < 0:
            return None
        fm = self.meta.array(key)
        return BlockLocation(self._paths[key][block // fm.blocks_per_shard], offset, fm.block_bytes)

    def block_runs(self, key: str, blocks: np.ndarray) -> list[tuple[str | None, int, int, int]]:
        """Blocks read back to back into a buffer, as runs ``(path, offset, nbytes, first)``: ``first`` is the
        run's position in ``blocks``; each run is one read of consecutive bytes of one file, or one block
        never written (``path`` None). One numpy pass instead of a lookup per block: this runs on a reader
        thread, where a long stretch of Python holds the GIL the training loop waits for."""
        fm = self.meta.array(key)
        bb = fm.block_bytes
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(blocks) == 0:
            return []
        offsets = self.block_offsets[key][blocks]
        shards = blocks // fm.blocks_per_shard
        missing = offsets < 0
        start = np.ones(len(blocks), dtype=bool)
        start[1:] = (shards[1:] != shards[:-1]) | (offsets[1:] != offsets[:-1] + bb) | missing[1:] | missing[:-1]
        firsts = np.flatnonzero(start)
        counts = np.diff(np.append(firsts, len(blocks)))
        paths = self._paths[key]
        return [(None if off < 0 else paths[shard], off, n * bb, first)
                for first, n, off, shard in zip(firsts.tolist(), counts.tolist(), offsets[firsts].tolist(),
                                                shards[firsts].tolist())]

    def locate_rows(self, key: str, row_start: int, row_stop: int) -> list[RowPiece]:
        """Where rows [row_start, row_stop) of an array lie, one piece per chunk they touch."""
        fm = self.meta.array(key)
        k, rb = fm.samples_per_block, fm.sample_bytes
        pieces = []
        for c in range(row_start // k, -(-row_stop // k)):
            a, b = max(row_start, c * k), min(row_stop, (c + 1) * k)
            loc = self.locate(key, c)
            if loc is not None:
                loc = BlockLocation(loc.path, loc.offset + (a - c * k) * rb, (b - a) * rb)
            pieces.append(RowPiece(loc, a, b))
        return pieces

    def shard_paths(self) -> list[str]:
        return [p for k in self.keys for p in self._paths[k]]
