"""Render a compression JSON (what ``benchmarks.compression`` writes) beside it: ``compression[-TAG].md`` with
the per-kind tables, the issue's acceptance checks, the chunk sweep and the summary figures, and
``compression[-TAG].png`` when matplotlib imports. Nothing here measures anything: every figure printed is one
of the JSON's, rounded; a figure the run did not measure shows ``-`` (a check on it: "not measured").

    python -m benchmarks.compression_report benchmarks/results/H200/compression.json
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from .common import load_result, save_figure, write_report

#: The acceptance targets: cold tokens zstd/raw per backend, and warm zstd gdsload / zarr-python per kind.
COLD_TARGET = 2.0
WARM_TARGET = 5.0


def fmt(v: Any) -> str:
    """A figure rounded to 3 significant digits (no exponent); ``-`` for None or absent."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if v == 0 or not math.isfinite(v):
        return str(v)
    digits = max(0, 2 - math.floor(math.log10(abs(v))))
    return f"{v:.{digits}f}"


def decoded_per_stored(ratio: float | None) -> str:
    """The compression ratio as decoded:stored (``2.46x`` for a stored/decoded ratio of 0.407)."""
    return "-" if not ratio else f"{1 / ratio:.2f}x"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:g}"


def passes(doc: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    """The ``pass`` rows whose fields equal ``match``."""
    return [r for r in doc["results"] if r.get("kind") == "pass" and all(r.get(k) == v for k, v in match.items())]


def zarr_rows(doc: dict[str, Any], data: str) -> list[dict[str, Any]]:
    """The zarr-python rows of one data kind (with figures or an ``error``)."""
    return [r for r in doc["results"] if r.get("kind") == "zarr" and r.get("data") == data]


def chunk_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunk sweep's rows, smallest chunk first."""
    return sorted((r for r in doc["results"] if r.get("kind") == "chunk"), key=lambda r: r["chunk_bytes"])


def kinds(doc: dict[str, Any]) -> list[str]:
    """The data kinds of the pass and zarr rows, in the run's order."""
    return list(dict.fromkeys(r["data"] for r in doc["results"] if r.get("kind") in ("pass", "zarr")))


def backends(doc: dict[str, Any]) -> list[str]:
    """The gdsload backends of the pass and chunk rows, in the run's order."""
    out = [r["backend"] for r in passes(doc)]
    for r in chunk_rows(doc):
        out += list(r.get("warm_gbps") or {})
    return list(dict.fromkeys(out))


def nvcomp_ceiling(doc: dict[str, Any]) -> tuple[float | None, str]:
    """nvCOMP's decode GB/s alone and where it comes from: the chunk row of the settings' default chunk
    (``default_chunk_bytes`` or ``chunk_bytes``) when it has the figure, else the best chunk row's."""
    s = doc.get("settings") or {}
    default = s.get("default_chunk_bytes", s.get("chunk_bytes"))
    rows = [r for r in chunk_rows(doc) if r.get("nvcomp_decode_gbps") is not None]
    for r in rows:
        if default is not None and r["chunk_bytes"] == default:
            return r["nvcomp_decode_gbps"], f"{_kib(r['chunk_bytes'])} KiB chunks, the default, {_windows(doc)}"
    if not rows:
        return None, "not measured"
    best = max(rows, key=lambda r: r["nvcomp_decode_gbps"])
    return best["nvcomp_decode_gbps"], (f"best of the chunk sweep, {_kib(best['chunk_bytes'])} KiB chunks, "
                                        f"{_windows(doc)}")


def _windows(doc: dict[str, Any]) -> str:
    """How many windows' chunks the ceiling decodes at once: the decode step's lanes (one before it had lanes)."""
    lanes = (doc.get("settings") or {}).get("decode_lanes") or 1
    return ("one window's chunks in one call" if lanes == 1 else
            f"{lanes} windows' chunks at once, a call each on streams of their own, as the decode step's lanes run "
            "them")


def best_zarr(doc: dict[str, Any], data: str) -> dict[str, Any] | None:
    """The fastest zarr-python row of one kind among those that ran; None if none did."""
    ok = [r for r in zarr_rows(doc, data) if "error" not in r and r.get("gbps") is not None]
    return max(ok, key=lambda r: r["gbps"], default=None)


def best_pass(doc: dict[str, Any], data: str, stored: str, key: str = "warm_gbps") -> dict[str, Any] | None:
    """The gdsload pass row of one kind and storage with the highest ``key``; None if none has it."""
    rows = [r for r in passes(doc, data=data, stored=stored) if r.get(key) is not None]
    return max(rows, key=lambda r: r[key], default=None)


def _which(row: dict[str, Any] | None, key: str) -> str:
    return f" ({row[key]})" if row else ""


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def checks(doc: dict[str, Any]) -> list[str]:
    """The issue's acceptance checks, one line each, with the figures compared and PASS, FAIL or not measured:
    (a) per backend, tokens zstd cold GB/s >= 2x raw cold GB/s; (b) per kind, the best gdsload zstd warm GB/s
    >= 5x the best zarr-python GB/s, nvCOMP's decode ceiling beside it."""
    out = []
    token_backends = list(dict.fromkeys(r["backend"] for r in passes(doc, data="tokens")))
    for b in token_backends:
        raw, zstd = (next((r.get("cold_gbps") for r in passes(doc, data="tokens", backend=b, stored=s)), None)
                     for s in ("raw", "zstd"))
        head = f"cold, tokens, {b}: zstd {fmt(zstd)} GB/s / raw {fmt(raw)} GB/s"
        if raw is None or zstd is None or raw <= 0:
            out.append(f"{head} (target >= {COLD_TARGET}x) -> not measured")
        else:
            out.append(f"{head} = {zstd / raw:.3g}x (target >= {COLD_TARGET}x) -> "
                       f"{_verdict(zstd >= COLD_TARGET * raw)}")
    if not token_backends:
        out.append(f"cold, tokens: no gdsload tokens rows (target >= {COLD_TARGET}x) -> not measured")
    ceiling, where = nvcomp_ceiling(doc)
    for data in kinds(doc):
        g, z = best_pass(doc, data, "zstd"), best_zarr(doc, data)
        head = (f"warm, zstd, {data}: best gdsload {fmt(g and g['warm_gbps'])} GB/s{_which(g, 'backend')} / "
                f"best zarr-python {fmt(z and z['gbps'])} GB/s{_which(z, 'mode')}")
        tail = f"; nvCOMP decode ceiling {fmt(ceiling)} GB/s ({where})"
        if g is None or z is None or z["gbps"] <= 0:
            out.append(f"{head} (target >= {WARM_TARGET}x) -> not measured{tail}")
        else:
            v = g["warm_gbps"] / z["gbps"]
            out.append(f"{head} = {v:.3g}x (target >= {WARM_TARGET}x) -> "
                       f"{_verdict(g['warm_gbps'] >= WARM_TARGET * z['gbps'])}{tail}")
    return out


def summarize(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compression-summary figures, per data kind (None: not measured): decoded:stored ratio, best warm
    GB/s raw and zstd (and their backends), best cold GB/s raw and zstd, best zarr-python GB/s."""
    out: dict[str, dict[str, Any]] = {}
    for data in kinds(doc):
        zstd = passes(doc, data=data, stored="zstd")
        ratio = next((r["ratio"] for r in zstd + zarr_rows(doc, data) if r.get("ratio")), None)
        fig: dict[str, Any] = {"decoded_per_stored": None if ratio is None else 1 / ratio}
        for stored in ("raw", "zstd"):
            for regime in ("warm", "cold"):
                r = best_pass(doc, data, stored, f"{regime}_gbps")
                fig[f"{regime}_{stored}_gbps"] = r and r[f"{regime}_gbps"]
                fig[f"{regime}_{stored}_backend"] = r and r["backend"]
        z = best_zarr(doc, data)
        fig["zarr_gbps"], fig["zarr_mode"] = z and z["gbps"], z and z["mode"]
        out[data] = fig
    return out


def _header(doc: dict[str, Any]) -> list[str]:
    m, s = doc.get("machine") or {}, doc.get("settings") or {}
    if m.get("gpu"):
        machine = (f"GPU {m['gpu']} (driver CUDA {m.get('driver', '-')}, runtime {m.get('cuda_runtime', '-')}, "
                   f"CuPy {m.get('cupy', '-')}, KvikIO {m.get('kvikio', '-')}, GDS available: "
                   f"{m.get('is_gds_available', '-')})")
    else:
        machine = f"No GPU ({m.get('reason', '-')})"
    io: dict[str, list[str]] = {}
    for r in passes(doc):
        io.setdefault(r["backend"], [])
        if r.get("io_mode") not in io[r["backend"]]:
            io[r["backend"]].append(r.get("io_mode"))
    lines = [f"# gdsload compression benchmark, {doc.get('date')}", "",
             f"{machine}; {m.get('cpu_cores')} cores; Python {m.get('python')}, numpy {m.get('numpy')}, zarr "
             f"{m.get('zarr')}, gdsload {m.get('gdsload')}; data on `{m.get('data_filesystem')}`.", "",
             "Settings: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in s.items()) + ".", "",
             "io mode per backend: " + ("; ".join(f"{b}: {', '.join(map(str, modes))}" for b, modes in io.items())
                                        or "no gdsload passes") + ".", ""]
    lines += [f"Note: {n}" for n in doc.get("notes") or []] + ([""] if doc.get("notes") else [])
    lines += ["GB/s are of decoded data delivered; decoded:stored is the compression ratio (1.00x raw); cold: "
              "page cache dropped first (`-`: not measured in this run).", ""]
    return lines


def ceiling_rows(doc: dict[str, Any], what: str, data: str | None = None) -> list[dict[str, Any]]:
    """The ``ceiling`` rows of one kind (``disk``: per store; ``h2d``: one per run, no data kind)."""
    return [r for r in doc["results"] if r.get("kind") == "ceiling" and r.get("what") == what
            and (data is None or r.get("data") == data)]


def _ceiling_lines(doc: dict[str, Any], data: str) -> list[str]:
    """The disk ceiling of each store (stored GB/s; for a compressed one, also the decoded GB/s a decoder
    keeping up would deliver) and the run's pinned host-to-device copy rate."""
    parts = []
    for r in ceiling_rows(doc, "disk", data):
        if "error" in r:
            parts.append(f"{r['stored']} store not measured ({_cell(r['error'])})")
        elif r.get("ratio") and r["ratio"] != 1.0:
            parts.append(f"{r['stored']} store {fmt(r['stored_gbps'])} GB/s stored = "
                         f"{fmt(r['stored_gbps'] / r['ratio'])} GB/s decoded")
        else:
            parts.append(f"{r['stored']} store {fmt(r['stored_gbps'])} GB/s")
    h2d = ceiling_rows(doc, "h2d")
    lines = []
    if parts:
        lines.append("Ceilings: disk, cold O_DIRECT reads of the store's files: " + "; ".join(parts) + ".")
    if h2d:
        lines.append(f"Pinned host-to-device copy: {fmt(h2d[0].get('gbps'))} GB/s.")
    return lines + ([""] if lines else [])


def _cold(r: dict[str, Any]) -> str:
    """The cold GB/s; for a row timed from the open (mmap), the open's and the pass's seconds after it."""
    if r.get("cold_open_s") is None:
        return fmt(r.get("cold_gbps"))
    return f"{fmt(r.get('cold_gbps'))} (open {r['cold_open_s']:.2f} s + pass {r['cold_pass_s']:.2f} s)"


def _kind_tables(doc: dict[str, Any], data: str) -> list[str]:
    lines = [f"## {data}", "", *_ceiling_lines(doc, data),
             "| backend | stored | decoded:stored | io mode | warm GB/s | cold GB/s | "
             "warm CPU core-s/GB | cold CPU core-s/GB | decoded where |", "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in passes(doc, data=data):
        where = ", ".join(f"{k}: {v}" for k, v in (r.get("decode") or {}).items()) or "-"
        lines.append(f"| {r['backend']} | {r['stored']} | {decoded_per_stored(r.get('ratio'))} | "
                     f"{r.get('io_mode', '-')} | {fmt(r.get('warm_gbps'))} | {_cold(r)} | "
                     f"{fmt(r.get('warm_cpu_core_s_per_gb'))} | {fmt(r.get('cold_cpu_core_s_per_gb'))} | "
                     f"{_cell(where)} |")
    z = zarr_rows(doc, data)
    if z:
        lines += ["", f"zarr-python reading the same zstd store ({data}):", "",
                  "| mode | array type | GB/s | CPU core-s/GB |", "|---|---|---:|---:|"]
        for r in z:
            if "error" in r:
                lines.append(f"| {r['mode']} | failed: {_cell(r['error'])} | - | - |")
            else:
                lines.append(f"| {r['mode']} | {r.get('array_type', '-')} | {fmt(r.get('gbps'))} | "
                             f"{fmt(r.get('cpu_core_s_per_gb'))} |")
    return lines + [""]


def _chunk_table(doc: dict[str, Any]) -> list[str]:
    rows = chunk_rows(doc)
    if not rows:
        return ["## Chunk sweep", "", "No chunk rows in this run.", ""]
    bs = list(dict.fromkeys(b for r in rows for b in (r.get("warm_gbps") or {})))
    lines = ["## Chunk sweep (tokens, zstd)", "", f"nvCOMP decode: its batched decode alone on {_windows(doc)}, "
             "already in device memory; warm: a gdsload pass over the tokens written with that chunk.", "",
             "| chunk KiB | decoded:stored | nvCOMP decode GB/s | " + " | ".join(f"warm GB/s {b}" for b in bs) + " |",
             "|---:|---:|---:|" + "---:|" * len(bs)]
    for r in rows:
        warm = r.get("warm_gbps") or {}
        lines.append(f"| {_kib(r['chunk_bytes'])} | {decoded_per_stored(r.get('ratio'))} | "
                     f"{fmt(r.get('nvcomp_decode_gbps'))} | " + " | ".join(fmt(warm.get(b)) for b in bs) + " |")
    return lines + [""]


def _summary_table(doc: dict[str, Any]) -> list[str]:
    def with_backend(fig: dict[str, Any], key: str) -> str:
        return fmt(fig[f"{key}_gbps"]) + (f" ({fig[f'{key}_backend']})" if fig[f"{key}_backend"] else "")

    ceiling, where = nvcomp_ceiling(doc)
    lines = ["## compression-summary", "", f"nvCOMP decode ceiling: {fmt(ceiling)} GB/s ({where}).", "",
             "| data | decoded:stored | warm raw GB/s | warm zstd GB/s | cold raw GB/s | cold zstd GB/s | "
             "zarr-python GB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for data, fig in summarize(doc).items():
        ratio = fig["decoded_per_stored"]
        lines.append(f"| {data} | {'-' if ratio is None else f'{ratio:.2f}x'} | {with_backend(fig, 'warm_raw')} | "
                     f"{with_backend(fig, 'warm_zstd')} | {with_backend(fig, 'cold_raw')} | "
                     f"{with_backend(fig, 'cold_zstd')} | {fmt(fig['zarr_gbps'])}"
                     + (f" ({fig['zarr_mode']})" if fig["zarr_mode"] else "") + " |")
    return lines + ["", "Best over backends (in brackets) and over zarr-python's modes that ran.", ""]


def markdown(doc: dict[str, Any]) -> str:
    """The whole report: header, per-kind tables, acceptance checks, chunk sweep, summary figures."""
    lines = _header(doc)
    for data in kinds(doc):
        lines += _kind_tables(doc, data)
    lines += ["## Acceptance checks", ""] + [f"- {c}" for c in checks(doc)] + [""]
    lines += _chunk_table(doc) + _summary_table(doc)
    return "\n".join(lines).rstrip("\n") + "\n"


def plot(doc: dict[str, Any], png: str) -> None:
    """Warm GB/s per kind and backend (raw beside zstd), and decode GB/s against chunk size (log2 axis).
    Raises ImportError without matplotlib. Missing figures are left out, not drawn as zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    groups = [(d, b) for d in kinds(doc) for b in dict.fromkeys(r["backend"] for r in passes(doc, data=d))]
    for i, stored in enumerate(("raw", "zstd")):
        xs, ys = [], []
        for g, (d, b) in enumerate(groups):
            v = next((r.get("warm_gbps") for r in passes(doc, data=d, backend=b, stored=stored)), None)
            if v is not None:
                xs.append(g + (i - 0.5) * 0.4)
                ys.append(v)
        left.bar(xs, ys, width=0.4, label=stored, color="#888888" if stored == "raw" else "#2b7bba")
    left.set_xticks(range(len(groups)), [f"{d}\n{b}" for d, b in groups], fontsize=8)
    left.set_ylabel("warm GB/s of decoded data")
    left.set_title("gdsload warm passes, raw vs zstd")
    left.legend()
    rows = chunk_rows(doc)
    series = {"nvCOMP decode": [r.get("nvcomp_decode_gbps") for r in rows]}
    for b in dict.fromkeys(b for r in rows for b in (r.get("warm_gbps") or {})):
        series[f"warm {b}"] = [(r.get("warm_gbps") or {}).get(b) for r in rows]
    for name, values in series.items():
        pts = [(r["chunk_bytes"] / 1024, v) for r, v in zip(rows, values) if v is not None]
        if pts:
            right.plot(*zip(*pts), marker="o", label=name)
    right.set_xscale("log", base=2)
    if rows:
        right.set_xticks([r["chunk_bytes"] / 1024 for r in rows], [_kib(r["chunk_bytes"]) for r in rows])
        right.set_ylim(bottom=0)
    right.set_xlabel("inner chunk KiB (tokens, zstd)")
    right.set_ylabel("GB/s of decoded data")
    nv = any(v is not None for v in series["nvCOMP decode"])
    right.set_title(("decode vs chunk size" + ("" if nv else " (nvCOMP decode not measured)")) if rows
                    else "no chunk rows in this run")
    if right.get_legend_handles_labels()[0]:
        right.legend()
    m = doc.get("machine") or {}
    fig.suptitle(f"{m.get('gpu') or 'no GPU'}, zstd level {(doc.get('settings') or {}).get('level')}, "
                 f"{doc.get('date')}", fontsize=10)
    save_figure(fig, png)


def load(path: str) -> dict[str, Any]:
    """A compression JSON, refused unless its ``benchmark`` is ``compression``."""
    return load_result(path, lambda doc: None if isinstance(doc, dict) and doc.get("benchmark") == "compression"
                       else "not a compression benchmark result")


def render(path: str) -> list[str]:
    """Write ``<path without .json>.md`` (and ``.png`` when matplotlib imports; otherwise say so) beside the
    compression JSON at ``path``; returns the paths written."""
    doc = load(path)
    return write_report(path, markdown(doc), lambda png: plot(doc, png), "python -m benchmarks.compression_report")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("wrote", ", ".join(render(p)))
