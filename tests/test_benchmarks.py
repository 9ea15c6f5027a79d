"""The benchmarks never rot: the suite, the report, the sweep and the shuffle-quality benchmark run on a tiny
dataset with the cpu backend (no GPU, torch or matplotlib needed), and gdsload.tools.measure's primitives are
checked against what they measure."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from gdsload import GDSDataset, write_dataset
from gdsload.backends.cpu import DEFAULT_THREADS as CPU_THREADS
from gdsload.tools.measure import PassResult, block_locations, read_files, shard_paths, time_pass, time_passes
from gdsload.tools.steps import HostStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"auto_backend", "io_mode", "warm_shuffled_gbps", "raw_kvikio_shuffled_gbps",
                "stall_1p5x_sync_every_step", "open_s", "first_batch_s"}


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<args>`` from the repository root, as the README runs them."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One quick suite on two tiny datasets, cpu backend, no cold rows: its results folder."""
    tmp = tmp_path_factory.mktemp("suite")
    bench("benchmarks.suite", "--quick", "--backends", "cpu", "--sizes-gib", "0.01,0.02", "--batch-size", "16",
          "--resident-bytes", "0", "--repeats", "2", "--stall-repeats", "2", "--no-cold",
          "--data", str(tmp / "data"), "--out", str(tmp / "results"), "--shm", str(tmp / "shm"))
    return str(tmp / "results" / "cpu-only")


def test_suite_writes_one_shape(suite_run: str) -> None:
    with open(os.path.join(suite_run, "suite.json")) as f:
        doc = json.load(f)
    assert doc["schema"] == 1 and doc["mode"] == "quick" and doc["machine"]["gpu"] is None
    assert doc["settings"]["backends"] == ["cpu"] and doc["settings"]["page_cache_dropped"] is False
    assert doc["auto_backend"]["backend"] == "cpu"
    rows = doc["results"]
    assert {r["kind"] for r in rows} == {"ceiling", "gdsload", "startup", "contender", "step"}
    assert {r["regime"] for r in rows} == {"warm", "shm"}  # no cold rows without dropping the cache
    gds = [r for r in rows if r["kind"] == "gdsload"]
    assert {(r["dataset"], r["regime"], r["shuffle"]) for r in gds} == {
        ("0.01GiB-4MiB", "warm", False), ("0.01GiB-4MiB", "warm", True), ("0.01GiB-4MiB", "shm", False),
        ("0.02GiB-4MiB", "warm", False), ("0.02GiB-4MiB", "warm", True)}
    for r in gds:
        assert r["backend"] == "cpu" and r["io_mode"] == "cpu" and r["default"] is True
        assert r["gb_per_s"] > 0 and r["samples_per_s"] > 0 and r["cpu_core_s_per_gb"] > 0
        assert 0 <= r["stall_fraction"] <= 1 and r["open_s"] > 0 and r["backend_stats"]["num_threads"] == CPU_THREADS
    steps = [r for r in rows if r["kind"] == "step" and r.get("backend") == "cpu"]
    assert [(r["step_factor"], r["sync_every"]) for r in steps] == [(1.5, 1), (3.0, 1), (1.5, 8)]
    for r in steps:
        assert r["dataset"] == "0.02GiB-4MiB" and len(r["wait_fraction_runs"]) == 2
        assert r["wait_fraction"] == round(float(np.median(r["wait_fraction_runs"])), 4)
        assert 0 <= r["first_pass_wait_fraction"] <= 1 and r["first_pass_seconds"] > 0
        assert -1 < r["alone_drift_fraction"] < 1  # the steps alone timed again after the passes
        # the first batch can be ready before the consumer asks (a tiny batch on a fast machine): never negative,
        # never longer than its pass
        assert 0 <= r["first_batch_s"] <= r["first_pass_seconds"]
    naive = [r for r in rows if r["name"] == "naive np.fromfile"]
    assert len(naive) == 2 and all(r["io_mode"] == "posix-pageable" and r["gb_per_s"] > 0 for r in naive)
    for r in rows:  # every row has figures, or says why not
        assert "gb_per_s" in r or "open_s" in r or "error" in r or "skipped" in r, r


