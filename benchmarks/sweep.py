"""gdsload's tunables swept by name on one warm dataset, beside the ceilings of the same files.

    python -m benchmarks.sweep --configs copies      # pinned: copy_share, slot and pool sizes, threads
    python -m benchmarks.sweep --configs events      # pinned: slot events spinning or sleeping
    python -m benchmarks.sweep --configs pools       # pinned: small pools, KvikIO or Python reader threads
    python -m benchmarks.sweep --configs windows     # kvikio / pinned: window size x prefetch depth
    python -m benchmarks.sweep --configs readers     # pinned: native stager / KvikIO reader, beside kvikio, mmap
    python -m benchmarks.sweep --configs cpu-threads --size-gib 0.1   # no GPU needed

A configuration is the keyword arguments of ``GDSDataset`` (``backend``, ``backend_options``, ``prefetch``;
``window_mib`` becomes ``window_blocks``): nothing else is changed. Each one: a warm-up pass, then the best of
``--passes`` (every pass kept). The ceilings are measured before and after the sweep, since they drift
within minutes on a shared machine. Writes ``results/<machine>/sweep-<configs>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

from gdsload import GDSDataset
from gdsload.format.meta import read_metadata
from gdsload.tools.measure import best, raw_kvikio_files, read_files, shard_paths, time_pass

from .common import BATCH, DATA_DIR, RESULTS_DIR, Rows, describe_machine, free_device_memory, make_dataset, \
    results_dir, today, write_json


def pinned(slot_mib: int, pool_mib: int, threads: int, copy_share: int, reader: str = "kvikio",
           spin_events: bool = True) -> dict[str, Any]:
    return {"backend": "pinned", "backend_options": {
        "slot_bytes": slot_mib << 20, "pool_bytes": pool_mib << 20, "num_threads": threads,
        "copy_share": copy_share, "reader": reader, "spin_events": spin_events}}


CONFIGS: dict[str, list[dict[str, Any]]] = {
    "copies": [pinned(16, 512, 16, s) for s in (0, 8, 4, 2)] + [
        pinned(8, 512, 16, 4), pinned(32, 1024, 16, 4), pinned(8, 256, 16, 4), pinned(16, 512, 32, 4)],
    "events": [pinned(16, 512, 16, s, spin_events=e) for s in (4, 0) for e in (True, False)],
    # small enough that a slot may stay in the CPU's last-level cache between its read and its copy
    "pools": [pinned(16, 512, 16, 4), pinned(16, 128, 16, 4), pinned(8, 64, 16, 4), pinned(4, 64, 16, 4),
              pinned(16, 512, 16, 4, "threads"), pinned(8, 128, 16, 4, "threads")],
    "windows": [{"backend": b, "window_mib": w, "prefetch": p, "backend_options": {"num_threads": 16}}
                for b, w, p in itertools.product(("kvikio", "pinned"), (128, 256), (1, 2, 4))],
    "cpu-threads": [{"backend": "cpu", "backend_options": {"num_threads": t}} for t in (1, 4, 8)],
    # pinned's readers side by side: the native stager (16 or 32 threads), KvikIO's pool, shuffled or not
    "readers": [{"backend": "pinned", "shuffle": sh, "backend_options": {"reader": "native", "num_threads": t}}
                for sh in (False, True) for t in (16, 32)]
               + [{"backend": "pinned", "shuffle": sh, "backend_options": {"reader": "kvikio"}} for sh in (False, True)]
               + [{"backend": "kvikio", "shuffle": True}, {"backend": "mmap", "shuffle": True}],
}


def label(config: dict[str, Any]) -> str:
    """``pinned slot_bytes=16MiB pool_bytes=512MiB ...``: a configuration in one line."""
    def show(v: Any) -> str:
        return f"{v >> 20}MiB" if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20 else str(v)

    opts = {**{k: v for k, v in config.items() if k not in ("backend", "backend_options")},
            **config.get("backend_options", {})}
    return " ".join([config["backend"]] + [f"{k}={show(v)}" for k, v in opts.items()])


def ceilings(paths: list[str], gpu: bool, rows: Rows) -> None:
    """The same bytes from the page cache into (pinned) host memory and, on a GPU, raw KvikIO into device
    memory: best of three each."""
    tries = {"page cache -> " + ("pinned" if gpu else "host memory"): lambda: read_files(paths, pinned=gpu)}
    if gpu:
        import cupy

        dest = cupy.empty(sum(os.path.getsize(p) for p in paths), cupy.uint8)
        tries["raw kvikio -> device (whole files)"] = lambda: raw_kvikio_files(paths, dest)
    for name, fn in tries.items():
        rows.emit({"ceiling": name, "gb_per_s": round(best([fn() for _ in range(3)]).gb_per_s, 2)})
    tries.clear()
    free_device_memory()


def sweep_one(path: str, config: dict[str, Any], passes: int, batch_size: int) -> dict[str, Any]:
    """One configuration: a warm-up pass, then ``passes`` timed ones; its row."""
    kwargs = {k: v for k, v in config.items() if k != "window_mib"}
    if "window_mib" in config:
        block = read_metadata(path).fields["image"].block_bytes
        kwargs["window_blocks"] = max(1, (config["window_mib"] << 20) // block)
    with GDSDataset(path, batch_size=batch_size, **kwargs) as ds:
        time_pass(ds)
        runs = [time_pass(ds) for _ in range(passes)]
        d = ds.describe()
    top = best(runs)
    return {"config": label(config), **config, "gb_per_s": round(top.gb_per_s, 2),
            "gb_per_s_runs": [round(r.gb_per_s, 2) for r in runs],
            "stall_fraction": round(min(r.stall_fraction or 0.0 for r in runs), 4), "io_mode": d["io_mode"],
            "window_blocks": d["window_blocks"], "window_buffers": d["window_buffers"],
            "backend_stats": d["backend_stats"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", choices=sorted(CONFIGS), default="copies")
    ap.add_argument("--data", default=DATA_DIR)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="times through the configurations, interleaved")
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    configs = CONFIGS[args.configs]
    gpu = any(c["backend"] != "cpu" for c in configs)
    info = describe_machine(args.data)
    path = make_dataset(args.data, args.size_gib)
    paths = shard_paths(path)
    read_files(paths)  # warm the page cache
    rows = Rows()
    ceilings(paths, gpu, rows)
    for _ in range(args.rounds):
        for config in configs:
            rows.emit(sweep_one(path, config, args.passes, args.batch_size))
            free_device_memory()
    ceilings(paths, gpu, rows)
    out = os.path.join(results_dir(args.out, info), f"sweep-{args.configs}.json")
    write_json(out, {"benchmark": "benchmarks.sweep", "configs": args.configs, "date": today(), "machine": info,
                     "dataset_bytes": sum(os.path.getsize(p) for p in paths), "passes": args.passes,
                     "batch_size": args.batch_size, "results": rows})
    print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
