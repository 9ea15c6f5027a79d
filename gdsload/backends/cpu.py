"""The cpu backend: threaded ``os.preadv`` straight into a numpy window buffer.

For CPU training and for every test on machines without a GPU: it runs the same plan, pipeline and error
paths as the GPU backends, only the buffer lives in host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._tasks import Pending, TaskGroup
from .base import Backend, FileHandles, FillRequest, ReadRequest, Request, coalesce, fill_pattern, pread_full, split

DEFAULT_TASK_BYTES = 4 << 20
DEFAULT_THREADS = 8


class CpuBackend(Backend):
    name = "cpu"
    io_mode = "cpu"
    window_bytes_hint = 64 << 20

    def __init__(self, num_threads: int = DEFAULT_THREADS, task_bytes: int = DEFAULT_TASK_BYTES):
        if num_threads < 1 or task_bytes < 1:
            raise ValueError(f"num_threads and task_bytes must be positive (found {num_threads}, {task_bytes})")
        self.num_threads = num_threads
        self.task_bytes = task_bytes
        self._files = FileHandles()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-cpu")

    def stats(self) -> dict[str, Any]:
        return {"num_threads": self.num_threads, "task_bytes": self.task_bytes}

    def handles(self) -> list[FileHandles]:
        return [self._files]

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def submit(self, dest: np.ndarray, requests: Sequence[Request], stop: threading.Event) -> Pending:
        view = memoryview(dest)
        for r in requests:
            if isinstance(r, FillRequest):
                fill_pattern(dest, r)
        reads = [r for r in requests if isinstance(r, ReadRequest)]
        pieces = [p for r in coalesce(reads, 1 << 62) for p in split(r, self.task_bytes)]

        def task(p: ReadRequest) -> Callable[[], None]:
            return lambda: pread_full(self._files.get(p.path), view[p.dest_offset:p.dest_offset + p.nbytes],
                                      p.offset, p.path)

        return TaskGroup(self._pool, [task(p) for p in pieces], stop)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._files.close()
