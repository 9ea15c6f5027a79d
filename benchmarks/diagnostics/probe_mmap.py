"""Probes behind the mmap backend's defaults, beside the ceilings and the kvikio backend, in one run.

    python -m benchmarks.diagnostics.probe_mmap [--sweep]

Open (map + lock) time cold and warm; pass GB/s across copy streams and copy sizes (``backend_options``
``num_streams`` / ``copy_bytes``, with ``--sweep``); and how long a simulated training step waits for data,
seen from outside (wall time beyond the steps run alone), with the consumer on the legacy default stream
(CuPy's and torch's default) and on a non-blocking stream. Writes
``results/<machine>/probe-mmap[-TAG].json``. GPU only.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time

from gdsload.measure import best, drop_page_cache, pinned_h2d_gbps, raw_kvikio_files, read_files, shard_paths

from gdsload.steps import Spin

from ..common import Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, write_probe
from ..rows import GdsRun


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    ap.add_argument("--sweep", action="store_true", help="also sweep copy streams and copy sizes")
    args = parse_probe_args(ap, argv)
    import cupy

    path = make_dataset(args.data, args.size_gib)
    paths = shard_paths(path)
    nbytes = sum(os.path.getsize(p) for p in paths)
    rows = Rows()
    rows.emit({"probe": "ceiling: pinned H2D", "gb_per_s": round(pinned_h2d_gbps(1 << 30), 2)})
    read_files(paths, pinned=True)
    rows.emit({"probe": "ceiling: page cache -> pinned",
               "gb_per_s": round(best([read_files(paths, pinned=True) for _ in range(3)]).gb_per_s, 2)})
    dest = cupy.empty(nbytes, dtype=cupy.uint8)
    rows.emit({"probe": "raw KvikIO whole files",
               "gb_per_s": round(best([raw_kvikio_files(paths, dest) for _ in range(3)]).gb_per_s, 2)})
    del dest
    free_device_memory()

    for cold in (True, False):
        if cold and not drop_page_cache():
            continue
        t0 = time.perf_counter()
        run = GdsRun(path, "mmap", 256)
        opened = time.perf_counter() - t0
        rows.emit({"probe": "mmap open", "cold": cold, "seconds": round(opened, 3),
                   "gb_per_s": round(nbytes / opened / 1e9, 2), "backend_stats": run.ds.describe()["backend_stats"]})
        run.close()

    sweep = [{"num_streams": s, "copy_bytes": c << 20} for s in (1, 2, 4) for c in (16, 64)] if args.sweep else [{}]
    configs = [("kvikio", {}, False)] + [("mmap", opts, False) for opts in sweep]
    configs += [("mmap", {}, True), ("kvikio", {}, True)]
    for backend, opts, shuffle in configs:
        run = GdsRun(path, backend, 256, shuffle=shuffle, backend_options=opts)
        run()
        r = best([run() for _ in range(3)])
        rows.emit({"probe": f"gdsload {backend}", "options": opts, "shuffle": shuffle,
                   "gb_per_s": round(r.gb_per_s, 2), "stall_s": round(r.stall_s or 0.0, 4),
                   "seconds": round(r.seconds, 4)})
        run.close()
        free_device_memory()

    for backend in ("kvikio", "mmap", "pinned"):
        probe = GdsRun(path, backend, 256)
        probe()
        r = probe()
        probe.close()
        batches = -(-(r.samples or 0) // 256)
        read_ms = r.seconds / batches * 1e3
        for factor, consumer in itertools.product((1.5, 3.0), ("legacy default stream", "non-blocking stream")):
            with contextlib.ExitStack() as scope:
                if consumer == "non-blocking stream":
                    scope.enter_context(cupy.cuda.Stream(non_blocking=True))
                run = GdsRun(path, backend, 256, step=Spin(read_ms * factor))
                run()
                r = run()
                run.close()
            rows.emit({"probe": f"gdsload {backend} + step", "factor": factor, "consumer": consumer,
                       "step_ms": round(read_ms * factor, 3),
                       "nominal_steps_s": round(batches * read_ms * factor / 1e3, 4),
                       "steps_alone_s": round(r.alone_s or 0.0, 4), "wall_s": round(r.seconds, 4),
                       "host_stall_s": round(r.stall_s or 0.0, 4), "wait_fraction": round(r.wait_fraction or 0.0, 4)})
        free_device_memory()
    print("wrote", write_probe(args, "probe-mmap", rows, dataset_bytes=nbytes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
