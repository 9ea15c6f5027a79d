"""The pinned backend's readers on the CPU: the native one through the stager's host mode, as the backend hands
it a window's reads (coalesced, named by path), with its stop, its errors and its stats; the Python-thread one
through the backend, on a stand-in for CuPy."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from gdsload.backends.native import stager
from gdsload.backends.base import FileHandles, ReadRequest, coalesce
from gdsload.backends.kvikio import default_threads
from gdsload.backends.native.shared import release_stager, shared_stager
from gdsload.backends.pinned.native_reader import NativeReader
from gdsload.backends.pinned.staging_pool import STATS_KEYS
from gdsload.backends.sizing import (DEFAULT_THREADS, NATIVE_BUF_BYTES, NATIVE_BUFS_PER_THREAD, NATIVE_SHARED_BUF_BYTES,
                                     PIPELINE_THREADS, native_buf_bytes, native_threads)
from gdsload.system.env import local_ranks, rank_cores, usable_cores
from gdsload.errors import ReadError
from gdsload.format.files import ShardFiles

if stager.load() is None:
    pytest.skip(f"the native stager cannot be built here: {stager.unavailable_reason()}", allow_module_level=True)

FILLS = object()  # stands for the event after the window's fill writes


@pytest.fixture
def backend(tmp_path):
    rng = np.random.default_rng(0)
    datas, paths = [], []
    for i in range(3):
        d = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        p = str(tmp_path / f"shard{i}")
        d.tofile(p)
        datas.append(d)
        paths.append(p)
    files = ShardFiles.open(paths)
    handles = FileHandles()
    handles.bind(files)
    st = stager.Stager("host", num_threads=3, buf_bytes=64 << 10)
    reader = NativeReader(st, handles, contextlib.nullcontext(), None)
    yield reader, paths, datas
    reader.close()
    files.close()


def test_a_window_lands_exactly_and_hands_back_the_fill_event(backend):
    b, paths, datas = backend
    rng = np.random.default_rng(1)
    dest = np.zeros(4 << 20, np.uint8)
    reads, at = [], 0
    for _ in range(40):
        f = int(rng.integers(3))
        n = int(rng.integers(1, 200_000))
        off = int(rng.integers(0, (1 << 20) - n))
        reads.append(ReadRequest(paths[f], off, n, at))
        at += n
    reads.append(ReadRequest(paths[0], 1000, 5000, at))  # two adjacent reads: merged into one piece
    reads.append(ReadRequest(paths[0], 6000, 3000, at + 5000))
    merged = coalesce(reads, 1 << 62)
    assert len(merged) == len(reads) - 1
    job = b.submit(dest.ctypes.data, merged, threading.Event(), FILLS)
    assert job.finish() is FILLS
    for r in reads:
        f = paths.index(r.path)
        np.testing.assert_array_equal(dest[r.dest_offset:r.dest_offset + r.nbytes],
                                      datas[f][r.offset:r.offset + r.nbytes])


def test_a_failed_read_names_its_file(backend):
    b, paths, _ = backend
    dest = np.zeros(1 << 20, np.uint8)
    reads = [ReadRequest(paths[1], 0, 4096, 0), ReadRequest(paths[2], (1 << 20) - 100, 300, 8192)]
    job = b.submit(dest.ctypes.data, reads, threading.Event(), FILLS)
    with pytest.raises(ReadError, match=rf"{paths[2]}.*offset {(1 << 20) - 100}"):
        job.finish()


def test_stop_cancels_and_nothing_is_written_after_finish(backend):
    b, paths, _ = backend
    n = 50_000
    dest = np.zeros((n, 4096), np.uint8)
    reads = [ReadRequest(paths[i % 3], (i % 256) << 12, 4096, i << 12) for i in range(n)]
    stop = threading.Event()
    job = b.submit(dest.ctypes.data, reads, stop, FILLS)
    stop.set()
    job.finish()  # no error: the window is abandoned, the pipeline is stopping
    assert (~dest.any(axis=1)).sum() > n // 2  # most pieces were dropped, not read
    dest[:] = 0
    time.sleep(0.2)
    assert not dest.any()  # no read still wrote into the buffer after finish() returned


def test_readers_share_one_stager_and_closing_one_leaves_the_others_reading(backend):
    """Pinned backends of one process share a stager (one thread pool for every dataset): a reader that closes
    cancels and waits for its own jobs only; the stager closes with its last user."""
    _, paths, datas = backend
    files = ShardFiles.open(paths)
    handles = FileHandles()
    handles.bind(files)
    st = shared_stager(0, 3, 64 << 10, 2, mode="host")
    assert shared_stager(0, 3, 64 << 10, 2, mode="host") is st
    one = NativeReader(st, handles, contextlib.nullcontext(), None)
    two = NativeReader(shared_stager(0, 3, 64 << 10, 2, mode="host"), handles, contextlib.nullcontext(), None)
    reads = [ReadRequest(paths[i % 3], (i * 7919) % 4096, 1 << 16, i << 16) for i in range(32)]
    dest1, dest2 = np.zeros(32 << 16, np.uint8), np.zeros(32 << 16, np.uint8)
    pending = one.submit(int(dest1.ctypes.data), reads, threading.Event(), FILLS)
    two.close()  # another user's jobs are not touched
    assert not st.closed
    assert pending.finish() is FILLS
    expected = np.concatenate([datas[i % 3][r.offset:r.offset + r.nbytes] for i, r in enumerate(reads)])
    np.testing.assert_array_equal(dest1, expected)
    assert one.submit(int(dest2.ctypes.data), reads, threading.Event(), FILLS).finish() is FILLS
    np.testing.assert_array_equal(dest2, expected)
    release_stager(st)  # the third asker
    assert not st.closed
    one.close()  # the last user
    assert st.closed
    files.close()


def test_the_native_readers_stats_have_the_common_keys(backend):
    b, _, _ = backend
    stats = b.stats()
    assert tuple(stats) == STATS_KEYS
    assert stats["reader"] == "native" and stats["num_threads"] == b.num_threads == 3
    assert stats["slots"] == 3 * NATIVE_BUFS_PER_THREAD and stats["slot_bytes"] == 64 << 10
    assert stats["pool_bytes"] == b.pinned_bytes == 0  # host mode pins nothing


def test_the_native_reader_leaves_the_pipeline_threads_their_cores():
    assert native_threads(16) == 16 - PIPELINE_THREADS == 12
    assert native_threads(64) == DEFAULT_THREADS  # never more than the KvikIO-sized default
    assert native_threads(2) == native_threads(1) == 2  # two readers at least, even on a small machine
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_ranks_on_one_machine_are_counted_from_the_launchers_variables():
    assert local_ranks({}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "2"}) == 2  # torchrun
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "8(x2)"}) == 8  # Slurm's "count(xnodes)"
    assert local_ranks({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}) == 2  # torchrun's first
    # Not a positive count: skipped, not guessed from.
    assert local_ranks({"LOCAL_WORLD_SIZE": "", "SLURM_NTASKS_PER_NODE": "x"}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3


def test_ranks_sharing_a_machines_cores_each_count_on_their_share():
    assert rank_cores(32, 32, 1) == 32
    assert rank_cores(32, 32, 2) == 16  # two ranks on the same 32 cores
    assert rank_cores(8, 32, 4) == 8  # a mask narrower than the machine: the launcher bound this rank
    assert rank_cores(2, 2, 4) == 1


def test_readers_of_ranks_sharing_a_machine_leave_its_cores_and_caches_to_the_others():
    # Two ranks on a 32-core machine: 12 readers each, as on 16 cores alone (docs/benchmarks.md, "Multi-GPU").
    assert native_threads(rank_cores(32, 32, 2)) == 12
    assert native_buf_bytes(1) == NATIVE_BUF_BYTES and native_buf_bytes(2) == NATIVE_SHARED_BUF_BYTES
    assert NATIVE_SHARED_BUF_BYTES < NATIVE_BUF_BYTES
    # KvikIO's readers leave two cores to the consumer and the pipeline, alone or beside other ranks
    assert default_threads(32) == DEFAULT_THREADS and default_threads(16) == 14 and default_threads(3) == 2
    assert default_threads(rank_cores(32, 32, 2)) == 14


class _Stream:
    def __init__(self, non_blocking: bool = False):
        self.ptr = 0

    def record(self, event=None):
        return event

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, **kw):
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream=None):
        return self


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CuPy stand-in: "device" memory is host memory, a copy is a memmove, events are no-ops."""
    runtime = SimpleNamespace(memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
                              setDevice=lambda i: None, hostRegister=lambda *a: None, hostUnregister=lambda *a: None)
    cuda = SimpleNamespace(runtime=runtime, Device=lambda i=0: contextlib.nullcontext(), Stream=_Stream, Event=_Event)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda, uint8=np.uint8))


