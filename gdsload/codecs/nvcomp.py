"""Decoding on the device: zstd chunks batched through nvCOMP, and the decode step's CUDA side.

nvCOMP (``nvidia-nvcomp-cu13`` >= 6, NVIDIA-proprietary, the optional ``gdsload[nvcomp]`` extra) is imported only
when a dataset with device-decoded fields opens. Its Python API as used here::

    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=D, cuda_stream=S)
    codec.decode(nvcomp.as_arrays([chunk, ...]), out=nvcomp.as_arrays([cell, ...]))  # chunk i into cell i

One call decodes every chunk of one field in one window (a call per chunk is far slower: few large chunks
leave the GPU underused), from views of the window buffer's compressed region straight into views of the
chunks' cells: nothing is allocated, copied or freed per window (nvCOMP's own outputs would be, and freeing
device memory synchronises the whole device). nvCOMP does not check the zstd magic number, so each chunk's
first four bytes are checked here first: a chunk that is not a zstd frame (a store whose metadata names the
wrong codec, a damaged file) is an error, never decoded into a wrong sample. A chunk nvCOMP refuses is named
by decoding the batch's chunks one by one after the batched call failed; one whose decoded size is not the
chunk's is named too.

Nothing in a window's decode waits for earlier work on the decoder's stream: each call passes a decompression
config built from the chunks' sizes (:meth:`NvcompBatch.config`; without one, nvCOMP reads the frame headers
back and waits for the stream), the magic-number and crc32c checks run on a stream of their own that waits
for the window's reads alone, and nvCOMP's scratch memory comes from CuPy's pools in stream order
(:mod:`gdsload.codecs.nvcomp_memory`; nvCOMP's own allocators wait for the whole device).

Teardown order matters: the codec is made on the decoder's stream and uses it when it is destroyed, so
:meth:`NvcompBatch.close` (called by the decoder's ``close()``, and when the batch is collected) destroys the
codec while the stream still exists; left to reference counting, the stream went first and the process
crashed in nvCOMP.

:class:`NvcompBatch` does the batching and the mapping of chunks to cells through an ``ops`` object
(:class:`DecodeDevice` here; tests pass host stand-ins and a fake codec, so this logic runs without a GPU).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ContextManager, Protocol

import numpy as np

from ..cuda.runtime import H2D, record_event
from .chunks import chunk_error
from ..format.arrays import CRC_BYTES

#: The first four bytes of every zstd frame, read as a little-endian uint32.
ZSTD_MAGIC = 0xFD2FB528
#: Decompression configs kept per codec, one per (chunk size, chunks in a call): a dataset's windows have few shapes.
CONFIGS = 16


class DecodeOps(Protocol):
    """The device side of the decode step: its stream, pinned host buffers, host-to-device copies ordered
    after a window's reads, and the buffer views nvCOMP decodes into. :class:`DecodeDevice` keeps it on a
    GPU; the tests keep it with numpy."""

    stream_ptr: int

    def pinned(self, nbytes: int) -> np.ndarray: ...
    def ordered(self, filled: Any) -> ContextManager[None]: ...
    def to_device(self, buffer: Any, dest: int, host: np.ndarray, src: int, nbytes: int) -> None: ...
    def done(self, outs: list[Any]) -> Any: ...
    def view(self, buffer: Any, lo: int, hi: int) -> Any: ...
    def nbytes(self, arr: Any) -> int: ...
    def heads(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray: ...
    def crc_mismatch(self, buffer: Any, lo: np.ndarray, hi: np.ndarray) -> np.ndarray: ...
    def quiesce(self) -> None: ...
    def close(self) -> None: ...


class NvcompBatch:
    """A field's chunks of one window, decoded by one nvCOMP call and copied into their cells."""

    def __init__(self, nvcomp: Any, ops: DecodeOps, device_id: int = 0):
        self.codec: Any = None
        self._configs: dict[tuple[int, int], Any] = {}  # (chunk bytes, chunks) -> DecompressConfig
        if nvcomp is None:
            raise ImportError("nvidia.nvcomp is not installed")
        self.nvcomp, self.ops = nvcomp, ops
        self.codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=device_id,
                                  cuda_stream=ops.stream_ptr)

    def config(self, block_bytes: int, n: int) -> Any:
        """The decompression config of ``n`` chunks of ``block_bytes`` each, built from their sizes alone (no
        header read back from the device, so the decode call does not wait for the stream) and kept for
        later windows of the same shape (the last :data:`CONFIGS` shapes)."""
        key = (block_bytes, n)
        got = self._configs.pop(key, None)
        if got is None:
            got = self.codec.decompression_config(self.codec.compression_config([block_bytes] * n))
        self._configs[key] = got
        while len(self._configs) > CONFIGS:
            self._configs.pop(next(iter(self._configs)))
        return got

    def close(self) -> None:
        """Destroy the codec now, while ``ops`` (and its stream) are still held (see the module's docstring)."""
        self.codec = None
        self._configs.clear()

    def __del__(self) -> None:
        self.close()

    def decode(self, buffer: Any, job: Any, layout: Any) -> Any:
        """Decode chunks ``job.chunks`` (compressed at ``job.src`` of ``buffer``, ``job.nbytes`` long, a crc32c
        after each when the array's codecs end with one) into ``buffer`` at ``job.dest``; returns what nvCOMP
        returned, to be kept until the decoder's stream has passed the call."""
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
        views = [ops.view(buffer, s, e) for s, e in zip(src.tolist(), ends.tolist())]
        cells = [ops.view(buffer, d, d + bb) for d in np.asarray(job.dest, dtype=np.int64).tolist()]
        config = self.config(bb, len(views))
        try:
            outs = self.codec.decode(self.nvcomp.as_arrays(views), out=self.nvcomp.as_arrays(cells),
                                     decompression_config=config)
        except Exception as e:
            raise self._culprit(views, job, layout, names, e) from None
        for i in range(len(views)):
            n = ops.nbytes(outs[i])
            if n != bb:
                raise chunk_error(layout, job.name, int(job.chunks[i]), names,
                                  f"nvCOMP decodes it to {n} bytes (expected {bb})")
        return outs

    def _culprit(self, views: list[Any], job: Any, layout: Any, names: list[str], error: Exception) -> Exception:
        """The batched call failed: decode chunk by chunk to name the first that does not decode."""
        for i, v in enumerate(views):
            try:
                self.codec.decode(self.nvcomp.as_arrays([v]), data_type="|u1")
            except Exception as e:
                return chunk_error(layout, job.name, int(job.chunks[i]), names, f"nvCOMP: {type(e).__name__}: {e}")
        chunks = [int(c) for c in job.chunks[:8]]
        return chunk_error(layout, job.name, chunks[0], names, f"nvCOMP failed on the batch of chunks {chunks}"
                                                               f"{'...' if len(job.chunks) > 8 else ''} "
                                                               f"({type(error).__name__}: {error})")


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
    """The decode step's CUDA side: a non-blocking stream of its own, pinned host buffers for host-decoded
    fields, copies of their decoded cells to the device, and the buffer operations :class:`NvcompBatch`
    needs."""

    def __init__(self, device_id: int):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.checks = cupy.cuda.Stream(non_blocking=True)  # the chunks' checks: they wait for reads only
        self.stream_ptr = self.stream.ptr
        self._crc: Any = None
        self._held: list[tuple[Any, Any]] = []  # (event, nvCOMP outputs) until the event has passed
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

    def done(self, outs: list[Any]) -> Any:
        """The event after the work queued so far; nvCOMP's outputs ``outs`` are kept until it has passed."""
        event = record_event(self.stream)
        with self._lock:
            self._held = [(e, o) for e, o in self._held if not e.done] + [(event, outs)]
        return event

    # -- what NvcompBatch needs ----------------------------------------------------------------------------
    def view(self, buffer: Any, lo: int, hi: int) -> Any:
        return buffer[lo:hi]

    def nbytes(self, arr: Any) -> int:
        cai = arr.__cuda_array_interface__
        return int(np.prod(cai["shape"], dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize

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
            self._held.clear()
