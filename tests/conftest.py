"""Fixtures: tiny datasets written through the real converter, and a GPU switch."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from gdsload.backends import gpu_available
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


def labelled(n: int, shape: tuple[int, ...] = (3, 5), dtype: str = "float32") -> dict[str, np.ndarray]:
    """Samples whose content is derived from their index, so any batch can be checked on its own."""
    idx = np.arange(n, dtype=np.int64)
    x = (idx.reshape(-1, *([1] * len(shape))) * 1000 + np.arange(int(np.prod(shape))).reshape(shape)).astype(dtype)
    return {"x": x, "idx": idx}


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gdsload-reader")]


def break_then_close(ds, check: Callable[[dict], object] = lambda b: None, stop_after: int = 4):
    """Leave a pass early (break), start another, take one batch, close the dataset: no reader thread
    may outlive either exit. Returns the second iterator, still unfinished."""
    for i, b in enumerate(ds):
        check(b)
        if i + 1 == stop_after:
            assert reader_threads(), "a reader runs ahead while the consumer works"
            break
    assert wait_no_readers() == []
    it = iter(ds)
    next(it)
    ds.close()
    assert wait_no_readers() == []
    return it


def wait_no_readers(timeout_s: float = 2.0) -> list[threading.Thread]:
    """Reader threads still alive after ``timeout_s`` (should be none)."""
    deadline = time.monotonic() + timeout_s
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return reader_threads()


def zarr_dataset_with_missing_block(path: str) -> np.ndarray:
    """A dataset written by plain zarr, whose block 1 equals the fill value (-5) and so is never written;
    returns the data it holds."""
    import zarr

    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 12, "samples_per_block": 3, "fields": {"x": {"kind": "fixed"}}}
    a = g.create_array("x", shape=(12, 2), dtype="int16", chunks=(3, 2), shards=(6, 2), fill_value=-5,
                       compressors=None)
    data = np.arange(24, dtype=np.int16).reshape(12, 2)
    data[3:6] = -5
    a[:] = data
    return data


def threads_left_after_use(ds) -> set[threading.Thread]:
    """Leave a pass early, run one to its end, close: the threads started meanwhile still alive 2 s later."""
    before = set(threading.enumerate())
    with ds:
        for i, _ in enumerate(ds):
            if i == 3:
                break
        list(ds)
    deadline = time.monotonic() + 2
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return set(threading.enumerate()) - before
