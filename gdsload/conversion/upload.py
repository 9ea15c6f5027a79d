"""Uploading a finished local dataset to ``s3://BUCKET/PREFIX/NAME``, published only once complete.

The root ``zarr.json`` goes up last, after every other file and after the objects of an older version that the
new one lacks are deleted; a marker object (:data:`MARKER`) says the prefix holds an unfinished upload, which the
next run completes; ``overwrite`` deletes the root ``zarr.json`` first; a prefix holding neither a dataset nor
the marker is never touched (why: docs/remote.md, "Conversion at scale"). Through botocore, as
:mod:`gdsload.remote.s3`; files above ``part_bytes`` go up multipart (aborted on failure), on ``threads`` threads.
Every failure is a ConversionError naming the URL and, where S3 answered, the status and S3's error code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from ..errors import ConversionError
from ..format.meta import ATTRS_KEY
from ..remote.s3 import split
from .spelling import overwrite_option

#: The object that marks an upload in progress (or cut short) under a dataset's prefix.
MARKER = ".gdsload-upload.json"
#: Part size of multipart uploads (S3 allows 5 MiB to 5 GiB, at most 10000 parts: larger files get larger parts).
PART_BYTES = 64 << 20
#: Files uploaded at once.
THREADS = 8


def _client(threads: int) -> Any:
    try:
        import botocore.session
        from botocore.config import Config
    except ImportError as e:
        raise ConversionError(f"an s3:// output needs botocore (pip install 'gdsload[s3]'): {e}") from None
    return botocore.session.get_session().create_client("s3", config=Config(
        retries={"mode": "standard", "total_max_attempts": 6}, max_pool_connections=2 * threads))


def _fail(url: str, e: Exception, what: str) -> ConversionError:
    """The ConversionError for botocore's ``e``: the URL, the HTTP status and S3's code and message."""
    from botocore.exceptions import ClientError

    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code, message = str(err.get("Code", "")), err.get("Message", "")
        label = f" {code}" if code and code != str(status) else ""
        return ConversionError(f"{url}: HTTP {status}{label}{': ' + message if message else ''} on {what}")
    return ConversionError(f"{url}: {what} failed ({type(e).__name__}: {e})")


class _Bucket:
    """The calls of one upload, each turning a failure into a ConversionError naming the object's URL."""

    def __init__(self, client: Any, bucket: str):
        self.s3, self.bucket = client, bucket

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def call(self, what: str, key: str, fn: Callable[..., Any], **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:
            if isinstance(e, ConversionError):
                raise
            raise _fail(self.url(key), e, what) from None

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        try:
            for page in pages:
                keys += [o["Key"] for o in page.get("Contents", [])]
        except Exception as e:
            raise _fail(self.url(prefix.rstrip("/")), e, "LIST") from None
        return keys

    def put(self, key: str, body: bytes) -> None:
        self.call("PUT", key, self.s3.put_object, Key=key, Body=body)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            got = self.call("DELETE", keys[i], self.s3.delete_objects,
                            Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            for err in got.get("Errors", []):
                raise ConversionError(f"{self.url(err.get('Key', ''))}: {err.get('Code')}: {err.get('Message')} "
                                      f"on DELETE")

    def upload(self, key: str, path: str, part_bytes: int, progress: Callable[[int], None]) -> None:
        """One file: a PUT, or a multipart upload (aborted if it fails) when larger than ``part_bytes``."""
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if size <= part_bytes:
                    self.call("PUT", key, self.s3.put_object, Key=key, Body=f, ContentLength=size)
                    progress(size)
                    return
                self._multipart(key, f, max(part_bytes, -(-size // 10000)), progress)
        except OSError as e:
            raise ConversionError(f"{path}: cannot read ({e.strerror or e}) to upload it to {self.url(key)}") from None

    def _multipart(self, key: str, f: Any, part_bytes: int, progress: Callable[[int], None]) -> None:
        upload_id = self.call("PUT (multipart start)", key, self.s3.create_multipart_upload, Key=key)["UploadId"]
        try:
            done = []
            while chunk := f.read(part_bytes):
                n = len(done) + 1
                got = self.call(f"PUT of part {n}", key, self.s3.upload_part, Key=key, UploadId=upload_id,
                                PartNumber=n, Body=chunk)
                done.append({"ETag": got["ETag"], "PartNumber": n})
                progress(len(chunk))
            self.call("PUT (multipart end)", key, self.s3.complete_multipart_upload, Key=key, UploadId=upload_id,
                      MultipartUpload={"Parts": done})
        except BaseException:
            with contextlib.suppress(Exception):
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise


def _local_files(local: str) -> list[str]:
    found = []
    for folder, _, names in os.walk(local):
        found += [os.path.relpath(os.path.join(folder, n), local).replace(os.sep, "/") for n in names]
    if "zarr.json" not in found:
        raise ConversionError(f"{local}: holds no zarr.json: not a dataset to upload")
    return sorted(found)


def _check_replaceable(b: _Bucket, root: str, url: str) -> None:
    """``--overwrite`` replaces only a gdsload dataset: a root zarr.json of a Zarr v3 group with its attribute."""
    body = b.call("GET", root, b.s3.get_object, Key=root)["Body"].read()
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not (isinstance(doc, dict) and doc.get("zarr_format") == 3 and doc.get("node_type") == "group"
            and ATTRS_KEY in (doc.get("attributes") or {})):
        raise ConversionError(f"{url}: {overwrite_option()} replaces only a gdsload dataset (found a zarr.json that "
                              f"is not a Zarr v3 group with a '{ATTRS_KEY}' attribute)")


def upload_dataset(local: str, url: str, *, overwrite: bool = False, progress: bool | None = None,
                   part_bytes: int = PART_BYTES, threads: int = THREADS) -> int:
    """Upload the dataset at ``local`` to ``url`` (``s3://BUCKET/PREFIX``), the root ``zarr.json`` last; returns
    the bytes uploaded. Refused when ``url`` holds a dataset (unless ``overwrite``) or objects of something
    else. See the module's docstring for what a reader sees meanwhile."""
    from tqdm import tqdm

    bucket, prefix = split(url)
    prefix = prefix.strip("/")
    if not prefix:
        raise ConversionError(f"{url}: expected s3://BUCKET/PREFIX (a dataset needs a prefix of its own)")
    url = f"s3://{bucket}/{prefix}"
    files = _local_files(local)
    b = _Bucket(_client(threads), bucket)
    base = prefix + "/"
    root, marker = base + "zarr.json", base + MARKER
    existing = set(b.list(base))
    if root in existing:
        if not overwrite:
            raise ConversionError(f"{url}: output exists (a dataset's zarr.json is there; pass "
                                  f"{overwrite_option()} to replace it)")
        _check_replaceable(b, root, url)
    elif existing and marker not in existing:
        raise ConversionError(f"{url}: holds {len(existing)} object(s) but no dataset (no zarr.json, no marker of "
                              f"an unfinished upload); left as it is: choose another URL or remove them")
    b.put(marker, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
    if root in existing:
        b.delete([root])  # from here on readers find no dataset, never a mix of two versions
    sizes = {rel: os.path.getsize(os.path.join(local, *rel.split("/"))) for rel in files}
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"upload {prefix.rsplit('/', 1)[-1]}",
              disable=None if progress is None else not progress) as bar:
        pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="gdsload-upload")
        try:
            jobs = [pool.submit(b.upload, base + rel, os.path.join(local, *rel.split("/")), part_bytes, bar.update)
                    for rel in files if rel != "zarr.json"]
            concurrent.futures.wait(jobs, return_when=concurrent.futures.FIRST_EXCEPTION)
            for job in jobs:
                if job.done() and job.exception() is not None:
                    raise job.exception()  # type: ignore[misc]
            for job in jobs:
                job.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        stale = sorted(existing - {base + rel for rel in files} - {root, marker})
        if stale:
            b.delete(stale)
        publish_root(b, root, os.path.join(local, "zarr.json"), bar.update)
    b.delete([marker])
    return sum(sizes.values())


def publish_root(b: _Bucket, root: str, path: str, progress: Callable[[int], None]) -> None:
    """The last step: the root ``zarr.json``, which makes the dataset exist for readers."""
    b.upload(root, path, PART_BYTES, progress)
