"""Backends: what moves a dataset's blocks from its files into a window buffer, in host memory (cpu) or
device memory (pinned, kvikio, mmap). :mod:`gdsload.backends.registry` says what each one is, picks one for
``auto`` and makes them, and adds one's own (:func:`register`); GPU packages are imported only when a GPU
backend is made."""

from __future__ import annotations

from .registry import (BACKENDS, ENV_BACKEND, RAM_TIER_SHARE, choose, info, known, make_backend, register, resolve,
                       unregister)

__all__ = ["BACKENDS", "ENV_BACKEND", "RAM_TIER_SHARE", "choose", "info", "known", "make_backend", "register",
           "resolve", "unregister"]
