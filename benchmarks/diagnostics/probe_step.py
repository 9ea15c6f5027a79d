"""Where a training step's extra time goes: a per-batch timeline of the consumer beside a simulated step.

    python -m benchmarks.diagnostics.probe_step [--what resident,kvikio,pinned,threads,mmap] [--step-ms 2.5]

For each case (and with every field resident, i.e. no I/O at all), one warm pass with a fixed GPU step per
batch, timing on the host the consumer's ``next()`` and the step, and on the device (CUDA events on the
consumer's stream) the stretch from before ``next()`` to after it (gathers, plus any wait for a window's
copies) and the step kernel; garbage collections during the pass are counted. Also the mmap backend's cold
open and first pass (the files load in the background: ``backend_stats["load_s"]``), beside cold buffered and O_DIRECT
reads of the same files. Writes ``results/<machine>/probe-step[-TAG].json``. GPU only.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset

from ..common import (BATCH, Rows, Spin, best, drop_page_cache, make_dataset, parse_probe_args, probe_parser,
                      read_files, shard_paths, time_pass, write_probe)

CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "resident": ("all fields resident (no I/O)", "kvikio", {"resident_bytes": 1 << 40}),
    "kvikio": ("kvikio", "kvikio", {}), "pinned": ("pinned", "pinned", {}),
    "threads": ("pinned, Python reader threads", "pinned", {"backend_options": {"reader": "threads"}}),
    "mmap": ("mmap", "mmap", {})}


def _us(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"mean": round(float(a.mean()), 1), "p50": round(float(np.median(a)), 1),
            "p90": round(float(np.percentile(a, 90)), 1), "max": round(float(a.max()), 1)}


def window_openings(num_samples: int, samples_per_block: int, window_blocks: int, batches: int) -> set[int]:
    """Batches of an unshuffled single-rank pass whose last sample lies in a later window than the previous
    batch's: those that wait for a window no earlier batch drew from."""
    per_window = window_blocks * samples_per_block
    last = [min((i + 1) * BATCH, num_samples) - 1 for i in range(batches)]
    return {i for i in range(1, batches) if last[i] // per_window != last[i - 1] // per_window}


def timeline(ds: GDSDataset, step: Spin) -> dict[str, Any]:
    import cupy

    stream = cupy.cuda.get_current_stream()
    host_next, host_step, events = [], [], []
    collections: list[float] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(on_gc)
    it = iter(ds)
    t_start = time.perf_counter()
    while True:
        e0 = cupy.cuda.Event()
        e0.record(stream)
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        e1 = cupy.cuda.Event()
        e1.record(stream)
        step()
        t2 = time.perf_counter()
        e2 = cupy.cuda.Event()
        e2.record(stream)
        host_next.append(t1 - t0)
        host_step.append(t2 - t1)
        events.append((e0, e1, e2))
    stream.synchronize()
    wall = time.perf_counter() - t_start
    gc.callbacks.remove(on_gc)
    dev_next = [cupy.cuda.get_elapsed_time(e0, e1) / 1e3 for e0, e1, _ in events]
    dev_step = [cupy.cuda.get_elapsed_time(e1, e2) / 1e3 for _, e1, e2 in events]
    n = len(events)
    alone = step.alone(n)
    waits = np.asarray(dev_next) * 1e6
    worst = np.argsort(waits)[::-1][:6]
    about = ds.describe()
    opens = window_openings(ds.num_samples, about["samples_per_block"], about["window_blocks"], n)
    return {"batches": n, "wall_s": round(wall, 4), "steps_alone_s": round(alone, 4),
            "excess_us_per_batch": round((wall - alone) / n * 1e6, 1),
            "first_batch_device_us": round(float(waits[0]), 1),
            "excess_us_per_batch_after_first": round((wall - alone - dev_next[0]) / max(1, n - 1) * 1e6, 1),
            "longest_device_next": [(int(i), round(float(waits[i]), 1)) for i in worst],
            "longest_open_a_window": [int(i) in opens for i in worst],
            "batches_opening_a_window": len(opens),
            "gc_collections": len(collections), "gc_ms": round(sum(collections) * 1e3, 2),
            "host_next_us": _us(host_next), "host_step_us": _us(host_step),
            "device_next_us": _us(dev_next), "device_step_us": _us(dev_step)}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=2.5)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache probes")
    ap.add_argument("--what", default=",".join(CASES), help=f"timelines to take, of: {', '.join(CASES)}")
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    paths = shard_paths(path)
    rows = Rows()
    if not args.no_cold and drop_page_cache():
        for direct in (False, True):
            drop_page_cache()
            rows.emit({"probe": "cold read", "o_direct": direct,
                       "gb_per_s": round(read_files(paths, direct=direct).gb_per_s, 2)})
        drop_page_cache()
        t0 = time.perf_counter()
        with GDSDataset(path, batch_size=BATCH, backend="mmap") as ds:
            opened = time.perf_counter() - t0
            for _ in ds:  # the first pass runs while the files load
                pass
            passed = time.perf_counter() - t0
            stats = ds.describe()["backend_stats"]
        rows.emit({"probe": "mmap open + first pass, cold", "open_s": round(opened, 3), "seconds": round(passed, 3),
                   "gb_per_s": round(stats["locked_bytes"] / passed / 1e9, 2),
                   "load_s": None if stats["load_s"] is None else round(stats["load_s"], 3)})
    read_files(paths)
    step = Spin(args.step_ms)
    for label, backend, opts in [CASES[w] for w in args.what.split(",")]:
        with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
            top = best([time_pass(ds) for _ in range(4)])  # the first pass warms up
            timeline(ds, step)  # warm-up pass
            rows.emit({"probe": "timeline", "what": label, "step_ms": args.step_ms,
                       "switch_interval_s": sys.getswitchinterval(), "pass_gb_per_s_without_step": round(
                           top.gb_per_s, 2), **timeline(ds, step)})
    print("wrote", write_probe(args, "probe-step", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
