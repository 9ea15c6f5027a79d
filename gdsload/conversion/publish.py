"""Publishing a conversion's output safely: temporary directory, overwrite rules, atomic rename, signals.

A conversion writes into a temporary sibling (:func:`make_temp`) and publishes it with one rename
(:func:`publish_output`: ``RENAME_NOREPLACE``, or ``RENAME_EXCHANGE`` with ``overwrite``); :func:`check_output`
refuses to replace anything but a gdsload dataset; :func:`remove_stale_temps` removes a killed converter's
leftovers (docs/format.md, "Writing and replacing a dataset"). :func:`on_signal` stops a conversion with
:class:`Interrupted`, except inside a :func:`protected` step (a zarr write, cleanup, the final rename) or once
published: the signal then takes effect when the step ends, or is returned by :func:`reset_signals`. Messages
spell the overwrite option as the caller does (:func:`gdsload.conversion.spelling.overwrite_option`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Callable

from ..format.zarr_json import read_json
from ..errors import ConversionError, GDSLoadError, one_line
from ..format.meta import ATTRS_KEY
from .spelling import overwrite_option


# -- signals ---------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """A conversion stopped by a signal (SIGINT, SIGTERM or SIGHUP); ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalState:
    """What :func:`on_signal` does: raise at once, or note the signal and let the current step finish.
    A step is protected while ``depth`` > 0 (a zarr write, which zarr's I/O thread would go on with after the
    main thread gave up; cleanup; the final rename) and for good once the output is published."""

    depth = 0
    published = False
    pending: int | None = None


_signals = _SignalState()


def on_signal(signum: int, frame: object) -> None:
    """Signal handler for a conversion (``shard_main`` installs it for SIGINT, SIGTERM and SIGHUP)."""
    if _signals.depth or _signals.published:
        if _signals.pending is None:
            _signals.pending = signum
        return
    raise Interrupted(signum)


def reset_signals() -> int | None:
    """Forget the state of the last conversion; returns a signal that arrived too late to stop it."""
    pending = _signals.pending
    _signals.depth, _signals.published, _signals.pending = 0, False, None
    return pending


@contextlib.contextmanager
def protected(deliver: bool = True) -> Iterator[None]:
    """A step a signal must not cut short; a signal that arrived meanwhile stops the conversion after it."""
    _signals.depth += 1
    try:
        yield
    finally:
        _signals.depth -= 1
    if deliver and not _signals.depth and not _signals.published and _signals.pending is not None:
        signum, _signals.pending = _signals.pending, None
        raise Interrupted(signum)


# -- the output ------------------------------------------------------------------------------------
def _inside(child: str, parent: str) -> bool:
    """``child`` is ``parent`` or lies below it, symlinks resolved."""
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def dataset_problem(path: str) -> str | None:
    """Why ``path`` is not a gdsload dataset (a directory whose zarr.json is a Zarr v3 group with a
    'gdsload' attribute), or None if it is one."""
    if os.path.islink(path):
        return "a symbolic link"
    if not os.path.isdir(path):
        return "a regular file" if os.path.isfile(path) else "not a directory"
    where = os.path.join(path, "zarr.json")
    if not os.path.lexists(where):
        return "a directory without zarr.json"
    try:
        meta = read_json(where)  # refuses a FIFO or device without blocking, and a huge file
    except GDSLoadError as e:
        return f"a directory whose zarr.json cannot be read ({e})"
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        return "a directory whose zarr.json is not a Zarr v3 group"
    attrs = meta.get("attributes")
    if not isinstance(attrs, dict) or ATTRS_KEY not in attrs:
        return f"a Zarr v3 group without the '{ATTRS_KEY}' attribute"
    return None


