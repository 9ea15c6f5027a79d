"""The sources the converter writes from: arrays read sequentially in slices along axis 0, never whole.

Every source reads into buffers of the caller's slice size (``.npy`` through ``readinto``, not memory-mapped),
so peak memory is one slice (docs/design.md, "The converter"). Every failure of an input becomes a
:class:`ConversionError` naming it (:func:`input_error`), where it happens; sizes are checked against the file as
Python ints before anything is allocated. Opening inputs by path is :mod:`gdsload.conversion.sources`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import stat
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import numpy as np

from ..errors import ConversionError, one_line

#: The largest array accepted: past this, byte offsets overflow int64 arithmetic (numpy's and the shard index's).
MAX_ARRAY_BYTES = 1 << 62

#: What a damaged .npy or .npz raises while it is parsed or read: numpy's header parser (ValueError,
#: SyntaxError, tokenize.TokenError), zipfile (BadZipFile, EOFError, NotImplementedError for an unknown
#: compression, RuntimeError for an encrypted member), zlib, and the OS.
INPUT_ERRORS = (OSError, ValueError, SyntaxError, tokenize.TokenError, EOFError, zlib.error, zipfile.BadZipFile,
                NotImplementedError, RuntimeError)


def input_error(origin: str, what: str, e: BaseException) -> ConversionError:
    """The ConversionError for ``e``, raised by whatever read input ``origin``: ``ORIGIN: what (TYPE: detail)``."""
    detail = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e) or type(e).__name__
    return ConversionError(f"{origin}: {what} ({type(e).__name__}: {detail})")


def open_input_file(path: str) -> BinaryIO:
    """Open an input file for reading; a FIFO or device is refused before ``open`` could block on it."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ConversionError(f"{path}: cannot read as an array file (expected a regular file, found {kind})")
        return open(path, "rb")
    except OSError as e:
        raise input_error(path, "cannot open", e) from e


def checked_shape(shape: tuple[int, ...], dtype: np.dtype, origin: str) -> int:
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


#: The .npy format versions numpy reads (``numpy.lib.format``): 1.0 has a 2-byte header length, 2.0 and 3.0 a
#: 4-byte one; 3.0 differs from 2.0 only in a UTF-8 header, which matters for structured field names alone
#: (refused by the converter anyway), so its header is read as 2.0's.
NPY_VERSIONS = ((1, 0), (2, 0), (3, 0))


def read_npy_header(f: BinaryIO, origin: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """Shape, dtype and Fortran order of a .npy stream, left positioned at the start of the data. The header
    is checked as ``numpy.load`` checks it, by numpy's own readers (magic string, format version, the
    dictionary's keys, shape, ``fortran_order``, ``descr``); a bad one is a ConversionError naming ``origin``."""
    try:
        version = np.lib.format.read_magic(f)
        if version not in NPY_VERSIONS:
            raise ConversionError(f"{origin}: not a valid .npy array (unsupported format version "
                                  f"{version[0]}.{version[1]}; expected 1.0, 2.0 or 3.0)")
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    except ConversionError:
        raise
    except INPUT_ERRORS as e:
        raise input_error(origin, "not a valid .npy array", e) from e
    checked_shape(shape, dtype, origin)
    return shape, dtype, bool(fortran)


def check_data_size(origin: str, shape: tuple[int, ...], dtype: np.dtype, available: int) -> None:
    """An array's data must fit in what its file (or zip member) holds past the header: checked before
    any sample is written, so a truncated input fails before the output is begun."""
    nbytes = checked_shape(shape, dtype, origin)
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
            self._seek(start)
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
        except INPUT_ERRORS as e:
            raise input_error(self.origin, f"cannot read samples {start}..{stop}", e) from e
        self._pos = stop
        return out

    def _seek(self, start: int) -> None:
        """Move to sample ``start``: a conversion in parts reads each part's rows only. A zip member seeks by
        decompressing up to there (and from its start, backwards); a stream that cannot seek is refused."""
        try:
            if not self._stream.seekable():
                raise ConversionError(f"{self.origin}: internal error, out-of-order read ({start} after {self._pos})")
            self._stream.seek((start - self._pos) * self.dtype.itemsize * math.prod(self.shape[1:]), os.SEEK_CUR)
        except ConversionError:
            raise
        except INPUT_ERRORS as e:
            raise input_error(self.origin, f"cannot seek to sample {start}", e) from e
        self._pos = start

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
            raise input_error(self.origin, f"cannot read samples {start}..{stop}", e) from e

    def close(self) -> None:
        pass


def as_source(out: str, name: str, obj: Any) -> Source:
    """``obj`` as the source of field ``name`` of the dataset at ``out``: a :class:`Source` as it is, an
    array-like (numpy, zarr, anything with ``shape``, ``dtype`` and slicing along axis 0) wrapped in
    :class:`ArraySource`; anything else is a ConversionError naming the output, the field and the type."""
    if all(hasattr(obj, a) for a in ("origin", "shape", "dtype", "read", "close")):
        return obj
    if all(hasattr(obj, a) for a in ("shape", "dtype", "__getitem__")):
        return ArraySource(f"<{type(obj).__name__} for field {name!r}>", obj)
    raise ConversionError(f"{out}: field {name!r}: expected an array (numpy, zarr, anything with shape, dtype "
                          f"and slicing along axis 0) or a gdsload Source, found {type(obj).__name__}")


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
        raise input_error(origin, f"cannot allocate a buffer of shape {shape} {dtype}", e) from e


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


@dataclass
class LazyNpySource:
    """One .npy file, opened only while it is read: a variable-length field may have a file per sample,
    far more than a process may keep open."""

    origin: str
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)

    def __post_init__(self) -> None:
        with open_input_file(self.origin) as f:
            self.shape, self.dtype, fortran = read_npy_header(f, self.origin)
            self._data_offset = f.tell()
            check_data_size(self.origin, self.shape, self.dtype, os.fstat(f.fileno()).st_size - f.tell())
        if fortran and len(self.shape) > 1:
            raise ConversionError(f"{self.origin}: Fortran-ordered array (save it in C order)")

    def read(self, start: int, stop: int) -> np.ndarray:
        with open_input_file(self.origin) as f:
            row = self.dtype.itemsize * math.prod(self.shape[1:])
            try:
                f.seek(self._data_offset + start * row)
            except OSError as e:
                raise input_error(self.origin, "cannot seek", e) from e
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
