"""CUDA helpers shared by the backends, the staging pool, the assembler and the verifier: ordering events
and the runtime's enum values. CuPy is imported inside the functions.
"""

from __future__ import annotations

import os
import time
from typing import Any

H2D = 1  # cudaMemcpyHostToDevice
D2H = 2  # cudaMemcpyDeviceToHost
D2D = 3  # cudaMemcpyDeviceToDevice
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
DEV_ATTR_MULTIPROCESSOR_COUNT = 16  # cudaDevAttrMultiProcessorCount


def new_event(blocking: bool = True) -> Any:
    """A CuPy event for ordering only, without timing (timing events cost more to record, wait on and
    query; ``Stream.record()`` makes those). ``blocking``: a thread waiting on it sleeps instead of spinning
    in the driver, leaving the core to the consumer; without it, a waiting thread resumes sooner."""
    import cupy

    return cupy.cuda.Event(block=blocking, disable_timing=True)


def pinned_array(count: int, dtype: Any) -> Any:
    """A numpy array of ``count`` items in pinned memory from CuPy's pinned pool (returned to it with the
    array). Not ``cupyx.empty_pinned``: importing cupyx imports SciPy, a fraction of a second on the path of
    a fresh process's first batch."""
    import cupy
    import numpy as np

    dtype = np.dtype(dtype)
    mem = cupy.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
    return np.frombuffer(mem, dtype=dtype, count=count)


def record_event(stream: Any) -> Any:
    """A :func:`new_event` recorded on ``stream``."""
    return stream.record(new_event())


#: How long the host waits for device work that follows a decode before the decode counts as hung: far beyond
#: any sound decode of one call (at most 512 MiB decoded); ``GDSLOAD_DECODE_WAIT_S`` sets it.
DECODE_WAIT_S = 60.0
DECODE_WAIT_ENV = "GDSLOAD_DECODE_WAIT_S"


def decode_wait_s() -> float:
    """:data:`DECODE_WAIT_S`, or ``GDSLOAD_DECODE_WAIT_S`` (seconds, > 0) where set; a ValueError otherwise."""
    text = os.environ.get(DECODE_WAIT_ENV)
    if text is None:
        return DECODE_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{DECODE_WAIT_ENV} must be a number of seconds above 0 (found {text!r})")
    return value


def wait_event(event: Any, timeout_s: float | None) -> None:
    """Return once ``event``'s work is done; a ``TimeoutError`` when it is not after ``timeout_s`` (None: no
    bound). The bounded wait polls ``event.done`` (CuPy's query): a blocking ``synchronize`` cannot be left,
    and a decode nvCOMP never ends would hold the thread for good."""
    if timeout_s is None:
        event.synchronize()
        return
    deadline, nap = time.monotonic() + timeout_s, 0.0001
    while not event.done:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not done after {timeout_s:g} s")
        time.sleep(nap)
        nap = min(nap * 2, 0.001)


def wait_stream(stream: Any, timeout_s: float | None) -> None:
    """:func:`wait_event` for everything queued on ``stream`` so far (its device made current by the caller)."""
    if timeout_s is None:
        stream.synchronize()
    else:
        wait_event(record_event(stream), timeout_s)


class PinnedHost:
    """``nbytes`` of page-locked host memory: anonymous pages mapped and faulted in by the kernel
    (``MAP_POPULATE``), then registered with CUDA for DMA: quicker to set up than ``cudaHostAlloc`` (CuPy's
    ``PinnedMemory``), and copies from it run at the same rate (docs/design.md). ``array`` is the memory as
    uint8; :meth:`close` unregisters and unmaps (after every copy out of it is done), and so does dropping
    the last reference (an owner whose constructor failed later never gets to call ``close``). The pages are
    faulted in by the calling thread, so they sit on the NUMA node of the CPUs it runs on: a caller binds it
    around the construction to place them (:meth:`gdsload.system.placement.Placer.around`); registering
    does not move them."""

    def __init__(self, nbytes: int, device_id: int = 0):
        import mmap

        import cupy
        import numpy as np

        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mm: Any = mmap.mmap(-1, nbytes, flags=flags)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self.array.ctypes.data)
        self.nbytes = nbytes
        try:
            with cupy.cuda.Device(device_id):
                cupy.cuda.runtime.hostRegister(self.ptr, nbytes, HOST_REGISTER_PORTABLE)
        except BaseException:
            self._unmap()
            raise
        self._registered = True

    def _unmap(self) -> None:
        import numpy as np

        self.array = np.zeros(0, np.uint8)  # the buffer export dropped before the map closes
        try:
            self._mm.close()
        except BufferError:  # a view of it is still held somewhere: unmapped when the last one goes
            pass

    def close(self) -> None:
        if getattr(self, "_registered", False):
            import cupy

            self._registered = False
            cupy.cuda.runtime.hostUnregister(self.ptr)
            self._unmap()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit CUDA may be gone already; the process frees the pages
            pass
