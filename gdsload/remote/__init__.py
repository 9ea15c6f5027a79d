"""Objects beyond the node: ``s3://`` and ``http(s)://`` URLs read by ranged GETs, each pinned to the size and
ETag it had when first seen, retried with backoff where a retry can help, and refused with the URL and the
HTTP status where it cannot. Imports nothing of gdsload above errors: the format and the backends build on it."""

from __future__ import annotations

import threading

from .objects import SCHEMES, ObjectClient

_clients: dict[tuple[str, str], ObjectClient] = {}
_lock = threading.Lock()


def _key(url: str) -> tuple[str, str]:
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{url}: not a remote URL (expected one of {[s + '://' for s in SCHEMES]})")
    return scheme, "" if scheme == "s3" else url.split("://", 1)[1].split("/", 1)[0]


def use_client(url: str, client: ObjectClient | None) -> ObjectClient | None:
    """Make ``client`` the process's client for ``url``'s scheme (and, for HTTP, host), e.g. one with other
    retries, timeouts or credentials; None goes back to the default, made on next use. Returns the client it
    replaces (None where none was made)."""
    key = _key(url)
    with _lock:
        previous = _clients.pop(key, None)
        if client is not None:
            _clients[key] = client
        return previous


def forget_clients() -> None:
    """Drop every client made so far: the next use makes one anew, from the environment as it is then (an S3
    client reads ``AWS_ENDPOINT_URL`` and the credentials when it is made)."""
    with _lock:
        _clients.clear()


def client_for(url: str) -> ObjectClient:
    """The process's client for ``url``'s scheme (and, for HTTP, host): made on first use."""
    key = _key(url)
    scheme = key[0]
    with _lock:
        if key not in _clients:
            if scheme == "s3":
                from .s3 import S3Client

                _clients[key] = S3Client()
            else:
                from .http import HttpClient

                _clients[key] = HttpClient()
        return _clients[key]
