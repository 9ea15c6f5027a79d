#!/usr/bin/env python3
"""Profiling probes behind the defaults: the pinned backend alone (no pipeline) across pool shapes, with
and without its device copies, and the consumer's gather rate. Warm page cache; prints JSON lines.

    python benchmarks/probe.py --data /path/on/nvme --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import best_pass_seconds, make_dataset, posix_read  # noqa: E402

from gdsload import read_metadata  # noqa: E402
from gdsload.backends.base import ReadRequest  # noqa: E402
from gdsload.backends.pinned import PinnedBackend  # noqa: E402
from gdsload.format import DatasetLayout  # noqa: E402


class ReadOnlyPinned(PinnedBackend):
    """The pinned backend minus its device copies: the read side alone."""

    def _copy_group(self, dest_ptr, slot, group):
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import cupy

    path = os.path.join(args.data, "bench.gds")
    make_dataset(path, args.size_gib)
    meta = read_metadata(path)
    layout = DatasetLayout(meta, ("image",))
    paths = layout.shard_paths()
    posix_read(paths, False, True)
    reqs, pos = [], 0
    for b in range(meta.num_blocks):
        loc = layout.locate("image", b)
        reqs.append(ReadRequest(loc.path, loc.offset, loc.nbytes, pos))
        pos += loc.nbytes
    dest = cupy.empty(pos, dtype=cupy.uint8)
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    emit({"probe": "pagecache-ceiling", "gb_per_s": round(max(
        n / t for n, t in (posix_read(paths, False, True) for _ in range(3))) / 1e9, 2)})
    for slot_mib, pool_mib, threads, copies in [(8, 256, 16, True), (8, 256, 16, False), (8, 512, 16, True),
                                               (16, 512, 16, True), (4, 256, 16, True), (8, 256, 12, True),
                                               (2, 256, 16, True)]:
        cls = PinnedBackend if copies else ReadOnlyPinned
        be = cls(num_threads=threads, slot_bytes=slot_mib << 20, pool_bytes=pool_mib << 20)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            ev = be.fill(dest, reqs, threading.Event())
            ev.synchronize()
            best = max(best, pos / (time.perf_counter() - t0) / 1e9)
        emit({"probe": "pinned-backend-fill", "slot_mib": slot_mib, "pool_mib": pool_mib, "threads": threads,
              "device_copies": copies, "gb_per_s": round(best, 2)})
        be.close()

    from gdsload.device import CudaOps

    ops = CudaOps(0, "cupy")
    ops.begin()
    window = dest[: 1700 * 150528].reshape(-1, 224, 224, 3)
    n = window.shape[0]
    idx_b = cupy.asarray(cupy.random.permutation(n)[:256].astype(cupy.int32))
    for label, idx in [("slice-memcpy", 100), ("take-words", idx_b), ("take-bytes", idx_b)]:
        out = cupy.empty((256, 224, 224, 3), cupy.uint8)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(2):  # the first round compiles and warms up
            start.record()
            for _i in range(20):
                with ops.scope():
                    if label == "take-bytes":
                        cupy.take(window, idx, axis=0, out=out)
                    elif label == "slice-memcpy":
                        ops.copy_rows(window, idx, out)
                    else:
                        ops.take(window, idx, out)
            end.record()
            end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end)
        emit({"probe": "gather", "how": label, "gb_per_s": round(20 * out.nbytes / (ms / 1e3) / 1e9, 1)})
    del dest, window, out
    cupy.get_default_memory_pool().free_all_blocks()
    from gdsload import GDSDataset

    for shuffle in (False, True):  # every field resident: no I/O, only the consumer's own per-batch work
        with GDSDataset(path, batch_size=256, backend="kvikio", resident_bytes=1 << 40, shuffle=shuffle) as ds:
            best = best_pass_seconds(ds, 3)
            emit({"probe": "consumer-only (all resident)", "shuffle": shuffle, "batches": len(ds),
                  "us_per_batch": round(best / len(ds) * 1e6, 1),
                  "gb_per_s": round(meta.num_samples * 150528 / best / 1e9, 1)})
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
