"""Measuring primitives shared by ``gdsload bench`` and the benchmark suite: ceilings and timings.

GPU packages are imported inside the functions.
"""

from __future__ import annotations

import time


def pinned_h2d_gbps(nbytes: int = 256 << 20, repeats: int = 5, device_id: int = 0) -> float:
    """Best-of-``repeats`` host-to-device copy rate from pinned memory, in GB/s (the pinned path's ceiling)."""
    import cupy
    import numpy as np

    with cupy.cuda.Device(device_id):
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
        host[:] = 1
        dev = cupy.empty(nbytes, dtype=np.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        best = float("inf")
        for _ in range(repeats):
            stream.synchronize()
            t0 = time.perf_counter()
            dev.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
            stream.synchronize()
            best = min(best, time.perf_counter() - t0)
        del dev, host, mem
    return nbytes / best / 1e9
