"""Setting up pinned host memory two ways, and copying from each to the device.

    python -m benchmarks.diagnostics.probe_pinned_alloc [--mib 512] [--repeats 2]

``cudaHostAlloc`` (CuPy's ``PinnedMemory``) against anonymous pages faulted in and registered with CUDA
(``gdsload._cuda.PinnedHost``, what the staging pool uses): seconds to set up ``--mib`` MiB, seconds to free
the registered kind, and the best of 5 host-to-device copies of the whole buffer from each, on a
non-blocking stream. Prints one line per repeat. GPU only.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    import cupy

    from gdsload._cuda import H2D, PinnedHost

    n = args.mib << 20
    cupy.arange(10).sum().get()  # CUDA initialised before anything is timed
    dev = cupy.empty(n, cupy.uint8)
    for _ in range(args.repeats):
        t = time.perf_counter()
        alloc = cupy.cuda.PinnedMemory(n)
        alloc_s = time.perf_counter() - t
        t = time.perf_counter()
        registered = PinnedHost(n)
        register_s = time.perf_counter() - t
        rates = {}
        for name, ptr in (("cudaHostAlloc", alloc.ptr), ("mmap+hostRegister", registered.ptr)):
            stream = cupy.cuda.Stream(non_blocking=True)
            best = float("inf")
            for _ in range(5):
                stream.synchronize()
                t = time.perf_counter()
                cupy.cuda.runtime.memcpyAsync(dev.data.ptr, ptr, n, H2D, stream.ptr)
                stream.synchronize()
                best = min(best, time.perf_counter() - t)
            rates[name] = n / best / 1e9
        t = time.perf_counter()
        registered.close()
        close_s = time.perf_counter() - t
        print(f"{args.mib} MiB pinned: cudaHostAlloc {alloc_s:.3f} s, mmap+register {register_s:.3f} s "
              f"(close {close_s:.3f} s); H2D GB/s {rates}", flush=True)
        del alloc
    return 0


if __name__ == "__main__":
    sys.exit(main())
