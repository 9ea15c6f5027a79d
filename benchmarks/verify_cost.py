"""What ``verify`` costs each backend, warm and cold, in one run on the same data. GPU only.

    python -m benchmarks.verify_cost [--size-gib 8] [--cold-gib 2] [--backends mmap,pinned,kvikio]

Verify off and on alternating round by round, in alternating order; warm: shuffled stretches from rest; cold: one
pass from a dropped cache (mmap: open + pass); first pass: a fresh dataset's open and pass; codec: Zarr stores
with and without zarr's crc32c codec. Cost = 1 - best(on) / best(off)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import numpy as np

from gdsload import GDSDataset
from gdsload.tools.measure import cold_pass, drop_page_cache, pinned_h2d_gbps, time_pass

from .common import BATCH, Rows, make_dataset, open_and_pass, probe_args, write_probe_table


def alternating(measure: Callable[[bool], float], rounds: int) -> dict[bool, list[float]]:
    """``measure(False)`` and ``measure(True)``, ``rounds`` times, off first in even rounds and on first in odd
    ones (neither is always measured second): each one's figures."""
    passes: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for v in (False, True) if r % 2 == 0 else (True, False):
            passes[v].append(measure(v))
    return passes


def alternate(datasets: dict[bool, GDSDataset], rounds: int, min_seconds: float) -> dict[bool, list[float]]:
    """Warm GB/s of the two ``datasets`` in turn, after a pass each (page cache, kernels, buffers), each stopped
    after its turn (neither reads ahead while the other is measured); closes them."""
    def turn(v: bool) -> float:
        gbps = time_pass(datasets[v], min_seconds=min_seconds).gb_per_s
        datasets[v].stop()
        return gbps

    try:
        for ds in datasets.values():
            time_pass(ds)
            ds.stop()
        return alternating(turn, rounds)
    finally:
        for ds in datasets.values():
            ds.close()


def warm(path: str, backend: str, rounds: int, min_seconds: float,
         options: dict) -> tuple[str, dict[bool, list[float]]]:
    datasets = {v: GDSDataset(path, BATCH, backend=backend, shuffle=True, verify=v, **options) for v in (False, True)}
    return datasets[True].io_mode, alternate(datasets, rounds, min_seconds)


def first(path: str, backend: str, verify: bool) -> float:
    """GB/s of a fresh dataset's open and first pass: where mmap checks each block (once, when first read)."""
    return open_and_pass(path, BATCH, backend=backend, shuffle=True, verify=verify).gb_per_s


def cold(path: str, backend: str, verify: bool) -> float:
    """One pass from a dropped page cache (mmap, whose open reads the files: open + pass)."""
    if backend == "mmap":
        drop_page_cache()
        return first(path, backend, verify)
    with GDSDataset(path, BATCH, backend=backend, shuffle=True, verify=verify) as ds:
        return cold_pass(ds).gb_per_s


def zarr_store(data_dir: str, size_gib: float, crc: bool) -> str:
    """A Zarr store as zarr-python writes one (no gdsload attribute): uint8 samples of 150,528 bytes in 4 MiB
    chunks of 28, shards of 64 chunks, raw, with zarr's ``crc32c`` codec after each chunk or without."""
    import zarr
    from zarr.codecs import Crc32cCodec

    path = os.path.join(data_dir, f"zarr-{size_gib:g}GiB-{'crc32c' if crc else 'raw'}")
    if os.path.exists(path):
        return path
    n, row = int(size_gib * 2**30 // 150528), 150528
    a = zarr.create_array(path, shape=(n, row), dtype="uint8", chunks=(28, row), shards=(28 * 64, row),
                          compressors=[Crc32cCodec()] if crc else None)
    rng = np.random.default_rng(0)
    for lo in range(0, n, 28 * 64):
        hi = min(n, lo + 28 * 64)
        a[lo:hi] = rng.integers(0, 256, (hi - lo, row), dtype=np.uint8)
    os.sync()
    return path


def codec(data_dir: str, size_gib: float, backend: str, rounds: int, min_seconds: float) -> dict:
    """What the always-on check of zarr's crc32c codec costs: the same samples read from a store with the
    codec and one without, warm, shuffled, alternating."""
    stores = {crc: zarr_store(data_dir, size_gib, crc) for crc in (False, True)}
    datasets = {crc: GDSDataset(p, BATCH, backend=backend, shuffle=True) for crc, p in stores.items()}
    return {"what": f"gdsload {backend}, Zarr store", "io_mode": datasets[True].io_mode, "regime": "warm, crc32c codec",
            **costs(alternate(datasets, rounds, min_seconds), "without_codec", "with_codec")}


def costs(passes: dict[bool, list[float]], off: str, on: str) -> dict:
    """Every run's GB/s off (``gb_per_s_<off>``) and on, the best of each, and the cost."""
    top = {v: max(x) for v, x in passes.items()}
    return {f"gb_per_s_{off}": [round(x, 2) for x in passes[False]],
            f"gb_per_s_{on}": [round(x, 2) for x in passes[True]], "best_off": round(top[False], 2),
            "best_on": round(top[True], 2), "cost_pct": round(100 * (1 - top[True] / top[False]), 1)}


def row(backend: str, io_mode: str, regime: str, passes: dict[bool, list[float]]) -> dict:
    return {"what": f"gdsload {backend}", "io_mode": io_mode, "regime": regime, "shuffle": True,
            **costs(passes, "verify_off", "verify_on")}


def markdown(rows: list[dict]) -> str:
    lines = ["| backend | io mode | regime | GB/s verify off | GB/s verify on | cost |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "cost_pct" in r:
            lines.append(f"| {r['what']} | {r['io_mode']} | {r['regime']} | {r['best_off']} | {r['best_on']} | "
                         f"{r['cost_pct']} % |")
        elif "gb_per_s" in r:
            lines.append(f"| {r['what']} | | | {r['gb_per_s']} | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = probe_args(__doc__.splitlines()[0], argv, 8.0, cold_gib=2.0, rounds=3, cold_rounds=2, first_rounds=2,
                      codec_gib=(2.0, "Zarr stores for the crc32c codec rows (0: none)"), min_seconds=0.5,
                      backends="mmap,pinned,kvikio",
                      options=({}, "GDSDataset options as JSON (warm rows)", json.loads))
    path = make_dataset(args.data, args.size_gib)
    rows = Rows()
    rows.emit({"what": "ceiling: pinned H2D copy", "gb_per_s": round(pinned_h2d_gbps(), 2)})
    backends = args.backends.split(",")
    for backend in backends:
        io_mode, passes = warm(path, backend, args.rounds, args.min_seconds, args.options)
        rows.emit({**row(backend, io_mode, "warm", passes), "options": args.options})
        if args.first_rounds:
            rows.emit(row(backend, io_mode, "warm, first pass from open",
                          alternating(lambda v: first(path, backend, v), args.first_rounds)))
    if args.codec_gib:
        for backend in backends:
            rows.emit(codec(args.data, args.codec_gib, backend, args.rounds, args.min_seconds))
    if args.cold_rounds and drop_page_cache():
        cold_path = make_dataset(args.data, args.cold_gib)
        for backend in backends:
            with GDSDataset(cold_path, BATCH, backend=backend) as ds:
                io_mode = ds.io_mode
            rows.emit(row(backend, io_mode, "cold",
                          alternating(lambda v: cold(cold_path, backend, v), args.cold_rounds)))
    write_probe_table(args, "verify-cost", rows, markdown(rows), rounds=args.rounds, method=__doc__.split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
