"""The direct route of a remote dataset (gdsload/backends/remote_direct.py): the route's rule and facts
(gdsload/remote/route.py, gdsload/backends/source.py), the map from a skeleton's shard files to their objects,
the reads and their pinning, on the CPU; on a GPU, whole datasets read by KvikIO's RemoteFile straight into
device memory and the faults. Real servers only, started here:
tests/remote_servers.py's HTTP server, and moto's S3 server where moto is installed (carried to the GPU machine
in a wheel folder of its own)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.backends import BACKENDS, info, resolve
from gdsload.backends import remote_direct as rd
from gdsload.backends import source as sources
from gdsload.backends.base import FillRequest, ReadRequest, fill_pattern
from gdsload.backends.cpu import CpuBackend
from gdsload.remote.mirror import open_version
from gdsload.remote import route as rules
from gdsload.remote.objects import ObjectChanged, ObjectInfo, join

from _helpers import assert_same_batches, host_batches, ragged_source
from remote_servers import Seen, upload

N = 600
SPB = 16
S3_ENV = {"AWS_ACCESS_KEY_ID": "AKIAX", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
CLIENT_TIMEOUT_S = 2.0  # conftest's fast_client: the pin checks' (no fault here waits on it)


@pytest.fixture
def local(make_dataset) -> str:
    rng = np.random.default_rng(0)
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    seqs = [rng.integers(0, 1000, size=int(rng.integers(1, 9))).astype(np.int32) for _ in range(N)]
    return make_dataset(data, samples_per_block=SPB, shard_bytes=4 * SPB * 6 * 4,
                        ragged={"tokens": ragged_source(seqs)})


# -- the route's rule (pure) -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend, on_device, locks_named, cache_option, usable, route, why", [
    ("cpu", False, False, None, (True, ""), "cached", "the cpu backend reads into host memory"),
    ("cpu", False, False, "cache_dir", (True, ""), "cached", "host memory"),
    ("pinned", True, False, "cache_dir", (True, ""), "cached", "cache_dir was given"),
    ("kvikio", True, False, "cache_bytes", (True, ""), "cached", "cache_bytes was given"),
    ("mmap", True, True, None, (True, ""), "cached", "the mmap backend was asked for by name"),
    ("kvikio", True, False, None, (False, "KvikIO is not installed"), "cached",
     "the direct route is not usable here (KvikIO is not installed)"),
    ("pinned", True, False, None, (False, "this KvikIO was built without remote file support (libcurl)"), "cached",
     "without remote file support"),
    ("kvikio", True, False, None, (True, ""), "direct", "KvikIO's RemoteFile reads each window's byte ranges"),
    ("pinned", True, False, None, (True, ""), "direct", "straight into device memory"),
    ("mmap", True, False, None, (True, ""), "direct", "a GPU backend and no cache_dir"),  # auto chose mmap
])
def test_the_route_rule(backend, on_device, locks_named, cache_option, usable, route, why):
    got = rules.choose_route(backend, on_device, locks_named, cache_option, usable)
    assert got.name == route and why in got.reason, got


@pytest.mark.parametrize("url, env, kvikio, ok, why", [
    ("http://h/d.gds", {}, (False, False), False, "KvikIO is not installed"),
    ("http://h/d.gds", {}, (True, False), False, "without remote file support"),
    ("http://h/d.gds", {"KVIKIO_REMOTE_IO_BACKEND": "MULTI_POLL"}, (True, True), False,
     "KVIKIO_REMOTE_IO_BACKEND=multi_poll reads into host memory only"),
    ("http://h/d.gds", {"KVIKIO_REMOTE_IO_BACKEND": "easy_threadpool"}, (True, True), True, ""),
    ("https://h/d.gds", {}, (True, True), True, ""),
    ("s3://b/d.gds", {}, (True, True), False,
     "environment only: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION not set"),
    ("s3://b/d.gds", {**S3_ENV, "AWS_DEFAULT_REGION": ""}, (True, True), False, ": AWS_DEFAULT_REGION not set"),
    ("s3://b/d.gds", {**S3_ENV, "AWS_DEFAULT_REGION": "", "AWS_REGION": "eu-west-1"}, (True, True), True, ""),
    ("S3://b/d.gds", {**S3_ENV, "AWS_ACCESS_KEY_ID": "ASIAX"}, (True, True), False, "without AWS_SESSION_TOKEN"),
    ("s3://b/d.gds", {**S3_ENV, "AWS_ACCESS_KEY_ID": "ASIAX", "AWS_SESSION_TOKEN": "t"}, (True, True), True, ""),
    ("s3://b/d.gds", S3_ENV, (True, True), True, ""),
])
def test_whether_kvikio_can_read_the_url(url, env, kvikio, ok, why):
    got_ok, got_why = rules.direct_usable(url, env, kvikio)
    assert got_ok is ok and why in got_why and (got_why == "") is ok, got_why


@pytest.mark.skipif(rules.kvikio_remote()[0], reason="KvikIO is installed here")
def test_the_facts_here_without_kvikio_give_the_cached_route_with_the_reason():
    assert rules.kvikio_remote() == (False, False)
    for backend in ("kvikio", "pinned"):
        got = sources.route_for("http://h/d.gds", backend, True, None)
        assert got == (rules.CACHED, "the direct route is not usable here (KvikIO is not installed (pip install "
                                  "'gdsload[gpu]')): shards come through the node's cache")
    assert sources.route_for("http://h/d.gds", "mmap", True, None).reason.startswith("the mmap backend was asked for")
    assert sources.route_for("http://h/d.gds", "mmap", False, "cache_dir").reason.startswith("cache_dir was given")
    assert sources.route_for("http://h/d.gds", "cpu", True, None).reason.startswith("the cpu backend reads into host")


def test_the_direct_backend_is_in_the_registry_but_not_a_name_users_pass(local):
    i = info(rd.BACKEND)
    assert i.on_device and i.needs_kvikio and not i.locks_dataset and i.io_modes == (rd.IO_MODE,)
    assert i.backend_class.name == rd.BACKEND and i.backend_class.io_mode == rd.IO_MODE
    assert {"num_threads", "task_bytes", "max_read_bytes", "check_threads"} == set(i.defaults["options"])
    assert rd.BACKEND not in BACKENDS
    with pytest.raises(ValueError, match="unknown backend 'remote'"):
        resolve(rd.BACKEND)
    with pytest.raises(ValueError, match="backend"):
        GDSDataset(local, 32, backend=rd.BACKEND)
    objects = {"/p": ObjectInfo("http://h/p", 10, None)}
    assert rd.direct_options({"num_threads": 4, "pool_bytes": 1 << 20}, objects, 7.0) == {
        "num_threads": 4, "objects": objects, "timeout_s": 7.0}


def test_remote_files_are_opened_with_the_pinned_size_one_per_object_by_the_documented_api(monkeypatch):
    """KvikIO's documented openers (26.x: ``RemoteFile.open_http(url, nbytes)``, ``open_s3_url(url, nbytes,
    aws_region_name=..., aws_endpoint_url=...)``) get the size pinned at open and the environment's S3 settings;
    KvikIO itself is not here, so a recorder stands in for the module."""
    import sys
    import types

    calls = []

    class RemoteFile:
        @classmethod
        def open_http(cls, url, nbytes=None):
            calls.append(("http", url, nbytes))
            return cls()

        @classmethod
        def open_s3_url(cls, url, nbytes=None, **kw):
            calls.append(("s3", url, nbytes, kw))
            return cls()

    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(RemoteFile=RemoteFile))
    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": "http://generic:9000", "AWS_ENDPOINT_URL_S3": "http://s3:9000"}.items():
        monkeypatch.setenv(k, v)
    http, s3 = ObjectInfo("http://h/d.gds/x/c/0/0", 123, '"e"'), ObjectInfo("s3://b/d.gds/x/c/1/0", 456, None)
    reads = rd.DirectReads({"/a": http, "/b": s3}, rd.open_remote_file)
    try:
        assert reads.handle(http) is reads.handle(http) and reads.handle(s3) is reads.handle(s3)
    finally:
        reads.close()
    assert calls == [("http", http.url, 123), ("s3", s3.url, 456, {"aws_region_name": "us-east-1",
                                                                    "aws_endpoint_url": "http://s3:9000"})]

    def refuse(info: ObjectInfo) -> None:
        raise RuntimeError("S3: must provide `aws_region` if AWS_DEFAULT_REGION isn't set.")

    reads = rd.DirectReads({"/a": http}, refuse)
    try:
        with pytest.raises(ReadError, match=r"^http://h/d\.gds/x/c/0/0: cannot open it with KvikIO \(RuntimeError: S3"):
            reads.handle(http)
    finally:
        reads.close()


# -- the objects of a skeleton, and the reads --------------------------------------------------------------
def test_every_shard_file_of_a_skeleton_maps_to_its_object_pinned(local, srv, tmp_path):
    url = upload(srv, local)
    version = open_version(url, str(tmp_path / "c"))
    objects = rd.object_map(version.shards)
    keys = {p[len("/d.gds/"):] for p in srv.objects if "/c/" in p and "checksums" not in p and "offsets" not in p}
    assert {os.path.relpath(p, version.root) for p in objects} == keys and len(keys) > 10
    for path, o in objects.items():
        key = os.path.relpath(path, version.root)
        assert o.url == join(url, key) and o.size == len(srv.objects[f"/d.gds/{key}"]) == os.path.getsize(path)
        assert o.etag == srv.etag(f"d.gds/{key}")


class _RangedGet:
    """A stand-in for KvikIO's RemoteFile on the CPU: the ranges it asks for, as KvikIO sends them (a ranged GET,
    no If-Match, nothing of the answer checked but its status), into a host buffer."""

    def __init__(self, info: ObjectInfo):
        self.url, self.size = info.url, info.size

    def pread(self, buf: np.ndarray, size: int, offset: int) -> _Done:
        done = _Done()
        try:
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={offset}-{offset + size - 1}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                body = resp.read()
            buf[:len(body)] = np.frombuffer(body, dtype=np.uint8)[:size]
            done.set_result(size)  # as KvikIO: the size asked for, whatever came
        except BaseException as e:  # noqa: BLE001 - what KvikIO's future raises
            done.set_exception(RuntimeError(f"curl_easy_perform() error ({e})"))
        return done


class _Done(Future):
    """A finished read, with the ``get()`` of KvikIO's IOFuture."""

    def get(self) -> int:
        return self.result()


