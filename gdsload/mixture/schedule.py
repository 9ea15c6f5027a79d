"""A mixture's schedule and its sources' positions: pure logic (Python ints and exact fractions), no I/O.

The schedule says, batch by batch, how many samples (or whole batches) each source gives. Weights are exact
fractions normalised to sum 1 (a float counts as the decimal it prints as); a *segment* runs from the start or
a weight change. After ``h`` samples of a segment source ``i`` has given ``c_i`` with ``|c_i - w_i h| < 1``
(earliest deadline first; why it holds: docs/mixtures.md, "The schedule and its guarantees"). A source's
position is a :class:`Stretch`, the same on every rank, from which each rank works out its own epoch and
position; :meth:`Stretch.end_hop` closes the old ranks' leg when a resume changes the ranks.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from math import lcm
from typing import Any

from numpy.random import default_rng

from ..pipeline.legs import Hop, rest_after
from ..pipeline.resume import StateError, state_int

WEIGHT_TEXT = re.compile(r"[0-9]+(/[0-9]+)?")  # a weight in a state: str(Fraction) of one >= 0


def exact_weights(weights: Any, names: Sequence[str]) -> tuple[Fraction, ...]:
    """``weights`` (a mapping of every name in ``names`` to a finite number >= 0, not all 0) as exact fractions
    in ``names``' order; a float as the decimal it prints as. TypeError / ValueError naming the entry."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of source name -> weight (found {type(weights).__name__})")
    missing, unknown = [n for n in names if n not in weights], [n for n in weights if n not in names]
    if missing or unknown:
        raise ValueError(f"weights must name every source once (expected {list(names)}; missing {missing}, "
                         f"unknown {unknown})")
    out = []
    for name in names:
        value = weights[name]
        if isinstance(value, Decimal) and not value.is_finite():  # Fraction() would raise, naming no weight
            raise TypeError(f"weights[{name!r}] must be a finite number (found {value!r})")
        if isinstance(value, (numbers.Rational, Decimal)) and not isinstance(value, bool):
            weight = Fraction(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and abs(float(value)) < float("inf"):
            weight = Fraction(repr(float(value)))
        else:
            raise TypeError(f"weights[{name!r}] must be a finite number (found {value!r})")
        if weight < 0:
            raise ValueError(f"weights[{name!r}] must be at least 0 (found {value!r})")
        out.append(weight)
    if not any(out):
        raise ValueError(f"weights are all 0 (expected at least one source with a positive weight: {dict(weights)})")
    return tuple(out)


@lru_cache(maxsize=64)
def _scaled(weights: tuple[Fraction, ...]) -> tuple[tuple[int, ...], int]:
    """Integer weights with the same ratios, and their sum."""
    common = lcm(*(w.denominator for w in weights))
    ints = tuple(int(w * common) for w in weights)
    return ints, sum(ints)


@lru_cache(maxsize=64)
def tie_order(seed: int, start: int, n: int) -> tuple[int, ...]:
    """Each source's priority among sources whose next samples are due at the same batch (lower first): a
    permutation seeded by the mixture's seed and the step its segment began at."""
    return tuple(int(p) for p in default_rng([seed, start]).permutation(n))


@dataclass(frozen=True)
class Schedule:
    """A segment: the step it began at, its weights (exact, any positive scale) and the units (samples, or
    batches with whole batches) each source gave since it began."""

    start: int
    weights: tuple[Fraction, ...]
    counts: tuple[int, ...]

    @classmethod
    def begin(cls, start: int, weights: tuple[Fraction, ...]) -> Schedule:
        return cls(start, weights, (0,) * len(weights))

    def normalised(self) -> tuple[Fraction, ...]:
        total = sum(self.weights)
        return tuple(w / total for w in self.weights)

    def reweighted(self, weights: tuple[Fraction, ...], step: int) -> Schedule:
        """A new segment from ``step`` under ``weights``, or this one where they are the same proportions."""
        if tuple(w / sum(weights) for w in weights) == self.normalised():
            return self
        return Schedule.begin(step, weights)


def next_counts(schedule: Schedule, unit: int, seed: int) -> tuple[tuple[int, ...], Schedule]:
    """The next batch's ``unit`` units, split among the sources (module docstring), and the segment after it.
    Raises StateError if the counts cannot go on within one of the targets (only a state edited by hand can
    hold such counts)."""
    ints, total = _scaled(schedule.weights)
    counts = schedule.counts
    h = sum(counts) + unit
    order = tie_order(seed, schedule.start, len(counts))
    after, optional = [], []
    for i, (a, c) in enumerate(zip(ints, counts)):
        due = max(c, a * h // total)  # every sample whose deadline is this batch, or earlier
        after.append(due)
        if due < -(-a * h // total):  # one more is allowed: its deadline decides
            optional.append((-(-(due + 1) * total // (a * unit)), order[i], i))
    room = h - sum(after)
    if not 0 <= room <= len(optional):
        raise StateError(f"state key 'schedule.counts': {dict(enumerate(counts))} cannot go on within one sample of "
                         f"the weights (expected counts from Mixture.state_dict())")
    for _, _, i in sorted(optional)[:room]:
        after[i] += 1
    return tuple(a - c for a, c in zip(after, counts)), Schedule(schedule.start, schedule.weights, tuple(after))


def schedule_state(schedule: Schedule, names: Sequence[str]) -> dict[str, Any]:
    return {"start": schedule.start, "weights": {n: str(w) for n, w in zip(names, schedule.weights)},
            "counts": dict(zip(names, schedule.counts))}


def parse_schedule(value: Any, names: Sequence[str], step: int, unit: int) -> Schedule:
    """A schedule state, checked: its keys, weights, a start at or before ``step``, and counts that add up to
    ``unit`` per batch since the start, each within one of its weight's share. StateError naming the key."""
    if not isinstance(value, Mapping) or set(value) != {"start", "weights", "counts"}:
        raise StateError(f"state key 'schedule': expected a dict with keys ['start', 'weights', 'counts'], found "
                         f"{value!r}"[:300])
    start = state_int(value["start"], "schedule.start", 0, step)
    for key in ("weights", "counts"):
        if not isinstance(value[key], Mapping) or list(value[key]) != list(names):
            raise StateError(f"state key 'schedule.{key}': expected a dict keyed by the sources {list(names)}, "
                             f"found {value[key]!r}"[:300])
    given = {n: state_weight(value["weights"][n], n) for n in names}
    try:
        weights = exact_weights(given, names)  # all 0 is refused there
    except (TypeError, ValueError) as e:
        raise StateError(f"state key 'schedule.weights': {e}") from None
    counts = tuple(state_int(value["counts"][n], f"schedule.counts[{n!r}]", 0) for n in names)
    h = (step - start) * unit
    ints, total = _scaled(weights)
    off = [n for n, a, c in zip(names, ints, counts) if abs(c * total - a * h) >= total]
    if sum(counts) != h or off:
        raise StateError(f"state key 'schedule.counts': {dict(zip(names, counts))} is not {h} units split by the "
                         f"weights within one each (step {step}, segment start {start})")
    return Schedule(start, weights, counts)


def state_weight(text: Any, name: str) -> Fraction:
    """A weight of a schedule state: a fraction >= 0 as ``str(Fraction)`` writes it (``'3/5'``, ``'2'``; no
    sign, exponent or float spelling, whose parsing could overflow, divide by zero or take unbounded time).
    StateError naming the weight and its value otherwise."""
    try:
        if isinstance(text, str) and WEIGHT_TEXT.fullmatch(text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):  # a zero denominator; more digits than Python converts
        pass
    raise StateError(f"state key 'schedule.weights[{name!r}]': expected a fraction >= 0 as Mixture.state_dict() "
                     f"writes it, such as '3/5' (found {text!r})"[:300])


# -- where a source stands ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stretch:
    """A source's position, the same on every rank: ``samples`` taken per rank since the stretch began, in
    ``epoch``, under ``world_size`` and ``window_blocks``, every rank reading in exact shares
    (``PlanConfig.exact_shares``).

    Without ``hops`` the stretch begins at the start of ``epoch`` and reads whole epochs. With ``hops`` (the
    GDSDataset hop dicts of the legs ``epoch`` was read in before, gdsload/pipeline/legs.py) it begins with the
    rest of ``epoch`` dealt out after an elastic resume, in shares sized as the exact shares of one continuous
    stream (:func:`gdsload.pipeline.legs.rest_shares`): each rank reads its own part of the rest and begins
    ``epoch + 1`` at once, no rank padded. Either way rank r's epochs follow from ``samples`` alone
    (:meth:`rank_position`), and ranks are at most one sample apart.

    ``source`` and ``fingerprint`` say whose position it is: the source's name and the digest of its dataset's
    fingerprint (:func:`gdsload.mixture.source.record_digest`), saved with it so that a state's positions cannot
    be swapped between sources or loaded into other ones unnoticed ('' where no source is meant)."""

    epoch: int
    hops: tuple[dict[str, int], ...]
    world_size: int
    window_blocks: int
    samples: int
    source: str = ""
    fingerprint: str = ""

    def _base(self, rank: int, num_samples: int) -> tuple[int, int]:
        """(``rank``'s samples in ``epoch``, its count in the stream of epochs where the stretch begins): the
        stream of epochs cut in exact shares, in which the stretch begins at sample :meth:`_start`."""
        n, w = num_samples, self.world_size
        base = (self._start(n) + rank) // w
        return ((self.epoch + 1) * n + rank) // w - base, base

    def _start(self, num_samples: int) -> int:
        """Where the stretch begins in the virtual stream of epochs (epoch e's sample i at ``e N + i``)."""
        n = num_samples
        return (self.epoch + 1) * n - (rest_after(n, self.epoch, [Hop(**h) for h in self.hops]) if self.hops else n)

    def rank_position(self, rank: int, num_samples: int) -> tuple[int, int]:
        """(epoch, samples of it taken) of ``rank``, exact to the sample; a share used up counts as the start of
        the next epoch. In ``epoch`` the samples taken are those of the stretch's first part (the dealt-out rest,
        with hops); rank r begins a later epoch e ``(e N + r) // W - ((epoch + 1) N - rest + r) // W`` samples
        into the stretch (:func:`gdsload.pipeline.plan.share_bounds`)."""
        n, w = num_samples, self.world_size
        first, base = self._base(rank, n)
        if self.samples < first:
            return self.epoch, self.samples
        epoch = ((self.samples + base + 1) * w - rank - 1) // n
        return epoch, self.samples - ((epoch * n + rank) // w - base)

    def end_hop(self, num_samples: int) -> tuple[int, tuple[dict[str, int], ...]]:
        """The epoch every rank is in or past, and its legs when the stretch ends there: its hops, and the leg
        read since (as a hop of batches of one sample, ``shift`` saying which ranks took one fewer), so that the
        rest of that epoch is exactly what no rank took (nothing read twice). No leg is added where no rank took
        a sample of that epoch."""
        n, w = num_samples, self.world_size
        epoch = min(self.rank_position(r, n)[0] for r in range(w))
        if epoch == self.epoch:
            hops, batches, shift = self.hops, self.samples, 0
        else:  # a later epoch, its first leg: the stretch began e N - start samples of the stream before it,
            # `ahead` rounds of a sample per rank and `shift` more, one each for `shift` ranks (legs.lags)
            ahead, shift = divmod(epoch * n - self._start(n), w)
            hops, batches = (), self.samples - ahead
        if batches:
            hops = (*hops, Hop(w, 1, self.window_blocks, batches, shift).as_dict(True))
        return epoch, tuple(hops)

    def taken(self, n: int) -> Stretch:
        # Called for every slice of every batch: made directly, which costs a fraction of dataclasses.replace.
        return Stretch(self.epoch, self.hops, self.world_size, self.window_blocks, self.samples + n, self.source,
                       self.fingerprint)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "fingerprint": self.fingerprint, "epoch": self.epoch,
                "hops": [dict(h) for h in self.hops], "world_size": self.world_size,
                "window_blocks": self.window_blocks, "samples": self.samples}


STRETCH_KEYS = ("source", "fingerprint", "epoch", "hops", "world_size", "window_blocks", "samples")
UNBOUND_KEYS = STRETCH_KEYS[2:]  # a position of a state saved before positions named their source


def parse_stretch(value: Any, key: str, unbound: bool = False) -> Stretch:
    """A stretch as :meth:`Stretch.as_dict` gives it (``unbound``: without ``source`` and ``fingerprint``, as
    states saved before them), its ints checked (the hops are checked where they are loaded, by
    gdsload.pipeline.resume; whose position it is, by gdsload.mixture.state): StateError naming the key."""
    keys = UNBOUND_KEYS if unbound else STRETCH_KEYS
    if not isinstance(value, Mapping) or sorted(value) != sorted(keys):
        raise StateError(f"state key '{key}': expected a dict with keys {list(keys)}, found {value!r}"[:300])
    hops = value["hops"]
    if not isinstance(hops, (list, tuple)) or not all(isinstance(h, Mapping) for h in hops):
        raise StateError(f"state key '{key}.hops': expected a list of dicts, found {hops!r}"[:300])
    owner = {k: value.get(k, "") for k in STRETCH_KEYS[:2]}
    for k, v in owner.items():
        if not isinstance(v, str):
            raise StateError(f"state key '{key}.{k}': expected a str, found {v!r}"[:300])
    return Stretch(state_int(value["epoch"], f"{key}.epoch", 0), tuple(dict(h) for h in hops),
                   state_int(value["world_size"], f"{key}.world_size", 1),
                   state_int(value["window_blocks"], f"{key}.window_blocks", 1),
                   state_int(value["samples"], f"{key}.samples", 0), **owner)
