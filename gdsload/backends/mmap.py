"""The mmap backend (the RAM tier): shard files mapped read-only and registered for DMA once, then copied
to the device.

For datasets that fit in RAM. Registering a mapping page-locks it (``cudaHostRegister`` with the
read-only flag), so every later "read" is a host-to-device DMA copy, with no page-cache read in between.
The price is memory: the dataset's pages stay locked in RAM for the dataset's life (shared with other
processes that map the same files), and opening a cold dataset reads all of it once. Registration happens
when the dataset opens, so a dataset too large for the budget fails there, never mid-epoch.

As with any memory-mapped file, a shard file truncated in place while the dataset is open kills the
process with SIGBUS. Replacing the dataset is safe: ``gdsload shard --overwrite`` renames a new folder
into place, and the open dataset keeps reading the files it locked.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._cuda import H2D, HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, record_event
from ..errors import BackendUnavailable, ReadError
from .base import Pending, ReadRequest, Request, coalesce, pread_full, read_error, split
from .cuda import CudaBackend

DEFAULT_COPY_BYTES = 64 << 20
DEFAULT_STREAMS = 2
_PRELOAD_CHUNK = 8 << 20


def default_budget() -> int:
    """Half of physical RAM: what the mmap backend may lock by default."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def check_budget(sizes: dict[str, int], budget: int) -> None:
    """Refuse, before anything is locked, a set of files larger than the lock budget."""
    total = sum(sizes.values())
    if total > budget:
        folders = sorted({os.path.dirname(os.path.dirname(p)) for p in sizes})[:3]
        raise BackendUnavailable(
            f"backend 'mmap' would lock {total / 2**30:.2f} GiB of shard files in RAM ({', '.join(folders)}...), "
            f"over its budget of {budget / 2**30:.2f} GiB (backend_options={{'max_bytes': ...}}; default half of "
            f"RAM). Use backend='kvikio' or 'pinned' for datasets that do not fit in memory.")


def plan_copies(reads: Sequence[ReadRequest], sizes: dict[str, int], max_bytes: int) -> list[ReadRequest]:
    """Reads -> copies of at most ``max_bytes``, adjacent blocks merged; a read past a file's end raises
    ReadError naming the file (the mapping covers the file as it was when registered)."""
    for r in reads:
        size = sizes.get(r.path)
        if size is None:
            raise ReadError(f"{r.path}: not registered with the mmap backend")
        if r.offset + r.nbytes > size:
            raise read_error(r.path, r.offset, r.nbytes, got=max(0, size - r.offset))
    return [p for r in coalesce(reads, max_bytes) for p in split(r, max_bytes)]


class _Mapping:
    """One shard file: mapped read-only, its pages locked and registered with CUDA until ``close``."""

    def __init__(self, path: str, fd: int, cupy: Any):
        self.cupy = cupy
        self.size = os.fstat(fd).st_size
        if self.size == 0:
            raise ReadError(f"{path}: empty file")
        self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._array = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self._array.ctypes.data)
        try:
            cupy.cuda.runtime.hostRegister(self.ptr, self.size, HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY)
        except Exception as e:
            self._unmap()
            raise BackendUnavailable(f"{path}: cannot lock and register {self.size} bytes for DMA "
                                     f"({type(e).__name__}: {e}); backend 'mmap' needs read-only host "
                                     f"registration (Linux, CUDA 11.1+)") from e

    def _unmap(self) -> None:
        self._array = np.zeros(0, np.uint8)  # drop the buffer export before closing the map
        self._mm.close()

    def close(self) -> None:
        self.cupy.cuda.runtime.hostUnregister(self.ptr)
        self._unmap()


