"""The consumer's side of the device: its stream, the events that order it against the readers, gathers.

Host arrays need none of this (numpy is synchronous), so :class:`HostOps` is all no-ops and the same
pipeline code runs on machines without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


_D2D = 3  # cudaMemcpyDeviceToDevice
_WORDS = ((16, np.complex128), (8, np.uint64), (4, np.uint32), (2, np.uint16), (1, np.uint8))


def _as_words(a: Any) -> Any:
    """A C-contiguous (rows, ...) array viewed as (rows, words) of the widest word dividing a row."""
    rows = a.shape[0]
    if rows == 0:
        return a
    row_bytes = a.nbytes // rows
    flat = a.reshape(rows, -1).view(np.uint8)
    for size, dtype in _WORDS:
        if row_bytes % size == 0 and a.data.ptr % size == 0:
            return flat.view(dtype)
    return flat


class HostOps:
    """numpy outputs: work is done when the call returns."""

    xp = np

    def begin(self) -> None:
        """Called before each batch: pick up the consumer's current stream."""

    def scope(self) -> Any:
        """Context for one batch's work (device and stream made current once, not per call)."""
        return contextlib.nullcontext()

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass

    def index_array(self, a: np.ndarray) -> Any:
        return a

    def copy_rows(self, src: Any, first: int, out: Any) -> None:
        """``out[:] = src[first:first + len(out)]``."""
        np.copyto(out, src[first:first + len(out)])

    def take(self, src: Any, idx: Any, out: Any) -> None:
        """``out[:] = src[idx]`` along axis 0."""
        np.take(src, idx, axis=0, out=out)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return np.empty(shape, dtype=dtype)

    def export(self, a: Any) -> Any:
        return a


class TorchHostOps(HostOps):
    """numpy work, handed out as CPU torch tensors sharing the same memory."""

    def export(self, a: Any) -> Any:
        import torch

        return torch.from_numpy(a)


class CudaOps:
    """CuPy work issued on the consumer's current stream (CuPy's, or torch's for torch outputs).

    Every gather of a batch runs on that stream after it waited on the window's "filled" event, and the
    window's "released" event is recorded on it, so the user needs no synchronization of their own.
    """

    def __init__(self, device_id: int, output: str):
        import cupy

        self.cupy = cupy
        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        self.output = output
        self.torch = None
        if output == "torch":
            import torch

            self.torch = torch
        self.stream: Any = None

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
            # The consumer switched streams: work already queued on the old one must come first.
            stream.wait_event(self.stream.record())
        self.stream = stream

    def scope(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.device)
        stack.enter_context(self.stream)
        return stack

    def record(self) -> Any:
        with self.device:
            return (self.stream or self._current_stream()).record()

    def wait(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def index_array(self, a: np.ndarray) -> Any:
        with self.device, self.stream:
            return self.cupy.asarray(a)

    # Called inside scope(): the device and the consumer's stream are current.
    def copy_rows(self, src: Any, first: int, out: Any) -> None:
        """Consecutive rows: one device-to-device memcpy."""
        if out.nbytes:
            row = src.nbytes // src.shape[0]
            self.cupy.cuda.runtime.memcpyAsync(out.data.ptr, src.data.ptr + first * row, out.nbytes, _D2D,
                                               self.stream.ptr)

    def take(self, src: Any, idx: Any, out: Any) -> None:
        """Rows moved as whole words (up to 16 bytes), not elements: a uint8 image row gathered byte by
        byte runs an order of magnitude slower than the same row as 8- or 16-byte words."""
        self.cupy.take(_as_words(src), idx, axis=0, out=_as_words(out))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self.cupy.empty(shape, dtype=dtype)

    def export(self, a: Any) -> Any:
        if self.torch is None:
            return a
        # Called inside scope(): CuPy's current stream is torch's, so DLPack adds no synchronization.
        return self.torch.from_dlpack(a)
