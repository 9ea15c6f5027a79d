"""Backend choice. GPU packages are imported only when a GPU backend is asked for."""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailable
from .base import Backend

BACKENDS = ("auto", "cpu", "pinned", "kvikio", "mmap")


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one device (False, not an error, on machines without one)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def gds_available() -> bool:
    """Whether KvikIO would do true GPUDirect Storage here (nvidia-fs driver loaded, compat mode off)."""
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults

        return bool(kvikio.cufile_driver.get("is_gds_available")) and not kvikio.defaults.is_compat_mode_preferred()
    except Exception:
        return False


def kvikio_installed() -> bool:
    try:
        import kvikio  # noqa: F401

        return True
    except Exception:
        return False


def resolve(name: str) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen.

    kvikio with GDS: the only direct path (disk DMA into device memory). Without GDS, pinned: KvikIO's
    compat mode copies through its own bounce buffers on *blocking* CUDA streams, so its copies serialize
    with the training step's work on the legacy default stream (CuPy's and torch's default). On the H100,
    with a training step 1.5x / 3x a batch's read time, the pass spent 34.1 % / 20.3 % beyond the steps
    alone waiting with kvikio, 4.9 % / 1.6 % with pinned, which alone read nearly as fast (41.24 vs 38.09
    GB/s warm; 16 GiB, run.py --full, benchmarks/results). cpu without a GPU. Never mmap: it locks the
    whole dataset in RAM, which only the user can decide to spend.
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
        from .mapped import MappedBackend

        return MappedBackend(device_id=device_id, **options)
    raise ValueError(f"unknown backend {name!r} (expected one of {BACKENDS})")
