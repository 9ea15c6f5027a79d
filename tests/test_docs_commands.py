"""Every command and program the docs show runs as shown: each ``sh`` block's commands and each ``python`` block
of README.md and docs/*.md, in the order a reader meets them (README's quick start writes the data.gds the others
use), in one scratch folder, on this machine (no GPU needed). What is not run is listed below with the reason --
GPU-only, an install, too slow -- and each entry must still be in the docs, so the lists cannot rot."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                             if f.endswith(".md"))]

#: Commands that need a GPU (run them on the GPU machine).
GPU_ONLY = {
    "python -m benchmarks.suite --quick": "the benchmark suite times GPU backends",
    "gdsload bench data.gds --backends pinned,mmap --cold --seconds 5 --json bench.json": "pinned and mmap are GPU "
                                                                                         "backends",
    "python -m benchmarks.check_ranks --elastic 8,4 --cut 20 --data /tmp/ranks --out results/": "ranks on 8 GPUs",
}
#: Commands not run here, and why.
NOT_RUN = {
    "python3 -m pip install .": "installs the package (CI's set-up installs it with the test extra)",
    'python3 -m pip install ".[test]"': "CI's own set-up (.ci/run runs exactly this line)",
    "python3 -m pytest -q": "the test suite itself (.ci/run)",
    "python -m benchmarks.shuffle_quality": "rewrites the committed benchmarks/results/shuffle-quality.*; "
                                            "docs/shuffling.md's command, with --out, runs",
    "python -m benchmarks.check_ranks --elastic 3,2,4 --cut 5 --backend cpu --data /tmp/ranks --out results/":
        "30,011 samples over 9 rank processes take half a minute; tests/test_resume.py runs it on a tiny dataset",
    "gdsload shard --images train/ -o train.gds": "needs an image tree: tests/test_image_convert.py converts each "
                                                  "input kind through the command line and Python",
    "gdsload shard --images train.txt -o train.gds": "needs a list file of images: tests/test_image_convert.py",
    "gdsload shard --images shards/*.tar -o train.gds": "needs WebDataset tars: tests/test_image_convert.py",
}
#: Python blocks not run (keyed by their first line), and why.
PYTHON_NOT_RUN = {
    'ds = GDSDataset("s3://bucket/datasets/train.gds", batch_size=256, cache_dir="/nvme/gdsload-cache")':
        "needs a bucket: tests/test_remote_dataset.py reads the same way from a local S3 server (moto)",
    "state = ds.state_dict()       # a small dict of ints, bools and strings: json.dump or torch.save it":
        "a fragment: ds is a GDSDataset opened as above",
    "from gdsload import GDSDataset, ImageSpec": "reads the train.gds of the image commands above, not run here: "
                                                "tests/test_image_decode.py reads image datasets the same way",
    "import json, os": "GPU-only: NCCL under torchrun; train_step, global_batch, epochs and save_atomically stand "
                       "for the user's own",
}
FENCE = re.compile(r"^( *)```(\w*)\s*$")


def blocks(doc: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of ``doc``, indented ones (in list items) included."""
    out, lang, lines, indent = [], None, [], 0
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        for line in f:
            m = FENCE.match(line.rstrip("\n"))
            if m and lang is None:
                lang, indent, lines = m.group(2), len(m.group(1)), []
            elif m and len(m.group(1)) == indent and not m.group(2):
                out.append((lang, "".join(lines)))
                lang = None
            elif lang is not None:
                lines.append(line[indent:] if line[:indent].strip() == "" else line)
    return out


def commands(text: str) -> list[str]:
    """The commands of an sh block: one per line, comments dropped, ``a && b`` as two."""
    out = []
    for line in text.splitlines():
        line = line.split("  #")[0].split(" # ")[0].strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split(" && ")]
    return out


def everything() -> list[tuple[str, str, str]]:
    """(doc, kind, command or program) in reading order."""
    out = []
    for doc in DOCS:
        for lang, text in blocks(doc):
            if lang in ("sh", "bash", "shell"):
                out += [(doc, "sh", c) for c in commands(text)]
            elif lang == "python":
                out.append((doc, "python", text))
            else:
                said = [line for line in text.splitlines() if re.match(r"\s*(gdsload|python3?|torchrun) ", line)]
                assert not said, f"{doc}: commands in a block that is not marked sh: {said}"
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A folder holding the checkout's benchmarks, examples and scripts (as a reader's clone does), and a
    PATH on which python, python3 and gdsload are this interpreter's."""
    here = tmp_path_factory.mktemp("docs")
    for name in ("benchmarks", "examples", "scripts"):
        os.symlink(os.path.join(ROOT, name), here / name)
    bin_dir = here / ".bin"
    bin_dir.mkdir()
    # Scripts that exec this interpreter by its own path, not links to it: a venv's python finds its
    # environment (pyvenv.cfg) beside the path it was started by, so a link elsewhere would lose the venv.
    for name, args in (("python", ""), ("python3", ""), ("gdsload", " -m gdsload")):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)}{args} \"$@\"\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return str(here), env


