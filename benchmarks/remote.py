"""Remote datasets against a ceiling of plain clients reading the same objects from benchmarks/sendfile_server.py;
every measurement a fresh process (benchmarks/remote_worker.py), the cases alternating over ``--runs``.

    python -m benchmarks.remote [--size-gib 2] [--runs 3] [--backend kvikio] [--out DIR]

GB/s of dataset bytes, medians with their spread: ``ceiling_gbps`` (the best client at its best setting),
``direct_gbps`` (no cache; ``direct_tuned_gbps`` with ``--direct-options``), ``cached_cold_gbps`` (the open and
first pass into an empty cache; ``cached_open_s`` its open, ``cached_reopen_s`` one of the complete cache after it),
``cached_warm_gbps``, ``one_process_gbps`` and ``nodes4_gbps`` (4 processes, a cache each, the open and one epoch;
``nodes4_fetched_ratio``: bytes fetched over the dataset's)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gdsload.system.env import gpu_available
from gdsload.tools.measure import read_files, shard_paths

from .common import BATCH, ROOT, gbps_plot, make_dataset, probe_args, write_probe_table
from .remote_worker import CLIENTS

#: The routes' cases, beside one per client.
ROUTES = ("direct", "cached", "one_process", "nodes4")


@contextmanager
def sendfile_server(root: str) -> Iterator[str]:
    """benchmarks/sendfile_server.py serving ``root`` in a process of its own; yields its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.sendfile_server", root], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=_env())
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait(10)


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def spawn(case: dict[str, Any], **env: str) -> subprocess.Popen:
    """benchmarks/remote_worker.py measuring ``case`` in a fresh process (``env`` added to the environment)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.remote_worker", json.dumps(case)], cwd=ROOT,
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The worker's ``RESULT`` line, or an error saying why there is none."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"no result within {timeout:g} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit {proc.returncode}: " + " ".join(err.split())[-400:]}
    return json.loads(lines[-1][len("RESULT "):])


def run_case(name: str, base: dict[str, Any], work: str, dataset_bytes: int, timeout: float) -> dict[str, Any]:
    """One run of case ``name`` (a client's name or one of :data:`ROUTES`) in fresh processes."""
    cache = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
    try:
        if name in CLIENTS:
            return result(spawn({**base, "case": "client", "client": name}), timeout)
        if name in ("direct", "cached"):
            return result(spawn({**base, "case": name, "cache": cache}), timeout)
        if name == "direct_tuned":
            return result(spawn({**base, "case": "direct", "backend_options": base["direct_options"]}), timeout)
        world = 4 if name == "nodes4" else 1
        procs = [spawn({**base, "case": "node", "cache": os.path.join(cache, f"node{rank}")},
                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0") for rank in range(world)]
        got = [result(p, timeout) for p in procs]
        bad = next((g for g in got if "error" in g), None)
        if bad is not None:
            return bad
        seconds = max(g["end"] for g in got) - min(g["start"] for g in got)
        fetched = sum(g["fetched_bytes"] for g in got)
        return {"gbps": round(sum(g["bytes"] for g in got) / seconds / 1e9, 3), "seconds": round(seconds, 3),
                "fetched_ratio": round(fetched / dataset_bytes, 3), "routes": sorted({g["route"] for g in got})}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def median_of(runs: list[dict[str, Any]], key: str = "gbps") -> tuple[float | None, list[float]]:
    """The median of ``key`` over the runs that have it, and those values."""
    rates = [float(r[key]) for r in runs if isinstance(r.get(key), (int, float))]
    return (round(statistics.median(rates), 3) if rates else None), rates


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The summary: each client's median and the ceiling, the routes' medians, every median's spread."""
    spread: dict[str, list[float]] = {}
    notes: dict[str, str] = {}

    def median(key: str, case: str, field: str = "gbps") -> float | None:
        value, rates = median_of(runs.get(case, []), field)
        if rates:
            spread[key] = [min(rates), max(rates)]
        elif runs.get(case):
            notes[key] = runs[case][0].get("skip") or runs[case][0].get("error") or "no figure"
        return value

    clients = {name: median(name, name) for name in CLIENTS if name in runs}
    measured = {k: v for k, v in clients.items() if v is not None}
    best = max(measured, key=measured.__getitem__) if measured else None
    out: dict[str, Any] = {"ceiling_gbps": measured.get(best) if best else None, "ceiling_client": best,
                           "clients": clients, "client_notes": notes,
                           "client_settings": {n: [r.get("best") for r in runs.get(n, []) if r.get("best")]
                                               for n in measured}}
    for key, case, field in (("direct_gbps", "direct", "gbps"), ("direct_tuned_gbps", "direct_tuned", "gbps"),
                             ("cached_cold_gbps", "cached", "cold_gbps"), ("cached_warm_gbps", "cached", "warm_gbps"),
                             ("cached_open_s", "cached", "open_s"), ("cached_reopen_s", "cached", "reopen_s"),
                             ("one_process_gbps", "one_process", "gbps"), ("nodes4_gbps", "nodes4", "gbps"),
                             ("nodes4_fetched_ratio", "nodes4", "fetched_ratio")):
        out[key] = median(key, case, field)
    ceiling = out["ceiling_gbps"]
    out["of_ceiling"] = {k: round(out[k] / ceiling, 3) for k in ("direct_gbps", "direct_tuned_gbps",
                                                                 "cached_cold_gbps", "cached_warm_gbps")
                         if out[k] and ceiling}
    if out["one_process_gbps"] and out["nodes4_gbps"]:
        out["nodes4_of_4x_one_process"] = round(out["nodes4_gbps"] / (4 * out["one_process_gbps"]), 3)
    out["spread"] = spread
    return out


def markdown(summary: dict[str, Any], runs: int, backend: str) -> str:
    """The summary as a table: each figure's median, its spread over the runs, and its share of the ceiling."""
    ceiling, spread = summary["ceiling_gbps"], summary["spread"]
    out = [f"GB/s of dataset bytes, median of {runs} fresh-process run(s), alternating (spread: lowest-highest), "
           f"from benchmarks/sendfile_server.py (sendfile, threaded). gdsload backend: `{backend}`. Ceiling: "
           f"`{summary['ceiling_client']}`.", "", "| what | GB/s | spread | % of ceiling | note |",
           "|---|---:|---|---:|---|"]

    def line(what: str, key: str, value: float | None, note: str = "") -> None:
        lo_hi = spread.get(key)
        pct = f"{100 * value / ceiling:.0f}" if value and ceiling and not key.endswith(("_s", "ratio")) else "-"
        out.append(f"| {what} | {'-' if value is None else f'{value:.3f}'} | "
                   f"{'-' if not lo_hi else f'{lo_hi[0]:.3f}-{lo_hi[1]:.3f}'} | {pct} | {note} |")

    for name, value in summary["clients"].items():
        best = summary["client_settings"].get(name) or [""]
        line(f"client {name}", name, value, summary["client_notes"].get(name, f"best: {best[-1]}"))
    for key in ("direct_gbps", "direct_tuned_gbps", "cached_cold_gbps", "cached_warm_gbps", "cached_open_s",
                "cached_reopen_s", "one_process_gbps", "nodes4_gbps", "nodes4_fetched_ratio"):
        line(key, key, summary.get(key), summary["client_notes"].get(key, ""))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = probe_args(
        __doc__.splitlines()[0], argv, 2.0, block_kib=(4096, "the dataset's block size (KiB)"),
        runs=(3, "fresh-process runs of every case (median reported)"), batch_size=BATCH,
        seconds=(1.0, "least seconds of each warm measurement"), concurrency=("16,64", "the threaded clients' sweep"),
        backend=(None, "gdsload's backend (default: kvikio with a GPU, else cpu)"),
        clients=(",".join(CLIENTS), "which plain clients to measure"),
        timeout=(300.0, "seconds a measurement may take"), resident_bytes=(None, "gdsload's resident_bytes "
                                                                           "(default: its own)", int),
        direct_options=(None, "JSON backend_options of a second direct case, direct_tuned (e.g. num_threads, "
                        "task_bytes)"))
    backend = args.backend or ("kvikio" if gpu_available() else "cpu")
    path = make_dataset(args.data, args.size_gib, args.block_kib << 10)
    files = shard_paths(path)
    read_files(files)  # the server sends from the page cache: no disk in the measured path
    dataset_bytes = sum(os.path.getsize(f) for f in files)
    work = tempfile.mkdtemp(prefix="remote-bench-", dir=args.data)
    names = [c for c in args.clients.split(",") if c] + list(ROUTES)
    names += ["direct_tuned"] if args.direct_options else []
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        os.symlink(os.path.dirname(os.path.abspath(path)), os.path.join(work, "bench"))
        with sendfile_server(work) as base_url:
            url = f"{base_url}/bench/{os.path.basename(path)}"
            print(f"serving {path} ({dataset_bytes / 1e9:.3f} GB) at {url}", flush=True)
            base = {"url": url, "skeleton": os.path.join(work, "skeleton"), "backend": backend,
                    "seconds": args.seconds, "batch_size": args.batch_size, "resident_bytes": args.resident_bytes,
                    "direct_options": json.loads(args.direct_options) if args.direct_options else None,
                    "concurrency": [int(c) for c in args.concurrency.split(",")]}
            for run in range(max(1, args.runs)):
                print(f"run {run + 1} of {args.runs}", flush=True)
                for name in names[run % len(names):] + names[:run % len(names)]:
                    t0 = time.perf_counter()
                    r = run_case(name, base, work, dataset_bytes, args.timeout)
                    runs[name].append(r)
                    figures = json.dumps({k: v for k, v in r.items() if k != "sweep"})
                    print(f"  {name} ({time.perf_counter() - t0:.1f} s): {figures}", flush=True)
                    if r.get("sweep"):
                        print("    sweep: " + ", ".join(f"{k} {v}" for k, v in r["sweep"].items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    print("summary: " + json.dumps({k: v for k, v in summary.items() if k != "client_settings"}), flush=True)
    rows = [{"what": n, "runs": runs[n]} for n in names]
    out = write_probe_table(args, "remote", rows, markdown(summary, args.runs, backend), summary=summary,
                            dataset=path, dataset_bytes=dataset_bytes, backend=backend, runs=args.runs,
                            seconds=args.seconds, batch_size=args.batch_size, method=__doc__.split("\n\n", 2)[2])
    bars = {k: {"GB/s": summary.get(k)} for k in ("direct_gbps", "cached_cold_gbps", "cached_warm_gbps",
                                                   "one_process_gbps", "nodes4_gbps")}
    gbps_plot(out, "remote dataset over HTTP (sendfile server)", bars,
              {f"ceiling: {summary['ceiling_client']}": summary["ceiling_gbps"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