@pytest.mark.parametrize("reader,direct", [("threads", False), ("threads", True)])
def test_the_slot_readers_land_a_window_exactly_and_report_the_common_stats(backend, fake_gpu, reader, direct):
    """The pinned backend's Python-thread reader, through the backend, on the CPU stand-in."""
    from gdsload.backends.pinned.backend import PinnedBackend

    _, paths, datas = backend
    files = ShardFiles.open(paths)
    b = PinnedBackend(reader=reader, direct=direct, slot_bytes=64 << 10, pool_bytes=4 * (64 << 10), num_threads=3)
    try:
        b.prepare(files)
        rng = np.random.default_rng(2)
        reads, at = [], 0
        for _ in range(30):
            f, n = int(rng.integers(3)), int(rng.integers(1, 200_000))
            reads.append(ReadRequest(paths[f], int(rng.integers(0, (1 << 20) - n)), n, at))
            at += n
        reads.append(ReadRequest(paths[0], 4096, 8192, at))  # aligned: through O_DIRECT with direct
        dest = np.zeros(at + 8192, np.uint8)
        window = SimpleNamespace(data=SimpleNamespace(ptr=dest.ctypes.data))
        assert isinstance(b.submit(window, reads, threading.Event()).finish(), _Event)  # after the copies
        for r in reads:
            np.testing.assert_array_equal(dest[r.dest_offset:r.dest_offset + r.nbytes],
                                          datas[paths.index(r.path)][r.offset:r.offset + r.nbytes])
        stats = b.stats()
        assert tuple(stats) == (*STATS_KEYS, "native", "numa") and stats["reader"] == b.reader == reader
        assert stats["pool_bytes"] == b.pinned_bytes == 4 * (64 << 10) and stats["slots"] == 4
        assert stats["reading_slots"] == 4 and 1 <= stats["peak_slots_in_use"] <= 4
        with pytest.raises(ReadError, match=rf"{paths[2]}.*offset {(1 << 20) - 100}"):
            b.submit(window, [ReadRequest(paths[2], (1 << 20) - 100, 300, 0)], threading.Event()).finish()
    finally:
        b.close()
        files.close()


