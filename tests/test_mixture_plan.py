"""A mixture's pure parts: the schedule (counts within one of the weights after every batch, within two over
any run of batches, restarting at a weight change), exact shares of an epoch across ranks, and where each
rank stands in a source given the samples every rank took."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import assert_epochs_once
from gdsload.mixture.schedule import (Schedule, Stretch, exact_weights, next_counts, parse_schedule, parse_stretch,
                                      schedule_state)
from gdsload.mixture.source import Placement, SourceStream
from gdsload.pipeline.legs import Hop, leg_taken, rest_shares
from gdsload.pipeline.plan import PlanConfig, epoch_plan, share_bounds
from gdsload.pipeline.position import Position
from gdsload.pipeline.resume import Fingerprint, StateError, make_state

NAMES = tuple("abcdef")
weight_lists = st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(any)


def run(schedule: Schedule, unit: int, steps: int, seed: int = 0) -> tuple[np.ndarray, Schedule]:
    """Each batch's counts (steps x sources) from ``schedule`` on."""
    rows = []
    for _ in range(steps):
        counts, schedule = next_counts(schedule, unit, seed)
        rows.append(counts)
    return np.array(rows, dtype=np.int64).reshape(steps, len(schedule.counts)), schedule


def assert_within(rows: np.ndarray, weights, unit: int) -> None:
    """Cumulative counts within one of the target after every batch, within two over every run of batches:
    exactly, in integers (count * total vs weight * samples)."""
    a = np.array([int(w) for w in weights], dtype=object)
    total = sum(a)
    assert (rows >= 0).all() and (rows.sum(axis=1) == unit).all()
    cum = np.vstack([np.zeros(len(a), np.int64), rows.cumsum(axis=0)]).astype(object)
    h = np.arange(len(cum), dtype=object)[:, None] * unit
    lag = cum * total - a[None, :] * h  # count minus target, scaled by total
    assert (abs(lag) < total).all(), "within one of weight x samples after every batch"
    window = lag[:, None, :] - lag[None, :, :]  # every run of batches, from one cut to another
    assert (abs(window) < 2 * total).all(), "within two over any run of batches"


@settings(max_examples=200, deadline=None)
@given(weight_lists, st.integers(1, 64), st.integers(1, 120), st.integers(0, 2**32 - 1))
def test_counts_stay_within_one_of_the_weights_after_every_batch(weights, unit, steps, seed):
    w = tuple(Fraction(x) for x in weights)
    rows, after = run(Schedule.begin(0, w), unit, steps, seed)
    assert_within(rows, weights, unit)
    assert after.counts == tuple(rows.sum(axis=0))
    again, _ = run(Schedule.begin(0, w), unit, steps, seed)
    assert np.array_equal(rows, again), "the schedule is deterministic"
    assert all(c == 0 for c, x in zip(rows.sum(axis=0), weights) if x == 0), "a weight of 0 gives nothing"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(weight_lists, st.integers(1, 40)), min_size=2, max_size=4), st.integers(1, 32))
def test_a_weight_change_restarts_the_count_from_that_batch(segments, unit):
    n = min(len(w) for w, _ in segments)
    segments = [(w[:n] if any(w[:n]) else [1] * n, steps) for w, steps in segments]
    schedule, step, since = Schedule.begin(0, tuple(Fraction(x) for x in segments[0][0])), 0, []
    for weights, steps in segments:
        new = schedule.reweighted(tuple(Fraction(x) for x in weights), step)
        same = [Fraction(x, sum(weights)) for x in weights] == list(schedule.normalised())
        assert (new is schedule) == same, "the same proportions keep the segment, others begin one"
        if new is not schedule:
            assert new.start == step and new.counts == (0,) * n
            since = []
        rows, schedule = run(new, unit, steps)
        since.append(rows)
        assert_within(np.vstack(since), weights, unit)  # counted from the last change
        step += steps


