"""``gdsload bench URL``: a remote dataset read by its route, beside raw KvikIO ``RemoteFile`` and the CPU client.

All in one run against one server, on the same ranges (:func:`remote_blocks`: every written block of the fixed
fields, located through the skeleton, shuffled with seed 0). Rows have ``gdsload bench``'s shape, regime
``"remote"``, plus ``route`` (the dataset's, or how a ceiling reads); a row that cannot run has ``error``.
:func:`raw_remote_file` reads a ``pread`` per block on KvikIO's pool as the direct route sets it (its ceiling);
:func:`client_blocks` a ranged GET per block on :data:`CPU_THREADS` threads into host memory. Each ceiling's
first read (:data:`PROBE_BYTES`) picks how many blocks fill ``seconds`` (:func:`budgeted`); ``bounded`` is
bench.py's ``Bounded``, passed in because bench.py imports this module (docs/remote.md, "Speed").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..errors import GDSLoadError, ReadError, one_line
from ..remote.objects import ObjectInfo
from .measure import (PassResult, best, block_locations, cpu_seconds, figures, num, save_report, take_batches,
                      time_pass)

#: Threads of the CPU client rows (gdsload's own default reader threads).
CPU_THREADS = 16
#: A ceiling's first read: enough to time a rate rather than a latency.
PROBE_BYTES = 64 << 20
MIN_TIMED_S = 0.2
Row = dict[str, Any]


class RemoteBlock(NamedTuple):
    """One block's bytes in a remote object: the object (URL, pinned size and ETag), offset, length."""

    info: ObjectInfo
    offset: int
    nbytes: int


def remote_blocks(url: str, cache_dir: str | None = None, shuffle: bool = True, seed: int = 0) -> list[RemoteBlock]:
    """The byte ranges a reader of the remote dataset ``url`` reads: every written block of its fixed-size fields,
    located through its skeleton (fetched into ``cache_dir``, default gdsload's ``datasets`` cache folder, unless
    there), shuffled with ``seed`` unless ``shuffle`` is False. Blocks in objects the skeleton holds whole (small
    arrays read at open) are left out: no route reads them per pass."""
    from ..remote.mirror import open_version
    from ..system.env import cache_dir as env_cache_dir

    version = open_version(url, os.fspath(cache_dir) if cache_dir else os.path.join(env_cache_dir(), "datasets"))
    shards = {os.path.realpath(p): e for p, e in version.shards.items()}
    blocks = []
    for loc in block_locations(version.root):
        entry = shards.get(os.path.realpath(loc.path))
        if entry is not None:
            blocks.append(RemoteBlock(entry.info, loc.offset, loc.nbytes))
    if not blocks:
        raise ReadError(f"{url}: no block of a fixed-size field to read")
    if shuffle:
        blocks = [blocks[i] for i in np.random.default_rng(seed).permutation(len(blocks)).tolist()]
    return blocks


def _starts(blocks: Sequence[RemoteBlock]) -> list[int]:
    return np.concatenate([[0], np.cumsum([b.nbytes for b in blocks])]).astype(np.int64).tolist()


def _sync(dest: Any) -> None:
    """Wait for device work when ``dest`` is a CuPy array (KvikIO's futures end with the bytes in place)."""
    if type(dest).__module__.startswith("cupy"):
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def raw_remote_file(blocks: Sequence[RemoteBlock], dest: Any, threads: int | None = None,
                    min_seconds: float = 0.0) -> PassResult:
    """Raw KvikIO ``RemoteFile`` reads of ``blocks``: one ``pread`` per block into its place in ``dest`` (a device
    or host buffer of at least their total size), all in flight at once, on KvikIO's pool held with ``threads``
    (default: the direct route's, ``default_threads(rank_cores())``) and 4 MiB tasks, exactly (RuntimeError where
    a dataset holds it otherwise). Handles are opened before the clock (no request is sent). Passes repeat until
    ``min_seconds``, timed as one stretch; a short read is a ReadError."""
    from ..backends.kvikio import default_threads
    from ..backends.remote_direct import IO_MODE, open_remote_file
    from ..system.env import rank_cores
    from .measure import kvikio_pool

    threads = threads or default_threads(rank_cores())
    starts = _starts(blocks)
    with kvikio_pool(threads):
        handles = {b.info.url: open_remote_file(b.info) for b in blocks}
        try:
            c0, t0 = cpu_seconds(), time.perf_counter()
            total = 0
            while total == 0 or time.perf_counter() - t0 < min_seconds:
                futures = [handles[b.info.url].pread(dest[starts[i]:starts[i + 1]], b.nbytes, b.offset)
                           for i, b in enumerate(blocks)]
                got = sum(f.get() for f in futures)
                if got != starts[-1]:
                    raise ReadError(f"raw RemoteFile: {got} bytes came of {starts[-1]}")
                total += got
            _sync(dest)
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        finally:
            for h in handles.values():
                getattr(h, "close", lambda: None)()
    return PassResult(bytes=total, seconds=dt, io_mode=IO_MODE, cpu_s=cpu)


