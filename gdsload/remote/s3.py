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
    are). ``endpoint_url`` overrides the standard configuration's."""

    lists = True

    def __init__(self, retries: int = 5, endpoint_url: str | None = None):
        try:
            import botocore.session
            from botocore.config import Config
        except ImportError as e:
            raise ReadError(f"s3:// needs botocore (pip install 'gdsload[s3]'): {e}") from None
        self.retries = retries
        session = botocore.session.get_session()
        self._s3 = session.create_client("s3", endpoint_url=endpoint_url or None, config=Config(
            retries={"mode": "standard", "total_max_attempts": retries + 1}, max_pool_connections=64))

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
            got = self._s3.head_object(Bucket=bucket, Key=key)
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
            got = self._s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + nbytes - 1}", **extra)
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
            return self._s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as e:
            raise self._fail(url, e, "GET") from None

    def list(self, url: str) -> list[str]:
        bucket, key = split(url)
        prefix = key if not key or key.endswith("/") else key + "/"
        found = []
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                found += [f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", [])]
        except Exception as e:
            raise self._fail(url, e, "LIST") from None
        return sorted(found)
