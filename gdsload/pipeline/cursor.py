"""Where reading stands: the one record of epoch and position that a dataset keeps and a pipeline is given."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import EpochPlan


@dataclass(frozen=True)
class Cursor:
    """Batch ``batch`` of ``epoch`` is the next one due.

    ``hops``: the legs the epoch was read in before, under other world_size / batch_size / window_blocks
    (see resume.py); ``plan``: this rank's plan of the current leg after such hops (None: the epoch's
    ordinary plan). ``fixed``: ``set_epoch`` or ``load_state_dict`` put the cursor here, so the next pass
    starts exactly here; otherwise a new pass starts a new epoch (see :meth:`next_pass`).
    """

    epoch: int = 0
    batch: int = 0
    hops: tuple[Any, ...] = ()
    plan: EpochPlan | None = dataclasses.field(default=None, compare=False)
    fixed: bool = False

    def next_pass(self, began: bool, numbered: bool) -> Cursor:
        """Where the next pass starts. ``began``: a pass was taken before; ``numbered``: the user numbers
        the epochs with ``set_epoch`` (then an unmarked new pass reads the same epoch again from its start;
        otherwise every new pass is the next epoch, as with a shuffling DataLoader)."""
        if self.fixed:
            return dataclasses.replace(self, fixed=False)
        if not began:
            return self
        return Cursor(self.epoch if numbered else self.epoch + 1)

    def reads_as(self, other: Cursor, shuffle: bool) -> bool:
        """Whether a pass from here yields the same batches as one from ``other``: the same position of an
        ordinary plan (of any epoch when there is no shuffle: every epoch has the same order)."""
        return (self.batch == other.batch and not self.hops and not other.hops
                and (self.epoch == other.epoch or not shuffle))
