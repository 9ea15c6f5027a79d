#!/usr/bin/env python3
"""Where a training step's extra time goes: a per-batch timeline of the consumer beside a simulated step.

For each backend (and with every field resident, i.e. no I/O at all), one warm pass with a fixed GPU step
per batch, timing on the host the consumer's ``next()`` and the step, and on the device (CUDA events on
the consumer's stream) the stretch from before ``next()`` to after it (gathers, plus any wait for a window's
copies) and the step kernel. Also the mmap backend's cold open, split into its read and its lock, beside
cold buffered and O_DIRECT reads of the same files. Prints JSON lines and writes probe-step-*.json.

    python benchmarks/probe_step.py --data /path/on/nvme --out benchmarks/results
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import (Rows, bench_dataset, best_pass_seconds, drop_caches, parse_step_probe_args,  # noqa: E402
                        posix_read, step_probe_parser, write_probe)
from run import BATCH, Spin  # noqa: E402

from gdsload import GDSDataset  # noqa: E402


def timeline(ds: GDSDataset, step: Spin) -> dict:
    import cupy

    stream = cupy.cuda.get_current_stream()
    host_next, host_step, dev_next, dev_step = [], [], [], []
    events = []
    collections: list[float] = []  # garbage collections during the pass (any thread), seconds each
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
    for e0, e1, e2 in events:
        dev_next.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
        dev_step.append(cupy.cuda.get_elapsed_time(e1, e2) / 1e3)
    n = len(events)
    alone, _ = step.alone(n)

    def us(xs: list[float]) -> dict:
        a = np.asarray(xs) * 1e6
        return {"mean": round(float(a.mean()), 1), "p50": round(float(np.median(a)), 1),
                "p90": round(float(np.percentile(a, 90)), 1), "max": round(float(a.max()), 1)}

    waits = np.asarray(dev_next) * 1e6
    worst = np.argsort(waits)[::-1][:6]
    plan = ds._plan(ds.epoch)
    table = plan.segment_table()
    # A batch that starts a window (its first segment from a window no earlier batch drew from).
    opens = {i for i in range(1, len(table)) if table[i][-1][0] != table[i - 1][-1][0]}
    return {"batches": n, "wall_s": round(wall, 4), "steps_alone_s": round(alone, 4),
            "excess_us_per_batch": round((wall - alone) / n * 1e6, 1),
            "first_batch_device_us": round(float(waits[0]), 1),
            "excess_us_per_batch_after_first": round((wall - alone - dev_next[0]) / max(1, n - 1) * 1e6, 1),
            "longest_device_next": [(int(i), round(float(waits[i]), 1)) for i in worst],
            "longest_open_a_window": [int(i) in opens for i in worst],
            "batches_opening_a_window": len(opens),
            "gc_collections": len(collections), "gc_ms": round(sum(collections) * 1e3, 2),
            "host_next_us": us(host_next), "host_step_us": us(host_step),
            "device_next_us": us(dev_next), "device_step_us": us(dev_step)}


def main() -> int:
    ap = step_probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=2.5)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache probes")
    ap.add_argument("--what", default="resident,kvikio,pinned,threads,mmap",
                    help="timelines to take, of: resident (no I/O), kvikio, pinned, threads (pinned with Python "
                         "reader threads), mmap")
    args = parse_step_probe_args(ap)
    import cupy

    path, paths, nbytes = bench_dataset(args.data, "step.gds", args.size_gib)
    rows = Rows()
    emit = rows.emit

    if not args.no_cold and drop_caches():
        for direct in (False, True):
            drop_caches()
            n, dt = posix_read(paths, direct, False)
            emit({"probe": "cold read", "o_direct": direct, "gb_per_s": round(n / dt / 1e9, 2)})
        drop_caches()
        t0 = time.perf_counter()
        with GDSDataset(path, batch_size=BATCH, backend="mmap") as ds:
            opened = time.perf_counter() - t0
            emit({"probe": "mmap open, cold", "seconds": round(opened, 3), "gb_per_s": round(nbytes / opened / 1e9, 2),
                  "preload_s": round(ds.backend.preload_s, 3),
                  "lock_s": round(ds.backend.register_s - ds.backend.preload_s, 3)})
    posix_read(paths, False, True)

    step = Spin(args.step_ms)
    cases = {"resident": ("all fields resident (no I/O)", "kvikio", {"resident_bytes": 1 << 40}),
             "kvikio": ("kvikio", "kvikio", {}), "pinned": ("pinned", "pinned", {}),
             "threads": ("pinned, Python reader threads", "pinned", {"backend_options": {"reader": "threads"}}),
             "mmap": ("mmap", "mmap", {})}
    for label, backend, opts in [cases[w] for w in args.what.split(",")]:
        with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
            best = best_pass_seconds(ds, 4)  # the first pass warms up
            pass_bytes = ds.stats.bytes_read
            timeline(ds, step)  # warm-up pass
            emit({"probe": "timeline", "what": label, "step_ms": args.step_ms,
                  "switch_interval_s": sys.getswitchinterval(),
                  "pass_gb_per_s_without_step": round(pass_bytes / best / 1e9, 2), **timeline(ds, step)})
        cupy.get_default_memory_pool().free_all_blocks()

    print("wrote", write_probe(args.out, "probe-step-", args.tag, rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
