"""Many nodes reading one remote dataset (gdsload/remote/pieces.py, shard_cache.py, shard_fetch.py): 4 processes
stand in for 4 nodes, each with a cache folder of its own and ``WORLD_SIZE=4``, ranks 0-3. Every sample is read
once per epoch across them (checked by content), and each fetches only its share: byte ranges of the blocks its
plan reads, not the shards they lie in whole. Real servers, started here; real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _helpers import files_below
from remote_servers import upload

N = 4096
ROW = 1024  # int32 per sample: 4 KiB
SPB = 16  # a block of x: 64 KiB, one piece


@pytest.fixture
def local(make_dataset) -> str:
    x = (np.arange(N, dtype=np.int32)[:, None] * ROW + np.arange(ROW, dtype=np.int32)).astype(np.int32)
    return make_dataset({"x": x, "idx": np.arange(N)}, samples_per_block=SPB, shard_bytes=512 << 10)


_NODE = """
import json, os, sys
import numpy as np
from gdsload import GDSDataset
url, cache = sys.argv[1], sys.argv[2]
seen, bad = [], 0
with GDSDataset(url, 64, backend="cpu", resident_bytes=0, cache_dir=cache, shuffle=True, seed=7,
                prefetch_next_epoch=False) as ds:  # one epoch: the next one's share is not fetched ahead
    for b in ds:
        idx, x = np.asarray(b["idx"]), np.asarray(b["x"])
        bad += int((x != idx[:, None] * 1024 + np.arange(1024)).any(axis=1).sum())
        seen += idx.tolist()
    remote = ds.describe()["remote"]
print(json.dumps({"seen": seen, "bad": bad, "fetched": remote["fetched_bytes"], "route": remote["route"]}))
"""


def _nodes(url: str, caches: list[str], env: dict[str, str]) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", _NODE, url, cache], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env, "WORLD_SIZE": str(len(caches)), "RANK": str(rank)})
             for rank, cache in enumerate(caches)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [e[-2000:] for _, e in outs]
    return [json.loads(o) for o, _ in outs]


def _check(local: str, url: str, tmp_path, env: dict[str, str]) -> list[dict]:
    got = _nodes(url, [str(tmp_path / f"node{r}") for r in range(4)], env)
    seen = sorted(i for g in got for i in g["seen"])
    assert seen == list(range(N)), "every sample once per epoch across the 4 nodes"
    assert [g["bad"] for g in got] == [0] * 4 and {g["route"] for g in got} == {"cached"}
    dataset = sum(len(v) for k, v in files_below(local).items() if "/c/" in k)  # the shards' bytes
    fetched = sum(g["fetched"] for g in got)
    assert 0 < fetched <= 1.2 * dataset, f"fetched {fetched} bytes for a dataset of {dataset}"
    assert all(g["fetched"] <= 0.4 * dataset for g in got), [g["fetched"] for g in got]
    return got


def test_four_nodes_over_http_each_fetch_their_share(local, srv, tmp_path):
    url = upload(srv, local)
    srv.reset_log()
    _check(local, url, tmp_path, {})
    ranges = [r.header("Range") for r in srv.requests if r.method == "GET" and r.status == 206]
    data = [r for r in ranges if r and not r.startswith("bytes=-")]
    served = sum(int(b) - int(a) + 1 for a, b in (r[len("bytes="):].split("-") for r in data))
    dataset = sum(len(v) for k, v in files_below(local).items() if "/c/" in k)
    assert served <= 1.2 * dataset, "the server sent no more than the fetch counters say"


def test_four_nodes_over_s3_each_fetch_their_share(local, s3, tmp_path):
    url = upload(s3, local)
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    _check(local, url, tmp_path, env)
