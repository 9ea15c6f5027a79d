"""The skeleton of a remote dataset (``s3://`` or ``http(s)://``) in a node-local cache: what opening it needs,
fetched once per node; the shards' data is fetched later, as ranks read it (:mod:`gdsload.format.shard_cache`).

A *version* of a URL is a folder of the cache named after the URL and the ETag of its root ``zarr.json``,
holding the dataset's tree: every metadata file and every small array read whole at open (the offsets of
variable-length fields, the block checksums) in full, and every shard file as a sparse file of its full size
holding only its index, written in place (in Zarr sharding the index lies at the end of the file; a ranged GET
of the last bytes gives the object's size, ETag and index at once). A marker lists every object with the
size and ETag it had then: the shard cache fetches the rest of each pinned to them (``If-Match``), so a shard
replaced on the server is ``ObjectChanged``, never mixed into an epoch. The skeleton is made once per node
under a file lock (the node's other ranks wait, then find it complete), in a folder of its own renamed into
place whole with the marker, so an interrupted fetch leaves nothing that looks complete; shard files are
never renamed afterwards, so the descriptors a dataset holds see the bytes the cache writes into them.
A version never changes once made: a new root ``zarr.json`` (another ETag) makes a new one beside it. A server
that sends no ETag pins nothing: every open then gets a private version, removed when it closes.
Which objects: every one under the URL where the store lists them (S3); else (HTTP) the metadata first,
then the shard files it names (a gdsload dataset's group names its arrays; a foreign group cannot be listed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, NamedTuple

from ..errors import FormatError, ReadError
from ..remote import client_for
from ..remote.objects import NotFound, ObjectClient, ObjectInfo, join
from .arrays import FieldMeta, read_array
from .meta import ATTRS_KEY

#: The marker a complete version holds (the URL, the root zarr.json's ETag, every object as first seen).
MARKER = ".gdsload-mirror.json"
#: Objects fetched at once while a version is made.
FETCH_THREADS = 16
#: Bytes of one ranged read: what a fetch holds in memory per thread.
PIECE_BYTES = 4 << 20
#: Suffix of a version's folder of cache state (locks, present markers; :mod:`gdsload.format.shard_cache`).
STATE = ".shards"
#: The version name of an open on a server that sends no ETag (followed by a unique token).
PRIVATE = "@private-"


class Entry(NamedTuple):
    """A shard file of a version: its object pinned (size, ETag), its local path, and the bytes ``keep_lo ..
    keep_hi`` fetched with the skeleton (its index), which the cache never evicts; the rest is its data."""

    info: ObjectInfo
    key: str
    path: str
    keep_lo: int
    keep_hi: int

    @property
    def data_bytes(self) -> int:
        return self.info.size - (self.keep_hi - self.keep_lo)


class Version(NamedTuple):
    """A version's folder, the root ETag it is of (None: private), and its shard files by local path."""

    url: str
    root: str
    etag: str | None
    shards: dict[str, Entry]


