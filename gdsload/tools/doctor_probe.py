"""What ``gdsload doctor`` asks of this machine beyond /proc, /sys and /etc: GPU stack, libcufile, PATH, live reads.

:class:`HostProbes` is the real machine; tests pass an object with the same methods. Everything here reports
what it found or why it could not, and never raises, except :meth:`HostProbes.inspect`, whose :class:`PathError`
is a bad PATH (exit 2). libcufile's version (``cuFileGetVersion``) is probed here: :mod:`gdsload.system.env`
does not report it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import mmap
import os
import platform
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from .._units import ALIGN
from ..errors import GDSLoadError

#: How much of the dataset the live read moves, at most.
LIVE_READ_BYTES = 256 << 20
_CHUNK = 64 << 20  # one pread: the device buffer's size


class PathError(GDSLoadError, ValueError):
    """PATH cannot be examined; the message starts with the path."""


@dataclass
class Target:
    """What PATH is: a dataset (its shard files) or one file."""

    path: str
    real: str
    kind: str  # "dataset" or "file"
    files: list[str]
    nbytes: int
    aligned: bool  # every block (a file: its size) starts and ends on 4 KiB
    align_ok: bool | None  # the alignment check: None where unaligned blocks do not matter
    align_note: str


@dataclass
class LiveRead:
    """A timed read through KvikIO into device memory (``error``: why it stopped, if it did)."""

    nbytes: int
    seconds: float
    error: str | None = None
    files: list[str] = field(default_factory=list)


def _errname(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "error")
    return f"{name} ({e.strerror or e})"


def dataset_alignment(layout: Any, resident: int | None = None) -> tuple[bool, bool | None, str]:
    """Whether every stored block of an open :class:`~gdsload.format.meta.DatasetLayout` starts and ends on
    4 KiB; the check's verdict (None: only fields small enough to be read whole at open, by a dataset opened
    with ``resident_bytes=resident`` (default: GDSDataset's), are unaligned, and their blocks are not read one
    by one); where the first unaligned block lies."""
    import numpy as np

    from ..pipeline.reader import DEFAULT_RESIDENT_BYTES, resident_fields

    resident = DEFAULT_RESIDENT_BYTES if resident is None else resident
    blocks, bad_keys = 0, []
    small_fields = resident_fields(layout.meta, layout.keys, resident)
    for key in layout.keys:
        offsets = layout.block_offsets[key]
        block_bytes = layout.meta.array(key).block_bytes
        written = offsets >= 0
        blocks += int(written.sum())
        bad = np.flatnonzero(written & ((offsets % ALIGN != 0) | (block_bytes % ALIGN != 0)))
        if len(bad):
            small = key in small_fields
            loc = layout.locate(key, int(bad[0]))
            bad_keys.append((small, f"array '{key}': {len(bad)} of {len(offsets)} blocks unaligned, the first "
                                    f"(block {int(bad[0])}) at offset {loc.offset} of {loc.path}, {loc.nbytes} bytes"))
    if not bad_keys:
        return True, True, f"all {blocks} stored blocks of {len(layout.keys)} array(s) start and end on 4 KiB"
    bad_keys.sort()  # the arrays read block by block first
    if bad_keys[0][0]:
        return False, None, (f"{bad_keys[0][1]}; read whole at open (at most resident_bytes={resident}), "
                             "not block by block")
    return False, False, bad_keys[0][1] + (f" (+{len(bad_keys) - 1} more array(s))" if len(bad_keys) > 1 else "")


def inspect_path(path: str, resident_bytes: int | None = None) -> Target:
    """PATH as a dataset (a directory: must be a gdsload dataset; its alignment judged for a dataset opened with
    ``resident_bytes``, default GDSDataset's) or a regular file; PathError otherwise."""
    from ..errors import GDSLoadError
    from ..format.layout import DatasetLayout
    from ..format.meta import read_metadata

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise PathError(f"{path}: {'does not exist' if e.errno == errno.ENOENT else _errname(e)}") from None
    real = os.path.realpath(path)
    if stat.S_ISREG(mode):
        size = os.path.getsize(real)
        return Target(path, real, "file", [real], size, size % ALIGN == 0, None,
                      f"a file of {size} bytes" + ("" if size % ALIGN == 0 else ", not a multiple of 4 KiB"))
    if not stat.S_ISDIR(mode):
        raise PathError(f"{path}: neither a regular file nor a directory")
    try:
        meta = read_metadata(real)
        with DatasetLayout(meta) as layout:
            files = layout.shard_paths()
            aligned, align_ok, note = dataset_alignment(layout, resident_bytes)
            nbytes = sum(layout.files[p].size for p in files)
    except (GDSLoadError, OSError) as e:
        raise PathError(f"{path}: not a readable gdsload dataset ({e})") from None
    return Target(path, real, "dataset", files, nbytes, aligned, align_ok, note)


def o_direct_read(path: str) -> tuple[bool, str]:
    """Open ``path`` with O_DIRECT and read up to 1 MiB at offset 0 into a page-aligned buffer: whether
    the kernel allowed both, and what it said."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return False, f"open(O_DIRECT) of {path} failed: {_errname(e)}"
    try:
        size = os.fstat(fd).st_size
        n = max(ALIGN, min(1 << 20, size - size % ALIGN))
        buf = mmap.mmap(-1, n)  # anonymous mappings are page aligned
        try:
            got = os.preadv(fd, [buf], 0)
        except OSError as e:
            return False, f"opened with O_DIRECT, but a {n}-byte aligned read of {path} failed: {_errname(e)}"
        finally:
            buf.close()
    finally:
        os.close(fd)
    return True, f"opened with O_DIRECT and read {got} bytes at offset 0 into a 4 KiB-aligned buffer"


def _loaded_path(fragment: str) -> str | None:
    """The file of a shared library mapped into this process whose name contains ``fragment``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split(None, 5)[-1].strip()
                if fragment in os.path.basename(p):
                    return p
    except OSError:
        pass
    return None


def cufile_version(lib: Any) -> str | None:
    """``cuFileGetVersion`` of a loaded libcufile as "major.minor"; None if it lacks the call or fails."""

    class CUfileError(ctypes.Structure):
        _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]

    try:
        fn = lib.cuFileGetVersion
    except AttributeError:
        return None
    fn.restype, fn.argtypes = CUfileError, [ctypes.POINTER(ctypes.c_int)]
    v = ctypes.c_int(0)
    if fn(ctypes.pointer(v)).err != 0 or v.value <= 0:
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def find_libcufile() -> dict[str, Any]:
    """Where libcufile is and its version: the copy already loaded (by KvikIO), else the nvidia-cufile wheel
    (nvidia/cu13/lib, nvidia/cufile/lib), else what the dynamic loader finds (ldconfig, LD_LIBRARY_PATH)."""
    candidates = [p for p in [_loaded_path("libcufile.so")] if p]
    try:
        import nvidia

        for d in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(d, "*", "lib", "libcufile.so*")))
    except ImportError:
        pass
    candidates += [n for n in [ctypes.util.find_library("cufile")] if n] + ["libcufile.so.0"]
    errors = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        path = _loaded_path("libcufile.so") or name
        return {"path": path, "file": os.path.realpath(path), "version": cufile_version(lib)}
    return {"path": None, "error": errors[-1] if errors else "not found"}


