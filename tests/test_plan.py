"""Read plan: order, shuffle, partitioning across ranks, batch cutting. Pure numpy."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from gdsload.pipeline.plan import PlanConfig, epoch_plan


def batches_of(plan) -> list[np.ndarray]:
    ids = plan.sample_ids()
    return [ids[slice(*plan.batch_bounds(i))] for i in range(plan.num_batches)]


def test_sequential_plan_is_identity():
    plan = epoch_plan(PlanConfig(num_samples=103, samples_per_block=10, batch_size=16, window_blocks=3), 0)
    np.testing.assert_array_equal(plan.sample_ids(), np.arange(103))
    assert plan.num_batches == 7 and plan.batch_bounds(6) == (96, 103)
    assert [len(w) for w in plan.windows] == [3, 3, 3, 2]


def test_shuffle_is_seeded_and_changes_per_epoch():
    cfg = PlanConfig(num_samples=1000, samples_per_block=8, batch_size=32, window_blocks=4, shuffle=True, seed=3)
    a, b = epoch_plan(cfg, 0).sample_ids(), epoch_plan(cfg, 0).sample_ids()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, epoch_plan(cfg, 1).sample_ids())
    other_seed = PlanConfig(**{**cfg.__dict__, "seed": 4})
    assert not np.array_equal(a, epoch_plan(other_seed, 0).sample_ids())
    assert not np.array_equal(a, np.arange(1000))
    assert sorted(a.tolist()) == list(range(1000))


def test_samples_stay_inside_their_window():
    cfg = PlanConfig(num_samples=500, samples_per_block=10, batch_size=7, window_blocks=5, shuffle=True)
    plan = epoch_plan(cfg, 2)
    ids = plan.sample_ids()
    for w, blocks in enumerate(plan.windows):
        mine = ids[plan.window_of == w]
        assert set((mine // 10).tolist()) == set(blocks.tolist())


def test_a_batchs_first_window_is_the_window_of_its_first_sample_and_none_past_the_end():
    cfg = PlanConfig(num_samples=500, samples_per_block=10, batch_size=7, window_blocks=5, shuffle=True)
    plan = epoch_plan(cfg, 2)
    ids = plan.sample_ids()
    for i in range(plan.num_batches):
        first = plan.first_window(i)
        assert ids[i * 7] // 10 in plan.windows[first].tolist() and first == plan.window_of[i * 7]
    assert plan.first_window(plan.num_batches) == len(plan.windows) == plan.first_window(plan.num_batches + 3)


@pytest.mark.parametrize("n, k, w, b, world", list(itertools.product(
    [1, 7, 97, 1000], [1, 3, 16], [1, 2, 5], [1, 4, 33], [1, 2, 3])))
def test_every_sample_once_and_ranks_agree(n, k, w, b, world):
    num_blocks = -(-n // k)
    if world > num_blocks:
        with pytest.raises(ValueError, match="exceeds the dataset's"):
            PlanConfig(num_samples=n, samples_per_block=k, batch_size=b, window_blocks=w, world_size=world)
        return
    for shuffle, drop_last in itertools.product([False, True], [False, True]):
        plans = [epoch_plan(PlanConfig(num_samples=n, samples_per_block=k, batch_size=b, window_blocks=w,
                                       shuffle=shuffle, seed=11, drop_last=drop_last, rank=r, world_size=world), 5)
                 for r in range(world)]
        ids = [p.sample_ids() for p in plans]
        sizes = [[len(x) for x in batches_of(p)] for p in plans]
        assert all(s == sizes[0] for s in sizes), "every rank yields the same batches"
        everything = np.concatenate(ids)
        if drop_last:
            assert all(s == b for s in sizes[0])
            assert len(np.unique(everything)) == len(everything), "no sample twice"
            assert n - len(everything) < world * (k + b), "drops at most a block and a batch per rank"
        else:
            assert set(everything.tolist()) == set(range(n)), "every sample at least once"
            assert len(everything) - n < world * k + 1, "padding repeats less than a block per rank"
            assert all(s == b for s in sizes[0][:-1])


def test_ranks_without_padding_partition_exactly():
    n, world = 1024, 4  # divisible: no padding, no drop
    ids = [epoch_plan(PlanConfig(num_samples=n, samples_per_block=16, batch_size=32, window_blocks=2, shuffle=True,
                                 rank=r, world_size=world), 0).sample_ids() for r in range(world)]
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(n))


def test_padding_repeats_samples_of_the_last_window_only():
    plans = [epoch_plan(PlanConfig(num_samples=50, samples_per_block=10, batch_size=8, window_blocks=2,
                                   rank=r, world_size=2), 0) for r in range(2)]
    # rank 0 holds blocks 0-2 (30 samples), rank 1 blocks 3-4 (20): rank 1 repeats 10 of its last window
    short = plans[1]
    assert len(short.positions) == 30
    assert (short.window_of[20:] == len(short.windows) - 1).all()


def test_segments_and_window_release():
    cfg = PlanConfig(num_samples=100, samples_per_block=10, batch_size=15, window_blocks=1)
    plan = epoch_plan(cfg, 0)
    assert plan.segment_table()[0] == [(0, 0, 10, 0), (1, 10, 15, 0)]
    last = plan.last_batch_of_window()
    assert last[0] == 0 and last[1] == 1 and last[-1] == plan.num_batches - 1
    assert plan.max_windows_per_batch() == 2
    wide = epoch_plan(PlanConfig(num_samples=100, samples_per_block=2, batch_size=25, window_blocks=2), 0)
    assert wide.max_windows_per_batch() == 7  # positions 25..49 span windows 6..12


def test_coalesce_split_and_pack():
    from gdsload.backends.base import ReadRequest, coalesce, split
    from gdsload.backends.pinned.staging_pool import pack

    reads = [ReadRequest("a", 0, 100, 0), ReadRequest("a", 100, 100, 100), ReadRequest("b", 200, 100, 200),
             ReadRequest("b", 300, 50, 300), ReadRequest("b", 350, 50, 400)]  # last: file-adjacent, not in dest
    merged = coalesce(reads, 1 << 20)
    assert merged == [ReadRequest("a", 0, 200, 0), ReadRequest("b", 200, 150, 200), ReadRequest("b", 350, 50, 400)]
    assert coalesce(reads, 150)[0] == ReadRequest("a", 0, 100, 0)
    pieces = split(ReadRequest("f", 1000, 10000, 7), 4096)
    assert [(p.offset, p.nbytes, p.dest_offset) for p in pieces] == [(1000, 4096, 7), (5096, 4096, 4103),
                                                                      (9192, 1808, 8199)]
    groups = pack([ReadRequest("f", i * 3000, 3000, i * 3000) for i in range(5)], 8192)
    assert [[at for at, _ in g] for g in groups] == [[0, 4096], [0, 4096], [0]]


def test_mmap_copies_merge_split_and_stop_at_the_file_end():
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.mmap.backend import plan_copies
    from gdsload.errors import ReadError

    def listed(c):
        return [c.read(i) for i in range(len(c))]

    reads = [ReadRequest("a", 0, 100, 0), ReadRequest("a", 100, 100, 100), ReadRequest("b", 0, 300, 200)]
    assert listed(plan_copies(reads, {"a": 200, "b": 300}, 1 << 20)) == [ReadRequest("a", 0, 200, 0),
                                                                         ReadRequest("b", 0, 300, 200)]
    assert listed(plan_copies(reads, {"a": 200, "b": 300}, 128)) == [
        ReadRequest("a", 0, 128, 0), ReadRequest("a", 128, 72, 128), ReadRequest("b", 0, 128, 200),
        ReadRequest("b", 128, 128, 328), ReadRequest("b", 256, 44, 456)]
    # Cut where the locked ranges end (multiples of range_bytes in the file), then every max_bytes.
    assert listed(plan_copies([ReadRequest("b", 50, 250, 7)], {"b": 300}, 64, range_bytes=128)) == [
        ReadRequest("b", 50, 64, 7), ReadRequest("b", 114, 14, 71), ReadRequest("b", 128, 64, 85),
        ReadRequest("b", 192, 64, 149), ReadRequest("b", 256, 44, 213)]
    assert len(plan_copies([], {}, 64)) == 0
    with pytest.raises(ReadError, match="b: file ends at offset 250 \\(expected 300 bytes from offset 0\\)"):
        plan_copies(reads, {"a": 200, "b": 250}, 1 << 20)
    with pytest.raises(ReadError, match="b: not registered"):
        plan_copies(reads, {"a": 200}, 1 << 20)


@pytest.mark.parametrize("seed", range(20))
def test_mmap_copies_move_every_byte_of_the_reads_and_nothing_else(seed):
    """Random reads (some continuing one another, across range ends): the copies carry exactly the bytes the
    reads ask for, to the same places, none longer than max_bytes nor across a range end."""
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.mmap.backend import plan_copies

    rng = np.random.default_rng(seed)
    reads, dest = [], 0
    for _ in range(int(rng.integers(1, 40))):
        path = f"f{int(rng.integers(3))}"
        if reads and rng.random() < 0.5:  # continue the last read in file and buffer
            path, offset = reads[-1].path, reads[-1].offset + reads[-1].nbytes
        else:
            offset = int(rng.integers(0, 5000))
            dest += int(rng.integers(0, 50))
        n = int(rng.integers(1, 700))
        reads.append(ReadRequest(path, offset, n, dest))
        dest += n
    max_bytes, range_bytes = int(rng.integers(1, 400)), int(rng.choice([64, 256, 1024]))
    copies = plan_copies(reads, {f"f{i}": 10_000 for i in range(3)}, max_bytes, range_bytes)

    def bytes_of(items):
        return sorted((r.path, r.offset + j, r.dest_offset + j) for r in items for j in range(r.nbytes))

    pieces = [copies.read(i) for i in range(len(copies))]
    assert bytes_of(pieces) == bytes_of(reads)
    assert all(0 < c.nbytes <= max_bytes for c in pieces)
    assert all(c.offset // range_bytes == (c.offset + c.nbytes - 1) // range_bytes for c in pieces)


def test_mmap_budget_is_checked_before_anything_is_locked():
    from gdsload.backends.mmap.backend import check_budget, default_budget
    from gdsload.errors import BackendUnavailable

    check_budget({"/d/x/c/0": 3 << 30, "/d/x/c/1": 1 << 30}, 4 << 30)
    with pytest.raises(BackendUnavailable, match=r"lock 4.00 GiB of shard files in RAM \(/d/x.*budget of 3.00 GiB"):
        check_budget({"/d/x/c/0": 3 << 30, "/d/x/c/1": 1 << 30}, 3 << 30)
    assert 0 < default_budget() < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shuffle", [False, True])
def test_segment_table_matches_batches(shuffle):
    for n, k, w, b in [(1000, 8, 3, 32), (97, 5, 1, 50), (10, 10, 1, 3), (1001, 7, 4, 1)]:
        plan = epoch_plan(PlanConfig(num_samples=n, samples_per_block=k, batch_size=b, window_blocks=w,
                                     shuffle=shuffle, seed=1), 0)
        table = plan.segment_table()
        assert len(table) == plan.num_batches
        for i, rows in enumerate(table):
            lo, hi = plan.batch_bounds(i)
            assert [r[1] for r in rows] == [lo] + [r[2] for r in rows[:-1]] and rows[-1][2] == hi
            for w, start, stop, first in rows:
                assert (plan.window_of[start:stop] == w).all()
                assert start == lo or plan.window_of[start - 1] != w, "segments are maximal"
                slots = plan.positions[start:stop]
                assert first == (int(slots[0]) if (np.diff(slots) == 1).all() else -1)
