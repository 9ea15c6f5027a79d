"""The node-local shard cache of a remote dataset (gdsload/remote/shard_cache.py, shard_fetch.py): only the skeleton
at open, each rank's shards fetched ahead of its reads, a bound with least-recently-used eviction, ranks of a node
sharing the cache, and the faults. Real servers only, started here (tests/remote_servers.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.remote.mirror import open_version

from _helpers import assert_same_batches, host_batches
from remote_servers import Seen, upload

N = 600
SPB = 16  # samples per block; 4 blocks per shard of x, 12 per shard of idx


@pytest.fixture
def local(make_dataset) -> str:
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    return make_dataset(data, samples_per_block=SPB, shard_bytes=4 * SPB * 6 * 4)


def _open(url: str, cache: str | None, **kw) -> GDSDataset:
    kw = {"backend": "cpu", "resident_bytes": 0, "window_blocks": 2, "cache_dir": cache, **kw}
    return GDSDataset(url, 32, **kw)


def _data_gets(requests: list[Seen]) -> list[str]:
    """The shard files of x and idx whose data was fetched (ranged GETs from an offset; an index is a suffix
    range, ``-n``; metadata and the checksums are fetched whole at open)."""
    return [r.path for r in requests if r.method == "GET" and r.status == 206 and _SHARD.match(r.path)
            and not (r.header("Range") or "bytes=-").startswith("bytes=-")]


_SHARD = re.compile(r"^/d\.gds/(x/c/\d+/0|idx/c/\d+)$")


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gdsload-fetch"]


def _no_fetch_threads(seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while _fetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _fetch_threads()


def _present_bytes(cache: str) -> int:
    total = 0
    for name in os.listdir(cache):
        if name.endswith(".shards"):
            for f in os.listdir(os.path.join(cache, name)):
                try:
                    with open(os.path.join(cache, name, f)) as fh:
                        total += json.load(fh)["data_bytes"] if f.endswith(".ok") else 0
                except FileNotFoundError:  # evicted meanwhile
                    pass
    return total


# -- what is fetched -------------------------------------------------------------------------------------
def test_the_open_fetches_only_the_skeleton(local, srv, tmp_path):
    url = upload(srv, local)
    srv.reset_log()
    with _open(url, str(tmp_path / "c"), window_blocks=1) as ds:
        first = set(_data_gets(srv.requests))
        info = ds.describe()["remote"]
    # the first window (one block: one shard of each field) is read at the open; nothing else
    assert first == {"/d.gds/x/c/0/0", "/d.gds/idx/c/0"}
    assert info["route"] == "cached" and info["cache_dir"] == str(tmp_path / "c") and info["fetched_shards"] == 2


def test_every_sample_exact_under_a_bound_smaller_than_the_dataset_with_eviction(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    with _open(local, None, shuffle=True, seed=5) as ref:
        want = host_batches(ref) + host_batches(ref)
    with _open(url, cache) as probe:
        version = open_version(url, cache)  # the version the probe opened, complete in the cache: found there
        assert version.root == probe.describe()["remote"]["version"]
        shards = version.shards
        total = sum(e.data_bytes for e in shards.values())
        biggest = max(e.data_bytes for e in shards.values())
    bound = max(total // 2, 6 * biggest)
    assert bound < total
    srv.reset_log()
    with _open(url, cache, shuffle=True, seed=5, cache_bytes=bound) as ds:
        got = host_batches(ds) + host_batches(ds)  # two epochs: the second finds part of the first evicted
        stats = ds.describe()["remote"]
        assert _present_bytes(cache) <= bound
    assert_same_batches(got, want)
    fetched = _data_gets(srv.requests)
    assert stats["evicted_pieces"] > 0 and stats["cache_bytes"] == bound
    assert len(fetched) > len(set(fetched)), "shards evicted in the first epoch are fetched again in the second"
    assert len(set(fetched)) <= len(shards)


def test_a_bound_that_holds_everything_scans_the_cache_folder_once_not_per_piece(local, srv, tmp_path, monkeypatch):
    from gdsload.remote import shard_cache

    scans = []
    real = shard_cache._scan
    monkeypatch.setattr(shard_cache, "_scan", lambda cache_dir: scans.append(cache_dir) or real(cache_dir))
    url, cache = upload(srv, local), str(tmp_path / "c")
    with _open(local, None) as ref:
        want = host_batches(ref)
    with _open(url, cache, cache_bytes=1 << 30) as ds:
        assert_same_batches(host_batches(ds), want)
        fetched = ds.describe()["remote"]["fetched_pieces"]
    assert fetched >= 10 and len(scans) == 1, "the ledger decides while it leaves room; the first fetch scans"
    with open(os.path.join(cache, shard_cache.LEDGER)) as f:
        assert json.load(f)["bytes"] == _present_bytes(cache)


def test_a_rank_fetches_only_the_shards_of_its_share(local, srv, tmp_path):
    url = upload(srv, local)
    num_blocks = -(-N // SPB)
    for rank in range(2):
        srv.reset_log()
        with _open(url, str(tmp_path / f"c{rank}"), rank=rank, world_size=2) as ds:
            assert len(host_batches(ds)) == len(ds)
        blocks = np.array_split(np.arange(num_blocks), 2)[rank]
        want = {f"/d.gds/x/c/{b // 4}/0" for b in blocks} | {f"/d.gds/idx/c/{b // 12}" for b in blocks}
        fetched = _data_gets(srv.requests)
        assert set(fetched) == want and len(fetched) == len(want), f"rank {rank}: each of its shards, once"


def test_a_window_read_in_two_parts_leaves_the_queue_so_the_fetch_goes_on_ahead(local, srv, tmp_path):
    """A window's reads through the backend and through its host reader (compressed chunks that CPU threads
    decode, on a GPU backend) pin apart: once both parts are read, or one is passed over (its buffer held it
    since the open), the window leaves the queue and the fetch threads go on to the windows after it."""
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.cpu import CpuBackend
    from gdsload.backends.remote_cached import CachedBackend
    from gdsload.backends.source import RemoteSource, open_source
    from gdsload.format.files import ShardFiles
    from gdsload.remote.shard_fetch import AHEAD_WINDOWS

    url = upload(srv, local)
    source = open_source(url, str(tmp_path / "c"))
    assert isinstance(source, RemoteSource)
    shards = source.shards
    x = sorted(p for p in shards.version.shards if f"{os.sep}x{os.sep}" in p)
    n = AHEAD_WINDOWS + 1  # window w reads x shard w through the backend and shard w + n through its host reader
    assert len(x) >= 2 * n

    def read(path: str) -> ReadRequest:
        return ReadRequest(path, 0, shards.version.shards[path].info.size, 0)

    files = ShardFiles.open(x)
    backend = CachedBackend(CpuBackend(), shards)
    host = backend.host_reader()
    stop = threading.Event()
    try:
        backend.prepare(files)
        host.prepare(files)
        srv.reset_log()
        backend.expect(range(n), lambda w: [read(x[w]), read(x[w + n])])
        got = {}
        for reader, path in ((backend, x[0]), (host, x[n])):
            got[path] = np.empty(read(path).nbytes, np.uint8)
            reader.submit(got[path], [read(path)], stop).finish()
        last = {f"/d.gds/x/c/{n - 1}/0", f"/d.gds/x/c/{2 * n - 1}/0"}  # the window past the first ones in reach
        deadline = time.monotonic() + 10
        while not last <= set(_data_gets(srv.requests)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert last <= set(_data_gets(srv.requests)), "window 0 left the queue: the last window was fetched ahead"
        backend.passed([read(x[1])])  # window 1's first part: its buffer holds it
        got[x[n + 1]] = np.empty(read(x[n + 1]).nbytes, np.uint8)
        host.submit(got[x[n + 1]], [read(x[n + 1])], stop).finish()
        for path, data in got.items():  # the shard's bytes as served, read from the cache while pinned
            with open(os.path.join(local, os.path.relpath(path, shards.root))) as f:
                assert data.tobytes() == np.fromfile(f, np.uint8).tobytes()
    finally:
        backend.idle()
        for part in (host, backend, files, source):
            part.close()
    assert _no_fetch_threads()


_CHILD = """
import json, sys
from gdsload import GDSDataset
url, cache = sys.argv[1], sys.argv[2]
with GDSDataset(url, 32, backend="cpu", resident_bytes=0, window_blocks=2, cache_dir=cache) as ds:
    print(json.dumps(sum(len(b["idx"]) for b in ds)))
