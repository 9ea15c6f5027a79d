"""GPU backends (kvikio, pinned, mmap): content, streams, torch, pinned-memory bounds, lifecycle, errors.

Skipped without a CUDA GPU and CuPy. Run on the GPU machine with ``python3 -m pytest -m gpu``.
"""

from __future__ import annotations

import functools
import os
import re
import threading

import numpy as np
import pytest

from _helpers import break_then_close, labelled, wait_no_readers, zarr_dataset_with_missing_block
from gdsload import GDSDataset, ReadError
from gdsload.backends.sizing import native_threads
from gdsload.system.env import rank_cores
from gdsload.pipeline.plan import epoch_plan
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset

# Small enough that "idx" is resident and "x" is read window by window: every test covers both paths.
Dataset = functools.partial(GDSDataset, resident_bytes=32 << 10)
pytestmark = pytest.mark.gpu
BACKENDS = ["kvikio", "pinned", "mmap"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    data = labelled(1999, shape=(7, 9), dtype="float32")
    path = str(tmp_path_factory.mktemp("gpu") / "small.gds")
    write_dataset(path, {k: ArraySource(k, v) for k, v in data.items()}, samples_per_block=16,
                  shard_bytes=16 * 252 * 8, progress=False)
    return path, data


def to_host(a):
    import cupy

    return cupy.asnumpy(a)


def kept(plug, backend: str, made: list) -> str:
    """``backend``'s class registered under a name of the test's (gdsload.backends.register), each instance it
    makes appended to ``made``: the backend a dataset reads with, reached through the registry."""
    from gdsload.backends import info

    class Kept(info(backend).backend_class):  # type: ignore[misc,valid-type]
        def __init__(self, **options):
            super().__init__(**options)
            made.append(self)

    return plug(Kept, on_device=True)


def registered_host_memory(ptr: int) -> bool:
    """Whether host memory at ``ptr`` is registered with CUDA (pinned) now."""
    import cupy

    try:
        return cupy.cuda.runtime.pointerGetAttributes(ptr).type != 0  # cudaMemoryTypeUnregistered
    except cupy.cuda.runtime.CUDARuntimeError:  # older drivers refuse unregistered pointers
        return False


def o_direct_files(under: str) -> list[str]:
    """Files below ``under`` this process holds open with O_DIRECT (/proc/self/fdinfo's flags)."""
    found, under = [], os.path.realpath(under)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(ln for ln in f if ln.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
        if target.startswith(under) and flags & os.O_DIRECT:
            found.append(target)
    return found


def check(batch, data):
    idx = to_host(batch["idx"])
    np.testing.assert_array_equal(to_host(batch["x"]), data["x"][idx])
    return idx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [
    {},
    {"shuffle": True, "seed": 1, "window_blocks": 3},
    {"window_blocks": 1, "batch_size": 100, "prefetch": 3},  # batches span several windows
    {"shuffle": True, "drop_last": True, "window_blocks": 5},
])
def test_every_sample_matches_and_all_batches_stay_valid(small, backend, options):
    import cupy

    path, data = small
    options = {"batch_size": 64, **options}
    with Dataset(path, backend=backend, **options) as ds:
        assert ds.output == "cupy"
        batches = list(ds)  # all kept alive: later reads must not overwrite any of them
        assert ds.stats.bytes_read > 0
        ds.set_epoch(1)
        batches += list(ds)  # epoch 1 was read ahead while epoch 0 ran
        cupy.cuda.get_current_stream().synchronize()
        seen = np.concatenate([check(b, data) for b in batches])
        np.testing.assert_array_equal(seen, np.concatenate([epoch_plan(ds.config, e).sample_ids() for e in (0, 1)]))
        assert isinstance(batches[0]["x"], cupy.ndarray)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cut", [1, 9, 31])
def test_shuffled_resume(small, backend, cut):
    path, data = small
    opts = dict(batch_size=64, backend=backend, shuffle=True, seed=4, window_blocks=3)
    with Dataset(path, **opts) as ref:
        ref.set_epoch(2)
        full = np.concatenate([to_host(b["idx"]) for b in ref])
        ref.set_epoch(3)
        nxt = np.concatenate([to_host(b["idx"]) for b in ref])
    assert not np.array_equal(full, nxt)
    with Dataset(path, **opts) as a:
        a.set_epoch(2)
        head = []
        for i, b in enumerate(a):
            head.append(check(b, data))
            if i + 1 == cut:
                state = a.state_dict()
                break
    with Dataset(path, **opts) as b:
        b.load_state_dict(state)
        tail = [check(x, data) for x in b]
        b.set_epoch(3)
        after = np.concatenate([check(x, data) for x in b])
    np.testing.assert_array_equal(np.concatenate(head + tail), full)
    np.testing.assert_array_equal(after, nxt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_consumer_on_a_non_default_cupy_stream(small, backend):
    import cupy

    path, data = small
    stream = cupy.cuda.Stream(non_blocking=True)
    with Dataset(path, batch_size=128, backend=backend, shuffle=True, window_blocks=2) as ds, stream:
        sums = [(b["idx"], b["x"].sum(axis=(1, 2))) for b in ds]  # queued on `stream`, no sync by us
        stream.synchronize()
    idx = np.concatenate([to_host(i) for i, _ in sums])
    got = np.concatenate([to_host(s) for _, s in sums])
    np.testing.assert_allclose(got, data["x"][idx].sum(axis=(1, 2)), rtol=1e-6)
    assert sorted(idx.tolist()) == list(range(1999))


@pytest.mark.parametrize("backend", BACKENDS)
def test_freed_batches_are_not_rewritten_while_the_consumer_still_reads_them(small, backend):
    """Each batch is read ~1 ms after the consumer dropped it (a slow kernel queued first): the assembler,
    which reuses that memory at once, must order its writes after the consumer's queued work."""
    import cupy

    path, data = small
    spin = cupy.RawKernel(r"""
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }""", "spin")
    with cupy.cuda.Stream(non_blocking=True) as stream:
        total = cupy.zeros((), dtype=cupy.float64)
        with Dataset(path, batch_size=64, backend=backend, shuffle=True, window_blocks=2, batches_ahead=3) as ds:
            for epoch in (0, 1):  # and across the boundary of a pass read ahead
                ds.set_epoch(epoch)
                for b in ds:
                    spin((1,), (1,), (np.int64(2_000_000),))
                    total += b["x"].sum(dtype=cupy.float64)
            ids = np.concatenate([epoch_plan(ds.config, e).sample_ids() for e in (0, 1)])
        stream.synchronize()
    assert float(total) == pytest.approx(float(data["x"][ids].sum(dtype=np.float64)), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_output_on_a_non_default_torch_stream(small, backend):
    torch = pytest.importorskip("torch")
    path, data = small
    stream = torch.cuda.Stream()
    results = []
    with Dataset(path, batch_size=100, backend=backend, output="torch", shuffle=True, window_blocks=2) as ds:
        with torch.cuda.stream(stream):
            for b in ds:
                assert isinstance(b["x"], torch.Tensor) and b["x"].is_cuda
                results.append((b["idx"], (b["x"] * 2).sum(dim=(1, 2))))
        stream.synchronize()
    idx = torch.cat([i for i, _ in results]).cpu().numpy()
    got = torch.cat([s for _, s in results]).cpu().numpy()
    np.testing.assert_allclose(got, 2 * data["x"][idx].sum(axis=(1, 2)), rtol=1e-5)
    assert sorted(idx.tolist()) == list(range(1999))


@pytest.mark.parametrize("slots", [1, 3])
def test_pinned_pool_is_bounded_and_freed(small, slots, plug):
    """One slot (the reader threads take turns) or a few: right batches, the pinned bytes held never above the
    pool, every slot given back, the pinned memory freed on close."""
    path, data = small
    pool_bytes = slots * 8192
    opts = {"pool_bytes": pool_bytes, "slot_bytes": 8192, "num_threads": 8,  # blocks (8064 B) span slots
            "reader": "threads"}
    made: list = []
    ds = Dataset(path, batch_size=64, backend=kept(plug, "pinned", made), backend_options=opts, window_blocks=8)
    pool = made[0].pool
    stats = ds.describe()["backend_stats"]
    assert stats["pool_bytes"] == pool_bytes and stats["reading_slots"] == slots
    assert registered_host_memory(pool.ptr(0))
    for b in ds:
        check(b, data)
    ds.stop()  # the next epoch's reads ahead hold slots too
    stats = ds.describe()["backend_stats"]
    assert 0 < stats["peak_slots_in_use"] * stats["slot_bytes"] <= pool_bytes
    assert pool.in_use == 0
    ds.close()
    assert not registered_host_memory(pool.ptr(0)), "close() frees the pinned pool"


@pytest.mark.parametrize("reader", ["native", "threads"])
def test_pinned_readers(small, reader):
    """The native stager or Python threads: same batches, threads stopped on close."""
    path, data = small
    opts = {"reader": reader, "slot_bytes": 8192, "pool_bytes": 4 * 8192}  # many slot loads per window
    before = len(os.listdir("/proc/self/task"))
    with Dataset(path, batch_size=64, backend="pinned", shuffle=True, window_blocks=5, backend_options=opts) as ds:
        assert ds.describe()["backend_stats"]["reader"] == reader
        seen = np.concatenate([check(b, data) for b in ds])
        np.testing.assert_array_equal(seen, epoch_plan(ds.config, 0).sample_ids())
        stats = ds.describe()["backend_stats"]
        if reader == "native":
            assert stats["pool_bytes"] > 0
        else:
            assert 0 < stats["peak_slots_in_use"] * stats["slot_bytes"] <= 4 * 8192
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gdsload-pinned")]
    if reader == "native":
        assert len(os.listdir("/proc/self/task")) <= before  # the stager's pthreads joined


def test_pinned_auto_reader_is_native_where_it_builds(small):
    path, data = small
    with Dataset(path, batch_size=64, backend="pinned") as ds:
        assert ds.describe()["backend_stats"]["reader"] == "native", ds.describe()["backend_stats"]
        assert ds.describe()["backend_stats"]["num_threads"] == native_threads(rank_cores())
        for b in ds:
            check(b, data)


def test_pinned_with_o_direct(tmp_path):
    """Blocks of 16 KiB at 4 KiB-aligned offsets: the pinned backend reads them with O_DIRECT."""
    n = 1000
    idx = np.arange(n, dtype=np.int64)
    x = ((idx[:, None] * 3 + np.arange(4096)[None, :]) % 251).astype(np.uint8)
    path = str(tmp_path / "aligned.gds")
    write_dataset(path, {"x": ArraySource("x", x), "idx": ArraySource("idx", idx)}, samples_per_block=4,
                  progress=False)
    with Dataset(path, batch_size=50, backend="pinned", shuffle=True, backend_options={"direct": True}) as ds:
        assert ds.io_mode == "pinned-odirect"
        seen = []
        for b in ds:
            i = to_host(b["idx"])
            np.testing.assert_array_equal(to_host(b["x"]), x[i])
            seen.append(i)
        assert o_direct_files(path), "aligned blocks went through O_DIRECT descriptors"
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lifecycle_threads_and_errors(small, backend, tmp_path):
    path, data = small
    broken = str(tmp_path / "broken.gds")
    write_dataset(broken, {k: ArraySource(k, v) for k, v in data.items()}, samples_per_block=16,
                  shard_bytes=16 * 252 * 4, progress=False)  # first: zarr starts its own I/O threads
    before = set(threading.enumerate())
    break_then_close(Dataset(path, batch_size=16, backend=backend, window_blocks=1), lambda b: check(b, data),
                     stop_after=6)
    # zarr's event loop keeps a pool of "asyncio_N" file threads that grows on demand (opening metadata);
    # they are zarr's, idle and persistent. Every other new thread is a leak.
    leftover = [t.name for t in threading.enumerate() if t not in before and not t.name.startswith("asyncio_")]
    assert not leftover, leftover

    if backend == "mmap":
        return  # files truncated under a map: SIGBUS territory; tests/test_mmap_load.py covers a short read
    with Dataset(broken, batch_size=16, backend=backend, window_blocks=2) as ds:
        shard = os.path.join(broken, "x", "c", "2", "0", "0")
        os.truncate(shard, 1000)
        with pytest.raises(ReadError) as info:
            for b in ds:
                check(b, data)
        assert shard in str(info.value) and "offset" in str(info.value)
    assert wait_no_readers() == []


def test_mmap_locks_at_open_within_budget(small, tmp_path, plug):
    from gdsload import BackendUnavailable
    from gdsload.format.layout import DatasetLayout

    path, data = small
    made: list = []
    with Dataset(path, batch_size=64, backend=kept(plug, "mmap", made), shuffle=True) as ds:
        with DatasetLayout(ds.meta, ds.fields) as layout:
            shards = layout.shard_paths()
        assert ds.io_mode == "mmap"
        stats = ds.describe()["backend_stats"]
        assert stats["locked_bytes"] == sum(os.path.getsize(p) for p in shards) and stats["open_s"] > 0
        first = [check(b, data) for b in ds]
    assert made[0].pinned_bytes == 0, "close() unlocks every file"
    assert sorted(np.concatenate(first).tolist()) == list(range(len(data["idx"])))
    with pytest.raises(BackendUnavailable, match=r"would lock .* over its budget"):
        Dataset(path, batch_size=64, backend="mmap", backend_options={"max_bytes": 4096})
    assert wait_no_readers() == []
    assert not [t for t in threading.enumerate() if "gdsload" in t.name and t.name != "gdsload-reaper"]

    # Replacing the dataset while it is open (shard.py --overwrite renames a new folder into place and
    # deletes the old one) leaves the locked files intact: the open dataset reads what it locked.
    copy = str(tmp_path / "copy.gds")
    write_dataset(copy, {k: ArraySource(k, v) for k, v in data.items()}, samples_per_block=16,
                  shard_bytes=16 * 252 * 4, progress=False)
    with Dataset(copy, batch_size=64, backend="mmap", shuffle=True) as ds:
        write_dataset(copy, {k: ArraySource(k, v[::-1].copy()) for k, v in data.items()}, samples_per_block=16,
                      shard_bytes=16 * 252 * 4, progress=False, overwrite=True)
        seen = [check(b, data) for b in ds]
    assert sorted(np.concatenate(seen).tolist()) == list(range(len(data["idx"])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_open_reads_the_first_window_and_the_first_pass_does_not_read_it_again(small, backend, plug):
    """The open reads the window a pass from the dataset's start reads first into the first window buffer
    (each backend's own start happens there, not under the first batch); that pass submits every other
    window, and its batches are right."""
    import cupy

    from _helpers import window_map
    from gdsload.backends import info
    from gdsload.format.layout import DatasetLayout

    path, data = small
    submitted, buffers = [], []

    class Recording(info(backend).backend_class):  # type: ignore[misc,valid-type]
        def submit(self, dest, requests, stop):
            submitted.append(list(requests))
            buffers.append(dest)
            return super().submit(dest, requests, stop)

    with Dataset(path, batch_size=64, backend=plug(Recording, on_device=True), shuffle=True, window_blocks=3,
                 resident_bytes=0, prefetch_next_epoch=False) as ds, DatasetLayout(ds.meta, ds.fields) as layout:
        plan = epoch_plan(ds.config, 0)
        first = window_map(ds, layout).first_requests(layout, plan)
        assert submitted == [first] and ds.describe()["window_buffers"] == 1
        cupy.cuda.Device().synchronize()
        buffer = buffers[0]
        for r in first:
            if hasattr(r, "path"):
                with open(r.path, "rb") as f:
                    f.seek(r.offset)
                    assert cupy.asnumpy(buffer[r.dest_offset:r.dest_offset + r.nbytes]).tobytes() == f.read(r.nbytes)
        if backend == "mmap":
            stats = ds.describe()["backend_stats"]
            assert 0 < stats["loaded_bytes"] < stats["locked_bytes"], "the first window's ranges only, before any pass"
        submitted.clear()
        assert sorted(np.concatenate([check(b, data) for b in ds]).tolist()) == list(range(len(data["idx"])))
        assert len(submitted) == len(plan.windows) - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_stopping_waits_for_the_gpu_work_its_pipeline_queued(small, backend, monkeypatch, plug):
    """Memory freed with a stopped pipeline (index uploads, batches nobody took) goes back to CuPy's pool and
    out again at once, so none of its gathers may still be queued: on the H100, stop/start in a loop made a
    gather read indices overwritten by a later pipeline's data (cudaErrorInvalidAddressSpace, or an illegal
    address). Here the gathers queue behind a long step on the consumer's stream; stop() must wait for them."""
    import time

    import cupy

    import gdsload.dataset
    from gdsload.pipeline import assembler
    from gdsload.tools.steps import Spin

    pipelines: list = []

    class Recorded(gdsload.dataset.Pipeline):  # type: ignore[misc,name-defined]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pipelines.append(self)

    monkeypatch.setattr(gdsload.dataset, "Pipeline", Recorded)

    path, data = small
    # One gather per batch: the batches assembled after the step is launched are gathered then (in groups,
    # they may all have been gathered with a group before it). The consumer on a stream of its own: on the
    # legacy default stream, KvikIO's compat-mode copies (blocking streams) would queue behind the step too,
    # and the windows those gathers need might never be read.
    monkeypatch.setattr(assembler, "GROUP_BYTES", 1)
    consumer = cupy.cuda.Stream(non_blocking=True)
    with consumer, Dataset(path, batch_size=64, backend=backend, shuffle=True, seed=2, window_blocks=3) as ds:
        it = iter(ds)
        check(next(it), data)
        pipeline = pipelines[-1]  # the one running: the dataset's first
        Spin(3000.0).launch()  # on the consumer's stream: what the assembler queues from now on waits for it
        next(it)  # room given back: the assembler gathers the next batches (once their windows are read), behind it
        deadline = time.monotonic() + 2.5
        while pipeline.ops.work.done and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not pipeline.ops.work.done, "no gather queued behind the step: the test would prove nothing"
        ds.stop()
        assert pipeline.ops.work.done and pipeline.ops.uploads.done, "stop() returned with gathers still queued"
        assert all(s.done for s in pipeline.reader.backend.streams()), "stop() returned with copies still queued"
        del it
        for _ in range(2):  # and the next pipelines serve the right samples
            seen = np.concatenate([check(b, data) for b in ds])
            assert sorted(seen.tolist()) == list(range(len(data["idx"])))
            ds.stop()
        cupy.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_not_yet_written_when_taken_is_waited_for_on_the_consumers_stream(small, backend, monkeypatch):
    """A batch taken before its gather ran is ordered on the consumer's stream by the hand-over: here every
    gather of the first batches waits behind a 300 ms spin on the assembler's stream, so they are taken
    unwritten; read on the consumer's stream, they must be right."""
    import cupy

    from gdsload.cuda.ops import CudaOps
    from gdsload.tools.steps import Spin

    path, data = small
    pending, begin, hand_over = [], CudaOps.begin, CudaOps.hand_over

    def held_begin(self):
        begin(self)
        with self.work:
            Spin(300.0).launch()  # the assembler's gathers queue behind it

    def recorded(self, ready):
        pending.append(ready is not None and not ready.done)
        hand_over(self, ready)

    monkeypatch.setattr(CudaOps, "begin", held_begin)
    monkeypatch.setattr(CudaOps, "hand_over", recorded)
    with Dataset(path, batch_size=64, backend=backend, shuffle=True, seed=4, window_blocks=3) as ds:
        seen = np.concatenate([check(b, data) for b in ds])
        assert sorted(seen.tolist()) == list(range(len(data["idx"])))
        cupy.cuda.get_current_stream().synchronize()
    assert pending[0], "the first batch was written before it was taken: the test would prove nothing"


@pytest.mark.parametrize("copier", ["native", "cupy"])
@pytest.mark.parametrize("queue_bytes", [0, 2 << 10])
def test_mmap_copies_through_either_copier_serve_the_same_batches(small, copier, queue_bytes):
    """The native copier (a window's copies in one call) and the CuPy loop it replaces, each queueing a
    window's copies at once or a piece at a time (queue_bytes: here pieces of at most 1 KiB of 4 KB
    blocks, two ahead at most): every sample of two shuffled epochs, every batch kept alive while later windows are
    copied; then a pass left early and a close, with no reader left."""
    import cupy

    path, data = small
    with Dataset(path, batch_size=50, backend="mmap", shuffle=True, seed=3, window_blocks=4,
                 backend_options={"copier": copier, "queue_bytes": queue_bytes}) as ds:
        stats = ds.describe()["backend_stats"]
        assert (stats["copier"], stats["queue_bytes"]) == (copier, queue_bytes)
        assert stats["copy_bytes"] == (1 << 10 if queue_bytes else 64 << 20)
        batches = list(ds)
        ds.set_epoch(1)
        batches += list(ds)
        cupy.cuda.get_current_stream().synchronize()
        seen = np.concatenate([check(b, data) for b in batches])
        np.testing.assert_array_equal(seen, np.concatenate([epoch_plan(ds.config, e).sample_ids() for e in (0, 1)]))
        break_then_close(ds, lambda b: check(b, data))


@pytest.mark.parametrize("queue_bytes", [0, 2 << 10])
def test_a_copy_the_native_copier_cannot_queue_names_the_shard_it_reads(small, monkeypatch, queue_bytes):
    """A failed copy reaches the consumer as a ReadError beginning with the shard file the copy reads (the
    copier reports the copy's index; the backend knows its file), with what was being read; also when the
    copies are queued a piece at a time (the index then counts from the piece's first copy)."""
    from gdsload.backends.mmap.copier import Copier, CopyFailed
    from gdsload.errors import ReadError

    def fail(self, dst, src, nbytes, after):
        raise CopyFailed(f"native copier: cuMemcpyHtoDAsync of copy {len(nbytes) - 1} of {len(nbytes)} failed: "
                         f"CUDA_ERROR_ILLEGAL_ADDRESS", len(nbytes) - 1)

    path, _ = small
    options = {"copier": "native", "queue_bytes": queue_bytes, "unlocked": "wait"}  # every read a copy
    with Dataset(path, batch_size=50, backend="mmap", backend_options=options) as ds:
        monkeypatch.setattr(Copier, "copy", fail)
        with pytest.raises(ReadError, match=rf"^{re.escape(path)}/\S+: read of \d+ bytes at offset \d+ failed \("
                                            r"native copier: .*CUDA_ERROR_ILLEGAL_ADDRESS\) \(reading "):
            next(iter(ds))


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_chunks_read_as_fill_value(tmp_path, backend):
    path = str(tmp_path / "z.gds")
    want = zarr_dataset_with_missing_block(path)
    with Dataset(path, batch_size=5, backend=backend, missing_chunks="fill") as ds:
        got = np.concatenate([to_host(b["x"]) for b in ds])
    np.testing.assert_array_equal(got, want)


def test_io_mode_is_reported_honestly(small, monkeypatch):
    from gdsload.system.env import gds_available

    path, _ = small
    with Dataset(path, batch_size=8, backend="kvikio") as ds:
        assert ds.io_mode == ("gds" if gds_available() else "kvikio-compat")
    with Dataset(path, batch_size=8, backend="pinned") as ds:
        assert ds.io_mode == "pinned"
    with Dataset(path, batch_size=8) as ds:
        assert ds.backend_name == "mmap" and "fits" in ds.backend_reason, "a small dataset: the RAM tier"
        assert ds.io_mode == "mmap"
    monkeypatch.setattr("gdsload.backends.registry.RAM_TIER_SHARE", 0.0)  # nothing fits: what auto picks from storage
    with Dataset(path, batch_size=8) as ds:
        assert ds.backend_name == ("kvikio" if gds_available() else "pinned") and ds.backend_reason
        # KvikIO is installed there, and a C compiler: pinned's reader is the native stager
        stats = ds.describe()["backend_stats"]
        assert ds.backend_name == "kvikio" or stats["reader"] == "native", stats


def test_few_cuda_queues_warn_at_open_and_in_info(small, monkeypatch):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 the steps queue behind the loader's copies: a GPU dataset's open
    warns (once per process: a fresh one here), and gdsload info shows the note with its fix beside the GPU."""
    import json
    import subprocess
    import sys

    from gdsload.system import env

    path, _ = small
    monkeypatch.setenv(env.CONNECTIONS_ENV, "1")
    script = f"""
import json, warnings
from gdsload import GDSDataset
from gdsload.system import env
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    GDSDataset({path!r}, batch_size=8, backend="mmap").close()
    GDSDataset({path!r}, batch_size=8, backend="mmap").close()
print(json.dumps([[str(w.message) for w in caught if w.category is RuntimeWarning], env.warn_few_connections()]))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr
    warned, again = json.loads(res.stdout.splitlines()[-1])
    assert len(warned) == 1 and warned[0].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1: CUDA gives this process 1 "
                                                     "hardware"), warned
    assert again is False, "warned once per process"
    res = subprocess.run([sys.executable, "-m", "gdsload", "info"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr
    note = env.connections_note({env.CONNECTIONS_ENV: "1"})
    assert f"warning: {note}; fix: {env.CONNECTIONS_FIX}" in res.stdout, res.stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padded", [None, "max", 6])
def test_variable_length_field(tmp_path, backend, padded):
    from _helpers import ragged_source, sequences

    seqs = sequences(301, elem=(3,))
    path = str(tmp_path / "r.gds")
    write_dataset(path, {"id": ArraySource("<id>", np.arange(301))}, ragged={"tokens": ragged_source(seqs)},
                  samples_per_block=8, block_bytes=256, shard_bytes=4096, progress=False)
    seen = []
    with Dataset(path, batch_size=24, backend=backend, shuffle=True, window_blocks=3, pad_to=padded,
                 pad_value=-7) as ds:
        for b in ds:
            ids = to_host(b["id"]).tolist()
            seen += ids
            tokens = to_host(b["tokens"])
            if padded is None:
                off = to_host(b["tokens/offsets"])
                for j, i in enumerate(ids):
                    np.testing.assert_array_equal(tokens[off[j]:off[j + 1]], seqs[i])
            else:
                lengths = to_host(b["tokens/lengths"])
                for j, i in enumerate(ids):
                    n = min(tokens.shape[1], len(seqs[i]))
                    assert lengths[j] == n  # the length of the row returned
                    np.testing.assert_array_equal(tokens[j, :n], seqs[i][:n])
                    assert (tokens[j, n:] == -7).all()
    assert sorted(seen) == list(range(301))


# -- a dataset of more than 4 GiB ------------------------------------------------------------------
SAMPLE_ELEMS = 1 << 20  # 1 MiB of uint8 per sample
BIG_N = 4200  # 4.1 GiB


class Pattern:
    """Sample i is (i * 7 + j) % 251 for element j: generated on the fly, checkable on the GPU."""

    origin = "<pattern>"
    shape = (BIG_N, 1024, SAMPLE_ELEMS // 1024)
    dtype = np.dtype(np.uint8)

    def read(self, start: int, stop: int) -> np.ndarray:
        i = np.arange(start, stop, dtype=np.int64)[:, None]
        j = np.arange(SAMPLE_ELEMS, dtype=np.int64)[None, :]
        return ((i * 7 + j) % 251).astype(np.uint8).reshape(stop - start, *self.shape[1:])

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("big") / "big.gds")
    idx = np.arange(BIG_N, dtype=np.int64)
    write_dataset(path, {"x": Pattern(), "idx": ArraySource("idx", idx)}, progress=False)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_big_dataset_every_sample(big, backend, shuffle):
    import cupy

    j = cupy.arange(SAMPLE_ELEMS, dtype=cupy.int64)[None, :]
    seen = []
    with Dataset(big, batch_size=32, backend=backend, shuffle=shuffle, seed=3) as ds:
        assert ds.meta.num_samples * SAMPLE_ELEMS > 4 * 2**30
        bad = cupy.zeros((), dtype=cupy.int64)
        for b in ds:
            i = b["idx"].astype(cupy.int64)[:, None]
            want = ((i * 7 + j) % 251).astype(cupy.uint8)
            bad += (b["x"].reshape(len(i), -1) != want).sum()
            seen.append(cupy.asnumpy(b["idx"]))
        assert int(bad) == 0
    assert sorted(np.concatenate(seen).tolist()) == list(range(BIG_N))
