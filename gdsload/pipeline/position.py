"""Where iteration over one dataset stands, the one owner of it: the :class:`Cursor` of a pass, the
:class:`Position` a dataset keeps, and where a rank stands once placed (:func:`place`) or resumed from a state
(:func:`resume`). Pure: what a state holds and how it is checked is :mod:`gdsload.pipeline.resume`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import warn
from .legs import Hop, next_leg
from .plan import EpochPlan, PlanConfig, epoch_plan
from .resume import (CONTENT_FREE_FORMAT, EXACT_HOP_KEYS, HOP_KEYS, MAX_HOPS, Fingerprint, SavedState, StateError,
                     batch_size_change, check_matches, legs_after, make_state, parse_hops, parse_state, resumed_plan,
                     state_int)


@dataclass(frozen=True)
class Cursor:
    """Batch ``batch`` of ``epoch`` is the next one due, ``skip`` of its samples already taken (only a mixture's
    feed starts inside a batch: a dataset's own pass yields whole batches).

    ``hops``: the legs the epoch was read in before, under other world_size / batch_size / window_blocks
    (see resume.py); ``plan``: this rank's plan of the current leg after such hops (None: the epoch's
    ordinary plan). ``fixed``: ``set_epoch``, ``place`` or ``load_state_dict`` put the cursor here, so the next
    pass starts exactly here; otherwise a new pass starts a new epoch (see :meth:`next_pass`).
    """

    epoch: int = 0
    batch: int = 0
    hops: tuple[Any, ...] = ()
    plan: EpochPlan | None = dataclasses.field(default=None, compare=False)
    fixed: bool = False
    skip: int = 0

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
        return (self.batch == other.batch and not self.hops and not other.hops and not self.skip
                and not other.skip and (self.epoch == other.epoch or not shuffle))


class Position:
    def __init__(self, config: PlanConfig, first_plan: EpochPlan, fingerprint: Callable[[], Fingerprint]):
        """``fingerprint`` makes the dataset's fingerprint (on first use: it reads every block checksum)."""
        self.config, self._make_fingerprint = config, fingerprint
        self._fingerprint: Fingerprint | None = None
        self.cursor, self.yielded = Cursor(), 0
        self.numbered = False  # set_epoch() was called: the user numbers the epochs
        self.passes = 0  # passes begun
        self._plan_cache = (0, first_plan)

    def set_epoch(self, epoch: int) -> None:
        """The next pass reads ``epoch`` (a resumed epoch keeps its position)."""
        self.numbered = True
        if not (self.cursor.fixed and self.cursor.epoch == epoch):
            self.cursor, self.yielded = Cursor(epoch, fixed=True), 0

    def fingerprint(self) -> Fingerprint:
        self._fingerprint = self._fingerprint or self._make_fingerprint()
        return self._fingerprint

    def state(self) -> dict[str, Any]:
        """The state of where this stands; StateError where it was placed inside a batch (a state counts
        whole batches)."""
        c = self.cursor
        if c.fixed and c.skip:
            raise StateError(f"placed {c.skip} samples into batch {c.batch} of epoch {c.epoch}: a state counts "
                             "whole batches (place at a multiple of batch_size, or read on first)")
        return make_state(self.config, self.fingerprint(), c.epoch, c.batch + (0 if c.fixed else self.yielded),
                          c.hops)

    def load(self, state: Any) -> None:
        """Continue from ``state`` (nothing changes when it is refused)."""
        self.cursor, self.yielded = resume(state, self.config, self.fingerprint()), 0

    def place(self, epoch: Any, legs: Sequence[Mapping[str, Any]], samples: Any) -> None:
        """Stand at ``samples`` of this rank's share of the leg of ``epoch`` after ``legs`` (hop dicts as a state
        holds them), read under this dataset's settings (nothing changes when it is refused: StateError)."""
        epoch, samples = state_int(epoch, "epoch", 0), state_int(samples, "samples", 0)
        hops = parse_hops(legs, EXACT_HOP_KEYS if self.config.exact_shares else HOP_KEYS, self.config.num_blocks)
        cursor = place(self.config, epoch, hops, samples, None if hops else self._ordinary(epoch))
        self.cursor, self.yielded = cursor, 0

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of ``epoch``: the current leg where it was read before under other settings."""
        c = self.cursor
        if c.epoch == epoch and c.plan is not None:
            return c.plan
        return self._ordinary(epoch)

    def _ordinary(self, epoch: int) -> EpochPlan:
        """The ordinary plan of ``epoch`` (the last one made is kept)."""
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


def place(config: PlanConfig, epoch: int, hops: tuple[Hop, ...], samples: int, plan: EpochPlan | None = None) -> Cursor:
    """``config``'s rank at ``samples`` of its share of the leg of ``epoch`` that follows ``hops``, read under
    ``config``'s own world_size, batch_size and window_blocks, as a fixed cursor (``plan``: the epoch's ordinary
    plan, where known; without hops only). StateError for hops the epoch cannot have been read in, or samples
    beyond the rank's share of that leg."""
    if hops:
        plan = resumed_plan(config, epoch, hops)
    elif plan is None:
        plan = epoch_plan(config, epoch)
    share = len(plan.positions)
    if samples > share:
        raise StateError(f"state key 'samples': expected an int from 0 to {share}, rank {config.rank}'s samples of "
                         f"epoch {epoch}'s current leg, found {samples}")
    batch, skip = divmod(samples, config.batch_size)
    return Cursor(epoch, batch, hops, plan if hops else None, fixed=True, skip=skip)


