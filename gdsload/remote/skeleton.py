"""Fetching a remote dataset's skeleton into a folder: its metadata, small arrays and shard indexes, all checked.

Objects: every one a listing gives (S3: :func:`listing`, whose sizes and ETags pin every read), else (HTTP) the
metadata, then the shard files it names. A shard file becomes a sparse file of its full size holding only its
index. The server's metadata is hostile input, checked as a local dataset's is before anything is built from it,
and every shard index as a local open checks it: a bad object is an error naming its URL (docs/remote.md,
"Versions, and the cache folder"). :mod:`gdsload.remote.mirror` names the folder, keeps it and redacts messages.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, NamedTuple

from ..errors import FormatError, with_context
from .objects import NotFound, ObjectClient, ObjectInfo, join
from ..format.arrays import FieldMeta, read_array
from ..format.meta import ATTRS_KEY, CHECKSUMS_GROUP
from ..format.shard_index import chunk_table, parse_shard_index
from ..format.zarr_json import MAX_METADATA_BYTES, as_object, exc_text, fail, show, valid_key, valid_name

#: The marker a complete version holds (the URL, its identity, every object as first seen).
MARKER = ".gdsload-mirror.json"
#: Objects fetched (or looked at) at once.
FETCH_THREADS = 16
#: Bytes of one ranged read: what a fetch holds in memory per thread.
PIECE_BYTES = 4 << 20


class Skeleton(NamedTuple):
    """What a fetch wrote: ``key -> [size, etag, keep_lo, keep_hi]`` of every object (whole objects keep
    ``0 .. size``), and the keys the metadata names that the server does not hold (HTTP only: a foreign
    array's chunks never written, read as the fill value)."""

    objects: dict[str, list]
    absent: list[str]


class Arrays(NamedTuple):
    """The arrays among the fetched metadata (prefix -> FieldMeta), those read whole at open (the offsets of
    variable-length fields, the block checksums), and the fields of a gdsload dataset (every shard file
    required, laid out as the converter writes it)."""

    meta: dict[str, FieldMeta]
    whole: set[str]
    strict: set[str]


def listing(client: ObjectClient, url: str) -> dict[str, ObjectInfo]:
    """Every object under ``url`` (a store that lists), by its key below it."""
    base = url.rstrip("/") + "/"
    return {o.url[len(base):]: o for o in client.list_info(url) if o.url.startswith(base)}


def fetch(client: ObjectClient, url: str, tmp: str, listed: dict[str, ObjectInfo] | None) -> Skeleton:
    """Fetch the skeleton of ``url`` into ``tmp``: from ``listed`` (:func:`listing`) where the store lists,
    else from what the metadata names."""
    if listed is not None:  # S3: every object under the URL, each read pinned to the listing's size and ETag
        if "zarr.json" not in listed:
            client.head(join(url, "zarr.json"))  # NotFound, naming it, as an open without a listing says
            raise FormatError(f"{url}: no zarr.json under this URL (not a dataset or Zarr store)")
        meta = sorted(k for k in listed if k.rsplit("/", 1)[-1] == "zarr.json")
        done = _fetch_whole(client, url, tmp, [listed[k] for k in meta], required=True)
        arrays = _arrays(url, tmp, meta)
        _check_listed(url, arrays, listed)
        todo = []
        for key in (k for k in listed if k not in done):
            prefix, fm, shard = _owner(key, arrays)
            todo.append((key, listed[key], fm, shard, prefix in arrays.strict))
        got, _ = _fetch_data(client, url, tmp, todo)
        return Skeleton({**done, **got}, [])
    done = _fetch_whole(client, url, tmp, [join(url, "zarr.json")], required=True)
    named, optional = _metadata_keys(url, tmp)
    done.update(_fetch_whole(client, url, tmp, [join(url, k) for k in named[1:]], required=True))
    done.update(_fetch_whole(client, url, tmp, [join(url, k) for k in optional], required=False))
    arrays = _arrays(url, tmp, [k for k in named + optional if k in done])
    _check_counts(url, arrays)  # before a key is made
    todo = []
    for prefix, fm in arrays.meta.items():
        whole, strict = prefix in arrays.whole, prefix in arrays.strict
        todo += [(_key(prefix, fm.shard_key(s)), None, None if whole else fm, s, strict) for s in range(fm.num_shards)]
    got, absent = _fetch_data(client, url, tmp, todo)
    return Skeleton({**done, **got}, absent)


# -- the metadata ----------------------------------------------------------------------------------------
def _root(url: str, tmp: str) -> dict:
    where = join(url, "zarr.json")
    with open(os.path.join(tmp, "zarr.json"), "rb") as f:
        try:
            doc = json.load(f)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{where}: not JSON ({exc_text(e)})") from None
    return as_object(where, "the metadata", doc)


def _metadata_keys(url: str, tmp: str) -> tuple[list[str], list[str]]:
    """The root ``zarr.json`` (fetched into ``tmp``) and, for a gdsload dataset's group, the ``zarr.json`` of
    every array it names; then those that may be there (each field's checksum array in the group the
    converter writes them to, whether or not the metadata names it)."""
    doc = _root(url, tmp)
    if doc.get("node_type") == "array":
        return ["zarr.json"], []
    named = named_arrays(url, doc)
    if named is None:
        raise FormatError(f"{url}: a Zarr group over HTTP(S) lists no arrays (only gdsload datasets name them): "
                          f"serve it from s3://, or convert it with 'gdsload shard'")
    arrays, _, fields = named
    sums = [f"{CHECKSUMS_GROUP}/{f}" for f in sorted(fields) if f"{CHECKSUMS_GROUP}/{f}" not in arrays]
    optional = [f"{CHECKSUMS_GROUP}/zarr.json", *(f"{a}/zarr.json" for a in sums)]
    return ["zarr.json", *[f"{a}/zarr.json" for a in arrays]], optional


def named_arrays(url: str, doc: dict) -> tuple[list[str], set[str], set[str]] | None:
    """The arrays a gdsload dataset's root document names, those of them read whole at open, and its field
    names; None for a document that is not a gdsload dataset's. Each value is type-checked as a local
    dataset's is (:func:`gdsload.format.meta.read_metadata`): a FormatError naming the URL and the key."""
    where = join(url, "zarr.json")
    if doc.get("node_type") == "array":
        return None
    attrs = as_object(where, "attributes", doc.get("attributes", {})).get(ATTRS_KEY)
    if attrs is None:
        return None
    attrs = as_object(where, f"attribute '{ATTRS_KEY}'", attrs)
    arrays, whole, fields = [], set(), set()
    for name, entry in as_object(where, f"{ATTRS_KEY}.fields", attrs.get("fields")).items():
        if not valid_name(name):
            raise fail(where, f"invalid field name {show(name)} (expected a name without '/', not '.' or '..')")
        entry = as_object(where, f"{ATTRS_KEY}.fields.{name}", {} if entry is None else entry)
        kind = entry.get("kind", "fixed")
        if kind == "ragged":
            arrays += [f"{name}/values", f"{name}/offsets"]
            whole.add(f"{name}/offsets")
        elif kind == "fixed":
            arrays.append(name)
        else:
            raise fail(where, f"field '{name}' has unknown kind {show(kind)} (expected 'fixed' or 'ragged')")
        fields.add(name)
    sums = attrs.get("checksums")
    if sums is not None:
        sums = as_object(where, f"{ATTRS_KEY}.checksums", sums)
        for name, key in as_object(where, f"{ATTRS_KEY}.checksums.arrays", sums.get("arrays")).items():
            if not valid_key(key):
                raise fail(where, f"checksum array of field {show(name)} must be a relative path inside the "
                                  f"dataset (found {show(key)})")
            arrays.append(key)
            whole.add(key)
    return arrays, whole, fields


def _arrays(url: str, tmp: str, meta_keys: list[str]) -> Arrays:
    """The arrays among the fetched metadata. A field of a gdsload dataset whose array cannot be read is an
    error now, naming its URL (the open would refuse it); another is left out, its files then fetched whole."""
    named = named_arrays(url, _root(url, tmp))
    whole = named[1] if named else set()
    strict = {f"{a}/values" if f"{a}/values" in named[0] else a for a in named[2]} if named else set()
    arrays = {}
    for key in meta_keys:
        prefix = key[:-len("zarr.json")].rstrip("/")
        local = os.path.join(tmp, *prefix.split("/")) if prefix else tmp
        try:
            arrays[prefix] = read_array(local, prefix, "named by the dataset's metadata", False)
        except FormatError as e:
            if prefix in strict:
                raise FormatError(str(e).replace(os.path.join(local, "zarr.json"), join(url, key))) from None
            continue  # a group, or an array the dataset's open will judge
    if named:  # the converter's checksum arrays are read whole at open, whether or not the metadata names them
        whole |= {p for p in arrays if p.startswith(CHECKSUMS_GROUP + "/") and p not in strict}
    return Arrays(arrays, whole, strict)


def _key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def _owner(key: str, arrays: Arrays) -> tuple[str, FieldMeta | None, int | None]:
    """The array whose chunk file ``key`` is, its FieldMeta (None: fetched whole) and the shard's number
    (None: not one of its chunk keys)."""
    parts = key.split("/")
    for n in range(len(parts) - 1, -1, -1):
        prefix = "/".join(parts[:n])
        if prefix in arrays.meta:
            fm = arrays.meta[prefix]
            return prefix, None if prefix in arrays.whole else fm, shard_number(fm, "/".join(parts[n:]))
    return "", None, None


def shard_number(fm: FieldMeta, rel: str) -> int | None:
    """The shard whose chunk key (below the array's folder) ``rel`` is, or None."""
    parts = rel.split(fm.key_separator)
    if fm.key_encoding != "v2":
        if parts[:1] != ["c"]:
            return None
        parts = parts[1:]
    if len(parts) != 1 + len(fm.sample_shape) or not parts[0].isascii() or not parts[0].isdigit():
        return None
    s = int(parts[0])
    return s if s < fm.num_shards and fm.shard_key(s) == rel else None


# -- bounds on what the metadata implies -----------------------------------------------------------------
def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def _tables(url: str, prefix: str, fm: FieldMeta) -> None:
    """An array whose chunk table and per-sample tables exceed this machine's memory is refused (as a local
    foreign store's is at open)."""
    need, memory = max(fm.num_chunks * 24, fm.num_rows * 8), _memory_bytes()
    if need > memory:
        raise fail(join(url, prefix, "zarr.json"), f"shape ({fm.num_rows}, ...) in chunks of {fm.samples_per_block} "
                                                  f"rows needs {need} bytes of tables, more than this machine's "
                                                  f"memory ({memory} bytes)")


def _check_counts(url: str, arrays: Arrays) -> None:
    """Without a listing: the shard files every array's shape implies, bounded before a key is made, by the
    descriptors the open of the dataset would need (one per file, as a local dataset's is) and the memory."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = (1 << 62) if limit == resource.RLIM_INFINITY else limit
    total = 0
    for prefix, fm in arrays.meta.items():
        _tables(url, prefix, fm)
        total += fm.num_shards
        if total > limit:
            raise fail(join(url, prefix, "zarr.json"),
                       f"shape ({fm.num_rows}, ...) in shards of {fm.blocks_per_shard * fm.samples_per_block} rows "
                       f"makes {total} shard files in all, more than this process may open (limit {limit})")


def _check_listed(url: str, arrays: Arrays, listed: dict[str, ObjectInfo]) -> None:
    """With a listing: a field of a gdsload dataset must have every shard file its shape implies (counted in
    the listing before a key is made, as a local dataset's folder is); every array's tables must fit."""
    for prefix, fm in arrays.meta.items():
        _tables(url, prefix, fm)
        if prefix not in arrays.strict:
            continue
        below = prefix + "/"
        found = {shard_number(fm, k[len(below):]) for k in listed if k.startswith(below)} - {None}
        n = fm.num_shards
        if len(found) < n:
            if n > len(listed):  # more than the listing names: the shape is refused before a key is made
                raise fail(join(url, prefix, "zarr.json"),
                           f"expected {n} shard files, found {len(found)} (shape ({fm.num_rows}, ...) in shards of "
                           f"{fm.blocks_per_shard * fm.samples_per_block} rows, under {join(url, prefix)})")
            missing = next(s for s in range(n) if s not in found)  # n is bounded by the listing here
            raise NotFound(f"{join(url, prefix, fm.shard_key(missing))}: no such object (a shard file of field "
                           f"{show(prefix)}: its metadata names {n}, the listing of {url} has {len(found)})")


# -- fetching --------------------------------------------------------------------------------------------
def check_key(url: str, key: str) -> None:
    if key == MARKER or any(part in ("", ".", "..") for part in key.split("/")):
        raise FormatError(f"{join(url, key)}: an object key that leaves the dataset's folder")


def _fetch_whole(client: ObjectClient, url: str, tmp: str, objects: list, required: bool) -> dict[str, list]:
    """Fetch ``objects`` (URLs, or ObjectInfo as listed) whole into ``tmp``, on threads, each read pinned (a
    missing object is passed over unless ``required``; a ``zarr.json`` larger than a local one may be is
    refused by its size before a byte of it is read)."""
    base = url.rstrip("/") + "/"

    def one(o: ObjectInfo | str) -> tuple[str, list] | None:
        key = (o if isinstance(o, str) else o.url)[len(base):]
        check_key(url, key)
        try:
            info = client.head(o) if isinstance(o, str) else o
        except NotFound as e:
            if required:
                raise with_context(e, "named by the dataset's metadata") from None
            return None
        if key.rsplit("/", 1)[-1] == "zarr.json" and info.size > MAX_METADATA_BYTES:
            raise FormatError(f"{info.url}: {info.size} bytes, more than a zarr.json may be "
                              f"({MAX_METADATA_BYTES} bytes): not the metadata of a dataset")
        with _create(tmp, key) as f:
            for offset in range(0, info.size, PIECE_BYTES):
                f.write(client.read(info, offset, min(PIECE_BYTES, info.size - offset)))
        return key, [info.size, info.etag, 0, info.size]

    return dict(r for r in parallel(one, objects) if r is not None)


def _fetch_data(client: ObjectClient, url: str, tmp: str,
                todo: list[tuple[str, ObjectInfo | None, FieldMeta | None, int | None, bool]]
                ) -> tuple[dict[str, list], list[str]]:
    """Write each data object into ``tmp``: a shard file as a sparse file of its size holding its index
    (checked), an unsharded chunk file as a sparse file, anything else (no FieldMeta) whole. A missing
    object is an error for a field of a gdsload dataset (``strict``), else passed over and returned as
    absent (a foreign array's chunk never written reads as the fill value)."""
    def one(item: tuple[str, ObjectInfo | None, FieldMeta | None, int | None, bool]) -> tuple[str, list | None]:
        key, info, fm, shard, strict = item
        check_key(url, key)
        try:
            if fm is None:
                got = _fetch_whole(client, url, tmp, [info or join(url, key)], required=strict)
                return key, got.get(key)
            n = fm.index_bytes if fm.sharded else 0
            if info is None and fm.index_location == "end" and n:
                info, tail = client.read_end(join(url, key), n)
                lo = info.size - len(tail)
            else:
                info = info or client.head(join(url, key))
                lo = max(0, info.size - n) if fm.index_location == "end" and n else 0
                tail = client.read(info, lo, min(n, info.size))
        except NotFound as e:
            if strict:
                raise with_context(e, "a shard file the dataset's metadata names") from None
            return key, None
        if shard is not None:
            _check_index(join(url, key), info.size, tail, fm, shard, strict)
        with _create(tmp, key) as f:
            f.truncate(info.size)
            os.pwrite(f.fileno(), tail, lo)
        return key, [info.size, info.etag, lo, lo + len(tail)]

    got = dict(parallel(one, todo))
    return {k: v for k, v in got.items() if v is not None}, sorted(k for k, v in got.items() if v is None)


def _check_index(where: str, size: int, index: bytes, fm: FieldMeta, shard: int, strict: bool) -> None:
    """The checks the open makes of a shard's index (:class:`gdsload.format.layout.DatasetLayout`), on the
    bytes just fetched, so that an error names the object's URL and nothing is kept of it."""
    if not fm.sharded:
        if not fm.compressed and size != fm.stored_bytes:
            raise FormatError(f"{where}: chunk file is {size} bytes (expected {fm.stored_bytes}: raw, uncompressed)")
        return
    if len(index) < fm.index_bytes:
        raise FormatError(f"{where}: shard file is {size} bytes, smaller than its index ({fm.index_bytes} bytes)")
    table = parse_shard_index(index, fm.blocks_per_shard, where, fm.index_checksum).offsets_and_lengths
    n = min(fm.blocks_per_shard, fm.num_chunks - shard * fm.blocks_per_shard)
    chunk_table(where, table, size, fm, allow_empty=not strict, n_chunks=n, tiled=strict)


def parallel(one: Callable[[Any], Any], items: list) -> list:
    """``one`` of every item, on up to :data:`FETCH_THREADS` threads, in order; the first error is raised once
    the calls running end (those not begun are dropped: a failed fetch does not go on to the last object)."""
    if not items:
        return []
    pool = ThreadPoolExecutor(min(FETCH_THREADS, len(items)), thread_name_prefix="gdsload-fetch")
    try:
        return list(pool.map(one, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _create(tmp: str, key: str) -> BinaryIO:
    path = os.path.join(tmp, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "wb")
