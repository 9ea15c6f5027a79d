"""Remote throughput tooling without a GPU: benchmarks/remote.py on a tiny dataset (the CPU rows timed, the GPU rows
saying why they did not run) and ``gdsload bench http://...`` against a local range server on the cpu backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from remote_servers import RangeServer, upload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "GDSLOAD_CACHE_DIR": str(tmp_path / "gdsload-cache"),
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def test_remote_benchmark_times_the_cpu_rows_and_says_why_gpu_rows_did_not_run(tmp_path):
    pytest.importorskip("aiohttp")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.remote", "--size-gib", "0.004", "--data",
                           str(tmp_path / "data"), "--out", str(out), "--seconds", "0.1", "--repeats", "1",
                           "--workers", "2"], capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path),
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    [folder] = os.listdir(out)
    with open(out / folder / "remote.json") as f:
        doc = json.load(f)
    rows = {r["what"]: r for r in doc["results"]}
    cpu = ["CPU route: HttpClient, same ranges, 16 threads", "gdsload cached cpu, cold cache",
           "gdsload cached cpu, warm cache", "local path cpu"]
    for what in cpu:
        assert rows[what]["gbps"] > 0 and rows[what]["io_mode"] and rows[what]["route"], rows[what]
    assert rows["gdsload cached cpu, warm cache"]["route"] == "cached"
    gpu = ["raw RemoteFile -> device", "raw RemoteFile -> host", "gdsload direct kvikio", "gdsload direct pinned",
           "gdsload cached kvikio, cold cache", "gdsload cached kvikio, warm cache", "local path kvikio"]
    from gdsload.system.env import gpu_available

    for what in gpu:
        if not gpu_available():
            assert rows[what]["gbps"] is None and rows[what]["note"].startswith("not run: "), rows[what]
            assert len(rows[what]["note"]) > len("not run: ")
        assert rows[what]["route"]
    assert (out / folder / "remote.md").read_text().count("| ") > len(rows)


def test_gdsload_bench_of_an_http_url_on_the_cpu_backend(make_dataset, tmp_path):
    n = 800
    path = make_dataset({"images": np.random.default_rng(0).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
                         "labels": np.arange(n, dtype=np.int64)}, block_bytes=64 << 10)
    out = tmp_path / "b.json"
    with RangeServer() as srv:
        url = upload(srv, path, "d.gds")
        done = subprocess.run([sys.executable, "-m", "gdsload", "bench", url, "--backends", "cpu", "--seconds", "0.2",
                               "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path),
                              timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raw RemoteFile" in done.stdout and "CPU client" in done.stdout, done.stdout
    rows = json.loads(out.read_text())["rows"]
    dataset, raw, cpu = rows
    assert dataset["backend"] == "cpu" and dataset["route"] == "cached" and dataset["gbps"] > 0, dataset
    assert cpu["ceiling"].startswith("CPU client") and cpu["gbps"] > 0 and cpu["io_mode"] == "cpu HttpClient", cpu
    from gdsload.system.env import gpu_available

    if not gpu_available():
        assert raw["gbps"] is None and raw["error"], raw
    assert raw["bytes"] if raw["gbps"] else True


def test_remote_blocks_are_the_local_blocks(make_dataset, tmp_path):
    from gdsload.tools.bench_remote import remote_blocks
    from gdsload.tools.measure import block_locations

    path = make_dataset({"x": np.arange(4000, dtype=np.int64)}, block_bytes=4 << 10)
    with RangeServer() as srv:
        url = upload(srv, path, "d.gds")
        got = remote_blocks(url, str(tmp_path / "cache"), shuffle=False)
    want = block_locations(path)
    assert [(b.info.url.split("d.gds/")[1], b.offset, b.nbytes) for b in got] == \
        [(os.path.relpath(w.path, path), w.offset, w.nbytes) for w in want]