def resume(state: Any, config: PlanConfig, fp: Fingerprint) -> Cursor:
    """Where ``config``'s rank continues from ``state``: the epoch, its earlier legs and the batch to start
    at, as a fixed cursor (the next pass starts exactly there).

    Under the state's own world_size, batch_size and window_blocks this continues the current leg (the plain
    resume: the same plan, from the next batch). Under others, the leg is closed as a hop and the next one
    starts at batch 0 of its own plan, made from what the state's ranks left; a leg in which nothing was
    yielded is simply replaced, so a state taken at an epoch's start resumes as that epoch, fresh. Under
    another batch_size it warns saying what changes (:func:`~gdsload.pipeline.resume.batch_size_change`).
    """
    saved = parse_state(state, config.num_blocks)
    check_matches(saved, config, fp)
    cursor = _cursor(saved, config)
    if saved.content_sha256 is None:
        warn(f"resume state of state_format {CONTENT_FREE_FORMAT} (saved before gdsload fingerprinted a "
             "dataset's content): its dataset's shapes and shard layout match, its content cannot be "
             "checked; resuming. States saved from now on carry 'content_sha256'", UserWarning)
    if saved.batch_size != config.batch_size:
        warn(batch_size_change(saved, config), UserWarning)
    return cursor


def _cursor(saved: SavedState, config: PlanConfig) -> Cursor:
    legs = legs_after(config, saved.epoch, saved.hops, saved.leg)
    batches = max(leg.plan.num_batches for leg in legs)  # ranks' exact shares may differ by a batch
    if saved.batches_yielded > batches:
        raise StateError(f"state key 'batches_yielded': expected an int from 0 to {batches}, the batches of epoch "
                         f"{saved.epoch}'s current leg (world_size, batch_size, window_blocks = {saved.leg}), found "
                         f"{saved.batches_yielded}")
    now = (config.world_size, config.batch_size, config.window_blocks)
    if now == saved.leg:
        plan = legs[config.rank].plan if saved.hops else None
        return Cursor(saved.epoch, saved.batches_yielded, saved.hops, plan, fixed=True)
    if saved.batches_yielded == 0:  # nothing read in that leg: the new one replaces it
        plan = resumed_plan(config, saved.epoch, saved.hops) if saved.hops else None
        return Cursor(saved.epoch, 0, saved.hops, plan, fixed=True)
    if len(saved.hops) == MAX_HOPS:
        raise StateError(f"state key 'hops': epoch {saved.epoch} was already read in {MAX_HOPS + 1} legs, the most "
                         "a state records; finish it under the settings it was saved with "
                         f"(world_size, batch_size, window_blocks = {saved.leg})")
    hop = Hop(*saved.leg, saved.batches_yielded)
    plans = next_leg(config, saved.epoch, legs, hop, now)
    return Cursor(saved.epoch, 0, (*saved.hops, hop), plans[config.rank].plan, fixed=True)
