"""The cached route of a remote dataset: the local backend wrapped, each read's pieces pinned from submit to finish.

``submit`` (and ``load``) waits until the pieces its requests read are present and pins them (a fetch error is
that window's ReadError); the pins go with the work's ``finish``. ``expect`` hands a pass's windows to the fetch
threads (:mod:`gdsload.remote.shard_fetch`), ``passed`` drops one already held, ``idle`` stops the threads,
``check_room`` refuses at open what ``cache_bytes`` cannot hold; under mmap every shard is pinned from
``prepare`` on (:attr:`CachedBackend.whole`). docs/remote.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._tasks import Pending, Queued
from ..errors import GDSLoadError
from ..remote.shard_fetch import RemoteShards, Ticket
from .base import Backend, ReadRequest, Request
from .cpu import CpuBackend


def ranges(requests: Iterable[Request]) -> list[tuple[str, int, int]]:
    """The byte ranges ``requests`` read from files: (path, offset, nbytes)."""
    return [(r.path, r.offset, r.nbytes) for r in requests if isinstance(r, ReadRequest)]


class CachedBackend(Backend):
    """``inner`` (the backend ``auto`` or the user chose) reading a remote dataset's shards from the node's cache,
    each read's pieces pinned while it runs. ``shards`` belongs to the dataset's source, which closes it."""

    def __init__(self, inner: Backend, shards: RemoteShards):
        self.inner, self.shards = inner, shards
        self.name, self.io_mode = inner.name, inner.io_mode
        self.window_bytes_hint, self.batches_ahead_hint = inner.window_bytes_hint, inner.batches_ahead_hint
        self.reads_locked_memory = inner.reads_locked_memory
        self.whole: Ticket | None = None  # every shard, pinned for the dataset's life (a backend that locks them)

    def allocate(self, nbytes: int) -> Any:
        return self.inner.allocate(nbytes)

    def prepare(self, files: Any) -> None:
        if self.inner.reads_locked_memory:  # it locks every file: every shard is fetched now
            paths = list(files)
            self.shards.check_room([paths])
            self.whole = self.shards.acquire(paths, threading.Event())
            self.shards.stop()
        self.inner.prepare(files)

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        ticket = self.shards.acquire(ranges(requests), stop)
        if ticket.stopped:
            return Queued(None)  # reading stops: nothing read
        try:
            return _Pinned(self.inner.submit(dest, requests, stop), self.shards, ticket)
        except BaseException:
            self.shards.release(ticket)
            raise

    def load(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Any:
        ticket = self.shards.acquire(ranges(requests), stop)
        if ticket.stopped:
            raise GDSLoadError(f"{self.shards.root}: the dataset was closed while it was read")
        try:
            return self.inner.load(dest, requests, stop)
        finally:
            self.shards.release(ticket)

    def host_reader(self) -> Backend:
        """What reads a window's host buffer (compressed chunks CPU threads decode): POSIX reads of the same
        cache, pinned the same way (one window's two parts pin apart: :meth:`RemoteShards.acquire`)."""
        return CachedBackend(CpuBackend(), self.shards)

    def expect(self, windows: Sequence[Any], reads_of: Callable[[Any], Sequence[Request]]) -> None:
        self.shards.expect(windows, lambda blocks: ranges(reads_of(blocks)))

    def passed(self, requests: Sequence[Request]) -> None:
        self.shards.passed(ranges(requests))

    def idle(self) -> None:
        self.shards.stop()

    def check_room(self, reads: Iterable[Sequence[Request]]) -> None:
        self.shards.check_room([ranges(r) for r in reads])

    def started(self) -> None:
        self.inner.started()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def quiesce(self) -> None:
        self.inner.quiesce()

    def close(self) -> None:
        self.inner.close()  # the pins (the whole dataset's too) go when the source closes the shards


class _Pinned(Pending):
    """One read's work, its pieces pinned until it is over."""

    def __init__(self, pending: Pending, shards: RemoteShards, ticket: Ticket):
        self.pending, self.shards = pending, shards
        self.ticket: Ticket | None = ticket

    def finish(self) -> Any:
        try:
            return self.pending.finish()
        finally:
            ticket, self.ticket = self.ticket, None
            if ticket is not None:
                self.shards.release(ticket)
