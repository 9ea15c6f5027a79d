"""Command line: shard.py as a user runs it, gdsload info and demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gdsload import GDSDataset

from remote_servers import upload

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
    res = run("-m", "gdsload.tools.cli", "info", str(out))
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
    res = run("-m", "gdsload.tools.cli", "info", str(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith(f"gdsload info: error: {tmp_path}/zarr.json: missing")
    assert "not a Zarr v3 group" in res.stderr and res.stderr.count("\n") == 1


def test_system_info_and_demo(tmp_path):
    res = run("-m", "gdsload.tools.cli", "info")
    assert res.returncode == 0, res.stderr
    assert "GPU:" in res.stdout and "backend auto ->" in res.stdout
    res = run("-m", "gdsload.tools.cli", "demo", "--samples", "3000", "--workdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "epoch 1: 3000 samples" in res.stdout and "every batch checked against its labels" in res.stdout
    assert os.listdir(tmp_path) == []


def test_system_info_names_this_ranks_share_of_the_cores():
    """Under torchrun with two ranks per machine, the readers' default counts on this rank's share of the
    cores: gdsload info says so, and says nothing of ranks for a process alone."""
    from gdsload.system.env import LOCAL_RANKS_ENV, rank_cores

    alone = {k: v for k, v in ENV.items() if k not in LOCAL_RANKS_ENV}
    for env, want in ((alone, None), ({**alone, "LOCAL_WORLD_SIZE": "2"}, rank_cores(ranks=2))):
        res = run("-m", "gdsload.tools.cli", "info", env=env)
        assert res.returncode == 0, res.stderr
        if want is None:
            assert "ranks on this machine" not in res.stdout
        else:
            assert f"(readers count on {want}: one of 2 ranks on this machine)" in res.stdout


def test_few_cuda_queues_are_warned_once(make_dataset):
    """CUDA_DEVICE_MAX_CONNECTIONS below 4 puts the loader's streams in the training step's hardware queue:
    the note names it, the warning comes once per process, and other values (or none, or what CUDA would not
    read as a count) say nothing; the cpu backend queues nothing on a GPU and opens without a warning.
    (A GPU dataset's open and gdsload info: test_gpu.py.)"""
    import json

    from gdsload.system import env

    for value, said in (("1", True), ("3", True), ("4", False), ("8", False), ("lots", False), (None, False)):
        environ = {} if value is None else {env.CONNECTIONS_ENV: value}
        note = env.connections_note(environ)
        assert (note is not None) is said, value
        if said:
            assert note.startswith(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: CUDA gives this process {value} hardware")
    # Once per process: each check in a fresh one (the cpu dataset's open with the variable set warns of nothing,
    # and leaves the warning to the first GPU dataset).
    script = f"""
import json, warnings
import numpy as np
from gdsload import GDSDataset
from gdsload.system import env
with warnings.catch_warnings():
    warnings.simplefilter("error")
    GDSDataset({make_dataset({"x": np.arange(100)})!r}, batch_size=10, backend="cpu").close()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    said = [env.warn_few_connections({{env.CONNECTIONS_ENV: v}}) for v in ("8", "1", "1")]
print(json.dumps([said, [(str(w.message), w.category.__name__) for w in caught]]))
"""
    done = run("-c", script, env={**ENV, env.CONNECTIONS_ENV: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said, caught = json.loads(done.stdout)
    assert said == [False, True, False], "warned by the second call alone: once per process"
    assert caught == [[f"{env.connections_note({env.CONNECTIONS_ENV: '1'})}; {env.CONNECTIONS_FIX}", "RuntimeWarning"]]


def test_the_issues_three_commands_print_one_line_and_exit_2(tmp_path):
    """Each printed a Python traceback and exited 1."""
    for args, env, message in (
            (["demo", "--workdir", str(tmp_path / "nonexistent")], ENV,
             f"gdsload demo: error: {tmp_path}/nonexistent: --workdir must be an existing directory"),
            (["demo", "--batch-size", "0"], ENV, "gdsload demo: error: --batch-size must be at least 1 (found 0)"),
            (["info"], {**ENV, "GDSLOAD_BACKEND": "bogus"},
             "gdsload info: error: environment variable GDSLOAD_BACKEND='bogus' is not a backend")):
        res = run("-m", "gdsload", *args, env=env)
        assert res.returncode == 2 and res.stdout == "", (args, res.stderr)
        assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, (args, res.stderr)


@pytest.fixture
def small(make_dataset) -> str:
    return make_dataset({"x": np.arange(40, dtype=np.int64)}, samples_per_block=8)


@pytest.mark.parametrize("args, env, message", [
    (["info", "{tmp}/missing.gds"], {}, "gdsload info: error: {tmp}/missing.gds: no such dataset directory"),
    (["info"], {"GDSLOAD_BACKEND": "floppy"}, "gdsload info: error: environment variable GDSLOAD_BACKEND='floppy'"),
    (["verify", "{tmp}/missing.gds"], {}, "gdsload verify: error: {tmp}/missing.gds: no such dataset directory"),
    (["verify", "{small}", "--threads", "0"], {}, "gdsload verify: error: --threads must be at least 1 (found 0)"),
    (["demo", "--samples", "0"], {}, "gdsload demo: error: --samples must be at least 1 (found 0)"),
    (["demo", "--batch-size", "-4"], {}, "gdsload demo: error: --batch-size must be at least 1 (found -4)"),
    (["demo", "--workdir", "{small}/zarr.json"], {}, "gdsload demo: error: {small}/zarr.json: --workdir must be"),
    (["demo", "--samples", "300"], {"RANK": "abc"}, "gdsload demo: error: environment variable RANK='abc' is not"),
    (["demo", "--samples", "300", "--backend", "cpu"], {"WORLD_SIZE": "0"},
     "gdsload demo: error: environment variable WORLD_SIZE='0' is out of range"),
    (["doctor", "{tmp}/missing.gds"], {}, "gdsload doctor: error: {tmp}/missing.gds: does not exist"),
    (["doctor"], {"GDSLOAD_BACKEND": "floppy"}, "gdsload doctor: error: environment variable GDSLOAD_BACKEND="),
    (["bench", "{tmp}/missing.gds"], {}, "gdsload bench: error: {tmp}/missing.gds: no such dataset directory"),
    (["bench", "{small}", "--batch-size", "0"], {}, "gdsload bench: error: --batch-size must be at least 1"),
    (["bench", "{small}", "--json", "{tmp}/no/b.json"], {}, "gdsload bench: error: {tmp}/no/b.json: its folder"),
    (["shard", "{tmp}/missing.npy", "-o", "{tmp}/o.gds"], {},
     "gdsload shard: error: {tmp}/missing.npy: input does not exist"),
])
def test_every_command_ends_an_expected_error_with_one_line_and_exit_2(tmp_path, small, monkeypatch, capsys, args,
                                                                       env, message):
    """One mechanism for every command (cli.fail): gdsload's errors, argument and environment errors, and
    the OS's on a user's path are one line ``gdsload CMD: error: ...`` on stderr, exit status 2."""
    from gdsload.tools import cli

    for name in ("GDSLOAD_BACKEND", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fill = {"tmp": str(tmp_path), "small": small}
    code = cli.main([a.format(**fill) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message.format(**fill)) and err.count("\n") == 1, err


def test_an_os_error_on_a_users_path_is_one_line(monkeypatch, capsys, tmp_path):
    """An OSError that escapes a command (here: the dataset cannot be listed) reads ``FILE: reason``."""
    from gdsload.tools import cli

    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cli, "describe_dataset", refuse)
    assert cli.main(["info", str(tmp_path / "d.gds")]) == 2
    assert capsys.readouterr().err == f"gdsload info: error: {tmp_path}/d.gds: Permission denied\n"


# -- issue 47: where users reach for it --------------------------------------------------------------------------
def help_entries(text: str) -> dict[str, str]:
    """The help of each argument in an argparse help text (flags' last spelling, or a positional's name)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m and not line.startswith("   "):
            current = m.group(1).split(", ")[-1].split()[0]
            entries[current] = m.group(2) or ""
        elif current is not None and line.startswith("    ") and line.strip():
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    entries.pop("--help", None)
    return entries


def check_help(text: str, defaults: dict[str, object]) -> None:
    """Every argument has help text, and every option with a default (not None, False or empty) names it."""
    entries = help_entries(text)
    assert entries, text
    for name, said in entries.items():
        assert said, f"{name} has no help text:\n{text}"
        default = defaults.get(name.lstrip("-").replace("-", "_"))
        if name.startswith("-") and default not in (None, False, []):
            assert "default" in said or f"({default})" in said, (name, default, said)


def help_text(capsys, argv: list[str]) -> str:
    from gdsload.tools import cli

    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_option_of_every_command_has_help_and_its_default(capsys, monkeypatch):
    """info's path, verify --threads, demo's options had no help; no help showed a default."""
    from gdsload.tools import cli

    monkeypatch.setenv("COLUMNS", "200")
    for cmd, args in (("info", []), ("demo", []), ("verify", ["d.gds"]), ("doctor", []), ("bench", ["d.gds"])):
        defaults = vars(cli.build_parser().parse_args([cmd, *args]))
        check_help(help_text(capsys, [cmd, "--help"]), defaults)
    shard = vars(cli.shard_parser().parse_args(["-o", "d.gds"]))
    shard.pop("output")  # required: given above
    check_help(help_text(capsys, ["shard", "--help"]), shard)
    said = help_entries(help_text(capsys, ["demo", "--help"]))
    assert said["--samples"].endswith("(default: 8192)") and said["--backend"].endswith("(default: auto)")
    assert said["--batch-size"].endswith("(default: 256)")
    assert help_entries(help_text(capsys, ["verify", "--help"]))["--threads"] == "reader threads (default: 8)"


def test_version(capsys):
    from gdsload import __version__

    res = run("-m", "gdsload", "--version")
    assert res.returncode == 0 and res.stdout == f"gdsload {__version__}\n", res


def test_info_on_a_file_says_what_it_holds_and_the_command_that_converts_it(tmp_path):
    """It said "no such dataset directory" for a file that exists; the command it shows converts the file."""
    np.save(tmp_path / "a.npy", np.arange(30, dtype=np.float32).reshape(10, 3))
    np.savez(tmp_path / "b.npz", x=np.zeros(5), y=np.ones((5, 2), np.uint8))
    res = run("-m", "gdsload", "info", str(tmp_path / "a.npy"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"{tmp_path}/a.npy: not a dataset but a file of 1 array(s), which 'gdsload shard' converts:"
    assert lines[1] == "  a: shape (10, 3), dtype <f4 (float32)"
    assert lines[2].startswith(f"convert it: gdsload shard {tmp_path}/a.npy -o a.gds   ")
    res = run("-m", "gdsload", "info", str(tmp_path / "b.npz"))
    assert res.returncode == 0 and "  x: shape (5,), dtype <f8 (float64)\n  y: shape (5, 2), dtype |u1" in res.stdout
    convert = lines[2].split("convert it: ")[1].split("   ")[0].split()  # gdsload shard PATH -o a.gds, run there
    done = subprocess.run([sys.executable, "-m", "gdsload", *convert[1:], "--quiet"], capture_output=True, text=True,
                          cwd=tmp_path, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    with GDSDataset(str(tmp_path / "a.gds"), batch_size=10, backend="cpu") as ds:
        np.testing.assert_array_equal(next(iter(ds))["a"], np.arange(30, dtype=np.float32).reshape(10, 3))
    (tmp_path / "notes.txt").write_text("hello")
    res = run("-m", "gdsload", "info", str(tmp_path / "notes.txt"))
    assert res.returncode == 2 and res.stderr == (f"gdsload info: error: {tmp_path}/notes.txt: unsupported input "
                                                  f"(expected .npy, .npz, a directory of them, or a zarr store)\n")


def test_info_lists_the_arrays_a_store_read_without_fields_skips(tmp_path):
    import zarr

    path = str(tmp_path / "s.zarr")
    g = zarr.create_group(path)
    g.create_array("x", shape=(40, 2), dtype="int32", chunks=(10, 2))[:] = np.arange(80).reshape(40, 2)
    g.create_array("text", shape=(40,), dtype=str, chunks=(10,))[:] = np.array([f"s{i}" for i in range(40)])
    res = run("-m", "gdsload", "info", path)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "  x: dtype <i4 (int32)" in res.stdout and "fields: 1" in res.stdout
    assert res.stdout.splitlines()[-1] == ("skipped: 'text' (data type 'string'): data types gdsload does not read "
                                           "(read the others, or choose with fields=)")


def test_demo_says_its_figures_are_not_a_benchmark(tmp_path):
    res = run("-m", "gdsload", "demo", "--samples", "600", "--backend", "cpu", "--workdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1].startswith("these figures are not a benchmark: epochs of ")
    assert "time your own dataset with 'gdsload bench PATH'" in res.stdout


# -- issue 58: info and verify take the URLs doctor and bench take --------------------------------------------------
def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1:]


def test_info_and_verify_of_an_http_url(make_dataset, srv, tmp_path):
    """``gdsload info URL`` and ``gdsload verify URL`` open a remote dataset as GDSDataset does (its skeleton, in
    a temporary folder removed after); verify reads every block from the objects, so a bit flipped on the
    server is BAD, named by its object's URL; a shard object gone is named too."""
    os.mkdir(tmp_path / "tmp")
    env = {**ENV, "TMPDIR": str(tmp_path / "tmp")}  # where the skeletons' temporary folders go
    path = make_dataset({"x": np.arange(400 * 4, dtype=np.float32).reshape(400, 4), "idx": np.arange(400)},
                        samples_per_block=16, shard_bytes=16 * 16 * 4 * 4)
    url = upload(srv, path, "d.gds")
    done = run("-m", "gdsload", "info", url, env=env)
    out = done.stdout
    assert done.returncode == 0 and out.startswith(f"dataset: {url}\nsamples: 400 "), done.stderr
    assert "  x: dtype <f4 (float32), sample shape (4,)" in out
    assert path not in out and str(tmp_path / "tmp") not in out, out
    done = run("-m", "gdsload", "verify", url, "--quiet", env=env)
    assert done.returncode == 0 and done.stdout == f"{url}: 50 block(s) checked, 0 bad\n"
    shard = "d.gds/x/c/1/0"
    srv.put(shard, _flip(srv.objects["/" + shard], 100))  # block 16's data: the first of shard 1
    done = run("-m", "gdsload", "verify", url, "--quiet", env=env)
    assert done.returncode == 1
    out = done.stdout.splitlines()
    assert out[0].startswith(f"BAD {srv.url(shard)}: block 16 of field 'x' (256 bytes at offset 0) fails its "
                             f"crc32c check"), out
    assert out[-1] == f"{url}: 50 block(s) checked, 1 bad", out
    srv.delete(shard)  # the open itself refuses: the skeleton names the shard object gone
    done = run("-m", "gdsload", "verify", url, "--quiet", env=env)
    err = done.stderr
    assert done.returncode == 2 and err.startswith("gdsload verify: error: ") and srv.url(shard) in err, err
    assert "404" in err, err
    assert os.listdir(tmp_path / "tmp") == [], "the skeletons' temporary folders are removed"


def test_info_and_verify_of_an_s3_zarr_store_name_its_missing_chunks(s3, tmp_path, capsys):
    """A zarr-python store (raw + crc32c) on S3 with one chunk object deleted: info counts the missing chunk,
    verify names its URL and exits 1; a flipped chunk is BAD, named by URL."""
    import zarr
    from zarr.codecs import Crc32cCodec

    from gdsload.tools import cli

    path = str(tmp_path / "z.zarr")
    g = zarr.create_group(path)
    g.create_array("u", shape=(40, 2), dtype="int32", chunks=(10, 2), compressors=[Crc32cCodec()])[:] = \
        np.arange(1, 81).reshape(40, 2)
    url = upload(s3, path, "z.zarr")
    assert cli.main(["verify", url, "--quiet"]) == 0
    assert capsys.readouterr().out == f"{url}: 4 chunk(s) checked, 0 bad\n"
    s3.delete("z.zarr/u/c/3/0")
    assert cli.main(["info", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dataset: {url}\n") and "1 chunk(s) missing" in out, out
    assert cli.main(["verify", url, "--quiet"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"MISSING {url}/u/c/3/0: chunk file missing (chunk 3 of field 'u')",
        f"{url}: 3 chunk(s) checked, 0 bad, 1 missing"]
    with open(os.path.join(path, "u", "c", "1", "0"), "rb") as f:
        s3.put("z.zarr/u/c/1/0", _flip(f.read(), 3))
    assert cli.main(["verify", url, "--quiet"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"BAD {url}/u/c/1/0: chunk 1 of field 'u' (80 bytes at offset 0) fails its crc32c"), out
