"""Converter safety: hostile inputs, --overwrite, atomic publish, signals, stale temporaries, resource limits,
natural order of directory inputs, block checksums.

Every failure must exit 2 with one line ``PROG: error: PATH: what is wrong`` and leave nothing behind; signals
and resource limits run in subprocesses (a slowed-down converter, so a signal lands mid-conversion)."""

from __future__ import annotations

import errno
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import crc32c
import numpy as np
import pytest
import zarr

from gdsload import ConversionError, GDSDataset
from gdsload.conversion import publish, writer
from gdsload.format.meta import read_metadata
from gdsload.tools.cli import shard_main
from gdsload.conversion.source_types import ArraySource, RaggedSource
from gdsload.conversion.sources import natural_key, open_input, open_ragged
from gdsload.conversion.writer import convert, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def run_shard(args: list, capsys) -> tuple[int, str, str]:
    code = shard_main([str(a) for a in args] + ["--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def leftovers(root) -> list[str]:
    """Temporary directories (``.NAME.tmp-...``) anywhere under ``root``."""
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if ".tmp-" in n]


def snapshot(root) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None for a directory)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = None
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = None if not os.path.isfile(p) else open(p, "rb").read()
    return out


def assert_one_line_error(code: int, err: str, root) -> str:
    """Exit 2, one line ``shard.py: error: PATH: ...`` with PATH under ``root``; returns the message."""
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    prefix = "shard.py: error: "
    assert err.startswith(prefix), err
    message = err[len(prefix):]
    assert message.startswith(str(root)) and ": " in message, message
    return message


def npy_with_header(path, header: str, data: bytes = b"") -> None:
    """A .npy file (format 1.0) with the header dictionary text given verbatim."""
    h = header.encode("latin1")
    h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data)


# -- hostile inputs --------------------------------------------------------------------------------
def _flip_inside(path, needle: bytes) -> None:
    """Flip one byte in the middle of the first occurrence of ``needle`` in the file."""
    raw = bytearray(open(path, "rb").read())
    at = raw.index(needle) + len(needle) // 2
    raw[at] ^= 0xFF
    open(path, "wb").write(bytes(raw))


