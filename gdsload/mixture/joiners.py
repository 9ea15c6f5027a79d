"""The joiners a mixture uses, one per kind of array and device: :class:`DeviceJoiner` for CuPy arrays and
torch CUDA tensors (outputs allocated by the arrays' own library, filled by device-to-device copies on a stream
of the mixture's own: gdsload/mixture/assemble.py says why and how the streams are ordered), the library's
concatenation for anything else."""

from __future__ import annotations

from typing import Any

import numpy as np

from .assemble import IDS_KEPT, SOURCE_KEY, Joiner, LibraryJoiner, Runs, Span, kind_of


class DeviceJoiner:
    """Joins CuPy arrays or torch CUDA tensors of one device by copies on a stream of its own (module notes).
    Called from the consumer's thread only."""

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
        self._memcpy = cupy.cuda.runtime.memcpyAsync
        self._external: Any = None  # the consumer's torch stream, as a CuPy stream
        self._ids: dict[Runs, Any] = {}
        self._library = LibraryJoiner()

    def join(self, spans: dict[str, list[Span]], tails: dict[str, int], runs: Runs) -> dict[str, Any]:
        if any(s.row_bytes < 0 for parts in spans.values() for s in parts):
            return self._library.join(spans, tails, runs)
        with self.device:
            consumer = self._consumer()
            out: dict[str, Any] = {}
            for key, parts in spans.items():
                first = parts[0]
                if len(parts) == 1 and key not in tails and not first.shift:
                    out[key] = first.array[first.lo:first.hi]  # a view of the one span
                else:
                    rows = sum(s.hi - s.lo for s in parts) + (key in tails)
                    out[key] = self._empty((rows, *first.array.shape[1:]), first.array.dtype)
            total = sum(n for _, n in runs)
            out[SOURCE_KEY] = ids = self._empty((total,), None)
            self._begin(consumer)
            with self.stream:  # the rebasing kernels, as the copies, on the joiner's stream
                for key, parts in spans.items():
                    if len(parts) > 1 or key in tails or parts[0].shift:
                        self._fill(out[key], parts, tails.get(key))
            self._copy(self._ptr(ids), int(self._ids_of(runs).data.ptr), total * 8)
            self._end(consumer)
        return out

    def ids(self, runs: Runs, like: Any) -> Any:
        with self.device:
            consumer = self._consumer()
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
        if self.torch is not None:
            return self.torch.empty(shape, dtype=self.torch.int64 if dtype is None else dtype,
                                    device=f"cuda:{self.device.id}")
        return self.cupy.empty(shape, dtype=np.int64 if dtype is None else dtype)

    def _ptr(self, a: Any) -> int:
        return int(a.data_ptr()) if self.torch is not None else int(a.data.ptr)

    def _begin(self, consumer: Any) -> None:
        consumer.record(self._before)  # after the allocations: the copies wait for the consumer's work so far
        self.stream.wait_event(self._before)

    def _end(self, consumer: Any) -> None:
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
        key = (kind, device)
        joiner = self._made.get(key)
        if joiner is None:
            if device >= 0:
                joiner = self._made[key] = DeviceJoiner(device, kind)
            else:
                joiner = self._made[key] = LibraryJoiner()
        return joiner

    def drain(self) -> None:
        for j in self._made.values():
            j.drain()


def _cuda_device(a: Any, kind: str) -> int:
    """The CUDA device of a CuPy array or torch tensor; -1 for anything else."""
    if kind == "cupy":
        return int(a.device.id)
    if kind == "torch" and a.is_cuda:
        return int(a.device.index)
    return -1
