"""Fixtures: tiny datasets written through the real converter, a GPU switch, a fake CUDA driver, and the real
servers of tests/remote_servers.py (an HTTP server with ranges, moto's S3 server)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gdsload.system.env import gpu_available
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset
from remote_servers import MotoS3, RangeServer, client_for_server, moto_endpoint, moto_server


@pytest.fixture(autouse=True, scope="session")
def _reaper_running() -> None:
    """The process's one reaper thread (gdsload._tasks.REAPER) runs from the first dataset's open on: started
    here, it is in every test's "threads before" snapshot, as in a process that has opened a dataset."""
    from gdsload._tasks import REAPER

    REAPER.start()


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





@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding the fake libcuda.so.1 built from tests/fixtures/fake_libcuda.c (put it first on
    LD_LIBRARY_PATH in a child process)."""
    d = tmp_path_factory.mktemp("fakecuda")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "fake_libcuda.c")
    done = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-pthread", "-Wl,-soname,libcuda.so.1", "-o",
                           str(d / "libcuda.so.1"), source], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot build the fake libcuda: {done.stderr[-300:]}")
    return str(d)


@pytest.fixture
def srv() -> Iterator[RangeServer]:
    """An HTTP/1.1 server of objects with ranged GETs, ETags and injectable faults, empty to begin with."""
    with RangeServer() as server:
        yield server


@pytest.fixture
def fast_client(srv: RangeServer, request: pytest.FixtureRequest) -> Iterator[object]:
    """The process's client for ``srv``: few retries, short backoff, and a timeout short enough for the faults
    (the test module's ``CLIENT_TIMEOUT_S``, 0.5 s where it sets none)."""
    timeout_s = getattr(request.module, "CLIENT_TIMEOUT_S", 0.5)
    with client_for_server(srv, retries=2, backoff_s=0.01, timeout_s=timeout_s) as client:
        yield client


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """moto's S3 server, one for the session (skipped where boto3 or moto's server mode is missing)."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def s3(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoS3]:
    """A fresh bucket on the session's moto server, with AWS_ENDPOINT_URL, fake keys and region in the env."""
    with moto_server(monkeypatch, endpoint=moto_url) as bucket:
        yield bucket


@pytest.fixture
def plug() -> Iterator[Callable[..., str]]:
    """``plug(cls, on_device=False)`` registers a backend class (gdsload.backends.register) under a name of this
    test's, returned for ``backend=``; forgotten when the test ends."""
    from gdsload.backends import register, unregister

    names: list[str] = []

    def add(cls: type, on_device: bool = False) -> str:
        names.append(f"test-{cls.__name__.lower()}-{len(names)}")
        register(names[-1], cls, on_device)
        return names[-1]

    yield add
    for name in names:
        unregister(name)
