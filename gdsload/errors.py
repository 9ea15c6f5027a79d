"""Exception types. Messages read ``PATH: what is wrong (expected X, found Y)``."""

from __future__ import annotations


class GDSLoadError(Exception):
    """Base of every error gdsload raises on purpose."""


class FormatError(GDSLoadError):
    """A dataset on disk does not match the gdsload format (metadata, shard files, index)."""


class ConversionError(GDSLoadError):
    """An input to the converter cannot be turned into a dataset."""


class ReadError(GDSLoadError):
    """A read of a block failed; the message names the file, offset and size."""


class BackendUnavailable(GDSLoadError):
    """The requested backend cannot run here (no GPU, missing package)."""