def test_float_weights_count_as_the_decimals_they_print_as():
    w = exact_weights({"web": 0.6, "code": 0.25, "books": 0.15}, ("web", "code", "books"))
    assert w == (Fraction(3, 5), Fraction(1, 4), Fraction(3, 20))
    rows, _ = run(Schedule.begin(0, w), 20, 50)
    assert (rows == [12, 5, 3]).all(), "0.6 / 0.25 / 0.15 of 20 is 12 / 5 / 3, every batch"
    rows, _ = run(Schedule.begin(0, w), 256, 200)
    assert_within(rows, (12, 5, 3), 256)
    assert set(rows[:, 0].tolist()) <= {153, 154}


def test_largest_remainder_would_let_a_count_fall():
    """Why the schedule is earliest-deadline-first: largest remainder over the cumulative target takes a
    sample back from source 3 between two batches (the Alabama paradox); the schedule never does."""
    weights, unit = (9, 3, 22, 1), 3

    def largest_remainder(h):
        quota = [Fraction(w * h, sum(weights)) for w in weights]
        seats = [int(q) for q in quota]
        for i in sorted(range(4), key=lambda i: seats[i] - quota[i])[:h - sum(seats)]:
            seats[i] += 1
        return seats

    assert largest_remainder(17 * unit)[3] == 2 and largest_remainder(18 * unit)[3] == 1
    rows, _ = run(Schedule.begin(0, tuple(Fraction(w) for w in weights)), unit, 40)
    assert (rows >= 0).all()
    assert_within(rows, weights, unit)


@settings(max_examples=30, deadline=None)
@given(weight_lists, st.integers(1, 32), st.integers(0, 60), st.integers(1, 40))
def test_a_saved_schedule_continues_as_if_never_saved(weights, unit, cut, more):
    names = NAMES[:len(weights)]
    w = tuple(Fraction(x) for x in weights)
    full, _ = run(Schedule.begin(5, w), unit, cut + more, seed=3)
    _, saved = run(Schedule.begin(5, w), unit, cut, seed=3)
    state = json.loads(json.dumps(schedule_state(saved, names)))
    rest, _ = run(parse_schedule(state, names, 5 + cut, unit), unit, more, seed=3)
    assert np.array_equal(full[cut:], rest)


def test_a_bad_schedule_state_is_refused_naming_the_key():
    names = ("a", "b")
    _, s = run(Schedule.begin(0, (Fraction(1), Fraction(2))), 4, 3)
    good = schedule_state(s, names)
    assert parse_schedule(good, names, 3, 4) == s
    cases = [({**good, "start": 4}, "schedule.start"), ({**good, "counts": {"a": 6, "b": 6}}, "schedule.counts"),
             ({**good, "counts": {"a": 4, "b": 7}}, "schedule.counts"), ({**good, "weights": {"a": "x", "b": "1"}},
                                                                       "schedule.weights"),
             ({**good, "counts": {"b": 8, "a": 4}}, "schedule.counts"), ({"start": 0}, "'schedule'"),
             ({**good, "counts": {"a": True, "b": 8}}, "schedule.counts")]
    for bad, key in cases:
        with pytest.raises(StateError, match=key.replace(".", r"\.")):
            parse_schedule(bad, names, 3, 4)
    # Within one of the weights, which the load checks, yet no way on: not counts the schedule makes.
    dead_end = Schedule(0, tuple(Fraction(w) for w in (12, 8, 10, 8)), (2, 0, 2, 0))
    with pytest.raises(StateError, match="cannot go on"):
        run(dead_end, 1, 60)


@pytest.mark.parametrize("weights, error, match", [
    ({"a": 1}, ValueError, "missing \\['b'\\]"), ({"a": 1, "b": 1, "c": 1}, ValueError, "unknown \\['c'\\]"),
    ({"a": -1, "b": 1}, ValueError, "weights\\['a'\\] must be at least 0"),
    ({"a": float("nan"), "b": 1}, TypeError, "finite"), ({"a": True, "b": 1}, TypeError, "weights\\['a'\\]"),
    ({"a": 0, "b": 0.0}, ValueError, "all 0"), ([1, 2], TypeError, "dict")])
