"""errors.with_context, the one way an error is re-raised with context: same type, same fields, for every
GDSLoadError subclass, and through the pipeline's and reader's re-raise sites."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import gdsload
from _helpers import labelled, wait_no_readers
from gdsload import GDSDataset, GDSLoadError
from gdsload.backends import info
from gdsload.errors import with_context
from gdsload.remote.shard_cache import CacheFull


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def _error_classes() -> list[type]:
    """Every GDSLoadError subclass the package defines (each module imported; GPU modules import here too,
    their device calls are never made)."""
    for info in pkgutil.walk_packages(gdsload.__path__, "gdsload."):
        if info.name.endswith("__main__"):  # runs the command line
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (torch, jax) this machine lacks: its errors are not ours
            continue
    classes = sorted(_all_subclasses(GDSLoadError) | {GDSLoadError}, key=lambda c: (c.__module__, c.__qualname__))
    return [c for c in classes if c.__module__.startswith("gdsload")]


def _make(cls: type) -> BaseException:
    """An instance with a message and, where ``__init__`` takes more, a distinct value for each argument."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.default is p.empty]
    args = ["/data/x.gds: something is wrong"] + [1000 + i for i in range(len(params) - 1)]
    return cls(*args) if params else cls("/data/x.gds: something is wrong")


CLASSES = _error_classes()


def test_the_package_defines_errors_with_their_own_constructor():
    """The reason for the helper: a subclass whose __init__ takes more than a message (CacheFull)."""
    assert CacheFull in CLASSES and len(CLASSES) >= 8


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_every_error_keeps_its_type_fields_and_message(cls):
    error = _make(cls)
    error.extra_field = "kept"
    again = with_context(error, "reading window 3 of pass 0")
    assert type(again) is cls
    assert str(again) == f"{error} (reading window 3 of pass 0)"
    fields = {k: v for k, v in vars(error).items()}
    assert {k: getattr(again, k) for k in fields} == fields
    if isinstance(error, OSError):
        assert again.errno == error.errno
    with pytest.raises(cls) as caught:  # raised from the original, as the sites do
        try:
            raise error
        except GDSLoadError as e:
            raise with_context(e, "ctx") from e
    assert caught.value.__cause__ is error


def test_cache_full_keeps_need_and_pinned():
    again = with_context(CacheFull("s3://b/d.gds: no room", need=123, pinned=456), "reading window 2")
    assert (again.need, again.pinned) == (123, 456) and "no room (reading window 2)" in str(again)


@pytest.fixture
def dataset(make_dataset):
    data = labelled(640)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


def _fail_on(plug, n: int = 0, field: str | None = None) -> str:
    """A cpu backend (its name, registered) whose n-th submit (or the first of ``field``'s reads) raises a
    CacheFull, whose __init__ takes need and pinned."""
    calls = [0]

    class Failing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def submit(self, dest, requests, stop):
            calls[0] += 1
            if calls[0] == n or (field is not None and f"/{field}/" in requests[0].path):
                raise CacheFull(f"{requests[0].path}: no room", need=77, pinned=88)
            return super().submit(dest, requests, stop)

    return plug(Failing)


def test_a_cache_full_in_a_later_window_reaches_the_consumer_as_itself(dataset, plug):
    path, data = dataset
    failing = _fail_on(plug, n=4)
    with GDSDataset(path, batch_size=16, backend=failing, window_blocks=2, resident_bytes=0) as ds:
        with pytest.raises(CacheFull, match=r"no room \(reading ") as caught:
            for b in ds:
                np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])
    assert (caught.value.need, caught.value.pinned) == (77, 88)
    assert wait_no_readers() == []


def test_a_cache_full_reading_a_resident_field_reaches_the_consumer_as_itself(dataset, plug):
    path, _ = dataset
    failing = _fail_on(plug, field="idx")
    with GDSDataset(path, batch_size=16, backend=failing, window_blocks=2) as ds:
        assert "idx" in ds.resident_fields
        with pytest.raises(CacheFull, match="reading resident field 'idx'") as caught:
            next(iter(ds))
    assert (caught.value.need, caught.value.pinned) == (77, 88)
    assert wait_no_readers() == []
