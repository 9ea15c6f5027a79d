"""Mixture on the cpu backend: proportions, every sample once per epoch of its source across ranks, resume at
any step, a weight change at any step, a world-size change mid-run, the state's checks, fields, threads.

Ranks are simulated in one process: one Mixture per rank, stepped in lockstep as synchronous training does."""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import os
import threading
import time
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import assert_epochs_once, labelled, ragged_source, sequences, threads_left_since, wait_no_readers
from gdsload import GDSLoadError, ReadError, merge_states
from gdsload.mixture.mixture import Mixture
from gdsload.mixture.schedule import Stretch
from gdsload.pipeline.plan import share_bounds
from gdsload.pipeline.resume import StateError
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset

SIZES = {"web": (53, 4), "code": (31, 3), "books": (17, 2)}  # samples, samples per block
OFFSET = {"web": 0, "code": 1000, "books": 2000}  # sample i of a source has idx OFFSET + i
WEIGHTS = {"web": 0.6, "code": 0.25, "books": 0.15}
HYPOTHESIS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write(path: str, name: str, n: int, k: int, dtype: str = "float32") -> str:
    data = labelled(n, dtype=dtype)
    data["idx"] += OFFSET[name]
    data["x"] += np.asarray(OFFSET[name] * 1000, dtype=dtype)
    write_dataset(path, {f: ArraySource(f"<{f}>", a) for f, a in data.items()}, samples_per_block=k,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mix")
    return {name: write(str(d / f"{name}.gds"), name, n, k) for name, (n, k) in SIZES.items()}


def open_ranks(paths, world, state=None, weights=WEIGHTS, **kw) -> list[Mixture]:
    kw = {"batch_size": 8, "seed": 1, "shuffle": True, "backend": "cpu", "resident_bytes": 0, **kw}
    mixes = [Mixture(paths, weights, rank=r, world_size=world, **kw) for r in range(world)]
    for m in mixes:
        if state is not None:
            m.load_state_dict(state)
    return mixes


def step(mixes, steps, change=None) -> tuple[list[list[tuple[list[int], list[int]]]], dict]:
    """``steps`` batches from every rank (``change``: (step, weights) applied before that step): each batch
    as (idx, source index) lists, content checked; then the ranks' states, merged."""
    its = [iter(m) for m in mixes]
    out = [[] for _ in mixes]
    for _ in range(steps):
        for r, (m, it) in enumerate(zip(mixes, its)):
            if change is not None and m.step == change[0]:
                m.set_weights(change[1])
            b = next(it)
            assert np.array_equal(b["x"][:, 0, 0], b["idx"] * 1000.0), "every sample's own data"
            assert b["source"].dtype == np.int64 and len(b["source"]) == len(b["idx"])
            out[r].append((b["idx"].tolist(), b["source"].tolist()))
    for it in its:
        it.close()
    state = merge_states([json.loads(json.dumps(m.state_dict())) for m in mixes])
    for m in mixes:
        m.close()
    return out, state


def run(paths, world, steps, state=None, change=None, **kw):
    return step(open_ranks(paths, world, state, **kw), steps, change)


def streams(out) -> list[dict[int, list[int]]]:
    """Per rank, per source index: the idx it gave, in order."""
    per = []
    for rank in out:
        got: dict[int, list[int]] = {}
        for idx, src in rank:
            for i, s in zip(idx, src):
                got.setdefault(s, []).append(i)
        per.append(got)
    return per


def check_counts(out, weights, unit=8, start=0):
    """Every rank's batches hold the same counts per source, within one of the weights since ``start``."""
    names = list(SIZES)
    w = np.array([Fraction(repr(float(weights[n]))) for n in names], dtype=object)
    w = w / w.sum()
    for rank in out:
        assert [Counter(s) for _, s in rank] == [Counter(s) for _, s in out[0]], "ranks draw the same counts"
    counts = np.array([[Counter(s)[i] for i in range(3)] for _, s in out[0][start:]], dtype=object).cumsum(axis=0)
    h = np.arange(1, len(counts) + 1, dtype=object)[:, None] * unit
    assert (abs(counts - w[None, :] * h) < 1).all()


def check_epochs(out, world, first_epoch=0):
    """Each source's samples, over all ranks, exactly once per epoch: rank r's stream is its exact shares."""
    for s, name in enumerate(SIZES):
        n = SIZES[name][0]
        per_rank = [st.get(s, []) for st in streams(out)]
        epoch, at = first_epoch, [0] * world
        while True:
            sizes = np.diff(share_bounds(n, world, epoch))
            if any(a + int(z) > len(p) for a, z, p in zip(at, sizes, per_rank)):
                break
            got = sorted(i for r in range(world) for i in per_rank[r][at[r]:at[r] + int(sizes[r])])
            assert got == list(range(OFFSET[name], OFFSET[name] + n)), f"{name}: epoch {epoch} exactly once"
            at = [a + int(z) for a, z in zip(at, sizes)]
            epoch += 1
        assert epoch >= first_epoch + 2, "the test reads a few epochs of every source"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_follow_the_weights_and_every_sample_comes_once_per_epoch_of_its_source(paths, world):
    out, state = run(paths, world, 40)
    check_counts(out, WEIGHTS)
    check_epochs(out, world)
    assert state["step"] == 40 and all(p["hops"] == [] for p in state["positions"].values())


@HYPOTHESIS
@given(cut=st.integers(0, 30), world=st.integers(1, 2), change=st.none() | st.integers(0, 30),
       whole=st.booleans())
def test_a_resume_at_any_step_yields_the_uninterrupted_run(paths, cut, world, change, whole):
    later = None if change is None else (change, {"web": 1, "code": 2, "books": 3})
    full, end = run(paths, world, 36, change=later, whole_batches=whole)
    first, state = run(paths, world, cut, change=later, whole_batches=whole)
    rest, resumed_end = run(paths, world, 36 - cut, state=state, change=later, whole_batches=whole)
    assert [a + b for a, b in zip(first, rest)] == full, "batch for batch"
    assert resumed_end == end


@HYPOTHESIS
@given(change=st.integers(0, 30), weights=st.lists(st.integers(0, 9), min_size=3, max_size=3).filter(any))
def test_a_weight_change_at_any_step_skips_and_repeats_nothing(paths, change, weights):
    new = dict(zip(SIZES, weights))
    plain, _ = run(paths, 2, 40)
    changed, state = run(paths, 2, 40, change=(change, new))
    for a, b in zip(streams(plain), streams(changed)):
        for s in range(3):  # each source's samples come in the same order, only at another rate
            n = min(len(a.get(s, [])), len(b.get(s, [])))
            assert a.get(s, [])[:n] == b.get(s, [])[:n]
    check_counts(changed, new, start=change)
    assert state["schedule"]["start"] == change or Fraction(weights[0], sum(weights)) == Fraction(3, 5)


def run_leg(paths, world, steps, state=None, **kw):
    """``run``, also giving every source's stretch as the resumed ranks begin (the same on every rank)."""
    mixes = open_ranks(paths, world, state, **kw)
    start = {n: Stretch(**{**p, "hops": tuple(p["hops"])}) for n, p in mixes[0].state_dict()["positions"].items()}
    out, end = step(mixes, steps)
    return out, start, end


def check_once_per_epoch(legs, end) -> None:
    """Legs ``(out, start stretches)`` of one run: each read put in its rank's epoch of its source (by the
    stretch the leg began with, Stretch.rank_position); every epoch all ranks have finished holds every sample
    of the source exactly once, a later one no sample twice."""
    for s, name in enumerate(SIZES):
        n, reads = SIZES[name][0], {}
        for out, start in legs:
            for r, got in enumerate(streams(out)):
                for i, idx in enumerate(got.get(s, [])):
                    reads.setdefault(start[name].taken(i).rank_position(r, n)[0], []).append(idx - OFFSET[name])
        final = Stretch(**{**end["positions"][name], "hops": tuple(end["positions"][name]["hops"])})
        assert_epochs_once(reads, final, n, name)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(worlds=st.lists(st.integers(1, 5), min_size=2, max_size=3), first=st.integers(1, 12), second=st.integers(1, 4),
       batch_size=st.integers(3, 12), weights=st.lists(st.integers(0, 9), min_size=3, max_size=3).filter(any))
def test_a_resume_on_another_number_of_ranks_skips_and_repeats_nothing(paths, worlds, first, second, batch_size,
                                                                        weights):
    """Legs on other numbers of ranks (1 to 5; the second cut often inside the rest of an epoch dealt out by
    the first resume): across all ranks, every sample of every source exactly once per epoch of that source
    (no allowance for ranks one sample ahead or for padding), and the counts within one of the weights."""
    weights = dict(zip(SIZES, weights))
    legs, state = [], None
    for world, cut in zip(worlds, (first, second, 40)[:len(worlds) - 1] + (40,)):
        out, start, state = run_leg(paths, world, cut, state, weights=weights, batch_size=batch_size)
        legs.append((out, start))
    check_once_per_epoch(legs, state)
    check_no_repeat(legs, state)
    check_counts([[b for out, _ in legs for b in out[0]]], weights, unit=batch_size)  # from step 0, rank 0
    for out, _ in legs:
        assert all([Counter(c) for _, c in rank] == [Counter(c) for _, c in out[0]] for rank in out)


def check_no_repeat(legs, end) -> None:
    """The old test's accounting with no allowance: the reads of a source, over all legs and ranks, number
    exactly the epochs every final rank finished plus what the final ranks read of the epoch they are in (from
    the final position alone); none of its samples is read fewer times than the epochs finished."""
    for s, name in enumerate(SIZES):
        n = SIZES[name][0]
        got = Counter(i for out, _ in legs for st_ in streams(out) for i in st_.get(s, []))
        final = Stretch(**{**end["positions"][name], "hops": tuple(end["positions"][name]["hops"])})
        at = [final.rank_position(r, n) for r in range(final.world_size)]
        done = min(e for e, _ in at)
        left = 0  # samples of epoch `done` no final rank has read yet
        for r, (e, _) in enumerate(at):
            more = 0
            while e == done:
                more += 1
                e = final.taken(more).rank_position(r, n)[0]
            left += more
        assert min(got[OFFSET[name] + i] for i in range(n)) >= done, f"{name}: no sample skipped"
        assert sum(got.values()) == (done + 1) * n - left, f"{name}: {sum(got.values()) - (done + 1) * n + left} " \
                                                          "samples read twice"


def test_a_sources_batch_size_sizes_its_whole_batches_and_is_refused_by_sample(paths):
    """Mixing by sample, every source is read for the mixture's batches (positions count samples): a source's
    own batch_size is refused, naming it; with whole_batches it sizes that source's batches."""
    with pytest.raises(ValueError, match="source 'code': batch_size is the mixture's"):
        Mixture({**paths, "code": {"path": paths["code"], "batch_size": 4}}, batch_size=8, backend="cpu")
    sizes = {**paths, "code": {"path": paths["code"], "batch_size": 3}}
    with Mixture(sizes, WEIGHTS, batch_size=8, backend="cpu", whole_batches=True, seed=2) as mix:
        got = {(mix.sources[int(b["source"][0])], len(b["idx"])) for _, b in zip(range(30), mix)}
    assert got == {("web", 8), ("code", 3), ("books", 8)}


@pytest.mark.parametrize("ahead", [0, 7])
def test_a_batch_spanning_more_windows_than_its_source_has_buffers_is_read(paths, ahead):
    """Windows of one block, and every batch from one source: a batch touches four or five of its windows, more
    than its dataset allocated at the open, and the pipeline adds buffers rather than wait for one that never
    comes back; every sample still comes once per epoch of its source, on one rank and on two."""
    n = SIZES["books"][0]
    for world in (1, 2):
        mixes = open_ranks(paths, world, weights={"web": 0, "code": 0, "books": 1}, read_ahead=ahead, window_blocks=1)
        assert [m.datasets["books"].describe()["window_buffers"] for m in mixes] == [1] * world
        its = [iter(m) for m in mixes]
        got = [[i for _ in range(12) for i in next(it)["idx"].tolist()] for it in its]
        assert all(m.datasets["books"].describe()["window_buffers"] >= 4 for m in mixes)
        at = [0] * world
        for epoch in range(3):
            shares = np.diff(share_bounds(n, world, epoch))
            seen = sorted(i for r in range(world) for i in got[r][at[r]:at[r] + shares[r]])
            assert seen == list(range(OFFSET["books"], OFFSET["books"] + n)), f"epoch {epoch} exactly once"
            at = [a + int(z) for a, z in zip(at, shares)]
        for m in mixes:
            m.close()


def test_a_resume_from_ranks_a_sample_apart_reads_nothing_twice(paths):
    """3 ranks stopped where some are a sample ahead of others in a source, resumed on 2, then on 4 inside the
    dealt-out rest: nothing read twice (the old dealing-out re-read up to W - 1 + M - 1 samples of each source
    per resume: the ranks a sample ahead, and the padding of the shorter new shares)."""
    legs, state = [], None
    for world, cut in ((3, 7), (2, 2), (4, 30)):
        out, start, state = run_leg(paths, world, cut, state)
        legs.append((out, start))
    assert any(len(s.hops) == 2 for s in legs[2][1].values()), "the last resume fell inside a dealt-out rest"
    check_no_repeat(legs, state)
    check_once_per_epoch(legs, state)


def test_a_state_of_other_sources_or_other_data_is_refused_naming_them(paths, tmp_path):
    _, state = run(paths, 1, 3)
    other = {**paths, "code": write(str(tmp_path / "other.gds"), "code", 31, 3)}
    changed = labelled(31)
    changed["idx"] += OFFSET["code"]
    changed["x"][5] += 1  # one sample differs: same shapes, same layout, other content
    write_dataset(str(tmp_path / "changed.gds"), {f: ArraySource(f, a) for f, a in changed.items()},
                  samples_per_block=3, progress=False)
    cases = [({"web": paths["web"], "code": paths["code"]}, "'sources'"),
             ({**paths, "code": str(tmp_path / "changed.gds")}, r"datasets\['code'\]\.content_sha256")]
    for sources, match in cases:
        (m,) = open_ranks(sources, 1, weights=None)
        with pytest.raises(StateError, match=match):
            m.load_state_dict(state)
        m.close()
    (m,) = open_ranks(other, 1)
    m.load_state_dict(state)  # the same data written again: its fingerprint is the same
    m.close()
    (m,) = open_ranks(paths, 1, seed=2)
    with pytest.raises(StateError, match="'seed'"):
        m.load_state_dict(state)
    m.close()
    (m,) = open_ranks(paths, 1)
    far = {**state["positions"], "web": {**state["positions"]["web"], "world_size": 999}}
    for key, value, match in (("step", -1, "'step'"), ("positions", {}, "'positions'"), ("rank", 5, "'rank'"),
                              ("schedule", {**state["schedule"], "start": 99}, "schedule.start"),
                              ("positions", far, r"source 'web'.*'positions\['web'\]'.*world_size")):
        with pytest.raises(StateError, match=match):
            m.load_state_dict({**state, key: value})
    with pytest.raises(TypeError):
        m.load_state_dict([state])
    m.close()
    (m,) = open_ranks(paths, 1, batch_size=12)  # counts in other units: a new segment from the saved step
    with pytest.warns(UserWarning, match="saved with batch_size=8, .* resumed with batch_size=12, .* from step 3 "
                                         "the batches differ .* no sample skipped or repeated"):
        m.load_state_dict(state)
    assert m.state_dict()["schedule"] == {**state["schedule"], "start": 3, "counts": dict.fromkeys(SIZES, 0)}
    assert len(next(iter(m))["idx"]) == 12
    m.close()


def test_a_position_is_only_loaded_into_the_source_it_was_saved_for(paths):
    """Two sources' positions swapped were accepted: one source repeated samples, another skipped as many. Each
    position now names its source and the fingerprint of that source's dataset; a swapped one, or one taken
    from another source's entry, is refused naming the source, and the mixture is left where it stood."""
    _, state = run(paths, 1, 5)
    p = state["positions"]
    assert p["web"]["source"] == "web" and len(p["web"]["fingerprint"]) == 64
    assert {n: q["fingerprint"] for n, q in p.items()} == {
        n: hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        for n, d in state["datasets"].items()}
    (m,) = open_ranks(paths, 1)
    swapped = {**p, "web": p["code"], "code": p["web"]}
    renamed = {**p, "web": {**p["code"], "source": "web"}}  # code's counts under web's name
    stranger = {**p, "books": {**p["books"], "source": "news"}}
    for positions, match in ((swapped, r"'positions\['web'\]\.source': this position is source 'code''s, not "
                                       r"'web''s \(positions swapped"),
                             (renamed, r"'positions\['web'\]\.fingerprint': .* is the fingerprint of source "
                                       r"'code''s dataset, not of source 'web''s"),
                             (stranger, r"'positions\['books'\]\.source': .* 'news', a source this mixture does "
                                        "not have")):
        with pytest.raises(StateError, match=match):
            m.load_state_dict({**state, "positions": positions})
        assert m.step == 0 and m.state_dict()["positions"]["web"]["samples"] == 0, "nothing changed"
    datasets = {**state["datasets"], "web": state["datasets"]["code"], "code": state["datasets"]["web"]}
    with pytest.raises(StateError, match=r"'datasets\['web'\]\.num_samples'.*it is source 'code''s \(swapped"):
        m.load_state_dict({**state, "datasets": datasets})
    m.load_state_dict(state)
    assert m.step == 5
    m.close()


@pytest.mark.parametrize("key", ["step", "batch_size", "world_size", "rank", "schedule.start", "schedule.counts",
                                 "positions.epoch", "positions.samples", "positions.world_size",
                                 "positions.window_blocks"])
def test_every_number_of_a_state_is_range_checked(paths, key):
    """A position's epoch or samples of 10**30 was accepted: every number of a state is refused beyond 2**63 - 1
    (as GDSDataset's arguments; the position's world size beyond the source's blocks), naming the key."""
    _, state = run(paths, 1, 2)
    huge = 10**30
    if key.startswith("positions."):
        name = key.split(".")[1]
        bad = {**state, "positions": {**state["positions"], "web": {**state["positions"]["web"], name: huge}}}
        match = rf"'positions\['web'\]\.{name}': expected an int from \d+ to {2**63 - 1}, found {huge}"
    elif key.startswith("schedule."):
        name = key.split(".")[1]
        value = huge if name == "start" else {**state["schedule"]["counts"], "web": huge}
        bad = {**state, "schedule": {**state["schedule"], name: value}}
        match = rf"'schedule\.{name}"
    else:
        bad, match = {**state, key: huge}, rf"'{key}': expected an int from \d+ to \d+, found {huge}"
    (m,) = open_ranks(paths, 1)
    with pytest.raises(StateError, match=match):
        m.load_state_dict(bad)
    assert m.step == 0
    m.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 24))
