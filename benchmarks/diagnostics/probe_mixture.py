"""Where a mixture of datasets loses rate against one dataset, per backend, warm.

    python -m benchmarks.diagnostics.probe_mixture [--size-gib 2] [--backends pinned,kvikio] [--seconds 1]

The data of ``benchmarks.mixture``: one dataset of ``--size-gib`` and three sources holding 1/2, 1/3 and 1/6
of it. Per backend, each a stretch of at least ``--seconds`` from rest:

- ``single``: the one dataset;
- ``alone <source>``: each source's dataset by itself, opened as the mixture opens it (with its share of the
  reader threads, :func:`gdsload.mixture.specs.share_threads`);
- ``concurrent``: the three sources' datasets, opened the same way, at once, each taken flat out on a thread
  of its own. Their sum is what three pipelines carry side by side in one process; each one's share of it
  stands beside;
- ``single x3``: the one dataset opened three times, each with a third of its reader threads, taken the same
  way: three pipelines over the same files and epochs. Where it loses what ``concurrent`` loses, the cost is
  the pipelines side by side; where it does not, it is in the sources (their sizes, their epochs' ends);
- ``mixture, read_ahead=R``: the Mixture, and per source the seconds it waited for that source's batches
  (``mix.stats``) as a share of the stretch. The source it waits on most is the one holding it back.

Prints a table and writes ``results/<machine>/probe-mixture[-TAG].json`` and ``.md``. Public API, and the
mixture's rule for sharing reader threads.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from gdsload import GDSDataset, Mixture
from gdsload.errors import BackendUnavailable
from gdsload.mixture.specs import share_threads
from gdsload.tools.measure import device_sync, time_pass

from ..common import BATCH, make_dataset, parse_probe_args, probe_parser, write_probe_table
from ..mixture import SHARES, time_mixture


def concurrent(datasets: dict[str, GDSDataset], seconds: float) -> dict[str, Any]:
    """Every dataset taken flat out at once, one thread each: GB/s in all, and each one's."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, ds: GDSDataset) -> None:
        try:
            results[name] = time_pass(ds, min_seconds=seconds)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in datasets.items()]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"gb_per_s": round(sum(r.bytes for r in results.values()) / took / 1e9, 2),
            "per_source": {n: round(r.gb_per_s, 2) for n, r in results.items()}}


def mixture_row(mix: Mixture, sync: Any, seconds: float) -> dict[str, Any]:
    """The mixture's GB/s over a stretch, and the share of it spent waiting for each source's batches."""
    before = {n: s["wait_s"] for n, s in mix.stats.as_dict()["sources"].items()}
    t0 = time.perf_counter()
    rate = time_mixture(mix, sync, seconds)
    took = time.perf_counter() - t0
    after = mix.stats.as_dict()["sources"]
    return {"gb_per_s": round(rate, 2),
            "waited_pct": {n: round(100 * (after[n]["wait_s"] - before[n]) / took, 1) for n in after}}


def probe(backend: str, single_path: str, sources: dict[str, str], seconds: float) -> dict[str, Any]:
    options = {"backend": backend, "shuffle": True, "seed": 0}
    row: dict[str, Any] = {"backend": backend}
    with GDSDataset(single_path, BATCH, **options) as single:
        sync = device_sync(single)
        time_pass(single)  # warm-up: page cache, kernels, buffers
        row["io_mode"] = single.io_mode
        row["single"] = round(time_pass(single, min_seconds=seconds).gb_per_s, 2)
        num_batches = len(single)
    specs = {n: (p, None, {}, dict(options)) for n, p in sources.items()}
    share_threads(specs)  # as the Mixture opens its sources: the reader threads of one dataset shared out
    row["source_options"] = {n: spec[3].get("backend_options") for n, spec in specs.items()}
    datasets = {n: GDSDataset(p, BATCH, **kwargs) for n, (p, _, _, kwargs) in specs.items()}
    try:
        row["alone"] = {n: round(time_pass(ds, min_seconds=seconds).gb_per_s, 2) for n, ds in datasets.items()}
        row["concurrent"] = concurrent(datasets, seconds)
    finally:
        for ds in datasets.values():
            ds.close()
    thirds = {f"single {i}": (single_path, None, {}, dict(options)) for i in range(3)}
    share_threads(thirds)
    datasets = {n: GDSDataset(p, BATCH, **kwargs) for n, (p, _, _, kwargs) in thirds.items()}
    try:
        for ds in datasets.values():
            time_pass(ds)  # warm-up, as the single dataset had
        row["single x3"] = concurrent(datasets, seconds)
    finally:
        for ds in datasets.values():
            ds.close()
    for ahead in (0, 2):
        with Mixture(sources, dict(SHARES), batch_size=BATCH, num_batches=num_batches, read_ahead=ahead,
                     **options) as mix:
            time_mixture(mix, sync, 0.0)  # warm-up
            row[f"mixture, read_ahead={ahead}"] = mixture_row(mix, sync, seconds)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| backend | io mode | single GB/s | alone (per source) | concurrent: sum (per source) | single x3: sum | "
             "mixture ra=0: GB/s (waited % per source) | mixture ra=2 |", "|---|---|---:|---|---|---:|---|---|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['backend']} | {r['note']} | | | | | | |")
            continue
        cells = []
        for ahead in (0, 2):
            m = r[f"mixture, read_ahead={ahead}"]
            cells.append(f"{m['gb_per_s']} ({', '.join(f'{n} {v}' for n, v in m['waited_pct'].items())})")
        c = r["concurrent"]
        lines.append(f"| {r['backend']} | {r['io_mode']} | {r['single']} | "
                     f"{', '.join(f'{n} {v}' for n, v in r['alone'].items())} | "
                     f"{c['gb_per_s']} ({', '.join(f'{n} {v}' for n, v in c['per_source'].items())}) | "
                     f"{r.get('single x3', {}).get('gb_per_s', 'n/a')} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.split("\n\n")[0], size_gib=2.0)
    ap.add_argument("--backends", default="pinned,kvikio,mmap")
    ap.add_argument("--seconds", type=float, default=1.0)
    args = parse_probe_args(ap, argv)
    single = make_dataset(args.data, args.size_gib)
    sources = {name: make_dataset(args.data, args.size_gib * n / 6) for name, n in SHARES.items()}
    rows = []
    for backend in args.backends.split(","):
        try:
            rows.append(probe(backend, single, sources, args.seconds))
        except BackendUnavailable as e:
            rows.append({"backend": backend, "note": "not run: " + " ".join(str(e).split())[:200]})
    write_probe_table(args, "probe-mixture", rows, markdown(rows), seconds=args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
