"""What a fresh process's first batch pays once per process: each measurement a new process that, after
CUDA's start and before the open, does some of those things itself (timed apart), then opens the dataset and
takes its first batch; then a second dataset's first batch in the same process (the floor).

    python -m benchmarks.diagnostics.probe_first_batch [--data FILE] [--repeats 2] [--json OUT]

Steps: ``random`` (import numpy.random, which the first plan imports), ``kernels`` (gdsload's gather module
loaded), ``streams`` (a non-blocking stream and an event used once), ``register`` (4 MiB of host memory
registered with CUDA and released), ``alloc`` (512 MiB from CuPy's pool, returned), ``kvikio`` (KvikIO's
thread pool set up as the kvikio backend sets it, and one read into device memory). GPU only.
"""

from __future__ import annotations

import sys

from .probe_startup import make, parser, run_fresh, save

STEPS = ("random", "kernels", "streams", "register", "alloc", "kvikio")

CODE = """
import json, mmap, time
import gdsload, cupy, numpy as np
from gdsload.measure import device_sync
cupy.zeros(1 << 20, dtype=cupy.uint8)
cupy.cuda.Device().synchronize()
steps, took = {steps!r}, {{}}
for step in steps:
    t = time.perf_counter()
    if step == "random":
        import numpy.random
    elif step == "kernels":
        from gdsload.gather_cuda import Gather
        Gather(cupy, cupy.cuda.Device(0))._kernel("gather_wide", 16, 8)
    elif step == "streams":
        s = cupy.cuda.Stream(non_blocking=True)
        e = cupy.cuda.Event(block=True, disable_timing=True)
        e.record(s); s.wait_event(e); e.synchronize()
    elif step == "register":
        m = mmap.mmap(-1, 4 << 20)
        a = np.frombuffer(m, dtype=np.uint8)
        cupy.cuda.runtime.hostRegister(a.ctypes.data, a.nbytes, 0)
        cupy.cuda.runtime.hostUnregister(a.ctypes.data)
        del a
    elif step == "alloc":
        del_me = cupy.empty(512 << 20, dtype=cupy.uint8)
        del del_me
    elif step == "kvikio":
        import kvikio
        from gdsload.backends.cuda import KvikioPool
        KvikioPool.acquire(16, 4 << 20)  # the settings the kvikio backend asks for, so its open keeps them
        f = kvikio.CuFile({path!r} + "/zarr.json", "r")
        buf = cupy.empty(256, dtype=cupy.uint8)
        f.pread(buf, 256).get()
        f.close()
    took[step] = round(time.perf_counter() - t, 4)
cupy.cuda.Device().synchronize()
rows = []
for again in (False, True):
    t0 = time.perf_counter()
    ds = gdsload.GDSDataset({path!r}, batch_size={batch_size}, backend={backend!r}, shuffle=True,
                            window_blocks={window_blocks!r})
    t1 = time.perf_counter()
    it = iter(ds)  # kept: a dropped iterator closes its pass, inside the timing
    next(it)
    device_sync(ds)()
    t2 = time.perf_counter()
    it.close()
    rows.append((round(t1 - t0, 4), round(t2 - t1, 4)))
    window = ds.describe()["window_blocks"]
    ds.close()
print(json.dumps({{"backend": {backend!r}, "window_blocks": window, "steps": list(steps), "steps_s": took,
                  "open_s": rows[0][0],
                  "first_batch_s": rows[0][1], "again_open_s": rows[1][0], "again_first_batch_s": rows[1][1]}}))
"""


def one(path: str, backend: str, steps: tuple[str, ...], batch_size: int, window_blocks: int | None = None) -> dict:
    code = CODE.format(path=path, backend=backend, steps=steps, batch_size=batch_size, window_blocks=window_blocks)
    return run_fresh(code, f"{backend} {steps}")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "mmap,pinned,kvikio", 2)
    ap.add_argument("--windows", default="", help="window_blocks to try (comma-separated) instead of the steps")
    args = ap.parse_args(argv)
    path, rows = make(args.data, args.samples), []
    if args.windows:
        variants = [((), int(w)) for w in args.windows.split(",")]
    else:
        variants = [(), *((s,) for s in STEPS), STEPS]
        variants = [(v, None) for v in variants]
    for r in range(args.repeats):
        for backend in args.backends.split(","):
            for steps, window in variants:
                try:
                    row = {**one(path, backend, steps, args.batch_size, window), "repeat": r}
                except RuntimeError as e:
                    print(e, flush=True)
                    continue
                rows.append(row)
                print(f"{backend:6s} #{r} window {row['window_blocks']:3d} {'+'.join(steps) or 'none':45s} "
                      f"steps {sum(row['steps_s'].values()):.3f} s  "
                      f"open {row['open_s']:.3f}  first batch {row['first_batch_s']:.4f} s  "
                      f"(again: open {row['again_open_s']:.3f}  first batch {row['again_first_batch_s']:.4f})",
                      flush=True)
    save(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
