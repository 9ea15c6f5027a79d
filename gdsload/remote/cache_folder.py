"""The node's cache folder of remote datasets as a whole: what ``gdsload cache ls`` lists and ``clear`` removes.

It lists the versions a folder holds (:mod:`gdsload.remote.mirror`), what each takes on disk, unfinished fetches
and versions of an older cache format. A version is in use while a dataset holds the shared lock on its
``open.lock``: :func:`clear` takes the URL's lock, then the version's ``open.lock`` exclusively, both without
waiting, and passes over what it cannot take (docs/remote.md, "Versions, and the cache folder").
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import NamedTuple

from .objects import redact
from .mirror import MARKER, STATE, mirror_path, read_marker, remove, unused


class Cached(NamedTuple):
    """A folder of the cache: its path, the URL (redacted; ``?`` where unknown), the version's name,
    ``kind`` (``"version"``; ``"unfinished"``: a fetch that did not complete; ``"stale"``: a version of an
    older format of the cache, or damaged), bytes on disk (its state's included), its shard files and how
    many hold their data, and whether a dataset has it open."""

    root: str
    url: str
    ident: str
    kind: str
    disk_bytes: int
    shards: int
    present: int
    in_use: bool


def versions(cache_dir: str) -> list[Cached]:
    """Every version (and unfinished or stale folder) in ``cache_dir``, sorted by URL then folder."""
    if not os.path.isdir(cache_dir):
        raise FileNotFoundError(f"{cache_dir}: no such cache folder")
    found = []
    for name in sorted(os.listdir(cache_dir)):
        root = os.path.join(cache_dir, name)
        if name.endswith((STATE, ".lock")) or not os.path.isdir(root) or os.path.islink(root):
            continue
        if ".tmp-" in name:
            found.append(_cached(root, "unfinished", name.rpartition(".tmp-")[2], {}))
        elif "@" in name:
            marker = read_marker(root)
            found.append(_cached(root, "version" if marker is not None else "stale", name.rpartition("@")[2],
                                 marker if marker is not None else _any_marker(root)))
    return sorted(found, key=lambda c: (c.url, c.root))


def clear(cache_dir: str, url: str | None = None) -> tuple[list[Cached], list[Cached]]:
    """Remove every version of ``cache_dir`` (of ``url`` only, where given) that no dataset has open, and the
    unfinished folders no open is filling: (removed, kept because in use or being opened)."""
    removed, kept = [], []
    for c in versions(cache_dir):
        if url is not None and not _of(c, url, cache_dir):
            continue
        stem = c.root.rpartition(".tmp-" if c.kind == "unfinished" else "@")[0]
        try:
            lock = os.open(stem + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            kept.append(c)
            continue
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an open of this URL is choosing or filling one
            except OSError:
                kept.append(c._replace(in_use=True))
                continue
            fd = unused(c.root)
            if fd is None:
                kept.append(c._replace(in_use=True))
                continue
            try:
                remove(c.root)
            finally:
                os.close(fd)
            removed.append(c)
        finally:
            os.close(lock)
    return removed, kept


def _of(c: Cached, url: str, cache_dir: str) -> bool:
    name = os.path.basename(mirror_path(url, cache_dir))
    folder = os.path.basename(c.root)
    return folder.startswith(name + "@") or folder.startswith(name + ".tmp-") or c.url == redact(url)


def _any_marker(root: str) -> dict:
    """A marker of any format, for its URL (an older cache's); empty where none can be read."""
    try:
        with open(os.path.join(root, MARKER)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _cached(root: str, kind: str, ident: str, marker: dict) -> Cached:
    objects = marker.get("objects") if isinstance(marker.get("objects"), dict) else {}
    shards = sum(1 for v in objects.values() if isinstance(v, list) and len(v) == 4 and (v[2], v[3]) != (0, v[0]))
    try:
        present = len({f.split(".", 1)[0] for f in os.listdir(root + STATE) if f.endswith(".ok")})  # by shard
    except OSError:
        present = 0
    url = marker.get("url")
    fd = unused(root) if kind != "unfinished" else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    if fd is not None:
        os.close(fd)
    return Cached(root, redact(url) if isinstance(url, str) else "?", ident, kind,
                  _disk_bytes(root) + _disk_bytes(root + STATE), shards, present, fd is None)


def _disk_bytes(folder: str) -> int:
    """The blocks the files below ``folder`` take (a sparse shard file counts what it holds)."""
    total = 0
    for top, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
            except OSError:
                pass
    return total
