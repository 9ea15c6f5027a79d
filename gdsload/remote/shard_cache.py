"""The node's shard cache: a remote dataset's pieces fetched into their sparse files, pinned, evicted under a bound.

On disk, ``<version>.shards/`` beside the version's folder holds per piece ``<id>.lock`` (``flock``: shared is a
pin, exclusive a fetch or an eviction), ``<id>.ok`` (the *present* marker, renamed into place once the bytes are
written and synced; its mtime is the last use), ``<id>.fill`` while it is fetched (naming the pid, touched after
each ranged read) and ``<id>.failed`` (a failed fetch's error, for those that waited on it); ``open.lock`` is held
shared while a dataset has the version open, and ``<cache_dir>/.gdsload-cache.lock`` serialises making room. A
piece is read only while pinned and marked; every wait ends within ``timeout_s``. Why: docs/remote.md, its
opening and "Time bounds".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
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
from .pieces import Piece

#: The lock a process holds while it decides what to evict to make room (the whole cache folder's).
CACHE_LOCK = ".gdsload-cache.lock"
#: The cache folder's ledger: the bytes of pieces present and reserved, at least (changed under ``CACHE_LOCK``).
LEDGER = ".gdsload-cache.used"
#: A scan that must evict frees this share of ``cache_bytes`` beyond the need, so the next fetches find room by
#: the ledger alone (a scan reads every marker of the folder).
SLACK = 16
#: How often a wait for another's lock looks again.
RETRY_S = 0.01
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


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
        self.fetched_bytes = self.fetched = self.hits = self.evicted = 0
        self.fetched_from: set[str] = set()  # the shards (keys) some piece of which this dataset fetched

    # -- pins ----------------------------------------------------------------------------------------------
    def pin(self, piece: Piece, stop: threading.Event) -> int:
        """Pin ``piece``, fetching it first unless present: the descriptor of the pin (pass it to
        :meth:`unpin`). Waits for another's fetch or eviction while it moves (a ReadError once it has not for
        ``timeout_s``, or the error the fetch it waited on ended with); :class:`Stopped` once ``stop`` is set;
        the fetch's ReadError naming the URL, CacheFull without room."""
        fd = os.open(self._lock_path(piece), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        waited, seen, moved = 0.0, None, 0.0  # since when (wall clock) it waited; the owner's progress, when
        try:
            while True:
                if stop.is_set():
                    raise Stopped()
                if _try(fd, fcntl.LOCK_SH):
                    if self._present(piece):
                        self._touch(piece)
                        with self._lock:
                            self.hits += 1
                        return fd
                    fcntl.flock(fd, fcntl.LOCK_UN)
                if _try(fd, fcntl.LOCK_EX):  # none holds it: this one fetches (or finds it fetched meanwhile)
                    if not self._present(piece):
                        if waited:
                            self._raise_failed(piece, waited)  # the fetch waited on failed: its error, not another try
                        self._fetch(piece, stop)
                    if _try(fd, fcntl.LOCK_SH) and self._present(piece):  # EX -> SH: no evictor comes between
                        return fd
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    continue
                now, state = time.monotonic(), _progress(self._id(piece) + ".fill")
                if not waited or state != seen:
                    waited, seen, moved = waited or time.time(), state, now
                elif now - moved > self.timeout_s:
                    owner = f"process {state[1]}" if state is not None else "another process"
                    raise ReadError(redact(f"{piece.entry.info.url}: no response for {self.timeout_s:g} s: its fetch "
                                           f"by {owner} has not moved (lock {self._lock_path(piece)})"))
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
        if self.version.ident is None:
            import shutil

            if _try(self._open, fcntl.LOCK_EX):
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

    def _lock_path(self, piece: Piece) -> str:
        return self._id(piece) + ".lock"

    def _present(self, piece: Piece) -> bool:
        try:
            with open(self._id(piece) + ".ok") as f:
                marker = json.load(f)
        except (OSError, ValueError):
            return False
        info = piece.entry.info
        return (marker.get("size") == info.size and marker.get("etag") == info.etag
                and marker.get("range") == [piece.lo, piece.hi])

    def _touch(self, piece: Piece) -> None:
        try:
            os.utime(self._id(piece) + ".ok")  # its last use, for the least-recently-used order
        except OSError:
            pass

    # -- fetch ---------------------------------------------------------------------------------------------
    def _fetch(self, piece: Piece, stop: threading.Event) -> None:
        """Fetch the bytes of ``piece`` into its file, in place (holding its lock exclusively), then sync them
        and write its marker. On any failure the bytes written are punched out again and no marker is written;
        a ReadError is also left in ``<id>.failed`` for the ranks that waited on this fetch."""
        base, need, entry = self._id(piece), piece.nbytes, piece.entry
        fd, reserved = -1, False
        try:
            self._make_room(piece, need)
            reserved = True
            fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC)
            for offset in range(piece.lo, piece.hi, PIECE_BYTES):
                if stop.is_set():
                    raise Stopped()
                data = self.client.read(entry.info, offset, min(PIECE_BYTES, piece.hi - offset), stop)  # If-Match
                _pwrite_all(fd, data, offset)
                _moved(base + ".fill")
                with self._lock:
                    self.fetched_bytes += len(data)
                    self.fetched_from.add(entry.key)
            os.fdatasync(fd)
            marker = {"key": entry.key, "path": entry.path, "size": entry.info.size, "etag": entry.info.etag,
                      "data_bytes": need, "range": [piece.lo, piece.hi]}
            with self._room():  # the reservation becomes the marker at once for a scan (which reads no folder whole)
                _write_marker(base + ".ok", marker)
                _remove(base + ".fill")
            _remove(base + ".failed")
            with self._lock:
                self.fetched += 1
        except BaseException as e:
            if fd >= 0:
                try:
                    _punch(fd, piece.lo, piece.hi)
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
                    _write_marker(base + ".failed", {"error": str(e), "kind": type(e).__name__, "time": time.time(),
                                                     "pid": os.getpid()})
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            _remove(base + ".fill")

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
        with self._room():
            used = _read_ledger(self.cache_dir)
            if bound is not None and (used is None or used + need > bound):
                present, used = _scan(self.cache_dir)
                for when, size, lock_path, marker in sorted(present):
                    if used + need <= bound - bound // SLACK:  # some room beyond the need: no scan next time
                        break
                    if self._evict(lock_path, marker):
                        used -= size
                if used + need > bound:
                    _write_ledger(self.cache_dir, used)
                    raise CacheFull(redact(f"cache_bytes={bound} is too small: {url} needs {need} bytes and {used} "
                                           f"bytes of shards are in use by the open datasets' windows (at least "
                                           f"{used + need} bytes needed at once)"), need, used)
            _write_marker(self._id(piece) + ".fill", {"size": need, "pid": os.getpid()})
            if used is not None:  # without a bound and a ledger, nothing to keep: a bound's first fetch scans
                _write_ledger(self.cache_dir, used + need)

    def _account(self, delta: int) -> None:
        """Add ``delta`` bytes to the ledger, if there is one (hold :meth:`_room`)."""
        used = _read_ledger(self.cache_dir)
        if used is not None:
            _write_ledger(self.cache_dir, max(0, used + delta))

    @contextlib.contextmanager
    def _room(self) -> Iterator[None]:
        """The cache folder's lock, held while room is reckoned, the ledger changed, and while a fetch's
        reservation becomes its marker (a listing that runs beside a rename may see neither name)."""
        lock = os.open(os.path.join(self.cache_dir, CACHE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held for a scan or a rename: no fetch waits on it long
            yield
        finally:
            os.close(lock)

    def _evict(self, lock_path: str, marker: dict) -> bool:
        """Evict one piece if no one holds its lock; whether it was."""
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if not _try(fd, fcntl.LOCK_EX):
                return False
            _remove(lock_path[:-len(".lock")] + ".ok")  # first: from here on it reads as absent
            try:
                data = os.open(marker["path"], os.O_RDWR | os.O_CLOEXEC)
            except (OSError, KeyError, TypeError):
                return True  # its file is gone with its version
            try:
                lo, hi = marker["range"]
                _punch(data, lo, hi)
            except (KeyError, TypeError, ValueError):
                pass  # a marker of no piece (another format): its bytes read as absent, its version is not served
            finally:
                os.close(data)
            with self._lock:
                self.evicted += 1
            return True
        finally:
            os.close(fd)


def _scan(cache_dir: str) -> tuple[list[tuple[float, int, str, dict]], int]:
    """Every present shard of the cache folder as (last use, data bytes, lock path, marker), and the bytes
    held: present shards and fetches in progress (a ``.fill`` whose lock no one holds is stale: removed)."""
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
            stem, _, kind = f.rpartition(".")
            path = os.path.join(folder, f)
            if kind not in ("ok", "fill"):
                continue
            try:
                with open(path) as fh:
                    marker = json.load(fh)
                size = int(marker.get("data_bytes", marker.get("size", 0))) if kind == "ok" else int(marker["size"])
                when = os.stat(path).st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue
            lock_path = os.path.join(folder, stem + ".lock")
            if kind == "fill" and _stale(lock_path):
                _remove(path)
                continue
            used += size
            if kind == "ok":
                present.append((when, size, lock_path, marker))
    return present, used


def _read_ledger(cache_dir: str) -> int | None:
    """The ledger's bytes, or None where it is missing or unreadable (a scan then counts them)."""
    try:
        with open(os.path.join(cache_dir, LEDGER)) as f:
            used = json.load(f)["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return used if type(used) is int and used >= 0 else None


def _write_ledger(cache_dir: str, used: int) -> None:
    _write_marker(os.path.join(cache_dir, LEDGER), {"bytes": used})


def _stale(lock_path: str) -> bool:
    """Whether no one holds the lock (a fetch's reservation left by a process that died)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        return _try(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


def _progress(fill: str) -> tuple[int, object] | None:
    """Where a fetch stands, from its ``.fill``: (last move in ns, the fetching pid); None without one."""
    try:
        when = os.stat(fill).st_mtime_ns
        with open(fill) as f:
            pid = json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return when, pid


def _moved(fill: str) -> None:
    """Mark a fetch's ``.fill`` as moved now (its waiters watch it)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(fill, ns=(now, now))


def _try(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)  # a short write (a file size limit) is followed by the error
        view, offset = view[n:], offset + n


def _punch(fd: int, lo: int, hi: int) -> None:
    """Free bytes ``lo .. hi`` of a shard file (a piece), keeping its size; zeros where it cannot punch holes."""
    if hi > lo and _libc.fallocate(fd, _PUNCH, ctypes.c_long(lo), ctypes.c_long(hi - lo)) != 0:
        zeros = bytes(min(hi - lo, PIECE_BYTES))
        for offset in range(lo, hi, len(zeros)):
            _pwrite_all(fd, zeros[:min(len(zeros), hi - offset)], offset)


def _write_marker(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass

