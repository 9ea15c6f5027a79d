"""benchmarks.compression_report renders a compression JSON as it stands: the per-kind tables with the run's
figures, the acceptance checks' PASS / FAIL / not measured from constructed figures, the chunk sweep, the
summary, and the PNG where matplotlib imports. Documents are built here (one from a real CPU run, one shaped
like a GPU run); nothing is measured."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from benchmarks.compression_report import checks, fmt, nvcomp_ceiling, render, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _pass(data: str, backend: str, stored: str, ratio: float, warm: float, cpu: float, io: str,
          **extra: Any) -> dict[str, Any]:
    decode = {} if stored == "raw" else {data: "cpu threads" if backend == "cpu" else "nvcomp", "label": "cpu threads"}
    return {"kind": "pass", "data": data, "backend": backend, "stored": stored, "ratio": ratio,
            "decoded_bytes": 4194304, "decode": decode, "warm_gbps": warm, "warm_cpu_core_s_per_gb": cpu,
            "io_mode": io, **extra}


def cpu_doc() -> dict[str, Any]:
    """A real CPU run (``--backends cpu --tiny``): warm only, one zarr mode, no nvCOMP."""
    rows: list[dict[str, Any]] = []
    for data, ratio, raw, zstd, zarr in (("tokens", 0.406846284866333, (1.1789337474705939, 1.0320598323170542),
                                          (0.24506098566382167, 5.948218368902419),
                                          (0.47859170510890975, 2.8629302978515137)),
                                         ("images", 0.7998070557071209, (0.5277417945932582, 2.168170465754827),
                                          (0.23607066126915455, 4.8801126466037115),
                                          (0.453398714761333, 2.794133369990237)),
                                         ("float16", 0.8690907955169678, (1.3558088201254892, 0.8034316482247404),
                                          (0.5044964134185231, 3.338171814202351),
                                          (0.6352771039655226, 2.0723342895507626))):
        rows += [_pass(data, "cpu", "raw", 1.0, *raw, "cpu"), _pass(data, "cpu", "zstd", ratio, *zstd, "cpu"),
                 {"kind": "zarr", "mode": "numpy", "gbps": zarr[0], "cpu_core_s_per_gb": zarr[1],
                  "array_type": "numpy", "data": data, "ratio": ratio}]
    rows += [{"kind": "chunk", "data": "tokens", "chunk_bytes": 65536, "ratio": 0.408916711807251,
              "warm_gbps": {"cpu": 0.21912348207765575}},
             {"kind": "chunk", "data": "tokens", "chunk_bytes": 262144, "ratio": 0.41914820671081543,
              "warm_gbps": {"cpu": 0.3447342629258412}}]
    return {"benchmark": "compression", "date": "2026-11-23",
            "machine": {"python": "3.11.7", "cpu_cores": 2, "numpy": "2.4.6", "zarr": "3.1.6", "gdsload": "0.1.0",
                        "gpu": None, "reason": "ModuleNotFoundError: No module named 'cupy'",
                        "data_filesystem": "/dev/vda 252G 25G 77G 25% /"},
            "notes": ["tokens: synthetic Zipf-distributed int32 stream (no text corpus on this machine)"],
            "settings": {"backends": ["cpu"], "size_bytes": 4194304, "level": 3, "tiny": True,
                         "chunk_sizes": [65536, 262144]},
            "results": rows}


def gpu_doc() -> dict[str, Any]:
    """Shaped like a GPU run, with figures picked so each check has a known verdict: tokens cold kvikio 2.5x
    (PASS), pinned 1.5x (FAIL), mmap unmeasured (None); warm tokens 12x zarr (PASS), images 4x (FAIL), float16
    with zarr failing in both modes (not measured); nvCOMP best at 512 KiB (40 GB/s), absent at 4 MiB."""
    cold = {("kvikio", "raw"): 2.0, ("kvikio", "zstd"): 5.0, ("pinned", "raw"): 2.0, ("pinned", "zstd"): 3.0,
            ("mmap", "raw"): None, ("mmap", "zstd"): None}
    warm = {"tokens": {"kvikio": (8.0, 12.0), "pinned": (7.5, 10.0), "mmap": (6.0, 9.0)},
            "images": {"kvikio": (8.0, 4.0), "pinned": (7.0, 3.5), "mmap": (6.0, 2.0)},
            "float16": {"kvikio": (8.0, 6.0), "pinned": (7.0, 5.5), "mmap": (6.0, 5.0)}}
    ratios = {"tokens": 0.4, "images": 0.8, "float16": 0.5}
    io = {"kvikio": "gds", "pinned": "pinned", "mmap": "mmap"}
    rows: list[dict[str, Any]] = []
    for data, per_backend in warm.items():
        for b, (raw, zstd) in per_backend.items():
            for stored, gbps in (("raw", raw), ("zstd", zstd)):
                extra = {"cold_gbps": cold[b, stored] if data == "tokens" else 1.5}
                if extra["cold_gbps"] is not None:
                    extra["cold_cpu_core_s_per_gb"] = 0.25
                rows.append(_pass(data, b, stored, 1.0 if stored == "raw" else ratios[data], gbps, 0.125, io[b],
                                  **extra))
        if data == "float16":
            rows += [{"kind": "zarr", "mode": m, "error": "ImportError: no nvidia codecs | here", "data": data,
                      "ratio": ratios[data]} for m in ("numpy+asarray", "enable_gpu")]
        else:
            rows += [{"kind": "zarr", "mode": "numpy+asarray", "gbps": 1.0 if data == "tokens" else 0.5,
                      "cpu_core_s_per_gb": 3.0, "array_type": "cupy", "data": data, "ratio": ratios[data]},
                     {"kind": "zarr", "mode": "enable_gpu", "gbps": 0.75 if data == "tokens" else 1.0,
                      "cpu_core_s_per_gb": 1.0, "array_type": "cupy", "data": data, "ratio": ratios[data]}]
    for chunk, nv, w in ((4 << 20, None, {"kvikio": 11.0, "pinned": 9.0, "mmap": 8.0}),
                         (64 << 10, 20.0, {"kvikio": 6.0, "pinned": 5.0, "mmap": 4.0}),
                         (512 << 10, 40.0, {"kvikio": 12.0, "pinned": 10.0, "mmap": 9.0})):
        rows.append({"kind": "chunk", "data": "tokens", "chunk_bytes": chunk, "ratio": 0.4,
                     "nvcomp_decode_gbps": nv, "warm_gbps": w})
    return {"benchmark": "compression", "date": "2026-12-01",
            "machine": {"python": "3.11.7", "cpu_cores": 16, "numpy": "2.4.6", "zarr": "3.1.6", "gdsload": "0.1.0",
                        "gpu": "NVIDIA H100 80GB HBM3", "driver": "12.8", "cuda_runtime": "12.8", "cupy": "13.6.0",
                        "kvikio": "25.10", "is_gds_available": True, "data_filesystem": "/dev/nvme0n1 3.5T /data"},
            "notes": ["tokens: synthetic Zipf-distributed int32 stream (no text corpus on this machine)",
                      "a second note | kept verbatim"],
            "settings": {"backends": ["kvikio", "pinned", "mmap"], "size_bytes": 1 << 30, "level": 3, "tiny": False,
                         "chunk_sizes": [65536, 524288, 4194304]},
            "results": rows}


def write(tmp_path: Any, doc: dict[str, Any], name: str = "compression.json") -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def rendered(tmp_path: Any, doc: dict[str, Any], name: str = "compression.json") -> tuple[list[str], str]:
    written = render(write(tmp_path, doc, name))
    with open(written[0]) as f:
        return written, f.read()


def test_fmt_rounds_and_marks_missing() -> None:
    assert [fmt(v) for v in (None, 0.24506098566382167, 1.1789337474705939, 12.34, 1234.5, 0.0)] == \
        ["-", "0.245", "1.18", "12.3", "1234", "0.0"]


def test_cpu_run_tables_checks_and_sweep(tmp_path: Any) -> None:
    written, md = rendered(tmp_path, cpu_doc())
    assert written[0] == os.path.join(tmp_path, "compression.md")
    assert md.startswith("# gdsload compression benchmark, 2026-11-23")
    assert "No GPU (ModuleNotFoundError: No module named 'cupy'); 2 cores" in md
    assert 'Settings: backends ["cpu"], size_bytes 4194304, level 3, tiny true, chunk_sizes [65536, 262144].' in md
    assert "io mode per backend: cpu: cpu." in md
    assert "Note: tokens: synthetic Zipf-distributed int32 stream (no text corpus on this machine)" in md
    assert "| cpu | raw | 1.00x | cpu | 1.18 | - | 1.03 | - | - |" in md
    assert "| cpu | zstd | 2.46x | cpu | 0.245 | - | 5.95 | - | tokens: cpu threads, label: cpu threads |" in md
    assert "| cpu | zstd | 1.25x | cpu | 0.236 | - | 4.88 | - | images: cpu threads, label: cpu threads |" in md
    assert "| numpy | numpy | 0.479 | 2.86 |" in md and "| numpy | numpy | 0.635 | 2.07 |" in md
    assert "- cold, tokens, cpu: zstd - GB/s / raw - GB/s (target >= 2.0x) -> not measured" in md
    assert ("- warm, zstd, tokens: best gdsload 0.245 GB/s (cpu) / best zarr-python 0.479 GB/s (numpy) = 0.512x "
            "(target >= 5.0x) -> FAIL; nvCOMP decode ceiling - GB/s (not measured)") in md
    assert "| chunk KiB | decoded:stored | nvCOMP decode GB/s | warm GB/s cpu |" in md
    assert "| 64 | 2.45x | - | 0.219 |" in md and "| 256 | 2.39x | - | 0.345 |" in md
    assert "## compression-summary" in md
    assert "| tokens | 2.46x | 1.18 (cpu) | 0.245 (cpu) | - | - | 0.479 (numpy) |" in md
    assert md.index("## tokens") < md.index("## images") < md.index("## float16") < md.index("## Acceptance")


def test_gpu_run_checks_pass_fail_and_not_measured(tmp_path: Any) -> None:
    written, md = rendered(tmp_path, gpu_doc(), "compression-h100.json")
    assert written[0] == os.path.join(tmp_path, "compression-h100.md")
    assert "GPU NVIDIA H100 80GB HBM3 (driver CUDA 12.8" in md and "GDS available: True" in md
    assert "io mode per backend: kvikio: gds; pinned: pinned; mmap: mmap." in md
    assert "Note: a second note | kept verbatim" in md
    lines = [line for line in md.splitlines() if line.startswith("- ")]
    assert lines[:3] == [
        "- cold, tokens, kvikio: zstd 5.00 GB/s / raw 2.00 GB/s = 2.5x (target >= 2.0x) -> PASS",
        "- cold, tokens, pinned: zstd 3.00 GB/s / raw 2.00 GB/s = 1.5x (target >= 2.0x) -> FAIL",
        "- cold, tokens, mmap: zstd - GB/s / raw - GB/s (target >= 2.0x) -> not measured"]
    ceiling = ("; nvCOMP decode ceiling 40.0 GB/s (best of the chunk sweep, 512 KiB chunks, one window's chunks in one "
               "call)")
    assert lines[3:] == [
        "- warm, zstd, tokens: best gdsload 12.0 GB/s (kvikio) / best zarr-python 1.00 GB/s (numpy+asarray) = 12x "
        "(target >= 5.0x) -> PASS" + ceiling,
        "- warm, zstd, images: best gdsload 4.00 GB/s (kvikio) / best zarr-python 1.00 GB/s (enable_gpu) = 4x "
        "(target >= 5.0x) -> FAIL" + ceiling,
        "- warm, zstd, float16: best gdsload 6.00 GB/s (kvikio) / best zarr-python - GB/s (target >= 5.0x) -> "
        "not measured" + ceiling]
    assert "| kvikio | zstd | 2.50x | gds | 12.0 | 5.00 | 0.125 | 0.250 | tokens: nvcomp, label: cpu threads |" in md
    assert "| mmap | raw | 1.00x | mmap | 6.00 | - | 0.125 | - | - |" in md
    assert "| enable_gpu | cupy | 0.750 | 1.00 |" in md
    assert "| enable_gpu | failed: ImportError: no nvidia codecs \\| here | - | - |" in md
    assert ("| chunk KiB | decoded:stored | nvCOMP decode GB/s | warm GB/s kvikio | warm GB/s pinned | "
            "warm GB/s mmap |") in md
    sweep = [line for line in md.splitlines() if line.startswith(("| 64 |", "| 512 |", "| 4096 |"))]
    assert sweep == ["| 64 | 2.50x | 20.0 | 6.00 | 5.00 | 4.00 |", "| 512 | 2.50x | 40.0 | 12.0 | 10.0 | 9.00 |",
                     "| 4096 | 2.50x | - | 11.0 | 9.00 | 8.00 |"]
    assert "| tokens | 2.50x | 8.00 (kvikio) | 12.0 (kvikio) | 2.00 (kvikio) | 5.00 (kvikio) | 1.00 (numpy+asarray) |" \
        in md
    assert "| float16 | 2.00x | 8.00 (kvikio) | 6.00 (kvikio) | 1.50 (kvikio) | 1.50 (kvikio) | - |" in md


def test_nvcomp_ceiling_prefers_the_default_chunk_and_says_how_many_windows_it_decodes_at_once() -> None:
    doc = gpu_doc()
    one = "one window's chunks in one call"  # a run from before the decode step had lanes
    assert nvcomp_ceiling(doc) == (40.0, f"best of the chunk sweep, 512 KiB chunks, {one}")
    doc["settings"]["default_chunk_bytes"] = 64 << 10
    assert nvcomp_ceiling(doc) == (20.0, f"64 KiB chunks, the default, {one}")
    doc["settings"]["decode_lanes"] = 2
    assert nvcomp_ceiling(doc)[1] == ("64 KiB chunks, the default, 2 windows' chunks at once, a call each on streams "
                                      "of their own, as the decode step's lanes run them")
    doc["settings"]["default_chunk_bytes"] = 4 << 20  # measured without nvCOMP there: the best one instead
    assert nvcomp_ceiling(doc)[0] == 40.0
    assert nvcomp_ceiling(cpu_doc()) == (None, "not measured")


def test_checks_on_the_edge_and_without_rows() -> None:
    doc = gpu_doc()
    for r in doc["results"]:
        if r["kind"] == "pass" and r["data"] == "tokens" and r["backend"] == "pinned" and r["stored"] == "zstd":
            r["cold_gbps"] = 4.0  # exactly 2x: meets the target
    assert "-> PASS" in checks(doc)[1]
    doc["results"] = [r for r in doc["results"] if r["kind"] != "pass"]
    assert checks(doc)[0].endswith("-> not measured") and "no gdsload tokens rows" in checks(doc)[0]
    assert all(c.split("; nvCOMP")[0].endswith("not measured") for c in checks(doc))


def test_summary_figures_are_the_rows() -> None:
    s = summarize(gpu_doc())
    assert list(s) == ["tokens", "images", "float16"]
    assert s["tokens"]["warm_zstd_gbps"] == 12.0 and s["tokens"]["warm_zstd_backend"] == "kvikio"
    assert s["tokens"]["cold_zstd_gbps"] == 5.0 and s["tokens"]["decoded_per_stored"] == pytest.approx(2.5)
    assert s["float16"]["zarr_gbps"] is None and s["images"]["zarr_mode"] == "enable_gpu"
    assert summarize(cpu_doc())["images"]["cold_raw_gbps"] is None


def test_png_when_matplotlib_imports(tmp_path: Any) -> None:
    for i, doc in enumerate((cpu_doc(), gpu_doc())):
        written, _ = rendered(tmp_path, doc, f"compression-{i}.json")
        png = os.path.join(tmp_path, f"compression-{i}.png")
        if HAS_MPL:
            assert written == [os.path.join(tmp_path, f"compression-{i}.md"), png] and os.path.getsize(png) > 0
        else:
            assert written == [os.path.join(tmp_path, f"compression-{i}.md")] and not os.path.exists(png)


def test_without_matplotlib_the_png_is_left_out(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    written, _ = rendered(tmp_path, gpu_doc())
    assert written == [os.path.join(tmp_path, "compression.md")]
    assert not os.path.exists(os.path.join(tmp_path, "compression.png")) and "no plot (" in capsys.readouterr().out


def test_no_chunk_rows_and_other_documents(tmp_path: Any) -> None:
    doc = copy.deepcopy(cpu_doc())
    doc["results"] = [r for r in doc["results"] if r["kind"] != "chunk"]
    _, md = rendered(tmp_path, doc)
    assert "No chunk rows in this run." in md
    bad = write(tmp_path, {"benchmark": "suite", "results": []}, "other.json")
    with pytest.raises(ValueError, match="not a compression benchmark result"):
        render(bad)


def test_command_line(tmp_path: Any) -> None:
    path = write(tmp_path, cpu_doc(), "compression-cli.json")
    done = subprocess.run([sys.executable, "-m", "benchmarks.compression_report", path], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {os.path.join(tmp_path, 'compression-cli.md')}" in done.stdout


def test_ceilings_and_the_mmap_cold_split_are_shown(tmp_path: Any) -> None:
    doc = gpu_doc()
    doc["results"] += [
        {"kind": "ceiling", "what": "disk", "data": "tokens", "stored": "raw", "ratio": 1.0, "stored_gbps": 1.5123},
        {"kind": "ceiling", "what": "disk", "data": "tokens", "stored": "zstd", "ratio": 0.25, "stored_gbps": 1.25},
        {"kind": "ceiling", "what": "disk", "data": "images", "stored": "raw", "ratio": 1.0,
         "error": "OSError: O_DIRECT refused"},
        {"kind": "ceiling", "what": "h2d", "gbps": 54.97, "io_mode": "cuda-memcpy"}]
    mmap = next(r for r in doc["results"] if r.get("kind") == "pass" and r["backend"] == "mmap")
    mmap.update(cold_open_s=0.4012, cold_pass_s=0.3349)
    _, text = rendered(tmp_path, doc)
    assert ("Ceilings: disk, cold O_DIRECT reads of the store's files: raw store 1.51 GB/s; zstd store 1.25 GB/s "
            "stored = 5.00 GB/s decoded.") in text
    assert "raw store not measured (OSError: O_DIRECT refused)" in text
    assert text.count("Pinned host-to-device copy: 55.0 GB/s.") == len({r["data"] for r in doc["results"]
                                                                         if r.get("kind") == "pass"})
    assert "(open 0.40 s + pass 0.33 s)" in text
