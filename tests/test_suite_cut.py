"""The suite within a time limit: a run killed by its limit (SIGTERM) or stopped with Ctrl-C keeps and renders
what it measured, saying where it was cut; contenders' passes end after ``--contender-seconds``."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import report
from benchmarks.common import make_dataset
from benchmarks.contenders import naive_run, torch_run, zarr_run
from gdsload.tools.measure import shard_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = os.path.join(ROOT, "benchmarks", "results", "H200", "suite.json")


def test_a_suite_killed_by_its_time_limit_writes_what_it_measured(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "results")
    run = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.suite", "--quick", "--backends", "cpu", "--sizes-gib", "0.01,0.02",
         "--batch-size", "16", "--repeats", "2", "--stall-repeats", "2", "--no-cold", "--fresh-starts", "8",
         "--canaries", "", "--data", os.path.join(tmp_path, "data"), "--out", out,
         "--shm", os.path.join(tmp_path, "shm")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    path = os.path.join(out, "cpu-only", "suite.json")
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the first stage saved: the run is under way, with most of it still to come
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
    with open(path) as f:
        doc = json.load(f)
    cut = doc["cut_short"]
    assert cut["signal"] == "SIGTERM" and cut["after_s"] >= 0 and "cut short by SIGTERM" in err
    # cut inside a stage (its seconds up to the cut kept), or between two ("after <stage>")
    assert cut["stage"] in doc["stage_seconds"] or cut["stage"][len("after "):] in doc["stage_seconds"]
    assert all(v >= 0 for v in doc["stage_seconds"].values())
    assert doc["results"], "what was measured before the cut is kept"
    with open(os.path.join(out, "cpu-only", "suite.md")) as f:
        md = f.read()
    assert "**Cut short** by SIGTERM" in md and "Seconds per stage: " in md
    with open(os.path.join(out, "cpu-only", "summary.json")) as f:
        assert json.load(f)["cut_short"] == cut
    assert not [p for p in os.listdir(os.path.join(out, "cpu-only")) if p.endswith(".tmp")]


@pytest.mark.parametrize("keep", [0.0, 0.25, 0.5, 0.75, 0.9])
def test_a_run_cut_after_any_row_renders(keep: float) -> None:
    """The kept GPU run cut after a share of its rows: the report and summary say so and use what is there."""
    with open(KEPT) as f:
        doc = json.load(f)
    rows = doc["results"]
    cut = copy.deepcopy(doc)
    cut["results"] = rows[:int(keep * len(rows))]
    cut["cut_short"] = {"signal": "SIGTERM", "stage": "8GiB-4MiB steps", "after_s": 585}
    md = report.markdown(cut)
    assert "**Cut short** by SIGTERM after 585 s (8GiB-4MiB steps)" in md
    summary = report.summarize(cut)
    assert summary["cut_short"] == cut["cut_short"] and "cut_short" not in report.summarize(doc)
    assert summary["compressed"] is None  # the last stage: never there in a cut run


def test_contenders_read_for_max_s_seconds_at_least_one_piece(tmp_path: str) -> None:
    from benchmarks.common import SAMPLE_BYTES, labels, random_images
    from gdsload import write_dataset

    path, n = os.path.join(tmp_path, "small-shards.gds"), 64
    write_dataset(path, {"image": random_images(n), "label": labels(n)}, block_bytes=2 * SAMPLE_BYTES,
                  shard_bytes=8 * SAMPLE_BYTES, progress=False)
    paths = shard_paths(path)
    assert len(paths) > 4
    first, whole = naive_run(paths, False, max_s=0.0)(), naive_run(paths, False)()
    assert first.bytes == os.path.getsize(paths[0]) and whole.bytes == sum(map(os.path.getsize, paths))
    one, every = zarr_run(path, False, max_s=0.0)(), zarr_run(path, False)()
    assert 0 < one.bytes < every.bytes and one.samples < every.samples


def test_a_torch_pass_with_a_step_runs_whole(tmp_path: str) -> None:
    pytest.importorskip("torch")
    from gdsload.tools.steps import make_step

    path = make_dataset(str(tmp_path), 0.01)
    blocks = torch_run(path, 0, False, max_s=0.0)()
    assert blocks.samples > 0 and blocks.bytes > 0
    assert blocks.samples < torch_run(path, 0, False)().samples
    with pytest.raises(ValueError, match="runs whole"):
        torch_run(path, 0, False, step=make_step(1.0, 1, False), max_s=1.0)
