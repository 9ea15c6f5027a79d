"""Remote datasets' throughput against a server that is not the bottleneck (issue 45): each route beside raw
KvikIO RemoteFile reads of the same byte ranges, in one run.

    python -m benchmarks.remote [--size-gib 2] [--out DIR] [--workers 4] [--seconds 1] [--repeats 2]

The synthetic dataset (``make_dataset``) is read once into the page cache, then its folder is served over HTTP by
``--workers`` aiohttp processes sharing one port (``web.FileResponse``: sendfile, Range, ETag; the server code
of benchmarks/remote_clients.py), so the server copies from memory into sockets and is not what is measured.
Every row is GB/s of dataset bytes delivered (GB = 1e9), with its io mode and route:

- ``ceiling: pinned H2D copy``: ``pinned_h2d_gbps`` (256 MiB, best of 5 copies): the host-to-device copy's ceiling
  of the routes that land in host memory first (GPU only).
- ``raw RemoteFile -> device``: KvikIO ``RemoteFile.open_http`` per shard object, one ``pread`` per block of the
  dataset (the ranges the direct route reads; shuffled, seed 0) into one device buffer, all futures in flight,
  on KvikIO's pool as the direct route sets it. The ceiling of the direct route, and a lower bound on the
  server's own ceiling. ``raw RemoteFile -> host``: the same into host memory (no device copy): the server
  and libcurl alone.
- ``gdsload direct``: ``GDSDataset(url, backend=kvikio|pinned, shuffle=True)``, route checked ``direct``; a few
  batches untimed, then ``time_pass`` for at least ``--seconds``. ``% of raw``: its share of the raw device row.
- ``gdsload cached``: ``GDSDataset(url, ..., cache_dir=fresh folder)``: the open and first pass (cold: fetching every
  shard) and a warm stretch (from the cache), beside ``local path``: the dataset opened from its folder with
  the same backend, the warm cache's reference.
- ``CPU route``: gdsload's ``HttpClient`` reading the same ranges into host memory on 16 threads, and the cpu
  backend's cached route (cold, warm) and local path.

The raw and direct rows are taken ``--repeats`` times, alternating, and the best is reported (every run kept).
A row that cannot run here (no GPU, no KvikIO) says ``not run: <reason>``; one that fails says ``error: ...``;
the run goes on. Writes ``results/<machine>/remote[-TAG].json``, a markdown table beside it and ``remote[-TAG].png``
(every measured row's GB/s as a bar, the ceilings, raw RemoteFile and H2D, as lines; where matplotlib imports).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gdsload.tools.bench_remote import (CPU_THREADS, client_blocks, device_buffer, direct_why_not, raw_remote_file,
                                        remote_blocks)
from gdsload.system.env import gpu_available
from gdsload.tools.measure import PassResult, pinned_h2d_gbps, read_files, shard_paths, take_batches, time_pass

from .common import BATCH, Rows, free_device_memory, make_dataset, parse_probe_args, probe_parser, write_probe_table
from .plots import gbps_plot, line_label
from .remote_clients import serve_files_on, servers

RAW = "raw RemoteFile -> device"
H2D = "ceiling: pinned H2D copy"
#: The rows drawn as lines on the plot (the others are bars).
CEILINGS = (H2D, RAW, "raw RemoteFile -> host")
Row = dict[str, Any]


def figures(runs: list[PassResult]) -> Row:
    """The best of ``runs`` (highest rate) as a row's figures, every run's GB/s kept."""
    r = max(runs, key=lambda x: x.gb_per_s)
    return {"io_mode": r.io_mode, "gbps": round(r.gb_per_s, 3), "runs": [round(x.gb_per_s, 3) for x in runs],
            "seconds": round(r.seconds, 3), "bytes": r.bytes,
            "cpu_s_per_gb": round(r.cpu_core_s_per_gb, 3) if r.cpu_s and r.cpu_core_s_per_gb else None}


def not_run(what: str, route: str, why: str) -> Row:
    return {"what": what, "route": route, "io_mode": None, "gbps": None, "note": f"not run: {why}"}


def warm_pass(source: str, backend: str, batch: int, seconds: float, route: str | None, **options: Any
              ) -> tuple[PassResult, str]:
    """``source`` read by ``backend``, shuffled: a few batches untimed, then ``time_pass`` for ``seconds``; the
    route the dataset took (``"local"`` for a folder), checked against ``route`` where given (ValueError)."""
    from gdsload import GDSDataset

    with GDSDataset(source, batch_size=batch, backend=backend, shuffle=True, seed=0, **options) as ds:
        took = ds.describe().get("remote", {}).get("route", "local")
        if route is not None and took != route:
            raise ValueError(f"took the {took} route, not {route}: {ds.describe()['remote']['route_reason']}")
        take_batches(ds)
        return time_pass(ds, min_seconds=seconds), took


def cached_passes(url: str, backend: str, batch: int, seconds: float, cache_dir: str) -> tuple[PassResult, ...]:
    """The cached route of ``url`` into the empty ``cache_dir``: the open and its first pass timed together (cold:
    every shard fetched, the first window's already by the open), then a warm stretch of at least ``seconds``
    (every shard present)."""
    from gdsload import GDSDataset

    started = time.perf_counter()
    with GDSDataset(url, batch_size=batch, backend=backend, shuffle=True, seed=0, cache_dir=cache_dir) as ds:
        cold = time_pass(ds, from_rest=False)  # what the open's fetch threads began counts: the clock runs since
        cold = dataclasses.replace(cold, seconds=time.perf_counter() - started)
        route = ds.describe()["remote"]["route"]
        if route != "cached":
            raise ValueError(f"took the {route} route with cache_dir given")
        return cold, time_pass(ds, min_seconds=seconds)


class Runner:
    """The rows of one run: each measurement attempted, a failure a row saying why."""

    def __init__(self, rows: Rows):
        self.rows = rows

    def emit(self, what: str, route: str, runs: list[PassResult], **extra: Any) -> None:
        self.rows.emit({"what": what, "route": route, **figures(runs), **extra})

    def error(self, what: str, route: str, e: BaseException) -> None:
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        self.rows.emit({"what": what, "route": route, "io_mode": None, "gbps": None, "note": f"error: {msg}"})

    def repeated(self, cases: dict[str, tuple[str, Callable[[], tuple[PassResult, str]]]], repeats: int) -> None:
        """Each case (name -> (route, measure)) ``repeats`` times, in a rotated order each time; a row each (best)."""
        names, runs, failed = list(cases), {n: [] for n in cases}, {}
        routes = {n: cases[n][0] for n in cases}
        for rep in range(max(1, repeats)):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                if name in failed:
                    continue
                try:
                    r, routes[name] = cases[name][1]()
                    runs[name].append(r)
                except Exception as e:  # noqa: BLE001 - the row says why; the others go on
                    failed[name] = e
                finally:
                    free_device_memory()
        for name in names:
            if name in failed:
                self.error(name, routes[name], failed[name])
            else:
                self.emit(name, routes[name], runs[name])

    def cached(self, url: str, backend: str, batch: int, seconds: float, cache_dir: str) -> None:
        try:
            cold, warm = cached_passes(url, backend, batch, seconds, cache_dir)
        except Exception as e:  # noqa: BLE001
            self.error(f"gdsload cached {backend}, cold cache", "cached", e)
            return
        finally:
            free_device_memory()
        self.emit(f"gdsload cached {backend}, cold cache", "cached", [cold])
        self.emit(f"gdsload cached {backend}, warm cache", "cached", [warm])


def h2d_row(run: Runner) -> None:
    """The pinned H2D copy ceiling's row: ``not run`` without a GPU, ``error`` where it fails."""
    if not gpu_available():
        run.rows.emit(not_run(H2D, "-", "no GPU here"))
        return
    try:
        rate = pinned_h2d_gbps()  # best of 5 copies of 256 MiB
    except Exception as e:  # noqa: BLE001 - the row says why; the others go on
        run.error(H2D, "-", e)
        return
    finally:
        free_device_memory()
    run.rows.emit({"what": H2D, "route": "-", "io_mode": "cuda-memcpy", "gbps": round(rate, 3),
                   "runs": [round(rate, 3)], "note": "256 MiB, best of 5"})


def measure(url: str, path: str, args: Any, work: str, rows: Rows) -> None:
    """Every row of the run, against the server at ``url`` serving the dataset at ``path``."""
    run = Runner(rows)
    h2d_row(run)
    gpu_why = direct_why_not(url)
    blocks = remote_blocks(url, os.path.join(work, "skeleton"))
    nbytes = sum(b.nbytes for b in blocks)
    print(f"{len(blocks)} blocks, {nbytes / 1e9:.3f} GB in {len({b.info.url for b in blocks})} objects", flush=True)
    gpu_rows = [(RAW, "-"), ("raw RemoteFile -> host", "-"), ("gdsload direct kvikio", "direct"),
                ("gdsload direct pinned", "direct"), ("gdsload cached kvikio, cold cache", "cached"),
                ("gdsload cached kvikio, warm cache", "cached"), ("local path kvikio", "local")]
    if gpu_why is not None:
        for what, route in gpu_rows:
            rows.emit(not_run(what, route, gpu_why))
    else:
        dest, dev_blocks = device_buffer(blocks)
        host = np.empty(nbytes, dtype=np.uint8)
        s, bs = args.seconds, args.batch_size
        run.repeated({
            RAW: ("-", lambda: (raw_remote_file(dev_blocks, dest, min_seconds=s), "-")),
            "raw RemoteFile -> host": ("-", lambda: (raw_remote_file(blocks, host, min_seconds=s), "-")),
            "gdsload direct kvikio": ("direct", lambda: warm_pass(url, "kvikio", bs, s, "direct")),
            "gdsload direct pinned": ("direct", lambda: warm_pass(url, "pinned", bs, s, "direct")),
        }, args.repeats)
        del dest, host
        free_device_memory()
        run.cached(url, "kvikio", bs, s, os.path.join(work, "cache-kvikio"))
        run.repeated({"local path kvikio": ("local", lambda: warm_pass(path, "kvikio", bs, s, None))}, 1)
    host = np.empty(nbytes, dtype=np.uint8)
    run.repeated({f"CPU route: HttpClient, same ranges, {CPU_THREADS} threads":
                  ("cpu client", lambda: (client_blocks(blocks, host, min_seconds=args.seconds), "cpu client"))},
                 args.repeats)
    del host
    run.cached(url, "cpu", args.batch_size, args.seconds, os.path.join(work, "cache-cpu"))
    run.repeated({"local path cpu": ("local", lambda: warm_pass(path, "cpu", args.batch_size, args.seconds, None))},
                 1)


def markdown(rows: list[Row], workers: int) -> str:
    """The rows as a table: GB/s, its share of the raw RemoteFile -> device row, the runs, CPU s/GB, notes."""
    raw = next((r["gbps"] for r in rows if r["what"] == RAW and r.get("gbps")), None)
    out = [f"GB/s of dataset bytes delivered (best of the runs listed), from a local aiohttp sendfile server of "
           f"{workers} processes; % of raw: share of the `{RAW}` row. `{H2D}`: bytes copied from pinned host "
           "memory to the device, no server (the copy's ceiling).", "",
           "| what | io mode | route | GB/s | % of raw | runs | CPU s/GB | note |",
           "|---|---|---|---:|---:|---|---:|---|"]
    for r in rows:
        g = r.get("gbps")
        pct = f"{100 * g / raw:.0f}" if g and raw and r["what"] != H2D else "-"
        cells = [r["what"], r.get("io_mode") or "-", r.get("route") or "-", "-" if g is None else f"{g:.2f}", pct,
                 " ".join(f"{x:.2f}" for x in r.get("runs", [])) or "-",
                 "-" if r.get("cpu_s_per_gb") is None else f"{r['cpu_s_per_gb']:.2f}", r.get("note", "")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(json_path: str, rows: list[Row]) -> str | None:
    """Every measured row's GB/s as a bar, the :data:`CEILINGS` as lines, beside ``json_path``."""
    bars = {f"{r['what']} ({r['io_mode']})": {"GB/s": r["gbps"]} for r in rows
            if r["what"] not in CEILINGS and r.get("gbps") is not None}
    lines = {line_label(r["what"], r.get("io_mode")): r.get("gbps") for r in rows if r["what"] in CEILINGS}
    return gbps_plot(json_path, "remote dataset over HTTP from a local aiohttp server", bars, lines)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=2.0)
    ap.add_argument("--workers", type=int, default=4, help="aiohttp server processes sharing the port")
    ap.add_argument("--seconds", type=float, default=1.0, help="least seconds of each warm measurement")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each raw and direct row (best reported)")
    ap.add_argument("--batch-size", type=int, default=BATCH)
    args = parse_probe_args(ap, argv)
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))  # the server sends from the page cache: no disk in the measured path
    rows = Rows()
    work = tempfile.mkdtemp(prefix="remote-bench-", dir=args.data)
    try:
        with servers(serve_files_on, args.workers, os.path.dirname(path)) as endpoint:
            url = f"{endpoint}/{os.path.basename(path)}"
            print(f"serving {path} at {url} ({args.workers} aiohttp processes)", flush=True)
            measure(url, path, args, work, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = write_probe_table(args, "remote", rows, markdown(rows, args.workers), dataset=path,
                            dataset_bytes=sum(os.path.getsize(f) for f in shard_paths(path)), workers=args.workers,
                            seconds=args.seconds, repeats=args.repeats, batch_size=args.batch_size,
                            method=__doc__.split("\n\n", 2)[2])
    plot(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
