#!/usr/bin/env python3
"""Read benchmark: gdsload's GPU backends against ceilings and a naive loader, in one run, on the same files.

    python benchmarks/bench_read.py --data /path/on/nvme --size-gib 4 --out benchmarks/results

Every figure is GB/s of dataset bytes landed in device memory (ceilings: bytes moved by that stage alone).
Cold runs drop the page cache first (root only; skipped and said so otherwise), warm runs read again right
after. The I/O mode is on every line. Writes ``read-<date>-<gpu>.json`` and ``.md``; plots come from
``benchmarks/report.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gdsload import GDSDataset, read_metadata  # noqa: E402
from gdsload.format import DatasetLayout  # noqa: E402
from gdsload.sysinfo import pinned_h2d_gbps, system_info  # noqa: E402
from gdsload.writer import write_dataset  # noqa: E402

CHUNK = 8 << 20
THREADS = 16


class RandomImages:
    """224x224x3 uint8 samples of noise, generated slice by slice (incompressible, like JPEG-decoded data)."""

    origin = "<random>"
    dtype = np.dtype(np.uint8)

    def __init__(self, n: int):
        self.shape = (n, 224, 224, 3)
        self.rng = np.random.default_rng(0)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.rng.integers(0, 256, (stop - start, *self.shape[1:]), dtype=np.uint8)

    def close(self) -> None:
        pass


class Labels:
    origin = "<labels>"
    dtype = np.dtype(np.int64)

    def __init__(self, n: int):
        self.shape = (n,)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.arange(start, stop, dtype=np.int64)

    def close(self) -> None:
        pass


def make_dataset(path: str, size_gib: float, block_bytes: int = 4 << 20) -> None:
    if os.path.exists(path):
        return
    n = int(size_gib * 2**30 // (224 * 224 * 3))
    t0 = time.perf_counter()
    write_dataset(path, {"image": RandomImages(n), "label": Labels(n)}, block_bytes=block_bytes, progress=False)
    os.sync()  # no writeback may run under the measurements
    print(f"wrote {path}: {n} samples in {time.perf_counter() - t0:.1f} s", flush=True)


def bench_dataset(data_dir: str, name: str, size_gib: float) -> tuple[str, list[str], int]:
    """Write (or keep) a benchmark dataset: its path, its shard files and their total bytes."""
    path = os.path.join(data_dir, name)
    make_dataset(path, size_gib)
    paths = DatasetLayout(read_metadata(path)).shard_paths()
    return path, paths, sum(os.path.getsize(p) for p in paths)


class Rows(list):
    """Result rows, each printed as a JSON line when added."""

    def emit(self, row: dict) -> None:
        self.append(row)
        print(json.dumps(row), flush=True)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def result_name(info: dict, prefix: str, suffix: str = "") -> str:
    """``{prefix}{date}-{gpu}{suffix}``: the name every results file gets (date in UTC, GPU without spaces)."""
    gpu = (info.get("gpu") or "cpu").replace("NVIDIA ", "").replace(" ", "-")
    return f"{prefix}{today()}-{gpu}{suffix}"


def write_probe(out: str, prefix: str, suffix: str, rows: list[dict], **extra: object) -> str:
    """Write a probe's rows with the machine described; returns the path."""
    info = system_info(bandwidth=False)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, result_name(info, prefix, suffix) + ".json")
    with open(path, "w") as f:
        json.dump({"date": today(), "machine": info,
                   **extra, "results": rows}, f, indent=1)
    return path