def check_output(out: str, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse an output that must not be written, before anything is: one inside an input, one that exists
    (unless ``overwrite``), and for ``overwrite`` anything but a gdsload dataset that holds no input and
    not the working directory. An output that exists and is no such dataset is refused saying what it is,
    with or without ``overwrite`` (suggesting it would only lead to a second refusal)."""
    for p in inputs:
        if _inside(out, p):
            raise ConversionError(f"{out}: output path is inside input {p} (or the same); choose another output")
    if not os.path.lexists(out):
        return
    option = overwrite_option()
    found = _not_replaceable(out, inputs)
    if found is None:
        if not overwrite:
            raise ConversionError(f"{out}: output exists (pass {option} to replace it)")
        return
    what, detail = found
    if not overwrite:
        raise ConversionError(f"{out}: output exists and is {what}, not a gdsload dataset ({option} replaces only "
                              f"a gdsload dataset): choose another output")
    raise ConversionError(f"{out}: {option} replaces only a gdsload dataset{detail}")


def _not_replaceable(out: str, inputs: Sequence[str]) -> tuple[str, str] | None:
    """Why ``overwrite`` would not replace the existing ``out`` -- what it is, and how a refusal of
    ``overwrite`` goes on after "replaces only a gdsload dataset" -- or None (a dataset it replaces)."""
    for p in inputs:
        if _inside(p, out):
            return f"a directory holding input {p}", f" (found a directory holding input {p})"
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None
    if cwd is not None and _inside(cwd, out):
        return ("a directory holding the working directory",
                f" (found a directory holding the working directory {cwd})")
    problem = dataset_problem(out)
    if problem:
        return problem, (f": a directory whose zarr.json is a Zarr v3 group with a '{ATTRS_KEY}' attribute "
                         f"(found {problem})")
    return None


def input_paths(origins: Iterable[str]) -> list[str]:
    """Files and directories that sources read, from their origins (``PATH`` or ``PATH:KEY``)."""
    paths = []
    for origin in origins:
        for candidate in (origin, origin.rsplit(":", 1)[0]):
            if os.path.lexists(candidate):
                paths.append(candidate)
                break
    return paths


def _temp_name(out: str, kind: str = "tmp") -> str:
    """A fresh sibling of ``out``: ``.NAME.tmp-<pid>-<hex>`` for a temporary directory (the pid lets a later
    run tell a dead converter's leftovers from a live one's, and remove them), ``.NAME.old-<pid>-<hex>``
    for an existing dataset moved aside, which nothing ever removes."""
    parent, name = os.path.split(out)
    return os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid this system has: not ours to judge
    return True


def remove_stale_temps(out: str) -> list[str]:
    """Remove temporary directories of ``out`` whose converter process is gone (killed, so it could not
    clean up); returns their paths. Another process's live conversion is left alone."""
    parent, name = os.path.split(out)
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-([0-9]+)-[0-9a-f]+")
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed  # creating the temporary directory will say what is wrong with the parent
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(m.group(1))
        if pid <= 0 or pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def make_temp(out: str) -> tuple[str, list[str]]:
    """Create the temporary directory (and missing parents); returns it and the parents made."""
    parent = os.path.dirname(out)
    made = []
    p = parent
    while p and not os.path.lexists(p):
        made.append(p)
        p = os.path.dirname(p)
    tmp = _temp_name(out)
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        remove_empty(made)
        where = os.fspath(e.filename) if e.filename and e.filename != tmp else parent
        raise ConversionError(f"{out}: cannot create the output in {where} ({e.strerror or e})") from e
    return tmp, made


def remove_empty(dirs: list[str]) -> None:
    """Remove the parent directories :func:`make_temp` created, where they are still empty."""
    for d in dirs:  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(d)


# -- atomic rename ---------------------------------------------------------------------------------
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}  # the number where glibc lacks the symbol (< 2.28)


