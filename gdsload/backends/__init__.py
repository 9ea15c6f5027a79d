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

    kvikio whenever it is installed: with GDS it is the only direct path, and without it KvikIO's compat
    mode still measured faster than our pinned staging on the H100 (44 vs 30 GB/s warm, equal cold; see
    benchmarks/results). pinned when KvikIO is missing; cpu without a GPU.
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
        return "kvikio", "GDS unavailable, KvikIO compat mode (measured faster than pinned staging)"
    return "pinned", "KvikIO is not installed: pinned staging"


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
