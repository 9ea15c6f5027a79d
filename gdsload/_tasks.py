"""Work in flight on other threads: the :class:`Pending` contract every read and decode step keeps, and
tasks on a shared pool that stop early on a stop or a first error."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self

#: How often a thread that waits (on a queue, an event, a condition) looks again at its stop event and the clock.
POLL_S = 0.05


def close_each(closers: Iterable[Callable[[], Any]]) -> None:
    """Call every closer, even after one raised; then raise the first error. What frees one resource must not
    leave the next one open (threads running, files held)."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - kept, raised once every closer ran
            if first is None:
                first = e
    if first is not None:
        raise first


class Pending(ABC):
    """Reads submitted for one window."""

    @abstractmethod
    def finish(self) -> Any:
        """Block until the host's part of every read is done (raising the first error once all have
        stopped), and return the event after which the data is in the buffer on the device, or None when
        it is there already."""


class Queued(Pending):
    """Work whose host part is over (copies queued on the device, or reads done before): ``finish`` returns
    the event after which the data is there (None: it is there already)."""

    def __init__(self, event: Any):
        self.event = event

    def finish(self) -> Any:
        return self.event


def drain(pending: Pending) -> None:
    """Wait for reads whose window is abandoned, whatever they end in (an error is already on its way):
    none may still write into a buffer that changes hands."""
    try:
        pending.finish()
    except BaseException:
        pass


class TaskGroup(Pending):
    """Tasks run on a shared thread pool. Queued tasks are skipped once ``stop`` is set or one of them
    failed, so a close or an error does not wait for the whole window."""

    def __init__(self, pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], Any]], stop: threading.Event,
                 done: Callable[[list[Any]], Any] | None = None):
        self._failed = threading.Event()
        self._stop = stop
        self._done = done
        self._futures: list[Future[Any]] = [pool.submit(self._guarded, t) for t in tasks]

    def _guarded(self, task: Callable[[], Any]) -> Any:
        if self._stop.is_set() or self._failed.is_set():
            return None
        try:
            return task()
        except BaseException:
            self._failed.set()
            raise

    def finish(self) -> Any:
        """Wait for every task; ``done`` gets the results of those that succeeded (its value is returned)."""
        error: BaseException | None = None
        results = []
        for f in self._futures:
            e = f.exception()
            if e is None:
                results.append(f.result())
            elif error is None:
                error = e
        result = self._done(results) if self._done is not None else None
        if error is not None:
            raise error
        return result


class Reaper:
    """Runs the clean-ups of objects the garbage collector found unreachable on a thread of its own.

    The collector runs a finalizer wherever it happens to run, even inside a new thread's start-up, which
    holds CPython's lock of thread bookkeeping; a clean-up that joins threads there waits for that lock and
    hangs the process. So a finalizer hands its clean-up here and returns. :meth:`start` is called where
    threads may start (a dataset's open); while the interpreter exits (the main thread has ended), or
    before any start, a clean-up runs at once instead."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # a forked child starts its own
                self._thread = threading.Thread(target=self._run, name="gdsload-reaper", daemon=True)
                self._thread.start()

    def __call__(self, cleanup: Callable[..., Any], *args: Any) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive() or not threading.main_thread().is_alive():
            cleanup(*args)
        else:
            self._queue.put((cleanup, args))

    def _run(self) -> None:
        while True:
            cleanup, args = self._queue.get()
            try:
                cleanup(*args)
            except BaseException:  # nobody to tell: the object is gone; the next one's clean-up still runs
                pass


#: The process's one reaper.
REAPER = Reaper()


class Closing:
    """``with obj: ...`` closes it on the way out, error or not: for whatever holds threads, buffers or files
    and frees them in an idempotent ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
