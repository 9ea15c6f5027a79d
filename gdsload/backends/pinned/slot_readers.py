"""The pinned backend's reader that fills the staging pool's slots
(:class:`gdsload.backends.pinned.staging_pool.StagingPool`): Python threads (:class:`ThreadReader`), each copying its
slot to the device with :meth:`StagingPool.copy_out` on a non-blocking stream of its own, so the copies never
serialize with work on the legacy default stream.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...cuda.runtime import record_event
from ..._units import ALIGN
from ..._tasks import Pending, TaskGroup
from ...system.placement import Placer, inactive
from ..base import FileHandles, ReadRequest, pread_full, split
from .staging_pool import SlotGroup, StagingPool, StagingReader, pack


def _open_direct(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def _groups(reads: Sequence[ReadRequest], slot_bytes: int) -> list[SlotGroup]:
    return pack([p for r in reads for p in split(r, slot_bytes)], slot_bytes)


class ThreadReader(StagingReader):
    """``num_threads`` Python threads each read a slot load with ``os.preadv`` (through ``files``; aligned
    pieces through O_DIRECT descriptors of its own when ``direct``) and copy it on a non-blocking stream of
    their own. A window's event is recorded on ``stream`` (the backend's) after its copies. Each thread binds
    itself to ``placer``'s CPUs (the GPU's NUMA node) as it starts."""

    name = "threads"

    def __init__(self, pool: StagingPool, files: FileHandles, direct: bool, device_id: int, num_threads: int,
                 stream: Any, placer: Placer | None = None):
        import cupy

        self._cupy, self._pool, self._files, self._stream = cupy, pool, files, stream
        self._device = cupy.cuda.Device(device_id)
        self._direct_files = FileHandles(opener=_open_direct) if direct else None
        self.num_threads = num_threads
        self._local = threading.local()
        self._streams: list[Any] = []
        self._streams_lock = threading.Lock()
        placer = placer or inactive("no placement given")

        def start() -> None:
            placer.bind_thread("reader threads")
            cupy.cuda.runtime.setDevice(device_id)

        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-pinned", initializer=start)

    @property
    def pinned_bytes(self) -> int:
        return self._pool.total_bytes

    def stats(self) -> dict[str, Any]:
        pool = self._pool  # every slot may be read into at once
        return {"reader": self.name, "num_threads": self.num_threads, "slot_bytes": pool.slot_bytes,
                "slots": pool.num_slots, "pool_bytes": pool.total_bytes, "reading_slots": pool.num_slots,
                "peak_slots_in_use": pool.peak_in_use, "spin_events": pool.spin_events}

    def handles(self) -> list[FileHandles]:
        return [self._direct_files] if self._direct_files is not None else []

    def streams(self) -> list[Any]:
        with self._streams_lock:
            return list(self._streams)

    def _thread_stream(self) -> Any:
        """This reader thread's own copy stream. One shared stream serialises every copy behind every
        other; per-thread streams let copies overlap, as KvikIO's own per-thread streams do."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._device:
                stream = self._cupy.cuda.Stream(non_blocking=True)
            self._local.stream = stream
            with self._streams_lock:
                self._streams.append(stream)
        return stream

    def _read_group(self, slot: int, group: SlotGroup) -> None:
        for at, p in group:
            aligned = p.offset % ALIGN == 0 and p.nbytes % ALIGN == 0
            files = self._direct_files if (self._direct_files is not None and aligned) else self._files
            pread_full(files.get(p.path), self._pool.view(slot, at + p.nbytes)[at:], p.offset, p.path)

    def _load(self, dest_ptr: int, group: SlotGroup, stop: threading.Event) -> Any:
        """Read a group of pieces into one slot, then queue their copies; returns an event of this load's own
        after them (the slot's is re-recorded by its next owner), or None if nothing was queued."""
        slot = self._pool.acquire(stop)
        if slot is None:
            return None
        copied = None
        try:
            self._read_group(slot, group)
            stream = self._thread_stream()
            self._pool.copy_out(slot, group, dest_ptr, stream)
            copied = record_event(stream)
        finally:
            self._pool.release(slot, copied is not None)
        return copied

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        def task(group: SlotGroup) -> Callable[[], Any]:
            return lambda: self._load(dest_ptr, group, stop)

        def done(copied: list[Any]) -> Any:
            # Exactly this window's copies: waiting on whole streams would also wait for the next
            # windows' copies queued behind them, and hold the consumer back. The fills are on this stream.
            with self._device:
                for event in copied:
                    if event is not None:
                        self._stream.wait_event(event)
                return record_event(self._stream)

        return TaskGroup(self._executor, [task(g) for g in _groups(reads, self._pool.slot_bytes)], stop, done)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._direct_files is not None:
            self._direct_files.close()