def test_the_docs_commands_run_in_this_environment(scratch):
    """In a venv, a link to its python started Python outside the venv (it looks for pyvenv.cfg beside the
    path it was started by), where the package's dependencies were missing: each tool on the PATH must be
    this environment's."""
    here, env = scratch
    for tool in ("python", "python3"):
        done = subprocess.run([tool, "-c", "import sys; print(sys.prefix)"], cwd=here, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.strip() == sys.prefix, (tool, done.stdout, done.stderr)
    done = subprocess.run(["gdsload", "--help"], cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_listed_exception_is_still_in_the_docs():
    shown = {c for _, kind, c in everything() if kind == "sh"}
    firsts = {text.splitlines()[0] for _, kind, text in everything() if kind == "python"}
    assert set(GPU_ONLY) <= shown and set(NOT_RUN) <= shown, (set(GPU_ONLY) | set(NOT_RUN)) - shown
    assert set(PYTHON_NOT_RUN) <= firsts, set(PYTHON_NOT_RUN) - firsts
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert 'python3 -m pip install ".[test]" && python3 -m pytest -q\n' in ci.splitlines(True)
    assert "python3 -m venv" in ci and "/bin/activate" in ci, "CI runs the tests in a venv, as most users do"


def test_every_command_and_program_in_the_docs_runs_as_shown(scratch):
    """Run in order; the first failure names the doc and the command. Python blocks that use torch and
    Lightning need them (the test extra installs both): without them the rest runs, then the test skips,
    naming the blocks."""
    here, env = scratch
    ran, missing = [], []
    for doc, kind, what in everything():
        if kind == "sh":
            if what in GPU_ONLY or what in NOT_RUN:
                continue
            done = subprocess.run(["bash", "-c", what], cwd=here, env=env, capture_output=True, text=True,
                                  timeout=300)
        else:
            if what.splitlines()[0] in PYTHON_NOT_RUN:
                continue
            needs = [m for m in re.findall(r"^(?:import|from) (torch|lightning)\b", what, re.M)
                     if importlib.util.find_spec(m) is None]
            if needs:
                missing.append(f"{doc}: a python block needs {needs}")
                continue
            done = subprocess.run([sys.executable, "-c", what], cwd=here, env=env, capture_output=True, text=True,
                                  timeout=300)
        assert done.returncode == 0, f"{doc}: {what}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran.append((doc, what))
    docs_run = {doc for doc, _ in ran}
    assert {"README.md", "docs/gds.md", "docs/shuffling.md", "docs/benchmarks.md", "docs/multi-gpu.md"} <= docs_run
    assert ("README.md", "gdsload info data.gds") in ran and ("README.md", "python3 -m gdsload demo") in ran
    if missing:  # everything else ran; these need the test extra (which CI installs)
        pytest.skip(f"not run, a package missing (pip install '.[test]'): {missing}")


def test_the_readme_programs_that_write_datasets_run_again(scratch):
    """A user runs a snippet twice: one that writes a dataset must not fail on the second run (the Mixing
    snippet did: "output exists"). Runs after the test above, in the folder it filled."""
    here, env = scratch
    writers = [what for doc, kind, what in everything()
               if doc == "README.md" and kind == "python" and "write_dataset(" in what
               and what.splitlines()[0] not in PYTHON_NOT_RUN]
    assert writers
    for what in writers:
        if not os.path.exists(os.path.join(here, "data.gds")):
            pytest.skip("runs after the test of every command, which makes data.gds")
        done = subprocess.run([sys.executable, "-c", what], cwd=here, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"README.md, a second run: {what}\n{done.stderr[-3000:]}"


def test_the_shuffle_quality_script_also_runs_as_a_file(tmp_path):
    """docs/shuffling.md showed ``python benchmarks/shuffle_quality.py ...``, which failed on a relative import."""
    done = subprocess.run([sys.executable, os.path.join("benchmarks", "shuffle_quality.py"), "--samples", "2000",
                           "--samples-per-block", "16", "--batch-size", "64", "--classes", "10", "--windows", "1,4",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path))[:2] == ["shuffle-quality.json", "shuffle-quality.md"]
