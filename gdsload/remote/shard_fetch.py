"""A rank's shard pieces fetched ahead of its reads, for the cached route's backend (backends/remote_cached.py).

:class:`RemoteShards` runs up to :data:`FETCH_THREADS` ``gdsload-fetch`` threads over the windows ``expect`` hands
it in plan order (at most :data:`AHEAD_WINDOWS` ahead), the pieces a read waits for (``acquire``) first. A piece
fetched stays pinned in :class:`gdsload.remote.shard_cache.ShardCache` while a window that reads it is ahead or in
flight; ``release`` unpins what no window needs. A fetch error is raised, naming the URL, by the ``acquire`` of a
window that reads the piece. ``stop`` wakes and joins the threads and unpins everything; every wait ends within
``timeout_s``; ``check_room`` refuses at open a ``cache_bytes`` too small for one read (docs/remote.md).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from .._tasks import POLL_S
from ..errors import ReadError
from .objects import DEFAULT_TIMEOUT_S, redact
from .mirror import Version, open_version
from ..format.layout import DatasetLayout
from .pieces import Piece, chunk_starts, covering, cut, pieces_of
from .shard_cache import CacheFull, ShardCache, Stopped

#: What a read names: a shard file (all of it) or bytes of one, ``(path, offset, nbytes)``.
Item = Union[str, tuple[str, int, int]]

#: Windows fetched ahead of the one submitted.
AHEAD_WINDOWS = 4
#: Pieces fetched at once.
FETCH_THREADS = 8
#: A reader's last resort: how many ``timeout_s`` it waits for a window's shards while no fetch of them moves
#: (the client's, the cache's and the room's bounds end every wait first).
STALL_TIMEOUTS = 4


class Ticket:
    """The pieces one window reads, pinned until :meth:`RemoteShards.release`; ``stopped``: the wait ended
    because reading stops (nothing was pinned, nothing may be read)."""

    def __init__(self, seq: int, paths: tuple[Piece, ...], stopped: bool = False):
        self.seq, self.paths, self.stopped = seq, paths, stopped


class RemoteShards:
    """A remote dataset's version in the node's cache, and the fetching of its shards ahead of the reads."""

    def __init__(self, version: Version, cache: ShardCache):
        self.version, self.cache, self.timeout_s = version, cache, cache.timeout_s
        self._cv = threading.Condition()
        self._queue: deque[tuple[int, Any]] = deque()  # windows expected, not yet acquired: (seq, blocks)
        self._paths: dict[int, tuple[Piece, ...]] = {}  # of queued windows, computed as they come in reach
        self._paths_of: Callable[[Any], Sequence[Item]] | None = None
        self._cut = {p: pieces_of(e, cut(e, None)) for p, e in version.shards.items()}  # shard -> its pieces
        self._need: dict[Piece, set[int]] = {}  # piece -> the windows (seqs) ahead or in flight that read it
        self._acquired: Counter[int] = Counter()  # window (seq) -> its parts acquired and not released
        self._pins: dict[Piece, int] = {}  # piece -> descriptor of its pin
        self._busy: set[Piece] = set()
        self._errors: dict[Piece, BaseException] = {}
        self._full_at = -1  # the seq no room was found for: windows past it are not fetched until a release
        self._full_since: dict[Piece, tuple[float, int]] = {}  # piece waited for -> (since when, pinned) no room
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @classmethod
    def open(cls, url: str, cache_dir: str, cache_bytes: int | None, timeout_s: float = DEFAULT_TIMEOUT_S
             ) -> RemoteShards:
        if cache_bytes is not None and (isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int)
                                        or cache_bytes < 1):
            raise ValueError(f"cache_bytes must be a positive int or None (found {cache_bytes!r})")
        version = open_version(url, os.fspath(cache_dir), timeout_s)
        return cls(version, ShardCache(version, os.fspath(cache_dir), cache_bytes, timeout_s))

    @property
    def root(self) -> str:
        return self.version.root

    def describe(self) -> dict[str, Any]:
        return {"url": redact(self.version.url), "cache_dir": self.cache.cache_dir, "version": self.version.root,
                "cache_bytes": self.cache.cache_bytes, "ahead_windows": AHEAD_WINDOWS, "timeout_s": self.timeout_s,
                **self.cache.stats()}

    def divide(self, layout: DatasetLayout) -> None:
        """Cut each shard file of ``layout`` at its chunks' offsets (:func:`gdsload.remote.pieces.cut`); before
        any read. A shard it does not hold stays one piece."""
        starts = chunk_starts(layout.block_offsets, layout.chunk_files, {k: layout.paths(k) for k in layout.keys})
        with self._cv:
            for path, offsets in starts.items():
                entry = self.version.shards.get(path)
                if entry is not None:
                    self._cut[path] = pieces_of(entry, cut(entry, offsets))

    def pieces(self, items: Iterable[Item]) -> tuple[Piece, ...]:
        """The pieces that ``items`` (shard files, whole, or ``(path, offset, nbytes)``) read, each once, in
        order; files that are not shards of the version (metadata, kept whole) have none."""
        out: set[Piece] = set()
        for item in items:
            if isinstance(item, str):
                out.update(self._cut.get(item, ()))
            elif item[0] in self._cut:
                out.update(covering(self._cut[item[0]], item[1], item[2]))
        return tuple(sorted(out, key=lambda p: (p.entry.path, p.lo)))

    def check_room(self, reads: Sequence[Sequence[Item]]) -> None:
        """CacheFull now, where ``cache_bytes`` cannot hold the pieces of the largest of ``reads`` (each what one
        read pins together: a window, a resident field, every shard for a backend that locks them): that read
        would wait for room its own pins hold. (What the node's other ranks pin beside it is not known here: a
        wait for that room ends once nothing on the node has moved for ``timeout_s``.)"""
        bound = self.cache.cache_bytes
        if bound is None:
            return
        most, largest, one = 0, (), None  # the most one read pins, its pieces; the largest piece
        for items in reads:
            pieces = self.pieces(items)
            if sum(p.nbytes for p in pieces) > most:
                most, largest = sum(p.nbytes for p in pieces), pieces
            for p in pieces:
                one = p if one is None or p.nbytes > one.nbytes else one
        if one is not None and one.nbytes > bound:
            raise CacheFull(redact(f"cache_bytes={bound} is smaller than one piece of a shard: {one.entry.info.url} "
                                   f"bytes {one.name} ({one.nbytes} bytes; raise cache_bytes to at least "
                                   f"{one.nbytes})"), one.nbytes, 0)
        if most > bound:
            raise CacheFull(redact(f"cache_bytes={bound} is too small: one read of this dataset pins {len(largest)} "
                                   f"pieces of shards at once ({most} bytes of data, e.g. "
                                   f"{largest[0].entry.info.url}); raise cache_bytes to at least {most} (or read "
                                   f"smaller windows: window_blocks)"), most, 0)

    # -- the reads' side ------------------------------------------------------------------------------------
    def expect(self, windows: Sequence[Any], paths_of: Callable[[Any], Sequence[Item]]) -> None:
        """The windows (block arrays) submitted next, in order: fetched ahead, replacing any expected before."""
        with self._cv:
            for seq, _ in self._queue:
                self._forget(seq)
            self._queue.clear()
            self._paths_of = paths_of
            for blocks in windows:
                self._seq += 1
                self._queue.append((self._seq, blocks))
            self._start()
            self._cv.notify_all()

    def acquire(self, paths: Sequence[Item], stop: threading.Event) -> Ticket:
        """Wait until the pieces ``paths`` read are pinned (the next expected window's, or any: the first window,
        the resident fields). A fetch's ReadError is raised here; a stop returns a stopped ticket."""
        shards = self.pieces(paths)
        with self._cv:
            seq = self._take(shards, passed=False)
            self._acquired[seq] += 1
            for p in shards:
                self._need.setdefault(p, set()).add(seq)
            ticket = Ticket(seq, shards)
            self._start()
            self._cv.notify_all()
            limit = STALL_TIMEOUTS * self.timeout_s
            deadline, seen = time.monotonic() + limit, None
            while True:
                failed = next((self._errors[p] for p in shards if p in self._errors), None)
                if failed is not None:
                    self._release(ticket)
                    raise failed if isinstance(failed, ReadError) else ReadError(str(failed))
                if stop.is_set() or self._stop.is_set():
                    self._release(ticket)
                    return Ticket(seq, (), stopped=True)
                now = sum(p in self._pins for p in shards)
                if now == len(shards):
                    return ticket
                moved = (now, self.cache.fetched_bytes, tuple(self._full_since.values()))
                if moved != seen:  # progress: the wait is bounded while nothing moves, not for the whole window
                    deadline, seen = time.monotonic() + limit, moved
                if time.monotonic() > deadline:
                    self._release(ticket)
                    missing = [p.entry.info.url for p in shards if p not in self._pins]
                    raise ReadError(redact(f"{missing[0]}: not in the shard cache after {limit:g} s in which no fetch "
                                           f"of the window's shards moved (timeout_s={self.timeout_s:g})"))
                self._cv.wait(POLL_S)

    def passed(self, paths: Sequence[Item]) -> None:
        """The next expected window's ``paths`` are not read after all (its buffer holds them since the open)."""
        with self._cv:
            self._take(self.pieces(paths), passed=True)

    def release(self, ticket: Ticket) -> None:
        """The window's reads are over: its shards are unpinned where no other window needs them."""
        with self._cv:
            self._release(ticket)

    def stop(self, everything: bool = False) -> None:
        """Stop the fetcher threads, wait for them, and unpin every shard but those of windows acquired and not
        released (``everything``: those too). Call it once no read is in flight."""
        with self._cv:
            self._stop.set()
            self._cv.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            if t is not threading.current_thread():
                t.join()
        with self._cv:
            held = Counter() if everything else self._acquired
            for p in list(self._pins):
                if everything or not self._need.get(p, set()) & held.keys():
                    self.cache.unpin(self._pins.pop(p))
            self._need = {p: users & held.keys() for p, users in self._need.items() if users & held.keys()}
            self._acquired = Counter(held)
            self._queue.clear()
            self._paths.clear()
            self._errors.clear()
            self._busy.clear()
            self._full_at = -1
            self._full_since.clear()
            self._stop = threading.Event()

    def close(self) -> None:
        self.stop(everything=True)
        self._closed = True
        self.cache.close()

    # -- inside (with self._cv held) -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._closed:
            raise ReadError(f"{self.version.url}: the dataset was closed")
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < FETCH_THREADS:
            t = threading.Thread(target=self._run, args=(self._stop,), name="gdsload-fetch", daemon=True)
            t.start()
            self._threads.append(t)

    def _window_paths(self, seq: int) -> tuple[Piece, ...]:
        if seq not in self._paths:
            blocks = next(b for s, b in self._queue if s == seq)
            self._paths[seq] = self.pieces(self._paths_of(blocks) if self._paths_of is not None else ())
        return self._paths[seq]

    def _take(self, shards: tuple[Piece, ...], passed: bool) -> int:
        """The window of a read of ``shards`` (its seq): the next window expected where they are among the pieces
        it still needs (a window may be read in parts that pin apart: its reads through the backend, and through
        its host reader), else a window of its own. ``passed``: they are not read after all (its buffer holds
        them since the open). A window expected leaves the queue once every piece of it was taken."""
        rest = self._window_paths(self._queue[0][0]) if self._queue else ()
        if not self._queue or not set(shards) <= set(rest):
            self._seq += 1
            return self._seq
        head = self._queue[0][0]
        if passed:
            for p in shards:
                self._drop_need(p, head)
        self._paths[head] = tuple(p for p in rest if p not in set(shards))
        if not self._paths[head]:
            self._queue.popleft()
            self._paths.pop(head)
        return head

    def _forget(self, seq: int) -> None:
        """Window ``seq`` no longer reads anything: unpin the shards no other window needs."""
        self._acquired.pop(seq, None)
        for p in self._paths.pop(seq, ()):
            self._drop_need(p, seq)

    def _release(self, ticket: Ticket) -> None:
        self._acquired[ticket.seq] -= 1
        if self._acquired[ticket.seq] <= 0:
            del self._acquired[ticket.seq]
        for p in ticket.paths:
            self._drop_need(p, ticket.seq)
        self._full_at = -1  # room may have come: fetching ahead goes on
        self._cv.notify_all()

    def _drop_need(self, path: Piece, seq: int) -> None:
        users = self._need.get(path)
        if users is None:
            return
        users.discard(seq)
        if not users:
            del self._need[path]
            fd = self._pins.pop(path, None)
            if fd is not None:
                self.cache.unpin(fd)
            self._errors.pop(path, None)

    def _next(self) -> tuple[Piece, int] | None:
        """The next shard to pin and the first window that needs it: those waited for first, then the
        windows ahead in order (not past one no room was found for)."""
        def todo(p: Piece) -> bool:
            return p not in self._pins and p not in self._busy and p not in self._errors

        for p, users in self._need.items():
            if todo(p) and users & self._acquired.keys():
                return p, min(users & self._acquired.keys())
        for seq, _ in list(itertools.islice(self._queue, AHEAD_WINDOWS)):
            if 0 <= self._full_at < seq:
                return None
            for p in self._window_paths(seq):
                self._need.setdefault(p, set()).add(seq)
            for p in self._paths[seq]:
                if todo(p):
                    return p, seq
        return None

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self._cv:
                job = None
                while not stop.is_set() and (job := self._next()) is None:
                    self._cv.wait(POLL_S)
                if stop.is_set():
                    return
                path, seq = job  # type: ignore[misc]
                self._busy.add(path)
                urgent = seq in self._acquired
            try:
                fd = self.cache.pin(path, stop)
            except Stopped:
                return
            except CacheFull as e:
                with self._cv:
                    self._busy.discard(path)
                    wait = self._room(path, seq, urgent, e)
                if wait:
                    stop.wait(POLL_S)  # the windows in flight here or on the node's other ranks make room
                continue
            except BaseException as e:  # noqa: BLE001 - kept for the window that reads it
                with self._cv:
                    self._busy.discard(path)
                    self._errors[path] = e
                    self._cv.notify_all()
                continue
            with self._cv:
                self._busy.discard(path)
                self._full_since.pop(path, None)
                if path in self._need and not stop.is_set():
                    self._pins[path] = fd
                else:
                    self.cache.unpin(fd)
                self._cv.notify_all()

    def _room(self, path: Piece, seq: int, urgent: bool, e: CacheFull) -> bool:
        """No room under ``cache_bytes`` for ``path`` (first needed by window ``seq``): unpin what only windows
        after it need, and stop fetching ahead past it until a release. For a window waited for now, once the
        bytes pinned on the node have not changed for ``timeout_s``, the CacheFull is its error. Whether to wait
        before trying again."""
        later = [p for p, users in self._need.items() if p in self._pins and min(users) > seq
                 and not users & self._acquired.keys()]
        for p in later:
            self.cache.unpin(self._pins.pop(p))
        if not urgent:
            self._full_at = seq if self._full_at < 0 else min(self._full_at, seq)
            return False
        since, pinned = self._full_since.get(path, (time.monotonic(), -1))
        if pinned != e.pinned:  # the node's windows moved: room may come
            since, pinned = time.monotonic(), e.pinned
        self._full_since[path] = (since, pinned)
        if e.pinned == 0 or time.monotonic() - since > self.timeout_s:
            self._errors[path] = e
            self._cv.notify_all()
            return False
        return not later
