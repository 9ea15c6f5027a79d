"""Trust on the reader's side (cpu backend): checksums verified on read, an open dataset pinned to its
files, close() from any thread, forked children, argument errors."""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

from _helpers import labelled, open_fds, threads_left_after_use, wait_no_readers, window_map
from gdsload import ChecksumError, GDSDataset, GDSLoadError, ReadError
from gdsload.backends import info
from gdsload.tools.cli import main as cli_main
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.pipeline.plan import epoch_plan

Dataset = functools.partial(GDSDataset, backend="cpu", resident_bytes=32 << 10)
Verified = functools.partial(Dataset, verify=True)


@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


def flip_byte(path: str, field: str, block: int, at: int = 5) -> tuple[str, int]:
    """Flip one byte inside a block's data in its shard file; returns (file, offset flipped)."""
    with DatasetLayout(read_metadata(path), (field,)) as layout:
        loc = layout.locate(field, block)
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + at)
        b = f.read(1)
        f.seek(loc.offset + at)
        f.write(bytes([b[0] ^ 0x40]))
    return loc.path, loc.offset


def gdsload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gdsload") and t.name != "gdsload-reaper"]


# -- integrity ---------------------------------------------------------------------------------------
def test_verify_is_on_by_default_and_passes_on_a_sound_dataset(data_path):
    path, data = data_path
    with Dataset(path, batch_size=32, verify=False) as ds:
        assert not ds.verify
    with Dataset(path, batch_size=32) as ds:
        assert ds.verify
    with Verified(path, batch_size=32) as ds:
        assert ds.verify
        got = np.concatenate([b["idx"] for b in ds])
        assert sorted(got.tolist()) == list(range(997))


@pytest.mark.parametrize("field,block", [("x", 3), ("idx", 2)])  # windowed and resident
@pytest.mark.parametrize("verify", [True, None])  # asked for, and by default
def test_a_flipped_bit_is_a_read_error_naming_file_field_block(data_path, field, block, verify):
    path, data = data_path
    shard, offset = flip_byte(path, field, block)
    with Dataset(path, batch_size=32, shuffle=True, verify=verify) as ds, pytest.raises(ChecksumError) as e:
        for _ in ds:
            pass
    msg = str(e.value)
    assert msg.startswith(f"{shard}: block {block} of field '{field}'"), msg
    assert f"at offset {offset}" in msg and "crc32c" in msg and "\n" not in msg
    assert isinstance(e.value, ReadError) and isinstance(e.value, OSError)


def test_without_verify_the_same_damage_is_served_silently(data_path):
    """What verify protects against: the damaged sample is served as if nothing were wrong."""
    path, data = data_path
    flip_byte(path, "x", 3)
    with Dataset(path, batch_size=1000, verify=False) as ds:
        (batch,) = list(ds)
    assert not np.array_equal(batch["x"], data["x"][batch["idx"]])


def test_verify_true_without_checksums_is_refused(data_path):
    import shutil
    import zarr

    path, _ = data_path
    g = zarr.open_group(path, mode="r+")
    attrs = dict(g.attrs["gdsload"])
    attrs.pop("checksums")
    g.attrs["gdsload"] = attrs
    shutil.rmtree(os.path.join(path, "_checksums"))
    with pytest.raises(ValueError, match=r"verify=True: .*: field\(s\) \['x', 'idx'\] carry no checksum \(written by"):
        Dataset(path, batch_size=8, verify=True)
    with Dataset(path, batch_size=8) as ds:
        assert not ds.verify and len(list(ds)) == len(ds)


def test_gdsload_verify_lists_bad_blocks(data_path, capsys):
    path, _ = data_path
    assert cli_main(["verify", path, "--quiet"]) == 0
    assert "0 bad" in capsys.readouterr().out
    shard, _ = flip_byte(path, "x", 7)
    assert cli_main(["verify", path, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {shard}: block 7 of field 'x'" in out and "1 bad" in out


# -- identity of an open dataset ---------------------------------------------------------------------
def test_files_replaced_after_open_are_not_read(data_path, make_dataset):
    """A dataset replaced (as shard.py --overwrite does: a new folder renamed into place) keeps serving
    the files it opened, never a mix."""
    path, data = data_path
    other = make_dataset({"x": data["x"] + 1, "idx": data["idx"]}, samples_per_block=8, shard_bytes=8 * 60 * 10)
    with Dataset(path, batch_size=32, shuffle=True) as ds:
        it = iter(ds)
        first = next(it)
        os.rename(path, path + ".old")
        os.rename(other, path)
        batches = [first, *it]
    for b in batches:
        np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])


