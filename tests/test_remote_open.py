"""What the cached route's open costs (docs/remote.md): with a complete cache, the requests that pin the version
(a HEAD per object over HTTP, a listing on S3) and nothing else; with an empty one, the skeleton and the pieces
of the first window only, never the shards that window touches whole. Counted in requests and bytes, not
seconds. Real servers, started here."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from gdsload import GDSDataset

from remote_servers import upload

N = 2048
SPB = 16  # a block of x: 64 KiB, one piece; 8 blocks per shard


@pytest.fixture
def local(make_dataset) -> str:
    x = np.arange(N * 1024, dtype=np.int32).reshape(N, 1024)
    return make_dataset({"x": x, "idx": np.arange(N)}, samples_per_block=SPB, shard_bytes=512 << 10)


def _open(url: str, cache: str) -> GDSDataset:
    return GDSDataset(url, 64, backend="cpu", resident_bytes=0, window_blocks=4, cache_dir=cache, shuffle=True,
                      seed=1)


def test_a_cold_open_fetches_the_first_windows_pieces_not_whole_shards(local, srv, tmp_path):
    url = upload(srv, local)
    with _open(url, str(tmp_path / "c")) as ds:
        remote = ds.describe()["remote"]
        assert remote["fetched_shards"] >= 3, "the first window's blocks lie in several shards"
        assert 0 < remote["fetched_bytes"] <= 4 * 64 * 1024 + N * 8, "4 blocks of x and the idx shard, no more"


def test_a_warm_open_over_http_sends_a_head_per_object_and_nothing_else(local, srv, tmp_path):
    url, cache = upload(srv, local), str(tmp_path / "c")
    with _open(url, cache) as ds:
        for _ in ds:
            pass
    srv.reset_log()
    with _open(url, cache) as ds:
        assert ds.describe()["remote"]["fetched_bytes"] == 0
    seen = Counter(r.method for r in srv.requests)
    assert seen == {"HEAD": len(srv.objects)}, seen


def test_a_warm_open_on_s3_lists_and_sends_nothing_else(local, s3, tmp_path):
    url, cache = upload(s3, local), str(tmp_path / "c")
    with _open(url, cache) as ds:
        for _ in ds:
            pass
    from botocore.client import BaseClient

    calls: list[str] = []
    original = BaseClient._make_api_call

    def counted(self, operation, params):  # type: ignore[no-untyped-def]
        calls.append(operation)
        return original(self, operation, params)

    BaseClient._make_api_call = counted  # type: ignore[method-assign]
    try:
        with _open(url, cache) as ds:
            assert ds.describe()["remote"]["fetched_bytes"] == 0
    finally:
        BaseClient._make_api_call = original  # type: ignore[method-assign]
    assert set(calls) == {"ListObjectsV2"} and len(calls) == 1, calls
