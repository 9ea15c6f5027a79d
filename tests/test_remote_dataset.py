"""GDSDataset over ``http://`` and ``s3://`` URLs: the dataset's skeleton (metadata, shard indexes) fetched into
a node-local cache once, its shards as they are read (tests/test_remote_cache.py tests the shard cache itself).
Real servers only, started here: tests/remote_servers.py's HTTP server and moto's S3 server."""

from __future__ import annotations

import multiprocessing
import os
import re

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.errors import FormatError
from gdsload.remote.mirror import MARKER, mirror, mirror_path

from _helpers import assert_same_batches, host_batches
from remote_servers import client_for_server, upload

N = 600


@pytest.fixture
def local(make_dataset) -> tuple[str, dict[str, np.ndarray]]:
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    return make_dataset(data, samples_per_block=16, shard_bytes=4 * 16 * 6 * 4), data


def _same_as_local(url: str, path: str, cache: str) -> None:
    with GDSDataset(path, 32, backend="cpu", shuffle=True, seed=3) as want_ds:
        want = host_batches(want_ds)
    with GDSDataset(url, 32, backend="cpu", shuffle=True, seed=3, cache_dir=cache) as ds:
        got = host_batches(ds)
    assert_same_batches(got, want)


# -- HTTP ------------------------------------------------------------------------------------------------
def test_a_dataset_over_http_reads_exactly_as_the_local_one(local, srv, tmp_path):
    path, _ = local
    url = upload(srv, path, "d.gds")
    _same_as_local(url, path, str(tmp_path / "cache"))
    (root,) = [n for n in os.listdir(tmp_path / "cache") if not n.endswith((".lock", ".shards"))]
    assert root.startswith(os.path.basename(mirror_path(url, str(tmp_path / "cache"))) + "@")
    assert os.path.exists(os.path.join(tmp_path / "cache", root, MARKER))
    assert not [n for n in os.listdir(tmp_path / "cache") if ".tmp-" in n or ".old-" in n], "nothing half-written"


def test_a_second_open_reads_the_mirror_and_a_changed_root_fetches_again(local, srv, tmp_path):
    path, _ = local
    url, cache = upload(srv, path, "d.gds"), str(tmp_path / "cache")
    first = mirror(url, cache)
    srv.reset_log()
    assert mirror(url, cache) == first
    keys = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    assert sorted((r.method, r.path) for r in srv.requests) == [("HEAD", f"/d.gds/{k}") for k in keys], \
        "a complete mirror costs one HEAD of each of its objects (whether any changed), and no GET"
    with GDSDataset(url, 32, backend="cpu", cache_dir=cache) as old:  # open on the first version meanwhile
        assert len(list(old)) == len(old)  # every shard now in the cache (no bound): the server's are no longer read
        shard = next(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(os.path.join(path, "x", "c"))
                     for f in fs)
        srv.delete(f"d.gds/{shard}")  # the server's dataset loses a shard, and its root zarr.json changes
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            srv.put("d.gds/zarr.json", f.read() + b"\n")  # the same JSON, another ETag
        with pytest.raises(FileNotFoundError, match=re.escape(f"{url}/{shard}: HTTP 404")):
            GDSDataset(url, 32, backend="cpu", cache_dir=cache)  # fetched again, beside: it lacks the shard
        assert len(list(old)) == len(old), "the dataset open on the first version still reads it whole"
    assert os.path.exists(os.path.join(first, MARKER)), "a complete version is never changed"


def test_a_foreign_group_over_http_is_refused_naming_the_url(srv, tmp_path):
    zarr = pytest.importorskip("zarr")
    g = zarr.open_group(str(tmp_path / "z.zarr"), mode="w", zarr_format=3)
    g.create_array("a", shape=(8, 2), dtype="int16", chunks=(4, 2))[:] = 1
    url = upload(srv, str(tmp_path / "z.zarr"), "z.zarr")
    with pytest.raises(FormatError, match=r"/z\.zarr: a Zarr group over HTTP\(S\) lists no arrays"):
        GDSDataset(url, 4, backend="cpu", cache_dir=str(tmp_path / "cache"))


def test_a_failing_server_is_a_read_error_naming_url_and_status_and_leaves_no_mirror(local, srv, tmp_path):
    path, _ = local
    url = upload(srv, path, "d.gds")
    srv.reset_log()
    srv.fail_next(100, 503)
    with client_for_server(srv, retries=2, backoff_s=0.01), \
            pytest.raises(ReadError, match=r"/d\.gds/zarr\.json: HEAD failed after 3 tries \(HTTP 503"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "cache"))
    assert srv.count == 3, "503 is retried, twice here"
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


# -- S3 --------------------------------------------------------------------------------------------------
def test_a_dataset_on_s3_reads_exactly_as_the_local_one(local, s3, tmp_path):
    path, _ = local
    _same_as_local(upload(s3, path, "sets/d.gds"), path, str(tmp_path / "cache"))


def test_a_listing_that_fails_is_an_error_not_another_route(local, s3, tmp_path):
    """Where the store lists (S3), a failed listing ends the open with its error: the objects are not then
    guessed from the metadata, which would pass over whatever the dataset holds beyond it. The process's S3
    client (gdsload.remote.use_client) reads moto's objects and is refused every listing."""
    from gdsload.remote import use_client
    from gdsload.remote.s3 import S3Client

    path, _ = local
    url = upload(s3, path, "sets/d.gds")

    class Refused(S3Client):
        def list(self, prefix):
            raise ReadError(f"{prefix}: HTTP 403 AccessDenied on LIST")

        list_info = list  # what the open lists with (sizes and ETags too)

    previous = use_client(url, Refused())
    try:
        with pytest.raises(ReadError, match=r"sets/d\.gds: HTTP 403 AccessDenied on LIST"):
            GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "cache"))
    finally:
        use_client(url, previous)


def test_a_missing_dataset_on_s3_is_not_found_naming_the_url(s3, tmp_path):
    url = s3.url("none.gds")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{url}/zarr.json: HTTP 404")):
        GDSDataset(url, 8, backend="cpu", cache_dir=str(tmp_path / "cache"))


def _open_in_child(url: str, cache: str, endpoint: str, out: multiprocessing.Queue) -> None:
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        with GDSDataset(url, 32, backend="cpu", cache_dir=cache) as ds:
            out.put(sum(len(b["idx"]) for b in ds))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(repr(e))


def test_ranks_of_a_node_share_one_mirror(local, s3, tmp_path):
    """Two processes opening the same URL at once: one fetches under the lock, the other waits and reads the
    same mirror; both read every sample, and the cache holds one mirror and nothing half-written."""
    path, _ = local
    url = upload(s3, path, "sets/d.gds")
    cache, ctx = str(tmp_path / "cache"), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_in_child, args=(url, cache, s3.endpoint, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert got == [N, N]
    (only,) = [n for n in os.listdir(cache) if not n.endswith((".lock", ".shards"))]
    assert only.startswith(os.path.basename(mirror_path(url, cache)) + "@"), "one mirror, nothing half-written"