def _corrupt_deflate(path) -> None:
    with zipfile.ZipFile(path) as zf:
        info = zf.infolist()[0]
    raw = bytearray(open(path, "rb").read())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(info.compress_size // 2, info.compress_size // 2 + 8):
        raw[start + i] ^= 0x55
    open(path, "wb").write(bytes(raw))


def _case(t, name: str) -> list:
    """Build the bad input ``name`` under ``t``; returns the arguments (besides -o) for shard.py."""
    good = t / "good.npy"
    np.save(good, np.arange(10, dtype=np.int64))
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }"
    if name == "missing":
        return [t / "missing.npy"]
    if name == "truncated":
        np.save(t / "x.npy", np.zeros((100, 8)))
        os.truncate(t / "x.npy", os.path.getsize(t / "x.npy") - 100)
        return [t / "x.npy"]
    if name == "header-tokenize":
        npy_with_header(t / "x.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), '''")
        return [t / "x.npy"]
    if name == "header-syntax":
        npy_with_header(t / "x.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2)) }")
        return [t / "x.npy"]
    if name == "header-dtype":
        npy_with_header(t / "x.npy", "{'descr': 'zz9', 'fortran_order': False, 'shape': (4, 2), }")
        return [t / "x.npy"]
    if name == "not-npy":
        (t / "x.npy").write_bytes(b"hello, this is not an array\n" * 10)
        return [t / "x.npy"]
    if name == "empty-file":
        (t / "x.npy").write_bytes(b"")
        return [t / "x.npy"]
    if name == "huge-shape":
        npy_with_header(t / "x.npy", hdr % "(4, 4611686018427387904, 4)", bytes(64))
        return [t / "x.npy"]
    if name == "huge-shape-fits-int64":
        npy_with_header(t / "x.npy", hdr % "(4, 1099511627776)", bytes(64))  # 2**44 bytes, in a file of 64
        return [t / "x.npy"]
    if name == "negative-dim":
        npy_with_header(t / "x.npy", hdr % "(4, -2)", bytes(64))
        return [t / "x.npy"]
    if name == "npz-not-zip":
        (t / "x.npz").write_bytes(b"PK\x03\x04 but not really a zip archive" * 3)
        return [t / "x.npz"]
    if name == "npz-crc":
        np.savez(t / "x.npz", a=np.full(4096, 0x5A5A5A5A, np.int32))
        _flip_inside(t / "x.npz", b"\x5a" * 256)
        return [t / "x.npz"]
    if name == "npz-deflate":
        np.savez_compressed(t / "x.npz", a=np.random.default_rng(0).integers(0, 50, 20000, np.int32))
        _corrupt_deflate(t / "x.npz")
        return [t / "x.npz"]
    if name == "npz-empty":
        with zipfile.ZipFile(t / "x.npz", "w") as zf:
            zf.writestr("readme.txt", "no arrays here")
        return [t / "x.npz"]
    if name == "npz-member-short":
        with zipfile.ZipFile(t / "x.npz", "w") as zf:  # header promises 4x2 floats, member holds 8 bytes
            h = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), }"
            h = h.encode() + b" " * (-(10 + len(h) + 1) % 64) + b"\n"
            zf.writestr("a.npy", b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + bytes(8))
        return [t / "x.npz"]
    if name == "zarr-chunk":
        a = zarr.create_array(str(t / "z.zarr"), shape=(20, 4), chunks=(5, 4), dtype="f4")
        a[:] = np.arange(80, dtype="f4").reshape(20, 4)
        (t / "z.zarr" / "c" / "1" / "0").write_bytes(b"garbage" * 5)
        return [t / "z.zarr"]
    if name == "object-dtype":
        np.save(t / "x.npy", np.array([{"k": 1}] * 4, dtype=object), allow_pickle=True)
        return [t / "x.npy"]
    if name == "structured-dtype":
        np.save(t / "x.npy", np.zeros(4, dtype=[("x", "f4"), ("y", "i4")]))
        return [t / "x.npy"]
    if name == "field-zarr.json":
        return ["--field", f"zarr.json={good}"]
    if name == "field-_checksums":
        return ["--field", f"_checksums={good}"]
    if name == "field-newline":
        return ["--field", f"a\nb={good}"]
    if name == "different-counts":
        np.save(t / "b.npy", np.zeros(11))
        return [good, t / "b.npy"]
    if name == "empty-dir":
        (t / "d").mkdir()
        return [t / "d"]
    if name == "ambiguous-names":
        (t / "d").mkdir()
        np.save(t / "d" / "1.npy", np.zeros(2))
        np.save(t / "d" / "01.npy", np.zeros(2))
        return [t / "d"]
    if name == "dir-mismatch":
        (t / "d").mkdir()
        np.save(t / "d" / "0.npy", np.zeros((2, 3)))
        np.save(t / "d" / "1.npy", np.zeros((2, 4)))
        return [t / "d"]
    if name == "scalar":
        np.save(t / "x.npy", np.float32(3))
        return [t / "x.npy"]
    if name == "zero-size":
        np.save(t / "x.npy", np.zeros((5, 0)))
        return [t / "x.npy"]
    if name == "fifo":
        os.mkfifo(t / "x.npy")
        return [t / "x.npy"]
    if name == "unsupported-kind":
        (t / "x.txt").write_text("1 2 3")
        return [t / "x.txt"]
    if name == "npz-fortran":
        np.savez(t / "x.npz", a=np.asfortranarray(np.zeros((4, 3))))
        return [t / "x.npz"]
    if name == "ragged-offsets":
        np.savez(t / "r.npz", values=np.zeros(5), offsets=np.array([0, 3, 2, 5]))
        return ["--ragged", f"r={t / 'r.npz'}"]
    if name == "ragged-scalar-file":
        (t / "r").mkdir()
        np.save(t / "r" / "0.npy", np.zeros(3))
        np.save(t / "r" / "1.npy", np.float64(1))
        return ["--ragged", f"r={t / 'r'}"]
    if name == "samples-per-block-0":
        return [good, "--samples-per-block", "0"]
    if name == "output-parent-is-file":
        (t / "file").write_text("x")
        return [good, "-o", t / "file" / "out.gds"]
    if name == "overwrite-regular-file":
        (t / "out.gds").write_text("precious")
        return [good, "--overwrite"]
    if name == "overwrite-other-directory":
        (t / "out.gds").mkdir()
        (t / "out.gds" / "notes.txt").write_text("precious")
        return [good, "--overwrite"]
    if name == "overwrite-plain-zarr":
        zarr.open_group(str(t / "out.gds"), mode="w").attrs["mine"] = 1
        return [good, "--overwrite"]
    if name == "output-exists":
        (t / "out.gds").mkdir()
        return [good]
    if name == "output-is-input":
        return [good, "-o", good]
    raise AssertionError(name)


