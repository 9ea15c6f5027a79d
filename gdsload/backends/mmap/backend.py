"""The mmap backend (the RAM tier): shard files mapped, locked and registered for DMA once, then copied.

Contract: the budget and the ability to lock are checked at open (a dataset too large fails there, never
mid-epoch); the files then load in ranges of ``RANGE_BYTES`` on background threads (preload.py), a window's
ranges first; a copy never spans two ranges. ``unlocked="stage"`` reads ranges not yet locked through the
native stager instead of waiting. A shard file truncated in place while open kills the process (SIGBUS);
replacing the dataset is safe. Why: docs/design.md, "`mmap`: the RAM tier".
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...cuda.runtime import H2D, HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, record_event
from ...errors import BackendUnavailable, ReadError
from .copier import Copier, CopyFailed
from .preload import Preloader
from ..._tasks import Pending, Queued
from ...system.env import local_ranks, rank_cores
from ..base import ReadRequest, Request
from ...format.files import read_error
from ..cuda import CudaBackend
from ..sizing import NATIVE_BUFS_PER_THREAD, native_buf_bytes, native_threads
from ...system.placement import for_device

DEFAULT_COPY_BYTES = 64 << 20
DEFAULT_STREAMS = 2
#: With few CUDA hardware queues (``gdsload.system.env.connections_note``) the training step's kernels queue behind
#: whatever copies are queued: a window's copies are then queued a piece at a time, at most this many bytes
#: ahead, so a step waits behind that much at most (docs/benchmarks.md, "Hardware work queues").
PACED_QUEUE_BYTES = 16 << 20
#: Files are locked in ranges of this many bytes (a multiple of the page size), each as soon as it is read.
#: Small enough that a shuffled window's blocks are in a fraction of a cold file's ranges (the first pass
#: starts once those are in, not the whole file); copies are cut at range ends, so also the largest copy.
RANGE_BYTES = 8 << 20


def default_budget() -> int:
    """Half of physical RAM: what the mmap backend may lock by default."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def check_budget(sizes: dict[str, int], budget: int) -> None:
    """Refuse, before anything is locked, a set of files larger than the lock budget."""
    total = sum(sizes.values())
    if total > budget:
        folders = sorted({os.path.dirname(os.path.dirname(p)) for p in sizes})[:3]
        raise BackendUnavailable(
            f"backend 'mmap' would lock {total / 2**30:.2f} GiB of shard files in RAM ({', '.join(folders)}...), "
            f"over its budget of {budget / 2**30:.2f} GiB (backend_options={{'max_bytes': ...}}; default half of "
            f"RAM). Use backend='kvikio' or 'pinned' for datasets that do not fit in memory.")


@dataclass(frozen=True)
class Copies:
    """A window's copies as columns: copy i moves ``nbytes[i]`` at ``offsets[i]`` of ``paths[file[i]]`` to
    ``dest[i]`` of the window buffer (arrays of int64)."""

    paths: list[str]
    file: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    dest: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def take(self, which: np.ndarray) -> "Copies":
        """The copies where ``which`` (bool) is set."""
        return Copies(self.paths, self.file[which], self.offsets[which], self.nbytes[which], self.dest[which])

    def read(self, i: int) -> ReadRequest:
        """Copy ``i`` as a read request (for messages)."""
        return ReadRequest(self.paths[int(self.file[i])], int(self.offsets[i]), int(self.nbytes[i]), int(self.dest[i]))


