"""Inputs of the converter: paths (.npy, .npz, zarr arrays and groups, directories of them) opened as sources.

Each path becomes one or more :class:`~gdsload.conversion.source_types.Source` (re-exported here), named after
the file, archive member or zarr array; a variable-length field comes from a directory of per-sample ``.npy``
files or a ``.npz`` of ``values`` and ``offsets`` (:func:`open_ragged`). A directory's files are taken in
natural order (``2.npy`` before ``10.npy``); two names of one natural order are refused. Every failure is a
ConversionError naming the input.
"""

from __future__ import annotations

import os
import re
import zipfile

import numpy as np

from ..errors import ConversionError
from .source_types import (INPUT_ERRORS, MAX_ARRAY_BYTES, ArraySource, ConcatSource, LazyNpySource, RaggedSource,
                           Source, StreamSource, check_data_size, checked_shape, input_error, open_input_file,
                           read_npy_header)
from ..errors import one_line

__all__ = [
    # defined here
    "natural_key", "directory_files", "open_npy", "open_npz", "open_zarr", "is_zarr", "open_input", "open_field",
    "open_ragged",
    # re-exported from gdsload.conversion.source_types
    "Source", "ArraySource", "StreamSource", "ConcatSource", "LazyNpySource", "RaggedSource", "MAX_ARRAY_BYTES",
    "one_line",
]


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
        raise input_error(path, "cannot list the directory", e) from e
    names.sort(key=lambda n: (natural_key(n), n))
    for a, b in zip(names, names[1:]):
        if natural_key(a) == natural_key(b):
            raise ConversionError(f"{path}: files '{a}' and '{b}' have no defined order (expected names whose "
                                  "numbers differ, found the same number written two ways)")
    return names


def open_npy(path: str) -> Source:
    """A .npy file: streamed if C-ordered (or 1-D), memory-mapped if Fortran-ordered."""
    f = open_input_file(path)
    try:
        shape, dtype, fortran = read_npy_header(f, path)
        check_data_size(path, shape, dtype, os.fstat(f.fileno()).st_size - f.tell())
        if fortran and len(shape) > 1:
            f.close()
            try:
                return ArraySource(path, np.load(path, mmap_mode="r"))
            except INPUT_ERRORS as e:
                raise input_error(path, "cannot map the Fortran-ordered array", e) from e
    except BaseException:
        f.close()
        raise
    return StreamSource(path, shape, dtype, f)


def open_npz(path: str) -> dict[str, Source]:
    """One streaming source per member of a .npz archive (compressed or not)."""
    open_input_file(path).close()
    try:
        zf = zipfile.ZipFile(path)
    except INPUT_ERRORS as e:
        raise input_error(path, "not a valid .npz archive", e) from e
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
            except INPUT_ERRORS as e:
                raise input_error(origin, "cannot open the archive member", e) from e
            try:
                shape, dtype, fortran = read_npy_header(stream, origin)
                if fortran and len(shape) > 1:
                    raise ConversionError(f"{origin}: Fortran-ordered arrays in .npz are not supported "
                                          "(save with C order)")
                # exactly the member's size: reading all of it reaches the end, where zipfile checks the CRC-32
                nbytes = checked_shape(shape, dtype, origin)
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
        raise input_error(path, "cannot open as zarr", e) from e
    if not arrays:
        raise ConversionError(f"{path}: zarr group holds no arrays (empty input)")
    for name, src in arrays.items():
        checked_shape(src.shape, src.dtype, src.origin)
    return arrays


def is_zarr(path: str) -> bool:
    """A directory holding zarr metadata (v3 ``zarr.json``, v2 ``.zarray`` / ``.zgroup``)."""
    return any(os.path.exists(os.path.join(path, m)) for m in ("zarr.json", ".zarray", ".zgroup"))


def _stem(path: str) -> str:
    """The field name a path gives: its base name without a known extension."""
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
