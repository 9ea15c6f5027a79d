"""The suite's rows behind ``summary.json``'s later keys (docs/benchmarks.md): start-up in fresh processes, the
continuous 10 ms step row (here and in a fresh process) and the compressed stores' rows."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload.tools.measure import PassResult, cpu_seconds, device_sync, read_files, shard_paths, time_pass, time_passes
from gdsload.tools.steps import Step

from .common import ROOT, device_used_bytes, run_child, run_fresh
from .rows import GdsRun, Recorder, figures, rnd, summed

CONTINUOUS_STEP_MS = 10.0

#: One fresh process: its clock starts before ``import gdsload`` (and ``import cupy`` on GPU runs).
FRESH = """
import sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import gdsload
{cupy}
imported = time.perf_counter() - t0
import json
from benchmarks.summary_rows import fresh_child
print(json.dumps(fresh_child({path!r}, {backend!r}, {batch_size}, {options!r}, imported, {gpu})))
"""


def fresh_child(path: str, backend: str, batch_size: int, options: dict[str, Any], import_s: float,
                gpu: bool) -> dict[str, Any]:
    """In the fresh process: CUDA started (GPU runs), then the open (shuffled) and the first batch, synchronised."""
    t0 = time.perf_counter()
    if gpu:
        import cupy

        cupy.zeros(1 << 20, dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()
    t1 = time.perf_counter()
    ds = GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=True, **options)
    t2 = time.perf_counter()
    it = iter(ds)  # kept: a dropped iterator closes its pass, inside the timing
    next(it)
    device_sync(ds)()
    t3 = time.perf_counter()
    row = {"backend": ds.backend_name, "io_mode": ds.io_mode, "import_s": round(import_s, 4),
           "cuda_start_s": round(t1 - t0, 4), "open_s": round(t2 - t1, 4), "first_batch_s": round(t3 - t2, 6)}
    del it
    ds.close()
    return row


def fresh_startup(rec: Recorder, tag: str, path: str, backends: tuple[str, ...], batch_size: int,
                  options: dict[str, Any], gpu: bool, processes: int) -> None:
    """Per backend, ``processes`` fresh processes, pages warm: a ``warm-fresh`` startup row of their medians,
    every process's figures in ``runs``."""
    imports = "gdsload, cupy" if gpu else "gdsload"
    for backend in backends:
        where = {"kind": "startup", "dataset": tag, "regime": "warm-fresh", "name": f"gdsload {backend} startup",
                 "config": f"fresh process: import {imports}, open (shuffle), first batch", "backend": backend}
        code = FRESH.format(root=ROOT, cupy="import cupy" if gpu else "", path=path, backend=backend,
                            batch_size=batch_size, options=options, gpu=gpu)
        try:
            runs = []
            for _ in range(processes):
                read_files(shard_paths(path))  # warm pages before every process
                runs.append(run_fresh(code, f"fresh start of {backend}"))
        except Exception as e:
            rec.failed(where, e)
            continue
        rec.emit({**where, "io_mode": runs[0]["io_mode"], "imports": imports, "processes": processes,
                  **{k: round(float(np.median([r[k] for r in runs])), 6)
                     for k in ("import_s", "cuda_start_s", "open_s", "first_batch_s")},
                  "seconds": round(float(np.median([r["open_s"] + r["first_batch_s"] for r in runs])), 4),
                  "runs": runs})


def continuous_passes(ds: Any, step: Step, epochs: int) -> tuple[list[PassResult], float, int]:
    """``epochs`` epochs in one loop as training takes them (``set_epoch`` each, nothing stopped between), each
    pass's ``wait_s`` its time beyond the steps alone (timed first); the passes, the steps alone timed again,
    and how many epochs after the first were not read ahead (0: the run stayed continuous)."""
    sync = device_sync(ds)
    ds.stop()
    alone = step.alone(len(ds))
    out: list[PassResult] = []
    restarts = 0
    c_prev, t_prev = cpu_seconds(), time.perf_counter()
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for _batch in ds:
            step()
        step.finish()
        sync()
        t, c = time.perf_counter(), cpu_seconds()
        s = ds.stats
        out.append(PassResult(bytes=s.bytes_delivered, seconds=t - t_prev, io_mode=s.io_mode, samples=s.samples,
                              cpu_s=c - c_prev, stall_s=s.stall_s, first_batch_s=s.first_batch_s, alone_s=alone,
                              wait_s=max(0.0, t - t_prev - alone)))
        restarts += int(epoch > 0 and not s.read_ahead)
        c_prev, t_prev = c, t
    ds.stop()
    again = step.alone(len(ds))
    return out, again, restarts


