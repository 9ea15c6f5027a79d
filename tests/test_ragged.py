"""Variable-length fields: index math, conversion, reading (concatenated and padded), shuffle and resume."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import zarr

from gdsload import ConversionError, GDSDataset
from gdsload.format.meta import read_metadata
from gdsload.pipeline.plan import PlanConfig, epoch_plan
from gdsload.pipeline.ragged import capacity_rows, epoch_value_index, gather, pad
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import convert, write_dataset

from _helpers import ragged_source, sequences

Dataset = functools.partial(GDSDataset, backend="cpu", resident_bytes=0)



def test_epoch_value_index_matches_a_direct_computation():
    seqs = sequences(103)
    offsets = ragged_source(seqs).offsets
    cfg = PlanConfig(num_samples=103, samples_per_block=4, batch_size=10, window_blocks=3, shuffle=True)
    plan = epoch_plan(cfg, 1)
    start, length = epoch_value_index(plan, offsets)
    ids = plan.sample_ids()
    np.testing.assert_array_equal(length, np.diff(offsets)[ids])
    for p in range(len(ids)):  # window buffer = its blocks' values back to back
        blocks = plan.windows[plan.window_of[p]]
        buf = np.concatenate([np.concatenate(seqs[b * 4:(b + 1) * 4]) for b in blocks])
        np.testing.assert_array_equal(buf[start[p]:start[p] + length[p]], seqs[ids[p]])
        assert sum(len(np.concatenate(seqs[b * 4:(b + 1) * 4])) for b in blocks) <= capacity_rows(offsets, 4, 3)


def test_gather_and_pad_in_numpy():
    values = np.arange(20) * 10
    starts, lengths = np.array([5, 0, 12, 3]), np.array([2, 0, 3, 1])
    out = np.empty(6, dtype=values.dtype)
    gather(np, lambda src, idx, o: np.take(src, idx, out=o), values, starts, lengths, out)
    assert out.tolist() == [50, 60, 120, 130, 140, 30]
    padded = np.empty((4, 2), dtype=out.dtype)
    pad(np, out, lengths, -1, padded)
    assert padded.tolist() == [[50, 60], [-1, -1], [120, 130], [30, -1]]


def check(batch: dict, seqs: list[np.ndarray], padded: int | str | None = None) -> list[int]:
    ids = batch["id"].tolist()
    if padded is None:
        off = batch["tokens/offsets"]
        assert off[0] == 0 and off[-1] == len(batch["tokens"])
        for j, i in enumerate(ids):
            np.testing.assert_array_equal(batch["tokens"][off[j]:off[j + 1]], seqs[i])
    else:
        width = batch["tokens"].shape[1]
        if padded == "max":
            assert width == max(len(seqs[i]) for i in ids)
        for j, i in enumerate(ids):
            n = min(width, len(seqs[i]))
            assert batch["tokens/lengths"][j] == n  # the length of the row returned: cut to the width
            np.testing.assert_array_equal(batch["tokens"][j, :n], seqs[i][:n])
            assert (batch["tokens"][j, n:] == -7).all()
    return ids


@pytest.fixture
def ragged_path(make_dataset, tmp_path):
    seqs = sequences(211, elem=(3,))
    path = str(tmp_path / "r.gds")
    write_dataset(path, {"id": ArraySource("<id>", np.arange(211))}, ragged={"tokens": ragged_source(seqs)},
                  samples_per_block=8, block_bytes=256, shard_bytes=4096, progress=False)
    return path, seqs


@pytest.mark.parametrize("padded", [None, "max", 5])
@pytest.mark.parametrize("options", [{}, {"shuffle": True, "window_blocks": 3}, {"window_blocks": 1,
                                                                                  "batch_size": 40}])
def test_read_back_every_sample(ragged_path, padded, options):
    path, seqs = ragged_path
    options = {"batch_size": 16, **options}
    with Dataset(path, pad_to=padded, pad_value=-7, **options) as ds:
        batches = list(ds)  # all alive at once
        seen = [i for b in batches for i in check(b, seqs, padded)]
    assert sorted(seen) == list(range(211))
    np.testing.assert_array_equal(seen, epoch_plan(ds.config, 0).sample_ids())


def test_layout_is_plain_zarr(ragged_path):
    path, seqs = ragged_path
    meta = read_metadata(path)
    assert list(meta.ragged) == ["tokens"] and meta.ragged["tokens"].values.num_shards > 1
    g = zarr.open_group(path, mode="r")
    values, offsets = g["tokens/values"][:], g["tokens/offsets"][:]
    for i in (0, 17, 100, 210):
        np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], seqs[i])


def test_resume_and_ranks(ragged_path):
    path, seqs = ragged_path
    opts = dict(batch_size=16, shuffle=True, window_blocks=2, seed=3)
    with Dataset(path, **opts) as ds:
        full = [i for b in ds for i in check(b, seqs)]
        ds.set_epoch(0)
        it = iter(ds)
        head = [i for _, b in zip(range(5), it) for i in check(b, seqs)]
        state = ds.state_dict()
        del it
    with Dataset(path, **opts) as ds:
        ds.load_state_dict(state)
        assert head + [i for b in ds for i in check(b, seqs)] == full
    ranks = []
    for r in range(3):
        with Dataset(path, batch_size=16, shuffle=True, rank=r, world_size=3) as ds:
            ranks.append([i for b in ds for i in check(b, seqs)])
    assert set(sum(ranks, [])) == set(range(211))


def test_convert_from_files(tmp_path):
    seqs = sequences(40, seed=2, elem=(2,))
    (tmp_path / "tok").mkdir()
    for i, s in enumerate(seqs):
        np.save(tmp_path / "tok" / f"{i:04d}.npy", s)
    offsets = ragged_source(seqs).offsets
    np.savez(tmp_path / "packed.npz", values=np.concatenate(seqs), offsets=offsets)
    np.save(tmp_path / "id.npy", np.arange(40))
    for src in ("tok", "packed.npz"):
        meta = convert([str(tmp_path / "id.npy")], tmp_path / f"{src}.gds", ragged={"tokens": str(tmp_path / src)},
                       samples_per_block=3, progress=False)
        with Dataset(meta.path, batch_size=7) as ds:
            assert sorted(i for b in ds for i in check(b, seqs)) == list(range(40))


def test_bad_variable_length_input(tmp_path):
    (tmp_path / "mixed").mkdir()
    np.save(tmp_path / "mixed" / "a.npy", np.zeros(3, np.int32))
    np.save(tmp_path / "mixed" / "b.npy", np.zeros(3, np.float32))
    with pytest.raises(ConversionError, match="b.npy: cannot concatenate with .*a.npy"):
        convert([], tmp_path / "o.gds", ragged={"t": str(tmp_path / "mixed")}, progress=False)
    np.savez(tmp_path / "bad.npz", values=np.zeros(5), offsets=np.array([0, 2, 4]))
    with pytest.raises(ConversionError, match="offsets end at 4 but there are 5 values"):
        convert([], tmp_path / "o.gds", ragged={"t": str(tmp_path / "bad.npz")}, progress=False)
    np.savez(tmp_path / "nokeys.npz", x=np.zeros(5))
    with pytest.raises(ConversionError, match="needs arrays 'values' and 'offsets'"):
        convert([], tmp_path / "o.gds", ragged={"t": str(tmp_path / "nokeys.npz")}, progress=False)
    np.save(tmp_path / "id.npy", np.arange(4))
    np.savez(tmp_path / "three.npz", values=np.zeros(5), offsets=np.array([0, 2, 4, 5]))
    with pytest.raises(ConversionError, match=r"different sample counts \(t=3, id=4"):
        convert([str(tmp_path / "id.npy")], tmp_path / "o.gds", ragged={"t": str(tmp_path / "three.npz")},
                progress=False)
    assert not os.path.exists(tmp_path / "o.gds")


def test_bad_pad_arguments(ragged_path):
    path, _ = ragged_path
    with pytest.raises(ValueError, match="pad_to names 'id', which is not a variable-length field"):
        Dataset(path, batch_size=4, pad_to={"id": 3})
    with pytest.raises(ValueError, match="must be a non-negative int or 'max'"):
        Dataset(path, batch_size=4, pad_to="longest")