HOSTILE = {
    "missing": "missing.npy: input does not exist",
    "truncated": "x.npy: file ends early",
    "header-tokenize": "x.npy: not a valid .npy array (TokenError",
    "header-syntax": "x.npy: not a valid .npy array",
    "header-dtype": "x.npy: not a valid .npy array",
    "not-npy": "x.npy: not a valid .npy array",
    "empty-file": "x.npy: not a valid .npy array",
    "huge-shape": "x.npy: shape (4, 4611686018427387904, 4) of float32 is",
    "huge-shape-fits-int64": "x.npy: file ends early",
    "negative-dim": "x.npy: negative dimension in shape (4, -2)",
    "npz-not-zip": "x.npz: not a valid .npz archive",
    "npz-crc": "x.npz:a: cannot read samples",
    "npz-deflate": "x.npz",
    "npz-empty": "x.npz: archive holds no .npy arrays",
    "npz-member-short": "x.npz:a: file ends early",
    "zarr-chunk": "z.zarr: cannot read samples",
    "object-dtype": "x.npy: unsupported dtype object",
    "structured-dtype": "x.npy: unsupported dtype",
    "field-zarr.json": "invalid field name 'zarr.json'",
    "field-_checksums": "invalid field name '_checksums'",
    "field-newline": "invalid field name 'a\\nb'",
    "different-counts": "b.npy: fields have different sample counts (good=10, b=11",
    "empty-dir": "d: directory holds no .npy or .npz files",
    "ambiguous-names": "d: files '01.npy' and '1.npy' have no defined order",
    "dir-mismatch": "1.npy: cannot concatenate with",
    "scalar": "x.npy: is a scalar",
    "zero-size": "x.npy: zero-size samples",
    "fifo": "x.npy: cannot read as an array file (expected a regular file",
    "unsupported-kind": "x.txt: unsupported input",
    "npz-fortran": "x.npz:a: Fortran-ordered arrays in .npz are not supported",
    "ragged-offsets": "r.npz: offsets must start at 0 and never decrease",
    "ragged-scalar-file": "1.npy: a scalar",
    "samples-per-block-0": "out.gds: samples_per_block must be at least 1",
    "output-parent-is-file": "out.gds: cannot create the output",
    "overwrite-regular-file": "out.gds: --overwrite replaces only a gdsload dataset",
    "overwrite-other-directory": "out.gds: --overwrite replaces only a gdsload dataset",
    "overwrite-plain-zarr": "(found a Zarr v3 group without the 'gdsload' attribute)",
    "output-exists": "out.gds: output exists and is a directory without zarr.json, not a gdsload dataset "
                     "(--overwrite replaces only a gdsload dataset): choose another output",
    "output-is-input": "good.npy: output path is inside input",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_fails_with_one_line_and_leaves_nothing(tmp_path, capsys, name):
    args = _case(tmp_path, name)
    if "-o" not in args:
        args += ["-o", tmp_path / "out.gds"]
    before = snapshot(tmp_path)
    code, out, err = run_shard(args, capsys)
    message = assert_one_line_error(code, err, tmp_path)
    assert HOSTILE[name] in message, message
    assert out == ""
    assert snapshot(tmp_path) == before  # nothing written, nothing removed (an output that existed included)
    assert leftovers(tmp_path) == []


def test_hostile_errors_are_conversion_errors_for_library_callers(tmp_path):
    npy_with_header(tmp_path / "x.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), '''")
    with pytest.raises(ConversionError, match="x.npy: not a valid .npy array"):
        convert([str(tmp_path / "x.npy")], tmp_path / "o.gds", progress=False)
    with pytest.raises(ConversionError, match="invalid field name"):
        write_dataset(tmp_path / "o.gds", {"zarr.json": ArraySource("<z>", np.zeros(3))}, progress=False)
    assert os.listdir(tmp_path) == ["x.npy"]


def test_field_named_c_does_not_collide_with_chunk_directories(tmp_path):
    """A chunk directory ``c`` belongs to an array, never to the group: a field may be called ``c``."""
    c = np.arange(12, dtype=np.int16).reshape(6, 2)
    meta = write_dataset(tmp_path / "o.gds", {"c": ArraySource("<c>", c)}, samples_per_block=4, progress=False)
    np.testing.assert_array_equal(zarr.open_group(meta.path, mode="r")["c"][:], c)


# -- --overwrite -----------------------------------------------------------------------------------
def test_overwrite_refuses_the_working_directory_and_its_ancestors(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "x.npy", np.arange(10))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    before = snapshot(tmp_path)
    for out in (".", str(tmp_path / "work"), str(tmp_path)):
        code, _, err = run_shard([tmp_path / "x.npy", "-o", out, "--overwrite"], capsys)
        assert code == 2 and "--overwrite replaces only a gdsload dataset" in err, err
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_directory_holding_an_input(tmp_path, capsys):
    """The reported case: the input lies inside the directory it is asked to replace."""
    (tmp_path / "old.gds").mkdir()
    np.save(tmp_path / "old.gds" / "p.npy", np.arange(10))
    code, _, err = run_shard([tmp_path / "old.gds" / "p.npy", "-o", tmp_path / "old.gds", "--overwrite"], capsys)
    assert code == 2 and "--overwrite replaces only a gdsload dataset (found a directory holding input" in err, err
    np.testing.assert_array_equal(np.load(tmp_path / "old.gds" / "p.npy"), np.arange(10))
    # the same even when the directory is a dataset (an input inside a dataset would be lost with it)
    write_dataset(tmp_path / "d.gds", {"x": ArraySource("<x>", np.arange(4))}, progress=False)
    np.save(tmp_path / "d.gds" / "p.npy", np.arange(4))
    code, _, err = run_shard([tmp_path / "d.gds" / "p.npy", "-o", tmp_path / "d.gds", "--overwrite"], capsys)
    assert code == 2 and "holding input" in err
    assert os.path.exists(tmp_path / "d.gds" / "p.npy") and leftovers(tmp_path) == []


def test_overwrite_refuses_a_symlink(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10))
    write_dataset(tmp_path / "real.gds", {"x": ArraySource("<x>", np.arange(3))}, progress=False)
    os.symlink(tmp_path / "real.gds", tmp_path / "link.gds")
    code, _, err = run_shard([tmp_path / "x.npy", "-o", tmp_path / "link.gds", "--overwrite"], capsys)
    assert code == 2 and "(found a symbolic link)" in err
    assert read_metadata(tmp_path / "real.gds").num_samples == 3 and os.path.islink(tmp_path / "link.gds")


