"""What every backend shares: the request types, the fill contract, and POSIX reads that name their file."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from .._tasks import Pending
from ..errors import ReadError
from ..format.files import read_error


class ReadRequest(NamedTuple):
    """Read ``nbytes`` at ``offset`` of ``path`` into the window buffer at ``dest_offset``."""

    path: str
    offset: int
    nbytes: int
    dest_offset: int


class FillRequest(NamedTuple):
    """Set ``nbytes`` of the window buffer at ``dest_offset`` to a repeated fill pattern (a missing block)."""

    dest_offset: int
    nbytes: int
    pattern: bytes


Request = ReadRequest | FillRequest


def coalesce(requests: Sequence[ReadRequest], max_bytes: int) -> list[ReadRequest]:
    """Merge reads that are adjacent both in their file and in the buffer into reads of at most
    ``max_bytes``: fewer, larger reads cost less per byte on every path."""
    out: list[ReadRequest] = []
    for r in requests:
        if out:
            p = out[-1]
            if (p.path == r.path and p.offset + p.nbytes == r.offset and p.dest_offset + p.nbytes == r.dest_offset
                    and p.nbytes + r.nbytes <= max_bytes):
                out[-1] = p._replace(nbytes=p.nbytes + r.nbytes)
                continue
        out.append(r)
    return out


def split(request: ReadRequest, chunk_bytes: int) -> list[ReadRequest]:
    """Cut one read into pieces of at most ``chunk_bytes`` (so several threads can share it)."""
    return [request._replace(offset=request.offset + o, nbytes=min(chunk_bytes, request.nbytes - o),
                             dest_offset=request.dest_offset + o)
            for o in range(0, request.nbytes, chunk_bytes)]


def pread_full(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file or an OS error raises ReadError naming both."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            raise read_error(path, offset, n, cause=e) from e
        if k == 0:
            raise read_error(path, offset, n, got=got)
        got += k


def fill_pattern(dest: Any, r: FillRequest) -> None:
    """Write a fill request's repeated pattern into a numpy or cupy uint8 buffer."""
    import numpy as np

    region = dest[r.dest_offset:r.dest_offset + r.nbytes]
    unit = np.frombuffer(r.pattern, dtype=np.uint8)
    if not unit.any():
        region.fill(0)
        return
    tile = np.tile(unit, r.nbytes // len(unit))
    if isinstance(region, np.ndarray):
        region[...] = tile
    else:
        region.set(tile)


def reopened(files: Any, path: str) -> str:
    """A path that opens the very file the dataset opened as ``path`` (``/proc/self/fd/N``), for readers
    that open files themselves (KvikIO, O_DIRECT): whatever is at ``path`` now, they read the original."""
    fd = files.fd(path)
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


class FileHandles:
    """Per-path handles made once from the dataset's open shard files and kept for the dataset's life
    (opening a file per read or per pass costs more than the read of a block). By default the dataset's
    own descriptor; with an opener (KvikIO's CuFile, an O_DIRECT descriptor) a handle opened on
    :func:`reopened`, which is the same inode wherever ``/proc/self/fd`` exists (elsewhere it falls back
    to the path, unchecked)."""

    def __init__(self, opener: Callable[[str], Any] | None = None, closer: Callable[[Any], None] = os.close):
        self._open = opener
        self._close = closer
        self._files: Any = None
        self._fds: dict[str, Any] = {}
        self._lock = threading.Lock()

    def bind(self, files: Any) -> None:
        """Use the dataset's open files (called once, by the backend's prepare)."""
        self._files = files

    def get(self, path: str) -> Any:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._make(path)
                    self._fds[path] = fd
        return fd

    def _make(self, path: str) -> Any:
        if self._files is None or path not in self._files:
            raise ReadError(f"{path}: not a file this dataset opened")
        if self._open is None:
            return self._files.fd(path)
        try:
            return self._open(reopened(self._files, path))
        except Exception as e:
            raise ReadError(f"{path}: cannot open ({type(e).__name__}: {e})") from e

    def close(self) -> None:
        with self._lock:
            if self._open is not None:
                for fd in self._fds.values():
                    self._close(fd)
            self._fds.clear()


class Backend(ABC):
    """Moves blocks from files into a window buffer: host memory (cpu) or device memory (GPU backends)."""

    name: str
    #: What actually moves the bytes: "cpu", "pinned", "pinned-odirect", "gds", "kvikio-compat" or "mmap".
    io_mode: str
    #: Preferred window size: large enough to keep every reader busy, small enough to double-buffer.
    window_bytes_hint: int = 64 << 20
    #: Batches gathered ahead of the consumer unless the dataset is told otherwise.
    batches_ahead_hint: int = 2
    #: Every read copies from memory this backend locked for the dataset's life, which nothing writes: a
    #: block's bytes there, checked once, are the bytes of every later read of it (gdsload.codecs.verify).
    reads_locked_memory: bool = False

    @abstractmethod
    def allocate(self, nbytes: int) -> Any:
        """A uint8 window buffer of ``nbytes`` (allocated once per dataset, reused every window)."""

    @abstractmethod
    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        """Start carrying out ``requests`` into ``dest`` and return at once.

        Reads of the next window can be submitted before this one's finish, so the readers never idle at a
        window boundary. Once ``stop`` is set, reads not yet started are skipped.
        """

    def prepare(self, files: Any) -> None:
        """Called once, when a dataset opens, with every file it may read, already open
        (:class:`gdsload.format.files.ShardFiles`): reads go to those files, whatever is at their paths later.
        A backend that maps them does it here, so a dataset it cannot serve fails at open, not mid-epoch."""
        for handles in self.handles():
            handles.bind(files)

    def started(self) -> None:
        """Called once a pipeline's first batch is assembled: work a backend kept back so that the first window
        came first and that batch did not compete with it (the mmap backend's background load) may begin.
        Idempotent."""

    def handles(self) -> list[FileHandles]:
        """The backend's per-file handles, bound to the dataset's files by :meth:`prepare`."""
        return []

    def stats(self) -> dict[str, Any]:
        """The backend's settings and counters, JSON-ready (for benchmarks and ``GDSDataset.describe()``)."""
        return {}

    def load(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Any:
        """Submit and finish: the data is in ``dest``, or queued behind the returned event."""
        return self.submit(dest, requests, stop).finish()

    def expect(self, windows: Sequence[Any], reads_of: Callable[[Any], Sequence[Request]]) -> None:
        """The windows (block arrays) a pass submits next, in order, and the requests each makes through this
        backend and its host reader (``reads_of``, called as they come in reach): a backend that works ahead of
        its reads (the cached route's fetch, gdsload/backends/remote_cached.py) starts on them. Nothing here."""

    def passed(self, requests: Sequence[Request]) -> None:
        """The next window expected is not read through this backend after all (its buffer holds it since the
        open): work done ahead for it is dropped. Nothing here."""

    def idle(self) -> None:
        """No pass runs and no read is in flight (a pipeline stopped, or a read outside one is over): work done
        ahead of the reads stops. Nothing here."""

    def check_room(self, reads: Iterable[Sequence[Request]]) -> None:
        """Before any read: raise now (a ReadError) where one of ``reads`` (each what one read holds at once)
        could never be carried out, rather than after waits (the cached route: ``cache_bytes``). Nothing here."""

    def quiesce(self) -> None:
        """Wait until no device work the backend queued (copies, fills) still writes into a window buffer:
        called when a pipeline stops, before its buffers change hands. Host-side reads are already over
        then (the pipeline finished every one it submitted)."""

    def close(self) -> None:
        """Stop threads and free memory the backend holds."""
