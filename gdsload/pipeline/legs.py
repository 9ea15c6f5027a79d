"""The plans of a partly read epoch: what one leg leaves, and how the rest is dealt out to the next (pure numpy).

A :class:`Hop` records a leg that ended. Every sample a leg left lands in exactly one new rank's stream, read in
windows of at most ``window_blocks`` blocks; shares are padded (or cut, with ``drop_last``) so that every rank
yields as many batches, except under ``exact_shares`` (:func:`rest_shares`, :func:`leg_taken`, a hop's
``shift``), where nothing is padded or dropped. The procedure step by step: docs/multi-gpu.md, "How the rest of
an epoch is dealt out".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .plan import EpochPlan, PlanConfig, block_sizes, epoch_plan


@dataclass(frozen=True)
class Hop:
    """An earlier leg of the epoch: the settings it ran under and the batches every rank took in it.

    ``shift`` (exact shares only, from 0 to ``world_size - 1``): rank r of the leg consumed
    ``batches * batch_size - lag_r`` of its stream positions, ``lag_r`` being 1 for ``shift`` of the ranks
    (:func:`lags`): what a mixture records when its ranks, a sample apart, all took the same count since a
    start before this leg. A GDSDataset's ranks yield whole batches in step: its hops have ``shift`` 0."""

    world_size: int
    batch_size: int
    window_blocks: int
    batches: int
    shift: int = 0

    def as_dict(self, exact_shares: bool) -> dict[str, int]:
        """The hop as a state holds it: ``shift`` only under exact shares (other states keep their four keys)."""
        out = dataclasses.asdict(self)
        if not exact_shares:
            del out["shift"]
        return out


