"""``http(s)://`` objects by ranged GETs over kept-alive connections (one per thread and host), through the
standard library: an object is pinned by its ETag (``If-Match``) and size, 5xx answers, timeouts and dropped
connections are retried with exponential backoff, and every refusal names the URL and the HTTP status."""

from __future__ import annotations

import http.client
import random
import threading
import time
import urllib.parse
from collections.abc import Mapping

from ..errors import ReadError
from .objects import NotFound, ObjectChanged, ObjectInfo

#: Answers worth another try: the server or something on the way was busy or failing, not the request.
RETRY_STATUSES = frozenset({500, 502, 503, 504, 429})


class HttpClient:
    """An :class:`gdsload.remote.objects.ObjectClient` for ``http://`` and ``https://`` URLs."""

    lists = False

    def __init__(self, retries: int = 5, backoff_s: float = 0.1, timeout_s: float = 30.0):
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._local = threading.local()  # per thread: (scheme, netloc) -> connection

    # -- requests ----------------------------------------------------------------------------------------
    def _connection(self, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (parts.scheme, parts.netloc)
        if key not in conns:
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conns[key] = cls(parts.netloc, timeout=self.timeout_s)
        return conns[key]

    def _drop(self, parts: urllib.parse.SplitResult) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((parts.scheme, parts.netloc), None)
        if conn is not None:
            conn.close()

    def _request(self, method: str, url: str, headers: Mapping[str, str] | None = None
                 ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """Status, headers and body of one request, retried with backoff on 5xx, timeouts and connection
        errors; ReadError naming the URL and the last status or cause once the tries are spent."""
        parts = urllib.parse.urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                conn = self._connection(parts)
                conn.request(method, target, headers=dict(headers or {}))
                resp = conn.getresponse()
                body = resp.read()  # IncompleteRead when the connection ends before Content-Length
                if resp.will_close:
                    self._drop(parts)
            except (OSError, http.client.HTTPException) as e:
                self._drop(parts)
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status in RETRY_STATUSES:
                last = f"HTTP {resp.status} {resp.reason}"
                continue
            return resp.status, resp.headers, body
        raise ReadError(f"{url}: {method} failed after {self.retries + 1} tries ({last})")

    @staticmethod
    def _refuse(url: str, status: int, what: str) -> ReadError:
        if status == 404:
            return NotFound(f"{url}: HTTP 404 (no such object) on {what}")
        return ReadError(f"{url}: HTTP {status} on {what}")

    # -- the contract -----------------------------------------------------------------------------------
    def head(self, url: str) -> ObjectInfo:
        status, headers, _ = self._request("HEAD", url)
        if status != 200:
            raise self._refuse(url, status, "HEAD")
        length = headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ReadError(f"{url}: HEAD gave no Content-Length (found {length!r}): its size is unknown")
        return ObjectInfo(url, int(length), headers.get("ETag"))

    def read(self, info: ObjectInfo, offset: int, nbytes: int) -> bytes:
        if nbytes <= 0:
            return b""
        if offset < 0 or offset + nbytes > info.size:
            raise ReadError(f"{info.url}: bytes {offset}..{offset + nbytes} lie past its end ({info.size} bytes)")
        headers = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
        if info.etag is not None:
            headers["If-Match"] = info.etag
        status, got, body = self._request("GET", info.url, headers)
        if status in (404, 410, 412, 416):  # 416: a range inside the size it was opened with no longer is
            raise ObjectChanged(f"{info.url}: HTTP {status}: the object changed or was removed since it was opened "
                                f"(ETag {info.etag}, {info.size} bytes)")
        if status == 200:  # a server that ignores Range: the whole object
            if len(body) != info.size:
                raise ObjectChanged(f"{info.url}: now {len(body)} bytes (opened with {info.size})")
            body = body[offset:offset + nbytes]
        elif status == 206:
            total = (got.get("Content-Range") or "").rpartition("/")[2]
            if total != str(info.size) or (info.etag is not None and got.get("ETag") not in (None, info.etag)):
                raise ObjectChanged(f"{info.url}: now {total} bytes, ETag {got.get('ETag')} (opened with "
                                    f"{info.size}, {info.etag})")
        else:
            raise self._refuse(info.url, status, f"GET of bytes {offset}..{offset + nbytes}")
        if len(body) != nbytes:
            raise ReadError(f"{info.url}: {len(body)} bytes for bytes {offset}..{offset + nbytes} (expected {nbytes})")
        return body

    def get(self, url: str) -> bytes:
        status, _, body = self._request("GET", url)
        if status != 200:
            raise self._refuse(url, status, "GET")
        return body

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        status, got, body = self._request("GET", url, {"Range": f"bytes=-{max(1, nbytes)}"})
        if status == 206:
            total = (got.get("Content-Range") or "").rpartition("/")[2]
            if not total.isdigit():
                raise ReadError(f"{url}: HTTP 206 without a Content-Range total (found {got.get('Content-Range')!r})")
            return ObjectInfo(url, int(total), got.get("ETag")), body
        if status == 416 and (got.get("Content-Range") or "").endswith("/0"):  # an empty object
            return ObjectInfo(url, 0, got.get("ETag")), b""
        if status == 200:  # a server that ignores Range: the whole object
            return ObjectInfo(url, len(body), got.get("ETag")), body[max(0, len(body) - nbytes):]
        raise self._refuse(url, status, f"GET of its last {nbytes} bytes")

    def list(self, url: str) -> list[str]:
        raise ReadError(f"{url}: HTTP has no listing of objects (name the files, or use s3://)")

    def list_info(self, url: str) -> list[ObjectInfo]:
        raise ReadError(f"{url}: HTTP has no listing of objects (name the files, or use s3://)")