def continuous_figures(passes: list[PassResult], again: float) -> dict[str, Any]:
    """A row's figures from :func:`continuous_passes`: ``wait_fraction`` of the epochs after the first as one
    stretch, each epoch's, the first's (the pipeline's start) and the whole run's beside it."""
    first, *steady = passes
    steady = steady or [first]
    total = summed(steady)
    whole = sum(r.wait_s or 0.0 for r in passes) / sum(r.seconds for r in passes)
    return {**figures(total, []), "wait_fraction": round(total.wait_fraction or 0.0, 5),
            "wait_fraction_runs": [round(r.wait_fraction or 0.0, 4) for r in steady],
            "first_pass_wait_fraction": round(first.wait_fraction or 0.0, 4),
            "whole_run_wait_fraction": round(whole, 5), "first_pass_seconds": round(first.seconds, 4),
            "first_batch_s": round(first.first_batch_s or 0.0, 6),
            "alone_drift_fraction": round(again / (first.alone_s or again) - 1, 4)}


def _continuous_where(tag: str, epochs: int, backend: str, fresh: bool) -> dict[str, Any]:
    return {"kind": "step", "dataset": tag, "regime": "warm-fresh" if fresh else "warm",
            "name": f"gdsload {backend} + training step",
            "config": f"step {CONTINUOUS_STEP_MS:g} ms, {epochs} epochs in one loop (set_epoch each, "
                      "prefetch_next_epoch)" + (", in a fresh process" if fresh else "")}


def continuous_row(rec: Recorder, tag: str, run: GdsRun, epochs: int, **labels: Any) -> dict[str, Any] | None:
    """The continuous ``step`` row on ``run``, in the suite's process (after every row before it)."""
    where = _continuous_where(tag, epochs, labels["backend"], fresh=False)
    try:
        passes, again, restarts = continuous_passes(run.ds, run.step, epochs)
    except Exception as e:
        rec.failed({**where, **labels}, e)
        return None
    return rec.emit({**where, **labels, "continuous": True, "epochs": epochs, **continuous_figures(passes, again),
                     "pipeline_restarts": restarts, **run.extra()})


def continuous_child(path: str, backend: str, batch_size: int, options: dict[str, Any], gpu: bool,
                     epochs: int) -> dict[str, Any]:
    """In the fresh process: the dataset opened as the continuous row opens it, one epoch with the step (kernel
    compiled, buffers made), then :func:`continuous_passes`; the row's figures."""
    from gdsload.tools.steps import make_step

    step = make_step(CONTINUOUS_STEP_MS, 1, gpu)
    with GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=True, prefetch_next_epoch=True,
                    **options) as ds:
        for _batch in ds:
            step()
        step.finish()
        passes, again, restarts = continuous_passes(ds, step, epochs)
        return {**continuous_figures(passes, again), "pipeline_restarts": restarts}


def fresh_continuous(rec: Recorder, tag: str, path: str, backend: str, batch_size: int, options: dict[str, Any],
                     gpu: bool, epochs: int, **labels: Any) -> dict[str, Any] | None:
    """The continuous row in a new interpreter, pages warm: ``fresh_process`` rows of regime ``warm-fresh``."""
    where = _continuous_where(tag, epochs, backend, fresh=True)
    try:
        read_files(shard_paths(path))
        row = run_child(f"continuous run of {backend} in a fresh process", "benchmarks.summary_rows",
                        "continuous_child", path, backend, batch_size, options, gpu, epochs)
    except Exception as e:
        rec.failed({**where, "backend": backend, **labels}, e)
        return None
    return rec.emit({**where, "backend": backend, **labels, "continuous": True, "fresh_process": True,
                     "epochs": epochs, **row})


#: The stores of the compressed rows (:func:`benchmarks.compression.make_kind`): Zipf-like tokens, images
#: (about 1.1x) and float16 signals.
COMPRESSED_KINDS = ("tokens", "images", "float16")


