"""One Zarr v3 array gdsload reads: its ``zarr.json`` checked and reduced to a :class:`FieldMeta`.

:func:`read_array` checks that chunks keep samples whole along axis 0, in two modes: ``strict`` (a field the
converter wrote: exactly the format of docs/format.md) and foreign (any Zarr v3 store's array: what is read and
what is refused by name, docs/format.md, "Reading existing Zarr stores"). Errors: a FormatError (a ValueError)
``PATH/zarr.json: what is wrong``; values are checked as Python ints before anything is allocated; no exception
of json, numpy or zarr escapes.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .zarr_json import (as_list, as_shape, bytes_endian, chunk_shape, codec_entry, exc_text, fail, key_encoding,
                        read_node, show)
from .chunk_codecs import check_codec

Codecs = tuple[tuple[str, Any], ...]

#: Data types gdsload reads (Zarr v3 names); numpy's dtype of each.
DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}
INT_DTYPES = tuple(n for n in DTYPES if "int" in n)
#: What a refusal of a foreign array suggests.
CONVERT_HINT = "convert the store with 'gdsload shard'"

#: One shard index entry: offset and nbytes, two uint64.
INDEX_ENTRY_BYTES = 16
#: A crc32c as Zarr's crc32c codec stores it (after a chunk, or after a shard index's entries): uint32 LE.
CRC_BYTES = 4


def shard_files(rows: int, rows_per_chunk: int, chunks_per_shard: int) -> int:
    """Files the chunk grid of an array implies: ``rows`` rows, ``rows_per_chunk`` a chunk, ``chunks_per_shard``
    chunks a file."""
    chunks = -(-rows // rows_per_chunk)
    return -(-chunks // chunks_per_shard)


@dataclass(frozen=True)
class FieldMeta:
    """One array of shape (num_rows, *sample_shape) read by rows: a fixed-size field (a row is a sample),
    or the values of a variable-length field (a row is one element of a sample's sequence).

    Its *chunks* are the inner chunks of a sharded array, or the chunks of an unsharded one (each then a
    file of its own, a "shard" of one chunk). ``samples_per_block`` is the rows per chunk: for a dataset
    the converter wrote, equal to the dataset's block; for a foreign store, the array's own.
    """

    name: str  # the array's path in the group: "image", "tokens/values", "a/b"
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    fill_value: Any
    samples_per_block: int  # rows per chunk
    blocks_per_shard: int  # chunks per file (1 for an unsharded array)
    index_location: str  # "end" or "start", as the sharding codec names it
    key_separator: str
    num_rows: int
    directory: str = ""  # the array's directory
    sharded: bool = True
    key_encoding: str = "default"  # or "v2"
    index_checksum: bool = True  # the shard index ends with its crc32c
    chunk_checksum: bool = False  # each raw stored chunk ends with a crc32c (checked: gdsload.codecs.verify)
    #: The bytes-to-bytes codecs after ``bytes``, in stored order, as (name, configuration): empty for raw
    #: chunks. A compressed chunk's stored length varies (the chunk table keeps each one's).
    codecs: tuple[tuple[str, Any], ...] = ()

    @property
    def compressed(self) -> bool:
        return bool(self.codecs)

    @property
    def codec_names(self) -> list[str]:
        """The chunks' codecs as zarr names them, ``bytes`` first."""
        return ["bytes", *(n for n, _ in self.codecs)] if self.codecs else ["bytes"] + (
            ["crc32c"] if self.chunk_checksum else [])

    @property
    def num_chunks(self) -> int:
        return -(-self.num_rows // self.samples_per_block)

    @property
    def num_shards(self) -> int:
        """Files the chunk grid implies (for an unsharded array, one per chunk)."""
        return shard_files(self.num_rows, self.samples_per_block, self.blocks_per_shard)

    @property
    def sample_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.sample_shape)  # on the reader's hot path: no numpy call

    @property
    def block_bytes(self) -> int:
        """Bytes of one chunk's data (what is read of a raw chunk; what a compressed one decodes to)."""
        return self.sample_bytes * self.samples_per_block

    @property
    def stored_bytes(self) -> int:
        """Bytes of one raw chunk as stored: its data, and the crc32c after it if the array has one (a
        compressed chunk's length is in the chunk table)."""
        return self.block_bytes + (CRC_BYTES if self.chunk_checksum else 0)

    @property
    def index_bytes(self) -> int:
        return self.blocks_per_shard * INDEX_ENTRY_BYTES + (CRC_BYTES if self.index_checksum else 0)

    def shard_key(self, shard: int) -> str:
        """Chunk key of a file: ``c/<shard>/0/...`` (default encoding), ``<shard>.0...`` (v2)."""
        parts = ([] if self.key_encoding == "v2" else ["c"]) + [str(shard)] + ["0"] * len(self.sample_shape)
        return self.key_separator.join(parts)

    def shard_path(self, shard: int) -> str:
        return os.path.join(self.directory, self.shard_key(shard))

    def fill_bytes(self) -> bytes:
        return np.full(1, self.fill_value, dtype=self.dtype).tobytes()


#: The keys of a Zarr v3 array document; any other is an extension, which zarr judges.
ARRAY_KEYS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                        "fill_value", "codecs", "attributes", "storage_transformers", "dimension_names"})


