"""Decoding on the device: zstd chunks batched through nvCOMP, and the decode step's CUDA side.

nvCOMP (``nvidia-libnvcomp-cu13`` >= 6, NVIDIA-proprietary, the optional ``gdsload[nvcomp]`` extra) is loaded
only when a dataset with device-decoded fields opens, and called through its C API
(:mod:`gdsload.codecs.nvcomp_lib`): ``nvcompBatchedZstdDecompressAsync`` decodes a batch of chunks, each from
its place in the window buffer's compressed region straight into its cell, and only queues the work on the
decoder's stream. Nothing waits for the stream or the decode, and nothing is allocated per window but a small
table of addresses and sizes (device memory from CuPy's pool, filled by one copy from a pinned buffer).

One call decodes every chunk of one field in one window, up to :data:`CALL_BYTES` decoded (a call per chunk is
far slower: few chunks leave the GPU underused). Its scratch memory is the decoder's, kept and grown as needed.
Before the call, each chunk's crc32c (when its codecs end with one) and its zstd magic number are checked on a
stream of their own that waits for the window's reads alone: nvCOMP checks neither, and a damaged frame can
make its decode run on without end. After it, each chunk's status and decoded size come back to the host with
the window's other checks (:class:`DecodeCheck`, confirmed before a sample of the window is handed on): a chunk
nvCOMP fails on, or decodes to another size than its cell's, is a ReadError naming it.

:class:`NvcompBatch` does the batching and the mapping of chunks to cells through an ``ops`` object
(:class:`DecodeDevice` here; tests pass host stand-ins and a library that decodes host memory, so this logic
runs without a GPU).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ContextManager, Protocol

import numpy as np

from ..cuda.runtime import D2H, H2D, record_event
from ..format.arrays import CRC_BYTES
from .chunks import chunk_error
from .nvcomp_lib import ZstdLib, status_name

#: The first four bytes of every zstd frame, read as a little-endian uint32.
ZSTD_MAGIC = 0xFD2FB528
#: Decoded bytes one nvCOMP call takes at most: more chunks per call keep more of the GPU busy, and nvCOMP 6's zstd
#: needs about three times a call's decoded bytes of scratch memory.
CALL_BYTES = 512 << 20
SIZE_BYTES, STATUS_BYTES = 8, 4  # a size_t, an nvcompStatus_t


class DecodeOps(Protocol):
    """The device side of the decode step: its stream, pinned host buffers, host-to-device copies ordered
    after a window's reads, device memory and copies to and from it on the decoder's stream, and the checks
    before a decode. :class:`DecodeDevice` keeps it on a GPU; the tests keep it with numpy."""

    stream_ptr: int

    def pinned(self, nbytes: int) -> np.ndarray: ...
    def ordered(self, filled: Any) -> ContextManager[None]: ...
    def to_device(self, buffer: Any, dest: int, host: np.ndarray, src: int, nbytes: int) -> None: ...
    def done(self, keep: list[Any]) -> Any: ...
    def address(self, arr: Any) -> int: ...
    def empty(self, nbytes: int) -> Any: ...
    def upload(self, data: np.ndarray, extra: int) -> tuple[Any, Any]: ...
    def download(self, arr: Any, lo: int, hi: int) -> Readback: ...
    def heads(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray: ...
    def crc_mismatch(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray: ...
    def quiesce(self) -> None: ...
    def close(self) -> None: ...


class Readback:
    """Bytes copied from the device into ``host`` on the decoder's stream: :meth:`get` waits for the copy
    (``event``; None: done) and returns them."""

    def __init__(self, host: np.ndarray, event: Any = None):
        self.host, self.event = host, event

    def get(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class DecodeCheck:
    """A field's decode in one window, queued: :meth:`confirm` waits for it and raises the ReadError of the
    first chunk nvCOMP failed on or decoded to another size than its cell's; later calls do nothing. ``keep``:
    what must live until the decoder's stream has passed the decode (its arguments, its readbacks)."""

    def __init__(self, layout: Any, job: Any, names: list[str], cell_bytes: int):
        self.layout, self.job, self.names, self.cell_bytes = layout, job, names, cell_bytes
        self.calls: list[tuple[int, Readback]] = []  # (the call's first chunk in the job, its readback)
        self.keep: list[Any] = []
        self.confirmed = False

    def confirm(self) -> None:
        if self.confirmed:
            return
        self.confirmed = True
        for first, readback in self.calls:
            got = readback.get()
            m = len(got) // (SIZE_BYTES + STATUS_BYTES)
            sizes = got[:m * SIZE_BYTES].view(np.uint64)
            statuses = got[m * SIZE_BYTES:].view(np.int32)
            bad = np.flatnonzero((statuses != 0) | (sizes != self.cell_bytes))
            if len(bad):
                i = int(bad[0])
                why = (f"nvCOMP: {status_name(int(statuses[i]))}" if statuses[i] != 0 else
                       f"nvCOMP decodes it to {int(sizes[i])} bytes (expected {self.cell_bytes})")
                raise chunk_error(self.layout, self.job.name, int(self.job.chunks[first + i]), self.names, why)