def _data_requests(version, objects) -> tuple[list[ReadRequest], int]:
    """A read of every shard's data (its bytes before the index), back to back in one buffer."""
    requests, at = [], 0
    for path in sorted(objects):
        n = version.shards[path].keep_lo
        if n:
            requests.append(ReadRequest(path, 0, n, at))
            at += n
    return requests, at


@contextlib.contextmanager
def _direct_reads(local: str, srv, tmp_path, check_threads: int) -> Iterator[tuple]:
    """``local`` uploaded to ``srv``, and direct reads of its objects through the stand-in for KvikIO:
    (version, objects, requests of every shard's data, their bytes, reads), the reads closed after."""
    version = open_version(upload(srv, local), str(tmp_path / "c"))
    objects = rd.object_map(version.shards)
    requests, nbytes = _data_requests(version, objects)
    reads = rd.DirectReads(objects, _RangedGet, check_threads=check_threads)
    try:
        yield version, objects, requests, nbytes, reads
    finally:
        reads.close()


def test_reads_come_from_the_objects_and_an_object_changed_since_is_an_error_naming_it(local, srv, tmp_path,
                                                                                     fast_client):
    with _direct_reads(local, srv, tmp_path, 4) as (version, objects, requests, nbytes, reads):
        buf = np.zeros(nbytes, dtype=np.uint8)
        reads.submit(buf, requests, threading.Event()).finish()
        for r in requests:  # the bytes of the local dataset's files (the cache's sparse files hold none of them)
            with open(os.path.join(local, os.path.relpath(r.path, version.root)), "rb") as f:
                assert buf[r.dest_offset:r.dest_offset + r.nbytes].tobytes() == f.read(r.nbytes), r.path
        assert reads.stats()["pin_checks"] == len(requests) and reads.stats()["objects_open"] == len(requests)

        victim = requests[len(requests) // 2]
        key = "/" + objects[victim.path].url.split("/", 3)[3]
        old = srv.objects[key]
        srv.put(key, bytes(len(old) - 8) + old[-8:])  # same size, another ETag: KvikIO's reads go through
        with pytest.raises(ObjectChanged, match=rf"{objects[victim.path].url}: HTTP 412: the object changed"):
            reads.submit(buf, requests, threading.Event()).finish()
        srv.put(key, old[:-1])  # shorter: the range past the new end comes short
        with pytest.raises(ObjectChanged, match=rf"{objects[victim.path].url}: HTTP 412"):
            reads.submit(buf, [victim], threading.Event()).finish()
        srv.delete(key)
        with pytest.raises(ObjectChanged, match=rf"{objects[victim.path].url}: HTTP 404"):
            reads.submit(buf, [victim], threading.Event()).finish()
        srv.put(key, old)

        srv.reset_log()
        past = ReadRequest(victim.path, objects[victim.path].size - 4, 8, victim.dest_offset)
        with pytest.raises(ReadError, match=rf"{objects[victim.path].url}: bytes \d+\.\.\d+ lie past its end"):
            reads.submit(buf, [past], threading.Event()).finish()
        stopped = threading.Event()
        stopped.set()
        reads.submit(buf, requests, stopped).finish()
        assert srv.count == 0, "nothing is asked of the server for a range past the pinned size, nor once stopped"
        with pytest.raises(ReadError, match="/nowhere: not a file of this remote dataset"):
            reads.submit(buf, [ReadRequest("/nowhere", 0, 4, 0)], threading.Event()).finish()


def test_a_read_that_fails_on_an_unchanged_object_is_a_read_error_naming_its_url(local, srv, tmp_path,
                                                                                fast_client):
    with _direct_reads(local, srv, tmp_path, 2) as (_, _, requests, nbytes, reads):
        srv.fail_next(1, 500)  # the stand-in does not retry (KvikIO does: http_max_attempts)
        with pytest.raises(ReadError, match=r"http://127\.0\.0\.1:\d+/d\.gds/.*: read of \d+ bytes at offset 0 "
                                            r"failed \(RuntimeError: curl_easy_perform\(\) error \(HTTP Error 500"):
            reads.submit(np.zeros(nbytes, dtype=np.uint8), requests[:1], threading.Event()).finish()


def test_the_cpu_backend_on_a_remote_dataset_says_its_route_and_why(local, srv, tmp_path):
    url = upload(srv, local)
    with GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c")) as ds:
        remote = ds.describe()["remote"]  # present: the dataset holds a remote version (its skeleton)
        assert ds.backend_name == "cpu"
    assert remote["route"] == "cached" and remote["route_reason"].startswith("the cpu backend reads into host memory")
    # the cached route reads through the skeleton's own cache: the first window, read at the open, fetched shards
    assert remote["fetched_shards"] > 0 and remote["version"].startswith(str(tmp_path / "c"))


class _HostDirect(CpuBackend):
    """The direct route's backend with host buffers: the same reads and checks (DirectReads), by the stand-in
    RemoteFile; what the reader does with the route is then seen without a GPU."""

    name, io_mode = rd.BACKEND, rd.IO_MODE

    def __init__(self, objects: dict[str, ObjectInfo], **options: object):
        super().__init__()
        self.reads = rd.DirectReads(objects, _RangedGet, None, 4)

    def submit(self, dest, requests, stop):
        for r in requests:
            if isinstance(r, FillRequest):
                fill_pattern(dest, r)
        return self.reads.submit(dest, requests, stop)

    def stats(self) -> dict[str, int]:
        return self.reads.stats()

    def close(self) -> None:
        self.reads.close()
        super().close()


def test_the_reader_on_the_direct_route_fetches_no_shard_and_stops_at_an_object_replaced(local, srv, tmp_path,
                                                                                        fast_client, monkeypatch):
    import dataclasses

    import gdsload.pipeline.reader as reader_module

    made = sources.make_backend
    monkeypatch.setattr(sources, "route_for", lambda url, backend, named, cache: rules.choose_route(
        backend, True, False, cache, (True, "")))
    monkeypatch.setattr(sources, "make_backend", lambda name, device, **o: _HostDirect(**o)
                        if name == rd.BACKEND else made(name, device, **o))
    monkeypatch.setattr(reader_module, "info", lambda name: dataclasses.replace(info(name), on_device=False))
    monkeypatch.setenv("GDSLOAD_CACHE_DIR", str(tmp_path / "gdsload-cache"))
    url = upload(srv, local)
    opts = dict(shuffle=True, seed=3, window_blocks=2, prefetch=1, pad_to="max", resident_bytes=0)
    with GDSDataset(local, 32, backend="cpu", **opts) as ref:
        want = host_batches(ref)
    got = []
    with GDSDataset(url, 32, backend="cpu", **opts) as ds:
        opened = ds.describe()  # at the open: a remote version (its skeleton), the direct route, nothing fetched
        assert "remote" in opened and opened["remote"]["route"] == "direct" and ds.backend_name == rd.BACKEND
        assert opened["remote"]["fetched_shards"] == 0
        assert ds.backend_reason == "a remote dataset's direct route, in place of 'cpu' (requested)"
        assert_same_batches(host_batches(ds), want)
        d = ds.describe()
        assert d["remote"]["route"] == "direct" and d["remote"]["fetched_shards"] == 0
        assert d["backend_stats"]["pin_checks"] > 0 and d["io_mode"] == rd.IO_MODE
        assert os.listdir(d["remote"]["version"] + ".shards") == ["open.lock"], "no shard was fetched"
        with pytest.raises(ReadError, match=r"http://127\.0\.0\.1:\d+/d\.gds/x/c/\d+/0: HTTP 412: the object "
                                            r"changed .* \(reading window \d+ of epoch 1"):
            for b in ds:
                got.append(b)
                if len(got) == 2:
                    for key in [k for k in srv.objects if k.startswith("/d.gds/x/c/")]:
                        srv.put(key, bytes(len(srv.objects[key]) - 8) + srv.objects[key][-8:])
    assert not [t for t in threading.enumerate() if t.name.startswith("gdsload-pin")], "its threads end at close"
    assert 2 <= len(got) < len(want)


# -- on a GPU: whole datasets by the direct route ----------------------------------------------------------
def _kvikio_gets(requests: list[Seen]) -> list[Seen]:
    """The data reads KvikIO sent: ranged GETs of shards without If-Match (the pin checks carry one)."""
    return [r for r in requests if r.method == "GET" and r.header("If-Match") is None
            and (r.header("Range") or "").startswith("bytes=") and not r.header("Range").startswith("bytes=-")]


def _present_markers(root: str) -> list[str]:
    return [f for f in os.listdir(root) if f.endswith(".ok")] if os.path.isdir(root) else []


@pytest.fixture
def gds_cache(tmp_path, monkeypatch) -> str:
    """gdsload's cache folder (the skeleton's, with no cache_dir given) in the test's folder."""
    monkeypatch.setenv("GDSLOAD_CACHE_DIR", str(tmp_path / "gdsload-cache"))
    return str(tmp_path / "gdsload-cache")


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("backend", ["kvikio", "pinned", "auto"])
def test_every_sample_exact_by_the_direct_route_on_two_ranks(local, srv, gds_cache, fast_client, backend, shuffle):
    url = upload(srv, local)
    # x and idx read whole once (resident) or window by window
    opts = dict(shuffle=shuffle, seed=7, world_size=2, window_blocks=3, pad_to="max", resident_bytes=0 if shuffle
                else 64 << 20)
    for rank in range(2):
        with GDSDataset(local, 32, backend="cpu", rank=rank, **opts) as ref:
            want = host_batches(ref) + host_batches(ref)
        with GDSDataset(url, 32, backend=backend, rank=rank, **opts) as ds:
            srv.reset_log()  # the open fetched the skeleton (rank 0) and read the first window
            got = host_batches(ds) + host_batches(ds)
            d = ds.describe()
        assert_same_batches(got, want)
        assert ds.backend_name == "remote" and ds.io_mode == "remote-kvikio" and d["io_mode"] == "remote-kvikio"
        assert "a remote dataset's direct route, in place of" in ds.backend_reason
        assert d["remote"]["route"] == "direct" and "KvikIO's RemoteFile" in d["remote"]["route_reason"]
        assert d["remote"]["fetched_shards"] == 0 and d["remote"]["cache_dir"] == os.path.join(gds_cache, "datasets")
        assert not _present_markers(d["remote"]["version"] + ".shards"), "no shard data went into the cache"
        stats = d["backend_stats"]
        assert stats["reads"] > 0 and stats["pin_checks"] > 0 and stats["objects_open"] > 0
        assert _kvikio_gets(srv.requests), "the data came by KvikIO's ranged GETs"
        checks = [r.header("Range") for r in srv.requests if r.header("If-Match") is not None]
        assert checks and all(c.split("=")[1].split("-")[0] == c.split("=")[1].split("-")[1] for c in checks), \
            "the pin checks read one byte each"


@pytest.mark.gpu
def test_compressed_fields_decoded_by_cpu_threads_are_read_by_the_direct_route(make_dataset, srv, gds_cache,
                                                                               fast_client, monkeypatch):
    monkeypatch.setenv("GDSLOAD_NVCOMP", "0")  # zstd decoded by CPU threads: read into the window's host buffer
    data = {"x": (np.arange(N * 64) % 251).astype(np.uint8).reshape(N, 64), "idx": np.arange(N)}
    path = make_dataset(data, samples_per_block=SPB, compress="zstd")
    url = upload(srv, path)
    with GDSDataset(path, 32, backend="cpu", shuffle=True, resident_bytes=0) as ref:
        want = host_batches(ref)
    with GDSDataset(url, 32, backend="kvikio", shuffle=True, resident_bytes=0) as ds:
        assert ds.describe()["decode"] == {"x": "cpu threads", "idx": "cpu threads"}
        assert_same_batches(host_batches(ds), want)
        assert ds.describe()["remote"]["route"] == "direct"


@pytest.mark.gpu
def test_mmap_by_name_and_a_cache_dir_take_the_cached_route(local, srv, tmp_path, gds_cache, fast_client):
    url = upload(srv, local)
    with GDSDataset(local, 32, backend="cpu", pad_to="max") as ref:
        want = host_batches(ref)
    with GDSDataset(url, 32, backend="mmap", pad_to="max") as ds:
        assert_same_batches(host_batches(ds), want)
        remote = ds.describe()["remote"]
        assert ds.backend_name == "mmap" and remote["route"] == "whole"
        assert "the mmap backend was asked for by name" in remote["route_reason"]
    with GDSDataset(url, 32, backend="kvikio", pad_to="max", cache_dir=str(tmp_path / "c")) as ds:
        assert_same_batches(host_batches(ds), want)
        remote = ds.describe()["remote"]
        assert ds.backend_name == "kvikio" and remote["route"] == "cached" and remote["fetched_shards"] > 0
        assert remote["route_reason"].startswith("cache_dir was given")


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, None])
def test_an_object_replaced_mid_epoch_is_a_read_error_naming_its_url(local, srv, gds_cache, fast_client, verify):
    url = upload(srv, local)
    with GDSDataset(local, 32, backend="cpu", pad_to="max") as ref:
        want = host_batches(ref)
    got = []
    with GDSDataset(url, 32, backend="kvikio", window_blocks=1, prefetch=1, pad_to="max", verify=verify,
                    resident_bytes=0) as ds:  # x read window by window, not whole at the first pass
        t0 = time.monotonic()
        with pytest.raises(ReadError, match=r"http://127\.0\.0\.1:\d+/d\.gds/x/c/\d+/0: HTTP 412: the object "
                                            r"changed"):
            for b in ds:
                got.append({k: v.get() for k, v in b.items()})
                if len(got) == 2:  # every shard of x replaced: same size, another ETag and other bytes
                    for key in [k for k in srv.objects if k.startswith("/d.gds/x/c/")]:
                        old = srv.objects[key]
                        srv.put(key, bytes(len(old) - 8) + old[-8:])
        assert time.monotonic() - t0 < 30
    assert 2 <= len(got) < len(want)
    assert_same_batches(got, want[:len(got)])  # batches served came from the objects as opened, never mixed


