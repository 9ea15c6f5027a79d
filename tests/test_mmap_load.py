"""The mmap backend's background load (backends/mmap/: preload.py, backend.py) on the CPU: ranges read once and
locked in order, the ranges a window needs first; a copy waits for its ranges and never spans two; errors
reach whoever waits, naming the file; close() stops the threads and unlocks everything. CUDA is a stand-in
that copies host memory and refuses a copy from memory not registered in one piece."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import types

import numpy as np
import pytest

from _helpers import FakeStream
from gdsload.errors import BackendUnavailable, ReadError
from gdsload.backends.mmap.preload import Preloader

MiB = 1 << 20


def _files(tmp_path, sizes):
    paths, fds = [], {}
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        p = str(tmp_path / f"f{i}")
        rng.integers(0, 256, n, dtype=np.uint8).tofile(p)
        paths.append(p)
        fds[p] = os.open(p, os.O_RDONLY)
    return paths, fds


# -- Preloader ---------------------------------------------------------------------------------------------
def test_every_unit_is_read_whole_then_done_once(tmp_path):
    paths, fds = _files(tmp_path, [3 * MiB + 5, 1, 2 * MiB])
    units = {(p, i): (p, o, min(MiB, os.path.getsize(p) - o)) for p in paths
             for i, o in enumerate(range(0, os.path.getsize(p), MiB))}
    seen: list = []
    reads: list = []
    real = os.preadv

    def counting(fd, bufs, offset):
        reads.append((fd, offset, sum(len(b) for b in bufs)))
        return real(fd, bufs, offset)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", counting)
        loader = Preloader(units, fds.__getitem__, seen.append, threads=3, chunk_bytes=256 << 10)
        assert loader.wait(units)
        loader.close()
    assert sorted(seen) == sorted(units) and len(seen) == len(set(seen))
    # Every byte read exactly once, by chunks of at most 256 KiB.
    got = {}
    for fd, offset, n in reads:
        assert n <= 256 << 10
        got.setdefault(fd, []).append((offset, n))
    for p in paths:
        spans = sorted(got[fds[p]])
        assert sum(n for _, n in spans) == os.path.getsize(p)
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    s = loader.stats()
    assert s["bytes_loaded"] == s["bytes"] == sum(map(os.path.getsize, paths)) and s["load_s"] >= 0


def test_units_waited_for_jump_the_queue(tmp_path):
    """One thread, 40 units: a wait for the last one is served before the units queued ahead of it."""
    paths, fds = _files(tmp_path, [40 * 4096])
    p = paths[0]
    units = {i: (p, i * 4096, 4096) for i in range(40)}
    order: list = []
    gate = threading.Event()

    def done(key):
        order.append(key)
        if key == 0:
            gate.wait(5)  # hold the only thread until the wait below has queued its unit

    loader = Preloader(units, fds.__getitem__, done, threads=1, chunk_bytes=4096)
    waiter = threading.Thread(target=lambda: loader.wait([39]))
    waiter.start()
    time.sleep(0.2)
    gate.set()
    waiter.join(5)
    loader.close()
    assert order[:2] == [0, 39], order[:5]


def test_a_failed_unit_raises_for_its_waiters_naming_the_file_and_the_others_load(tmp_path):
    paths, fds = _files(tmp_path, [MiB, MiB])
    units = {p: (p, 0, 2 * MiB if p == paths[0] else MiB) for p in paths}  # the first is shorter than said
    loader = Preloader(units, fds.__getitem__, lambda k: None, threads=2, chunk_bytes=MiB)
    with pytest.raises(ReadError, match=paths[0]):
        loader.wait([paths[0]])
    assert loader.wait([paths[1]])
    with pytest.raises(ReadError, match=paths[0]):
        loader.wait(paths)  # and again, for every later waiter
    loader.close()


def test_a_failing_callback_is_named_with_its_file(tmp_path):
    paths, fds = _files(tmp_path, [4096])

    def done(key):
        raise RuntimeError("cannot lock")

    loader = Preloader({paths[0]: (paths[0], 0, 4096)}, fds.__getitem__, done, threads=1)
    with pytest.raises(ReadError, match=rf"{paths[0]}: loading it into memory failed \(RuntimeError: cannot lock"):
        loader.wait([paths[0]])
    loader.close()


def test_close_stops_the_threads_and_ends_waits(tmp_path):
    paths, fds = _files(tmp_path, [64 * 4096])
    p = paths[0]
    started = threading.Event()

    def slow(key):
        started.set()
        time.sleep(0.05)

    loader = Preloader({i: (p, i * 4096, 4096) for i in range(64)}, fds.__getitem__, slow, threads=2, chunk_bytes=4096)
    started.wait(5)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(loader.wait([63])))
    waiter.start()
    loader.close()
    waiter.join(5)
    assert result == [False], "a wait ends once the loader is closed"
    assert not [t for t in threading.enumerate() if t.name.startswith("gdsload-preload")]
    assert loader.stats()["bytes_loaded"] < 64 * 4096, "chunks not started were dropped"
    stop = threading.Event()
    stop.set()
    assert loader.wait([0, 1, 2, 63], stop) in (True, False)  # returns, never hangs


def test_a_wait_returns_false_once_its_stop_is_set(tmp_path):
    paths, fds = _files(tmp_path, [8 * 4096])
    gate = threading.Event()
    loader = Preloader({i: (paths[0], i * 4096, 4096) for i in range(8)}, fds.__getitem__,
                       lambda k: gate.wait(5), threads=1, chunk_bytes=4096)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    assert loader.wait([7], stop) is False
    gate.set()
    loader.close()


def _loaded_keys(loader):
    with loader._cond:
        return set(loader._ready)


def test_a_held_loader_loads_only_the_units_waited_for_until_started(tmp_path):
    """With ``hold``, the threads take no unit nobody waits for (a window's units load alone, not behind
    chunks already handed out); start() lets them load the rest without any wait; close() ends them."""
    paths, fds = _files(tmp_path, [16 * 4096])
    units = {i: (paths[0], i * 4096, 4096) for i in range(16)}
    loader = Preloader(units, fds.__getitem__, lambda k: None, threads=4, chunk_bytes=4096, hold=True)
    time.sleep(0.1)
    assert _loaded_keys(loader) == set()
    assert loader.wait([9, 3])
    time.sleep(0.1)
    assert _loaded_keys(loader) == {3, 9}
    loader.start()
    deadline = time.monotonic() + 5
    while _loaded_keys(loader) != set(units) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _loaded_keys(loader) == set(units) and loader.stats()["load_s"] is not None
    loader.close()
    held = Preloader(units, fds.__getitem__, lambda k: None, threads=2, chunk_bytes=4096, hold=True)
    held.close()  # threads waiting for work end too
    assert not [t for t in threading.enumerate() if t.name.startswith("gdsload-preload")]


# -- the mmap backend, CUDA replaced ---------------------------------------------------------------------
class _Runtime:
    """hostRegister / hostUnregister / memcpyAsync on host memory; a copy from memory that is not inside one
    registered range fails, as a DMA from pageable memory would not be what the backend means to do."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def hostRegister(self, ptr, nbytes, flags):
        with self.lock:
            assert not any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()), "overlap"
            self.registered[ptr] = nbytes

    def hostUnregister(self, ptr):
        with self.lock:
            del self.registered[ptr]

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        with self.lock:
            ok = any(p <= src and src + nbytes <= p + n for p, n in self.registered.items())
        if not ok:
            raise RuntimeError(f"copy of {nbytes} bytes from unregistered memory")
        self.copies.append((src, nbytes))
        ctypes.memmove(dst, src, nbytes)


