"""``gdsload doctor URL`` against real servers started here: tests/remote_servers.RangeServer over HTTP (with
faults injected: 403, a stall) and moto's S3 server reached through ``AWS_ENDPOINT_URL``; a port nothing
listens on for a refused connection. No client is mocked: the doctor's own clients talk to the servers."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset
from gdsload.tools.doctor import main
from gdsload.tools.doctor_remote import LATENCY_BYTES, LATENCY_GETS

from _helpers import files_below
from remote_servers import RangeServer, etag_of, moto_endpoint, moto_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "/data/d.gds"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A small dataset's files, key -> bytes: 'x' (3 MiB in shards of 1 MiB) and 'y' (labels)."""
    path = str(tmp_path_factory.mktemp("doctor-remote") / "d.gds")
    x = np.random.default_rng(0).integers(0, 255, (768, 4096), dtype=np.uint8)
    write_dataset(path, {"x": ArraySource("<x>", x), "y": ArraySource("<y>", np.arange(768))},
                  block_bytes=256 << 10, shard_bytes=1 << 20, progress=False)
    return files_below(path)


@pytest.fixture
def srv(files: dict[str, bytes]) -> Iterator[RangeServer]:
    with RangeServer({f"{PREFIX}/{k}": v for k, v in files.items()}) as s:
        yield s


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    with moto_endpoint() as endpoint:
        yield endpoint


def doctor_json(url: str, **kw: object) -> dict:
    out = io.StringIO()
    assert main(url, as_json=True, out=out, **kw) == 0
    return json.loads(out.getvalue())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gdsload", "doctor", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(res: subprocess.CompletedProcess[str], start: str) -> str:
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("gdsload doctor: error: " + start), res.stderr
    return res.stderr


def test_http_healthy_dataset(srv: RangeServer, files: dict[str, bytes]) -> None:
    url = srv.url(PREFIX)
    rep = doctor_json(url)
    root = rep["root"]
    assert root["url"] == f"{url}/zarr.json" and root["status"] == 200
    assert root["etag"] == etag_of(files["zarr.json"]) and root["bytes"] == len(files["zarr.json"])
    assert rep["scheme"] == "http" and rep["sources"] is None and rep["client"].startswith("HttpClient")
    assert rep["dataset"]["kind"] == "a gdsload dataset of 2 field(s)"
    shard = f"{url}/x/c/0/0"  # the larger of the two first chunk files
    assert rep["dataset"]["probed"] == {"url": shard, "bytes": len(files["x/c/0/0"])}
    lat = rep["latency"]
    assert lat["gets"] == LATENCY_GETS and lat["bytes"] == LATENCY_BYTES and lat["url"] == shard
    assert 0 < lat["median_ms"] <= lat["p90_ms"]
    ranged = [r for r in srv.requests if r.path == f"{PREFIX}/x/c/0/0" and r.method == "GET"]
    sizes = [int(b) - int(a) + 1 for a, b in (r.header("Range")[6:].split("-") for r in ranged)]
    assert sizes == [LATENCY_BYTES] * LATENCY_GETS + [len(files["x/c/0/0"])]  # then one throughput GET
    assert all(r.status == 206 and r.header("If-Match") == etag_of(files["x/c/0/0"]) for r in ranged)
    thr = rep["throughput"]
    assert thr["bytes"] == len(files["x/c/0/0"]) and thr["gb_per_s"] > 0 and thr["url"] == shard
    assert check(rep, "throughput")["ok"] is None and "a lower bound" in check(rep, "throughput")["found"]
    assert [c["ok"] for c in rep["checks"] if c["ok"] is False] == []
    assert rep["verdict"].startswith(f"remote: reachable; latency median {lat['median_ms']:.1f} ms")
    res = cli(url)
    assert res.returncode == 0 and res.stderr == ""
    lines = res.stdout.splitlines()
    assert lines[0] == f"gdsload doctor: {url} (remote, http)" and lines[-1].startswith("remote: reachable; ")
    assert any(ln.startswith(f"  ✔ reachable           {url}/zarr.json: HTTP 200, ETag ") for ln in lines)


def test_http_404_names_the_url_and_the_fix(srv: RangeServer) -> None:
    url = srv.url("/data/missing.gds")
    err = one_error_line(cli(url), f"{url}/zarr.json: HTTP 404")
    assert "fix: no dataset at this URL: check the path (it names the folder holding zarr.json)" in err


def test_http_403(srv: RangeServer) -> None:
    srv.fail_next(1, 403)
    url = srv.url(PREFIX)
    err = one_error_line(cli(url), f"{url}/zarr.json: HTTP 403 on HEAD; fix: ")
    assert "may not read it" in err


