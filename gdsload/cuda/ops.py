"""The assembler's device work: its stream, gathers and allocations, and the events ordering it with the rest.

:class:`CudaOps` orders the assembler's stream against the readers (window filled / released) and the
consumer's stream (batch ready, memory reuse); :class:`HostOps` is the same interface with numpy, all no-ops
where CUDA orders work, so the same pipeline code runs without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol

import numpy as np

from ..errors import DecodeError, warn
from .runtime import D2D, decode_wait_s, new_event, record_event, wait_event, wait_stream
from .gather import Gather, row_pointers, word_bytes

#: take_rows' row tables in flight at most (a launch of each may still be queued).
TABLES = 32
_WORD_DTYPES = {16: np.complex128, 8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def _as_words(a: Any) -> Any:
    """A C-contiguous (rows, ...) array viewed as (rows, words) of the widest word dividing a row and its
    address (:func:`gdsload.cuda.gather.word_bytes`)."""
    rows = a.shape[0]
    if rows == 0:
        return a
    flat = a.reshape(rows, -1).view(np.uint8)
    return flat.view(_WORD_DTYPES[word_bytes(a.nbytes // rows, a.data.ptr)])


class Ops(Protocol):
    """What the pipeline and the assembler do on the memory batches live in: order work by events, upload
    index arrays, gather rows, allocate batches and export them. :class:`HostOps` (numpy, synchronous) and
    :class:`CudaOps` (a CUDA stream of the assembler's own) keep it."""

    xp: Any  # numpy or cupy: the array module of that memory
    decodes: bool  # a reader decodes on the device: the waits behind gathers are bounded (CudaOps.synchronize)

    def begin(self) -> None: ...
    def hand_over(self, ready: Any) -> None: ...
    def scope(self) -> Any: ...
    def fence(self) -> None: ...
    def record(self) -> Any: ...
    def wait(self, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def quiesce(self) -> None: ...
    def upload(self, arrays: dict[Any, np.ndarray]) -> tuple[dict[Any, Any], Any]: ...
    def retire(self, arrays: dict[Any, Any]) -> None: ...
    def copy_rows(self, src: Any, first: int, out: Any) -> None: ...
    def take(self, src: Any, idx: Any, out: Any) -> None: ...
    def take_rows(self, parts: list[tuple[Any, np.ndarray]], out: Any) -> None: ...
    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any: ...
    def export(self, batch: dict[str, Any]) -> dict[str, Any]: ...


class HostOps:
    """numpy outputs: work is done when the call returns."""

    xp = np
    decodes = False

    # Called from the consumer's thread.
    def begin(self) -> None:
        """Called as a pass starts: pick up the consumer's current stream."""

    def hand_over(self, ready: Any) -> None:
        """Called for each batch, in series with the consumer's step: pick up its current stream (as
        :meth:`begin`) and make that stream wait until the assembled batch is written."""

    # Called from the assembler's thread.
    def scope(self) -> Any:
        """Context for one batch's work (device and stream made current once, not per call)."""
        return contextlib.nullcontext()

    def fence(self) -> None:
        """Order what follows after the work the consumer has queued so far (memory it freed may be reused)."""

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass

    def quiesce(self) -> None:
        """Wait for every gather and upload queued so far (a pipeline stops: what it frees is then unused)."""

    def upload(self, arrays: dict[Any, np.ndarray]) -> tuple[dict[Any, Any], Any]:
        """Index arrays where the gathers read them, and the event after which they are there (None)."""
        return dict(arrays), None

    def retire(self, arrays: dict[Any, Any]) -> None:
        """Uploaded arrays no gather will be queued from any more (kept until the queued ones are done)."""

    def copy_rows(self, src: Any, first: int, out: Any) -> None:
        """``out[:] = src[first:first + len(out)]``."""
        np.copyto(out, src[first:first + len(out)])

    def take(self, src: Any, idx: Any, out: Any) -> None:
        """``out[:] = src[idx]`` along axis 0."""
        np.take(src, idx, axis=0, out=out)

    def take_rows(self, parts: list[tuple[Any, np.ndarray]], out: Any) -> None:
        """``out`` = the rows ``rows`` (host ints) of each ``(src, rows)`` of ``parts``, part after part."""
        at = 0
        for src, rows in parts:
            np.take(src, rows, axis=0, out=out[at:at + len(rows)])
            at += len(rows)
        if at != len(out):
            raise ValueError(f"internal error: {at} rows taken into {len(out)}")

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return np.empty(shape, dtype=dtype)

    def export(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch's arrays as the consumer gets them (after hand_over()); the dict itself when they need
        no conversion (the assembler made it for this batch alone)."""
        return batch


class TorchHostOps(HostOps):
    """numpy work, handed out as CPU torch tensors sharing the same memory."""

    def export(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        return {name: torch.from_numpy(a) for name, a in batch.items()}


def jax_narrowed(batch: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The arrays of ``batch`` JAX would take as another type: name -> (dtype, JAX's). With its 64-bit types
    off (``jax_enable_x64``, off by default) JAX narrows int64, uint64, float64 and complex128, copying."""
    import jax

    out = {}
    for name, a in batch.items():
        got = np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))
        if got != a.dtype:
            out[name] = (np.dtype(a.dtype).name, got.name)
    return out


def warn_jax_narrowed(batch: dict[str, Any]) -> None:
    """Warn, naming them, of the fields a batch handed to JAX loses bits of (:func:`jax_narrowed`)."""
    narrowed = jax_narrowed(batch)
    if narrowed:
        fields = ", ".join(f"{n!r} ({a} -> {b})" for n, (a, b) in narrowed.items())
        warn(f"output='jax': field(s) {fields} arrive narrowed and copied, not zero-copy: JAX's 64-bit types are "
             "off (jax_enable_x64, off by default), so JAX converts them; enable them before reading "
             "(jax.config.update('jax_enable_x64', True), or JAX_ENABLE_X64=1) to keep them as stored", UserWarning)


class JaxHostOps(HostOps):
    """numpy work, handed out as jax arrays on jax's CPU device, zero-copy through DLPack: each output array
    is allocated 64-byte aligned, which jax's CPU client needs to take it without copying. jax's own rules
    apply: without ``jax_enable_x64``, 64-bit fields arrive as 32-bit (copied), which the first batch of a
    pass warns of (:func:`warn_jax_narrowed`)."""

    #: Alignment of output arrays, in bytes.
    ALIGN = 64

    def __init__(self) -> None:
        import jax

        self.from_dlpack = jax.dlpack.from_dlpack
        self.checked = False  # whether a batch was checked for fields JAX narrows

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(nbytes + self.ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % self.ALIGN
        return raw[start:start + nbytes].view(dtype).reshape(shape)

    def export(self, batch: dict[str, Any]) -> dict[str, Any]:
        if not self.checked:
            self.checked = True
            warn_jax_narrowed(batch)
        return {name: self.from_dlpack(a) for name, a in batch.items()}


def host_ops(output: str) -> HostOps:
    """The host ops of an ``output`` kind of the cpu backend: numpy, torch or jax."""
    return {"torch": TorchHostOps, "jax": JaxHostOps}.get(output, HostOps)()


class CudaOps:
    """Gathers on the assembler's own non-blocking stream, handed to the consumer's current stream (CuPy's,
    or torch's for torch outputs) through a "ready" event, so the user needs no synchronization of their own.

    The assembler's stream waits on a window's "filled" event before gathering from it and records the
    window's "released" event after its last gather; before writing a batch it waits on an event recorded
    on the consumer's stream, because the output memory may be memory the consumer freed (CuPy's pool hands
    it back at once) while the consumer's queued work still reads it.
    """

    def __init__(self, device_id: int, output: str):
        import cupy

        self.cupy = cupy
        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        self.output = output
        self.torch = self.from_dlpack = None
        if output == "torch":
            import torch

            self.torch = torch
            self.from_dlpack = torch.from_dlpack
        elif output == "jax":
            import jax

            self.from_dlpack = jax.dlpack.from_dlpack  # onto the jax device of the array's own GPU
        self.checked = output != "jax"  # whether a batch was checked for fields JAX narrows (warn_jax_narrowed)
        self.stream: Any = None  # the consumer's current stream, as of its latest batch
        self.decodes = False  # set where a reader decodes on the device: waits behind gathers are then bounded
        with self.device:
            self.work = cupy.cuda.Stream(non_blocking=True)  # the assembler's
            # Never given work: CuPy's pool keeps freed memory per stream it was allocated on, so arrays
            # allocated "on" this one return, once the consumer drops them, to a pool only empty() draws
            # from, and the assembler's own scratch never lands in memory the consumer may still read.
            self.outputs = cupy.cuda.Stream(non_blocking=True)
            self.uploads = cupy.cuda.Stream(non_blocking=True)  # index arrays, from whichever thread makes a pass
            self._fence = new_event()
        self._retired: list[tuple[Any, dict[Any, Any]]] = []
        self._retired_lock = threading.Lock()
        self.gather = Gather(cupy, self.device)
        self._tables: list[list[Any]] = []  # take_rows' pinned row tables: [memory, uint64 view, event after use]
        self._table_at = 0

    def _current_stream(self) -> Any:
        if self.torch is not None:
            current = self.torch.cuda.current_stream(self.device.id)
            if self.stream is not None and self.stream.ptr == current.cuda_stream:
                return self.stream
            from_external = getattr(self.cupy.cuda.Stream, "from_external", None)
            if from_external is not None:
                try:
                    return from_external(current)
                except Exception:  # a torch without the CUDA stream protocol
                    pass
            return self.cupy.cuda.ExternalStream(current.cuda_stream, self.device.id)
        return self.cupy.cuda.get_current_stream(self.device.id)

    def begin(self) -> None:
        stream = self._current_stream()
        if self.stream is not None and stream.ptr != self.stream.ptr:
            self._switched(stream)
        self.stream = stream

    def hand_over(self, ready: Any) -> None:
        # begin() inlined: this runs between two of the consumer's steps, where every call is waited for.
        stream = self._current_stream()  # no device switch unless the streams differ
        if stream.ptr != self.stream.ptr:
            self._switched(stream)
            self.stream = stream
        if ready is not None:
            stream.wait_event(ready)

    def _switched(self, stream: Any) -> None:
        """The consumer switched streams: work already queued on the old one must come first."""
        with self.device:
            stream.wait_event(record_event(self.stream))

    def scope(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.device)
        stack.enter_context(self.work)
        return stack

    def fence(self) -> None:
        """Arrays from empty() may be memory the consumer dropped while its queued work still reads it:
        the assembler's stream waits for everything the consumer has queued so far. One event, recorded
        again each time: a stream wait takes the record current when it is queued, and only the
        assembler's thread fences."""
        self.work.wait_event(self.stream.record(self._fence))

    def record(self) -> Any:
        with self.device:
            return record_event(self.work)

    def wait(self, event: Any) -> None:
        if event is not None:
            self.work.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """Wait for ``event`` (a window buffer's last gather). Where the device decodes (``decodes``), within
        :func:`gdsload.cuda.runtime.decode_wait_s`: gathers wait on their window's decode, and one that does not
        end is a :class:`DecodeError`, not a submitter blocked for good (a polling wait, only when the event has
        not passed yet)."""
        if event is not None and not self.decodes:
            event.synchronize()  # nothing queued waits on a decode: a blocking wait, no poll on this path
        elif event is not None and not event.done:
            bound = decode_wait_s()
            try:
                wait_event(event, bound)
            except TimeoutError:
                raise _stuck("a window buffer's last gather", bound) from None

    def quiesce(self) -> None:
        """The pipeline stops and drops this object, its streams and the arrays it holds (uploads, retired
        ones, batches nobody took): CuPy's pool hands freed memory out again at once, keyed by a stream
        handle the driver may give a new stream, so work still queued could read or write memory already
        someone else's. No kernel or copy of this pipeline runs after this returns. Bounded by
        :func:`gdsload.cuda.runtime.decode_wait_s`: gathers wait on their window's decode, and one that does not
        end is a :class:`DecodeError` (the arrays are then never handed on)."""
        bound = decode_wait_s()
        with self.device:
            for s in (self.work, self.uploads):
                try:
                    wait_stream(s, bound)
                except TimeoutError:
                    raise _stuck("the GPU work of a pipeline", bound) from None

    def upload(self, arrays: dict[Any, np.ndarray]) -> tuple[dict[Any, Any], Any]:
        """Copied to the device on a stream of their own (any thread): the assembler's stream waits on the
        event returned, and nothing else does."""
        with self._retired_lock:  # memory of retired arrays the assembler's stream is done with may go
            self._retired = [(e, a) for e, a in self._retired if not e.done]
        with self.device, self.uploads:
            dev = {k: self.cupy.asarray(a) for k, a in arrays.items()}
            return dev, record_event(self.uploads)

    def retire(self, arrays: dict[Any, Any]) -> None:
        """Freed memory goes back to the pool of the stream it was allocated on, here the upload stream, at
        once: kept until the assembler's stream has run every gather queued so far, or a later upload could
        overwrite indices a queued gather has yet to read."""
        with self.device:
            event = record_event(self.work)
        with self._retired_lock:
            self._retired.append((event, arrays))

    # Called inside scope(): the device and the assembler's stream are current.
    def copy_rows(self, src: Any, first: int, out: Any) -> None:
        """Consecutive rows: one device-to-device memcpy."""
        if out.nbytes:
            row = src.nbytes // src.shape[0]
            self.cupy.cuda.runtime.memcpyAsync(out.data.ptr, src.data.ptr + first * row, out.nbytes, D2D,
                                               self.work.ptr)

    def take(self, src: Any, idx: Any, out: Any) -> None:
        """Rows moved as whole words (up to 16 bytes), by a kernel of bounded grid that runs beside the
        consumer's work instead of in front of it (gdsload.cuda.gather); arrays it does not take (not
        contiguous) go through CuPy's ``take``, also by words."""
        if not self.gather(src, idx, out):
            self.cupy.take(_as_words(src), idx, axis=0, out=_as_words(out))

    def take_rows(self, parts: list[tuple[Any, np.ndarray]], out: Any) -> None:
        """One launch for rows of several arrays (:meth:`Gather.by_pointers`): their addresses in a pinned host
        table of a small ring, each reused once the launch that read it has run. Every ``src`` has ``out``'s
        row size."""
        rows = int(out.shape[0])
        if rows == 0:
            return
        row = out.nbytes // rows
        for src, _ in parts:
            if src.shape[0] and src.nbytes // src.shape[0] != row:
                raise ValueError(f"internal error: rows of {src.nbytes // src.shape[0]} bytes taken into rows "
                                 f"of {row}")
        slot = self._table(rows)
        table = slot[1]
        if row_pointers([(src.data.ptr, r) for src, r in parts], row, table) != rows:
            raise ValueError(f"internal error: rows taken do not fill {rows} rows")
        self.gather.by_pointers(slot[0].ptr, int(np.bitwise_or.reduce(table[:rows])), out)
        slot[2] = record_event(self.work)

    def _table(self, rows: int) -> list[Any]:
        """The ring's next table, once the launch that last read it has run, grown to ``rows`` rows."""
        if len(self._tables) < TABLES:
            self._tables.append([None, np.zeros(0, np.uint64), None])
        slot = self._tables[self._table_at % len(self._tables)]
        self._table_at += 1
        self.synchronize(slot[2])
        if len(slot[1]) < rows:
            size = max(rows, 2 * len(slot[1]), 1024)
            cuda = self.cupy.cuda  # mapped: the kernel reads it where it lies (the same address, under UVA)
            slot[0] = cuda.PinnedMemory(size * 8, cuda.runtime.hostAllocMapped | cuda.runtime.hostAllocPortable)
            slot[1] = np.frombuffer(cuda.PinnedMemoryPointer(slot[0], 0), np.uint64, size)
        return slot

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An array for the consumer (call fence() after allocating, before writing)."""
        with self.outputs:
            return self.cupy.empty(shape, dtype=dtype)

    def export(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Called from the consumer's thread after hand_over(): the batch is ready on its stream. CuPy
        arrays go out as they are (the dict was made for this batch alone). torch and jax arrays share their
        memory (DLPack); each framework names its stream to CuPy's ``__dlpack__``, which makes it wait for
        the batch, ready on the consumer's stream made current here."""
        if self.from_dlpack is None:
            return batch
        if not self.checked:
            self.checked = True
            warn_jax_narrowed(batch)
        # For torch, CuPy's current stream is torch's, so DLPack adds no synchronization of its own.
        with self.device, self.stream:
            return {name: self.from_dlpack(a) for name, a in batch.items()}


def _stuck(what: str, bound: float) -> DecodeError:
    """The DecodeError of ``what`` (gathers, which wait on their window's decode) still queued after ``bound``."""
    return DecodeError(f"{what} is still queued after {bound:g} s (GDSLOAD_DECODE_WAIT_S): gathers wait on their "
                       f"window's decode, and one has not ended (a damaged frame can hang nvCOMP); the GPU may stay "
                       f"busy with it, so the process may have to exit")