def step_probe_parser(description: str) -> argparse.ArgumentParser:
    """The options every training-step probe takes: dataset, output, and Python's thread switch interval
    (``parse_step_probe_args`` applies it)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data", required=True)
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this run (seconds; Python's default is 0.005)")
    return ap


def parse_step_probe_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    return args


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def chunks_of(paths: list[str], chunk: int) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        size = os.path.getsize(p)
        out += [(p, o, min(chunk, size - o)) for o in range(0, size, chunk)]
    return out


# -- ceilings --------------------------------------------------------------------------------------
def posix_read(paths: list[str], direct: bool, pinned: bool) -> tuple[int, float]:
    """Many threads reading whole files in 8 MiB pieces: O_DIRECT (disk ceiling) or buffered (page cache)."""
    import cupy

    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in paths}
    local = threading.local()
    keep = []

    def buf() -> memoryview:
        if not hasattr(local, "b"):
            if pinned:
                mem = cupy.cuda.alloc_pinned_memory(CHUNK)
                keep.append(mem)
                local.b = memoryview(np.frombuffer(mem, np.uint8, CHUNK))
            else:
                local.b = memoryview(mmap.mmap(-1, CHUNK))  # page aligned, as O_DIRECT needs
        return local.b

    def read(item: tuple[str, int, int]) -> int:
        p, off, n = item
        n_al = -(-n // 4096) * 4096 if direct else n
        got = os.preadv(fds[p], [buf()[:n_al]], off)
        return min(got, n)

    items = chunks_of(paths, CHUNK)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda _: buf(), range(THREADS * 2)))  # allocate outside the timing
        t0 = time.perf_counter()
        total = sum(pool.map(read, items))
        dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total, dt


def raw_kvikio(paths: list[str], dest, threads: int = THREADS) -> tuple[int, float]:
    """The best raw KvikIO read of the same bytes: whole shard files, handles opened before timing, KvikIO's
    process-wide pool set to ``threads`` threads and 4 MiB tasks first (as gdsload sets it; KvikIO's own
    default is one thread, and gdsload backends made since may have set another count)."""
    import cupy
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": threads, "task_size": 4 << 20})

    handles = [kvikio.CuFile(p, "r") for p in paths]
    sizes = [os.path.getsize(p) for p in paths]
    t0 = time.perf_counter()
    futures, off = [], 0
    for h, n in zip(handles, sizes):
        futures.append(h.pread(dest[off:off + n], n, 0))
        off += n
    total = sum(f.get() for f in futures)
    cupy.cuda.runtime.deviceSynchronize()
    dt = time.perf_counter() - t0
    for h in handles:
        h.close()
    return total, dt


def naive(paths: list[str]) -> tuple[int, float]:
    """What people write first: np.fromfile per file, then cupy.asarray (pageable copy)."""
    import cupy

    t0 = time.perf_counter()
    total = 0
    for p in paths:
        d = cupy.asarray(np.fromfile(p, dtype=np.uint8))
        total += d.nbytes
        del d
    cupy.cuda.runtime.deviceSynchronize()
    return total, time.perf_counter() - t0


def gdsload_epoch(ds: GDSDataset) -> tuple[int, float]:
    import cupy

    t0 = time.perf_counter()
    last = None
    for b in ds:
        last = b
    cupy.cuda.get_current_stream().synchronize()
    dt = time.perf_counter() - t0
    del last
    return ds.stats.bytes_read, dt


def best_pass_seconds(ds: GDSDataset, passes: int) -> float:
    """Seconds of the fastest of ``passes`` passes over ``ds`` (the first, warming up, counts too)."""
    return min(gdsload_epoch(ds)[1] for _ in range(passes))


# -- driver ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="directory for the dataset (created if missing)")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--warm-repeats", type=int, default=3)
    ap.add_argument("--skip-cold", action="store_true")
    args = ap.parse_args()

    import cupy

    os.makedirs(args.data, exist_ok=True)
    path = os.path.join(args.data, "bench.gds")
    make_dataset(path, args.size_gib)
    meta = read_metadata(path)
    layout = DatasetLayout(meta)
    paths = [p for p in layout.shard_paths()]
    data_bytes = sum(os.path.getsize(p) for p in paths)
    info = system_info(bandwidth=False)
    disk = subprocess.run(["df", "-h", args.data], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    info["data_filesystem"] = disk
    print(json.dumps(info), flush=True)

    results: list[dict] = []
    can_drop = drop_caches()

    def record(name: str, regime: str, io_mode: str, fn: Callable[[], tuple[int, float]], **extra) -> None:
        nbytes, dt = fn()
        row = {"name": name, "regime": regime, "io_mode": io_mode, "bytes": nbytes, "seconds": round(dt, 4),
               "gb_per_s": round(nbytes / dt / 1e9, 2), **extra}
        results.append(row)
        print(f"{name:<28} {regime:<5} {io_mode:<14} {row['gb_per_s']:7.2f} GB/s  ({nbytes / 1e9:.2f} GB in "
              f"{dt:.2f} s)", flush=True)

    def cold_then_warm(name: str, io_mode: str, fn: Callable[[], tuple[int, float]], **extra) -> None:
        if not args.skip_cold and can_drop:
            drop_caches()
            record(name, "cold", io_mode, fn, **extra)
        else:
            fn()  # warm the cache
        for _ in range(args.warm_repeats):
            record(name, "warm", io_mode, fn, **extra)

    # Ceilings
    record("h2d-pinned-ceiling", "-", "cuda-memcpy", lambda: (1 << 30, (1 << 30) / (pinned_h2d_gbps(1 << 30) * 1e9)))
    if can_drop:
        drop_caches()
        record("disk-odirect-ceiling", "cold", "posix-odirect", lambda: posix_read(paths, True, False))
    posix_read(paths, False, True)
    for _ in range(args.warm_repeats):
        record("pagecache-ceiling", "warm", "posix-pinned", lambda: posix_read(paths, False, True))

    dest = cupy.empty(data_bytes, dtype=cupy.uint8)
    from gdsload.backends import gds_available

    kv_mode = "gds" if gds_available() else "kvikio-compat"
    cold_then_warm("raw-kvikio-whole-files", kv_mode, lambda: raw_kvikio(paths, dest))
    dest = None  # free the device copy before the next contender
    cupy.get_default_memory_pool().free_all_blocks()

    for backend in ("kvikio", "pinned"):
        ds = GDSDataset(path, batch_size=args.batch_size, backend=backend)
        cold_then_warm(f"gdsload-{backend}", ds.io_mode, lambda: gdsload_epoch(ds),
                       window_blocks=ds.config.window_blocks)
        ds.close()
        ds = GDSDataset(path, batch_size=args.batch_size, backend=backend, shuffle=True)
        for _ in range(args.warm_repeats):
            record(f"gdsload-{backend}-shuffle", "warm", ds.io_mode, lambda: gdsload_epoch(ds),
                   window_blocks=ds.config.window_blocks)
        ds.close()
        cupy.get_default_memory_pool().free_all_blocks()

    cold_then_warm("naive-fromfile-asarray", "posix-pageable", lambda: naive(paths))

    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, result_name(info, "read-"))
    stamp = today()
    doc = {"benchmark": "bench_read", "date": stamp, "machine": info, "dataset": {
        "path": path, "bytes": data_bytes, "samples": meta.num_samples, "samples_per_block": meta.samples_per_block,
        "block_bytes": meta.fields["image"].block_bytes, "shards": len(paths)},
        "page_cache_dropped": can_drop, "threads": THREADS, "results": results}
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    from report import markdown  # noqa: E402

    with open(base + ".md", "w") as f:
        f.write(markdown(doc))
    print(f"wrote {base}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
