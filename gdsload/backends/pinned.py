"""The pinned backend: threads read into a small pool of pinned host slots, copies go async to the device.

Without the GDS driver this is the fastest path we measured to device memory: page cache into pinned
buffers with 16 threads runs ~43 GB/s, and the host-to-device copy from pinned memory ~55 GB/s runs
beside it on non-blocking copy streams, one per reader thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..pool import PinnedPool
from .base import (Backend, FileHandles, FillRequest, Pending, ReadRequest, Request, TaskGroup, coalesce,
                   fill_pattern, pread_full, split)

DEFAULT_THREADS = 16
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_POOL_BYTES = 256 << 20
_ALIGN = 4096
_H2D = 1  # cudaMemcpyHostToDevice


def pack(pieces: Sequence[ReadRequest], slot_bytes: int) -> list[list[tuple[int, ReadRequest]]]:
    """Group pieces (each at most ``slot_bytes``) into slot loads: (offset in slot, piece), offsets 4 KiB
    aligned. Small blocks share a slot, so a slot, an event and a task serve many of them."""
    groups: list[list[tuple[int, ReadRequest]]] = []
    used = slot_bytes
    for p in pieces:
        start = -(-used // _ALIGN) * _ALIGN
        if start + p.nbytes > slot_bytes:
            groups.append([])
            start = 0
        groups[-1].append((start, p))
        used = start + p.nbytes
    return groups


class PinnedBackend(Backend):
    name = "pinned"
    window_bytes_hint = 256 << 20

    def __init__(self, device_id: int = 0, num_threads: int = DEFAULT_THREADS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 pool_bytes: int = DEFAULT_POOL_BYTES, direct: bool = False):
        """``pool_bytes`` bounds the pinned memory held (``pool_bytes // slot_bytes`` slots); ``direct`` reads
        aligned blocks with O_DIRECT, bypassing the page cache (for datasets larger than RAM)."""
        import cupy

        if num_threads < 1:
            raise ValueError(f"num_threads must be positive (found {num_threads})")
        if pool_bytes < slot_bytes:
            raise ValueError(f"pool_bytes ({pool_bytes}) must hold at least one slot of {slot_bytes} bytes")
        self.cupy = cupy
        self.device_id = device_id
        self.num_threads = num_threads
        self.direct = direct
        self.io_mode = "pinned-odirect" if direct else "pinned"
        self.pool = PinnedPool(slot_bytes, pool_bytes // slot_bytes, device_id)
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._local = threading.local()
        self._streams: list[Any] = []
        self._streams_lock = threading.Lock()
        self._files = FileHandles()
        self._direct_files = FileHandles(os.O_RDONLY | os.O_DIRECT) if direct else None
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-pinned",
                                            initializer=cupy.cuda.runtime.setDevice, initargs=(device_id,))

    @property
    def pinned_bytes(self) -> int:
        return self.pool.total_bytes

    def allocate(self, nbytes: int) -> Any:
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.empty(nbytes, dtype=self.cupy.uint8)

    def _thread_stream(self) -> Any:
        """This reader thread's own copy stream. One shared stream serialises every copy behind every
        other; per-thread streams let copies overlap, as KvikIO's own per-thread streams do."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self.cupy.cuda.Device(self.device_id):
                stream = self.cupy.cuda.Stream(non_blocking=True)
            self._local.stream = stream
            with self._streams_lock:
                self._streams.append(stream)
        return stream

    def _read_group(self, slot: int, group: list[tuple[int, ReadRequest]]) -> None:
        for at, p in group:
            aligned = p.offset % _ALIGN == 0 and p.nbytes % _ALIGN == 0
            files = self._direct_files if (self._direct_files is not None and aligned) else self._files
            pread_full(files.get(p.path), self.pool.view(slot, at + p.nbytes)[at:], p.offset, p.path)

    def _copy_group(self, dest_ptr: int, slot: int, group: list[tuple[int, ReadRequest]]) -> Any:
        """Queue the slot's host-to-device copies and record the slot's event after them; returns an
        event of this load's own (the slot's is re-recorded by its next owner), or None if nothing was
        queued."""
        stream = self._thread_stream()
        base = self.pool.ptr(slot)
        for at, p in group:
            self.cupy.cuda.runtime.memcpyAsync(dest_ptr + p.dest_offset, base + at, p.nbytes, _H2D, stream.ptr)
        self.pool.events[slot].record(stream)
        return stream.record()

    def _load(self, dest_ptr: int, group: list[tuple[int, ReadRequest]], stop: threading.Event) -> Any:
        """Read a group of pieces into one slot, then queue their copies; returns the copies' event."""
        slot = self.pool.acquire(stop)
        if slot is None:
            return None
        copied = None
        try:
            self._read_group(slot, group)
            copied = self._copy_group(dest_ptr, slot, group)
        finally:
            self.pool.release(slot, copied is not None)
        return copied

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        with self.cupy.cuda.Device(self.device_id), self.stream:
            for r in requests:
                if isinstance(r, FillRequest):
                    fill_pattern(dest, r)
        reads = [r for r in requests if isinstance(r, ReadRequest)]
        pieces = [p for r in coalesce(reads, 1 << 62) for p in split(r, self.pool.slot_bytes)]
        dest_ptr = int(dest.data.ptr)

        def task(group: list[tuple[int, ReadRequest]]) -> Callable[[], Any]:
            return lambda: self._load(dest_ptr, group, stop)

        def done(copied: list[Any]) -> Any:
            # Exactly this window's copies: waiting on whole streams would also wait for the next
            # windows' copies queued behind them, and hold the consumer back.
            with self.cupy.cuda.Device(self.device_id):
                for event in copied:
                    if event is not None:
                        self.stream.wait_event(event)
                return self.stream.record()

        return TaskGroup(self._executor, [task(g) for g in pack(pieces, self.pool.slot_bytes)], stop, done)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for s in [self.stream, *self._streams]:
            s.synchronize()
        self.pool.close()
        self._files.close()
        if self._direct_files is not None:
            self._direct_files.close()
