"""GDSDataset.place: a dataset put at a position (epoch, legs, samples) yields exactly the batches a run
resumed from the state saying so, or continued from there, yields (cpu backend, every byte checked); and the
one merge_states, for a GDSDataset's states and a Mixture's."""

import functools

import numpy as np
import pytest

import gdsload
import gdsload.mixture
from _helpers import labelled
from gdsload import GDSDataset, merge_states
from gdsload.pipeline.resume import StateError

Dataset = functools.partial(GDSDataset, backend="cpu", resident_bytes=32 << 10, batch_size=32, window_blocks=3,
                            shuffle=True, seed=1)


@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


def batches(ds, data, count=None) -> list[list[int]]:
    """The sample ids of up to ``count`` batches of the next pass (None: all of it), every byte checked."""
    out = []
    for b in ds:
        np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])
        out.append(b["idx"].tolist())
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("opts", [{}, {"exact_shares": True}])
def test_a_placed_dataset_yields_what_the_continued_and_the_resumed_run_yield(data_path, opts):
    path, data = data_path
    with Dataset(path, **opts) as run:
        run.set_epoch(1)
        full = batches(run, data)  # the continued run: epoch 1 read through
        run.set_epoch(1)
        batches(run, data, 5)
        state = run.state_dict()
        run.set_epoch(2)
        following = batches(run, data)
    with Dataset(path, **opts) as ds:
        ds.place(1, samples=5 * 32)
        assert ds.epoch == 1 and ds.state_dict() == state, "placed where the run's state says it stands"
        assert batches(ds, data) == full[5:]
        assert batches(ds, data) == following, "then on into the next epoch, as after load_state_dict"
    with Dataset(path, **opts) as resumed:
        resumed.load_state_dict(state)
        assert batches(resumed, data) == full[5:]
    with Dataset(path, **opts) as ds:
        ds.place(3)
        three = batches(ds, data)
        ds.set_epoch(3)
        assert three == batches(ds, data), "place(e): epoch e from its start"


@pytest.mark.parametrize("opts", [{}, {"exact_shares": True}])
def test_a_dataset_placed_in_a_later_leg_yields_what_the_elastic_resume_yields(data_path, opts):
    """A state of 2 ranks resumed on 1: the epoch's second leg. Placed at that leg (its legs as the state's
    hops), a dataset yields exactly the rest the resumed run yields from there."""
    path, data = data_path
    states, first = [], []
    for rank in (0, 1):
        with Dataset(path, rank=rank, world_size=2, **opts) as ds:
            ds.set_epoch(1)
            first += batches(ds, data, 4)
            states.append(ds.state_dict())
    with Dataset(path, rank=0, world_size=1, **opts) as resumed:
        resumed.load_state_dict(merge_states(states))
        leg = batches(resumed, data)  # the rest of epoch 1, dealt out to one rank
        resumed.load_state_dict(merge_states(states))
        batches(resumed, data, 3)
        later = resumed.state_dict()
    assert later["hops"] and later["batches_yielded"] == 3
    with Dataset(path, rank=0, world_size=1, **opts) as ds:
        ds.place(later["epoch"], later["hops"], 3 * 32)
        assert ds.state_dict() == later
        assert batches(ds, data) == leg[3:]
    rest = [i for b in leg for i in b]
    assert len(rest) == len(set(rest)) and set(rest) | {i for b in first for i in b} == set(range(997))


def test_a_place_inside_a_batch_is_for_a_feed_and_a_refused_place_changes_nothing(data_path):
    """A pass of the dataset's own yields whole batches, and a state counts them: both refuse a position inside
    a batch (what a mixture's feed reads from). A place out of range is a StateError naming the call and the
    key, and leaves the position as it was."""
    path, data = data_path
    with Dataset(path) as run:
        run.set_epoch(1)
        full = batches(run, data)
    with Dataset(path) as ds:
        ds.place(1, samples=5 * 32 + 7)
        with pytest.raises(StateError, match=r"placed 7 samples into batch 5 of epoch 1; a pass yields whole"):
            next(iter(ds))
        with pytest.raises(StateError, match="a state counts whole batches"):
            ds.state_dict()
        ds.place(1, samples=5 * 32)
        before = ds.state_dict()
        bad = [((1, (), 998), r"place\(epoch=1, samples=998\): state key 'samples': expected an int from 0 to 997"),
               ((-1, (), 0), "state key 'epoch'"),
               ((1, [{"world_size": 2}], 0), r"state key 'hops\[0\]' lacks \['batch_size'"),
               ((1, [{"world_size": 2, "batch_size": 32, "window_blocks": 3, "batches": 10**6}], 0),
                r"state key 'hops\[0\].batches': expected an int from 1 to"),
               ((1, "legs", 0), "state key 'hops'")]
        for args, match in bad:
            with pytest.raises(StateError, match=match):
                ds.place(*args)
            assert ds.state_dict() == before, f"a refused place changes nothing: {args}"
        assert batches(ds, data) == full[5:]


def test_one_merge_states_for_a_datasets_and_a_mixtures_states():
    assert gdsload.mixture.merge_states is merge_states, "the mixture's documented name is the same function"
    mix = {"mixture_format": 3, "step": 4, "positions": {"a": {"samples": 8}}, "world_size": 2}
    two = [{**mix, "rank": r} for r in (1, 0)]
    assert merge_states(two) == {**mix, "rank": 0}
    with pytest.raises(StateError, match=r"rank 1's state differs from rank 0's \(step: 4 against 5\) \(the ranks "
                                         "stopped at different batches"):
        merge_states([two[1], {**two[0], "rank": 1, "step": 5}])
    with pytest.raises(StateError, match=r"expected one state per rank 0..1, found ranks \[0\]"):
        merge_states(two[1:])
    with pytest.raises(StateError, match="state key 'rank'"):
        merge_states([{**mix, "rank": "0"}, two[0]])
    with pytest.raises(TypeError, match="a list of state dicts"):
        merge_states([mix, 3])