def test_overwrite_does_not_block_on_a_fifo_in_place_of_zarr_json(tmp_path):
    """Deciding whether the output is a dataset read OUT/zarr.json with a plain open(): a FIFO there blocked
    the converter forever. It is refused, in time, and left where it is."""
    from _helpers import in_thread
    from gdsload.conversion.publish import check_output

    out = tmp_path / "out.gds"
    out.mkdir()
    os.mkfifo(out / "zarr.json")
    with pytest.raises(ConversionError, match="zarr.json cannot be read"):
        in_thread(lambda: check_output(str(out), True, []))
    assert os.path.exists(out / "zarr.json")


def test_overwrite_replaces_a_dataset(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10))
    out = tmp_path / "o.gds"
    write_dataset(out, {"old": ArraySource("<old>", np.arange(3))}, progress=False)
    code, stdout, err = run_shard([tmp_path / "x.npy", "-o", out, "--overwrite"], capsys)
    assert code == 0, err
    meta = read_metadata(out)
    assert list(meta.fields) == ["x"] and meta.num_samples == 10
    assert sorted(os.listdir(tmp_path)) == ["o.gds", "x.npy"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_every_file_reaches_the_disk_before_the_dataset_is_published(tmp_path, monkeypatch, overwrite):
    """Every file and directory of the new dataset is fsynced before the rename that publishes it, and its
    parent directory after it: a crash just after a conversion cannot leave the name on empty shards."""
    out = tmp_path / "o.gds"
    if overwrite:
        write_dataset(out, {"old": np.arange(3)}, progress=False)
    events: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def renamed(fn):
        def wrapper(src, dst):
            events.append(("rename", str(src)))
            return fn(src, dst)
        return wrapper

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(publish, "rename_noreplace", renamed(publish.rename_noreplace))
    monkeypatch.setattr(publish, "rename_exchange", renamed(publish.rename_exchange))
    write_dataset(out, {"x": np.arange(1000, dtype=np.int64).reshape(100, 10)}, samples_per_block=8,
                  overwrite=overwrite, progress=False)
    first_rename = next(i for i, (what, _) in enumerate(events) if what == "rename")
    tmp = events[first_rename][1]
    before = {path for what, path in events[:first_rename] if what == "fsync"}
    written = {os.path.join(d, f) for d, _, files in os.walk(out) for f in files}
    written |= {d for d, _, _ in os.walk(out)}
    assert {p.replace(str(out), tmp, 1) for p in written} <= before
    assert ("fsync", str(tmp_path)) in events[first_rename:]
    np.testing.assert_array_equal(next(iter(GDSDataset(out, batch_size=100, backend="cpu")))["x"],
                                  np.arange(1000).reshape(100, 10))


class Hook:
    """A source that runs ``hook`` at its first read: something happening during a conversion."""

    origin = "<hook>"
    dtype = np.dtype("int64")

    def __init__(self, n: int, hook):
        self.shape = (n,)
        self.hook = hook

    def read(self, start: int, stop: int) -> np.ndarray:
        if self.hook:
            self.hook, hook = None, self.hook
            hook()
        return np.arange(start, stop, dtype=np.int64)

    def close(self) -> None:
        pass


def test_output_created_during_conversion_is_not_replaced(tmp_path):
    """The exists check and the rename are one step: what appears meanwhile is kept."""
    out = tmp_path / "o.gds"

    def appear():
        out.mkdir()
        (out / "keep.txt").write_text("mine")

    with pytest.raises(ConversionError, match="output exists .it appeared during the conversion"):
        write_dataset(out, {"x": Hook(10, appear)}, progress=False)
    assert os.listdir(out) == ["keep.txt"] and leftovers(tmp_path) == []


def test_output_replaced_during_overwrite_by_a_non_dataset_is_put_back(tmp_path):
    out = tmp_path / "o.gds"
    write_dataset(out, {"x": ArraySource("<x>", np.arange(3))}, progress=False)

    def replace():
        shutil.rmtree(out)
        out.mkdir()
        (out / "keep.txt").write_text("mine")

    with pytest.raises(ConversionError, match="appeared during the conversion; left as it is"):
        write_dataset(out, {"x": Hook(10, replace)}, overwrite=True, progress=False)
    assert os.listdir(out) == ["keep.txt"] and leftovers(tmp_path) == []
    out_gone = tmp_path / "gone.gds"
    write_dataset(out_gone, {"x": ArraySource("<x>", np.arange(3))}, progress=False)
    meta = write_dataset(out_gone, {"x": Hook(5, lambda: shutil.rmtree(out_gone))}, overwrite=True, progress=False)
    assert meta.num_samples == 5 and leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", ["syscall", "unsupported"])
def test_rename_fallbacks(tmp_path, monkeypatch, mode):
    """renameat2 through a raw syscall (glibc without the symbol), and exists-check + rename where the
    kernel has none (ENOSYS): the same results."""
    fn = publish._load_renameat2(use_symbol=False) if mode == "syscall" else None
    if mode == "syscall" and fn is None:
        pytest.skip("no renameat2 syscall number for this machine")
    monkeypatch.setattr(publish, "_renameat2_fn", fn)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").write_text("")
    with pytest.raises(FileExistsError):
        publish.rename_noreplace(str(tmp_path / "a"), str(tmp_path / "b"))
    publish.rename_exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    assert os.listdir(tmp_path / "b") == ["from_a"] and os.listdir(tmp_path / "a") == []
    out = tmp_path / "o.gds"
    write_dataset(out, {"x": ArraySource("<x>", np.arange(3))}, progress=False)
    with pytest.raises(ConversionError, match="output exists"):
        write_dataset(out, {"x": ArraySource("<x>", np.arange(4))}, progress=False)
    write_dataset(out, {"x": ArraySource("<x>", np.arange(5))}, overwrite=True, progress=False)
    assert read_metadata(out).num_samples == 5
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "o.gds"]


