"""``s3://bucket/key`` objects through botocore: standard credentials, retries and endpoints, reads pinned by ETag.

Credentials, region and endpoint come the standard way (``AWS_*``, ``~/.aws``, instance roles;
``AWS_ENDPOINT_URL``); retries are botocore's standard mode; reads carry ``IfMatch``; a refusal names the URL and
the status. Each call runs on a ``gdsload-s3`` thread while the caller waits at most ``timeout_s`` and watches its
stop event; a call given up has its body shut down (docs/remote.md, "Time bounds"; why botocore: "The CPU
route's client").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import FormatError, ReadError, one_line
from .objects import (DEFAULT_TIMEOUT_S, MAX_GET_BYTES, NotFound, ObjectChanged, ObjectInfo, Stopped, check_timeout,
                      redact, too_large)

#: Error codes S3 gives for an object that is not there.
_MISSING = ("404", "NoSuchKey", "NotFound")


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); ValueError naming the URL without a bucket."""
    rest = url.split("://", 1)[1] if "://" in url else ""
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(redact(f"{url}: not an s3:// URL with a bucket (expected s3://BUCKET/KEY)"))
    if "@" in bucket:
        raise ValueError(redact(f"{url}: credentials in an s3:// URL are not used (give them the standard way: "
                                f"the AWS_* environment, ~/.aws files, an instance role)"))
    return bucket, key


