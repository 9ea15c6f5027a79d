"""Values made once per key by whichever thread asks first (a pipeline's passes): only askers for the same key
wait while it is made, and a value made is read without a lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class MadeOnce(Generic[V]):
    """Values by key, each made once (:meth:`get`), kept until dropped (:meth:`drop`, or ``keep`` in :meth:`get`)."""

    def __init__(self) -> None:
        self._made: dict[int, V] = {}  # replaced whole, never changed: askers read it without the lock
        self._lock = threading.Lock()
        self._making: dict[int, threading.Lock] = {}  # a lock per key being made

    def get(self, k: int, make: Callable[[], V], keep: Callable[[int], bool] | None = None) -> V:
        """The value of ``k``, made by ``make()`` here if no thread has made it yet. A value made here replaces
        the values of the keys ``keep`` does not keep (None: it keeps all)."""
        v = self._made.get(k)
        if v is not None:
            return v
        with self._lock:
            making = self._making.setdefault(k, threading.Lock())
        with making:
            v = self._made.get(k)
            if v is not None:  # made by another thread while this one waited
                return v
            v = make()
            with self._lock:
                made = self._made if keep is None else {j: q for j, q in self._made.items() if keep(j)}
                self._made = {**made, k: v}
                self._making.pop(k, None)
            return v

    def drop(self, below: int) -> list[V]:
        """Forget the values of the keys below ``below``; returns them."""
        with self._lock:
            gone = [v for j, v in self._made.items() if j < below]
            self._made = {j: v for j, v in self._made.items() if j >= below}
        return gone