def test_exchange_fallback_parks_the_old_dataset_where_stale_cleanup_never_looks(tmp_path, monkeypatch):
    """Without renameat2's exchange, the old dataset is moved aside for a moment. Killed right then, a
    converter used to leave it under a temporary name that the next run's stale cleanup deletes (its pid is
    dead): the user's old dataset lost. It is parked under a name that cleanup never matches."""
    monkeypatch.setattr(publish, "_renameat2_fn", None)
    (tmp_path / "new").mkdir()
    (tmp_path / "b").mkdir()
    seen = []
    real = publish.rename_noreplace

    def spy(src, dst):
        seen.extend(n for n in os.listdir(tmp_path) if n.startswith(".b."))
        real(src, dst)

    monkeypatch.setattr(publish, "rename_noreplace", spy)
    publish.rename_exchange(str(tmp_path / "new"), str(tmp_path / "b"))
    (parked,) = seen
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    os.mkdir(tmp_path / parked.replace(str(os.getpid()), dead))  # as a killed converter would leave it
    assert publish.remove_stale_temps(str(tmp_path / "b")) == []
    assert os.path.isdir(tmp_path / parked.replace(str(os.getpid()), dead))


# -- subprocesses: races, signals, SIGKILL, resource limits -----------------------------------------
# shard_main with every read slowed down; with GATE set, the first read announces itself with a file
# GATE.started-<pid> and waits for GATE.go, so a test can line up two converters or a signal.
_SLOW = """
import os, sys, time
import gdsload.conversion.sources as s
read, gate, delay = s.StreamSource.read, os.environ.get("GATE"), float(os.environ.get("DELAY", "0"))
def slow(self, a, b):
    global gate
    if gate:
        open(f"{gate}.started-{os.getpid()}", "w").close()
        deadline = time.monotonic() + 30
        while os.environ.get("WAIT") and not os.path.exists(gate + ".go") and time.monotonic() < deadline:
            time.sleep(0.01)
        gate = None
    time.sleep(delay)
    return read(self, a, b)
s.StreamSource.read = slow
from gdsload.tools.cli import shard_main
sys.exit(shard_main(sys.argv[1:], prog="gdsload shard"))
"""


