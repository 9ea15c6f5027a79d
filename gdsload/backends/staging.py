"""The pinned backend's staging pool: a fixed set of pinned host buffers ("staging slots"), allocated
once, reused, never grown.

A staging slot has one owner at a time: a reader acquires it, reads into it, queues its host-to-device
copies and records the slot's event after them; the next owner waits on that event before writing. Pinned
bytes held are exactly ``num_slots * slot_bytes`` from construction to ``close()``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

from .._cuda import PinnedHost, new_event
from .._units import ALIGN

_POLL_S = 0.05


class StagingPool:
    def __init__(self, slot_bytes: int, num_slots: int, device_id: int = 0, spin_events: bool = True):
        """``spin_events``: a thread waiting for a slot's last copy spins in the driver (returns sooner)
        rather than sleeping (costs a core while it waits)."""
        import cupy

        if slot_bytes < ALIGN or slot_bytes % ALIGN or num_slots < 1:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN} and num_slots >= 1 "
                             f"(found {slot_bytes}, {num_slots})")
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.total_bytes = slot_bytes * num_slots
        # Not from CuPy's pinned pool: that one caches freed memory, and close() must really free it.
        self._mem: PinnedHost | None = PinnedHost(self.total_bytes, device_id)
        self._base = self._mem.array
        self._ptr = self._mem.ptr  # once: ndarray.ctypes builds objects on every access
        # Each slot's view made once: the driver thread slices one per read, holding the GIL.
        self._views = [memoryview(self._base[i * slot_bytes:(i + 1) * slot_bytes]) for i in range(num_slots)]
        # C-level: the pinned driver takes and gives back a slot per load, holding the GIL while it does.
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
                i = self._free.get(timeout=_POLL_S)
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
