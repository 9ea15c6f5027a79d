"""The on-disk format: a Zarr v3 group of arrays sharded along the sample axis.

Each ``zarr.json`` is parsed here with plain ``json`` and checked key by key, sizes as Python ints before
anything is allocated or looped over; zarr then opens each array as a second opinion (data type, fill
value). The shard index (``n_chunks x (offset, nbytes)`` uint64 little endian plus a crc32c, as the
sharding codec writes it) is parsed here, once per shard, through the descriptor the layout keeps open
(:mod:`gdsload.files`), so the hot path turns (field, block) into (file, offset, nbytes) without zarr's
decode pipeline, and reads the very inodes whose index was checked.

Error contract: anything wrong with a dataset on disk (metadata, shard index, a file that is not a regular
file) is a FormatError, also a ValueError, whose one-line message starts with the offending path and
``': '``; an I/O failure while reading it is a ReadError, also an OSError. No exception of json, numpy or
zarr escapes.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, NamedTuple

import crc32c
import numpy as np

from .errors import FormatError
from .files import ShardFile, ShardFiles, not_regular, open_shard, pread_exact, read_small, refusal

FORMAT_VERSION = 1
ATTRS_KEY = "gdsload"
MAX_UINT_64 = 2**64 - 1
INDEX_ENTRY_BYTES = 16
CRC_BYTES = 4
CHECKSUM_ALGORITHM = "crc32c"
#: A zarr.json larger than this is refused unread (real ones are a few KiB).
MAX_METADATA_BYTES = 16 << 20
#: More dimensions than numpy supports is not an array gdsload can read.
MAX_DIMENSIONS = 32
#: Small whole-read arrays (offsets, checksums) may have chunks this many elements long even when shorter.
MIN_CHUNK_LIMIT = 1 << 16

_DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}
_INT_DTYPES = tuple(n for n in _DTYPES if "int" in n)


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
    """Group-level facts of a dataset, validated against every field's array metadata.

    ``checksums`` maps a field to the path (in the group) of its checksum array: uint32, one crc32c per
    block (a fixed field: of the inner chunk's stored bytes, padding included; a variable-length field: of
    the bytes of values rows ``[offsets[b*K], offsets[min((b+1)*K, N)])``). Empty when the dataset has none.
    """

    path: str
    num_samples: int
    samples_per_block: int
    fields: dict[str, FieldMeta]
    ragged: dict[str, RaggedMeta] = dataclass_field(default_factory=dict)
    checksums: dict[str, str] = dataclass_field(default_factory=dict)

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


def read_shard_index(shard: ShardFile | str, field: FieldMeta) -> tuple[ShardIndex, int]:
    """Read one shard's index through an open file (or a path, opened and closed here); returns the index
    and the file size seen when it was opened."""
    if isinstance(shard, str):
        f = open_shard(shard)
        try:
            return read_shard_index(f, field)
        finally:
            os.close(f.fd)
    path, size, n = shard.path, shard.size, field.index_bytes
    if size < n:
        raise FormatError(f"{path}: shard file is {size} bytes, smaller than its index ({n} bytes)")
    buf = pread_exact(shard, size - n if field.index_location == "end" else 0, n)
    return parse_shard_index(buf, field.blocks_per_shard, path), size


def chunk_offsets(path: str, table: np.ndarray, size: int, field: FieldMeta) -> np.ndarray:
    """Check the index entries of one shard's chunks (``table``: (n, 2) uint64, the chunks of the array in
    this shard) against a file of ``size`` bytes, and return each chunk's offset (-1: never written).

    A written chunk must be exactly one raw block, lie inside the file and outside the index, and overlap
    no other chunk; a shard must hold at least one written chunk (zarr deletes a shard with none instead of
    writing it), which also bounds the block size by the file's.
    """
    bb, ib = field.block_bytes, field.index_bytes
    starts, lengths = table[:, 0], table[:, 1]
    missing = (starts == MAX_UINT_64) & (lengths == MAX_UINT_64)
    written = np.flatnonzero(~missing)
    if len(written) == 0:
        raise FormatError(f"{path}: shard index marks all {len(table)} chunks as never written (expected at "
                          f"least one: zarr does not write an empty shard)")
    wrong = written if bb > MAX_UINT_64 else written[lengths[written] != np.uint64(bb)]  # no uint64 holds bb
    if len(wrong):
        i = int(wrong[0])
        raise FormatError(f"{path}: chunk {i} is {int(lengths[i])} bytes (expected {bb}: raw, uncompressed)")
    # Every written chunk is bb long: it must start within [lo, hi - bb], outside the index region.
    lo, hi = (0, size - ib) if field.index_location == "end" else (ib, size)
    s = starts[written]
    outside = np.ones(len(s), dtype=bool) if hi - bb < lo else (s < np.uint64(lo)) | (s > np.uint64(hi - bb))
    if outside.any():
        k = int(np.flatnonzero(outside)[0])
        i, start = int(written[k]), int(s[k])
        if start + bb > size:
            raise FormatError(f"{path}: chunk {i} ends at byte {start + bb}, past the end of the file ({size} bytes)")
        region = (size - ib, size) if field.index_location == "end" else (0, ib)
        raise FormatError(f"{path}: chunk {i} (bytes {start}..{start + bb}) overlaps the shard index "
                          f"(bytes {region[0]}..{region[1]})")
    order = np.argsort(s, kind="stable")
    sorted_starts = s[order]
    clash = np.flatnonzero(np.diff(sorted_starts) < np.uint64(bb))
    if len(clash):
        k = int(clash[0])
        a, b = int(written[order[k]]), int(written[order[k + 1]])
        sa, sb = int(sorted_starts[k]), int(sorted_starts[k + 1])
        raise FormatError(f"{path}: chunks {a} and {b} overlap (chunk {b} starts at byte {sb}, before chunk {a} "
                          f"ends at byte {sa + bb})")
    offsets = np.full(len(table), -1, dtype=np.int64)
    offsets[written] = s.astype(np.int64)
    return offsets


# -- metadata --------------------------------------------------------------------------------------------
def _fail(where: str, what: str) -> FormatError:
    return FormatError(f"{where}: {what}")


def _show(value: Any) -> str:
    """A value for a message: its repr, cut short (metadata may hold anything)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _exc(e: BaseException) -> str:
    """An exception of a library, on one line, cut short."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"


def _is_int(value: Any) -> bool:
    return type(value) is int  # JSON's true / false are bools, which are ints to Python: not here


def _int(where: str, what: str, value: Any, minimum: int) -> int:
    if not _is_int(value):
        raise _fail(where, f"{what} must be an integer (found {_show(value)})")
    if value < minimum:
        raise _fail(where, f"{what} must be at least {minimum} (found {value})")
    return value


def _obj(where: str, what: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"{what} must be an object (found {_show(value)})")
    return value


def _list(where: str, what: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, f"{what} must be a list (found {_show(value)})")
    return value


def _shape(where: str, what: str, value: Any, minimum: int, ndim: int | None = None) -> tuple[int, ...]:
    """A list of ints, each at least ``minimum`` (and ``ndim`` long if given)."""
    if (not isinstance(value, list) or not all(_is_int(v) and v >= minimum for v in value)
            or not 1 <= len(value) <= MAX_DIMENSIONS or (ndim is not None and len(value) != ndim)):
        length = f"{ndim}" if ndim is not None else f"1 to {MAX_DIMENSIONS}"
        raise _fail(where, f"{what} must be a list of {length} integers of at least {minimum} "
                           f"(found {_show(value)})")
    return tuple(value)


def _valid_name(name: Any) -> bool:
    """A path component that stays inside its directory."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in "/\\\0"))


