"""The native stager (:mod:`gdsload.backends.native.stager`) as the pinned backend's reader: a window's reads
through it (:class:`NativeReader`); its default size for this rank is in :mod:`gdsload.backends.sizing`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ...cuda.runtime import record_event
from ..native.shared import Jobs
from ..._tasks import Pending
from ..base import FileHandles, ReadRequest
from .staging_pool import StagingReader


class NativeReader(StagingReader):
    """The pinned backend's native reader: ``stager``'s C threads read each piece into buffers of their own and
    copy it to the device; a piece's data is there when its job finishes. Reads go to the descriptors of
    ``files``; ``device`` and ``stream`` (the backend's) are where the event of a window without fills is
    recorded. The stager may be shared (:mod:`gdsload.backends.native.shared`): closing the reader cancels and
    waits for its own jobs, so none of its copies lands after that."""

    name = "native"

    def __init__(self, stager: Any, files: FileHandles, device: Any, stream: Any):
        self._stager, self._files, self._device, self._stream = stager, files, device, stream
        self.num_threads: int = stager.num_threads
        self._jobs = Jobs(stager)  # what close() cancels and waits for

    @property
    def pinned_bytes(self) -> int:
        return int(self._stager.pinned_bytes)

    def submit(self, dest_ptr: int, reads: Sequence[ReadRequest], stop: threading.Event, fills: Any) -> Pending:
        paths = [r.path for r in reads]
        job = self._jobs.submit([(self._files.get(r.path), r.offset, r.nbytes, dest_ptr + r.dest_offset)
                                 for r in reads])
        return _NativeJob(self, job, paths, stop, fills)

    def stats(self) -> dict[str, Any]:
        st = self._stager
        slots = st.num_threads * st.bufs_per_thread
        # Every buffer is held (and used in turn) for the stager's life; each thread reads one at a time.
        return {"reader": self.name, "num_threads": st.num_threads, "slot_bytes": st.buffer_bytes // slots,
                "slots": slots, "pool_bytes": st.pinned_bytes, "reading_slots": st.num_threads,
                "peak_slots_in_use": slots, "spin_events": not st.blocking_sync}

    def close(self) -> None:
        """Cancel this reader's jobs and wait until none is in flight (no copy of theirs writes after this), then
        give the stager back (closed by its last user)."""
        self._jobs.close()


class _NativeJob(Pending):
    """One window's reads, carried out by the native stager; the data is on the device when they finish
    (its threads wait for their own copies)."""

    def __init__(self, reader: NativeReader, job: int, paths: list[str], stop: threading.Event, fills: Any):
        self.reader, self.job, self.paths, self.stop, self.fills = reader, job, paths, stop, fills

    def finish(self) -> Any:
        reader = self.reader
        reader._jobs.finish(self.job, self.stop, self.paths)
        # The reads' copies are complete; the fills, if any, are queued on the backend's stream.
        with reader._device:
            return self.fills if self.fills is not None else record_event(reader._stream)
