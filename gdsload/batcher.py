"""The native batcher (``_batches.c``, in the library :mod:`gdsload.stager` loads): a C thread that assembles
a pipeline's batches from its window buffers into output slots, with no Python between two of the
consumer's training steps but the consumer's own ``next()``.

Contract. Python gives it, in order, each pass's program (:mod:`gdsload.batch_program`), each window once it
is filled (:meth:`Batcher.announce`: buffer index and "filled" event), and output slots the consumer no
longer holds (:meth:`Batcher.free_slot`). The thread publishes slots in batch order, each with its "ready"
event recorded; it hands window buffers back (:meth:`Batcher.free_buffer`) once their last reader's gathers
are queued, and waits there for them to finish. Before writing a slot its stream waits for the work queued
so far on the consumer's stream (:meth:`Batcher.set_stream`), since the consumer may have read that slot
until it dropped it. Handles passed in (streams, events, function and memory addresses) are borrowed:
the caller keeps them alive until :meth:`Batcher.close` returned.

"host" mode: addresses are host memory and the operations memcpy (tests without a GPU, the cpu backend).
Calls that never block go through a ``PyDLL`` handle (the GIL is kept: giving it up and taking it back
costs the consumer more than the call); the waits go through ``CDLL`` and give it up.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from . import stager
from .batch_program import Program
from .errors import BackendUnavailable, ReadError

_MODES = {"host": 0, "cuda": 1}
#: gds_batcher_state
RUNNING, STOPPED, FAILED, READER_FAILED = 0, 1, 2, 3
#: gds_batcher_announce's buffer for a failed read, and for the readers' end
WINDOW_FAILED, WINDOW_END = -1, -2
#: gds_batcher_take / gds_batcher_wait
NONE_YET, NONE_LEFT = -1, -2


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_i64, c_u64, c_ptr, c_str, c_size = (ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p,
                                                 ctypes.c_char_p, ctypes.c_size_t)
    for name, restype, argtypes in (
            ("gds_batcher_create", c_ptr, [c_int, c_int, c_u64, c_int, c_ptr, c_int, c_i64, c_str, c_size]),
            ("gds_batcher_add_slot", c_int, [c_ptr, c_u64, c_u64]),
            ("gds_batcher_free_slot", None, [c_ptr, c_int]),
            ("gds_batcher_set_stream", None, [c_ptr, c_u64]),
            ("gds_batcher_add_pass", c_int, [c_ptr, c_i64, c_i64, c_i64, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_u64, c_str,
                                             c_size]),
            ("gds_batcher_announce", c_int, [c_ptr, c_i64, c_i64, c_int, c_u64]),
            ("gds_batcher_free_buffer", c_int, [c_ptr, c_int]),
            ("gds_batcher_take", c_int, [c_ptr]),
            ("gds_batcher_wait", c_int, [c_ptr, c_int]),
            ("gds_batcher_state", c_int, [c_ptr, c_str, c_size]),
            ("gds_batcher_published", c_i64, [c_ptr, ctypes.POINTER(c_int)]),
            ("gds_batcher_stop", None, [c_ptr]),
            ("gds_batcher_join", None, [c_ptr]),
            ("gds_batcher_destroy", None, [c_ptr])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


#: After the consumer takes a batch, its training step is being launched: the batcher's CUDA calls wait this
#: long, so that they do not take turns with the launch in the driver.
DELAY_S = 100e-6
ENV_DELAY = "GDSLOAD_BATCHER_DELAY_US"


def delay() -> float:
    """:data:`DELAY_S`, or ``GDSLOAD_BATCHER_DELAY_US`` (microseconds) when set."""
    value = os.environ.get(ENV_DELAY, "").strip()
    return float(value) * 1e-6 if value else DELAY_S


def available() -> str | None:
    """None when the native batcher can be used here, else why not (the library's own reason)."""
    return stager.unavailable_reason()


class Batcher:
    """One pipeline's batcher thread (see the module docstring). Thread safety: every method may be called
    from any thread; the waits return on :meth:`stop` from another thread."""

    def __init__(self, mode: str, device: int, work_stream: int, buffers: Sequence[int], ahead: int = 2,
                 delay_s: float | None = None):
        """``buffers``: the window buffers' addresses (index i is buffer i in every call), all free;
        ``ahead``: batches published and not yet taken, at most; ``delay_s``: while the consumer has batches
        to take, the thread queues no work until this long after its latest take (default
        :data:`DELAY_S`, or ``GDSLOAD_BATCHER_DELAY_US``).
        BackendUnavailable when the library is missing or switched off, or CUDA cannot be reached."""
        if mode not in _MODES:
            raise ValueError(f"mode must be 'host' or 'cuda' (found {mode!r})")
        lib = stager.load()
        path = stager.library_path()
        if lib is None or path is None:
            raise BackendUnavailable(f"native batcher: {stager.unavailable_reason()}")
        self._lib = _declare(lib)
        fast = _declare(ctypes.PyDLL(path))
        bases = np.asarray([int(b) for b in buffers], dtype=np.uint64)
        err = ctypes.create_string_buffer(stager.MSG_LEN)
        handle = lib.gds_batcher_create(_MODES[mode], device, int(work_stream), len(bases), bases.ctypes.data,
                                        max(1, ahead), round(1e9 * (delay() if delay_s is None else delay_s)), err,
                                        stager.MSG_LEN)
        if not handle:
            raise BackendUnavailable(f"native batcher ({mode} mode): {err.value.decode(errors='replace')}")
        self.mode = mode
        self._closed = False
        self._close_lock = threading.Lock()
        owner = _Owner(lib, handle)
        self._h = owner.ptr
        take = fast.gds_batcher_take
        #: The next published slot, or NONE_YET / NONE_LEFT: never blocks, keeps the GIL. Safe after close()
        #: (NONE_LEFT): the C object lives as long as this function or the batcher does.
        self.take = lambda: take(owner.ptr)
        self._owner = owner
        self._free_slot, self._set_stream = fast.gds_batcher_free_slot, fast.gds_batcher_set_stream
        self._announce = fast.gds_batcher_announce

    def add_slot(self, base: int, ready: int = 0) -> int:
        """Register an output slot (``ready``: its event handle, 0 in host mode); it is free only once
        :meth:`free_slot` is called for it."""
        s = self._lib.gds_batcher_add_slot(self._h, int(base), int(ready))
        if s < 0:
            raise ReadError("native batcher: too many output slots (the consumer holds thousands of batches)")
        return s

    def free_slot(self, slot: int) -> None:
        """The consumer holds slot ``slot`` no more: the batcher may write it (after the consumer's queued work)."""
        self._free_slot(self._h, slot)

    def set_stream(self, stream: int) -> None:
        """The consumer's stream (raw handle), whose queued work every slot write waits for."""
        self._set_stream(self._h, int(stream))

    def add_pass(self, k: int, program: Program, first: int = 0, index_ready: int = 0) -> None:
        """Pass ``k``'s program (copied), run from batch ``first``; ``index_ready``: an event the gathers wait
        for (0: none)."""
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in
                  (program.op_start, program.ops, program.win_start, program.win_w, program.win_rel)]
        err = ctypes.create_string_buffer(stager.MSG_LEN)
        if self._lib.gds_batcher_add_pass(self._h, k, first, program.num_batches, *(a.ctypes.data for a in arrays),
                                          int(index_ready), err, stager.MSG_LEN) != 0:
            raise ReadError(f"native batcher: {err.value.decode(errors='replace')}")

    def announce(self, k: int, w: int, buffer: int, filled: int = 0) -> None:
        """Window ``w`` of pass ``k`` is in buffer ``buffer`` once event ``filled`` (0: now); ``buffer``
        WINDOW_FAILED: a read failed there; WINDOW_END: the readers are done."""
        if self._announce(self._h, k, w, buffer, int(filled)) != 0:
            raise ReadError(f"internal error: native batcher refused window {w} of pass {k} (buffer {buffer})")

    def free_buffer(self, timeout_s: float) -> int:
        """A window buffer free for reading (its last gathers done), -1 after ``timeout_s``, -2 once stopped."""
        return self._lib.gds_batcher_free_buffer(self._h, max(1, round(timeout_s * 1000)))

    def wait(self, timeout_s: float) -> int:
        """As :attr:`take`, waiting up to ``timeout_s`` for a slot (the GIL given up)."""
        return self._lib.gds_batcher_wait(self._h, max(1, round(timeout_s * 1000)))

    def state(self) -> tuple[int, str]:
        """(RUNNING, STOPPED, FAILED or READER_FAILED, the thread's message)."""
        err = ctypes.create_string_buffer(stager.MSG_LEN)
        state = self._lib.gds_batcher_state(self._h, err, stager.MSG_LEN)
        return state, err.value.decode(errors="replace")

    def published(self) -> tuple[int, int]:
        """(batches published so far, those of them not taken yet)."""
        ready = ctypes.c_int(0)
        n = self._lib.gds_batcher_published(self._h, ctypes.byref(ready))
        return int(n), ready.value

    def stop(self) -> None:
        """Stop the thread (it finishes the operation it is queueing) and wake every waiter; returns at once."""
        self._lib.gds_batcher_stop(self._h)

    def close(self) -> None:
        """Stop and join the thread. Idempotent; not from the batcher's own thread. Every call stays safe
        after it (the waits return -2): the C object is freed once nothing refers to it."""
        with self._close_lock:
            if not self._closed:
                self._lib.gds_batcher_join(self._h)
                self._closed = True


class _Owner:
    """Owns the C object, freed (thread joined first) when the last reference to this goes."""

    def __init__(self, lib: ctypes.CDLL, handle: int):
        self.ptr = ctypes.c_void_p(handle)
        finalizer = weakref.finalize(self, lib.gds_batcher_destroy, handle)
        finalizer.atexit = False  # at exit the thread goes with the process
