"""The compressed stores of the suite's ``compressed`` rows (``python -m benchmarks.suite --compressed``): the
data, written raw and with zstd by the converter, a gdsload pass over them, and nvCOMP's batch decode alone on
the same chunks (the decoder's ceiling).

Data, per kind: ``tokens`` int32 ids of real text (the Python standard library's source and documentation files,
split into words and punctuation, ids by frequency rank in a 50,000-word vocabulary, the stream repeated to size:
no corpus or tokenizer is on the benchmark machine), ``images`` uint8 (smooth gradients plus noise), ``float16``
(smooth signals plus noise). The standalone benchmark that also swept chunk sizes and timed zarr-python on the
same stores (its last run: ``results/H200/compression.*``) is in git history.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import shutil
import sysconfig
import time
from typing import Any

import numpy as np

from gdsload import GDSDataset, write_dataset
from gdsload.codecs import screen
from gdsload.codecs.decode import DECODE_LANES
from gdsload.conversion.source_types import ArraySource
from gdsload.tools.measure import cold_pass, cpu_seconds, drop_page_cache, time_pass

from .common import free_device_memory

VOCAB = 50_000
_WORD = re.compile(r"\w+|([^\w\s])\1*")


def make_kind(kind: str, nbytes: int, seed: int = 0) -> np.ndarray:
    """About ``nbytes`` of one kind of data (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        n = max(2, nbytes // (2048 * 4))
        return np.resize(text_ids(), (n, 2048))
    if kind == "images":
        n = max(2, nbytes // (64 * 64 * 3))
        ramp = (np.arange(64)[:, None] + np.arange(64)[None, :]).astype(np.int32)
        base = (ramp[None, :, :, None] + rng.integers(0, 64, (n, 1, 1, 3))) % 256
        return (base + rng.integers(0, 8, (n, 64, 64, 3))).astype(np.uint8)
    n = max(2, nbytes // (1024 * 2))
    t = np.linspace(0, 8 * np.pi, 1024, dtype=np.float32)
    return (np.sin(t[None, :] * rng.uniform(0.5, 2, (n, 1))) + rng.normal(0, 0.01, (n, 1024))).astype(np.float16)


@functools.lru_cache(maxsize=1)
def text_ids(max_words: int = 6_000_000) -> np.ndarray:
    """Word-level token ids of real text: the standard library's ``.py``, ``.txt`` and ``.rst`` files in a fixed
    order, split into words and runs of one punctuation mark; ids are frequency ranks, words past the
    vocabulary share the last id."""
    words: list[str] = []
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith((".py", ".txt", ".rst")) and len(words) < max_words:
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    words += [m.group(0) for m in _WORD.finditer(f.read())]
    if not words:
        raise RuntimeError(f"no text found under {root}")
    vocab = {w: i for i, (w, _) in enumerate(collections.Counter(words).most_common(VOCAB - 1))}
    return np.fromiter((vocab.get(w, VOCAB - 1) for w in words), dtype=np.int32, count=len(words))


def write_pair(data_dir: str, kind: str, data: np.ndarray, level: int, chunk_bytes: int | None = None,
               raw: bool = True) -> dict[str, str]:
    """The raw and the compressed dataset of ``data`` (rewritten every run: the data are generated)."""
    paths = {}
    for mode in (("raw", "zstd") if raw else ("zstd",)):
        tag = f"{kind}-{mode}" + (f"-{chunk_bytes >> 10}KiB" if chunk_bytes and mode == "zstd" else "")
        path = os.path.join(data_dir, tag + ".gds")
        shutil.rmtree(path, ignore_errors=True)
        fields = {kind: ArraySource(f"<{kind}>", data), "label": ArraySource("<label>", np.arange(len(data)))}
        options: dict[str, Any] = {"compress": f"zstd:{level}", "chunk_bytes": chunk_bytes} if mode == "zstd" else {}
        write_dataset(path, fields, progress=False, **options)
        paths[mode] = path
    os.sync()
    return paths


def stored_ratio(path: str, field: str) -> float:
    """Stored bytes / decoded bytes of a field (1.0 raw)."""
    from gdsload.format.layout import DatasetLayout
    from gdsload.format.meta import read_metadata

    with DatasetLayout(read_metadata(path), (field,)) as layout:
        lengths = layout.chunk_lengths.get(field)
        f = layout.meta.fields[field]
        return 1.0 if lengths is None else float(lengths.sum()) / (f.block_bytes * f.num_chunks)


def gdsload_pass(path: str, backend: str, batch: int, warm_s: float, cold: bool,
                 resident_bytes: int | None = None) -> dict[str, Any]:
    """Cold (from a dropped page cache; for mmap, which reads its files at open, open + pass) and warm GB/s of
    decoded data delivered, CPU core-s/GB, where each field decodes. ``resident_bytes``: GDSDataset's (None:
    its default, as users get it)."""
    out: dict[str, Any] = {}
    opts: dict[str, Any] = {} if resident_bytes is None else {"resident_bytes": resident_bytes}
    if cold and backend == "mmap":
        if drop_page_cache():
            c0, t0 = cpu_seconds(), time.perf_counter()
            with GDSDataset(path, batch_size=batch, backend=backend, shuffle=True, **opts) as ds:
                opened = time.perf_counter() - t0
                r = time_pass(ds)
            seconds = time.perf_counter() - t0
            out["cold_gbps"] = r.bytes / seconds / 1e9
            out["cold_cpu_core_s_per_gb"] = (cpu_seconds() - c0) / (r.bytes / 1e9)
            out["cold_open_s"], out["cold_pass_s"] = opened, r.seconds
        else:
            out["cold_gbps"] = None
    with GDSDataset(path, batch_size=batch, backend=backend, shuffle=True, **opts) as ds:
        out["decode"] = ds.describe()["decode"]
        if cold and backend != "mmap":
            next(iter(ds), None)  # buffers, streams, kernels set up outside the timed pass (cold_pass stops it)
            try:
                c = cold_pass(ds)
                out["cold_gbps"], out["cold_cpu_core_s_per_gb"] = c.gb_per_s, c.cpu_core_s_per_gb
            except PermissionError:
                out["cold_gbps"] = None
        time_pass(ds)  # warm the page cache and CUDA
        r = time_pass(ds, min_seconds=warm_s)
        out.update(warm_gbps=r.gb_per_s, warm_cpu_core_s_per_gb=r.cpu_core_s_per_gb, io_mode=r.io_mode)
    free_device_memory()
    return out


def nvcomp_decode_gbps(path: str, field: str, window_bytes: int = 256 << 20, repeats: int = 3,
                       lanes: int | None = None) -> float | None:
    """nvCOMP's batched decode alone, as the decode step calls it: ``lanes`` windows' worth of ``field``'s
    chunks (the decoder's :data:`gdsload.codecs.decode.DECODE_LANES` by default), each window back to back in
    a device buffer and decoded by one call into cells of its own, the calls on as many streams at once;
    decoded GB/s (best of ``repeats``, timed by events from the first call's start to the last one's end).
    Windows beyond the field's chunks decode its first chunks again. None without nvCOMP or CuPy."""
    from gdsload.codecs.chunks import load_nvcomp
    from gdsload.codecs.nvcomp import decompress_table
    from gdsload.format.arrays import CRC_BYTES
    from gdsload.format.layout import DatasetLayout
    from gdsload.format.meta import read_metadata

    lib = load_nvcomp()
    if lib is None:
        return None
    import cupy

    lanes = lanes or DECODE_LANES
    with DatasetLayout(read_metadata(path), (field,)) as layout:
        f = layout.meta.fields[field]
        m = max(1, min(f.num_chunks, window_bytes // f.block_bytes))
        chunks = [[(lane * m + i) % f.num_chunks for i in range(m)] for lane in range(lanes)]
        locs = [[layout.locate(field, c) for c in window] for window in chunks]
        packed = [b"".join(os.pread(layout.files.fd(loc.path), loc.nbytes, loc.offset) for loc in window)
                  for window in locs]
    bb = f.block_bytes
    calls = []
    for window, data in zip(locs, packed):
        stored = np.array([loc.nbytes for loc in window], np.int64)
        sizes = stored - (CRC_BYTES if f.codecs[-1][0] == "crc32c" else 0)  # each frame without its crc32c
        # One buffer as a window's: the cells, then the chunks back to back; the table laid out as the step's.
        buf = cupy.empty(m * bb + len(data), cupy.uint8)
        buf[m * bb:] = cupy.asarray(np.frombuffer(data, np.uint8))
        lo = m * bb + np.cumsum(stored) - stored
        rows = screen.table(int(buf.data.ptr), lo, lo + sizes, bb, np.arange(m, dtype=np.int64) * bb)
        table = cupy.zeros(rows.nbytes + screen.TAIL_ITEM_BYTES * m, cupy.uint8)
        table[:rows.nbytes] = cupy.asarray(rows.reshape(-1).view(np.uint8))
        need = lib.temp_bytes(m, bb, m * bb)
        calls.append((buf, table, need, cupy.empty(need, cupy.uint8), cupy.cuda.Stream(non_blocking=True)))
    cupy.cuda.Device().synchronize()  # the copies above ran on the default stream, which the others do not wait for
    row = 8 * m
    best = float("inf")
    for _ in range(repeats):
        start = cupy.cuda.Event()
        start.record(calls[0][-1])
        ends = []
        for _, table, need, temp, stream in calls:
            stream.wait_event(start)
            code = decompress_table(lib, int(table.data.ptr), m, temp.data.ptr, need, stream.ptr)
            if code != 0:
                raise RuntimeError(f"{path}: nvCOMP refused '{field}' (launch status {code})")
            ends.append(cupy.cuda.Event())
            ends[-1].record(stream)
        for end in ends:
            end.synchronize()
        for _, table, *_ in calls:
            got = table.get()
            decoded, statuses = got[:screen.ROWS * row].view(np.uint64)[screen.OUT * m:], got[screen.ROWS * row:]
            if statuses[:4 * m].view(np.int32).any() or not (decoded == bb).all():
                raise RuntimeError(f"{path}: nvCOMP failed on '{field}'")
        best = min(best, max(cupy.cuda.get_elapsed_time(start, end) for end in ends) / 1e3)
    return lanes * m * bb / best / 1e9
