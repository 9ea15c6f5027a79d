"""GDSDataset over ``http://`` and ``s3://`` URLs: the dataset mirrored into a node-local cache once, then read
as a local one. Real servers only, started here: Python's HTTP server and moto's S3 server mode."""

from __future__ import annotations

import functools
import hashlib
import http.server
import multiprocessing
import os
import re
import shutil
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.errors import FormatError
from gdsload.format.mirror import MARKER, mirror, mirror_path

from remote_servers import MotoS3, moto_server

N = 600


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files of a folder, with an ETag (size and mtime) and a failure mode the test sets on the server."""

    def log_message(self, *args: object) -> None:
        pass

    def end_headers(self) -> None:
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            st = os.stat(path)
            self.send_header("ETag", '"%s"' % hashlib.md5(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest())
        super().end_headers()

    def send_head(self):  # type: ignore[no-untyped-def]
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        status = self.server.fail_with  # type: ignore[attr-defined]
        if status:
            self.send_error(status)
            return None
        return super().send_head()


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[http.server.ThreadingHTTPServer, str]]:
    """An HTTP server of ``tmp_path/www`` and its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    server.requests, server.fail_with = [], 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def s3(monkeypatch) -> Iterator[MotoS3]:
    """A fresh bucket on moto's S3 server, reached the standard way (tests/remote_servers.py)."""
    import gdsload.remote as remote

    with moto_server(monkeypatch) as bucket:
        monkeypatch.setattr(remote, "_clients", {})  # a client made for another server's endpoint is not reused
        yield bucket


@pytest.fixture
def local(make_dataset) -> tuple[str, dict[str, np.ndarray]]:
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    return make_dataset(data, samples_per_block=16, shard_bytes=4 * 16 * 6 * 4), data


def _batches(ds: GDSDataset) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in b.items()} for b in ds]


def _same_as_local(url: str, path: str, cache: str) -> None:
    with GDSDataset(path, 32, backend="cpu", shuffle=True, seed=3) as want_ds:
        want = _batches(want_ds)
    with GDSDataset(url, 32, backend="cpu", shuffle=True, seed=3, cache_dir=cache) as ds:
        got = _batches(ds)
    assert len(got) == len(want) and all(g.keys() == w.keys() for g, w in zip(got, want))
    for g, w in zip(got, want):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def _upload(s3: MotoS3, path: str, prefix: str) -> str:
    """Every file of the dataset at ``path`` put under ``prefix``; the dataset's URL."""
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                s3.put(f"{prefix}/{os.path.relpath(os.path.join(d, f), path)}", fh.read())
    return s3.url(prefix)


# -- HTTP ------------------------------------------------------------------------------------------------
def test_a_dataset_over_http_reads_exactly_as_the_local_one(local, served, tmp_path):
    path, _ = local
    server, base = served
    shutil.copytree(path, str(tmp_path / "www" / "d.gds"))
    _same_as_local(f"{base}/d.gds", path, str(tmp_path / "cache"))
    (root,) = [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")]
    assert root.startswith(os.path.basename(mirror_path(f"{base}/d.gds", str(tmp_path / "cache"))) + "@")
    assert os.path.exists(os.path.join(tmp_path / "cache", root, MARKER))
    assert not [n for n in os.listdir(tmp_path / "cache") if ".tmp-" in n or ".old-" in n], "nothing half-written"


def test_a_second_open_reads_the_mirror_and_a_changed_root_fetches_again(local, served, tmp_path):
    path, _ = local
    server, base = served
    www = tmp_path / "www" / "d.gds"
    shutil.copytree(path, str(www))
    url, cache = f"{base}/d.gds", str(tmp_path / "cache")
    first = mirror(url, cache)
    server.requests.clear()
    assert mirror(url, cache) == first
    assert server.requests == ["/d.gds/zarr.json"], "a complete mirror costs one HEAD of the root zarr.json"
    with GDSDataset(url, 32, backend="cpu", cache_dir=cache) as old:  # open on the first version meanwhile
        shard = next(os.path.join(d, f) for d, _, fs in os.walk(www / "x" / "c") for f in fs)
        os.remove(shard)  # the server's dataset loses a shard, and its root zarr.json changes (another ETag)
        os.utime(www / "zarr.json", ns=(1, 1))
        with pytest.raises(FormatError, match="shard files"):
            GDSDataset(url, 32, backend="cpu", cache_dir=cache)  # fetched again, beside: it lacks the shard too
        assert len(list(old)) == len(old), "the dataset open on the first version still reads it whole"
    assert os.path.exists(os.path.join(first, MARKER)), "a complete version is never changed"


def test_a_foreign_group_over_http_is_refused_naming_the_url(served, tmp_path):
    zarr = pytest.importorskip("zarr")
    server, base = served
    g = zarr.open_group(str(tmp_path / "www" / "z.zarr"), mode="w", zarr_format=3)
    g.create_array("a", shape=(8, 2), dtype="int16", chunks=(4, 2))[:] = 1
    with pytest.raises(FormatError, match=r"/z\.zarr: a Zarr group over HTTP\(S\) lists no arrays"):
        GDSDataset(f"{base}/z.zarr", 4, backend="cpu", cache_dir=str(tmp_path / "cache"))


def test_a_failing_server_is_a_read_error_naming_url_and_status_and_leaves_no_mirror(local, served, tmp_path,
                                                                                      monkeypatch):
    import gdsload.remote as remote
    from gdsload.remote.http import HttpClient

    path, _ = local
    server, base = served
    shutil.copytree(path, str(tmp_path / "www" / "d.gds"))
    monkeypatch.setattr(remote, "_clients", {("http", base.split("://")[1]): HttpClient(retries=2, backoff_s=0.01)})
    server.fail_with = 503
    with pytest.raises(ReadError, match=r"/d\.gds/zarr\.json: HEAD failed after 3 tries \(HTTP 503"):
        GDSDataset(f"{base}/d.gds", 32, backend="cpu", cache_dir=str(tmp_path / "cache"))
    assert len(server.requests) == 3, "503 is retried, twice here"
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


# -- S3 --------------------------------------------------------------------------------------------------
def test_a_dataset_on_s3_reads_exactly_as_the_local_one(local, s3, tmp_path):
    path, _ = local
    _same_as_local(_upload(s3, path, "sets/d.gds"), path, str(tmp_path / "cache"))


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
    url = _upload(s3, path, "sets/d.gds")
    cache, ctx = str(tmp_path / "cache"), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_in_child, args=(url, cache, s3.endpoint, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert got == [N, N]
    (only,) = [n for n in os.listdir(cache) if not n.endswith(".lock")]
    assert only.startswith(os.path.basename(mirror_path(url, cache)) + "@"), "one mirror, nothing half-written"