class NvcompBatch:
    """A field's chunks of one window decoded by nvCOMP straight into their cells, in calls of at most
    ``call_bytes`` decoded bytes (nvCOMP's scratch memory for a call is about three times that, kept and
    reused in stream order; ``temp_bytes`` says how much is held)."""

    def __init__(self, lib: ZstdLib | None, ops: DecodeOps, call_bytes: int | None = None):
        if lib is None:
            raise ImportError("libnvcomp is not installed (nvidia-libnvcomp-cu13)")
        self.lib, self.ops, self.call_bytes = lib, ops, call_bytes or CALL_BYTES
        self._temp: Any = None
        self.temp_bytes = 0  # the scratch memory held

    def close(self) -> None:
        """Let go of the scratch memory (the decoder's stream is drained first)."""
        self._temp, self.temp_bytes = None, 0

    def _scratch(self, nbytes: int) -> int:
        """The address of scratch memory of at least ``nbytes``, reused call after call in the stream's order
        and grown when a call needs more."""
        if nbytes > self.temp_bytes:
            self._temp = None  # back to the pool, reused in the stream's order
            self._temp, self.temp_bytes = self.ops.empty(nbytes), nbytes
        return self.ops.address(self._temp)

    def decode(self, buffer: Any, job: Any, layout: Any) -> DecodeCheck | None:
        """Queue the decode of chunks ``job.chunks`` (compressed at ``job.src`` of ``buffer``, ``job.nbytes``
        long, a crc32c after each when the array's codecs end with one) into ``buffer`` at ``job.dest``, after
        checking each chunk's crc32c and zstd magic number; the returned check confirms the decode."""
        meta = layout.meta.array(job.name)
        names = [n for n, _ in meta.codecs]
        bb, ops = meta.block_bytes, self.ops
        src = np.asarray(job.src, dtype=np.int64)
        ends = src + np.asarray(job.nbytes, dtype=np.int64) - (CRC_BYTES if names[-1] == "crc32c" else 0)
        if len(src) == 0:
            return None
        if names[-1] == "crc32c":
            short = np.flatnonzero(ends < src)
            if len(short):
                i = int(short[0])
                raise chunk_error(layout, job.name, int(job.chunks[i]), names,
                                  f"{int(job.nbytes[i])} bytes, too short for a crc32c")
            bad = np.flatnonzero(ops.crc_mismatch(buffer, src, ends))
            if len(bad):
                raise chunk_error(layout, job.name, int(job.chunks[bad[0]]), names, "crc32c mismatch", True)
        heads = ops.heads(buffer, src, ends)
        bad = np.flatnonzero(heads != ZSTD_MAGIC)
        if len(bad):
            i = int(bad[0])
            raise chunk_error(layout, job.name, int(job.chunks[i]), names,
                              f"not a zstd frame (it starts with {int(heads[i]):#010x}, not the magic number "
                              f"{ZSTD_MAGIC:#010x}{'; shorter than one' if ends[i] - src[i] < 4 else ''})")
        base = ops.address(buffer)
        table = np.stack([base + src, ends - src, np.full(len(src), bb), base + np.asarray(job.dest, np.int64),
                          np.zeros(len(src), np.int64)]).astype(np.uint64)
        check = DecodeCheck(layout, job, names, bb)
        step = max(1, self.call_bytes // bb)
        for lo in range(0, len(src), step):
            check.calls.append((lo, self._call(np.ascontiguousarray(table[:, lo:lo + step]), bb, check, layout)))
        return check

    def _call(self, table: np.ndarray, bb: int, check: DecodeCheck, layout: Any) -> Readback:
        """One nvCOMP call over ``table``'s chunks (rows: compressed addresses and sizes, cell sizes and
        addresses, decoded sizes), its statuses after the table in the same device array."""
        ops, m = self.ops, table.shape[1]
        dev, staged = ops.upload(table.reshape(-1).view(np.uint8), STATUS_BYTES * m)
        at = ops.address(dev)
        row = SIZE_BYTES * m
        need = self.lib.temp_bytes(m, bb, m * bb)
        code = self.lib.decompress(at, at + row, at + 2 * row, at + 4 * row, m, self._scratch(need), need,
                                   at + 3 * row, at + 5 * row, ops.stream_ptr)
        check.keep += [dev, staged]
        if code != 0:
            chunks = [int(c) for c in check.job.chunks[:8]]
            raise chunk_error(layout, check.job.name, chunks[0], check.names,
                              f"nvCOMP refused the batch of chunks {chunks}{'...' if len(check.job.chunks) > 8 else ''}"
                              f" ({status_name(code)})")
        readback = ops.download(dev, 4 * row, 5 * row + STATUS_BYTES * m)
        check.keep.append(readback)
        return readback


def heads(gather: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Each segment's first four bytes as a little-endian uint32, zero past its end; ``gather(index)``
    returns the buffer's bytes at ``index`` (a host array)."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    idx = lo[:, None] + np.arange(4)
    inside = idx < hi[:, None]
    got = np.asarray(gather(np.where(inside, idx, 0).reshape(-1)), np.uint8).reshape(-1, 4)  # 0: any valid index
    return np.ascontiguousarray(np.where(inside, got, 0).astype(np.uint8)).view("<u4").reshape(-1)


def trailing_index(hi: np.ndarray) -> np.ndarray:
    """Offsets of the 4 bytes after each segment ending at ``hi``: where its crc32c is stored."""
    return (np.asarray(hi, np.int64)[:, None] + np.arange(CRC_BYTES)).reshape(-1)


def crc_mismatch(got: np.ndarray, trailing: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each segment's CRC as the device kernel computes it (``got``: :mod:`gdsload.codecs.checksum_cuda`)
    differs from the standard crc32c stored after it (``trailing``: those 4 bytes per segment, little endian)."""
    from .checksum import device_expected

    stored = np.ascontiguousarray(trailing, dtype=np.uint8).view("<u4").astype(np.uint32)
    return got != device_expected(stored, lo, hi)


class DecodeDevice:
    """The decode step's CUDA side: a non-blocking stream of its own (and one for the checks), pinned host
    buffers for host-decoded fields, copies of their decoded cells to the device, and the buffer operations
    :class:`NvcompBatch` needs. Device memory it allocates comes from CuPy's pool on its stream; when it
    closes, the pool's free blocks of its streams are released (no later stream could reuse them)."""

    def __init__(self, device_id: int):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.checks = cupy.cuda.Stream(non_blocking=True)  # the chunks' checks: they wait for reads only
        self.stream_ptr = self.stream.ptr
        self._crc: Any = None
        self._held: list[tuple[Any, Any]] = []  # (event, what queued work uses) until the event has passed
        self._lock = threading.Lock()

    def pinned(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer (freed with its last reference; not from CuPy's caching pool)."""
        with self.device:
            mem = self.cupy.cuda.PinnedMemory(nbytes)
        return np.frombuffer(self.cupy.cuda.PinnedMemoryPointer(mem, 0), dtype=np.uint8, count=nbytes)

    @contextlib.contextmanager
    def ordered(self, filled: Any) -> Iterator[None]:
        """The device and the decoder's stream made current; the stream, and the checks' stream, wait on
        ``filled`` first."""
        with self.device, self.stream:
            if filled is not None:
                self.stream.wait_event(filled)
                self.checks.wait_event(filled)
            yield

    def to_device(self, buffer: Any, dest: int, host: np.ndarray, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` of the pinned ``host`` buffer at ``src`` into the device ``buffer`` at ``dest``."""
        self.cupy.cuda.runtime.memcpyAsync(int(buffer.data.ptr) + dest, int(host.ctypes.data) + src, nbytes, H2D,
                                           self.stream_ptr)

    def done(self, keep: list[Any]) -> Any:
        """The event after the work queued so far; ``keep`` (what that work reads or writes) is held until it
        has passed."""
        event = record_event(self.stream)
        with self._lock:
            self._held = [(e, k) for e, k in self._held if not e.done] + [(event, keep)]
        return event

    # -- what NvcompBatch needs ----------------------------------------------------------------------------
    def address(self, arr: Any) -> int:
        return int(arr.data.ptr)

    def empty(self, nbytes: int) -> Any:
        """Device memory from CuPy's pool, allocated on the decoder's stream: once let go, only later work on
        that stream reuses it."""
        with self.device, self.stream:
            return self.cupy.empty(nbytes, self.cupy.uint8)

    def upload(self, data: np.ndarray, extra: int) -> tuple[Any, Any]:
        """A device array of ``data``'s bytes followed by ``extra`` more, filled on the decoder's stream through
        a pinned buffer from CuPy's pool; returns it and that buffer (held until the copy has run)."""
        n = len(data)
        staged = self.cupy.cuda.alloc_pinned_memory(n)
        np.frombuffer(staged, np.uint8, n)[:] = data
        dev = self.empty(n + extra)
        self.cupy.cuda.runtime.memcpyAsync(int(dev.data.ptr), staged.ptr, n, H2D, self.stream_ptr)
        return dev, staged

    def download(self, arr: Any, lo: int, hi: int) -> Readback:
        """Bytes ``[lo, hi)`` of the device array ``arr``, copied to a pinned buffer on the decoder's stream."""
        staged = self.cupy.cuda.alloc_pinned_memory(hi - lo)
        self.cupy.cuda.runtime.memcpyAsync(staged.ptr, int(arr.data.ptr) + lo, hi - lo, D2H, self.stream_ptr)
        return Readback(np.frombuffer(staged, np.uint8, hi - lo), record_event(self.stream))

    def heads(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The first four bytes of each segment ``[lo, hi)`` as little-endian uint32 (bytes past ``hi`` read as
        zero); only these come back to the host. On the checks' stream, which waits for the window's reads
        alone: a decode still running on the decoder's stream does not hold the next window's checks up."""
        with self.checks:
            return heads(lambda idx: buffer[self.cupy.asarray(idx)].get(stream=self.checks), lo, hi)

    def crc_mismatch(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Whether each segment ``[lo, hi)`` of the device buffer differs from the crc32c stored in the 4
        bytes after it (computed on the device; only the CRCs come back)."""
        from .checksum_cuda import DeviceCrc

        if self._crc is None:
            self._crc = DeviceCrc(self.device.id)
        with self.checks:
            got = self._crc.launch(buffer, lo, hi, self.checks).get(stream=self.checks)
            trailing = buffer[self.cupy.asarray(trailing_index(hi))].get(stream=self.checks)
        return crc_mismatch(got, trailing, lo, hi)

    def quiesce(self) -> None:
        """Wait for every copy and decode queued so far (they write into window buffers), and the checks."""
        self.stream.synchronize()
        self.checks.synchronize()

    def close(self) -> None:
        self.quiesce()
        with self._lock:
            self._held.clear()  # the stream has passed every use
        pool = self.cupy.get_default_memory_pool()
        for stream in (self.stream, self.checks):
            pool.free_all_blocks(stream=stream)