def test_a_resume_after_an_elastic_one_yields_the_uninterrupted_run(paths, cut):
    """After a resume from 3 ranks onto 2, a checkpoint at any later step (inside the dealt-out rest, or past
    it, where ranks begin their next epochs a sample apart) resumes on 2 batch for batch."""
    _, state = run(paths, 3, 7)
    full, end = run(paths, 2, 24, state=state)
    first, mid = run(paths, 2, cut, state=state)
    rest, resumed_end = run(paths, 2, 24 - cut, state=mid)
    assert [a + b for a, b in zip(first, rest)] == full and resumed_end == end


def unbound(state: dict, fmt: int) -> dict:
    """``state`` as a release before positions named their source saved it (mixture_format 1 or 2)."""
    return {**state, "mixture_format": fmt, "positions": {n: {k: v for k, v in p.items() if k not in
                                                              ("source", "fingerprint")}
                                                          for n, p in state["positions"].items()}}


def test_a_state_of_a_previous_format_resumes_unless_inside_a_padded_rest(paths):
    """mixture_format 2 (positions without their source) resumes, warning that whose each position is goes
    unchecked; so do mixture_format 1's positions without hops, which mean what they mean now; one inside a
    rest of an epoch dealt out with padding is refused, naming the source; another format too."""
    _, state = run(paths, 2, 5)
    assert state["mixture_format"] == 3
    want, _ = run(paths, 2, 3, state=state)
    for fmt in (2, 1):
        with pytest.warns(UserWarning, match=f"mixture_format {fmt} .*whose each position is cannot be checked"):
            got, _ = run(paths, 2, 3, state=unbound(state, fmt))
        assert got == want
    hop = {"world_size": 3, "batch_size": 1, "window_blocks": 1, "batches": 2}
    old = unbound(state, 1)
    inside = {**old, "positions": {**old["positions"], "code": {**old["positions"]["code"], "hops": [hop]}}}
    (m,) = open_ranks(paths, 1)
    with pytest.raises(StateError, match=r"'positions\['code'\]': a position of mixture_format 1 inside the rest"):
        m.load_state_dict(inside)
    shifted = {**state, "positions": {**state["positions"], "code": {**state["positions"]["code"],
                                                                      "hops": [{**hop, "shift": 3}]}}}
    with pytest.raises(StateError, match=r"source 'code'.*'hops\[0\]\.shift': expected an int from 0 to 2"):
        m.load_state_dict(shifted)
    for fmt in (4, True, "3"):
        with pytest.raises(StateError, match="mixture_format 3"):
            m.load_state_dict({**state, "mixture_format": fmt})
    with pytest.raises(StateError, match=r"'positions\['web'\]': expected a dict with keys \['epoch'"):
        m.load_state_dict({**state, "mixture_format": 2})  # positions that name their source: not format 2's
    m.close()


