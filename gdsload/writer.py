"""Writing datasets: metadata through zarr, shard files streamed block by block.

zarr writes the group and array metadata (so plain zarr opens the result); the shard files themselves are
written here, sequentially, because zarr rewrites a whole shard on every partial write: streaming blocks
keeps memory at one slice and each byte is written once. The layout is exactly the sharding codec's
(blocks back to back, index and crc32c at the end); the tests read every dataset back through zarr.

A crc32c of every block is computed from the bytes as they stream past and stored beside the data, in plain
zarr arrays ``_checksums/FIELD`` (uint32, one value per block), listed in the ``checksums`` entry of the
group attributes. A fixed field's value covers its inner chunk exactly as stored (the final block's zero
padding included); a variable-length field's covers the values rows of the block's samples.

Nothing the user owns is ever lost: everything is written to a temporary sibling ``.NAME.tmp-<pid>-<hex>``
and published with one atomic rename that fails if the output appeared meanwhile (``renameat2`` with
``RENAME_NOREPLACE``), or, with ``overwrite``, swaps it with the old dataset (``RENAME_EXCHANGE``) before
the old one is removed. ``overwrite`` replaces only a gdsload dataset, never a file, a directory holding an
input or the working directory. A temporary directory left by a killed converter is recognised by its pid
and removed by the next conversion to the same output.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import platform
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

import crc32c
import numpy as np

from .errors import ConversionError
from .format import ATTRS_KEY, FORMAT_VERSION, MAX_UINT_64, DatasetMeta, encode_shard_index, read_metadata
from .sources import MAX_ARRAY_BYTES, RaggedSource, Source, one_line, open_field, open_input, open_ragged

DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_SLICE_BYTES = 64 << 20
ALIGN_BYTES = 4096
CHECKSUMS_GROUP = "_checksums"
CHECKSUM_ALGORITHM = "crc32c"
# Field names that would land on the group's own metadata file or on the checksums group.
RESERVED_NAMES = ("zarr.json", CHECKSUMS_GROUP)
NAME_MAX_BYTES = 255  # a field is a directory: its name is one path component


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
def _protected(deliver: bool = True) -> Iterator[None]:
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
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _dataset_problem(path: str) -> str | None:
    """Why ``path`` is not a gdsload dataset (a directory whose zarr.json is a Zarr v3 group with a
    'gdsload' attribute), or None if it is one."""
    if os.path.islink(path):
        return "a symbolic link"
    if not os.path.isdir(path):
        return "a regular file" if os.path.isfile(path) else "not a directory"
    try:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return "a directory without zarr.json"
    except (OSError, ValueError) as e:
        return f"a directory whose zarr.json cannot be read ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        return "a directory whose zarr.json is not a Zarr v3 group"
    attrs = meta.get("attributes")
    if not isinstance(attrs, dict) or ATTRS_KEY not in attrs:
        return f"a Zarr v3 group without the '{ATTRS_KEY}' attribute"
    return None


def check_output(out: str, overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """Refuse an output that must not be written, before anything is: one inside an input, one that exists
    (unless ``overwrite``), and for ``overwrite`` anything but a gdsload dataset that holds no input and
    not the working directory."""
    for p in inputs:
        if _inside(out, p):
            raise ConversionError(f"{out}: output path is inside input {p} (or the same); choose another output")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise ConversionError(f"{out}: output exists (pass --overwrite to replace it)")
    refused = f"{out}: --overwrite replaces only a gdsload dataset"
    for p in inputs:
        if _inside(p, out):
            raise ConversionError(f"{refused} (found a directory holding input {p})")
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None
    if cwd is not None and _inside(cwd, out):
        raise ConversionError(f"{refused} (found a directory holding the working directory {cwd})")
    problem = _dataset_problem(out)
    if problem:
        raise ConversionError(f"{refused}: a directory whose zarr.json is a Zarr v3 group with a '{ATTRS_KEY}' "
                              f"attribute (found {problem})")


def _input_paths(sources: Sequence[Source | RaggedSource]) -> list[str]:
    """Files and directories the sources read, from their origins (``PATH`` or ``PATH:KEY``)."""
    paths = []
    for src in sources:
        for candidate in (src.origin, src.origin.rsplit(":", 1)[0]):
            if os.path.lexists(candidate):
                paths.append(candidate)
                break
    return paths


def _temp_name(out: str) -> str:
    parent, name = os.path.split(out)
    return os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


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


@dataclass(frozen=True)
class _Target:
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


def _make_temp(out: str) -> tuple[str, list[str]]:
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
        _remove_empty(made)
        where = os.fspath(e.filename) if e.filename and e.filename != tmp else parent
        raise ConversionError(f"{out}: cannot create the output in {where} ({e.strerror or e})") from e
    return tmp, made


def _remove_empty(dirs: list[str]) -> None:
    for d in dirs:  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(d)


# -- atomic rename ---------------------------------------------------------------------------------
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYSCALL_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}  # the number where glibc lacks the symbol (< 2.28)


def _load_renameat2(use_symbol: bool = True) -> Callable[..., int] | None:
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


def _renameat2(src: str, dst: str, flags: int) -> None:
    """Linux ``renameat2``; OSError (ENOSYS where there is none) on failure."""
    if _renameat2_fn is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), src, None, dst)
    if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, None, dst)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` in one step that fails with FileExistsError if ``dst`` exists."""
    try:
        _renameat2(src, dst, RENAME_NOREPLACE)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        # This kernel or filesystem cannot rename without replacing (no renameat2, or a filesystem without
        # RENAME_NOREPLACE): check, then rename. Only here can an output created in between be replaced.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst) from None
        os.rename(src, dst)