# -- exact shares: pure arithmetic, shared with the mixture's positions ------------------------------------
def rest_shares(num_samples: int, world_size: int, epoch: int, rest: int) -> list[int]:
    """Under exact shares, each rank's share of the last ``rest`` samples of ``epoch`` dealt out to
    ``world_size`` ranks (``rest == num_samples``: the epoch's own shares, :func:`gdsload.pipeline.plan.share_bounds`).
    They are the exact shares of one continuous stream ending where the epoch ends: rank r holds
    ``((e + 1) N + r) // W - ((e + 1) N - rest + r) // W``, so with the later epochs' shares a rank holds, over
    the rest and any run of epochs, as many samples as there are multiples of W in a run of as many integers:
    ranks taking the same counts stay at most one sample apart, and none is padded."""
    end = (epoch + 1) * num_samples
    return [(end + r) // world_size - (end - rest + r) // world_size for r in range(world_size)]


def lags(start: int, shift: int, world_size: int) -> list[int]:
    """Per rank, 1 where a leg's count began one sample later (0 otherwise): the ranks whose exact-share
    boundary falls between ``start - shift`` and ``start`` of the stream's virtual positions (``shift`` of them)."""
    return [(start + r) // world_size - (start - shift + r) // world_size for r in range(world_size)]


def leg_taken(num_samples: int, epoch: int, sizes: Sequence[int], hop: Hop) -> list[int]:
    """Under exact shares: the stream positions each rank of a leg of ``epoch`` consumed, its shares being
    ``sizes`` (they end where the epoch ends, so the leg begins ``sum(sizes)`` samples before that)."""
    start = (epoch + 1) * num_samples - sum(sizes)
    return [min(max(hop.batches * hop.batch_size - lag, 0), size)
            for lag, size in zip(lags(start, hop.shift, len(sizes)), sizes)]


def leg_batches(num_samples: int, epoch: int, sizes: Sequence[int], hop: Hop) -> int:
    """Under exact shares: the most batches a hop over a leg of shares ``sizes`` may record (past it, every
    rank's share is used up)."""
    start = (epoch + 1) * num_samples - sum(sizes)
    return max(-(-(size + lag) // hop.batch_size) for lag, size in zip(lags(start, hop.shift, len(sizes)), sizes))


def rest_after(num_samples: int, epoch: int, hops: Sequence[Hop]) -> int:
    """Under exact shares: the samples of ``epoch`` left after ``hops`` (the whole epoch without)."""
    rest = num_samples
    for hop in hops:
        rest -= sum(leg_taken(num_samples, epoch, rest_shares(num_samples, hop.world_size, epoch, rest), hop))
    return rest


# -- the plans of a leg -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPlan:
    plan: EpochPlan
    real: int  # stream positions before the padding (every one a different sample)


@dataclass(frozen=True)
class _Rest:
    """The unconsumed samples of a leg, in order: each one's id, the old window it was read in (numbered
    across ranks, non-decreasing) and its block's position in that window."""

    ids: np.ndarray
    window: np.ndarray
    position: np.ndarray


def leg_config(base: PlanConfig, world_size: int, batch_size: int, window_blocks: int, rank: int = 0) -> PlanConfig:
    return dataclasses.replace(base, world_size=world_size, batch_size=batch_size, window_blocks=window_blocks,
                               rank=rank)


def first_leg(base: PlanConfig, epoch: int, settings: tuple[int, int, int]) -> list[RankPlan]:
    """Every rank's ordinary plan of ``epoch`` under ``settings`` = (world_size, batch_size, window_blocks)."""
    legs = []
    for r in range(settings[0]):
        plan = epoch_plan(leg_config(base, *settings, r), epoch)
        blocks = np.concatenate(plan.windows) if plan.windows else np.zeros(0, np.int64)
        real = min(len(plan.positions), int(block_sizes(blocks, base.num_samples, base.samples_per_block).sum()))
        legs.append(RankPlan(plan, real))
    return legs


def most_batches(base: PlanConfig, epoch: int, legs: list[RankPlan], hop: Hop) -> int:
    """The most batches ``hop`` may record over ``legs`` (every rank's plan of that leg)."""
    if base.exact_shares:
        return leg_batches(base.num_samples, epoch, [leg.real for leg in legs], hop)
    return legs[0].plan.num_batches


def next_leg(base: PlanConfig, epoch: int, legs: list[RankPlan], hop: Hop,
             settings: tuple[int, int, int]) -> list[RankPlan]:
    """Every rank's plan of the leg after ``legs`` ended as ``hop``, under ``settings``."""
    if base.exact_shares:
        taken = leg_taken(base.num_samples, epoch, [leg.real for leg in legs], hop)
    else:
        taken = [min(hop.batches * hop.batch_size, leg.real) for leg in legs]
    return _deal(_remaining(legs, taken, base.samples_per_block), leg_config(base, *settings), epoch)


def _remaining(legs: list[RankPlan], taken: Sequence[int], k: int) -> _Rest:
    """What ``legs`` leave once rank r has consumed ``taken[r]`` stream positions: the rest of each rank's
    stream without its padding, rank after rank."""
    ids, window, position, first = [], [], [], 0
    for leg, consumed in zip(legs, taken):
        lo, hi = min(consumed, leg.real), leg.real
        plan = leg.plan
        ids.append(plan.sample_ids()[lo:hi])
        window.append(plan.window_of[lo:hi] + first)
        position.append(plan.positions[lo:hi] // k)
        first += len(plan.windows)
    return _Rest(*(np.concatenate(a) if a else np.zeros(0, np.int64) for a in (ids, window, position)))


def _deal(rest: _Rest, cfg: PlanConfig, epoch: int) -> list[RankPlan]:
    """Every rank's plan for ``rest`` under ``cfg`` (its rank ignored): consecutive shares, read in windows
    of at most ``cfg.window_blocks`` blocks. Exact shares: :func:`rest_shares`, nothing padded. Otherwise
    shares differing by at most one, padded (or cut, with drop_last) to equal length."""
    k, world, total = cfg.samples_per_block, cfg.world_size, len(rest.ids)
    ranks = np.arange(world + 1)
    if cfg.exact_shares:
        target = 0  # no padding
        bounds = np.array([0, *itertools.accumulate(rest_shares(cfg.num_samples, world, epoch, total))])
    elif cfg.drop_last:
        target = total // world // cfg.batch_size * cfg.batch_size
        bounds = ranks * target
    else:
        target = -(-total // world)
        bounds = ranks * (total // world) + np.minimum(ranks, total % world)
    out = []
    for r in range(world):
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        windows, window_of, positions = _windows(rest.ids[lo:hi], rest.window[lo:hi], rest.position[lo:hi], k,
                                                 cfg.window_blocks)
        if hi - lo < target:  # pad as a fresh plan does: repeat the start of the rank's last window
            if windows:
                last = positions[window_of == len(windows) - 1]
                extra = last[np.arange(target - (hi - lo)) % len(last)]
                window_of = np.concatenate([window_of, np.full(len(extra), len(windows) - 1, dtype=np.int64)])
                positions = np.concatenate([positions, extra])
            else:  # fewer samples left than ranks: repeat the remainder's last one
                s = int(rest.ids[-1])
                windows = (np.array([s // k], dtype=np.int64),)
                window_of, positions = np.zeros(target, np.int64), np.full(target, s % k, dtype=np.int64)
        out.append(RankPlan(EpochPlan(dataclasses.replace(cfg, rank=r), windows, window_of, positions,
                                        epoch), hi - lo))
    return out


def _windows(ids: np.ndarray, window: np.ndarray, position: np.ndarray, k: int,
             window_blocks: int) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """New windows reading ``ids`` (samples of old windows, in order). The blocks holding them are taken in
    order (old window by old window, each in its order) and packed into windows of at most ``window_blocks``:
    an old window's blocks go whole into the current new window if they fit, else start a new one, split
    every ``window_blocks`` blocks if there are more. Each new window takes its blocks' samples in their
    order, so the order changes only where an old window is split. Returns the windows' blocks and each
    stream position's window and position in it."""
    if not len(ids):
        return (), np.zeros(0, np.int64), np.zeros(0, np.int64)
    # The (old window, block position) pairs held, in order: a mark per pair, no sort of the samples.
    span = int(position.max()) + 1
    key = (window - window[0]) * span + position
    present = np.zeros(int(key[-1] // span + 1) * span, dtype=bool)
    present[key] = True
    held = np.flatnonzero(present)
    inverse = (np.cumsum(present) - 1)[key]
    blocks = np.empty(len(held), dtype=np.int64)
    blocks[inverse] = ids // k
    owner = held // span
    group_start = np.flatnonzero(np.diff(owner, prepend=-1))
    counts = np.diff(np.append(group_start, len(held)))
    # Packing is sequential: one step per old window, not per sample.
    w_max = min(window_blocks, len(held))  # an int64 however large the setting
    first_window, offset = np.empty(len(counts), np.int64), np.empty(len(counts), np.int64)
    current, fill = -1, w_max
    for g, c in enumerate(counts.tolist()):
        if c <= w_max - fill:  # fits beside the old windows already in the current one
            first_window[g], offset[g] = current, fill
            fill += c
        else:
            first_window[g], offset[g] = current + 1, 0
            n = -(-c // w_max)
            current, fill = current + n, c - (n - 1) * w_max
    group = np.repeat(np.arange(len(counts)), counts)
    at = offset[group] + np.arange(len(held)) - group_start[group]
    new_window = first_window[group] + at // w_max
    window_of = new_window[inverse]
    positions = (at % w_max)[inverse] * k + ids % k
    if (np.diff(window_of) < 0).any():  # an old window was split: window by window, each in the old order
        order = np.argsort(window_of, kind="stable")
        window_of, positions = window_of[order], positions[order]
    return tuple(np.split(blocks, np.flatnonzero(np.diff(new_window)) + 1)), window_of, positions
