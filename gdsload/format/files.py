"""Shard files opened once, safely, and held while a dataset is open (pure POSIX I/O, no GPU).

A dataset is read through the descriptors opened at its open, never through its paths again. Opening refuses,
without blocking, anything that is not a regular file (a FormatError naming the path and what it is);
:func:`reserve_descriptors` raises the soft ``RLIMIT_NOFILE`` toward the hard one, or refuses. Every ReadError for
a failed read (here and in the backends) is built by :func:`read_error`, so its wording is the same everywhere.
Why: docs/design.md, "Files: an open dataset is pinned to its files".
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import stat
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._tasks import Closing
from ..errors import FormatError, ReadError

#: O_NONBLOCK: open a FIFO without waiting for a writer (cleared again once the file is known to be regular).
#: O_NOCTTY: a terminal device in a shard's place must not become the process's controlling terminal.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class ShardFile:
    """One open, regular file: its descriptor and what ``fstat`` said of it right after opening."""

    path: str
    fd: int
    size: int
    dev: int
    ino: int
    mtime_ns: int


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"a special file (mode {mode:#o})"


def refusal(path: str, what: str, e: OSError) -> FormatError:
    """The FormatError for an OSError met opening or stat'ing ``path``."""
    if e.errno == errno.ENOENT:
        return FormatError(f"{path}: {what} is missing")
    if e.errno == errno.ELOOP:
        return FormatError(f"{path}: {what} is a symlink loop (expected a regular file)")
    if e.errno in (errno.EACCES, errno.EPERM):
        return FormatError(f"{path}: {what} is not readable (permission denied)")
    if e.errno == errno.EISDIR:
        return FormatError(f"{path}: {what} is a directory (expected a regular file)")
    return FormatError(f"{path}: cannot open {what} ({e.strerror or e})")


def not_regular(path: str, what: str, mode: int) -> FormatError:
    """The FormatError for a file that is not regular (``mode`` from its stat)."""
    return FormatError(f"{path}: {what} is {_kind(mode)} (expected a regular file)")


def open_regular(path: str, what: str = "file") -> ShardFile:
    """Open ``path`` read-only if it is a regular file (symlinks followed); FormatError otherwise.

    ``what`` names the file in messages ("shard file", "zarr.json"). The path is stat'ed first, so a device
    or FIFO is refused without being opened at all (opening some devices has side effects); the descriptor
    is checked again with ``fstat``, so a swap between the two cannot slip a FIFO through (it was opened with
    O_NONBLOCK, so even that open returned at once).
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise refusal(path, what, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, what, st.st_mode)
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as e:
        raise refusal(path, what, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, what, st.st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as e:
        os.close(fd)
        raise FormatError(f"{path}: cannot open {what} ({e.strerror or e})") from None
    except BaseException:
        os.close(fd)
        raise
    return ShardFile(path, fd, st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns)


def open_shard(path: str) -> ShardFile:
    """Open one shard file (see :func:`open_regular`); the caller owns the descriptor."""
    return open_regular(path, "shard file")


def read_error(path: str, offset: int, nbytes: int, cause: BaseException | None = None,
               got: int | None = None) -> ReadError:
    """The ReadError for a read of ``nbytes`` at ``offset`` of ``path`` that failed: ``cause`` is what the
    read raised, or ``got`` the bytes it returned before the file ended (a file truncated after it was
    opened). Every failed read of a dataset's files is reported through here, so the wording is the same
    whichever code path read: ``PATH: read of N bytes at offset X failed (TYPE: cause)`` or
    ``PATH: file ends at offset Y (expected N bytes from offset X)``. A ``cause`` that is already a
    ReadError is returned as it is (it names its file)."""
    if isinstance(cause, ReadError):
        return cause
    if cause is not None:
        return ReadError(f"{path}: read of {nbytes} bytes at offset {offset} failed "
                         f"({type(cause).__name__}: {cause})")
    if got is not None:
        return ReadError(f"{path}: file ends at offset {offset + got} (expected {nbytes} bytes from offset "
                         f"{offset})")
    return ReadError(f"{path}: read of {nbytes} bytes at offset {offset} failed")


def pread_exact(f: ShardFile, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset`` of an open file; a file that ends first, or an OS error, is a ReadError
    (:func:`read_error`)."""
    parts, got = [], 0
    while got < nbytes:
        try:
            part = os.pread(f.fd, nbytes - got, offset + got)
        except OSError as e:
            raise read_error(f.path, offset, nbytes, cause=e) from e
        if not part:
            raise read_error(f.path, offset, nbytes, got=got)
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_small(path: str, what: str, max_bytes: int) -> bytes:
    """The whole of a small regular file (metadata), opened as safely as a shard; refused unread if it
    is larger than ``max_bytes``."""
    f = open_regular(path, what)
    try:
        if f.size > max_bytes:
            raise FormatError(f"{path}: {what} is {f.size} bytes (expected at most {max_bytes})")
        return pread_exact(f, 0, f.size)
    finally:
        os.close(f.fd)