def _load_renameat2(use_symbol: bool = True) -> Callable[..., int] | None:
    """libc's ``renameat2`` (``use_symbol``), else the raw system call where its number is known, else None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None) if use_symbol else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    nr = _SYSCALL_RENAMEAT2.get(platform.machine())
    syscall = getattr(libc, "syscall", None)
    if nr is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long

    def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return syscall(ctypes.c_long(nr), ctypes.c_int(olddirfd), ctypes.c_char_p(old), ctypes.c_int(newdirfd),
                       ctypes.c_char_p(new), ctypes.c_uint(flags))

    return renameat2


_renameat2_fn = _load_renameat2()


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Linux ``renameat2``: True once done; False where this libc, kernel or filesystem cannot do it with
    ``flags`` (no function, ENOSYS, EINVAL), so the caller falls back; OSError for any other failure."""
    if _renameat2_fn is None:
        return False
    if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS):
            return False
        raise OSError(code, os.strerror(code), src, None, dst)
    return True


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` in one step that fails with FileExistsError if ``dst`` exists."""
    if _renameat2(src, dst, RENAME_NOREPLACE):
        return
    # This kernel or filesystem cannot rename without replacing (no renameat2, or a filesystem without
    # RENAME_NOREPLACE): check, then rename. Only here can an output created in between be replaced.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def rename_exchange(src: str, dst: str) -> None:
    """Swap ``src`` and ``dst`` in one step (FileNotFoundError if ``dst`` does not exist)."""
    if _renameat2(src, dst, RENAME_EXCHANGE):
        return
    # No atomic exchange here (see rename_noreplace): move dst aside, then src in, then the old dst to src,
    # the same end state; a reader in between finds no dataset at dst.
    if not os.path.lexists(dst):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    aside = _temp_name(dst, "old")  # not a name remove_stale_temps removes: killed here, the user keeps it
    os.rename(dst, aside)
    try:
        rename_noreplace(src, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    os.rename(aside, src)


class ForeignTemp(ConversionError):
    """The temporary directory holds what was at the output and could not be put back: keep it."""


def sync_tree(root: str) -> None:
    """Flush every file and directory under ``root`` (and ``root``) to stable storage, deepest first. Before
    the rename that publishes a dataset: otherwise a crash or power loss soon after could leave the new name
    pointing at files whose data never reached the disk (empty or partial shards where the old dataset was)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(os.path.join(dirpath, name), os.O_RDONLY)
        _fsync_dir(dirpath)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """fsync a directory; file systems that cannot (EINVAL, ENOTSUP) are left as they are."""
    try:
        _fsync(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise


def _fsync_published(parent: str) -> None:
    """Make the rename durable; the dataset is published already, so a failure here is not the conversion's."""
    with contextlib.suppress(OSError):
        _fsync(parent, os.O_RDONLY | os.O_DIRECTORY)


def publish_output(tmp: str, out: str, overwrite: bool) -> None:
    """Move the finished dataset at ``tmp`` to ``out`` in one step, its data flushed first (:func:`sync_tree`)
    and the rename itself after (the parent directory). Without ``overwrite`` this fails if anything
    appeared at ``out`` during the conversion; with it, the old dataset is swapped out (into ``tmp``) and
    removed, after checking it is still a dataset."""
    sync_tree(tmp)
    parent = os.path.dirname(os.path.abspath(out))
    if not overwrite:
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise ConversionError(f"{out}: output exists (it appeared during the conversion; pass "
                                  f"{overwrite_option()} to replace it)") from None
        _signals.published = True
        _fsync_published(parent)
        return
    try:
        rename_exchange(tmp, out)
    except FileNotFoundError:
        if os.path.lexists(out):
            raise
        try:  # the old output is gone: publish as new
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise ConversionError(f"{out}: output was replaced during the conversion; left as it is") from None
        _signals.published = True
        _fsync_published(parent)
        return
    problem = dataset_problem(tmp)  # what was at out: the dataset checked at the start, unless replaced since
    if problem is None:
        _signals.published = True
        _fsync_published(parent)  # the swap is durable before the old dataset goes
        shutil.rmtree(tmp, ignore_errors=True)  # what a failure leaves is removed as stale once we exit
        return
    try:
        rename_exchange(tmp, out)
    except OSError as e:
        raise ForeignTemp(f"{out}: was replaced during the conversion by {problem}, which now lies at {tmp} "
                          f"and could not be put back ({e.strerror})") from e
    raise ConversionError(f"{out}: {overwrite_option()} replaces only a gdsload dataset (found {problem}, which "
                          "appeared during the conversion; left as it is)")


@dataclass(frozen=True)
class Target:
    """The output being written: ``out`` once published, ``tmp`` until then."""

    out: str
    tmp: str

    def error(self, e: OSError, path: str | None = None) -> ConversionError:
        """An OS error of writing the output, as a one-line message naming the output."""
        where = os.fspath(path or e.filename or "")
        if where == self.tmp or where.startswith(self.tmp + os.sep):
            where = os.path.relpath(where, self.tmp) if where != self.tmp else ""
        what = e.strerror or one_line(e) or type(e).__name__
        return ConversionError(f"{self.out}: cannot write{' ' + where if where else ''} ({what})")


@contextlib.contextmanager
def staged_output(out: str, overwrite: bool) -> Iterator[Target]:
    """A temporary sibling of ``out`` (:func:`make_temp`, made where no signal interrupts it) to write a
    dataset into; when the block ends, it is published at ``out`` (:func:`publish_output`, under the overwrite
    rules). If anything fails or a signal stops it, before or while publishing, the temporary directory and
    the directories made for it are removed and the error goes on."""
    tmp, made = None, []
    try:
        with protected():
            tmp, made = make_temp(out)
        target = Target(out, tmp)
        yield target
        with protected(deliver=False):
            try:
                publish_output(tmp, out, overwrite)
            except OSError as e:
                raise target.error(e, out) from e
    except BaseException as e:
        with protected():
            if tmp is not None and not isinstance(e, ForeignTemp):
                shutil.rmtree(tmp, ignore_errors=True)
            remove_empty(made)
        raise
