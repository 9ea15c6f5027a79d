"""What every remote client keeps: the :class:`ObjectClient` contract, the pinned :class:`ObjectInfo`, and the
errors of objects that are missing or changed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ReadError

#: URL schemes read remotely.
SCHEMES = ("s3", "http", "https")
# scheme://user[:password]@ (userinfo cannot hold "/", "@" or white space)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/@\s:]*)(?::([^/@\s]*))?@")


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL of a scheme in :data:`SCHEMES` (a local path, or a PathLike, is not)."""
    return isinstance(path, str) and path.split("://", 1)[0].lower() in SCHEMES and "://" in path


def redact(text: object) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (``https://user:***@host/x``), for
    messages: credentials in a URL are never printed."""
    return _USERINFO.sub(lambda m: m.group(1) + (m.group(2) + ":***@" if m.group(3) is not None else m.group(2) + "@"),
                         str(text))


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path segments (``join("s3://b/d.gds", "x", "c/0")``)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


@dataclass(frozen=True)
class ObjectInfo:
    """An object as first seen: every later read of it must find the same ``size`` and ``etag`` (None where
    the server sends none: then only the size is checked)."""

    url: str
    size: int
    etag: str | None


class ObjectChanged(ReadError):
    """An object changed (ETag or size) or vanished since it was first seen: never mixed into an epoch."""


class ObjectClient(Protocol):
    """Ranged reads of one scheme's objects. Thread-safe. Errors are :class:`ReadError` naming the URL and,
    where there was one, the HTTP status; a missing object is also a ``FileNotFoundError``."""

    #: Whether :meth:`list` can name the objects under a prefix (S3 can; HTTP has no listing).
    lists: bool

    def head(self, url: str) -> ObjectInfo:
        """Size and ETag of ``url`` now."""

    def read(self, info: ObjectInfo, offset: int, nbytes: int) -> bytes:
        """Bytes ``offset .. offset + nbytes`` of the object ``info`` pins (:class:`ObjectChanged` if it is
        no longer that object; a range past its end is a ReadError)."""

    def get(self, url: str) -> bytes:
        """The whole object (small ones: metadata)."""

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        """The object as it is now and its last ``nbytes`` bytes (all of it when smaller), in one request: what a
        shard's size, ETag and index (at its end, in Zarr sharding) cost together."""

    def list_info(self, url: str) -> list[ObjectInfo]:
        """The objects under ``url`` (a prefix) with their sizes and ETags, sorted by URL (as :meth:`list`)."""

    def list(self, url: str) -> list[str]:
        """URLs of the objects under ``url`` (a prefix), sorted; where ``lists`` is False, a ReadError."""


class NotFound(ReadError, FileNotFoundError):
    """No object at the URL (HTTP 404)."""