def test_a_flag_that_is_not_a_bool_is_refused_naming_the_source(paths):
    """shuffle="no" shuffled every source (a non-empty string is true)."""
    for options, source in (({"shuffle": "no"}, "web"), ({"books": {"path": paths["books"], "shuffle": "yes"}},
                                                         "books")):
        sources = {**paths, **{k: v for k, v in options.items() if k in paths}}
        kw = {k: v for k, v in options.items() if k not in paths}
        with pytest.raises(TypeError, match=f"^source '{source}': shuffle must be True or False \\(found str"):
            Mixture(sources, batch_size=8, backend="cpu", **kw)


def test_sources_must_read_the_same_fields_unless_whole_batches(paths, tmp_path):
    ints = write(str(tmp_path / "ints.gds"), "books", 17, 2, dtype="int32")
    with pytest.raises(ValueError, match="source 'books': field 'x' is int32 .* in source 'web' float32"):
        Mixture({**paths, "books": ints}, batch_size=8, backend="cpu")
    with pytest.raises(ValueError, match="source 'books': field 'x' is absent"):
        Mixture({**paths, "books": {"path": paths["books"], "fields": ["idx"]}}, batch_size=8, backend="cpu")
    renamed = {**paths, "books": {"path": paths["books"], "fields": {"x": "y", "idx": "idx"}}}
    with pytest.raises(ValueError, match="field 'x' is absent"):
        Mixture(renamed, batch_size=8, backend="cpu")
    with pytest.raises(ValueError, match="'source' would hide"):
        Mixture({**paths, "books": {"path": paths["books"], "fields": {"x": "source"}}}, batch_size=8,
                backend="cpu")
    with Mixture({**paths, "books": ints}, WEIGHTS, batch_size=8, backend="cpu", whole_batches=True,
                 seed=3) as mix:
        got = [(set(b["source"].tolist()), b["x"].dtype, len(b["idx"])) for _, b in zip(range(40), mix)]
    assert all(len(s) == 1 and n == 8 for s, _, n in got), "each batch one whole batch of one source"
    assert {d for s, d, _ in got if s == {2}} == {np.dtype("int32")}
    counts = np.cumsum([[s == {i} for i in range(3)] for s, _, _ in got], axis=0)
    target = np.array([0.6, 0.25, 0.15]) * np.arange(1, 41)[:, None]
    assert (abs(counts - target) < 1 + 1e-9).all(), "whole batches follow the weights within one"


