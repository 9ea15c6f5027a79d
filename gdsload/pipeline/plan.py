"""The read plan of one epoch on one rank: pure numpy, no I/O.

Blocks are permuted per epoch (seeded), split across ranks and grouped into windows of ``window_blocks``
blocks; samples are permuted inside each window and cut into batches. The plan is a function of the config and
the epoch, so a resume recomputes it. Ranks take shares of whole blocks, every rank yielding as many batches,
or under ``exact_shares`` shares of samples, nothing repeated or dropped (docs/multi-gpu.md, "How an epoch is
split across ranks"; docs/mixtures.md, "Epochs per source, and ranks"; the windows' mixing: docs/shuffling.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from numpy.random import default_rng  # imported with gdsload, not by the first pass's plan

#: The largest integer argument (counts, sizes, seed, epoch, rank) and state entry: they meet numpy's int64
#: arithmetic in the plan (block ids, stream positions, batch bounds) and are saved in states as int64-sized ints.
MAX_INT = 2**63 - 1

@dataclass(frozen=True)
class PlanConfig:
    num_samples: int
    samples_per_block: int
    batch_size: int
    window_blocks: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    exact_shares: bool = False  # each rank its share of the samples: no padding, no drop (:func:`share_bounds`)

    def __post_init__(self) -> None:
        for name in ("num_samples", "samples_per_block", "batch_size", "window_blocks", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (found {getattr(self, name)})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) (found {self.rank})")
        if self.world_size > self.num_blocks:
            raise ValueError(
                f"world_size {self.world_size} exceeds the dataset's {self.num_blocks} blocks "
                "(every rank needs at least one block; write smaller blocks)"
            )
        if not isinstance(self.exact_shares, bool):
            raise TypeError(f"exact_shares must be True or False (found {self.exact_shares!r})")
        if self.exact_shares and self.drop_last:
            raise ValueError("exact_shares and drop_last exclude each other (exact shares drop no sample)")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)


@dataclass(frozen=True)
class EpochPlan:
    """Windows to read, in order, and the stream of (window, position) pairs that batches are cut from."""

    config: PlanConfig
    windows: tuple[np.ndarray, ...]  # block ids of each window
    window_of: np.ndarray  # window index of each stream position (non-decreasing)
    positions: np.ndarray  # of each sample of the epoch's stream: its row in its window (block * K + sample)
    epoch: int = 0  # the epoch planned (what seeds per-sample transforms)

    @property
    def num_batches(self) -> int:
        return -(-len(self.positions) // self.config.batch_size)

    def batch_bounds(self, i: int) -> tuple[int, int]:
        b = self.config.batch_size
        return i * b, min((i + 1) * b, len(self.positions))

    def first_window(self, batch: int) -> int:
        """The window batch ``batch`` draws from first: the first a pass from there reads
        (``len(windows)`` past the plan's end)."""
        return int(self.window_of[self.batch_bounds(batch)[0]]) if batch < self.num_batches else len(self.windows)

    def segment_table(self) -> list[list[tuple[int, int, int, int]]]:
        """Every batch's segments as ``(window, start, stop, first_position)``, ``first_position`` being -1
        unless the positions are consecutive (then the gather is one copy). Computed for the whole epoch at once, and
        once per plan, so the consumer's per-batch work is a list lookup."""
        return self._segments

    @cached_property
    def _segments(self) -> list[list[tuple[int, int, int, int]]]:
        n, b = len(self.positions), self.config.batch_size
        if n == 0:
            return []
        cut = np.zeros(n, dtype=bool)
        cut[1:] = np.diff(self.window_of) != 0
        cut[::b] = True
        starts = np.flatnonzero(cut)
        stops = np.append(starts[1:], n)
        breaks = np.ones(n, dtype=bool)
        breaks[1:] = np.diff(self.positions) != 1
        count = np.cumsum(breaks)
        first = np.where(count[stops - 1] == count[starts], self.positions[starts], -1)
        table: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.num_batches)]
        for row in zip((starts // b).tolist(), self.window_of[starts].tolist(), starts.tolist(), stops.tolist(),
                       first.tolist()):
            table[row[0]].append(row[1:])
        return table

    def last_batch_of_window(self) -> np.ndarray:
        """For each window, the index of the last batch that draws from it (when it can be released)."""
        b = self.config.batch_size
        last = np.full(len(self.windows), -1, dtype=np.int64)
        positions = np.arange(len(self.window_of))
        np.maximum.at(last, self.window_of, positions // b)
        return last

    def max_windows_per_batch(self) -> int:
        """Windows one batch draws from, at most: a batch has one segment per window."""
        return max((len(rows) for rows in self._segments), default=1)

    def stream_blocks(self) -> np.ndarray:
        """Global block id of every entry of the stream."""
        if not self.windows:
            return np.zeros(0, np.int64)
        flat = np.concatenate(self.windows)
        starts = np.cumsum([0] + [len(w) for w in self.windows[:-1]])
        return flat[starts[self.window_of] + self.positions // self.config.samples_per_block]

    def sample_ids(self) -> np.ndarray:
        """Global sample index of every entry of the stream (resident fields are gathered by it)."""
        k = self.config.samples_per_block
        return self.stream_blocks() * k + self.positions % k


def block_order(num_blocks: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """All block ids in this epoch's order (identical on every rank)."""
    if not shuffle:
        return np.arange(num_blocks, dtype=np.int64)
    return default_rng([seed, epoch]).permutation(num_blocks).astype(np.int64)


def rank_blocks(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous share of the epoch's block order (sizes differ by at most one)."""
    return np.array_split(order, world_size)[rank]


def block_sizes(blocks: np.ndarray, num_samples: int, samples_per_block: int) -> np.ndarray:
    """Valid samples in each block (the dataset's last block may be partial)."""
    return np.minimum(samples_per_block, num_samples - blocks * samples_per_block)


def _target_samples(cfg: PlanConfig, order: np.ndarray) -> int:
    """Samples each rank yields: ranks are made equal by dropping (drop_last) or padding by wrapping."""
    counts = [int(block_sizes(rank_blocks(order, r, cfg.world_size), cfg.num_samples, cfg.samples_per_block).sum())
              for r in range(cfg.world_size)]
    if cfg.drop_last:
        return (min(counts) // cfg.batch_size) * cfg.batch_size
    return max(counts)


def _block_positions(sizes: np.ndarray, samples_per_block: int, cells: np.ndarray) -> np.ndarray:
    """Positions of the valid samples of blocks, in block order: block j in cell ``cells[j]`` of its window
    holds positions cells[j]*K .. cells[j]*K+sizes[j]-1."""
    owner = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    starts = np.cumsum(sizes) - sizes
    return cells[owner] * samples_per_block + (np.arange(len(owner), dtype=np.int64) - starts[owner])


def epoch_plan(cfg: PlanConfig, epoch: int, pace: Callable[[], None] | None = None) -> EpochPlan:
    """The plan of ``epoch`` for ``cfg.rank``; ``pace`` (a :class:`gdsload.pipeline.pacing.Pacer`) is called after
    each window, and changes nothing in the plan.

    With ``drop_last`` every rank yields the same number of full batches and the remainder is dropped.
    Without it, ranks holding fewer samples are padded up to the largest rank's count by repeating samples
    of their own last window (already resident, so padding costs no extra reads); a rank's last batch may
    be partial, and all ranks' batches have the same sizes. With ``exact_shares``: :func:`_exact_share_plan`.
    """
    if cfg.exact_shares:
        return _exact_share_plan(cfg, epoch, pace)
    k = cfg.samples_per_block
    order = block_order(cfg.num_blocks, cfg.shuffle, cfg.seed, epoch)
    mine = rank_blocks(order, cfg.rank, cfg.world_size)
    w = min(cfg.window_blocks, max(1, len(mine)))  # a window of more blocks than the rank has is all of them
    target = _target_samples(cfg, order)
    rng = default_rng([cfg.seed, epoch, 1 + cfg.rank]) if cfg.shuffle else None

    # Every window's positions at once, in window order (block j of a window holds j*K .. j*K+size-1); the
    # loop below only shuffles them, window by window, as the seeded generator always has.
    sizes = block_sizes(mine, cfg.num_samples, k)
    flat = _block_positions(sizes, k, np.arange(len(mine), dtype=np.int64) % w)
    ends = np.cumsum(sizes)  # where each window's positions end in flat: at its last block's
    bounds = [int(b) for b in np.append(ends[w - 1::w], ends[-1:])] if len(mine) else []
    windows, positions = [], []
    total = 0
    for i in range(0, len(mine), w):
        if total >= target:
            break
        local = flat[total:bounds[i // w]]
        if rng is not None:
            local = rng.permutation(local)
        windows.append(mine[i:i + w])
        positions.append(local)
        total += len(local)
        if pace is not None:
            pace()
    counts = [len(p) for p in positions]
    window_of_a = np.repeat(np.arange(len(windows), dtype=np.int64), counts)
    positions_a = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    if total > target:
        window_of_a, positions_a = window_of_a[:target], positions_a[:target]
    elif total < target:
        last = positions[-1]
        extra = last[np.arange(target - total) % len(last)]
        window_of_a = np.concatenate([window_of_a, np.full(len(extra), len(windows) - 1, dtype=np.int64)])
        positions_a = np.concatenate([positions_a, extra])
    return EpochPlan(cfg, tuple(windows), window_of_a, positions_a, epoch)


def share_bounds(num_samples: int, world_size: int, epoch: int) -> list[int]:
    """Where each rank's share of ``epoch`` begins in the epoch's sample order (the blocks in their epoch order,
    each block's samples in order) under ``exact_shares``, and where the last one ends: ``world_size + 1``
    offsets. Rank r holds ``((epoch + 1) * N + r) // W - (epoch * N + r) // W`` samples, ``N // W`` or one
    more, the extra ones passing from rank to rank with the epoch: over any run of E epochs a rank holds as
    many samples as there are multiples of W among E * N consecutive integers, ``E * N // W`` or one more. So
    ranks that took the same number of samples are never more than one sample apart in their epochs."""
    sizes = [((epoch + 1) * num_samples + r) // world_size - (epoch * num_samples + r) // world_size
             for r in range(world_size)]
    return [0, *itertools.accumulate(sizes)]


def _exact_share_plan(cfg: PlanConfig, epoch: int, pace: Callable[[], None] | None) -> EpochPlan:
    """The plan of ``epoch`` for ``cfg.rank`` under ``exact_shares``: its share of the samples
    (:func:`share_bounds`), no padding, no drop. The blocks holding the share, in epoch order, are grouped into
    windows of ``window_blocks``; a window's positions are shuffled as in :func:`epoch_plan`. The first and
    last block may be partial (the neighbouring rank reads the rest of it)."""
    k = cfg.samples_per_block
    order = block_order(cfg.num_blocks, cfg.shuffle, cfg.seed, epoch)
    sizes = block_sizes(order, cfg.num_samples, k)
    ends = np.cumsum(sizes)
    bounds = share_bounds(cfg.num_samples, cfg.world_size, epoch)
    stream = np.arange(bounds[cfg.rank], bounds[cfg.rank + 1], dtype=np.int64)  # never empty: W <= blocks <= N
    block_at = np.searchsorted(ends, stream, side="right")
    first = int(block_at[0])
    mine = order[first:int(block_at[-1]) + 1]
    w = min(cfg.window_blocks, len(mine))
    at = block_at - first  # each sample's block, counted in this rank's blocks
    window_of = at // w
    positions = (at % w) * k + stream - (ends[block_at] - sizes[block_at])
    windows = tuple(mine[i:i + w] for i in range(0, len(mine), w))
    rng = default_rng([cfg.seed, epoch, 1 + cfg.rank]) if cfg.shuffle else None
    starts = np.searchsorted(window_of, np.arange(len(windows) + 1))
    for i in range(len(windows)):
        if rng is not None:
            positions[starts[i]:starts[i + 1]] = rng.permutation(positions[starts[i]:starts[i + 1]])
        if pace is not None:
            pace()
    return EpochPlan(cfg, windows, window_of, positions, epoch)


def blocks_per_rank(num_blocks: int, world_size: int) -> int:
    """The most blocks a rank holds in an epoch (:func:`rank_blocks`: shares differ by at most one)."""
    return max(1, -(-num_blocks // max(1, world_size)))


def window_blocks_for(block_bytes: int, window_bytes: int, batch_size: int, samples_per_block: int,
                      num_blocks: int, world_size: int) -> int:
    """The default window size in blocks: about ``window_bytes`` (the backend's preference) of blocks of
    ``block_bytes`` (all fields read per window), at least a batch's worth, at most a rank's share
    (:func:`blocks_per_rank`, to which GDSDataset clamps a requested size too: a window never holds more
    blocks than its rank has, :func:`epoch_plan`, so a larger value would only size larger buffers)."""
    by_size = max(1, window_bytes // max(1, block_bytes))
    return max(1, min(max(-(-batch_size // samples_per_block), by_size), blocks_per_rank(num_blocks, world_size)))


def fewest_rank_samples(num_samples: int, samples_per_block: int, world_size: int) -> int:
    """The fewest samples any rank holds in any epoch, shuffled or not: a smallest share
    (``num_blocks // world_size`` blocks) holding the dataset's partial last block, as the last rank's does
    unshuffled and any smallest share may when shuffled. With ``drop_last`` a rank yields
    ``(fewest // batch_size)`` batches in such an epoch."""
    num_blocks = -(-num_samples // samples_per_block)
    short = num_blocks * samples_per_block - num_samples  # samples the last block lacks
    return (num_blocks // max(1, world_size)) * samples_per_block - short


def check_yields(cfg: PlanConfig) -> None:
    """Refuse a config under which a rank would yield no batch in some epoch (only ``drop_last`` can drop
    every sample): ValueError naming the arguments, since an empty pass would end a training loop silently."""
    fewest = fewest_rank_samples(cfg.num_samples, cfg.samples_per_block, cfg.world_size)
    if not cfg.drop_last or fewest >= cfg.batch_size:
        return
    if cfg.world_size == 1:
        raise ValueError(f"batch_size={cfg.batch_size} with drop_last=True yields no batch: the dataset holds "
                         f"{cfg.num_samples} samples (expected batch_size at most {cfg.num_samples}, or "
                         f"drop_last=False)")
    raise ValueError(f"batch_size={cfg.batch_size} with drop_last=True and world_size={cfg.world_size} yields no "
                     f"batch in some epoch: a rank holds as few as {fewest} of the dataset's {cfg.num_samples} "
                     f"samples (expected batch_size at most {fewest}, drop_last=False, or a smaller world_size)")


def window_buffers_for(prefetch: int, plan: EpochPlan) -> int:
    """Window buffers a pass needs: the consumer holds the windows its current batch draws from while
    ``prefetch`` more are being read."""
    return prefetch + plan.max_windows_per_batch()


#: Fields whose whole array is at most this many bytes are read once and kept (``resident_bytes``).
DEFAULT_RESIDENT_BYTES = 64 << 20


def resident_fields(meta: Any, names: Sequence[str], resident_bytes: int) -> tuple[str, ...]:
    """The fixed fields among ``names`` read whole, once, on the first pass (resident): those whose chunks
    total at most ``resident_bytes``. The one rule for GDSDataset and the doctor."""
    return tuple(n for n in names if n in meta.fields
                 and meta.fields[n].block_bytes * meta.fields[n].num_chunks <= resident_bytes)
