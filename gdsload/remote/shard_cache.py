"""The node's shard cache: a remote dataset's pieces fetched into their sparse files, pinned, evicted under a bound.

A piece is locked by a byte-range lock on its bytes of its shard file (shared: a pin; exclusive: a fetch or an
eviction; :mod:`gdsload.remote.piece_files`). On disk, ``<version>.shards/`` beside the version's folder holds per
piece ``<id>.ok`` (the *present* marker, renamed into place once the bytes are written: for this boot until they
are synced behind the reads, :mod:`gdsload.remote.piece_sync`; its mtime is the last use), ``<id>.fill`` while
it is fetched (naming the pid and the bytes, touched after each ranged read) and ``<id>.failed`` (a failed
fetch's error, for those that waited on it); ``open.lock`` is held shared while a dataset has the version open,
and ``<cache_dir>/.gdsload-cache.lock`` serialises making room. A piece is read only while pinned and marked;
every wait ends within ``timeout_s``. Why: docs/remote.md, its opening and "Time bounds".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Iterator

from ..errors import GDSLoadError, ReadError
from . import client_for
from .objects import DEFAULT_TIMEOUT_S, ObjectChanged, Stopped, redact
from .mirror import PIECE_BYTES, STATE, Version
from .piece_files import (BOOT, LEDGER, lock_range, marker_valid, moved, open_range, progress, punch, pwrite_all,
                          read_json, read_ledger, remove, unheld, write_ledger, write_marker)
from .piece_sync import Syncer, Unsynced
from .pieces import Piece

__all__ = ["CACHE_LOCK", "LEDGER", "CacheFull", "ShardCache", "Stopped"]

#: The lock a process holds while it decides what to evict to make room (the whole cache folder's).
CACHE_LOCK = ".gdsload-cache.lock"
#: A scan that must evict frees this share of ``cache_bytes`` beyond the need, so the next fetches find room by
#: the ledger alone (a scan reads every marker of the folder).
SLACK = 16
#: How often a wait for another's lock looks again.
RETRY_S = 0.01


class CacheFull(ReadError):
    """No room for a piece under ``cache_bytes``: every piece that could make room is pinned."""

    def __init__(self, message: str, need: int, pinned: int):
        super().__init__(message)
        self.need, self.pinned = need, pinned


class ShardCache:
    """Pins of one version's pieces for one open dataset (thread-safe; :meth:`pin` blocks, on a fetcher
    thread). ``cache_bytes`` (None: no bound) bounds the bytes of shard data the whole cache folder holds."""

    def __init__(self, version: Version, cache_dir: str, cache_bytes: int | None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.version, self.cache_dir, self.cache_bytes, self.timeout_s = version, cache_dir, cache_bytes, timeout_s
        self.client = client_for(version.url, timeout_s)
        self.state = version.root + STATE
        os.makedirs(self.state, exist_ok=True)
        self._open = os.open(os.path.join(self.state, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._open, fcntl.LOCK_SH)  # this version is open: a private one is not removed under it
        if version.hold is not None:
            version.hold.close()  # the open's own lock, held from the skeleton's lock until this one
        self._lock = threading.Lock()
        self._syncer = Syncer()
        self.fetched_bytes = self.fetched = self.hits = self.evicted = 0
        self.fetched_from: set[str] = set()  # the shards (keys) some piece of which this dataset fetched

    # -- pins ----------------------------------------------------------------------------------------------
    def pin(self, piece: Piece, stop: threading.Event) -> int:
        """Pin ``piece``, fetching it first unless present: the descriptor of the pin (pass it to
        :meth:`unpin`). Waits for another's fetch or eviction while it moves (a ReadError once it has not for
        ``timeout_s``, or the error the fetch it waited on ended with); :class:`Stopped` once ``stop`` is set;
        the fetch's ReadError naming the URL, CacheFull without room."""
        lo, hi = piece.lo, piece.hi
        fd = os.open(piece.entry.path, os.O_RDWR | os.O_CLOEXEC)
        waited, seen, went = 0.0, None, 0.0  # since when (wall clock) it waited; the owner's progress, when
        try:
            while True:
                if stop.is_set():
                    raise Stopped()
                if lock_range(fd, lo, hi, fcntl.F_RDLCK):
                    if self._present(piece):
                        self._touch(piece)
                        with self._lock:
                            self.hits += 1
                        return fd
                    lock_range(fd, lo, hi, fcntl.F_UNLCK)
                if lock_range(fd, lo, hi, fcntl.F_WRLCK):  # none holds it: this one fetches (or finds it fetched)
                    if not self._present(piece):
                        if waited:
                            self._raise_failed(piece, waited)  # the fetch waited on failed: its error, not another try
                        self._fetch(piece, fd, stop)
                    if lock_range(fd, lo, hi, fcntl.F_RDLCK) and self._present(piece):  # EX -> SH, atomically
                        return fd
                    lock_range(fd, lo, hi, fcntl.F_UNLCK)
                    continue
                now, state = time.monotonic(), progress(self._id(piece) + ".fill")
                if not waited or state != seen:
                    waited, seen, went = waited or time.time(), state, now
                elif now - went > self.timeout_s:
                    owner = f"process {state[1]}" if state is not None else "another process"
                    raise ReadError(redact(f"{piece.entry.info.url}: no response for {self.timeout_s:g} s: its fetch "
                                           f"by {owner} has not moved (bytes {piece.name})"))
                time.sleep(RETRY_S * (0.5 + random.random()))  # two waiters do not keep meeting
        except BaseException:
            os.close(fd)  # closing the descriptor drops its lock
            raise

    def _raise_failed(self, piece: Piece, since: float) -> None:
        """Raise the error another's fetch of ``piece`` ended with at or after ``since`` (wall clock), if any."""
        try:
            with open(self._id(piece) + ".failed") as f:
                doc = json.load(f)
            if float(doc["time"]) < since:
                return
            message = str(doc["error"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        cls = ObjectChanged if doc.get("kind") == "ObjectChanged" else ReadError
        raise cls(f"{message} (in process {doc.get('pid')}, whose fetch this one waited on)")

    @staticmethod
    def unpin(fd: int) -> None:
        os.close(fd)

    def close(self) -> None:
        """Drop the version's open lock; a private version (no ETag) no other dataset holds is removed."""
        if self._open < 0:
            return
        self._syncer.close()
        if self.version.ident is None:
            import shutil

            if _try_flock(self._open, fcntl.LOCK_EX):
                shutil.rmtree(self.version.root, ignore_errors=True)
                shutil.rmtree(self.state, ignore_errors=True)
        os.close(self._open)
        self._open = -1

    def stats(self) -> dict[str, int]:
        return {"fetched_bytes": self.fetched_bytes, "fetched_shards": len(self.fetched_from),
                "fetched_pieces": self.fetched, "hits": self.hits, "evicted_pieces": self.evicted}

    # -- markers -------------------------------------------------------------------------------------------
    def _id(self, piece: Piece) -> str:
        shard = hashlib.sha256(piece.entry.key.encode()).hexdigest()[:24]
        return os.path.join(self.state, f"{shard}.{piece.name}")

    def _present(self, piece: Piece) -> bool:
        marker = read_json(self._id(piece) + ".ok")
        info = piece.entry.info
        return (marker is not None and marker.get("size") == info.size and marker.get("etag") == info.etag
                and marker.get("range") == [piece.lo, piece.hi] and marker_valid(marker))

    def _touch(self, piece: Piece) -> None:
        try:
            os.utime(self._id(piece) + ".ok")  # its last use, for the least-recently-used order
        except OSError:
            pass

    # -- fetch ---------------------------------------------------------------------------------------------
    def _fetch(self, piece: Piece, fd: int, stop: threading.Event) -> None:
        """Fetch the bytes of ``piece`` into its file, in place (``fd`` holds its lock exclusively), then write its
        marker: for this boot, the sync left to the syncer (synced first where the boot cannot be told). On any
        failure the bytes written are punched out again and no marker is written; a ReadError is also left in
        ``<id>.failed`` for the ranks that waited on this fetch."""
        base, need, entry = self._id(piece), piece.nbytes, piece.entry
        reserved, written = False, False
        try:
            self._make_room(piece, need)
            reserved = True
            for offset in range(piece.lo, piece.hi, PIECE_BYTES):
                if stop.is_set():
                    raise Stopped()
                data = self.client.read(entry.info, offset, min(PIECE_BYTES, piece.hi - offset), stop)  # If-Match
                written = True
                pwrite_all(fd, data, offset)
                moved(base + ".fill")
                with self._lock:
                    self.fetched_bytes += len(data)
                    self.fetched_from.add(entry.key)
            if BOOT is None:
                os.fdatasync(fd)
            marker = {"key": entry.key, "path": entry.path, "size": entry.info.size, "etag": entry.info.etag,
                      "data_bytes": need, "range": [piece.lo, piece.hi], "boot": BOOT, "synced": BOOT is None,
                      "fetch": f"{os.getpid()}-{time.time_ns()}"}  # this fetch's: the syncer marks no later one
            with self._room(self._accounted()):  # the reservation becomes the marker at once for a scan
                write_marker(base + ".ok", marker)
                remove(base + ".fill")
            if os.path.lexists(base + ".failed"):  # a look, not a change of the folder, where there is none
                remove(base + ".failed")
            with self._lock:
                self.fetched += 1
            if BOOT is not None:
                self._syncer.add(Unsynced(base + ".ok", marker, entry.path, piece.lo, piece.hi))
        except BaseException as e:
            if written:
                try:
                    punch(fd, piece.lo, piece.hi)
                except OSError:
                    pass  # no marker: it reads as absent whatever the file holds
            if reserved:
                with contextlib.suppress(OSError), self._room():
                    self._account(-need)
            if isinstance(e, OSError) and not isinstance(e, GDSLoadError):  # writing the cache failed
                raise ReadError(f"{self.cache_dir}: cannot write {redact(entry.info.url)} into the shard cache "
                                f"({errno.errorcode.get(e.errno or 0, 'OSError')}: {e.strerror or e}); free space "
                                f"in the cache folder or lower cache_bytes") from None
            if isinstance(e, ReadError) and not isinstance(e, CacheFull):
                with contextlib.suppress(OSError):
                    write_marker(base + ".failed", {"error": str(e), "kind": type(e).__name__, "time": time.time(),
                                                     "pid": os.getpid()})
            raise
        finally:
            remove(base + ".fill")

    def _make_room(self, piece: Piece, need: int) -> None:
        """Reserve ``need`` bytes (a ``.fill`` file, and the ledger), under the bound evicting least recently used
        pieces that no one pins; CacheFull when the pinned ones leave too little. The ledger (the bytes present
        and reserved, never fewer) decides without a scan while it leaves room; a scan (every marker read, stale
        reservations dropped) sets it right again whenever it does not, or is missing."""
        bound, url = self.cache_bytes, piece.entry.info.url
        if bound is not None and need > bound:
            raise CacheFull(redact(f"cache_bytes={bound} is smaller than one piece of a shard: {url} "
                                   f"bytes {piece.name} ({need} bytes; raise cache_bytes to at least {need})"),
                            need, 0)
        if not self._accounted():  # no bound, no ledger: nothing to reckon, nor to keep
            self._reserve(piece, need)
            return
        with self._room():
            used = read_ledger(self.cache_dir)
            if bound is not None and (used is None or used + need > bound):
                present, used = _scan(self.cache_dir)
                for when, size, ok, marker in sorted(present, key=lambda p: p[:3]):
                    if used + need <= bound - bound // SLACK:  # some room beyond the need: no scan next time
                        break
                    if self._evict(ok, marker):
                        used -= size
                if used + need > bound:
                    write_ledger(self.cache_dir, used)
                    raise CacheFull(redact(f"cache_bytes={bound} is too small: {url} needs {need} bytes and {used} "
                                           f"bytes of shards are in use by the open datasets' windows (at least "
                                           f"{used + need} bytes needed at once)"), need, used)
            self._reserve(piece, need)
            if used is not None:  # without a bound and a ledger, nothing to keep: a bound's first fetch scans
                write_ledger(self.cache_dir, used + need)

    def _reserve(self, piece: Piece, need: int) -> None:
        """Write the piece's ``.fill`` (its reservation, and where its fetch stands): in place, as a reader takes
        one it cannot parse for none (under a bound it is written under the folder's lock, which a scan holds)."""
        fill = os.open(self._id(piece) + ".fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fill, json.dumps({"size": need, "pid": os.getpid(), "path": piece.entry.path,
                                       "range": [piece.lo, piece.hi]}).encode())
        finally:
            os.close(fill)

    def _account(self, delta: int) -> None:
        """Add ``delta`` bytes to the ledger, if there is one (hold :meth:`_room`)."""
        used = read_ledger(self.cache_dir)
        if used is not None:
            write_ledger(self.cache_dir, max(0, used + delta))

    def _accounted(self) -> bool:
        """Whether room is reckoned: a bound, or a ledger a bounded dataset keeps in the folder (without either,
        a fetch takes no lock of the folder: a dataset without a bound does not keep one)."""
        return self.cache_bytes is not None or os.path.exists(os.path.join(self.cache_dir, LEDGER))

    @contextlib.contextmanager
    def _room(self, needed: bool = True) -> Iterator[None]:
        """The cache folder's lock (where ``needed``), held while room is reckoned, the ledger changed, and while
        a fetch's reservation becomes its marker (a listing that runs beside a rename may see neither name)."""
        if not needed:
            yield
            return
        lock = os.open(os.path.join(self.cache_dir, CACHE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held for a scan or a rename: no fetch waits on it long
            yield
        finally:
            os.close(lock)

    def _evict(self, ok: str, marker: dict) -> bool:
        """Evict one piece (its marker ``ok``) if no one holds its lock; whether it was."""
        try:
            path, (lo, hi) = marker["path"], marker["range"]
            fd = open_range(path, int(lo), int(hi), fcntl.F_WRLCK)
        except (KeyError, TypeError, ValueError):  # a marker of no piece (another format): its bytes read as absent
            remove(ok)
            return True
        if fd is None:
            if os.path.exists(path):
                return False  # pinned, or being fetched
            remove(ok)
            return True  # its file is gone with its version
        try:
            remove(ok)  # first: from here on it reads as absent
            punch(fd, int(lo), int(hi))
            with self._lock:
                self.evicted += 1
            return True
        finally:
            os.close(fd)


def _scan(cache_dir: str) -> tuple[list[tuple[float, int, str, dict]], int]:
    """Every present piece of the cache folder as (last use, data bytes, marker path, marker), and the bytes
    held: present pieces and fetches in progress (a ``.fill`` whose bytes no one locks is stale: removed)."""
    present, used = [], 0
    for name in os.listdir(cache_dir):
        if not name.endswith(STATE):
            continue
        folder = os.path.join(cache_dir, name)
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for f in entries:
            kind = f.rpartition(".")[2]
            path = os.path.join(folder, f)
            if kind not in ("ok", "fill"):
                continue
            try:
                marker = read_json(path)
                size = int(marker.get("data_bytes", marker.get("size", 0))) if kind == "ok" else int(marker["size"])
                when = os.stat(path).st_mtime
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if kind == "fill" and _stale(marker):
                remove(path)
                continue
            used += size
            if kind == "ok":
                present.append((when, size, path, marker))
    return present, used


def _stale(fill: dict) -> bool:
    """Whether a fetch's reservation was left by a process that died (no one locks its bytes)."""
    try:
        lo, hi = fill["range"]
        return unheld(fill["path"], int(lo), int(hi))
    except (KeyError, TypeError, ValueError):
        return True  # of another format


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
