"""Whether the kvikio backend (KvikIO's compat mode) serialises with the consumer's stream: its warm shuffled
rate and its waiting beside a training step, with the consumer on the legacy default stream (where CuPy and
torch put work unless told otherwise) and on a non-blocking stream of its own, beside raw KvikIO reading the
same blocks.

    python -m benchmarks.diagnostics.probe_kvikio_streams [--size-gib 8] [--repeats 3] [--backends kvikio]

Per backend and consumer stream: the best of ``--repeats`` warm shuffled stretches of at least 0.5 s from
rest (GB/s), then the suite's training-step row (a step 1.5x a batch's read time on the legacy stream,
synced every step; waiting = a pass's time beyond the same steps alone, median of three passes after the
one from rest). The step's length is taken from the legacy-stream rate and kept for the other stream, so
both rows run the same steps. Raw KvikIO (one read per block, shuffled) before and after. GPU only. Writes
``results/<machine>/probe-kvikio-streams[-TAG].json``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from typing import Any

from gdsload import GDSDataset
from gdsload.measure import block_locations, read_files, raw_kvikio_blocks, shard_paths, time_pass, time_passes
from gdsload.steps import Spin

from ..common import BATCH, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, step_ms, write_probe


def raw_rate(path: str, repeats: int) -> float:
    import cupy

    image = block_locations(path, ("image",))
    dest = cupy.empty(sum(b.nbytes for b in image), dtype=cupy.uint8)
    best = max(raw_kvikio_blocks(image, dest).gb_per_s for _ in range(repeats))
    del dest
    free_device_memory()
    return best


def main(argv: list[str] | None = None) -> int:
    import cupy

    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="kvikio")
    args = parse_probe_args(ap, argv)
    rows = Rows()
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    raw = "raw KvikIO (blocks, shuffled)"
    rows.emit({"what": raw, "when": "before", "gb_per_s": round(raw_rate(path, args.repeats), 2)})
    for backend in args.backends.split(","):
        ds = GDSDataset(path, batch_size=BATCH, backend=backend, shuffle=True)
        ms: float | None = None
        for where in ("legacy", "own"):
            ctx: Any = contextlib.nullcontext() if where == "legacy" else cupy.cuda.Stream(non_blocking=True)
            with ctx:
                rate = max((time_pass(ds, min_seconds=0.5) for _ in range(args.repeats)),
                           key=lambda r: r.gb_per_s)
                if ms is None:  # 1.5x a batch's read time on the legacy stream, for both rows
                    ms = step_ms(rate, 1.5)
                passes = time_passes(ds, Spin(ms, 1), 3)
            later = [round(p.wait_fraction, 4) for p in passes[1:]]
            row = {"what": f"gdsload {backend}", "consumer_stream": where, "io_mode": rate.io_mode,
                   "gb_per_s": round(rate.gb_per_s, 2), "step_ms": round(ms, 3),
                   "wait_fraction": statistics.median(later), "wait_fraction_passes": later,
                   "first_pass_wait_fraction": round(passes[0].wait_fraction, 4)}
            rows.emit(row)
        ds.close()
    rows.emit({"what": raw, "when": "after", "gb_per_s": round(raw_rate(path, args.repeats), 2)})
    print("wrote", write_probe(args, "probe-kvikio-streams", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
