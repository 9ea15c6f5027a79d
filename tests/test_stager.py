"""The native stager (gdsload/backends/native/stager.py, _stage.c) on the CPU: host mode, the runtime build and
its cache, and the CUDA mode's code paths against a fake libcuda.so.1 whose copies happen only when their
event or stream is synchronized (so a missing wait, or a staging buffer reused too early, shows in the data)."""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gdsload.backends.native import stager
from gdsload.errors import BackendUnavailable, ReadError
from gdsload.backends.native.stager import JobCancelled, Stager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUF = 64 << 10
SENTINEL = 0xA5

if stager.load() is None:
    pytest.skip(f"the native stager cannot be built here: {stager.unavailable_reason()}", allow_module_level=True)


def addr(a: np.ndarray, at: int = 0) -> int:
    return a.ctypes.data + at


@pytest.fixture
def files(tmp_path):
    """Three files of random bytes, open: (paths, fds, contents)."""
    rng = np.random.default_rng(7)
    paths, fds, datas = [], [], []
    for i, size in enumerate((300_001, 777_777, 1 << 20)):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        path = str(tmp_path / f"f{i}.bin")
        data.tofile(path)
        paths.append(path)
        fds.append(os.open(path, os.O_RDONLY))
        datas.append(data)
    yield paths, fds, datas
    for fd in fds:
        os.close(fd)


def random_jobs(rng, fds, datas, njobs, max_pieces, dest_size=None):
    """Jobs of random pieces (1 byte to 3 buffers, unaligned offsets, unaligned gaps between them in the
    destination): (jobs of (pieces, file index per piece), expected destination, destination size)."""
    jobs, at = [], 0
    for _ in range(njobs):
        pieces = []
        for _ in range(int(rng.integers(1, max_pieces + 1))):
            f = int(rng.integers(len(fds)))
            n = int(rng.integers(1, 3 * BUF + 2)) if rng.random() < 0.7 else int(rng.integers(1, 64))
            n = min(n, len(datas[f]))
            off = int(rng.integers(0, len(datas[f]) - n + 1))
            at += int(rng.integers(0, 9))
            pieces.append((f, off, n, at))
            at += n
        jobs.append(pieces)
    expected = np.full(at + 16, SENTINEL, np.uint8)
    for pieces in jobs:
        for f, off, n, d in pieces:
            expected[d:d + n] = datas[f][off:off + n]
    return jobs, expected


