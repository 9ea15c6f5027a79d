"""The native stager: C threads (``_stage.c``) read pieces of files into their own staging buffers and copy them on.

Loaded by ctypes: a build installed beside this module, else one compiled at first use into
:func:`gdsload.system.env.cache_dir` (named by the source's hash) with ``$CC`` or ``cc``; ``GDSLOAD_NATIVE=0``
switches it off (:func:`load` returns None; callers use pure Python). A job is a list of pieces
``(fd, offset, nbytes, dest)``, copied by ``memcpy`` ("host") or ``cuMemcpyHtoDAsync`` ("cuda").
:meth:`Stager.wait` returns only once nothing of the job is in flight, True meaning the data is at the
destination; the first error fails the job, naming its piece. ``close()`` cancels everything, joins the threads
and frees the memory. How the workers run: docs/design.md, "`pinned` and the staging pool".
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.machinery
import math
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._tasks import Closing
from ...system.env import cache_dir
from ...errors import BackendUnavailable, ReadError, one_line
from ...format.files import read_error

ENV_NATIVE = "GDSLOAD_NATIVE"
ABI = 5  # GDS_STAGER_ABI in _stage.c: a library of another version is not used
_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "_stage.c")
_MODES = {"host": 0, "cuda": 1}
MSG_LEN = 512  # bytes of the buffer the library writes its error message into
#: The longest single wait in C: a wait without a timeout returns to Python this often, so Ctrl-C in the
#: waiting thread is seen.
_WAIT_SLICE_MS = 1000

_load_lock = threading.Lock()
_tried = False
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_reason: str | None = None


class JobCancelled(ReadError):
    """A job's wait found it cancelled (by :meth:`Stager.cancel` or by :meth:`Stager.close`): none of its
    copies is in flight any more, some of its data may be missing."""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_i64, c_size, c_ptr, c_str = ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    for name, restype, argtypes in (
            ("gds_stager_abi", c_int, []),
            ("gds_stager_create", c_ptr, [c_int, c_int, c_int, c_size, c_int, c_int, c_str, c_size]),
            ("gds_stager_submit", c_i64, [c_ptr, c_int, c_ptr, c_ptr, c_ptr, c_ptr, c_str, c_size]),
            ("gds_stager_wait", c_int, [c_ptr, c_i64, c_int, ctypes.POINTER(c_i64), ctypes.POINTER(c_int),
                                        ctypes.POINTER(c_i64), c_str, c_size]),
            ("gds_stager_cancel", None, [c_ptr, c_i64]),
            ("gds_stager_stop", None, [c_ptr]),
            ("gds_stager_destroy", None, [c_ptr]),
            ("gds_stager_pinned_bytes", c_i64, [c_ptr]),
            ("gds_stager_buffer_bytes", c_i64, [c_ptr]),
            ("gds_stager_copies", c_i64, [c_ptr]),
            ("gds_copier_create", c_ptr, [c_int, c_int, c_int, c_ptr, c_str, c_size]),
            ("gds_copier_copy", c_int, [c_ptr, c_int, c_ptr, c_ptr, c_ptr, ctypes.c_uint64, c_ptr, c_str, c_size]),
            ("gds_copier_destroy", None, [c_ptr])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _open(path: str) -> ctypes.CDLL:
    """Load and check one library file (OSError if it cannot be loaded or is of another ABI)."""
    lib = _declare(ctypes.CDLL(path))
    if lib.gds_stager_abi() != ABI:
        raise OSError(f"{path}: ABI {lib.gds_stager_abi()}, expected {ABI}")
    return lib


def installed_path() -> str | None:
    """The library pip built next to this module (``_stage`` plus an extension suffix), if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, "_stage" + suffix)
        if os.path.isfile(path):
            return path
    return None


