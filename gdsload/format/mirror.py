"""A remote dataset (``s3://`` or ``http(s)://``) mirrored into a node-local cache, then read as a local one.

The mirror of a URL is a folder of the cache named after the URL and the ETag of its root ``zarr.json``: one
per version of the dataset, never changed once complete, so a dataset open on an older version keeps reading
it while a newer one is fetched beside it. It is made once per node: the ranks of a node take a file lock,
the first fetches while the others wait, and later opens find it complete. It is written in a folder of its
own and renamed into place whole, with a marker naming the URL and the ETag, so an interrupted fetch leaves
nothing that looks complete. A server that sends no ETag is fetched again at every open, into the one folder
of that URL. Which objects to fetch: every object under the
URL where the store lists them (S3); else (HTTP) the dataset's metadata is fetched first, then the shard
files it names (a gdsload dataset's group names its arrays; a foreign group over HTTP cannot be listed).
What the objects hold is checked as a local dataset's is: every shard index at open, blocks as they are read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from ..errors import FormatError, ReadError
from ..remote import client_for
from ..remote.objects import NotFound, ObjectClient, join
from .arrays import read_array
from .meta import ATTRS_KEY

#: The marker a complete mirror holds (the URL, the root zarr.json's ETag, the objects fetched).
MARKER = ".gdsload-mirror.json"
#: Objects fetched at once.
FETCH_THREADS = 16
#: Bytes of one ranged read of an object: what a fetch holds in memory per thread.
PIECE_BYTES = 16 << 20


def mirror_path(url: str, cache_dir: str, etag: str | None = None) -> str:
    """The folder of ``url``'s mirror in ``cache_dir``: its last path segment, after a digest of the URL, and
    ``@`` a digest of the root zarr.json's ETag where there is one."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "dataset"
    version = f"@{hashlib.sha256(etag.encode()).hexdigest()[:12]}" if etag is not None else ""
    return os.path.join(cache_dir, f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}{version}")


def mirror(url: str, cache_dir: str) -> str:
    """The local folder holding the dataset at ``url``, fetched into ``cache_dir`` unless a complete mirror
    of the same root ``zarr.json`` is there. ReadError naming the URL (and the HTTP status) when an object
    cannot be fetched; nothing half-written is left where a later open would take it."""
    client = client_for(url)
    os.makedirs(cache_dir, exist_ok=True)
    with open(mirror_path(url, cache_dir) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here, then find the mirror complete
        etag = client.head(join(url, "zarr.json")).etag
        root = mirror_path(url, cache_dir, etag)
        if _complete(root, url, etag):
            return root
        tmp = f"{root}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            keys = _fetch_all(client, url, tmp)
            now = client.head(join(url, "zarr.json")).etag
            if now != etag:  # rewritten meanwhile: the objects may be of two versions
                raise ReadError(f"{join(url, 'zarr.json')}: changed while the dataset was fetched (ETag {etag}, "
                                f"now {now}); open it again once it is written")
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump({"url": url, "etag": etag, "objects": sorted(keys)}, f)
            if os.path.exists(root):  # only where the server sends no ETag: that URL's one folder
                old = f"{root}.old-{os.getpid()}"
                os.replace(root, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _complete(root: str, url: str, etag: str | None) -> bool:
    try:
        with open(os.path.join(root, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return marker.get("url") == url and etag is not None and marker.get("etag") == etag


def _fetch_all(client: ObjectClient, url: str, tmp: str) -> list[str]:
    """Fetch the dataset's objects into ``tmp``; their keys (relative to ``url``)."""
    if client.lists:  # S3: every object under the URL; a failure to list is an error, not another route
        listed = client.list(url)
        base = url.rstrip("/") + "/"
        keys = [u[len(base):] for u in listed if u.startswith(base)]
        if "zarr.json" not in keys:
            raise FormatError(f"{url}: no zarr.json under this URL (not a dataset or Zarr store)")
        _fetch(client, url, tmp, keys, required=True)
        return keys
    meta_keys = _metadata_keys(client, url, tmp)
    data_keys = []
    for key in meta_keys:
        directory = os.path.join(tmp, os.path.dirname(key))
        fm = read_array(directory, os.path.dirname(key), "named by the dataset's metadata", False)
        prefix = os.path.dirname(key)
        data_keys += [f"{prefix}/{fm.shard_key(s)}" if prefix else fm.shard_key(s) for s in range(fm.num_shards)]
    return meta_keys + _fetch(client, url, tmp, data_keys, required=False)


def _metadata_keys(client: ObjectClient, url: str, tmp: str) -> list[str]:
    """The root ``zarr.json`` and, for a gdsload dataset's group, its arrays' (fetched into ``tmp``): the
    keys of the arrays' ``zarr.json`` files."""
    _fetch(client, url, tmp, ["zarr.json"], required=True)
    with open(os.path.join(tmp, "zarr.json")) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise FormatError(f"{join(url, 'zarr.json')}: not JSON ({e})") from None
    if doc.get("node_type") == "array":
        return ["zarr.json"]
    attrs = (doc.get("attributes") or {}).get(ATTRS_KEY)
    if not isinstance(attrs, dict):
        raise FormatError(f"{url}: a Zarr group over HTTP(S) lists no arrays (only gdsload datasets name them): "
                          f"serve it from s3://, or convert it with 'gdsload shard'")
    arrays = []
    for name, entry in (attrs.get("fields") or {}).items():
        kind = (entry or {}).get("kind", "fixed")
        arrays += [f"{name}/values", f"{name}/offsets"] if kind == "ragged" else [name]
    arrays += list(((attrs.get("checksums") or {}).get("arrays") or {}).values())
    keys = [f"{a}/zarr.json" for a in arrays]
    _fetch(client, url, tmp, keys, required=True)
    return keys


def _fetch(client: ObjectClient, url: str, tmp: str, keys: list[str], required: bool) -> list[str]:
    """Fetch ``keys`` into ``tmp`` on threads; the keys fetched (a missing object is passed over unless
    ``required``: a shard never written reads as the fill value)."""
    def one(key: str) -> str | None:
        if key == MARKER or any(part in ("", ".", "..") for part in key.split("/")):
            raise FormatError(f"{join(url, key)}: an object key that leaves the dataset's folder")
        try:
            info = client.head(join(url, key))
        except NotFound:
            if required:
                raise
            return None
        path = os.path.join(tmp, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:  # in pieces, each pinned to the object first seen (ObjectChanged otherwise)
            for offset in range(0, info.size, PIECE_BYTES):
                f.write(client.read(info, offset, min(PIECE_BYTES, info.size - offset)))
        return key

    with ThreadPoolExecutor(min(FETCH_THREADS, max(1, len(keys))), thread_name_prefix="gdsload-fetch") as pool:
        return [k for k in pool.map(one, keys) if k is not None]
