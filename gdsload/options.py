"""Checking and normalising GDSDataset's arguments: every bad value is refused naming the argument."""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .backends import BACKENDS, info, known
from .errors import BackendUnavailable, one_line
from .pipeline.plan import MAX_INT  # the largest integer argument (why: there)

#: The largest device id: CUDA takes it as a C int.
MAX_DEVICE = 2**31 - 1


def check_int(name: str, value: Any, minimum: int, maximum: int = MAX_INT, none_ok: bool = False) -> Any:
    """``value`` -- a Python or numpy integer, never a bool -- as a Python int from ``minimum`` to ``maximum``
    (None as it is, with ``none_ok``): TypeError (not an integer) or ValueError (out of range) naming ``name``.
    Callers keep what it returns, so no numpy scalar (whose arithmetic wraps or refuses Python ints) goes
    further."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int (found {type(value).__name__} {value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int (found {type(value).__name__} {value!r})") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum} (found {number})")
    if number > maximum:
        raise ValueError(f"{name} must be at most {maximum} (found {number})")
    return number


def check_bool(name: str, value: Any) -> bool:
    """``value`` -- True or False, a numpy bool too -- as a Python bool; TypeError naming ``name`` for anything
    else (a string such as ``"no"`` is truthy: taken as a flag it would mean the opposite of what it says)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (found {type(value).__name__} {value!r})")
    return bool(value)


def field_names(fields: Any) -> tuple[str, ...] | None:
    """``fields`` as given (None, one name, or any iterable of names: read once, so an iterator works) as a
    tuple of distinct names; TypeError or ValueError naming ``fields`` for anything else, an empty selection
    included (it would read nothing)."""
    if fields is None:
        return None
    if isinstance(fields, str):
        fields = (fields,)
    if isinstance(fields, (bytes, dict)) or not isinstance(fields, Iterable):
        raise TypeError(f"fields must be a field name or an iterable of them (found {type(fields).__name__})")
    names = tuple(fields)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"fields must be names (str) (found {bad[0]!r} of type {type(bad[0]).__name__})")
    if not names:
        raise ValueError("fields is empty (expected at least one field name, or None for all fields)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"fields names {twice} more than once (expected each field once)")
    return names


def env_int(name: str, default: int, minimum: int, maximum: int = MAX_INT) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty), from ``minimum`` to
    ``maximum``: ValueError naming the variable and its value otherwise."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (expected an int from {minimum} "
                         f"to {maximum})") from None
    if not minimum <= value <= maximum:
        raise ValueError(f"environment variable {name}={raw!r} is out of range (expected an int from {minimum} "
                         f"to {maximum})")
    return value


def pad_spec(pad_to: Any, pad_value: Any, ragged: tuple[str, ...]) -> dict[str, tuple[int | None, Any]]:
    """pad_to as given by the user -> {field: (width or None for the batch's longest, pad value)}. A width is
    a non-negative int (numpy integers too, never a bool) or ``"max"``; checked even where no field is
    variable-length."""
    if pad_to is None:
        return {}
    if isinstance(pad_to, dict):
        per_field = pad_to
    else:
        width = _pad_width("pad_to", pad_to)
        per_field = {f: width for f in ragged}
    spec = {}
    for name, width in per_field.items():
        if name not in ragged:
            raise ValueError(f"pad_to names {name!r}, which is not a variable-length field read here {list(ragged)}")
        if width is None:
            continue
        width = _pad_width(f"pad_to for {name!r}", width)
        spec[name] = (None if width == "max" else width, pad_value)
    return spec


def _pad_width(name: str, width: Any) -> int | str:
    if isinstance(width, str):
        if width == "max":
            return width
        raise ValueError(f"{name} must be a non-negative int or 'max' (found {width!r})")
    try:
        return check_int(name, width, 0)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative int or 'max' (found {width!r})") from None


def device_id(device: Any) -> int:
    """The CUDA device: ``device`` when given, else LOCAL_RANK, else 0 (a C int, as CUDA takes it)."""
    return env_int("LOCAL_RANK", 0, 0, MAX_DEVICE) if device is None else check_int("device", device, 0, MAX_DEVICE)


#: GDSDataset's ``output`` values (None: the backend's own arrays, numpy or cupy).
OUTPUTS = (None, "numpy", "cupy", "torch", "jax")


def check_choices(backend: Any, output: Any, verify: Any, backend_options: Any) -> None:
    """Refuse a ``backend``, ``output``, ``verify`` or ``backend_options`` of the wrong kind, naming it
    (checked before anything is read)."""
    if verify not in (None, True, False):
        raise TypeError(f"verify must be True, False or None (found {verify!r})")
    if backend_options is not None and not isinstance(backend_options, dict):
        raise TypeError(f"backend_options must be a dict (found {type(backend_options).__name__})")
    if not isinstance(backend, str) or not known(backend):
        raise ValueError(f"unknown backend {backend!r} (expected one of {BACKENDS})")
    check_output(output)


