"""Conversion spread over N processes (``gdsload shard --part I/N``, then ``--publish-parts``): real processes
write the parts, and the published dataset is compared file by file, byte for byte, with a single-process
``gdsload shard`` of the same inputs and options. Then the refusals: a missing part, a part of other inputs
or options, a part run twice, an output that exists."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import crc32c
import numpy as np
import pytest

from _helpers import files_below
from gdsload import GDSDataset
from gdsload.conversion.parts import parse_part
from gdsload.conversion.spans import crc32c_combine
from gdsload.tools.cli import shard_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 600
RAW = ["--block-bytes", "4KiB", "--shard-bytes", "16KiB"]
ZSTD = ["--compress", "zstd:3", "--chunk-bytes", "4KiB", "--shard-bytes", "16KiB"]


def make_inputs(d, seed: int = 0) -> list[str]:
    """Images in a directory of two .npy files, labels in a compressed .npz, tokens of variable length (some
    none) in a directory of per-sample .npy files: the arguments of ``gdsload shard`` for them."""
    rng = np.random.default_rng(seed)
    os.makedirs(d / "img", exist_ok=True)
    images = rng.integers(0, 255, (N, 8, 8, 3), dtype=np.uint8)
    np.save(d / "img" / "0.npy", images[:250])
    np.save(d / "img" / "1.npy", images[250:])
    np.savez_compressed(d / "meta.npz", label=np.arange(N) % 10, score=rng.random(N).astype(np.float32))
    os.makedirs(d / "tok", exist_ok=True)
    for i in range(N):
        np.save(d / "tok" / f"{i}.npy", rng.integers(0, 1000, int(rng.integers(0, 40)), dtype=np.int32))
    return [str(d / "img"), str(d / "meta.npz"), "--ragged", f"tok={d / 'tok'}"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


def gds(*args: str) -> subprocess.Popen:
    """``python -m gdsload shard ARGS --quiet``, started (a real process)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "gdsload", "shard", *args, "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def shard(*args: str) -> tuple[int, str, str]:
    return finish(gds(*args))


def assert_same_files(got, want) -> None:
    a, b = files_below(got), files_below(want)
    assert sorted(a) == sorted(b), f"other files: {sorted(set(a) ^ set(b))}"
    differ = [k for k in b if a[k] != b[k]]
    assert not differ, f"files that differ: {differ}"


def run(argv: list[str], capsys) -> tuple[int, str]:
    """``gdsload shard`` in this process (for refusals): exit status and stderr."""
    code = shard_main([*argv, "--quiet"], prog="gdsload shard")
    return code, capsys.readouterr().err


def three_parts(inputs: list[str], out, options: list[str], extra: tuple[str, ...] = ()) -> None:
    """Parts 0, 1 and 2 of 3, in three processes running at once."""
    procs = [gds(*inputs, "-o", str(out), *options, "--part", f"{i}/3", *extra) for i in range(3)]
    for i, p in enumerate(procs):
        code, _, err = finish(p)
        assert code == 0, f"part {i}: {err}"


@pytest.mark.parametrize("options", [RAW, ZSTD], ids=["raw", "zstd"])
def test_three_processes_publish_the_bytes_of_one_conversion(inputs, tmp_path, options):
    out, one = tmp_path / "many.gds", tmp_path / "one.gds"
    three_parts(inputs, out, options)
    parts = tmp_path / "many.gds.parts"
    written = {i: [k for k in files_below(parts / f"part-{i}-of-3" / "data") if "/c/" in k] for i in range(3)}
    assert all(written.values()), f"every part writes shards of its own: {written}"
    assert not set(written[0]) & set(written[1]) and not set(written[1]) & set(written[2])
    code, stdout, err = shard("--publish-parts", "-o", str(out))
    assert code == 0, err
    assert f"dataset: {out}" in stdout and "samples: 600" in stdout
    assert not parts.exists(), "the parts are removed once published"
    code, _, err = shard(*inputs, "-o", str(one), *options)
    assert code == 0, err
    assert_same_files(out, one)
    assert len([k for k in files_below(one) if k.startswith("img/c/")]) > 3, "several shards per field"
    with GDSDataset(str(out), batch_size=64, backend="cpu", verify=True) as ds:  # every block's checksum holds
        assert sum(len(b["label"]) for b in ds) == N