def compressed_child(path: str, backend: str, batch_size: int, options: dict[str, Any], gpu: bool,
                     epochs: int) -> dict[str, Any]:
    """In the fresh process: the store opened (shuffled), a pass to set up, then ``epochs`` warm epochs in a row:
    decoded GB/s each, and the GPU memory in use around them."""
    with GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=True, **options) as ds:
        decode = ds.describe()["decode"]
        time_pass(ds)
        before = device_used_bytes(gpu)
        runs = time_passes(ds, None, epochs - 1)
        after = device_used_bytes(gpu)
    return {"epochs": [round(r.gb_per_s, 3) for r in runs], "first_batch_s": runs[0].first_batch_s,
            "io_mode": runs[0].io_mode, "decode": decode, "decoded_bytes": runs[0].bytes,
            "device_used_bytes_before": before, "device_used_bytes_after": after}


def spread(values: list[float], of: float | None = None) -> float:
    """(max - min) / ``of`` (the best by default), to 4 places: how far the worst falls behind."""
    return round((max(values) - min(values)) / (of or max(values)), 4)


def runs_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A compressed row's figures from its runs: ``gb_per_s`` the median of the runs' best epochs with their
    spread; the median run's epochs, first batch and GPU memory; and each run."""
    best = [max(r["epochs"]) for r in runs]
    median = float(np.median(best))
    mid = runs[int(np.argmin([abs(b - median) for b in best]))]
    first = mid["first_batch_s"]
    kept = ("io_mode", "decode", "decoded_bytes", "device_used_bytes_before", "device_used_bytes_after")
    return {"gb_per_s": round(median, 3), "runs_spread": spread(best, median), "warm_epochs_gbps": mid["epochs"],
            "epoch_spread": spread(mid["epochs"]), "first_batch_s": None if first is None else round(first, 4),
            **{k: mid[k] for k in kept},
            "runs": [{"gb_per_s": b, "epoch_spread": spread(r["epochs"]), "epochs": r["epochs"]}
                     for b, r in zip(best, runs)]}


def compressed(rec: Recorder, backends: tuple[str, ...], data_dir: str, mib: int, batch_size: int,
               options: dict[str, Any], gpu: bool, epochs: int = 8, level: int = 3, runs: int = 3,
               kinds: tuple[str, ...] = COMPRESSED_KINDS) -> None:
    """Per store of ``kinds`` (``mib`` MiB decoded) and backend, a ``compressed`` row: the ratio, ``runs`` fresh
    processes of ``epochs`` warm epochs, cold GB/s of the zstd and raw stores (where the cache can be dropped),
    and nvCOMP's batch decode alone on the same chunks (None, with the reason, where it cannot run)."""
    from .common import free_device_memory
    from .compression import cold_gbps, make_kind, nvcomp_decode_gbps, stored_ratio, write_pair
    from gdsload.codecs.decode import DECODE_LANES

    resident = options.get("resident_bytes")
    for kind in kinds:
        paths = write_pair(os.path.join(data_dir, "compressed"), kind, make_kind(kind, mib << 20), level)
        ratio = round(stored_ratio(paths["zstd"], kind), 4)
        ceiling, why = None, "no GPU: nvCOMP's batch decode runs on the device"
        if gpu:
            try:
                ceiling = nvcomp_decode_gbps(paths["zstd"], kind, lanes=DECODE_LANES)
                why = None if ceiling is not None else "nvCOMP (libnvcomp) does not load here"
            except Exception as e:
                why = f"{type(e).__name__}: {e}"[:300]
            free_device_memory()  # the fresh processes' GPU memory figures count the whole device's
        for backend in backends:
            where = {"kind": "compressed", "dataset": f"{kind}-{mib}MiB-zstd", "regime": "warm", "backend": backend,
                     "name": f"gdsload {backend} compressed", "config": f"zstd:{level}, shuffle, {epochs} epochs, "
                     f"{runs} fresh processes"}
            try:
                figures = runs_figures([run_child(f"compressed {kind} on {backend}", "benchmarks.summary_rows",
                                                  "compressed_child", paths["zstd"], backend, batch_size, options,
                                                  gpu, epochs) for _ in range(runs)])
                cold = raw_cold = None
                if rec.can_drop:
                    cold, raw_cold = (cold_gbps(paths[m], backend, batch_size, resident) for m in ("zstd", "raw"))
            except Exception as e:
                rec.failed(where, e)
                continue
            rec.emit({**where, "store": kind, "ratio": ratio, **figures, "cold_gbps": rnd(cold),
                      "raw_cold_gbps": rnd(raw_cold), "decoder_ceiling_gbps": rnd(ceiling),
                      "decoder_ceiling_why": why, "decoder_lanes": DECODE_LANES})
