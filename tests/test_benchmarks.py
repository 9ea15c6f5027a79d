"""The benchmarks never rot: the suite, the report, the A/B and the shuffle-quality benchmark run on a tiny
dataset with the cpu backend (no GPU, torch or matplotlib needed), issue 46's summary keys included.
gdsload.tools.measure's primitives are checked in tests/test_measure_tools.py."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gdsload.backends.cpu import DEFAULT_THREADS as CPU_THREADS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"auto_backend", "io_mode", "warm_shuffled_gbps", "raw_kvikio_shuffled_gbps",
                "stall_1p5x_sync_every_step", "open_s", "first_batch_s"}
#: What schema 2 added (issue 46): None where a run did not measure them.
NEW_SUMMARY_KEYS = {"startup", "stall_10ms_continuous", "stall_1p5x_unslowed", "compressed"}
#: The keys each later schema added, None where a run did not measure them.
ADDED_KEYS = {2: NEW_SUMMARY_KEYS, 3: {"stall_10ms_continuous_fresh"}, 4: {"mixture", "first_epoch"}}


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
    """One quick suite on two tiny datasets, cpu backend, no cold rows, no canaries, two fresh starts, the
    continuous step over 4 epochs, a 2 MiB compressed store and the mixture's 3 rounds: its results folder."""
    tmp = tmp_path_factory.mktemp("suite")
    bench("benchmarks.suite", "--quick", "--backends", "cpu", "--sizes-gib", "0.01,0.02", "--batch-size", "16",
          "--resident-bytes", "0", "--repeats", "2", "--stall-repeats", "2", "--no-cold", "--fresh-starts", "2",
          "--continuous-epochs", "4", "--canaries", "", "--compressed", "--compressed-mib", "2",
          "--mixture", "--warm-seconds", "0.1",
          "--data", str(tmp / "data"), "--out", str(tmp / "results"), "--shm", str(tmp / "shm"))
    return str(tmp / "results" / "cpu-only")


def test_suite_writes_one_shape(suite_run: str) -> None:
    with open(os.path.join(suite_run, "suite.json")) as f:
        doc = json.load(f)
    from benchmarks.report import SCHEMA

    assert doc["schema"] == SCHEMA == 4 and doc["mode"] == "quick" and doc["machine"]["gpu"] is None
    assert doc["settings"]["backends"] == ["cpu"] and doc["settings"]["page_cache_dropped"] is False
    assert doc["auto_backend"]["backend"] == "cpu"
    rows = doc["results"]
    assert {r["kind"] for r in rows} == {"ceiling", "gdsload", "startup", "contender", "step", "compressed"}
    # no cold rows without dropping the cache
    assert {r["regime"] for r in rows} == {"warm", "shm", "warm-fresh"}
    gds = [r for r in rows if r["kind"] == "gdsload"]
    assert {(r["dataset"], r["regime"], r["shuffle"]) for r in gds} == {
        ("0.01GiB-4MiB", "warm", False), ("0.01GiB-4MiB", "warm", True), ("0.01GiB-4MiB", "shm", False),
        ("0.02GiB-4MiB", "warm", False), ("0.02GiB-4MiB", "warm", True)}
    for r in gds:
        assert r["backend"] == "cpu" and r["io_mode"] == "cpu" and r["default"] is True
        assert r["gb_per_s"] > 0 and r["samples_per_s"] > 0 and r["cpu_core_s_per_gb"] > 0
        assert 0 <= r["stall_fraction"] <= 1 and r["open_s"] > 0 and r["backend_stats"]["num_threads"] == CPU_THREADS
    steps = [r for r in rows if r["kind"] == "step" and r.get("backend") == "cpu" and not r.get("continuous")]
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
    assert NEW_SUMMARY_KEYS <= set(summary) and summary["startup"]["cpu"]["open_s"] > 0
    assert 0 <= summary["stall_10ms_continuous"]["cpu"] < 1
    assert len(summary["compressed"]) == 3  # tokens, images, float16


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
    assert SUMMARY_KEYS <= set(kept)
    if kept["schema"] == fresh["schema"]:
        assert kept == fresh
    else:  # a summary of an earlier schema: the keys it has are the same, the keys added since not measured
        added = set().union(*(keys for schema, keys in ADDED_KEYS.items() if schema > kept["schema"]))
        assert kept["schema"] < fresh["schema"] and set(fresh) == set(kept) | added
        assert {k: fresh[k] for k in kept if k != "schema"} == {k: v for k, v in kept.items() if k != "schema"}
        assert fresh["compressed"] is None or "compressed" not in added
        assert all(v is None for k in added - {"compressed"} for v in fresh[k].values())


