"""The native batcher in host mode (gdsload/batcher.py, _batches.c): its scheduling, copies and gathers, slots,
window hand-back, failures and stops, on host memory; and the pipeline's use of it against the Python
assembler's."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest

from gdsload import GDSDataset, stager
from gdsload.batch_program import COPY, GATHER, OP_WORDS, Program
from gdsload.batcher import (FAILED, NONE_LEFT, NONE_YET, READER_FAILED, STOPPED, WINDOW_END, WINDOW_FAILED,
                             Batcher)
from gdsload.errors import ReadError

from _helpers import labelled, reader_threads, wait_no_readers

# "idx" resident, "x" read window by window: both kinds of source.
Dataset = functools.partial(GDSDataset, resident_bytes=32 << 10)
pytestmark = pytest.mark.skipif(stager.load() is None, reason=f"no native library: {stager.unavailable_reason()}")


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class Rig:
    """Two window buffers of 64 bytes (buffer i holds bytes 100 * i + 0..63) and slots of 16 bytes."""

    def __init__(self, ahead: int = 2, slots: int = 3):
        self.bufs = [np.arange(64, dtype=np.uint8) + 100 * i for i in range(2)]
        self.b = Batcher("host", 0, 0, [addr(x) for x in self.bufs], ahead)
        self.slots = [np.zeros(16, dtype=np.uint8) for _ in range(slots)]
        for s in self.slots:
            self.b.free_slot(self.b.add_slot(addr(s)))
        self.idx = np.array([3, 1], dtype=np.int32)

    def op(self, kind: int, window: int, src: int, out: int, rows: int, row_bytes: int = 4) -> list[int]:
        idx = addr(self.idx) if kind == GATHER else 0
        return [kind, 0, window, src, idx, 4, out, rows, row_bytes, row_bytes, 0]

    def program(self, batches: list[tuple[list[tuple[int, int]], list[list[int]]]]) -> Program:
        """batches: ([(window, last reader?)], [op, ...]) each."""
        op_start, win_start, ops, win_w, win_rel = [0], [0], [], [], []
        for windows, batch_ops in batches:
            ops += batch_ops
            win_w += [w for w, _ in windows]
            win_rel += [int(r) for _, r in windows]
            op_start.append(len(ops))
            win_start.append(len(win_w))
        return Program(np.array(op_start), np.array(ops, dtype=np.int64).reshape(-1, OP_WORDS), np.array(win_start),
                       np.array(win_w), np.array(win_rel), np.full(len(batches), 4))

    def take(self, timeout: float = 5.0) -> int:
        s = self.b.wait(timeout)
        assert s >= 0, f"no batch within {timeout} s (got {s}, state {self.b.state()})"
        return s


def two_batches(rig: Rig) -> Program:
    return rig.program([
        ([(0, False)], [rig.op(COPY, 0, 8, 0, 2), rig.op(GATHER, 0, 16, 8, 2)]),
        ([(0, True), (1, True)], [rig.op(COPY, 0, 40, 0, 1), rig.op(GATHER, 1, 0, 4, 2), rig.op(COPY, 1, 60, 12, 1)]),
    ])


def test_batches_come_in_order_with_copies_and_gathers_from_the_right_buffers():
    rig = Rig()
    try:
        rig.b.add_pass(0, two_batches(rig))
        assert rig.b.take() == NONE_YET  # no window yet
        rig.b.announce(0, 0, 1)  # window 0 is in buffer 1
        s = rig.take()
        buf = rig.bufs[1]
        want = np.concatenate([buf[8:16], buf[16 + 12:16 + 16], buf[16 + 4:16 + 8]])
        np.testing.assert_array_equal(rig.slots[s], want)
        rig.b.announce(0, 1, 0)  # window 1 in buffer 0
        s = rig.take()
        other = rig.bufs[0]
        want = np.concatenate([buf[40:44], other[12:16], other[4:8], other[60:64]])
        np.testing.assert_array_equal(rig.slots[s], want)
        assert rig.b.published() == (2, 0)
    finally:
        rig.b.close()


def test_window_buffers_are_handed_back_once_read_for_the_last_time():
    rig = Rig()
    try:
        assert [rig.b.free_buffer(1.0), rig.b.free_buffer(1.0)] == [0, 1]  # all free at first, in order
        assert rig.b.free_buffer(0.05) == -1
        rig.b.add_pass(0, two_batches(rig))
        rig.b.announce(0, 0, 1)
        rig.take()
        assert rig.b.free_buffer(0.05) == -1, "window 0 is read again by batch 1"
        rig.b.announce(0, 1, 0)
        rig.take()
        assert sorted([rig.b.free_buffer(1.0), rig.b.free_buffer(1.0)]) == [0, 1]
    finally:
        rig.b.close()


def test_the_batcher_waits_for_a_free_slot_and_keeps_at_most_ahead_batches():
    rig = Rig(ahead=1, slots=2)
    one = rig.program([([(0, i == 2)], [rig.op(COPY, 0, 4 * i, 0, 1)]) for i in range(3)])
    try:
        rig.b.add_pass(0, one)
        rig.b.announce(0, 0, 0)
        a = rig.take()
        time.sleep(0.1)
        assert rig.b.published() == (2, 1), "one batch ahead, no more"
        b = rig.take()
        time.sleep(0.1)
        assert rig.b.published() == (2, 0), "both slots are the consumer's: nothing is written"
        rig.b.free_slot(a)
        c = rig.take()
        assert c == a and rig.slots[c][:4].tolist() == rig.bufs[0][8:12].tolist()
        assert b != a
    finally:
        rig.b.close()


def test_a_failed_read_stops_the_batcher_after_the_batches_before_it():
    rig = Rig()
    try:
        rig.b.add_pass(0, two_batches(rig))
        rig.b.announce(0, 0, 0)
        rig.b.announce(-1, -1, WINDOW_FAILED)
        assert rig.take() >= 0, "batch 0 needs only window 0"
        assert rig.b.wait(5.0) == NONE_LEFT
        state, message = rig.b.state()
        assert state == READER_FAILED and "window 1 of pass 0" in message
        assert rig.b.free_buffer(0.05) == -2, "the submitter stops too"
    finally:
        rig.b.close()


def test_the_readers_ending_before_the_plan_is_an_internal_error():
    rig = Rig()
    try:
        rig.b.add_pass(0, two_batches(rig))
        rig.b.announce(-1, -1, WINDOW_END)
        assert rig.b.wait(5.0) == NONE_LEFT
        state, message = rig.b.state()
        assert state == FAILED and "internal error: the reader finished before the plan did" in message
    finally:
        rig.b.close()


def test_passes_go_in_order_and_on_from_their_first_batch():
    rig = Rig()
    try:
        with pytest.raises(ReadError, match="pass 1 added where pass 0 was due"):
            rig.b.add_pass(1, two_batches(rig))
        rig.b.add_pass(0, two_batches(rig), first=1)  # resumed at batch 1
        rig.b.add_pass(1, two_batches(rig))
        rig.b.announce(0, 0, 0)
        rig.b.announce(0, 1, 1)
        s = rig.take()
        assert rig.slots[s][:4].tolist() == rig.bufs[0][40:44].tolist(), "pass 0 began at its batch 1"
        rig.b.free_slot(s)
        assert sorted([rig.b.free_buffer(1.0), rig.b.free_buffer(1.0)]) == [0, 1]
        rig.b.announce(1, 0, 1)
        s = rig.take()
        assert rig.slots[s][:8].tolist() == rig.bufs[1][8:16].tolist(), "then pass 1 from its start"
    finally:
        rig.b.close()


def test_stop_wakes_every_waiter_and_calls_after_close_are_safe():
    rig = Rig()
    rig.b.add_pass(0, two_batches(rig))
    for _ in range(2):
        rig.b.free_buffer(1.0)
    got: list[int] = []
    waiters = [threading.Thread(target=lambda: got.append(rig.b.wait(30.0))),
               threading.Thread(target=lambda: got.append(rig.b.free_buffer(30.0)))]
    for t in waiters:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    rig.b.stop()
    for t in waiters:
        t.join(5)
    assert time.monotonic() - t0 < 2 and sorted(got) == [-2, -2]
    rig.b.close()
    rig.b.close()
    assert rig.b.take() == NONE_LEFT and rig.b.state()[0] == STOPPED


# -- the pipeline: native batches against the Python assembler's --

@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


def check_batch(batch: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(batch["x"], data["x"][batch["idx"]])

def test_the_pipeline_assembles_natively_and_matches_the_python_assembler(data_path, monkeypatch):
    path, data = data_path
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, shuffle=True, seed=3) as ds:
        it = iter(ds)
        first = next(it)
        assert ds._active[0].native is not None
        assert len(reader_threads()) == 2, "no assembler thread"
        native = [first["idx"].copy()] + [check_batch(b, data) or b["idx"].copy() for b in it]
    monkeypatch.setenv(stager.ENV_NATIVE, "0")
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, shuffle=True, seed=3) as ds:
        it = iter(ds)
        first = next(it)
        assert ds._active[0].native is None and len(reader_threads()) == 3
        python = [first["idx"].copy()] + [b["idx"].copy() for b in it]
    assert [a.tolist() for a in native] == [a.tolist() for a in python]
    assert wait_no_readers() == []


def test_batches_and_views_the_consumer_keeps_are_never_written_again(data_path):
    """Every batch of two epochs kept (and a view of one): slots are added, none is reused under them."""
    path, data = data_path
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, shuffle=True, seed=5,
                 batches_ahead=2) as ds:
        kept, views = [], []
        for e in range(2):
            ds.set_epoch(e)
            for b in ds:
                kept.append(b)
                views.append(b["x"][1:3])
        native = ds._active[0].native if ds._active else None
        for b, v in zip(kept, views):
            check_batch(b, data)
            np.testing.assert_array_equal(v, data["x"][b["idx"][1:3]])
        if native is not None:
            assert len(native.slots) >= len(kept)


@pytest.mark.parametrize("shuffle, kinds", [(False, {COPY}), (True, {GATHER})])
def test_programs_copy_runs_of_consecutive_samples_and_gather_the_rest(data_path, monkeypatch, shuffle, kinds):
    """The windowed field "x" (the resident "idx" is always gathered by sample id, from no window)."""
    path, data = data_path
    programs = []
    add_pass = Batcher.add_pass
    monkeypatch.setattr(Batcher, "add_pass", lambda self, k, program, *a: (programs.append(program),
                                                                         add_pass(self, k, program, *a))[1])
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, shuffle=shuffle, prefetch_next_epoch=False) as ds:
        for b in ds:
            check_batch(b, data)
    (program,) = programs
    windowed = program.ops[program.ops[:, 2] >= 0]
    assert set(windowed[:, 0].tolist()) == kinds
    assert (program.ops[program.ops[:, 2] < 0][:, 0] == GATHER).all()
    assert program.sizes.sum() == 997 and program.num_batches == len(ds)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kvikio", "pinned", "mmap"])
@pytest.mark.parametrize("output", ["cupy", "torch"])
def test_gpu_batches_come_from_the_batcher_and_what_the_consumer_keeps_is_never_rewritten(data_path, backend,
                                                                                         output):
    """Only a view of one batch kept (a torch view of the tensor, for torch): its slot stays out of use
    while every other slot goes round many times."""
    if output == "torch":
        pytest.importorskip("torch")
    import cupy

    path, data = data_path
    with Dataset(path, batch_size=16, backend=backend, window_blocks=2, shuffle=True, seed=7, output=output) as ds:
        views, ids = [], []
        for i, b in enumerate(ds):
            if i == 0:
                assert ds._active[0].native is not None, "assembled by the native batcher"
            if i in (0, 3):
                views.append(b["x"][2:5])
                ids.append(np.asarray(b["idx"][2:5].tolist()))
        cupy.cuda.get_current_stream().synchronize()
        for v, idx in zip(views, ids):
            got = v.cpu().numpy() if output == "torch" else cupy.asnumpy(v)
            np.testing.assert_array_equal(got, data["x"][idx])
        native = ds._active[0].native
        assert len(native.slots) <= native.ahead + 3 + len(views), "a slot added for each batch held, no more"


def test_slots_the_consumer_dropped_are_reused_and_none_are_added(data_path):
    path, data = data_path
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, shuffle=True, seed=5) as ds:
        for e in range(3):
            ds.set_epoch(e)
            for b in ds:
                check_batch(b, data)
        native = ds._active[0].native
        assert len(native.slots) == native.ahead + 3, "the consumer held one batch at a time"
