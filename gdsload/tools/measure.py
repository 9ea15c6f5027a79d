"""Measuring primitives shared by ``gdsload bench`` and the benchmark suite: passes, steps and ceilings.

Every function works on any gdsload dataset (or its shard files) and returns what it measured; none prints,
writes files or keeps state. Rates are GB/s (GB = 1e9 bytes); CPU time is this process's and its finished
children's (a contender's live workers are undercounted until joined). GPU packages are imported inside the
functions that need them. *Cold* passes follow :func:`drop_page_cache`, which needs root: without it the
caller must say a cold figure could not be taken, not report a warm one.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import resource
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._units import ALIGN, align_up
from ..backends import info
from ..format.layout import DatasetLayout
from ..format.meta import read_metadata
from .steps import Step

if TYPE_CHECKING:
    from ..format.layout import BlockLocation

#: Reader threads and read size of the POSIX ceilings and raw KvikIO reads (gdsload's own default threads).
THREADS = 16
CHUNK_BYTES = 8 << 20


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished (waited-for) children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def drop_page_cache() -> bool:
    """``sync`` then drop the kernel's page cache (whole machine). True if dropped; False when not
    permitted (not root, or a read-only /proc in a container): the caller then has no cold regime."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


# -- the files of a dataset ------------------------------------------------------------------------------
def shard_paths(path: str | os.PathLike[str]) -> list[str]:
    """Every shard file of every field of the dataset at ``path``."""
    with DatasetLayout(read_metadata(path)) as layout:
        return layout.shard_paths()


def block_locations(path: str | os.PathLike[str], fields: Sequence[str] | None = None) -> list[BlockLocation]:
    """Where every written block of the fixed-size ``fields`` (default: all of them) lies, field by field in
    block order. Blocks never written are left out (a reader fills them, it does not read them)."""
    meta = read_metadata(path)
    names = tuple(fields) if fields is not None else tuple(meta.fields)
    with DatasetLayout(meta, names) as layout:
        locs = [layout.locate(name, b) for name in names for b in range(meta.num_blocks)]
    return [loc for loc in locs if loc is not None]


# -- a pass over a dataset -------------------------------------------------------------------------------
@dataclass
class PassResult:
    """One timed pass (or one read of the same bytes by a contender or a ceiling).

    ``seconds`` is wall time from the first request to the last byte in place (device work synchronized);
    ``cpu_s`` the CPU time spent in that stretch; ``stall_s`` / ``first_batch_s``: gdsload's own count of the
    time its consumer waited for data (None for others); ``wait_s``: with a simulated step, wall time beyond
    the same steps run alone (``alone_s``), clipped at 0; ``alone_again_s``: those steps timed alone once more
    after the passes (:func:`time_passes`), so how far they move by themselves stands beside ``wait_s``."""

    bytes: int
    seconds: float
    io_mode: str
    samples: int | None = None
    cpu_s: float = 0.0
    stall_s: float | None = None
    first_batch_s: float | None = None
    wait_s: float | None = None
    alone_s: float | None = None
    alone_again_s: float | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.seconds if self.samples and self.seconds > 0 else None

    @property
    def cpu_core_s_per_gb(self) -> float | None:
        return self.cpu_s / (self.bytes / 1e9) if self.bytes else None

    @property
    def stall_fraction(self) -> float | None:
        return self.stall_s / self.seconds if self.stall_s is not None and self.seconds > 0 else None

    @property
    def steady_stall_fraction(self) -> float | None:
        """The stall share after the first batch: the pass's steady state, without its first window."""
        if self.stall_s is None or self.first_batch_s is None or self.seconds <= self.first_batch_s:
            return None
        return (self.stall_s - self.first_batch_s) / (self.seconds - self.first_batch_s)

    @property
    def wait_fraction(self) -> float | None:
        return self.wait_s / self.seconds if self.wait_s is not None and self.seconds > 0 else None


def device_sync(ds: Any) -> Callable[[], None]:
    """A function waiting for the work queued on the consumer's current stream (nothing for backend cpu)."""
    if not info(ds.describe()["backend"]).on_device:
        return lambda: None
    import cupy

    return lambda: cupy.cuda.get_current_stream().synchronize()


