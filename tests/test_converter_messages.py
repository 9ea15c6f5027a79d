"""What the converter says when its output exists: what is wrong, and the option as the caller spells it.

``gdsload shard -o afile`` once suggested ``--overwrite``, which then refused (a file is no dataset), and a
Python caller of ``write_dataset`` was told to pass ``--overwrite`` instead of ``overwrite=True``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

from gdsload import ConversionError, convert, write_dataset
from gdsload.conversion.source_types import ArraySource
from gdsload.tools.cli import shard_main


def _shard(capsys, *args) -> tuple[int, str]:
    code = shard_main([str(a) for a in args] + ["--quiet"], prog="gdsload shard")
    return code, capsys.readouterr().err


def _not_a_dataset(tmp_path, kind: str) -> str:
    out = tmp_path / "out.gds"
    if kind == "a regular file":
        out.write_text("precious")
    elif kind == "a directory without zarr.json":
        out.mkdir()
        (out / "notes.txt").write_text("precious")
    else:
        zarr.open_group(str(out), mode="w").attrs["mine"] = 1
    return str(out)


KINDS = ["a regular file", "a directory without zarr.json", "a Zarr v3 group without the 'gdsload' attribute"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_output_overwrite_would_not_replace_is_refused_saying_what_it_is(tmp_path, capsys, kind):
    """The first refusal says what the output is and that --overwrite replaces only a dataset: it does not
    suggest --overwrite, which would be refused in turn. Nothing is touched."""
    np.save(tmp_path / "x.npy", np.arange(10))
    out = _not_a_dataset(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    code, err = _shard(capsys, tmp_path / "x.npy", "-o", out)
    assert code == 2 and err == (f"gdsload shard: error: {out}: output exists and is {kind}, not a gdsload dataset "
                                 f"(--overwrite replaces only a gdsload dataset): choose another output\n"), err
    assert "pass --overwrite" not in err
    code, err = _shard(capsys, tmp_path / "x.npy", "-o", out, "--overwrite")
    assert code == 2 and f"{out}: --overwrite replaces only a gdsload dataset" in err, err
    assert sorted(os.listdir(tmp_path)) == before
    if kind == "a regular file":
        assert open(out).read() == "precious"


def test_an_existing_dataset_is_refused_suggesting_overwrite_which_replaces_it(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10))
    out = tmp_path / "d.gds"
    assert _shard(capsys, tmp_path / "x.npy", "-o", out)[0] == 0
    code, err = _shard(capsys, tmp_path / "x.npy", "-o", out)
    assert code == 2 and err == f"gdsload shard: error: {out}: output exists (pass --overwrite to replace it)\n"
    assert _shard(capsys, tmp_path / "x.npy", "-o", out, "--overwrite")[0] == 0


def test_python_callers_are_told_overwrite_true(tmp_path):
    """write_dataset and convert name their argument, overwrite=True, not the command line's flag; with it,
    writing the same output again (the README's Mixing snippet run twice) replaces the dataset."""
    out = str(tmp_path / "more.gds")
    data = {"images": np.zeros((20, 4, 4, 3), np.uint8), "labels": np.arange(20) % 10}
    write_dataset(out, data, progress=False)
    with pytest.raises(ConversionError, match=r"^" + out + r": output exists \(pass overwrite=True to replace it\)$"):
        write_dataset(out, data, progress=False)
    np.save(tmp_path / "x.npy", np.arange(20))
    with pytest.raises(ConversionError, match=r": output exists \(pass overwrite=True to replace it\)$"):
        convert([str(tmp_path / "x.npy")], out, progress=False)
    assert write_dataset(out, data, overwrite=True, progress=False).num_samples == 20
    afile = _not_a_dataset(tmp_path, "a regular file")
    with pytest.raises(ConversionError, match=r": output exists and is a regular file, not a gdsload dataset "
                                              r"\(overwrite=True replaces only a gdsload dataset\)"):
        write_dataset(afile, {"x": ArraySource("<x>", np.arange(3))}, progress=False)
    with pytest.raises(ConversionError, match=r": overwrite=True replaces only a gdsload dataset: a directory"):
        write_dataset(afile, {"x": ArraySource("<x>", np.arange(3))}, overwrite=True, progress=False)