def array_fill_value(where: str, doc: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The array's fill value, a value of ``dtype``. A document of the specification's keys only, whose fill
    value is a plain JSON number within range of its numeric type (or a JSON bool for ``bool``), is read
    here; anything else (extensions, "NaN" and the other spellings, complex values) zarr opens and judges,
    as :func:`zarr_fill_value`. Importing zarr costs a fresh process tenths of a second, which a dataset the
    converter wrote then never pays at open."""
    names = doc.get("dimension_names")
    if (set(doc) <= ARRAY_KEYS and isinstance(doc.get("attributes", {}), dict)
            and (names is None or (isinstance(names, list) and len(names) == len(shape)
                                   and all(n is None or isinstance(n, str) for n in names)))):
        v = doc.get("fill_value")
        if dtype.kind == "b" and type(v) is bool:
            return dtype.type(v)
        if dtype.kind in "iu" and type(v) is int and np.iinfo(dtype).min <= v <= np.iinfo(dtype).max:
            return dtype.type(v)
        if dtype.kind == "f" and type(v) in (int, float) and math.isfinite(v) and abs(v) <= np.finfo(dtype).max.item():
            return dtype.type(v)
    return zarr_fill_value(where, shape, dtype)


def zarr_fill_value(where: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
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


def unreadable_data_type(doc: dict[str, Any]) -> str | None:
    """An array document's data type, as messages show it, when it is one gdsload does not read (strings,
    bytes, objects, dates, structured types: named by a string or an object with a ``name``), else None. A
    malformed ``data_type`` is not one of these: :func:`read_array` refuses it."""
    data_type = doc.get("data_type")
    name = data_type.get("name") if isinstance(data_type, dict) else data_type
    if isinstance(name, str) and not (isinstance(data_type, str) and data_type in DTYPES):
        return show(name)
    return None


def read_array(directory: str, key: str, missing: str, strict: bool, num_rows: int | None = None,
               chunk_rows: int | None = None) -> FieldMeta:
    """Check the array in ``directory`` (named ``key`` in the group) and reduce it to a FieldMeta.

    ``strict``: a field of a converter-written dataset, which must have ``num_rows`` rows in chunks of
    ``chunk_rows`` when given (``None``: take them from the array, as for the values of a variable-length
    field). Otherwise a foreign array (see the module's docstring). ``missing`` says, for a missing
    ``zarr.json``, why it was expected.
    """
    where = os.path.join(directory, "zarr.json")
    doc = read_node(where, "array", missing)
    shape = as_shape(where, "shape", doc.get("shape"), 0)
    ndim = len(shape)
    dtype = DTYPES.get(doc["data_type"]) if isinstance(doc.get("data_type"), str) else None
    if dtype is None:
        raise fail(where, f"unsupported data type {show(doc.get('data_type'))} of field '{key}' (expected one of "
                          f"{list(DTYPES)}: gdsload reads numbers and bools); leave the field out of fields=")
    grid = chunk_shape(where, doc, ndim)
    encoding, sep = key_encoding(where, doc, allow_v2=not strict)
    if doc.get("storage_transformers") not in (None, []):
        raise fail(where, f"storage transformers are not supported (found {show(doc.get('storage_transformers'))})")
    codecs = [codec_entry(where, c) for c in as_list(where, "codecs", doc.get("codecs"))]
    sharded = bool(codecs) and codecs[0][0] == "sharding_indexed"
    if strict and [name for name, _ in codecs] != ["sharding_indexed"]:
        raise fail(where, f"expected one sharding_indexed codec, found {show([name for name, _ in codecs])}")
    if sharded:
        if len(codecs) > 1:
            raise fail(where, f"codecs after sharding_indexed ({show([n for n, _ in codecs[1:]])}) are not "
                              f"supported; {CONVERT_HINT}")
        chunk, (chunk_crc, chain), index_crc, location = _sharding(where, codecs[0][1], ndim, dtype, strict)
    else:
        chunk, index_crc, location = grid, False, "end"
        chunk_crc, chain = _chunk_codecs(where, codecs, "chunks", dtype)
    if strict:
        if num_rows is None or chunk_rows is None:
            num_rows, chunk_rows = shape[0], chunk[0]
        if shape[0] != num_rows:
            raise fail(where, f"expected {num_rows} samples on axis 0, found shape {shape}")
        if chunk != (chunk_rows, *shape[1:]):
            raise fail(where, f"inner chunk shape must be {(chunk_rows, *shape[1:])}, found {chunk}")
        if grid[1:] != shape[1:] or grid[0] % chunk_rows:
            raise fail(where, f"shards must split axis 0 only, in whole blocks of {chunk_rows}; found shard shape "
                              f"{grid}")
    else:
        _whole_samples(where, shape, grid, chunk, sharded)
    if math.prod(shape[1:]) == 0:
        raise fail(where, f"zero-size samples (sample shape {shape[1:]})")
    return FieldMeta(
        name=key,
        dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
        sample_shape=shape[1:],
        fill_value=array_fill_value(where, doc, shape, dtype),
        samples_per_block=chunk[0],
        blocks_per_shard=grid[0] // chunk[0] if sharded else 1,
        index_location=location,
        key_separator=sep,
        num_rows=shape[0],
        directory=directory,
        sharded=sharded,
        key_encoding=encoding,
        index_checksum=index_crc,
        chunk_checksum=chunk_crc,
        codecs=chain,
    )


def _sharding(where: str, cfg: dict[str, Any], ndim: int, dtype: np.dtype,
              strict: bool) -> tuple[tuple[int, ...], tuple[bool, Codecs], bool, str]:
    """Inner chunk shape, inner codecs (crc32c of raw chunks, compressors), index crc32c and index location
    of a ``sharding_indexed`` codec."""
    chunk = as_shape(where, "inner chunk_shape", cfg.get("chunk_shape"), 1, ndim)
    inner = [codec_entry(where, c) for c in as_list(where, "inner codecs", cfg.get("codecs"))]
    if strict:
        if [name for name, _ in inner] not in (["bytes"], ["bytes", "zstd"], ["bytes", "zstd", "crc32c"]):
            raise fail(where, f"inner chunks must be raw ('bytes' codec only) or 'bytes' then 'zstd' (then "
                              f"'crc32c'), found "
                              f"{show([n for n, _ in inner])}")
        endian = bytes_endian(where, inner[0][1])
        if endian != "little" and dtype.itemsize > 1:
            raise fail(where, f"inner chunks must be little endian, found {endian}")
    chunk_codecs = _chunk_codecs(where, inner, "inner chunks", dtype)
    index_codecs = [codec_entry(where, c) for c in as_list(where, "index_codecs", cfg.get("index_codecs"))]
    names = [n for n, _ in index_codecs]
    if names != ["bytes", "crc32c"] and (strict or names != ["bytes"]):
        expected = "['bytes', 'crc32c']" if strict else "['bytes', 'crc32c'] or ['bytes']"
        raise fail(where, f"shard index codecs must be {expected}, found {show(names)}")
    if bytes_endian(where, index_codecs[0][1]) != "little":
        raise fail(where, "shard index must be little endian, found big")
    location = cfg.get("index_location", "end")
    if location not in ("end", "start"):
        raise fail(where, f"index_location must be 'end' or 'start' (found {show(location)})")
    return chunk, chunk_codecs, len(names) == 2, location


def _chunk_codecs(where: str, codecs: list[tuple[Any, dict[str, Any]]], what: str, dtype: np.dtype
                  ) -> tuple[bool, Codecs]:
    """Check that an array's chunk codecs store whole samples: ``bytes`` (little endian, or any order for
    one-byte data), then nothing or ``crc32c`` (raw chunks), or bytes-to-bytes codecs gdsload decodes
    (:func:`gdsload.format.chunk_codecs.check_codec`). Returns whether a crc32c follows each raw chunk, and the
    bytes-to-bytes codecs of compressed chunks (empty for raw ones)."""
    names = [name for name, _ in codecs]
    if "transpose" in names:
        raise fail(where, f"{what} use a 'transpose' codec (stored in another axis order), which gdsload does not "
                          f"read; write the array without it or {CONVERT_HINT}")
    if "bytes" in names[1:]:
        raise fail(where, f"{what} use array-to-array codec {show(names[0])} (before 'bytes'), which gdsload does "
                          f"not read; write the array without it or {CONVERT_HINT}")
    if not names or names[0] != "bytes":
        found = "nested sharding" if names and names[0] == "sharding_indexed" else f"codecs {show(names)}"
        raise fail(where, f"{what} must be stored raw by the 'bytes' codec, found {found}; {CONVERT_HINT}")
    if bytes_endian(where, codecs[0][1]) != "little" and dtype.itemsize > 1:
        raise fail(where, f"{what} hold big-endian data (bytes codec endian 'big'), which gdsload does not read; "
                          f"{CONVERT_HINT}")
    rest = names[1:]
    if rest in ([], ["crc32c"]):
        return bool(rest), ()
    for name, cfg in codecs[1:]:
        check_codec(where, name, cfg)
    return False, tuple((str(name), cfg) for name, cfg in codecs[1:])


def _whole_samples(where: str, shape: tuple[int, ...], grid: tuple[int, ...], chunk: tuple[int, ...],
                   sharded: bool) -> None:
    """A foreign array must have samples and keep each one whole in one chunk (and one shard)."""
    if len(shape) < 1 or shape[0] < 1:
        raise fail(where, f"no samples along axis 0 (shape {shape})")
    for what, part in (("shards", grid), ("inner chunks", chunk)) if sharded else (("chunks", chunk),):
        if part[1:] != shape[1:]:
            raise fail(where, f"{what} of shape {part} split the samples of shape {shape[1:]} (gdsload reads whole "
                              f"samples: {what} must be (n, *{shape[1:]})); rechunk the array or {CONVERT_HINT}")
    if sharded and grid[0] % chunk[0]:
        raise fail(where, f"shard shape {grid} is not a whole number of inner chunks {chunk}")
