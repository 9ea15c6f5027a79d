"""gdsload.codecs.verify on the host: a window's checks, verdicts confirmed later than they start, and checks kept
once passed where a backend reads from memory it locked (the mmap backend's rule, run here on host buffers)."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest

from _helpers import labelled
from gdsload import ChecksumError, FormatError, GDSDataset
from gdsload.backends.cpu import CpuBackend
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.codecs.verify import Verification
from gdsload.tools.cli import main as cli_main
from gdsload.pipeline.window import WindowMap


@pytest.fixture
def opened(make_dataset):
    path = make_dataset(labelled(200), samples_per_block=8)
    layout = DatasetLayout(read_metadata(path))
    meta = layout.meta
    wl = WindowMap([meta.fields["x"], meta.fields["idx"]], 4, samples_per_block=meta.samples_per_block)
    backend = CpuBackend()
    backend.prepare(layout.files)
    yield layout, wl, backend
    backend.close()
    layout.close()


def window(wl: WindowMap, layout: DatasetLayout, backend: CpuBackend, blocks: np.ndarray) -> np.ndarray:
    buf = backend.allocate(wl.nbytes)
    backend.load(buf, wl.work(layout, blocks).requests, threading.Event())
    return buf


@pytest.mark.parametrize("once", [False, True])
def test_checks_pass_and_are_kept_only_where_reads_copy_locked_memory(opened, once):
    layout, wl, backend = opened
    v = Verification(layout, blocks=True, on_device=False, device_id=0, once=once)
    try:
        blocks = np.array([3, 0, 7, 5])
        checks = v.checks(wl)(blocks)
        assert len(checks.lo) == 2 * len(blocks)  # a segment per block and field
        v.start(window(wl, layout, backend, blocks), checks, None).confirm()
        again = v.checks(wl)(np.array([5, 1, 0, 2]))
        # Kept: blocks 5 and 0 passed, only 1 and 2 are left (both fields); else all four again.
        assert sorted(set(again.blocks.tolist())) == ([1, 2] if once else [0, 1, 2, 5])
        assert len(again.lo) == (4 if once else 8)
    finally:
        v.close()


def test_a_failed_check_is_not_kept_and_raises_at_confirm(opened):
    """The verdict is raised when confirmed, not when the check starts, and a block that failed is checked
    again the next time."""
    layout, wl, backend = opened
    v = Verification(layout, blocks=True, on_device=False, device_id=0, once=True)
    try:
        blocks = np.array([2, 6])
        buf = window(wl, layout, backend, blocks)
        checks = v.checks(wl)(blocks)
        buf[int(checks.lo[1]) + 3] ^= 1  # the second segment: block 6 of field 'x'
        verdict = v.start(buf, checks, None)
        with pytest.raises(ChecksumError, match=r": block 6 of field 'x' .* fails its crc32c check"):
            verdict.confirm()
        verdict.confirm()  # confirmed once: nothing more
        assert sorted(set(v.checks(wl)(blocks).blocks.tolist())) == [2, 6]  # nothing kept from a failed verdict
    finally:
        v.close()


def test_host_checks_run_on_a_thread_that_close_stops(opened):
    layout, wl, backend = opened
    before = {t for t in threading.enumerate() if t.name.startswith("gdsload-verify")}
    v = Verification(layout, blocks=True, on_device=False, device_id=0)
    blocks = np.arange(4)
    v.start(window(wl, layout, backend, blocks), v.checks(wl)(blocks), None).confirm()
    assert {t for t in threading.enumerate() if t.name.startswith("gdsload-verify")} - before
    v.quiesce()
    v.close()
    v.close()  # idempotent
    assert {t for t in threading.enumerate() if t.name.startswith("gdsload-verify") and t.is_alive()} <= before


def _doctor(path: str, edit) -> None:
    """Rewrite the group's zarr.json with ``edit(attributes)``."""
    where = os.path.join(path, "zarr.json")
    with open(where) as f:
        doc = json.load(f)
    edit(doc["attributes"])
    with open(where, "w") as f:
        json.dump(doc, f)


def _flip_data_bit(path: str) -> None:
    """Flip one bit of block 3 of field x (data, not index)."""
    with DatasetLayout(read_metadata(path)) as layout:
        loc = layout.locate("x", 3)
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + 5)
        byte = f.read(1)
        f.seek(loc.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))


DOCTORED = {
    "checksums removed": lambda a: a["gdsload"].pop("checksums"),
    "checksums null": lambda a: a["gdsload"].update(checksums=None),
    "arrays emptied": lambda a: a["gdsload"]["checksums"].update(arrays={}),
    "one field's array dropped": lambda a: a["gdsload"]["checksums"]["arrays"].pop("x"),
}


@pytest.mark.parametrize("case", list(DOCTORED))
def test_metadata_that_switches_verification_off_while_checksums_exist_is_refused(make_dataset, case):
    """Editing the group's attributes so that no checksum array is named for a field, while _checksums/ still
    holds it, would turn the default verification off and serve a flipped bit: the open refuses it instead,
    naming the group's zarr.json and the field (verify=False does not make it acceptable either)."""
    path = make_dataset(labelled(200), samples_per_block=8)
    _flip_data_bit(path)
    with GDSDataset(path, batch_size=16, backend="cpu") as ds, pytest.raises(ChecksumError, match="block 3"):
        list(ds)  # as written: the flipped bit is caught
    _doctor(path, DOCTORED[case])
    for verify in (None, False):
        with pytest.raises(FormatError) as info:
            GDSDataset(path, batch_size=16, backend="cpu", verify=verify)
        msg = str(info.value)
        assert msg.startswith(os.path.join(path, "zarr.json") + ": gdsload.checksums names no checksum array for "
                              "field(s) ['x'") and "_checksums/x exists" in msg and "\n" not in msg, msg
    assert cli_main(["verify", path, "--quiet"]) == 2


def test_a_gdsload_attribute_removed_with_checksums_left_is_refused(make_dataset):
    """Without the gdsload attribute the group would read as a foreign Zarr store (fields chosen by name),
    unverified: _checksums/ on disk says it is a gdsload dataset, so the open refuses it."""
    path = make_dataset(labelled(200), samples_per_block=8)
    _flip_data_bit(path)
    _doctor(path, lambda a: a.pop("gdsload"))
    with pytest.raises(FormatError, match=re.escape(os.path.join(path, "zarr.json")) +
                       r": a group without the 'gdsload' attribute holding _checksums/"):
        GDSDataset(path, batch_size=16, backend="cpu", fields=["x", "idx"])
