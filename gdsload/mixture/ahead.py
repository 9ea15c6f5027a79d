"""A mixture's batches made ahead of the consumer, on a thread of their own.

The consumer's loop then takes a finished batch between two training steps instead of cutting and joining
one there. :class:`Ahead` runs the mixture's ``_make`` (weakly held: an abandoned mixture is collected, and
the thread ends at its next look) until ``depth`` batches wait, each a :class:`Made` carrying where the mixture
stands after it (step, schedule, every source's stretch), so the consumer's state is always that of the batches
it was given. An error raised there is raised again, the same object, in the consumer's ``next()``; once the
thread has stopped (``stop()``, from the consumer's side) what it made is dropped, and the mixture moves its
sources back to the consumer's position.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import GDSLoadError
from .schedule import Schedule, Stretch

POLL_S = 0.01  # how often a blocked put or get looks at the stop flag and the thread


@dataclass(frozen=True)
class Made:
    """One batch and where the mixture stands after it: ``step`` is the batch's own index; ``samples`` and
    ``bytes`` are each source's share of it; ``ready``: the event after which a batch of device arrays made
    ahead is written (None: written when made)."""

    batch: dict[str, Any]
    step: int
    schedule: Schedule
    stretches: tuple[Stretch, ...]
    samples: tuple[int, ...]
    bytes: tuple[int, ...]
    ready: Any = None


class Ahead:
    """``make()`` called on a thread named ``name`` until ``depth`` results wait; :meth:`next` takes them in
    order. ``make`` is a bound method, held weakly."""

    def __init__(self, make: Callable[[], Made], depth: int, name: str):
        self._make = weakref.WeakMethod(make)  # type: ignore[arg-type]
        self._queue: queue.Queue[Made | BaseException] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            make = self._make()
            if make is None:  # the mixture was collected
                return
            try:
                item: Made | BaseException = make()
            except BaseException as e:  # noqa: BLE001 - raised again in the consumer's next()
                item = e
            del make
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=POLL_S)
                    break
                except queue.Full:
                    if self._make() is None:
                        return
            if isinstance(item, BaseException):
                return

    def next(self) -> Made:
        """The next batch made; the error the thread met instead, raised here. Once :meth:`stop` was called
        (from another thread: ``close()``) none is handed out: what it drops would leave a gap."""
        while True:
            item: Made | BaseException | None = None
            try:
                if not self._stop.is_set():
                    item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._thread.is_alive() or not self._queue.empty():
                    continue
            if item is None or self._stop.is_set():
                raise GDSLoadError("the mixture's batch maker was stopped (the mixture was stopped or closed "
                                   "from another thread)")
            if isinstance(item, BaseException):
                raise item
            return item

    def stop(self, join: bool = True) -> None:
        """Stop the thread (after the batch it is making) and drop what it made; ``join``: wait for it."""
        self._stop.set()
        while join and self._thread.is_alive():
            self._drain()
            self._thread.join(POLL_S)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
