"""Versions of a remote dataset in the node's cache (gdsload/remote/mirror.py, skeleton.py, cache_folder.py): a
version is identified by every object it serves, so a republished dataset is never served from the cache in its
old version, even where its root zarr.json came out byte-identical; a shard missing, truncated or replaced on the
server is an error naming its URL, and nothing filled from it is served once it is restored; ``gdsload cache
ls|clear`` lists and removes versions no dataset has open. Real servers only (tests/remote_servers.py), real
processes where a process matters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.errors import FormatError
from gdsload.remote.mirror import open_version

from _helpers import files_below
from remote_servers import client_for_server, upload

N = 600
SPB = 16  # 4 blocks per shard of x: 10 shards of x, 4 of idx


def _data(offset: int) -> dict[str, np.ndarray]:
    return {"x": (np.arange(N * 6, dtype=np.float32).reshape(N, 6) + offset), "idx": np.arange(N) + offset}


@pytest.fixture
def two(make_dataset) -> tuple[str, str]:
    """Two datasets of the same shapes and different data: their root zarr.json is byte-identical."""
    old, new = (make_dataset(_data(k), samples_per_block=SPB, shard_bytes=4 * SPB * 6 * 4) for k in (0, 100_000))
    assert files_below(old)["zarr.json"] == files_below(new)["zarr.json"]
    assert files_below(old)["x/zarr.json"] == files_below(new)["x/zarr.json"]
    return old, new


def _open(url: str, cache: str, **kw) -> GDSDataset:
    return GDSDataset(url, 32, **{"backend": "cpu", "resident_bytes": 0, "window_blocks": 2, "cache_dir": cache, **kw})


def _samples(batches) -> dict[str, np.ndarray]:
    got = {"x": [], "idx": []}
    for b in batches:
        for k in got:
            got[k].append(np.asarray(b[k]))
    return {k: np.concatenate(v) for k, v in got.items()}


def _exact(ds: GDSDataset, offset: int) -> None:
    """Every sample of a pass, in order (no shuffle), is the dataset of ``offset``'s."""
    got, want = _samples(ds), _data(offset)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


_CHILD = """
import json, sys
import numpy as np
from gdsload import GDSDataset
url, cache = sys.argv[1], sys.argv[2]
with GDSDataset(url, 32, backend="cpu", resident_bytes=0, window_blocks=2, cache_dir=cache) as ds:
    idx = np.concatenate([np.asarray(b["idx"]) for b in ds])
    x = np.concatenate([np.asarray(b["x"]) for b in ds])
print(json.dumps({"idx": idx.tolist(), "x0": x[:, 0].tolist()}))
"""