def test_a_renamed_field_mixes_with_its_namesakes(paths, tmp_path):
    data = labelled(17)
    data = {"features": data["x"] + np.float32(OFFSET["books"] * 1000), "id": data["idx"] + OFFSET["books"]}
    path = str(tmp_path / "renamed.gds")
    write_dataset(path, {f: ArraySource(f, a) for f, a in data.items()}, samples_per_block=2, progress=False)
    sources = {**paths, "books": {"path": path, "fields": {"features": "x", "id": "idx"}}}
    out, _ = run(sources, 1, 40)
    check_epochs(out, 1)


def test_variable_length_fields_mix_by_sample(tmp_path):
    seqs = {name: sequences(n, seed=i) for i, (name, n) in enumerate([("a", 23), ("b", 11)])}
    paths = {}
    for name, s in seqs.items():
        paths[name] = str(tmp_path / f"{name}.gds")
        write_dataset(paths[name], {"idx": ArraySource("idx", np.arange(len(s)))},
                      ragged={"tokens": ragged_source(s)}, samples_per_block=4, progress=False)
    with Mixture(paths, {"a": 2, "b": 1}, batch_size=6, backend="cpu", shuffle=True, resident_bytes=0) as mix:
        for _, batch in zip(range(30), mix):
            off = batch["tokens/offsets"]
            assert off[0] == 0 and off[-1] == len(batch["tokens"]) and len(off) == 7
            for j, (i, s) in enumerate(zip(batch["idx"], batch["source"])):
                expected = seqs[mix.sources[s]][i]
                assert np.array_equal(batch["tokens"][off[j]:off[j + 1]], expected)
    with pytest.raises(ValueError, match="pad_to='max'"):
        Mixture(paths, batch_size=6, backend="cpu", pad_to="max")
    with Mixture(paths, batch_size=6, backend="cpu", pad_to=8) as mix:
        batch = next(iter(mix))
        assert batch["tokens"].shape == (6, 8) and batch["tokens/lengths"].shape == (6,)


