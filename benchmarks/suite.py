"""gdsload against the loaders people use today, beside the ceilings, in one run on the same data
(docs/benchmarks.md, "Method"; ``benchmarks.report`` renders the JSON).

    python -m benchmarks.suite --quick          # minutes: 1 + 4 GiB, main contenders, training-step rows
    python -m benchmarks.suite --full           # 1 GiB: 1/4/16 MiB blocks, 8/16/32 threads; 8 GiB; compressed, mixture
    python -m benchmarks.suite --quick --backends cpu   # no GPU: the cpu backend beside host-memory contenders"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from gdsload import GDSDataset
from gdsload.system.env import gpu_available
from gdsload.tools.measure import (block_locations, drop_page_cache, pinned_h2d_gbps, raw_kvikio_blocks,
                                   raw_kvikio_files, read_files, shard_paths)
from gdsload.tools.steps import make_step

from . import canaries, mixture, report, summary_rows
from .common import BATCH, DATA_DIR, RESULTS_DIR, SAMPLE_BYTES, describe_machine, free_device_memory, \
    make_dataset, dataset_tag, open_and_pass, results_dir, today, write_json
from .contenders import dali_run, naive_run, torch_run, zarr_run
from .rows import GdsRun, Recorder, lazy

GPU_BACKENDS = ("kvikio", "pinned", "mmap")
THREADS = 16  # reader threads of the ceilings (KvikIO's pool as the kvikio backend sets it by default)
MAIN_BLOCK = 4 << 20
#: Training-step rows: (step duration as a multiple of a batch's read time, host syncs every that many steps).
STEPS = ((1.5, 1), (3.0, 1), (1.5, 8))
TORCH_STEP_MS = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="1 + 4 GiB, the main contenders (default)")
    mode.add_argument("--full", action="store_true", help="1 GiB in three block sizes and thread counts; 8 GiB")
    ap.add_argument("--backends", default=None, help="comma list (default: kvikio,pinned,mmap with a GPU, else cpu)")
    ap.add_argument("--sizes-gib", default=None, help="comma list of dataset sizes replacing the mode's")
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--repeats", type=int, default=3, help="passes per warm row (the best is reported)")
    ap.add_argument("--stall-repeats", type=int, default=3, help="step rows: passes after the one from rest")
    ap.add_argument("--resident-bytes", type=int, default=None, help="GDSDataset(resident_bytes=), every row")
    ap.add_argument("--no-cold", action="store_true", help="never drop the page cache (no cold rows)")
    ap.add_argument("--warm-seconds", type=float, default=0.5, help="a warm row's back-to-back passes, from rest")
    ap.add_argument("--fresh-starts", type=int, default=5, help="fresh processes per backend (0: none)")
    ap.add_argument("--contender-seconds", type=float, default=2.0, help="a contender's pass ends then (0: whole)")
    ap.add_argument("--continuous-epochs", type=int, default=6, help="epochs of the 10 ms step row (0: none)")
    ap.add_argument("--canaries", default="auto", help="cores for the canaries (benchmarks.canaries) around the "
                                                       "1.5x step rows ('auto': 3 where 8 or more cores; '': none)")
    ap.add_argument("--canary-threshold", type=float, default=canaries.CANARY_THRESHOLD, help="the machine's slowdown")
    ap.add_argument("--compressed", action="store_true", help="the compressed rows (on with --full)")
    ap.add_argument("--compressed-mib", type=int, default=4096, help="decoded MiB of each compressed store")
    ap.add_argument("--compressed-runs", type=int, default=3, help="fresh processes per compressed row (median)")
    ap.add_argument("--compressed-kinds", default=",".join(summary_rows.COMPRESSED_KINDS), help="the stores' kinds")
    ap.add_argument("--mixture", type=int, nargs="?", const=3, help="benchmarks.mixture's rounds (3; on with --full)")
    ap.add_argument("--data", default=DATA_DIR, help="directory on the disk under test (datasets are kept)")
    ap.add_argument("--shm", default="/dev/shm/gdsload-bench", help="tmpfs copy for the /dev/shm regime")
    ap.add_argument("--out", default=RESULTS_DIR, help="results root: files go to OUT/<machine>/")
    args = ap.parse_args(argv)
    args.mode = "full" if args.full else "quick"
    args.backends = tuple(args.backends.split(",")) if args.backends else (
        GPU_BACKENDS if gpu_available() else ("cpu",))
    args.gpu = any(b != "cpu" for b in args.backends)
    args.sizes = [float(s) for s in args.sizes_gib.split(",")] if args.sizes_gib else [1.0, 8.0 if args.full else 4.0]
    args.options = {} if args.resident_bytes is None else {"resident_bytes": args.resident_bytes}
    args.contender_s = args.contender_seconds or None
    args.compressed = args.compressed or args.full
    args.mixture = 3 * args.full if args.mixture is None else args.mixture
    args.canary_cores = canaries.canary_cores(args.canaries)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    os.makedirs(args.data, exist_ok=True)
    info = describe_machine(args.data)
    print(info, flush=True)
    can_drop = not args.no_cold and drop_page_cache()
    rec = Recorder(can_drop, args.batch_size)
    base = os.path.join(results_dir(args.out, info), "suite")
    doc: dict[str, Any] = {
        "schema": report.SCHEMA, "benchmark": "benchmarks.suite", "date": today(), "machine": info,
        "mode": args.mode, "auto_backend": None,
        "settings": {"backends": list(args.backends), "sizes_gib": args.sizes, "batch_size": args.batch_size,
                     "sample_bytes": SAMPLE_BYTES, "repeats": args.repeats, "stall_repeats": args.stall_repeats,
                     "dataset_options": args.options, "page_cache_dropped": can_drop, "from_rest": True,
                     "warm_seconds": args.warm_seconds, "fresh_starts": args.fresh_starts,
                     "continuous_epochs": args.continuous_epochs, "canary_cores": args.canary_cores,
                     "canary_threshold": args.canary_threshold, "contender_seconds": args.contender_s,
                     "compressed_mib": args.compressed_mib if args.compressed else None,
                     "compressed_runs": args.compressed_runs if args.compressed else None,
                     "mixture_rounds": args.mixture}, "results": rec.rows}

    def save() -> None:
        """After every stage: a run cut short still leaves what it measured."""
        doc["elapsed_s"] = round(time.perf_counter() - started)
        write_json(base + ".json", doc)

    stages: dict[str, float] = {}
    doc["stage_seconds"] = stages
    where = ["before the first stage"]  # what a cut interrupts

    def stage(name: str, fn: Callable[..., Any], *a: Any) -> None:
        where[0] = name
        t0 = time.perf_counter()
        try:
            fn(*a)
        finally:
            stages[name] = round(time.perf_counter() - t0, 1)
            save()
        where[0] = f"after {name}"
        print(f"{name}: {stages[name]:.0f} s (elapsed {time.perf_counter() - started:.0f} s)", flush=True)

    def cut(signum: int, frame: Any) -> None:
        raise Cut(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, cut)
    try:
        run_stages(args, rec, doc, stage)
    except Cut as e:
        doc["cut_short"] = {"signal": e.args[0], "stage": where[0], "after_s": round(time.perf_counter() - started)}
        print(f"cut short by {e.args[0]} ({where[0]}): writing what was measured", file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the files are written whole, once
        signal.signal(sig, signal.SIG_IGN)
    save()
    report.render(base + ".json")
    print(f"wrote {base}.json", flush=True)
    return 128 + signal.Signals[doc["cut_short"]["signal"]].value if "cut_short" in doc else 0


class Cut(BaseException):
    """SIGTERM (a time limit's kill) or SIGINT stops the run where it is; a BaseException, so that no row's
    ``except Exception`` records it as that row's failure and goes on."""


def run_stages(args: argparse.Namespace, rec: Recorder, doc: dict[str, Any], stage: Callable[..., None]) -> None:
    """Every stage of the run, in order, each through ``stage`` (timed, then the JSON saved)."""
    if args.gpu:
        rec.emit({"kind": "ceiling", "dataset": "-", "regime": "-", "name": "ceiling: pinned H2D copy",
                  "config": "1 GiB", "io_mode": "cuda-memcpy", "gb_per_s": round(pinned_h2d_gbps(1 << 30), 2)})
    for size in args.sizes:
        blocks = [MAIN_BLOCK] + ([1 << 20, 16 << 20] if args.full and size == args.sizes[0] else [])
        for block in blocks:
            path = make_dataset(args.data, size, block)
            tag = dataset_tag(size, block)
            paths = shard_paths(path)
            if doc["auto_backend"] is None:
                doc["auto_backend"] = auto_backend(path, args.batch_size)
            main_block = block == MAIN_BLOCK
            stage(f"{tag} ceilings", ceilings, args, rec, path, tag, paths, main_block)
            # None: the backend's own default (the pinned native reader leaves the pipeline's threads a core).
            threads = [None, 8, 16, 32] if args.full and main_block and size == args.sizes[0] else [None]
            stage(f"{tag} backends", backends, args, rec, path, tag, main_block, threads)
            if not main_block:
                continue
            stage(f"{tag} startup", startup, args, rec, path, tag)
            stage(f"{tag} contenders", contenders, args, rec, path, tag, paths)
            if size == args.sizes[0] and len(args.sizes) > 1:
                stage(f"{tag} shm", shm, args, rec, path, tag)
            else:
                if args.fresh_starts > 0:
                    stage(f"{tag} fresh starts", summary_rows.fresh_startup, rec, tag, path, args.backends,
                          args.batch_size, args.options, args.gpu, args.fresh_starts)
                stage(f"{tag} steps", stall, args, rec, path, tag, paths)
    if args.compressed:
        stage("compressed", summary_rows.compressed, rec, args.backends, args.data, args.compressed_mib,
              args.batch_size, args.options, args.gpu, 8, 3, args.compressed_runs,
              tuple(args.compressed_kinds.split(",")))
    if args.mixture:
        stage("mixture", mixtures, args, doc)


def mixtures(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """``mixture`` and ``first_epoch`` of :func:`benchmarks.mixture.fresh_figures` on the largest dataset, warm
    (a failure is a note: the summary says not measured)."""
    try:
        single, sources = mixture.make_sources(args.data, args.sizes[-1])
        read_files(shard_paths(single))
        doc.update(mixture.fresh_figures(list(args.backends), single, sources, args.mixture, args.warm_seconds,
                                         args.batch_size, STEPS[0][0])[1])
    except Exception as e:  # noqa: BLE001 - the run goes on
        doc.setdefault("notes", []).append(f"mixture: {type(e).__name__}: {e}"[:400])


def auto_backend(path: str, batch_size: int) -> dict[str, Any]:
    """The backend ``auto`` picks on this machine, and why (from the dataset's own description)."""
    try:
        with GDSDataset(path, batch_size=batch_size) as ds:
            d = ds.describe()
    except Exception as e:  # reported, as a contender that cannot run is
        return {"backend": None, "reason": f"opening with backend auto failed: {type(e).__name__}: {e}"}
    return {"backend": d["backend"], "reason": d["backend_reason"], "io_mode": d["io_mode"]}


def ceilings(args: argparse.Namespace, rec: Recorder, path: str, tag: str, paths: list[str], main_block: bool) -> None:
    """The disk, the page cache into (pinned) host memory, and raw KvikIO of the same bytes."""
    rec.record(tag, "cold", "ceiling: O_DIRECT disk read", f"{THREADS} threads, 8 MiB",
               lambda: read_files(paths, direct=True), kind="ceiling")
    read_files(paths, pinned=args.gpu)  # warm the page cache
    rec.record(tag, "warm", f"ceiling: page cache -> {'pinned' if args.gpu else 'host memory'}",
               f"{THREADS} threads, 8 MiB", lambda: read_files(paths, pinned=args.gpu), repeats=args.repeats,
               kind="ceiling")
    if not args.gpu:
        return
    import cupy

    dest = cupy.empty(sum(os.path.getsize(p) for p in paths), dtype=cupy.uint8)
    for regime in ("cold", "warm") if main_block else ("warm",):
        rec.record(tag, regime, "raw KvikIO (whole files)", f"{THREADS} threads", lambda: raw_kvikio_files(paths, dest),
                   repeats=args.repeats if regime == "warm" else 1, kind="ceiling")
    image = block_locations(path, ("image",))
    rec.record(tag, "warm", "raw KvikIO (blocks, shuffled)", f"{THREADS} threads, one read per block",
               lambda: raw_kvikio_blocks(image, dest), repeats=args.repeats, kind="ceiling")
    dest = None  # free the device copy before the next contender
    free_device_memory()


def backends(args: argparse.Namespace, rec: Recorder, path: str, tag: str, main_block: bool,
             threads: list[int | None]) -> None:
    """Each backend warm (ordered and shuffled) and cold (mmap: open + pass); thread counts other than None (the
    backend's default, the rows the summary takes) are the full mode's sweep."""
    regimes = ["cold", "warm"] if main_block else ["warm"]
    for backend in args.backends:
        for t in threads if backend != "mmap" else [None]:
            for shuffle in [False, True] if main_block else [False]:
                config = f"threads={t} shuffle={shuffle}" if t else f"shuffle={shuffle}"
                labels = {"backend": backend, "shuffle": shuffle, "threads": t, "default": t is None}
                if backend == "mmap" and "cold" in regimes and not shuffle:
                    rec.record(tag, "cold", "gdsload mmap", config + " (open + pass)",
                               lambda: open_and_pass(path, args.batch_size, backend="mmap", shuffle=shuffle,
                                                     **args.options),
                               kind="gdsload", **labels)
                run = rec.attempt(tag, f"gdsload {backend}", config, lambda: GdsRun(
                    path, backend, args.batch_size, shuffle=shuffle, threads=t, min_seconds=args.warm_seconds,
                    **args.options))
                if run is None:
                    continue
                n = run.ds.describe()["backend_stats"].get("num_threads")  # what a default came to
                if t is None and n:
                    config, labels["threads"] = f"threads={n} shuffle={shuffle}", n
                run()  # the process's first pass: CUDA modules, kernels and buffers set up
                for regime in regimes if not shuffle else ["warm"]:
                    if regime == "warm":
                        run()
                    elif backend == "mmap":
                        continue  # measured above: its files are locked, a dropped cache is no cold start
                    rec.record(tag, regime, f"gdsload {backend}", config, run,
                               repeats=args.repeats if regime == "warm" else 1, kind="gdsload", **labels)
                run.close()
                free_device_memory()


def startup(args: argparse.Namespace, rec: Recorder, path: str, tag: str) -> None:
    """Each backend's open and first batch, from a dropped cache where allowed, then warm."""
    for regime in (["cold"] if rec.can_drop else []) + ["warm"]:
        for backend in args.backends:
            if regime == "warm":
                read_files(shard_paths(path))
            rec.startup(tag, regime, backend, path, args.batch_size, **args.options)
            free_device_memory()


def contenders(args: argparse.Namespace, rec: Recorder, path: str, tag: str, paths: list[str]) -> None:
    regimes = ["cold", "warm"]
    gpu = args.gpu
    for workers in (0, 4, 8):
        run = lazy(lambda w=workers: torch_run(path, w, gpu, max_s=args.contender_s))
        for regime in regimes:
            if regime == "warm":
                read_files(paths, pinned=gpu)
            rec.record(tag, regime, "torch DataLoader", f"num_workers={workers}" + (" pin_memory" if gpu else ""),
                       run, repeats=2 if regime == "warm" else 1, kind="contender")
    for gpu_buffers in (False, True) if gpu else (False,):
        for regime in regimes:
            name = "zarr-python" + (" (GPU buffers)" if gpu_buffers else "") + (" + cupy" if gpu else "")
            rec.record(tag, regime, name, "shard-sized reads",
                       lazy(lambda g=gpu_buffers: zarr_run(path, gpu, g, args.contender_s)), kind="contender")
    for regime in regimes:
        rec.record(tag, regime, "naive np.fromfile" + (" + cupy.asarray" if gpu else ""), "per shard file",
                   naive_run(paths, gpu, args.contender_s), kind="contender")
    if gpu:
        rec.record(tag, "warm", "DALI file reader", "whole shard files, .gpu()",
                   lazy(lambda: dali_run(paths, max_s=args.contender_s)), kind="contender")
    free_device_memory()


def warmed(args: argparse.Namespace, rec: Recorder, tag: str, name: str, config: str, path: str,
           backend: str) -> GdsRun | None:
    """A :class:`GdsRun` of ``path`` on ``backend``, its first pass taken; None where it could not open."""
    run = rec.attempt(tag, name, config, lambda: GdsRun(path, backend, args.batch_size, min_seconds=args.warm_seconds,
                                                         **args.options))
    if run is not None:
        run()
    return run


def shm(args: argparse.Namespace, rec: Recorder, path: str, tag: str) -> None:
    """The /dev/shm regime: storage faster than this machine's disk (tmpfs)."""
    copy = os.path.join(args.shm, os.path.basename(path))
    shutil.rmtree(args.shm, ignore_errors=True)
    shutil.copytree(path, copy)
    try:
        for backend in args.backends:
            run = warmed(args, rec, tag, f"gdsload {backend}", "shm", copy, backend)
            if run is None:
                continue
            rec.record(tag, "shm", f"gdsload {backend}", "shuffle=False", run, repeats=args.repeats, kind="gdsload",
                       backend=backend, shuffle=False, threads=None, default=True)
            run.close()
            free_device_memory()
        rec.record(tag, "shm", "torch DataLoader", "num_workers=8" + (" pin_memory" if args.gpu else ""),
                   lazy(lambda: torch_run(copy, 8, args.gpu, max_s=args.contender_s)), kind="contender")
    finally:
        shutil.rmtree(args.shm, ignore_errors=True)


def stall(args: argparse.Namespace, rec: Recorder, path: str, tag: str, paths: list[str]) -> None:
    """Waiting beside a simulated training step, per backend: steps of 1.5x and 3x a batch's read time, host
    syncs every step or every 8th (canaries at 1.5x); a 10 ms step over epochs in one loop, here and in a
    fresh process; torch DataLoader with a 5 ms step beside them."""
    read_files(paths, pinned=args.gpu)
    for backend in args.backends:
        probe = warmed(args, rec, tag, f"gdsload {backend} + training step", "-", path, backend)
        if probe is None:
            continue
        r = probe()
        probe.close()
        batch_read_ms = r.seconds / -(-r.samples // args.batch_size) * 1e3
        for factor, sync_every in STEPS:
            ms = batch_read_ms * factor
            run = GdsRun(path, backend, args.batch_size, step=make_step(ms, sync_every, args.gpu),
                         min_seconds=args.warm_seconds, **args.options)
            run()  # the process's first pass with this step: its kernel compiled, its buffers set up
            synced = "" if sync_every == 1 else f", host syncs every {sync_every} steps"
            cores = args.canary_cores if (factor, sync_every) == (1.5, 1) else []
            seconds = (args.stall_repeats + 3) * len(run.ds) * ms / 1e3 * 2 + 2  # the passes, their steps alone
            with canaries.judged_by_canaries(cores, seconds, run.step, args.stall_repeats,
                                                 args.canary_threshold) as judge:
                rec.steps(tag, f"gdsload {backend} + training step",
                          f"step = {factor} x batch read time ({ms:.2f} ms){synced}", run, args.stall_repeats,
                          judge=judge, backend=backend, step_factor=factor, step_ms=round(ms, 3),
                          sync_every=sync_every)
            run.close()
        if args.continuous_epochs > 0:
            ms = summary_rows.CONTINUOUS_STEP_MS
            run = GdsRun(path, backend, args.batch_size, shuffle=True, step=make_step(ms, 1, args.gpu),
                         prefetch_next_epoch=True, **args.options)
            run()  # as above: the step's kernel and the buffers set up outside the timing
            summary_rows.continuous_row(rec, tag, run, args.continuous_epochs, backend=backend, step_ms=ms,
                                        sync_every=1)
            run.close()
            free_device_memory()  # the child has the device to itself, as a training script would
            summary_rows.fresh_continuous(rec, tag, path, backend, args.batch_size, args.options, args.gpu,
                                          args.continuous_epochs, step_ms=ms, sync_every=1)
        free_device_memory()
    rec.record(tag, "warm", "torch DataLoader + training step", f"num_workers=8, step {TORCH_STEP_MS:g} ms",
               lazy(lambda: torch_run(path, 8, args.gpu, make_step(TORCH_STEP_MS, 1, args.gpu))), kind="step",
               step_ms=TORCH_STEP_MS, sync_every=1)


if __name__ == "__main__":
    sys.exit(main())