def test_auto_reads_through_python_threads_where_the_native_stager_is_off(fake_gpu, monkeypatch):
    """Without the native stager, "auto" is the Python-thread reader, KvikIO installed or not, and says why."""
    from gdsload.backends.pinned.backend import PinnedBackend

    monkeypatch.setenv("GDSLOAD_NATIVE", "0")
    monkeypatch.setitem(sys.modules, "kvikio", SimpleNamespace())  # installed: no longer a reader of pinned's
    b = PinnedBackend(slot_bytes=64 << 10, pool_bytes=2 * (64 << 10), num_threads=2)
    try:
        assert b.reader == b.stats()["reader"] == "threads" and "GDSLOAD_NATIVE=0" in b.stats()["native"]
    finally:
        b.close()


@pytest.mark.parametrize("reader,direct,said", [
    ("kvikio", False, r"reader 'kvikio' was removed: its readers are 'auto', 'native' and 'threads'"),
    ("gds", False, r"reader must be 'auto', 'native' or 'threads' \(found 'gds'\)"),
    ("native", True, r"O_DIRECT \(direct=True\) needs 'threads'")])
def test_a_reader_pinned_does_not_have_is_refused_naming_the_ones_it_has(reader, direct, said):
    from gdsload.backends.pinned.backend import PinnedBackend

    with pytest.raises(ValueError, match=said):
        PinnedBackend(reader=reader, direct=direct)