def test_report_refuses_another_shape(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "old.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "run.py", "results": []}, f)
    done = bench("benchmarks.report", path, check=False)
    assert done.returncode != 0 and "not a suite result of schema 1 or 2 or 3 or 4" in done.stderr


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


def test_images_benchmark_cpu(tmp_path: str) -> None:
    pytest.importorskip("PIL")
    out = str(tmp_path / "results")
    bench("benchmarks.images", "--tiny", "--images", "40", "--backends", "cpu", "--batch", "8", "--min-seconds", "0",
          "--data-dir", str(tmp_path / "data"), "--out", out)
    (path,) = glob.glob(os.path.join(out, "*", "images.json"))
    with open(path) as f:
        doc = json.load(f)
    assert doc["images"] == 40 and doc["jpeg_bytes"] > 40 * 10_000 and doc["summary"]["gdsload_cpu_warm"] > 0


def test_shuffle_quality(tmp_path: str) -> None:
    bench("benchmarks.shuffle_quality", "--samples", "4000", "--samples-per-block", "16", "--batch-size", "64",
          "--classes", "10", "--windows", "1,16", "--out", str(tmp_path))
    with open(os.path.join(tmp_path, "shuffle-quality.json")) as f:
        rows = {str(r["window_blocks"]): r for r in json.load(f)["results"]}
    assert set(rows) == {"1", "16", "full permutation", "no shuffle"}
    assert rows["no shuffle"]["rank_correlation"] == 1.0 and rows["full permutation"]["rank_correlation"] < 0.1
    assert rows["1"]["class_entropy_fraction"] < rows["16"]["class_entropy_fraction"]
    assert os.path.exists(os.path.join(tmp_path, "shuffle-quality.md"))


def test_summary_startup_is_the_warm_regime_with_cold_beside_it(suite_run: str) -> None:
    """The start-up targets are set for a warm dataset: a run with both regimes summarises the warm rows
    and keeps the cold ones under their own keys (a run with cold rows only summarised those as if warm)."""
    from benchmarks.report import load, summarize

    doc = load(os.path.join(suite_run, "suite.json"))
    warm = [r for r in doc["results"] if r["kind"] == "startup" and r["regime"] != "warm-fresh"]
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



def test_ab_sets_each_arm_against_the_first_as_with_the_pinned_readers() -> None:
    """benchmarks.ab --readers: one column per reader, each later one's median against the first's; a reader
    whose runs failed shows its error and no ratio."""
    from benchmarks.ab import table

    runs = {"native": [{"gbps": 40.0, "io_mode": "pinned"}, {"gbps": 42.0, "io_mode": "pinned"}],
            "threads": [{"gbps": 20.5, "io_mode": "pinned"}, {"gbps": 20.5, "io_mode": "pinned"}],
            "auto": [{"error": "BackendUnavailable: no GPU"}]}
    doc = {"trees": ["."], "arms": list(runs), "labels": [f"`.` reader={r}" for r in runs], "gib": 1.0,
           "batch": 256, "rows": [{"backend": "pinned", "mode": "warm", **runs}]}
    md = table(doc)
    assert md.startswith("native: `.` reader=native, threads: `.` reader=threads, auto: `.` reader=auto;")
    assert "| figure | native | threads | auto | threads / native | auto / native |" in md
    assert ("| pinned | pinned | warm | GB/s | 40.00 / 42.00 | 20.50 / 20.50 | error: BackendUnavailable: no GPU "
            "| 0.500 | – |") in md


# -- issue 46's summary keys: fresh-process start-up, the continuous 10 ms step, canaries, compressed ------------
def _suite(suite_run: str) -> tuple[dict, dict]:
    with open(os.path.join(suite_run, "suite.json")) as f, open(os.path.join(suite_run, "summary.json")) as g:
        return json.load(f), json.load(g)


def test_summary_startup_from_fresh_processes(suite_run: str) -> None:
    """Each figure is the median of the processes' own, every process a new interpreter (its own pid-less
    clock: the import of gdsload is timed, which an in-process row could not do)."""
    doc, summary = _suite(suite_run)
    assert NEW_SUMMARY_KEYS <= set(summary) and summary["schema"] == 4
    (row,) = [r for r in doc["results"]
              if r["kind"] == "startup" and r["regime"] == "warm-fresh" and r["dataset"] == summary["dataset"]]
    assert row["kind"] == "startup" and row["imports"] == "gdsload" and row["processes"] == len(row["runs"]) == 2
    for key in ("import_s", "open_s", "first_batch_s"):
        assert row[key] == round(float(np.median([r[key] for r in row["runs"]])), 6)
        assert summary["startup"]["cpu"][key] == row[key]
    assert all(r["import_s"] > 0 and r["open_s"] > 0 and r["first_batch_s"] > 0 and r["cuda_start_s"] == 0
               and r["io_mode"] == "cpu" for r in row["runs"])
    # the in-process startup rows are kept as they were, and still give open_s / first_batch_s
    warm = [r for r in doc["results"] if r["kind"] == "startup" and r["regime"] == "warm"
            and r["dataset"] == summary["dataset"]]
    assert summary["open_s"]["cpu"] == warm[0]["open_s"]


@pytest.mark.parametrize("fresh", [False, True])
def test_summary_stall_10ms_continuous(suite_run: str, fresh: bool) -> None:
    """Four epochs in one loop, in the suite's process and in a fresh one (the dataset opened there, as a
    training script opens it): the summary's figures are the epochs after the first as one stretch, and the
    dataset never started a second pipeline (set_epoch with the next epoch keeps what was read ahead)."""
    doc, summary = _suite(suite_run)
    (row,) = [r for r in doc["results"] if r.get("continuous") and bool(r.get("fresh_process")) == fresh]
    assert row["kind"] == "step" and row["step_ms"] == 10.0 and row["epochs"] == 4 and row["sync_every"] == 1
    assert row["regime"] == ("warm-fresh" if fresh else "warm") and row["backend"] == "cpu"
    assert row["pipeline_restarts"] == 0 and len(row["wait_fraction_runs"]) == 3
    key = "stall_10ms_continuous_fresh" if fresh else "stall_10ms_continuous"
    assert summary[key] == {"cpu": row["wait_fraction"]} and 0 <= row["wait_fraction"] < 1
    assert 0 <= row["first_pass_wait_fraction"] < 1 and 0 <= row["whole_run_wait_fraction"] < 1
    # 9 batches of 16 samples per epoch: three epochs of 10 ms steps take at least 0.27 s
    assert row["seconds"] >= 3 * 9 * 0.010 and row["samples_per_s"] > 0
    assert summary["stall_1p5x_unslowed"] == {"cpu": None}  # --canaries '': not measured, said so


def test_summary_compressed(suite_run: str) -> None:
    """A row per store (tokens, images, float16) and backend, each from three fresh processes: the median of
    their best epochs and its spread, the median run's epochs and their spread, the ceiling and its lanes."""
    doc, summary = _suite(suite_run)
    rows = {c["store"]: c for c in summary["compressed"]}
    assert set(rows) == {"tokens", "images", "float16"} and all(c["backend"] == "cpu" for c in rows.values())
    assert rows["tokens"]["ratio"] < rows["images"]["ratio"] < 1  # tokens compress most; images about 1.1x
    for c in rows.values():
        assert len(c["warm_epochs_gbps"]) == 8 and all(g > 0 for g in c["warm_epochs_gbps"])
        assert len(c["runs"]) == 3 and all(len(r["epochs"]) == 8 for r in c["runs"])
        best = sorted(max(r["epochs"]) for r in c["runs"])
        assert c["gb_per_s"] == round(best[1], 3) and [r["gb_per_s"] for r in c["runs"]] == [
            max(r["epochs"]) for r in c["runs"]]
        assert c["runs_spread"] == round((best[2] - best[0]) / best[1], 4)
        warm = c["warm_epochs_gbps"]
        assert c["epoch_spread"] == round((max(warm) - min(warm)) / max(warm), 4) and warm in [r["epochs"] for r in
                                                                                               c["runs"]]
        assert c["cold_gbps"] is None and c["raw_cold_gbps"] is None  # --no-cold
        assert c["decoder_ceiling_gbps"] is None and "no GPU" in c["decoder_ceiling_why"] and c["decoder_lanes"] >= 1
        assert c["first_batch_s"] > 0  # the first epoch's, from rest
        assert c["device_used_bytes_before"] is None  # no GPU
    with open(os.path.join(suite_run, "suite.md")) as f:
        md = f.read()
    assert "## Compressed" in md and "compressed (ratio " in md and "| warm-fresh | cpu | cpu |" in md
    assert re.search(r"GB/s \(the first from rest, its first batch after \d+\.\d ms\), slowest", md)
    assert re.search(r"the median of 3 fresh processes' best epochs \([\d.]+, [\d.]+, [\d.]+; spread \d+%\)", md)


def test_targets_of_the_new_rows(suite_run: str) -> None:
    """The targets come from the rows' own figures: moved across each line, the verdict follows."""
    from benchmarks.report import load, targets

    doc = load(os.path.join(suite_run, "suite.json"))
    for r in doc["results"]:
        if r.get("regime") == "warm-fresh":
            r.update(open_s=0.2, first_batch_s=0.02)
        if r.get("continuous"):
            r["wait_fraction"] = 0.001
        if r.get("kind") == "compressed":
            r.update(warm_epochs_gbps=[1.0, 0.95, 0.91], gb_per_s=1.0, decoder_ceiling_gbps=1.2, cold_gbps=1.0,
                     raw_cold_gbps=0.2)
    lines = targets(doc)
    fresh = [t for t in lines if "start in a fresh process" in t]
    assert len(fresh) == 1 and fresh[0].endswith("-> met")  # the main dataset's (the smaller is the shm one)
    cont = [t for t in lines if "one loop" in t]
    assert len(cont) == 2 and sum("in a fresh process" in t for t in cont) == 1  # the suite's process, a fresh one
    assert all("0.10% over the epochs after the first" in t and t.endswith("-> met") for t in cont)
    packed = [t for t in lines if "compressed" in t]
    assert [t.rsplit("-> ", 1)[-1] for t in packed] == ["met", "met", "met"] * 3  # 0.91 >= 0.9; 1.0 >= 0.8 x 1.2
    for r in doc["results"]:
        if r.get("regime") == "warm-fresh":
            r["first_batch_s"] = 0.03
        if r.get("continuous"):
            r["wait_fraction"] = 0.003
        if r.get("kind") == "compressed":
            r.update(warm_epochs_gbps=[1.0, 0.85], decoder_ceiling_gbps=1.5)
    lines = targets(doc)
    assert all(t.endswith("MISSED") for t in lines if "fresh process" in t or "one loop" in t)
    assert [t.rsplit("-> ", 1)[-1] for t in lines if "compressed" in t] == ["MISSED", "MISSED", "met"] * 3


def test_kvikio_is_held_to_sixty_percent_of_the_decoders_ceiling() -> None:
    """The issue's decision: kvikio (compat mode) at >= 60 % of the ceiling, mmap and pinned at >= 80 %; judged
    on the median of the fresh-process runs, not the best epoch of one."""
    from benchmarks.report import _compressed

    row = {"dataset": "tokens", "ratio": 0.3, "warm_epochs_gbps": [7.0, 6.5], "decoder_ceiling_gbps": 10.0,
           "gb_per_s": 6.5, "runs_spread": 0.08, "runs": [{"gb_per_s": g} for g in (6.0, 6.5, 7.0)]}
    assert _compressed({**row, "backend": "kvikio"})[1].endswith("= 65% (target >= 60%) -> met")
    line = _compressed({**row, "backend": "pinned"})[1]
    assert "the median of 3 fresh processes' best epochs (6.0, 6.5, 7.0; spread 8%)" in line
    assert line.endswith("= 65% (target >= 80%) -> MISSED")


def test_the_cold_compressed_target_is_capped_by_the_decoders_ceiling() -> None:
    from benchmarks.report import _compressed

    row = {"dataset": "tokens", "backend": "pinned", "ratio": 0.25, "warm_epochs_gbps": [1.9, 2.0],
           "decoder_ceiling_gbps": 2.0, "raw_cold_gbps": 1.0}
    # 0.8 x raw / ratio = 3.2 GB/s, more than the decoder gives: the target is 0.8 x its 2.0 instead
    assert _compressed({**row, "cold_gbps": 1.7})[2].endswith("= 1.60 -> met")
    assert _compressed({**row, "cold_gbps": 1.5})[2].endswith("= 1.60 -> MISSED")
    uncapped = _compressed({**row, "decoder_ceiling_gbps": 10.0, "cold_gbps": 3.0})[2]
    assert "capped" not in uncapped and uncapped.endswith("= 3.20 -> MISSED")


def test_summary_mixture_and_first_epoch(suite_run: str) -> None:
    """``--mixture``: benchmarks.mixture's figures in the suite's summary, from 3 rounds of fresh processes on the
    main dataset: the mixture's rate as a share of one dataset's with its spread, and a fresh open's first epoch
    per backend (``auto`` among them) with ``pinned``'s beside it (None: no GPU here)."""
    doc, summary = _suite(suite_run)
    assert doc["settings"]["mixture_rounds"] == 3 and "mixture" in doc["stage_seconds"] and not doc.get("notes")
    (mix,) = summary["mixture"].values()
    assert list(summary["mixture"]) == ["cpu"] and mix["io_mode"] == "cpu" and mix["runs"] == 3
    assert mix["best_single"] > 0 and mix["best_mixture"] > 0 and mix["mixture_of_single_pct"] > 0
    low, high = mix["spread_pct"]
    assert 0 < low <= high  # each run's share of its own round's single dataset
    assert mix["waiting_pct_single"] >= 0 and mix["waiting_pct_mixture"] >= 0
    assert summary["mixture"] == doc["mixture"] and summary["first_epoch"] == doc["first_epoch"]
    assert set(summary["first_epoch"]) == {"auto", "cpu"}  # pinned needs a GPU
    for backend, first in summary["first_epoch"].items():
        assert first["chose"] == "cpu" and first["io_mode"] == "cpu" and first["pinned_gbps"] is None
        assert len(first["runs"]) == 3 and all(g > 0 for g in first["runs"]) and first["epoch2_gbps"] > 0
        assert first["gbps"] == round(float(np.median(first["runs"])), 2) and first["open_s"] > 0
        assert first["spread"] == [round(min(first["runs"]), 3), round(max(first["runs"]), 3)]
    with open(os.path.join(suite_run, "suite.md")) as f:
        md = f.read()
    assert "`mixture` (benchmarks.mixture" in md and "`first_epoch` (benchmarks.mixture" in md
    assert f"| cpu | {mix['mixture_of_single_pct']} | {mix['spread_pct']} | 3 | {mix['best_single']} |" in md
