"""What the CUDA backends share: the device, a non-blocking stream of the backend's own, window buffers in
device memory, fill values written on that stream, and KvikIO's process-wide thread pool.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..cuda.runtime import record_event
from .base import Backend, FillRequest, Request, fill_pattern
from ..errors import warn


class CudaBackend(Backend):
    """A backend whose window buffers live in device memory. Its stream is non-blocking: work on it never
    waits for, nor holds up, the legacy default stream the training step may use."""

    def __init__(self, device_id: int):
        import cupy

        self.cupy = cupy
        self.device_id = device_id
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def streams(self) -> list[Any]:
        """Every stream the backend queues device work on."""
        return [self.stream]

    def quiesce(self) -> None:
        for s in self.streams():
            s.synchronize()

    def allocate(self, nbytes: int) -> Any:
        with self.device:
            return self.cupy.empty(nbytes, dtype=self.cupy.uint8)

    def write_fills(self, dest: Any, requests: Sequence[Request]) -> Any:
        """Write the fill requests among ``requests`` on the backend's stream; the event after them, or None
        when there are none."""
        fills = [r for r in requests if isinstance(r, FillRequest)]
        if not fills:
            return None
        with self.device, self.stream:
            for r in fills:
                fill_pattern(dest, r)
            return record_event(self.stream)


def _current(defaults: Any) -> tuple[Any, ...] | None:
    """KvikIO's pool settings now (threads, task size, bounce buffer size); None where it cannot say."""
    try:
        return tuple(defaults.get(k) for k in ("num_threads", "task_size", "bounce_buffer_size"))
    except (AttributeError, KeyError, ValueError):
        return None


class KvikioPool:
    """KvikIO's thread pool is one per process, and setting it restarts it. Backends that read through it
    ask for their settings here: the first one applies them; while it is in use, a request for other
    settings warns and gets the pool as it is.

    The bounce buffers (compat mode: each task's bytes go from the file into one, then to the device) are
    made the task's size: KvikIO's default (16 MiB) held four 4 MiB tasks' worth of pinned memory per
    thread of which a task used one, and a process's first reads allocated all of it."""

    _lock = threading.Lock()
    _users = 0
    _settings: tuple[int, int] | None = None

    @classmethod
    def acquire(cls, num_threads: int, task_bytes: int, exact: bool = False) -> None:
        """Hold the pool with these settings (each call owes a :meth:`release`). ``exact``: a pool in use with
        other settings raises RuntimeError instead of warning (a measurement must not report settings it did
        not read with)."""
        import kvikio.defaults

        wanted = (num_threads, task_bytes)
        with cls._lock:
            if cls._users:
                if cls._settings != wanted:
                    have = cls._settings or (0, 0)
                    said = (f"KvikIO's thread pool is shared by the process and in use with {have[0]} threads and "
                            f"{have[1]}-byte tasks; {num_threads} and {task_bytes} were asked for")
                    if exact:
                        raise RuntimeError(f"{said}: close the dataset holding it first")
                    warn(f"{said}, and this dataset gets the pool as it is", RuntimeWarning)
            else:
                # Compared with KvikIO's own settings, not the last ones set here: other code in the process
                # (the user's, a benchmark's raw reads) may have set the pool since.
                if _current(kvikio.defaults) != (num_threads, task_bytes, task_bytes):
                    kvikio.defaults.set({"num_threads": num_threads, "task_size": task_bytes,
                                         "bounce_buffer_size": task_bytes})
                cls._settings = wanted
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users = max(0, cls._users - 1)