def rename_exchange(src: str, dst: str) -> None:
    """Swap ``src`` and ``dst`` in one step (FileNotFoundError if ``dst`` does not exist)."""
    try:
        _renameat2(src, dst, RENAME_EXCHANGE)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        # No atomic exchange here (see rename_noreplace): move dst aside, then src in, then the old dst to
        # src, the same end state; a reader in between finds no dataset at dst.
        if not os.path.lexists(dst):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst) from None
        aside = _temp_name(dst)
        os.rename(dst, aside)
        try:
            rename_noreplace(src, dst)
        except BaseException:
            os.rename(aside, dst)
            raise
        os.rename(aside, src)


class _ForeignTemp(ConversionError):
    """The temporary directory holds what was at the output and could not be put back: keep it."""


def _publish(tmp: str, out: str, overwrite: bool) -> None:
    """Move the finished dataset at ``tmp`` to ``out`` in one step. Without ``overwrite`` this fails if
    anything appeared at ``out`` during the conversion; with it, the old dataset is swapped out (into
    ``tmp``) and removed, after checking it is still a dataset."""
    if not overwrite:
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise ConversionError(f"{out}: output exists (it appeared during the conversion; pass --overwrite "
                                  "to replace it)") from None
        _signals.published = True
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
        return
    problem = _dataset_problem(tmp)  # what was at out: the dataset checked at the start, unless replaced since
    if problem is None:
        _signals.published = True
        shutil.rmtree(tmp, ignore_errors=True)  # what a failure leaves is removed as stale once we exit
        return
    try:
        rename_exchange(tmp, out)
    except OSError as e:
        raise _ForeignTemp(f"{out}: was replaced during the conversion by {problem}, which now lies at {tmp} "
                           f"and could not be put back ({e.strerror})") from e
    raise ConversionError(f"{out}: --overwrite replaces only a gdsload dataset (found {problem}, which "
                          "appeared during the conversion; left as it is)")


# -- checksums -------------------------------------------------------------------------------------
class _BlockCrc:
    """crc32c of consecutive byte ranges of a stream fed in order: block ``b`` is bytes
    ``[b * block_bytes, (b + 1) * block_bytes)``, or ``[bounds[b], bounds[b + 1])`` where blocks differ in
    size. Bytes past the last block are ignored."""

    def __init__(self, num_blocks: int, block_bytes: int = 0, bounds: np.ndarray | None = None):
        self.block_bytes, self.bounds = block_bytes, bounds
        self.crcs = np.zeros(num_blocks, dtype=np.uint32)
        self.pos = 0

    def _start(self, b: int) -> int:
        return b * self.block_bytes if self.bounds is None else int(self.bounds[b])

    def update(self, buf: memoryview) -> None:
        start, end = self.pos, self.pos + len(buf)
        if self.bounds is None:
            b = start // self.block_bytes
        else:  # the last block starting at or before ``start`` (empty blocks share their start)
            b = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while b < len(self.crcs) and self._start(b) < end:
            lo, hi = max(start, self._start(b)), min(end, self._start(b + 1))
            if hi > lo:
                self.crcs[b] = crc32c.crc32c(buf[lo - start:hi - start], int(self.crcs[b]))
            b += 1
        self.pos = end


