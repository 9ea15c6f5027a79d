"""A mixture's sources as the user gives them: each one's path, fields, renaming and dataset options, checked,
and the reader threads of backends that start their own shared out between the sources."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..backends import info
from ..backends.registry import NAMES
from ..options import field_names
from .assemble import SOURCE_KEY

MIN_THREADS = 2  # reader threads a source's own pool keeps when the mixture shares them out
MIXTURE_OPTIONS = ("rank", "world_size", "exact_shares", "drop_last")  # the mixture's, the same for every source


def source_specs(sources: Any, options: dict[str, Any]) -> dict[str, tuple[Any, Any, dict[str, str], dict]]:
    """name -> (path, fields for GDSDataset, {field: name in the mixture}, the dataset's other options)."""
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError(f"sources must be a non-empty dict of name -> path or dict of options (found "
                        f"{type(sources).__name__})")
    specs = {}
    for name, spec in sources.items():
        if not isinstance(name, str):
            raise TypeError(f"source names must be str (found {name!r})")
        spec = dict(spec) if isinstance(spec, Mapping) else {"path": spec}
        if not isinstance(spec.get("path"), (str, os.PathLike)):
            raise TypeError(f"source {name!r}: expected a path or a dict with a 'path' (found {spec.get('path')!r})")
        kwargs = {**options, **spec}
        path, fields = kwargs.pop("path"), kwargs.pop("fields", None)
        fixed = [k for k in MIXTURE_OPTIONS if k in kwargs and not (k == "drop_last" and kwargs[k] is False)]
        if fixed:
            raise ValueError(f"source {name!r}: {fixed} are the mixture's (rank and world_size: pass them to "
                             "Mixture; every source is read in exact shares, no sample dropped)")
        rename = {}
        if isinstance(fields, Mapping):
            rename = dict(fields)
            if not all(isinstance(v, str) for v in rename.values()) or len(set(rename.values())) < len(rename):
                raise ValueError(f"source {name!r}: fields {rename!r} must map fields to distinct names (str)")
            fields = list(rename)
        fields = field_names(fields)
        if SOURCE_KEY in (rename.get(f, f) for f in fields or ()):
            raise ValueError(f"source {name!r}: field {SOURCE_KEY!r} would hide the mixture's source index (rename "
                             f"it: fields={{'{SOURCE_KEY}': 'other name'}})")
        specs[name] = (path, fields, rename, kwargs)
    share_threads(specs)
    return specs


def share_threads(specs: dict[str, tuple[Any, Any, dict[str, str], dict]]) -> None:
    """Sources whose backend starts reader threads of its own (``BackendInfo.threads``, sized for a process
    reading one dataset) split that default between them equally, unless their options set ``num_threads``:
    several full pools on the same cores would fight over them, while the bytes to read are those of one."""
    own = {}
    for name, (_, _, _, kwargs) in specs.items():
        backend, options = kwargs.get("backend", "auto"), kwargs.get("backend_options") or {}
        if isinstance(backend, str) and backend in NAMES and isinstance(options, Mapping) \
                and info(backend).threads is not None and "num_threads" not in options:
            own[name] = backend
    if len(own) < 2:
        return
    for name, backend in own.items():
        kwargs = specs[name][3]
        share = max(MIN_THREADS, info(backend).threads() // len(own))  # type: ignore[misc]
        kwargs["backend_options"] = {**(kwargs.get("backend_options") or {}), "num_threads": share}


def named(error: BaseException, message: str) -> BaseException:
    """``error`` again, its message prefixed (the same type, so ``except`` clauses keep working)."""
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - an error type with another constructor: keep the original
        return error
