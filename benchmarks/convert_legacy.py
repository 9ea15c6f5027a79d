"""One-off: convert the last run.py suite JSON (the old shape) into the suite's one shape (schema 1), the
measured values unchanged. Used once for 2026-11-23-H100-80GB-HBM3-full.json; removed afterwards.

    python -m benchmarks.convert_legacy OLD.json NEW.json
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from . import report
from .common import write_json


def convert_row(r: dict[str, Any]) -> dict[str, Any]:
    name, config = r["name"], r.get("config", "")
    row = {"kind": "contender", **r}
    m = re.match(r"gdsload (\w+)( \+ training step)?$", name)
    if name.startswith(("ceiling:", "raw KvikIO")):
        row["kind"] = "ceiling"
    elif m and m.group(2):
        factor = re.match(r"step = ([\d.]+) x", config)
        row.update(kind="step", backend=m.group(1), step_factor=float(factor.group(1)) if factor else None)
    elif m:
        threads = re.search(r"threads=(\d+)", config)
        t = int(threads.group(1)) if threads else None
        row.update(kind="gdsload", backend=m.group(1), shuffle="shuffle=True" in config, threads=t,
                   default=t in (None, 16))
    elif name.endswith("+ training step"):
        row["kind"] = "step"
    stats = {new: row.pop(old) for old, new in (("reader", "reader"), ("pinned_pool_bytes", "pool_bytes"),
                                                ("register_s", "open_s"), ("preload_s", "preload_s")) if old in row}
    if row.get("backend") == "mmap" and "peak_pinned_bytes" in row:
        stats["locked_bytes"] = row["peak_pinned_bytes"]
    if stats:
        row["backend_stats"] = stats
    return row


def convert(old: dict[str, Any], source: str) -> dict[str, Any]:
    backends = list(dict.fromkeys(r["backend"] for r in map(convert_row, old["results"]) if r.get("backend")))
    sizes = sorted({float(r["dataset"].split("GiB")[0]) for r in old["results"] if r["dataset"] != "-"})
    return {"schema": report.SCHEMA, "benchmark": "benchmarks.suite", "mode": old["mode"], "date": old["date"],
            "machine": old["machine"], "auto_backend": None,
            "settings": {"backends": backends, "sizes_gib": sizes, "batch_size": old["batch_size"],
                         "sample_bytes": old["sample_bytes"], "repeats": 3, "stall_repeats": 3,
                         "batches_ahead": None, "dataset_options": {},
                         "page_cache_dropped": old["page_cache_dropped"]},
            "elapsed_s": old["elapsed_s"], "results": [convert_row(r) for r in old["results"]],
            "converted_from": {
                "file": source, "writer": "benchmarks/run.py (" + old["mode"] + ")",
                "how": "benchmarks/convert_legacy.py (one-off, removed after use; see git history): every "
                       "measured value copied unchanged; rows labelled with kind, backend, shuffle, threads, "
                       "default and step_factor parsed from their names and configs; pinned and mmap extras "
                       "moved under backend_stats (reader, pinned_pool_bytes -> pool_bytes, register_s -> "
                       "open_s, preload_s, mmap's peak_pinned_bytes -> locked_bytes)."},
            "notes": ["Converted from the last run of the former benchmarks/run.py --full (same measured values). "
                      "Not measured by that run, so null in summary.json: backend auto, raw KvikIO of the same "
                      "blocks shuffled, startup (open and first batch) per backend. The lead replaces this file "
                      "with a fresh run of benchmarks.suite."]}


def main(argv: list[str]) -> int:
    src, dst = argv
    with open(src) as f:
        old = json.load(f)
    write_json(dst, convert(old, "benchmarks/results/" + src.rsplit("/", 1)[-1]))
    report.render(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
