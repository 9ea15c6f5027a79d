"""Host-to-device copies queued by one native call: the mmap backend's copies of a window.

The copies go round robin over the backend's streams, which the backend's own stream then waits for (two
events recorded again on every call); host mode copies with memcpy (tests). Why one call instead of one CuPy
call per copy: docs/design.md, "`mmap`: the RAM tier".
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from ..native import stager
from ...errors import BackendUnavailable, ReadError

_MODES = {"host": 0, "cuda": 1}


class CopyFailed(ReadError):
    """A copy could not be queued: ``index`` is the copy's position in the call (None: the failure was not
    one copy's), so that the caller, who knows which file each copy reads, can name it."""

    def __init__(self, message: str, index: int | None):
        super().__init__(message)
        self.index = index


class Copier:
    """Queues host-to-device copies over ``streams`` (raw ``cudaStream_t`` handles of device ``device``,
    borrowed: they must outlive the copier). One thread at a time copies (calls are serialised); close()
    frees the copier's events."""

    def __init__(self, mode: str, device: int, streams: Sequence[int]):
        """BackendUnavailable (with the reason) when the native library is missing or switched off
        (``GDSLOAD_NATIVE=0``) or CUDA cannot be reached; ValueError for a bad argument."""
        if mode not in _MODES:
            raise ValueError(f"mode must be 'host' or 'cuda' (found {mode!r})")
        if not streams:
            raise ValueError("a copier needs at least one stream")
        lib = stager.load()
        if lib is None:
            raise BackendUnavailable(f"native copier: {stager.unavailable_reason()}")
        handles = np.asarray([int(s) for s in streams], dtype=np.uint64)
        err = ctypes.create_string_buffer(stager.MSG_LEN)
        handle = lib.gds_copier_create(_MODES[mode], device, len(handles), handles.ctypes.data, err, stager.MSG_LEN)
        if not handle:
            raise BackendUnavailable(f"native copier ({mode} mode): {err.value.decode(errors='replace')}")
        self.mode, self.device, self.num_streams = mode, device, len(handles)
        self._lib, self._handle = lib, handle
        self._err = ctypes.create_string_buffer(stager.MSG_LEN)
        self._failed = ctypes.c_int(-1)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, lib.gds_copier_destroy, handle)
        self._finalizer.atexit = False  # at exit the driver goes with the process; nothing to give back

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, after: int) -> None:
        """Queue ``nbytes[i]`` from host address ``src[i]`` to device address ``dst[i]`` for every i, then
        make stream ``after`` wait for them all (host mode: copied on return). The host memory must be
        page-locked for the copies to be asynchronous, and both sides must stay valid until they are done.
        :class:`CopyFailed` (a ReadError) naming the copy that could not be queued, by its index too; the ones
        before it are still joined."""
        n = len(nbytes)
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(nbytes, dtype=np.int64)
        if len(dst) != n or len(src) != n:
            raise ValueError(f"dst, src and nbytes differ in length ({len(dst)}, {len(src)}, {n})")
        with self._lock:
            if not self._finalizer.alive:
                raise ReadError("native copier: closed")
            rc = self._lib.gds_copier_copy(self._handle, n, dst.ctypes.data, src.ctypes.data, sizes.ctypes.data,
                                           after, ctypes.byref(self._failed), self._err, stager.MSG_LEN)
            if rc != 0:
                failed = self._failed.value
                raise CopyFailed(f"native copier: {self._err.value.decode(errors='replace')}",
                                 failed if 0 <= failed < n else None)

    def close(self) -> None:
        """Free the copier's events (idempotent). Copies already queued are not waited for: the caller
        synchronises its streams first."""
        with self._lock:
            self._finalizer()