def mirror_path(url: str, cache_dir: str, etag: str | None = None) -> str:
    """The folder of ``url``'s version in ``cache_dir``: its last path segment, after a digest of the URL, and
    ``@`` a digest of the root zarr.json's ETag where there is one."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "dataset"
    version = f"@{hashlib.sha256(etag.encode()).hexdigest()[:12]}" if etag is not None else ""
    return os.path.join(cache_dir, f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}{version}")


def mirror(url: str, cache_dir: str) -> str:
    """The folder of the version of ``url`` that the server holds now (see :func:`open_version`)."""
    return open_version(url, cache_dir).root


def open_version(url: str, cache_dir: str, timeout_s: float | None = None) -> Version:
    """The version of ``url`` the server holds now, its skeleton fetched into ``cache_dir`` unless complete
    there (each request within ``timeout_s``, None: the client's default). ReadError naming the URL (and the
    HTTP status) when an object cannot be fetched; nothing half-written is left where a later open would take it."""
    client = client_for(url, timeout_s)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(mirror_path(url, cache_dir) + ".lock", "a")
    except OSError as e:
        raise ReadError(f"{cache_dir}: cannot make the cache folder ({e.strerror or e})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here, then find the version complete
        etag = client.head(join(url, "zarr.json")).etag
        root = mirror_path(url, cache_dir, etag)
        if etag is None:
            _remove_stale_private(root)
            root = f"{root}{PRIVATE}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        marker = _marker(root, url, etag)
        if marker is None:
            tmp = f"{root}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                objects = _fetch_skeleton(client, url, tmp)
                now = client.head(join(url, "zarr.json")).etag
                if now != etag:  # rewritten meanwhile: the objects may be of two versions
                    raise ReadError(f"{join(url, 'zarr.json')}: changed while the dataset was opened (ETag {etag}, "
                                    f"now {now}); open it again once it is written")
                marker = {"url": url, "etag": etag, "objects": objects}
                with open(os.path.join(tmp, MARKER), "w") as f:
                    json.dump(marker, f)
                    f.flush()
                    os.fsync(f.fileno())
                shutil.rmtree(root + STATE, ignore_errors=True)  # a crashed version's state: of no file now
                os.replace(tmp, root)
            except OSError as e:
                raise ReadError(f"{cache_dir}: cannot write the dataset's skeleton into the cache "
                                f"({e.strerror or e}): free space there, or choose another cache_dir") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    shards = {}
    for key, (size, tag, lo, hi) in marker["objects"].items():
        if (lo, hi) != (0, size):
            path = os.path.join(root, *key.split("/"))
            shards[path] = Entry(ObjectInfo(join(url, key), size, tag), key, path, lo, hi)
    return Version(url, root, etag, shards)


def _marker(root: str, url: str, etag: str | None) -> dict | None:
    """The marker of a complete version of ``url`` at ``root``, or None."""
    try:
        with open(os.path.join(root, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    ok = marker.get("url") == url and etag is not None and marker.get("etag") == etag
    return marker if ok and isinstance(marker.get("objects"), dict) else None


def _remove_stale_private(base: str) -> None:
    """Remove the private versions of ``base`` no open dataset holds (their owner crashed)."""
    folder, name = os.path.split(base)
    for entry in os.listdir(folder):
        if entry.startswith(name + PRIVATE) and not entry.endswith((STATE, ".lock")) and ".tmp-" not in entry:
            root = os.path.join(folder, entry)
            try:
                fd = os.open(os.path.join(root + STATE, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # open somewhere
            finally:
                os.close(fd)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(root + STATE, ignore_errors=True)


def _check_key(url: str, key: str) -> None:
    if key == MARKER or any(part in ("", ".", "..") for part in key.split("/")):
        raise FormatError(f"{join(url, key)}: an object key that leaves the dataset's folder")


def _fetch_skeleton(client: ObjectClient, url: str, tmp: str) -> dict[str, list]:
    """Fetch the skeleton into ``tmp``: ``key -> [size, etag, keep_lo, keep_hi]`` of every object (whole
    objects keep ``0 .. size``)."""
    if client.lists:  # S3: every object under the URL; a failure to list is an error, not another route
        base = url.rstrip("/") + "/"
        listed = {o.url[len(base):]: o for o in client.list_info(url) if o.url.startswith(base)}
        if "zarr.json" not in listed:
            raise FormatError(f"{url}: no zarr.json under this URL (not a dataset or Zarr store)")
        meta = [k for k in listed if k.rsplit("/", 1)[-1] == "zarr.json"]
        done = _fetch_whole(client, url, tmp, [listed[k] for k in meta], required=True)
        arrays, whole = _arrays(url, tmp, meta)
        data = [k for k in listed if k not in done]
        return {**done, **_fetch_data(client, url, tmp, [(k, listed[k], _owner(k, arrays, whole)) for k in data])}
    done = _fetch_whole(client, url, tmp, [join(url, "zarr.json")], required=True)
    meta_keys = _metadata_keys(url, tmp)
    done.update(_fetch_whole(client, url, tmp, [join(url, k) for k in meta_keys[1:]], required=True))
    arrays, whole = _arrays(url, tmp, meta_keys)
    todo = []
    for prefix, fm in arrays.items():
        todo += [(f"{prefix}/{fm.shard_key(s)}" if prefix else fm.shard_key(s), None, None if prefix in whole else fm)
                 for s in range(fm.num_shards)]
    return {**done, **_fetch_data(client, url, tmp, todo)}


def _metadata_keys(url: str, tmp: str) -> list[str]:
    """The root ``zarr.json`` (fetched into ``tmp``) and, for a gdsload dataset's group, the ``zarr.json`` of
    every array it names."""
    doc = _root(url, tmp)
    if doc.get("node_type") == "array":
        return ["zarr.json"]
    attrs = (doc.get("attributes") or {}).get(ATTRS_KEY)
    if not isinstance(attrs, dict):
        raise FormatError(f"{url}: a Zarr group over HTTP(S) lists no arrays (only gdsload datasets name them): "
                          f"serve it from s3://, or convert it with 'gdsload shard'")
    return ["zarr.json", *[f"{a}/zarr.json" for a in _named_arrays(attrs)[0]]]


def _root(url: str, tmp: str) -> dict:
    with open(os.path.join(tmp, "zarr.json")) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise FormatError(f"{join(url, 'zarr.json')}: not JSON ({e})") from None
    return doc if isinstance(doc, dict) else {}


def _named_arrays(attrs: dict) -> tuple[list[str], set[str]]:
    """The arrays a gdsload dataset's attributes name, and those of them read whole at open (the offsets of
    variable-length fields, the block checksums)."""
    arrays, whole = [], set()
    for name, entry in (attrs.get("fields") or {}).items():
        if (entry or {}).get("kind", "fixed") == "ragged":
            arrays += [f"{name}/values", f"{name}/offsets"]
            whole.add(f"{name}/offsets")
        else:
            arrays.append(name)
    sums = list(((attrs.get("checksums") or {}).get("arrays") or {}).values())
    return arrays + sums, whole | set(sums)


def _arrays(url: str, tmp: str, meta_keys: list[str]) -> tuple[dict[str, FieldMeta], set[str]]:
    """The arrays among the fetched metadata (prefix -> FieldMeta; one that cannot be read is left out, its
    files then fetched whole) and the prefixes of those read whole at open."""
    attrs = (_root(url, tmp).get("attributes") or {}).get(ATTRS_KEY)
    whole = _named_arrays(attrs)[1] if isinstance(attrs, dict) else set()
    arrays = {}
    for key in meta_keys:
        prefix = key[:-len("zarr.json")].rstrip("/")
        try:
            arrays[prefix] = read_array(os.path.join(tmp, *prefix.split("/")) if prefix else tmp, prefix,
                                        "named by the dataset's metadata", False)
        except FormatError:
            continue  # a group, or an array the dataset's open will judge
    return arrays, whole


def _owner(key: str, arrays: dict[str, FieldMeta], whole: set[str]) -> FieldMeta | None:
    """The array whose chunk file ``key`` is (None: fetched whole)."""
    parts = key.split("/")
    for n in range(len(parts) - 1, -1, -1):
        prefix = "/".join(parts[:n])
        if prefix in arrays:
            return None if prefix in whole else arrays[prefix]
    return None


def _fetch_whole(client: ObjectClient, url: str, tmp: str, objects: list, required: bool) -> dict[str, list]:
    """Fetch ``objects`` (URLs, or ObjectInfo as listed) whole into ``tmp``, on threads (a missing object is
    passed over unless ``required``)."""
    base = url.rstrip("/") + "/"

    def one(o: ObjectInfo | str) -> tuple[str, list] | None:
        key = (o if isinstance(o, str) else o.url)[len(base):]
        _check_key(url, key)
        try:
            info = client.head(o) if isinstance(o, str) else o
        except NotFound:
            if required:
                raise
            return None
        with _create(tmp, key) as f:
            for offset in range(0, info.size, PIECE_BYTES):
                f.write(client.read(info, offset, min(PIECE_BYTES, info.size - offset)))
        return key, [info.size, info.etag, 0, info.size]

    with ThreadPoolExecutor(min(FETCH_THREADS, max(1, len(objects))), thread_name_prefix="gdsload-fetch") as pool:
        return dict(r for r in pool.map(one, objects) if r is not None)


def _fetch_data(client: ObjectClient, url: str, tmp: str, todo: list[tuple[str, ObjectInfo | None, FieldMeta | None]]
                ) -> dict[str, list]:
    """Write each data object into ``tmp``: a shard file as a sparse file of its size holding its index, an
    unsharded chunk file as a sparse file, anything else (``None``) whole. A missing object is passed over
    (a shard never written reads as the fill value; the open judges one the dataset must have)."""
    def one(item: tuple[str, ObjectInfo | None, FieldMeta | None]) -> tuple[str, list] | None:
        key, info, fm = item
        _check_key(url, key)
        if fm is None:
            return next(iter(_fetch_whole(client, url, tmp, [info or join(url, key)], required=False).items()), None)
        try:
            if fm.sharded and fm.index_location == "end":
                info, tail = client.read_end(join(url, key), fm.index_bytes)
                lo, hi = info.size - len(tail), info.size
            else:
                info = info or client.head(join(url, key))
                lo, hi = 0, min(info.size, fm.index_bytes if fm.sharded else 0)
                tail = client.read(info, lo, hi - lo)
        except NotFound:
            return None
        with _create(tmp, key) as f:
            f.truncate(info.size)
            os.pwrite(f.fileno(), tail, lo)
        return key, [info.size, info.etag, lo, hi]

    with ThreadPoolExecutor(min(FETCH_THREADS, max(1, len(todo))), thread_name_prefix="gdsload-fetch") as pool:
        return dict(r for r in pool.map(one, todo) if r is not None)


def _create(tmp: str, key: str) -> BinaryIO:
    path = os.path.join(tmp, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "wb")
