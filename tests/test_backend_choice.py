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
    from gdsload.sysfiles import SystemFiles, path_support

    root = SystemFiles(os.path.join(os.path.dirname(__file__), "fixtures", "doctor", "gds_host"))
    shm, raid, scratch = (path_support(p, root) for p in ("/dev/shm/d.gds/x/c/0", "/raid/d.gds/x/c/0",
                                                           "/scratch/d.gds/x/c/0"))
    assert shm.gds is False and raid.gds is True and scratch.gds is False  # tmpfs; ext4 on NVMe; writeback
    assert choose(True, True, True, None, None, raid) == ("kvikio", "GPUDirect Storage is available")
    name, why = choose(True, True, True, None, None, shm)
    assert name == "pinned" and "not for this dataset's files (tmpfs" in why
    assert io_mode_for(True, [raid]) == "gds" and io_mode_for(True, [raid, shm]) == "kvikio-compat"
    assert io_mode_for(True, [None]) == "gds" and io_mode_for(False, [raid]) == "kvikio-compat"
    from gdsload.sysfiles import paths_support

    reads = []
    counting = SystemFiles(root.root)
    counting.read = lambda name, read=counting.read: (reads.append(name), read(name))[1]
    many = paths_support([f"/raid/d.gds/x/c/{i}" for i in range(50)] + ["/dev/shm/a"], counting)
    assert many == [raid] * 50 + [shm], "the same answers as one path at a time"
    assert reads.count("/proc/self/mountinfo") == 1 and len(reads) <= 4, "the mount table read once"