def test_a_shard_truncated_after_open_is_a_read_error(data_path):
    path, _ = data_path
    with Dataset(path, batch_size=32, window_blocks=1) as ds:
        # The last block's shard: not the first window's, which the open has read already.
        with DatasetLayout(ds.meta, ("x",)) as layout:
            shard = layout.locate("x", ds.meta.num_blocks - 1).path
            assert shard != layout.locate("x", 0).path
        with open(shard, "r+b") as f:
            f.truncate(100)
        with pytest.raises(ReadError, match=f"^{shard}: "):
            list(ds)


# -- close from any thread ---------------------------------------------------------------------------
def _close_soon(ds: GDSDataset, delay_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), ds.close()))
    t.start()
    return t


@pytest.mark.parametrize("delay_s", [0.0, 0.001, 0.005, 0.02])
def test_close_from_another_thread_while_a_pass_starts(data_path, delay_s):
    path, _ = data_path
    for _ in range(3):
        ds = Dataset(path, batch_size=8, window_blocks=1)
        closer = _close_soon(ds, delay_s)
        t0 = time.monotonic()
        try:
            for _ in ds:
                time.sleep(0.001)
        except GDSLoadError as e:
            assert "closed" in str(e)
        assert time.monotonic() - t0 < 1.0
        closer.join()
        assert wait_no_readers() == []


def test_close_from_another_thread_between_passes(data_path):
    path, _ = data_path
    ds = Dataset(path, batch_size=64)
    list(ds)  # the next pass is read ahead now
    _close_soon(ds, 0.0).join()
    with pytest.raises(GDSLoadError, match="closed"):
        iter(ds)
    assert wait_no_readers() == []


def test_no_thread_survives_close(data_path):
    path, _ = data_path
    assert threads_left_after_use(Dataset(path, batch_size=32, shuffle=True)) == set()


def test_a_part_that_fails_to_close_leaves_none_of_the_others_open(data_path, plug):
    """The defect: close() stopped at the first part that raised, so the shard files (and whatever came after
    the failing part) stayed open. Now every part is closed and the first error is raised after."""
    path, _ = data_path
    before = open_fds()

    class Failing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def close(self):
            super().close()
            raise RuntimeError("the backend could not close")

    ds = Dataset(path, batch_size=32, shuffle=True, backend=plug(Failing))
    next(iter(ds))
    with pytest.raises(RuntimeError, match="the backend could not close"):
        ds.close()
    assert open_fds() == before, "the shard files were closed after the backend failed to"
    ds.close()  # a second close does nothing


def test_a_stopped_pipeline_waits_for_its_device_work_after_its_threads(data_path, monkeypatch, plug):
    """close() quiesces the ops (gathers, uploads), the backend (copies) and the decoder, in that order after
    the threads are joined; on the GPU that is what keeps freed memory from being handed out while queued
    work still uses it (tests/test_gpu.py checks the streams)."""
    from gdsload.cuda.ops import HostOps

    calls = []

    def quiesce(what):
        calls.append((what, sorted(t.name for t in gdsload_threads() if "reader" in t.name)))

    class Quiescing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def quiesce(self):
            quiesce("backend")

    monkeypatch.setattr(HostOps, "quiesce", lambda self: quiesce("ops"), raising=False)
    path, _ = data_path
    with Dataset(path, batch_size=32, shuffle=True, backend=plug(Quiescing)) as ds:
        for i, _batch in enumerate(ds):
            if i == 3:
                break  # leaving a pass stops its pipeline
        assert [c[0] for c in calls] == ["ops", "backend"] and calls[0][1] == [] == calls[1][1]
        ds.stop()  # the pipeline reading the next epoch ahead
        assert [c[0] for c in calls] == ["ops", "backend"]  # none was running: the break closed it
        list(ds)
        ds.stop()
        assert [c[0] for c in calls] == ["ops", "backend"] * 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the pass's own stop, unseen