def start_slow(args: list, gate, delay: float = 0.0, wait: bool = False, **kw) -> subprocess.Popen:
    env = {**ENV, "GATE": str(gate), "DELAY": str(delay), "WAIT": "1" if wait else ""}
    return subprocess.Popen([sys.executable, "-c", _SLOW, *map(str, args), "--quiet"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_started(gate, count: int = 1, procs=()) -> None:
    deadline = time.monotonic() + 30
    while len([n for n in os.listdir(os.path.dirname(gate)) if ".started-" in n]) < count:
        assert time.monotonic() < deadline, [p.communicate() for p in procs]
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)


def slow_input(tmp_path) -> str:
    """An input of 400 samples that the slowed converter reads one sample at a time."""
    np.save(tmp_path / "x.npy", np.arange(400 * 256, dtype=np.int32).reshape(400, 256))
    return str(tmp_path / "x.npy")


SLOW_ARGS = ["--samples-per-block", "1", "--slice-bytes", "1024"]


def test_two_converters_racing_for_one_output(tmp_path):
    """Both pass the early exists check; one publishes, the other finds the output at its rename."""
    src, out, gate = slow_input(tmp_path), tmp_path / "o.gds", tmp_path / "gate"
    procs = [start_slow([src, "-o", out, "--samples-per-block", "100"], gate, wait=True) for _ in range(2)]
    wait_started(gate, 2, procs)
    open(f"{gate}.go", "w").close()
    results = sorted((p.wait(timeout=60), *p.communicate()) for p in procs)
    assert [r[0] for r in results] == [0, 2], results
    err = results[1][2]
    assert err.count("\n") == 1 and f"gdsload shard: error: {out}: output exists" in err, err
    assert read_metadata(out).num_samples == 400 and leftovers(tmp_path) == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_stops_cleanly(tmp_path, sig, code):
    src, out, gate = slow_input(tmp_path), tmp_path / "o.gds", tmp_path / "gate"
    write_dataset(out, {"old": ArraySource("<old>", np.arange(7))}, progress=False)
    proc = start_slow([src, "-o", out, "--overwrite", *SLOW_ARGS], gate, delay=0.02)
    wait_started(gate, 1, [proc])
    assert leftovers(tmp_path), "the conversion is under way"
    proc.send_signal(sig)
    stdout, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err == f"gdsload shard: interrupted; nothing written to {out}\n"
    assert leftovers(tmp_path) == []
    meta = read_metadata(out)  # the dataset it was to replace is untouched
    assert list(meta.fields) == ["old"] and meta.num_samples == 7


def test_signal_handlers_are_restored(tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "x.npy", np.arange(10))
    kinds = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXFSZ)
    before = {s: signal.getsignal(s) for s in kinds}
    seen = {}
    write = writer.write_dataset

    def spy(*args, **kw):  # the handlers in force while the dataset is written
        seen.update({s: signal.getsignal(s) for s in kinds})
        return write(*args, **kw)

    monkeypatch.setattr(writer, "write_dataset", spy)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: must stay ignored
    try:
        code, _, err = run_shard([tmp_path / "x.npy", "-o", tmp_path / "o.gds"], capsys)
        assert code == 0, err
        assert seen[signal.SIGINT] is writer.on_signal and seen[signal.SIGTERM] is writer.on_signal
        assert seen[signal.SIGHUP] is signal.SIG_IGN and seen[signal.SIGXFSZ] is signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous_hup)
    assert {s: signal.getsignal(s) for s in kinds} == before


def test_killed_converter_temp_is_removed_by_the_next_conversion(tmp_path):
    src, out, gate = slow_input(tmp_path), tmp_path / "o.gds", tmp_path / "gate"
    proc = start_slow([src, "-o", out, *SLOW_ARGS], gate, delay=0.02)
    wait_started(gate, 1, [proc])
    proc.kill()
    proc.communicate(timeout=30)
    stale = leftovers(tmp_path)
    assert len(stale) == 1 and os.path.basename(stale[0]).startswith(f".o.gds.tmp-{proc.pid}-")
    # a live converter's temp, and another output's, stay
    live = tmp_path / f".o.gds.tmp-{os.getppid()}-0123abcd"
    other = tmp_path / f".p.gds.tmp-{proc.pid}-0123abcd"
    live.mkdir()
    other.mkdir()
    convert([src], out, samples_per_block=100, progress=False)
    assert sorted(leftovers(tmp_path)) == sorted([str(live), str(other)])
    assert read_metadata(out).num_samples == 400


def test_file_size_limit_fails_with_efbig_not_sigxfsz(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((256, 1024), np.float32))  # 1 MiB

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    res = subprocess.run([sys.executable, "-m", "gdsload", "shard", str(tmp_path / "x.npy"), "-o",
                          str(tmp_path / "o.gds"), "--quiet"], capture_output=True, text=True, cwd=ROOT, env=ENV,
                         preexec_fn=limit, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"gdsload shard: error: {tmp_path}/o.gds: cannot write x/c/0/0 (File too large)")
    assert os.listdir(tmp_path) == ["x.npy"]


