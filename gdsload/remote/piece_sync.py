"""Pieces of the node's shard cache marked before their bytes were synced, synced behind the reads.

A fetch marks its piece present for this boot at once (:mod:`gdsload.remote.piece_files`) and hands it here; the
``gdsload-sync`` thread syncs the shard files (``fdatasync``, once per file for all the pieces waiting) and
rewrites each marker ``synced``, holding the piece's shared lock so an eviction cannot come between (a piece
locked exclusively is tried again, a while; one whose marker changed is left as it is: read in this boot, fetched
again after a reboot).
:meth:`Syncer.close` stops the thread and syncs what is left (docs/remote.md).
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import NamedTuple

from .piece_files import open_range, read_json, write_marker


#: Seconds before a piece another holds exclusively (a fetch converting its lock, an eviction) is tried again,
#: and how many times (then it is left as it is: read in this boot, fetched again after a reboot).
RETRY_S = 0.05
RETRIES = 100


class Unsynced(NamedTuple):
    """A piece marked for this boot: its marker's path and content, its shard file and bytes."""

    ok: str
    marker: dict
    path: str
    lo: int
    hi: int
    tries: int = 0


class Syncer:
    """Syncs the pieces :meth:`add` is given on a thread of its own, started on the first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: list[Unsynced] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.synced = 0

    def add(self, piece: Unsynced) -> None:
        with self._cv:
            if self._closed:
                sync([piece])
                return
            self._pending.append(piece)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gdsload-sync", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the thread (after the batch it is syncing) and sync what is left."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            rest, self._pending = self._pending, []
        self.synced += sync(rest)[0]

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._pending = self._pending, []
            done, busy = sync(batch)
            self.synced += done
            busy = [p._replace(tries=p.tries + 1) for p in busy if p.tries < RETRIES]
            if busy:
                with self._cv:
                    self._pending.extend(busy)
                    self._cv.wait(RETRY_S)


def sync(pieces: list[Unsynced]) -> tuple[int, list[Unsynced]]:
    """Sync the shard files of ``pieces``, then mark each synced: how many were, and those another held
    exclusively."""
    done, ok_files, busy = 0, set(), []
    for path in {p.path for p in pieces}:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            ok_files.add(path)
        except OSError:
            pass  # the markers stay as they are: read in this boot only
    for p in pieces:
        if p.path not in ok_files:
            continue
        fd = open_range(p.path, p.lo, p.hi, fcntl.F_RDLCK)
        if fd is None:
            if os.path.exists(p.path):
                busy.append(p)
            continue
        try:
            if read_json(p.ok) == p.marker:  # not evicted (nor fetched again) since
                write_marker(p.ok, {**p.marker, "synced": True})
                done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done, busy