def test_a_decode_still_running_when_the_dataset_closes_is_raised_by_close(data_path, plug):
    """The defect: a stopping pipeline swallowed every failure of its device work's wait, the DecodeError of a
    decode still running after its bound among them, so close() returned as if all had ended."""
    from gdsload import DecodeError

    class Hung(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def quiesce(self):
            raise DecodeError("train.gds: a decode is still running after 0.1 s (test)")

    path, _ = data_path
    ds = Dataset(path, batch_size=32, shuffle=True, backend=plug(Hung))
    next(iter(ds))
    with pytest.raises(DecodeError, match="still running"):
        ds.close()
    ds.close()  # a second close does nothing


class Calls(list):
    """What a recording backend was given: reads as (buffer, requests) in the list, buffers in ``allocated``;
    ``backend``: its name for ``backend=``."""

    backend: str
    allocated: list


@pytest.fixture
def submitted(plug) -> Calls:
    """Every read a cpu backend registered for the test is given, as (buffer, requests), the open's included,
    and every buffer it allocates."""
    calls = Calls()
    calls.allocated = []

    class Recording(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def allocate(self, nbytes):
            calls.allocated.append(super().allocate(nbytes))
            return calls.allocated[-1]

        def submit(self, dest, requests, stop):
            calls.append((dest, list(requests)))
            return super().submit(dest, requests, stop)

    calls.backend = plug(Recording)
    return calls


@pytest.mark.parametrize("rank", [0, 1])
def test_the_open_reads_the_window_the_first_pass_reads_first_and_that_pass_does_not_read_it_again(
        data_path, submitted, rank):
    allocated = submitted.allocated
    path, data = data_path
    with Dataset(path, batch_size=16, shuffle=True, seed=5, window_blocks=3, rank=rank, world_size=2,
                 resident_bytes=0, prefetch_next_epoch=False, backend=submitted.backend) as ds, \
            DatasetLayout(ds.meta, ds.fields) as layout:
        plan, wm = epoch_plan(ds.config, 0), window_map(ds, layout)
        first = wm.first_requests(layout, plan)
        assert len(submitted) == 1 and submitted[0][1] == first, "the first window, at open"
        # Into the dataset's window buffer: the one buffer allocated at open, the one the dataset holds.
        assert len(allocated) == 1 and ds.describe()["window_buffers"] == 1
        opened = submitted[0][0]
        assert opened is allocated[0]
        submitted.clear()
        batches = list(ds)
        assert [r for _, r in submitted] == [wm.work(layout, w).requests
                                             for w in plan.windows[1:]], "every window but the first"
        assert any(dest is opened for dest, _ in submitted), "the pass reads into the open's buffer too"
        for b in batches:
            np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])
        ds.stop()
        submitted.clear()
        ds.set_epoch(0)  # the buffer was written since: the same window is read again
        assert len(list(ds)) == len(ds) and len(submitted) == len(plan.windows)


@pytest.mark.parametrize("window_blocks", [3, 1])
def test_nothing_is_read_between_the_open_and_the_first_batch_unless_that_batch_needs_it(
        data_path, submitted, monkeypatch, window_blocks):
    """The window read at open holds the first batch (3 blocks of 8 samples, batches of 16): no other window
    is submitted until that batch is out, so its assembly shares nothing with reads. Where the batch needs
    the next window too (1 block a window), that window is read for it."""
    from gdsload.pipeline import assembler
    from gdsload.pipeline.assembler import Assembler

    monkeypatch.setattr(assembler, "GROUP_BYTES", 1)  # a batch at a time, not the whole window's at once
    real, seen = Assembler.batches, []

    def batches(self, *args, **kwargs):
        for n, item in enumerate(real(self, *args, **kwargs)):
            if n == 0:
                time.sleep(0.05)  # time enough for a read submitted beside it to show
            seen.append(len(submitted))
            yield item

    monkeypatch.setattr(Assembler, "batches", batches)
    path, data = data_path
    with Dataset(path, batch_size=16, shuffle=True, seed=5, window_blocks=window_blocks, resident_bytes=0,
                 prefetch_next_epoch=False, backend=submitted.backend) as ds:
        assert len(submitted) == 1, "the open reads the first window"
        got = list(ds)
    if window_blocks == 3:
        assert seen[0] == 1, "reads submitted before the first batch was out"
    idx = np.concatenate([b["idx"] for b in got])
    assert len(got) == len(ds) and np.array_equal(np.sort(idx), np.arange(len(data["x"])))
    for b in got:
        np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])


