"""Where the time goes, by sampling: warm passes to run under py-spy, and a summary of its raw output.

    py-spy record --idle --threads --format raw -o pinned.raw -- \\
        python -m benchmarks.diagnostics.profile passes --backend pinned
    py-spy record --gil --threads --format raw -o gil.raw -- python -m benchmarks.diagnostics.profile passes
    py-spy record --gil --threads --rate 1000 --format raw -o step.raw -- \\
        python -m benchmarks.diagnostics.profile passes --backend mmap --step-factor 1.5
    python -m benchmarks.diagnostics.profile summary gil.raw --top 12

``summary`` prints markdown: samples per thread and, per thread, the functions they were in, deepest
gdsload frame first (with ``--gil`` only the thread holding the GIL is sampled). The raw file itself is too
large to keep.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter, defaultdict

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass

from ..common import BATCH, DATA_DIR, make_dataset, step_ms


def passes(data: str, size_gib: float, backend: str, count: int, step_factor: float | None = None) -> None:
    """``count`` warm passes, each printed (GB/s and gdsload's own stall share); with ``step_factor``,
    shuffled, each batch followed by the suite's training step of that many times a batch's read time,
    synced every step (then the waiting share and the batches are printed too)."""
    path = make_dataset(data, size_gib)
    read_files(shard_paths(path))
    with GDSDataset(path, batch_size=BATCH, backend=backend, shuffle=step_factor is not None) as ds:
        step = None
        if step_factor is not None:
            from gdsload.steps import Spin

            for _ in range(2):  # warm: the pipeline's start, and mmap's background load, out of the way
                time_pass(ds)
            r = time_pass(ds, min_seconds=0.5)
            step = Spin(step_ms(r, step_factor), 1)
            print(f"step {step.ms:.3f} ms (read rate {r.gb_per_s:.2f} GB/s)", flush=True)
        waits = []
        for i in range(count):
            r = time_pass(ds, step, from_rest=step is None)  # with a step: each pass read ahead, as epochs are
            waits.append(r.wait_fraction or 0.0)
            print(f"pass {i}: {r.gb_per_s:.2f} GB/s, stall {r.stall_fraction or 0.0:.0%}, waiting "
                  f"{waits[-1]:.2%}, {-(-(r.samples or 0) // BATCH)} batches in {r.seconds:.3f} s",
                  flush=True)
        if step is not None and count > 1:
            print(f"waiting, median of passes 1-{count - 1}: {statistics.median(waits[1:]):.2%}", flush=True)


def frame_label(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py:123)``."""
    m = re.match(r"(.*) \((?:.*/)?([^/]+:\d+)\)$", frame.strip())
    return f"{m.group(1)} ({m.group(2)})" if m else frame.strip()


def summarise(lines: list[str], top: int, by_name: bool = False) -> str:
    """``by_name``: threads of one name counted together (a pipeline per pass makes new threads, and py-spy
    may name a thread after an earlier one with its id)."""
    per_thread: Counter[str] = Counter()
    where: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), "?")
        if by_name:
            thread = re.sub(r"^thread \(\d+\)(: )?", "", thread) or "unnamed"
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
    p.add_argument("--step-factor", type=float, default=None, help="a training step per batch (x read time)")
    p.add_argument("--group-mib", type=int, default=None, help="gdsload.assembler.GROUP_BYTES for this run (MiB)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for this run (s)")
    s = sub.add_parser("summary", help="summarise a py-spy raw profile")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=12)
    s.add_argument("--by-name", action="store_true", help="count threads of one name together")
    args = ap.parse_args(argv)
    if args.command == "passes":
        if args.group_mib is not None:
            from gdsload import assembler

            assembler.GROUP_BYTES = args.group_mib << 20
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        passes(args.data, args.size_gib, args.backend, args.count, args.step_factor)
    else:
        with open(args.raw) as f:
            sys.stdout.write(summarise(f.readlines(), args.top, args.by_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
