"""Command line: shard.py as a user runs it, gdsload info and demo."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from gdsload import GDSDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def run(*args: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_shard_script_and_info(tmp_path):
    np.save(tmp_path / "image.npy", np.zeros((300, 8, 8, 3), np.uint8))
    np.save(tmp_path / "label.npy", np.arange(300))
    out = tmp_path / "d.gds"
    res = run("scripts/shard.py", str(tmp_path / "image.npy"), str(tmp_path / "label.npy"), "-o", str(out),
              "--block-bytes", "12KiB", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "samples: 300" in res.stdout
    res = run("-m", "gdsload.cli", "info", str(out))
    assert res.returncode == 0, res.stderr
    assert "image: dtype |u1 (uint8), sample shape (8, 8, 3), block 12.0 KiB" in res.stdout
    assert "label: dtype <i8 (int64), sample shape ()" in res.stdout and "shards: 2" in res.stdout


def test_shard_script_bad_input_exit_code(tmp_path):
    res = run("scripts/shard.py", str(tmp_path / "nope.npy"), "-o", str(tmp_path / "d.gds"))
    assert res.returncode == 2
    assert res.stderr.strip() == f"shard.py: error: {tmp_path}/nope.npy: input does not exist"
    res = run("scripts/shard.py", "x.npy", "-o", "d.gds", "--block-bytes", "lots")
    assert res.returncode == 2 and "not a size: 'lots'" in res.stderr


def test_info_on_bad_dataset(tmp_path):
    res = run("-m", "gdsload.cli", "info", str(tmp_path))
    assert res.returncode == 2 and "gdsload: error:" in res.stderr and "not a Zarr v3 group" in res.stderr


def test_system_info_and_demo(tmp_path):
    res = run("-m", "gdsload.cli", "info")
    assert res.returncode == 0, res.stderr
    assert "GPU:" in res.stdout and "backend auto ->" in res.stdout
    res = run("-m", "gdsload.cli", "demo", "--samples", "3000", "--workdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "epoch 1: 3000 samples" in res.stdout and "every batch checked against its labels" in res.stdout
    assert os.listdir(tmp_path) == []


def test_system_info_names_this_ranks_share_of_the_cores():
    """Under torchrun with two ranks per machine, the readers' default counts on this rank's share of the
    cores: gdsload info says so, and says nothing of ranks for a process alone."""
    from gdsload.env import LOCAL_RANKS_ENV, rank_cores

    alone = {k: v for k, v in ENV.items() if k not in LOCAL_RANKS_ENV}
    for env, want in ((alone, None), ({**alone, "LOCAL_WORLD_SIZE": "2"}, rank_cores(ranks=2))):
        res = run("-m", "gdsload.cli", "info", env=env)
        assert res.returncode == 0, res.stderr
        if want is None:
            assert "ranks on this machine" not in res.stdout
        else:
            assert f"(readers count on {want}: one of 2 ranks on this machine)" in res.stdout


def test_few_cuda_queues_are_warned_once(monkeypatch, make_dataset):
    """CUDA_DEVICE_MAX_CONNECTIONS below 4 puts the loader's streams in the training step's hardware queue:
    the note names it, the warning comes once per process, and other values (or none, or what CUDA would not
    read as a count) say nothing; the cpu backend queues nothing on a GPU and opens without a warning.
    (A GPU dataset's open and gdsload info: test_gpu.py.)"""
    import warnings

    from gdsload import env

    for value, said in (("1", True), ("3", True), ("4", False), ("8", False), ("lots", False), (None, False)):
        environ = {} if value is None else {env.CONNECTIONS_ENV: value}
        note = env.connections_note(environ)
        assert (note is not None) is said, value
        if said:
            assert note.startswith(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: CUDA gives this process {value} hardware")
    monkeypatch.setattr(env, "_connections_warned", type(env._connections_warned)())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert env.warn_few_connections({env.CONNECTIONS_ENV: "8"}) is False
        assert env.warn_few_connections({env.CONNECTIONS_ENV: "1"}) is True
        assert env.warn_few_connections({env.CONNECTIONS_ENV: "1"}) is False  # once per process
    assert [str(w.message) for w in caught] == [f"{env.connections_note({env.CONNECTIONS_ENV: '1'})}; "
                                                f"{env.CONNECTIONS_FIX}"]
    assert caught[0].category is RuntimeWarning
    monkeypatch.setattr(env, "_connections_warned", type(env._connections_warned)())
    monkeypatch.setenv(env.CONNECTIONS_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GDSDataset(make_dataset({"x": np.arange(100)}), batch_size=10, backend="cpu").close()
    assert not env._connections_warned.is_set()
