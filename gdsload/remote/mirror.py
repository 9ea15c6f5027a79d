"""A remote dataset's version in the node's cache: its skeleton, made once per node, served while the server agrees.

:func:`open_version` looks at the server first (S3: one listing; HTTP: a HEAD of every object of the newest
version) and serves a version only while every object is unchanged, else fetches a new one beside it
(:mod:`gdsload.remote.skeleton`). A version is a folder named after the URL and a digest of every object's size
and ETag, made under the URL's file lock, renamed into place whole with its marker and never changed after; the
version returned is held (a shared lock on its ``open.lock``) for the shard cache. Every message is redacted
(:func:`gdsload.remote.objects.redact`). Why: docs/remote.md, its opening and "Versions, and the cache folder".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import urllib.parse
import uuid
from typing import NamedTuple

from ..errors import FormatError, GDSLoadError, ReadError, reworded
from . import client_for
from .objects import NotFound, ObjectClient, ObjectInfo, join, redact
from .skeleton import FETCH_THREADS, MARKER, PIECE_BYTES, Skeleton, fetch, listing, parallel

__all__ = ["FETCH_THREADS", "MARKER", "PIECE_BYTES", "PRIVATE", "STATE", "Entry", "Hold", "Version", "mirror",
           "mirror_path", "open_version", "read_marker", "named"]

#: Suffix of a version's folder of cache state (locks, present markers; :mod:`gdsload.remote.shard_cache`).
STATE = ".shards"
#: The version name of an open on a server that sends no ETag (followed by a unique token).
PRIVATE = "@private-"
#: The marker's format (a marker of another is not a version this code serves).
MARKER_FORMAT = 4  # 3: pieces of shards marked present; 4: locked by byte ranges, marked per boot until synced


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


class Hold:
    """A shared lock on a version's ``open.lock``, taken at open under the URL's lock: no ``cache clear``
    removes the version before the dataset holds its own (:class:`gdsload.remote.shard_cache.ShardCache`
    then closes this). Closed when collected, if nothing did before."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class Version(NamedTuple):
    """A version's folder, its identity (None: private), its shard files by local path, and its hold."""

    url: str
    root: str
    ident: str | None
    shards: dict[str, Entry]
    hold: Hold | None = None


def mirror_path(url: str, cache_dir: str, ident: str | None = None) -> str:
    """The folder of ``url``'s version ``ident`` in ``cache_dir``: its last path segment, after a digest of the
    URL, and ``@`` the version's identity; without ``ident``, the stem its versions and its lock share."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "dataset"
    stem = os.path.join(cache_dir, f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}")
    return stem if ident is None else f"{stem}@{ident}"


def mirror(url: str, cache_dir: str) -> str:
    """The folder of the version of ``url`` that the server holds now (see :func:`open_version`)."""
    return open_version(url, cache_dir).root


def identity(objects: dict[str, list], absent: list[str]) -> str:
    """The identity of a version: a digest of every object's key, size and ETag, and of the keys absent."""
    doc = json.dumps([sorted([k, v[0], v[1]] for k, v in objects.items()), sorted(absent)])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def open_version(url: str, cache_dir: str, timeout_s: float | None = None) -> Version:
    """The version of ``url`` the server holds now, its skeleton fetched into ``cache_dir`` unless a version
    of exactly these objects is complete there (each request within ``timeout_s``; None: the client's default).
    ReadError naming the URL and the HTTP status (or cause) when an object cannot be fetched, FormatError naming
    the URL and key for metadata gdsload cannot read; nothing half-written is left where a later open would
    take it."""
    try:
        return _open(url, cache_dir, timeout_s)
    except GDSLoadError as e:
        raise reworded(e, scrub(e, url)) from None


def scrub(text: object, url: str) -> str:
    """``text`` redacted (:func:`gdsload.remote.objects.redact`), and without the password of ``url`` wherever
    a library's message quotes it outside a URL (botocore's, of a bucket name)."""
    out = redact(text)
    password = urllib.parse.urlsplit(url).password if "@" in url else None
    return out.replace(password, "***") if password else out