#: Batches a warm measurement takes, untimed, before it starts (the pipeline's start left out).
WARMUP_BATCHES = 3


def take_batches(ds: Any, n: int = WARMUP_BATCHES) -> None:
    """Take up to ``n`` batches of a pass and leave it (its readers stop)."""
    it = iter(ds)
    try:
        for _, _batch in zip(range(n), it):
            pass
    finally:
        it.close()


def time_pass(ds: Any, step: Step | None = None, min_seconds: float = 0.0, from_rest: bool = True) -> PassResult:
    """Time passes over ``ds`` (a :class:`gdsload.GDSDataset`), back to back, every batch taken and dropped:
    one pass, or as many as it takes to fill ``min_seconds``, reported as one stretch.

    Reading ahead is stopped first, so the clock starts from nothing: what the readers did while nobody
    timed them (between two measurements, or while the steps ran alone) never counts as this stretch's.
    Within the stretch every pass is read ahead during the one before, as in training; its one start-up
    is amortized over ``min_seconds``. With ``step``, each batch is followed by one simulated training
    step, and as many steps are first timed alone: ``wait_s`` is the stretch's wall time beyond them. The
    passes are warm or cold as the page cache is (:func:`cold_pass` for one pass from a dropped cache).
    ``from_rest=False`` keeps what was read ahead before the clock started (the method of earlier result
    files, kept for comparisons with them)."""
    sync = device_sync(ds)
    if from_rest:
        ds.stop()  # before the steps alone: no reader competes with them either
    alone = step.alone(len(ds)) if step is not None else None
    c0, t0 = cpu_seconds(), time.perf_counter()
    total = PassResult(bytes=0, seconds=0.0, io_mode="", samples=0, stall_s=0.0)
    passes = 0
    while passes == 0 or time.perf_counter() - t0 < min_seconds:
        for _batch in ds:
            if step is not None:
                step()
        s = ds.stats
        passes += 1
        total.bytes += s.bytes_delivered  # what reached the consumer, whichever tier it came from
        total.samples += s.samples
        total.stall_s += s.stall_s
        total.io_mode = s.io_mode
        if passes == 1:
            total.first_batch_s = s.first_batch_s
    sync()
    total.seconds = time.perf_counter() - t0
    total.cpu_s = cpu_seconds() - c0
    if alone is not None:
        total.alone_s = alone * passes
        total.wait_s = max(0.0, total.seconds - total.alone_s)
    return total


def time_passes(ds: Any, step: Step | None = None, passes: int = 3) -> list[PassResult]:
    """Passes as a training run takes them, each timed on its own: ``1 + passes`` passes back to back from
    rest, the first carrying the pipeline's start (its first batch included), each later one read ahead
    during the one before, as epochs are. A pass's time runs from the end of the one before (the first: from
    rest) to its last batch and step done, so the passes split one stretch of wall time between them. With
    ``step``, one pass's worth of steps is timed alone first (reading ahead stopped, so no reader competes
    with them), and every pass ends with a sync as those steps do; ``wait_s`` is a pass's time beyond
    them; they are timed alone again after the passes, reading stopped again (``alone_again_s``). The median
    of the later passes is the steady state the suite's training-step rows report."""
    sync = device_sync(ds)
    ds.stop()
    alone = step.alone(len(ds)) if step is not None else None
    out: list[PassResult] = []
    c_prev, t_prev = cpu_seconds(), time.perf_counter()
    for _ in range(1 + passes):
        for _batch in ds:
            if step is not None:
                step()
        if step is not None:
            step.finish()  # every pass starts in the phase its steps alone started in
        sync()
        t, c = time.perf_counter(), cpu_seconds()
        s = ds.stats
        r = PassResult(bytes=s.bytes_delivered, seconds=t - t_prev, io_mode=s.io_mode, samples=s.samples,
                       cpu_s=c - c_prev, stall_s=s.stall_s, first_batch_s=s.first_batch_s, alone_s=alone)
        if alone is not None:
            r.wait_s = max(0.0, r.seconds - alone)
        out.append(r)
        c_prev, t_prev = c, t
    if step is not None:
        ds.stop()
        again = step.alone(len(ds))
        for r in out:
            r.alone_again_s = again
    return out


