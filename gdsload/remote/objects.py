"""What every remote client keeps: the :class:`ObjectClient` contract, the pinned :class:`ObjectInfo`, and the
errors of objects that are missing or changed."""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import FormatError, ReadError

#: URL schemes read remotely.
SCHEMES = ("s3", "http", "https")
#: The default of ``timeout_s``: what every remote wait is bounded by (a request with all its tries, a wait for
#: another process's fetch) unless given.
DEFAULT_TIMEOUT_S = 30.0
#: The most bytes :meth:`ObjectClient.get` reads by default: whole objects are metadata, never a dataset's data.
MAX_GET_BYTES = 64 << 20
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


def check_timeout(value: Any, name: str = "timeout_s") -> float:
    """``value`` as a float of seconds: a positive finite number (not a bool), else a TypeError or ValueError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (found {type(value).__name__} {value!r})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number of seconds (found {value!r})")
    return float(value)


def too_large(url: str, size: int | None, max_bytes: int) -> FormatError:
    """The refusal of an object larger than a whole-object read takes (``size`` None: its body ran past)."""
    found = f"{size} bytes" if size is not None else "a body that ran past it"
    return FormatError(redact(f"{url}: too large to read whole (at most {max_bytes} bytes, found {found})"))


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

    def check_range(self, offset: int, nbytes: int) -> None:
        """A ReadError naming the URL unless bytes ``offset .. offset + nbytes`` all lie inside the object."""
        if offset < 0 or offset + nbytes > self.size:
            raise ReadError(redact(f"{self.url}: bytes {offset}..{offset + nbytes} lie past its end ({self.size} "
                                   f"bytes when it was opened)"))


class Stopped(Exception):
    """A request (or a wait) given up because its stop event was set: not an error, the reading stops."""


class ObjectChanged(ReadError):
    """An object changed (ETag or size) or vanished since it was first seen: never mixed into an epoch."""


class ObjectClient(Protocol):
    """Ranged reads of one scheme's objects. Thread-safe. Errors are :class:`ReadError` naming the URL (its
    password redacted) and the cause: the HTTP status, or ``no response for N s``; a missing object is also a
    ``FileNotFoundError``. Every call ends within ``timeout_s`` (a request with all its tries: a stalled or
    trickling server is a ReadError then); a read given ``stop`` ends soon after it is set (:class:`Stopped`)."""

    #: Whether :meth:`list` can name the objects under a prefix (S3 can; HTTP has no listing).
    lists: bool
    #: The bound of each call, in seconds.
    timeout_s: float

    def head(self, url: str) -> ObjectInfo:
        """Size and ETag of ``url`` now."""

    def read(self, info: ObjectInfo, offset: int, nbytes: int, stop: threading.Event | None = None) -> bytes:
        """Bytes ``offset .. offset + nbytes`` of the object ``info`` pins (:class:`ObjectChanged` if it is
        no longer that object; a range past its end is a ReadError); :class:`Stopped` once ``stop`` is set."""

    def get(self, url: str, max_bytes: int = MAX_GET_BYTES) -> bytes:
        """The whole object (small ones: metadata). One larger than ``max_bytes`` (by its Content-Length, or by
        a body that runs past it) is a FormatError naming the URL and the size, and is not read into memory."""

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        """The object as it is now and its last ``nbytes`` bytes (all of it when smaller), in one request: what a
        shard's size, ETag and index (at its end, in Zarr sharding) cost together."""

    def list_info(self, url: str) -> list[ObjectInfo]:
        """The objects under ``url`` (a prefix) with their sizes and ETags, sorted by URL (as :meth:`list`)."""

    def list(self, url: str) -> list[str]:
        """URLs of the objects under ``url`` (a prefix), sorted; where ``lists`` is False, a ReadError."""


class NotFound(ReadError, FileNotFoundError):
    """No object at the URL (HTTP 404)."""
