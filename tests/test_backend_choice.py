"""What backend ``auto`` picks, from the facts (pure), and the GDSLOAD_BACKEND override."""

from __future__ import annotations

import pytest

from gdsload import GDSDataset
from gdsload.backends import RAM_TIER_SHARE, choose, resolve

from _helpers import labelled

GiB = 1 << 30


def test_without_a_gpu_auto_is_cpu_whatever_else_holds():
    assert choose(False, True, True, 1, 100 * GiB)[0] == "cpu"


@pytest.mark.parametrize("gds,kvikio,other", [(True, True, "kvikio"), (False, True, "pinned"),
                                              (False, False, "pinned")])
def test_a_dataset_that_fits_goes_to_the_ram_tier(gds, kvikio, other):
    available = 100 * GiB
    fits = int(RAM_TIER_SHARE * available)
    name, why = choose(True, gds, kvikio, fits, available)
    assert name == "mmap" and "fits" in why and "GiB" in why
    assert choose(True, gds, kvikio, fits + 1, available)[0] == other
    assert choose(True, gds, kvikio, None, available)[0] == other, "size unknown: never the RAM tier"


def test_environment_overrides_auto_but_not_an_explicit_backend(monkeypatch, make_dataset):
    monkeypatch.setenv("GDSLOAD_BACKEND", "cpu")
    assert resolve("auto") == ("cpu", "GDSLOAD_BACKEND=cpu")
    assert resolve("mmap") == ("mmap", "requested")
    path = make_dataset(labelled(50), samples_per_block=10)
    with GDSDataset(path, batch_size=8) as ds:
        assert ds.backend_name == "cpu" and ds.backend_reason == "GDSLOAD_BACKEND=cpu"
    monkeypatch.setenv("GDSLOAD_BACKEND", "fast")
    with pytest.raises(ValueError, match="GDSLOAD_BACKEND='fast' is not a backend"):
        resolve("auto")


def test_gds_only_where_the_file_system_allows_it():
    """On a GDS machine, a dataset on a file system cuFile reads only in compat mode (tmpfs, ext4 in
    writeback, NFS over TCP) is not given to kvikio as GDS, and the kvikio backend does not claim io mode
    "gds" for it (it did: both looked at the machine only)."""
    import os

    from gdsload.backends.kvikio import io_mode_for
    from gdsload.system.sysfiles import SystemFiles, path_support

    root = SystemFiles(os.path.join(os.path.dirname(__file__), "fixtures", "doctor", "gds_host"))
    shm, raid, scratch = (path_support(p, root) for p in ("/dev/shm/d.gds/x/c/0", "/raid/d.gds/x/c/0",
                                                           "/scratch/d.gds/x/c/0"))
    assert shm.gds is False and raid.gds is True and scratch.gds is False  # tmpfs; ext4 on NVMe; writeback
    assert choose(True, True, True, None, None, raid) == ("kvikio", "GPUDirect Storage is available")
    name, why = choose(True, True, True, None, None, shm)
    assert name == "pinned" and "not for this dataset's files (tmpfs" in why
    assert io_mode_for(True, [raid]) == "gds" and io_mode_for(True, [raid, shm]) == "kvikio-compat"
    assert io_mode_for(True, [None]) == "gds" and io_mode_for(False, [raid]) == "kvikio-compat"
    from gdsload.system.sysfiles import paths_support

    reads = []
    counting = SystemFiles(root.root)
    counting.read = lambda name, read=counting.read: (reads.append(name), read(name))[1]
    many = paths_support([f"/raid/d.gds/x/c/{i}" for i in range(50)] + ["/dev/shm/a"], counting)
    assert many == [raid] * 50 + [shm], "the same answers as one path at a time"
    assert reads.count("/proc/self/mountinfo") == 1 and len(reads) <= 4, "the mount table read once"


def _fake_kvikio(monkeypatch, compat_preferred: bool, driver_gds: bool) -> list[str]:
    """KvikIO's modules as gdsload.system.env reads them; returns the list of driver properties asked for."""
    import sys
    import types

    from gdsload.system import env

    asked: list[str] = []
    kvikio = types.ModuleType("kvikio")
    kvikio.__version__ = "26.10.0"
    driver = types.ModuleType("kvikio.cufile_driver")
    driver.get = lambda key: asked.append(key) or driver_gds
    defaults = types.ModuleType("kvikio.defaults")
    defaults.is_compat_mode_preferred = lambda: compat_preferred
    defaults.get = lambda key: {"num_threads": 1, "task_size": 4 << 20}[key]
    kvikio.cufile_driver, kvikio.defaults = driver, defaults
    for name, module in [("kvikio", kvikio), ("kvikio.cufile_driver", driver), ("kvikio.defaults", defaults)]:
        monkeypatch.setitem(sys.modules, name, module)
    env._kvikio_info.cache_clear()
    return asked


@pytest.fixture
def fresh_kvikio_info():
    from gdsload.system import env

    env._kvikio_info.cache_clear()
    yield
    env._kvikio_info.cache_clear()


@pytest.mark.parametrize("driver_gds", [True, False])
def test_with_compat_mode_preferred_the_io_mode_needs_no_driver_start(monkeypatch, fresh_kvikio_info, driver_gds):
    """The defect: every kvikio dataset's open started cuFile's driver to ask about GDS, even where KvikIO
    prefers compat mode and would never use GDS."""
    from gdsload.system import env

    asked = _fake_kvikio(monkeypatch, compat_preferred=True, driver_gds=driver_gds)
    info = env.kvikio_info()
    assert asked == [] and info["io_mode"] == "kvikio-compat" and not env.gds_available()
    assert info["is_gds_available"] is None and "compat mode" in info["gds_not_asked"]
    full = env.kvikio_info(driver=True)  # gdsload info and doctor ask the driver anyway
    assert asked == ["is_gds_available"] and full["is_gds_available"] is driver_gds
    assert full["io_mode"] == "kvikio-compat"


def test_without_compat_mode_preferred_the_driver_decides(monkeypatch, fresh_kvikio_info):
    from gdsload.system import env

    asked = _fake_kvikio(monkeypatch, compat_preferred=False, driver_gds=True)
    assert env.kvikio_info()["io_mode"] == "gds" and env.gds_available() and asked == ["is_gds_available"]
    env._kvikio_info.cache_clear()
    asked = _fake_kvikio(monkeypatch, compat_preferred=False, driver_gds=False)
    assert env.kvikio_info()["io_mode"] == "kvikio-compat" and asked == ["is_gds_available"]