def test_bad_weights_are_refused_naming_the_entry(weights, error, match):
    with pytest.raises(error, match=match):
        exact_weights(weights, ("a", "b"))


def test_weights_of_any_number_type_are_exact():
    from decimal import Decimal

    got = exact_weights({"a": np.float32(0.5), "b": Decimal("0.1"), "c": np.int64(2), "d": Fraction(1, 3)}, "abcd")
    assert got == (Fraction(1, 2), Fraction(1, 10), Fraction(2), Fraction(1, 3))


@pytest.mark.parametrize("value", [Decimal("Infinity"), Decimal("-Infinity"), Decimal("NaN"), Decimal("sNaN"),
                                   float("inf"), "1/0"])
def test_non_finite_weights_are_refused_naming_the_weight_and_value(value):
    """Decimal('Infinity') raised OverflowError and Decimal('NaN') a ValueError naming no weight."""
    with pytest.raises(TypeError) as info:
        exact_weights({"a": 1, "b": value}, ("a", "b"))
    assert str(info.value) == f"weights['b'] must be a finite number (found {value!r})"


@pytest.mark.parametrize("value", ["1/0", float("inf"), "inf", Decimal("Infinity"), Decimal("NaN"), "nan", "1e999999",
                                   "-1", "0.5", 1, None, "1" * 5000], ids=lambda v: repr(v)[:12])
def test_a_bad_weight_in_a_schedule_state_is_refused_naming_it(value):
    """A saved schedule's weight of '1/0' raised ZeroDivisionError and one of inf an OverflowError (and
    '1e999999' would compute a number of a million digits): a weight of a state is a fraction as the state
    writes it ('3/5'), else a StateError naming the weight and its value."""
    names = ("a", "b")
    good = schedule_state(Schedule.begin(0, (Fraction(1), Fraction(2))), names)
    with pytest.raises(StateError) as info:
        parse_schedule({**good, "weights": {"a": "1", "b": value}}, names, 0, 4)
    assert str(info.value).startswith("state key 'schedule.weights['b']': expected a fraction >= 0 as "
                                      f"Mixture.state_dict() writes it, such as '3/5' (found {value!r}"[:120])


# -- exact shares --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 9), st.integers(1, 4), st.integers(1, 5), st.booleans(),
       st.integers(0, 50))