def test_suite_summary(suite_run: str) -> None:
    with open(os.path.join(suite_run, "summary.json")) as f:
        summary = json.load(f)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["dataset"] == "0.02GiB-4MiB" and summary["auto_backend"] == "cpu"
    assert summary["io_mode"] == {"cpu": "cpu"} and summary["raw_kvikio_shuffled_gbps"] is None
    assert summary["warm_shuffled_gbps"]["cpu"] > 0
    assert 0 <= summary["stall_1p5x_sync_every_step"]["cpu"] <= 1
    assert summary["open_s"]["cpu"] > 0 and summary["first_batch_s"]["cpu"] >= 0
    assert summary["startup_regime"] == "warm"


def test_suite_markdown_and_png(suite_run: str) -> None:
    with open(os.path.join(suite_run, "suite.md")) as f:
        md = f.read()
    assert md.startswith("# gdsload benchmark suite (quick)") and "No GPU (" in md
    assert f"| 0.02GiB-4MiB | warm | gdsload cpu | threads={CPU_THREADS} shuffle=True | cpu |" in md
    assert "## Startup" in md and "## Summary (summary.json)" in md and "| cpu | cpu |" in md
    assert "; steps alone again " in md and "the steps alone timed again after them: " in md
    assert os.path.exists(os.path.join(suite_run, "suite.png")) == has_matplotlib()


def test_report_renders_the_suite_json_again(suite_run: str, tmp_path: str) -> None:
    """The markdown comes from the JSON alone: rendering a copy gives the same file."""
    copy = os.path.join(tmp_path, "suite.json")
    with open(os.path.join(suite_run, "suite.json")) as f, open(copy, "w") as g:
        g.write(f.read())
    bench("benchmarks.report", copy)
    for name in ("suite.md", "summary.json"):
        with open(os.path.join(suite_run, name)) as f, open(os.path.join(tmp_path, name)) as g:
            assert f.read() == g.read(), name


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*", "suite.json"))))
def test_committed_results_render_to_their_summary(path: str, tmp_path: str) -> None:
    """Every kept suite run has the one shape, and its summary.json is what its JSON gives."""
    copy = os.path.join(tmp_path, "suite.json")
    with open(path) as f, open(copy, "w") as g:
        g.write(f.read())
    bench("benchmarks.report", copy)
    with open(os.path.join(os.path.dirname(path), "summary.json")) as f, \
            open(os.path.join(tmp_path, "summary.json")) as g:
        kept, fresh = json.load(f), json.load(g)
    assert kept == fresh and SUMMARY_KEYS <= set(kept)


