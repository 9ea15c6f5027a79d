"""The native stager (:mod:`gdsload.backends.native.stager`) as the pinned backend's reader: a window's reads
through it (:class:`NativeReader`); its default size for this rank is in :mod:`gdsload.backends.sizing`."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from ...cuda.runtime import record_event
from ...errors import ReadError
from ..handoff import POLL_S
from ..._tasks import Pending
from ..base import FileHandles, ReadRequest
from .staging_pool import StagingReader


class NativeReader(StagingReader):
    """The pinned backend's native reader: ``stager``'s C threads read each piece into buffers of their own and
    copy it to the device; a piece's data is there when its job finishes. Reads go to the descriptors of
    ``files``; ``device`` and ``stream`` (the backend's) are where the event of a window without fills is
    recorded. Closing it closes the stager, whose every copy is then complete."""

    name = "native"

    def __init__(self, stager: Any, files: FileHandles, device: Any, stream: Any):
        self._stager, self._files, self._device, self._stream = stager, files, device, stream
        self.num_threads: int = stager.num_threads
        self._jobs: set[int] = set()  # submitted and not yet finished: what close() cancels and waits for
        self._jobs_lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        return int(self._stager.pinned_bytes)

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        job = self._stager.submit([(self._files.get(r.path), r.offset, r.nbytes, dest_ptr + r.dest_offset)
                                   for r in reads])
        with self._jobs_lock:
            self._jobs.add(job)
        return _NativeJob(self, job, [r.path for r in reads], stop, fills)

    def finished(self, job: int) -> None:
        """``job`` was waited for to its end (done, failed or cancelled)."""
        with self._jobs_lock:
            self._jobs.discard(job)

    def stats(self) -> dict[str, Any]:
        st = self._stager
        slots = st.num_threads * st.bufs_per_thread
        # Every buffer is held (and used in turn) for the stager's life; each thread reads one at a time.
        return {"reader": self.name, "num_threads": st.num_threads, "slot_bytes": st.buffer_bytes // slots,
                "slots": slots, "pool_bytes": st.pinned_bytes, "reading_slots": st.num_threads,
                "peak_slots_in_use": slots, "copy_share": None, "spin_events": not st.blocking_sync}

    def close(self) -> None:
        """Cancel this reader's jobs and wait until none is in flight (no copy of theirs writes after this), then
        give the stager back (closed by its last user)."""
        from ..native.stager import JobCancelled

        with self._jobs_lock:
            jobs, self._jobs = sorted(self._jobs), set()
        for job in jobs:
            self._stager.cancel(job)
        for job in jobs:
            try:
                self._stager.wait(job)
            except (JobCancelled, ReadError):  # cancelled, failed, or the stager closed: nothing of it in flight
                pass
        release_stager(self._stager)


def shared_stager(device_id: int, num_threads: int, buf_bytes: int, bufs_per_thread: int, mode: str = "cuda") -> Any:
    """The native stager of this process for these settings, made by the first pinned backend that asks and shared
    by the others (one thread pool for every dataset a process reads, a mixture's sources among them); each asker
    gives it back with :func:`release_stager`."""
    from ..native.stager import Stager

    key = (os.getpid(), mode, device_id, num_threads, buf_bytes, bufs_per_thread)  # a forked child makes its own
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0].closed:
            entry = _SHARED[key] = [Stager(mode, device_id, num_threads, buf_bytes, bufs_per_thread), 0]
        entry[1] += 1
        return entry[0]


def release_stager(stager: Any) -> None:
    """One user of a :func:`shared_stager` is done with it; the last closes it (every copy it issued complete)."""
    last = True
    with _SHARED_LOCK:
        for key, entry in list(_SHARED.items()):
            if entry[0] is stager:
                entry[1] -= 1
                last = entry[1] <= 0
                if last:
                    del _SHARED[key]
    if last:
        stager.close()


_SHARED: dict[tuple[Any, ...], list[Any]] = {}  # (process, settings) -> [stager, users]
_SHARED_LOCK = threading.Lock()


class _NativeJob(Pending):
    """One window's reads, carried out by the native stager; the data is on the device when they finish
    (its threads wait for their own copies)."""

    def __init__(self, reader: NativeReader, job: int, paths: list[str], stop: threading.Event, fills: Any):
        self.reader, self.stager, self.job, self.paths, self.stop = reader, reader._stager, job, paths, stop
        self.fills, self.device, self.stream = fills, reader._device, reader._stream

    def finish(self) -> Any:
        from ..native.stager import JobCancelled

        cancelled = False
        try:
            while True:
                if self.stop.is_set() and not cancelled:
                    self.stager.cancel(self.job)  # pieces not started are dropped; the wait ends once none is in flight
                    cancelled = True
                if self.stager.wait(self.job, POLL_S, self.paths):
                    break
        except JobCancelled:
            if not self.stop.is_set():
                raise
        finally:
            self.reader.finished(self.job)
        # The reads' copies are complete; the fills, if any, are queued on the backend's stream.
        with self.device:
            return self.fills if self.fills is not None else record_event(self.stream)
