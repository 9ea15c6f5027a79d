"""The backend registry: what each backend is (:class:`BackendInfo`), the choice ``auto`` makes, construction.

The only module that knows the backends by name: code elsewhere asks :func:`info` what a backend is rather
than comparing its name. Adding a backend means an entry here and its own module. GPU packages are imported
only when a GPU backend is made or its availability is asked.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable
from ..system.env import gds_available, gpu_available, kvikio_installed, memory_available
from ..system.sysfiles import FsSupport, path_support
from .base import Backend

#: The RAM tier is chosen by ``auto`` for a dataset of at most this share of the memory available when it
#: opens: its pages stay locked for the dataset's life, and the rest is left to the training process and
#: the page cache (docs/design.md, section `auto`).
RAM_TIER_SHARE = 0.5
ENV_BACKEND = "GDSLOAD_BACKEND"

_NO_GPU = "no usable GPU (CuPy missing or no device)"
_NO_KVIKIO = "KvikIO is not installed (pip install 'gdsload[gpu]')"
_GDS_MODE = "gds"


def _no_limit() -> int | None:
    return None


def _mmap_budget() -> int | None:
    from .mmap.backend import default_budget

    return default_budget()


def _pinned_threads(options: Mapping[str, Any]) -> int | None:
    """The pinned backend's own reader threads with ``options``: none where its reader is the native stager (one
    per process and device, shared by every dataset); else its Python threads."""
    from .sizing import DEFAULT_THREADS
    from .native.stager import load

    reader, direct = options.get("reader", "auto"), options.get("direct", False)
    if direct or reader == "threads" or (reader == "auto" and load() is None):
        return DEFAULT_THREADS
    return None


@dataclass(frozen=True)
class BackendInfo:
    """What one backend is. ``on_device``: its window buffers and batches live in device memory.
    ``io_modes``: the ``io_mode`` strings its instances report.
    ``needs_kvikio``: it reads through KvikIO. ``locks_dataset``: opening it locks the dataset's files in RAM
    (every read then copies from there). ``capacity``: the most dataset bytes it holds with default options
    (None: no limit). ``threads``: the reader threads an instance with these backend options starts of its own
    by default, sized for the process alone (None, or no hook: none, or a pool the process shares); a process
    opening several datasets at once (a Mixture) gives each a share as the ``num_threads`` option. The class
    (``module``, ``class_name``) is imported only when asked for."""

    name: str
    on_device: bool
    io_modes: tuple[str, ...]
    module: str
    class_name: str
    needs_kvikio: bool = False
    locks_dataset: bool = False
    capacity: Callable[[], int | None] = _no_limit
    threads: Callable[[Mapping[str, Any]], int | None] | None = None
    registered: type[Backend] | None = None

    @property
    def backend_class(self) -> type[Backend]:
        """The backend's class (imports its module, never a GPU package)."""
        if self.registered is not None:
            return self.registered
        cls: type[Backend] = getattr(importlib.import_module(f"{__package__}.{self.module}"), self.class_name)
        return cls

    @property
    def defaults(self) -> dict[str, Any]:
        """Its defaults, read from the class: ``batches_ahead`` and ``window_bytes`` (the hints a dataset uses
        unless told otherwise) and ``options`` (its constructor's keyword defaults)."""
        cls = self.backend_class
        params = inspect.signature(cls.__init__).parameters.values()
        options = {p.name: p.default for p in params
                   if p.default is not inspect.Parameter.empty and p.name != "device_id"}
        return {"batches_ahead": cls.batches_ahead_hint, "window_bytes": cls.window_bytes_hint,
                "options": options}

    def available(self) -> tuple[bool, str]:
        """Whether it can run on this machine, and why not (an empty reason when it can)."""
        if self.on_device and not gpu_available():
            return False, _NO_GPU
        if self.needs_kvikio and not kvikio_installed():
            return False, _NO_KVIKIO
        return True, ""

    def holds(self, nbytes: int) -> bool:
        """Whether a dataset of ``nbytes`` fits what it holds with default options."""
        limit = self.capacity()
        return limit is None or nbytes <= limit

    def io_mode(self, gds: bool) -> str:
        """The io mode an instance reports with default options: ``"gds"`` where it has that mode and ``gds``
        (GPUDirect Storage works for the dataset) holds, else its default mode."""
        if gds and _GDS_MODE in self.io_modes:
            return _GDS_MODE
        return next(m for m in self.io_modes if m != _GDS_MODE)

    def make(self, device_id: int = 0, **options: Any) -> Backend:
        """Construct one; a device backend raises BackendUnavailable without a GPU."""
        if not self.on_device:
            return self.backend_class(**options)
        if not gpu_available():
            raise BackendUnavailable(f"backend {self.name!r} needs a CUDA GPU and CuPy (pip install 'gdsload[gpu]')")
        return self.backend_class(device_id=device_id, **options)  # type: ignore[call-arg]


