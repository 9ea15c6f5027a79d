"""What a forked child does with the datasets it inherited: nothing that touches CUDA.

In the child every inherited dataset is marked unusable (iterating it raises :class:`GDSLoadError`), its
finalizer detached and what it holds kept referenced until the child exits; objects the parent dropped but had
not yet collected are frozen out of the child's garbage collector. A dataset opened in the child is unaffected.
Why: docs/design.md, "Fork safety".
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

from .backends import info
from .errors import GDSLoadError

_open: weakref.WeakSet[Any] = weakref.WeakSet()
_kept: list[Any] = []  # in a child: what inherited datasets hold, never freed there


def track(dataset: Any) -> None:
    """Register an open dataset (its ``_pid`` is the process that opened it)."""
    dataset._pid = os.getpid()
    _open.add(dataset)


def check(dataset: Any) -> None:
    """Refuse to use a dataset in a process it was not opened in."""
    if getattr(dataset, "_pid", os.getpid()) != os.getpid():
        raise GDSLoadError(f"{dataset.meta.path}: this dataset was opened in process {dataset._pid} and inherited "
                           f"by fork; a child process cannot use the parent's GPU state: open a new GDSDataset "
                           f"in the child")


def _after_fork_in_child() -> None:
    inherited = list(_open)
    if not inherited:
        return
    for ds in inherited:
        ds._finalizer.detach()
        _kept.append(ds.__dict__.copy())
    _open.clear()
    if any(info(ds.backend_name).on_device for ds in inherited):
        gc.freeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _after_fork_in_child())