def cold_pass(ds: Any, step: Step | None = None) -> PassResult:
    """A pass from a dropped page cache: reading ahead stopped first (nothing may come from the warm cache).
    Raises PermissionError when the cache cannot be dropped."""
    ds.stop()
    if not drop_page_cache():
        raise PermissionError("cannot drop the page cache (needs root): no cold pass")
    return time_pass(ds, step)


# -- ceilings --------------------------------------------------------------------------------------------
def pinned_h2d_gbps(nbytes: int = 256 << 20, repeats: int = 5, device_id: int = 0) -> float:
    """Best-of-``repeats`` host-to-device copy rate from pinned memory, in GB/s (the pinned path's ceiling)."""
    import cupy

    with cupy.cuda.Device(device_id):
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
        host[:] = 1
        dev = cupy.empty(nbytes, dtype=np.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        best = float("inf")
        for _ in range(repeats):
            stream.synchronize()
            t0 = time.perf_counter()
            dev.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
            stream.synchronize()
            best = min(best, time.perf_counter() - t0)
        del dev, host, mem
    return nbytes / best / 1e9


def _pieces(paths: Sequence[str], chunk: int) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        size = os.path.getsize(p)
        out += [(p, o, min(chunk, size - o)) for o in range(0, size, chunk)]
    return out


def read_files(paths: Sequence[str], direct: bool = False, pinned: bool = False, threads: int = THREADS,
               chunk: int = CHUNK_BYTES, min_seconds: float = 0.0) -> PassResult:
    """``threads`` threads reading whole files in reads of ``chunk`` bytes into per-thread buffers: with ``direct``
    through O_DIRECT (the disk's ceiling: run it cold), else buffered (warm: the page cache's). ``pinned``
    reads into pinned host memory (needs CuPy): the pinned path's first stage alone. Buffers are allocated
    and files opened before the timing starts. Passes over all of ``paths`` follow each other until
    ``min_seconds`` have passed (at least one), timed as one stretch: a small set of files is timed at its
    rate, not at the cost of starting the reads. Raises OSError where the file system refuses O_DIRECT."""
    if direct and chunk % ALIGN:
        raise ValueError(f"O_DIRECT needs chunk to be a multiple of {ALIGN} (found {chunk})")
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds: dict[str, int] = {}
    local = threading.local()
    keep: list[Any] = []

    def buf() -> memoryview:
        if not hasattr(local, "b"):
            if pinned:
                import cupy

                mem = cupy.cuda.alloc_pinned_memory(chunk)
                keep.append(mem)
                local.b = memoryview(np.frombuffer(mem, np.uint8, chunk))
            else:
                local.b = memoryview(mmap.mmap(-1, chunk))  # page aligned, as O_DIRECT needs
        return local.b

    def read(item: tuple[str, int, int]) -> int:
        p, off, n = item
        n_al = align_up(n) if direct else n
        return min(os.preadv(fds[p], [buf()[:n_al]], off), n)

    try:
        for p in paths:  # inside the try: a refused open closes those made before it
            fds[p] = os.open(p, flags)
        items = _pieces(paths, chunk)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: buf(), range(threads * 2)))  # allocate outside the timing
            c0, t0 = cpu_seconds(), time.perf_counter()
            total = sum(pool.map(read, items))
            while time.perf_counter() - t0 < min_seconds and total:
                total += sum(pool.map(read, items))
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        for fd in fds.values():
            os.close(fd)
    mode = "posix-odirect" if direct else "posix-pinned" if pinned else "posix"
    return PassResult(bytes=total, seconds=dt, io_mode=mode, cpu_s=cpu)


@contextlib.contextmanager
def kvikio_pool(threads: int) -> Iterator[Any]:
    """KvikIO with its process-wide pool set as the kvikio backend sets it (``threads`` threads, 4 MiB tasks
    and bounce buffers), held through ``KvikioPool`` while the reads run: a dataset open with other settings
    keeps its pool (restarting it would change what the dataset reads with) and the ceiling raises
    RuntimeError rather than report threads it did not read with."""
    import kvikio

    from ..backends.cuda import KvikioPool
    from ..backends.kvikio import DEFAULT_TASK_BYTES

    KvikioPool.acquire(threads, DEFAULT_TASK_BYTES, exact=True)
    try:
        yield kvikio
    finally:
        KvikioPool.release()


