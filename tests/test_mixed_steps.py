"""The pieces of the one pipeline a mixture reads through that need no data: the schedule's steps, made once and
in order whichever thread asks first, and the options a mixture refuses for its sources."""

from __future__ import annotations

import threading

import pytest

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


def test_a_mixture_refuses_to_decode_images_naming_the_source(tmp_path):
    import numpy as np

    from gdsload import Mixture, write_dataset

    path = str(tmp_path / "a.gds")
    write_dataset(path, {"x": np.arange(8)}, progress=False)
    with pytest.raises(ValueError, match="source 'a': images are not decoded in a Mixture yet"):
        Mixture({"a": {"path": path, "images": {"image": object()}}}, batch_size=2, backend="cpu")
