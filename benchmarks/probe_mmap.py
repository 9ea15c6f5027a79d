#!/usr/bin/env python3
"""Probes behind the mmap backend's defaults, beside the ceilings and the kvikio backend, in one run:
open (map + lock) time cold and warm, pass GB/s across copy streams and copy sizes, and how long a
simulated training step waits for data, seen from outside (wall time beyond the steps run alone), with the
consumer on the legacy default stream (CuPy's and torch's default) and on a non-blocking stream.

    python benchmarks/probe_mmap.py --data /path/on/nvme --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import Rows, bench_dataset, drop_caches, posix_read, raw_kvikio, write_probe  # noqa: E402
from run import BATCH, Spin, gdsload_run  # noqa: E402

from gdsload.sysinfo import pinned_h2d_gbps  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true", help="also sweep copy streams and copy sizes")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    args = ap.parse_args()
    import cupy

    path, paths, nbytes = bench_dataset(args.data, "bench.gds", args.size_gib)
    rows = Rows()
    emit = rows.emit

    def best(run, repeats: int = 3) -> dict:
        run()
        return min((run() for _ in range(repeats)), key=lambda r: r["seconds"])

    emit({"probe": "ceiling: pinned H2D", "gb_per_s": round(pinned_h2d_gbps(1 << 30), 2)})
    posix_read(paths, False, True)
    emit({"probe": "ceiling: page cache -> pinned", "gb_per_s": round(max(
        n / t for n, t in (posix_read(paths, False, True) for _ in range(3))) / 1e9, 2)})
    dest = cupy.empty(nbytes, dtype=cupy.uint8)
    emit({"probe": "raw KvikIO whole files", "gb_per_s": round(max(
        n / t for n, t in (raw_kvikio(paths, dest) for _ in range(3))) / 1e9, 2)})
    dest = None
    cupy.get_default_memory_pool().free_all_blocks()

    for cold in (True, False):
        if cold and not drop_caches():
            continue
        t0 = time.perf_counter()
        run = gdsload_run(path, "mmap", False, None)
        opened = time.perf_counter() - t0
        emit({"probe": "mmap open", "cold": cold, "seconds": round(opened, 3),
              "gb_per_s": round(nbytes / opened / 1e9, 2)})
        run.close()

    sweep = [{"num_streams": s, "copy_bytes": c << 20} for s in (1, 2, 4) for c in (16, 64)] if args.sweep else [{}]
    configs = [("kvikio", {}, False)] + [("mmap", opts, False) for opts in sweep]
    configs += [("mmap", {}, True), ("kvikio", {}, True)]
    for backend, opts, shuffle in configs:
        run = gdsload_run(path, backend, shuffle, None, backend_options=opts or None)
        r = best(run)
        emit({"probe": f"gdsload {backend}", "options": {k: v for k, v in opts.items()}, "shuffle": shuffle,
              "gb_per_s": round(r["bytes"] / r["seconds"] / 1e9, 2), "stall_s": round(r["stall_s"], 4),
              "seconds": round(r["seconds"], 4)})
        run.close()
        cupy.get_default_memory_pool().free_all_blocks()

    for backend in ("kvikio", "mmap", "pinned"):
        probe = gdsload_run(path, backend, False, None)
        r = best(probe, 1)
        probe.close()
        batches = -(-r["samples"] // BATCH)
        read_ms = r["seconds"] / batches * 1e3
        for factor, consumer in itertools.product((1.5, 3.0), ("legacy default stream", "non-blocking stream")):
            with contextlib.ExitStack() as scope:
                if consumer == "non-blocking stream":
                    scope.enter_context(cupy.cuda.Stream(non_blocking=True))
                step = Spin(read_ms * factor)
                run = gdsload_run(path, backend, False, step)
                run()
                r = run()
                run.close()
            emit({"probe": f"gdsload {backend} + step", "factor": factor, "consumer": consumer,
                  "step_ms": round(read_ms * factor, 3),
                  "nominal_steps_s": round(batches * read_ms * factor / 1e3, 4),
                  "steps_alone_s": round(r["alone_s"], 4),
                  "wall_s": round(r["seconds"], 4), "host_stall_s": round(r["stall_s"], 4),
                  "wait_fraction": round(r["wait_s"] / r["seconds"], 4)})
        cupy.get_default_memory_pool().free_all_blocks()

    print("wrote", write_probe(args.out, "probe-mmap-", args.tag, rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
