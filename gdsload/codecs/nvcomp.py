"""Decoding on the device: zstd chunks batched through nvCOMP, and the decode step's CUDA side.

nvCOMP is loaded only when a dataset with device-decoded fields opens, and called through its C API
(:mod:`gdsload.codecs.nvcomp_lib`): one call per field and window, up to :data:`CALL_BYTES` decoded, each chunk
from the window's compressed region straight into its cell, only queued on the decoder's stream. Chunks are
screened on the device first (:mod:`gdsload.codecs.screen`); each chunk's verdict, status and decoded size come
back with the window's checks (:class:`DecodeCheck`), a failure being a ReadError naming it, and a decode still
running after :func:`decode_wait_s` a :class:`gdsload.errors.DecodeError`. :class:`NvcompBatch` maps chunks to
cells through an ``ops`` object (:class:`DecodeDevice`; tests pass host stand-ins). docs/format.md, "Compressed
chunks".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ContextManager, Protocol

import numpy as np

from ..cuda.runtime import D2H, H2D, decode_wait_s, record_event, wait_event, wait_stream
from ..errors import DecodeError
from ..format.arrays import CRC_BYTES
from . import screen
from .chunks import chunk_error
from .nvcomp_lib import ZstdLib, status_name
from .screen import ZSTD_MAGIC
#: Decoded bytes one nvCOMP call takes at most: more chunks per call keep more of the GPU busy, and nvCOMP 6's zstd
#: needs about three times a call's decoded bytes of scratch memory.
CALL_BYTES = 512 << 20
SIZE_BYTES = 8  # a size_t: the table's rows


class DecodeOps(Protocol):
    """The device side of the decode step: its stream, pinned host buffers, host-to-device copies ordered
    after a window's reads, device memory and copies to and from it on the decoder's stream, and the screening
    of frames before a decode. :class:`DecodeDevice` keeps it on a GPU; the tests keep it with numpy."""

    stream_ptr: int

    def pinned(self, nbytes: int) -> np.ndarray: ...
    def ordered(self, filled: Any) -> ContextManager[None]: ...
    def to_device(self, buffer: Any, dest: int, host: np.ndarray, src: int, nbytes: int) -> None: ...
    def done(self, keep: list[Any]) -> Any: ...
    def address(self, arr: Any) -> int: ...
    def empty(self, nbytes: int) -> Any: ...
    def upload(self, data: np.ndarray, extra: int) -> tuple[Any, Any]: ...
    def download(self, arr: Any, lo: int, hi: int) -> Readback: ...
    def screen(self, buffer: Any, tab: Any, lo: np.ndarray, hi: np.ndarray, crc: bool) -> Any: ...
    def quiesce(self, timeout_s: float | None = None) -> None: ...
    def close(self) -> None: ...


class Readback:
    """Bytes copied from the device into ``host`` on the decoder's stream: :meth:`get` waits for the copy
    (``event``; None: done) and returns them."""

    def __init__(self, host: np.ndarray, event: Any = None):
        self.host, self.event = host, event

    def get(self, timeout_s: float | None = None) -> np.ndarray:
        """The bytes, once copied; a ``TimeoutError`` when the copy is not done after ``timeout_s`` (None: no
        bound; :func:`gdsload.cuda.runtime.wait_event`)."""
        if self.event is not None:
            wait_event(self.event, timeout_s)
        return self.host


class DecodeCheck:
    """A field's decode in one window, queued: :meth:`confirm` waits for it and raises the ReadError of the
    first chunk screened out (its crc32c first, then its magic number, as the CPU path checks them), else of
    the first nvCOMP failed on or decoded to another size than its cell's; later calls do nothing. ``keep``:
    what must live until the decoder's stream has passed the decode (its arguments, its readbacks)."""

    def __init__(self, layout: Any, job: Any, names: list[str], cell_bytes: int):
        self.layout, self.job, self.names, self.cell_bytes = layout, job, names, cell_bytes
        self.calls: list[Readback] = []  # each call's readback, in the job's order of chunks
        self.keep: list[Any] = []
        self.confirmed = False

    def confirm(self) -> None:
        if self.confirmed:
            return
        self.confirmed = True
        if not self.calls:
            return
        parts, bound, at = [], decode_wait_s(), 0
        for readback in self.calls:
            try:
                got = readback.get(bound)
            except TimeoutError:
                self._hung(at, bound)
            at += (len(readback.host) // (SIZE_BYTES + screen.TAIL_ITEM_BYTES))
            m = len(got) // (SIZE_BYTES + screen.TAIL_ITEM_BYTES)
            tail = got[m * SIZE_BYTES:].view(np.int32)
            parts.append((got[:m * SIZE_BYTES].view(np.uint64), tail[:m], tail[m:2 * m], tail[2 * m:].view(np.uint32)))
        sizes, statuses, reasons, heads = (np.concatenate(col) for col in zip(*parts))
        for reason in (screen.CRC_MISMATCH, screen.NOT_ZSTD, screen.FRAME_BROKEN):
            bad = np.flatnonzero(reasons == reason)
            if len(bad):
                self._fail(int(bad[0]), reason, int(heads[bad[0]]))
        bad = np.flatnonzero((statuses != 0) | (sizes != self.cell_bytes))
        if len(bad):
            i = int(bad[0])
            self._fail(i, 0, 0, f"nvCOMP: {status_name(int(statuses[i]))}" if statuses[i] != 0 else
                       f"nvCOMP decodes it to {int(sizes[i])} bytes (expected {self.cell_bytes})")

    def _hung(self, first: int, bound: float) -> None:
        """Raise the DecodeError of a call, from the job's ``first``-th chunk on, still running after ``bound``."""
        chunk = int(self.job.chunks[first])
        raise chunk_error(self.layout, self.job.name, chunk, self.names,
                          f"the decode of its call (from this chunk on) is still running after {bound:g} s "
                          f"(GDSLOAD_DECODE_WAIT_S): a damaged frame can hang nvCOMP; the GPU may stay busy with "
                          f"it, so the process may have to exit", error=DecodeError)

    def _fail(self, i: int, reason: int, head: int, why: str = "") -> None:
        """Raise the ReadError of the job's ``i``-th chunk."""
        chunk = int(self.job.chunks[i])
        if reason == screen.CRC_MISMATCH:
            raise chunk_error(self.layout, self.job.name, chunk, self.names, "crc32c mismatch", True)
        if reason == screen.NOT_ZSTD:
            short = int(self.job.nbytes[i]) - (CRC_BYTES if self.names[-1] == "crc32c" else 0) < 4
            why = (f"not a zstd frame (it starts with {head:#010x}, not the magic number {ZSTD_MAGIC:#010x}"
                   f"{'; shorter than one' if short else ''})")
        if reason == screen.FRAME_BROKEN:
            n = int(self.job.nbytes[i]) - (CRC_BYTES if self.names[-1] == "crc32c" else 0)
            why = (f"a damaged zstd frame: its header and block headers do not add up to its {n} bytes "
                   f"(the walk stopped at byte {head}); not handed to nvCOMP")
        raise chunk_error(self.layout, self.job.name, chunk, self.names, why)


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
        long, a crc32c after each when the array's codecs end with one) into ``buffer`` at ``job.dest``, each
        chunk screened first (its crc32c, its zstd magic number); the returned check confirms both. Nothing
        here waits for the device."""
        meta = layout.meta.array(job.name)
        names = [n for n, _ in meta.codecs]
        crc, bb = names[-1] == "crc32c", meta.block_bytes
        src = np.asarray(job.src, dtype=np.int64)
        ends = src + np.asarray(job.nbytes, dtype=np.int64) - (CRC_BYTES if crc else 0)
        if len(src) == 0:
            return None
        short = np.flatnonzero(ends < src)
        if len(short):
            i = int(short[0])
            raise chunk_error(layout, job.name, int(job.chunks[i]), names,
                              f"{int(job.nbytes[i])} bytes, too short for a crc32c")
        rows = screen.table(self.ops.address(buffer), src, ends, bb, np.asarray(job.dest, np.int64))
        check = DecodeCheck(layout, job, names, bb)
        step = max(1, self.call_bytes // bb)
        for lo in range(0, len(src), step):
            part = slice(lo, lo + step)
            check.calls.append(self._call(buffer, np.ascontiguousarray(rows[:, part]), src[part], ends[part], crc,
                                          check, layout))
        return check

    def _call(self, buffer: Any, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, crc: bool, check: DecodeCheck,
              layout: Any) -> Readback:
        """One nvCOMP call over ``rows``' chunks (at ``[lo, hi)`` of ``buffer``), screened first; the verdicts,
        statuses and decoded sizes come back in one readback."""
        ops, m = self.ops, rows.shape[1]
        bb = int(rows[screen.CAP][0])
        dev, staged = ops.upload(rows.reshape(-1).view(np.uint8), screen.TAIL_ITEM_BYTES * m)
        check.keep += [dev, staged, ops.screen(buffer, dev, lo, hi, crc)]
        need = self.lib.temp_bytes(m, bb, m * bb)
        code = decompress_table(self.lib, ops.address(dev), m, self._scratch(need), need, ops.stream_ptr)
        if code != 0:
            chunks = [int(c) for c in check.job.chunks[:8]]
            raise chunk_error(layout, check.job.name, chunks[0], check.names,
                              f"nvCOMP refused the batch of chunks {chunks}{'...' if len(check.job.chunks) > 8 else ''}"
                              f" ({status_name(code)})")
        row = SIZE_BYTES * m
        readback = ops.download(dev, screen.OUT * row, screen.ROWS * row + screen.TAIL_ITEM_BYTES * m)
        check.keep.append(readback)
        return readback


def decompress_table(lib: ZstdLib, table: int, m: int, temp: int, temp_bytes: int, stream: int) -> int:
    """Queue nvCOMP's decode of the ``m`` chunks of a call's table at device address ``table`` (rows as
    :func:`gdsload.codecs.screen.table` lays them out, nvCOMP's statuses after them) on ``stream``, with
    ``temp_bytes`` of scratch memory at ``temp``; the launch's status."""
    row = SIZE_BYTES * m
    return lib.decompress(table + screen.SRC * row, table + screen.LEN * row, table + screen.CAP * row,
                          table + screen.OUT * row, m, temp, temp_bytes, table + screen.CELL * row,
                          table + screen.ROWS * row, stream)


class DecodeDevice:
    """The decode step's CUDA side: a non-blocking stream of its own, pinned host buffers for host-decoded
    fields, copies of their decoded cells to the device, and the buffer operations :class:`NvcompBatch` needs.
    Device memory it allocates comes from CuPy's pool on its stream; when it closes, the pool's free blocks of
    its stream are released (no later stream could reuse them)."""

    def __init__(self, device_id: int):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream_ptr = self.stream.ptr
        self._screen: Any = None
        self._held: list[tuple[Any, Any]] = []  # (event, what queued work uses) until the event has passed
        self._lock = threading.Lock()

    def pinned(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer (freed with its last reference; not from CuPy's caching pool)."""
        with self.device:
            mem = self.cupy.cuda.PinnedMemory(nbytes)
        return np.frombuffer(self.cupy.cuda.PinnedMemoryPointer(mem, 0), dtype=np.uint8, count=nbytes)

    @contextlib.contextmanager
    def ordered(self, filled: Any) -> Iterator[None]:
        """The device and the decoder's stream made current; the stream waits on ``filled`` first."""
        with self.device, self.stream:
            if filled is not None:
                self.stream.wait_event(filled)
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

    def screen(self, buffer: Any, tab: Any, lo: np.ndarray, hi: np.ndarray, crc: bool) -> Any:
        """Queue the screening of the frames at ``[lo, hi)`` of ``buffer`` into the call's table ``tab``
        (:class:`gdsload.codecs.screen.DeviceScreen`, loaded on first use); returns what it must keep."""
        if self._screen is None:
            self._screen = screen.DeviceScreen(self.device.id)
        return self._screen.launch(buffer, tab, lo, hi, crc, self.stream)

    def quiesce(self, timeout_s: float | None = None) -> None:
        """Wait for every copy and decode queued so far (they write into window buffers); a ``TimeoutError``
        when they still run after ``timeout_s`` (None: no bound)."""
        with self.device:
            wait_stream(self.stream, timeout_s)

    def close(self) -> None:
        """Drain the stream (within :func:`decode_wait_s`: a ``TimeoutError`` leaves everything held), then let
        the pool's blocks of its stream go."""
        self.quiesce(decode_wait_s())
        with self._lock:
            self._held.clear()  # the stream has passed every use
        pool = self.cupy.get_default_memory_pool()
        pool.free_all_blocks(stream=self.stream)
