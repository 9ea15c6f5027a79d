"""The cpu backend: threaded ``os.preadv`` straight into a numpy window buffer.

For CPU training and for every test on machines without a GPU: it runs the same plan, pipeline and error
paths as the GPU backends, only the buffer lives in host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .base import Backend, FileHandles, FillRequest, ReadRequest, Request, coalesce, fill_pattern, pread_full, split

DEFAULT_TASK_BYTES = 4 << 20
DEFAULT_THREADS = 8


def run_tasks(pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], None]], stop: threading.Event) -> None:
    """Run ``tasks`` on ``pool`` and wait for all of them; the first error is raised after the rest stop.

    Tasks still queued are skipped once ``stop`` is set or an error occurred, so a failure or a close does
    not wait for the whole window.
    """
    failed = threading.Event()

    def guarded(task: Callable[[], None]) -> None:
        if stop.is_set() or failed.is_set():
            return
        try:
            task()
        except BaseException:
            failed.set()
            raise

    futures: list[Future[None]] = [pool.submit(guarded, t) for t in tasks]
    error: BaseException | None = None
    for f in futures:
        e = f.exception()
        if e is not None and error is None:
            error = e
    if error is not None:
        raise error


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

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def fill(self, dest: np.ndarray, requests: Sequence[Request], stop: threading.Event) -> Any:
        view = memoryview(dest)
        reads = [r for r in requests if isinstance(r, ReadRequest)]
        for r in requests:
            if isinstance(r, FillRequest):
                fill_pattern(dest, r)
        pieces = [p for r in coalesce(reads, 1 << 62) for p in split(r, self.task_bytes)]

        def task(p: ReadRequest) -> Callable[[], None]:
            return lambda: pread_full(self._files.get(p.path), view[p.dest_offset:p.dest_offset + p.nbytes],
                                      p.offset, p.path)

        run_tasks(self._pool, [task(p) for p in pieces], stop)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._files.close()

