"""One native stager per process and settings, shared by its users, and the jobs each user has in flight.

Every pinned backend of a process (a mixture's sources among them) and the mmap backend's first pass read
through the same stager: one thread pool for every dataset. A user closes by cancelling and waiting for its own
jobs (no copy of theirs lands after that); the stager itself closes with its last user.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from ...errors import ReadError
from ..._tasks import POLL_S
from .stager import JobCancelled, Stager

_SHARED: dict[tuple[Any, ...], list[Any]] = {}  # (process, settings) -> [stager, users]
_SHARED_LOCK = threading.Lock()


def shared_stager(device_id: int, num_threads: int, buf_bytes: int, bufs_per_thread: int, mode: str = "cuda") -> Stager:
    """The stager of this process for these settings, made by the first user that asks; each asker gives it back
    with :func:`release_stager`. BackendUnavailable where the native library cannot load."""
    key = (os.getpid(), mode, device_id, num_threads, buf_bytes, bufs_per_thread)  # a forked child makes its own
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0].closed:
            entry = _SHARED[key] = [Stager(mode, device_id, num_threads, buf_bytes, bufs_per_thread), 0]
        entry[1] += 1
        return entry[0]


def release_stager(stager: Stager) -> None:
    """One user of a stager is done with it; the last closes it (every copy it issued complete)."""
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


class Jobs:
    """One user's jobs on ``stager``: submitted, finished (waited for to their end) and, on :meth:`close`,
    cancelled and waited for, then the stager given back."""

    def __init__(self, stager: Stager):
        self.stager = stager
        self._open: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, pieces: Any) -> int:
        """Queue ``(fd, offset, nbytes, dest_address)`` pieces (Stager.submit); the job's id."""
        job = self.stager.submit(pieces)
        with self._lock:
            self._open.add(job)
        return job

    def finish(self, job: int, stop: threading.Event, paths: Sequence[str] | None = None) -> None:
        """Wait until ``job``'s data is at its destinations; once ``stop`` is set, its pieces not started are
        dropped and the wait ends when none is in flight. A failed read raises ReadError naming its file."""
        cancelled = False
        try:
            while True:
                if stop.is_set() and not cancelled:
                    self.stager.cancel(job)
                    cancelled = True
                if self.stager.wait(job, POLL_S, paths):
                    return
        except JobCancelled:
            if not stop.is_set():
                raise
        finally:
            with self._lock:
                self._open.discard(job)

    def close(self) -> None:
        """Cancel the jobs not finished and wait until none is in flight, then give the stager back."""
        with self._lock:
            jobs, self._open = sorted(self._open), set()
        for job in jobs:
            self.stager.cancel(job)
        for job in jobs:
            try:
                self.stager.wait(job)
            except (JobCancelled, ReadError):  # cancelled, failed, or the stager closed: nothing in flight
                pass
        release_stager(self.stager)
