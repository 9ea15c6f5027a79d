#!/usr/bin/env python3
"""What a training step pays per batch for taking it from a loader, taken apart piece by piece.

Each variant runs N simulated steps (one GPU kernel of fixed duration, then a sync, as ``loss.item()``)
and reports the wall time beyond the same N steps alone, per batch: first the steps with nothing else,
then with each piece of the consumer's hand-off added (a Python iterator, a queue and a stream wait),
then with a producer thread that holds the GIL (pure Python) or issues CUDA calls between batches, then
gdsload itself. Writes probe-overhead-*.json.

    python benchmarks/probe_overhead.py --data /path/on/nvme --out benchmarks/results
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import (Rows, bench_dataset, best_pass_seconds, parse_step_probe_args, posix_read,  # noqa: E402
                        step_probe_parser, write_probe)
from run import BATCH, Spin  # noqa: E402

from gdsload import GDSDataset  # noqa: E402


def excess_us(step: Spin, batches: Callable[[], Iterator[object]], repeats: int = 3) -> float:
    """Best of ``repeats`` passes (each over every batch ``batches()`` yields): microseconds per batch beyond
    as many steps alone."""
    import cupy

    best, n = float("inf"), 0
    for _ in range(repeats):
        it = batches()
        n = 0
        t0 = time.perf_counter()
        for _b in it:
            step()
            n += 1
        cupy.cuda.get_current_stream().synchronize()
        best = min(best, time.perf_counter() - t0)
    return round((best - step.alone(n)) / n * 1e6, 1)


def producer(work: Callable[[], None], n: int, ahead: int = 2) -> Callable[[], Iterator[object]]:
    """``n`` batches from a thread that runs ``work`` for each, ``ahead`` batches before the consumer."""

    def batches() -> Iterator[object]:
        q: queue.Queue[object] = queue.Queue(maxsize=ahead)
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                work()
                while not stop.is_set():
                    try:
                        q.put(1, timeout=0.05)
                        break
                    except queue.Full:
                        pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            for _ in range(n):
                yield q.get()
        finally:
            stop.set()
            t.join()

    return batches


def main() -> int:
    ap = step_probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--steps-ms", default="1.0,2.5")
    ap.add_argument("--n", type=int, default=400)
    args = parse_step_probe_args(ap)
    import cupy

    path, paths, nbytes = bench_dataset(args.data, "step.gds", args.size_gib)
    posix_read(paths, False, True)
    rows = Rows()
    n = args.n
    stream = cupy.cuda.get_current_stream()
    done = cupy.cuda.Event()
    done.record(stream)
    done.synchronize()
    side = cupy.cuda.Stream(non_blocking=True)
    scratch = cupy.zeros(1 << 20, dtype=cupy.uint8)

    def python_work(us: float) -> Callable[[], None]:
        def work() -> None:
            end = time.perf_counter() + us / 1e6
            while time.perf_counter() < end:
                pass
        return work

    def cuda_work() -> None:  # about what the assembler issues per batch: allocations, copies, events
        with side:
            a = cupy.empty(1 << 20, dtype=cupy.uint8)
            for _ in range(4):
                a[...] = scratch
            side.wait_event(stream.record())
            side.record()

    def queue_and_wait() -> Iterator[object]:
        q: queue.Queue[object] = queue.Queue()
        for _ in range(n):
            q.put(1)
            yield q.get(timeout=0.05)
            stream.wait_event(done)

    for step_ms in [float(s) for s in args.steps_ms.split(",")]:
        step = Spin(step_ms)
        emit = lambda what, us: rows.emit({"probe": "overhead", "step_ms": step_ms, "what": what,  # noqa: E731
                                           "switch_interval_s": sys.getswitchinterval(),
                                           "excess_us_per_batch": us,
                                           "excess_fraction": round(us / (step_ms * 1e3 + us), 4)})
        emit("steps alone, timed twice (noise)", excess_us(step, lambda: iter(range(n))))
        emit("Python iterator", excess_us(step, lambda: (x for x in range(n))))
        emit("queue.get + stream.wait_event", excess_us(step, queue_and_wait))
        for us in (50, 150, 400):
            emit(f"producer thread, {us} us of Python per batch", excess_us(step, producer(python_work(us), n)))
        emit("producer thread, CUDA calls per batch", excess_us(step, producer(cuda_work, n)))
        resident = {"resident_bytes": 1 << 40}
        for label, backend, opts in [("gdsload, all fields resident (no I/O)", "kvikio", resident),
                                     ("gdsload, resident, batches_ahead=1", "kvikio", {**resident, "batches_ahead": 1}),
                                     ("gdsload, resident, batches_ahead=4", "kvikio", {**resident, "batches_ahead": 4}),
                                     ("gdsload mmap", "mmap", {}), ("gdsload pinned", "pinned", {})]:
            with GDSDataset(path, batch_size=BATCH, backend=backend, **opts) as ds:
                best_pass_seconds(ds, 2)
                emit(label, excess_us(step, lambda: iter(ds)))  # whole passes: each one read ahead by the last
            cupy.get_default_memory_pool().free_all_blocks()

    print("wrote", write_probe(args.out, "probe-overhead-", args.tag, rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
