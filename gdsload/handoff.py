"""The queues between gdsload's threads, and the one way every thread waits on them: polling, so that a
stop is noticed within ``POLL_S`` even when nobody wakes the waiter."""

from __future__ import annotations

import queue
import threading
from typing import Any

POLL_S = 0.05


def get(q: queue.Queue[Any] | queue.SimpleQueue[Any], stop: threading.Event) -> Any:
    """The next item of ``q`` (items queued before a stop are still taken), or None once ``stop`` is set
    and the queue is empty."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            if stop.is_set():
                return None


class Handoff:
    """Assembled batches, from the assembler thread to the consumer, at most ``capacity`` waiting.

    Unlike ``queue.Queue``, taking a batch wakes nobody: the consumer gives its room back with
    :meth:`release` once its own calls for the batch are made. The assembler, woken there, then does the
    next batch's Python work while the consumer's step runs, not between the consumer's wake-up from its
    previous step and its next launch, where it would hold the GIL the consumer needs. Items and room
    tokens go through C-level ``SimpleQueue``s: this is on the consumer's path for every batch.
    """

    def __init__(self, capacity: int):
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[bool] = queue.SimpleQueue()  # one token per free place
        for _ in range(capacity):
            self._room.put(True)

    def __len__(self) -> int:
        return self._items.qsize()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Queue ``item`` once there is room; False once ``stop`` is set first."""
        if get(self._room, stop) is None:
            return False
        self._items.put(item)
        return True

    def get(self, stop: threading.Event) -> Any:
        """The next item (items queued before a stop are still taken), or None once ``stop`` is set and
        none is left. The caller owes a :meth:`release`."""
        return get(self._items, stop)

    def release(self) -> None:
        """Room for one more item: wakes the producer if it waits."""
        self._room.put(True)

    def clear(self) -> None:
        """Drop what is queued and make room for the producer (stopping)."""
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                break
            self._room.put(True)
        self._room.put(True)