def _open(url: str, cache_dir: str, timeout_s: float | None) -> Version:
    client = client_for(url, timeout_s)
    stem = mirror_path(url, cache_dir)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(stem + ".lock", "a")
    except OSError as e:
        raise ReadError(f"{cache_dir}: cannot make the cache folder ({e.strerror or e})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here, then find the version complete
        listed = listing(client, url) if client.lists else None
        found = _current(client, url, stem, listed)
        root, marker = found if found is not None else _build(client, url, cache_dir, stem, listed)
        hold = _hold(root)
    shards = {}
    for key, (size, tag, lo, hi) in marker["objects"].items():
        if (lo, hi) != (0, size):
            path = os.path.join(root, *key.split("/"))
            shards[path] = Entry(ObjectInfo(join(url, key), size, tag), key, path, lo, hi)
    return Version(url, root, None if PRIVATE in os.path.basename(root) else marker["ident"], shards, hold)


def _current(client: ObjectClient, url: str, stem: str, listed: dict[str, ObjectInfo] | None
             ) -> tuple[str, dict] | None:
    """The complete version in the cache whose every object is unchanged on the server, or None."""
    if listed is not None:
        now = {k: [o.size, o.etag] for k, o in listed.items()}
        if any(o.etag is None for o in listed.values()):
            return None
        root = f"{stem}@{identity(now, [])}"
        marker = read_marker(root)
        return (root, marker) if marker is not None and _same(marker, now, []) else None
    newest = max(versions_of(stem), default=None)
    if newest is None:
        return None
    root, marker = newest[1], newest[2]

    def now(key: str) -> list | None:
        try:
            info = client.head(join(url, key))
        except NotFound:
            return None
        return [info.size, info.etag]

    keys = [*marker["objects"], *marker["absent"]]
    seen = dict(zip(keys, parallel(now, keys)))
    current = {k: v for k, v in seen.items() if v is not None}
    return (root, marker) if _same(marker, current, [k for k, v in seen.items() if v is None]) else None


def versions_of(stem: str) -> list[tuple[float, str, dict]]:
    """The complete, shared versions of the URL whose folders begin ``stem``: (marker's time in ns, root, marker)."""
    folder, name = os.path.split(stem)
    out = []
    for entry in os.listdir(folder):
        if entry.startswith(name + "@") and PRIVATE not in entry and not entry.endswith((STATE, ".lock")):
            root = os.path.join(folder, entry)
            marker = read_marker(root)
            if marker is not None:
                out.append((os.stat(os.path.join(root, MARKER)).st_mtime_ns, root, marker))
    return out


def _same(marker: dict, objects: dict[str, list], absent: list[str]) -> bool:
    return ({k: v[:2] for k, v in marker["objects"].items()} == objects
            and sorted(marker["absent"]) == sorted(absent))


def read_marker(root: str) -> dict | None:
    """The marker of a complete version at ``root`` (of this code's format, every entry well formed), or None."""
    try:
        with open(os.path.join(root, MARKER)) as f:
            marker = json.load(f)
        objects, absent = marker["objects"], marker["absent"]
        ok = (marker.get("format") == MARKER_FORMAT and isinstance(marker.get("ident"), str)
              and isinstance(objects, dict) and isinstance(absent, list)
              and all(isinstance(v, list) and len(v) == 4 and all(type(n) is int for n in (v[0], v[2], v[3]))
                      and (v[1] is None or isinstance(v[1], str)) for v in objects.values()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return marker if ok else None


def _build(client: ObjectClient, url: str, cache_dir: str, stem: str, listed: dict[str, ObjectInfo] | None
           ) -> tuple[str, dict]:
    """Fetch the version the server holds now into a folder of its own, then rename it into place (or find
    it complete there already: a version the server went back to)."""
    tmp = f"{stem}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        skeleton = fetch(client, url, tmp, listed)
        if listed is None:
            _recheck(client, url, skeleton)
        ident = identity(skeleton.objects, skeleton.absent)
        marker = {"format": MARKER_FORMAT, "url": redact(url), "ident": ident, "objects": skeleton.objects,
                  "absent": skeleton.absent}
        if any(v[1] is None for v in skeleton.objects.values()):  # no ETag: nothing can be pinned
            _remove_stale_private(stem)
            root = f"{stem}{PRIVATE}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        else:
            root = f"{stem}@{ident}"
            old = read_marker(root)
            if old is not None and _same(old, {k: v[:2] for k, v in skeleton.objects.items()}, skeleton.absent):
                os.utime(os.path.join(root, MARKER))  # the newest again
                return root, old
            _remove_damaged(root, url, cache_dir)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(root + STATE, ignore_errors=True)  # a crashed version's state: of no file now
        os.replace(tmp, root)
        return root, marker
    except GDSLoadError:
        raise
    except OSError as e:
        raise ReadError(f"{cache_dir}: cannot write the dataset's skeleton into the cache ({e.strerror or e}): "
                        f"free space there ('gdsload cache clear {cache_dir}' removes the versions no dataset has "
                        f"open), or choose another cache_dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _recheck(client: ObjectClient, url: str, skeleton: Skeleton) -> None:
    """Without a listing: the metadata fetched is still what the server holds (a dataset rewritten while it was
    fetched would mix two versions); ReadError naming the object otherwise."""
    meta = [k for k in skeleton.objects if k.rsplit("/", 1)[-1] == "zarr.json"]

    def now(key: str) -> tuple[str, list | None]:
        try:
            info = client.head(join(url, key))
        except NotFound:
            return key, None
        return key, [info.size, info.etag]

    for key, seen in parallel(now, meta):
        if seen != skeleton.objects[key][:2]:
            raise ReadError(f"{join(url, key)}: changed while the dataset was opened ({skeleton.objects[key][:2]}, "
                            f"now {seen}); open it again once it is written")


def _hold(root: str) -> Hold:
    """A shared lock on the version's ``open.lock`` (made with its state folder)."""
    os.makedirs(root + STATE, exist_ok=True)
    fd = os.open(os.path.join(root + STATE, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return Hold(fd)


def unused(root: str) -> int | None:
    """A descriptor of the version's ``open.lock`` held exclusively when no dataset has the version open (close
    it once the version is removed), else None."""
    try:
        fd = os.open(os.path.join(root + STATE, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # no state: no dataset ever held it
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove(root: str) -> None:
    """Remove a version's folder and its state (hold :func:`unused`'s descriptor, and the URL's lock)."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + STATE, ignore_errors=True)


def _remove_damaged(root: str, url: str, cache_dir: str) -> None:
    """A folder at ``root`` without a complete marker (damaged) is removed unless a dataset holds it open."""
    if not os.path.lexists(root):
        return
    fd = unused(root)
    if fd is None:
        raise ReadError(f"{root}: a damaged version of {url} in the cache, open in a dataset: close it, then run "
                        f"'gdsload cache clear {cache_dir} {url}'")
    try:
        remove(root)
    finally:
        os.close(fd)


def _remove_stale_private(stem: str) -> None:
    """Remove the private versions of ``stem`` no open dataset holds (their owner crashed)."""
    folder, name = os.path.split(stem)
    for entry in os.listdir(folder):
        if entry.startswith(name + PRIVATE) and not entry.endswith((STATE, ".lock")) and ".tmp-" not in entry:
            root = os.path.join(folder, entry)
            fd = unused(root)
            if fd is not None:
                try:
                    remove(root)
                finally:
                    os.close(fd)


def named(error: GDSLoadError, version: Version, cache_dir: str) -> GDSLoadError:
    """``error`` of a remote dataset's open or read, of the same type, naming the objects' URLs in place of
    their copies in the cache (redacted); a FormatError (a copy whose bytes do not check) also says how to
    remove the version, in case the cache, not the server, is what is damaged."""
    text = str(error)
    if version.root not in text:
        return error if scrub(text, version.url) == text else reworded(error, scrub(text, version.url))
    below = version.root + os.sep in text  # a file of the version, not the dataset as a whole (no field 'y')
    if isinstance(error, FormatError) and below:
        text += (f" (read from the node's cache of it in {cache_dir}; if the object is sound on the server, "
                 f"'gdsload cache clear {cache_dir} {version.url}' removes that copy once no dataset has it open)")
    return reworded(error, as_urls(text, version))


def as_urls(text: str, version: Version) -> str:
    """``text`` naming the objects' URLs in place of their copies under ``version.root``, redacted."""
    text = text.replace(version.root + os.sep, version.url.rstrip("/") + "/").replace(version.root, version.url)
    return scrub(text, version.url)
