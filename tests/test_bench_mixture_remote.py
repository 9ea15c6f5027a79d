"""benchmarks/mixture.py carries its ceilings in the same run (measured, or ``not run`` with the reason where they
need a GPU), lists them in the markdown, and draws the PNG beside the JSON when matplotlib imports (says so when
it does not); benchmarks/remote.py is tested in tests/test_bench_remote.py. Run in-process on tiny datasets with the
cpu backend."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import pytest

from gdsload.system.env import gpu_available, kvikio_installed

Run = dict[str, Any]


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _run(main: Any, argv: list[str], out: str, name: str) -> Run:
    """``main(argv)`` with its stdout kept; the JSON, markdown, PNG path and printed text of ``OUT/*/name``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    [folder] = os.listdir(out)
    base = os.path.join(out, folder, name)
    with open(base + ".json") as f:
        doc = json.load(f)
    with open(base + ".md") as f:
        table = f.read()
    return {"doc": doc, "md": table, "png": base + ".png", "stdout": printed.getvalue()}


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from benchmarks import mixture

    tmp = tmp_path_factory.mktemp("mixture")
    out = str(tmp / "results")
    backends = "cpu" if gpu_available() else "cpu,pinned"  # pinned: a row saying why it did not run
    return _run(mixture.main, ["--data", str(tmp / "data"), "--out", out, "--size-gib", "0.02", "--backends", backends,
                               "--rounds", "2", "--min-seconds", "0", "--batch-size", "16", "--step-factor", "0"],
                out, "mixture")


def _gpu_row_ok(row: dict[str, Any], needs_kvikio: bool = False) -> None:
    """A GPU ceiling: measured where it can run here, else no figures and a reason."""
    if gpu_available() and (kvikio_installed() or not needs_kvikio):
        assert row["gbps"] > 0 and row["io_mode"], row
    else:
        assert row["gbps"] is None and row["io_mode"] is None, row
        assert row["note"].startswith("not run: ") and len(row["note"]) > len("not run: "), row


def test_mixture_ceilings_in_the_json(mixture_run: Run) -> None:
    from benchmarks.mixture import H2D, PAGE_CACHE, RAW_KVIKIO

    doc = mixture_run["doc"]
    row = doc["results"][0]
    assert row["what"] == "gdsload cpu" and row["io_mode"] == "cpu" and row["best_single"] > 0
    ceilings = {c["what"]: c for c in doc["ceilings"]}
    assert list(ceilings) == [PAGE_CACHE, RAW_KVIKIO, H2D]
    page = ceilings[PAGE_CACHE]
    assert page["io_mode"] == "posix" and page["gbps"] > 0 and len(page["runs"]) == 2 and page["note"] == ""
    assert page["gbps"] == max(page["runs"])
    _gpu_row_ok(ceilings[RAW_KVIKIO], needs_kvikio=True)
    _gpu_row_ok(ceilings[H2D])
    assert all(c["kind"] == "ceiling" and c["regime"] == "warm" for c in ceilings.values())


def test_mixture_markdown_lists_the_ceilings(mixture_run: Run) -> None:
    table = mixture_run["md"]
    assert "| gdsload cpu | cpu |" in table
    for c in mixture_run["doc"]["ceilings"]:
        line = next(x for x in table.splitlines() if x.startswith(f"| {c['what']} |"))
        assert (c["io_mode"] or "-") in line and c["note"] in line
        if c["gbps"] is not None:
            assert str(c["gbps"]) in line


def test_mixture_png(mixture_run: Run) -> None:
    if not _has_matplotlib():
        assert "no plot" in mixture_run["stdout"] and not os.path.exists(mixture_run["png"])
    pytest.importorskip("matplotlib")
    assert os.path.getsize(mixture_run["png"]) > 0


def test_plot_without_matplotlib_says_so(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.common import gbps_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    json_path = str(tmp_path / "x.json")
    assert gbps_plot(json_path, "t", {"a": {"one": 1.0}}, {"c": 2.0}) is None
    assert "no plot" in capsys.readouterr().out and not os.path.exists(tmp_path / "x.png")


def test_plot_leaves_out_rows_not_run(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.common import gbps_plot

    json_path = str(tmp_path / "x.json")
    png = gbps_plot(json_path, "t", {"a": {"one": 1.0, "two": None}, "b": {"one": 0.5, "two": 0.7}},
                    {"ceiling": 2.0, "gpu ceiling": None})
    assert png == str(tmp_path / "x.png") and os.path.getsize(png) > 0


def test_a_backend_that_cannot_run_here_is_a_row_saying_why(mixture_run: Run) -> None:
    if gpu_available():
        pytest.skip("every backend runs here")
    (row,) = [r for r in mixture_run["doc"]["results"] if r["what"] == "gdsload pinned"]
    assert row["best_single"] is None
    assert row["note"].startswith("not run: backend 'pinned' cannot run here: no usable GPU")
    assert "| gdsload pinned | - | - | - |" in mixture_run["md"] and row["note"] in mixture_run["md"]