@pytest.mark.gpu
def test_server_errors_are_retried_by_kvikio_then_a_read_error_naming_the_url(local, srv, gds_cache, fast_client):
    import kvikio.defaults

    url = upload(srv, local)
    with GDSDataset(local, 32, backend="cpu", pad_to="max", resident_bytes=0) as ref:
        want = host_batches(ref)
    with kvikio.defaults.set({"http_max_attempts": 3}):
        with GDSDataset(url, 32, backend="kvikio", pad_to="max", resident_bytes=0) as ds:
            srv.reset_log()
            srv.fail_next(2, 503)  # at most two failures of any request: KvikIO's third attempt succeeds
            assert_same_batches(host_batches(ds), want)
            assert sum(r.status == 503 for r in srv.requests) == 2
            srv.fail_next(100_000, 503)
            t0 = time.monotonic()
            # KvikIO's read of a window, or the check of one read before the faults began
            with pytest.raises(ReadError, match=r"http://127\.0\.0\.1:\d+/d\.gds/\S+: .*503"):
                host_batches(ds)
            assert time.monotonic() - t0 < 30  # KvikIO: 3 attempts, 0.5 s and 1 s apart, per task
            srv.clear_faults()


@pytest.mark.gpu
def test_a_server_without_etags_reads_exactly_and_its_private_version_goes_at_close(local, srv, gds_cache,
                                                                                   fast_client):
    url = upload(srv, local)
    srv.send_etags = False
    with GDSDataset(local, 32, backend="cpu", pad_to="max") as ref:
        want = host_batches(ref)
    with GDSDataset(url, 32, backend="kvikio", pad_to="max") as ds:
        root = ds.describe()["remote"]["version"]
        assert "@private-" in root and ds.describe()["remote"]["route"] == "direct"
        assert_same_batches(host_batches(ds), want)
    assert not os.path.exists(root), "removed when the dataset closed"