def test_report_refuses_another_shape(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "old.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "run.py", "results": []}, f)
    done = bench("benchmarks.report", path, check=False)
    assert done.returncode != 0 and "not a suite result of schema 1" in done.stderr


def test_sweep_cpu(tmp_path: str) -> None:
    bench("benchmarks.sweep", "--configs", "cpu-threads", "--size-gib", "0.02", "--passes", "1", "--batch-size", "16",
          "--data", os.path.join(tmp_path, "data"), "--out", os.path.join(tmp_path, "results"))
    with open(os.path.join(tmp_path, "results", "cpu-only", "sweep-cpu-threads.json")) as f:
        doc = json.load(f)
    swept = [r for r in doc["results"] if "config" in r]
    assert [r["backend_stats"]["num_threads"] for r in swept] == [1, 4, 8]  # the option reached the backend
    assert [r["config"] for r in swept] == ["cpu num_threads=1", "cpu num_threads=4", "cpu num_threads=8"]
    assert all(r["io_mode"] == "cpu" and len(r["gb_per_s_runs"]) == 1 for r in swept)
    assert [r["ceiling"] for r in doc["results"] if "ceiling" in r] == ["page cache -> host memory"] * 2


def test_mixture_benchmark_cpu(tmp_path: str) -> None:
    out = str(tmp_path / "results")
    bench("benchmarks.mixture", "--data", str(tmp_path / "data"), "--out", out, "--size-gib", "0.02",
          "--backends", "cpu", "--rounds", "2", "--min-seconds", "0", "--batch-size", "16")
    (path,) = glob.glob(os.path.join(out, "*", "mixture.json"))
    with open(path) as f:
        (row,) = json.load(f)["results"]
    assert row["io_mode"] == "cpu" and len(row["gb_per_s_single"]) == len(row["gb_per_s_mixture"]) == 2
    assert row["best_mixture"] > 0 and os.path.exists(path[:-5] + ".md")
    assert row["step_factor"] == 1.5 and row["waiting_pct_single"] >= 0 and row["waiting_pct_mixture"] >= 0


def test_shuffle_quality(tmp_path: str) -> None:
    bench("benchmarks.shuffle_quality", "--samples", "4000", "--samples-per-block", "16", "--batch-size", "64",
          "--classes", "10", "--windows", "1,16", "--out", str(tmp_path))
    with open(os.path.join(tmp_path, "shuffle-quality.json")) as f:
        rows = {str(r["window_blocks"]): r for r in json.load(f)["results"]}
    assert set(rows) == {"1", "16", "full permutation", "no shuffle"}
    assert rows["no shuffle"]["rank_correlation"] == 1.0 and rows["full permutation"]["rank_correlation"] < 0.1
    assert rows["1"]["class_entropy_fraction"] < rows["16"]["class_entropy_fraction"]
    assert os.path.exists(os.path.join(tmp_path, "shuffle-quality.md"))


# -- gdsload.tools.measure ---------------------------------------------------------------------------------------
class Source:
    """An array source for write_dataset (the test's own, as the benchmarks' synthetic one)."""

    origin = "<test>"

    def __init__(self, a: np.ndarray):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.a[start:stop]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("measure") / "small.gds")
    x = np.arange(600 * 1024, dtype=np.uint8).reshape(600, 1024)
    write_dataset(path, {"x": Source(x), "y": Source(np.arange(600, dtype=np.int64))}, block_bytes=16 << 10,
                  progress=False)
    return path


