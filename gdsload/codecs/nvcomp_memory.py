"""nvCOMP's scratch memory from CuPy's pools, given back in stream order.

Each batched decode call asks nvCOMP's allocators for device and pinned scratch memory and frees it when the
call's outputs go. nvCOMP's own allocators wait for the whole device there (a decode call then waits for every
stream's work, the reads and copies of other windows included), and allocating anew each call costs more than
the decode of a small batch. :func:`install` sets both allocators, once per process, to CuPy's device and pinned
memory pools (as nvCOMP's documentation recommends) through :class:`StreamOrdered`: memory that nvCOMP lets go
is held until the stream it was used on has passed that point, then returned to the pool, so the next call can
never be handed memory that queued work still reads or writes.

nvCOMP's allocators are the process's: once a dataset decodes on the device, every nvCOMP call in the process
uses these.
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

_installed = False
_install_lock = threading.Lock()
_allocators: list[StreamOrdered] = []  # the installed ones, for reap()


class StreamOrdered:
    """An nvCOMP allocator (``alloc(nbytes, device) -> memory with .ptr``). ``current()`` gives the stream the
    caller works on and its device; ``record(stream, device)`` returns an event recorded on that
    stream now (with ``.done``); a released block is kept until its event has passed.
    Blocks whose events have passed go back to the pool at the next allocation (or :meth:`reap`)."""

    def __init__(self, alloc: Callable[[int, int], Any], record: Callable[[Any, int], Any],
                 current: Callable[[], tuple[Any, int]]):
        self.alloc, self.record, self.current = alloc, record, current
        self._held: deque[tuple[Any, Any]] = deque()
        self._lock = threading.Lock()

    def __call__(self, nbytes: int, stream: Any) -> Lease:
        self.reap()
        # nvCOMP calls from inside the decode call, on the caller's thread, whose current stream is the codec's
        # (the decoder's); the ``stream`` it passes crashed the process when read (nvCOMP 6.0.0)
        on, device = self.current()
        return Lease(self, self.alloc(max(int(nbytes), 1), device), on, device)

    def release(self, memory: Any, stream: Any, device: int) -> None:
        """``memory`` is no longer nvCOMP's: keep it until ``stream`` has passed what is queued on it now."""
        event = self.record(stream, device)
        with self._lock:
            self._held.append((event, memory))

    def reap(self) -> None:
        """Give back every held block whose event has passed (in release order; a later one waits its turn)."""
        with self._lock:
            while self._held and self._held[0][0].done:
                self._held.popleft()

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)


class Lease:
    """A block lent to nvCOMP: ``ptr`` for nvCOMP; when nvCOMP drops it, it goes back through its allocator."""

    def __init__(self, owner: StreamOrdered, memory: Any, stream: Any, device: int):
        self.owner, self.memory, self.stream, self.device = owner, memory, stream, device  # the stream kept alive
        self.ptr = int(memory.ptr)

    def __del__(self) -> None:
        memory, self.memory = self.memory, None
        if memory is not None:
            self.owner.release(memory, self.stream, self.device)


def _on_device(alloc: Callable[[int], Any]) -> Callable[[int, int], Any]:
    import cupy

    def on(nbytes: int, device: int) -> Any:
        with cupy.cuda.Device(device):
            return alloc(nbytes)
    return on


def _record(stream: Any, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return stream.record(cupy.cuda.Event(block=False, disable_timing=True, interprocess=False))


def _current() -> tuple[Any, int]:
    import cupy

    return cupy.cuda.get_current_stream(), int(cupy.cuda.runtime.getDevice())


def _uninstall(nvcomp: Any) -> None:
    """nvCOMP's own allocators back (at exit: Python callables left in nvCOMP crashed the process after)."""
    nvcomp.set_device_allocator(None)
    nvcomp.set_pinned_allocator(None)


def install(nvcomp: Any) -> None:
    """Set nvCOMP's device and pinned allocators to CuPy's pools, stream-ordered (once per process), and
    back to nvCOMP's own at exit."""
    global _installed
    with _install_lock:
        if _installed:
            return
        import cupy

        device = StreamOrdered(_on_device(cupy.cuda.alloc), _record, _current)
        pinned = StreamOrdered(_on_device(cupy.cuda.alloc_pinned_memory), _record, _current)
        nvcomp.set_device_allocator(device)
        nvcomp.set_pinned_allocator(pinned)
        _allocators.extend((device, pinned))
        atexit.register(_uninstall, nvcomp)
        _installed = True


def reap() -> None:
    """Give back what the installed allocators hold whose stream has passed (a decoder calls it when it
    closes, its stream drained and its codec gone, so nothing it had lent stays held until the next decode)."""
    for allocator in list(_allocators):
        allocator.reap()