def client_blocks(blocks: Sequence[RemoteBlock], dest: np.ndarray, threads: int = CPU_THREADS,
                  min_seconds: float = 0.0) -> PassResult:
    """The CPU route's client (:func:`gdsload.remote.client_for` of the first block's URL) reading every block by
    one ranged GET pinned to its ETag, copied into its place in the host buffer ``dest`` (uint8, at least their
    total size), on ``threads`` threads; passes repeat until ``min_seconds``, timed as one stretch."""
    from ..remote import client_for

    client = client_for(blocks[0].info.url)
    starts = _starts(blocks)

    def one(i: int) -> int:
        b = blocks[i]
        data = client.read(b.info, b.offset, b.nbytes)
        dest[starts[i]:starts[i + 1]] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    with ThreadPoolExecutor(threads, thread_name_prefix="gdsload-bench-client") as pool:
        c0, t0 = cpu_seconds(), time.perf_counter()
        total = 0
        while total == 0 or time.perf_counter() - t0 < min_seconds:
            total += sum(pool.map(one, range(len(blocks))))
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return PassResult(bytes=total, seconds=dt, io_mode=f"cpu {type(client).__name__}", cpu_s=cpu)


def budgeted(blocks: Sequence[RemoteBlock], seconds: float,
             measure: Callable[[Sequence[RemoteBlock], float], PassResult]) -> PassResult:
    """``measure(blocks, min_seconds)`` of the first blocks that it reads in about ``seconds``: a first read of
    :data:`PROBE_BYTES` (or one block) times the rate; then, if more blocks remain, as many as that rate reads in
    ``seconds``, passes over them repeated for at least :data:`MIN_TIMED_S`. The better of the two is reported."""
    total = np.cumsum([b.nbytes for b in blocks])
    first = min(len(blocks), int(np.searchsorted(total, PROBE_BYTES, side="left")) + 1)
    runs = [measure(blocks[:first], MIN_TIMED_S)]
    if first < len(blocks):
        budget = runs[0].gb_per_s * 1e9 * seconds
        n = max(first, int(np.searchsorted(total, budget, side="right")))
        runs.append(measure(blocks[:n], MIN_TIMED_S))
    return best(runs)