def expected_copies(pieces: list[tuple[int, int]], buf: int) -> int:
    """The copies a job of ``(nbytes, dest)`` pieces takes: one per sub-piece of a piece over ``buf``, one per
    run of whole pieces (size-0 ones skipped) whose destinations lie back to back and that fit ``buf``."""
    live, n, i = [(size, dest) for size, dest in pieces if size], 0, 0
    while i < len(live):
        size, dest = live[i]
        i += 1
        if size > buf:
            n += -(-size // buf)
            continue
        n, end = n + 1, dest + size
        while i < len(live) and live[i][1] == end and live[i][0] <= buf - (end - dest):
            end += live[i][0]
            i += 1
    return n


def contiguous(fds, datas, sizes, seed=0):
    """Pieces of ``sizes`` from random files and offsets, destinations back to back from 0: (file index,
    offset, nbytes, dest) each."""
    rng, pieces, at = np.random.default_rng(seed), [], 0
    for n in sizes:
        f = int(rng.integers(len(fds)))
        off = int(rng.integers(0, len(datas[f]) - n + 1))
        pieces.append((f, off, n, at))
        at += n
    return pieces


def test_random_pieces_from_several_files_land_byte_exact(files):
    """Many jobs in flight at once, far more pieces than buffers, pieces split over several buffers: every
    byte lands where it belongs and nothing is written between the pieces."""
    _, fds, datas = files
    rng = np.random.default_rng(1)
    jobs, expected = random_jobs(rng, fds, datas, njobs=40, max_pieces=25)
    dest = np.full(len(expected), SENTINEL, np.uint8)
    with Stager("host", num_threads=3, buf_bytes=BUF, bufs_per_thread=2) as st:
        ids = [st.submit([(fds[f], off, n, addr(dest, d)) for f, off, n, d in pieces]) for pieces in jobs]
        for i in rng.permutation(len(ids)):
            assert st.wait(ids[i], timeout_s=30) is True
        assert st.copies == sum(expected_copies([(n, d) for _, _, n, d in pieces], BUF) for pieces in jobs)
    assert np.array_equal(dest, expected)
    assert st.copies == sum(expected_copies([(n, d) for _, _, n, d in pieces], BUF) for pieces in jobs)


def test_small_pieces_with_back_to_back_destinations_are_copied_a_buffer_at_a_time(files):
    """A compressed window: many small pieces from several files and offsets, landing back to back. They are
    read into one staging buffer and copied with one call per buffer, not one per piece."""
    _, fds, datas = files
    pieces = contiguous(fds, datas, [10_000] * 64)
    pieces.insert(20, (0, 5, 0, 12345))  # an empty piece, its destination anywhere: skipped, the run goes on
    for buf, copies in ((4 << 20, 1), (BUF, 11)):  # 64 pieces of 10 KB: one buffer, or 6 to a 64 KiB buffer
        dest = np.full(640_000 + 16, SENTINEL, np.uint8)
        with Stager("host", num_threads=4, buf_bytes=buf) as st:
            assert st.wait(st.submit([(fds[f], o, n, addr(dest, d)) for f, o, n, d in pieces]), timeout_s=10)
            assert st.copies == copies == expected_copies([(n, d) for _, _, n, d in pieces], buf)
        for f, o, n, d in pieces:
            assert np.array_equal(dest[d:d + n], datas[f][o:o + n])
        assert (dest[640_000:] == SENTINEL).all()


def test_pieces_whose_destinations_are_not_back_to_back_are_copied_one_each(files):
    _, fds, datas = files
    gapped = [(f, o, n, d + i) for i, (f, o, n, d) in enumerate(contiguous(fds, datas, [10_000] * 64, seed=1))]
    backwards = [(f, o, n, 640_000 - n - d) for f, o, n, d in contiguous(fds, datas, [10_000] * 64, seed=2)]
    for pieces in (gapped, backwards):
        dest = np.full(640_064, SENTINEL, np.uint8)
        with Stager("host", num_threads=4, buf_bytes=4 << 20) as st:
            assert st.wait(st.submit([(fds[f], o, n, addr(dest, d)) for f, o, n, d in pieces]), timeout_s=10)
            assert st.copies == 64
        expected = np.full(len(dest), SENTINEL, np.uint8)
        for f, o, n, d in pieces:
            expected[d:d + n] = datas[f][o:o + n]
        assert np.array_equal(dest, expected)


def test_a_run_stops_before_a_piece_too_big_for_the_buffer_which_is_split_as_before(files):
    """All destinations back to back: A | B (over a buffer: 4 sub-pieces, none in a run) | C D (E would
    overflow) | E F G (exactly a buffer) | H."""
    _, fds, datas = files
    sizes = [10_000, 200_000, 10_000, 10_000, 50_000, 10_000, BUF - 60_000, 1]
    pieces = contiguous(fds, datas, sizes, seed=3)
    dest = np.full(sum(sizes) + 16, SENTINEL, np.uint8)
    with Stager("host", num_threads=3, buf_bytes=BUF) as st:
        assert st.wait(st.submit([(fds[f], o, n, addr(dest, d)) for f, o, n, d in pieces]), timeout_s=10)
        assert st.copies == 1 + 4 + 1 + 1 + 1 == expected_copies([(n, d) for _, _, n, d in pieces], BUF)
    for f, o, n, d in pieces:
        assert np.array_equal(dest[d:d + n], datas[f][o:o + n])
    assert (dest[sum(sizes):] == SENTINEL).all()


def test_a_failed_piece_inside_a_run_names_that_piece_and_nothing_of_the_run_is_copied(files):
    """One worker, one buffer of 4 MiB: the whole job is one run. Its third piece runs past the end of its
    file, or its fourth has a closed descriptor: the error names that piece and only its bytes, and the
    run's copy is not made."""
    paths, fds, datas = files
    size = len(datas[0])
    dead = os.open(os.devnull, os.O_RDONLY)
    os.close(dead)
    names = [f"piece{i}" for i in range(6)]
    with Stager("host", num_threads=1, buf_bytes=4 << 20) as st:
        pieces = [(fds[1], 1000 * i, 1000, 1000 * i) for i in range(6)]
        pieces[2] = (fds[0], size - 100, 1000, 2000)
        dest = np.full(6000, SENTINEL, np.uint8)
        with pytest.raises(ReadError) as e:
            st.wait(st.submit([(fd, o, n, addr(dest, d)) for fd, o, n, d in pieces]), timeout_s=10, paths=names)
        assert str(e.value) == f"piece2: file ends at offset {size} (expected 1000 bytes from offset {size - 100})"
        assert (dest == SENTINEL).all() and st.copies == 0

        pieces[2] = (fds[0], 2000, 1000, 2000)
        pieces[3] = (dead, 3000, 1000, 3000)
        with pytest.raises(ReadError) as e:
            st.wait(st.submit([(fd, o, n, addr(dest, d)) for fd, o, n, d in pieces]), timeout_s=10, paths=names)
        assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EBADF
        assert str(e.value).startswith("piece3: read of 1000 bytes at offset 3000 failed (OSError: [Errno")
        assert (dest == SENTINEL).all() and st.copies == 0
        pieces[3] = (fds[1], 3000, 1000, 3000)
        assert st.wait(st.submit([(fd, o, n, addr(dest, d)) for fd, o, n, d in pieces]), timeout_s=10)
        assert st.copies == 1 and np.array_equal(dest[:2000], datas[1][:2000])
        assert np.array_equal(dest[2000:3000], datas[0][2000:3000]) and np.array_equal(dest[3000:], datas[1][3000:6000])


def test_failed_runs_among_many_in_flight_complete_every_sub_piece_exactly_once(files):
    """Jobs of runs on several workers, every other one failing in a middle piece: each wait returns (no
    count left over, none counted twice, which would hang or end a job early), later jobs still land."""
    paths, fds, datas = files
    size = len(datas[0])
    dest = np.full(32 * 640_000, SENTINEL, np.uint8)
    with Stager("host", num_threads=4, buf_bytes=BUF, bufs_per_thread=2) as st:
        jobs = []
        for k in range(32):
            pieces = [(f, o, n, d + k * 640_000) for f, o, n, d in contiguous(fds, datas, [10_000] * 64, k)]
            if k % 2:
                pieces[37] = (0, size - 10, 10_000, pieces[37][3])
            jobs.append((st.submit([(fds[f], o, n, addr(dest, d)) for f, o, n, d in pieces]), pieces))
        for k, (job, pieces) in enumerate(jobs):
            if k % 2:
                with pytest.raises(ReadError, match=f"^piece37: file ends at offset {size} "):
                    st.wait(job, timeout_s=10, paths=[f"piece{i}" for i in range(64)])
            else:
                assert st.wait(job, timeout_s=10) is True
                for f, o, n, d in pieces:
                    assert np.array_equal(dest[d:d + n], datas[f][o:o + n])


def test_jobs_submitted_and_waited_from_several_threads(files):
    _, fds, datas = files
    results: dict[int, bool] = {}
    errors: list[BaseException] = []

    def client(k: int, st: Stager) -> None:
        try:
            rng = np.random.default_rng(100 + k)
            jobs, expected = random_jobs(rng, fds, datas, njobs=8, max_pieces=10)
            dest = np.full(len(expected), SENTINEL, np.uint8)
            for pieces in jobs:
                assert st.wait(st.submit([(fds[f], o, n, addr(dest, d)) for f, o, n, d in pieces]), 30)
            results[k] = np.array_equal(dest, expected)
        except BaseException as e:  # reported below
            errors.append(e)

    with Stager("host", num_threads=2, buf_bytes=BUF) as st:
        threads = [threading.Thread(target=client, args=(k, st)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors and results == {k: True for k in range(4)}


def test_empty_jobs_and_empty_pieces_are_done_at_once(files):
    _, fds, datas = files
    dest = np.full(10, SENTINEL, np.uint8)
    with Stager("host", num_threads=1, buf_bytes=BUF) as st:
        assert st.wait(st.submit([]), timeout_s=0) is True
        assert st.wait(st.submit([(fds[0], 5, 0, addr(dest))]), timeout_s=5) is True
        assert st.wait(st.submit([(fds[0], 5, 0, addr(dest)), (fds[0], 3, 4, addr(dest, 2))]), timeout_s=5)
    assert dest[2:6].tolist() == datas[0][3:7].tolist() and (dest[:2] == SENTINEL).all()


def test_a_piece_past_the_end_of_its_file_names_the_path_offset_and_bytes_got(files):
    """The job fails (its data is not claimed done); the error names piece 1's path, not piece 0's, and
    where its file really ends, even when the piece was split and a sub-piece wholly past the end failed
    first."""
    paths, fds, datas = files
    size = len(datas[0])
    dest = np.zeros(4 * BUF, np.uint8)
    with Stager("host", num_threads=3, buf_bytes=BUF) as st:
        job = st.submit([(fds[1], 0, 100, addr(dest)), (fds[0], size - 100, 1000, addr(dest, 100))])
        with pytest.raises(ReadError) as e:
            st.wait(job, timeout_s=10, paths=["first", paths[0]])
        assert str(e.value) == f"{paths[0]}: file ends at offset {size} (expected 1000 bytes from offset {size - 100})"
    with Stager("host", num_threads=4, buf_bytes=BUF) as st:
        for _ in range(100):  # sub-pieces 1-3 lie wholly past the end and race sub-piece 0 to fail first
            job = st.submit([(fds[0], size - 1000, 4 * BUF, addr(dest))])
            with pytest.raises(ReadError, match=f"file ends at offset {size} \\(expected {4 * BUF} bytes"):
                st.wait(job, timeout_s=10, paths=[paths[0]])
        with pytest.raises(ValueError, match="unknown job"):
            st.wait(job)
        assert st.wait(st.submit([(fds[0], 0, 100, addr(dest))]), timeout_s=5), "a failed job stops no other"


def huge_job(fd: int, dest: np.ndarray, count: int = 200_000) -> np.ndarray:
    """``count`` reads of a whole 1 MiB file into the 4 MiB ``dest``, over and over (many seconds of work
    if nothing stops it)."""
    k = np.arange(count, dtype=np.int64) % 4
    return np.stack([np.full(count, fd), np.zeros(count, np.int64), np.full(count, 1 << 20), addr(dest) + (k << 20)],
                    axis=1)


def test_a_closed_descriptor_fails_the_job_with_ebadf_and_drops_its_queued_pieces(files):
    _, fds, _ = files
    dead = os.open(os.devnull, os.O_RDONLY)
    os.close(dead)
    dest = np.zeros(4 << 20, np.uint8)
    pieces = np.concatenate([[(dead, 0, 4096, addr(dest))], huge_job(fds[2], dest)])
    with Stager("host", num_threads=2, buf_bytes=1 << 20) as st:
        t0 = time.monotonic()
        with pytest.raises(ReadError) as e:
            st.wait(st.submit(pieces), timeout_s=10)
        assert time.monotonic() - t0 < 3, "the failed job's queued pieces were read anyway"
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EBADF
    assert str(e.value).startswith(f"fd {dead}: read of 4096 bytes at offset 0 failed (OSError: [Errno {errno.EBADF}]")


def test_cancel_returns_promptly_and_nothing_is_written_after_the_wait(files):
    _, fds, datas = files
    dest = np.zeros(4 << 20, np.uint8)
    with Stager("host", num_threads=2, buf_bytes=1 << 20) as st:
        job = st.submit(huge_job(fds[2], dest))
        time.sleep(0.05)
        assert st.wait(job, timeout_s=0) is False, "the job should still be running"
        t0 = time.monotonic()
        st.cancel(job)
        with pytest.raises(JobCancelled):
            st.wait(job, timeout_s=5)
        assert time.monotonic() - t0 < 1
        dest[:] = SENTINEL
        time.sleep(0.3)
        assert (dest == SENTINEL).all(), "a worker wrote into the destination after the wait returned"
        st.cancel(job)  # forgotten: ignored
        with pytest.raises(ValueError, match="unknown job"):
            st.wait(job)
        assert st.wait(st.submit([(fds[2], 10, 5000, addr(dest))]), timeout_s=5), "the stager goes on working"
        assert np.array_equal(dest[:5000], datas[2][10:5010])


def test_cancel_and_close_stop_a_job_of_runs_and_nothing_is_written_after(files):
    """A million pieces of 4 KiB landing back to back over a 4 MiB destination, again and again: runs of 256
    pieces to a 1 MiB buffer (3,907 copies in all). Cancel, then close, once copies began: the waits end
    promptly, nothing lands after them."""
    _, fds, _ = files
    dest = np.zeros(4 << 20, np.uint8)
    k = np.arange(1_000_000, dtype=np.int64)
    pieces = np.stack([np.full(len(k), fds[2]), (k % 256) << 12, np.full(len(k), 4096),
                       addr(dest) + ((k % 1024) << 12)], axis=1)
    st = Stager("host", num_threads=3, buf_bytes=1 << 20)

    def started(job: int, before: int) -> None:
        deadline = time.monotonic() + 5
        while st.copies == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert st.wait(job, timeout_s=0) is False, "the job should still be running"

    job = st.submit(pieces)
    started(job, 0)
    t0 = time.monotonic()
    st.cancel(job)
    with pytest.raises(JobCancelled):
        st.wait(job, timeout_s=5)
    assert time.monotonic() - t0 < 1 and 0 < st.copies < 3907
    dest[:] = SENTINEL
    time.sleep(0.2)
    assert (dest == SENTINEL).all(), "a worker wrote into the destination after the wait returned"
    job = st.submit(pieces)
    started(job, st.copies)
    t0 = time.monotonic()
    st.close()
    assert time.monotonic() - t0 < 1
    with pytest.raises(JobCancelled):
        st.wait(job)
    copies = st.copies
    dest[:] = SENTINEL
    time.sleep(0.2)
    assert (dest == SENTINEL).all() and st.copies == copies < 2 * 3907


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def settle_tasks(limit: int) -> int:
    deadline = time.monotonic() + 3
    while task_count() > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return task_count()


def test_close_while_another_thread_waits_ends_that_wait_and_joins_every_worker(files):
    _, fds, _ = files
    baseline = task_count()
    dest = np.zeros(4 << 20, np.uint8)
    st = Stager("host", num_threads=6, buf_bytes=1 << 20)
    assert task_count() == baseline + 6
    job = st.submit(huge_job(fds[2], dest))
    out: dict[str, object] = {}

    def waiter() -> None:
        try:
            out["result"] = st.wait(job)
        except BaseException as e:
            out["error"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    assert t.is_alive()
    t0 = time.monotonic()
    st.close()
    t.join(2)
    assert not t.is_alive() and isinstance(out.get("error"), JobCancelled) and out["at"] - t0 < 1
    st.close()  # twice: nothing
    assert st.closed
    with pytest.raises(ReadError, match="closed"):
        st.submit([(fds[0], 0, 1, addr(dest))])
    with pytest.raises(JobCancelled):
        st.wait(job)
    st.cancel(job)
    dest[:] = SENTINEL
    time.sleep(0.1)
    assert (dest == SENTINEL).all()
    assert settle_tasks(baseline) <= baseline, "worker threads outlived close()"


def test_a_stager_dropped_unclosed_stops_its_threads():
    baseline = task_count()
    st = Stager("host", num_threads=3, buf_bytes=BUF)
    assert task_count() == baseline + 3 and st.pinned_bytes == 0 and st.buffer_bytes == 3 * 2 * BUF
    del st
    gc.collect()
    assert settle_tasks(baseline) <= baseline


def test_bad_arguments_are_value_errors(files):
    _, fds, _ = files
    with pytest.raises(ValueError, match="mode"):
        Stager("gpu")
    with pytest.raises(ValueError, match="positive"):
        Stager("host", num_threads=0)
    with Stager("host", num_threads=1, buf_bytes=BUF) as st:
        with pytest.raises(ValueError, match="non-negative"):
            st.submit([(fds[0], 0, -1, 0)])
        with pytest.raises(ValueError, match="shape"):
            st.submit([(fds[0], 0, 1)])
        with pytest.raises(ValueError, match="unknown job"):
            st.wait(12345)


def test_native_off_makes_load_return_none(monkeypatch):
    monkeypatch.setenv("GDSLOAD_NATIVE", "0")
    assert stager.load() is None and "GDSLOAD_NATIVE=0" in stager.unavailable_reason()
    with pytest.raises(BackendUnavailable, match="GDSLOAD_NATIVE=0"):
        Stager("host")
    monkeypatch.delenv("GDSLOAD_NATIVE")
    assert stager.load() is not None and stager.unavailable_reason() is None


def libcuda_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is installed here")
def test_cuda_mode_without_libcuda_is_unavailable_naming_it():
    with pytest.raises(BackendUnavailable, match=r"libcuda\.so\.1"):
        Stager("cuda")


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("GDSLOAD_NATIVE", "CC")}
    full.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.skipif(stager.installed_path() is not None, reason="an installed library is used before any build")
def test_the_runtime_build_is_cached_and_reused_without_compiling(tmp_path):
    code = ("from gdsload.backends.native import stager; print(stager.library_path()); "
            "print(stager.unavailable_reason())")
    first = python(code, XDG_CACHE_HOME=str(tmp_path))
    path = first.stdout.splitlines()[0]
    assert first.returncode == 0 and path.startswith(str(tmp_path / "gdsload")) and os.path.isfile(path), first
    made = os.stat(path).st_mtime_ns
    again = python(code, XDG_CACHE_HOME=str(tmp_path), CC="false")  # a compile now would fail
    assert again.stdout.splitlines() == [path, "None"], again
    assert os.stat(path).st_mtime_ns == made and os.listdir(tmp_path / "gdsload") == [os.path.basename(path)]
    failed = python(code, XDG_CACHE_HOME=str(tmp_path / "other"), CC="false")
    assert failed.stdout.splitlines()[0] == "None" and "with 'false' failed: exit status 1" in failed.stdout, failed
    assert os.listdir(tmp_path / "other" / "gdsload") == [], "a failed build left a file behind"


# -- the CUDA mode against a fake driver --


CUDA_SCRIPT = r"""
import ctypes, json, os, sys
import numpy as np
from gdsload.errors import BackendUnavailable, ReadError
from gdsload.backends.native.stager import Stager
fake = ctypes.CDLL("libcuda.so.1")
def counts():
    out = (ctypes.c_long * 6)()
    fake.fake_counts(out)
    return list(out)
paths = sys.argv[1:]
datas = [np.fromfile(p, np.uint8) for p in paths]
fds = [os.open(p, os.O_RDONLY) for p in paths]
rng = np.random.default_rng(3)
report = {}
with Stager("cuda", num_threads=3, buf_bytes=65536, bufs_per_thread=2,
            blocking_sync=bool(os.environ.get("STAGER_BLOCKING"))) as st:
    report["open"] = counts()
    report["pinned"] = st.pinned_bytes
    ok, npieces = True, 0
    for rounds in range(30):
        pieces, want, at = [], [], 0
        for _ in range(int(rng.integers(1, 12))):
            f = int(rng.integers(3)); n = int(rng.integers(1, int(os.environ.get("STAGER_TOP", 3 * 65536 + 2))))
            n = min(n, len(datas[f])); npieces += 1
            off = int(rng.integers(0, len(datas[f]) - n + 1))
            pieces.append((f, off, n, at)); at += n + int(os.environ.get("STAGER_GAP", "3"))
        dest = np.zeros(at, np.uint8)
        job = st.submit([(fds[f], o, n, dest.ctypes.data + d) for f, o, n, d in pieces])
        if not st.wait(job, timeout_s=10):
            ok = False
            break
        for f, o, n, d in pieces:
            ok = ok and np.array_equal(dest[d:d + n], datas[f][o:o + n])
    report["exact"] = ok
    report["queued"] = counts()[4]
    report["copies"], report["pieces"] = st.copies, npieces
    if os.environ.get("FAKE_CUDA_FAIL_COPY"):
        try:
            st.wait(st.submit([(fds[0], 0, 1000, dest.ctypes.data)]), paths=[paths[0]])
            report["copy_error"] = None
        except ReadError as e:
            report["copy_error"] = str(e)
report["closed"] = counts()
try:
    Stager("cuda", device=3)
except BackendUnavailable as e:
    report["device3"] = str(e)
print(json.dumps(report))
"""


def run_cuda_script(fake_libcuda: str, paths: list[str], **env: str) -> dict:
    code = f"import sys; sys.argv[1:] = {paths!r}\n" + CUDA_SCRIPT
    done = python(code, LD_LIBRARY_PATH=fake_libcuda, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_cuda_mode_copies_after_every_read_waits_for_them_and_frees_everything(files, fake_libcuda):
    """The fake driver copies only at event or stream synchronization, from the staging buffer as it is
    then: data arrives only if every copy is waited for before wait() returns and before its buffer is
    read into again. Streams, events, the registration and the context reference are all given back."""
    paths, _, _ = files
    r = run_cuda_script(fake_libcuda, paths)
    retained, streams, events, regs, queued, blocking = r["open"]
    assert (retained, streams, events, regs, blocking) == (1, 3, 6, 1, 0) and r["pinned"] == 6 * 65536
    assert r["exact"] is True
    assert r["closed"][:4] == [0, 0, 0, 0] and r["closed"][4] > 30
    assert "cuDeviceGet (device 3) failed: CUDA_ERROR_INVALID_DEVICE" in r["device3"]


def test_cuda_mode_blocking_sync_makes_sleeping_events_and_still_waits_for_every_copy(files, fake_libcuda):
    paths, _, _ = files
    r = run_cuda_script(fake_libcuda, paths, STAGER_BLOCKING="1")
    assert r["open"][2] == r["open"][5] == 6  # every buffer's event made with CU_EVENT_BLOCKING_SYNC
    assert r["exact"] is True and r["closed"][:4] == [0, 0, 0, 0]


def test_cuda_mode_copies_a_run_of_back_to_back_pieces_at_once_and_waits_for_it(files, fake_libcuda):
    """Destinations back to back: small pieces go in runs, one copy and event each, big ones are split;
    settling a buffer completes every piece of its run (else a wait would hang or return before the data)."""
    paths, _, _ = files
    mixed = run_cuda_script(fake_libcuda, paths, STAGER_GAP="0")
    apart = run_cuda_script(fake_libcuda, paths, STAGER_TOP="20000")
    together = run_cuda_script(fake_libcuda, paths, STAGER_TOP="20000", STAGER_GAP="0")
    assert mixed["exact"] is True and apart["exact"] is True and together["exact"] is True
    assert apart["copies"] == apart["queued"] == apart["pieces"], "pieces 3 bytes apart: a copy each"
    assert together["copies"] == together["queued"] and 3 * together["copies"] < together["pieces"]
    assert mixed["copies"] == mixed["queued"] and mixed["closed"][:4] == together["closed"][:4] == [0, 0, 0, 0]


def test_cuda_mode_a_failed_copy_is_a_read_error_naming_the_cuda_error(files, fake_libcuda):
    paths, _, _ = files
    queued = run_cuda_script(fake_libcuda, paths)["queued"]  # the same pieces every run (seeded)
    r = run_cuda_script(fake_libcuda, paths, FAKE_CUDA_FAIL_COPY=str(queued + 1))  # the last job's one copy
    assert r["exact"] is True
    assert r["copy_error"] == (f"{paths[0]}: read of 1000 bytes at offset 0 failed (cuMemcpyHtoDAsync failed: "
                               f"CUDA_ERROR_ILLEGAL_ADDRESS)")
    assert r["closed"][:4] == [0, 0, 0, 0]
