"""``s3://bucket/key`` objects through botocore, the well-kept client every AWS tool builds on: credentials,
region and endpoint come the standard way (the ``AWS_*`` environment, ``~/.aws`` files, instance roles;
``AWS_ENDPOINT_URL`` for an S3-compatible store), retries are botocore's standard mode (5xx, throttling,
timeouts, with backoff), reads are pinned with ``IfMatch``, and every refusal names the URL and the status."""

from __future__ import annotations

from typing import Any

from ..errors import ReadError
from .objects import NotFound, ObjectChanged, ObjectInfo

#: Error codes S3 gives for an object that is not there.
_MISSING = ("404", "NoSuchKey", "NotFound")


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); ValueError naming the URL without a bucket."""
    rest = url.split("://", 1)[1] if "://" in url else ""
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url}: not an s3:// URL with a bucket (expected s3://BUCKET/KEY)")
    return bucket, key


class S3Client:
    """An :class:`gdsload.remote.objects.ObjectClient` for ``s3://`` URLs (thread-safe, as botocore's clients
    are). ``endpoint_url`` overrides the standard configuration's; ``timeout_s``, where given, bounds the
    connection and each wait for bytes (botocore's default otherwise). ``session`` is the botocore session
    it was made from (where its endpoint, region and credentials came from), ``s3`` botocore's client."""

    lists = True

    def __init__(self, retries: int = 5, endpoint_url: str | None = None, timeout_s: float | None = None,
                 max_connections: int = 64):
        try:
            import botocore.session
            from botocore.config import Config
        except ImportError as e:
            raise ReadError(f"s3:// needs botocore (pip install 'gdsload[s3]'): {e}") from None
        self.retries = retries
        bounds = {} if timeout_s is None else {"connect_timeout": timeout_s, "read_timeout": timeout_s}
        self.session = botocore.session.get_session()
        self.s3 = self.session.create_client("s3", endpoint_url=endpoint_url or None, config=Config(
            retries={"mode": "standard", "total_max_attempts": retries + 1}, max_pool_connections=max_connections,
            **bounds))

    def _fail(self, url: str, e: Exception, what: str, changed: bool = False) -> ReadError:
        """The ReadError for botocore's ``e``: NotFound for a missing object (ObjectChanged where it was there
        when opened), ObjectChanged for a failed IfMatch, else the status and S3's code and message."""
        from botocore.exceptions import ClientError

        if not isinstance(e, ClientError):
            return ReadError(f"{url}: {what} failed ({type(e).__name__}: {e})")
        err: dict[str, Any] = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code, message = str(err.get("Code", "")), err.get("Message", "")
        label = f" {code}" if code and code != str(status) else ""
        text = f"{url}: HTTP {status}{label}{': ' + message if message else ''} on {what}"
        if status == 412 or code == "PreconditionFailed" or (changed and code in _MISSING):
            return ObjectChanged(f"{text}: the object changed or was removed since it was opened")
        if code in _MISSING or status == 404:
            return NotFound(text)
        return ReadError(text)

    def head(self, url: str) -> ObjectInfo:
        bucket, key = split(url)
        try:
            got = self.s3.head_object(Bucket=bucket, Key=key)
        except Exception as e:
            raise self._fail(url, e, "HEAD") from None
        return ObjectInfo(url, int(got["ContentLength"]), got.get("ETag"))

    def read(self, info: ObjectInfo, offset: int, nbytes: int) -> bytes:
        if nbytes <= 0:
            return b""
        if offset < 0 or offset + nbytes > info.size:
            raise ReadError(f"{info.url}: bytes {offset}..{offset + nbytes} lie past its end ({info.size} bytes)")
        bucket, key = split(info.url)
        extra = {"IfMatch": info.etag} if info.etag is not None else {}
        what = f"GET of bytes {offset}..{offset + nbytes}"
        try:
            got = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + nbytes - 1}", **extra)
            body = got["Body"].read()
        except Exception as e:
            raise self._fail(info.url, e, what, changed=True) from None
        total = str(got.get("ContentRange", "")).rpartition("/")[2]
        if total and total != str(info.size):
            raise ObjectChanged(f"{info.url}: now {total} bytes (opened with {info.size})")
        if len(body) != nbytes:
            raise ReadError(f"{info.url}: {len(body)} bytes for bytes {offset}..{offset + nbytes} (expected {nbytes})")
        return body

    def get(self, url: str) -> bytes:
        bucket, key = split(url)
        try:
            return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as e:
            raise self._fail(url, e, "GET") from None

    def read_end(self, url: str, nbytes: int) -> tuple[ObjectInfo, bytes]:
        bucket, key = split(url)
        try:
            got = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=-{max(1, nbytes)}")
            body = got["Body"].read()
        except Exception as e:
            raise self._fail(url, e, f"GET of its last {nbytes} bytes") from None
        total = str(got.get("ContentRange", "")).rpartition("/")[2]
        size = int(total) if total.isdigit() else len(body)  # no ContentRange: the whole object came
        return ObjectInfo(url, size, got.get("ETag")), body[max(0, len(body) - nbytes):]

    def list(self, url: str) -> list[str]:
        return [o.url for o in self.list_info(url)]

    def list_info(self, url: str) -> list[ObjectInfo]:
        bucket, key = split(url)
        prefix = key if not key or key.endswith("/") else key + "/"
        found = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                found += [ObjectInfo(f"s3://{bucket}/{o['Key']}", int(o["Size"]), o.get("ETag"))
                          for o in page.get("Contents", [])]
        except Exception as e:
            raise self._fail(url, e, "LIST") from None
        return sorted(found, key=lambda o: o.url)