_INFOS: dict[str, BackendInfo] = {i.name: i for i in (
    BackendInfo("cpu", False, ("cpu",), "cpu", "CpuBackend"),
    BackendInfo("pinned", True, ("pinned", "pinned-odirect"), "pinned.backend", "PinnedBackend",
                threads=_pinned_threads),
    BackendInfo("kvikio", True, (_GDS_MODE, "kvikio-compat"), "kvikio", "KvikioBackend", needs_kvikio=True),
    BackendInfo("mmap", True, ("mmap",), "mmap.backend", "MmapBackend", locks_dataset=True, capacity=_mmap_budget),
)}

#: Backends a remote dataset's route picks (gdsload/backends/remote_direct.py), never named by ``backend=``:
#: known to :func:`info`, outside :data:`NAMES` and :data:`BACKENDS`.
_ROUTED: dict[str, BackendInfo] = {i.name: i for i in (
    BackendInfo("remote", True, ("remote-kvikio",), "remote_direct", "RemoteDirectBackend", needs_kvikio=True),
)}

#: The concrete backends.
NAMES: tuple[str, ...] = tuple(_INFOS)
BACKENDS: tuple[str, ...] = ("auto", *NAMES)
#: The order ``gdsload bench`` measures backends in: the device ones, storage to device straight first, cpu last.
BENCH_ORDER: tuple[str, ...] = ("kvikio", "pinned", "mmap", "cpu")


#: Backends added by :func:`register`, by name.
_REGISTERED: dict[str, BackendInfo] = {}


def register(name: str, backend_class: type[Backend], on_device: bool = False) -> BackendInfo:
    """Make ``backend=name`` open ``backend_class`` (a :class:`Backend` of one's own: a storage gdsload does not
    know, or a subclass of a built-in one that records or changes what it does), constructed with the
    dataset's ``backend_options`` (and ``device_id`` when ``on_device``). ``auto`` never picks it. A
    built-in name is refused (ValueError); registering a name again replaces its class."""
    if name in BACKENDS or name in _ROUTED:
        raise ValueError(f"backend {name!r} is built in: register another name")
    if not (isinstance(backend_class, type) and issubclass(backend_class, Backend)):
        raise TypeError(f"backend {name!r}: expected a subclass of gdsload.backends.base.Backend "
                        f"(found {backend_class!r})")
    mode = getattr(backend_class, "io_mode", name)
    _REGISTERED[name] = entry = BackendInfo(name, on_device, (mode,), backend_class.__module__,
                                            backend_class.__qualname__, registered=backend_class)
    return entry


def unregister(name: str) -> None:
    """Forget a backend :func:`register` added (nothing when none is registered under ``name``)."""
    _REGISTERED.pop(name, None)


def known(name: str) -> bool:
    """Whether ``name`` is a backend ``backend=`` accepts: built in or added by :func:`register`."""
    return name in BACKENDS or name in _REGISTERED


def info(name: str) -> BackendInfo:
    """The concrete backend ``name``'s info; ValueError naming it and the known ones otherwise."""
    try:
        return _INFOS[name] if name in _INFOS else _ROUTED[name] if name in _ROUTED else _REGISTERED[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r} (expected one of {BACKENDS})") from None


