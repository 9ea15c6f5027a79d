"""Inputs of the converter: arrays read sequentially in slices, never whole.

Every source reads into buffers of the caller's slice size, so peak memory is bounded by the slice, not by
the input. ``.npy`` files are read with ``readinto`` rather than memory-mapped, so the pages read do not
count against the process's resident memory either.

Every failure of an input, whatever raised it (the OS, zipfile, zlib, numpy's header parser, zarr's codecs),
becomes a :class:`ConversionError` naming the input here, where it happens; an array's size is checked
against its file with Python ints before anything is allocated. Files of a directory input are taken in
natural order (``2.npy`` before ``10.npy``), so numbered parts keep their samples in step with other fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import stat
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import numpy as np

from .errors import ConversionError

MAX_ARRAY_BYTES = 1 << 62  # past this, byte offsets overflow int64 arithmetic (numpy's and the shard index's)

# What a damaged .npy or .npz raises while it is parsed or read: numpy's header parser (ValueError,
# SyntaxError, tokenize.TokenError), zipfile (BadZipFile, EOFError, NotImplementedError for an unknown
# compression, RuntimeError for an encrypted member), zlib, and the OS.
_READ_ERRORS = (OSError, ValueError, SyntaxError, tokenize.TokenError, EOFError, zlib.error, zipfile.BadZipFile,
                NotImplementedError, RuntimeError)


def one_line(text: object) -> str:
    """An embedded error message on one line (messages from zarr or numcodecs may span several)."""
    return " ".join(str(text).split())


def _read_error(origin: str, what: str, e: BaseException) -> ConversionError:
    detail = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e) or type(e).__name__
    return ConversionError(f"{origin}: {what} ({type(e).__name__}: {detail})")


def natural_key(name: str) -> tuple[str | int, ...]:
    """Sort key of a file name: runs of digits compare as numbers, so ``2.npy`` sorts before ``10.npy``.
    Text and numbers alternate, starting with (possibly empty) text, so any two keys compare."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"([0-9]+)", name)))


def directory_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """Names in directory ``path`` ending with one of ``suffixes``, in natural order. Two names with the
    same natural key (``1.npy`` and ``01.npy``) have no defined order between them and are refused."""
    try:
        names = [n for n in os.listdir(path) if n.endswith(suffixes)]
    except OSError as e:
        raise _read_error(path, "cannot list the directory", e) from e
    names.sort(key=lambda n: (natural_key(n), n))
    for a, b in zip(names, names[1:]):
        if natural_key(a) == natural_key(b):
            raise ConversionError(f"{path}: files '{a}' and '{b}' have no defined order (expected names whose "
                                  "numbers differ, found the same number written two ways)")
    return names


