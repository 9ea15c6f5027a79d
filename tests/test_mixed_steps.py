"""The pieces of the one pipeline a mixture reads through that need no data: the schedule's steps, made once and
in order whichever thread asks first, passes made once per key, and the options a mixture refuses for its
sources."""

from __future__ import annotations

import threading

import pytest

from gdsload.pipeline.once import MadeOnce
from gdsload.pipeline.steps import Step, Steps


def test_steps_are_made_once_in_order_whichever_thread_asks_and_forgotten_once_passed():
    made: list[int] = []

    def make(step: int) -> Step:
        made.append(step)
        return Step((step, 1), f"after {step}")

    steps = Steps(make, 5)
    got: list[Step] = []
    threads = [threading.Thread(target=lambda s=s: got.append(steps.get(s))) for s in (40, 7, 25, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == list(range(5, 41)), "each step once, in order, however the threads ask"
    assert steps.get(12) == Step((12, 1), "after 12") and sorted(s.counts[0] for s in got) == [7, 25, 40, 40]
    steps.forget(30)
    assert steps.get(30).after == "after 30" and made == list(range(5, 41)), "a step not passed is kept"
    with pytest.raises(KeyError):
        steps.get(29)  # passed by every thread: forgotten, never made again
    steps.forget(1000)  # beyond what was made: drops what was made, nothing more
    assert steps.get(41).after == "after 41" and made[-1] == 41


def test_a_pass_is_made_once_by_the_first_asker_while_askers_of_another_wait_for_none():
    passes: MadeOnce[object] = MadeOnce()
    made: list[int] = []
    making, gate = threading.Event(), threading.Event()

    def slow(k: int) -> object:
        made.append(k)
        making.set()
        assert gate.wait(5), "the gate opens"
        return object()

    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(passes.get(1, lambda: slow(1)))) for _ in range(2)]
    for t in threads:
        t.start()
    assert making.wait(5)
    other = passes.get(2, lambda: made.append(2) or "two")  # while pass 1 is being made
    gate.set()
    for t in threads:
        t.join(5)
    assert other == "two" and made == [1, 2], "pass 1 made once; pass 2 made meanwhile, not behind it"
    assert len(got) == 2 and got[0] is got[1] is passes.get(1, lambda: slow(1))
    passes.get(3, lambda: "three", keep=lambda j: j >= 2)
    assert passes.drop(3) == ["two"] and passes.get(3, lambda: "again") == "three"
    assert passes.get(1, lambda: "anew") == "anew", "a pass dropped is made again"


def test_a_mixture_refuses_to_decode_images_naming_the_source(tmp_path):
    import numpy as np

    from gdsload import Mixture, write_dataset

    path = str(tmp_path / "a.gds")
    write_dataset(path, {"x": np.arange(8)}, progress=False)
    with pytest.raises(ValueError, match="source 'a': images are not decoded in a Mixture yet"):
        Mixture({"a": {"path": path, "images": {"image": object()}}}, batch_size=2, backend="cpu")
