"""gdsload bench on a tiny dataset with the cpu backend: the table, the JSON rows, exit codes, a backend that
cannot run, cold without root; and the pieces that bound its measurements (Bounded, sized)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from gdsload.tools import bench, cli
from gdsload.system.env import gpu_available
from gdsload.tools.measure import PassResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
ROW_KEYS = {"backend", "io_mode", "regime", "shuffle", "gbps", "samples_per_s", "cpu_s_per_gb"}


@pytest.fixture
def tiny(make_dataset) -> str:
    n = 2000
    return make_dataset({"images": np.random.default_rng(0).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
                         "labels": np.arange(n, dtype=np.int64) % 10}, block_bytes=64 << 10)


def gdsload(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gdsload", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, **env}, timeout=300)


def test_bench_prints_a_table_and_writes_json_rows(tiny, tmp_path):
    out = tmp_path / "b.json"
    done = gdsload("bench", tiny, "--backends", "cpu", "--seconds", "0.3", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{tiny}: 2,000 samples")
    assert any(ln.split()[:4] == ["what", "io", "mode", "regime"] for ln in lines)
    assert sum(ln.startswith("gdsload cpu") for ln in lines) == 2, done.stdout
    assert any(ln.startswith("ceiling: page cache -> host memory") for ln in lines), done.stdout
    doc = json.loads(out.read_text())
    assert doc["command"] == "gdsload bench" and doc["samples"] == 2000 and doc["settings"]["backends"] == ["cpu"]
    rows = doc["rows"]
    assert all(ROW_KEYS <= set(r) for r in rows), rows
    measured = [r for r in rows if r["backend"] == "cpu"]
    assert {(r["regime"], r["shuffle"]) for r in measured} == {("warm", False), ("warm", True)}
    for r in measured:
        assert r["io_mode"] == "cpu" and r["gbps"] > 0 and r["samples_per_s"] > 0 and r["cpu_s_per_gb"] > 0
        assert 0.3 <= r["seconds"] < 5, "a measurement fills --seconds and stops soon after"
    ceilings = [r for r in rows if r.get("ceiling")]
    assert ceilings and all(r["backend"] is None and r["io_mode"] == "posix" for r in ceilings)
    assert not any("error" in r for r in rows)


def test_bad_path_exits_2_with_one_line(tmp_path):
    done = gdsload("bench", str(tmp_path / "missing.gds"), "--backends", "cpu")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "missing.gds" in done.stderr
    not_a_dataset = gdsload("bench", str(tmp_path), "--backends", "cpu")
    assert not_a_dataset.returncode == 2 and len(not_a_dataset.stderr.strip().splitlines()) == 1


def test_bad_json_folder_and_bad_backend_exit_2(tiny, tmp_path):
    done = gdsload("bench", tiny, "--backends", "cpu", "--json", str(tmp_path / "no" / "b.json"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert gdsload("bench", tiny, "--backends", "cpu,floppy").returncode == 2
    assert gdsload("bench", tiny, "--seconds", "0").returncode == 2


def test_a_backend_that_cannot_run_gives_a_row_with_the_reason(tiny, tmp_path):
    """Opening pinned fails (no GPU visible to the process): one row says why, it is not tried again, the rest
    runs."""
    out = tmp_path / "b.json"
    done = gdsload("bench", tiny, "--backends", "cpu,pinned", "--seconds", "0.2", "--json", str(out),
                   CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BackendUnavailable: backend 'pinned' needs a CUDA GPU and CuPy" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    pinned = [r for r in rows if r["backend"] == "pinned"]
    assert len(pinned) == 1 and pinned[0]["gbps"] is None and "needs a CUDA GPU" in pinned[0]["error"]
    assert ROW_KEYS <= set(pinned[0])
    assert len([r for r in rows if r["backend"] == "cpu" and r["gbps"]]) == 2


@pytest.mark.skipif(gpu_available(), reason="the GPU backends can run here")
def test_without_a_gpu_the_defaults_are_auto_and_cpu_and_gpu_backends_say_why(tiny, capsys):
    assert cli.main(["bench", tiny, "--seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "auto picks cpu" in out and out.count("gdsload cpu (auto)") == 2
    assert cli.main(["bench", tiny, "--backends", "mmap", "--seconds", "0.2"]) == 0
    assert "gdsload mmap" in (out := capsys.readouterr().out) and "needs a CUDA GPU" in out


def test_cold_without_root_says_so(tiny):
    target = bench.Target.open(tiny)
    no_root = dataclasses.replace(bench.Machine.here(target), can_drop=False)
    rows = bench.Bench(target, ["cpu"], cold=True, seconds=0.2, batch_size=bench.DEFAULT_BATCH, machine=no_root).run()
    cold = [r for r in rows if r["regime"] == "cold"]
    assert any(r["backend"] is None and "needs root" in (r.get("error") or "") for r in cold)
    assert not any(r["backend"] == "cpu" for r in cold), "no cold figure without a dropped cache"
    disk = [r for r in cold if r.get("ceiling") == "O_DIRECT disk read"]
    assert len(disk) == 1 and (disk[0]["gbps"] or disk[0]["error"]), "O_DIRECT needs no root: measured or why not"


class Slow:
    """A stand-in dataset: batches every 10 ms; records whether a pass was closed."""

    def __init__(self, batches: int = 1000):
        self.batches, self.closed = batches, 0
        self.stats = "stats"

    def __iter__(self):
        try:
            for i in range(self.batches):
                time.sleep(0.01)
                yield i
        finally:
            self.closed += 1


def test_bounded_cuts_a_pass_at_its_deadline_and_closes_it():
    ds = Slow()
    b = bench.Bounded(ds, 0.1)
    t0 = time.perf_counter()
    taken = list(b)
    assert 5 <= len(taken) < 30 and time.perf_counter() - t0 < 1.0
    assert ds.closed == 1 and b.stats == "stats"
    assert list(b) == [0], "a later pass past the deadline ends after one batch"


def test_sized_measures_a_probe_then_what_its_rate_reads_in_the_time_given():
    mib = 1 << 20
    sizes = [16 * mib] * 100
    calls = []

    def measure(units):
        calls.append(list(units))
        n = sum(sizes[u] for u in units)
        return PassResult(bytes=n, seconds=n / 1e9, io_mode="x")  # 1 GB/s

    r = bench.sized(list(range(100)), sizes, 0.5, measure, repeat=False)
    probe, main = calls
    assert sum(sizes[u] for u in probe) >= bench.PROBE_BYTES and not set(probe) & set(main), "a cold read stays cold"
    assert abs(r.seconds - 0.5) <= 16 * mib / 1e9 and r.bytes == sum(sizes[u] for u in main)
    calls.clear()
    bench.sized([0, 1, 2], sizes[:3], 0.5, measure)
    assert all(c == [0, 1, 2] for c in calls) and 2 <= len(calls) <= 5, "a small set is repeated, the best kept"


def test_sized_warm_reads_every_unit_after_a_large_first_one():
    """The issue's shape: a first file of at least PROBE_BYTES, then an 82 KB labels file. The ceiling was
    measured on the labels file alone (the units after the probe); warm, it is measured on both."""
    sizes = [bench.PROBE_BYTES, 82_000]
    calls = []

    def measure(units):
        calls.append(list(units))
        n = sum(sizes[u] for u in units)
        return PassResult(bytes=n, seconds=n / 10e9, io_mode="x")  # 10 GB/s

    r = bench.sized([0, 1], sizes, 0.5, measure)
    assert calls[0] == [0] and all(c == [0, 1] for c in calls[1:]) and len(calls) > 1, calls
    assert r.bytes == sum(sizes)


def test_sized_cold_keeps_the_probe_when_fewer_bytes_follow_it():
    sizes = [bench.PROBE_BYTES, 82_000]
    calls = []

    def measure(units):
        calls.append(list(units))
        n = sum(sizes[u] for u in units)
        return PassResult(bytes=n, seconds=n / 10e9, io_mode="x")

    r = bench.sized([0, 1], sizes, 0.5, measure, repeat=False)
    assert calls == [[0]] and r.bytes == bench.PROBE_BYTES, "82 KB read cold is a latency, not a rate"


def test_file_ceiling_reads_the_files_the_dataset_reads_for_long_enough(make_dataset):
    """The page-cache ceiling reads every shard file of the fields the dataset reads, back to back for at
    least MIN_TIMED_S (a tiny dataset read once is timed at the cost of starting the reads). Its first files
    hold more than a probe (as a large image field's do): the probe is a part, the measurement all of them."""
    from gdsload.format.layout import DatasetLayout

    n = bench.PROBE_BYTES // 1024
    path = make_dataset({"a": np.zeros((n, 1024), np.uint8), "labels": np.arange(n, dtype=np.int64)},
                        samples_per_block=4096)
    b = bench.Bench(bench.Target.open(path), ["cpu"], cold=False, seconds=0.3, batch_size=64)
    with b.open("cpu", False) as ds:  # the files of the dataset the bench measures, through its public face
        with DatasetLayout(ds.meta, ds.fields) as layout:
            files = layout.shard_paths()
    assert sorted(b.target.files) == sorted(files) and len(files) >= 2
    sizes = [os.path.getsize(f) for f in b.target.files]
    assert sizes[0] >= bench.PROBE_BYTES, "the probe is the first file alone: a part"
    b.warm_cache()
    r = b.files()
    total = sum(sizes)
    assert r.seconds >= bench.MIN_TIMED_S and r.bytes >= 2 * total
    assert r.bytes % total == 0, "passes over every file: none left out"


def test_read_files_fills_min_seconds_with_passes(tiny):
    from gdsload.tools.measure import read_files, shard_paths

    paths = shard_paths(tiny)
    size = sum(os.path.getsize(p) for p in paths)
    once = read_files(paths, threads=2)
    assert once.bytes == size
    r = read_files(paths, threads=2, min_seconds=0.1)
    assert r.seconds >= 0.1 and r.bytes % size == 0 and r.bytes > size


def test_the_plan_on_a_gpu_machine(tiny):
    """What a GPU machine with KvikIO would measure, planned without running it: ceilings first, auto's pick
    measured once and marked, each backend warm then cold, in order and shuffled."""
    gpu = bench.Machine(gpu=True, kvikio=True, memory=1 << 40, can_drop=True, auto=("mmap", "the dataset fits"),
                        runnable=("kvikio", "pinned", "mmap", "cpu"))
    b = bench.Bench(bench.Target.open(tiny), None, cold=True, seconds=1.0, batch_size=64, machine=gpu)
    assert b.backends == ["mmap", "kvikio", "pinned", "cpu"], "auto's pick once, then the others that can run"
    plan = b.tasks()
    ceilings = [t.where["ceiling"] + " " + t.where["regime"] for t in plan if t.where.get("ceiling")]
    assert ceilings == ["pinned H2D copy -", "page cache -> pinned memory warm", "raw KvikIO, same blocks warm",
                        "O_DIRECT disk read cold", "raw KvikIO, same blocks cold"]
    measured = [(t.where["backend"], t.where["regime"], t.where["shuffle"]) for t in plan
                if t.where.get("backend") and not t.where.get("ceiling")]
    assert measured == [(n, r, s) for r in ("warm", "cold") for n in b.backends for s in (False, True)]
    assert all(t.where["auto"] == (t.where["backend"] == "mmap") for t in plan if "auto" in t.where)
    assert [t.label for t in plan if not t.where] == ["reading the dataset into the page cache"]


def test_cold_rows_do_not_time_the_datasets_set_up(tiny, monkeypatch):
    """A cold row timed the dataset's first pass, which also allocates its window buffers and sets up
    streams and kernels (warm rows took a few batches first): cold figures came out low for that alone."""
    started = []

    def spy(ds, *args, **kwargs):
        started.append(ds.describe()["window_buffers"] > 0)
        return PassResult(bytes=1, seconds=1.0, io_mode="cpu")

    monkeypatch.setattr(bench, "cold_pass", spy)
    b = bench.Bench(bench.Target.open(tiny), ["cpu"], cold=True, seconds=0.2, batch_size=64)
    b.measure("cpu", False, cold=True)()
    assert started == [True], "the dataset had run before the cold pass was timed"