def _open_regular(path: str) -> BinaryIO:
    """Open an input file for reading; a FIFO or device is refused before ``open`` could block on it."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ConversionError(f"{path}: cannot read as an array file (expected a regular file, found {kind})")
        return open(path, "rb")
    except OSError as e:
        raise _read_error(path, "cannot open", e) from e


def _checked_shape(shape: tuple[int, ...], dtype: np.dtype, origin: str) -> int:
    """Bytes of an array of ``shape`` and ``dtype``, computed with Python ints (numpy's int64 would wrap)."""
    if any(s < 0 for s in shape):
        raise ConversionError(f"{origin}: negative dimension in shape {shape} (expected sizes >= 0)")
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes > MAX_ARRAY_BYTES:
        raise ConversionError(f"{origin}: shape {shape} of {dtype} is {nbytes} bytes (expected at most 2**62)")
    return nbytes


class Source(Protocol):
    """An array of shape (N, ...) read in increasing, non-overlapping ranges of axis 0."""

    origin: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def close(self) -> None: ...


def _read_npy_header(f: BinaryIO, origin: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """Shape, dtype and Fortran order of a .npy stream, left positioned at the start of the data."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    except _READ_ERRORS as e:
        raise _read_error(origin, "not a valid .npy array", e) from e
    _checked_shape(shape, dtype, origin)
    return shape, dtype, bool(fortran)


def _check_data_size(origin: str, shape: tuple[int, ...], dtype: np.dtype, available: int) -> None:
    """An array's data must fit in what its file (or zip member) holds past the header: checked before
    any sample is written, so a truncated input fails before the output is begun."""
    nbytes = _checked_shape(shape, dtype, origin)
    if available < nbytes:
        raise ConversionError(f"{origin}: file ends early (expected {nbytes} bytes of array data for shape "
                              f"{shape} {dtype}, found {max(available, 0)})")


@dataclass
class StreamSource:
    """A C-ordered .npy payload in a byte stream (a file, or a member of a .npz zip)."""

    origin: str
    shape: tuple[int, ...]
    dtype: np.dtype
    _stream: BinaryIO
    _pos: int = 0

    def read(self, start: int, stop: int) -> np.ndarray:
        if start != self._pos:
            raise ConversionError(f"{self.origin}: internal error, out-of-order read ({start} after {self._pos})")
        out = _empty(self.origin, (stop - start, *self.shape[1:]), self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        got = 0
        try:
            while got < len(view):
                n = self._stream.readinto(view[got:])
                if not n:
                    raise ConversionError(f"{self.origin}: file ends early (expected {len(view)} bytes for "
                                          f"samples {start}..{stop}, got {got})")
                got += n
            if stop == self.shape[0]:
                self._stream.read(1)  # reach the end of a zip member, where zipfile checks its CRC-32
        except ConversionError:
            raise
        except _READ_ERRORS as e:
            raise _read_error(self.origin, f"cannot read samples {start}..{stop}", e) from e
        self._pos = stop
        return out

    def close(self) -> None:
        self._stream.close()


@dataclass
class ArraySource:
    """An array-like that supports slicing along axis 0 (zarr arrays, Fortran-ordered .npy memmaps)."""

    origin: str
    array: Any
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.array.shape)
        self.dtype = np.dtype(self.array.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(self.array[start:stop])
        except ConversionError:
            raise
        except Exception as e:  # a damaged zarr chunk fails in whichever codec decodes it, with its own type
            _settle_zarr()
            raise _read_error(self.origin, f"cannot read samples {start}..{stop}", e) from e

    def close(self) -> None:
        pass


def _settle_zarr() -> None:
    """After a failed zarr read, let zarr's other chunk reads of that call finish: zarr does not cancel them,
    and asyncio reports a task still pending at exit on stderr, which would spoil a one-line error."""
    try:
        from zarr.core.sync import sync
    except ImportError:
        return

    async def drain() -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    with contextlib.suppress(Exception):
        sync(drain())


def _empty(origin: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    try:
        return np.empty(shape, dtype=dtype)
    except (MemoryError, ValueError) as e:
        raise _read_error(origin, f"cannot allocate a buffer of shape {shape} {dtype}", e) from e


@dataclass
class ConcatSource:
    """Several sources of equal sample shape and dtype, concatenated along axis 0; ``files`` names the
    files of a directory input in the order used."""

    origin: str
    parts: list[Source]
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)
    files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        first = self.parts[0]
        for p in self.parts[1:]:
            if p.shape[1:] != first.shape[1:] or p.dtype != first.dtype:
                raise ConversionError(
                    f"{p.origin}: cannot concatenate with {first.origin} "
                    f"(expected sample shape {first.shape[1:]} {first.dtype}, found {p.shape[1:]} {p.dtype})"
                )
        self.shape = (sum(p.shape[0] for p in self.parts), *first.shape[1:])
        self.dtype = first.dtype
        self._bounds = np.cumsum([0] + [p.shape[0] for p in self.parts])

    def read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        for i, p in enumerate(self.parts):
            lo, hi = int(self._bounds[i]), int(self._bounds[i + 1])
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                pieces.append(p.read(a - lo, b - lo))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def close(self) -> None:
        for p in self.parts:
            p.close()


def open_npy(path: str) -> Source:
    f = _open_regular(path)
    try:
        shape, dtype, fortran = _read_npy_header(f, path)
        _check_data_size(path, shape, dtype, os.fstat(f.fileno()).st_size - f.tell())
        if fortran and len(shape) > 1:
            f.close()
            try:
                return ArraySource(path, np.load(path, mmap_mode="r"))
            except _READ_ERRORS as e:
                raise _read_error(path, "cannot map the Fortran-ordered array", e) from e
    except BaseException:
        f.close()
        raise
    return StreamSource(path, shape, dtype, f)


def open_npz(path: str) -> dict[str, Source]:
    """One streaming source per member of a .npz archive (compressed or not)."""
    _open_regular(path).close()
    try:
        zf = zipfile.ZipFile(path)
    except _READ_ERRORS as e:
        raise _read_error(path, "not a valid .npz archive", e) from e
    out: dict[str, Source] = {}
    try:
        infos = sorted((i for i in zf.infolist() if i.filename.endswith(".npy")), key=lambda i: i.filename)
        for a, b in zip(infos, infos[1:]):
            if a.filename == b.filename:
                raise ConversionError(f"{path}: archive holds two members named '{a.filename}' (expected one)")
        if not infos:
            raise ConversionError(f"{path}: archive holds no .npy arrays (empty input)")
        for info in infos:
            origin = f"{path}:{info.filename[:-4]}"
            try:
                stream = zf.open(info)
            except _READ_ERRORS as e:
                raise _read_error(origin, "cannot open the archive member", e) from e
            try:
                shape, dtype, fortran = _read_npy_header(stream, origin)
                if fortran and len(shape) > 1:
                    raise ConversionError(f"{origin}: Fortran-ordered arrays in .npz are not supported "
                                          "(save with C order)")
                # exactly the member's size: reading all of it reaches the end, where zipfile checks the CRC-32
                nbytes = _checked_shape(shape, dtype, origin)
                available = info.file_size - stream.tell()
                if available != nbytes:
                    raise ConversionError(f"{origin}: {'file ends early' if available < nbytes else 'member too long'}"
                                          f" (expected {nbytes} bytes of array data for shape {shape} {dtype}, "
                                          f"found {max(available, 0)})")
            except BaseException:
                stream.close()
                raise
            out[info.filename[:-4]] = StreamSource(origin, shape, dtype, stream)
    except BaseException:
        for m in out.values():
            m.close()
        raise
    finally:
        zf.close()  # the archive file stays open until its last member stream is closed
    return out


def open_zarr(path: str) -> dict[str, Source]:
    """A zarr array (one field named after it) or group (one field per array member)."""
    import zarr

    try:
        node = zarr.open(path, mode="r")
        if isinstance(node, zarr.Array):
            arrays = {_stem(path): ArraySource(path, node)}
        else:
            arrays = {name: ArraySource(os.path.join(path, name), arr) for name, arr in sorted(node.arrays())}
    except Exception as e:  # zarr raises several types for a store it cannot open
        raise _read_error(path, "cannot open as zarr", e) from e
    if not arrays:
        raise ConversionError(f"{path}: zarr group holds no arrays (empty input)")
    for name, src in arrays.items():
        _checked_shape(src.shape, src.dtype, src.origin)
    return arrays


def is_zarr(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, m)) for m in ("zarr.json", ".zarray", ".zgroup"))


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    for ext in (".npy", ".npz", ".zarr", ".gds"):
        if base.endswith(ext):
            return base[: -len(ext)]
    return base


def open_input(path: str) -> dict[str, Source]:
    """Fields of one input path: .npy, .npz, a zarr array/group, or a directory of .npy or of .npz."""
    if not os.path.exists(path):
        raise ConversionError(f"{path}: input does not exist")
    if os.path.isdir(path):
        if is_zarr(path):
            return open_zarr(path)
        names = directory_files(path, (".npy", ".npz"))
        kinds = {os.path.splitext(n)[1] for n in names}
        if not names:
            raise ConversionError(f"{path}: directory holds no .npy or .npz files (empty input)")
        if len(kinds) > 1:
            raise ConversionError(f"{path}: directory mixes .npy and .npz files (expected one kind)")
        files = [os.path.join(path, n) for n in names]
        if kinds == {".npy"}:
            return {_stem(path): ConcatSource(path, [open_npy(f) for f in files], files=tuple(names))}
        per_file = [open_npz(f) for f in files]
        keys = list(per_file[0])
        for f, members in zip(files, per_file):
            if list(members) != keys:
                raise ConversionError(f"{f}: holds arrays {list(members)} (expected the same as {files[0]}: {keys})")
        return {k: ConcatSource(f"{path}:{k}", [m[k] for m in per_file], files=tuple(names)) for k in keys}
    if path.endswith(".npy"):
        return {_stem(path): open_npy(path)}
    if path.endswith(".npz"):
        return open_npz(path)
    raise ConversionError(f"{path}: unsupported input (expected .npy, .npz, a directory of them, or a zarr store)")


def open_field(path: str) -> Source:
    """The single array at ``path`` (``FILE.npz:KEY`` selects one member of an archive)."""
    if ":" in path and not os.path.exists(path):
        archive, key = path.rsplit(":", 1)
        members = open_input(archive)
        if key not in members:
            raise ConversionError(f"{archive}: has no array '{key}' (found {list(members)})")
        return members[key]
    members = open_input(path)
    if len(members) != 1:
        raise ConversionError(f"{path}: holds {len(members)} arrays {list(members)} (expected one; use FILE.npz:KEY)")
    return next(iter(members.values()))


@dataclass
class LazyNpySource:
    """One .npy file, opened only while it is read: a variable-length field may have a file per sample,
    far more than a process may keep open."""

    origin: str
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)

    def __post_init__(self) -> None:
        with _open_regular(self.origin) as f:
            self.shape, self.dtype, fortran = _read_npy_header(f, self.origin)
            self._data_offset = f.tell()
            _check_data_size(self.origin, self.shape, self.dtype, os.fstat(f.fileno()).st_size - f.tell())
        if fortran and len(self.shape) > 1:
            raise ConversionError(f"{self.origin}: Fortran-ordered array (save it in C order)")

    def read(self, start: int, stop: int) -> np.ndarray:
        with _open_regular(self.origin) as f:
            row = self.dtype.itemsize * math.prod(self.shape[1:])
            try:
                f.seek(self._data_offset + start * row)
            except OSError as e:
                raise _read_error(self.origin, "cannot seek", e) from e
            stream = StreamSource(self.origin, self.shape, self.dtype, f, start)
            return stream.read(start, stop)

    def close(self) -> None:
        pass


@dataclass
class RaggedSource:
    """A variable-length field: every sample's rows back to back, and where each sample starts."""

    origin: str
    values: Source
    offsets: np.ndarray  # int64, num_samples + 1

    def close(self) -> None:
        self.values.close()


def open_ragged(path: str) -> RaggedSource:
    """A directory of per-sample .npy files (in natural order of their names; lengths may differ, trailing
    shape may not) or a .npz holding ``values`` and ``offsets``."""
    if not os.path.exists(path):
        raise ConversionError(f"{path}: input does not exist")
    if os.path.isdir(path):
        names = directory_files(path, (".npy",))
        if not names:
            raise ConversionError(f"{path}: directory holds no .npy files (empty input)")
        parts: list[Source] = []
        for n in names:
            part = LazyNpySource(os.path.join(path, n))
            if len(part.shape) == 0:
                raise ConversionError(f"{part.origin}: a scalar (expected a sequence: at least one dimension)")
            parts.append(part)
        lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return RaggedSource(path, ConcatSource(path, parts, files=tuple(names)), offsets)
    if path.endswith(".npz"):
        members = open_npz(path)
        if set(members) != {"values", "offsets"}:
            for m in members.values():
                m.close()
            raise ConversionError(f"{path}: a variable-length field needs arrays 'values' and 'offsets' "
                                  f"(found {sorted(members)})")
        off = members["offsets"]
        offsets = np.asarray(off.read(0, off.shape[0]))
        off.close()
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
            raise ConversionError(f"{path}:offsets: expected a 1-D integer array (found {offsets.dtype} "
                                  f"{offsets.shape})")
        return RaggedSource(path, members["values"], offsets.astype(np.int64))
    raise ConversionError(f"{path}: a variable-length field comes from a directory of per-sample .npy "
                          "files or a .npz with 'values' and 'offsets'")
