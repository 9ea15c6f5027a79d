"""A mixture's batches made ahead of the consumer, on a thread of their own.

The consumer's loop then takes a finished batch between two training steps instead of cutting and joining
one there. :class:`Ahead` runs the mixture's ``_make`` (weakly held: an abandoned mixture is collected, and its
finalizer stops the thread) until ``depth`` batches wait, handed over through the pipeline's
:class:`gdsload.backends.handoff.Handoff` (the consumer's take wakes nobody). Each is a :class:`Made` carrying
where the mixture stands after it (step, schedule, every source's stretch), so the consumer's state is always
that of the batches it was given. An error raised there is raised again, the same object, in the consumer's
``next()``; once the thread is stopped (``stop()``, from the consumer's side or ``close()`` from any thread)
nothing more is handed out, and the mixture moves its sources back to the consumer's position.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backends.handoff import Handoff
from ..errors import GDSLoadError
from .schedule import Schedule, Stretch


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
    order. ``make`` is a bound method, held weakly; its object's collection stops the thread."""

    def __init__(self, make: Callable[[], Made], depth: int, name: str, what: str):
        """``what`` names the owner in errors (``"mixture of [...]"``)."""
        self._what = what
        self._make = weakref.WeakMethod(make)  # type: ignore[arg-type]
        self._handoff = Handoff(depth)
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(make.__self__, self._stop.set)  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            make = self._make()
            if make is None:  # the owner was collected
                return
            try:
                item: Made | BaseException = make()
            except BaseException as e:  # noqa: BLE001 - raised again in the consumer's next()
                item = e
            del make
            if not self._handoff.put(item, self._stop) or isinstance(item, BaseException):
                return

    def next(self) -> Made:
        """The next batch made; the error the thread met instead, raised here. Once :meth:`stop` was called
        (from another thread: ``close()``) none is handed out: what it drops would leave a gap."""
        item = self._handoff.get(self._stop)
        if item is None or self._stop.is_set():
            raise GDSLoadError(f"{self._what}: its batch maker was stopped (stop() or close() from another "
                               "thread)")
        self._handoff.release()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self, join: bool = True) -> None:
        """Stop the thread (after the batch it is making); ``join``: wait for it and drop what it made."""
        self._stop.set()
        self._finalizer.detach()
        if join:
            self._handoff.clear()  # room given back: a thread waiting for it wakes now, not at its next poll
            self._thread.join()
            self._handoff.clear()  # and what it queued meanwhile is dropped
