"""Objects beyond the node (``s3://``, ``http(s)://`` clients) and a remote dataset's copy in the node's cache.

Every object is read by ranged GETs pinned to the size and ETag it had when first seen; every call ends within
the client's ``timeout_s``, its tries included, and a refusal names the URL and the HTTP status. The wing's
modules: docs/design.md, "Module map"; the backends of its two routes are in backends/.
"""

from __future__ import annotations

import threading
import weakref

from .objects import DEFAULT_TIMEOUT_S, SCHEMES, ObjectClient, check_timeout

_clients: dict[tuple[str, str], ObjectClient] = {}  # given by use_client: used whatever the timeout asked
_made: dict[tuple[str, str, float], ObjectClient] = {}  # made here, one per timeout
_origin: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # every client made here -> its key in _made
_lock = threading.Lock()


def _key(url: str) -> tuple[str, str]:
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{url}: not a remote URL (expected one of {[s + '://' for s in SCHEMES]})")
    return scheme, "" if scheme == "s3" else url.split("://", 1)[1].split("/", 1)[0]


def use_client(url: str, client: ObjectClient | None) -> ObjectClient | None:
    """Make ``client`` the process's client for ``url``'s scheme (and, for HTTP, host), e.g. one with other
    retries, timeouts or credentials (used whatever ``timeout_s`` a dataset asks for); None goes back to the
    defaults, made on next use. Returns the client it replaces (the default one where none was given, None
    where none was made); giving that back restores what was."""
    key = _key(url)
    with _lock:
        previous = _clients.pop(key, None) or _made.get((*key, DEFAULT_TIMEOUT_S))
        for k in [k for k in _made if k[:2] == key]:
            del _made[k]
        made = _origin.get(client) if client is not None else None
        if made is not None and made[:2] == key:  # one made here, given back: a default again
            _made[made] = client
        elif client is not None:
            _clients[key] = client
        return previous


def forget_clients() -> None:
    """Drop every client made so far: the next use makes one anew, from the environment as it is then (an S3
    client reads ``AWS_ENDPOINT_URL`` and the credentials when it is made)."""
    with _lock:
        _clients.clear()
        _made.clear()


def client_for(url: str, timeout_s: float | None = None) -> ObjectClient:
    """The process's client for ``url``'s scheme (and, for HTTP, host) whose every call ends within
    ``timeout_s`` (None: :data:`DEFAULT_TIMEOUT_S`), made on first use; one given by :func:`use_client` wins,
    with its own timeouts."""
    key = _key(url)
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else check_timeout(timeout_s)
    with _lock:
        if key in _clients:
            return _clients[key]
        if (*key, timeout) not in _made:
            if key[0] == "s3":
                from .s3 import S3Client

                _made[(*key, timeout)] = S3Client(timeout_s=timeout)
            else:
                from .http import HttpClient

                _made[(*key, timeout)] = HttpClient(timeout_s=timeout)
            _origin[_made[(*key, timeout)]] = (*key, timeout)
        return _made[(*key, timeout)]
