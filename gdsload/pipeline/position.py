"""Where iteration over one dataset stands: the cursor of the current pass (or, fixed, of the next one), the
batches that pass has yielded, whether the user numbers the epochs (``set_epoch``), and the epoch plans.
Pure: the dataset holds one and asks it; state and resume go through :mod:`gdsload.pipeline.resume`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import resume
from .cursor import Cursor
from .plan import EpochPlan, PlanConfig, epoch_plan


class Position:
    def __init__(self, config: PlanConfig, first_plan: EpochPlan, fingerprint: Callable[[], resume.Fingerprint]):
        """``fingerprint`` makes the dataset's fingerprint (on first use: it reads every block checksum)."""
        self.config, self._make_fingerprint = config, fingerprint
        self._fingerprint: resume.Fingerprint | None = None
        self.cursor, self.yielded = Cursor(), 0
        self.numbered = False  # set_epoch() was called: the user numbers the epochs
        self.passes = 0  # passes begun
        self._plan_cache = (0, first_plan)

    def set_epoch(self, epoch: int) -> None:
        """The next pass reads ``epoch`` (a resumed epoch keeps its position)."""
        self.numbered = True
        if not (self.cursor.fixed and self.cursor.epoch == epoch):
            self.cursor, self.yielded = Cursor(epoch, fixed=True), 0

    def fingerprint(self) -> resume.Fingerprint:
        self._fingerprint = self._fingerprint or self._make_fingerprint()
        return self._fingerprint

    def state(self) -> dict[str, Any]:
        c = self.cursor
        return resume.make_state(self.config, self.fingerprint(), c.epoch, c.batch + (0 if c.fixed else self.yielded),
                                 c.hops)

    def load(self, state: Any) -> None:
        """Continue from ``state`` (nothing changes when it is refused)."""
        self.cursor, self.yielded = resume.resume(state, self.config, self.fingerprint()), 0

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of ``epoch``: the current leg where it was read before under other settings."""
        c = self.cursor
        if c.epoch == epoch and c.plan is not None:
            return c.plan
        if self._plan_cache[0] != epoch:
            self._plan_cache = (epoch, epoch_plan(self.config, epoch))
        return self._plan_cache[1]

    def begin(self) -> Cursor:
        """Where a new pass starts; it becomes the current one."""
        start = self.cursor.next_pass(began=self.passes > 0, numbered=self.numbered)
        self.passes += 1
        self.cursor, self.yielded = start, 0
        return start

    def count(self, start: Cursor) -> None:
        """The pass from ``start`` yielded a batch (not counted once set_epoch / a loaded state moved on)."""
        if self.cursor is start:
            self.yielded += 1
