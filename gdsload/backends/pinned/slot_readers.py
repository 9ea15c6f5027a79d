"""The pinned backend's readers that fill the staging pool's slots
(:class:`gdsload.backends.pinned.staging_pool.StagingPool`): Python threads (:class:`ThreadReader`) and KvikIO's C++
thread pool driven by one Python thread (:class:`KvikioReader`). Both copy a slot to the device with
:meth:`StagingPool.copy_out` on non-blocking streams of their own, so the copies never serialize with work on the
legacy default stream.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...cuda.runtime import record_event
from ..._units import ALIGN
from ...errors import ReadError
from ..._tasks import Pending, TaskGroup
from ...system.placement import Placer, inactive
from ..base import FileHandles, ReadRequest, pread_full, split
from ...format.files import read_error
from ..cuda import KvikioPool
from .staging_pool import SlotGroup, StagingPool, StagingReader, pack

TASK_BYTES = 4 << 20  # KvikIO's task size for the staging reads


def _open_direct(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def _groups(reads: Sequence[ReadRequest], slot_bytes: int) -> list[SlotGroup]:
    return pack([p for r in reads for p in split(r, slot_bytes)], slot_bytes)


class ThreadReader(StagingReader):
    """``num_threads`` Python threads each read a slot load with ``os.preadv`` (through ``files``; aligned
    pieces through O_DIRECT descriptors of its own when ``direct``) and copy it on a non-blocking stream of
    their own. A window's event is recorded on ``stream`` (the backend's) after its copies. Each thread binds
    itself to ``placer``'s CPUs (the GPU's NUMA node) as it starts."""

    name = "threads"

    def __init__(self, pool: StagingPool, files: FileHandles, direct: bool, device_id: int, num_threads: int,
                 stream: Any, placer: Placer | None = None):
        import cupy

        self._cupy, self._pool, self._files, self._stream = cupy, pool, files, stream
        self._device = cupy.cuda.Device(device_id)
        self._direct_files = FileHandles(opener=_open_direct) if direct else None
        self.num_threads = num_threads
        self._local = threading.local()
        self._streams: list[Any] = []
        self._streams_lock = threading.Lock()
        placer = placer or inactive("no placement given")

        def start() -> None:
            placer.bind_thread("reader threads")
            cupy.cuda.runtime.setDevice(device_id)

        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-pinned", initializer=start)

    @property
    def pinned_bytes(self) -> int:
        return self._pool.total_bytes

    def stats(self) -> dict[str, Any]:
        return _pool_stats(self, self._pool, self._pool.num_slots, None)

    def handles(self) -> list[FileHandles]:
        return [self._direct_files] if self._direct_files is not None else []

    def streams(self) -> list[Any]:
        with self._streams_lock:
            return list(self._streams)

    def _thread_stream(self) -> Any:
        """This reader thread's own copy stream. One shared stream serialises every copy behind every
        other; per-thread streams let copies overlap, as KvikIO's own per-thread streams do."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._device:
                stream = self._cupy.cuda.Stream(non_blocking=True)
            self._local.stream = stream
            with self._streams_lock:
                self._streams.append(stream)
        return stream

    def _read_group(self, slot: int, group: SlotGroup) -> None:
        for at, p in group:
            aligned = p.offset % ALIGN == 0 and p.nbytes % ALIGN == 0
            files = self._direct_files if (self._direct_files is not None and aligned) else self._files
            pread_full(files.get(p.path), self._pool.view(slot, at + p.nbytes)[at:], p.offset, p.path)

    def _load(self, dest_ptr: int, group: SlotGroup, stop: threading.Event) -> Any:
        """Read a group of pieces into one slot, then queue their copies; returns an event of this load's own
        after them (the slot's is re-recorded by its next owner), or None if nothing was queued."""
        slot = self._pool.acquire(stop)
        if slot is None:
            return None
        copied = None
        try:
            self._read_group(slot, group)
            stream = self._thread_stream()
            self._pool.copy_out(slot, group, dest_ptr, stream)
            copied = record_event(stream)
        finally:
            self._pool.release(slot, copied is not None)
        return copied

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        def task(group: SlotGroup) -> Callable[[], Any]:
            return lambda: self._load(dest_ptr, group, stop)

        def done(copied: list[Any]) -> Any:
            # Exactly this window's copies: waiting on whole streams would also wait for the next
            # windows' copies queued behind them, and hold the consumer back. The fills are on this stream.
            with self._device:
                for event in copied:
                    if event is not None:
                        self._stream.wait_event(event)
                return record_event(self._stream)

        return TaskGroup(self._executor, [task(g) for g in _groups(reads, self._pool.slot_bytes)], stop, done)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._direct_files is not None:
            self._direct_files.close()


