"""The native stager (gdsload.stager) as the pinned backend's reader: its default size for this rank, and a
window's reads through it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._cuda import record_event
from ..handoff import POLL_S
from .base import Pending, ReadRequest

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
    """Reader threads by default on ``cores`` cores (this rank's share, :func:`gdsload.env.rank_cores`):
    ``DEFAULT_THREADS`` at most, ``reserved`` cores left to the pipeline's own threads, two readers at least."""
    return max(2, min(DEFAULT_THREADS, cores - reserved))


def native_threads(cores: int) -> int:
    """The native reader's default thread count on ``cores`` cores: the pipeline's busy threads
    (``PIPELINE_THREADS``) keep their cores."""
    return reader_threads(cores, PIPELINE_THREADS)


def native_buf_bytes(ranks: int) -> int:
    """The native reader's default buffer size with ``ranks`` processes of the job on this machine."""
    return NATIVE_BUF_BYTES if ranks <= 1 else NATIVE_SHARED_BUF_BYTES


class NativeJob(Pending):
    """One window's reads, carried out by the native stager; the data is on the device when they finish
    (its threads wait for their own copies). ``backend`` gives the stager (``_stager``), the file handles
    (``_files``), and the ``device`` and ``stream`` the fills' event, if none, is recorded on."""

    def __init__(self, backend: Any, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event,
                 fills: Any):
        self.backend, self.stop, self.fills = backend, stop, fills
        self.paths = [r.path for r in reads]
        files = backend._files
        self.job = backend._stager.submit([(files.get(r.path), r.offset, r.nbytes, dest_ptr + r.dest_offset)
                                           for r in reads])

    def finish(self) -> Any:
        from ..stager import JobCancelled

        stager = self.backend._stager
        cancelled = False
        try:
            while True:
                if self.stop.is_set() and not cancelled:
                    stager.cancel(self.job)  # pieces not started are dropped; the wait ends once none is in flight
                    cancelled = True
                if stager.wait(self.job, POLL_S, self.paths):
                    break
        except JobCancelled:
            if not self.stop.is_set():
                raise
        # The reads' copies are complete; the fills, if any, are queued on the backend's stream.
        with self.backend.device:
            return self.fills if self.fills is not None else record_event(self.backend.stream)