def test_leaving_a_pass_stops_every_reader_and_the_next_pass_goes_on(paths):
    (whole,) = open_ranks(paths, 1)
    expected = [b["idx"].tolist() for _, b in zip(range(30), whole)]
    whole.close()
    (mix,) = open_ranks(paths, 1, num_batches=10)
    assert len(mix) == 10
    got = []
    for i, b in enumerate(mix):
        got.append(b["idx"].tolist())
        if i == 3:
            break
    assert wait_no_readers() == [], "leaving a pass early stops its sources' readers"
    got += [b["idx"].tolist() for b in mix]  # the rest of that pass
    assert len(got) == 10
    got += [b["idx"].tolist() for b in mix]
    assert got == expected[:20] and mix.step == 20
    stats = mix.stats
    assert stats.batches == 20 and stats.samples == 160 and stats.wall_s > 0
    assert sum(s.samples for s in stats.sources.values()) == 160 and stats.sources["web"].bytes > 0
    assert set(stats.as_dict()["sources"]) == set(SIZES)
    mix.close()
    assert wait_no_readers() == []
    with pytest.raises(Exception, match="closed"):
        iter(mix)
    (endless,) = open_ranks(paths, 1)
    with pytest.raises(TypeError, match="endless"):
        len(endless)
    endless.close()


