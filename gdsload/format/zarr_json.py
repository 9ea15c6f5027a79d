"""Checked reading of Zarr v3 metadata documents (``zarr.json``).

A document is read through :func:`gdsload.format.files.read_small` (refused unread above
:data:`MAX_METADATA_BYTES`) and its values taken one key at a time through these accessors, type and range
checked as Python ints before anything is allocated. Every refusal is a FormatError ``WHERE: what is wrong
(expected X, found Y)`` on one line, values cut short (:func:`show`); no exception of ``json`` escapes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import FormatError, one_line
from .files import read_small

#: A zarr.json larger than this is refused unread (real ones are a few KiB).
MAX_METADATA_BYTES = 16 << 20
#: More dimensions than numpy supports is not an array gdsload can read.
MAX_DIMENSIONS = 32
#: Small whole-read arrays (offsets, checksums) may have chunks this many elements long even when shorter.
MIN_CHUNK_LIMIT = 1 << 16


def fail(where: str, what: str) -> FormatError:
    """The FormatError ``WHERE: what`` (raise it)."""
    return FormatError(f"{where}: {what}")


def show(value: Any) -> str:
    """A value for a message: its repr, cut short (metadata may hold anything)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def exc_text(e: BaseException) -> str:
    """An exception of a library, on one line, cut short."""
    text = one_line(e)
    return f"{type(e).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"


def is_int(value: Any) -> bool:
    """A JSON integer: JSON's true / false are bools, which are ints to Python, and are not integers here."""
    return type(value) is int


def as_int(where: str, what: str, value: Any, minimum: int) -> int:
    """``value`` (named ``what`` in messages), which must be an integer of at least ``minimum``."""
    if not is_int(value):
        raise fail(where, f"{what} must be an integer (found {show(value)})")
    if value < minimum:
        raise fail(where, f"{what} must be at least {minimum} (found {value})")
    return value


def as_object(where: str, what: str, value: Any) -> dict[str, Any]:
    """``value``, which must be a JSON object."""
    if not isinstance(value, dict):
        raise fail(where, f"{what} must be an object (found {show(value)})")
    return value


def as_list(where: str, what: str, value: Any) -> list[Any]:
    """``value``, which must be a JSON list."""
    if not isinstance(value, list):
        raise fail(where, f"{what} must be a list (found {show(value)})")
    return value


def as_shape(where: str, what: str, value: Any, minimum: int, ndim: int | None = None) -> tuple[int, ...]:
    """A list of ints, each at least ``minimum`` (and ``ndim`` long if given)."""
    if (not isinstance(value, list) or not all(is_int(v) and v >= minimum for v in value)
            or not 1 <= len(value) <= MAX_DIMENSIONS or (ndim is not None and len(value) != ndim)):
        length = f"{ndim}" if ndim is not None else f"1 to {MAX_DIMENSIONS}"
        raise fail(where, f"{what} must be a list of {length} integers of at least {minimum} "
                          f"(found {show(value)})")
    return tuple(value)


def valid_name(name: Any) -> bool:
    """A path component that stays inside its directory."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in "/\\\0"))


def valid_key(key: Any) -> bool:
    """A relative path inside the group: valid names joined by '/'."""
    return isinstance(key, str) and all(valid_name(part) for part in key.split("/"))


def read_json(where: str) -> dict[str, Any]:
    """A zarr.json as a dict; anything else (not a regular file, not JSON, not an object) is a FormatError."""
    raw = read_small(where, "zarr.json", MAX_METADATA_BYTES)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep, too long an int
        raise fail(where, f"not valid JSON ({exc_text(e)})") from None
    return as_object(where, "the metadata", doc)


def read_node(where: str, kind: str, missing: str) -> dict[str, Any]:
    """The metadata document of a Zarr v3 node of ``kind`` ("group" or "array")."""
    if not os.path.lexists(where):
        raise fail(where, f"missing ({missing})")
    doc = read_json(where)
    fmt, node = doc.get("zarr_format"), doc.get("node_type")
    if not (is_int(fmt) and fmt == 3 and node == kind):
        raise fail(where, f"not a Zarr v3 {kind} (expected zarr_format 3 and node_type '{kind}', found "
                          f"{show(fmt)} and {show(node)})")
    return doc


def codec_entry(where: str, codec: Any) -> tuple[Any, dict[str, Any]]:
    """(name, configuration) of one codec entry (a name alone stands for a codec without configuration)."""
    if isinstance(codec, str):
        return codec, {}
    codec = as_object(where, "a codec", codec)
    config = codec.get("configuration")
    if config is None:
        return codec.get("name"), {}
    return codec.get("name"), as_object(where, f"configuration of codec {show(codec.get('name'))}", config)


def bytes_endian(where: str, config: dict[str, Any]) -> str:
    """The ``endian`` of a ``bytes`` codec configuration: 'little' (the default) or 'big'."""
    endian = config.get("endian", "little")
    if endian not in ("little", "big"):
        raise fail(where, f"bytes codec endian must be 'little' or 'big' (found {show(endian)})")
    return endian


def chunk_shape(where: str, doc: dict[str, Any], ndim: int) -> tuple[int, ...]:
    """The regular chunk grid's chunk shape (for a sharded array: the shard shape)."""
    grid = as_object(where, "chunk_grid", doc.get("chunk_grid"))
    if grid.get("name") != "regular":
        raise fail(where, f"expected a regular chunk grid, found {show(grid.get('name'))}")
    config = as_object(where, "chunk_grid configuration", grid.get("configuration"))
    return as_shape(where, "chunk_grid chunk_shape", config.get("chunk_shape"), 1, ndim)


def key_encoding(where: str, doc: dict[str, Any], allow_v2: bool = False) -> tuple[str, str]:
    """The chunk key encoding and its separator: ``default`` ('/' unless configured '.') and, if
    ``allow_v2``, ``v2`` ('.' unless configured '/')."""
    enc = as_object(where, "chunk_key_encoding", doc.get("chunk_key_encoding"))
    name = enc.get("name")
    if name != "default" and not (allow_v2 and name == "v2"):
        expected = "'default' or 'v2'" if allow_v2 else "the default"
        raise fail(where, f"expected {expected} chunk key encoding, found {show(name)}")
    config = enc.get("configuration")
    default = "/" if name == "default" else "."
    sep = default if config is None else as_object(where, "chunk_key_encoding configuration",
                                                   config).get("separator", default)
    if sep not in ("/", "."):
        raise fail(where, f"chunk key separator must be '/' or '.' (found {show(sep)})")
    return name, sep


def check_whole_array(where: str, missing: str, what: str, length: int, dtypes: tuple[str, ...]) -> None:
    """Check an array read whole (offsets, checksums): ``length`` elements of one of ``dtypes``, in chunks
    no longer than it needs (a chunk is decoded whole, so its length is memory)."""
    doc = read_node(where, "array", missing)
    shape, dtype = doc.get("shape"), doc.get("data_type")
    if not (isinstance(shape, list) and len(shape) == 1 and is_int(shape[0]) and shape[0] == length
            and isinstance(dtype, str) and dtype in dtypes):
        raise fail(where, f"expected {what}, found shape {show(shape)} of {show(dtype)}")
    (chunk,) = chunk_shape(where, doc, 1)
    if chunk > max(length, MIN_CHUNK_LIMIT):
        raise fail(where, f"chunks of {chunk} elements for an array of {length} (expected at most "
                          f"{max(length, MIN_CHUNK_LIMIT)})")