@pytest.fixture
def fake_cupy(monkeypatch):
    runtime = _Runtime()
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i: contextlib.nullcontext(), Stream=FakeStream,
                                 Event=lambda **kw: object())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, uint8=np.uint8))
    return runtime


class _Dest:
    """A "device" buffer: host memory with ``.data.ptr``."""

    def __init__(self, n):
        self.array = np.zeros(n, np.uint8)
        self.data = types.SimpleNamespace(ptr=self.array.ctypes.data)


def test_mmap_backend_copies_wait_for_their_ranges_and_never_span_two(tmp_path, fake_cupy, monkeypatch):
    from gdsload.backends.mmap import backend as mmap_backend
    from gdsload.backends.base import ReadRequest
    from gdsload.format.files import ShardFiles

    paths, _ = _files(tmp_path, [300 << 10, 100 << 10])
    files = ShardFiles.open(paths)
    gate, real = threading.Event(), os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: (gate.wait(5), real(*a))[1])  # the loader reads once let
    backend = mmap_backend.MmapBackend(copy_bytes=1 << 30, register_threads=2)
    backend.range_bytes = 64 << 10  # locked and copied in ranges of this: several per file here
    t0 = time.perf_counter()
    backend.prepare(files)
    assert time.perf_counter() - t0 < 1, "the open does not wait for the files to load"
    reads = [ReadRequest(paths[0], 10, 250 << 10, 0), ReadRequest(paths[1], 0, 100 << 10, 250 << 10),
             ReadRequest(paths[0], 290 << 10, 10 << 10, 350 << 10)]
    dest = _Dest(360 << 10)
    submit = threading.Thread(target=lambda: backend.submit(dest, reads, threading.Event()).finish())
    submit.start()
    time.sleep(0.2)
    assert submit.is_alive() and not fake_cupy.copies, "nothing is copied before its ranges are locked"
    gate.set()
    submit.join(5)
    want = np.concatenate([np.fromfile(paths[0], np.uint8)[10:10 + (250 << 10)], np.fromfile(paths[1], np.uint8),
                           np.fromfile(paths[0], np.uint8)[290 << 10:]])
    np.testing.assert_array_equal(dest.array, want)
    boundaries = {m.ptr + o for m in backend._maps.values() for o in range(0, m.size, 64 << 10)}
    assert all(not any(src < b < src + n for b in boundaries) for src, n in fake_cupy.copies)
    assert len(fake_cupy.copies) > len(reads), "copies were cut at range boundaries"
    backend._loader.wait(list(backend._loader._units))
    assert sum(fake_cupy.registered.values()) == (400 << 10) == backend.pinned_bytes
    backend.close()
    assert fake_cupy.registered == {}, "close() unlocks every range"
    assert not [t for t in threading.enumerate() if t.name.startswith("gdsload-preload")]
    files.close()


