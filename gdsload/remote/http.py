"""``http(s)://`` objects by ranged GETs over kept-alive connections (one per thread and host), standard library only.

An object is pinned by its ETag (``If-Match``) and size; 5xx answers, timeouts and dropped connections are
retried with exponential backoff; a refusal names the URL (its password redacted) and the HTTP status or the
cause. A URL's ``user:password@`` is sent as HTTP Basic authentication. A request ends within ``timeout_s``, its
tries included: the watchdog (:class:`_Watch`) shuts its socket down at the deadline or on its stop event
(docs/remote.md, "Time bounds", says why a socket timeout alone is not enough).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import http.client
import os
import random
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import FormatError, ReadError, one_line
from .objects import (DEFAULT_TIMEOUT_S, MAX_GET_BYTES, NotFound, ObjectChanged, ObjectInfo, Stopped, check_timeout,
                      redact, too_large)

#: Answers worth another try: the server or something on the way was busy or failing, not the request.
RETRY_STATUSES = frozenset({500, 502, 503, 504, 429})
#: How often a connect, and the watchdog, look at the stop events and the clock.
SLICE_S = 0.05
#: Bytes read at a time from a body of unknown length.
READ_BYTES = 1 << 20


class _Watch:
    """The connections of requests in flight, each one's socket shut down once its deadline passes or its stop
    event is set. One thread, ``gdsload-http-watch``, alive while a request is in flight."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._live: dict[int, list[Any]] = {}  # id -> [connection, deadline, stop, fired, socket shut]
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, conn: http.client.HTTPConnection, deadline: float, stop: threading.Event | None
              ) -> Iterator[list[Any]]:
        """While inside: ``conn``'s socket is shut down at ``deadline`` or on ``stop``; yields the entry,
        whose ``[3]`` says whether it was."""
        entry = [conn, deadline, stop, False, None]
        with self._cv:
            self._live[id(entry)] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gdsload-http-watch", daemon=True)
                self._thread.start()
        try:
            yield entry
        finally:
            with self._cv:
                self._live.pop(id(entry), None)

    def _run(self) -> None:
        with self._cv:
            while self._live:
                now = time.monotonic()
                for entry in self._live.values():
                    conn, deadline, stop = entry[0], entry[1], entry[2]
                    if now >= deadline or (stop is not None and stop.is_set()):
                        entry[3] = True
                        sock = conn.sock
                        if sock is not None and sock is not entry[4]:  # a socket made after it fired, too
                            entry[4] = sock
                            with contextlib.suppress(OSError):
                                sock.shutdown(socket.SHUT_RDWR)
                self._cv.wait(SLICE_S)
            self._thread = None


_WATCH = _Watch()