def test_weights_from_a_function_of_the_step_resume_exactly(paths):
    def schedule(step):
        return WEIGHTS if step < 12 else {"web": 1, "code": 1, "books": 2}

    full, _ = run(paths, 2, 30, weights=schedule)
    check_counts(full, {"web": 1, "code": 1, "books": 2}, start=12)
    first, state = run(paths, 2, 17, weights=schedule)
    assert state["schedule"]["start"] == 12
    rest, _ = run(paths, 2, 13, state=state, weights=schedule)
    assert [a + b for a, b in zip(first, rest)] == full


def test_bad_arguments_are_refused_naming_them(paths):
    for kwargs, error, match in [({"batch_size": 0}, ValueError, "batch_size"),
                                 ({"batch_size": 8, "drop_last": True}, ValueError, "drop_last"),
                                 ({"batch_size": 8, "whole_batches": 1}, TypeError, "whole_batches"),
                                 ({"batch_size": 8, "no_such": 1}, TypeError, "source 'web'")]:
        with pytest.raises(error, match=match):
            Mixture(paths, backend="cpu", **kwargs)
    with pytest.raises(TypeError, match="sources"):
        Mixture([paths["web"]], batch_size=8)
    with pytest.raises(ValueError, match="source 'web'.*world_size"):
        Mixture(paths, batch_size=8, backend="cpu", rank=0, world_size=20)
    with pytest.raises(ValueError, match="missing"):
        Mixture(paths, {"web": 1}, batch_size=8, backend="cpu")
    assert wait_no_readers() == []