def _valid_key(key: Any) -> bool:
    """A relative path inside the group: valid names joined by '/'."""
    return isinstance(key, str) and all(_valid_name(part) for part in key.split("/"))


def _read_json(where: str) -> dict[str, Any]:
    """A zarr.json as a dict; anything else (not a regular file, not JSON, not an object) is a FormatError."""
    raw = read_small(where, "zarr.json", MAX_METADATA_BYTES)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep, too long an int
        raise _fail(where, f"not valid JSON ({_exc(e)})") from None
    return _obj(where, "the metadata", doc)


def _read_node(where: str, kind: str, missing: str) -> dict[str, Any]:
    """The metadata document of a Zarr v3 node of ``kind`` ("group" or "array")."""
    if not os.path.lexists(where):
        raise _fail(where, f"missing ({missing})")
    doc = _read_json(where)
    fmt, node = doc.get("zarr_format"), doc.get("node_type")
    if not (_is_int(fmt) and fmt == 3 and node == kind):
        raise _fail(where, f"not a Zarr v3 {kind} (expected zarr_format 3 and node_type '{kind}', found "
                           f"{_show(fmt)} and {_show(node)})")
    return doc


def _codec(where: str, codec: Any) -> tuple[Any, dict[str, Any]]:
    """(name, configuration) of one codec entry (a name alone stands for a codec without configuration)."""
    if isinstance(codec, str):
        return codec, {}
    codec = _obj(where, "a codec", codec)
    config = codec.get("configuration")
    if config is None:
        return codec.get("name"), {}
    return codec.get("name"), _obj(where, f"configuration of codec {_show(codec.get('name'))}", config)


