"""The files of the node's shard cache, below :class:`gdsload.remote.shard_cache.ShardCache`: markers, the ledger,
byte-range locks on the shard files, and punching a piece out.

A piece's lock is an open-file-description byte-range lock (``F_OFD_SETLK``) on its own bytes of its shard file:
shared is a pin, exclusive a fetch or an eviction. Like ``flock`` it belongs to the open file description (two
descriptors of one process exclude each other, closing one drops only its own), and no lock file is made, so
none is left behind. A marker written before its piece's bytes are synced holds the machine's boot id: it stands
for that boot only (the page cache every process of the node reads holds the bytes), and once the bytes are synced
it is rewritten ``synced`` (docs/remote.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import struct
import threading
import time

#: The cache folder's ledger: the bytes of pieces present and reserved, at least (changed under its lock).
LEDGER = ".gdsload-cache.used"
#: Bytes of zeros written at a time where a file system cannot punch holes.
ZERO_BYTES = 4 << 20
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)  # Linux's value where Python does not name it
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


#: This boot of the machine (None where it cannot be told: every piece is then synced before it is marked).
BOOT = _boot_id()


def lock_range(fd: int, lo: int, hi: int, kind: int) -> bool:
    """Take (``fcntl.F_RDLCK``, ``F_WRLCK``; converting one held) or drop (``F_UNLCK``) the lock of bytes ``lo ..
    hi`` of ``fd``'s file without waiting; whether it was taken."""
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, lo, hi - lo, 0)  # struct flock; l_pid 0, as OFD locks want
    try:
        fcntl.fcntl(fd, _OFD_SETLK, arg)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


def open_range(path: str, lo: int, hi: int, kind: int) -> int | None:
    """A new descriptor of ``path`` holding the lock ``kind`` of bytes ``lo .. hi`` (close it to drop the lock);
    None where another holds a lock in the way, or the file is gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if lock_range(fd, lo, hi, kind):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def unheld(path: str, lo: int, hi: int) -> bool:
    """Whether no one holds a lock of bytes ``lo .. hi`` of ``path`` (true where the file is gone)."""
    if not os.path.exists(path):
        return True
    fd = open_range(path, lo, hi, fcntl.F_WRLCK)
    if fd is None:
        return False
    os.close(fd)
    return True


def marker_valid(marker: dict) -> bool:
    """Whether a present marker's bytes can be read: synced, or marked in this boot (its page cache holds them)."""
    return marker.get("synced", True) is True or (BOOT is not None and marker.get("boot") == BOOT)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_marker(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` whole: aside, then renamed into place."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def read_ledger(cache_dir: str) -> int | None:
    """The ledger's bytes, or None where it is missing or unreadable (a scan then counts them)."""
    doc = read_json(os.path.join(cache_dir, LEDGER))
    used = doc.get("bytes") if doc is not None else None
    return used if type(used) is int and used >= 0 else None


def write_ledger(cache_dir: str, used: int) -> None:
    write_marker(os.path.join(cache_dir, LEDGER), {"bytes": used})


def progress(fill: str) -> tuple[int, object] | None:
    """Where a fetch stands, from its ``.fill``: (last move in ns, the fetching pid); None without one."""
    try:
        when = os.stat(fill).st_mtime_ns
        with open(fill) as f:
            pid = json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return when, pid


def moved(fill: str) -> None:
    """Mark a fetch's ``.fill`` as moved now (its waiters watch it)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(fill, ns=(now, now))


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)  # a short write (a file size limit) is followed by the error
        view, offset = view[n:], offset + n


def punch(fd: int, lo: int, hi: int) -> None:
    """Free bytes ``lo .. hi`` of a shard file (a piece), keeping its size; zeros where it cannot punch holes."""
    if hi > lo and _libc.fallocate(fd, _PUNCH, ctypes.c_long(lo), ctypes.c_long(hi - lo)) != 0:
        zeros = bytes(min(hi - lo, ZERO_BYTES))
        for offset in range(lo, hi, len(zeros)):
            pwrite_all(fd, zeros[:min(len(zeros), hi - offset)], offset)