def test_torch_output(paths):
    torch = pytest.importorskip("torch")
    with Mixture(paths, WEIGHTS, batch_size=8, backend="cpu", output="torch", resident_bytes=0) as mix:
        batch = next(iter(mix))
    assert isinstance(batch["x"], torch.Tensor) and batch["source"].dtype == torch.int64
    assert torch.equal(batch["x"][:, 0, 0], batch["idx"].to(torch.float32) * 1000)


@pytest.mark.gpu
def test_a_mixture_of_the_three_gpu_backends_serves_every_sample_exactly(paths):
    """RAM tier, pinned and kvikio sources in one mixture: every sample's bytes as written, the counts as the
    weights say, everything on the device."""
    import cupy

    sources = {"web": {"path": paths["web"], "backend": "mmap"}, "code": {"path": paths["code"], "backend": "pinned"},
               "books": {"path": paths["books"], "backend": "kvikio"}}
    seen: Counter = Counter()
    with Mixture(sources, WEIGHTS, batch_size=20, seed=1, shuffle=True, resident_bytes=0, num_batches=12) as mix:
        assert [ds.backend_name for ds in mix.datasets.values()] == ["mmap", "pinned", "kvikio"]
        for batch in mix:
            assert all(isinstance(a, cupy.ndarray) for a in batch.values())
            idx, x, src = (cupy.asnumpy(batch[k]) for k in ("idx", "x", "source"))
            np.testing.assert_array_equal(x, (idx.reshape(-1, 1, 1) * 1000 + np.arange(15).reshape(3, 5)))
            for j, s in enumerate(src.tolist()):
                name = mix.sources[s]
                assert OFFSET[name] <= idx[j] < OFFSET[name] + SIZES[name][0]
                seen[name] += 1
    assert seen == {"web": 144, "code": 60, "books": 36}  # 0.6 / 0.25 / 0.15 of 12 batches of 20