"""


def test_two_processes_share_one_cache_and_fetch_no_shard_twice(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    srv.reset_log()
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, url, cache], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert [json.loads(o) for o, _ in outs] == [N, N]
    fetched = _data_gets(srv.requests)
    assert len(fetched) == len(set(fetched)) == 10 + 4, "every shard fetched once, by one of the two"
    index_gets = [r for r in srv.requests if (r.header("Range") or "").startswith("bytes=-")]
    assert len(index_gets) == 14, "the skeleton made once: the other process waited for it"


# -- faults ----------------------------------------------------------------------------------------------
def test_5xx_then_success_is_retried(local, srv, tmp_path, fast_client):
    url = upload(srv, local)
    with _open(local, None) as ref:
        want = host_batches(ref)
    with _open(url, str(tmp_path / "c")) as ds:
        srv.fail_next(2, 503)
        assert_same_batches(host_batches(ds), want)


def test_a_stall_beyond_the_timeout_is_a_clear_error_in_bounded_time(local, srv, tmp_path, fast_client):
    url = upload(srv, local)
    with _open(url, str(tmp_path / "c")) as ds:
        srv.delay_next(1000, 5.0)
        t0 = time.monotonic()
        with pytest.raises(ReadError, match=r"127\.0\.0\.1.*/d\.gds/.*: no response for 0\.5 s \(GET, 2 tries; "
                                            r"before: TimeoutError"):
            host_batches(ds)
        assert time.monotonic() - t0 < 15
        assert _no_fetch_threads(), "the fetcher threads stop on an error"
        srv.clear_faults()


def test_an_object_replaced_mid_epoch_is_a_read_error_never_mixed_data(local, srv, tmp_path, fast_client):
    url = upload(srv, local)
    with _open(local, None) as ref:
        want = host_batches(ref)
    got = []
    with _open(url, str(tmp_path / "c"), cache_bytes=1 << 20) as ds:
        last = "d.gds/x/c/9/0"  # the last shard of x, read at the epoch's end: not fetched yet
        old = srv.objects["/" + last]
        srv.put(last, bytes(len(old) - 8) + old[-8:])  # same size, another ETag
        with pytest.raises(ReadError, match=r"/d\.gds/x/c/9/0: HTTP 412: the object changed"):
            for b in ds:
                got.append({k: np.asarray(v) for k, v in b.items()})
        assert _no_fetch_threads()
    assert 0 < len(got) < len(want)
    assert_same_batches(got, want[:len(got)])


_FULL = """
import json, os, resource, signal, sys
from gdsload import GDSDataset, ReadError
url, cache = sys.argv[1], sys.argv[2]
ds = GDSDataset(url, 32, backend="cpu", resident_bytes=0, window_blocks=1, cache_dir=cache)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    list(ds)
    print(json.dumps("no error"))
