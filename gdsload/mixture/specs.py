"""A mixture's sources as the user gives them: each one's path, fields, renaming and dataset options, checked,
and the reader threads of backends that start their own shared out between the sources."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..backends import info
from ..backends.registry import NAMES
from ..options import field_names
from ..pipeline.mixed_gather import SOURCE_KEY

if TYPE_CHECKING:
    from .source import SourceStream

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
        if kwargs.get("images"):
            raise ValueError(f"source {name!r}: images are not decoded in a Mixture yet (read the encoded field, or "
                             "decode them with a GDSDataset of their own)")
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
        threads = info(backend).threads if isinstance(backend, str) and backend in NAMES else None
        if threads is not None and isinstance(options, Mapping) and "num_threads" not in options:
            count = threads(options)
            if count is not None:
                own[name] = count
    if len(own) < 2:
        return
    for name, count in own.items():
        kwargs = specs[name][3]
        share = max(MIN_THREADS, count // len(own))
        kwargs["backend_options"] = {**(kwargs.get("backend_options") or {}), "num_threads": share}


def named(error: BaseException, message: str) -> BaseException:
    """``error`` again, its message prefixed (the same type, so ``except`` clauses keep working)."""
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - an error type with another constructor: keep the original
        return error


def check_fields(sources: list[SourceStream], specs: dict[str, tuple[Any, Any, dict[str, str], dict]],
                 whole_batches: bool) -> None:
    """Sources mixed by sample give the same fields (after renaming), padded alike; every source gives arrays of
    one output on one device (one pipeline serves them all)."""
    first = None
    for s in sources:
        kwargs, described = specs[s.name][3], s.ds.state_dict()["fields"]
        pad_to, fields = kwargs.get("pad_to"), {}
        for f in s.ds.fields:
            what = described[f]
            width = pad_to.get(f) if isinstance(pad_to, Mapping) else pad_to
            if what.startswith("ragged") and width == "max" and not whole_batches:
                raise ValueError(f"source {s.name!r}: pad_to='max' pads field {f!r} to each batch's longest "
                                 "sample, which differs from source to source (expected an int, or None)")
            if what.startswith("ragged") and width is not None:
                what += f" padded to {width} with {kwargs.get('pad_value', 0)!r}"
            fields[s.rename.get(f, f)] = what
        on = f"device {s.ds.device}" if info(s.ds.backend_name).on_device else "the host"
        where = f"{s.ds.output} arrays on {on}"
        if first is None:
            first = (s.name, fields, where)
            continue
        name, fields0, where0 = first
        if where != where0:
            raise ValueError(f"source {s.name!r} gives {where}, source {name!r} {where0} (one pipeline reads every "
                             "source: they need the same output and device)")
        for f in sorted(fields0.keys() | fields.keys()) if not whole_batches else ():
            if fields0.get(f) != fields.get(f):
                raise ValueError(f"source {s.name!r}: field {f!r} is {fields.get(f, 'absent')}, in source "
                                 f"{name!r} {fields0.get(f, 'absent')} (sources mixed by sample read the same "
                                 "fields; rename with fields={...}, or pass whole_batches=True)")

