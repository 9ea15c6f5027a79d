"""The native stager (gdsload.backends.stager) as the pinned backend's reader: its default size for this rank, and a
window's reads through it (:class:`NativeReader`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..cuda.runtime import record_event
from .handoff import POLL_S
from .._tasks import Pending
from .base import FileHandles, ReadRequest
from .staging import StagingReader

#: The readers' default where cores allow, as KvikIO's pool by default (the pinned backend's other readers too).
DEFAULT_THREADS = 16
#: Threads of the pipeline busy beside the native readers (submitter, completer, assembler, the consumer):
#: the native reader's default leaves them their cores, since its workers spin while their copies run and
#: readers on every core starve those threads (docs/design.md, "pinned and the staging pool").
PIPELINE_THREADS = 4
# The native stager's buffers: two per thread, smaller where other ranks of the job stage on the same
# machine, whose staging shares the host's caches and memory bandwidth (docs/benchmarks.md, "Multi-GPU").
NATIVE_BUF_BYTES = 4 << 20
NATIVE_SHARED_BUF_BYTES = 2 << 20
NATIVE_BUFS_PER_THREAD = 2


def reader_threads(cores: int, reserved: int) -> int:
    """Reader threads by default on ``cores`` cores (this rank's share, :func:`gdsload.system.env.rank_cores`):
    ``DEFAULT_THREADS`` at most, ``reserved`` cores left to the pipeline's own threads, two readers at least."""
    return max(2, min(DEFAULT_THREADS, cores - reserved))


def native_threads(cores: int) -> int:
    """The native reader's default thread count on ``cores`` cores: the pipeline's busy threads
    (``PIPELINE_THREADS``) keep their cores."""
    return reader_threads(cores, PIPELINE_THREADS)


def native_buf_bytes(ranks: int) -> int:
    """The native reader's default buffer size with ``ranks`` processes of the job on this machine."""
    return NATIVE_BUF_BYTES if ranks <= 1 else NATIVE_SHARED_BUF_BYTES


class NativeReader(StagingReader):
    """The pinned backend's native reader: ``stager``'s C threads read each piece into buffers of their own and
    copy it to the device; a piece's data is there when its job finishes. Reads go to the descriptors of
    ``files``; ``device`` and ``stream`` (the backend's) are where the event of a window without fills is
    recorded. Closing it closes the stager, whose every copy is then complete."""

    name = "native"

    def __init__(self, stager: Any, files: FileHandles, device: Any, stream: Any):
        self._stager, self._files, self._device, self._stream = stager, files, device, stream
        self.num_threads: int = stager.num_threads

    @property
    def pinned_bytes(self) -> int:
        return int(self._stager.pinned_bytes)

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        job = self._stager.submit([(self._files.get(r.path), r.offset, r.nbytes, dest_ptr + r.dest_offset)
                                   for r in reads])
        return _NativeJob(self._stager, job, [r.path for r in reads], stop, fills, self._device, self._stream)

    def stats(self) -> dict[str, Any]:
        st = self._stager
        slots = st.num_threads * st.bufs_per_thread
        # Every buffer is held (and used in turn) for the stager's life; each thread reads one at a time.
        return {"reader": self.name, "num_threads": st.num_threads, "slot_bytes": st.buffer_bytes // slots,
                "slots": slots, "pool_bytes": st.pinned_bytes, "reading_slots": st.num_threads,
                "peak_slots_in_use": slots, "copy_share": None, "spin_events": not st.blocking_sync}

    def close(self) -> None:
        self._stager.close()


class _NativeJob(Pending):
    """One window's reads, carried out by the native stager; the data is on the device when they finish
    (its threads wait for their own copies)."""

    def __init__(self, stager: Any, job: int, paths: list[str], stop: threading.Event, fills: Any, device: Any,
                 stream: Any):
        self.stager, self.job, self.paths, self.stop, self.fills = stager, job, paths, stop, fills
        self.device, self.stream = device, stream

    def finish(self) -> Any:
        from .stager import JobCancelled

        cancelled = False
        try:
            while True:
                if self.stop.is_set() and not cancelled:
                    self.stager.cancel(self.job)  # pieces not started are dropped; the wait ends once none is in flight
                    cancelled = True
                if self.stager.wait(self.job, POLL_S, self.paths):
                    break
        except JobCancelled:
            if not self.stop.is_set():
                raise
        # The reads' copies are complete; the fills, if any, are queued on the backend's stream.
        with self.device:
            return self.fills if self.fills is not None else record_event(self.stream)