# -- validation ------------------------------------------------------------------------------------
def choose_samples_per_block(sample_bytes: Sequence[int], block_bytes: int, num_samples: int) -> int:
    """Samples per block: as many of the largest sample as fit in ``block_bytes``, rounded down so the
    largest field's block is a multiple of 4 KiB when that leaves at least one sample, and never more
    than the dataset holds."""
    largest = max(sample_bytes)
    k = max(1, block_bytes // largest)
    step = ALIGN_BYTES // math.gcd(largest, ALIGN_BYTES)
    if k >= step:
        k -= k % step
    return max(1, min(k, num_samples))


def _check_dtype(src: Source) -> np.dtype:
    dt = src.dtype
    if dt.fields is not None or dt.kind == "V":
        raise ConversionError(f"{src.origin}: unsupported dtype {dt} (structured arrays: save each field separately)")
    if dt.kind not in "biufc":
        raise ConversionError(
            f"{src.origin}: unsupported dtype {dt} (expected bool, integer, float or complex; found kind '{dt.kind}')"
        )
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


def _check_name(name: str, origin: str) -> None:
    problem = None
    if not name or "/" in name or any(ord(c) < 32 or c == "\x7f" for c in name):
        problem = "expected a non-empty name without '/' or control characters"
    elif name.startswith(".") or name.startswith("__"):
        problem = "names starting with '.' or '__' are reserved by zarr"
    elif name.lower() in RESERVED_NAMES:
        problem = f"reserved: {', '.join(RESERVED_NAMES)} would collide with the dataset's own files"
    else:
        try:
            if len(name.encode("utf-8")) > NAME_MAX_BYTES:
                problem = f"longer than {NAME_MAX_BYTES} bytes"
        except UnicodeEncodeError:
            problem = "not valid UTF-8"
    if problem:
        raise ConversionError(f"{origin}: invalid field name {name!r} ({problem})")


def _validate_ragged(name: str, r: RaggedSource) -> int:
    """Check a variable-length field; returns its number of samples."""
    _check_name(name, r.origin)
    _check_dtype(r.values)
    off = r.offsets
    if off.ndim != 1 or len(off) < 2:
        raise ConversionError(f"{r.origin}: holds no samples (empty input)")
    if off[0] != 0 or (np.diff(off) < 0).any():
        raise ConversionError(f"{r.origin}: offsets must start at 0 and never decrease (found {off[:4]}...)")
    if len(r.values.shape) == 0 or off[-1] != r.values.shape[0]:
        raise ConversionError(f"{r.origin}: offsets end at {off[-1]} but there are "
                              f"{r.values.shape[0] if r.values.shape else 0} values (expected equal)")
    if 0 in r.values.shape[1:]:
        raise ConversionError(f"{r.origin}: zero-size elements (element shape {r.values.shape[1:]})")
    return len(off) - 1


def _validate(sources: Mapping[str, Source], ragged: Mapping[str, RaggedSource] | None = None) -> int:
    ragged = ragged or {}
    if not sources and not ragged:
        raise ConversionError("no input arrays (empty input)")
    twice = sorted(set(sources) & set(ragged))
    if twice:
        raise ConversionError(f"{ragged[twice[0]].origin}: field '{twice[0]}' given twice")
    counts = {name: _validate_ragged(name, r) for name, r in ragged.items()}
    origins = {name: r.origin for name, r in ragged.items()}
    for name, src in sources.items():
        _check_name(name, src.origin)
        _check_dtype(src)
        if len(src.shape) == 0:
            raise ConversionError(f"{src.origin}: is a scalar (expected an array with samples on axis 0)")
        if src.shape[0] == 0:
            raise ConversionError(f"{src.origin}: holds no samples (empty input)")
        if 0 in src.shape[1:]:
            raise ConversionError(f"{src.origin}: zero-size samples (sample shape {src.shape[1:]})")
        if src.shape[0] * src.dtype.itemsize * math.prod(src.shape[1:]) > MAX_ARRAY_BYTES:
            raise ConversionError(f"{src.origin}: shape {src.shape} of {src.dtype} is too large (expected at most "
                                  "2**62 bytes)")
        counts[name] = src.shape[0]
        origins[name] = src.origin
    if len(set(counts.values())) > 1:
        first = next(iter(counts.values()))
        odd = next(n for n, c in counts.items() if c != first)
        detail = ", ".join(f"{n}={c}" for n, c in counts.items())
        raise ConversionError(f"{origins[odd]}: fields have different sample counts ({detail}; expected all equal)")
    return next(iter(counts.values()))


# -- writing ---------------------------------------------------------------------------------------
def _write_all(f, buf: memoryview, target: _Target, path: str) -> None:
    try:
        while len(buf):
            n = f.write(buf)
            buf = buf[n:]
    except OSError as e:
        raise target.error(e, path) from e


def _write_shard(path: str, src: Source, dtype: np.dtype, first_sample: int, stop_sample: int, block_bytes: int,
                 blocks_per_shard: int, slice_samples: int, progress: Callable[[int], None], crc: _BlockCrc,
                 target: _Target) -> None:
    """Write one shard file: whole blocks back to back (the last padded with zeros), then the index. Every
    byte of the blocks also goes through ``crc``. Source errors pass through as they are; errors of the
    output become ConversionError naming it."""
    n_bytes = 0
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "wb", buffering=0)  # unbuffered: no flush at close that could fail after the fact
    except OSError as e:
        raise target.error(e, path) from e
    with f:
        pos = first_sample
        while pos < stop_sample:
            end = min(pos + slice_samples, stop_sample)
            data = np.ascontiguousarray(src.read(pos, end), dtype=dtype)
            buf = memoryview(data.reshape(-1).view(np.uint8))
            _write_all(f, buf, target, path)
            crc.update(buf)
            n_bytes += len(buf)
            progress(len(buf))
            pos = end
        pad = -n_bytes % block_bytes
        if pad:
            padding = memoryview(bytes(pad))  # the fill value is zero: pad the final partial block to full size
            _write_all(f, padding, target, path)
            crc.update(padding)
        n_blocks = (n_bytes + pad) // block_bytes
        table = np.full((blocks_per_shard, 2), MAX_UINT_64, dtype=np.uint64)
        table[:n_blocks, 0] = np.arange(n_blocks, dtype=np.uint64) * np.uint64(block_bytes)
        table[:n_blocks, 1] = block_bytes
        _write_all(f, memoryview(encode_shard_index(table)), target, path)


