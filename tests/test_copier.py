"""The native copier (backends/mmap/copier.py, ``gds_copier_*`` in backends/native/_stage.c) on the CPU: host mode, its
errors, and its CUDA mode against the fake driver (tests/fixtures/fake_libcuda.c), whose copies run only
when a stream is synchronized: the data arrives only if the copier made the caller's stream wait for every
stream it queued copies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gdsload.backends.native import stager
from gdsload.backends.mmap.copier import Copier
from gdsload.errors import BackendUnavailable, ReadError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if stager.load() is None:
    pytest.skip(f"the native library cannot be built here: {stager.unavailable_reason()}", allow_module_level=True)


def scattered(rng: np.random.Generator, size: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` copies of random sizes from random source offsets to disjoint, shuffled destinations."""
    sizes = rng.integers(1, size // count, count)
    order = rng.permutation(count)
    dst = np.empty(count, np.int64)
    dst[order] = np.cumsum(sizes[order]) - sizes[order]  # back to back, in another order than the copies
    src = np.array([rng.integers(0, size - n + 1) for n in sizes], np.int64)
    return src, dst, sizes


def test_host_mode_copies_every_piece_byte_exact():
    rng = np.random.default_rng(5)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    src, dst, sizes = scattered(rng, len(source), 97)
    out = np.zeros(int(sizes.sum()) + 8, np.uint8)
    copier = Copier("host", 0, [0, 0, 0])
    copier.copy(dst + out.ctypes.data, src + source.ctypes.data, sizes, after=0)
    want = np.zeros_like(out)
    for s, d, n in zip(src, dst, sizes):
        want[d:d + n] = source[s:s + n]
    assert np.array_equal(out, want) and not out[-8:].any()
    copier.copy(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.int64), after=0)  # nothing to do
    copier.close()
    copier.close()  # idempotent
    with pytest.raises(ReadError, match="closed"):
        copier.copy(dst + out.ctypes.data, src + source.ctypes.data, sizes, after=0)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="mode"):
        Copier("disk", 0, [0])
    with pytest.raises(ValueError, match="at least one stream"):
        Copier("host", 0, [])
    copier = Copier("host", 0, [0])
    with pytest.raises(ValueError, match=r"differ in length \(2, 1, 1\)"):
        copier.copy(np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.ones(1, np.int64), after=0)


def test_switched_off_or_without_libcuda_is_unavailable_with_the_reason(monkeypatch):
    with pytest.raises(BackendUnavailable, match=r"libcuda\.so\.1"):
        Copier("cuda", 0, [1])
    monkeypatch.setenv(stager.ENV_NATIVE, "0")
    with pytest.raises(BackendUnavailable, match="GDSLOAD_NATIVE=0"):
        Copier("host", 0, [0])


def test_the_mmap_backend_refuses_an_unknown_copier_before_touching_cuda():
    from gdsload.backends.mmap.backend import MmapBackend

    with pytest.raises(ValueError, match="copier must be 'auto', 'native' or 'cupy'"):
        MmapBackend(copier="fast")


CUDA_SCRIPT = r"""
import ctypes, json, sys
import numpy as np
from gdsload.backends.mmap.copier import Copier
from gdsload.errors import ReadError
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_stream.restype = ctypes.c_void_p
fake.fake_sync.argtypes = [ctypes.c_void_p]
fake.fake_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
def counts():
    out = (ctypes.c_long * 6)()
    fake.fake_counts(out)
    return list(out)
rng = np.random.default_rng(11)
source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
fake.fake_register(source.ctypes.data, source.nbytes)
streams = [fake.fake_stream() for _ in range(3)]
after = fake.fake_stream()
n = 40
sizes = rng.integers(1, 20000, n)
dst = np.cumsum(sizes) - sizes
src = np.array([rng.integers(0, source.nbytes - k + 1) for k in sizes])
out = np.zeros(int(sizes.sum()), np.uint8)
want = np.concatenate([source[s:s + k] for s, k in zip(src, sizes)])
report = {"before": counts()}
copier = Copier("cuda", 0, streams)
report["open"] = counts()
copier.copy(dst + out.ctypes.data, src + source.ctypes.data, sizes, after)
report["queued_untouched"] = not out.any()
fake.fake_sync(after)  # runs only what `after` was made to wait for
report["exact"] = bool(np.array_equal(out, want))
out[:] = 0
unregistered = np.zeros(64, np.uint8)
report["addrs"] = [unregistered.ctypes.data, out.ctypes.data + 64]
try:
    copier.copy(np.array([out.ctypes.data, out.ctypes.data + 64]),
                np.array([source.ctypes.data, unregistered.ctypes.data]), np.array([64, 64]), after)
    report["error"] = None
except ReadError as e:
    report["error"], report["index"] = str(e), e.index
fake.fake_sync(after)
report["first_joined"] = bool(np.array_equal(out[:64], source[:64]))
copier.close()
report["closed"] = counts()
print(json.dumps(report))
"""


def test_cuda_mode_joins_every_stream_into_the_callers_and_gives_everything_back(fake_libcuda):
    env = {k: v for k, v in os.environ.items() if k not in ("GDSLOAD_NATIVE", "CC")}
    env.update(PYTHONPATH=ROOT, LD_LIBRARY_PATH=fake_libcuda)
    done = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.splitlines()[-1])
    retained, streams, events = r["open"][:3]
    assert (retained, streams, events) == (1, 4, 3), r  # one join event per stream, the context retained once
    assert r["queued_untouched"] and r["exact"], r
    src, dst = r["addrs"]
    assert r["error"] == (f"native copier: cuMemcpyHtoDAsync of copy 1 of 2 (64 bytes from {src:#x} to {dst:#x}) "
                          f"failed: CUDA_ERROR_INVALID_VALUE")
    assert r["index"] == 1, "the failed copy's index, for the caller to name its file"
    assert r["first_joined"], "the copy queued before the failed one was not joined into the caller's stream"
    assert r["closed"][:3] == [0, 4, 0], r  # events destroyed, context released; the streams are the caller's


def test_a_copy_that_fails_is_reported_with_the_file_it_reads():
    """The copier knows addresses only: the mmap backend turns the failed copy's index into its file, offset
    and size, so the error begins with the shard's path as every read error does."""
    from gdsload.backends.base import ReadRequest
    from gdsload.backends.mmap.backend import copy_error, plan_copies
    from gdsload.backends.mmap.copier import CopyFailed

    copies = plan_copies([ReadRequest("/d/a.shard", 0, 64, 0), ReadRequest("/d/b.shard", 4096, 128, 64)],
                         {"/d/a.shard": 64, "/d/b.shard": 8192}, 1 << 20)
    cause = CopyFailed("native copier: cuMemcpyHtoDAsync of copy 1 of 2 failed: CUDA_ERROR_ILLEGAL_ADDRESS", 1)
    e = copy_error(copies, cause)
    assert isinstance(e, ReadError)
    assert str(e) == ("/d/b.shard: read of 128 bytes at offset 4096 failed (native copier: cuMemcpyHtoDAsync of "
                      "copy 1 of 2 failed: CUDA_ERROR_ILLEGAL_ADDRESS)")
    joined = CopyFailed("native copier: joining the copies' streams failed: CUDA_ERROR_UNKNOWN", None)
    assert copy_error(copies, joined) is joined, "no one copy failed: nothing to name"