def _endian(where: str, config: dict[str, Any]) -> str:
    endian = config.get("endian", "little")
    if endian not in ("little", "big"):
        raise _fail(where, f"bytes codec endian must be 'little' or 'big' (found {_show(endian)})")
    return endian


def _chunk_shape(where: str, doc: dict[str, Any], ndim: int) -> tuple[int, ...]:
    """The regular chunk grid's chunk shape (for a sharded array: the shard shape)."""
    grid = _obj(where, "chunk_grid", doc.get("chunk_grid"))
    if grid.get("name") != "regular":
        raise _fail(where, f"expected a regular chunk grid, found {_show(grid.get('name'))}")
    config = _obj(where, "chunk_grid configuration", grid.get("configuration"))
    return _shape(where, "chunk_grid chunk_shape", config.get("chunk_shape"), 1, ndim)


def _key_separator(where: str, doc: dict[str, Any]) -> str:
    enc = _obj(where, "chunk_key_encoding", doc.get("chunk_key_encoding"))
    if enc.get("name") != "default":
        raise _fail(where, f"expected the default chunk key encoding, found {_show(enc.get('name'))}")
    config = enc.get("configuration")
    sep = "/" if config is None else _obj(where, "chunk_key_encoding configuration", config).get("separator", "/")
    if sep not in ("/", "."):
        raise _fail(where, f"chunk key separator must be '/' or '.' (found {_show(sep)})")
    return sep