def check_output(output: Any) -> None:
    """Refuse an ``output`` that is none of :data:`OUTPUTS`, naming it (checked before anything is read)."""
    if output not in OUTPUTS:
        raise ValueError(f"unknown output {output!r} (expected one of {list(OUTPUTS[1:])}, or None)")


def output_kind(output: str | None, backend: str) -> str:
    """The output kind, checked against the backend: numpy, torch or jax on the cpu backend, cupy, torch or
    jax on a GPU one (ValueError naming the value otherwise; BackendUnavailable for torch without PyTorch,
    jax without JAX, or a GPU backend with a JAX that has no GPU)."""
    check_output(output)
    on_gpu = info(backend).on_device
    output = output or ("cupy" if on_gpu else "numpy")
    allowed = ("cupy", "torch", "jax") if on_gpu else ("numpy", "torch", "jax")
    if output not in allowed:
        raise ValueError(f"output {output!r} does not fit backend {backend!r} (expected one of {allowed})")
    if output == "torch":
        require_torch()
    if output == "jax":
        require_jax(on_gpu)
    return output


def require_torch() -> None:
    """Refuse ``output='torch'`` without PyTorch, naming the extra that installs it."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"output='torch' needs PyTorch, which is not installed ({e}); install it with "
                                 f"pip install 'gdsload[torch]', or use the default output") from e


def require_jax(on_gpu: bool) -> None:
    """Refuse ``output='jax'`` without JAX, or on a GPU backend with a JAX that sees no GPU (a CPU-only
    install: it could not take the device's arrays), naming what to install."""
    try:
        import jax
    except ImportError as e:
        raise BackendUnavailable(f"output='jax' needs JAX, which is not installed ({e}); install it with "
                                 f"pip install 'gdsload[jax]' (CPU) or 'jax[cuda12]' / 'jax[cuda13]' (GPU)") from e
    if on_gpu:
        try:
            jax.devices("gpu")
        except RuntimeError as e:
            raise BackendUnavailable(f"output='jax' on a GPU backend needs JAX with GPU support, which this JAX "
                                     f"lacks ({one_line(e)}); install 'jax[cuda12]' or 'jax[cuda13]', or use "
                                     f"backend='cpu'") from e


def distributed() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else RANK / WORLD_SIZE, else (0, 1).
    torch is never imported for this: a process group needs torch imported already, and importing it
    costs seconds. A malformed RANK or WORLD_SIZE is a ValueError naming the variable and its value."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    world_size = env_int("WORLD_SIZE", 1, 1)
    return env_int("RANK", 0, 0), world_size


def rank_and_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """GDSDataset's ``rank`` and ``world_size`` as Python ints, each from the argument when given, else from
    :func:`distributed`; a rank not below the world size is a ValueError naming where each came from."""
    given_rank, given_world = rank is not None, world_size is not None
    if given_rank:
        rank = check_int("rank", rank, 0)
    if given_world:
        world_size = check_int("world_size", world_size, 1)
    if not (given_rank and given_world):
        env_rank, env_world = distributed()
        rank = rank if given_rank else env_rank
        world_size = world_size if given_world else env_world
    if rank >= world_size:
        src = "" if given_rank and given_world else " (what is not passed comes from torch.distributed, else RANK / " \
                                                    "WORLD_SIZE)"
        raise ValueError(f"rank must be below world_size (found rank {rank}, world_size {world_size}){src}")
    return rank, world_size


def image_specs(images: Any, meta: Any, fields: Sequence[str], pad: dict[str, Any]) -> dict[str, Any]:
    """``images`` as given (field -> :class:`~gdsload.codecs.image_params.ImageSpec`, or None) -> the specs,
    checked: each names an image field read here (its entry records image formats: ``gdsload shard
    --images``), not padded; a ValueError or TypeError naming it otherwise."""
    from .codecs.image_params import ImageSpec

    if images is None:
        return {}
    if not isinstance(images, dict):
        raise TypeError(f"images must be a dict of field name -> ImageSpec (found {type(images).__name__})")
    for name, spec in images.items():
        if not isinstance(spec, ImageSpec):
            raise TypeError(f"images[{name!r}] must be a gdsload.ImageSpec (found {type(spec).__name__})")
        ragged = meta.ragged.get(name)
        if name not in fields or ragged is None or not ragged.image_formats:
            raise ValueError(f"images names {name!r}, which is not an image field read here (image fields: "
                             f"{[n for n, r in meta.ragged.items() if r.image_formats and n in fields]}; "
                             f"'gdsload shard --images' writes them)")
        if name in pad:
            raise ValueError(f"images[{name!r}]: an image field decoded to one shape is not padded (pad_to)")
        spec.check(name)
    return dict(images)
