"""Inputs of the converter: arrays read sequentially in slices, never whole.

Every source reads into buffers of the caller's slice size, so peak memory is bounded by the slice, not by
the input. ``.npy`` files are read with ``readinto`` rather than memory-mapped, so the pages read do not
count against the process's resident memory either.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import numpy as np

from .errors import ConversionError


class Source(Protocol):
    """An array of shape (N, ...) read in increasing, non-overlapping ranges of axis 0."""

    origin: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, start: int, stop: int) -> np.ndarray: ...

    def close(self) -> None: ...


def _read_npy_header(f: BinaryIO, origin: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except ValueError as e:
        raise ConversionError(f"{origin}: not a valid .npy array ({e})") from e
    return tuple(int(s) for s in shape), np.dtype(dtype), bool(fortran)


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
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        got = 0
        while got < len(view):
            n = self._stream.readinto(view[got:])
            if not n:
                raise ConversionError(
                    f"{self.origin}: file ends early (expected {len(view)} bytes for samples {start}..{stop}, got {got})"
                )
            got += n
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
        return np.asarray(self.array[start:stop])

    def close(self) -> None:
        pass


@dataclass
class ConcatSource:
    """Several sources of equal sample shape and dtype, concatenated along axis 0."""

    origin: str
    parts: list[Source]
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)

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
    f = open(path, "rb")
    shape, dtype, fortran = _read_npy_header(f, path)
    if fortran and len(shape) > 1:
        f.close()
        return ArraySource(path, np.load(path, mmap_mode="r"))
    return StreamSource(path, shape, dtype, f)


def open_npz(path: str) -> dict[str, Source]:
    """One streaming source per member of a .npz archive (compressed or not)."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ConversionError(f"{path}: not a valid .npz archive ({e})") from e
    out: dict[str, Source] = {}
    for name in sorted(zf.namelist()):
        if not name.endswith(".npy"):
            continue
        origin = f"{path}:{name[:-4]}"
        stream = zf.open(name)
        shape, dtype, fortran = _read_npy_header(stream, origin)
        if fortran and len(shape) > 1:
            raise ConversionError(f"{origin}: Fortran-ordered arrays in .npz are not supported (save with C order)")
        out[name[:-4]] = StreamSource(origin, shape, dtype, stream)
    return out


def open_zarr(path: str) -> dict[str, Source]:
    """A zarr array (one field named after it) or group (one field per array member)."""
    import zarr

    try:
        node = zarr.open(path, mode="r")
    except Exception as e:
        raise ConversionError(f"{path}: cannot open as zarr ({type(e).__name__}: {e})") from e
    if isinstance(node, zarr.Array):
        return {_stem(path): ArraySource(path, node)}
    return {name: ArraySource(os.path.join(path, name), arr) for name, arr in sorted(node.arrays())}


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
        names = sorted(n for n in os.listdir(path) if n.endswith((".npy", ".npz")))
        kinds = {os.path.splitext(n)[1] for n in names}
        if not names:
            raise ConversionError(f"{path}: directory holds no .npy or .npz files (empty input)")
        if len(kinds) > 1:
            raise ConversionError(f"{path}: directory mixes .npy and .npz files (expected one kind)")
        files = [os.path.join(path, n) for n in names]
        if kinds == {".npy"}:
            return {_stem(path): ConcatSource(path, [open_npy(f) for f in files])}
        per_file = [open_npz(f) for f in files]
        keys = list(per_file[0])
        for f, members in zip(files, per_file):
            if list(members) != keys:
                raise ConversionError(f"{f}: holds arrays {list(members)} (expected the same as {files[0]}: {keys})")
        return {k: ConcatSource(f"{path}:{k}", [m[k] for m in per_file]) for k in keys}
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
        with open(self.origin, "rb") as f:
            self.shape, self.dtype, fortran = _read_npy_header(f, self.origin)
            self._data_offset = f.tell()
        if fortran and len(self.shape) > 1:
            raise ConversionError(f"{self.origin}: Fortran-ordered array (save it in C order)")

    def read(self, start: int, stop: int) -> np.ndarray:
        with open(self.origin, "rb") as f:
            row = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
            f.seek(self._data_offset + start * row)
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
    """A directory of per-sample .npy files (sorted names; lengths may differ, trailing shape may not) or
    a .npz holding ``values`` and ``offsets``."""
    if not os.path.exists(path):
        raise ConversionError(f"{path}: input does not exist")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".npy"))
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
        return RaggedSource(path, ConcatSource(path, parts), offsets)
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