def plan_copies(reads: Sequence[ReadRequest], sizes: dict[str, int], max_bytes: int,
                range_bytes: int = RANGE_BYTES) -> Copies:
    """Reads -> copies: reads adjacent both in their file and in the buffer merged, then cut at every multiple
    of ``range_bytes`` in the file (the ranges are locked one by one) and every ``max_bytes`` after it; a read
    past a file's end raises ReadError naming the file (the mapping covers the file as it was when the
    dataset opened). Whole-array numpy: this runs once per window on the submitter's thread, beside the
    consumer's, which needs the GIL the moment its step ends."""
    empty = np.zeros(0, np.int64)
    if not reads:
        return Copies([], empty, empty, empty, empty)
    path_of, offsets, nbytes, dest = zip(*reads)
    paths = list(dict.fromkeys(path_of))
    for p in paths:
        if p not in sizes:
            raise ReadError(f"{p}: not registered with the mmap backend")
    index = {p: i for i, p in enumerate(paths)}
    file = np.array([index[p] for p in path_of], np.int64)
    start, n, to = np.array(offsets, np.int64), np.array(nbytes, np.int64), np.array(dest, np.int64)
    over = np.flatnonzero(start + n > np.array([sizes[p] for p in paths], np.int64)[file])
    if len(over):
        i = int(over[0])
        size = sizes[path_of[i]]
        raise read_error(path_of[i], int(start[i]), int(n[i]), got=max(0, size - int(start[i])))
    # Runs of reads that continue one another in file and buffer.
    first = np.ones(len(n), bool)
    first[1:] = (file[1:] != file[:-1]) | (start[1:] != start[:-1] + n[:-1]) | (to[1:] != to[:-1] + n[:-1])
    heads = np.flatnonzero(first)
    ends = np.append(heads[1:], len(n)) - 1
    run_file, run_start, run_end = file[heads], start[heads], start[ends] + n[ends]
    run_dest = to[heads]
    # Cut at range ends (multiples of range_bytes in the file), then every max_bytes from a piece's start.
    seg_start, seg_end, run = _cut(run_start, run_end, range_bytes, np.zeros_like(run_start))
    piece_start, piece_end, seg = _cut(seg_start, seg_end, max_bytes, seg_start)
    owner = run[seg]
    return Copies(paths, run_file[owner], piece_start, piece_end - piece_start,
                  run_dest[owner] + piece_start - run_start[owner])


def _stager(device_id: int, mode: str) -> tuple[Any, str | None]:
    """The jobs of this backend on the process's shared native stager, sized as the pinned backend's; (None,
    why) where the library does not load."""
    from ..native.shared import Jobs, shared_stager

    try:
        return Jobs(shared_stager(device_id, native_threads(rank_cores()), native_buf_bytes(local_ranks()),
                                  NATIVE_BUFS_PER_THREAD, mode)), None
    except BackendUnavailable as e:
        return None, f"wait: {e}"


class _Staged(Pending):
    """A window read partly by the copier (``event`` after its copies) and partly by a stager job."""

    def __init__(self, jobs: Any, job: tuple[int, list[str]], stop: threading.Event, event: Any):
        self.jobs, self.job, self.stop, self.event = jobs, job, stop, event

    def finish(self) -> Any:
        self.jobs.finish(self.job[0], self.stop, self.job[1])  # its copies are done when the job is
        return self.event