def test_time_pass_counts_the_bytes_delivered(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        r = time_pass(ds)
        twice = time_pass(ds, min_seconds=1e-9)  # at least one pass: the same figures
    # What reached the consumer: every sample once (the blocks stored add the last block's padding).
    assert r.bytes == 600 * (1024 + 8) < sum(b.nbytes for b in block_locations(small))
    assert r.samples == 600 and r.io_mode == "cpu" and twice.bytes == r.bytes
    assert r.gb_per_s > 0 and r.samples_per_s > 0 and 0 <= r.stall_fraction <= 1 and r.wait_s is None


def test_time_pass_with_a_step_waits_at_least_nothing(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu") as ds:
        r = time_pass(ds, HostStep(2.0))
    # Timings on a shared CI machine jitter either way: only the relations that define the figures are checked.
    assert r.alone_s >= 12 * 0.002 and r.seconds >= 12 * 0.002
    assert r.wait_s == max(0.0, r.seconds - r.alone_s) and 0 <= r.wait_fraction < 1


class _Watched(HostStep):
    """A step that notes, when its steps alone are timed, whether the dataset still had a pass reading."""

    def __init__(self, ds: GDSDataset, ms: float):
        super().__init__(ms)
        self.ds, self.reading_while_alone = ds, []

    def alone(self, steps: int) -> float:
        self.reading_while_alone.append(bool(self.ds._active))
        return super().alone(steps)


@pytest.mark.parametrize("timer", ["time_pass", "time_passes"])
def test_steps_alone_are_timed_with_nothing_reading(small: str, timer: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        step = _Watched(ds, 0.5)
        for _ in range(2):  # the second time, the pass before has left the pipeline reading the next epoch
            time_pass(ds, step) if timer == "time_pass" else time_passes(ds, step, 1)
    # time_passes times the steps alone before its passes and again after them
    assert step.reading_while_alone == [False] * (2 if timer == "time_pass" else 4)


def test_time_passes_splits_one_stretch_into_passes(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        t0 = time.perf_counter()
        runs = time_passes(ds, HostStep(1.0), passes=3)
        wall = time.perf_counter() - t0
    assert len(runs) == 4
    for r in runs:  # every pass delivers every sample once, with its own first batch and waiting
        assert r.samples == 600 and r.bytes == 600 * (1024 + 8) and r.first_batch_s is not None
        assert r.alone_s == runs[0].alone_s >= 12 * 0.001 and r.wait_s == max(0.0, r.seconds - r.alone_s)
        assert r.alone_again_s == runs[0].alone_again_s >= 12 * 0.001  # the steps alone, timed again after
    assert sum(r.seconds for r in runs) <= wall  # consecutive stretches of one clock, the steps alone before them


def test_host_step_queues_like_a_device() -> None:
    step = HostStep(5.0, sync_every=4)
    t0 = time.perf_counter()
    for _ in range(3):
        step()  # launched, not waited for
    assert time.perf_counter() - t0 < 0.005
    step()  # the 4th syncs: the queue of 4 steps has drained
    assert time.perf_counter() - t0 >= 0.02
    assert step.alone(4) >= 0.02


def test_read_files_reads_every_byte(small: str) -> None:
    paths = shard_paths(small)
    total = sum(os.path.getsize(p) for p in paths)
    r = read_files(paths, threads=3, chunk=8 << 10)
    assert r.bytes == total and r.io_mode == "posix" and r.cpu_s >= 0
    try:
        direct = read_files(paths, direct=True, threads=2, chunk=8 << 10)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    assert direct.bytes == total and direct.io_mode == "posix-odirect"


def test_block_locations_are_the_blocks(small: str) -> None:
    blocks = block_locations(small, ("x",))
    assert len(blocks) == -(-600 * 1024 // (16 << 10)) and all(b.nbytes == 16 << 10 for b in blocks)
    with open(blocks[3].path, "rb") as f:
        f.seek(blocks[3].offset)
        data = np.frombuffer(f.read(blocks[3].nbytes), np.uint8)
    assert np.array_equal(data, np.arange(600 * 1024, dtype=np.uint8)[3 * (16 << 10):4 * (16 << 10)])


def test_pass_result_fractions() -> None:
    r = PassResult(bytes=2_000_000_000, seconds=2.0, io_mode="x", samples=100, cpu_s=1.0, stall_s=0.5,
                   first_batch_s=0.5, wait_s=0.2)
    assert (r.gb_per_s, r.samples_per_s, r.cpu_core_s_per_gb) == (1.0, 50.0, 0.5)
    assert (r.stall_fraction, r.steady_stall_fraction, r.wait_fraction) == (0.25, 0.0, 0.1)


def test_a_first_batch_under_a_tenth_of_a_millisecond_keeps_its_figure() -> None:
    from benchmarks.rows import figures

    r = PassResult(bytes=1000, seconds=0.01, io_mode="x", stall_s=0.0, first_batch_s=3.2e-05)
    assert figures(r, [])["first_batch_s"] == 3.2e-05


def test_time_pass_starts_from_rest_unless_told(small: str) -> None:
    """What the readers did between measurements (they read the next epoch ahead while nobody timed them)
    must not count as the timed stretch's: time_pass stops reading ahead before the clock starts."""

    class Spy(GDSDataset):
        stops = 0

        def stop(self) -> None:
            Spy.stops += 1
            super().stop()

    with Spy(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        assert Spy.stops == 1
        time_pass(ds, from_rest=False)
        assert Spy.stops == 1, "the earlier method, kept for comparisons, keeps what was read ahead"


def test_read_files_closes_what_it_opened_when_an_open_fails(tmp_path) -> None:
    """The files were all opened before the try that closes them: a refused open leaked the ones before it."""
    import os

    from gdsload.tools.measure import read_files

    good = tmp_path / "a.bin"
    good.write_bytes(b"x" * 8192)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        read_files([str(good), str(tmp_path / "missing.bin")])
    assert len(os.listdir("/proc/self/fd")) == before


def test_summary_startup_is_the_warm_regime_with_cold_beside_it(suite_run: str) -> None:
    """The start-up targets are set for a warm dataset: a run with both regimes summarises the warm rows
    and keeps the cold ones under their own keys (a run with cold rows only summarised those as if warm)."""
    from benchmarks.report import load, summarize

    doc = load(os.path.join(suite_run, "suite.json"))
    warm = [r for r in doc["results"] if r["kind"] == "startup"]
    assert {r["regime"] for r in warm} == {"warm"}
    cold = [{**r, "regime": "cold", "open_s": r["open_s"] + 1.0, "first_batch_s": r["first_batch_s"] + 2.0}
            for r in warm]
    doc["results"] = cold + doc["results"]
    s = summarize(doc)
    main = [r for r in warm if r["dataset"] == s["dataset"]][0]
    assert s["startup_regime"] == "warm"
    assert (s["open_s"]["cpu"], s["first_batch_s"]["cpu"]) == (main["open_s"], main["first_batch_s"])
    assert (s["open_s_cold"]["cpu"], s["first_batch_s_cold"]["cpu"]) == (main["open_s"] + 1.0,
                                                                         main["first_batch_s"] + 2.0)


def test_ab_compares_two_trees_each_from_its_own_process(tmp_path: str) -> None:
    """benchmarks.ab on the cpu backend: one row per mode, each tree's runs made by a process that imported
    gdsload from that tree, and the table and JSON written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = os.path.join(str(tmp_path), "other")
    os.makedirs(other)
    os.symlink(os.path.join(root, "gdsload"), os.path.join(other, "gdsload"))
    out = os.path.join(str(tmp_path), "out")
    done = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--trees", other, root, "--backends", "cpu",
                           "--gib", "0.01", "--rounds", "1", "--no-cold", "--data", str(tmp_path), "--out", out],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.load(open(os.path.join(out, "ab.json")))
    assert [r["mode"] for r in doc["rows"]] == ["warm", "step 1.5x a batch's read", "10 ms step"]
    for row in doc["rows"]:
        a, b = row["A"][0], row["B"][0]
        assert a["gdsload"] == os.path.join(other, "gdsload") and b["gdsload"] == os.path.join(root, "gdsload")
        assert a["gbps"] > 0 and b["gbps"] > 0 and a["io_mode"] == "cpu"
    assert "| cpu | cpu | warm | GB/s |" in open(os.path.join(out, "ab.md")).read()


def test_remote_clients_benchmark(tmp_path: str) -> None:
    """benchmarks.remote_clients on a tiny object: every installed client read the same ranges from both local
    servers, and the packages not installed are rows that say so, never figures."""
    import importlib.util

    out = str(tmp_path / "results")
    bench("benchmarks.remote_clients", "--data", str(tmp_path / "data"), "--out", out, "--size-gib", "0.004",
          "--ranges", "1MiB", "--threads", "1,2", "--repeats", "1", "--bytes-per-case", "2MiB", "--moto-bytes", "2MiB")
    (path,) = glob.glob(os.path.join(out, "*", "remote-clients.json"))
    with open(path) as f:
        doc = json.load(f)
    rows = doc["results"]
    timed = {(r["server"], r["client"], r["threads"]) for r in rows if "gb_per_s" in r}
    for server in ("aiohttp (sendfile)", "moto (S3 server)"):
        for client in ("gdsload S3Client (botocore)", "botocore get_object"):
            assert {(server, client, 1), (server, client, 2)} <= timed
    assert {("aiohttp (sendfile)", c, 2) for c in ("gdsload HttpClient", "fsspec http")} <= timed
    for r in rows:
        assert "gb_per_s" in r or "skipped" in r, r  # no client failed
        if "gb_per_s" in r:
            assert r["bytes"] == r["requests"] * r["range_bytes"] == 2 << 20 and r["gb_per_s"] > 0
    for module, client in (("obstore", "obstore s3"), ("s3fs", "s3fs")):
        if importlib.util.find_spec(module) is None:
            assert {"server": "moto (S3 server)", "client": client,
                    "skipped": f"{module} is not installed: not measured"} in rows
    assert doc["versions"]["botocore"] and doc["cases"] == [{"range_bytes": 1 << 20, "threads": t} for t in (1, 2)]
    with open(path[:-5] + ".md") as f:
        md = f.read()
    assert "### aiohttp (sendfile)" in md and "| gdsload HttpClient | " in md