def device_buffer(blocks: Sequence[RemoteBlock]) -> tuple[Any, list[RemoteBlock]]:
    """A device buffer for the first ``blocks`` that fit in half the free device memory, and those blocks."""
    import cupy

    sizes = np.cumsum([b.nbytes for b in blocks])
    keep = max(1, int(np.searchsorted(sizes, cupy.cuda.runtime.memGetInfo()[0] // 2, side="right")))
    return cupy.empty(int(sizes[keep - 1]), dtype=cupy.uint8), list(blocks[:keep])


def direct_why_not(url: str) -> str | None:
    """Why raw KvikIO RemoteFile reads of ``url`` into device memory cannot run here (None: they can)."""
    from ..remote.route import direct_usable, kvikio_remote
    from ..system.env import gpu_available

    if not gpu_available():
        return "no GPU here"
    ok, why = direct_usable(url, os.environ, kvikio_remote())
    return None if ok else why


def dataset_row(url: str, backend: str, batch_size: int, seconds: float, bounded: Callable[[Any, float], Any]) -> Row:
    """The remote dataset read by ``backend`` by its default route, shuffled: a few batches untimed, then a pass
    cut after ``seconds`` (``bounded``), timed by ``time_pass``."""
    from ..dataset import GDSDataset

    with GDSDataset(url, batch_size=batch_size, backend=backend, shuffle=True, seed=0) as ds:
        route = ds.describe()["remote"]["route"]
        take_batches(ds)
        r = time_pass(bounded(ds, seconds), min_seconds=seconds)
        return {"backend": ds.backend_name, "route": route, **figures(r)}


def run(url: str, backends: Sequence[str], batch_size: int, seconds: float,
        bounded: Callable[[Any, float], Any]) -> list[Row]:
    """Every row of ``gdsload bench URL``: each of ``backends`` by its default route, raw RemoteFile on the same
    ranges (GPU), the CPU client on the same ranges. A row that fails says why; the others still run."""
    rows: list[Row] = []
    empty = dict.fromkeys(("io_mode", "gbps", "samples_per_s", "cpu_s_per_gb"))

    def attempt(where: Row, fn: Callable[[], Row]) -> None:
        try:
            rows.append({**where, **fn()})
        except Exception as e:  # a row that cannot run here says why; the run goes on
            rows.append({**where, **empty, "error": one_line(f"{type(e).__name__}: {e}")})
        finally:
            cupy = sys.modules.get("cupy")
            if cupy is not None:
                cupy.get_default_memory_pool().free_all_blocks()

    for b in backends:
        attempt({"backend": b, "auto": b == "auto", "regime": "remote", "shuffle": True, "route": None},
                lambda b=b: dataset_row(url, b, batch_size, seconds, bounded))
    try:
        blocks: list[RemoteBlock] | None = remote_blocks(url)
    except Exception as e:  # the dataset rows above already say so
        blocks, why = None, one_line(f"{type(e).__name__}: {e}")
    raw = {"ceiling": "raw RemoteFile, same ranges", "backend": None, "regime": "remote", "shuffle": True,
           "route": "direct (KvikIO, device)"}
    cpu = {"ceiling": f"CPU client, same ranges, {CPU_THREADS} threads", "backend": None, "regime": "remote",
           "shuffle": True, "route": "cached's client (host)"}
    if blocks is None:
        rows += [{**w, **empty, "error": why} for w in (raw, cpu)]
        return rows

    def raw_row() -> Row:
        why_not = direct_why_not(url)
        if why_not:
            raise GDSLoadError(why_not)
        dest, chosen = device_buffer(blocks)
        return figures(budgeted(chosen, seconds, lambda bs, s: raw_remote_file(bs, dest, min_seconds=s)))

    def cpu_row() -> Row:
        dest = np.empty(sum(b.nbytes for b in blocks), dtype=np.uint8)
        return figures(budgeted(blocks, seconds, lambda bs, s: client_blocks(bs, dest, min_seconds=s)))

    attempt(raw, raw_row)
    attempt(cpu, cpu_row)
    return rows


def render(url: str, rows: Sequence[Row], seconds: float, batch_size: int) -> str:
    """The table printed on screen; each gdsload row's share of the raw RemoteFile row in the last column."""
    raw = next((r["gbps"] for r in rows if r.get("ceiling", "").startswith("raw") and r.get("gbps")), None)
    table = [("what", "io mode", "route", "GB/s", "samples/s", "CPU core-s/GB", "% of raw", "note")]
    for r in rows:
        what = f"ceiling: {r['ceiling']}" if r.get("ceiling") else f"gdsload {r['backend']}"
        share = f"{100 * r['gbps'] / raw:.0f}" if raw and r.get("gbps") and not r.get("ceiling") else "-"
        table.append((what, r.get("io_mode") or "-", r.get("route") or "-", num(r.get("gbps"), ".2f"),
                      num(r.get("samples_per_s"), ",.0f"), num(r.get("cpu_s_per_gb"), ".3f"), share,
                      r.get("error", "")))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if 2 < i < 7 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             + ("  " + line[-1] if line[-1] else "") for line in table]
    head = [f"{url}: remote dataset, shuffled, batch {batch_size}; each measurement about {seconds:g} s"]
    return "\n".join(head + [""] + [ln.rstrip() for ln in lines])


def main(args: argparse.Namespace, bounded: Callable[[Any, float], Any]) -> int:
    """``gdsload bench URL`` (bench.py's ``main`` hands a remote path here): 0 when it ran. ``--backends``
    (default ``auto``) picks the dataset rows; ``--cold`` has no remote meaning and is said to be ignored."""
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise GDSLoadError(f"{args.json}: its folder does not exist")
    if args.cold:
        print("--cold: no page cache stands between a remote dataset and its reader here: ignored")
    backends = list(args.backends or ["auto"])
    rows = run(args.path, backends, args.batch_size, args.seconds, bounded)
    print(render(args.path, rows, args.seconds, args.batch_size), flush=True)
    if args.json:
        from ..system.env import system_info

        doc = {"command": "gdsload bench", "dataset": args.path, "remote": True,
               "settings": {"backends": backends, "seconds": args.seconds, "batch_size": args.batch_size},
               "machine": system_info(), "rows": rows}
        save_report(args.json, doc)
    return 0


def num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)