#: Descriptors left free beyond a dataset's files, for everything else the process opens meanwhile.
DESCRIPTOR_HEADROOM = 256


def reserve_descriptors(count: int, where: str) -> None:
    """Make sure ``count`` more files can be opened: raise the soft ``RLIMIT_NOFILE`` (for the whole process,
    and never lowered again) toward the hard limit when the files open now plus ``count`` plus
    :data:`DESCRIPTOR_HEADROOM` exceed it, asking for room for twice ``count`` where the hard limit allows (a
    backend may open its own handle per file). A FormatError naming ``where`` if the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    need = in_use + count + DESCRIPTOR_HEADROOM
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    advice = ("raise the hard limit (ulimit -Hn) or rewrite the store with fewer, larger files: 'gdsload shard' "
              "writes one file per shard of many chunks")
    if hard != resource.RLIM_INFINITY and need > hard:
        raise FormatError(f"{where}: needs {count} open files, more than this process may open (limit {hard}, "
                          f"{in_use} open); {advice}")
    want = need + count if hard == resource.RLIM_INFINITY else min(hard, need + count)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        raise FormatError(f"{where}: needs {count} open files, more than this process may open (limit {soft}, "
                          f"raising it to {want} failed: {e}); {advice}") from None


def _close_all(files: dict[str, ShardFile]) -> None:
    for f in files.values():
        try:
            os.close(f.fd)
        except OSError:
            pass
    files.clear()


class ShardFiles(Closing):
    """Shard files opened once, by path, and held until :meth:`close` (idempotent; also at garbage
    collection). Reading by ``fd(path)`` reads the inode that was opened, not whatever the path names now.

    Notes
    -----
    A descriptor must not be used after ``close()``: the number may already name another file. Stop every
    reader before closing.
    """

    def __init__(self) -> None:
        self._files: dict[str, ShardFile] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._files)

    @classmethod
    def open(cls, paths: Iterable[str]) -> ShardFiles:
        """Open every path (a repeated path once); if one fails, those already opened are closed."""
        files = cls()
        try:
            for path in paths:
                files.add(path)
        except BaseException:
            files.close()
            raise
        return files

    def add(self, path: str, what: str = "shard file") -> ShardFile:
        """Open ``path`` (see :func:`open_regular`; ``what`` names it in messages) unless it is held already."""
        with self._lock:
            if self._closed:
                raise ReadError(f"{path}: cannot open, the dataset's shard files were closed")
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = open_regular(path, what)
            return f

    def fd(self, path: str) -> int:
        """The descriptor of a held shard file; ReadError if it was never opened here or is closed."""
        f = self._files.get(path)
        if f is None:
            state = "were closed" if self._closed else "do not include it"
            raise ReadError(f"{path}: not an open shard file (the dataset's shard files {state})")
        return f.fd

    def get(self, path: str) -> ShardFile | None:
        """The held file at ``path``, or None."""
        return self._files.get(path)

    def __getitem__(self, path: str) -> ShardFile:
        return self._files[path]

    def __contains__(self, path: object) -> bool:
        return path in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._files))

    def __len__(self) -> int:
        return len(self._files)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every descriptor. Idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __repr__(self) -> str:
        return f"ShardFiles({len(self)} files{', closed' if self._closed else ''})"
