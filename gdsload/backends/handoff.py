"""The queues between gdsload's threads, and the one way every thread waits on them: polling, so that a
stop is noticed within ``POLL_S`` even when nobody wakes the waiter."""

from __future__ import annotations

import queue
import threading
from typing import Any

from .._tasks import POLL_S  # noqa: F401 - the waits here and of the threads that import it


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
    """Assembled batches, from the assembler thread to the consumer: ``ahead`` of them kept ready.

    Unlike ``queue.Queue``, taking a batch wakes nobody: the consumer gives its room back with
    :meth:`release` once its own calls for the batch are made, and only every ``GROUP``-th release wakes the
    producer, giving back that many places at once. Waking a thread is a system call on the consumer's path
    between two training steps, so it is made once per ``GROUP`` batches; the producer, once woken, does that
    many batches' Python work while the consumer's step runs, not between the consumer's wake-up from its
    previous step and its next launch, where it would hold the GIL the consumer needs. To keep as many
    batches ready as a per-batch hand-back would, it holds up to ``ahead + GROUP - 1``: after any take at
    least ``ahead - 1`` are ready. Items and room go through C-level ``SimpleQueue``s.
    """

    GROUP = 2

    def __init__(self, ahead: int):
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1 (found {ahead})")
        self.capacity = ahead + self.GROUP - 1
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room: queue.SimpleQueue[int] = queue.SimpleQueue()  # counts of places given back
        self._room.put(self.capacity)
        self._free = 0  # places the producer holds (its thread only)
        self._owed = 0  # places taken by the consumer, not given back yet (its thread only)
        #: The next item if one is queued, else ``queue.Empty`` (no wait, no timeout: the consumer's fast path).
        #: The caller owes a :meth:`release`.
        self.take_ready = self._items.get_nowait

    def __len__(self) -> int:
        return self._items.qsize()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Queue ``item`` once there is room; False once ``stop`` is set first. A producer stopped already
        gives up at once: the room :meth:`clear` gives back as a pipeline closes must not send it on to
        another batch and a wait of a whole poll on a queue nobody fills any more."""
        if stop.is_set():
            return False
        if self._free == 0:
            n = get(self._room, stop)
            if n is None:
                return False
            self._free = n
        self._free -= 1
        self._items.put(item)
        return True

    def get(self, stop: threading.Event) -> Any:
        """The next item (items queued before a stop are still taken), or None once ``stop`` is set and
        none is left. The caller owes a :meth:`release`."""
        return get(self._items, stop)

    def release(self) -> None:
        """The consumer is done with its calls for a batch: every ``GROUP``-th call gives that many places
        back, waking the producer if it waits."""
        self._owed += 1
        if self._owed >= self.GROUP:
            self._room.put(self._owed)
            self._owed = 0

    def clear(self) -> None:
        """Drop what is queued and make room for the producer (stopping)."""
        self._drop_items()
        self._room.put(self.capacity)

    def _drop_items(self) -> None:
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                return
