"""Parts of files read once in the background, those waited for first: the mmap backend's load at open.

A *unit* is a byte range of a file, read in chunks through the page cache; ``done(key)`` runs on the reader
thread once its last chunk is in (the mmap backend locks the range there), ``on_start()`` first on each thread.
Made with ``hold``, only units waited for load until :meth:`Preloader.start`. A failure is kept with its unit
and raised to whoever waits for it. No CUDA here (docs/design.md, "`mmap`: the RAM tier").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from ..base import pread_full
from ...errors import GDSLoadError, ReadError
from ..handoff import POLL_S

CHUNK_BYTES = 8 << 20


class Preloader:
    """Loads ``units`` (key -> (path, offset, nbytes), in load order) from ``fd(path)`` on ``threads``
    threads, calling ``done(key)`` once each unit is read. :meth:`wait` blocks until the units it names are
    done (moving them to the front first); :meth:`close` stops the threads (from any thread) and returns
    once they are gone."""

    def __init__(self, units: dict[Hashable, tuple[str, int, int]], fd: Callable[[str], int],
                 done: Callable[[Any], None], threads: int, chunk_bytes: int = CHUNK_BYTES, hold: bool = False,
                 on_start: Callable[[], Any] | None = None):
        """``hold``: load only the units :meth:`wait` names until :meth:`start` is called; ``on_start``: run
        first on each thread (must not raise)."""
        if threads < 1 or chunk_bytes < 1:
            raise ValueError(f"threads and chunk_bytes must be positive (found {threads}, {chunk_bytes})")
        self._fd, self._done, self._chunk, self._on_start = fd, done, chunk_bytes, on_start
        self._units = dict(units)
        # Offsets not yet handed to a thread, per unit; an empty unit is one chunk of no bytes (its done()
        # still runs).
        self._todo = {k: deque(range(o, o + n, chunk_bytes) or [o]) for k, (_, o, n) in units.items()}
        self._left = {k: len(q) for k, q in self._todo.items()}  # chunks not yet read, per unit
        self._order: deque[Hashable] = deque(units)
        self._urgent: deque[Hashable] = deque()
        self._ready: set[Hashable] = set()
        self._errors: dict[Hashable, BaseException] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._bulk = not hold  # the threads may go on to units nobody waits for
        self.started = time.perf_counter()
        self.finished: float | None = None if units else self.started  # when the last unit was done (or failed)
        self._threads = [threading.Thread(target=self._run, name=f"gdsload-preload-{i}", daemon=True)
                         for i in range(min(threads, sum(self._left.values())))]
        for t in self._threads:
            t.start()

    def _next(self) -> tuple[Hashable, int] | None:
        """The next chunk to read (called under the lock): units waited for first, then the load order (once
        the bulk may load)."""
        for q in (self._urgent, self._order) if self._bulk else (self._urgent,):
            while q:
                todo = self._todo[q[0]]
                if todo:
                    return q[0], todo.popleft()
                q.popleft()
        return None

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        buf = None
        while True:
            with self._cond:
                while not self._closing and (got := self._next()) is None and not self._bulk:
                    self._cond.wait()  # held: until a unit is waited for, start() or close()
                if self._closing or got is None:
                    return
            key, offset = got
            path, start, nbytes = self._units[key]
            n = min(self._chunk, start + nbytes - offset)
            try:
                if n > 0:
                    if buf is None:
                        buf = np.empty(self._chunk, dtype=np.uint8)
                    pread_full(self._fd(path), memoryview(buf)[:n], offset, path)
                with self._cond:
                    self._left[key] -= 1
                    last = self._left[key] == 0 and key not in self._errors
                if last:
                    self._done(key)
                    self._settle(key, None)
            except BaseException as e:
                self._settle(key, e)

    def _settle(self, key: Hashable, error: BaseException | None) -> None:
        """Unit ``key`` is done, or failed with ``error`` (its chunks not yet started are dropped)."""
        with self._cond:
            if error is None:
                self._ready.add(key)
            elif key not in self._errors:
                self._errors[key] = error
                self._todo[key].clear()
            if len(self._ready) + len(self._errors) == len(self._units) and self.finished is None:
                self.finished = time.perf_counter()
            self._cond.notify_all()

    def wait(self, keys: Iterable[Hashable], stop: threading.Event | None = None) -> bool:
        """Block until every unit of ``keys`` is done: True; False once ``stop`` is set or the loader is
        closed first. A unit that failed raises its error (a ReadError naming its file)."""
        keys = list(dict.fromkeys(keys))
        with self._cond:
            for k in keys:
                if k not in self._units:
                    raise ReadError(f"internal error: {k} is not among the parts of files loaded")
            waiting = [k for k in keys if k not in self._ready]
            self._urgent.extend(k for k in waiting if self._todo[k])
            self._cond.notify_all()  # threads held back wake for them
            while True:
                for k in waiting:
                    if k in self._errors:
                        raise _as_read_error(self._units[k][0], self._errors[k])
                if all(k in self._ready for k in waiting):
                    return True
                if self._closing or (stop is not None and stop.is_set()):
                    return False
                self._cond.wait(POLL_S)

    def ready(self, keys: Iterable[Hashable]) -> set[Hashable]:
        """Which units of ``keys`` are done, without waiting or moving any forward (a unit that failed raises its
        error, as :meth:`wait`)."""
        with self._cond:
            for k in keys:
                if k in self._errors:
                    raise _as_read_error(self._units[k][0], self._errors[k])
            return {k for k in keys if k in self._ready}

    def start(self) -> None:
        """Let the threads go on to every unit, in load order (idempotent; nothing to do without ``hold``)."""
        with self._cond:
            self._bulk = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop reading: chunks not started are dropped; returns once every thread has ended (a ``done``
        under way finishes first). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def stats(self) -> dict[str, Any]:
        """Bytes loaded, of how many, and the seconds from start to the last unit (None while loading)."""
        with self._cond:
            done = list(self._ready)
        return {"bytes_loaded": sum(self._units[k][2] for k in done),
                "bytes": sum(n for _, _, n in self._units.values()),
                "load_s": None if self.finished is None else self.finished - self.started}


def _as_read_error(path: str, e: BaseException) -> BaseException:
    """A loader failure as the consumer sees it: gdsload's own errors as they are (they name the file),
    anything else a ReadError naming it."""
    if isinstance(e, GDSLoadError):
        return e
    err = ReadError(f"{path}: loading it into memory failed ({type(e).__name__}: {e})")
    err.__cause__ = e
    return err
