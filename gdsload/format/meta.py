"""The on-disk format's metadata: a Zarr v3 group of arrays read along the sample axis, as a :class:`DatasetMeta`.

A group whose attributes carry a ``gdsload`` entry (:data:`ATTRS_KEY`) is a dataset the converter wrote
(docs/format.md); any other Zarr v3 group, or a single array, is a *foreign* store
(:mod:`gdsload.format.zarr_store`). :func:`read_metadata` reads every ``zarr.json`` with plain ``json`` and
checks it key by key (:mod:`gdsload.format.zarr_json`, :mod:`gdsload.format.arrays`). Errors: anything wrong on
disk is a FormatError (also a ValueError) whose one-line message starts with the offending path and ``': '``; an
I/O failure is a ReadError (also an OSError); no exception of json, numpy or zarr escapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from .zarr_json import as_int, as_object, check_whole_array, fail, is_int, read_json, show, valid_key, valid_name
from .arrays import INT_DTYPES, FieldMeta, read_array
from ..errors import FormatError
from .zarr_store import NOT_A_STORE, block_rows, read_store


#: Version of the ``gdsload`` group attribute this code reads and writes.
FORMAT_VERSION = 1
#: The group attribute that makes a Zarr v3 group a gdsload dataset.
ATTRS_KEY = "gdsload"
#: The one block checksum gdsload writes and checks.
CHECKSUM_ALGORITHM = "crc32c"
#: The group the writer puts the checksum arrays in (``_checksums/FIELD``); readers take each array's path
#: from the attributes, and look here too: checksums on disk that the attributes do not name are refused
#: (:func:`unnamed_checksums`), so editing the metadata cannot switch verification off.
CHECKSUMS_GROUP = "_checksums"
#: The keys the ``gdsload`` attribute may hold, each ``fields.NAME`` entry, and ``checksums`` (exactly what
#: :mod:`gdsload.conversion.writer` writes): any other key is refused, since a misspelled one would otherwise be
#: ignored (a garbled ``checksums`` would make a dataset look as if it had no checksums).
ATTRS_KEYS = ("format", "num_samples", "samples_per_block", "fields", "checksums")
FIELD_ENTRY_KEYS = ("kind", "image")
CHECKSUMS_KEYS = ("algorithm", "arrays")


@dataclass(frozen=True)
class RaggedMeta:
    """A variable-length field: ``NAME/values`` (all samples' elements back to back, sharded like any
    field) and ``NAME/offsets`` (int64, num_samples + 1: sample i is values[offsets[i]:offsets[i+1]])."""

    name: str
    values: FieldMeta
    #: An image field's formats (``"image": {"formats": [...]}`` in its entry): each sample is one encoded
    #: image file of one of them. Empty for other fields.
    image_formats: tuple[str, ...] = ()

    @property
    def offsets_key(self) -> str:
        return f"{self.name}/offsets"


@dataclass(frozen=True)
class DatasetMeta:
    """Group-level facts of a dataset, validated against every field's array metadata.

    ``samples_per_block`` is K, the plan's block: for a dataset the converter wrote, every field's rows per
    chunk; for a foreign store (``foreign``), a choice (:func:`gdsload.format.zarr_store.block_rows`) that each
    array's chunks need not match. ``checksums`` maps a field to the path (in the group) of its checksum
    array: uint32, one crc32c per block (a fixed field: of the block's bytes as decoded, padding included,
    which for a raw chunk are its stored bytes; a variable-length field: of the bytes of values rows
    ``[offsets[b*K], offsets[min((b+1)*K, N)])``). Empty when the dataset has none (always, for a foreign
    store).
    """

    path: str
    num_samples: int
    samples_per_block: int
    fields: dict[str, FieldMeta]
    ragged: dict[str, RaggedMeta] = dataclass_field(default_factory=dict)
    checksums: dict[str, str] = dataclass_field(default_factory=dict)
    foreign: bool = False  # no gdsload attribute: missing chunks and files read as the fill value

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)

    @property
    def names(self) -> list[str]:
        """Every field, fixed and variable-length, in the order the attributes list them (a foreign
        store: the order selected, else the arrays' paths sorted)."""
        return list(self.fields) + list(self.ragged)

    def array(self, key: str) -> FieldMeta:
        """The array at ``key``: a fixed field's name, or ``NAME/values``."""
        if key in self.fields:
            return self.fields[key]
        return self.ragged[key.rsplit("/", 1)[0]].values

    def shard_path(self, key: str, shard: int) -> str:
        return self.array(key).shard_path(shard)

    def num_shards(self, key: str) -> int:
        return self.array(key).num_shards

    def with_block(self, arrays: list[str]) -> DatasetMeta:
        """A foreign store's metadata with K chosen for reading ``arrays`` block by block (those not held
        whole: see :func:`gdsload.format.zarr_store.block_rows`); a converter-written dataset's, unchanged."""
        if not self.foreign:
            return self
        chosen = [self.fields[a] for a in arrays] or list(self.fields.values())
        return dataclasses.replace(self, samples_per_block=block_rows(chosen, self.num_samples))


def _known_keys(where: str, what: str, value: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Every key of the object ``what`` is one of ``allowed``: FormatError naming the first other one."""
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise fail(where, f"{what} has unknown key {show(unknown[0])} (expected keys among {list(allowed)}, "
                          f"found {show(list(value))})")


def _checksums_attr(where: str, value: Any, kinds: dict[str, str]) -> dict[str, str]:
    """``attrs["gdsload"]["checksums"]``: ``{"algorithm": "crc32c", "arrays": {FIELD: PATH}}``."""
    if value is None:
        return {}
    value = as_object(where, f"{ATTRS_KEY}.checksums", value)
    _known_keys(where, f"{ATTRS_KEY}.checksums", value, CHECKSUMS_KEYS)
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


def unnamed_checksums(path: str, where: str, fields: list[str], named: dict[str, str]) -> None:
    """Refuse a dataset whose ``_checksums/FIELD`` exists for a field its attributes name no checksum array
    for (``checksums`` removed, ``null``, or its ``arrays`` emptied or cut), or, for a group without the
    ``gdsload`` attribute (``fields`` empty), any ``_checksums/``: metadata that switches verification off while
    the checksums are still on disk was edited or damaged, and reading on would serve unchecked data.
    Refused rather than used: which of the two is right is not the reader's to guess, and a refusal names
    both. FormatError naming ``where`` (the group's zarr.json)."""
    group = os.path.join(path, CHECKSUMS_GROUP)
    if not os.path.lexists(group):
        return
    if not fields:
        raise fail(where, f"a group without the '{ATTRS_KEY}' attribute holding {CHECKSUMS_GROUP}/, a gdsload "
                          f"dataset's block checksums: its metadata was edited or damaged (verification would be "
                          f"off); restore the '{ATTRS_KEY}' attribute, or remove {group} to read it as a Zarr store")
    unnamed = [f for f in fields if f not in named and os.path.lexists(os.path.join(group, f))]
    if unnamed:
        arrays = {f: f"{CHECKSUMS_GROUP}/{f}" for f in fields if f in named or f in unnamed}
        raise fail(where, f"{ATTRS_KEY}.checksums names no checksum array for field(s) {unnamed}, but "
                          f"{CHECKSUMS_GROUP}/{unnamed[0]} exists: the metadata was edited or damaged (verification "
                          f"would be off); restore it (\"checksums\": "
                          f"{json.dumps({'algorithm': CHECKSUM_ALGORITHM, 'arrays': arrays})}), or remove "
                          f"{os.path.join(group, unnamed[0])} to read without checksums")


def read_metadata(path: str | os.PathLike[str], fields: list[str] | tuple[str, ...] | None = None) -> DatasetMeta:
    """Read and check a dataset's metadata: a converter-written group (its ``gdsload`` attributes and every
    field's arrays), or a foreign store (a group without them, or one array), of which only the arrays in
    ``fields`` (default: all) are checked and kept; a foreign store's K is chosen for all of them.

    Raises FormatError naming the offending ``zarr.json`` for anything gdsload cannot read.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "a file, not a dataset directory" if os.path.exists(path) else "no such dataset directory"
        raise FormatError(f"{path}: {what} ({NOT_A_STORE})")
    where = os.path.join(path, "zarr.json")
    if not os.path.lexists(where):
        raise fail(where, f"missing (not a Zarr v3 group or array; {NOT_A_STORE})")
    doc = read_json(where)
    fmt, node = doc.get("zarr_format"), doc.get("node_type")
    if not (is_int(fmt) and fmt == 3 and node in ("group", "array")):
        raise fail(where, f"not a Zarr v3 group or array (expected zarr_format 3 and node_type 'group' or 'array', "
                          f"found {show(fmt)} and {show(node)}; {NOT_A_STORE})")
    attrs = None
    if node == "group":
        attrs = as_object(where, "attributes", doc.get("attributes", {})).get(ATTRS_KEY)
    if attrs is None:
        if node == "group":
            unnamed_checksums(path, where, [], {})
        arrays, num_samples = read_store(path, node == "array", fields)
        return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=block_rows(list(arrays.values()),
                           num_samples), fields=arrays, foreign=True)
    attrs = as_object(where, f"attribute '{ATTRS_KEY}'", attrs)
    version = attrs.get("format")
    if not (is_int(version) and version == FORMAT_VERSION):
        raise fail(where, f"unsupported format version (expected {FORMAT_VERSION}, found {show(version)})")
    _known_keys(where, f"attribute '{ATTRS_KEY}'", attrs, ATTRS_KEYS)
    num_samples = as_int(where, f"{ATTRS_KEY}.num_samples", attrs.get("num_samples"), 1)
    spb = as_int(where, f"{ATTRS_KEY}.samples_per_block", attrs.get("samples_per_block"), 1)
    listed = as_object(where, f"{ATTRS_KEY}.fields", attrs.get("fields"))
    if not listed:
        raise fail(where, f"{ATTRS_KEY}.fields is empty (expected at least one field)")
    kinds: dict[str, str] = {}
    images: dict[str, tuple[str, ...]] = {}
    for name, entry in listed.items():
        if not valid_name(name):
            raise fail(where, f"invalid field name {show(name)} (expected a name without '/', not '.' or '..')")
        entry = as_object(where, f"{ATTRS_KEY}.fields.{name}", {} if entry is None else entry)
        _known_keys(where, f"{ATTRS_KEY}.fields.{name}", entry, FIELD_ENTRY_KEYS)
        kind = entry.get("kind", "fixed")
        if kind not in ("fixed", "ragged"):
            raise fail(where, f"field '{name}' has unknown kind {show(kind)} (expected 'fixed' or 'ragged')")
        kinds[name] = kind
        if entry.get("image") is not None:
            images[name] = _image_formats(where, name, kind, entry["image"])
    checksums = _checksums_attr(where, attrs.get("checksums"), kinds)
    unnamed_checksums(path, where, list(kinds), checksums)
    fixed, ragged = {}, {}
    for name, kind in kinds.items():
        missing = f"field '{name}' is listed in the group attributes but has no array "
        if kind == "fixed":
            fixed[name] = read_array(os.path.join(path, name), name, missing + name, True, num_samples, spb)
            continue
        key = f"{name}/values"
        ragged[name] = RaggedMeta(name, read_array(os.path.join(path, name, "values"), key, missing + key, True),
                                  images.get(name, ()))
        values = ragged[name].values
        if name in images and (values.dtype != "uint8" or values.sample_shape != ()):
            raise fail(os.path.join(path, name, "values", "zarr.json"), f"image field '{name}' must hold bytes "
                       f"(expected uint8 values of shape (), found {values.dtype} {values.sample_shape})")
        if ragged[name].values.compressed:  # read by rows, not whole chunks: they must stay raw
            raise fail(os.path.join(path, name, "values", "zarr.json"), f"the values of variable-length field "
                                                                       f"'{name}' must be raw (found codecs "
                                                                       f"{ragged[name].values.codec_names})")
        check_whole_array(os.path.join(path, name, "offsets", "zarr.json"),
                          f"variable-length field '{name}' has no offsets array",
                          f"{num_samples + 1} integer offsets", num_samples + 1, INT_DTYPES)
    return DatasetMeta(path=path, num_samples=num_samples, samples_per_block=spb, fields=fixed, ragged=ragged,
                       checksums=checksums)


def _image_formats(where: str, name: str, kind: str, value: Any) -> tuple[str, ...]:
    """A field entry's ``image``: ``{"formats": [FORMAT, ...]}``, on a variable-length field only."""
    from .image_header import FORMATS

    what = f"{ATTRS_KEY}.fields.{name}.image"
    value = as_object(where, what, value)
    _known_keys(where, what, value, ("formats",))
    formats = value.get("formats")
    if kind != "ragged":
        raise fail(where, f"{what}: only a variable-length field holds encoded images (field '{name}' is {kind})")
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        raise fail(where, f"{what}.formats must be a non-empty list of {list(FORMATS)} (found {show(formats)})")
    return tuple(formats)
