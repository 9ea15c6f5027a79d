"""``gdsload shard ... -o s3://...``: converted locally, uploaded to moto's S3 server (real sockets, no mocked
client), the root zarr.json last. The uploaded dataset reads as the local conversion does; an upload killed
before its root zarr.json leaves no dataset a reader opens, and the next run completes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gdsload import GDSDataset
from gdsload.errors import ReadError
from gdsload.tools.cli import shard_main

from remote_servers import MotoS3
from _helpers import files_below
from test_conversion_parts import RAW, finish, gds, make_inputs, three_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


def objects(s3: MotoS3, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix/``, by its key below it."""
    keys = [o["Key"] for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket,
                                                                                       Prefix=prefix + "/")
            for o in page.get("Contents", [])]
    return {k[len(prefix) + 1:]: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in keys}


def same_as_local(s3: MotoS3, prefix: str, local) -> None:
    want = files_below(local)
    got = objects(s3, prefix)
    assert sorted(got) == sorted(want), f"other objects: {sorted(set(got) ^ set(want))}"
    assert [k for k in want if got[k] != want[k]] == [], "every object is the local file, byte for byte"


def samples(path: str, cache) -> dict[str, list[np.ndarray]]:
    with GDSDataset(path, batch_size=64, backend="cpu", cache_dir=str(cache), verify=True) as ds:
        out: dict[str, list[np.ndarray]] = {}
        for batch in ds:
            for k, v in batch.items():
                out.setdefault(k, []).append(np.asarray(v))
    return out


def assert_reads_like(url: str, local, cache) -> None:
    got, want = samples(url, cache), samples(str(local), cache)
    assert sorted(got) == sorted(want) and sum(len(b) for b in want["label"]) == 600
    for k in want:
        assert len(got[k]) == len(want[k])
        for g, w in zip(got[k], want[k]):
            np.testing.assert_array_equal(g, w)


def test_shard_to_s3_uploads_a_dataset_that_reads_like_the_local_conversion(inputs, s3, tmp_path, capsys):
    url = s3.url("sets/d.gds")
    code, stdout, err = finish(gds(*inputs, "-o", url, *RAW))  # a real process, AWS_* from the environment
    assert code == 0, err
    assert f"{url}: 600 samples" in stdout and "uploaded (the root zarr.json last)" in stdout
    assert shard_main([*inputs, "-o", str(tmp_path / "one.gds"), *RAW, "--quiet"]) == 0
    same_as_local(s3, "sets/d.gds", tmp_path / "one.gds")
    assert_reads_like(url, tmp_path / "one.gds", tmp_path / "cache")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "no temporary folder left"


def test_parts_published_to_s3(inputs, s3, tmp_path):
    url, staging = s3.url("sets/p.gds"), tmp_path / "staging"
    code, _, err = finish(gds(*inputs, "-o", url, *RAW, "--part", "0/3"))
    assert code == 2 and "need --staging DIR" in err
    three_parts(inputs, url, RAW, ("--staging", str(staging)))
    code, stdout, err = finish(gds("--publish-parts", "-o", url, "--staging", str(staging)))
    assert code == 0, err
    assert "3 parts published" in stdout and not staging.exists(), "parts removed once uploaded"
    assert shard_main([*inputs, "-o", str(tmp_path / "one.gds"), *RAW, "--quiet"]) == 0
    same_as_local(s3, "sets/p.gds", tmp_path / "one.gds")


def test_large_files_go_up_in_parts(s3, tmp_path):
    from gdsload.conversion.upload import upload_dataset
    from gdsload.conversion.writer import write_dataset

    data = np.random.default_rng(0).integers(0, 255, (12, 1 << 20), dtype=np.uint8)  # one 12 MiB shard
    write_dataset(tmp_path / "big.gds", {"x": data}, progress=False)
    upload_dataset(str(tmp_path / "big.gds"), s3.url("big.gds"), part_bytes=5 << 20, progress=False)
    same_as_local(s3, "big.gds", tmp_path / "big.gds")
    etag = s3.client.head_object(Bucket=s3.bucket, Key="big.gds/x/c/0/0")["ETag"]
    assert etag.strip('"').endswith("-3"), f"a multipart upload of 3 parts (ETag {etag})"
    assert not s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads"), "none left open"