def test_full_disk_fails_cleanly(tmp_path, monkeypatch):
    """ENOSPC in the middle of a shard: one error naming the output, nothing left."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.left = f, 300

        def write(self, buf):
            if len(buf) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(buf)
            return self.f.write(buf)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(writer, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    with pytest.raises(ConversionError, match=r"o.gds: cannot write x/c/0/0 \(No space left on device\)"):
        write_dataset(tmp_path / "o.gds", {"x": ArraySource("<x>", np.zeros((100, 8)))}, samples_per_block=10,
                      slice_bytes=80, progress=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_output_directory(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10))
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    try:
        code, _, err = run_shard([tmp_path / "x.npy", "-o", tmp_path / "ro" / "o.gds"], capsys)
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    message = assert_one_line_error(code, err, tmp_path)
    assert message.endswith("o.gds: cannot create the output in " f"{tmp_path / 'ro'} (Permission denied)\n")
    assert os.listdir(tmp_path / "ro") == []


def _unshare() -> list[str] | None:
    for cmd in (["unshare", "-m"], ["unshare", "-rm"]):
        try:
            if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


@pytest.mark.skipif(sys.platform != "linux", reason="Linux mount namespaces")
def test_real_full_and_read_only_filesystems(tmp_path):
    """On a 256 KiB tmpfs in a private mount namespace: a dataset that does not fit (ENOSPC), then the
    same filesystem read-only (EROFS). Each fails with one line and leaves the filesystem as it was."""
    unshare = _unshare()
    if unshare is None:
        pytest.skip("cannot create a mount namespace here")
    np.save(tmp_path / "big.npy", np.zeros((512, 1024), np.float32))  # 2 MiB
    np.save(tmp_path / "small.npy", np.arange(10))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    shard = f"{sys.executable} -m gdsload shard --quiet"
    script = (f"mount -t tmpfs -o size=256k tmpfs {mnt} || exit 99; "
              f"{shard} {tmp_path}/big.npy -o {mnt}/o.gds; echo rc=$?; ls -A {mnt}; "
              f"mount -o remount,ro {mnt}; {shard} {tmp_path}/small.npy -o {mnt}/r.gds; echo rc=$?")
    res = subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, env=ENV,
                         timeout=60)
    if res.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    assert res.stdout.split() == ["rc=2", "rc=2"], (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"gdsload shard: error: {mnt}/o.gds: cannot write ") and \
        lines[0].endswith("(No space left on device)")
    assert lines[1] == (f"gdsload shard: error: {mnt}/r.gds: cannot create the output in {mnt} "
                        "(Read-only file system)")


# -- natural order and block size ------------------------------------------------------------------
def test_natural_key():
    names = ["10.npy", "2.npy", "1.npy", "part10.npy", "part9.npy", "a.npy", "0.npy"]
    assert sorted(names, key=natural_key) == ["0.npy", "1.npy", "2.npy", "10.npy", "a.npy", "part9.npy",
                                              "part10.npy"]
    assert natural_key("1.npy") == natural_key("01.npy")


def test_directory_inputs_are_read_in_natural_order(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    (tmp_path / "tok").mkdir()
    (tmp_path / "npz").mkdir()
    for i in range(12):  # text order would be 0, 1, 10, 11, 2, ...
        np.save(tmp_path / "img" / f"{i}.npy", np.full((1, 2), i, np.int32))
        np.save(tmp_path / "tok" / f"{i}.npy", np.full(i % 3 + 1, i, np.int16))
        np.savez(tmp_path / "npz" / f"part{i}.npz", v=np.array([i], np.int64))
    np.save(tmp_path / "label.npy", np.arange(12))
    out = tmp_path / "o.gds"
    code, stdout, err = run_shard([tmp_path / "img", tmp_path / "label.npy", tmp_path / "npz", "--ragged",
                                   f"tok={tmp_path / 'tok'}", "-o", out, "--samples-per-block", "5"], capsys)
    assert code == 0, err
    g = zarr.open_group(str(out), mode="r")
    np.testing.assert_array_equal(g["img"][:, 0], g["label"][:])
    np.testing.assert_array_equal(g["v"][:], np.arange(12))
    offsets = g["tok/offsets"][:]
    assert [int(g["tok/values"][offsets[i]]) for i in range(12)] == list(range(12))
    for d, first, last in (("img", "0.npy", "11.npy"), ("npz", "part0.npz", "part11.npz"),
                           ("tok", "0.npy", "11.npy")):
        assert f"{tmp_path / d}: 12 files in natural order, first {first}, last {last}" in stdout, stdout


def test_open_input_and_open_ragged_use_natural_order(tmp_path):
    (tmp_path / "d").mkdir()
    for i in (1, 2, 10):
        np.save(tmp_path / "d" / f"{i}.npy", np.array([i]))
    src = open_input(str(tmp_path / "d"))["d"]
    assert src.files == ("1.npy", "2.npy", "10.npy") and src.read(0, 3).tolist() == [1, 2, 10]
    r = open_ragged(str(tmp_path / "d"))
    assert r.values.read(0, 3).tolist() == [1, 2, 10]
    np.save(tmp_path / "d" / "002.npy", np.array([0]))
    with pytest.raises(ConversionError, match="files '002.npy' and '2.npy' have no defined order"):
        open_ragged(str(tmp_path / "d"))


def test_samples_per_block_is_capped_at_the_sample_count(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(100, dtype=np.int64))
    out = tmp_path / "o.gds"
    code, _, err = run_shard([tmp_path / "x.npy", "-o", out, "--samples-per-block", "1000000"], capsys)
    assert code == 0, err
    assert read_metadata(out).samples_per_block == 100
    assert os.path.getsize(out / "x" / "c" / "0") == 800 + 16 + 4  # one block of 100 samples and its index


# -- checksums -------------------------------------------------------------------------------------
def stored_blocks(path: str, name: str):
    """The inner chunks of a fixed field, read from its shard files through their indexes (no gdsload)."""
    meta = json.load(open(os.path.join(path, name, "zarr.json")))
    cfg = meta["codecs"][0]["configuration"]
    per_shard = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // cfg["chunk_shape"][0]
    num_chunks = -(-meta["shape"][0] // cfg["chunk_shape"][0])
    for shard in range(-(-num_chunks // per_shard)):
        file = os.path.join(path, name, "c", str(shard), *["0"] * (len(meta["shape"]) - 1))
        raw = open(file, "rb").read()
        index = np.frombuffer(raw[-(16 * per_shard + 4):-4], "<u8").reshape(per_shard, 2)
        for offset, nbytes in index[:min(per_shard, num_chunks - shard * per_shard)].tolist():
            yield raw[offset:offset + nbytes]


def test_checksums_match_shard_files_and_sources(tmp_path):
    rng = np.random.default_rng(5)
    n, k = 103, 8
    fixed = {"img": rng.integers(0, 256, (n, 5, 3), dtype=np.uint8),
             "f": rng.standard_normal((n, 2)).astype(">f8"),  # stored little endian: so is its checksum
             "flag": rng.random(n) > 0.5}
    lengths = rng.integers(0, 6, n)
    lengths[8:16] = 0  # block 1 has no values at all
    seqs = [np.full((m, 2), i, np.int32) for i, m in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(seqs)
    path = str(tmp_path / "o.gds")
    write_dataset(path, {name: ArraySource(f"<{name}>", a) for name, a in fixed.items()},
                  ragged={"tok": RaggedSource("<tok>", ArraySource("<tok>", values), offsets)},
                  samples_per_block=k, shard_bytes=200, slice_bytes=100, block_bytes=96, progress=False)
    g = zarr.open_group(path, mode="r")
    attrs = g.attrs["gdsload"]["checksums"]
    assert attrs == {"algorithm": "crc32c", "arrays": {f: f"_checksums/{f}" for f in ["img", "f", "flag", "tok"]}}
    num_blocks = math.ceil(n / k)
    for name in attrs["arrays"]:
        arr = g[attrs["arrays"][name]]
        meta = json.load(open(os.path.join(path, "_checksums", name, "zarr.json")))
        assert arr.dtype == np.uint32 and arr.shape == (num_blocks,) and arr.chunks == (num_blocks,)
        assert [c["name"] for c in meta["codecs"]] == ["bytes"] and meta["fill_value"] == 0
        assert os.path.isfile(os.path.join(path, "_checksums", name, "c", "0"))
    for name, a in fixed.items():
        stored = g[f"_checksums/{name}"][:].tolist()
        blocks = list(stored_blocks(path, name))
        assert len(blocks) == num_blocks and len({len(b) for b in blocks}) == 1
        assert stored == [crc32c.crc32c(b) for b in blocks], name
        raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
        block_bytes = len(blocks[0])
        raw += bytes(num_blocks * block_bytes - len(raw))  # the final block's zero padding
        assert stored == [crc32c.crc32c(raw[b * block_bytes:(b + 1) * block_bytes]) for b in range(num_blocks)]
    stored = g["_checksums/tok"][:].tolist()
    want = [crc32c.crc32c(values[offsets[b * k]:offsets[min((b + 1) * k, n)]].astype("<i4").tobytes())
            for b in range(num_blocks)]
    assert stored == want and stored[1] == 0
    assert g["tok/values"].chunks[0] != k  # the values' own chunks are not the blocks the checksums cover


def test_checksums_of_a_single_partial_block(tmp_path):
    x = np.arange(5, dtype=np.int16)
    path = str(tmp_path / "o.gds")
    write_dataset(path, {"x": ArraySource("<x>", x)}, samples_per_block=8, progress=False)
    stored = zarr.open_group(path, mode="r")["_checksums/x"][:]
    assert read_metadata(path).samples_per_block == 5
    assert stored.tolist() == [crc32c.crc32c(x.tobytes())]
