"""gdsload.tools.measure's primitives checked against what they measure, and the suite's canaries
(benchmarks.canaries, around a training-step row's passes), on the cpu backend."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from _helpers import reader_threads
from gdsload import GDSDataset, write_dataset
from gdsload.tools.measure import PassResult, block_locations, read_files, shard_paths, time_pass, time_passes
from gdsload.tools.steps import HostStep


# -- gdsload.tools.measure ---------------------------------------------------------------------------------------
class Source:
    """An array source for write_dataset (the test's own, as the benchmarks' synthetic one)."""

    origin = "<test>"

    def __init__(self, a: np.ndarray):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.a[start:stop]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("measure") / "small.gds")
    x = np.arange(600 * 1024, dtype=np.uint8).reshape(600, 1024)
    write_dataset(path, {"x": Source(x), "y": Source(np.arange(600, dtype=np.int64))}, block_bytes=16 << 10,
                  progress=False)
    return path


def test_time_pass_counts_the_bytes_delivered(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        r = time_pass(ds)
        twice = time_pass(ds, min_seconds=1e-9)  # at least one pass: the same figures
    # What reached the consumer: every sample once (the blocks stored add the last block's padding).
    assert r.bytes == 600 * (1024 + 8) < sum(b.nbytes for b in block_locations(small))
    assert r.samples == 600 and r.io_mode == "cpu" and twice.bytes == r.bytes
    assert r.gb_per_s > 0 and r.samples_per_s > 0 and 0 <= r.stall_fraction <= 1 and r.wait_s is None


def test_time_pass_with_a_step_waits_at_least_nothing(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu") as ds:
        r = time_pass(ds, HostStep(2.0))
    # Timings on a shared CI machine jitter either way: only the relations that define the figures are checked.
    assert r.alone_s >= 12 * 0.002 and r.seconds >= 12 * 0.002
    assert r.wait_s == max(0.0, r.seconds - r.alone_s) and 0 <= r.wait_fraction < 1


class _Watched(HostStep):
    """A step that notes, when its steps alone are timed, whether the dataset still had a pass reading (its
    pipeline's threads, ``gdsload-reader-*``, alive)."""

    def __init__(self, ds: GDSDataset, ms: float):
        super().__init__(ms)
        self.ds, self.reading_while_alone = ds, []

    def alone(self, steps: int) -> float:
        self.reading_while_alone.append(bool(reader_threads()))
        return super().alone(steps)


@pytest.mark.parametrize("timer", ["time_pass", "time_passes"])
def test_steps_alone_are_timed_with_nothing_reading(small: str, timer: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        step = _Watched(ds, 0.5)
        for _ in range(2):  # the second time, the pass before has left the pipeline reading the next epoch
            time_pass(ds, step) if timer == "time_pass" else time_passes(ds, step, 1)
    # time_passes times the steps alone before its passes and again after them
    assert step.reading_while_alone == [False] * (2 if timer == "time_pass" else 4)


def test_time_passes_splits_one_stretch_into_passes(small: str) -> None:
    with GDSDataset(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        t0 = time.perf_counter()
        runs = time_passes(ds, HostStep(1.0), passes=3)
        wall = time.perf_counter() - t0
    assert len(runs) == 4
    for r in runs:  # every pass delivers every sample once, with its own first batch and waiting
        assert r.samples == 600 and r.bytes == 600 * (1024 + 8) and r.first_batch_s is not None
        assert r.alone_s == runs[0].alone_s >= 12 * 0.001 and r.wait_s == max(0.0, r.seconds - r.alone_s)
        assert r.alone_again_s == runs[0].alone_again_s >= 12 * 0.001  # the steps alone, timed again after
    assert sum(r.seconds for r in runs) <= wall  # consecutive stretches of one clock, the steps alone before them


def test_host_step_queues_like_a_device() -> None:
    step = HostStep(5.0, sync_every=4)
    t0 = time.perf_counter()
    for _ in range(3):
        step()  # launched, not waited for
    assert time.perf_counter() - t0 < 0.005
    step()  # the 4th syncs: the queue of 4 steps has drained
    assert time.perf_counter() - t0 >= 0.02
    assert step.alone(4) >= 0.02


def test_read_files_reads_every_byte(small: str) -> None:
    paths = shard_paths(small)
    total = sum(os.path.getsize(p) for p in paths)
    r = read_files(paths, threads=3, chunk=8 << 10)
    assert r.bytes == total and r.io_mode == "posix" and r.cpu_s >= 0
    try:
        direct = read_files(paths, direct=True, threads=2, chunk=8 << 10)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    assert direct.bytes == total and direct.io_mode == "posix-odirect"


def test_block_locations_are_the_blocks(small: str) -> None:
    blocks = block_locations(small, ("x",))
    assert len(blocks) == -(-600 * 1024 // (16 << 10)) and all(b.nbytes == 16 << 10 for b in blocks)
    with open(blocks[3].path, "rb") as f:
        f.seek(blocks[3].offset)
        data = np.frombuffer(f.read(blocks[3].nbytes), np.uint8)
    assert np.array_equal(data, np.arange(600 * 1024, dtype=np.uint8)[3 * (16 << 10):4 * (16 << 10)])


def test_pass_result_fractions() -> None:
    r = PassResult(bytes=2_000_000_000, seconds=2.0, io_mode="x", samples=100, cpu_s=1.0, stall_s=0.5,
                   first_batch_s=0.5, wait_s=0.2)
    assert (r.gb_per_s, r.samples_per_s, r.cpu_core_s_per_gb) == (1.0, 50.0, 0.5)
    assert (r.stall_fraction, r.steady_stall_fraction, r.wait_fraction) == (0.25, 0.0, 0.1)


def test_a_first_batch_under_a_tenth_of_a_millisecond_keeps_its_figure() -> None:
    from benchmarks.rows import figures

    r = PassResult(bytes=1000, seconds=0.01, io_mode="x", stall_s=0.0, first_batch_s=3.2e-05)
    assert figures(r, [])["first_batch_s"] == 3.2e-05


def test_time_pass_starts_from_rest_unless_told(small: str) -> None:
    """What the readers did between measurements (they read the next epoch ahead while nobody timed them)
    must not count as the timed stretch's: time_pass stops reading ahead before the clock starts."""

    class Spy(GDSDataset):
        stops = 0

        def stop(self) -> None:
            Spy.stops += 1
            super().stop()

    with Spy(small, batch_size=50, backend="cpu", resident_bytes=0) as ds:
        time_pass(ds)
        assert Spy.stops == 1
        time_pass(ds, from_rest=False)
        assert Spy.stops == 1, "the earlier method, kept for comparisons, keeps what was read ahead"


def test_read_files_closes_what_it_opened_when_an_open_fails(tmp_path) -> None:
    """The files were all opened before the try that closes them: a refused open leaked the ones before it."""
    import os

    from gdsload.tools.measure import read_files

    good = tmp_path / "a.bin"
    good.write_bytes(b"x" * 8192)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        read_files([str(good), str(tmp_path / "missing.bin")])
    assert len(os.listdir("/proc/self/fd")) == before


# -- the canaries of the 1.5x step rows (benchmarks.canaries) ---------------------------------------------------
def test_unslowed_leaves_out_the_passes_every_canary_saw_slow() -> None:
    from benchmarks.canaries import pass_windows, unslowed

    stamps = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # alone (2), passes 1 + 3 (4), alone again (2)
    windows = pass_windows(stamps, 3)
    assert windows == [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0)] and pass_windows(stamps, 2) is None
    starts = np.arange(0.0, 6.0, 0.1)
    fast = np.stack([starts, np.full(len(starts), 0.001)], axis=1)
    slow = fast.copy()
    slow[(starts >= 3.0) & (starts < 4.0), 1] = 0.002  # both canaries slow in the third pass
    other = slow.copy()
    other[(starts >= 4.0) & (starts < 5.0), 1] = 0.002  # only one canary slow in the fourth: not the machine
    median, least = unslowed([0.01, 0.05, 0.02], windows[1:], [slow, other])
    assert least == [1.0, 2.0, 1.0] and median == 0.015
    assert unslowed([0.01], [(9.0, 10.0)], [fast]) == (None, [None])  # no canary unit: unjudged, left out


def test_canaries_judge_the_passes_of_a_step_row(small: str) -> None:
    """A canary process, pinned to one core, around a training-step row's passes: each pass gets
    its least slowdown, and with a threshold nothing reaches the median of the kept passes is the row's."""
    from benchmarks.rows import GdsRun, Recorder
    from benchmarks.canaries import judged_by_canaries

    run = GdsRun(small, "cpu", 50, step=HostStep(5.0), resident_bytes=0)
    try:
        run()
        core = sorted(os.sched_getaffinity(0))[-1]
        with judged_by_canaries([core], 2.0, run.step, 2, threshold=1e6) as judge:
            assert judge is not None
            row = Recorder(False, 50).steps("small", "gdsload cpu + training step", "5 ms", run, 2, judge=judge,
                                            backend="cpu", step_factor=1.5, sync_every=1)
    finally:
        run.close()
    assert row is not None and row["canary_cores"] == [core] and len(row["canary_least_slowdown_runs"]) == 2
    assert all(s is not None and s > 0 for s in row["canary_least_slowdown_runs"])
    assert row["wait_fraction_unslowed"] == round(float(np.median(row["wait_fraction_runs"])), 4)