class _Call:
    """One botocore call on its own thread: its result or error once ``done``; ``body``, the streaming body
    being read (shut down when the call is given up)."""

    def __init__(self, fn: Callable[[_Call], Any]):
        self.fn, self.done, self.cancelled = fn, threading.Event(), False
        self.result: Any = None
        self.error: BaseException | None = None
        self.body: Any = None

    def run(self) -> None:
        try:
            self.result = self.fn(self)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()

    def abandon(self) -> None:
        self.cancelled = True
        shutdown = getattr(getattr(self.body, "_raw_stream", None), "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()  # the read blocked on it ends now
            except Exception:  # noqa: BLE001 - the call is given up either way
                pass

    def read(self, got: dict, url: str, max_bytes: int | None) -> bytes:
        """The body of ``got`` (a GetObject answer), refused past ``max_bytes`` before it is read."""
        body, size = got["Body"], got.get("ContentLength")
        self.body = body
        if self.cancelled or (max_bytes is not None and size is not None and size > max_bytes):
            body.close()
            if self.cancelled:
                raise Stopped()
            raise too_large(url, size, max_bytes)  # type: ignore[arg-type]
        if size is not None or max_bytes is None:
            return body.read()
        pieces, n = [], 0
        while piece := body.read(min(1 << 20, max_bytes + 1 - n)):
            n += len(piece)
            if n > max_bytes:
                body.close()
                raise too_large(url, None, max_bytes)
            pieces.append(piece)
        return b"".join(pieces)


class S3Client:
    """An :class:`gdsload.remote.objects.ObjectClient` for ``s3://`` URLs (thread-safe, as botocore's clients
    are). ``endpoint_url`` overrides the standard configuration's; ``timeout_s`` bounds each call, botocore's
    tries together (and each of them: the connection and each wait for bytes). ``session`` is the botocore
    session it was made from (where its endpoint, region and credentials came from), ``s3`` botocore's client."""

    lists = True

    def __init__(self, retries: int = 5, endpoint_url: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_connections: int = 64):
        try:
            import botocore.session
            from botocore.config import Config
        except ImportError as e:
            raise ReadError(f"s3:// needs botocore (pip install 'gdsload[s3]'): {e}") from None
        self.retries, self.timeout_s = retries, check_timeout(timeout_s)
        self.session = botocore.session.get_session()
        self.s3 = self.session.create_client("s3", endpoint_url=endpoint_url or None, config=Config(
            retries={"mode": "standard", "total_max_attempts": retries + 1}, max_pool_connections=max_connections,
            connect_timeout=self.timeout_s, read_timeout=self.timeout_s))

    def _bounded(self, url: str, what: str, fn: Callable[[_Call], Any], stop: threading.Event | None = None,
                 changed: bool = False) -> Any:
        """``fn`` (botocore calls) on a thread of its own, waited for at most ``timeout_s``: its result, or the
        ReadError naming the URL (``no response for N s`` past the bound); :class:`Stopped` once ``stop`` is set."""
        call = _Call(fn)
        threading.Thread(target=call.run, name="gdsload-s3", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not call.done.wait(min(0.05, max(deadline - time.monotonic(), 0.0))):
            if stop is not None and stop.is_set():
                call.abandon()
                raise Stopped()
            if time.monotonic() >= deadline:
                call.abandon()
                t = f"{self.timeout_s:g}"
                stalled = "" if call.body is None else ": the body stalled after its headers"
                raise ReadError(redact(f"{url}: no response for {t} s ({what}{stalled})"))
        if call.error is not None:
            if isinstance(call.error, (FormatError, Stopped)):
                raise call.error
            error = self._fail(url, call.error, what, changed)
            if error is not call.error:  # botocore's error stays its context (the doctor reads it), unprinted
                error.__context__, error.__suppress_context__ = call.error, True
            raise error
        return call.result

    def _fail(self, url: str, e: BaseException, what: str, changed: bool = False) -> ReadError:
        """The ReadError for botocore's ``e``: NotFound for a missing object (ObjectChanged where it was there
        when opened), ObjectChanged for a failed IfMatch, else the status and S3's code and message."""
        from botocore.exceptions import ClientError

        if isinstance(e, ReadError):
            return e
        if not isinstance(e, ClientError):
            return ReadError(redact(f"{url}: {what} failed ({type(e).__name__}: {one_line(e)})"))
        err: dict[str, Any] = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code, message = str(err.get("Code", "")), err.get("Message", "")
        label = f" {code}" if code and code != str(status) else ""
        text = redact(f"{url}: HTTP {status}{label}{': ' + one_line(message) if message else ''} on {what}")
        if status == 412 or code == "PreconditionFailed" or (changed and code in _MISSING):
            return ObjectChanged(f"{text}: the object changed or was removed since it was opened")
        if code in _MISSING or status == 404:
            return NotFound(text)
        return ReadError(text)

    def head(self, url: str) -> ObjectInfo:
        bucket, key = split(url)
        got = self._bounded(url, "HEAD", lambda call: self.s3.head_object(Bucket=bucket, Key=key))
        return ObjectInfo(url, int(got["ContentLength"]), got.get("ETag"))

    def read(self, info: ObjectInfo, offset: int, nbytes: int, stop: threading.Event | None = None) -> bytes:
        url = info.url
        if nbytes <= 0:
            return b""
        info.check_range(offset, nbytes)
        bucket, key = split(url)
        extra = {"IfMatch": info.etag} if info.etag is not None else {}

        def fn(call: _Call) -> tuple[dict, bytes]:
            got = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + nbytes - 1}", **extra)
            return got, call.read(got, url, nbytes)

        got, body = self._bounded(url, f"GET of bytes {offset}..{offset + nbytes}", fn, stop, changed=True)
        total = str(got.get("ContentRange", "")).rpartition("/")[2]
        if total and total != str(info.size):
            raise ObjectChanged(redact(f"{url}: now {total} bytes (opened with {info.size})"))
        if len(body) != nbytes:
            raise ReadError(redact(f"{url}: {len(body)} bytes for bytes {offset}..{offset + nbytes} (expected "
                                   f"{nbytes})"))
        return body

    def get(self, url: str, max_bytes: int = MAX_GET_BYTES) -> bytes:
        bucket, key = split(url)
        return self._bounded(url, "GET", lambda call: call.read(self.s3.get_object(Bucket=bucket, Key=key), url,
                                                                max_bytes))

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        bucket, key = split(url)

        def fn(call: _Call) -> tuple[dict, bytes]:
            got = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=-{max(1, nbytes)}")
            return got, call.read(got, url, max(nbytes, MAX_GET_BYTES))

        got, body = self._bounded(url, f"GET of its last {nbytes} bytes", fn)
        total = str(got.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else len(body)  # no ContentRange: the whole object came
        return ObjectInfo(url, size, got.get("ETag")), body[max(0, len(body) - nbytes):]

    def list(self, url: str) -> list[str]:
        return [o.url for o in self.list_info(url)]

    def list_info(self, url: str) -> list[ObjectInfo]:
        bucket, key = split(url)
        prefix = key if not key or key.endswith("/") else key + "/"
        pages = iter(self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix))
        found = []
        while (page := self._bounded(url, "LIST", lambda call: next(pages, None))) is not None:  # a page a call
            found += [ObjectInfo(f"s3://{bucket}/{o['Key']}", int(o["Size"]), o.get("ETag"))
                      for o in page.get("Contents", [])]
        return sorted(found, key=lambda o: o.url)
