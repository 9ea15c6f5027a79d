"""The pinned backend: reads land in pinned host memory, copies go async to the device on non-blocking streams.

Two readers behind :class:`~gdsload.backends.pinned.staging_pool.StagingReader`: the native stager's
(:mod:`gdsload.backends.pinned.native_reader`, the default where it builds), else Python threads filling the
staging pool's slots (:mod:`gdsload.backends.pinned.slot_readers`; the only one with O_DIRECT). Why each, and why
non-blocking streams: docs/design.md, "`pinned` and the staging pool" and "`auto`".
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..._tasks import Pending
from ..base import FileHandles, ReadRequest, Request, coalesce
from ..cuda import CudaBackend
from ..sizing import DEFAULT_THREADS, NATIVE_BUFS_PER_THREAD, native_buf_bytes, native_threads
from ..native.shared import shared_stager
from .native_reader import NativeReader
from .slot_readers import ThreadReader
from .staging_pool import StagingPool, StagingReader, pack

__all__ = ["PinnedBackend", "pack", "DEFAULT_SLOT_BYTES", "DEFAULT_POOL_BYTES"]

# Larger staging slots mean fewer calls per byte in the driver thread (docs/benchmarks.md: the sweep).
DEFAULT_SLOT_BYTES = 16 << 20
DEFAULT_POOL_BYTES = 512 << 20
#: The values of the ``reader`` option.
READERS = ("auto", "native", "threads")


class PinnedBackend(CudaBackend):
    """Pinned host staging, then asynchronous copies to the device, through one of two readers
    (:class:`gdsload.backends.pinned.staging_pool.StagingReader`) picked at construction."""

    name = "pinned"
    window_bytes_hint = 256 << 20
    # Its driver thread's Python work delays the assembler's turns now and then; two more batches in hand
    # keep that from a loop that syncs every step (docs/design.md).
    batches_ahead_hint = 4

    def __init__(self, device_id: int = 0, num_threads: int | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 pool_bytes: int = DEFAULT_POOL_BYTES, direct: bool = False, reader: str = "auto",
                 spin_events: bool = True, buf_bytes: int | None = None,
                 bufs_per_thread: int = NATIVE_BUFS_PER_THREAD):
        """``pool_bytes`` bounds the pinned memory held (``pool_bytes // slot_bytes`` slots); ``direct`` reads
        aligned blocks with O_DIRECT, bypassing the page cache (for datasets larger than RAM); ``reader``:
        "native" (the native stager), "threads" (Python threads) or "auto" (native where the stager builds and
        without ``direct``, else threads); ``spin_events``: waits for a slot's last copy spin rather than sleep;
        ``buf_bytes`` and ``bufs_per_thread``: the native reader's own pinned buffers per thread (default
        :func:`native_buf_bytes`). ``num_threads`` (reader threads) defaults to :func:`native_threads` of this
        rank's cores for the native reader, ``DEFAULT_THREADS`` for threads."""
        from ...system.env import local_ranks, rank_cores
        from ...system.placement import for_device

        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be positive (found {num_threads})")
        if pool_bytes < slot_bytes:
            raise ValueError(f"pool_bytes ({pool_bytes}) must hold at least one slot of {slot_bytes} bytes")
        if reader == "kvikio":
            raise ValueError("the pinned backend's reader 'kvikio' was removed: its readers are 'auto', 'native' and "
                             "'threads' (backend='kvikio' reads through KvikIO)")
        if reader not in READERS:
            raise ValueError(f"reader must be 'auto', 'native' or 'threads' (found {reader!r})")
        if reader == "native" and direct:
            raise ValueError("reader='native' reads through the page cache: O_DIRECT (direct=True) needs 'threads'")
        super().__init__(device_id)
        self.direct = direct
        self.io_mode = "pinned-odirect" if direct else "pinned"
        self.spin_events = spin_events
        self.native_reason: str | None = None  # why "auto" did not get the native stager
        # The GPU's NUMA node: reader threads and staging memory are made there (docs/design.md, "NUMA placement").
        self.placer = placer = for_device(self.device)
        self._files = FileHandles()
        staging: StagingReader | None = None
        if reader in ("auto", "native") and not direct:
            from ...errors import BackendUnavailable

            try:
                buf = native_buf_bytes(local_ranks()) if buf_bytes is None else buf_bytes
                # Its C threads inherit this thread's mask and its buffers are faulted in here (MAP_POPULATE).
                with placer.around("native stager threads and buffers"):
                    stager = shared_stager(device_id, num_threads or native_threads(rank_cores()), buf,
                                           bufs_per_thread)
                staging = NativeReader(stager, self._files, self.device, self.stream)
                reader = "native"
            except BackendUnavailable as e:
                if reader == "native":
                    raise
                self.native_reason = str(e)
        self.reader = reader = "threads" if reader == "auto" else reader
        # The default depends on the reader that runs: the native one leaves the pipeline's threads a core.
        self.num_threads = num_threads = staging.num_threads if staging is not None else num_threads or DEFAULT_THREADS
        # The native stager stages through buffers of its own: the pool is not made.
        self.pool: StagingPool | None = None
        if staging is None:
            with placer.around("staging pool"):  # PinnedHost's pages are faulted in by this thread
                self.pool = pool = StagingPool(slot_bytes, pool_bytes // slot_bytes, device_id, spin_events)
            staging = ThreadReader(pool, self._files, direct, device_id, num_threads, self.stream, placer)
        self._staging: StagingReader = staging

    @property
    def pinned_bytes(self) -> int:
        return self._staging.pinned_bytes

    def stats(self) -> dict[str, Any]:
        """The reader's stats (:data:`gdsload.backends.pinned.staging_pool.STATS_KEYS`), ``native``: why ``auto``
        did not get the native reader (None when it did, or was not asked), and ``numa``: what was placed on the GPU's
        node (:meth:`gdsload.system.placement.Placer.describe`)."""
        return {**self._staging.stats(), "native": self.native_reason, "numa": self.placer.describe()}

    def handles(self) -> list[FileHandles]:
        return [self._files, *self._staging.handles()]

    def streams(self) -> list[Any]:
        return [self.stream, *self._staging.streams()]

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        filled = self.write_fills(dest, requests)  # the window's "filled" event must cover them too
        reads = coalesce([r for r in requests if isinstance(r, ReadRequest)], 1 << 62)
        return self._staging.submit(int(dest.data.ptr), reads, stop, filled)

    def close(self) -> None:
        self._staging.close()  # the native reader's stager: every copy it issued is complete
        self.quiesce()
        if self.pool is not None:
            self.pool.close()
        self._files.close()