except ReadError as e:
    print(json.dumps(str(e)))
ds.close()
"""


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_that_looks_complete(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    done = subprocess.run([sys.executable, "-c", _FULL, url, cache], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    message = json.loads(done.stdout)
    assert message.startswith(f"{cache}: cannot write http://") and "EFBIG" in message and "cache_bytes" in message
    present = _present_bytes(cache)
    assert present <= 2 * 2000, "only the shards of the first window (fetched before the limit) look complete"
    with _open(local, None) as ref:
        want = host_batches(ref)
    with _open(url, cache) as ds:  # the same cache, without the limit: exact
        assert_same_batches(host_batches(ds), want)


def test_a_bound_below_one_shard_is_a_clear_error_naming_cache_bytes(local, srv, tmp_path):
    url = upload(srv, local)
    with pytest.raises(ReadError, match=r"cache_bytes=100 is smaller than one piece of a shard: .* \(\d+ bytes; "
                                        r"raise cache_bytes to "
                                        r"at least \d+\)"):
        _open(url, str(tmp_path / "c"), cache_bytes=100)
    with pytest.raises(ValueError, match="cache_bytes must be a positive int"):
        _open(url, str(tmp_path / "c"), cache_bytes=0)
    assert _no_fetch_threads()


# -- threads ---------------------------------------------------------------------------------------------
def test_fetcher_threads_stop_on_break_on_stop_and_on_close(local, srv, tmp_path):
    url = upload(srv, local)
    before = set(threading.enumerate())
    ds = _open(url, str(tmp_path / "c"), cache_bytes=1 << 20)
    assert _no_fetch_threads(), "no fetcher runs while no pass does"
    for i, _ in enumerate(ds):
        if i == 2:
            assert _fetch_threads(), "the fetcher reads ahead of the pass"
            break
    assert _no_fetch_threads(), "on break"
    it = iter(ds)
    next(it)
    ds.stop()
    assert _no_fetch_threads(), "on stop()"
    it = iter(ds)
    next(it)
    ds.close()
    assert _no_fetch_threads(), "on close()"
    deadline = time.monotonic() + 2
    while _new_gdsload_threads(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _new_gdsload_threads(before)


def _new_gdsload_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("gdsload")]


def test_a_server_without_etags_reads_exactly_from_a_private_version_removed_at_close(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    srv.send_etags = False
    with _open(local, None) as ref:
        want = host_batches(ref)
    with _open(url, cache, cache_bytes=1 << 20) as ds:
        root = ds.describe()["remote"]["version"]
        assert "@private-" in root and os.path.isdir(root)
        assert_same_batches(host_batches(ds), want)
    assert not os.path.exists(root) and not os.path.exists(root + ".shards"), "removed when the dataset closed"
