"""The joiners a mixture uses, one per kind of array and device: :class:`DeviceJoiner` for CuPy arrays and
torch CUDA tensors (outputs allocated by the arrays' own library, filled by device-to-device copies on a stream
of the mixture's own: gdsload/mixture/assemble.py says why and how the streams are ordered), the library's
concatenation for anything else."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .assemble import IDS_KEPT, SOURCE_KEY, Joiner, LibraryJoiner, Runs, Span, kind_of


class DeviceJoiner:
    """Joins CuPy arrays or torch CUDA tensors of one device by copies on a stream of its own (module notes).

    Called from the consumer's thread, or, once :meth:`make_ahead` was called, from the one thread that makes
    batches ahead of it. Then the consumer's stream is the one its thread last handed over (:meth:`pick_up`,
    :meth:`hand_over`); outputs come from the pool of a stream of the joiner's that is never given work (as
    the pipeline's outputs do), ordered after the consumer's latest stream by the event recorded on it; a
    single slice is copied too (the consumer never holds a source's memory, which the sources' gathers reuse
    after the joiner's copies, not after the consumer's work); and each batch's copies end in an event of
    its own (:attr:`ready`), which the consumer's stream waits on when it takes the batch."""

    def __init__(self, device_id: int, kind: str):
        import cupy

        from ..cuda.runtime import D2D, new_event

        self.cupy, self.kind, self._d2d = cupy, kind, D2D
        self.device = cupy.cuda.Device(device_id)
        self.torch = None
        if kind == "torch":
            import torch

            self.torch = torch
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._before, self._after = new_event(), new_event()
        self._new_event = new_event
        self.ahead = False
        self.consumer: Any = None  # ahead: the consumer's stream as its thread last handed it over
        self.ready: Any = None  # ahead: the event after the latest batch's copies
        self._outputs: Any = None  # ahead: never given work; the pool the outputs come from
        self._memcpy = cupy.cuda.runtime.memcpyAsync
        self._external: Any = None  # the consumer's torch stream, as a CuPy stream
        self._ids: dict[Runs, Any] = {}
        self._library = LibraryJoiner()

    # -- making batches ahead: the consumer's thread ----------------------------------------------------------
    def make_ahead(self) -> None:
        """From now on joins run on the thread making batches ahead (the consumer's stream picked up first)."""
        if self._outputs is None:  # one for the joiner's life: its pool holds the outputs handed out
            with self.device:
                self._outputs = self.cupy.cuda.Stream(non_blocking=True)
        self.pick_up()
        self.ahead = True

    def pick_up(self) -> None:
        """The consumer's current stream, for the joins made ahead of it; a stream it switched to first waits
        for what was queued on the one before."""
        with self.device:
            stream = self._consumer()
            if self.consumer is not None and stream.ptr != self.consumer.ptr:
                stream.wait_event(self.consumer.record())
        self.consumer = stream

    def hand_over(self, ready: Any) -> None:
        """The consumer takes a batch made ahead: its stream waits for the batch's copies (``ready``)."""
        self.pick_up()
        with self.device:
            self.consumer.wait_event(ready)

    # -- making batches ahead: the maker's thread ---------------------------------------------------------------
    @contextlib.contextmanager
    def taking(self) -> Iterator[None]:
        """The joiner's stream made current (CuPy's, and torch's for torch outputs) while the sources' batches
        are taken: their pipelines hand them over to it, and it is what they wait for before reusing memory."""
        with self.device, self.stream:
            if self.torch is None:
                yield
                return
            with self.torch.cuda.stream(self._torch_stream(self.stream)):
                yield

    def _torch_stream(self, stream: Any) -> Any:
        return self.torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{self.device.id}")

    def join(self, spans: dict[str, list[Span]], tails: dict[str, int], runs: Runs) -> dict[str, Any]:
        if any(s.row_bytes < 0 for parts in spans.values() for s in parts):
            if self.ahead:
                raise ValueError("a source gives device arrays that are not contiguous, which a mixture joins by "
                                 "their library in your thread only (pass read_ahead=0)")
            return self._library.join(spans, tails, runs)
        with self.device:
            consumer = self.consumer if self.ahead else self._consumer()
            out: dict[str, Any] = {}
            for key, parts in spans.items():
                first = parts[0]
                if len(parts) == 1 and key not in tails and not first.shift and not self.ahead:
                    out[key] = first.array[first.lo:first.hi]  # a view of the one span
                else:
                    rows = sum(s.hi - s.lo for s in parts) + (key in tails)
                    out[key] = self._empty((rows, *first.array.shape[1:]), first.array.dtype)
            total = sum(n for _, n in runs)
            out[SOURCE_KEY] = ids = self._empty((total,), None)
            self._begin(consumer)
            with self.stream:  # the rebasing kernels, as the copies, on the joiner's stream
                for key, parts in spans.items():
                    if len(parts) > 1 or key in tails or parts[0].shift or self.ahead:
                        self._fill(out[key], parts, tails.get(key))
            self._copy(self._ptr(ids), int(self._ids_of(runs).data.ptr), total * 8)
            self._end(consumer)
        return out

    def ids(self, runs: Runs, like: Any) -> Any:
        with self.device:
            consumer = self.consumer if self.ahead else self._consumer()
            total = sum(n for _, n in runs)
            ids = self._empty((total,), None)
            self._begin(consumer)
            self._copy(self._ptr(ids), int(self._ids_of(runs).data.ptr), total * 8)
            self._end(consumer)
        return ids

    def drain(self) -> None:
        """Every copy queued so far is done (before the sources' batches may be freed with their pipelines)."""
        self.stream.synchronize()

    # -- inside the device's scope ---------------------------------------------------------------------
    def _fill(self, out: Any, parts: list[Span], tail: int | None) -> None:
        """``out`` from ``parts`` in order: a copy each, or a kernel adding a rebased span's shift; then the
        offsets' last value."""
        dst, at = self._ptr(out), 0
        for s in parts:
            size = (s.hi - s.lo) * s.row_bytes
            if s.shift:
                n = s.hi - s.lo
                self.cupy.add(self._int64(s.array, n, s.lo * 8), s.shift, out=self._int64(out, n, at))
            elif size:
                self._memcpy(dst + at, self._ptr(s.array) + s.lo * s.row_bytes, size, self._d2d, self.stream.ptr)
            at += size
        if tail is not None:
            self._int64(out, 1, at).fill(tail)

    def _consumer(self) -> Any:
        """The consumer's current stream (torch's, for torch outputs), as a CuPy stream."""
        if self.torch is None:
            return self.cupy.cuda.get_current_stream()
        current = self.torch.cuda.current_stream(self.device.id)
        if self._external is None or self._external.ptr != current.cuda_stream:
            try:
                self._external = self.cupy.cuda.Stream.from_external(current)
            except Exception:  # a torch without the CUDA stream protocol
                self._external = self.cupy.cuda.ExternalStream(current.cuda_stream, self.device.id)
        return self._external

    def _empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """Allocated by the output's library on the consumer's current stream (its pool, its reuse rules);
        ``dtype`` None: int64."""
        pool = self._outputs if self.ahead else None
        if self.torch is not None:
            with self.torch.cuda.stream(self._torch_stream(pool)) if pool is not None else contextlib.nullcontext():
                return self.torch.empty(shape, dtype=self.torch.int64 if dtype is None else dtype,
                                        device=f"cuda:{self.device.id}")
        with pool if pool is not None else contextlib.nullcontext():
            return self.cupy.empty(shape, dtype=np.int64 if dtype is None else dtype)

    def _ptr(self, a: Any) -> int:
        return int(a.data_ptr()) if self.torch is not None else int(a.data.ptr)

    def _begin(self, consumer: Any) -> None:
        consumer.record(self._before)  # after the allocations: the copies wait for the consumer's work so far
        self.stream.wait_event(self._before)

    def _end(self, consumer: Any) -> None:
        if self.ahead:  # an event per batch: several are in flight, and the consumer waits when it takes one
            self.ready = self._new_event()
            self.stream.record(self.ready)
            return
        self.stream.record(self._after)
        consumer.wait_event(self._after)  # one event, recorded again per batch: a wait takes the record current

    def _copy(self, dst: int, src: int, size: int) -> None:
        if size:
            self._memcpy(dst, src, size, self._d2d, self.stream.ptr)

    def _int64(self, a: Any, n: int, at: int = 0) -> Any:
        """``n`` int64 of ``a``'s memory from byte ``at``, as a CuPy array (a view; ``a`` kept alive)."""
        cupy = self.cupy
        mem = cupy.cuda.UnownedMemory(self._ptr(a) + at, n * 8, a, self.device.id)
        return cupy.ndarray((n,), np.int64, cupy.cuda.MemoryPointer(mem, 0))

    def _ids_of(self, runs: Runs) -> Any:
        """The source index of every sample of a batch of ``runs``, kept on the device as a CuPy array
        (written on the joiner's stream, so every copy from it queued later finds it written)."""
        ids = self._ids.get(runs)
        if ids is None:
            if len(self._ids) >= IDS_KEPT:
                self.stream.synchronize()  # no copy still reads the arrays dropped here
                self._ids.clear()
            with self.stream:
                ids = self.cupy.asarray(np.repeat(np.array([i for i, _ in runs], np.int64), [n for _, n in runs]))
            self._ids[runs] = ids
        return ids


class Joiners:
    """The joiner for each kind of array a mixture's batches hold (made on first use)."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, int], Joiner] = {}

    def __call__(self, like: Any) -> Joiner:
        kind = kind_of(like)
        device = _cuda_device(like, kind)
        if device >= 0:
            return self.device(kind, device)
        joiner = self._made.get((kind, device))
        if joiner is None:
            joiner = self._made[(kind, device)] = LibraryJoiner()
        return joiner

    def drain(self) -> None:
        for j in self._made.values():
            j.drain()

    def device(self, kind: str, device_id: int) -> DeviceJoiner:
        """The joiner of ``kind`` arrays (``cupy`` or ``torch``) on device ``device_id``, made now if need be."""
        joiner = self._made.get((kind, device_id))
        if joiner is None:
            joiner = self._made[(kind, device_id)] = DeviceJoiner(device_id, kind)
        assert isinstance(joiner, DeviceJoiner)
        return joiner


def _cuda_device(a: Any, kind: str) -> int:
    """The CUDA device of a CuPy array or torch tensor; -1 for anything else."""
    if kind == "cupy":
        return int(a.device.id)
    if kind == "torch" and a.is_cuda:
        return int(a.device.index)
    return -1
