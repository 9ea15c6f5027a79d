"""The kvikio backend: ``CuFile.pread`` straight into the device window buffer.

With the nvidia-fs driver this is GPUDirect Storage (disk DMA into GPU memory, no host copy). Without it
KvikIO runs in compat mode: POSIX reads through its own pinned bounce buffers, and its copies go on
blocking CUDA streams, which serialize with work on the legacy default stream (docs/design.md). File
handles stay open for the dataset's life.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from .._tasks import Pending
from .base import FileHandles, ReadRequest, Request, coalesce
from ..format.files import read_error
from .cuda import CudaBackend, KvikioPool
from .sizing import reader_threads

#: Cores left to the consumer and the pipeline's busy threads beside KvikIO's (its submitter and completer
#: mostly wait on KvikIO).
PIPELINE_CORES = 2
DEFAULT_TASK_BYTES = 4 << 20
DEFAULT_MAX_READ_BYTES = 64 << 20


def default_threads(cores: int) -> int:
    """KvikIO's pool size by default on ``cores`` cores (this rank's share, :func:`gdsload.system.env.rank_cores`):
    ``PIPELINE_CORES`` left to the consumer and the pipeline's threads, so that KvikIO's readers and they do
    not outnumber the cores (docs/benchmarks.md, "`kvikio`'s readers and the cores")."""
    return reader_threads(cores, PIPELINE_CORES)


class KvikioBackend(CudaBackend):
    name = "kvikio"
    window_bytes_hint = 256 << 20

    def __init__(self, device_id: int = 0, num_threads: int | None = None, task_bytes: int = DEFAULT_TASK_BYTES,
                 max_read_bytes: int = DEFAULT_MAX_READ_BYTES):
        """``num_threads`` and ``task_bytes`` ask for KvikIO's process-wide thread pool and task size (its own
        default is one thread; ours :func:`default_threads`); adjacent blocks are merged into reads of up to
        ``max_read_bytes``."""
        import kvikio

        from ..system.env import gds_available, rank_cores

        if num_threads is None:
            num_threads = default_threads(rank_cores())
        if num_threads < 1 or task_bytes < 1 or max_read_bytes < 1:
            raise ValueError(f"num_threads, task_bytes and max_read_bytes must be positive (found {num_threads}, "
                             f"{task_bytes}, {max_read_bytes})")
        super().__init__(device_id)
        self.num_threads, self.task_bytes, self.max_read_bytes = num_threads, task_bytes, max_read_bytes
        KvikioPool.acquire(num_threads, task_bytes)
        self._pool_held = True
        self._gds = gds_available()
        self.io_mode = "gds" if self._gds else "kvikio-compat"
        self._files = FileHandles(opener=lambda path: kvikio.CuFile(path, "r"), closer=lambda f: f.close())

    def stats(self) -> dict[str, Any]:
        return {"num_threads": self.num_threads, "task_bytes": self.task_bytes, "max_read_bytes": self.max_read_bytes}

    def handles(self) -> list[FileHandles]:
        return [self._files]

    def prepare(self, files: Any) -> None:
        """Bind the dataset's files, and say ``kvikio-compat`` when GDS is there but some of them lie on a
        file system that cuFile reads only in its compat mode."""
        super().prepare(files)
        if self._gds:
            from ..system.sysfiles import paths_support

            folders = {os.path.dirname(os.path.realpath(p)) for p in files}
            self.io_mode = io_mode_for(True, paths_support(sorted(folders)))

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        pending = _Reads(self.write_fills(dest, requests))
        base = int(dest.data.ptr)
        with self.device:
            for r in coalesce([r for r in requests if isinstance(r, ReadRequest)], self.max_read_bytes):
                if stop.is_set():
                    break
                try:
                    view = DeviceSpan(base + r.dest_offset, r.nbytes)
                    pending.futures.append((r, self._files.get(r.path).pread(view, r.nbytes, r.offset)))
                except BaseException as e:
                    pending.error = read_error(r.path, r.offset, r.nbytes, cause=e)
                    break
        return pending

    def close(self) -> None:
        self._files.close()
        if self._pool_held:
            self._pool_held = False
            KvikioPool.release()


class DeviceSpan:
    """``nbytes`` of device memory at ``ptr``, described by the CUDA array interface alone: what KvikIO's
    ``pread`` needs of a slice of the window buffer, without a CuPy view made per read (a window of small
    compressed chunks makes hundreds of reads, each paid in Python beside the pipeline's other threads). It
    holds no reference to the buffer: the window buffer outlives its reads (``_Reads.finish``)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def io_mode_for(gds: bool, supports: list[Any]) -> str:
    """``gds`` only when GDS is available and no file system of the dataset is known to exclude it (an
    ``FsSupport`` of each, or None where the mount is not known)."""
    if not gds or any(s is not None and s.gds is False for s in supports):
        return "kvikio-compat"
    return "gds"


class _Reads(Pending):
    """KvikIO futures of one window. Every submitted read writes into the window buffer, so all of them
    finish before ``finish`` returns or raises, and the buffer can change hands."""

    def __init__(self, fills: Any) -> None:
        self.fills = fills  # event after the window's fill values, or None
        self.futures: list[tuple[ReadRequest, Any]] = []
        self.error: BaseException | None = None

    def finish(self) -> Any:
        error = self.error
        for r, future in self.futures:
            try:
                n = future.get()
            except BaseException as e:
                error = error or read_error(r.path, r.offset, r.nbytes, cause=e)
                continue
            if n != r.nbytes and error is None:
                error = read_error(r.path, r.offset, r.nbytes, got=n)
        if error is not None:
            raise error
        return self.fills  # KvikIO's reads are complete in device memory when their futures return
