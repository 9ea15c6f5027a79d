"""Where the time goes, by sampling: warm passes to run under py-spy, and a summary of its raw output.

    py-spy record --idle --threads --format raw -o pinned.raw -- \\
        python -m benchmarks.diagnostics.profile passes --backend pinned
    py-spy record --gil --threads --format raw -o gil.raw -- python -m benchmarks.diagnostics.profile passes
    python -m benchmarks.diagnostics.profile summary gil.raw --top 12

``summary`` prints markdown: samples per thread and, per thread, the functions they were in, deepest
gdsload frame first (with ``--gil`` only the thread holding the GIL is sampled). The raw file itself is too
large to keep.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass

from ..common import BATCH, DATA_DIR, make_dataset


def passes(data: str, size_gib: float, backend: str, count: int) -> None:
    """``count`` warm passes, each printed (GB/s and gdsload's own stall share)."""
    path = make_dataset(data, size_gib)
    read_files(shard_paths(path))
    with GDSDataset(path, batch_size=BATCH, backend=backend) as ds:
        for i in range(count):
            r = time_pass(ds)
            print(f"pass {i}: {r.gb_per_s:.2f} GB/s, stall {r.stall_fraction or 0.0:.0%}", flush=True)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("passes", help="warm passes to sample")
    p.add_argument("--data", default=DATA_DIR)
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--backend", default="pinned")
    p.add_argument("--count", type=int, default=8)
    s = sub.add_parser("summary", help="summarise a py-spy raw profile")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if args.command == "passes":
        passes(args.data, args.size_gib, args.backend, args.count)
    else:
        with open(args.raw) as f:
            sys.stdout.write(summarise(f.readlines(), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
