"""The on-disk format's metadata: a Zarr v3 group of arrays sharded along the sample axis.

A dataset is a Zarr v3 group whose attributes carry a ``gdsload`` entry (:data:`ATTRS_KEY`: format version,
number of samples, samples per block, the fields and their kinds, the checksum arrays). Each field is one
sharded array (a variable-length field: ``NAME/values`` sharded, ``NAME/offsets`` read whole) whose inner
chunks are raw little-endian blocks of ``samples_per_block`` rows and whose shard index is ``bytes`` +
``crc32c``. :func:`read_metadata` reads every ``zarr.json`` with plain ``json`` and checks it key by key
(:mod:`gdsload._zarr_json`), sizes as Python ints before anything is allocated or looped over; zarr then
opens each array as a second opinion (data type, fill value). The result is a :class:`DatasetMeta`.

The rest of the format lives beside this module: the shard index in :mod:`gdsload.shard_index`, the
block locations of an open dataset in :mod:`gdsload.layout` (both re-exported here).

Error contract: anything wrong with a dataset on disk (metadata, shard index, a file that is not a regular
file) is a FormatError, also a ValueError, whose one-line message starts with the offending path and
``': '``; an I/O failure while reading it is a ReadError, also an OSError. No exception of json, numpy or
zarr escapes.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import numpy as np

from ._zarr_json import (MAX_DIMENSIONS, MAX_METADATA_BYTES, MIN_CHUNK_LIMIT, as_int, as_list, as_object,
                         as_shape, bytes_endian, check_whole_array, chunk_shape, codec_entry, exc_text, fail,
                         is_int, key_separator, read_node, show, valid_key, valid_name)
from .errors import FormatError
from .layout import BlockLocation, DatasetLayout, RowPiece
from .shard_index import (CRC_BYTES, INDEX_ENTRY_BYTES, MAX_UINT_64, ShardIndex, chunk_offsets,
                          encode_shard_index, parse_shard_index, read_shard_index)

__all__ = [
    # defined here
    "FORMAT_VERSION", "ATTRS_KEY", "CHECKSUM_ALGORITHM", "CHECKSUMS_GROUP", "FieldMeta", "RaggedMeta",
    "DatasetMeta", "read_metadata",
    # re-exported from the module named after each line
    "MAX_UINT_64", "INDEX_ENTRY_BYTES", "CRC_BYTES", "ShardIndex", "parse_shard_index", "encode_shard_index",
    "read_shard_index", "chunk_offsets",  # gdsload.shard_index
    "DatasetLayout", "BlockLocation", "RowPiece",  # gdsload.layout
    "MAX_METADATA_BYTES", "MAX_DIMENSIONS", "MIN_CHUNK_LIMIT",  # gdsload._zarr_json
]

#: Version of the ``gdsload`` group attribute this code reads and writes.
FORMAT_VERSION = 1
#: The group attribute that makes a Zarr v3 group a gdsload dataset.
ATTRS_KEY = "gdsload"
#: The one block checksum gdsload writes and checks.
CHECKSUM_ALGORITHM = "crc32c"
#: The group the writer puts the checksum arrays in (``_checksums/FIELD``); readers take each array's path
#: from the attributes, not from this name.
CHECKSUMS_GROUP = "_checksums"

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
        raise fail(where, f"zarr refuses the array ({exc_text(e)})") from None
    if zshape != shape:
        raise fail(where, f"changed while being read (shape {shape}, then {zshape})")
    return fill


def _field_meta(path: str, key: str, num_samples: int | None, spb: int | None) -> FieldMeta:
    """Validate one sharded array's metadata and reduce it to a FieldMeta (``None``: take rows / rows per
    chunk from the array itself, as for the values of a variable-length field)."""
    where = os.path.join(path, *key.split("/"), "zarr.json")
    doc = read_node(where, "array", f"field '{key.split('/')[0]}' is listed in the group attributes but "
                                    f"has no array {key}")
    shape = as_shape(where, "shape", doc.get("shape"), 0)
    ndim = len(shape)
    dtype = _DTYPES.get(doc["data_type"]) if isinstance(doc.get("data_type"), str) else None
    if dtype is None:
        raise fail(where, f"unsupported data type {show(doc.get('data_type'))} (expected one of {list(_DTYPES)})")
    shard = chunk_shape(where, doc, ndim)
    sep = key_separator(where, doc)
    if doc.get("storage_transformers") not in (None, []):
        raise fail(where, f"storage transformers are not supported (found {show(doc.get('storage_transformers'))})")
    codecs = [codec_entry(where, c) for c in as_list(where, "codecs", doc.get("codecs"))]
    if [name for name, _ in codecs] != ["sharding_indexed"]:
        raise fail(where, f"expected one sharding_indexed codec, found {show([name for name, _ in codecs])}")
    cfg = codecs[0][1]
    chunk = as_shape(where, "inner chunk_shape", cfg.get("chunk_shape"), 1, ndim)
    inner = [codec_entry(where, c) for c in as_list(where, "inner codecs", cfg.get("codecs"))]
    if [name for name, _ in inner] != ["bytes"]:
        raise fail(where, f"inner chunks must be raw ('bytes' codec only), found {show([n for n, _ in inner])}")
    endian = bytes_endian(where, inner[0][1])
    if endian != "little" and dtype.itemsize > 1:
        raise fail(where, f"inner chunks must be little endian, found {endian}")
    index_codecs = [codec_entry(where, c) for c in as_list(where, "index_codecs", cfg.get("index_codecs"))]
    if [name for name, _ in index_codecs] != ["bytes", "crc32c"]:
        raise fail(where, f"shard index codecs must be ['bytes', 'crc32c'], found "
                          f"{show([n for n, _ in index_codecs])}")
    if bytes_endian(where, index_codecs[0][1]) != "little":
        raise fail(where, "shard index must be little endian, found big")
    location = cfg.get("index_location", "end")
    if location not in ("end", "start"):
        raise fail(where, f"index_location must be 'end' or 'start' (found {show(location)})")
    if num_samples is None or spb is None:
        num_samples, spb = shape[0], chunk[0]
    if shape[0] != num_samples:
        raise fail(where, f"expected {num_samples} samples on axis 0, found shape {shape}")
    if chunk != (spb, *shape[1:]):
        raise fail(where, f"inner chunk shape must be {(spb, *shape[1:])}, found {chunk}")
    if shard[1:] != shape[1:] or shard[0] % spb:
        raise fail(where, f"shards must split axis 0 only, in whole blocks of {spb}; found shard shape {shard}")
    if math.prod(shape[1:]) == 0:
        raise fail(where, f"zero-size samples (sample shape {shape[1:]})")
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


def _checksums_attr(where: str, value: Any, kinds: dict[str, str]) -> dict[str, str]:
    """``attrs["gdsload"]["checksums"]``: ``{"algorithm": "crc32c", "arrays": {FIELD: PATH}}``."""
    if value is None:
        return {}
    value = as_object(where, f"{ATTRS_KEY}.checksums", value)
    algorithm = value.get("algorithm")
    if algorithm != CHECKSUM_ALGORITHM:
        raise fail(where, f"unsupported checksum algorithm {show(algorithm)} (expected '{CHECKSUM_ALGORITHM}')")
    out = {}
    for name, key in as_object(where, f"{ATTRS_KEY}.checksums.arrays", value.get("arrays")).items():
        if name not in kinds:
            raise fail(where, f"{ATTRS_KEY}.checksums names an unknown field {show(name)} (fields: {list(kinds)})")
        if not valid_key(key):
            raise fail(where, f"checksum array of field '{name}' must be a relative path inside the dataset "
                              f"(found {show(key)})")
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
    doc = read_node(where, "group", "not a Zarr v3 group")
    attributes = as_object(where, "attributes", doc.get("attributes", {}))
    attrs = attributes.get(ATTRS_KEY)
    if attrs is None:
        raise fail(where, f"group attributes lack the '{ATTRS_KEY}' entry (not a gdsload dataset)")
    attrs = as_object(where, f"attribute '{ATTRS_KEY}'", attrs)
    version = attrs.get("format")
    if not (is_int(version) and version == FORMAT_VERSION):
        raise fail(where, f"unsupported format version (expected {FORMAT_VERSION}, found {show(version)})")
    num_samples = as_int(where, f"{ATTRS_KEY}.num_samples", attrs.get("num_samples"), 1)
    spb = as_int(where, f"{ATTRS_KEY}.samples_per_block", attrs.get("samples_per_block"), 1)
    listed = as_object(where, f"{ATTRS_KEY}.fields", attrs.get("fields"))
    if not listed:
        raise fail(where, f"{ATTRS_KEY}.fields is empty (expected at least one field)")
    kinds: dict[str, str] = {}
    for name, entry in listed.items():
        if not valid_name(name):
            raise fail(where, f"invalid field name {show(name)} (expected a name without '/', not '.' or '..')")
        kind = as_object(where, f"{ATTRS_KEY}.fields.{name}", {} if entry is None else entry).get("kind", "fixed")
        if kind not in ("fixed", "ragged"):
            raise fail(where, f"field '{name}' has unknown kind {show(kind)} (expected 'fixed' or 'ragged')")
        kinds[name] = kind
    checksums = _checksums_attr(where, attrs.get("checksums"), kinds)
    fields, ragged = {}, {}
    for name, kind in kinds.items():
        if kind == "fixed":
            fields[name] = _field_meta(path, name, num_samples, spb)
            continue
        ragged[name] = RaggedMeta(name, _field_meta(path, f"{name}/values", None, None))
        check_whole_array(os.path.join(path, name, "offsets", "zarr.json"),
                          f"variable-length field '{name}' has no offsets array",
                          f"{num_samples + 1} integer offsets", num_samples + 1, _INT_DTYPES)
    return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=spb, fields=fields, ragged=ragged,
                       checksums=checksums)
