"""Backends: what moves a dataset's blocks from its files into a window buffer, in host memory (cpu) or
device memory (pinned, kvikio, mmap). :mod:`gdsload.backends.registry` says what each one is, picks one for
``auto`` and makes them; GPU packages are imported only when a GPU backend is made."""

from __future__ import annotations

from .registry import BACKENDS, ENV_BACKEND, RAM_TIER_SHARE, choose, info, make_backend, resolve

__all__ = ["BACKENDS", "ENV_BACKEND", "RAM_TIER_SHARE", "choose", "info", "make_backend", "resolve"]
