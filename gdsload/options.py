"""Checking and normalising GDSDataset's arguments: every bad value is refused naming the argument."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from .errors import BackendUnavailable


def check_int(name: str, value: Any, minimum: int) -> None:
    """``value`` is an int (not a bool) of at least ``minimum``: TypeError or ValueError naming ``name``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (found {type(value).__name__} {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum} (found {value})")


def pad_spec(pad_to: Any, pad_value: Any, ragged: tuple[str, ...]) -> dict[str, tuple[int | None, Any]]:
    """pad_to as given by the user -> {field: (width or None for the batch's longest, pad value)}."""
    if pad_to is None:
        return {}
    per_field = pad_to if isinstance(pad_to, dict) else {f: pad_to for f in ragged}
    spec = {}
    for name, width in per_field.items():
        if name not in ragged:
            raise ValueError(f"pad_to names {name!r}, which is not a variable-length field read here {list(ragged)}")
        if width is None:
            continue
        if width != "max" and (not isinstance(width, int) or width < 0):
            raise ValueError(f"pad_to for {name!r} must be a non-negative int or 'max' (found {width!r})")
        spec[name] = (None if width == "max" else width, pad_value)
    return spec


def require_torch() -> None:
    """Refuse ``output='torch'`` without PyTorch, naming the extra that installs it."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"output='torch' needs PyTorch, which is not installed ({e}); install it with "
                                 f"pip install 'gdsload[torch]', or use the default output") from e


def distributed() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else RANK / WORLD_SIZE, else (0, 1).
    torch is never imported for this: a process group needs torch imported already, and importing it
    costs seconds."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


#: GDSDataset's default ``resident_bytes``.
DEFAULT_RESIDENT_BYTES = 64 << 20


def resident_fields(meta: Any, names: Any, resident_bytes: int) -> tuple[str, ...]:
    """The fixed fields among ``names`` read whole, once, at open (resident): those whose chunks total at most
    ``resident_bytes``. The one rule for GDSDataset and the doctor."""
    return tuple(n for n in names if n in meta.fields
                 and meta.fields[n].block_bytes * meta.fields[n].num_chunks <= resident_bytes)
