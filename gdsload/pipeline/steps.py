"""The steps of a schedule that several threads walk (a mixture's): each made once, in order, by whichever
thread asks first, and forgotten once every thread has passed it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple


class Step(NamedTuple):
    """One step of the schedule: each source's samples in the batch, and what the caller's ``make`` gave
    with them (the mixture's schedule after the step)."""

    counts: tuple[int, ...]
    after: Any


class Steps:
    """The schedule's steps from ``start`` on, each made once by ``make(step)``, in order, by whichever thread
    asks first; :meth:`forget` drops the steps every thread has passed."""

    def __init__(self, make: Callable[[int], Step], start: int):
        self._make, self._next = make, start
        self._made: dict[int, Step] = {}
        self._low = start  # every step below it is forgotten
        self._lock = threading.Lock()

    def get(self, step: int) -> Step:
        got = self._made.get(step)
        if got is not None:
            return got
        with self._lock:
            while self._next <= step:
                self._made[self._next] = self._make(self._next)
                self._next += 1
            return self._made[step]

    def forget(self, below: int) -> None:
        with self._lock:
            while self._low < min(below, self._next):
                del self._made[self._low]
                self._low += 1