def test_a_first_window_read_at_open_serves_no_pass_but_one_from_the_start(data_path, submitted):
    path, data = data_path
    for leave_early in (False, True):
        with Dataset(path, batch_size=16, shuffle=True, seed=5, window_blocks=3, resident_bytes=0,
                     prefetch_next_epoch=False, backend=submitted.backend) as ds:
            ds.set_epoch(3)  # another window first
            if leave_early:
                next(iter(ds))  # the first pass stops after its first window
            else:
                assert len(list(ds)) == len(ds)
            ds.stop()
            submitted.clear()
            ds.set_epoch(0)  # the first buffer holds another window now
            batches = list(ds)
            assert len(submitted) == len(epoch_plan(ds.config, 0).windows), "every window read by the pass"
            for b in batches:
                np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])


def test_stopping_before_any_pass_keeps_the_window_read_at_open(data_path, submitted):
    path, data = data_path
    with Dataset(path, batch_size=16, shuffle=True, seed=5, window_blocks=3, resident_bytes=0,
                 prefetch_next_epoch=False, backend=submitted.backend) as ds:
        submitted.clear()
        ds.stop()  # no pipeline runs, none wrote the buffer
        batches = list(ds)
        assert len(submitted) == len(epoch_plan(ds.config, 0).windows) - 1
        for b in batches:
            np.testing.assert_array_equal(b["x"], data["x"][b["idx"]])


def test_a_first_window_that_cannot_be_read_fails_the_open_and_leaves_nothing_open(data_path, plug):
    class Failing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def submit(self, dest, requests, stop):
            raise ReadError(f"{requests[0].path}: cannot read")

    path, _ = data_path
    before = open_fds()
    with pytest.raises(ReadError, match="cannot read"):
        Dataset(path, batch_size=16, backend=plug(Failing))
    assert open_fds() == before and wait_no_readers() == []


# -- forked children ---------------------------------------------------------------------------------
def test_a_forked_child_refuses_the_inherited_dataset(data_path):
    path, _ = data_path
    with Dataset(path, batch_size=32) as ds:
        next(iter(ds))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 0
            try:
                try:
                    iter(ds)
                    code = 3
                except GDSLoadError as e:
                    code = 0 if "inherited by fork" in str(e) else 4
                held = open_fds()
                ds.close()  # detached there: frees nothing (the files, backend and buffers are the parent's)
                if open_fds() != held:
                    code = 5
                del ds  # must not close the parent's backend from here
            finally:
                os.write(w, bytes([code]))
                os._exit(0)
        os.close(w)
        code = os.read(r, 1)
        os.waitpid(pid, 0)
        assert code == b"\x00", code
        assert len(list(ds)) == len(ds)  # the parent's dataset still works


# -- arguments -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,match", [
    ({"batch_size": "32"}, TypeError, "batch_size must be an int"),
    ({"batch_size": 0}, ValueError, "batch_size must be at least 1"),
    ({"batch_size": True}, TypeError, "batch_size must be an int"),
    ({"prefetch": 1.5}, TypeError, "prefetch must be an int"),
    ({"window_blocks": 0}, ValueError, "window_blocks must be at least 1"),
    ({"seed": "1"}, TypeError, "seed must be an int"),
    ({"verify": "yes"}, TypeError, "verify must be True, False or None"),
    ({"backend_options": [1]}, TypeError, "backend_options must be a dict"),
    ({"rank": -1}, ValueError, "rank must be at least 0"),
])
def test_bad_arguments_name_the_argument(data_path, kwargs, error, match):
    path, _ = data_path
    kwargs = {"batch_size": 8, **kwargs}
    with pytest.raises(error, match=match):
        Dataset(path, **kwargs)