def test_mmap_backend_locks_only_a_windows_ranges_until_the_pipeline_started(tmp_path, fake_cupy):
    """The first window's ranges load alone (nothing else queued before them); started() loads the rest."""
    from gdsload.backends.mmap import backend as mmap_backend
    from gdsload.backends.base import ReadRequest
    from gdsload.format.files import ShardFiles

    paths, _ = _files(tmp_path, [512 << 10])
    files = ShardFiles.open(paths)
    backend = mmap_backend.MmapBackend(register_threads=4)
    backend.range_bytes = 64 << 10
    backend.prepare(files)
    dest = _Dest(100 << 10)
    backend.submit(dest, [ReadRequest(paths[0], 200 << 10, 100 << 10, 0)], threading.Event()).finish()
    np.testing.assert_array_equal(dest.array, np.fromfile(paths[0], np.uint8)[200 << 10:300 << 10])
    time.sleep(0.1)
    assert sorted(fake_cupy.registered.values()) == [64 << 10] * 2, "ranges 3 and 4 only"
    backend.started()
    deadline = time.monotonic() + 5
    while sum(fake_cupy.registered.values()) < (512 << 10) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(fake_cupy.registered.values()) == (512 << 10) == backend.pinned_bytes
    backend.close()
    files.close()


def test_ranges_not_yet_locked_are_read_through_the_stager_and_locked_ones_copied(tmp_path, fake_cupy):
    """unlocked="stage": a window whose ranges are not locked is read at once through the native stager (here in
    host mode), never waiting for the loader; once every range is locked the same window is copied from the
    locked memory alone. Exact bytes both ways; close() gives the stager back."""
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.mmap.backend import MmapBackend
    from gdsload.backends.native import stager
    from gdsload.format.files import ShardFiles

    if stager.load() is None:
        pytest.skip(f"the native stager cannot be built here: {stager.unavailable_reason()}")
    paths, _ = _files(tmp_path, [300 << 10, 100 << 10])
    files = ShardFiles.open(paths)
    backend = MmapBackend(register_threads=2, copy_bytes=1 << 30, unlocked="stage")
    backend.range_bytes, backend.stager_mode = 64 << 10, "host"
    backend.prepare(files)  # held: nothing is locked until a window waits for it or started()
    assert backend.stage_reason is None
    reads = [ReadRequest(paths[0], 10, 250 << 10, 0), ReadRequest(paths[1], 0, 100 << 10, 250 << 10),
             ReadRequest(paths[0], 290 << 10, 10 << 10, 350 << 10)]
    want = np.concatenate([np.fromfile(paths[0], np.uint8)[10:10 + (250 << 10)], np.fromfile(paths[1], np.uint8),
                           np.fromfile(paths[0], np.uint8)[290 << 10:]])
    first = _Dest(360 << 10)
    backend.submit(first, reads, threading.Event()).finish()
    np.testing.assert_array_equal(first.array, want)
    assert backend.staged_bytes == 360 << 10 and not fake_cupy.copies and not fake_cupy.registered
    backend.started()
    deadline = time.monotonic() + 5
    while sum(fake_cupy.registered.values()) < (400 << 10) and time.monotonic() < deadline:
        time.sleep(0.01)
    again = _Dest(360 << 10)
    backend.submit(again, reads, threading.Event()).finish()
    np.testing.assert_array_equal(again.array, want)
    assert backend.staged_bytes == 360 << 10 and sum(n for _, n in fake_cupy.copies) == 360 << 10
    assert backend.stats()["staged_bytes"] == 360 << 10
    backend.close()
    files.close()


