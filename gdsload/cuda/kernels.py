"""gdsload's CUDA kernels compiled once per machine and kept on disk, so that a process loads them without NVRTC.

A kernel's file is named by facts known without compiling (the source, compute capability, CuPy's, the
runtime's and the driver's versions), written whole and renamed, recompiled where the driver refuses it; an
unwritable folder falls back to CuPy's cache. Why not CuPy's own cache: docs/design.md, "Memory reuse".
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from ..system import env


def cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where compiled kernels are kept: ``kernels`` in :func:`gdsload.system.env.cache_dir`."""
    return os.path.join(env.cache_dir(environ), "kernels")


def cache_key(source: str, facts: Sequence[object]) -> str:
    """A name for ``source`` compiled under ``facts``: any change of either gives another."""
    h = hashlib.sha256()
    for part in (source, *facts):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _facts(cupy: Any, device_id: int) -> tuple[object, ...]:
    rt = cupy.cuda.runtime
    return (cupy.__version__, rt.runtimeGetVersion(), rt.driverGetVersion(),
            cupy.cuda.Device(device_id).compute_capability)


def _write_whole(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _loaded(cupy: Any, path: str, probe: str) -> Any:
    module = cupy.RawModule(path=path)
    module.get_function(probe)  # the driver loads the file here, so a file it refuses is found now
    return module


def load_module(cupy: Any, source: str, device_id: int, probe: str, folder: str | None = None) -> Any:
    """A ``cupy.RawModule`` of ``source`` for the current device (``device_id``), whose kernel ``probe`` is
    loaded: from the cache folder when compiled there before, else compiled with NVRTC and kept. Compile
    errors propagate; a folder that cannot be written gives CuPy's own ``RawModule(code=...)``."""
    folder = folder if folder is not None else cache_dir()
    path = os.path.join(folder, f"{cache_key(source, _facts(cupy, device_id))}.bin")
    if os.path.exists(path):
        try:
            return _loaded(cupy, path, probe)
        except Exception:
            pass  # not loadable here: compiled again and replaced below
    binary, _ = cupy.cuda.compiler.compile_using_nvrtc(source, cache_in_memory=True)
    try:
        _write_whole(path, binary)
    except OSError:
        module = cupy.RawModule(code=source)
        module.get_function(probe)
        return module
    return _loaded(cupy, path, probe)