def test_torch_output_without_torch_names_the_extra(data_path, tmp_path):
    """In a process where ``import torch`` fails (a torch package that cannot be imported comes first on its
    path), output="torch" is refused at open, naming the extra to install."""
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path, _ = data_path
    script = f"""
from gdsload import BackendUnavailable, GDSDataset
try:
    GDSDataset({path!r}, batch_size=8, backend="cpu", output="torch")
except BackendUnavailable as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gdsload[torch]" in done.stdout, done.stdout


def test_a_single_field_name_as_a_string(data_path):
    path, data = data_path
    with Dataset(path, batch_size=100, fields="x") as ds:
        assert ds.fields == ("x",) and set(next(iter(ds))) == {"x"}


def test_shard_mutations_with_verify_never_serve_different_data(make_dataset, tmp_path):
    """Seeded mutations of shard files (a flipped bit, an inserted or deleted byte, anywhere): with
    verify=True every outcome is a GDSLoadError or exactly the data written."""
    import shutil

    data = labelled(203, shape=(5,), dtype="int32")
    pristine = make_dataset(data, samples_per_block=8, shard_bytes=8 * 20 * 4)
    with DatasetLayout(read_metadata(pristine)) as layout:
        shards = layout.shard_paths()
    rng = np.random.default_rng(14)
    outcomes = {"error": 0, "exact": 0}
    for i in range(120):
        path = str(tmp_path / f"m{i}.gds")
        shutil.copytree(pristine, path)
        shard = os.path.join(path, os.path.relpath(shards[rng.integers(len(shards))], pristine))
        raw = bytearray(open(shard, "rb").read())
        at = int(rng.integers(len(raw)))
        kind = rng.integers(3)
        if kind == 0:
            raw[at] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            raw.insert(at, int(rng.integers(256)))
        else:
            del raw[at]
        open(shard, "wb").write(bytes(raw))
        try:
            with Verified(path, batch_size=64, shuffle=True, seed=i) as ds:
                got = {k: np.concatenate([b[k] for b in ds]) for k in ("x", "idx")}
        except GDSLoadError:
            outcomes["error"] += 1
        else:
            np.testing.assert_array_equal(np.sort(got["idx"]), np.arange(203))
            np.testing.assert_array_equal(got["x"], data["x"][got["idx"]], err_msg=f"mutation {i} served silently")
            outcomes["exact"] += 1
        shutil.rmtree(path)
    assert outcomes["error"] > 0


class _FakeRuntime:
    """CuPy's runtime calls that ``PinnedHost`` makes, recorded (no GPU here)."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def hostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes

    def hostUnregister(self, ptr):
        del self.registered[ptr]


def test_pinned_host_memory_is_unregistered_when_dropped_unclosed(monkeypatch):
    """A staging pool whose owner failed before it could close it (an error later in a backend's constructor)
    must not leave its pages registered with CUDA: dropping the last reference unregisters them, once."""
    import contextlib
    import sys
    import types

    from gdsload.cuda.runtime import PinnedHost

    runtime = _FakeRuntime()
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    kept = PinnedHost(1 << 20)
    kept.array[:] = 7
    assert list(runtime.registered.values()) == [1 << 20]
    kept.close()
    assert runtime.registered == {}
    dropped = PinnedHost(1 << 20)
    assert len(runtime.registered) == 1
    del dropped
    assert runtime.registered == {}
    kept.close()  # closing twice does nothing


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"), reason="CPython's thread bookkeeping lock")
def test_a_dataset_collected_while_a_thread_starts_does_not_hang(data_path):
    """An unclosed dataset in a reference cycle is collected by the garbage collector wherever it runs, even
    inside a new thread's start-up, which holds CPython's lock of thread bookkeeping; joining threads there
    (the cpu backend's pool) needs that lock and hung the process. What the collector runs must not join."""
    path, _ = data_path
    ds = GDSDataset(path, batch_size=8, backend="cpu", window_blocks=2)
    assert len(list(ds)) == len(ds)  # the backend's pool threads exist
    dataset, done, collecting = weakref.ref(ds), threading.Event(), gc.isenabled()
    gc.collect()  # nothing else left for the collection below
    gc.disable()  # no automatic collection frees the dataset before the one under the lock
    try:
        cycle = [ds]
        cycle.append(cycle)
        del ds, cycle
        assert dataset() is not None, "held by its reference cycle: only the collector frees it"

        def as_the_collector_would() -> None:
            with threading._shutdown_locks_lock:
                gc.collect()  # the dataset's finalizer runs here, under the lock
            done.set()

        threading.Thread(target=as_the_collector_would, daemon=True).start()
        assert done.wait(10), "the collector's clean-up joined threads under the thread bookkeeping lock"
    finally:
        if collecting:
            gc.enable()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("gdsload-cpu") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)  # cleaned up on another thread
    assert not any(t.name.startswith("gdsload-cpu") for t in threading.enumerate()), "the pool was not shut down"
    assert dataset() is None, "the collector did not free the dataset (its finalizer did not run)"