def _cut(start: np.ndarray, end: np.ndarray, unit: int, origin: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """Intervals ``[start, end)`` cut at ``origin + j * unit`` for every j: the pieces' starts, ends, and the
    interval each comes from."""
    lo = (start - origin) // unit
    counts = (end - 1 - origin) // unit - lo + 1
    which = np.repeat(np.arange(len(start), dtype=np.int64), counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    at = origin[which] + (lo[which] + j) * unit
    return np.maximum(start[which], at), np.minimum(end[which], at + unit), which


def queue_bytes_for(environ: Any = os.environ) -> int:
    """The mmap backend's default ``queue_bytes``: :data:`PACED_QUEUE_BYTES` where the process has few CUDA
    hardware queues, else 0 (a window's copies queued at once)."""
    from ...system.env import connections_note

    return PACED_QUEUE_BYTES if connections_note(environ) else 0


def copy_error(copies: Copies, error: CopyFailed, first: int = 0) -> ReadError:
    """The error for a window whose copy ``first + error.index`` could not be queued, beginning with the file
    that copy reads (the copier only knows addresses); ``error`` itself when no one copy failed."""
    if error.index is None:
        return error
    c = copies.read(first + error.index)
    return ReadError(f"{c.path}: read of {c.nbytes} bytes at offset {c.offset} failed ({error})")


def file_ranges(sizes: dict[str, int], range_bytes: int = RANGE_BYTES) -> dict[tuple[str, int], tuple[str, int, int]]:
    """Every file's ranges, in file order: (path, index) -> (path, offset, nbytes)."""
    return {(p, i): (p, o, min(range_bytes, n - o)) for p, n in sizes.items()
            for i, o in enumerate(range(0, n, range_bytes))}


class _Mapping:
    """One shard file mapped read-only; its ranges locked and registered with CUDA one at a time, all
    unregistered by ``close``."""

    def __init__(self, path: str, fd: int, size: int, cupy: Any):
        self.path, self.size, self.cupy = path, size, cupy
        if size == 0:
            raise ReadError(f"{path}: empty file")
        try:
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise ReadError(f"{path}: cannot map its {size} bytes ({type(e).__name__}: {e}; now "
                            f"{os.fstat(fd).st_size} bytes: changed since the dataset opened?)") from e
        self._array = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self._array.ctypes.data)
        self._registered: list[int] = []  # offsets of the ranges registered
        self._lock = threading.Lock()

    def register(self, offset: int, nbytes: int) -> None:
        """Lock ``nbytes`` at ``offset`` and register them for DMA (faults the pages in)."""
        try:
            self.cupy.cuda.runtime.hostRegister(self.ptr + offset, nbytes,
                                                HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY)
        except Exception as e:
            raise BackendUnavailable(f"{self.path}: cannot lock and register {nbytes} bytes at offset {offset} for "
                                     f"DMA ({type(e).__name__}: {e}); backend 'mmap' needs read-only host "
                                     f"registration (Linux, CUDA 11.1+)") from e
        with self._lock:
            self._registered.append(offset)

    def close_ranges(self) -> None:
        """Unregister every range registered so far."""
        with self._lock:
            for offset in self._registered:
                self.cupy.cuda.runtime.hostUnregister(self.ptr + offset)
            self._registered.clear()

    def close(self) -> None:
        self.close_ranges()
        self._array = np.zeros(0, np.uint8)  # drop the buffer export before closing the map
        self._mm.close()


class MmapBackend(CudaBackend):
    name = "mmap"
    io_mode = "mmap"
    reads_locked_memory = True
    window_bytes_hint = 256 << 20

    def __init__(self, device_id: int = 0, max_bytes: int | None = None, num_streams: int = DEFAULT_STREAMS,
                 copy_bytes: int = DEFAULT_COPY_BYTES, register_threads: int = 16, copier: str = "auto",
                 queue_bytes: int | None = None, unlocked: str = "wait"):
        """``max_bytes`` caps the bytes locked (default half of RAM); copies of at most ``copy_bytes`` (and
        never across two locked ranges) go round robin over ``num_streams`` non-blocking streams;
        ``register_threads`` read and lock the files in the background (a window's ranges when it is
        submitted, everything once the first batch is assembled). ``copier``: "native"
        queues a window's copies in one call (gdsload.backends.mmap.copier), "cupy" one CuPy call per copy, "auto" the
        native one where the library loads (``copier_reason`` says why not). ``queue_bytes``: when positive,
        a window's copies (then at most half of it each) are queued a piece at a time, at most that many bytes
        ahead; 0 queues them at once; default :func:`queue_bytes_for`. ``unlocked``: "wait" (default) waits for
        the ranges a window reads to be locked; "stage" reads those not yet locked through the native stager
        (where it loads; ``stage_reason`` says why not)."""
        queue_bytes = queue_bytes_for() if queue_bytes is None else queue_bytes
        if num_streams < 1 or copy_bytes < 1 or register_threads < 1 or queue_bytes < 0 or queue_bytes == 1:
            raise ValueError(f"num_streams, copy_bytes and register_threads must be positive and queue_bytes 0 or "
                             f"at least 2 (found {num_streams}, {copy_bytes}, {register_threads}, {queue_bytes})")
        if copier not in ("auto", "native", "cupy"):
            raise ValueError(f"copier must be 'auto', 'native' or 'cupy' (found {copier!r})")
        if unlocked not in ("stage", "wait"):
            raise ValueError(f"unlocked must be 'stage' or 'wait' (found {unlocked!r})")
        super().__init__(device_id)
        # The loader threads run on the GPU's NUMA node: a cold file's pages are allocated there as they read
        # it; pages already cached stay where they were first read (docs/design.md, "NUMA placement").
        self.placer = for_device(self.device)
        if self.placer.placement.active:
            self.placer.note("page cache pages already cached", "the kernel placed them where they were first "
                             "read; gdsload does not migrate them (move_pages/migrate_pages)")
        self.max_bytes = default_budget() if max_bytes is None else max_bytes
        self.queue_bytes = queue_bytes
        self.copy_bytes = min(copy_bytes, queue_bytes // 2) if queue_bytes else copy_bytes
        self.register_threads = register_threads
        self.range_bytes = RANGE_BYTES
        with self.device:
            self._streams = [self.cupy.cuda.Stream(non_blocking=True) for _ in range(num_streams)]
        self._copier: Copier | None = None
        self.copier_reason: str | None = None  # why "auto" queues copies through CuPy
        if copier != "cupy":
            try:
                self._copier = Copier("cuda", device_id, [s.ptr for s in self._streams])
            except BackendUnavailable as e:
                if copier == "native":
                    raise
                self.copier_reason = str(e)
        self._maps: dict[str, _Mapping] = {}  # every file the dataset reads, mapped at prepare()
        self._sizes: dict[str, int] = {}  # their sizes as mapped (checked against the budget)
        self._loader: Preloader | None = None
        self._ranges: dict[tuple[str, int], tuple[str, int, int]] = {}  # what the loader loads (file_ranges)
        self.register_s = 0.0  # time prepare() took: the checks, mapping the files, starting the loader
        self.unlocked = unlocked
        self.stager_mode = "cuda"  # where the stager copies to ("host" in tests without a GPU)
        self.stage_reason: str | None = None  # why ranges not yet locked are waited for, with unlocked="stage"
        self._staged: Any = None  # the stager's jobs of this backend (gdsload.backends.native.shared.Jobs)
        self._fd: Any = None
        self.staged_bytes = 0  # read through the stager: ranges not yet locked

    @property
    def pinned_bytes(self) -> int:
        """Bytes of shard files this backend locks in RAM (all of them once loading is over)."""
        return sum(m.size for m in self._maps.values())

    def stats(self) -> dict[str, Any]:
        loader = self._loader.stats() if self._loader is not None else {}
        return {"locked_bytes": self.pinned_bytes, "open_s": self.register_s,
                "loaded_bytes": loader.get("bytes_loaded", 0), "load_s": loader.get("load_s"),
                "num_streams": len(self._streams), "copy_bytes": self.copy_bytes, "queue_bytes": self.queue_bytes,
                "copier": "cupy" if self._copier is None else "native", "numa": self.placer.describe(),
                "staged_bytes": self.staged_bytes, "stage": self.stage_reason or self.unlocked}

    def prepare(self, files: Any) -> None:
        """Check the whole set against the budget, map every file, check that this process can lock and
        register its memory, and start the loader: every range of every file read once through the page
        cache by parallel reads (locking alone faults pages in one at a time, far below the disk's rate),
        then locked, on the loader's threads, while the dataset is already read. Until :meth:`started`, the
        loader loads only the ranges a submitted window waits for."""
        t0 = time.perf_counter()
        sizes = {p: files.get(p).size for p in files}
        check_budget(sizes, self.max_bytes)
        self._sizes = sizes
        for p, n in sizes.items():
            self._maps[p] = _Mapping(p, files.fd(p), n, self.cupy)
        probe = next(iter(self._maps.values()), None)
        if probe is not None:  # a page locked and unlocked: a process that cannot lock fails here, not mid-pass
            with self.device:
                probe.register(0, min(probe.size, mmap.PAGESIZE))
                probe.close_ranges()
        self._ranges = file_ranges(sizes, self.range_bytes)
        self._fd = files.fd
        if self.unlocked == "stage":
            self._staged, self.stage_reason = _stager(self.device_id, self.stager_mode)
        # Held until the first batch is assembled (started()): the ranges a window waits for load alone.
        self._loader = Preloader(self._ranges, files.fd, self._lock_range, self.register_threads, hold=True,
                                 on_start=lambda: self.placer.bind_thread("loader threads"))
        self.register_s = time.perf_counter() - t0

    def started(self) -> None:
        if self._loader is not None:
            self._loader.start()

    def _lock_range(self, key: tuple[str, int]) -> None:
        """Lock a range the loader has read (on a loader thread)."""
        path, offset, nbytes = self._ranges[key]
        with self.device:
            self._maps[path].register(offset, nbytes)

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        """Copies queued once every range they read from is locked (the loader loads those first)."""
        reads = [r for r in requests if isinstance(r, ReadRequest)]
        copies = plan_copies(reads, self._sizes, self.copy_bytes, self.range_bytes)
        if self._loader is None:
            raise ReadError("internal error: the mmap backend was not prepared with the dataset's files")
        keys = [(copies.paths[f], i) for f, i in zip(copies.file.tolist(),
                                                     (copies.offsets // self.range_bytes).tolist())]
        job = None
        if self._staged is not None:  # ranges not yet locked are read now, through the stager
            locked = self._loader.ready(dict.fromkeys(keys))
            later = np.array([k not in locked for k in keys], bool)
            if later.any():
                job = self._stage(copies, later, int(dest.data.ptr))
                copies = copies.take(~later)
        elif not self._loader.wait(list(dict.fromkeys(keys)), stop):
            return Queued(None)  # stopped while its ranges loaded: nothing copied, nobody reads it
        bases = np.array([self._maps[p].ptr for p in copies.paths], np.uint64)
        dst = np.uint64(int(dest.data.ptr)) + copies.dest.astype(np.uint64)
        src = bases[copies.file] + copies.offsets.astype(np.uint64)
        self.write_fills(dest, requests)  # on self.stream: the event recorded last covers them
        with self.device:
            if not self.queue_bytes:
                if len(copies):
                    self._queue(copies, dst, src, 0, len(copies))
            else:
                ahead: deque[Any] = deque()  # the events of the pieces queued and maybe not done
                for i in range(len(copies)):
                    if stop.is_set():
                        break  # the pipeline stops: what was queued is covered by the event below
                    while len(ahead) >= 2:  # two pieces of at most queue_bytes / 2 each
                        ahead.popleft().synchronize()
                    self._queue(copies, dst, src, i, i + 1)
                    ahead.append(record_event(self.stream))
            event = record_event(self.stream)
        return Queued(event) if job is None else _Staged(self._staged, job, stop, event)

    def _stage(self, copies: Copies, which: np.ndarray, dest: int) -> tuple[int, list[str]]:
        """Copies ``which`` read through the stager into ``dest`` (one job): (job, each piece's path)."""
        at = np.flatnonzero(which)
        paths = [copies.paths[int(f)] for f in copies.file[at]]
        fds = np.array([self._fd(p) for p in copies.paths], np.int64)[copies.file[at]]
        pieces = np.stack([fds, copies.offsets[at], copies.nbytes[at], dest + copies.dest[at]], axis=1)
        self.staged_bytes += int(copies.nbytes[at].sum())
        return self._staged.submit(pieces), paths

    def _queue(self, copies: Copies, dst: np.ndarray, src: np.ndarray, lo: int, hi: int) -> None:
        """Queue copies ``lo`` to ``hi`` over the copy streams; ``self.stream`` waits for them."""
        if self._copier is not None:
            try:
                self._copier.copy(dst[lo:hi], src[lo:hi], copies.nbytes[lo:hi], self.stream.ptr)
            except CopyFailed as e:
                raise copy_error(copies, e, lo) from e
            return
        rt = self.cupy.cuda.runtime
        for i in range(lo, hi):
            try:
                rt.memcpyAsync(int(dst[i]), int(src[i]), int(copies.nbytes[i]), H2D,
                               self._streams[(i - lo) % len(self._streams)].ptr)
            except Exception as e:
                c = copies.read(i)
                raise read_error(c.path, c.offset, c.nbytes, cause=e) from e
        for s in self._streams[:hi - lo]:
            self.stream.wait_event(record_event(s))

    def streams(self) -> list[Any]:
        return [self.stream, *self._streams]

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()  # no range is locked after this
        if self._staged is not None:
            self._staged.close()  # no read of its own still lands in a window buffer
            self._staged = None
        self.quiesce()  # no copy may still read a mapping that is about to go
        if self._copier is not None:
            self._copier.close()
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._sizes = {}
