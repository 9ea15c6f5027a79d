"""The backend registry: names, the choice ``auto`` makes, construction. GPU packages are imported only
when a GPU backend is made."""

from __future__ import annotations

import os
from typing import Any

from ..env import gds_available, gpu_available, kvikio_installed, memory_available
from ..errors import BackendUnavailable
from ..sysfiles import FsSupport, path_support
from .base import Backend

BACKENDS = ("auto", "cpu", "pinned", "kvikio", "mmap")


#: The RAM tier is chosen by ``auto`` for a dataset of at most this share of the memory available when it
#: opens: its pages stay locked for the dataset's life, and the rest is left to the training process and
#: the page cache (docs/design.md, section `auto`).
RAM_TIER_SHARE = 0.5
ENV_BACKEND = "GDSLOAD_BACKEND"


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
    if name not in BACKENDS:
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
    other file systems in its compat mode): the only direct path from disk to device. Else pinned: KvikIO's compat
    mode copies through its own bounce buffers on *blocking* CUDA streams, which serialize with the
    training step's work on the legacy default stream; the pinned backend copies on non-blocking streams.
    """
    if not gpu:
        return "cpu", "no usable GPU (CuPy missing or no device)"
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
