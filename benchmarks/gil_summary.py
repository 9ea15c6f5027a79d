#!/usr/bin/env python3
"""Summarise a py-spy raw profile taken with ``--threads`` (and ``--gil``: only samples of the thread that
holds the GIL): samples per thread, and per thread the functions they were in, deepest gdsload frame
first. Prints markdown; the raw file itself is too large to keep.

    py-spy record --gil --threads --format raw -o gil.raw -- python3 benchmarks/probe_step.py ...
    python benchmarks/gil_summary.py gil.raw --top 12
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict


def frame_label(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py:123)``."""
    m = re.match(r"(.*) \((?:.*/)?([^/]+:\d+)\)$", frame.strip())
    return f"{m.group(1)} ({m.group(2)})" if m else frame.strip()


def summarise(lines: list[str], top: int) -> str:
    per_thread: Counter[str] = Counter()
    where: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), "?")
        body = [f for f in frames if not f.startswith(("thread", "process"))]
        ours = [f for f in body if "gdsload" in f or "benchmarks" in f]
        # the deepest frame of ours, and what it called (the library call it was in)
        key = frame_label(ours[-1]) if ours else frame_label(body[-1]) if body else "?"
        if ours and body and body[-1] != ours[-1]:
            key += " -> " + frame_label(body[-1])
        per_thread[thread] += int(count)
        where[thread][key] += int(count)
    total = sum(per_thread.values()) or 1
    out = [f"{total} samples", "", "| thread | samples | share |", "|---|---:|---:|"]
    out += [f"| {t} | {n} | {n / total:.1%} |" for t, n in per_thread.most_common()]
    for t, n in per_thread.most_common(6):
        out += ["", f"### {t} ({n} samples)", "", "| where | share of the thread |", "|---|---:|"]
        out += [f"| `{k}` | {c / n:.1%} |" for k, c in where[t].most_common(top)]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    with open(args.raw) as f:
        sys.stdout.write(summarise(f.readlines(), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
