"""What the converter checks of its sources before anything is written.

Field names (one path component that zarr and the dataset's own files leave free), dtypes (bool, integer,
float or complex, stored little endian), shapes (samples on axis 0, none of size zero, at most
:data:`gdsload.conversion.source_types.MAX_ARRAY_BYTES`), the offsets of variable-length fields, and one
sample count shared by every field. Each failure is a ConversionError naming the input it concerns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..errors import ConversionError
from ..format.meta import CHECKSUMS_GROUP
from .source_types import MAX_ARRAY_BYTES, RaggedSource, Source

#: Field names that would land on the group's own metadata file or on the checksums group.
RESERVED_NAMES = ("zarr.json", CHECKSUMS_GROUP)
#: A field is a directory: its name is one path component.
NAME_MAX_BYTES = 255


def check_dtype(src: Source) -> np.dtype:
    """The dtype a source is stored as (little endian); ConversionError for one gdsload cannot store."""
    dt = src.dtype
    if dt.fields is not None or dt.kind == "V":
        raise ConversionError(f"{src.origin}: unsupported dtype {dt} (structured arrays: save each field separately)")
    if dt.kind not in "biufc":
        raise ConversionError(
            f"{src.origin}: unsupported dtype {dt} (expected bool, integer, float or complex; found kind '{dt.kind}')"
        )
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


def check_name(name: str, origin: str) -> None:
    """A field name must be one path component free for the field's directory (ConversionError if not)."""
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


def check_ragged(name: str, r: RaggedSource) -> int:
    """Check a variable-length field; returns its number of samples."""
    check_name(name, r.origin)
    check_dtype(r.values)
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


def check_sources(sources: Mapping[str, Source], ragged: Mapping[str, RaggedSource] | None = None) -> int:
    """Check every field (fixed ``sources`` and variable-length ``ragged``); returns their one sample count."""
    ragged = ragged or {}
    if not sources and not ragged:
        raise ConversionError("no input arrays (empty input)")
    twice = sorted(set(sources) & set(ragged))
    if twice:
        raise ConversionError(f"{ragged[twice[0]].origin}: field '{twice[0]}' given twice")
    counts = {name: check_ragged(name, r) for name, r in ragged.items()}
    origins = {name: r.origin for name, r in ragged.items()}
    for name, src in sources.items():
        check_name(name, src.origin)
        check_dtype(src)
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
