"""Where a first batch's time goes: a timeline of the first pass, each measurement a new process (CUDA
started first), and a second dataset opened in the same process after it.

    python -m benchmarks.diagnostics.probe_timeline [--data FILE] [--windows 0,4] [--repeats 2] [--json OUT]

Milliseconds from the first ``next()``: the plan and the pass's index arrays made, each of the first
windows' ``submit`` called and returned, its ``finish`` returned and its "filled" event complete (waited
for here, on a thread of the probe's own, so the pipeline is not slowed), each of the first batches
assembled, ``next()`` returned, and the pass's close (each thread's join). Patches the library's classes in
that process only. GPU only.
"""

from __future__ import annotations

import sys

from .probe_startup import make, parser, run_fresh, save

CODE = """
import json, threading, time
import gdsload, cupy
from gdsload import assembler, dataset
from gdsload.measure import device_sync
cupy.zeros(1 << 20, dtype=cupy.uint8)
cupy.cuda.Device().synchronize()
import collections
marks, t0, seen = [], [0.0], collections.Counter()
def mark(what):
    seen[what] += 1
    if seen[what] <= 4:  # the first few of each, in order
        marks.append((what, round((time.perf_counter() - t0[0]) * 1e3, 2)))
def timed(owner, name, label):
    orig = getattr(owner, name)
    def wrapper(*a, **k):
        mark(label + " begins")
        try:
            return orig(*a, **k)
        finally:
            mark(label + " ends")
    setattr(owner, name, wrapper)
from gdsload import device, handoff, pipeline
timed(dataset, "epoch_plan", "plan")
timed(assembler.Assembler, "index", "index")
timed(pipeline.Pipeline, "_wait_assembled", "consumer's wait")
timed(handoff.Handoff, "put", "hand-off put")
timed(device.CudaOps, "hand_over", "hand_over")
timed(device.CudaOps, "record", "assembler's record")
timed(device.CudaOps, "fence", "fence")
orig_batches = assembler.Assembler.batches
def batches(self, *a, **k):
    for n, item in enumerate(orig_batches(self, *a, **k)):
        if n < 3:
            mark(f"batch {{n}} assembled")
        yield item
assembler.Assembler.batches = batches
def watch(backend):
    submit = backend.submit
    count = [0]
    def patched(dest, requests, stop):
        w = count[0]; count[0] += 1
        mark(f"window {{w}} submit ({{len(requests)}} requests)")
        pending = submit(dest, requests, stop)
        mark(f"window {{w}} submitted")
        finish = pending.finish
        def fin():
            ev = finish()
            mark(f"window {{w}} finish returned")
            if ev is not None:
                threading.Thread(target=lambda: (ev.synchronize(), mark(f"window {{w}} filled on the device"))).start()
            return ev
        pending.finish = fin
        return pending
    backend.submit = patched
out = []
for again in (False, True):
    marks.clear()
    seen.clear()
    a = time.perf_counter()
    ds = gdsload.GDSDataset({path!r}, batch_size={batch_size}, backend={backend!r}, shuffle=True,
                            window_blocks={window_blocks!r})
    open_s = time.perf_counter() - a
    watch(ds._backend)
    t0[0] = time.perf_counter()
    it = iter(ds)
    next(it)
    mark("next() returned")
    device_sync(ds)()
    mark("synchronised")
    join = threading.Thread.join
    def timed_join(self, *a, **k):
        mark(f"join {{self.name}} begins")
        join(self, *a, **k)
        mark(f"join {{self.name}} ends")
    threading.Thread.join = timed_join
    mark("close begins")
    it.close()
    mark("close ends")
    threading.Thread.join = join
    time.sleep(0.05)
    out.append({{"again": again, "open_s": round(open_s, 4), "window_blocks": ds.describe()["window_blocks"],
                "marks": sorted(marks, key=lambda m: m[1])}})
    ds.close()
print(json.dumps(out))
"""


def one(path: str, backend: str, batch_size: int, window_blocks: int | None) -> list[dict]:
    code = CODE.format(path=path, backend=backend, batch_size=batch_size, window_blocks=window_blocks)
    return run_fresh(code, backend)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "mmap,pinned,kvikio", 2)
    ap.add_argument("--windows", default="0,4", help="window_blocks to try (0: the default)")
    args = ap.parse_args(argv)
    path, rows = make(args.data, args.samples), []
    for r in range(args.repeats):
        for backend in args.backends.split(","):
            for w in (int(x) for x in args.windows.split(",")):
                try:
                    runs = one(path, backend, args.batch_size, w or None)
                except RuntimeError as e:
                    print(e, flush=True)
                    continue
                for run in runs:
                    rows.append({"backend": backend, "repeat": r, **run})
                    print(f"{backend} #{r} window {run['window_blocks']} {'again' if run['again'] else 'fresh'} "
                          f"(open {run['open_s']:.3f} s): " + ", ".join(f"{m} {t}" for m, t in run["marks"]),
                          flush=True)
    save(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
