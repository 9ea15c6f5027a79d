"""Where opening a dataset and taking its first batch spend their time, per backend, warm.

    python -m benchmarks.diagnostics.probe_startup [--samples 20000] [--repeats 3] [--profile] [--fresh]

The dataset: ``--samples`` images of 3 x 64 x 64 uint8 plus int64 labels (the small-sample case), read into
the page cache before anything is timed; CUDA is initialised first (a training script has done so before it
opens its data). For each backend, ``--repeats`` times: the constructor's seconds (``open``), then the
first ``next()`` (``first batch``, synchronised), then the rest of the pass. With ``--profile`` the last
repeat runs under cProfile and the functions that took the most time (cumulative) are printed. With
``--fresh`` each measurement is a new process, as a training script starts: ``import gdsload``, CUDA's start
(first, as a script that built its model would, or left to the open), the open and the first batch; there
``--profile`` profiles the last repeat's open and first batch, every thread's calls together (CUDA first).
Prints a table and writes ``--json FILE`` when given. GPU only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset, write_dataset

from ..common import read_files, shard_paths


def make(path: str, samples: int) -> str:
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (samples, 3, 64, 64), dtype=np.uint8)
        labels = rng.integers(0, 10, samples).astype(np.int64)
        write_dataset(path, {"images": images, "labels": labels}, progress=False)
        os.sync()
    read_files(shard_paths(path))
    return path


def one(path: str, backend: str, batch_size: int, profile: bool) -> dict:
    import cupy

    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    ds = GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=True)
    t1 = time.perf_counter()
    it = iter(ds)
    next(it)
    sync = cupy.cuda.get_current_stream().synchronize
    sync()
    t2 = time.perf_counter()
    if prof:
        prof.disable()
    n = 1
    for _ in it:
        n += 1
    sync()
    t3 = time.perf_counter()
    row = {"backend": ds.backend_name, "io_mode": ds.io_mode, "open_s": round(t1 - t0, 4),
           "first_batch_s": round(t2 - t1, 4), "rest_s": round(t3 - t2, 4), "batches": n,
           "describe_open_s": round(ds.describe()["open_s"], 4)}
    ds.close()
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        row["profile"] = s.getvalue()
    return row


#: One fresh process: its own clock from before ``import gdsload``. CUDA is started as a training script that
#: built its model has started it: a context and an allocation, no CuPy kernel compiled.
FRESH = """
import json, sys, time
t0 = time.perf_counter()
import gdsload
t1 = time.perf_counter()
if {cuda_first}:
    import cupy
    cupy.zeros(1 << 20, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
if {profile}:
    from benchmarks.diagnostics.probe_startup import ThreadProfiles
    profiles = ThreadProfiles()
ds = gdsload.GDSDataset({path!r}, batch_size={batch_size}, backend={backend!r}, shuffle=True)
t3 = time.perf_counter()
it = iter(ds)  # kept: a dropped iterator closes its pass, inside the timing
next(it)
import cupy  # imported by the open already
cupy.cuda.get_current_stream().synchronize()
t4 = time.perf_counter()
row = {{"backend": ds.backend_name, "io_mode": ds.io_mode, "cuda_first": {cuda_first},
       "import_s": round(t1 - t0, 4), "cuda_start_s": round(t2 - t1, 4), "open_s": round(t3 - t2, 4),
       "first_batch_s": round(t4 - t3, 4)}}
ds.close()
if {profile}:
    row["profile"] = profiles.report()
print(json.dumps(row))
"""


class ThreadProfiles:
    """One cProfile from here to :meth:`report`. Under Python 3.12+ (sys.monitoring) it sees the calls of every
    thread, the pipeline's too; a profiler per thread is refused there ("another profiling tool is already
    active"), so the threads' calls are reported together, by cumulative and by own time."""

    def __init__(self) -> None:
        self.prof = cProfile.Profile()
        self.prof.enable()

    def report(self, top: int = 40) -> str:
        self.prof.disable()
        parts = []
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(self.prof, stream=s).sort_stats(key).print_stats(top)
            parts.append(f"==== by {key}\n{s.getvalue()}")
        return "\n".join(parts)


def run_fresh(code: str, what: str) -> Any:
    """Run ``code`` in a new interpreter and return its last line of output, as JSON; a RuntimeError naming
    ``what`` and ending with the process's last lines of stderr when it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"{what}: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parser(doc: str, backends: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments every start-up probe takes (its dataset, batch, backends, repeats, JSON output)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--data", default="/tmp/gdsload-startup.gds")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--backends", default=backends)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--json", default=None)
    return ap


def save(args: argparse.Namespace, rows: list[dict], **extra: Any) -> None:
    """The rows as JSON under ``--json``, when given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": args.samples, **extra, "rows": rows}, f, indent=1)


def fresh(path: str, backend: str, batch_size: int, cuda_first: bool, profile: bool = False) -> dict:
    code = FRESH.format(path=path, backend=backend, batch_size=batch_size, cuda_first=cuda_first, profile=profile)
    return {"asked": backend, **run_fresh(code, backend)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "kvikio,pinned,mmap", 3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="each measurement in a new process")
    args = ap.parse_args(argv)
    if args.fresh:
        path, rows = make(args.data, args.samples), []
        for r in range(args.repeats):
            for backend in ["auto", *args.backends.split(",")]:
                for cuda_first in (True, False):
                    profile = args.profile and cuda_first and r == args.repeats - 1
                    rows.append({**fresh(path, backend, args.batch_size, cuda_first, profile), "repeat": r})
                    w = rows[-1]
                    print(f"{backend:6s} -> {w['backend']:6s} #{r} {'CUDA first' if cuda_first else 'CUDA in open'}: "
                          f"import {w['import_s']:.3f} s  CUDA {w['cuda_start_s']:.3f} s  open {w['open_s']:.3f} s  "
                          f"first batch {w['first_batch_s']:.4f} s", flush=True)
                    if "profile" in w:
                        print(w["profile"], flush=True)
        save(args, rows, fresh_processes=True)
        return 0
    import cupy

    (cupy.arange(1 << 20) * 2).sum().get()  # CUDA initialised, a kernel compiled and launched
    path = make(args.data, args.samples)
    rows = []
    for backend in args.backends.split(","):
        for r in range(args.repeats):
            row = one(path, backend, args.batch_size, args.profile and r == args.repeats - 1)
            row["repeat"] = r
            rows.append(row)
            print(f"{backend:7s} #{r} open {row['open_s']:.4f} s  first batch {row['first_batch_s']:.4f} s  "
                  f"rest {row['rest_s']:.3f} s ({row['batches']} batches)", flush=True)
            if "profile" in row:
                print(row["profile"], flush=True)
    save(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
