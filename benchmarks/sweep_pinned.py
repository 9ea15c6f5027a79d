#!/usr/bin/env python3
"""The pinned backend's warm GB/s across slot sizes, pool sizes and reader threads (one run, same data).

    python benchmarks/sweep_pinned.py --data /path/on/nvme --out benchmarks/results

Each configuration: best of four passes over a 4 GiB dataset after one warm-up pass. Behind the default
of 16 MiB slots in a 512 MiB pool, one slot in four kept out of reading for copies in flight.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_read import Rows, bench_dataset, best_pass_seconds, posix_read, raw_kvikio, write_probe  # noqa: E402

from gdsload import GDSDataset  # noqa: E402

from gdsload import pool as slot_pool  # noqa: E402
from gdsload.backends import pinned  # noqa: E402

# (slot MiB, pool MiB, reader threads, pinned.COPY_SHARE: one slot in that many kept for copies (0: none),
# reader[, pool.SLOT_EVENTS_SPIN]). "pools": small enough that slots may stay in the CPU's last-level cache
# between their read and their copy.
CONFIGS = {
    "copies": [(16, 512, 16, 0, "kvikio"), (16, 512, 16, 8, "kvikio"), (16, 512, 16, 4, "kvikio"),
               (16, 512, 16, 2, "kvikio"), (8, 512, 16, 4, "kvikio"), (32, 1024, 16, 4, "kvikio"),
               (8, 256, 16, 4, "kvikio"), (16, 512, 32, 4, "kvikio")],
    # the slots' events: a waiting driver spins (True) or sleeps (False)
    "events": [(16, 512, 16, 4, "kvikio", True), (16, 512, 16, 4, "kvikio", False),
               (16, 512, 16, 0, "kvikio", True), (16, 512, 16, 0, "kvikio", False)],
    "pools": [(16, 512, 16, 4, "kvikio"), (16, 128, 16, 4, "kvikio"), (8, 64, 16, 4, "kvikio"),
              (4, 64, 16, 4, "kvikio"), (16, 512, 16, 4, "threads"), (8, 128, 16, 4, "threads")],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=1, help="times through the configurations, interleaved")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--configs", choices=sorted(CONFIGS), default="copies")
    args = ap.parse_args()
    import cupy

    path, paths, nbytes = bench_dataset(args.data, "step.gds", args.size_gib)
    posix_read(paths, False, True)
    rows = Rows()
    ceilings(paths, nbytes, rows)
    cupy.get_default_memory_pool().free_all_blocks()
    for _ in range(args.rounds):
        for config in CONFIGS[args.configs]:
            sweep_one(path, config, rows)
    ceilings(paths, nbytes, rows)
    print("wrote", write_probe(args.out, "sweep-pinned-", args.suffix, rows, dataset_bytes=nbytes), flush=True)
    return 0


def ceilings(paths: list[str], nbytes: int, rows: Rows) -> None:
    """The same bytes from the page cache into pinned memory, and raw KvikIO into device memory (best of
    three), measured beside the sweep: this machine's ceilings drift between minutes."""
    import cupy

    dest = cupy.empty(nbytes, cupy.uint8)
    for name, fn in (("page cache -> pinned", lambda: posix_read(paths, False, True)),
                     ("raw kvikio -> device", lambda: raw_kvikio(paths, dest))):
        rows.emit({"ceiling": name, "gb_per_s": round(max(n / dt for n, dt in (fn() for _ in range(3))) / 1e9, 2)})


def sweep_one(path: str, config: tuple, rows: Rows) -> None:
    import cupy

    slot, pool, threads, share, reader, spin = (*config, True)[:6]
    pinned.COPY_SHARE = share
    slot_pool.SLOT_EVENTS_SPIN = spin
    opts = {"slot_bytes": slot << 20, "pool_bytes": pool << 20, "num_threads": threads, "reader": reader}
    with GDSDataset(path, batch_size=256, backend="pinned", backend_options=opts) as ds:
        best = best_pass_seconds(ds, 5)
        rows.emit({"slot_mib": slot, "pool_mib": pool, "threads": threads, "reader": ds.backend.reader,
                   "slot_events": "spin" if spin else "sleep", "copy_share": share if ds.backend._driver else None,
                   "reading_slots": ds.backend._driver.reading_slots if ds.backend._driver else None,
                   "gb_per_s": round(ds.stats.bytes_read / best / 1e9, 2)})
    cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    sys.exit(main())
