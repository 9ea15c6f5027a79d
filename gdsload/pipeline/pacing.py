"""Pacing the pipeline threads' longer Python work, so the training loop gets the GIL when its step ends.

A :class:`Pacer` cuts such work into pieces of at most ``piece_s``, with a nap between them long enough for a
waiting thread to wake and take the GIL (docs/design.md, "Pacing", says why a nap). Nothing here touches data.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Python work on a pipeline thread between two naps, at most (seconds).
PIECE_S = 100e-6
#: A nap: asked of the OS, which rounds it up to its timer slack; long enough for a waiting thread to wake
#: and take the GIL (docs/design.md, "Pacing").
NAP_S = 20e-6


class Pacer:
    """Call it between the steps of a long piece of work on one thread: it naps once ``piece_s`` has
    passed since the last nap (or :meth:`start`), and otherwise only reads the clock. One per thread."""

    def __init__(self, piece_s: float = PIECE_S, nap_s: float = NAP_S,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.piece_s, self.nap_s = piece_s, nap_s
        self._clock, self._sleep = clock, sleep
        self.naps = 0
        self._since = clock()

    def start(self) -> None:
        """A stretch of work begins (the thread was blocked until now, the GIL given up there)."""
        self._since = self._clock()

    def __call__(self) -> None:
        if self._clock() - self._since >= self.piece_s:
            self._sleep(self.nap_s)
            self.naps += 1
            self._since = self._clock()