def test_refused_connection() -> None:
    port = closed_port()
    url = f"http://127.0.0.1:{port}/d.gds"
    err = one_error_line(cli(url), f"{url}/zarr.json: connection to 127.0.0.1:{port} refused; fix: ")
    assert f"nothing listens at 127.0.0.1:{port}" in err


def test_a_stalled_server_costs_the_timeout_once(srv: RangeServer) -> None:
    srv.delay_next(1, 60)
    url = srv.url(PREFIX)
    err, t0 = io.StringIO(), time.monotonic()
    assert main(url, timeout_s=0.5, err=err) == 2
    assert time.monotonic() - t0 < 5  # one request, no retries: not the library's minutes of backoff
    port = url.split(":")[2].split("/")[0]
    assert err.getvalue() == (f"gdsload doctor: error: {url}/zarr.json: no answer from 127.0.0.1:{port} within 0.5 s; "
                              "fix: check the network path (firewall, proxy, VPC endpoint) and the server; "
                              "--timeout SECONDS waits longer\n")
    srv.delay_next(1, 60)
    one_error_line(cli(url, "--timeout", "0.5"), f"{url}/zarr.json: no answer from 127.0.0.1:{port} within 0.5 s")


def test_a_foreign_group_over_http_is_a_cross_with_its_fix(srv: RangeServer) -> None:
    """Reachable (exit 0), but a Zarr group that names no arrays cannot be opened over HTTP: a ✘ line and the
    verdict say so; latency and throughput are measured on its zarr.json."""
    body = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()
    url = srv.put("/foreign.zarr/zarr.json", body).rsplit("/", 1)[0]
    rep = doctor_json(url)
    ds = check(rep, "dataset")
    assert ds["ok"] is False and ds["found"] == "a Zarr v3 group that is no gdsload dataset"
    assert "serve it from s3://" in ds["fix"] and rep["verdict"].startswith("remote: reachable, but dataset: ")
    assert rep["latency"]["bytes"] == len(body) and rep["throughput"]["bytes"] == len(body)


def test_s3_through_aws_endpoint_url(moto: str, monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes]) -> None:
    with moto_server(monkeypatch, endpoint=moto) as m:
        for key, data in files.items():
            m.put(f"ds/d.gds/{key}", data)
        url = m.url("ds/d.gds")
        rep = doctor_json(url, timeout_s=5)
        assert rep["sources"] == {"endpoint": moto, "endpoint_source": "AWS_ENDPOINT_URL (environment)",
                                  "region": "us-east-1", "profile": "default",
                                  "credentials": "environment (AWS_ACCESS_KEY_ID)", "credentials_error": None}
        etag = m.client.head_object(Bucket=m.bucket, Key="ds/d.gds/zarr.json")["ETag"]
        assert rep["root"] == {"url": f"{url}/zarr.json", "status": 200, "etag": etag,
                               "bytes": len(files["zarr.json"]), "ms": rep["root"]["ms"]}
        assert rep["dataset"]["objects"] == len(files) and rep["dataset"]["bytes"] == sum(map(len, files.values()))
        largest = max((k for k in files if not k.endswith("zarr.json")), key=lambda k: len(files[k]))
        assert rep["dataset"]["probed"]["bytes"] == len(files[largest])
        assert rep["latency"]["gets"] == LATENCY_GETS and rep["throughput"]["gb_per_s"] > 0
        assert rep["verdict"].startswith("remote: reachable; latency median ")
        res = cli(url)
        assert res.returncode == 0, res.stderr
        assert f"  ✔ endpoint            {moto} from AWS_ENDPOINT_URL (environment); region us-east-1" in res.stdout
        assert "  ✔ credentials         environment (AWS_ACCESS_KEY_ID), profile default; secrets not shown" \
            in res.stdout
        assert "testing" not in res.stdout  # the fake key and secret moto_server sets: never printed
        missing = m.url("ds/none.gds")
        err = one_error_line(cli(missing), f"{missing}/zarr.json: HTTP 404")
        assert f"(endpoint {moto} from AWS_ENDPOINT_URL (environment), credentials environment" in err
        assert "fix: no dataset at this URL: check the bucket and the path" in err


def test_s3_refused_and_without_credentials(moto: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with moto_server(monkeypatch, endpoint=moto) as m:
        port = closed_port()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        url = m.url("ds/d.gds")
        err = one_error_line(cli(url), f"{url}/zarr.json: connection to 127.0.0.1:{port} refused")
        assert "(AWS_ENDPOINT_URL for an S3-compatible store)" in err
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(k)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup off EC2
        err = one_error_line(cli(url), f"{url}/zarr.json: ")
        assert "credentials none)" in err and "fix: no AWS credentials found" in err
