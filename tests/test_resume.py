"""Elastic resume: a checkpoint taken on N ranks continues on M (and under another batch size or window), every
sample of the epoch delivered once. Pure plans first (a property test), then the dataset in one process,
then real processes, then the state's checks."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import labelled
from gdsload import GDSDataset
from gdsload.pipeline.plan import PlanConfig, epoch_plan
from gdsload.pipeline.position import Cursor, resume
from gdsload.pipeline.legs import rest_shares
from gdsload.pipeline.resume import (HOP_KEYS, MAX_HOPS, Fingerprint, Hop, StateError, leg_plans, make_state,
                                     merge_states)

Dataset = functools.partial(GDSDataset, backend="cpu", resident_bytes=32 << 10)  # "idx" resident, "x" windowed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP = Fingerprint({"x": "float32 ()"}, {"x": "0" * 64}, {"x": "1" * 64})


# -- pure: plans of the legs of an epoch ---------------------------------------------------------------
def real_length(ids: np.ndarray) -> int:
    """Positions before the padding: padding repeats samples already in the stream, and only at its end."""
    _, first = np.unique(ids, return_index=True)
    real = len(first)
    assert np.array_equal(np.sort(first), np.arange(real)), "distinct samples first, repeats only after"
    return real


@dataclass
class LegRun:
    plans: list  # every rank's plan of the leg
    start: int  # the batch the ranks started at
    stop: int  # the batch they stopped at (the checkpoint)
    hops: tuple  # the epoch's earlier legs


def run_legs(n, k, seed, shuffle, drop_last, legs, epoch=3) -> list[LegRun]:
    """Run an epoch in legs ``(world_size, batch_size, window_blocks, batches taken or None for the rest)``,
    every leg resumed through ``resume()`` from rank 0's state as a dataset does."""
    state, out = None, []
    for world, b, w, take in legs:
        plans, starts, cursors = [], [], []
        for r in range(world):
            cfg = PlanConfig(num_samples=n, samples_per_block=k, batch_size=b, window_blocks=w, shuffle=shuffle,
                             seed=seed, drop_last=drop_last, rank=r, world_size=world)
            cursor = Cursor(epoch) if state is None else resume(state, cfg, FP)
            start = cursor.batch
            plans.append(cursor.plan or epoch_plan(cfg, epoch))
            starts.append(start)
            cursors.append(cursor)
        assert len(set(starts)) == 1 and len({c.hops for c in cursors}) == 1
        batches = {p.num_batches for p in plans}
        assert len(batches) == 1, "every rank yields the same number of batches"
        start, nb = starts[0], batches.pop()
        stop = nb if take is None else min(nb, start + take)
        out.append(LegRun(plans, start, stop, cursors[0].hops))
        state = make_state(plans[0].config, FP, epoch, stop, cursors[0].hops)
        state = json.loads(json.dumps(state))  # what a checkpoint file gives back
    return out