def test_a_variable_length_block_straddles_shards_written_by_two_processes(inputs, tmp_path):
    """The tokens' blocks (samples_per_block samples) do not follow the values' shards: the crc32c of a block
    cut between two parts is joined from the two spans, and equals the one-process value."""
    out, one = tmp_path / "many.gds", tmp_path / "one.gds"
    three_parts(inputs, out, RAW)
    assert shard("--publish-parts", "-o", str(out))[0] == 0
    assert shard(*inputs, "-o", str(one), *RAW)[0] == 0
    import zarr

    group = zarr.open_group(str(one), mode="r")
    spb = group.attrs["gdsload"]["samples_per_block"]
    offsets = group["tok/offsets"][:]
    shard_rows = group["tok/values"].shards[0]
    starts, ends = offsets[0:-1:spb], offsets[np.minimum(np.arange(spb, N + spb, spb), N)]
    assert ((starts // shard_rows) < ((ends - 1) // shard_rows)).any(), "some block straddles two shards"
    assert_same_files(out, one)


def test_crc32c_combine_joins_pieces():
    r = random.Random(1)
    for _ in range(100):
        a, b = r.randbytes(r.randrange(0, 5000)), r.randbytes(r.randrange(0, 5000))
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_part_auto_from_slurm_and_torchrun():
    assert parse_part("2/5") == (2, 5)
    slurm = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "2"}
    assert parse_part("auto", slurm) == (2, 3)
    assert parse_part("auto", {"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    for text, env, said in (("3/3", {}, "0 <= I < N"), ("1of3", {}, "I/N"), ("auto", {}, "SLURM_ARRAY_TASK_ID"),
                            ("auto", {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'")):
        with pytest.raises(ValueError, match=said):
            parse_part(text, env)


def test_publish_refuses_a_missing_part(inputs, tmp_path, capsys):
    out = tmp_path / "d.gds"
    for i in (0, 2):
        assert run([*inputs, "-o", str(out), *RAW, "--part", f"{i}/3"], capsys)[0] == 0
    code, err = run(["--publish-parts", "-o", str(out)], capsys)
    assert code == 2 and f"{out}.parts/part-1-of-3: part 1/3 is missing" in err
    assert not out.exists() and (tmp_path / "d.gds.parts" / "part-0-of-3").is_dir(), "parts kept, nothing published"
    code, err = run(["--publish-parts", "-o", str(tmp_path / "none.gds")], capsys)
    assert code == 2 and "none.gds.parts: no parts to publish" in err


@pytest.mark.parametrize("odd,said", [
    (["--shard-bytes", "8KiB"], "chunks_per_shard is 2 (expected 4)"),
    (["--block-bytes", "8KiB"], "samples_per_block is 42 (expected 21)"),
    ("other inputs", "inputs"),
])
def test_publish_refuses_a_part_of_other_inputs_or_options(inputs, tmp_path, capsys, odd, said):
    out = tmp_path / "d.gds"
    for i in (0, 1):
        assert run([*inputs, "-o", str(out), *RAW, "--part", f"{i}/3"], capsys)[0] == 0
    if odd == "other inputs":  # the same shapes, from other files
        argv = [*make_inputs(tmp_path / "other", seed=1), *RAW]
    else:
        argv = [*inputs, *RAW, *odd]
    assert run([*argv, "-o", str(out), "--part", "2/3"], capsys)[0] == 0
    code, err = run(["--publish-parts", "-o", str(out)], capsys)
    assert code == 2 and "part-2-of-3: part 2/3 is of another conversion than the other parts" in err, err
    assert said in err and not out.exists()
    if odd == "other inputs":
        assert str(tmp_path / "other") in err, "the message names the other input"
    code, err = run([*inputs, *RAW, "--publish-parts", "-o", str(out)], capsys)  # inputs given: checked too
    assert code == 2 and "than the inputs and options given" in err and "part 2/3" in err


def test_a_part_run_twice_is_refused_and_overwrite_writes_it_again(inputs, tmp_path, capsys):
    out, one = tmp_path / "d.gds", tmp_path / "one.gds"
    for i in range(3):
        assert run([*inputs, "-o", str(out), *RAW, "--part", f"{i}/3"], capsys)[0] == 0
    record = (tmp_path / "d.gds.parts" / "part-1-of-3" / "part.json").read_bytes()
    code, err = run([*inputs, "-o", str(out), *RAW, "--part", "1/3"], capsys)
    assert code == 2 and "part-1-of-3: part 1/3 is already written" in err
    assert (tmp_path / "d.gds.parts" / "part-1-of-3" / "part.json").read_bytes() == record, "left as it was"
    assert run([*inputs, "-o", str(out), *RAW, "--part", "1/3", "--overwrite"], capsys)[0] == 0
    assert not [n for n in os.listdir(tmp_path / "d.gds.parts") if n.startswith(".")], "nothing half-written"
    assert run([*inputs, *RAW, "--publish-parts", "-o", str(out)], capsys)[0] == 0
    assert run([*inputs, "-o", str(one), *RAW], capsys)[0] == 0
    assert_same_files(out, one)


def test_publish_into_an_existing_output_needs_overwrite(inputs, tmp_path, capsys):
    out, one = tmp_path / "d.gds", tmp_path / "one.gds"
    assert run([*inputs, "-o", str(out), "--samples-per-block", "50"], capsys)[0] == 0  # another dataset there
    old = files_below(out)
    code, err = run([*inputs, "-o", str(out), *RAW, "--part", "0/2"], capsys)
    assert code == 2 and "output exists (pass --overwrite to replace it)" in err, "refused before converting"
    for i in range(2):
        assert run([*inputs, "-o", str(out), *RAW, "--part", f"{i}/2", "--overwrite"], capsys)[0] == 0
    code, err = run(["--publish-parts", "-o", str(out)], capsys)
    assert code == 2 and "output exists (pass --overwrite to replace it)" in err
    assert files_below(out) == old and (tmp_path / "d.gds.parts").is_dir()
    assert run(["--publish-parts", "-o", str(out), "--overwrite"], capsys)[0] == 0
    assert run([*inputs, "-o", str(one), *RAW], capsys)[0] == 0
    assert_same_files(out, one)
    assert sorted(os.listdir(tmp_path)) == ["d.gds", "one.gds"], "no parts, temporary or old folder left"


def test_parts_of_two_conversions_and_bad_input_are_named(inputs, tmp_path, capsys):
    out = tmp_path / "d.gds"
    assert run([*inputs, "-o", str(out), *RAW, "--part", "0/2"], capsys)[0] == 0
    assert run([*inputs, "-o", str(out), *RAW, "--part", "1/3"], capsys)[0] == 0
    code, err = run(["--publish-parts", "-o", str(out)], capsys)
    assert code == 2 and "holds parts of conversions in 2 and 3 parts" in err
    bad = tmp_path / "bad.npy"
    bad.write_bytes(np.lib.format.magic(1, 0) + b"garbage")
    code, err = run([str(bad), "-o", str(tmp_path / "b.gds"), "--part", "0/2"], capsys)
    assert code == 2 and f"{bad}: not a valid .npy array" in err
    code, err = run([*inputs, "-o", str(out), "--part", "2/2"], capsys)
    assert code == 2 and "--part 2/2: expected 0 <= I < N" in err
    code, err = run([*inputs, "-o", str(out), "--part", "0/2", "--publish-parts"], capsys)
    assert code == 2 and "give one" in err
