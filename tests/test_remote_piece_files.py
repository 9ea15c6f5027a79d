"""The files of the node's shard cache (gdsload/remote/piece_files.py, piece_sync.py): no lock file per piece
(byte-range locks on the shard files), markers written for the boot before their bytes are synced and marked
synced behind the reads. Real servers and processes only (tests/remote_servers.py)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest

from gdsload.remote.piece_files import BOOT, open_range, unheld

from _helpers import assert_same_batches, host_batches
from remote_servers import upload
from test_remote_cache import _open, local  # noqa: F401 - the same dataset and options (local: a fixture)


def _state(cache: str) -> list[str]:
    (folder,) = [os.path.join(cache, n) for n in os.listdir(cache) if n.endswith(".shards")]
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder))]


def _markers(cache: str) -> dict[str, dict]:
    out = {}
    for path in _state(cache):
        if path.endswith(".ok"):
            with open(path) as f:
                out[path] = json.load(f)
    return out


def test_no_lock_file_is_left_per_piece_fetched_or_evicted(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    with _open(url, cache) as probe:
        host_batches(probe)
    markers = _markers(cache)
    assert len(markers) >= 10
    bound = sum(m["data_bytes"] for m in markers.values()) // 2
    with _open(url, str(tmp_path / "bounded"), shuffle=True, seed=3, cache_bytes=bound) as ds:
        host_batches(ds)
        host_batches(ds)
        assert ds.describe()["remote"]["evicted_pieces"] > 0
    for c in (cache, str(tmp_path / "bounded")):
        left = [os.path.basename(f) for f in _state(c) if not f.endswith(".ok")]
        assert left == ["open.lock"], f"only the version's open.lock and the present markers: {left}"


def test_a_piece_locked_by_another_process_is_held_until_it_ends(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(bytes(1 << 16))
    child = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys; from gdsload.remote.piece_files import open_range\n"
        f"fd = open_range({str(path)!r}, 100, 200, fcntl.F_RDLCK)\nprint(fd is not None, flush=True)\n"
        "sys.stdin.readline()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "True"
        assert not unheld(str(path), 0, 150), "a pin of bytes 100..200 is in the way of an eviction of 0..150"
        assert unheld(str(path), 200, 300), "other pieces of the file are not"
        fd = open_range(str(path), 150, 160, fcntl.F_RDLCK)
        assert fd is not None, "pins share"
        os.close(fd)
    finally:
        child.communicate("\n", timeout=30)
    assert unheld(str(path), 0, 150), "the lock went with the process"


def test_markers_are_synced_by_close_and_one_of_another_boot_not_synced_is_fetched_again(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    with _open(local, None) as ref:
        want = host_batches(ref)
    with _open(url, cache) as ds:
        assert_same_batches(host_batches(ds), want)
        fetched = ds.describe()["remote"]["fetched_bytes"]
    markers = _markers(cache)
    assert markers and all(m["synced"] is True for m in markers.values()), "synced behind the reads, by close()"
    assert BOOT is not None, "Linux tells its boot id"
    for path, m in markers.items():  # as a crash before the sync leaves them: read in this boot only
        with open(path, "w") as f:
            json.dump({**m, "synced": False}, f)
    with _open(url, cache) as ds:
        assert_same_batches(host_batches(ds), want)
        assert ds.describe()["remote"]["fetched_bytes"] == 0, "this boot's page cache holds the bytes"
    for path, m in markers.items():  # and as they read after a reboot
        with open(path, "w") as f:
            json.dump({**m, "synced": False, "boot": "another-boot"}, f)
    srv.reset_log()
    with _open(url, cache) as ds:
        assert_same_batches(host_batches(ds), want)
        assert ds.describe()["remote"]["fetched_bytes"] == fetched, "every piece fetched again"
    bad = [m for m in _markers(cache).values() if not (m["synced"] is True and m["boot"] == BOOT)]
    assert not bad, bad