def cached_path() -> str:
    """The runtime build's file: named by the sha256 of ``_stage.c``'s bytes (and the machine)."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return os.path.join(cache_dir(), f"_stage-{platform.machine() or 'unknown'}-{digest}.so")


def _build(target: str) -> None:
    """Compile ``_stage.c`` to ``target``: to a temporary name in the same folder, then renamed into place,
    so a concurrent process never loads a half-written file. RuntimeError with the compiler's last line."""
    raw = os.environ.get("CC", "")
    try:
        cc = shlex.split(raw) or ["cc"]
    except ValueError as e:  # an unclosed quote
        raise RuntimeError(f"environment variable CC={raw!r} is not a command line ({e})") from None
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".stage-", suffix=".so")
    os.close(fd)
    cmd = [*cc, "-O2", "-std=c11", "-shared", "-fPIC", "-pthread", "-o", tmp, SOURCE, "-ldl"]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"cannot run the C compiler {cc[0]!r} ({type(e).__name__}: {e})") from None
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            last = lines[-1].strip() if lines else f"exit status {done.returncode}"
            raise RuntimeError(f"compiling {SOURCE} with {cc[0]!r} failed: {one_line(last)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _find() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, its path, None) or (None, None, why not)."""
    notes = []
    path = installed_path()
    if path is not None:
        try:
            return _open(path), path, None
        except OSError as e:
            notes.append(f"installed {os.path.basename(path)} unusable ({e}); ")
    if not os.path.isfile(SOURCE):
        return None, None, f"{''.join(notes)}no native stager: {SOURCE} is missing"
    try:
        path = cached_path()
        if os.path.isfile(path):
            try:
                return _open(path), path, None
            except OSError as e:  # damaged: built again below
                notes.append(f"cached {path} unusable ({e}); ")
        _build(path)
        return _open(path), path, None
    except (OSError, RuntimeError) as e:
        return None, None, f"{''.join(notes)}{one_line(e)}"


def _switched_off() -> bool:
    return os.environ.get(ENV_NATIVE, "").strip() == "0"


def load() -> ctypes.CDLL | None:
    """The native stager library, found or built once per process (see the module docstring), or None:
    switched off with ``GDSLOAD_NATIVE=0`` (checked on every call), or not buildable here
    (:func:`unavailable_reason` says why)."""
    global _tried, _lib, _lib_path, _reason
    if _switched_off():
        return None
    with _load_lock:
        if not _tried:
            _lib, _lib_path, _reason = _find()
            _tried = True
        return _lib


def library_path() -> str | None:
    """The file :func:`load` loaded, or None."""
    return _lib_path if load() is not None else None


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (None when it does not)."""
    if _switched_off():
        return f"the native stager is switched off ({ENV_NATIVE}=0)"
    return None if load() is not None else _reason


_live: weakref.WeakSet[Stager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child has none of the parent's worker threads: a stager it inherited must never be destroyed
    # (joining threads that do not exist) or used there; its memory is left to the child's exit.
    for st in list(_live):
        st._finalizer.detach()
        st._forked = True


def _close_live() -> None:
    for st in list(_live):
        st.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_live)


class Stager(Closing):
    """Native worker threads reading pieces of files into destination memory (see the module docstring).

    ``mode`` "host": destinations are host addresses (tests, and the same code path otherwise); "cuda":
    device addresses of device ``device``, reached through its primary context. Thread safety: every
    method may be called from any thread; :meth:`close` may run while other threads wait (their waits
    raise :class:`JobCancelled`). A stager inherited by a forked child cannot be used there.
    """

    def __init__(self, mode: str = "host", device: int = 0, num_threads: int = 16, buf_bytes: int = 4 << 20,
                 bufs_per_thread: int = 2, blocking_sync: bool = False):
        """``blocking_sync``: a worker waiting for its buffer's last copy sleeps (an event created with
        CU_EVENT_BLOCKING_SYNC) instead of spinning on a core the other workers' reads could use.
        BackendUnavailable (with the reason) when the library is missing or its creation fails (no
        libcuda, no such device, no memory); ValueError for a bad argument."""
        if mode not in _MODES:
            raise ValueError(f"mode must be 'host' or 'cuda' (found {mode!r})")
        if num_threads < 1 or bufs_per_thread < 1 or buf_bytes < 1:
            raise ValueError(f"num_threads, bufs_per_thread and buf_bytes must be positive (found {num_threads}, "
                             f"{bufs_per_thread}, {buf_bytes})")
        lib = load()
        if lib is None:
            raise BackendUnavailable(f"native stager: {unavailable_reason()}")
        err = ctypes.create_string_buffer(MSG_LEN)
        handle = lib.gds_stager_create(_MODES[mode], device, num_threads, buf_bytes, bufs_per_thread,
                                       1 if blocking_sync else 0, err, MSG_LEN)
        if not handle:
            raise BackendUnavailable(f"native stager ({mode} mode): {err.value.decode(errors='replace')}")
        self._lib, self._handle = lib, handle
        self.mode, self.device, self.num_threads = mode, device, num_threads
        self.buf_bytes, self.bufs_per_thread, self.blocking_sync = buf_bytes, bufs_per_thread, blocking_sync
        #: Page-locked bytes held ("cuda" mode; 0 in "host" mode, whose buffers are ordinary memory).
        self.pinned_bytes: int = lib.gds_stager_pinned_bytes(handle)
        #: Staging bytes held, pinned or not: ``num_threads * bufs_per_thread`` buffers of ``buf_bytes``
        #: rounded up to 4 KiB.
        self.buffer_bytes: int = lib.gds_stager_buffer_bytes(handle)
        self._copies = 0  # the count once closed
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no call is inside the library
        self._calls = 0
        self._closed = False
        self._close_lock = threading.Lock()  # a second close() returns once the first is over
        self._forked = False
        self._pid = os.getpid()
        self._jobs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # for naming a failed piece
        self._finalizer = weakref.finalize(self, lib.gds_stager_destroy, handle)
        self._finalizer.atexit = False  # at exit _close_live closes it, past threads still inside the library
        _live.add(self)

    # -- calls into the library: counted, so close() frees it only once no thread is inside --
    def _enter(self, what: str) -> None:
        with self._lock:
            if self._forked or os.getpid() != self._pid:
                raise ReadError(f"native stager: cannot {what} in a forked child (it was made in process "
                                f"{self._pid})")
            if self._closed:
                raise (JobCancelled if what == "wait" else ReadError)(
                    f"native stager: cannot {what}, the stager is closed")
            self._calls += 1

    def _leave(self) -> None:
        with self._lock:
            self._calls -= 1
            if self._calls == 0:
                self._idle.notify_all()

    def submit(self, pieces: Sequence[tuple[int, int, int, int]] | np.ndarray) -> int:
        """Queue a job: for each ``(fd, offset, nbytes, dest_address)`` read ``nbytes`` at ``offset`` of
        ``fd`` into ``dest_address``; returns the job id for :meth:`wait`. The descriptors must stay open
        and the destinations valid until wait() returned or raised (not False). ReadError once closed;
        ValueError for a negative offset or size."""
        a = np.asarray(pieces, dtype=np.int64)
        if a.size == 0:
            a = a.reshape(0, 4)
        if a.ndim != 2 or a.shape[1] != 4:
            raise ValueError(f"pieces must be (fd, offset, nbytes, dest) tuples (found an array of shape {a.shape})")
        if (a[:, :3] < 0).any():
            raise ValueError("pieces need non-negative descriptors, offsets and sizes")
        if (a[:, 0] > np.iinfo(np.intc).max).any():
            raise ValueError("a descriptor out of range")
        fds = np.ascontiguousarray(a[:, 0], dtype=np.intc)
        offsets, sizes = np.ascontiguousarray(a[:, 1]), np.ascontiguousarray(a[:, 2])
        dests = np.ascontiguousarray(a[:, 3]).view(np.uint64)
        err = ctypes.create_string_buffer(MSG_LEN)
        self._enter("submit")
        try:
            job = self._lib.gds_stager_submit(self._handle, len(a), fds.ctypes.data, offsets.ctypes.data,
                                              sizes.ctypes.data, dests.ctypes.data, err, MSG_LEN)
            if job < 0:
                raise ReadError(f"native stager: submit failed ({err.value.decode(errors='replace')})")
            self._jobs[job] = (fds, offsets, sizes)
        finally:
            self._leave()
        return job

    def wait(self, job: int, timeout_s: float | None = None, paths: Sequence[str] | None = None) -> bool:
        """True once every piece of ``job`` is read and copied (its data is at the destinations); False if
        ``timeout_s`` passed first (call again). A failed job raises ReadError naming the piece's file
        (``paths[i]`` for piece ``i``, else ``fd N``), its offset and size, as every failed read of
        gdsload is worded (:func:`gdsload.format.files.read_error`); a cancelled one, or one whose stager was
        closed, :class:`JobCancelled`. Either only once nothing of the job is in flight. After True or an
        error the job is forgotten: waiting on it again is a ValueError."""
        deadline = None if timeout_s is None else max(0.0, timeout_s)
        piece, err_no, got = ctypes.c_int64(-1), ctypes.c_int(0), ctypes.c_int64(0)
        msg = ctypes.create_string_buffer(MSG_LEN)
        while True:
            step = _WAIT_SLICE_MS if deadline is None else min(_WAIT_SLICE_MS, math.ceil(deadline * 1000))
            self._enter("wait")
            try:
                # ctypes releases the GIL for the foreign call: the other Python threads (the consumer,
                # close()) run while this one blocks in the library.
                rc = self._lib.gds_stager_wait(self._handle, job, step, ctypes.byref(piece), ctypes.byref(err_no),
                                               ctypes.byref(got), msg, MSG_LEN)
            finally:
                self._leave()
            if rc != 1:
                break
            if deadline is not None:
                deadline -= step / 1000
                if deadline <= 0:
                    return False
        text = msg.value.decode(errors="replace")
        if rc == -1:
            raise ValueError(f"native stager: {text}")
        arrays = self._jobs.pop(job, None)
        if rc == 0:
            return True
        if rc == 3:
            raise JobCancelled(f"native stager: job {job} {text}")
        return self._raise_failure(job, arrays, piece.value, err_no.value, got.value, text, paths)

    @staticmethod
    def _raise_failure(job: int, arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None, i: int, err_no: int,
                       got: int, text: str, paths: Sequence[str] | None) -> bool:
        if arrays is None or not 0 <= i < len(arrays[0]):
            raise ReadError(f"native stager: job {job} failed at piece {i} ({text})")
        fd, offset, nbytes = int(arrays[0][i]), int(arrays[1][i]), int(arrays[2][i])
        path = paths[i] if paths is not None else f"fd {fd}"
        if err_no > 0:
            cause = OSError(err_no, os.strerror(err_no))
            raise read_error(path, offset, nbytes, cause=cause) from cause
        if err_no == 0:
            raise read_error(path, offset, nbytes, got=got)
        raise ReadError(f"{path}: read of {nbytes} bytes at offset {offset} failed ({text})")

    def cancel(self, job: int) -> None:
        """Drop ``job``'s pieces not yet started; pieces being read finish uncopied. Its :meth:`wait` then
        raises JobCancelled once nothing of it is in flight (or still reports True or the error, when it
        had finished or failed first). Unknown jobs, and any job once closed, are ignored."""
        try:
            self._enter("cancel")
        except ReadError:  # closed (every job was cancelled) or inherited by fork
            return
        try:
            self._lib.gds_stager_cancel(self._handle, job)
        finally:
            self._leave()

    @property
    def copies(self) -> int:
        """Copies issued so far (``memcpy`` or ``cuMemcpyHtoDAsync`` calls): one per sub-piece, or per run of
        pieces with back-to-back destinations. Once closed, the count when close() stopped the workers."""
        with self._lock:
            if self._closed:
                return self._copies
            return int(self._lib.gds_stager_copies(self._handle))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Cancel every job, let each worker finish its current read and its copies, join the threads and
        free the buffers. Idempotent, from any thread; waits blocked in other threads raise JobCancelled."""
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                if self._forked:
                    return
                self._lib.gds_stager_stop(self._handle)  # waits in other threads return now (3)
                while self._calls:
                    self._idle.wait()
                self._copies = self._lib.gds_stager_copies(self._handle)
            self._finalizer()  # gds_stager_destroy: no thread is inside the library any more
            self._jobs.clear()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (f"Stager({self.mode!r}, {self.num_threads} threads, {self.bufs_per_thread} x {self.buf_bytes} "
                f"bytes each{state})")