def _zarr_fill_value(where: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """Let zarr open the array (its own validation of the metadata) and return its fill value, checked to be
    a value of ``dtype``."""
    import zarr

    try:
        arr = zarr.open_array(os.path.dirname(where), mode="r", zarr_format=3)
        zshape, fill = tuple(arr.shape), arr.fill_value
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy casts NaN to uint8 with only a warning
            np.full(1, fill, dtype=dtype)
    except Exception as e:
        raise _fail(where, f"zarr refuses the array ({_exc(e)})") from None
    if zshape != shape:
        raise _fail(where, f"changed while being read (shape {shape}, then {zshape})")
    return fill


def _field_meta(path: str, key: str, num_samples: int | None, spb: int | None) -> FieldMeta:
    """Validate one sharded array's metadata and reduce it to a FieldMeta (``None``: take rows / rows per
    chunk from the array itself, as for the values of a variable-length field)."""
    where = os.path.join(path, *key.split("/"), "zarr.json")
    doc = _read_node(where, "array", f"field '{key.split('/')[0]}' is listed in the group attributes but "
                                     f"has no array {key}")
    shape = _shape(where, "shape", doc.get("shape"), 0)
    ndim = len(shape)
    dtype = _DTYPES.get(doc["data_type"]) if isinstance(doc.get("data_type"), str) else None
    if dtype is None:
        raise _fail(where, f"unsupported data type {_show(doc.get('data_type'))} (expected one of {list(_DTYPES)})")
    shard = _chunk_shape(where, doc, ndim)
    sep = _key_separator(where, doc)
    if doc.get("storage_transformers") not in (None, []):
        raise _fail(where, f"storage transformers are not supported (found {_show(doc.get('storage_transformers'))})")
    codecs = [_codec(where, c) for c in _list(where, "codecs", doc.get("codecs"))]
    if [name for name, _ in codecs] != ["sharding_indexed"]:
        raise _fail(where, f"expected one sharding_indexed codec, found {_show([name for name, _ in codecs])}")
    cfg = codecs[0][1]
    chunk = _shape(where, "inner chunk_shape", cfg.get("chunk_shape"), 1, ndim)
    inner = [_codec(where, c) for c in _list(where, "inner codecs", cfg.get("codecs"))]
    if [name for name, _ in inner] != ["bytes"]:
        raise _fail(where, f"inner chunks must be raw ('bytes' codec only), found {_show([n for n, _ in inner])}")
    endian = _endian(where, inner[0][1])
    if endian != "little" and dtype.itemsize > 1:
        raise _fail(where, f"inner chunks must be little endian, found {endian}")
    index_codecs = [_codec(where, c) for c in _list(where, "index_codecs", cfg.get("index_codecs"))]
    if [name for name, _ in index_codecs] != ["bytes", "crc32c"]:
        raise _fail(where, f"shard index codecs must be ['bytes', 'crc32c'], found "
                           f"{_show([n for n, _ in index_codecs])}")
    if _endian(where, index_codecs[0][1]) != "little":
        raise _fail(where, "shard index must be little endian, found big")
    location = cfg.get("index_location", "end")
    if location not in ("end", "start"):
        raise _fail(where, f"index_location must be 'end' or 'start' (found {_show(location)})")
    if num_samples is None or spb is None:
        num_samples, spb = shape[0], chunk[0]
    if shape[0] != num_samples:
        raise _fail(where, f"expected {num_samples} samples on axis 0, found shape {shape}")
    if chunk != (spb, *shape[1:]):
        raise _fail(where, f"inner chunk shape must be {(spb, *shape[1:])}, found {chunk}")
    if shard[1:] != shape[1:] or shard[0] % spb:
        raise _fail(where, f"shards must split axis 0 only, in whole blocks of {spb}; found shard shape {shard}")
    if math.prod(shape[1:]) == 0:
        raise _fail(where, f"zero-size samples (sample shape {shape[1:]})")
    return FieldMeta(
        name=key,
        dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
        sample_shape=shape[1:],
        fill_value=_zarr_fill_value(where, shape, dtype),
        samples_per_block=spb,
        blocks_per_shard=shard[0] // spb,
        index_location=location,
        key_separator=sep,
        num_rows=num_samples,
    )


def _whole_array_doc(where: str, missing: str, what: str, length: int, dtypes: tuple[str, ...]) -> None:
    """Check an array read whole (offsets, checksums): ``length`` elements of one of ``dtypes``, in chunks
    no longer than it needs (a chunk is decoded whole, so its length is memory)."""
    doc = _read_node(where, "array", missing)
    shape, dtype = doc.get("shape"), doc.get("data_type")
    if not (isinstance(shape, list) and len(shape) == 1 and _is_int(shape[0]) and shape[0] == length
            and isinstance(dtype, str) and dtype in dtypes):
        raise _fail(where, f"expected {what}, found shape {_show(shape)} of {_show(dtype)}")
    (chunk,) = _chunk_shape(where, doc, 1)
    if chunk > max(length, MIN_CHUNK_LIMIT):
        raise _fail(where, f"chunks of {chunk} elements for an array of {length} (expected at most "
                           f"{max(length, MIN_CHUNK_LIMIT)})")


def _checksums_attr(where: str, value: Any, kinds: dict[str, str]) -> dict[str, str]:
    """``attrs["gdsload"]["checksums"]``: ``{"algorithm": "crc32c", "arrays": {FIELD: PATH}}``."""
    if value is None:
        return {}
    value = _obj(where, f"{ATTRS_KEY}.checksums", value)
    algorithm = value.get("algorithm")
    if algorithm != CHECKSUM_ALGORITHM:
        raise _fail(where, f"unsupported checksum algorithm {_show(algorithm)} (expected '{CHECKSUM_ALGORITHM}')")
    out = {}
    for name, key in _obj(where, f"{ATTRS_KEY}.checksums.arrays", value.get("arrays")).items():
        if name not in kinds:
            raise _fail(where, f"{ATTRS_KEY}.checksums names an unknown field {_show(name)} (fields: {list(kinds)})")
        if not _valid_key(key):
            raise _fail(where, f"checksum array of field '{name}' must be a relative path inside the dataset "
                               f"(found {_show(key)})")
        out[name] = key
    return out


def read_metadata(path: str | os.PathLike[str]) -> DatasetMeta:
    """Read and check a dataset's metadata: the group's ``gdsload`` attributes and every field's arrays.

    Raises FormatError naming the offending ``zarr.json`` for anything that is not a gdsload dataset.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FormatError(f"{path}: no such dataset directory")
    where = os.path.join(path, "zarr.json")
    doc = _read_node(where, "group", "not a Zarr v3 group")
    attributes = _obj(where, "attributes", doc.get("attributes", {}))
    attrs = attributes.get(ATTRS_KEY)
    if attrs is None:
        raise _fail(where, f"group attributes lack the '{ATTRS_KEY}' entry (not a gdsload dataset)")
    attrs = _obj(where, f"attribute '{ATTRS_KEY}'", attrs)
    version = attrs.get("format")
    if not (_is_int(version) and version == FORMAT_VERSION):
        raise _fail(where, f"unsupported format version (expected {FORMAT_VERSION}, found {_show(version)})")
    num_samples = _int(where, f"{ATTRS_KEY}.num_samples", attrs.get("num_samples"), 1)
    spb = _int(where, f"{ATTRS_KEY}.samples_per_block", attrs.get("samples_per_block"), 1)
    listed = _obj(where, f"{ATTRS_KEY}.fields", attrs.get("fields"))
    if not listed:
        raise _fail(where, f"{ATTRS_KEY}.fields is empty (expected at least one field)")
    kinds: dict[str, str] = {}
    for name, entry in listed.items():
        if not _valid_name(name):
            raise _fail(where, f"invalid field name {_show(name)} (expected a name without '/', not '.' or '..')")
        kind = _obj(where, f"{ATTRS_KEY}.fields.{name}", {} if entry is None else entry).get("kind", "fixed")
        if kind not in ("fixed", "ragged"):
            raise _fail(where, f"field '{name}' has unknown kind {_show(kind)} (expected 'fixed' or 'ragged')")
        kinds[name] = kind
    checksums = _checksums_attr(where, attrs.get("checksums"), kinds)
    fields, ragged = {}, {}
    for name, kind in kinds.items():
        if kind == "fixed":
            fields[name] = _field_meta(path, name, num_samples, spb)
            continue
        ragged[name] = RaggedMeta(name, _field_meta(path, f"{name}/values", None, None))
        _whole_array_doc(os.path.join(path, name, "offsets", "zarr.json"),
                         f"variable-length field '{name}' has no offsets array",
                         f"{num_samples + 1} integer offsets", num_samples + 1, _INT_DTYPES)
    return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=spb, fields=fields, ragged=ragged,
                       checksums=checksums)


def _stored_chunks(array_dir: str) -> int:
    """Count the chunk files under an array read through zarr, refusing first anything zarr would block on
    (a FIFO) or trip over (a device, a symlink loop)."""
    count, todo = 0, [(array_dir, 0)]
    while todo:
        directory, depth = todo.pop()
        try:
            with os.scandir(directory) as it:
                entries = [e.path for e in it if not (depth == 0 and e.name == "zarr.json")]
        except OSError as e:
            raise _fail(directory, f"cannot list the array's chunks ({e.strerror or e})") from None
        for entry in entries:
            try:
                mode = os.stat(entry).st_mode
            except OSError as e:
                raise refusal(entry, "chunk file", e) from None
            if stat.S_ISDIR(mode):
                if depth > MAX_DIMENSIONS + 2:
                    raise _fail(entry, "chunk directories nest deeper than any chunk key")
                todo.append((entry, depth + 1))
            elif stat.S_ISREG(mode):
                count += 1
            else:
                raise not_regular(entry, "chunk file", mode)
    return count


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


class RowPiece(NamedTuple):
    """Rows [row_start, row_stop) of an array that lie in one chunk: where to read them (None: never
    written, fill value)."""

    location: BlockLocation | None
    row_start: int
    row_stop: int


class DatasetLayout:
    """Block locations of every selected array, the offsets of variable-length fields and the block
    checksums, all read once at open, and the shard files themselves, held open.

    Every shard file of the selected arrays is opened here (:mod:`gdsload.files`) and kept in ``files``
    until :meth:`close` (idempotent; also ``with DatasetLayout(...) as layout``); its index is read through
    that descriptor. Readers read data through ``files.fd(path)``, so the bytes come from the inodes whose
    index was checked even if the dataset is replaced (renamed over) later. If opening fails, every file
    opened so far is closed before the error propagates.

    Sizes are checked as Python ints before anything is allocated: an array whose shape implies more shard
    files than its chunk directory holds is refused before any is opened.
    """

    def __init__(self, meta: DatasetMeta, fields: tuple[str, ...] | None = None):
        self.meta = meta
        self.fields = tuple(fields) if fields is not None else tuple(meta.names)
        unknown = [f for f in self.fields if f not in meta.fields and f not in meta.ragged]
        if unknown:
            raise FormatError(f"{meta.path}: no field {unknown} (fields: {meta.names})")
        self.keys = tuple(f"{f}/values" if f in meta.ragged else f for f in self.fields)
        self.files = ShardFiles()
        try:
            self._paths = {k: self._shard_paths(k) for k in self.keys}  # every count checked before any open
            for k in self.keys:
                for p in self._paths[k]:
                    self.files.add(p)
            # block_offsets[key][c] is the byte offset of chunk c in its shard file, -1 if never written.
            self.block_offsets: dict[str, np.ndarray] = {k: self._scan(meta.array(k)) for k in self.keys}
            self.offsets: dict[str, np.ndarray] = {f: self._read_offsets(meta.ragged[f]) for f in self.fields
                                                   if f in meta.ragged}
            # checksums[field][b]: crc32c of block b's bytes (see DatasetMeta), for fields that have them.
            self.checksums: dict[str, np.ndarray] = {f: self._read_checksums(f, meta.checksums[f])
                                                     for f in self.fields if f in meta.checksums}
        except BaseException:
            self.files.close()
            raise

    @property
    def has_checksums(self) -> bool:
        """Every selected field has a checksum per block."""
        return bool(self.fields) and all(f in self.checksums for f in self.fields)

    @property
    def closed(self) -> bool:
        return self.files.closed

    def close(self) -> None:
        """Close the shard files (stop every reader first). Idempotent."""
        self.files.close()

    def __enter__(self) -> DatasetLayout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shard_paths(self, key: str) -> list[str]:
        """The shard files of an array, once its chunk directory is seen to hold at least as many entries
        as the metadata implies (a shape of 10**15 fails here, before anything is allocated)."""
        fm = self.meta.array(key)
        n = fm.num_shards
        if n:
            array_dir = os.path.join(self.meta.path, *key.split("/"))
            if fm.key_separator == "/":
                directory, prefix = os.path.join(array_dir, "c"), ""
            else:
                directory, prefix = array_dir, "c."
            try:
                with os.scandir(directory) as it:
                    found = sum(1 for e in it if e.name.startswith(prefix))
            except (FileNotFoundError, NotADirectoryError):
                found = 0
            except OSError as e:
                raise _fail(directory, f"cannot list shard files ({e.strerror or e})") from None
            if found < n:
                raise _fail(os.path.join(array_dir, "zarr.json"),
                            f"expected {n} shard files, found {found} (shape ({fm.num_rows}, ...) in shards of "
                            f"{fm.blocks_per_shard * fm.samples_per_block} rows, under {directory})")
        return [self.meta.shard_path(key, s) for s in range(n)]

    def _scan(self, field: FieldMeta) -> np.ndarray:
        bps, parts = field.blocks_per_shard, []
        for shard, path in enumerate(self._paths[field.name]):
            index, size = read_shard_index(self.files[path], field)
            n = min(bps, field.num_chunks - shard * bps)
            parts.append(chunk_offsets(path, index.offsets_and_lengths[:n], size, field))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _read_offsets(self, r: RaggedMeta) -> np.ndarray:
        import zarr

        where = os.path.join(self.meta.path, r.name, "offsets")
        n = self.meta.num_samples + 1
        if n * 8 > _memory_bytes():
            raise _fail(os.path.join(where, "zarr.json"), f"{n} offsets need {n * 8} bytes, more than this "
                                                          f"machine's memory ({_memory_bytes()} bytes)")
        _stored_chunks(where)
        try:
            offsets = np.asarray(zarr.open_array(where, mode="r", zarr_format=3)[:]).astype(np.int64)
        except Exception as e:
            raise _fail(where, f"cannot read the offsets ({_exc(e)})") from None
        if offsets.shape != (n,):
            raise _fail(where, f"expected {n} offsets, found shape {offsets.shape}")
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != r.values.num_rows:
            raise FormatError(f"{where}: offsets must start at 0, never decrease and end at the number of "
                              f"values ({r.values.num_rows}); found {offsets[0]}..{offsets[-1]}")
        return offsets

    def _read_checksums(self, name: str, key: str) -> np.ndarray:
        """A field's checksum array, read whole: uint32, one per block."""
        import zarr

        where = os.path.join(self.meta.path, *key.split("/"))
        n = self.meta.num_blocks
        _whole_array_doc(os.path.join(where, "zarr.json"), f"field '{name}' names it as its checksum array",
                         f"the checksums of field '{name}': ({n},) uint32", n, ("uint32",))
        if _stored_chunks(where) == 0:
            raise _fail(where, f"checksum array of field '{name}' holds no stored chunks (expected its values)")
        try:
            values = np.asarray(zarr.open_array(where, mode="r", zarr_format=3)[:])
        except Exception as e:
            raise _fail(where, f"cannot read the checksum array of field '{name}' ({_exc(e)})") from None
        if values.dtype != np.uint32 or values.shape != (n,):
            raise _fail(where, f"expected the checksums of field '{name}': ({n},) uint32, found {values.shape} "
                               f"{values.dtype}")
        return values.astype(np.uint32)

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
