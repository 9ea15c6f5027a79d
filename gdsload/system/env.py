"""The one environment probe: GPU, CUDA, CuPy and KvikIO versions, and whether KvikIO would do GPUDirect
Storage here. Backend ``auto``, the kvikio backend's ``io_mode`` and ``gdsload info`` all ask these
functions, so they cannot disagree.

Every probe reports what it found or why it could not, never a guess. GPU packages are imported inside
the functions: importing this module costs nothing on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from collections.abc import Mapping
from typing import Any
from ..errors import warn



def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one device (False, not an error, on machines without one)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def memory_available() -> int:
    """Bytes of memory available for new use without swapping (``MemAvailable`` of /proc/meminfo; where
    that is missing, free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kvikio_installed() -> bool:
    try:
        import kvikio  # noqa: F401

        return True
    except Exception:
        return False


def gds_available() -> bool:
    """Whether KvikIO would do true GPUDirect Storage here: its cuFile driver reports GDS (the nvidia-fs
    driver is loaded) and compat mode is not preferred (``KVIKIO_COMPAT_MODE``, cufile.json)."""
    return kvikio_info().get("io_mode") == "gds"


def kvikio_info(driver: bool = False) -> dict[str, Any]:
    """KvikIO version and how it would move bytes: "gds" or "kvikio-compat" (and why). Probed once per
    process (what it reports does not change while the process runs).

    Whether cuFile's driver reports GDS is asked (which starts the driver, a fraction of a second) only
    where it decides the io mode, when KvikIO does not prefer its compat mode, or when ``driver`` asks for it
    (``gdsload info``, ``doctor``): with compat mode preferred (``KVIKIO_COMPAT_MODE=ON``, or no usable
    cuFile library), KvikIO never uses GDS, whatever the driver says.
    """
    return dict(_kvikio_info(driver))


@functools.lru_cache(maxsize=2)
def _kvikio_info(driver: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"kvikio": None}
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except Exception as e:
        info["kvikio_error"] = f"{type(e).__name__}: {e}"
        return info
    info["kvikio"] = getattr(kvikio, "__version__", None) or _version("kvikio-cu13")
    try:
        info["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as e:
        info["compat_mode_error"] = f"{type(e).__name__}: {e}"
    if driver or not info.get("compat_mode_preferred", False):
        try:
            info["is_gds_available"] = bool(kvikio.cufile_driver.get("is_gds_available"))
        except Exception as e:
            info["is_gds_available"] = False
            info["gds_error"] = f"{type(e).__name__}: {e}"
    else:
        info["is_gds_available"] = None
        info["gds_not_asked"] = "KvikIO prefers its compat mode here, so it would not use GDS"
    info["nvidia_fs_loaded"] = os.path.exists("/proc/driver/nvidia-fs")
    gds = info.get("is_gds_available") and not info.get("compat_mode_preferred", True)
    info["io_mode"] = "gds" if gds else "kvikio-compat"
    try:
        info["num_threads"] = kvikio.defaults.get("num_threads")
        info["task_size"] = kvikio.defaults.get("task_size")
    except Exception:
        pass
    return info


def gpu_info(device_id: int = 0) -> dict[str, Any]:
    """GPU name, driver and runtime versions through CuPy; {"gpu": None, "reason": ...} without one."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return {"gpu": None, "reason": f"{type(e).__name__}: {e}".strip()}
    if n < 1:
        return {"gpu": None, "reason": "no CUDA device"}
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

    def fmt(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    return {"gpu": name, "device_count": n, "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "driver": fmt(cupy.cuda.runtime.driverGetVersion()),
            "cuda_runtime": fmt(cupy.cuda.runtime.runtimeGetVersion()), "cupy": cupy.__version__}


def system_info(device_id: int = 0) -> dict[str, Any]:
    """Everything above plus host facts, as one JSON-ready dict."""
    info: dict[str, Any] = {"python": platform.python_version(), "cpu_cores": os.cpu_count(),
                            "local_ranks": local_ranks(), "rank_cores": rank_cores(),
                            "numpy": _version("numpy"), "zarr": _version("zarr"), "gdsload": _version("gdsload"),
                            "cuda_device_max_connections": os.environ.get(CONNECTIONS_ENV)}
    info.update(gpu_info(device_id))
    if info.get("gpu"):
        info.update(kvikio_info(driver=True))
    return info


#: CUDA's count of hardware work queues per process, read when CUDA starts (docs/benchmarks.md, "Hardware work
#: queues"). Streams beyond that many share a queue, and a queue runs its work in the order it was queued.
CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
#: Fewer queues than this make a training step wait behind the loader's queued copies (docs/benchmarks.md).
MIN_CONNECTIONS = 4
CONNECTIONS_FIX = (f"unset {CONNECTIONS_ENV} or set it to {MIN_CONNECTIONS} or more for jobs that read with "
                   "gdsload, unless something in the job needs so few queues (Megatron-LM requires 1 for sequence "
                   "parallelism, to order its communication kernels ahead of its compute)")
_connections_warned = threading.Event()


def connections_note(environ: Mapping[str, str | None] = os.environ) -> str | None:
    """What ``CUDA_DEVICE_MAX_CONNECTIONS`` in ``environ`` costs a training step beside gdsload, or None when
    it is unset, not a count (CUDA then keeps its default), or at least :data:`MIN_CONNECTIONS`. With few
    queues, the loader's streams share the training step's queue, so a step queued after a window's copies
    and gathers starts only once they are done (the mmap backend paces its copies then:
    ``backends.mmap.backend.queue_bytes_for``)."""
    raw = (environ.get(CONNECTIONS_ENV) or "").strip()
    if not raw.isdigit() or int(raw) >= MIN_CONNECTIONS:
        return None
    n = int(raw)
    return (f"{CONNECTIONS_ENV}={n}: CUDA gives this process {n} hardware work queue{'s' if n > 1 else ''} "
            "for all its streams, so the training step's kernels queue behind gdsload's copies and wait for them "
            "(the mmap backend then queues a window's copies a few at a time, which shortens the waits)")


def warn_few_connections(environ: Mapping[str, str | None] = os.environ) -> bool:
    """Warn once per process (RuntimeWarning) when :func:`connections_note` has something to say; True if
    this call warned. Called as a GPU dataset opens."""
    note = connections_note(environ)
    if note is None or _connections_warned.is_set():
        return False
    _connections_warned.set()
    warn(f"{note}; {CONNECTIONS_FIX}", RuntimeWarning)
    return True


#: The cache folder's environment variable (the native stager's build, compiled kernels).
CACHE_ENV = "GDSLOAD_CACHE_DIR"


def cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where gdsload keeps what it builds once per machine: ``$GDSLOAD_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/gdsload``, else ``~/.cache/gdsload``."""
    if environ.get(CACHE_ENV):
        return environ[CACHE_ENV]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdsload")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Launchers' variables for the number of a job's processes on this machine, in the order asked.
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """The job's processes on this machine, as its launcher says (torchrun, Open MPI, Slurm); 1 when none
    does. A value that is not a positive count (Slurm's "2(x3)" gives its leading count) is skipped."""
    for name in LOCAL_RANKS_ENV:
        value = environ.get(name, "").split("(")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def rank_cores(cores: int | None = None, total: int | None = None, ranks: int | None = None) -> int:
    """The cores this process's reader threads may count on: its affinity mask (``cores``), shared out
    among the job's ``ranks`` on this machine when the mask spans all ``total`` cores (the ranks run on the
    same cores). A mask narrower than the machine is taken as the launcher's binding for this rank alone."""
    cores = usable_cores() if cores is None else cores
    total = (os.cpu_count() or cores) if total is None else total
    ranks = local_ranks() if ranks is None else ranks
    return max(1, cores // ranks) if ranks > 1 and cores >= total else cores
