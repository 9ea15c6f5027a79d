"""GDSDataset's arguments and the environment it reads: numpy integers are Python ints, every value out of
range is refused naming the argument (or the variable), ``fields`` is read once, ``window_blocks`` is clamped
to what a rank can use, and a configuration that would yield no batch is refused at open."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from gdsload import GDSDataset
from gdsload.backends import resolve
from gdsload.options import MAX_INT
from gdsload.pipeline.plan import PlanConfig, epoch_plan, fewest_rank_samples

N, K = 630, 10  # 63 blocks, as in the issue


@pytest.fixture
def path(make_dataset) -> str:
    idx = np.arange(N, dtype=np.int64)
    return make_dataset({"x": (idx[:, None] * 4 + np.arange(4)).astype(np.float32), "label": idx},
                        samples_per_block=K)


def open_(path: str, **kw) -> GDSDataset:
    kw.setdefault("batch_size", 64)
    return GDSDataset(path, backend="cpu", **kw)


def labels(ds: GDSDataset) -> list[int]:
    return [int(v) for b in ds for v in b["label"]]


# -- numpy integers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.uint32, np.int64, np.uint64])
def test_numpy_integer_arguments_are_python_ints(path, dtype):
    """np.uint8(64) as batch_size raised OverflowError (plan.py), np.int16 warned of an overflow
    (assembler.py), seed=np.int64(1) was refused: every integer argument now reads as the Python int."""
    n = dtype
    want = dict(batch_size=64, prefetch=2, resident_bytes=0, window_blocks=3, batches_ahead=2, rank=1, world_size=2,
                device=0, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warnings included
        with open_(path, shuffle=True, **want) as plain, open_(path, shuffle=True,
                                                              **{k: n(v) for k, v in want.items()}) as ds:
            c = ds.config
            for name in ("batch_size", "window_blocks", "seed", "rank", "world_size"):
                assert type(getattr(c, name)) is int and getattr(c, name) == want[name], name
            assert type(ds.prefetch) is int and type(ds.batches_ahead) is int and type(ds.device) is int
            ds.set_epoch(n(3))
            plain.set_epoch(3)
            assert type(ds.epoch) is int and ds.state_dict() == plain.state_dict()
            assert labels(ds) == labels(plain)


def test_numpy_integer_pad_to(make_dataset):
    from gdsload.conversion.source_types import ArraySource, RaggedSource

    offsets = np.array([0, 2, 3, 6, 6, 7], dtype=np.int64)
    path = make_dataset({"id": np.arange(5)}, samples_per_block=2,
                        ragged={"t": RaggedSource("t", ArraySource("t", np.arange(7, dtype=np.int32)), offsets)})
    for pad_to in (np.int16(4), {"t": np.uint8(4)}):
        with GDSDataset(path, batch_size=5, backend="cpu", pad_to=pad_to) as ds:
            batch = next(iter(ds))
            assert batch["t"].shape == (5, 4) and list(batch["t/lengths"]) == [2, 1, 3, 0, 1]
    with pytest.raises(TypeError, match="pad_to must be a non-negative int or 'max' \\(found True\\)"):
        GDSDataset(path, batch_size=5, backend="cpu", pad_to=True)
    with pytest.raises(ValueError, match="pad_to for 't' must be at least 0 \\(found -1\\)"):
        GDSDataset(path, batch_size=5, backend="cpu", pad_to={"t": np.int64(-1)})
    with pytest.raises(ValueError, match=f"pad_to must be at most {MAX_INT} "):
        GDSDataset(path, batch_size=5, backend="cpu", pad_to=2**63)


# -- out of range -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value, error, message", [
    ("batch_size", 10**30, ValueError, f"batch_size must be at most {MAX_INT} (found {10**30})"),
    ("batch_size", 2**63, ValueError, "batch_size must be at most"),
    ("batch_size", np.int64(-3), ValueError, "batch_size must be at least 1 (found -3)"),
    ("batch_size", True, TypeError, "batch_size must be an int (found bool True)"),
    ("batch_size", np.bool_(True), TypeError, "batch_size must be an int"),
    ("batch_size", 64.0, TypeError, "batch_size must be an int (found float 64.0)"),
    ("batch_size", np.float32(64), TypeError, "batch_size must be an int"),
    ("prefetch", 2**64, ValueError, "prefetch must be at most"),
    ("prefetch", 0, ValueError, "prefetch must be at least 1"),
    ("resident_bytes", -1, ValueError, "resident_bytes must be at least 0"),
    ("resident_bytes", 10**20, ValueError, "resident_bytes must be at most"),
    ("window_blocks", 2**63, ValueError, "window_blocks must be at most"),
    ("window_blocks", False, TypeError, "window_blocks must be an int"),
    ("batches_ahead", 0, ValueError, "batches_ahead must be at least 1"),
    ("batches_ahead", 2**70, ValueError, "batches_ahead must be at most"),
    ("seed", -1, ValueError, "seed must be at least 0 (found -1)"),
    ("seed", 2**63, ValueError, "seed must be at most"),
    ("seed", "1", TypeError, "seed must be an int"),
    ("rank", 2**63, ValueError, "rank must be at most"),
    ("world_size", 0, ValueError, "world_size must be at least 1"),
    ("world_size", 10**19, ValueError, "world_size must be at most"),
    ("device", -1, ValueError, "device must be at least 0"),
    ("device", 2**31, ValueError, f"device must be at most {2**31 - 1}"),
    ("device", 1.0, TypeError, "device must be an int"),
])
def test_out_of_range_arguments_are_refused_naming_them(path, name, value, error, message):
    kw = {"batch_size": 64, name: value}
    with pytest.raises(error) as info:
        open_(path, **kw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_set_epoch_takes_numpy_ints_and_refuses_what_is_out_of_range(path):
    with open_(path) as ds:
        for value, error in ((-1, ValueError), (2**63, ValueError), (True, TypeError), (1.0, TypeError)):
            with pytest.raises(error, match="epoch must be"):
                ds.set_epoch(value)
        ds.set_epoch(np.uint64(2**63 - 1))
        assert ds.epoch == 2**63 - 1 and type(ds.epoch) is int


def test_rank_not_below_world_size_is_refused_before_anything_is_read(path):
    with pytest.raises(ValueError, match="rank must be below world_size \\(found rank 2, world_size 2\\)$"):
        open_(path, rank=np.int32(2), world_size=2)


# -- window_blocks --------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*window_blocks=.* is more than the dataset's")  # said: the test below
@pytest.mark.parametrize("world_size, per_rank", [(1, 63), (2, 32), (4, 16)])
def test_window_blocks_is_clamped_to_a_ranks_blocks(path, world_size, per_rank):
    """window_blocks=10**9 asked numpy for 11 TiB; 100000 sized 1.16 GiB window buffers for 63 blocks. The
    value is clamped to the blocks a rank holds, and the plan, the state and describe() all see it."""
    with open_(path, window_blocks=per_rank, resident_bytes=0, world_size=world_size, rank=world_size - 1,
               shuffle=True) as exact:
        want, want_bytes = labels(exact), exact.describe()["window_bytes"]
    for huge in (100_000, 10**9, MAX_INT):
        with open_(path, window_blocks=huge, resident_bytes=0, world_size=world_size, rank=world_size - 1,
                   shuffle=True) as ds:
            d = ds.describe()
            assert ds.config.window_blocks == d["window_blocks"] == ds.state_dict()["window_blocks"] == per_rank
            assert d["window_bytes"] == want_bytes and labels(ds) == want


def test_window_blocks_below_a_ranks_share_is_kept(path):
    with open_(path, window_blocks=np.int64(5), resident_bytes=0) as ds:
        assert ds.config.window_blocks == ds.describe()["window_blocks"] == 5


def test_window_blocks_beyond_the_dataset_is_clamped_with_a_warning(path):
    """window_blocks=10**9 was clamped without a word. No window of the dataset can hold more blocks than it
    has, so that is said, naming the windows read; a value up to the dataset's blocks is clamped to a rank's
    share as documented (it is the largest window under fewer ranks), silently."""
    with pytest.warns(UserWarning, match=r"window_blocks=1000000000 is more than the dataset's 63 blocks; a window "
                                         r"holds at most a rank's share, so windows of 32 blocks are read$"):
        with open_(path, window_blocks=10**9, world_size=2, rank=0, resident_bytes=0) as ds:
            assert ds.config.window_blocks == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_(path, window_blocks=63, world_size=2, rank=0, resident_bytes=0) as ds:
            assert ds.config.window_blocks == 32


# -- flags ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shuffle", "drop_last", "exact_shares", "prefetch_next_epoch"])
@pytest.mark.parametrize("value", ["yes", "no", 1, None, [False]])
def test_flags_must_be_bools(path, name, value):
    """shuffle="no" shuffled (a non-empty string is true): every flag is True or False, else a TypeError
    naming it and the value."""
    with pytest.raises(TypeError) as info:
        open_(path, **{name: value})
    assert str(info.value) == f"{name} must be True or False (found {type(value).__name__} {value!r})"


def test_numpy_bools_are_flags_and_become_python_bools(path):
    with open_(path, shuffle=np.bool_(True), drop_last=np.bool_(True), prefetch_next_epoch=np.bool_(False)) as ds:
        assert ds.config.shuffle is True and ds.config.drop_last is True and ds.prefetch_next_epoch is False
        assert json.loads(json.dumps(ds.state_dict()))["shuffle"] is True
    with open_(path, exact_shares=np.bool_(True)) as ds:  # PlanConfig refused a numpy bool here
        assert ds.config.exact_shares is True


# -- fields -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [iter(["label"]), (f for f in ["label"]), "label", ["label"], ("label",),
                                    {"label": 1}.keys()])
def test_fields_is_read_once_from_any_iterable(path, fields):
    """fields=iter(["label"]) opened a dataset of zero fields: the iterator was used up reading the metadata."""
    with open_(path, fields=fields) as ds:
        assert ds.fields == ("label",)
        batch = next(iter(ds))
        assert set(batch) == {"label"} and list(batch["label"]) == list(range(64))


@pytest.mark.parametrize("fields, error, message", [
    ([], ValueError, "fields is empty"),
    (iter([]), ValueError, "fields is empty"),
    (["label", "label"], ValueError, "fields names ['label'] more than once"),
    ([b"label"], TypeError, "fields must be names (str)"),
    (5, TypeError, "fields must be a field name or an iterable of them (found int)"),
    ({"label": 1}, TypeError, "fields must be a field name or an iterable of them (found dict)"),
])
def test_bad_fields_are_refused_naming_them(path, fields, error, message):
    with pytest.raises(error) as info:
        open_(path, fields=fields)
    assert message in str(info.value)


# -- a dataset that yields nothing -------------------------------------------------------------------
def test_a_configuration_that_yields_no_batch_is_refused_at_open(path):
    """drop_last=True with batch_size above a rank's samples opened a dataset of len 0, whose passes ended
    at once."""
    with pytest.raises(ValueError, match=f"batch_size=1000 with drop_last=True yields no batch: the dataset holds "
                                         f"{N} samples \\(expected batch_size at most {N}, or drop_last=False\\)"):
        open_(path, batch_size=1000, drop_last=True)
    # 63 blocks over 4 ranks: 15 or 16 blocks each, one of them with no short block (N is whole blocks)
    with pytest.raises(ValueError, match="batch_size=151 with drop_last=True and world_size=4 yields no batch in "
                                         "some epoch: a rank holds as few as 150 of the dataset's 630 samples"):
        open_(path, batch_size=151, drop_last=True, world_size=4, rank=0)
    with open_(path, batch_size=150, drop_last=True, world_size=4, rank=0, shuffle=True) as ds:
        assert len(ds) == 1
    with open_(path, batch_size=1000, drop_last=False) as ds:  # without drop_last: one short batch
        assert len(ds) == 1 and len(labels(ds)) == N


@pytest.mark.parametrize("num_samples, k, world_size", [(630, 10, 4), (101, 10, 3), (97, 8, 5), (37, 4, 9),
                                                        (10, 3, 1), (12, 4, 3)])
def test_fewest_rank_samples_is_what_the_plan_gives_some_rank_in_some_epoch(num_samples, k, world_size):
    """The bound the open checks against: no rank of any epoch holds fewer samples, and some rank of some
    epoch holds exactly that many (unshuffled: every epoch's last rank)."""
    fewest = fewest_rank_samples(num_samples, k, world_size)
    seen = []
    for shuffle in (False, True):
        for epoch in range(40 if shuffle else 1):
            per_rank = []
            for rank in range(world_size):
                cfg = PlanConfig(num_samples=num_samples, samples_per_block=k, batch_size=1, window_blocks=2,
                                 shuffle=shuffle, seed=3, drop_last=True, rank=rank, world_size=world_size)
                per_rank.append(len(epoch_plan(cfg, epoch).positions))  # drop_last, batch 1: the rank's fewest
            seen.append(min(per_rank))
    assert min(seen) == fewest and seen[0] == fewest


# -- environment variables -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value, message", [
    ("RANK", "abc", "environment variable RANK='abc' is not an integer"),
    ("RANK", "1.0", "environment variable RANK='1.0' is not an integer"),
    ("RANK", "-1", "environment variable RANK='-1' is out of range (expected an int from 0 to"),
    ("WORLD_SIZE", "two", "environment variable WORLD_SIZE='two' is not an integer"),
    ("WORLD_SIZE", "0", "environment variable WORLD_SIZE='0' is out of range (expected an int from 1 to"),
    ("WORLD_SIZE", "99999999999999999999", "environment variable WORLD_SIZE='99999999999999999999' is out of range"),
    ("LOCAL_RANK", "gpu0", "environment variable LOCAL_RANK='gpu0' is not an integer"),
    ("LOCAL_RANK", str(2**31), f"environment variable LOCAL_RANK='{2**31}' is out of range"),
])
def test_a_malformed_environment_variable_is_named_with_its_value(path, monkeypatch, name, value, message):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        open_(path)
    assert message in str(info.value)


