"""The stores of the suite's ``compressed`` rows, written raw and with zstd: ``tokens`` (word-level ids of the
Python standard library's text), ``images`` (gradients plus noise), ``float16`` (signals plus noise); a gdsload
pass over them, and nvCOMP's batch decode alone on their chunks (the decoder's ceiling)."""

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
from gdsload.tools.measure import cold_pass, drop_page_cache, time_pass

from .common import free_device_memory

VOCAB = 50_000
_WORD = re.compile(r"\w+|([^\w\s])\1*")


def make_kind(kind: str, nbytes: int, seed: int = 0) -> np.ndarray:
    """About ``nbytes`` of one kind of data (the module's docstring)."""
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
    """Word-level token ids of the standard library's ``.py``, ``.txt`` and ``.rst`` files: frequency ranks,
    words past the vocabulary sharing the last id."""
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


def write_pair(data_dir: str, kind: str, data: np.ndarray, level: int) -> dict[str, str]:
    """The raw and the zstd dataset of ``data`` (rewritten every run: the data are generated)."""
    paths = {}
    for mode in ("raw", "zstd"):
        path = os.path.join(data_dir, f"{kind}-{mode}.gds")
        shutil.rmtree(path, ignore_errors=True)
        fields = {kind: ArraySource(f"<{kind}>", data), "label": ArraySource("<label>", np.arange(len(data)))}
        write_dataset(path, fields, progress=False, **({"compress": f"zstd:{level}"} if mode == "zstd" else {}))
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


def cold_gbps(path: str, backend: str, batch: int, resident_bytes: int | None = None) -> float | None:
    """GB/s of decoded data of one shuffled pass from a dropped page cache (mmap, which reads its files at open:
    open + pass); None where the cache cannot be dropped. ``resident_bytes``: GDSDataset's (None: its default)."""
    opts: dict[str, Any] = {} if resident_bytes is None else {"resident_bytes": resident_bytes}
    try:
        if backend == "mmap":
            if not drop_page_cache():
                return None
            t0 = time.perf_counter()
            with GDSDataset(path, batch_size=batch, backend=backend, shuffle=True, **opts) as ds:
                r = time_pass(ds)
            return r.bytes / (time.perf_counter() - t0) / 1e9
        with GDSDataset(path, batch_size=batch, backend=backend, shuffle=True, **opts) as ds:
            next(iter(ds), None)  # buffers, streams, kernels set up outside the timed pass (cold_pass stops it)
            try:
                return cold_pass(ds).gb_per_s
            except PermissionError:
                return None
    finally:
        free_device_memory()


def nvcomp_decode_gbps(path: str, field: str, window_bytes: int = 256 << 20, repeats: int = 3,
                       lanes: int | None = None) -> float | None:
    """nvCOMP's batched decode alone, as the decode step calls it: ``lanes`` windows of ``field``'s chunks, a
    call each on its own stream; decoded GB/s (best of ``repeats``, timed by events). None without nvCOMP."""
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
