"""Batches gathered in groups: the grouping itself (pure functions) and whole epochs, grouped and one by one."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from _helpers import labelled
from gdsload import GDSDataset
from gdsload.pipeline import assembler
from gdsload.pipeline.assembler import batch_groups, merge_segments
from gdsload.pipeline.plan import PlanConfig, epoch_plan

Dataset = functools.partial(GDSDataset, resident_bytes=32 << 10)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("per_group", [1, 2, 5, 1000])
def test_groups_cover_every_batch_once_and_end_with_windows(shuffle, per_group):
    plan = epoch_plan(PlanConfig(num_samples=997, samples_per_block=8, batch_size=13, window_blocks=3,
                                 shuffle=shuffle, seed=3), 0)
    table, last = plan.segment_table(), plan.last_batch_of_window()
    for start in (0, 7):
        groups = list(batch_groups(table, last, start, plan.num_batches, per_group))
        assert [i for a, b in groups for i in range(a, b)] == list(range(start, plan.num_batches))
        assert all(1 <= b - a <= per_group for a, b in groups)
        for a, b in groups:
            # no window's last batch inside a group but at its end: a group never waits for a later window
            assert not any(last[w] == i for i in range(a, b - 1) for w, *_ in table[i])
    if per_group > 1:
        assert any(b - a > 1 for a, b in batch_groups(table, last, 0, plan.num_batches, per_group))


def test_merged_segments_gather_the_same_rows():
    plan = epoch_plan(PlanConfig(num_samples=500, samples_per_block=10, batch_size=7, window_blocks=4), 0)
    table = plan.segment_table()
    rows = merge_segments([s for i in range(0, 20) for s in table[i]])
    assert rows[0][1] == 0 and rows[-1][2] == plan.batch_bounds(19)[1]
    for (w, start, stop, first), nxt in zip(rows, rows[1:] + [None]):
        if nxt is not None:
            assert nxt[1] == stop and nxt[0] != w  # merged as far as the window goes
        if first >= 0:  # a copy: the positions run on
            np.testing.assert_array_equal(plan.positions[start:stop], np.arange(first, first + stop - start))
    # unshuffled, the windows' positions run on: one copy per window
    assert all(first >= 0 for *_, first in rows)


def test_a_break_in_the_positions_makes_a_gather():
    assert merge_segments([(0, 0, 4, 10), (0, 4, 8, 20)]) == [(0, 0, 8, -1)]
    assert merge_segments([(0, 0, 4, 10), (0, 4, 8, 14)]) == [(0, 0, 8, 10)]
    assert merge_segments([(0, 0, 4, 10), (1, 4, 8, 0)]) == [(0, 0, 4, 10), (1, 4, 8, 0)]
    assert merge_segments([(0, 0, 4, -1), (0, 4, 8, 4)]) == [(0, 0, 8, -1)]


@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


@pytest.mark.parametrize("options", [
    {"shuffle": True, "seed": 2, "window_blocks": 3},
    {"window_blocks": 2},
    {"window_blocks": 1, "batch_size": 50},  # batches span windows
    {"shuffle": True, "window_blocks": 4, "drop_last": True},
])
def test_grouped_epochs_equal_batch_by_batch(data_path, monkeypatch, options):
    path, data = data_path
    options = {"batch_size": 16, **options}
    epochs = {}
    for group_bytes in (1, 4 << 10, 1 << 30):
        monkeypatch.setattr(assembler, "GROUP_BYTES", group_bytes)
        with Dataset(path, backend="cpu", **options) as ds:
            epochs[group_bytes] = [[{k: v.copy() for k, v in b.items()} for b in ds] for _ in range(2)]
    for group_bytes in (4 << 10, 1 << 30):
        for e0, e1 in zip(epochs[1], epochs[group_bytes]):
            assert len(e0) == len(e1)
            for b0, b1 in zip(e0, e1):
                assert b0.keys() == b1.keys()
                for k in b0:
                    np.testing.assert_array_equal(b0[k], b1[k])
    for epoch in epochs[1 << 30]:
        for b in epoch:
            np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])


def test_a_batch_kept_alone_outlives_its_group(data_path):
    path, data = data_path  # small batches: gathered in groups of several at the default group size
    with Dataset(path, backend="cpu", batch_size=16, shuffle=True) as ds:
        kept = None
        for i, b in enumerate(ds):
            if i == 3:
                kept = b
        assert kept["x"].base is not None  # a view of its group's rows
        np.testing.assert_array_equal(kept["x"], data["x"][kept["idx"]])
        assert kept["x"].shape[0] == 16 and kept["x"].flags.c_contiguous


def test_a_pass_index_arrays_go_up_before_its_first_read(data_path, monkeypatch, plug):
    """An upload queued behind a window's copies waits for them (the copy engine serves them in order), and
    the pass's first batch with it: each pass's index arrays are uploaded before its first read is
    submitted, the next pass's (read ahead) included. Its windows, in order: uploads counted per pass."""
    import threading

    from gdsload.backends import info
    from gdsload.cuda.ops import HostOps

    path, data = data_path
    log: list[str] = []
    lock = threading.Lock()
    upload = HostOps.upload

    def logged(name, fn):
        def f(*a, **kw):
            with lock:
                log.append(name)
            return fn(*a, **kw)
        return f

    class Logged(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def submit(self, *a, **kw):
            return logged("submit", super().submit)(*a, **kw)

    monkeypatch.setattr(HostOps, "upload", logged("upload", upload))
    with Dataset(path, backend=plug(Logged), batch_size=16, window_blocks=5, shuffle=True) as ds:
        windows, resident = len(epoch_plan(ds.config, 0).windows), len(ds.resident_fields)
        with lock:
            assert log == ["submit"], "the open reads the first window"
            log.clear()
        for _ in range(2):
            for b in ds:
                np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])
        ds.stop()
    with lock:
        reads = [i for i, e in enumerate(log) if e == "submit"]
        uploads = [i for i, e in enumerate(log) if e == "upload"]
    # Resident fields are read once first (one submit each), through the same backend; then pass after pass,
    # the first without its first window (read at open).
    assert resident >= 1 and len(reads) >= resident + 2 * windows - 1 and len(uploads) >= 2
    for k in range(2):
        first_read = reads[resident + k * windows - k]
        assert uploads[k] < first_read, f"pass {k}: its index went up after its first read ({log[:40]})"