def _close_all(sources: Mapping[str, Source]) -> None:
    for src in sources.values():
        src.close()


def write_dataset(
    out: str | os.PathLike[str],
    sources: Mapping[str, Source],
    *,
    ragged: Mapping[str, RaggedSource] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    samples_per_block: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    slice_bytes: int = DEFAULT_SLICE_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
) -> DatasetMeta:
    """Write ``sources`` (field name -> array source) as a gdsload dataset at ``out``, atomically.

    Everything goes to a temporary sibling directory that is renamed to ``out`` only once complete, so a
    failure or interruption leaves nothing at ``out`` (and an existing dataset there untouched).
    ``overwrite`` replaces an existing gdsload dataset, and nothing else. ``samples_per_block`` larger than
    the dataset is capped at its number of samples. Failures of the inputs and of the output raise
    ConversionError naming the file; an error raised by a caller's own source passes through as it is.
    """
    import zarr
    from tqdm import tqdm

    out = os.path.abspath(os.fspath(out))
    ragged = dict(ragged or {})
    arrays: dict[str, Source] = dict(sources)  # every sharded array, by its path in the group
    arrays.update({f"{n}/values": r.values for n, r in ragged.items()})
    closed = False
    try:
        if not sources and not ragged:
            raise ConversionError(f"{out}: no input arrays (empty input)")
        check_output(out, overwrite, _input_paths([*sources.values(), *ragged.values()]))
        num_samples = _validate(sources, ragged)
        dtypes = {n: _check_dtype(s) for n, s in arrays.items()}
        row_bytes = {n: dtypes[n].itemsize * math.prod(s.shape[1:]) for n, s in arrays.items()}
        # a variable-length field counts with its mean sample size when choosing samples per block
        sample_bytes = [row_bytes[n] for n in sources] + [
            max(1, row_bytes[f"{n}/values"] * int(r.offsets[-1]) // num_samples) for n, r in ragged.items()]
        if samples_per_block is None:
            spb = choose_samples_per_block(sample_bytes, block_bytes, num_samples)
        elif samples_per_block < 1:
            raise ConversionError(f"{out}: samples_per_block must be at least 1 (found {samples_per_block})")
        else:
            spb = min(samples_per_block, num_samples)  # more would only write padding
        num_blocks = -(-num_samples // spb)
        first_samples = np.minimum(np.arange(num_blocks + 1, dtype=np.int64) * spb, num_samples)

        remove_stale_temps(out)
        total = sum(row_bytes[n] * s.shape[0] for n, s in arrays.items())
        tmp, made = None, []
        try:
            with _protected():
                tmp, made = _make_temp(out)
                target = _Target(out, tmp)
                try:
                    fields_attr = {n: {"kind": "fixed"} for n in sources}
                    fields_attr.update({n: {"kind": "ragged"} for n in ragged})
                    checksums_attr = {"algorithm": CHECKSUM_ALGORITHM,
                                      "arrays": {n: f"{CHECKSUMS_GROUP}/{n}" for n in fields_attr}}
                    group = zarr.open_group(tmp, mode="w", zarr_format=3)
                    group.attrs[ATTRS_KEY] = {"format": FORMAT_VERSION, "num_samples": num_samples,
                                              "samples_per_block": spb, "fields": fields_attr,
                                              "checksums": checksums_attr}
                    for name, r in ragged.items():
                        sub = group.create_group(name)
                        off = sub.create_array("offsets", shape=r.offsets.shape, dtype=np.int64, compressors=None)
                        off[:] = r.offsets
                except OSError as e:
                    raise target.error(e) from e
            checksums: dict[str, np.ndarray] = {}
            with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(out),
                      disable=None if progress is None else not progress) as bar:
                for key, src in arrays.items():
                    rows = src.shape[0]
                    if key in sources:  # a block is an inner chunk, exactly as stored (padding included)
                        per_chunk = spb
                        crc = _BlockCrc(num_blocks, block_bytes=row_bytes[key] * spb)
                    else:  # values: rows per chunk chosen like samples per block; a block is its samples' rows
                        per_chunk = choose_samples_per_block([row_bytes[key]], block_bytes, max(1, rows))
                        offsets = ragged[key.rsplit("/", 1)[0]].offsets
                        crc = _BlockCrc(num_blocks, bounds=offsets[first_samples] * row_bytes[key])
                    _write_array(group, target, key, src, dtypes[key], rows, per_chunk, row_bytes[key] * per_chunk,
                                 shard_bytes, slice_bytes, bar.update, crc)
                    checksums[key.rsplit("/", 1)[0] if key not in sources else key] = crc.crcs
            _close_all(arrays)
            closed = True
            with _protected():
                try:
                    _write_checksums(group, checksums, num_blocks)
                except OSError as e:
                    raise target.error(e) from e
                read_metadata(tmp)  # the result must parse before it may replace anything
            with _protected(deliver=False):
                try:
                    _publish(tmp, out, overwrite)
                except OSError as e:
                    raise target.error(e, out) from e
        except BaseException as e:
            with _protected():
                if tmp is not None and not isinstance(e, _ForeignTemp):
                    shutil.rmtree(tmp, ignore_errors=True)
                _remove_empty(made)
            raise
    finally:
        if not closed:
            _close_all(arrays)
    return read_metadata(out)


def _write_array(group, target: _Target, key: str, src: Source, dtype: np.dtype, rows: int, per_chunk: int,
                 chunk_bytes: int, shard_bytes: int, slice_bytes: int, progress: Callable[[int], None],
                 crc: _BlockCrc) -> None:
    """One sharded array: metadata through zarr, then its shard files streamed chunk by chunk."""
    shape = src.shape[1:]
    num_chunks = -(-rows // per_chunk)
    cps = max(1, min(shard_bytes // chunk_bytes, num_chunks))
    with _protected():
        try:
            group.create_array(key, shape=(rows, *shape), dtype=dtype, chunks=(per_chunk, *shape),
                               shards=(per_chunk * cps, *shape), fill_value=0, compressors=None, filters=None)
        except OSError as e:
            raise target.error(e) from e
    slice_rows = max(per_chunk, (slice_bytes // chunk_bytes) * per_chunk)
    for shard in range(-(-num_chunks // cps)):
        path = os.path.join(target.tmp, *key.split("/"), "c", str(shard), *(["0"] * len(shape)))
        first = shard * cps * per_chunk
        _write_shard(path, src, dtype, first, min(first + cps * per_chunk, rows), chunk_bytes, cps, slice_rows,
                     progress, crc, target)


def _write_checksums(group, checksums: Mapping[str, np.ndarray], num_blocks: int) -> None:
    """``_checksums/FIELD``: uint32 (num_blocks,), one uncompressed chunk, always written."""
    sub = group.create_group(CHECKSUMS_GROUP)
    for name, crcs in checksums.items():
        arr = sub.create_array(name, shape=(num_blocks,), chunks=(num_blocks,), dtype=np.uint32, fill_value=0,
                               compressors=None, filters=None, config={"write_empty_chunks": True})
        arr[:] = crcs


def convert(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    named: Mapping[str, str] | None = None,
    ragged: Mapping[str, str] | None = None,
    *,
    log: Callable[[str], None] | None = None,
    **options: object,
) -> DatasetMeta:
    """Convert input paths (fields named after files/keys), ``named`` fields (name -> path) and
    variable-length ``ragged`` fields (name -> directory of per-sample .npy, or .npz with values and
    offsets) to ``out``. After a successful conversion ``log`` gets one line per directory input naming
    its first and last file in the order used (natural order: ``2.npy`` before ``10.npy``)."""
    out = os.fspath(out)
    named = dict(named or {})
    ragged = dict(ragged or {})
    all_paths = list(inputs) + [p.rsplit(":", 1)[0] if not os.path.exists(p) else p for p in named.values()]
    all_paths += list(ragged.values())
    if not all_paths:
        raise ConversionError(f"{out}: no inputs given (empty input)")
    for p in all_paths:
        if not os.path.exists(p):
            raise ConversionError(f"{p}: input does not exist")
    check_output(os.path.abspath(out), bool(options.get("overwrite", False)), all_paths)
    sources: dict[str, Source] = {}
    ragged_sources: dict[str, RaggedSource] = {}
    orders: dict[str, tuple[str, ...]] = {}
    try:
        for p in inputs:
            for name, src in open_input(p).items():
                if name in sources or name in named:
                    src.close()
                    raise ConversionError(f"{src.origin}: field '{name}' given twice (rename with --field NAME=PATH)")
                sources[name] = src
                orders.setdefault(p, getattr(src, "files", ()))
        for name, p in named.items():
            sources[name] = open_field(p)
            orders.setdefault(p, getattr(sources[name], "files", ()))
        for name, p in ragged.items():
            ragged_sources[name] = open_ragged(p)
            orders.setdefault(p, getattr(ragged_sources[name].values, "files", ()))
    except BaseException:
        _close_all(sources)
        _close_all(ragged_sources)  # type: ignore[arg-type]
        raise
    meta = write_dataset(out, sources, ragged=ragged_sources, **options)  # type: ignore[arg-type]
    for p, files in orders.items():
        if files and log is not None:
            log(f"{p}: {len(files)} files in natural order, first {files[0]}, last {files[-1]}")
    return meta
