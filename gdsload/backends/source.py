"""Where a dataset's files are, and the backend that reads them: local files, or a remote version in the node's cache.

:class:`Source` is local files; :class:`RemoteSource` a remote dataset, whose skeleton is in the node's cache
and whose shards come by the direct route or the cached one (:mod:`gdsload.remote.route`; docs/remote.md,
"Routes: direct or cached"). The reader opens a dataset at its source's ``root``, has the source make its
backend and name its errors; it knows nothing of where the files came from. :func:`open_source` is the only way
in from a dataset's path.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ..errors import GDSLoadError
from ..format.layout import DatasetLayout
from ..remote.mirror import named
from ..remote.objects import DEFAULT_TIMEOUT_S, is_remote
from ..remote.route import DIRECT, Route, choose_route, direct_usable, kvikio_remote
from ..remote.shard_fetch import RemoteShards
from ..system.env import cache_dir as env_cache_dir
from .base import Backend
from .registry import ENV_BACKEND, info, make_backend
from .remote_cached import CachedBackend
from .remote_direct import BACKEND, direct_options, object_map


class Made(NamedTuple):
    """A backend made for a dataset, its name (``backend_name``) and why (``backend_reason``)."""

    backend: Backend
    name: str
    reason: str


class Source:
    """A local dataset: its files are under ``root``."""

    #: The most bytes of the dataset a backend may hold (``auto`` picks the RAM tier only within it); None: no bound.
    bound: int | None = None

    def __init__(self, root: str | os.PathLike[str]):
        self.root = root

    def backend(self, requested: str, name: str, reason: str, options: dict[str, Any] | None, device: int,
                layout: DatasetLayout) -> Made:
        """The backend that reads ``layout``'s files: ``name`` (what ``requested`` resolved to, for ``reason``),
        made with ``options``."""
        return Made(make_backend(name, device, **(options or {})), name, reason)

    def named(self, e: GDSLoadError) -> GDSLoadError:
        """``e`` naming what the user knows the files by (here: ``e``)."""
        return e

    def describe(self) -> dict[str, Any]:
        """What ``describe()`` shows of the source (nothing for local files)."""
        return {}

    def close(self) -> None:
        """Free what the source holds. Idempotent."""


class RemoteSource(Source):
    """A remote dataset's version in the node's cache (``shards``); ``cache_option``: the cache option given
    (``"cache_dir"``, ``"cache_bytes"``), else None."""

    def __init__(self, shards: RemoteShards, cache_option: str | None):
        super().__init__(shards.root)
        self.shards, self.cache_option = shards, cache_option
        self.bound = shards.cache.cache_bytes
        self.route = Route("", "")
        self._cached: CachedBackend | None = None

    @classmethod
    def open(cls, url: str, cache_dir: str | os.PathLike[str] | None, cache_bytes: int | None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> RemoteSource:
        folder = os.fspath(cache_dir) if cache_dir else os.path.join(env_cache_dir(), "datasets")
        option = "cache_dir" if cache_dir is not None else "cache_bytes" if cache_bytes is not None else None
        return cls(RemoteShards.open(url, folder, cache_bytes, timeout_s), option)

    def backend(self, requested: str, name: str, reason: str, options: dict[str, Any] | None, device: int,
                layout: DatasetLayout) -> Made:
        """On the direct route, :data:`gdsload.backends.remote_direct.BACKEND` with the objects' options in place
        of ``name``; on the cached route, ``name`` wrapped in a :class:`CachedBackend`."""
        asked = requested != "auto" or bool(os.environ.get(ENV_BACKEND, "").strip())
        self.route = route_for(self.shards.version.url, name, asked, self.cache_option)
        if self.route.name == DIRECT:  # the direct route reads with its own backend, in place of this one
            direct = direct_options(options, object_map(self.shards.version.shards), self.shards.timeout_s)
            return Made(make_backend(BACKEND, device, **direct), BACKEND,
                        f"a remote dataset's direct route, in place of {name!r} ({reason})")
        self.shards.divide(layout)  # shards cut into pieces at their chunks: a rank fetches what it reads
        self._cached = CachedBackend(make_backend(name, device, **(options or {})), self.shards)
        return Made(self._cached, name, reason)

    def named(self, e: GDSLoadError) -> GDSLoadError:
        """``e`` naming the objects' URLs in place of their copies in the node's cache."""
        return named(e, self.shards.version, self.shards.cache.cache_dir)

    def describe(self) -> dict[str, Any]:
        """The route (``"direct"``, ``"cached"``, or ``"whole"``: every shard fetched at open, for a backend that
        locks every file; docs/remote.md), why, and the cache's counters."""
        route, why = self.route
        if self._cached is not None and self._cached.whole is not None:
            route, why = "whole", f"the {self._cached.name} backend locks every shard file in memory; {why}"
        return {"remote": {"route": route, "route_reason": why, **self.shards.describe()}}

    def close(self) -> None:
        self.shards.close()  # its threads end, its pins (the whole dataset's too) are dropped


def route_for(url: str, backend: str, named: bool, cache_option: str | None) -> Route:
    """The route of ``url`` read by the concrete ``backend`` (``named``: asked for by name, not chosen by auto)."""
    i = info(backend)
    usable = direct_usable(url, os.environ, kvikio_remote()) if i.on_device and cache_option is None else (False, "")
    return choose_route(backend, i.on_device, i.locks_dataset and named, cache_option, usable)


def open_source(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                cache_bytes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Source:
    """The files of the dataset at ``path``: local ones; or, for an ``s3://`` or ``http(s)://`` URL, its version
    in the node's cache, the skeleton fetched into ``cache_dir`` (default: the ``datasets`` folder of gdsload's
    cache), its shards read straight from the objects (the direct route) or fetched into the cache as they are
    read, the node's cache holding at most ``cache_bytes`` of them (None: no bound), each remote wait within
    ``timeout_s``."""
    if is_remote(path):
        return RemoteSource.open(str(path), cache_dir, cache_bytes, timeout_s)
    return Source(path)
