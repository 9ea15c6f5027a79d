#!/usr/bin/env python3
"""Render a benchmark JSON into a markdown table and a PNG bar chart (nothing here measures anything).

    python benchmarks/report.py benchmarks/results/read-2026-11-23-H100-80GB-HBM3.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def best(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Best GB/s per (name, regime): warm runs are repeated, the best is the steady state."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in doc["results"]:
        key = (r["name"], r["regime"])
        if key not in out or r["gb_per_s"] > out[key]["gb_per_s"]:
            out[key] = r
    return out


def markdown(doc: dict[str, Any]) -> str:
    m, d = doc["machine"], doc["dataset"]
    rows = best(doc)
    lines = [
        f"# Read benchmark, {doc['date']}",
        "",
        f"GPU {m.get('gpu')} (driver CUDA {m.get('driver')}, runtime {m.get('cuda_runtime')}, CuPy {m.get('cupy')}), "
        f"KvikIO {m.get('kvikio')}, GDS available: {m.get('is_gds_available')} -> KvikIO io mode "
        f"**{m.get('io_mode')}**; {m.get('cpu_cores')} cores; data on `{m.get('data_filesystem')}`.",
        f"Dataset: {d['bytes'] / 1e9:.2f} GB in {d['shards']} shard files, {d['samples']} samples, "
        f"blocks of {d['block_bytes'] / 2**20:.2f} MiB. Page cache dropped before cold runs: "
        f"{doc['page_cache_dropped']}. Best of the warm repeats; all runs are in the JSON.",
        "",
        "| what | cache | io mode | GB/s | seconds |",
        "|---|---|---|---:|---:|",
    ]
    for (name, regime), r in rows.items():
        lines.append(f"| {name} | {regime} | {r['io_mode']} | {r['gb_per_s']:.2f} | {r['seconds']:.2f} |")
    lines += ["", "Ratios (same run):", ""]

    def g(name: str, regime: str) -> float | None:
        r = rows.get((name, regime))
        return r["gb_per_s"] if r else None

    raw, naive, disk = g("raw-kvikio-whole-files", "warm"), g("naive-fromfile-asarray", "warm"), \
        g("disk-odirect-ceiling", "cold")
    for backend in ("kvikio", "pinned"):
        warm, cold = g(f"gdsload-{backend}", "warm"), g(f"gdsload-{backend}", "cold")
        parts = []
        if warm and raw:
            parts.append(f"warm {warm / raw:.0%} of raw KvikIO")
        if warm and naive:
            parts.append(f"warm {warm / naive:.1f}x naive")
        if cold and disk:
            parts.append(f"cold {cold / disk:.0%} of the O_DIRECT disk ceiling")
        if parts:
            lines.append(f"- gdsload {backend}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = best(doc)
    labels = [f"{n}\n({r})" if r != "-" else n for n, r in rows]
    values = [v["gb_per_s"] for v in rows.values()]
    colors = ["#888888" if "ceiling" in n else "#2b7bba" if n.startswith("gdsload") else "#e08a2b"
              for n, _ in rows]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.5))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=8)
    m = doc["machine"]
    ax.set_xlabel("GB/s: contenders into device memory; ceilings (grey) for their stage alone. Blue: gdsload")
    ax.set_title(f"{m.get('gpu')}, KvikIO io mode {m.get('io_mode')}, {doc['dataset']['bytes'] / 1e9:.1f} GB, "
                 f"{doc['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str]) -> int:
    for path in argv:
        doc = json.load(open(path))
        base = os.path.splitext(path)[0]
        with open(base + ".md", "w") as f:
            f.write(markdown(doc))
        plot(doc, base + ".png")
        print(f"wrote {base}.md and {base}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