def _kvikio_mode() -> str:
    from ..system.env import kvikio_info

    return kvikio_info().get("io_mode") or "kvikio"


def raw_kvikio_files(paths: Sequence[str], dest: Any, threads: int = THREADS) -> PassResult:
    """The best raw KvikIO read of a dataset's bytes: each whole shard file in one ``pread`` into the device
    buffer ``dest`` (at least the files' total size), handles opened before the timing."""
    import cupy

    sizes = [os.path.getsize(p) for p in paths]
    with kvikio_pool(threads) as kvikio:
        handles = [kvikio.CuFile(p, "r") for p in paths]
        try:
            c0, t0 = cpu_seconds(), time.perf_counter()
            futures, off = [], 0
            for h, n in zip(handles, sizes):
                futures.append(h.pread(dest[off:off + n], n, 0))
                off += n
            total = sum(f.get() for f in futures)
            cupy.cuda.runtime.deviceSynchronize()
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        finally:
            for h in handles:
                h.close()
    return PassResult(bytes=total, seconds=dt, io_mode=_kvikio_mode(), cpu_s=cpu)


def raw_kvikio_blocks(blocks: Sequence[BlockLocation], dest: Any, threads: int = THREADS, shuffle: bool = True,
                      seed: int = 0, min_seconds: float = 0.0) -> PassResult:
    """Raw KvikIO reads of the same blocks a reader of the dataset reads (:func:`block_locations`): one
    ``pread`` per block into the device buffer ``dest`` (at least their total size), issued in a shuffled
    order (``shuffle``, from ``seed``) as a shuffled pass issues them, handles opened before the timing.
    The rate a loader of those blocks could reach through KvikIO alone. Passes over the blocks follow each
    other (each in a new order) until ``min_seconds`` have passed, timed as one stretch; the first pass's
    order is the same whatever ``min_seconds``."""
    import cupy

    starts = np.concatenate([[0], np.cumsum([b.nbytes for b in blocks])]).tolist()
    rng = np.random.default_rng(seed)
    with kvikio_pool(threads) as kvikio:
        handles = {p: kvikio.CuFile(p, "r") for p in dict.fromkeys(b.path for b in blocks)}
        try:
            c0, t0 = cpu_seconds(), time.perf_counter()
            total = 0
            while total == 0 or (time.perf_counter() - t0 < min_seconds and blocks):
                order = rng.permutation(len(blocks)) if shuffle else np.arange(len(blocks))
                futures = []
                for i in order.tolist():
                    b = blocks[i]
                    futures.append(handles[b.path].pread(dest[starts[i]:starts[i] + b.nbytes], b.nbytes, b.offset))
                got = sum(f.get() for f in futures)
                total += got
                if not got:
                    break
            cupy.cuda.runtime.deviceSynchronize()
            dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        finally:
            for h in handles.values():
                h.close()
    return PassResult(bytes=total, seconds=dt, io_mode=_kvikio_mode(), cpu_s=cpu)


def best(results: Sequence[PassResult]) -> PassResult:
    """The fastest of several passes of the same thing (the steady state of a warm regime): the highest
    rate, which is the shortest time where they read the same bytes (a stretch of passes may read more)."""
    return max(results, key=lambda r: (r.gb_per_s, -r.seconds))


def save_report(path: str, doc: dict[str, Any]) -> None:
    """``gdsload bench --json PATH``: the run's document as indented JSON, and a line saying so."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def num(v: float | None, fmt: str) -> str:
    """A table's figure: ``v`` in ``fmt``, ``-`` where not measured."""
    return "-" if v is None else format(v, fmt)


def figures(r: PassResult) -> dict[str, Any]:
    """A measurement's figures as the benchmark rows hold them (rounded for the tables)."""
    per_gb = r.cpu_core_s_per_gb if r.cpu_s else None
    return {"io_mode": r.io_mode, "gbps": round(r.gb_per_s, 3),
            "samples_per_s": round(r.samples_per_s) if r.samples_per_s else None,
            "cpu_s_per_gb": None if per_gb is None else round(per_gb, 4), "seconds": round(r.seconds, 3),
            "bytes": r.bytes}