def test_exact_shares_read_every_sample_once_per_epoch(n, k, window, world, shuffle, epoch):
    world = min(world, -(-n // k))
    ids = []
    for r in range(world):
        cfg = PlanConfig(num_samples=n, samples_per_block=k, batch_size=3, window_blocks=window, shuffle=shuffle,
                         seed=7, rank=r, world_size=world, exact_shares=True)
        plan = epoch_plan(cfg, epoch)
        got = plan.sample_ids()
        assert (np.diff(plan.window_of) >= 0).all() and len(got) == len(plan.positions)
        for w, blocks in enumerate(plan.windows):
            assert 1 <= len(blocks) <= window and len(np.unique(blocks)) == len(blocks)
            assert set((got[plan.window_of == w] // k).tolist()) <= set(blocks.tolist())
        ids.append(got)
    bounds = share_bounds(n, world, epoch)
    assert [len(i) for i in ids] == np.diff(bounds).tolist() and np.ptp(np.diff(bounds)) <= 1
    assert sorted(np.concatenate(ids).tolist()) == list(range(n)), "every sample once, none padded or dropped"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 8), st.integers(0, 30), st.integers(1, 12))
def test_ranks_stay_within_one_sample_of_each_other_over_any_epochs(n, world, first, epochs):
    world = min(world, n)
    sizes = np.array([np.diff(share_bounds(n, world, e)) for e in range(first, first + epochs)])
    assert (sizes.sum(axis=1) == n).all()
    cum = sizes.cumsum(axis=0)
    assert (np.ptp(cum, axis=1) <= 1).all(), "summed over any run of epochs, ranks differ by one at most"


def test_exact_shares_refuse_drop_last_and_anything_but_a_bool():
    with pytest.raises(ValueError, match="exact_shares and drop_last"):
        PlanConfig(num_samples=10, samples_per_block=2, batch_size=2, window_blocks=1, drop_last=True,
                   exact_shares=True)
    with pytest.raises(TypeError, match="exact_shares must be True or False"):
        PlanConfig(num_samples=10, samples_per_block=2, batch_size=2, window_blocks=1, exact_shares=1)


# -- positions -----------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(0, 20), st.integers(0, 400))
def test_each_rank_finds_its_epoch_and_position_from_the_samples_taken(n, world, first, samples):
    world = min(world, n)
    stretch = Stretch(first, (), world, 1, samples)
    positions = []
    for r in range(world):
        epoch, left = first, samples  # walk the rank's shares, epoch after epoch
        while left >= np.diff(share_bounds(n, world, epoch))[r]:
            left -= np.diff(share_bounds(n, world, epoch))[r]
            epoch += 1
        assert stretch.rank_position(r, n) == (epoch, left)
        positions.append((epoch, left))
    common = min(e for e, _ in positions)
    in_common = [samples - (sum(np.diff(share_bounds(n, world, e))[r] for e in range(first, common)))
                 for r in range(world)]
    assert max(in_common) - min(in_common) <= 1, "ranks are one sample apart at most"
    epoch, hops = stretch.end_hop(n)  # the leg the ranks read, ended exactly where each of them stands
    assert epoch == common
    taken = [min(t, int(np.diff(share_bounds(n, world, common))[r])) for r, t in enumerate(in_common)]
    if not any(taken):
        assert hops == ()
    else:
        (hop,) = hops
        sizes = np.diff(share_bounds(n, world, common)).tolist()
        assert leg_taken(n, common, sizes, Hop(**hop)) == taken and hop["batch_size"] == 1


def test_a_bad_stretch_is_refused_naming_the_key():
    good = Stretch(2, ({"world_size": 2, "batch_size": 1, "window_blocks": 3, "batches": 4},), 3, 2, 9).as_dict()
    assert parse_stretch(json.loads(json.dumps(good)), "p") == parse_stretch(good, "p")
    for key, value in (("samples", -1), ("epoch", "1"), ("world_size", 0), ("hops", [1]), ("window_blocks", 1.0)):
        with pytest.raises(StateError, match=f"p.{key}"):
            parse_stretch({**good, key: value}, "p")
    with pytest.raises(StateError, match="'p': expected a dict"):
        parse_stretch({**good, "extra": 1}, "p")


# -- elastic resume of a source: every sample once per epoch, across any number of world-size changes ---------
FP = Fingerprint({"x": "float32 ()"}, {"x": "0" * 64}, {"x": "1" * 64})


class FakeDataset:
    """What :meth:`SourceStream.locate` reads of a GDSDataset: its config and a state of it."""

    def __init__(self, config: PlanConfig):
        self.config = config

    def state_dict(self) -> dict:
        return make_state(self.config, FP, 0, 0)


def read(config: PlanConfig, placement: Placement, count: int) -> list[int]:
    """The next ``count`` samples a GDSDataset of ``config`` yields after ``place(*placement)``, pass after pass
    (each pass the next epoch), as a mixture's feed reads it (from any sample of a batch)."""
    position = Position(config, epoch_plan(config, 0), lambda: FP)
    position.place(*json.loads(json.dumps(placement)))
    cursor = position.begin()
    plan = position.plan(cursor.epoch)
    ids, epoch = plan.sample_ids()[cursor.batch * config.batch_size + cursor.skip:].tolist(), cursor.epoch
    while len(ids) < count:
        epoch += 1
        ids += epoch_plan(config, epoch).sample_ids().tolist()
    return ids[:count]


@st.composite
def elastic_source(draw):
    """A source (samples, per block, shuffle, seed) and legs (world size, window, batch size, samples taken
    per rank); the second leg's cut is small, so the next resume often falls inside the dealt-out rest."""
    n, k = draw(st.integers(1, 60)), draw(st.integers(1, 6))
    world = st.integers(1, min(5, -(-n // k)))
    legs = []
    for i in range(draw(st.integers(2, 4))):
        taken = draw(st.integers(0, 4) if i == 1 else st.integers(0, 3 * n))
        legs.append((draw(world), draw(st.integers(1, 4)), draw(st.integers(1, 9)), taken))
    return n, k, draw(st.booleans()), draw(st.integers(0, 99)), legs


def check_one_apart(stretch: Stretch, n: int) -> None:
    """Ranks that took the same count are at most one sample apart: where their epochs differ, those ahead
    took none of theirs and those behind have one sample left."""
    at = [stretch.rank_position(r, n) for r in range(stretch.world_size)]
    low = min(e for e, _ in at)
    if any(e != low for e, _ in at):
        assert all(e == low + 1 and t == 0 for e, t in at if e != low)
        assert all(stretch.taken(1).rank_position(r, n)[0] == low + 1 for r, (e, _) in enumerate(at) if e == low)


@settings(max_examples=150, deadline=None)
@given(elastic_source())
def test_an_elastic_resume_of_a_source_reads_every_sample_once_per_epoch(case):
    """A mixture's source read on legs of any world sizes and windows, resumed through SourceStream.locate at
    any sample (often twice inside one dealt-out rest): every sample of every epoch exactly once across ranks,
    none skipped, none repeated (each read is put in its rank's epoch by Stretch.rank_position), and the ranks
    a sample apart at most after every sample."""
    n, k, shuffle, seed, legs = case
    reads: dict[int, list[int]] = {}
    stretch = None
    for world, window, batch, taken in legs:
        starts = []
        for r in range(world):
            cfg = PlanConfig(num_samples=n, samples_per_block=k, batch_size=batch, window_blocks=window,
                             shuffle=shuffle, seed=seed, rank=r, world_size=world, exact_shares=True)
            source = SourceStream("s", FakeDataset(cfg), {})
            placement, start = ((Placement(0, (), 0), source.stretch) if stretch is None
                                else source.locate(parse_stretch(json.loads(json.dumps(stretch.as_dict())), "p")))
            for i, sample in enumerate(read(cfg, placement, taken)):
                reads.setdefault(start.taken(i).rank_position(r, n)[0], []).append(sample)
            starts.append(start)
        assert all(s == starts[0] for s in starts), "every rank makes the same stretch of it"
        for i in range(taken + 1):
            check_one_apart(starts[0].taken(i), n)
        stretch = starts[0].taken(taken)
    assert_epochs_once(reads, stretch, n)


def test_rest_shares_continue_the_exact_shares_of_later_epochs():
    """A dealt-out rest is cut as the exact shares of one stream ending where the epoch ends: with the later
    epochs' shares, every rank holds as many samples as the others up to one, over any run."""
    for n, world, epoch, rest in [(10, 3, 0, 7), (53, 4, 2, 1), (17, 5, 1, 17), (9, 2, 0, 0)]:
        sizes = np.array([rest_shares(n, world, epoch, rest)]
                         + [np.diff(share_bounds(n, world, e)) for e in range(epoch + 1, epoch + 6)])
        assert sizes[0].sum() == rest and np.ptp(sizes.cumsum(axis=0), axis=1).max() <= 1
        assert rest_shares(n, world, epoch, n) == np.diff(share_bounds(n, world, epoch)).tolist()