# The child: gdsload shard, stopped just before it uploads the root zarr.json (GATE announces it), to be killed.
CHILD = """
import os, sys, time
import gdsload.conversion.upload as upload
def stop(*args):
    open(os.environ["GATE"], "w").close()
    time.sleep(600)
upload.publish_root = stop
from gdsload.tools.cli import shard_main
sys.exit(shard_main(sys.argv[1:], prog="gdsload shard"))
"""


def test_an_upload_killed_before_its_root_zarr_json_is_no_dataset_and_a_rerun_completes_it(inputs, s3, tmp_path):
    url, gate = s3.url("sets/k.gds"), tmp_path / "gate"
    env = dict(os.environ, PYTHONPATH=ROOT, GATE=str(gate))
    child = subprocess.Popen([sys.executable, "-c", CHILD, *inputs, "-o", url, *RAW, "--quiet"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not gate.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.exists(), child.communicate()[1] if child.poll() is not None else "the child never got there"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    left = objects(s3, "sets/k.gds")
    assert "zarr.json" not in left and "img/zarr.json" in left and ".gdsload-upload.json" in left
    assert any("/c/" in k for k in left), "shards were uploaded before the kill"
    with pytest.raises(ReadError, match="zarr.json: HTTP 404") as e:  # a reader finds no dataset
        GDSDataset(url, batch_size=64, backend="cpu", cache_dir=str(tmp_path / "cache"))
    assert url in str(e.value)
    code, _, err = finish(gds(*inputs, "-o", url, *RAW))  # no --overwrite: the marker says it was ours
    assert code == 0, err
    assert shard_main([*inputs, "-o", str(tmp_path / "one.gds"), *RAW, "--quiet"]) == 0
    same_as_local(s3, "sets/k.gds", tmp_path / "one.gds")  # the marker is gone
    assert_reads_like(url, tmp_path / "one.gds", tmp_path / "cache")


def test_overwrite_rules_and_errors_name_the_url_and_status(inputs, s3, tmp_path, capsys):
    url = s3.url("sets/o.gds")
    assert shard_main([*inputs, "-o", url, "--shard-bytes", "4KiB", "--block-bytes", "4KiB", "--quiet"]) == 0
    many = objects(s3, "sets/o.gds")
    capsys.readouterr()
    assert shard_main([*inputs, "-o", url, *RAW, "--quiet"], prog="gdsload shard") == 2
    assert f"gdsload shard: error: {url}: output exists" in capsys.readouterr().err
    assert objects(s3, "sets/o.gds") == many, "left as it was"
    assert shard_main([*inputs, "-o", url, *RAW, "--overwrite", "--quiet"]) == 0
    assert shard_main([*inputs, "-o", str(tmp_path / "one.gds"), *RAW, "--quiet"]) == 0
    same_as_local(s3, "sets/o.gds", tmp_path / "one.gds")  # the old version's extra shards are gone
    assert len(many) > len(files_below(tmp_path / "one.gds"))
    s3.put("sets/mine/notes.txt", b"not a dataset")
    capsys.readouterr()
    assert shard_main([*inputs, "-o", s3.url("sets/mine"), "--overwrite", "--quiet"]) == 2
    assert "holds 1 object(s) but no dataset" in capsys.readouterr().err
    assert objects(s3, "sets/mine") == {"notes.txt": b"not a dataset"}, "never touched"
    missing = f"s3://no-such-bucket-{os.getpid()}/d.gds"
    assert shard_main([*inputs, "-o", missing, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: HTTP 404 NoSuchBucket" in err
    assert shard_main([*inputs, "-o", "http://example.com/d.gds", "--quiet"]) == 2
    assert "uploads to s3:// only" in capsys.readouterr().err