# -- on a GPU: the same from S3 (moto's server) ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kvikio", "pinned"])
def test_every_sample_exact_by_the_direct_route_from_s3_on_two_ranks(local, s3, gds_cache, backend):
    url = upload(s3, local)
    opts = dict(shuffle=True, seed=7, world_size=2, window_blocks=3, pad_to="max", resident_bytes=0)
    for rank in range(2):
        with GDSDataset(local, 32, backend="cpu", rank=rank, **opts) as ref:
            want = host_batches(ref) + host_batches(ref)
        with GDSDataset(url, 32, backend=backend, rank=rank, **opts) as ds:
            got = host_batches(ds) + host_batches(ds)
            d = ds.describe()
        assert_same_batches(got, want)
        assert url.startswith("s3://") and d["io_mode"] == "remote-kvikio"
        assert d["remote"]["route"] == "direct" and d["remote"]["fetched_shards"] == 0
        assert d["backend_stats"]["reads"] > 0 and d["backend_stats"]["pin_checks"] > 0


@pytest.mark.gpu
def test_an_s3_object_replaced_mid_epoch_is_a_read_error_naming_its_url(local, s3, gds_cache):
    url = upload(s3, local)
    with GDSDataset(local, 32, backend="cpu", pad_to="max") as ref:
        want = host_batches(ref)
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="d.gds/x/c/")["Contents"]]
    got = []
    with GDSDataset(url, 32, backend="kvikio", window_blocks=1, prefetch=1, pad_to="max",
                    resident_bytes=0) as ds:
        t0 = time.monotonic()
        with pytest.raises(ReadError, match=rf"s3://{s3.bucket}/d\.gds/x/c/\d+/0: .*(412|PreconditionFailed)"):
            for b in ds:
                got.append({k: v.get() for k, v in b.items()})
                if len(got) == 2:  # every shard of x replaced: same size, another ETag and other bytes
                    for key in keys:
                        old = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
                        s3.put(key, bytes(len(old) - 8) + old[-8:])
        assert time.monotonic() - t0 < 30
    assert 2 <= len(got) < len(want)
    assert_same_batches(got, want[:len(got)])
