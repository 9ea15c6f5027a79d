#!/usr/bin/env python3
"""gdsload against the loaders people use today, beside the ceilings, in one run on the same data.

    python benchmarks/run.py --quick          # minutes: 1 GiB, warm/cold/shm, main contenders
    python benchmarks/run.py --full           # + 16 GiB dataset, 1/4/16 MiB blocks, thread counts

Contenders: gdsload kvikio, pinned and mmap (dataset locked in RAM at open; its cold figure is open + one
pass); torch DataLoader over the same blocks (num_workers 0/4/8,
pin_memory=True, then .to("cuda", non_blocking=True)); zarr-python + cupy.asarray (and zarr's GPU
buffers if they work here); naive np.fromfile + cupy.asarray. Ceilings: O_DIRECT disk read, page-cache
read into pinned memory, pinned host-to-device copy. Figures: GB/s into device memory, samples/s,
CPU core-seconds per GB (this process and its finished children: DataLoader workers), gdsload's peak
pinned bytes, and with a simulated training step (a GPU kernel of fixed duration per batch) the share of
time spent waiting for data: wall time beyond the same steps run alone (and gdsload's own count of the time
its consumer blocked on the host). Writes benchmarks/results/<date>-<gpu>.json, .md and .png (and prints every line).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_read import drop_caches, make_dataset, naive, posix_read, raw_kvikio, result_name, today  # noqa: E402
from report_suite import DEFAULT_CONFIG, render  # noqa: E402

from gdsload import GDSDataset, read_metadata  # noqa: E402
from gdsload.format import DatasetLayout  # noqa: E402
from gdsload.sysinfo import pinned_h2d_gbps, system_info  # noqa: E402

SAMPLE_BYTES = 224 * 224 * 3
BATCH = 256
GDSLOAD_BACKENDS = tuple(DEFAULT_CONFIG)


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Spin:
    """A simulated training step: one GPU kernel that runs for a fixed time, then a sync (as loss.item()).

    The kernel spins on the GPU's nanosecond global timer, not on clock cycles: a cycle count lasts as long
    as the clock the GPU happens to run at, and "alone" and "with a loader" must be the same step. Given
    ``stamps`` (a device uint64 pointer), the kernel writes when it started and ended there (two words)."""

    def __init__(self, ms: float, sync_every: int = 1):
        """``sync_every``: the host waits for the GPU after every that many steps (1: each step, the worst
        case for a loader, whose ``next()`` then lies between two steps on the GPU; more: the host runs
        ahead, as a loop that reads its loss every few steps)."""
        import cupy

        self.cupy = cupy
        self.sync_every = sync_every
        self._calls = 0
        self.ns = np.uint64(round(ms * 1e6))
        self.kernel = cupy.RawKernel(r"""
        extern "C" __global__ void spin(unsigned long long ns, unsigned long long* stamps) {
            unsigned long long t0, t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
            if (stamps) { stamps[0] = t0; stamps[1] = t; }
        }""", "spin")
        self._null = np.uint64(0)

    def launch(self, stamps: np.uint64 | None = None) -> None:
        self.kernel((1,), (1,), (self.ns, self._null if stamps is None else stamps))

    def __call__(self) -> None:
        self.launch()
        self._calls += 1
        if self._calls % self.sync_every == 0:
            self.cupy.cuda.get_current_stream().synchronize()

    def alone(self, steps: int) -> tuple[float, float]:
        """Seconds ``steps`` steps take with no data to wait for, timed now, and the CPU seconds that took.
        A pass's wall time beyond this is time spent waiting for data, seen from outside (host waits,
        device-side waits and gather work alike). Timed right before each pass it is compared with: on the
        H100 machine the same steps' launch-and-sync turnaround drifted by up to 40 us per step between
        minutes of one run (benchmarks/results/probe-overhead-*), 4 % of a 1 ms step."""
        self()
        self.cupy.cuda.get_current_stream().synchronize()
        self._calls = 0
        c0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(steps):
            self()
        self.cupy.cuda.get_current_stream().synchronize()
        took = time.perf_counter() - t0, cpu_seconds() - c0
        self._calls = 0  # the pass timed next starts in the same phase
        return took


# -- contenders: each returns (bytes into device memory, samples, seconds, stall seconds, extra) -------
def gdsload_run(path: str, backend: str, shuffle: bool, step: Spin | None, **opts: Any) -> Callable[[], dict]:
    ds = GDSDataset(path, batch_size=BATCH, backend=backend, shuffle=shuffle, **opts)

    def run() -> dict:
        import cupy

        alone, alone_cpu = step.alone(len(ds)) if step is not None else (0.0, 0.0)
        t0 = time.perf_counter()
        n = 0
        for b in ds:
            n += int(b["label"].shape[0])
            if step is not None:
                step()
        cupy.cuda.get_current_stream().synchronize()
        wall = time.perf_counter() - t0
        extra = {"io_mode": ds.io_mode, "window_blocks": ds.config.window_blocks,
                 "first_batch_s": ds.stats.first_batch_s}
        if backend == "pinned":
            extra["peak_pinned_bytes"] = ds.backend.pool.peak_bytes_in_use
            extra["pinned_pool_bytes"] = ds.backend.pool.total_bytes
            extra["reader"] = ds.backend.reader
        if backend == "mmap":
            extra["peak_pinned_bytes"] = ds.backend.pinned_bytes  # the whole dataset, locked at open
            extra["register_s"] = round(ds.backend.register_s, 3)
            extra["preload_s"] = round(ds.backend.preload_s, 3)
        if step is not None:
            extra.update(wait_s=max(0.0, wall - alone), alone_s=alone, untimed_cpu_s=alone_cpu)
        return {"bytes": ds.stats.bytes_read, "samples": n, "seconds": wall, "stall_s": ds.stats.stall_s, **extra}

    run.close = ds.close  # type: ignore[attr-defined]
    run.stop = ds.stop  # type: ignore[attr-defined]  # before a cold pass: nothing read ahead from a warm cache
    return run


def mmap_open_and_pass(path: str, shuffle: bool) -> dict:
    """The mmap backend from a cold cache: it reads the files while it locks them at open, so its cold
    figure is open + one pass (a pass alone would replay what the open already loaded)."""
    t0 = time.perf_counter()
    run = gdsload_run(path, "mmap", shuffle, None)
    opened = time.perf_counter() - t0
    try:
        r = run()
    finally:
        run.close()
    return {**r, "seconds": opened + r["seconds"], "first_batch_s": opened + r["first_batch_s"],
            "stall_s": opened + r["stall_s"]}


class TorchBlocks:
    """Map-style torch dataset of the same blocks: item i is block i of the image field (os.pread)."""

    def __init__(self, path: str):
        layout = DatasetLayout(read_metadata(path), ("image", "label"))
        meta = layout.meta
        self.items = [(layout.locate("image", b), layout.locate("label", b),
                       min(meta.samples_per_block, meta.num_samples - b * meta.samples_per_block))
                      for b in range(meta.num_blocks)]
        self.fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _read(self, loc) -> Any:
        import torch

        fd = self.fds.get(loc.path)
        if fd is None:
            fd = self.fds[loc.path] = os.open(loc.path, os.O_RDONLY)
        buf = np.empty(loc.nbytes, dtype=np.uint8)
        os.preadv(fd, [buf], loc.offset)
        return torch.from_numpy(buf)

    def __getitem__(self, i: int) -> tuple[Any, Any, int]:
        image, label, n = self.items[i]
        return self._read(image), self._read(label), n


def torch_run(path: str, workers: int, shuffle: bool, step: Spin | None) -> Callable[[], dict]:
    import torch
    from torch.utils.data import DataLoader

    blocks = TorchBlocks(path)

    def run() -> dict:
        loader = DataLoader(blocks, batch_size=None, shuffle=shuffle, num_workers=workers, pin_memory=True,
                            prefetch_factor=4 if workers else None)
        nbytes, n, stall = 0, 0, 0.0
        alone, alone_cpu = step.alone(len(blocks)) if step is not None else (0.0, 0.0)
        t0 = time.perf_counter()
        it = iter(loader)
        while True:
            w0 = time.perf_counter()
            try:
                image, label, count = next(it)
            except StopIteration:
                break
            stall += time.perf_counter() - w0
            image = image.to("cuda", non_blocking=True)
            label = label.to("cuda", non_blocking=True)
            nbytes += image.numel() + label.numel()
            n += int(count)
            if step is not None:
                step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        del it, loader
        extra = {"wait_s": max(0.0, wall - alone), "untimed_cpu_s": alone_cpu} if step is not None else {}
        return {"bytes": nbytes, "samples": n, "seconds": wall, "stall_s": stall, "io_mode": "posix-pageable",
                **extra}

    return run


def zarr_run(path: str, gpu: bool) -> Callable[[], dict]:
    import cupy
    import zarr

    def run() -> dict:
        ctx = zarr.config.enable_gpu() if gpu else _nullcontext()
        with ctx:
            g = zarr.open_group(path, mode="r")
            image, label = g["image"], g["label"]
            step = image.shards[0]
            t0 = time.perf_counter()
            nbytes = n = 0
            for a in range(0, image.shape[0], step):
                x = cupy.asarray(image[a:a + step])
                y = cupy.asarray(label[a:a + step])
                nbytes += x.nbytes + y.nbytes
                n += y.shape[0]
            cupy.cuda.runtime.deviceSynchronize()
        return {"bytes": nbytes, "samples": n, "seconds": time.perf_counter() - t0, "stall_s": None,
                "io_mode": "zarr-gpu-buffers" if gpu else "zarr-host"}

    return run


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def naive_run(paths: list[str]) -> Callable[[], dict]:
    def run() -> dict:
        nbytes, dt = naive(paths)
        return {"bytes": nbytes, "samples": None, "seconds": dt, "stall_s": None, "io_mode": "posix-pageable"}

    return run


# -- driver ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="1 GiB, the main contenders (default)")
    mode.add_argument("--full", action="store_true", help="+16 GiB, block sizes, thread counts")
    ap.add_argument("--data", default="/root/gdsload-bench", help="directory on the disk under test")
    ap.add_argument("--shm", default="/dev/shm/gdsload-bench", help="tmpfs copy for the /dev/shm regime")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--stall-only", action="store_true",
                    help="only the training-step rows, on the larger dataset (written as *-stall.json)")
    ap.add_argument("--stall-repeats", type=int, default=3, help="passes per training-step row")
    ap.add_argument("--batches-ahead", type=int, default=None,
                    help="GDSDataset(batches_ahead=...) for the training-step rows (default: the dataset's)")
    ap.add_argument("--suffix", default="", help="added to the results' file names")
    args = ap.parse_args()
    import cupy

    started = time.perf_counter()
    os.makedirs(args.data, exist_ok=True)
    info = system_info(bandwidth=False)
    info["data_filesystem"] = subprocess.run(["df", "-h", args.data], capture_output=True,
                                             text=True).stdout.strip().splitlines()[-1]
    print(json.dumps(info), flush=True)
    can_drop = drop_caches()
    rows: list[dict] = []
    stamp = today()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, result_name(info, "", ("-full" if args.full else "-quick")
                                              + ("-stall" if args.stall_only else "") + args.suffix))

    def save() -> None:
        """Written after every dataset, so a run cut short still leaves what it measured."""
        doc = {"benchmark": "run.py", "mode": "full" if args.full else "quick", "date": stamp, "machine": info,
               "batch_size": BATCH, "sample_bytes": SAMPLE_BYTES, "page_cache_dropped": can_drop,
               "elapsed_s": round(time.perf_counter() - started), "results": rows}
        with open(base + ".json", "w") as f:
            json.dump(doc, f, indent=1)

    def measure(dataset: str, regime: str, name: str, config: str, fn: Callable[[], dict], repeats: int = 1,
                **extra: Any) -> dict | None:
        if regime == "cold":
            if not can_drop:
                return None
            if hasattr(fn, "stop"):
                fn.stop()  # gdsload reads the next epoch ahead: that must not come from the warm cache
            drop_caches()
        best = None
        waits = []  # every repeat's waiting fraction (with a training step): the spread, not just the best
        for _ in range(repeats):
            c0 = cpu_seconds()
            try:
                r = fn()
            except Exception as e:  # a contender that cannot run here is reported, not hidden
                row = {"dataset": dataset, "regime": regime, "name": name, "config": config,
                       "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                return None
            r["cpu_s"] = cpu_seconds() - c0 - r.get("untimed_cpu_s", 0.0)  # not the steps timed alone
            if r.get("wait_s") is not None:
                waits.append(round(r["wait_s"] / r["seconds"], 4))
            if best is None or r["seconds"] < best["seconds"]:
                best = r
        r = best
        gb = r["bytes"] / 1e9
        row = {"dataset": dataset, "regime": regime, "name": name, "config": config, "io_mode": r["io_mode"],
               "gb_per_s": round(gb / r["seconds"], 2),
               "samples_per_s": round(r["samples"] / r["seconds"]) if r.get("samples") else None,
               "cpu_core_s_per_gb": round(r["cpu_s"] / gb, 3), "seconds": round(r["seconds"], 3),
               "stall_fraction": round(r["stall_s"] / r["seconds"], 4) if r.get("stall_s") is not None else None,
               # after the first batch: the pass's steady state, without the wait for its first window
               "steady_stall_fraction": round((r["stall_s"] - r["first_batch_s"]) / (r["seconds"] - r["first_batch_s"]),
                                              4) if r.get("first_batch_s") is not None else None,
               # with a training step: wall time beyond the same steps run alone, over wall time
               "wait_fraction": round(r["wait_s"] / r["seconds"], 4) if r.get("wait_s") is not None else None,
               **({"wait_fraction_runs": waits} if len(waits) > 1 else {}),
               **{k: v for k, v in r.items() if k in ("peak_pinned_bytes", "pinned_pool_bytes", "window_blocks",
                                                      "register_s", "preload_s", "reader")},
               **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    sizes = [("1GiB", 1.0), ("16GiB", 16.0) if args.full else ("4GiB", 4.0)][1 if args.stall_only else 0:]
    blocks = [4 << 20] + ([1 << 20, 16 << 20] if args.full else [])
    record = lambda *a, **k: measure(*a, **k)  # noqa: E731

    h2d = pinned_h2d_gbps(1 << 30)
    rows.append({"dataset": "-", "regime": "-", "name": "ceiling: pinned H2D copy", "config": "1 GiB",
                 "io_mode": "cuda-memcpy", "gb_per_s": round(h2d, 2)})
    for label, gib in sizes:
        for block in blocks if label == "1GiB" else [4 << 20]:
            tag = f"{label}-{block >> 20}MiB"
            path = os.path.join(args.data, f"{tag}.gds")
            make_dataset(path, gib, block)
            paths = DatasetLayout(read_metadata(path)).shard_paths()
            if args.stall_only:
                _stall(path, tag, record, paths, args.stall_repeats, args.batches_ahead)
                continue
            main_block = block == 4 << 20
            regimes = ["cold", "warm"] if main_block else ["warm"]
            record(tag, "cold", "ceiling: O_DIRECT disk read", "16 threads, 8 MiB",
                   lambda: _ceiling(posix_read(paths, True, False), "posix-odirect"))
            posix_read(paths, False, True)
            record(tag, "warm", "ceiling: page cache -> pinned", "16 threads, 8 MiB",
                   lambda: _ceiling(posix_read(paths, False, True), "posix-pinned"), repeats=3)
            total = sum(os.path.getsize(p) for p in paths)
            dest = cupy.empty(total, dtype=cupy.uint8)
            for regime in regimes:
                record(tag, regime, "raw KvikIO (whole files)", "16 threads",
                       lambda: _ceiling(raw_kvikio(paths, dest), "kvikio-compat"), repeats=3 if regime == "warm" else 1)
            dest = None
            cupy.get_default_memory_pool().free_all_blocks()
            threads = [8, 16, 32] if args.full and main_block and label == "1GiB" else [16]
            for backend in GDSLOAD_BACKENDS:
                for t in threads if backend != "mmap" else [0]:
                    for shuffle in ([False, True] if main_block else [False]):
                        config = f"threads={t} shuffle={shuffle}" if t else f"shuffle={shuffle}"
                        if backend == "mmap" and "cold" in regimes and not shuffle:
                            record(tag, "cold", "gdsload mmap", config + " (open + pass)",
                                   lambda: mmap_open_and_pass(path, shuffle))
                        run = gdsload_run(path, backend, shuffle, None,
                                          backend_options={"num_threads": t} if t else None)
                        run()  # first pass of the process: CUDA modules, kernels and buffers set up
                        for regime in regimes if not shuffle else ["warm"]:
                            if regime == "warm":
                                run()
                            elif backend == "mmap":
                                continue  # measured above: its files are locked, a dropped cache is no cold start
                            record(tag, regime, f"gdsload {backend}", config, run,
                                   repeats=3 if regime == "warm" else 1)
                        run.close()
                        cupy.get_default_memory_pool().free_all_blocks()
            if not main_block:
                continue
            for workers in (0, 4, 8):
                run = torch_run(path, workers, False, None)
                for regime in regimes:
                    if regime == "warm":
                        posix_read(paths, False, True)
                    record(tag, regime, "torch DataLoader", f"num_workers={workers} pin_memory", run,
                           repeats=2 if regime == "warm" else 1)
            for gpu in (False, True):
                for regime in regimes:
                    record(tag, regime, "zarr-python" + (" (GPU buffers)" if gpu else "") + " + cupy",
                           "shard-sized reads", zarr_run(path, gpu))
            for regime in regimes:
                record(tag, regime, "naive np.fromfile + cupy.asarray", "per shard file", naive_run(paths))
            if label == "1GiB":
                _shm(args, path, tag, record)
            else:
                _stall(path, tag, record, paths, args.stall_repeats, args.batches_ahead)
            save()
            print(f"elapsed {time.perf_counter() - started:.0f} s", flush=True)

    save()
    if not args.stall_only:  # a table and plot for the whole suite only
        render(base + ".json")
    print(f"wrote {base}.json", flush=True)
    return 0


def _ceiling(result: tuple[int, float], io_mode: str) -> dict:
    nbytes, dt = result
    return {"bytes": nbytes, "samples": None, "seconds": dt, "stall_s": None, "io_mode": io_mode}


def _shm(args: argparse.Namespace, path: str, tag: str, record: Callable[..., Any]) -> None:
    """The /dev/shm regime: storage faster than this machine's disk (tmpfs)."""
    shm = os.path.join(args.shm, os.path.basename(path))
    shutil.rmtree(args.shm, ignore_errors=True)
    shutil.copytree(path, shm)
    try:
        for backend in GDSLOAD_BACKENDS:
            run = gdsload_run(shm, backend, False, None)
            run()
            record(tag, "shm", f"gdsload {backend}", DEFAULT_CONFIG[backend], run, repeats=3)
            run.close()
        record(tag, "shm", "torch DataLoader", "num_workers=8 pin_memory", torch_run(shm, 8, False, None))
    finally:
        shutil.rmtree(args.shm, ignore_errors=True)