def test_mmap_backend_checks_budget_and_locking_at_open(tmp_path, fake_cupy):
    from gdsload.backends.mmap.backend import MmapBackend
    from gdsload.format.files import ShardFiles

    paths, _ = _files(tmp_path, [8192])
    files = ShardFiles.open(paths)
    with pytest.raises(BackendUnavailable, match="over its budget"):
        MmapBackend(max_bytes=4096).prepare(files)

    def refuse(ptr, nbytes, flags):
        raise RuntimeError("cudaErrorNotSupported")

    fake_cupy.hostRegister = refuse
    backend = MmapBackend()
    with pytest.raises(BackendUnavailable, match=rf"{paths[0]}: cannot lock and register .*cudaErrorNotSupported"):
        backend.prepare(files)
    backend.close()
    files.close()


def test_mmap_backend_read_error_names_the_file(tmp_path, fake_cupy, monkeypatch):
    """A file cut short after the dataset opened: the window that needs the lost bytes fails, naming the file
    and where; cut short before the backend maps it, the open fails, naming it."""
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.mmap.backend import MmapBackend
    from gdsload.format.files import ShardFiles

    paths, _ = _files(tmp_path, [1 << 20])
    files = ShardFiles.open(paths)
    gate, real = threading.Event(), os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: (gate.wait(5), real(*a))[1])  # the loader reads once let
    backend = MmapBackend(register_threads=1)
    backend.prepare(files)
    os.truncate(paths[0], 4096)
    gate.set()
    with pytest.raises(ReadError, match=rf"{paths[0]}.*offset 0"):
        backend.submit(_Dest(1 << 20), [ReadRequest(paths[0], 0, 1 << 20, 0)], threading.Event())
    backend.close()
    with pytest.raises(ReadError, match=rf"{paths[0]}: cannot map its {1 << 20} bytes .*now 4096 bytes"):
        MmapBackend().prepare(files)
    files.close()


