"""Exception types. Messages are one line: ``PATH: what is wrong (expected X, found Y)``.

Each error also subclasses the built-in it resembles (as zarr's ``NodeNotFoundError`` is a
``FileNotFoundError``), so code written against the built-ins keeps catching them: a bad dataset or input
is a ``ValueError``, a failed read an ``OSError``, a backend that cannot run here a ``RuntimeError``.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class GDSLoadError(Exception):
    """Base of every error gdsload raises on purpose."""


class FormatError(GDSLoadError, ValueError):
    """A dataset on disk does not match the gdsload format (metadata, shard files, index)."""


class ConversionError(GDSLoadError, ValueError):
    """An input to the converter cannot be turned into a dataset."""


class ReadError(GDSLoadError, OSError):
    """A read of a block failed; the message names the file, offset and size."""


class ChecksumError(ReadError, FormatError):
    """Data on disk differs from the checksum stored for it (a block's, a chunk's crc32c codec, a shard
    index's): what was read is not what was written. Both a ReadError (found while reading) and a
    FormatError (the dataset on disk is damaged), as ``io.UnsupportedOperation`` is both an OSError and a
    ValueError; the message names the file, the field or array, the block or chunk, and the offset."""


class DecodeError(ReadError):
    """A decode on the device did not end within its bound (a damaged frame can hang nvCOMP): the message names
    the file, the chunk and the bound, and says the process may have to exit (the GPU may stay busy)."""


class BackendUnavailable(GDSLoadError, RuntimeError):
    """The requested backend cannot run here (no GPU, missing package)."""


def one_line(text: object) -> str:
    """An embedded error message on one line (messages from zarr, numcodecs or the OS may span several)."""
    return " ".join(str(text).split())


def printable(text: object) -> str:
    """A message for a terminal on one line: control characters (a newline in a file name) and undecodable
    bytes escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside gdsload (the user's line), however deep in
    the package the warning is raised."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


def with_context(error: E, context: str) -> E:
    """``error`` again with `` (context)`` appended to its message, of the same type and with the same
    attributes (a ``CacheFull``'s ``need``, an ``OSError``'s ``errno``), to be raised ``from error``.

    Why not ``type(e)(f"{e} (...)")``: a subclass whose ``__init__`` takes other arguments (``CacheFull``)
    fails that call with a ``TypeError`` that hides the real error. The copy is made without calling
    ``__init__``; its ``args`` carry the new message (:func:`reworded`)."""
    return reworded(error, f"{error} ({context})")


def reworded(error: E, message: str) -> E:
    """``error`` again with ``message`` in place of its own, of the same type and with the same attributes, as
    :func:`with_context` makes it (a message with its URLs redacted, or naming a URL for a file of the cache)."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(getattr(error, "__dict__", {}))
    copy.args = (message,)
    if isinstance(error, OSError):  # str() of an OSError with strerror set ignores args: keep errno alone
        copy.errno = error.errno
    return copy
