"""Pacing: the pipeline threads' longer Python work (the next epoch's plan and index, a window's requests) is
cut into short pieces with naps between them, so a consumer back from its step gets the GIL at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gdsload.pipeline import pipeline as pipeline_module
from gdsload.pipeline.pacing import Pacer
from gdsload.pipeline.plan import PlanConfig, epoch_plan

from _helpers import labelled


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_pacer_naps_once_a_piece_of_work_is_over_and_start_begins_a_new_piece():
    clock = FakeClock()
    pace = Pacer(piece_s=1e-4, nap_s=2e-5, clock=clock, sleep=clock.sleep)
    clock.now += 0.5e-4
    pace()
    assert clock.slept == []
    clock.now += 0.6e-4
    pace()
    assert clock.slept == [2e-5] and pace.naps == 1
    clock.now += 0.9e-4
    pace()
    assert pace.naps == 1, "a new piece began after the nap"
    clock.now += 5e-4
    pace.start()  # the thread was blocked: that time was not work holding the GIL
    pace()
    assert pace.naps == 1


def test_pacing_changes_nothing_in_a_plan_and_is_called_after_each_window():
    cfg = PlanConfig(num_samples=1003, samples_per_block=10, batch_size=32, window_blocks=4, shuffle=True, seed=3)
    calls = []
    paced = epoch_plan(cfg, 2, pace=lambda: calls.append(1))
    plain = epoch_plan(cfg, 2)
    assert len(calls) == len(plain.windows) == 26
    assert [w.tolist() for w in paced.windows] == [w.tolist() for w in plain.windows]
    np.testing.assert_array_equal(paced.positions, plain.positions)
    np.testing.assert_array_equal(paced.window_of, plain.window_of)


def _wake_delays(work: callable, seconds: float = 0.3) -> np.ndarray:
    """How late a thread that sleeps 1 ms at a time wakes while ``work`` runs on another thread (seconds)."""
    late: list[float] = []
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(1e-3)
            late.append(time.perf_counter() - t0 - 1e-3)

    t = threading.Thread(target=sleeper)
    t.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
    stop.set()
    t.join()
    return np.array(late)


def test_a_paced_thread_lets_a_sleeping_thread_take_the_gil_as_it_wakes():
    """The mechanism: pure Python work keeps a waking thread out for the whole switch interval (5 ms); the
    same work paced lets it in within a piece. Both arms run, so the test shows it can see the difference."""
    if abs(__import__("sys").getswitchinterval() - 0.005) > 1e-9:
        pytest.skip("the interpreter's switch interval was changed")

    def busy(pace: Pacer | None) -> None:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            sum(range(200))
            if pace is not None:
                pace()

    unpaced = _wake_delays(lambda: busy(None))
    paced = _wake_delays(lambda: busy(Pacer()))
    assert np.median(unpaced) > 2e-3, f"unpaced work let the sleeper in early: {np.median(unpaced) * 1e3:.2f} ms"
    assert np.median(paced) < 1e-3, f"paced work kept the sleeper out: {np.median(paced) * 1e3:.2f} ms"


def test_the_next_epochs_plan_and_index_are_paced_on_the_pipeline_threads_only(make_dataset, monkeypatch):
    """The pass the consumer asks for is made on its own thread, unpaced; the passes read ahead are made on
    the pipeline's threads, paced (window by window, and between the index's steps)."""
    made: list[tuple[str, int]] = []

    class Recording(Pacer):
        def __init__(self) -> None:
            super().__init__(piece_s=0.0, nap_s=0.0)
            self.thread = threading.current_thread().name

        def __call__(self) -> None:
            made.append((self.thread, 1))
            super().__call__()

    monkeypatch.setattr(pipeline_module, "Pacer", Recording)
    from gdsload import GDSDataset

    path = make_dataset(labelled(400), samples_per_block=10)
    with GDSDataset(path, batch_size=16, backend="cpu", shuffle=True, window_blocks=3) as ds:
        first = [b["idx"] for b in ds]
        plans_made = {name for name, _ in made}
        second = [b["idx"] for b in ds]
    assert np.concatenate(second).tolist() == epoch_plan(ds.config, 1).sample_ids().tolist(), "paced plan differs"
    assert len(first) == 25
    assert plans_made and all(name.startswith("gdsload-reader-") for name in plans_made), plans_made
    windows = len(epoch_plan(ds.config, 1).windows)
    assert sum(1 for name, _ in made if name.startswith("gdsload-reader-")) >= windows + 2