def _child_reads(url: str, cache: str) -> dict[str, list]:
    done = subprocess.run([sys.executable, "-c", _CHILD, url, cache], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


# -- republished with a byte-identical root ---------------------------------------------------------------
@pytest.mark.parametrize("server", ["http", "s3"])
def test_a_republished_dataset_is_read_new_by_a_new_process_with_the_old_cache(two, server, request, tmp_path):
    store = request.getfixturevalue("srv" if server == "http" else "s3")
    old, new = two
    url, cache = upload(store, old, "d.gds"), str(tmp_path / "c")
    with _open(url, cache) as ds:  # the whole old version in the cache
        _exact(ds, 0)
    upload(store, new, "d.gds")  # republished: the same root zarr.json, other shards and checksums
    got = _child_reads(url, cache)
    want = _data(100_000)
    assert got["idx"] == want["idx"].tolist(), "every sample is the new version's"
    assert got["x0"] == want["x"][:, 0].tolist()
    with _open(url, cache) as ds:  # and this process too, every field of every sample
        _exact(ds, 100_000)


@pytest.mark.parametrize("server", ["http", "s3"])
def test_a_partly_warm_cache_after_a_republish_serves_no_old_sample(two, server, request, tmp_path):
    store = request.getfixturevalue("srv" if server == "http" else "s3")
    old, new = two
    url, cache = upload(store, old, "d.gds"), str(tmp_path / "c")
    with _open(url, cache) as ds:
        for i, _ in enumerate(ds):
            if i == 5:
                break  # a part of the old version's shards is present in the cache
        first = ds.describe()["remote"]
    assert first["fetched_shards"] > 0
    upload(store, new, "d.gds")
    with _open(url, cache) as ds:
        got = _samples(ds)
        now = ds.describe()["remote"]
    assert now["version"] != first["version"], "a new version, beside the old one"
    assert not np.isin(got["idx"], _data(0)["idx"]).any(), "no old sample"
    np.testing.assert_array_equal(got["x"], _data(100_000)["x"])
    np.testing.assert_array_equal(got["idx"], _data(100_000)["idx"])


def test_an_unchanged_complete_version_on_s3_is_found_by_one_listing(two, s3, tmp_path):
    old, _ = two
    url, cache = upload(s3, old, "d.gds"), str(tmp_path / "c")
    first = open_version(url, cache).root
    again = open_version(url, cache).root
    assert again == first
    assert [n for n in os.listdir(cache) if not n.endswith((".lock", ".shards"))] == [os.path.basename(first)]


def test_a_single_object_added_under_an_s3_dataset_is_a_new_version(two, s3, tmp_path):
    old, _ = two
    url, cache = upload(s3, old, "d.gds"), str(tmp_path / "c")
    first = open_version(url, cache).root
    s3.put("d.gds/notes.txt", b"anything under the URL is part of what the version serves")
    second = open_version(url, cache).root
    assert second != first and os.path.isdir(first), "the old version stays for datasets that have it open"


# -- a poisoned cache ------------------------------------------------------------------------------------
SHARD = "d.gds/x/c/3/0"


@pytest.fixture
def fast(srv):
    with client_for_server(srv, retries=1, backoff_s=0.01, timeout_s=2) as client:
        yield client


def _versions(cache: str) -> list[str]:
    return [n for n in os.listdir(cache) if not n.endswith((".lock", ".shards"))]


@pytest.mark.parametrize("server", ["http", "s3"])
@pytest.mark.parametrize("fault", ["removed", "truncated"])
def test_a_shard_missing_or_truncated_while_a_fresh_cache_is_filled_names_the_url_and_is_not_kept(
        two, server, fault, request, tmp_path):
    store = request.getfixturevalue("srv" if server == "http" else "s3")
    old, _ = two
    url, cache = upload(store, old, "d.gds"), str(tmp_path / "c")
    good = files_below(old)["x/c/3/0"]
    if fault == "removed":
        store.delete(SHARD)
        expected, cause = FileNotFoundError, r"(HTTP 404|no such object)"
    else:
        store.put(SHARD, good[:-100])
        expected, cause = FormatError, r"shard index checksum mismatch"
    with pytest.raises(expected, match=rf"^{store.url(SHARD)}: .*{cause}") as e:
        _open(url, cache)
    assert cache not in str(e.value), "the URL is named, not a file of the cache"
    assert _versions(cache) == [], "nothing filled from the bad object is kept"
    store.put(SHARD, good)  # restored
    with _open(url, cache) as ds:
        _exact(ds, 0)


def test_a_shard_replaced_by_another_valid_one_names_the_url_and_its_restore_is_read_exactly(two, srv, tmp_path):
    """A shard replaced by another of the same layout (its index checks out) is caught by the block checksums
    as it is read: the error names the URL (not the cache's copy); once the object is restored, the same
    cache_dir reads every sample exactly (the version filled from the replaced object is never served again)."""
    old, _ = two
    url, cache = upload(srv, old, "d.gds"), str(tmp_path / "c")
    files = files_below(old)
    srv.put(SHARD, files["x/c/4/0"])
    with _open(url, cache) as ds:
        with pytest.raises(FormatError, match=rf"{srv.url(SHARD)}\b.*crc32c") as e:
            _samples(ds)
    assert cache + "/" not in str(e.value).split(" (read from the node's cache")[0]
    assert "gdsload cache clear" in str(e.value)
    srv.put(SHARD, files["x/c/3/0"])
    with _open(url, cache) as ds:
        _exact(ds, 0)


def test_a_damaged_copy_in_the_cache_names_the_url_and_says_to_clear_the_cache(two, srv, tmp_path):
    old, _ = two
    url, cache = upload(srv, old, "d.gds"), str(tmp_path / "c")
    with _open(url, cache) as ds:
        root = ds.describe()["remote"]["version"]
    with open(os.path.join(root, "x", "c", "3", "0"), "r+b") as f:  # the index at the end of the cache's copy
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    with pytest.raises(FormatError) as e:
        _open(url, cache)
    message = str(e.value)
    assert message.startswith(f"{srv.url(SHARD)}: shard index checksum mismatch")
    assert f"'gdsload cache clear {cache} {url}'" in message
    done = _cli("cache", "clear", cache, url)
    assert done.returncode == 0 and f"removed {url}" in done.stdout, done.stderr
    with _open(url, cache) as ds:
        _exact(ds, 0)


def test_an_error_about_the_dataset_as_a_whole_names_its_url_and_no_cache(two, srv, tmp_path):
    old, _ = two
    url, cache = upload(srv, old, "d.gds"), str(tmp_path / "c")
    with pytest.raises(FormatError) as e:
        _open(url, cache, fields=["nope"])
    assert str(e.value).startswith(f"{url}: no field ['nope']")
    assert cache not in str(e.value), "an argument's error: the cache is not the matter"


# -- gdsload cache ls|clear ------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdsload", *args], capture_output=True, text=True, timeout=120)


def test_cache_ls_and_clear_keep_a_version_a_live_dataset_has_open(two, srv, tmp_path):
    old, new = two
    url, cache = upload(srv, old, "d.gds"), str(tmp_path / "c")
    with _open(url, cache) as ds:
        _exact(ds, 0)
        v1 = ds.describe()["remote"]["version"]
    upload(srv, new, "d.gds")
    live = _open(url, cache)
    try:
        v2 = live.describe()["remote"]["version"]
        listed = _cli("cache", "ls", cache)
        assert listed.returncode == 0, listed.stderr
        *rows, summary = listed.stdout.splitlines()
        lines = {line.rsplit("(", 1)[1].rstrip(")"): line for line in rows}
        assert re.fullmatch(rf"{re.escape(cache)}: 2 folder\(s\), \d+\.\d (KiB|MiB) on disk", summary)
        assert set(lines) == {v1, v2}
        assert lines[v1].startswith(f"{url}  version ") and "14/14 shards with data" in lines[v1]
        assert lines[v1].endswith(f"not in use  ({v1})") and lines[v2].endswith(f"  in use  ({v2})")
        assert " KiB" in lines[v1] or " MiB" in lines[v1]
        cleared = _cli("cache", "clear", cache)
        assert cleared.returncode == 0, cleared.stderr
        assert f"removed {lines[v1]}" in cleared.stdout and f"kept {url}" in cleared.stdout
        assert re.fullmatch(rf"{re.escape(cache)}: removed 1 folder\(s\) \(\d+\.\d (KiB|MiB)\); kept 1 in use",
                            cleared.stdout.splitlines()[-1])
        assert not os.path.exists(v1) and not os.path.exists(v1 + ".shards")
        assert os.path.isdir(v2)
        _exact(live, 100_000)  # the live dataset reads on, every sample
    finally:
        live.close()
    cleared = _cli("cache", "clear", cache, url)
    assert cleared.returncode == 0 and f"removed {url}" in cleared.stdout
    assert _versions(cache) == [] and not [n for n in os.listdir(cache) if n.endswith(".shards")]
    with _open(url, cache) as ds:  # fetched again
        _exact(ds, 100_000)


def test_cache_clear_of_a_url_removes_only_that_urls_versions(two, srv, tmp_path):
    old, new = two
    a, b, cache = upload(srv, old, "a.gds"), upload(srv, new, "b.gds"), str(tmp_path / "c")
    ra, rb = open_version(a, cache).root, open_version(b, cache).root
    done = _cli("cache", "clear", cache, b)
    assert done.returncode == 0, done.stderr
    assert os.path.isdir(ra) and not os.path.exists(rb)
    assert done.stdout.count("removed ") == 2 and f"removed {b}" in done.stdout


def test_cache_commands_refuse_a_missing_folder_in_one_line(tmp_path):
    done = _cli("cache", "ls", str(tmp_path / "none"))
    assert done.returncode == 2
    assert done.stderr == f"gdsload cache: error: {tmp_path / 'none'}: no such cache folder\n"


def test_a_skeleton_that_cannot_be_written_says_so_and_how_to_free_space(two, srv, tmp_path):
    old, _ = two
    url, cache = upload(srv, old, "d.gds"), str(tmp_path / "c")
    code = ("import resource, signal, sys\n"
            "from gdsload import GDSDataset, ReadError\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
            "try:\n    GDSDataset(sys.argv[1], 32, backend='cpu', cache_dir=sys.argv[2])\n"
            "except ReadError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code, url, cache], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{cache}: cannot write the dataset's skeleton into the cache (File too large)")
    assert f"'gdsload cache clear {cache}'" in done.stdout
