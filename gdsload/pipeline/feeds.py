"""One source of a pipeline that serves several (a mixture's sources): what it reads with, and its stream.

A :class:`Feed` is what a source's dataset lends the pipeline: its reader, window buffers, position and how to
plan its later epochs; its samples are one stream, its epochs' passes one after another. A :class:`Walk` follows
that stream for one thread, a :class:`Part` (a range of one pass) at a time; :class:`Passes` makes each pass once,
for whichever thread asks first. Nothing here reads or waits on a device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import GDSLoadError
from .assembler import Assembler, EpochIndex, ResidentField
from .once import MadeOnce
from .position import Cursor
from .pacing import Pacer
from .plan import EpochPlan
from .reader import Reader
from .window import WindowBuffer


@dataclass
class Feed:
    """A source as the pipeline reads it: ``reader`` and ``buffers`` (the dataset's own, which the pipeline
    borrows and may add to with ``allocate``), ``first`` (the cursor of the epoch it stands in, with the samples
    of its batch already taken) with its plan, ``plans`` (epoch -> plan, for the epochs after it), the
    fields it gives with their names in the output (``names``), its resident fields and padding."""

    name: str
    reader: Reader
    buffers: list[WindowBuffer]
    allocate: Callable[[], WindowBuffer]
    first: Cursor
    first_plan: EpochPlan
    plans: Callable[[int, Pacer | None], EpochPlan]
    fields: Sequence[str]
    names: dict[str, str] = field(default_factory=dict)
    resident: dict[str, ResidentField] = field(default_factory=dict)
    pad: dict[str, tuple[int | None, Any]] = field(default_factory=dict)

    @property
    def start(self) -> int:
        """Where the first pass's stream starts."""
        return self.first.batch * self.first_plan.config.batch_size + self.first.skip

    def out_name(self, key: str) -> str:
        """``key`` of this source's batch (a field, or its ``/offsets`` or ``/lengths``) in the output."""
        base, slash, rest = key.partition("/")
        return self.names.get(base, base) + slash + rest


@dataclass
class FeedPass:
    """Pass ``k`` of a feed: epoch ``epoch``'s plan, where each window's samples start in its stream
    (``starts``, one more than the windows), the runs of consecutive positions (``runs``: a segment is one
    copy where its count does not change) and the index arrays the gathers use (uploaded when made)."""

    k: int
    epoch: int
    plan: EpochPlan
    starts: np.ndarray
    runs: np.ndarray
    index: EpochIndex

    def __len__(self) -> int:
        return len(self.plan.positions)

    def segments(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """Stream samples ``[a, b)`` as ``(window, start, stop, first_position)``, one per window; the first
        position is -1 unless the segment's positions are consecutive (then it is one copy)."""
        out = []
        plan, starts, runs = self.plan, self.starts, self.runs
        for w in range(int(plan.window_of[a]), int(plan.window_of[b - 1]) + 1):
            s, e = max(a, int(starts[w])), min(b, int(starts[w + 1]))
            first = int(plan.positions[s]) if runs[e - 1] == runs[s] else -1
            out.append((w, s, e, first))
        return out

    def describe(self, w: int) -> str:
        blocks = [int(b) for b in self.plan.windows[w]]
        return f"window {w} of epoch {self.epoch} (blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''})"


class Part(NamedTuple):
    """Samples ``[a, b)`` of pass ``p``'s stream."""

    p: FeedPass
    a: int
    b: int

    def windows(self) -> range:
        return range(int(self.p.plan.window_of[self.a]), int(self.p.plan.window_of[self.b - 1]) + 1)


class Passes:
    """A feed's passes, each made once by whichever thread asks first (plan, segments and the index arrays,
    uploaded before any read of the pass is submitted); only askers for the same pass wait while it is made.
    Passes no walk needs any more are dropped (:meth:`forget`)."""

    def __init__(self, feed: Feed, assembler: Assembler, pacing: Callable[[], bool]):
        self.feed, self.assembler, self._pacing = feed, assembler, pacing
        self._made: MadeOnce[FeedPass] = MadeOnce()

    def get(self, k: int) -> FeedPass:
        return self._made.get(k, lambda: self._make(k))

    def _make(self, k: int) -> FeedPass:
        pace = Pacer() if self._pacing() else None
        f = self.feed
        epoch = f.first.epoch + k
        plan = f.first_plan if k == 0 else f.plans(epoch, pace)
        n = len(plan.positions)
        starts = np.searchsorted(plan.window_of, np.arange(len(plan.windows) + 1))
        breaks = np.ones(n, dtype=bool)
        breaks[1:] = np.diff(plan.positions) != 1
        return FeedPass(k, epoch, plan, starts, np.cumsum(breaks), self.assembler.index(plan, pace))

    def forget(self, below: int) -> None:
        """Passes before ``below`` are not asked for again: their index arrays may go."""
        for p in self._made.drop(below):
            self.assembler.ops.retire(p.index.dev)


class Walk:
    """One thread's way along a feed's stream: :meth:`take` hands out the next samples as parts of passes."""

    def __init__(self, passes: Passes):
        self.passes = passes
        self.k, self.pos = 0, passes.feed.start
        self.entered = 0  # passes this walk has entered (its first included)
        self._current: FeedPass | None = None

    @property
    def current(self) -> FeedPass:
        """The pass the walk is in (kept: asked for once per pass)."""
        p = self._current
        if p is None or p.k != self.k:
            p = self._current = self.passes.get(self.k)
        return p

    def take(self, n: int) -> list[Part]:
        """The next ``n`` samples, as parts of one pass or more (a source that runs out begins its next
        epoch). Empty passes (a position saved at an epoch's end) are passed over."""
        parts: list[Part] = []
        skipped = 0  # passes in a row that gave nothing
        while n:
            p = self.current
            if self.pos >= len(p):
                skipped += 1
                if skipped > 3:  # only a resumed pass may be empty: under exact shares every rank holds a sample
                    raise GDSLoadError(f"{self.passes.feed.reader.meta.path}: source {self.passes.feed.name!r} "
                                       "yielded no sample in three passes")
                self.k, self.pos = self.k + 1, 0
                self.entered += 1
                continue
            skipped = 0
            got = min(n, len(p) - self.pos)
            parts.append(Part(p, self.pos, self.pos + got))
            self.pos, n = self.pos + got, n - got
        return parts
