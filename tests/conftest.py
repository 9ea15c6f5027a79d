"""Fixtures: tiny datasets written through the real converter, and a GPU switch."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from gdsload.env import gpu_available
from gdsload.sources import ArraySource
from gdsload.writer import write_dataset


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_dataset(tmp_path: os.PathLike[str]) -> Callable[..., str]:
    """Write ``arrays`` (name -> numpy array) as a dataset and return its path."""
    counter = iter(range(1_000_000))

    def make(arrays: dict[str, np.ndarray], **options: object) -> str:
        path = os.path.join(tmp_path, f"ds{next(counter)}.gds")
        options.setdefault("progress", False)
        write_dataset(path, {k: ArraySource(f"<{k}>", v) for k, v in arrays.items()}, **options)
        return path

    return make



