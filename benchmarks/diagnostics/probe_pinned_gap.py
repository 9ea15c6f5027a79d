"""Where the pinned backend loses to raw KvikIO on the same blocks: the native stager alone, in window-sized
jobs, and inside the pipeline, beside raw KvikIO, in one run on the same warm files.

    python -m benchmarks.diagnostics.probe_pinned_gap [--size-gib 4] [--repeats 3]

Rows (GB/s, best of ``--repeats``, every run kept, with the process's CPU core-seconds per GB):
raw KvikIO of the image blocks shuffled (16 threads, as the suite's ceiling); the stager reading the same
blocks in the same order into one device buffer as one job, for thread counts, buffers per thread, buffer
sizes and spinning or sleeping copy waits; the stager in jobs of one window's blocks with three in flight
(the pipeline's shape without its Python threads); the pinned backend's shuffled pass (the suite's warm
row) with the same stager settings; raw KvikIO again at the end (the machine drifts). GPU only. Writes
``results/<machine>/probe-pinned-gap[-TAG].json``.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload import stager as stager_module
from gdsload.measure import block_locations, cpu_seconds, raw_kvikio_blocks, read_files, shard_paths, time_pass

from ..common import BATCH, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, write_probe

WINDOW_BLOCKS = 74  # the pipeline's window on the suite's image dataset (256 MiB of 3x224x224 samples)


def stager_read(pieces: np.ndarray, threads: int, bufs: int, buf_bytes: int, blocking: bool,
                job_blocks: int | None, in_flight: int = 3) -> tuple[float, float]:
    """Seconds and CPU seconds for the stager to read ``pieces`` (fd, offset, nbytes, dest): one job, or jobs
    of ``job_blocks`` pieces with ``in_flight`` queued at a time. The stager is made before the clock."""
    with stager_module.Stager("cuda", 0, threads, buf_bytes, bufs, blocking) as st:
        st.wait(st.submit(pieces[:threads]))  # workers and their streams warm
        c0, t0 = cpu_seconds(), time.perf_counter()
        if job_blocks is None:
            st.wait(st.submit(pieces))
        else:
            queued: collections.deque[int] = collections.deque()
            for i in range(0, len(pieces), job_blocks):
                if len(queued) >= in_flight:
                    st.wait(queued.popleft())
                queued.append(st.submit(pieces[i:i + job_blocks]))
            while queued:
                st.wait(queued.popleft())
        return time.perf_counter() - t0, cpu_seconds() - c0


def main(argv: list[str] | None = None) -> int:
    import cupy

    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    paths = shard_paths(path)
    read_files(paths)
    blocks = block_locations(path, ("image",))
    total = sum(b.nbytes for b in blocks)
    dest = cupy.empty(total, dtype=cupy.uint8)
    starts = np.concatenate([[0], np.cumsum([b.nbytes for b in blocks])])[:-1]
    order = np.random.default_rng(0).permutation(len(blocks))  # as raw_kvikio_blocks orders them
    fds = {p: os.open(p, os.O_RDONLY) for p in dict.fromkeys(b.path for b in blocks)}
    pieces = np.array([(fds[blocks[i].path], blocks[i].offset, blocks[i].nbytes, int(dest.data.ptr) + int(starts[i]))
                       for i in order], dtype=np.int64)
    rows = Rows()

    def emit(name: str, runs: list[tuple[float, float]], **config: Any) -> None:
        best_s = min(s for s, _ in runs)
        rows.emit({"name": name, **config, "gb_per_s": round(total / best_s / 1e9, 2),
                   "gb_per_s_runs": [round(total / s / 1e9, 2) for s, _ in runs],
                   "cpu_core_s_per_gb": round(float(np.median([c for _, c in runs])) / (total / 1e9), 3)})

    def raw(label: str) -> None:
        runs = [raw_kvikio_blocks(blocks, dest) for _ in range(args.repeats)]
        emit(f"raw KvikIO, blocks shuffled ({label})", [(r.seconds, r.cpu_s) for r in runs], threads=16)

    try:
        raw("first")
        for threads, bufs, buf_mib, blocking in [(16, 2, 4, False), (16, 2, 4, True), (12, 2, 4, False),
                                                 (12, 2, 4, True), (8, 2, 4, False), (24, 2, 4, True),
                                                 (16, 1, 4, False), (16, 4, 4, False), (16, 4, 4, True),
                                                 (16, 2, 8, False), (16, 2, 1, False)]:
            config = {"threads": threads, "bufs_per_thread": bufs, "buf_mib": buf_mib, "blocking_sync": blocking}
            runs = [stager_read(pieces, threads, bufs, buf_mib << 20, blocking, None)
                    for _ in range(args.repeats)]
            emit("stager alone, one job", runs, **config)
        for threads, blocking in [(16, False), (16, True), (12, True)]:
            runs = [stager_read(pieces, threads, 2, 4 << 20, blocking, WINDOW_BLOCKS)
                    for _ in range(args.repeats)]
            emit(f"stager alone, jobs of {WINDOW_BLOCKS} blocks, 3 in flight", runs, threads=threads,
                 bufs_per_thread=2, buf_mib=4, blocking_sync=blocking)
        made = stager_module.Stager
        for threads, blocking in [(16, False), (16, True), (12, True), (12, False)]:
            stager_module.Stager = lambda *a, _b=blocking, **k: made(*a, **k, blocking_sync=_b)  # type: ignore
            try:
                with GDSDataset(path, batch_size=BATCH, backend="pinned", shuffle=True,
                                backend_options={"reader": "native", "num_threads": threads}) as ds:
                    time_pass(ds)
                    runs = [time_pass(ds, min_seconds=0.5) for _ in range(args.repeats)]
            finally:
                stager_module.Stager = made
            best_run = min(runs, key=lambda r: r.seconds / r.bytes)
            rows.emit({"name": "pinned backend, shuffled pass (0.5 s from rest)", "threads": threads,
                       "blocking_sync": blocking, "gb_per_s": round(best_run.gb_per_s, 2),
                       "gb_per_s_runs": [round(r.gb_per_s, 2) for r in runs],
                       "cpu_core_s_per_gb": round(best_run.cpu_core_s_per_gb or 0.0, 3),
                       "stall_fraction": round(best_run.stall_fraction or 0.0, 4)})
            free_device_memory()
        raw("last")
    finally:
        for fd in fds.values():
            os.close(fd)
    print("wrote", write_probe(args, "probe-pinned-gap", rows, dataset_bytes=total), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