def test_rank_and_world_size_from_the_environment(path, monkeypatch):
    monkeypatch.setenv("RANK", " 1 ")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "")  # set but empty: the default
    with open_(path) as ds:
        assert (ds.config.rank, ds.config.world_size, ds.device) == (1, 2, 0)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="rank must be below world_size \\(found rank 2, world_size 2\\) \\(what "
                                         "is not passed comes from torch.distributed, else RANK / WORLD_SIZE\\)"):
        open_(path)
    with open_(path, rank=0) as ds:  # an argument wins over the variable
        assert (ds.config.rank, ds.config.world_size) == (0, 2)


def test_gdsload_backend_names_the_variable(path, monkeypatch):
    monkeypatch.setenv("GDSLOAD_BACKEND", "bogus")
    with pytest.raises(ValueError, match="^environment variable GDSLOAD_BACKEND='bogus' is not a backend"):
        GDSDataset(path, batch_size=8)
    monkeypatch.delenv("GDSLOAD_BACKEND")
    unset = resolve("auto", 1)
    monkeypatch.setenv("GDSLOAD_BACKEND", " ")  # set but empty: as unset
    assert resolve("auto", 1) == unset
    monkeypatch.setenv("GDSLOAD_BACKEND", " cpu ")
    assert resolve("auto") == ("cpu", "GDSLOAD_BACKEND=cpu")


@pytest.mark.parametrize("cc, message", [
    ("gcc '-O3", "environment variable CC=\"gcc '-O3\" is not a command line (No closing quotation)"),
    ("   ", "'cc'"),  # blank: the default compiler, which fails on this source (or is missing): no IndexError
])
def test_a_malformed_cc_is_named_with_its_value(tmp_path, monkeypatch, cc, message):
    """The native stager's runtime build reads CC: a value shlex cannot split was a ValueError naming nothing,
    which escaped the build's fallback; it is now the build's RuntimeError (the fallback's reason) naming CC."""
    from gdsload.backends.native import stager

    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(stager, "SOURCE", str(tmp_path / "broken.c"))
    (tmp_path / "broken.c").write_text("this is not C\n")
    with pytest.raises(RuntimeError) as info:
        stager._build(str(tmp_path / "out" / "_stage.so"))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
