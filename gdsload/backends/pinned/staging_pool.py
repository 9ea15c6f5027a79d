"""The pinned backend's staging: its readers' interface (:class:`StagingReader`) and the pool of pinned slots.

The pool is a fixed set of pinned host buffers ("staging slots") allocated once and never grown: exactly
``num_slots * slot_bytes`` pinned from construction to ``close()``. A slot has one owner at a time, which reads
into it, queues its copies and records the slot's event (:meth:`StagingPool.copy_out`); the next owner waits on it.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...cuda.runtime import H2D, PinnedHost, new_event
from ..._tasks import POLL_S, Pending
from ..._units import ALIGN, align_up
from ..base import FileHandles, ReadRequest


#: The keys of every reader's :meth:`StagingReader.stats`: ``reader`` (its name), ``num_threads`` (reading
#: threads), ``slot_bytes`` and ``slots`` (its staging buffers: size and count), ``pool_bytes`` (staging bytes
#: held), ``reading_slots`` (buffers that may be read into at once), ``peak_slots_in_use`` and ``spin_events``
#: (a wait for a buffer's last copy spins rather than sleeps).
STATS_KEYS = ("reader", "num_threads", "slot_bytes", "slots", "pool_bytes", "reading_slots", "peak_slots_in_use",
              "spin_events")

#: A slot load: the pieces read into one staging slot, each with its offset in the slot.
SlotGroup = list[tuple[int, ReadRequest]]


class StagingReader(ABC):
    """One way of reading a window's pieces into pinned host memory and copying them to the device on streams
    of its own. Made with everything it uses; shares nothing private with the backend."""

    #: "native" or "threads".
    name: str
    num_threads: int

    @abstractmethod
    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        """Start reading ``reads`` (coalesced, any size) into device memory at ``dest_ptr`` and return at once.
        ``fills``: the event after the window's fill writes on the backend's stream, or None. ``finish()``
        raises the first ReadError, or returns an event (on the backend's device) after the window's copies
        and its fills. Once ``stop`` is set, reads not yet started are skipped."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Settings and counters, JSON-ready, under :data:`STATS_KEYS` exactly."""

    @property
    @abstractmethod
    def pinned_bytes(self) -> int:
        """Staging bytes it holds from construction to :meth:`close`."""

    def handles(self) -> list[FileHandles]:
        """File handles of its own, to be bound to the dataset's files (by the backend's prepare)."""
        return []

    def streams(self) -> list[Any]:
        """Streams its copies go on that the backend's quiesce waits for."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Stop its threads once their reads are over; copies they queued may still run (the backend's quiesce
        and the pool's close wait for them). Handles it was handed stay open."""


def pack(pieces: Sequence[ReadRequest], slot_bytes: int) -> list[SlotGroup]:
    """Group pieces (each at most ``slot_bytes``) into slot loads: (offset in slot, piece), offsets 4 KiB
    aligned. Small blocks share a slot, so a slot, an event and a task serve many of them."""
    groups: list[SlotGroup] = []
    used = slot_bytes
    for p in pieces:
        start = align_up(used)
        if start + p.nbytes > slot_bytes:
            groups.append([])
            start = 0
        groups[-1].append((start, p))
        used = start + p.nbytes
    return groups


class StagingPool:
    """The staging slots, their events, and the one host-to-device copy loop out of them."""

    def __init__(self, slot_bytes: int, num_slots: int, device_id: int = 0, spin_events: bool = True):
        """``spin_events``: a thread waiting for a slot's last copy spins in the driver (returns sooner)
        rather than sleeping (costs a core while it waits)."""
        import cupy

        if slot_bytes < ALIGN or slot_bytes % ALIGN or num_slots < 1:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN} and num_slots >= 1 "
                             f"(found {slot_bytes}, {num_slots})")
        self.slot_bytes, self.num_slots, self.spin_events = slot_bytes, num_slots, spin_events
        self._runtime = cupy.cuda.runtime
        self.total_bytes = slot_bytes * num_slots
        # Not from CuPy's pinned pool: that one caches freed memory, and close() must really free it.
        self._mem: PinnedHost | None = PinnedHost(self.total_bytes, device_id)
        self._base = self._mem.array
        self._ptr = self._mem.ptr  # once: ndarray.ctypes builds objects on every access
        # Each slot's view made once: a reader thread slices one per read, holding the GIL.
        self._views = [memoryview(self._base[i * slot_bytes:(i + 1) * slot_bytes]) for i in range(num_slots)]
        # C-level: a reader thread takes and gives back a slot per load, holding the GIL while it does.
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(num_slots):
            self._free.put(i)
        with cupy.cuda.Device(device_id):
            self.events: list[Any] = [new_event(blocking=not spin_events) for _ in range(num_slots)]
        self._recorded = [False] * num_slots  # whether events[i] guards a copy out of slot i
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def peak_bytes_in_use(self) -> int:
        return self.peak_in_use * self.slot_bytes

    def acquire(self, stop: threading.Event) -> int | None:
        """A free slot whose last copy has finished, or None once ``stop`` is set."""
        while not stop.is_set():
            try:
                i = self._free.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if self._recorded[i]:
                self.events[i].synchronize()
            with self._lock:
                self.in_use += 1
                self.peak_in_use = max(self.peak_in_use, self.in_use)
            return i
        return None

    def release(self, i: int, recorded: bool) -> None:
        """Give slot ``i`` back; ``recorded``: ``events[i]`` was recorded after a copy out of it."""
        self._recorded[i] = recorded
        with self._lock:
            self.in_use -= 1
        self._free.put(i)

    def view(self, i: int, nbytes: int) -> memoryview:
        return self._views[i][:nbytes]

    def ptr(self, i: int) -> int:
        return self._ptr + i * self.slot_bytes

    def copy_out(self, i: int, group: SlotGroup, dest_ptr: int, stream: Any) -> None:
        """Queue on ``stream`` the copies of slot ``i``'s pieces to device memory at ``dest_ptr`` (each at its
        ``dest_offset``), and record ``events[i]`` after them (release the slot with ``recorded=True``)."""
        base = self.ptr(i)
        for at, p in group:
            self._runtime.memcpyAsync(dest_ptr + p.dest_offset, base + at, p.nbytes, H2D, stream.ptr)
        self.events[i].record(stream)

    def close(self) -> None:
        """Wait for copies still reading the slots, then free the pinned memory."""
        for recorded, e in zip(self._recorded, self.events):
            if recorded:
                e.synchronize()
        self._recorded = [False] * self.num_slots
        self._views = []
        self._base = np.zeros(0, np.uint8)
        if self._mem is not None:
            self._mem.close()
            self._mem = None