def kvikio_live_read(files: list[str], limit: int) -> LiveRead:
    """Read up to ``limit`` bytes of ``files``, in order from offset 0, through ``kvikio.CuFile.pread``
    into one CuPy device buffer; timed."""
    done, t0, used = 0, time.perf_counter(), []
    try:
        import cupy
        import kvikio

        buf = cupy.empty(min(limit, _CHUNK), dtype=cupy.uint8)
        for path in files:
            if done >= limit:
                break
            used.append(path)
            f = kvikio.CuFile(path, "r")
            try:
                size, offset = os.path.getsize(path), 0
                while offset < size and done < limit:
                    n = min(buf.nbytes, size - offset, limit - done)
                    got = f.pread(buf, n, offset).get()
                    if got != n:
                        raise OSError(f"{path}: read {got} of {n} bytes at offset {offset}")
                    offset, done = offset + n, done + n
            finally:
                f.close()
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:
        return LiveRead(done, time.perf_counter() - t0, f"{type(e).__name__}: {e}", used)
    return LiveRead(done, time.perf_counter() - t0, None, used)


class HostProbes:
    """The real machine, for :func:`gdsload.tools.doctor.gather` (tests pass a stand-in with these methods).
    ``resident_bytes``: the dataset's alignment is judged for a GDSDataset opened with it (default its own)."""

    def __init__(self, resident_bytes: int | None = None):
        self.resident_bytes = resident_bytes

    def gpu(self) -> dict[str, Any]:
        """:func:`gdsload.system.env.gpu_info`, plus ``pci_bus_id`` of CUDA device 0 when CuPy can tell (the NUMA
        line finds the GPU's node by it)."""
        from ..system.env import gpu_info

        info = gpu_info()
        if info.get("gpu"):
            try:
                import cupy

                info["pci_bus_id"] = cupy.cuda.runtime.deviceGetPCIBusId(0)
            except Exception:  # an old CuPy: the NUMA line falls back to CUDA_VISIBLE_DEVICES
                pass
        return info

    def kvikio(self, gpu: bool) -> dict[str, Any]:
        """KvikIO as :func:`gdsload.system.env.kvikio_info` sees it; without a GPU only whether it is installed."""
        from ..system.env import _version, kvikio_info, kvikio_installed

        if gpu:
            return kvikio_info(driver=True)
        if kvikio_installed():
            return {"kvikio": _version("kvikio") or _version("kvikio-cu13") or _version("kvikio-cu12") or "?"}
        return {"kvikio": None, "kvikio_error": "ModuleNotFoundError: No module named 'kvikio'"}

    def libcufile(self) -> dict[str, Any]:
        return find_libcufile()

    def nvcomp(self) -> dict[str, Any]:
        """libnvcomp as the decode step loads it (:func:`gdsload.codecs.nvcomp_lib.describe`)."""
        from ..codecs.chunks import NVCOMP_ENV, load_nvcomp
        from ..codecs.nvcomp_lib import describe

        return describe(load_nvcomp(), os.environ.get(NVCOMP_ENV) == "0")

    def backend(self, dataset_bytes: int | None = None, path: str | None = None) -> tuple[str, str]:
        """What ``auto`` picks, for a dataset of ``dataset_bytes`` (the RAM tier needs its size) whose files
        lie where ``path`` does (GDS needs a file system that allows it)."""
        from ..backends import resolve

        return resolve("auto", dataset_bytes, path)

    def machine(self) -> str:
        return platform.machine()

    def inspect(self, path: str) -> Target:
        return inspect_path(path, self.resident_bytes)

    def o_direct(self, path: str) -> tuple[bool, str]:
        return o_direct_read(path)

    def live_read(self, files: list[str], limit: int) -> LiveRead:
        return kvikio_live_read(files, limit)
