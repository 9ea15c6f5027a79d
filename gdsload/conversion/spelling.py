"""How the converter's messages spell the option that replaces an output: ``overwrite=True`` for a Python caller
(``write_dataset``, ``convert``, ``upload_dataset``), ``--overwrite`` inside :func:`command_line` (what
``gdsload shard`` runs), so that a message never asks a caller for a flag it cannot pass."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_OVERWRITE = contextvars.ContextVar("gdsload_overwrite_option", default="overwrite=True")


def overwrite_option() -> str:
    """``--overwrite`` inside :func:`command_line`, else ``overwrite=True``."""
    return _OVERWRITE.get()


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Messages inside name the command line's ``--overwrite``."""
    token = _OVERWRITE.set("--overwrite")
    try:
        yield
    finally:
        _OVERWRITE.reset(token)
