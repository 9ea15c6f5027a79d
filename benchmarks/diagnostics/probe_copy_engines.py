"""Does a device-to-device copy wait behind host-to-device copies queued on other streams?

    python -m benchmarks.diagnostics.probe_copy_engines

A large host-to-device copy (pinned source) is queued on one non-blocking stream, then a batch-sized
device-to-device copy on another, as ``cudaMemcpyAsync`` and as a kernel (an elementwise copy of 16-byte
words); each one's duration from its own stream's point of view (events before and after it on that
stream) is printed, beside the same copy with nothing else queued. Writes
``results/<machine>/probe-copy-engines[-TAG].json``. GPU only.
"""

from __future__ import annotations

import sys

from ..common import Rows, parse_probe_args, probe_parser, write_probe


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--h2d-mib", type=int, default=1024)
    ap.add_argument("--d2d-mib", type=int, default=36)
    args = parse_probe_args(ap, argv)
    import cupy

    rows = Rows()
    h2d = args.h2d_mib << 20
    d2d = args.d2d_mib << 20
    host = cupy.cuda.alloc_pinned_memory(h2d)
    big = cupy.empty(h2d, cupy.uint8)
    src = cupy.ones(d2d // 16, cupy.complex128)
    dst = cupy.empty_like(src)
    copy = cupy.ElementwiseKernel("T x", "T y", "y = x", "gdsload_probe_copy")
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)

    def timed(how: str, busy: bool) -> float:
        cupy.cuda.Device().synchronize()
        if busy:
            big.data.copy_from_host_async(host.ptr, h2d, a)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(b)
        if how == "memcpyAsync":
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, d2d, 3, b.ptr)
        else:
            with b:
                copy(src, dst)
        e1.record(b)
        cupy.cuda.Device().synchronize()
        return cupy.cuda.get_elapsed_time(e0, e1)

    for how in ("memcpyAsync", "kernel"):
        for busy in (False, True):
            timed(how, busy)
            ms = sorted(timed(how, busy) for _ in range(5))
            rows.emit({"d2d": how, "h2d_queued_mib": args.h2d_mib if busy else 0, "d2d_mib": args.d2d_mib,
                       "ms_runs": [round(x, 3) for x in ms]})
    h2d_ms = []
    for _ in range(3):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(a)
        big.data.copy_from_host_async(host.ptr, h2d, a)
        e1.record(a)
        e1.synchronize()
        h2d_ms.append(cupy.cuda.get_elapsed_time(e0, e1))
    rows.emit({"h2d_alone_ms": [round(x, 3) for x in h2d_ms], "h2d_mib": args.h2d_mib})
    print("wrote", write_probe(args, "probe-copy-engines", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