# -- batches made ahead (host arrays) ----------------------------------------------------------------------------
@pytest.mark.parametrize("whole", [False, True])
def test_batches_made_ahead_are_those_made_in_the_consumers_thread(paths, whole):
    """The same batches and states with the maker thread (the default for host arrays) as without, across a
    weight change, a function of the step and a resume on another number of ranks."""
    (probe,) = open_ranks(paths, 1)
    assert probe.read_ahead == 2
    probe.close()
    later = (9, {"web": 1, "code": 2, "books": 3})
    for kw in ({"change": later}, {"weights": lambda s: WEIGHTS if s < 7 else {"web": 1, "code": 0, "books": 1}}):
        now = [run(paths, 2, 23, whole_batches=whole, read_ahead=ra, **kw) for ra in (0, 2, 5)]
        assert now[0] == now[1] == now[2]
        resumed = [run(paths, 3, 11, state=now[0][1], whole_batches=whole, read_ahead=ra) for ra in (0, 3)]
        assert resumed[0] == resumed[1]


def test_a_weight_change_drops_what_was_read_ahead(paths):
    """The schedule is made ahead, step by step, as far as the pipeline reads; a weight change stops that
    pipeline and the next batch follows the new weights."""
    asked = []

    def weights(step):
        asked.append(step)
        return WEIGHTS
    (mix,) = open_ranks(paths, 1, read_ahead=4, weights=weights)
    it = iter(mix)
    first = [next(it)["source"].tolist() for _ in range(3)]
    deadline = time.monotonic() + 5
    while max(asked) < 3 + 4 and time.monotonic() < deadline:  # read ahead of the consumer
        time.sleep(0.01)
    assert max(asked) >= 3 + 4 and asked[1:9] == list(range(8)), "made once per step, in order (after the open's)"
    mix.set_weights({"web": 0, "code": 0, "books": 1})
    assert wait_no_readers() == [], "the pipeline reading under the old weights stopped"
    assert all(s == 2 for s in next(it)["source"].tolist()), "the next batch follows the new weights"
    assert mix.stats.batches == 4 and mix.stats.samples == 32 == sum(s.samples for s in mix.stats.sources.values())
    assert mix.state_dict()["step"] == 4 and mix.stats.stall_s >= 0 and len(first) == 3
    mix.close()
    assert wait_no_readers() == []


def test_an_error_made_ahead_surfaces_in_the_consumer_naming_the_file(paths, tmp_path):
    books = write(str(tmp_path / "books.gds"), "books", *SIZES["books"])
    shards = sorted(glob.glob(os.path.join(books, "x", "c", "**", "*"), recursive=True))
    shards = [f for f in shards if os.path.isfile(f)]
    before = set(threading.enumerate())
    (mix,) = open_ranks({**paths, "books": books}, 1, read_ahead=3)
    with open(shards[-1], "r+b") as f:  # damaged after the open read its index
        f.truncate(10)
    got = 0
    with pytest.raises(ReadError) as info:
        for _ in mix:
            got += 1
    assert shards[-1] in str(info.value)
    assert wait_no_readers() == [], "the maker and every source's readers stopped"
    mix.close()
    assert threads_left_since(before) == []


def test_close_from_another_thread_ends_a_pass_waiting_for_batches_made_ahead(paths):
    (mix,) = open_ranks(paths, 1, read_ahead=2)
    it = iter(mix)
    next(it)
    closer = threading.Timer(0.05, mix.close)
    closer.start()
    with pytest.raises(GDSLoadError, match="closed"):
        for _ in range(100_000):
            next(it)
    closer.join()
    assert wait_no_readers() == []


def test_an_abandoned_mixture_is_collected_and_its_pipeline_ends(paths):
    (mix,) = open_ranks(paths, 1, read_ahead=2)
    before = set(threading.enumerate())
    it = iter(mix)
    next(it)
    started = [t for t in threading.enumerate() if t.name.startswith("gdsload-reader") and t not in before]
    assert len(started) == 3, "one pipeline: three threads, whatever the number of sources"
    del mix, it
    gc.collect()
    for t in started:
        t.join(5)
        assert not t.is_alive()
    assert wait_no_readers(5) == []