def test_with_few_cuda_queues_a_windows_copies_are_queued_two_pieces_ahead(tmp_path, fake_cupy, monkeypatch):
    """Where the process has few CUDA hardware queues the training step queues behind every copy queued
    before it: the backend then queues a window's copies a piece at a time (each at most half of
    ``queue_bytes``), waiting for the piece two before before queuing the next, so at most two are ahead;
    the bytes are the same, and a stop between pieces queues no more. Elsewhere a window goes at once."""
    from gdsload.backends.mmap import backend as mmap_backend
    from gdsload.backends.base import ReadRequest
    from gdsload.format.files import ShardFiles

    ahead: list[int] = []  # pieces queued and not waited for (events on the backend's stream), as each copy is

    class Event:
        def __init__(self, **kw):
            self.stream, self.waited = None, False

        def synchronize(self):
            self.waited = True

    events: list[Event] = []

    class Stream(FakeStream):
        def record(self, e=None):
            e.stream = self
            events.append(e)
            return e

    real_copy = fake_cupy.memcpyAsync

    def copy(*a):
        ahead.append(sum(1 for e in events if e.stream is backend.stream and not e.waited))
        if stop_after and len(fake_cupy.copies) == stop_after:
            stop.set()
        real_copy(*a)

    fake_cupy.memcpyAsync = copy  # this test's fake driver, made by its fixture
    cuda = sys.modules["cupy"].cuda
    cuda.Stream, cuda.Event = Stream, Event
    assert mmap_backend.queue_bytes_for({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == mmap_backend.PACED_QUEUE_BYTES
    assert mmap_backend.queue_bytes_for({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == 0 == mmap_backend.queue_bytes_for({})
    paths, _ = _files(tmp_path, [512 << 10])
    files = ShardFiles.open(paths)
    want = np.fromfile(paths[0], np.uint8)[8:8 + (500 << 10)]
    for env, stop_after, pieces in ((None, 0, 1), ("1", 0, 32), ("2", 3, 4)):  # stop set in the 4th copy
        if env is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", env)
        # Paced where the environment asks for it (queue_bytes_for, the default), here 32 KiB: pieces of 16 KiB
        backend = mmap_backend.MmapBackend(register_threads=2,
                                           queue_bytes=(32 << 10) if mmap_backend.queue_bytes_for() else None)
        backend.range_bytes = 64 << 10
        backend.prepare(files)
        ahead.clear(), events.clear(), fake_cupy.copies.clear()
        stop = threading.Event()
        dest = _Dest(500 << 10)
        backend.submit(dest, [ReadRequest(paths[0], 8, 500 << 10, 0)], stop).finish()
        if env is None:
            assert backend.queue_bytes == 0 and ahead == [0] * len(fake_cupy.copies), "a window at once"
            assert max(n for _, n in fake_cupy.copies) == 64 << 10  # cut at range ends only
            np.testing.assert_array_equal(dest.array, want)
        else:
            assert backend.queue_bytes == 32 << 10 and backend.copy_bytes == 16 << 10
            assert max(n for _, n in fake_cupy.copies) <= 16 << 10
            # the piece being queued and at most one before it
            assert len(fake_cupy.copies) == pieces and ahead == [0] + [1] * (pieces - 1)
            if not stop_after:
                np.testing.assert_array_equal(dest.array, want)
        backend.close()
    files.close()