def _pool_stats(reader: StagingReader, pool: StagingPool, reading_slots: int, copy_share: int | None
                ) -> dict[str, Any]:
    return {"reader": reader.name, "num_threads": reader.num_threads, "slot_bytes": pool.slot_bytes,
            "slots": pool.num_slots, "pool_bytes": pool.total_bytes, "reading_slots": reading_slots,
            "peak_slots_in_use": pool.peak_in_use, "copy_share": copy_share, "spin_events": pool.spin_events}


class _Job(Pending):
    """One window's slot loads, carried out by the driver thread."""

    def __init__(self, dest_ptr: int, groups: list[SlotGroup], stop: threading.Event, fills: Any = None):
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


class KvikioReader(StagingReader):
    """One driver thread keeps the slots reading through KvikIO's C++ thread pool (``num_threads`` threads; one
    slot in ``copy_share`` kept for copies in flight, 0: none) and copies each slot to the device, in order, as
    its reads finish, on a non-blocking stream of its own. Loads of the next windows are issued while earlier
    ones finish, so the reads never drain at a window boundary. Opens its own KvikIO file handles. The
    driver thread binds itself to ``placer``'s CPUs; KvikIO's own threads are KvikIO's (see :meth:`__init__`)."""

    name = "kvikio"

    def __init__(self, pool: StagingPool, device_id: int, num_threads: int, copy_share: int,
                 placer: Placer | None = None):
        import cupy
        import kvikio

        self.placer = placer = placer or inactive("no placement given")
        # KvikIO's pool threads are started by KvikIO (at its first use, or when its settings change): a pool
        # (re)started in this call inherits the node's CPUs, one already running keeps its threads' masks,
        # and gdsload cannot reach them to tell which.
        with placer.around(None):
            KvikioPool.acquire(num_threads, TASK_BYTES)
        if placer.placement.active:
            placer.note("KvikIO's pool threads", "started by KvikIO: bound only if its pool (re)started here "
                        "(KvikioPool.acquire runs bound); a pool already running is not moved")
        self.pool_held = True
        self._cupy, self.pool, self.device_id, self.num_threads = cupy, pool, device_id, num_threads
        self.copy_share = copy_share
        self.files = FileHandles(opener=lambda path: kvikio.CuFile(path, "r"), closer=lambda f: f.close())
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.jobs: queue.Queue[Any] = queue.Queue()
        slots = pool.num_slots
        self.reading_slots = max(1, slots - (max(1, slots // copy_share) if copy_share else 0))
        self.fatal: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gdsload-pinned-driver", daemon=True)
        self.thread.start()

    @property
    def pinned_bytes(self) -> int:
        return self.pool.total_bytes

    def stats(self) -> dict[str, Any]:
        return _pool_stats(self, self.pool, self.reading_slots, self.copy_share)

    def handles(self) -> list[FileHandles]:
        return [self.files]

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        job = _Job(dest_ptr, _groups(reads, self.pool.slot_bytes), stop, fills)
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
        inflight: deque[tuple[_Job, int, SlotGroup, list[Any]]] = deque()
        taken: list[_Job] = []  # jobs taken off the queue and maybe not done
        try:
            self.placer.bind_thread("driver thread")
            self._cupy.cuda.runtime.setDevice(self.device_id)
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

    def _issue(self, job: _Job, slot: int, group: SlotGroup) -> list[Any] | None:
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

    def _finish(self, job: _Job, slot: int, group: SlotGroup, futures: list[Any]) -> None:
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
            self.pool.copy_out(slot, group, job.dest_ptr, self.stream)
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