def _stall(path: str, tag: str, record: Callable[..., Any], paths: list[str], repeats: int = 3,
           batches_ahead: int | None = None) -> None:
    """How long a simulated training step waits for data when it is slower than reading a batch."""
    import cupy

    posix_read(paths, False, True)
    for backend in GDSLOAD_BACKENDS:
        probe = gdsload_run(path, backend, False, None)
        probe()
        r = probe()
        probe.close()
        batch_read_ms = r["seconds"] / -(-r["samples"] // BATCH) * 1e3
        for factor, sync_every in ((1.5, 1), (3.0, 1), (1.5, 8)):
            step = Spin(batch_read_ms * factor, sync_every)
            ahead = {} if batches_ahead is None else {"batches_ahead": batches_ahead}
            run = gdsload_run(path, backend, False, step, **ahead)
            run()  # a pass first: the next one is read ahead, as in training
            synced = "" if sync_every == 1 else f", host syncs every {sync_every} steps"
            record(tag, "warm", f"gdsload {backend} + training step", f"step = {factor} x batch read time "
                   f"({batch_read_ms * factor:.2f} ms){synced}", run, repeats=repeats,
                   step_ms=round(batch_read_ms * factor, 3), sync_every=sync_every, **ahead)
            run.close()
        cupy.get_default_memory_pool().free_all_blocks()
    step = Spin(5.0)
    record(tag, "warm", "torch DataLoader + training step", "num_workers=8, step 5 ms",
           torch_run(path, 8, False, step), step_ms=5.0)


if __name__ == "__main__":
    sys.exit(main())