def _connector(deadline: float, stop: threading.Event | None) -> Callable[..., socket.socket]:
    """``socket.create_connection`` for one request: made in slices of :data:`SLICE_S` that end it at the
    deadline (TimeoutError) or on ``stop`` (:class:`Stopped`)."""
    def connect(address: tuple[str, int], timeout: Any = None, source_address: Any = None) -> socket.socket:
        last: BaseException = OSError(f"no address for {address[0]}")
        for family, kind, proto, _, addr in socket.getaddrinfo(address[0], address[1], 0, socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                err = sock.connect_ex(addr)
                while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
                    if stop is not None and stop.is_set():
                        raise Stopped()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("the connection was not made in time")
                    if select.select([], [sock], [], min(left, SLICE_S))[1]:
                        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                return sock
            except (Stopped, TimeoutError):
                sock.close()
                raise
            except OSError as e:
                sock.close()
                last = e
        raise last

    return connect


def _garbage(e: BaseException) -> bool:
    """Whether ``e`` says the server's answer is not HTTP at all (no retry helps)."""
    return (isinstance(e, (http.client.BadStatusLine, http.client.LineTooLong, http.client.UnknownProtocol))
            and not isinstance(e, http.client.RemoteDisconnected))


class HttpClient:
    """An :class:`gdsload.remote.objects.ObjectClient` for ``http://`` and ``https://`` URLs: ``retries`` more
    tries after the first, ``backoff_s`` apart and doubling, all within ``timeout_s`` per request."""

    lists = False

    def __init__(self, retries: int = 5, backoff_s: float = 0.1, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, check_timeout(timeout_s)
        self._local = threading.local()  # per thread: (scheme, netloc) -> connection

    # -- requests ----------------------------------------------------------------------------------------
    def _connection(self, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (parts.scheme, parts.netloc)
        if key not in conns:
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            host = parts.hostname or ""
            conns[key] = cls(f"[{host}]" if ":" in host else host, parts.port, timeout=self.timeout_s)
        return conns[key]

    def _drop(self, parts: urllib.parse.SplitResult) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((parts.scheme, parts.netloc), None)
        if conn is not None:
            conn.close()

    def _request(self, method: str, url: str, headers: Mapping[str, str] | None = None,
                 stop: threading.Event | None = None, max_bytes: int | None = None
                 ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """Status, headers and body of one request, retried with backoff on 5xx, timeouts and connection
        errors, all within ``timeout_s``: a ReadError naming the URL and the last status or cause once the
        tries or the time are spent; :class:`Stopped` on ``stop``; a body over ``max_bytes`` a FormatError."""
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - a port that is not a number is refused here
        except ValueError as e:
            raise ReadError(redact(f"{url}: not a valid URL ({e})")) from None
        if not parts.hostname:
            raise ReadError(redact(f"{url}: not an http(s) URL with a host"))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = dict(headers or {})
        if parts.username is not None:
            who = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            sent["Authorization"] = "Basic " + base64.b64encode(who.encode()).decode()
        deadline = time.monotonic() + self.timeout_s
        silence = self.timeout_s / 2  # a try that hears nothing for this long is given up: another fits in
        last, tries, silent, stalled_body = "", 0, False, False
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                if time.monotonic() + pause >= deadline:
                    break
                if stop is not None and stop.wait(pause):
                    raise Stopped()
                if stop is None:
                    time.sleep(pause)
            if stop is not None and stop.is_set():
                raise Stopped()
            tries += 1
            conn, status, now = self._connection(parts), None, time.monotonic()
            # what HTTPConnection.connect() calls to make its socket (HTTPS wraps it after): this try's
            conn._create_connection = _connector(min(deadline, now + silence), stop)  # type: ignore[attr-defined]
            conn.timeout = max(min(deadline - now, silence), 0.001)  # each wait for bytes
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                with _WATCH.guard(conn, deadline, stop) as watch:
                    conn.request(method, target, headers=sent)
                    resp = conn.getresponse()
                    status = resp.status
                    body = self._body(url, resp, max_bytes)
            except FormatError:
                self._drop(parts)
                raise
            except (OSError, http.client.HTTPException, Stopped) as e:
                self._drop(parts)
                if isinstance(e, Stopped) or (stop is not None and stop.is_set()):
                    raise Stopped() from None
                if _garbage(e):
                    line = getattr(e, "line", None) or str(e)
                    raise ReadError(redact(f"{url}: the server's answer is not HTTP (it began "
                                           f"{str(line).strip()[:60]!r})")) from None
                over = watch[3] or time.monotonic() >= deadline  # the watchdog ended it: its error says nothing
                silent = over or isinstance(e, TimeoutError)
                if over and status is not None:
                    stalled_body = True
                    got = len(e.partial) if isinstance(e, http.client.IncompleteRead) else None
                    last = f"HTTP {status}, " + (f"{got} of {got + (e.expected or 0)} bytes came"  # type: ignore
                                                 if got is not None else "the body stalled")
                elif not over:
                    last = f"{type(e).__name__}: {one_line(e)}"
                if over:
                    break
                continue
            if resp.will_close or watch[3]:  # the watchdog may have shut it down as the answer ended
                self._drop(parts)
            if status in RETRY_STATUSES:
                last, silent = f"HTTP {status} {resp.reason}", False
                continue
            return status, resp.headers, body  # type: ignore[return-value]
        t, tried = f"{self.timeout_s:g}", f"{method}, {tries} tr{'y' if tries == 1 else 'ies'}"
        if stalled_body:
            raise ReadError(redact(f"{url}: no complete response within {t} s ({tried}; {last})"))
        if silent:
            raise ReadError(redact(f"{url}: no response for {t} s ({tried}{'; before: ' + last if last else ''})"))
        raise ReadError(redact(f"{url}: {method} failed after {tries} tries ({last})"))

    @staticmethod
    def _body(url: str, resp: http.client.HTTPResponse, max_bytes: int | None) -> bytes:
        """The whole body; over ``max_bytes`` by its Content-Length (nothing read) or as it comes, a FormatError."""
        if resp.length is not None:
            if max_bytes is not None and resp.length > max_bytes:
                raise too_large(url, resp.length, max_bytes)
            return resp.read()  # IncompleteRead when the connection ends before Content-Length
        if max_bytes is None:
            return resp.read()
        pieces, n = [], 0
        while piece := resp.read(min(READ_BYTES, max_bytes + 1 - n)):  # no further than one byte past the bound
            n += len(piece)
            if n > max_bytes:
                raise too_large(url, None, max_bytes)
            pieces.append(piece)
        return b"".join(pieces)

    @staticmethod
    def _refuse(url: str, status: int, what: str) -> ReadError:
        if status == 404:
            return NotFound(redact(f"{url}: HTTP 404 (no such object) on {what}"))
        return ReadError(redact(f"{url}: HTTP {status} on {what}"))

    # -- the contract -----------------------------------------------------------------------------------
    def head(self, url: str) -> ObjectInfo:
        status, headers, _ = self._request("HEAD", url)
        if status != 200:
            raise self._refuse(url, status, "HEAD")
        length = headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ReadError(redact(f"{url}: HEAD gave no Content-Length (found {length!r}): its size is unknown"))
        return ObjectInfo(url, int(length), headers.get("ETag"))

    def read(self, info: ObjectInfo, offset: int, nbytes: int, stop: threading.Event | None = None) -> bytes:
        url = info.url
        if nbytes <= 0:
            return b""
        info.check_range(offset, nbytes)
        headers = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
        if info.etag is not None:
            headers["If-Match"] = info.etag
        status, got, body = self._request("GET", url, headers, stop, max_bytes=info.size)
        if status in (404, 410, 412, 416):  # 416: a range inside the size it was opened with no longer is
            raise ObjectChanged(redact(f"{url}: HTTP {status}: the object changed or was removed since it was "
                                       f"opened (ETag {info.etag}, {info.size} bytes)"))
        if status == 200:  # a server that ignores Range: the whole object
            if len(body) != info.size:
                raise ObjectChanged(redact(f"{url}: now {len(body)} bytes (opened with {info.size})"))
            body = body[offset:offset + nbytes]
        elif status == 206:
            total = (got.get("Content-Range") or "").rpartition("/")[2]
            if total != str(info.size) or (info.etag is not None and got.get("ETag") not in (None, info.etag)):
                raise ObjectChanged(redact(f"{url}: now {total} bytes, ETag {got.get('ETag')} (opened with "
                                           f"{info.size}, {info.etag})"))
        else:
            raise self._refuse(url, status, f"GET of bytes {offset}..{offset + nbytes}")
        if len(body) != nbytes:
            raise ReadError(redact(f"{url}: {len(body)} bytes for bytes {offset}..{offset + nbytes} (expected "
                                   f"{nbytes})"))
        return body

    def get(self, url: str, max_bytes: int = MAX_GET_BYTES) -> bytes:
        status, _, body = self._request("GET", url, max_bytes=max_bytes)
        if status != 200:
            raise self._refuse(url, status, "GET")
        return body

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        status, got, body = self._request("GET", url, {"Range": f"bytes=-{max(1, nbytes)}"},
                                          max_bytes=max(nbytes, MAX_GET_BYTES))
        if status == 206:
            total = (got.get("Content-Range") or "").rpartition("/")[2]
            if not total.isdigit():
                raise ReadError(redact(f"{url}: HTTP 206 without a Content-Range total (found "
                                       f"{got.get('Content-Range')!r})"))
            return ObjectInfo(url, int(total), got.get("ETag")), body
        if status == 416 and (got.get("Content-Range") or "").endswith("/0"):  # an empty object
            return ObjectInfo(url, 0, got.get("ETag")), b""
        if status == 200:  # a server that ignores Range: the whole object
            return ObjectInfo(url, len(body), got.get("ETag")), body[max(0, len(body) - nbytes):]
        raise self._refuse(url, status, f"GET of its last {nbytes} bytes")

    def list(self, url: str) -> list[str]:
        raise ReadError(redact(f"{url}: HTTP has no listing of objects (name the files, or use s3://)"))

    def list_info(self, url: str) -> list[ObjectInfo]:
        raise ReadError(redact(f"{url}: HTTP has no listing of objects (name the files, or use s3://)"))
