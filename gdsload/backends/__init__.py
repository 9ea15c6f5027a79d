"""The backend registry: names, the choice ``auto`` makes, construction. GPU packages are imported only
when a GPU backend is made."""

from __future__ import annotations

from typing import Any

from ..env import gds_available, gpu_available, kvikio_installed
from ..errors import BackendUnavailable
from .base import Backend

BACKENDS = ("auto", "cpu", "pinned", "kvikio", "mmap")


def resolve(name: str) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen.

    kvikio with GDS: the only direct path (disk DMA into device memory). Without GDS, pinned: KvikIO's
    compat mode copies through its own bounce buffers on *blocking* CUDA streams, so its copies serialize
    with the training step's work on the legacy default stream (CuPy's and torch's default), while the
    pinned backend copies on non-blocking streams (docs/design.md). cpu without a GPU. Never mmap: it
    locks the whole dataset in RAM, which only the user can decide to spend.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (expected one of {BACKENDS})")
    if name != "auto":
        return name, "requested"
    if not gpu_available():
        return "cpu", "no usable GPU (CuPy missing or no device)"
    if gds_available():
        return "kvikio", "GPUDirect Storage is available"
    if kvikio_installed():
        return "pinned", ("GDS unavailable: pinned staging read by KvikIO's threads (KvikIO's compat-mode "
                          "copies serialize with work on the default CUDA stream)")
    return "pinned", "GDS unavailable, KvikIO not installed: pinned staging read by Python threads"


def make_backend(name: str, device_id: int = 0, **options: Any) -> Backend:
    """Construct a concrete backend; GPU backends raise BackendUnavailable without a GPU."""
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(**options)
    if not gpu_available():
        raise BackendUnavailable(f"backend {name!r} needs a CUDA GPU and CuPy (pip install 'gdsload[gpu]')")
    if name == "pinned":
        from .pinned import PinnedBackend

        return PinnedBackend(device_id=device_id, **options)
    if name == "kvikio":
        from .kvikio import KvikioBackend

        return KvikioBackend(device_id=device_id, **options)
    if name == "mmap":
        from .mmap import MmapBackend

        return MmapBackend(device_id=device_id, **options)
    raise ValueError(f"unknown backend {name!r} (expected one of {BACKENDS})")