class MmapBackend(CudaBackend):
    name = "mmap"
    io_mode = "mmap"
    window_bytes_hint = 256 << 20

    def __init__(self, device_id: int = 0, max_bytes: int | None = None, num_streams: int = DEFAULT_STREAMS,
                 copy_bytes: int = DEFAULT_COPY_BYTES, register_threads: int = 16):
        """``max_bytes`` caps the bytes locked (default half of RAM); copies of at most ``copy_bytes`` go
        round robin over ``num_streams`` non-blocking streams; ``register_threads`` read and lock the files
        at open."""
        if num_streams < 1 or copy_bytes < 1 or register_threads < 1:
            raise ValueError(f"num_streams, copy_bytes and register_threads must be positive "
                             f"(found {num_streams}, {copy_bytes}, {register_threads})")
        super().__init__(device_id)
        self.max_bytes = default_budget() if max_bytes is None else max_bytes
        self.copy_bytes = copy_bytes
        self.register_threads = register_threads
        with self.device:
            self._streams = [self.cupy.cuda.Stream(non_blocking=True) for _ in range(num_streams)]
        self._sizes: dict[str, int] = {}
        self._sizes_lock = threading.Lock()
        self._maps: dict[str, _Mapping] = {}  # every file the dataset reads, mapped and locked at prepare()
        self.register_s = 0.0  # wall time spent opening: reading the files once, mapping and locking them
        self.preload_s = 0.0  # from the start of opening to the end of the last read (locks overlap the reads)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of shard files locked in RAM."""
        return sum(self._sizes.values())

    def stats(self) -> dict[str, Any]:
        return {"locked_bytes": self.pinned_bytes, "open_s": self.register_s, "preload_s": self.preload_s,
                "num_streams": len(self._streams), "copy_bytes": self.copy_bytes}

    def _register(self, path: str, fd: int) -> None:
        with self.device:
            m = _Mapping(path, fd, self.cupy)
        with self._sizes_lock:
            self._maps[path] = m
            self._sizes[path] = m.size

    def prepare(self, files: Any) -> None:
        """Map and lock every file the dataset reads, checking the whole set against the budget first.

        The files are read once through the page cache by parallel reads, and each is locked as soon as its
        last read is done, while the others still load: locking alone faults pages in one at a time, far
        below the disk's rate, and locking only after all the reads adds its whole time at the end.
        """
        import time

        paths = list(files)
        sizes = {p: files.get(p).size for p in paths}
        check_budget(sizes, self.max_bytes)
        t0 = time.perf_counter()
        left = {p: -(-n // _PRELOAD_CHUNK) for p, n in sizes.items()}  # reads still to do, per file
        lock = threading.Lock()
        local = threading.local()
        read_done = [t0]

        def load(path: str, offset: int, nbytes: int) -> None:
            if getattr(local, "buf", None) is None:
                local.buf = np.empty(_PRELOAD_CHUNK, dtype=np.uint8)
            pread_full(files.fd(path), memoryview(local.buf)[:nbytes], offset, path)
            with lock:
                left[path] -= 1
                last = left[path] == 0
                read_done[0] = max(read_done[0], time.perf_counter())
            if last:
                self._register(path, files.fd(path))  # map and lock it now, while the other files load

        chunks = [(p, o, min(_PRELOAD_CHUNK, n - o)) for p, n in sizes.items() for o in range(0, n, _PRELOAD_CHUNK)]
        pool = ThreadPoolExecutor(self.register_threads, thread_name_prefix="gdsload-mmap-open")
        try:
            # An empty file has no reads: registering it reports it.
            futures = [pool.submit(load, *c) for c in chunks] + [pool.submit(self._register, p, files.fd(p))
                                                                  for p in paths if sizes[p] == 0]
            for f in futures:
                f.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after an error, the reads not yet started are dropped
        self.preload_s += read_done[0] - t0
        self.register_s += time.perf_counter() - t0

    def _mapping(self, path: str) -> _Mapping:
        m = self._maps.get(path)
        if m is None:
            raise ReadError(f"{path}: not registered with the mmap backend")
        return m

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        reads = [r for r in requests if isinstance(r, ReadRequest)]
        maps = {p: self._mapping(p) for p in {r.path for r in reads}}
        copies = plan_copies(reads, {p: m.size for p, m in maps.items()}, self.copy_bytes)
        dest_ptr = int(dest.data.ptr)
        rt = self.cupy.cuda.runtime
        self.write_fills(dest, requests)  # on self.stream: the event recorded last covers them
        with self.device:
            for i, c in enumerate(copies):
                s = self._streams[i % len(self._streams)]
                rt.memcpyAsync(dest_ptr + c.dest_offset, maps[c.path].ptr + c.offset, c.nbytes, H2D, s.ptr)
            for s in self._streams[:len(copies)]:
                self.stream.wait_event(record_event(s))
            return _Queued(record_event(self.stream))

    def close(self) -> None:
        for s in [self.stream, *self._streams]:
            s.synchronize()  # no copy may still read a mapping that is about to go
        with self._sizes_lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
            self._sizes.clear()


class _Queued(Pending):
    """Copies queued on the device: nothing to wait for on the host, the consumer's stream waits on the event."""

    def __init__(self, event: Any):
        self.event = event

    def finish(self) -> Any:
        return self.event
