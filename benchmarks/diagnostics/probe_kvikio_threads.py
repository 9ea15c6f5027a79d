"""The kvikio backend's warm rate against the size of KvikIO's thread pool, beside raw KvikIO reading the same
blocks: how many readers a machine's cores leave room for beside the pipeline's own threads.

    python -m benchmarks.diagnostics.probe_kvikio_threads [--size-gib 8] [--threads 16,14,12,10,8] [--rounds 3]

Per round: raw KvikIO (one read per block, shuffled, 16 threads; best of three), then the kvikio backend at
each ``--threads`` count, shuffled (best of three warm stretches of at least 0.5 s from rest), the order
reversed every other round (drift within a call), and in order at the first and last count; after the
rounds, a cold pass (page cache dropped) at the first and last count, twice each. GPU only. Writes
``results/<machine>/probe-kvikio-threads[-TAG].json``.
"""

from __future__ import annotations

import sys

from gdsload import GDSDataset
from gdsload.env import kvikio_info
from gdsload.measure import cold_pass, read_files, shard_paths, time_pass

from ..common import BATCH, Rows, make_dataset, parse_probe_args, probe_parser, write_probe
from .probe_kvikio_streams import raw_rate


def rate(path: str, threads: int, shuffle: bool = True, cold: bool = False) -> dict[str, object]:
    """GB/s of the kvikio backend with ``threads`` KvikIO threads, warm (best of three stretches) or cold,
    and its io mode."""
    with GDSDataset(path, batch_size=BATCH, backend="kvikio", shuffle=shuffle,
                    backend_options={"num_threads": threads}) as ds:
        if cold:
            gbps = cold_pass(ds).gb_per_s
        else:
            time_pass(ds)
            gbps = max(time_pass(ds, min_seconds=0.5).gb_per_s for _ in range(3))
        return {"gbps": round(gbps, 2), "io_mode": ds.io_mode}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    ap.add_argument("--threads", default="16,14,12,10,8")
    ap.add_argument("--rounds", type=int, default=3)
    args = parse_probe_args(ap, argv)
    counts = [int(t) for t in args.threads.split(",")]
    path = make_dataset(args.data, args.size_gib)
    rows = Rows()
    for rnd in range(args.rounds):
        read_files(shard_paths(path))
        rows.emit({"round": rnd, "what": "raw KvikIO", "threads": 16, "order": "shuffled",
                   "io_mode": kvikio_info().get("io_mode"), "gbps": round(raw_rate(path, 3), 2)})
        for t in counts if rnd % 2 == 0 else counts[::-1]:
            rows.emit({"round": rnd, "what": "kvikio", "threads": t, "order": "shuffled", **rate(path, t)})
        for t in dict.fromkeys((counts[0], counts[-1])):
            rows.emit({"round": rnd, "what": "kvikio", "threads": t, "order": "in order",
                       **rate(path, t, shuffle=False)})
    for t in (counts[0], counts[-1]) * 2:
        rows.emit({"what": "kvikio", "threads": t, "order": "in order, cold", **rate(path, t, False, cold=True)})
    print("wrote", write_probe(args, "probe-kvikio-threads", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
