"""The pinned backend: reads land in a small pool of pinned host slots, copies go async to the device.

Three readers. The default, where the native stager builds (:mod:`gdsload.stager`; a C compiler at
install or first use): C threads read each piece into a small pinned buffer of their own and copy it on a
non-blocking stream of their own, with no Python per piece, so nothing on the consumer's path competes for
the GIL; its buffers (``num_threads`` x 2 x 4 MiB) replace the staging pool. Otherwise two readers fill the
pool's slots. With KvikIO installed, KvikIO's C++ thread pool reads into them
(host memory: plain POSIX reads, no bounce buffer) and one driver thread copies each finished slot on a
non-blocking stream: no Python thread per read, so the consumer's thread is not fighting 16 readers for
the GIL. Otherwise (or with O_DIRECT) a pool of Python threads reads with ``os.preadv`` and copies on
per-thread non-blocking streams. Either way the copies never serialize with work on the legacy default
stream, which KvikIO's own device reads in compat mode do (its internal streams are blocking ones).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._cuda import H2D, record_event
from .._units import ALIGN, align_up
from ..errors import ReadError
from .base import FileHandles, Pending, ReadRequest, Request, TaskGroup, coalesce, pread_full, read_error, split
from .cuda import CudaBackend, KvikioPool
from .native import DEFAULT_THREADS, NATIVE_BUFS_PER_THREAD, NativeJob, native_buf_bytes, native_threads
from .staging import StagingPool

# Larger staging slots mean fewer calls per byte in the driver thread (docs/benchmarks.md: the sweep).
DEFAULT_SLOT_BYTES = 16 << 20
DEFAULT_POOL_BYTES = 512 << 20
# One staging slot in DEFAULT_COPY_SHARE is kept out of reading, for copies still in flight: with every
# slot reading, the slot a finished read frees is the one whose copy was just queued, so the driver would
# wait for each copy before issuing the next read.
DEFAULT_COPY_SHARE = 4
TASK_BYTES = 4 << 20  # KvikIO's task size for the staging reads


def _open_direct(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def pack(pieces: Sequence[ReadRequest], slot_bytes: int) -> list[list[tuple[int, ReadRequest]]]:
    """Group pieces (each at most ``slot_bytes``) into slot loads: (offset in slot, piece), offsets 4 KiB
    aligned. Small blocks share a slot, so a slot, an event and a task serve many of them."""
    groups: list[list[tuple[int, ReadRequest]]] = []
    used = slot_bytes
    for p in pieces:
        start = align_up(used)
        if start + p.nbytes > slot_bytes:
            groups.append([])
            start = 0
        groups[-1].append((start, p))
        used = start + p.nbytes
    return groups


class PinnedBackend(CudaBackend):
    name = "pinned"
    window_bytes_hint = 256 << 20
    # Its driver thread's Python work delays the assembler's turns now and then; two more batches in hand
    # keep that from a loop that syncs every step (docs/design.md).
    batches_ahead_hint = 4

    def __init__(self, device_id: int = 0, num_threads: int | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 pool_bytes: int = DEFAULT_POOL_BYTES, direct: bool = False, reader: str = "auto",
                 copy_share: int = DEFAULT_COPY_SHARE, spin_events: bool = True, buf_bytes: int | None = None,
                 bufs_per_thread: int = NATIVE_BUFS_PER_THREAD):
        """``pool_bytes`` bounds the pinned memory held (``pool_bytes // slot_bytes`` slots); ``direct`` reads
        aligned blocks with O_DIRECT, bypassing the page cache (for datasets larger than RAM); ``reader``:
        "kvikio" (KvikIO's thread pool, ``num_threads`` threads), "threads" (Python threads) or "auto"
        (kvikio when installed, threads with ``direct``); ``copy_share``: with KvikIO's reader, one
        staging slot in ``copy_share`` is kept for copies in flight (0: every slot reads); ``spin_events``:
        waits for a slot's last copy spin rather than sleep; ``buf_bytes`` and ``bufs_per_thread``: the native
        reader's own pinned buffers per thread (default :func:`native_buf_bytes`). ``num_threads`` (reader
        threads) defaults to :func:`native_threads` of this rank's cores for the native reader,
        ``DEFAULT_THREADS`` for the others."""
        from ..env import kvikio_installed, local_ranks, rank_cores

        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be positive (found {num_threads})")
        if pool_bytes < slot_bytes:
            raise ValueError(f"pool_bytes ({pool_bytes}) must hold at least one slot of {slot_bytes} bytes")
        if not isinstance(copy_share, int) or copy_share < 0:
            raise ValueError(f"copy_share must be a non-negative int (found {copy_share!r})")
        if reader not in ("auto", "native", "kvikio", "threads"):
            raise ValueError(f"reader must be 'auto', 'native', 'kvikio' or 'threads' (found {reader!r})")
        if reader in ("native", "kvikio") and direct:
            raise ValueError(f"reader={reader!r} reads through the page cache: O_DIRECT (direct=True) needs 'threads'")
        super().__init__(device_id)
        self.direct = direct
        self.io_mode = "pinned-odirect" if direct else "pinned"
        self.copy_share, self.spin_events = copy_share, spin_events
        self.native_reason: str | None = None  # why "auto" did not get the native stager
        self._stager: Any = None
        if reader in ("auto", "native") and not direct:
            from ..errors import BackendUnavailable
            from ..stager import Stager

            try:
                buf = native_buf_bytes(local_ranks()) if buf_bytes is None else buf_bytes
                self._stager = Stager("cuda", device_id, num_threads or native_threads(rank_cores()), buf,
                                      bufs_per_thread)
                reader = "native"
            except BackendUnavailable as e:
                if reader == "native":
                    raise
                self.native_reason = str(e)
        if reader == "auto":
            reader = "kvikio" if kvikio_installed() and not direct else "threads"
        self.reader = reader
        # The default depends on the reader that runs: the native one leaves the pipeline's threads a core.
        self.num_threads = num_threads = (self._stager.num_threads if self._stager is not None
                                          else num_threads or DEFAULT_THREADS)
        # The native stager stages through buffers of its own: the pool is not made.
        self.pool = StagingPool(slot_bytes, pool_bytes // slot_bytes, device_id, spin_events) if reader != "native" \
            else None
        self._local = threading.local()
        self._streams: list[Any] = []
        self._streams_lock = threading.Lock()
        self._files = FileHandles()
        self._direct_files = FileHandles(opener=_open_direct) if direct else None
        self._executor: ThreadPoolExecutor | None = None
        self._driver: _KvikioDriver | None = None
        if reader == "kvikio":
            self._driver = _KvikioDriver(self, num_threads)
        elif reader == "threads":
            self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-pinned",
                                                initializer=self.cupy.cuda.runtime.setDevice, initargs=(device_id,))

    @property
    def pinned_bytes(self) -> int:
        return self._stager.pinned_bytes if self._stager is not None else self.pool.total_bytes

    def stats(self) -> dict[str, Any]:
        if self._stager is not None:
            return {"reader": "native", "num_threads": self.num_threads, "buf_bytes": self._stager.buf_bytes,
                    "bufs_per_thread": self._stager.bufs_per_thread, "pool_bytes": self._stager.pinned_bytes}
        return {"reader": self.reader, "num_threads": self.num_threads, "slot_bytes": self.pool.slot_bytes,
                "slots": self.pool.num_slots, "pool_bytes": self.pool.total_bytes,
                "reading_slots": self._driver.reading_slots if self._driver is not None else self.pool.num_slots,
                "peak_slots_in_use": self.pool.peak_in_use, "copy_share": self.copy_share,
                "spin_events": self.spin_events, **({"native": self.native_reason} if self.native_reason else {})}

    def handles(self) -> list[FileHandles]:
        return [h for h in (self._files, self._direct_files, self._driver and self._driver.files) if h is not None]

    def streams(self) -> list[Any]:
        with self._streams_lock:
            return [self.stream, *self._streams]

    def _thread_stream(self) -> Any:
        """This reader thread's own copy stream. One shared stream serialises every copy behind every
        other; per-thread streams let copies overlap, as KvikIO's own per-thread streams do."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self.device:
                stream = self.cupy.cuda.Stream(non_blocking=True)
            self._local.stream = stream
            with self._streams_lock:
                self._streams.append(stream)
        return stream

    def _read_group(self, slot: int, group: list[tuple[int, ReadRequest]]) -> None:
        for at, p in group:
            aligned = p.offset % ALIGN == 0 and p.nbytes % ALIGN == 0
            files = self._direct_files if (self._direct_files is not None and aligned) else self._files
            pread_full(files.get(p.path), self.pool.view(slot, at + p.nbytes)[at:], p.offset, p.path)

    def _copy_group(self, dest_ptr: int, slot: int, group: list[tuple[int, ReadRequest]]) -> Any:
        """Queue the slot's host-to-device copies and record the slot's event after them; returns an
        event of this load's own (the slot's is re-recorded by its next owner), or None if nothing was
        queued."""
        stream = self._thread_stream()
        base = self.pool.ptr(slot)
        for at, p in group:
            self.cupy.cuda.runtime.memcpyAsync(dest_ptr + p.dest_offset, base + at, p.nbytes, H2D, stream.ptr)
        self.pool.events[slot].record(stream)
        return record_event(stream)

    def _load(self, dest_ptr: int, group: list[tuple[int, ReadRequest]], stop: threading.Event) -> Any:
        """Read a group of pieces into one slot, then queue their copies; returns the copies' event."""
        slot = self.pool.acquire(stop)
        if slot is None:
            return None
        copied = None
        try:
            self._read_group(slot, group)
            copied = self._copy_group(dest_ptr, slot, group)
        finally:
            self.pool.release(slot, copied is not None)
        return copied

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        filled = self.write_fills(dest, requests)  # the window's "filled" event must cover them too
        reads = coalesce([r for r in requests if isinstance(r, ReadRequest)], 1 << 62)
        dest_ptr = int(dest.data.ptr)
        if self._stager is not None:
            return NativeJob(self, dest_ptr, reads, stop, filled)
        pieces = [p for r in reads for p in split(r, self.pool.slot_bytes)]
        if self._driver is not None:
            return self._driver.submit(dest_ptr, pack(pieces, self.pool.slot_bytes), stop, filled)

        def task(group: list[tuple[int, ReadRequest]]) -> Callable[[], Any]:
            return lambda: self._load(dest_ptr, group, stop)

        def done(copied: list[Any]) -> Any:
            # Exactly this window's copies: waiting on whole streams would also wait for the next
            # windows' copies queued behind them, and hold the consumer back.
            with self.device:
                for event in copied:
                    if event is not None:
                        self.stream.wait_event(event)
                return record_event(self.stream)

        return TaskGroup(self._executor, [task(g) for g in pack(pieces, self.pool.slot_bytes)], stop, done)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self._driver is not None:
            self._driver.close()
        if self._stager is not None:
            self._stager.close()  # every copy it issued is complete
        self.quiesce()
        if self.pool is not None:
            self.pool.close()
        self._files.close()
        if self._direct_files is not None:
            self._direct_files.close()


class _Job(Pending):
    """One window's slot loads, carried out by the driver thread."""

    def __init__(self, dest_ptr: int, groups: list[list[tuple[int, ReadRequest]]], stop: threading.Event,
                 fills: Any = None):
        self.dest_ptr, self.groups, self.stop = dest_ptr, groups, stop
        self.fills = fills  # event after the window's fill-value writes (on the backend's stream), or None
        self.outstanding = 0  # slot loads issued and not yet finished
        self.issued = False  # every slot load it will get has been issued
        self.error: BaseException | None = None
        self.filled: Any = None
        self.done = threading.Event()

    def finish(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.filled


_STOP = object()


class _KvikioDriver:
    """One thread keeps every slot of the pool reading through KvikIO's C++ thread pool, and copies each
    slot to the device, in order, as its reads finish. Loads of the next windows are issued while earlier
    ones finish, so the reads never drain at a window boundary."""

    def __init__(self, backend: PinnedBackend, num_threads: int):
        import kvikio

        KvikioPool.acquire(num_threads, TASK_BYTES)
        self.pool_held = True
        self.backend, self.pool = backend, backend.pool
        self.files = FileHandles(opener=lambda path: kvikio.CuFile(path, "r"), closer=lambda f: f.close())
        with backend.device:
            self.stream = backend.cupy.cuda.Stream(non_blocking=True)
        self.jobs: queue.Queue[Any] = queue.Queue()
        slots = self.pool.num_slots
        share = backend.copy_share
        self.reading_slots = max(1, slots - (max(1, slots // share) if share else 0))
        self.fatal: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gdsload-pinned-driver", daemon=True)
        self.thread.start()

    def submit(self, dest_ptr: int, groups: list[list[tuple[int, ReadRequest]]], stop: threading.Event,
               fills: Any = None) -> _Job:
        job = _Job(dest_ptr, groups, stop, fills)
        if self.fatal is not None:
            job.error = ReadError(f"the pinned backend's driver thread failed earlier ({self.fatal})")
            job.done.set()
        else:
            self.jobs.put(job)
            if self.fatal is not None and not job.done.is_set():  # the driver died as it was queued
                job.error = ReadError(f"the pinned backend's driver thread failed ({self.fatal})")
                job.done.set()
        return job

    def close(self) -> None:
        self.jobs.put(_STOP)
        self.thread.join()
        self.files.close()
        if self.pool_held:
            self.pool_held = False
            KvikioPool.release()

    def _run(self) -> None:
        inflight: deque[tuple[_Job, int, list[tuple[int, ReadRequest]], list[Any]]] = deque()
        taken: list[_Job] = []  # jobs taken off the queue and maybe not done
        try:
            self.backend.cupy.cuda.runtime.setDevice(self.backend.device_id)
            self._loop(inflight, taken)
        except BaseException as e:  # a CUDA or internal failure: every job still open fails with it
            self.fatal = e
        finally:
            while inflight:  # KvikIO's threads may still write into these slots: wait for them
                job, slot, group, futures = inflight.popleft()
                try:
                    self._finish(job, slot, group, futures)
                except BaseException as e:
                    self.fatal = self.fatal or e
            while True:
                try:
                    taken.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in taken:  # jobs nobody will carry out any more
                if job is not _STOP and not job.done.is_set():
                    reason = f"its driver thread failed ({self.fatal})" if self.fatal else "it was closed"
                    job.error = job.error or ReadError(f"the pinned backend stopped: {reason}")
                    job.done.set()

    def _loop(self, inflight: deque, taken: list[_Job]) -> None:
        while True:
            try:
                job = self.jobs.get(block=not inflight)
            except queue.Empty:
                self._finish(*inflight.popleft())
                continue
            if job is _STOP:
                return
            taken[:] = [j for j in taken if not j.done.is_set()] + [job]
            for group in job.groups:
                if job.stop.is_set() or job.error is not None:
                    break
                while len(inflight) >= self.reading_slots:
                    self._finish(*inflight.popleft())
                # The free slot released longest ago: its copy was queued loads ago, mostly done by now.
                slot = self.pool.acquire(job.stop)
                if slot is None:
                    break
                futures = self._issue(job, slot, group)
                if futures is None:
                    break
                job.outstanding += 1
                inflight.append((job, slot, group, futures))
            job.issued = True
            self._complete_if_done(job)

    def _issue(self, job: _Job, slot: int, group: list[tuple[int, ReadRequest]]) -> list[Any] | None:
        futures = []
        for at, p in group:
            try:
                view = self.pool.view(slot, at + p.nbytes)[at:]
                futures.append(self.files.get(p.path).pread(view, p.nbytes, p.offset))
            except BaseException as e:
                for f in futures:
                    _get(f)
                self.pool.release(slot, False)
                job.error = read_error(p.path, p.offset, p.nbytes, cause=e)
                return None
        return futures

    def _finish(self, job: _Job, slot: int, group: list[tuple[int, ReadRequest]], futures: list[Any]) -> None:
        """Wait for a slot's reads, queue its copies, hand the slot back guarded by its event."""
        error = None
        for (_, p), f in zip(group, futures):
            n, e = _get(f)
            if e is not None:
                error = error or read_error(p.path, p.offset, p.nbytes, cause=e)
            elif n != p.nbytes:
                error = error or read_error(p.path, p.offset, p.nbytes, got=n)
        copied = False
        if error is None and job.error is None and not job.stop.is_set():
            base = self.pool.ptr(slot)
            for at, p in group:
                self.backend.cupy.cuda.runtime.memcpyAsync(job.dest_ptr + p.dest_offset, base + at, p.nbytes, H2D,
                                                           self.stream.ptr)
            self.pool.events[slot].record(self.stream)
            copied = True
        self.pool.release(slot, copied)
        if error is not None and job.error is None:
            job.error = error
        job.outstanding -= 1
        self._complete_if_done(job)

    def _complete_if_done(self, job: _Job) -> None:
        if job.issued and job.outstanding == 0 and not job.done.is_set():
            if job.error is None:
                # Copies are queued in order: this event covers the window's, and the fills before them.
                if job.fills is not None:
                    self.stream.wait_event(job.fills)
                job.filled = record_event(self.stream)
            job.done.set()


def _get(future: Any) -> tuple[int, BaseException | None]:
    try:
        return future.get(), None
    except BaseException as e:
        return 0, e