def check_plan(plan, window_blocks, drop_last):
    """Structure every plan has, fresh or resumed; returns its sample ids and its positions before padding."""
    ids = plan.sample_ids()
    assert (np.diff(plan.window_of) >= 0).all()
    for w, blocks in enumerate(plan.windows):
        assert 1 <= len(blocks) <= window_blocks and len(np.unique(blocks)) == len(blocks)
        mine = plan.window_of == w
        assert mine.any(), "no window is read for nothing"
        assert set((ids[mine] // plan.config.samples_per_block).tolist()) <= set(blocks.tolist())
    real = real_length(ids)
    if drop_last:
        assert real == len(ids)
    elif real < len(ids):
        last = plan.window_of == len(plan.windows) - 1
        assert set(ids[real:].tolist()) <= set(ids[last].tolist()), "padding repeats the rank's own last window"
    b = plan.config.batch_size
    sizes = [hi - lo for lo, hi in map(plan.batch_bounds, range(plan.num_batches))]
    assert all(s == b for s in sizes[:-1]) and (not drop_last or all(s == b for s in sizes))
    return ids, real


def check_dealt(before, consumed, plans, streams, drop_last):
    """A new leg holds what the last left (rank after rank, padding excluded), in consecutive equal shares,
    each window keeping the old order (exactly the old order when the windows did not shrink). Returns the
    samples it drops (drop_last)."""
    rest = np.concatenate([ids[min(consumed, real):real] for ids, real in before.streams])
    new = [ids[:real] for ids, real in streams]
    dealt = np.concatenate(new)
    world, b = plans[0].config.world_size, plans[0].config.batch_size
    if drop_last:
        assert len(rest) - len(dealt) < world * b and len(dealt) % (world * b) == 0
    else:
        assert len(dealt) == len(rest) and max(map(len, new)) - min(map(len, new)) <= 1
    position = {s: i for i, s in enumerate(rest.tolist())}
    shrunk = plans[0].config.window_blocks < max(len(x) for p in before.plans for x in p.windows)
    lo = 0
    for p, share in zip(plans, new):
        at = np.array([position[s] for s in share.tolist()], dtype=np.int64)
        assert np.array_equal(np.sort(at), np.arange(lo, lo + len(at))), "the next consecutive share"
        lo += len(at)
        for w in range(len(p.windows)):
            assert (np.diff(at[p.window_of[:len(at)] == w]) > 0).all(), "a window keeps the old order"
        assert shrunk or (np.diff(at) > 0).all(), "windows as large as before: the old order exactly"
    return len(rest) - len(dealt)


@dataclass
class Leg:
    plans: list
    streams: list


@st.composite
def epochs(draw, samples: int, block: int, world: int, batch: int, window: int, flags: int):
    """An epoch cut into legs: (samples, samples per block, seed, ``flags`` booleans, legs), each leg (world size,
    batch size, window blocks, batches taken; the last leg None: to the end), every number up to the bound
    named."""
    n = draw(st.integers(1, samples))
    k = draw(st.integers(1, block))
    worlds = st.integers(1, min(-(-n // k), world))
    legs = [(draw(worlds), draw(st.integers(1, batch)), draw(st.integers(1, window)), draw(st.integers(0, 9)))
            for _ in range(draw(st.integers(1, 3)))]
    legs.append((draw(worlds), draw(st.integers(1, batch)), draw(st.integers(1, window)), None))
    return (n, k, draw(st.integers(0, 99)), *[draw(st.booleans()) for _ in range(flags)], legs)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(epochs(samples=300, block=12, world=6, batch=40, window=6, flags=2))
def test_every_sample_once_over_legs(case):
    """Legs on any world sizes, batch sizes and windows, cut anywhere: every sample of the epoch is yielded
    once, plus exactly the padding positions the ranks reached (with drop_last: none twice, and exactly the
    samples the legs drop are missing); the rest of the epoch keeps its order as it is dealt out again."""
    n, k, seed, shuffle, drop_last, legs = case
    got, padding, pool = [], 0, set()
    dropped: dict[int, int] = {}  # by the leg after h hops (a leg that took nothing is replaced)
    by_hops: dict[int, Leg] = {}  # the latest leg after h hops
    for (world, b, w, _), run in zip(legs, run_legs(n, k, seed, shuffle, drop_last, legs)):
        streams = [check_plan(p, w, drop_last) for p in run.plans]
        h = len(run.hops)
        if h == 0:
            pool = set(np.concatenate([ids[:real] for ids, real in streams]).tolist())
            assert sum(len(ids) - real for ids, real in streams) <= world * k
        elif run.start == 0:  # a new leg, from what the one before it left
            last = run.hops[-1]
            dropped[h] = check_dealt(by_hops[h - 1], last.batches * last.batch_size, run.plans, streams, drop_last)
            assert sum(len(ids) - real for ids, real in streams) <= world - 1
        by_hops[h] = Leg(run.plans, streams)
        for ids, real in streams:
            got.extend(ids[run.start * b:run.stop * b].tolist())
            padding += max(0, min(run.stop * b, len(ids)) - max(real, run.start * b))
    counts = Counter(got)
    if drop_last:
        assert max(counts.values(), default=1) == 1, "drop_last: nothing twice"
        assert set(counts) <= pool and len(counts) == len(pool) - sum(dropped.values())
    else:
        assert set(counts) == set(range(n)), "every sample"
        assert len(got) == n + padding, "once each, plus the padding reached"


def test_new_leg_deals_out_the_rest_in_order():
    """3 ranks take 2 batches of 4, then 2 ranks take the rest: a worked example (docs/multi-gpu.md)."""
    n, k = 60, 5  # 12 blocks: 4 per rank, 20 samples each
    run = run_legs(n, k, 0, False, False, [(3, 4, 2, 2), (2, 4, 2, None)], epoch=0)
    old, new, (start, stop) = run[0].plans, run[1].plans, (run[1].start, run[1].stop)
    assert [p.sample_ids()[:8].tolist() for p in old] == [list(range(8)), list(range(20, 28)), list(range(40, 48))]
    # left: 8..19, 28..39, 48..59 (36 samples): 18 each, in that order
    rest = [*range(8, 20), *range(28, 40), *range(48, 60)]
    assert [p.sample_ids().tolist() for p in new] == [rest[:18], rest[18:]]
    assert (start, stop) == (0, 5)
    # the rest of the old windows, packed in order into windows of 2 blocks; block 6 is on the boundary:
    # both ranks read it, each for its own samples
    assert [b.tolist() for b in new[0].windows] == [[1], [2, 3], [5, 6]]
    assert [b.tolist() for b in new[1].windows] == [[6, 7], [9], [10, 11]]
    assert new[0].config.world_size == 2 and [p.config.rank for p in new] == [0, 1]


def test_unchanged_settings_continue_the_same_plan():
    cfg = PlanConfig(num_samples=500, samples_per_block=7, batch_size=16, window_blocks=3, shuffle=True, seed=4,
                     rank=1, world_size=2)
    cursor = resume(make_state(cfg, FP, 2, 9), cfg, FP)
    assert cursor == Cursor(2, 9, fixed=True) and cursor.plan is None, "the plain resume: the ordinary plan, from 9"
    later = PlanConfig(**{**cfg.__dict__, "world_size": 3, "rank": 0})
    cursor = resume(make_state(cfg, FP, 2, 0), later, FP)
    assert cursor == Cursor(2, 0, fixed=True), "nothing read in the epoch: a fresh epoch under the new settings"
    cursor = resume(make_state(cfg, FP, 2, 9), later, FP)
    assert cursor.hops == (Hop(2, 16, 3, 9),) and cursor.batch == 0
    assert np.array_equal(cursor.plan.sample_ids(), leg_plans(later, 2, cursor.hops)[0].sample_ids())
    again = resume(make_state(later, FP, 2, 4, cursor.hops), later, FP)
    assert again.hops == cursor.hops and again.batch == 4, "same settings again: the leg goes on"


def test_leg_at_an_epoch_end_leaves_nothing():
    cfg = PlanConfig(num_samples=100, samples_per_block=10, batch_size=8, window_blocks=2, world_size=2)
    end = epoch_plan(cfg, 0).num_batches
    cursor = resume(make_state(cfg, FP, 0, end), PlanConfig(**{**cfg.__dict__, "world_size": 3}), FP)
    assert cursor.batch == 0 and cursor.plan.num_batches == 0 and not cursor.plan.windows


def test_fewer_samples_left_than_ranks():
    cfg = PlanConfig(num_samples=40, samples_per_block=4, batch_size=3, window_blocks=2, world_size=2)
    plans = [epoch_plan(PlanConfig(**{**cfg.__dict__, "rank": r}), 0) for r in range(2)]
    last = plans[0].num_batches - 1  # one batch of 2 samples left on each rank: 4 samples for 6 ranks
    wide = PlanConfig(**{**cfg.__dict__, "world_size": 6, "batch_size": 5})
    new = leg_plans(wide, 0, [Hop(2, 3, 2, last)])
    ids = [p.sample_ids().tolist() for p in new]
    assert all(len(x) == 1 for x in ids)
    rest = plans[0].sample_ids()[last * 3:].tolist() + plans[1].sample_ids()[last * 3:].tolist()
    assert [x[0] for x in ids] == rest + [rest[-1]] * 2, "ranks left without a sample repeat the last one"


def test_hops_are_bounded():
    """A state records at most MAX_HOPS earlier legs; one more change of settings in that epoch is refused."""
    one = PlanConfig(num_samples=1000, samples_per_block=1, batch_size=1, window_blocks=1)
    two = PlanConfig(**{**one.__dict__, "world_size": 2})
    hops = [Hop(1 + i % 2, 1, 1, 1) for i in range(MAX_HOPS)]
    last = one if MAX_HOPS % 2 == 0 else two
    cursor = resume(make_state(last, FP, 0, 1, hops), last, FP)
    assert len(cursor.hops) == MAX_HOPS and cursor.batch == 1, "the same settings: the last leg goes on"
    other = two if last is one else one
    with pytest.raises(ValueError, match=f"already read in {MAX_HOPS + 1} legs"):
        resume(make_state(last, FP, 0, 1, hops), other, FP)
    assert resume(make_state(last, FP, 0, 0, hops), other, FP).hops == tuple(hops), "an empty leg is replaced"


# -- the dataset, one process ----------------------------------------------------------------------------
@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


def take(ds, batches, data, epoch=None):
    """Up to ``batches`` batches (None: the rest of the pass), every byte checked against the source."""
    if epoch is not None:
        ds.set_epoch(epoch)
    ids = []
    for i, b in enumerate(ds):
        np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])
        ids.append(b["idx"])
        if batches is not None and i + 1 == batches:
            break
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def run_elastic(path, data, legs, **opts):
    """Legs ``(world_size, options, batches or None)`` of epoch 1, each rank a dataset of its own, every
    rank's state merged at a checkpoint; then epoch 2 on the last leg's ranks. Returns the ids per leg and
    rank, and the datasets' configs of the last leg with their epoch-2 ids."""
    state, per_leg, last = None, [], []
    for world, leg_opts, batches in legs:
        states, ids = [], []
        for r in range(world):
            with Dataset(path, rank=r, world_size=world, **{**opts, **leg_opts}) as ds:
                if state is None:
                    ds.set_epoch(1)
                else:
                    ds.load_state_dict(copy.deepcopy(state))
                ids.append(take(ds, batches, data))
                states.append(ds.state_dict())
                if batches is None:
                    last.append((ds.config, take(ds, None, data, epoch=2)))
        assert len({len(x) for x in ids}) == 1 or batches is None
        state = merge_states(states)
        per_leg.append(ids)
    return per_leg, last


@pytest.mark.parametrize("legs, opts", [
    ([(3, {}, 4), (2, {}, None)], {"batch_size": 16, "shuffle": True, "seed": 3}),  # default windows: N-dependent
    ([(2, {}, 5), (4, {"batch_size": 8}, None)], {"batch_size": 16, "shuffle": True, "seed": 1}),  # global 32 kept
    ([(4, {"window_blocks": 4}, 3), (1, {"window_blocks": 2, "batch_size": 50}, None)], {"batch_size": 10}),
    ([(1, {}, 7), (3, {"window_blocks": 1}, 2), (2, {}, None)], {"batch_size": 20, "shuffle": True}),
    ([(3, {}, 4), (2, {"batch_size": 12}, None)], {"batch_size": 16, "shuffle": True, "drop_last": True}),
])
def test_dataset_resumes_on_other_ranks(data_path, legs, opts):
    path, data = data_path
    per_leg, last = run_elastic(path, data, legs, **opts)
    got = np.concatenate([np.concatenate(x) for x in per_leg])
    counts = Counter(got.tolist())
    if opts.get("drop_last"):
        assert max(counts.values()) == 1 and len(counts) > 997 - 3 * (8 + 16) - 2 * 12
    else:
        assert set(counts) == set(range(997)) and len(got) - 997 < legs[0][0] * 8 + sum(w for w, _, _ in legs)
    for cfg, ids in last:  # the epoch after: exactly a fresh run on the new ranks
        np.testing.assert_array_equal(ids, epoch_plan(cfg, 2).sample_ids())


def test_resumed_leg_is_not_the_pass_read_ahead(data_path):
    """A dataset reading epoch 1 ahead (fresh plan, batch 0) is given a state of epoch 1 at batch 0 of a new
    leg: it must read the leg's own plan, not the one read ahead."""
    path, data = data_path
    opts = dict(batch_size=16, shuffle=True, seed=2)
    with Dataset(path, rank=0, world_size=1, **opts) as one:
        head = take(one, 10, data, epoch=1)
        state = one.state_dict()
    with Dataset(path, rank=1, world_size=2, **opts) as ds:
        take(ds, None, data, epoch=0)  # its threads now read epoch 1 ahead
        ds.load_state_dict(state)
        assert ds.state_dict()["hops"] == [{"world_size": 1, "batch_size": 16, "window_blocks": state["window_blocks"],
                                            "batches": 10}]
        rest = take(ds, None, data)
        want = leg_plans(ds.config, 1, [Hop(1, 16, state["window_blocks"], 10)])[1].sample_ids()
        np.testing.assert_array_equal(rest, want)
        assert not set(rest.tolist()) & set(head.tolist())
        assert len(ds) == len(rest) // 16 + (len(rest) % 16 > 0)
        np.testing.assert_array_equal(take(ds, None, data, epoch=2), epoch_plan(ds.config, 2).sample_ids())


def test_state_mid_leg_and_checkpoint_again(data_path):
    """A checkpoint in a resumed leg, resumed under the same settings, goes on in that leg."""
    path, data = data_path
    opts = dict(batch_size=16, shuffle=True, seed=2, window_blocks=3)
    with Dataset(path, rank=0, world_size=2, **opts) as a:
        take(a, 6, data, epoch=4)
        state = a.state_dict()
    with Dataset(path, rank=2, world_size=3, **opts) as b:
        b.load_state_dict(state)
        full = leg_plans(b.config, 4, [Hop(2, 16, 3, 6)])[2].sample_ids()
        head = take(b, 3, data)
        mid = b.state_dict()
    assert mid["hops"] == [{"world_size": 2, "batch_size": 16, "window_blocks": 3, "batches": 6}]
    assert (mid["epoch"], mid["batches_yielded"]) == (4, 3)
    with Dataset(path, rank=2, world_size=3, **opts) as c:
        c.load_state_dict(json.loads(json.dumps(mid)))
        np.testing.assert_array_equal(np.concatenate([head, take(c, None, data)]), full)


def test_state_after_a_pass_and_set_epoch(data_path):
    path, data = data_path
    with Dataset(path, batch_size=32, window_blocks=3) as ds:
        take(ds, None, data, epoch=0)
        ds.set_epoch(1)
        assert (ds.state_dict()["epoch"], ds.state_dict()["batches_yielded"]) == (1, 0), "nothing of epoch 1 yet"


def test_ragged_fields_resume_on_other_ranks(make_dataset):
    from gdsload.conversion.source_types import ArraySource, RaggedSource

    lengths = np.random.default_rng(0).integers(0, 9, 301)
    seqs = [(i * 100 + np.arange(m)).astype(np.int32) for i, m in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    path = make_dataset({"idx": np.arange(301)}, samples_per_block=4,
                        ragged={"tokens": RaggedSource("<t>", ArraySource("<t>", np.concatenate(seqs)), offsets)})
    opts = dict(backend="cpu", resident_bytes=0, shuffle=True, seed=1)
    seen, states = [], []
    for r in range(2):
        with GDSDataset(path, batch_size=8, rank=r, world_size=2, window_blocks=5, **opts) as ds:
            for i, b in enumerate(ds):
                seen.append((b["idx"], b["tokens"], b["tokens/offsets"]))
                if i == 6:
                    break
            states.append(ds.state_dict())
    for r in range(3):
        with GDSDataset(path, batch_size=6, rank=r, world_size=3, window_blocks=2, **opts) as ds:
            ds.load_state_dict(merge_states(states))
            seen.extend((b["idx"], b["tokens"], b["tokens/offsets"]) for b in ds)
    for idx, values, offs in seen:
        for j, i in enumerate(idx.tolist()):
            np.testing.assert_array_equal(values[offs[j]:offs[j + 1]], seqs[i])
    assert set(np.concatenate([s[0] for s in seen]).tolist()) == set(range(301))


# -- real processes: 3 ranks, then 2, then 4 -------------------------------------------------------------
WORKER = """
import json, sys
import numpy as np
from gdsload import GDSDataset
from gdsload.pipeline.plan import epoch_plan
path, source, batch_size, take, state_in, out = sys.argv[1:7]
x = np.load(source, mmap_mode="r")
ds = GDSDataset(path, batch_size=int(batch_size), backend="cpu", shuffle=True, seed=5, resident_bytes=4096)
if state_in:
    with open(state_in) as f:
        ds.load_state_dict(json.load(f))
else:
    ds.set_epoch(1)
def epoch(limit):
    ids, bad = [], 0
    for i, b in enumerate(ds):
        bad += int((b["x"].view(np.uint8) != x[b["idx"]].view(np.uint8)).sum())  # every byte of every sample
        ids.append(b["idx"])
        if limit and i + 1 == limit:
            break
    return np.concatenate(ids).tolist() if ids else [], bad, len(ids)
ids, bad, batches = epoch(int(take))
result = {"ids": ids, "bad_bytes": bad, "batches": batches, "state": ds.state_dict(),
          "rank": ds.config.rank, "world_size": ds.config.world_size}
if not int(take):
    ds.set_epoch(2)
    later, later_bad, _ = epoch(0)
    result["next_epoch_fresh"] = later == epoch_plan(ds.config, 2).sample_ids().tolist() and later_bad == 0
with open(out, "w") as f:
    json.dump(result, f)
"""


def test_processes_three_then_two_then_four(make_dataset, tmp_path):
    """Each rank a process (cpu backend, RANK / WORLD_SIZE from the environment): 3 ranks take 4 batches of
    16 and checkpoint, 2 ranks take 5 of 24 and checkpoint, 4 ranks take the rest in batches of 12 (the global
    batch stays 48; the default window follows the world size); then the epoch after on the 4."""
    data = labelled(1201, shape=(7,), dtype="int16")
    path = make_dataset(data, samples_per_block=8, shard_bytes=8 * 14 * 12)
    np.save(tmp_path / "x.npy", data["x"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    state, legs = "", []
    for leg, (world, batch_size, batches) in enumerate([(3, 16, 4), (2, 24, 5), (4, 12, 0)]):
        procs = []
        for r in range(world):
            out = tmp_path / f"leg{leg}-rank{r}.json"
            procs.append((out, subprocess.Popen(
                [sys.executable, "-c", WORKER, path, str(tmp_path / "x.npy"), str(batch_size), str(batches), state,
                 str(out)], env={**env, "RANK": str(r), "WORLD_SIZE": str(world)}, cwd=ROOT,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        results = []
        for out, p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.read_text()))
        assert [(r["rank"], r["world_size"]) for r in results] == [(r, world) for r in range(world)]
        assert all(r["bad_bytes"] == 0 for r in results)
        assert len({r["batches"] for r in results}) == 1, "every rank took the same batches"
        state = str(tmp_path / f"state{leg}.json")
        with open(state, "w") as f:
            json.dump(merge_states([r["state"] for r in results]), f)
        legs.append(results)
    assert [r["batches"] for r in legs[0]] == [4] * 3 and [r["batches"] for r in legs[1]] == [5] * 2
    got = [i for results in legs for r in results for i in r["ids"]]
    assert set(got) == set(range(1201)), "every sample"
    assert len(got) - 1201 < 3 * 8 + 2 + 4, "repeats: the first leg's padding and one sample per rank per leg"
    assert all(r["next_epoch_fresh"] for r in legs[2])
    with open(state) as f:
        final = json.load(f)
    assert final["epoch"] == 1 and [h["world_size"] for h in final["hops"]] == [3, 2]


def test_check_ranks_elastic_on_cpu(tmp_path):
    """benchmarks.check_ranks's elastic mode, tiny: launches the ranks itself, checks union and bytes."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.check_ranks", "--elastic", "3,2,4",
                          "--cut", "2,1", "--samples", "130", "--batch-size", "8", "--backend", "cpu",
                          "--data", str(tmp_path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    (summary_file,) = (tmp_path / "out").glob("elastic-*.json")
    summary = json.loads(summary_file.read_text())
    assert summary["ok"] and summary["every_sample_read"] and summary["mismatched_bytes"] == 0


# -- the state's checks -----------------------------------------------------------------------------------
@pytest.fixture
def saved(data_path):
    path, data = data_path
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        take(ds, 5, data, epoch=1)
        state = ds.state_dict()
    return path, state


def refused(path, state, match, error=ValueError, **opts):
    with Dataset(path, **{"batch_size": 32, "window_blocks": 3, "shuffle": True, "seed": 1, **opts}) as ds:
        before = ds.state_dict()
        with pytest.raises(error, match=match):
            ds.load_state_dict(state)
        assert ds.state_dict() == before, "a refused state changes nothing"


def test_state_is_small_and_plain(saved):
    _, state = saved
    assert list(state) == ["state_format", "epoch", "batches_yielded", "hops", "num_samples", "samples_per_block",
                           "batch_size", "window_blocks", "shuffle", "seed", "drop_last", "rank", "world_size",
                           "fields", "index_sha256", "content_sha256", "exact_shares"]
    assert state["fields"] == {"x": "float32 (3, 5)", "idx": "int64 ()"}
    assert len(json.dumps(state)) < 800  # two sha256 per field read, the rest a few ints


@pytest.mark.parametrize("bad, error, match", [
    (None, TypeError, "must be a dict.*found NoneType"),
    ("state", TypeError, "found str"),
    ([("epoch", 1)], TypeError, "found list"),
    ({"epoch": 1, "batches_yielded": 5}, ValueError, r"lacks \['state_format', 'hops'"),
])
def test_not_a_state(saved, bad, error, match):
    refused(saved[0], bad, match, error)


def mutate(state, key, value):
    s = copy.deepcopy(state)
    if value is KeyError:
        del s[key]
    else:
        s[key] = value
    return s


@pytest.mark.parametrize("key, value, match", [
    ("batches_yielded", -5, r"'batches_yielded': expected an int >= 0.*found -5"),
    ("batches_yielded", 33, r"'batches_yielded': expected an int from 0 to 32.*found 33"),
    ("batches_yielded", True, r"'batches_yielded'.*found True \(bool\)"),
    ("batches_yielded", 2.0, r"'batches_yielded'.*float"),
    ("epoch", "1", r"'epoch': expected an int >= 0, found '1'"),
    ("epoch", -1, r"'epoch'"),
    ("epoch", 10**30, rf"'epoch': expected an int from 0 to {2**63 - 1}, found {10**30}$"),
    ("window_blocks", 2**63, rf"'window_blocks': expected an int from 1 to {2**63 - 1}, found {2**63}$"),
    ("hops", [{"world_size": 2, "batch_size": 10**30, "window_blocks": 3, "batches": 1}],
     rf"'hops\[0\]\.batch_size': expected an int from 1 to {2**63 - 1}, found {10**30}$"),
    ("hops", KeyError, r"lacks \['hops'\]"),
    ("extra", 1, r"unknown keys \['extra'\]"),
    ("state_format", 3, r"'state_format': expected 2 \(or 1\), found 3"),
    ("state_format", 1, r"state has unknown keys \['content_sha256', 'exact_shares'\]"),
    ("shuffle", 1, r"'shuffle': expected True or False"),
    ("rank", 1, r"'rank': expected an int from 0 to 0"),
    ("world_size", 0, r"'world_size': expected an int from 1 to 125"),
    ("world_size", 126, r"'world_size'"),
    ("window_blocks", None, r"'window_blocks'"),
    ("hops", {}, r"'hops': expected a list of at most 64 dicts"),
    ("hops", [{"world_size": 2}], r"'hops\[0\]' lacks \['batch_size', 'window_blocks', 'batches'\]"),
    ("hops", [{"world_size": 2, "batch_size": 8, "window_blocks": 3, "batches": 0}], r"'hops\[0\].batches'"),
    ("hops", [{"world_size": 2, "batch_size": 8, "window_blocks": 3, "batches": 999}],
     r"'hops\[0\].batches': expected an int from 1 to 63"),
    ("hops", [{"world_size": 2, "batch_size": 8, "window_blocks": 3, "batches": 1}] * (MAX_HOPS + 1), "at most 64"),
    ("fields", ["x"], r"'fields': expected a dict"),
    ("fields", {"x": "float64 (3, 5)", "idx": "int64 ()"}, r"fields\['x'\]: saved float64 \(3, 5\), now float32"),
    ("index_sha256", {"x": "nothex"}, r"'index_sha256': expected a sha256 hex digest for 'x'"),
    ("index_sha256", {"x": "f" * 64}, r"index_sha256\['x'\]: saved ffffffffffff\.\.\., now"),
    ("content_sha256", {"x": "f" * 64}, r"content_sha256\['x'\]: saved ffffffffffff\.\.\., now .* \(its block "
                                        r"checksums or chunk sizes differ"),
    ("content_sha256", {"y": "f" * 64}, r"'content_sha256': expected digests of fields in 'fields' \['idx', 'x'\], "
                                        r"found \['y'\]"),
    ("content_sha256", None, r"'content_sha256': expected a dict of field name -> sha256 hex digest"),
    ("num_samples", 1000, r"num_samples: saved 1000, now 997"),
    ("seed", 2, r"seed: saved 2, now 1.*cannot change mid-epoch"),
    ("drop_last", True, r"drop_last: saved True, now False"),
])
def test_tampered_state_is_refused(saved, key, value, match):
    path, state = saved
    refused(path, mutate(state, key, value), match)


def test_refused_settings_and_dataset(saved, make_dataset):
    path, state = saved
    refused(path, state, "shuffle: saved True, now False; seed: saved 1, now 0", shuffle=False, seed=0)
    other = make_dataset({"x": np.zeros((997, 3, 5), "float64"), "idx": np.arange(997)}, samples_per_block=8)
    refused(other, state, r"fields\['x'\]: saved float32 \(3, 5\), now float64 \(3, 5\)")
    resharded = make_dataset(labelled(997), samples_per_block=8, shard_bytes=8 * 60 * 3)
    refused(resharded, state, r"index_sha256\['x'\]: saved .* \(its shard indexes differ")


def test_fuzzed_states_raise_only_value_errors(saved):
    """Every key set to values of the wrong type or range: a ValueError naming the key, nothing else."""
    path, state = saved
    rng = np.random.default_rng(0)
    junk = [None, -5, -1, 2**70, 1.5, "1", True, [], {}, [1], {"a": 1}, "x" * 64]
    accepted = []
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        for key in state:
            for value in junk:
                try:
                    ds.load_state_dict(mutate(state, key, value))
                except ValueError as e:
                    assert repr(key)[1:-1] in str(e), (key, value, e)
                else:
                    if value != state[key]:
                        accepted.append((key, value))
        for _ in range(200):  # several keys at once: a ValueError or a valid state, nothing else
            s = copy.deepcopy(state)
            for key in rng.choice(list(state), size=3, replace=False):
                s[str(key)] = junk[rng.integers(len(junk))]
            try:
                ds.load_state_dict(s)
            except ValueError:
                pass
    # valid after all: another epoch (resumed at its batch 5), a leg read in one huge window (its batch 5
    # exists), no field's hash to compare
    assert accepted == [("index_sha256", {}), ("content_sha256", {})]  # 2**70 was accepted as epoch, window_blocks


def test_other_field_selection_and_rank_resume(saved):
    path, state = saved
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1, fields=["x"]) as ds:
        ds.load_state_dict(state)  # fields read differ: the hashes of those both read agree
        assert ds.state_dict()["index_sha256"].keys() == {"x"}
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1, rank=1, world_size=2) as ds:
        ds.load_state_dict(state)  # rank 0 of 1 -> rank 1 of 2
        assert ds.state_dict()["hops"][0]["batches"] == 5


def test_merge_states(saved):
    _, state = saved
    two = [{**state, "world_size": 2, "rank": r} for r in (1, 0)]
    assert merge_states(two) == {**state, "world_size": 2, "rank": 0}
    with pytest.raises(ValueError, match=r"expected one state per rank 0..1, found ranks \[1\]"):
        merge_states(two[:1])
    with pytest.raises(ValueError, match="stopped at different batches"):
        merge_states([two[0], {**two[1], "batches_yielded": 6}])
    with pytest.raises(TypeError):
        merge_states(state)
    with pytest.raises(StateError):
        merge_states([{**two[0], "seed": -1}, two[1]])


def test_huge_world_sizes_are_refused_before_a_list_of_ranks_is_made(saved):
    _, state = saved
    for world in (2**62, 10**30):
        with pytest.raises(StateError, match="'(world_size|rank)'"):
            merge_states([{**state, "world_size": world, "rank": 0}])


@pytest.mark.parametrize("cut", [0, 5])
def test_a_resume_under_another_batch_size_warns_saying_what_changes(data_path, cut):
    """A state of batch_size 32 loaded with batch_size 16 was resumed without a word. It is exact (every sample
    of the epoch once), and now says that the batches, and with another window the order, are not the saved
    run's."""
    path, data = data_path
    with Dataset(path, batch_size=32, shuffle=True, seed=1) as ds:
        first = take(ds, cut, data, epoch=1) if cut else np.zeros(0, np.int64)
        if not cut:
            ds.set_epoch(1)
        state = ds.state_dict()
    for window, note in ((state["window_blocks"], "$"), (1, r"; window_blocks is 1, saved \d+ .* order of samples "
                                                            r"differs too \(pass window_blocks to keep it\)$")):
        with Dataset(path, batch_size=16, window_blocks=window, shuffle=True, seed=1) as ds:
            what = (r"the rest of epoch 1 is dealt out anew in batches of 16 \(every sample not yet yielded once"
                    if cut else r"epoch 1 \(not begun\) and the later ones come in batches of 16")
            with pytest.warns(UserWarning, match=r"^resume state saved with batch_size=32, resumed with "
                                                 rf"batch_size=16: {what}.*{note}"):
                ds.load_state_dict(state)
            rest = take(ds, None, data)
            assert sorted(np.concatenate([first, rest]).tolist()) == list(range(997)), "exact all the same"
    with Dataset(path, batch_size=32, shuffle=True, seed=1) as ds, warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.load_state_dict(state)  # the same batch_size: nothing to say


# -- the fingerprint covers the data, not only the layout -------------------------------------------------
def test_another_dataset_of_the_same_layout_is_refused(make_dataset):
    """Same shapes, dtypes, blocks and shards, one sample value changed: the block checksums differ, so a
    state of one is refused by the other, naming the key; the same dataset reopened accepts it."""
    data = labelled(997)
    path = make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10)
    other_data = {k: v.copy() for k, v in data.items()}
    other_data["x"][500, 1, 2] += 0.5
    other = make_dataset(other_data, samples_per_block=8, shard_bytes=8 * 60 * 10)
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        take(ds, 5, data, epoch=1)
        state = ds.state_dict()
        assert state["state_format"] == 2 and set(state["content_sha256"]) == {"x", "idx"}
    refused(other, state, r"content_sha256\['x'\]: saved [0-9a-f]{12}\.\.\., now [0-9a-f]{12}\.\.\. \(its block "
                          r"checksums or chunk sizes differ: another dataset of the same shapes and layout")
    with Dataset(other, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        other_state = ds.state_dict()
    assert other_state["index_sha256"] == state["index_sha256"], "the layouts agree: only the content tells them apart"
    assert other_state["content_sha256"]["idx"] == state["content_sha256"]["idx"]
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        ds.load_state_dict(state)  # the same dataset, reopened
        rest = take(ds, None, data)
    assert len(rest) == (997 // 32 + 1 - 5) * 32 - (32 - 997 % 32)
    with Dataset(other, batch_size=32, window_blocks=3, shuffle=True, seed=1, fields=["idx"]) as ds:
        ds.load_state_dict(state)  # only the fields both read are compared: idx is the same in both


def write_zstd_store(path: str, x: np.ndarray) -> None:
    """A foreign store as zarr-python writes it: one array, zstd inner chunks of 4 rows, shards of 8, a
    shard index with its crc32c."""
    import zarr

    g = zarr.open_group(path, mode="w", zarr_format=3)
    a = g.create_array("x", shape=x.shape, dtype=x.dtype, chunks=(4, *x.shape[1:]), shards=(8, *x.shape[1:]),
                       compressors=[zarr.codecs.ZstdCodec()], fill_value=0)
    a[:] = x


def test_foreign_store_with_a_chunk_of_another_length_is_refused(tmp_path):
    """A zarr-python store, sharded and compressed, without block checksums: the last chunk of a shard made
    incompressible keeps every chunk's offset (so the layout hash agrees) but changes that chunk's stored
    length and its shard index's crc32c, and the state is refused."""
    from gdsload.format.layout import DatasetLayout
    from gdsload.format.meta import read_metadata

    x = np.arange(32 * 6, dtype=np.int32).reshape(32, 6) % 7
    changed = x.copy()
    changed[4:8] = np.random.default_rng(0).integers(0, 2**31, (4, 6), dtype=np.int32)  # chunk 1, shard 0's last
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_zstd_store(a, x)
    write_zstd_store(b, changed)
    layouts = [DatasetLayout(read_metadata(p)) for p in (a, b)]
    try:
        assert np.array_equal(layouts[0].block_offsets["x"], layouts[1].block_offsets["x"])
        assert layouts[0].chunk_lengths["x"][1] != layouts[1].chunk_lengths["x"][1]
        for layout in layouts:  # one crc32c per shard file, the one stored at the end of its index
            stored = [int.from_bytes(open(p, "rb").read()[-4:], "little") for p in layout.paths("x")]
            assert layout.index_crcs["x"].dtype == np.uint32 and layout.index_crcs["x"].tolist() == stored
        assert layouts[0].index_crcs["x"][0] != layouts[1].index_crcs["x"][0]
    finally:
        for layout in layouts:
            layout.close()
    with GDSDataset(a, batch_size=4, backend="cpu") as ds:
        next(iter(ds))
        state = ds.state_dict()
    with GDSDataset(b, batch_size=4, backend="cpu") as ds:
        assert ds.state_dict()["index_sha256"] == state["index_sha256"]
        with pytest.raises(ValueError, match=r"content_sha256\['x'\]: saved .* \(its block checksums or chunk sizes "
                                             r"differ"):
            ds.load_state_dict(state)
    with GDSDataset(a, batch_size=4, backend="cpu") as ds:
        ds.load_state_dict(state)


def test_a_state_saved_before_content_fingerprints_resumes_with_a_warning(saved, data_path):
    """A state of format 1 (no content_sha256) is what the previous release saved: its shapes and layout are
    checked as they were, and it resumes exactly, with a warning that the content could not be checked."""
    path, state = saved
    _, data = data_path
    old = {k: v for k, v in state.items() if k not in ("content_sha256", "exact_shares")}
    old["state_format"] = 1
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        ds.load_state_dict(state)
        want = take(ds, None, data)
    with Dataset(path, batch_size=32, window_blocks=3, shuffle=True, seed=1) as ds:
        with pytest.warns(UserWarning, match="state_format 1 .* its content cannot be checked"):
            ds.load_state_dict(old)
        np.testing.assert_array_equal(take(ds, None, data), want)
        assert ds.state_dict()["state_format"] == 2  # saved again, it carries the content
    refused(path, {**old, "seed": 2}, r"seed: saved 2, now 1")  # every other check still applies
    two = [{**old, "world_size": 2, "rank": r} for r in (1, 0)]
    assert merge_states(two) == {**old, "world_size": 2, "rank": 0}
    with pytest.raises(StateError, match=r"rank 1's state differs from rank 0's \(state_format: 1 against 2, "
                                         r"content_sha256: 'absent' against"):
        merge_states([two[1], {**state, "world_size": 2, "rank": 1}])


def test_exact_shares_is_part_of_the_state_and_every_rank_resumes_its_last_batch(make_dataset):
    """With exact shares ranks may hold a batch more than rank 0: a state at that last batch resumes (it was
    refused as past rank 0's batches), and a state of one kind of shares is refused by the other, naming it."""
    path = make_dataset(labelled(41), samples_per_block=2)
    opened = functools.partial(Dataset, path, batch_size=4, world_size=2, exact_shares=True)
    counts = {}
    for rank in (0, 1):
        with opened(rank=rank) as ds:
            counts[rank] = len(list(ds))
            state = ds.state_dict()  # at the end of the epoch: every batch of this rank yielded
        with opened(rank=rank) as ds:
            ds.load_state_dict(state)
            assert state["exact_shares"] and list(ds) == []
    assert counts[0] != counts[1]  # 41 samples in shares of 20 and 21: 5 and 6 batches of 4
    with Dataset(path, batch_size=4, world_size=2, rank=0) as ds, pytest.raises(StateError, match="exact_shares"):
        ds.load_state_dict(state)


# -- exact shares: the rest dealt out without padding, nothing read twice -----------------------------------
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(epochs(samples=200, block=10, world=5, batch=30, window=5, flags=1))
def test_exact_shares_read_every_sample_once_over_legs(case):
    """GDSDataset(exact_shares=True) plans resumed on any world sizes, batch sizes and windows, cut anywhere
    (ranks yielding the same batches, or all they hold): the epoch's samples exactly once, none padded, and
    each dealt-out rest cut in the shares of one continuous stream (sizes a sample apart at most)."""
    n, k, seed, shuffle, legs = case
    state, got, epoch = None, [], 2
    for world, b, w, take in legs:
        plans, starts, hops = [], set(), set()
        for r in range(world):
            cfg = PlanConfig(num_samples=n, samples_per_block=k, batch_size=b, window_blocks=w, shuffle=shuffle,
                             seed=seed, rank=r, world_size=world, exact_shares=True)
            cursor = Cursor(epoch) if state is None else resume(state, cfg, FP)
            plans.append(cursor.plan or epoch_plan(cfg, epoch))
            starts.add(cursor.batch)
            hops.add(cursor.hops)
        (start,), (hop,) = starts, hops
        lengths = [len(p.positions) for p in plans]
        if hop and start == 0:
            assert lengths == rest_shares(n, world, epoch, sum(lengths)), "no padding: the shares of a stream"
        assert all(h.shift == 0 for h in hop)
        stop = max(p.num_batches for p in plans) if take is None else start + take
        stop = min(stop, max(p.num_batches for p in plans))
        for p in plans:  # a rank holding fewer batches has yielded them all
            got.extend(p.sample_ids()[start * b:stop * b].tolist())
        state = json.loads(json.dumps(make_state(plans[0].config, FP, epoch, stop, hop)))
        assert state["state_format"] == 3 and all(set(h) == {*HOP_KEYS, "shift"} for h in state["hops"])
    assert sorted(got) == list(range(n)), "every sample of the epoch exactly once"


@pytest.mark.parametrize("legs, opts", [
    ([(3, {}, 4), (2, {}, None)], {"batch_size": 16, "shuffle": True, "seed": 3}),
    ([(2, {}, 5), (5, {"batch_size": 8}, 3), (3, {"window_blocks": 1}, None)], {"batch_size": 16, "shuffle": True}),
    ([(4, {"window_blocks": 4}, 3), (1, {"window_blocks": 2, "batch_size": 50}, None)], {"batch_size": 10}),
])
def test_exact_shares_dataset_resumes_on_other_ranks_reading_nothing_twice(data_path, legs, opts):
    """GDSDataset(exact_shares=True) on the cpu backend, resumed on other numbers of ranks: the union of every
    leg is the epoch, every sample exactly once (no padding), and the epoch after is a fresh run's."""
    path, data = data_path
    per_leg, last = run_elastic(path, data, legs, exact_shares=True, **opts)
    got = np.concatenate([np.concatenate(x) for x in per_leg])
    assert sorted(got.tolist()) == list(range(997)), "every sample once"
    for cfg, ids in last:
        np.testing.assert_array_equal(ids, epoch_plan(cfg, 2).sample_ids())


def test_exact_shares_states_have_their_own_format(make_dataset):
    """An exact-shares state is of format 3, its hops with a 'shift'; one of format 2 resumes where it has no
    hops (it means what it meant) and is refused, naming the reason, inside a rest dealt out with padding."""
    path = make_dataset(labelled(41), samples_per_block=2)
    opened = functools.partial(Dataset, path, batch_size=4, exact_shares=True)
    with opened(world_size=2, rank=0) as ds:
        next(iter(ds))
        state = ds.state_dict()
    assert state["state_format"] == 3 and state["hops"] == []
    with opened(world_size=3, rank=1) as ds:
        ds.load_state_dict(state)
        resumed = ds.state_dict()
        with opened(world_size=3, rank=1) as again:
            again.load_state_dict({**state, "state_format": 2})  # no hops: the same meaning
            assert again.state_dict() == resumed
    assert resumed["hops"] == [{"world_size": 2, "batch_size": 4, "window_blocks": state["window_blocks"],
                                "batches": 1, "shift": 0}]
    for bad, match in [({"state_format": 2}, r"'state_format': 2 with exact_shares and hops"),
                       ({"state_format": 4}, r"'state_format': expected 3 \(or 2 without hops\)"),
                       ({"hops": [{**resumed["hops"][0], "shift": 2}]}, r"'hops\[0\].shift': expected an int from 0 "
                                                                         r"to 1"),
                       ({"hops": [{k: v for k, v in resumed["hops"][0].items() if k != "shift"}]},
                        r"'hops\[0\]' lacks \['shift'\]")]:
        with opened(world_size=3, rank=1) as ds, pytest.raises(StateError, match=match):
            ds.load_state_dict({**resumed, **bad})