def make_backend(name: str, device_id: int = 0, **options: Any) -> Backend:
    """Construct a concrete backend; GPU backends raise BackendUnavailable without a GPU."""
    return info(name).make(device_id, **options)


def io_mode(name: str, gds: bool) -> str:
    """The io mode backend ``name`` reads with by default, ``gds`` telling whether GPUDirect Storage works."""
    return info(name).io_mode(gds)


def runnable(nbytes: int) -> list[str]:
    """The concrete backends that can run here for a dataset of ``nbytes``, in :data:`BENCH_ORDER`."""
    return [n for n in BENCH_ORDER if info(n).available()[0] and info(n).holds(nbytes)]


def resolve(name: str, dataset_bytes: int | None = None, dataset_path: str | None = None) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen. ``"auto"`` gives way to the environment
    variable ``GDSLOAD_BACKEND`` when it is set and not empty (a value that names no backend is a ValueError
    naming the variable); ``dataset_bytes`` (the shard files a dataset reads) lets
    ``auto`` pick the RAM tier, ``dataset_path`` (a file of the dataset) tells whether its file system allows
    GDS."""
    raw = os.environ.get(ENV_BACKEND, "")
    forced = raw.strip() or "auto"  # set but empty reads as unset
    if name == "auto" and forced != "auto":
        if forced not in BACKENDS:
            raise ValueError(f"environment variable {ENV_BACKEND}={raw!r} is not a backend (expected one of "
                             f"{BACKENDS})")
        return forced, f"{ENV_BACKEND}={forced}"
    if name not in BACKENDS and name not in _REGISTERED:
        raise ValueError(f"unknown backend {name!r} (expected one of {BACKENDS})")
    if name != "auto":
        return name, "requested"
    if not gpu_available():
        return choose(False, False, False, dataset_bytes, None)
    available = memory_available() if dataset_bytes is not None else None
    if _fits(dataset_bytes, available):  # the storage probes (cuFile's driver starts) are not needed
        return choose(True, False, False, dataset_bytes, available)
    gds = gds_available()
    fs = path_support(dataset_path) if gds and dataset_path is not None else None
    return choose(True, gds, kvikio_installed(), dataset_bytes, available, fs)


def _fits(dataset_bytes: int | None, available: int | None) -> bool:
    return dataset_bytes is not None and available is not None and dataset_bytes <= RAM_TIER_SHARE * available


def choose(gpu: bool, gds: bool, kvikio: bool, dataset_bytes: int | None, available: int | None,
           fs: FsSupport | None = None) -> tuple[str, str]:
    """What ``auto`` picks from the facts, and why (pure: the rule, tested without a GPU).

    cpu without a GPU. mmap when the dataset fits in :data:`RAM_TIER_SHARE` of available memory: every
    later read is a DMA copy from locked pages, faster than any read from storage. Else kvikio when
    GPUDirect Storage is there and the dataset's file system allows it (``fs``, when known: cuFile reads
    other file systems in its compat mode): the only direct path from disk to device. Else pinned: KvikIO's
    compat mode copies through its own bounce buffers on *blocking* CUDA streams, which serialize with the
    training step's work on the legacy default stream; the pinned backend copies on non-blocking streams.
    """
    if not gpu:
        return "cpu", _NO_GPU
    if _fits(dataset_bytes, available):
        return "mmap", (f"the dataset ({dataset_bytes / 2**30:.2f} GiB) fits in {RAM_TIER_SHARE:.0%} of available "
                        f"memory ({available / 2**30:.1f} GiB): locked in RAM once, copied by DMA")
    if gds and fs is not None and fs.gds is False:
        return "pinned", (f"GPUDirect Storage is available but not for this dataset's files ({fs.what}): pinned "
                          f"staging")
    if gds:
        return "kvikio", "GPUDirect Storage is available"
    if kvikio:
        return "pinned", ("GDS unavailable: pinned staging read by KvikIO's threads (KvikIO's compat-mode "
                          "copies serialize with work on the default CUDA stream)")
    return "pinned", "GDS unavailable, KvikIO not installed: pinned staging read by Python threads"
