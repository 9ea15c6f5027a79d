"""The backend registry (gdsload.backends.registry): every backend describes itself, and nothing outside
gdsload/backends tells backends apart by their names."""

from __future__ import annotations

import ast
import os

import pytest

from gdsload import backends
from gdsload.backends import registry
from gdsload.backends.base import Backend
from gdsload.errors import BackendUnavailable
from gdsload.system.env import gpu_available

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gdsload")
BACKEND_NAMES = {"cpu", "pinned", "kvikio", "mmap"}


def test_every_name_has_an_info_and_auto_is_not_one():
    assert set(registry.NAMES) == BACKEND_NAMES and registry.BACKENDS == ("auto", *registry.NAMES)
    assert sorted(registry.BENCH_ORDER) == sorted(registry.NAMES)
    for name in registry.NAMES:
        i = registry.info(name)
        assert i.name == name and i.io_modes and issubclass(i.backend_class, Backend)
        assert i.backend_class.name == name
    with pytest.raises(ValueError, match=r"unknown backend 'auto' \(expected one of .*'cpu'"):
        registry.info("auto")


@pytest.mark.parametrize("bad", ["gds", "", "CPU", None])
def test_an_unknown_name_is_a_value_error_naming_it_and_the_known_ones(bad):
    with pytest.raises(ValueError, match=rf"unknown backend {bad!r}.*'pinned', 'kvikio', 'mmap'"):
        registry.info(bad)
    with pytest.raises(ValueError, match=rf"unknown backend {bad!r}"):
        registry.make_backend(bad)


def test_which_backends_are_on_the_device():
    assert {n: registry.info(n).on_device for n in registry.NAMES} == {"cpu": False, "pinned": True, "kvikio": True,
                                                                       "mmap": True}


def test_io_modes_are_the_ones_instances_report():
    assert registry.info("cpu").io_modes == ("cpu",) and registry.info("mmap").io_modes == ("mmap",)
    assert set(registry.info("pinned").io_modes) == {"pinned", "pinned-odirect"}
    assert set(registry.info("kvikio").io_modes) == {"gds", "kvikio-compat"}
    assert registry.io_mode("kvikio", True) == "gds" and registry.io_mode("kvikio", False) == "kvikio-compat"
    for name in ("cpu", "pinned", "mmap"):
        assert registry.io_mode(name, True) == registry.io_mode(name, False) == name


def test_defaults_are_read_from_the_classes():
    from gdsload.backends.cpu import DEFAULT_THREADS, CpuBackend
    from gdsload.backends.pinned.backend import DEFAULT_POOL_BYTES, PinnedBackend

    cpu, pinned = registry.info("cpu").defaults, registry.info("pinned").defaults
    assert cpu["batches_ahead"] == CpuBackend.batches_ahead_hint and cpu["window_bytes"] == CpuBackend.window_bytes_hint
    assert cpu["options"]["num_threads"] == DEFAULT_THREADS
    assert pinned["batches_ahead"] == PinnedBackend.batches_ahead_hint
    assert pinned["options"]["pool_bytes"] == DEFAULT_POOL_BYTES and "device_id" not in pinned["options"]
    assert registry.info("mmap").locks_dataset and not registry.info("pinned").locks_dataset


def test_cpu_is_available_everywhere_and_the_gpu_backends_say_why_not():
    assert registry.info("cpu").available() == (True, "")
    for name in ("pinned", "kvikio", "mmap"):
        ok, why = registry.info(name).available()
        if gpu_available():
            assert ok or "KvikIO" in why
        else:
            assert not ok and "GPU" in why
    assert "cpu" in registry.runnable(1 << 20)
    if not gpu_available():
        assert registry.runnable(1 << 20) == ["cpu"]


@pytest.mark.skipif(gpu_available(), reason="a GPU backend can be made here")
def test_a_gpu_backend_is_refused_without_a_gpu():
    with pytest.raises(BackendUnavailable, match="'pinned' needs a CUDA GPU"):
        registry.make_backend("pinned")


def test_the_cpu_backend_is_made_with_its_options():
    b = registry.make_backend("cpu", 0, num_threads=2)
    try:
        assert b.name == "cpu" and b.stats()["num_threads"] == 2
    finally:
        b.close()


def test_a_registered_backend_is_opened_by_name_and_never_by_auto(make_dataset, plug, monkeypatch):
    """register(name, cls): backend=name opens cls with the dataset's backend_options; auto and the
    environment variable's pick are unchanged; built-in names and classes that are not backends are refused."""
    import numpy as np

    from gdsload import GDSDataset

    made = []

    class Mine(registry.info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def __init__(self, **options):
            super().__init__(**options)
            made.append(options)

    name = plug(Mine)
    assert registry.known(name) and registry.info(name).backend_class is Mine and not registry.info(name).on_device
    assert name not in registry.BACKENDS and registry.resolve(name) == (name, "requested")
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    assert registry.resolve("auto")[0] in registry.NAMES
    path = make_dataset({"x": np.arange(100, dtype=np.int64)}, samples_per_block=10)
    with GDSDataset(path, batch_size=10, backend=name, backend_options={"num_threads": 2}) as ds:
        assert ds.backend_name == name and ds.io_mode == "cpu" and made == [{"num_threads": 2}]
        assert np.array_equal(np.concatenate([b["x"] for b in ds]), np.arange(100))
    with pytest.raises(ValueError, match="'cpu' is built in"):
        registry.register("cpu", Mine)
    with pytest.raises(TypeError, match="expected a subclass of gdsload.backends.base.Backend"):
        registry.register("other", dict)  # type: ignore[arg-type]
    registry.unregister(name)
    assert not registry.known(name)
    with pytest.raises(ValueError, match=f"unknown backend '{name}'"):
        GDSDataset(path, batch_size=10, backend=name)


def test_the_package_re_exports_the_registry():
    for name in ("BACKENDS", "make_backend", "resolve", "choose", "info", "RAM_TIER_SHARE", "ENV_BACKEND", "register",
                 "unregister", "known"):
        assert getattr(backends, name) is getattr(registry, name)


def _name_compares(root: str = ROOT) -> list[str]:
    """``file:line`` of every comparison with a backend's name as a string literal in the package at ``root``,
    outside its backends folder."""
    found = []
    for folder, _, files in os.walk(root):
        if os.path.relpath(folder, root).split(os.sep)[0] == "backends":
            continue
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    sides += [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
                    if any(isinstance(s, ast.Constant) and s.value in BACKEND_NAMES for s in sides):
                        found.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    return found


def test_the_scan_finds_name_compares_of_every_shape(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "x.py").write_text('ok = name == "cpu"\n')  # the registry's own folder
    (tmp_path / "a.py").write_text('if b != "cpu":\n    pass\nc = "mmap" == d\ne = f in ("pinned", "x")\n'
                                   'g = h == "auto"\n')
    assert _name_compares(str(tmp_path)) == ["a.py:1", "a.py:3", "a.py:4"]


def test_no_code_outside_the_backends_tells_backends_apart_by_name():
    assert _name_compares() == [], "ask gdsload.backends.info(name) instead"
