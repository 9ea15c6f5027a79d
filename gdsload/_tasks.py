"""Work in flight on other threads: the :class:`Pending` contract every read and decode step keeps, and
tasks on a shared pool that stop early on a stop or a first error."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


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
