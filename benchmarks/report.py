"""Render a suite JSON (the one shape ``benchmarks.suite`` writes): a markdown table with the targets checked, a
PNG (when matplotlib imports) and ``summary.json`` with the headline figures. Nothing here measures anything.

    python -m benchmarks.report benchmarks/results/H200/suite.json"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .common import load_result, pyplot, save_figure, write_json, write_report

#: Version of the JSON shape (each adds summary keys, None where a run did not measure them); ``READS``: rendered.
SCHEMA = 4
READS = (1, 2, 3, 4)
RAW_SHUFFLED = "raw KvikIO (blocks, shuffled)"
RAW_FILES = "raw KvikIO (whole files)"


def measured(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    """Rows with figures whose fields equal ``match``."""
    return [r for r in rows if ("gb_per_s" in r or "open_s" in r) and all(r.get(k) == v for k, v in match.items())]


def main_dataset(rows: list[dict[str, Any]]) -> str | None:
    """The largest dataset in the default 4 MiB blocks: the one headline figures come from."""
    names = {r["dataset"] for r in rows if r.get("dataset", "-") != "-" and r["dataset"].endswith("-4MiB")}
    return max(names, key=lambda d: float(d.split("GiB")[0]), default=None)


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of one run, per backend: what ``summary.json`` holds (None: not measured)."""
    rows, main = doc["results"], main_dataset(doc["results"])
    gds = measured(rows, kind="gdsload", dataset=main)
    backends = list(dict.fromkeys(r["backend"] for r in gds + measured(rows, kind="step", dataset=main)
                                  if r.get("backend")))

    def one(**match: Any) -> dict[str, Any] | None:
        found = measured(rows, dataset=main, **match)
        return found[0] if found else None

    def per_backend(key: str, **match: Any) -> dict[str, Any]:
        return {b: (one(backend=b, **match) or {}).get(key) for b in backends}

    startup = {r["regime"] for r in measured(rows, kind="startup", dataset=main)}
    warm_or_cold = "warm" if "warm" in startup else "cold" if startup else None  # warm: what targets are set for
    raw, raw_files = one(regime="warm", name=RAW_SHUFFLED), one(regime="warm", name=RAW_FILES)
    auto = doc.get("auto_backend") or {}
    compressed = [r for r in rows if r.get("kind") == "compressed" and "warm_epochs_gbps" in r]
    return {"schema": SCHEMA, "date": doc["date"], "mode": doc["mode"], "gpu": doc["machine"].get("gpu"),
            "dataset": main, "auto_backend": auto.get("backend"),
            "io_mode": {b: next((r["io_mode"] for r in gds if r["backend"] == b), None) for b in backends},
            "warm_shuffled_gbps": per_backend("gb_per_s", kind="gdsload", regime="warm", shuffle=True, default=True),
            "raw_kvikio_shuffled_gbps": raw and raw["gb_per_s"],
            "raw_kvikio_whole_files_gbps": raw_files and raw_files["gb_per_s"],
            "stall_1p5x_sync_every_step": per_backend("wait_fraction", kind="step", step_factor=1.5, sync_every=1),
            "startup_regime": warm_or_cold, "open_s": per_backend("open_s", kind="startup", regime=warm_or_cold),
            "first_batch_s": per_backend("first_batch_s", kind="startup", regime=warm_or_cold),
            "open_s_cold": per_backend("open_s", kind="startup", regime="cold"),
            "first_batch_s_cold": per_backend("first_batch_s", kind="startup", regime="cold"),
            "startup": {b: fresh_startup(one(kind="startup", regime="warm-fresh", backend=b)) for b in backends},
            "stall_10ms_continuous": per_backend("wait_fraction", kind="step", continuous=True, step_ms=10.0,
                                                 fresh_process=None),
            "stall_10ms_continuous_fresh": per_backend("wait_fraction", kind="step", continuous=True, step_ms=10.0,
                                                       fresh_process=True),
            "stall_1p5x_unslowed": per_backend("wait_fraction_unslowed", kind="step", step_factor=1.5, sync_every=1),
            "compressed": [{k: r.get(k) for k in COMPRESSED_KEYS + (RUNS_KEYS if "runs" in r else ())}
                           for r in compressed] if compressed else None,
            **{k: doc.get(k) or dict.fromkeys(backends) for k in ("mixture", "first_epoch")},  # benchmarks.mixture's
            **({"cut_short": doc["cut_short"]} if doc.get("cut_short") else {})}


#: What the summary keeps of each compressed row.
COMPRESSED_KEYS = ("store", "backend", "ratio", "warm_epochs_gbps", "first_batch_s", "cold_gbps", "raw_cold_gbps",
                   "decoder_ceiling_gbps", "decoder_ceiling_why", "decoder_lanes", "device_used_bytes_before",
                   "device_used_bytes_after")
#: ... and of a row measured in fresh processes (``runs``; rows of earlier runs have none).
RUNS_KEYS = ("gb_per_s", "runs_spread", "epoch_spread", "runs")
#: The warm target, as a share of nvCOMP's ceiling: ``kvikio`` (compat mode) is held to less.
CEILING_SHARE = {"kvikio": 0.6}


def fresh_startup(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """A fresh-process startup row's medians (None: not measured)."""
    return None if row is None else {k: row.get(k) for k in ("import_s", "cuda_start_s", "open_s", "first_batch_s",
                                                              "imports", "processes")}


def targets(doc: dict[str, Any]) -> list[str]:
    """The issue's targets, checked against this run's own numbers (or said to be unmeasured)."""
    rows, out = doc["results"], []
    auto = (doc.get("auto_backend") or {}).get("backend")
    h2d = measured(rows, name="ceiling: pinned H2D copy")
    for ds in sorted({r["dataset"] for r in measured(rows) if r["dataset"].endswith("-4MiB")}):
        page = measured(rows, dataset=ds, name="ceiling: page cache -> pinned")
        disk = measured(rows, dataset=ds, name="ceiling: O_DIRECT disk read")
        torch_warm = measured(rows, dataset=ds, regime="warm", name="torch DataLoader")
        for backend in dict.fromkeys(r["backend"] for r in measured(rows, dataset=ds, kind="gdsload")):
            std = {"dataset": ds, "kind": "gdsload", "backend": backend, "default": True, "shuffle": False}
            warm, cold = measured(rows, regime="warm", **std), measured(rows, regime="cold", **std)
            if warm and h2d and page:
                ceiling = min(h2d[0]["gb_per_s"], page[0]["gb_per_s"])
                v = warm[0]["gb_per_s"]
                out.append(f"{ds} {backend} warm: {v} GB/s = {v / ceiling:.0%} of min(page cache, H2D) = "
                           f"{ceiling} (target 80 %) -> {'met' if v >= 0.8 * ceiling else 'MISSED'}")
            if warm and torch_warm:
                top = max(torch_warm, key=lambda r: r["gb_per_s"])
                v = warm[0]["gb_per_s"]
                out.append(f"{ds} {backend} warm: {v / top['gb_per_s']:.1f}x the best torch DataLoader "
                           f"({top['config']}, {top['gb_per_s']} GB/s; target 3x) -> "
                           f"{'met' if v >= 3 * top['gb_per_s'] else 'MISSED'}")
                cpu, tcpu = warm[0]["cpu_core_s_per_gb"], min(r["cpu_core_s_per_gb"] for r in torch_warm)
                out.append(f"{ds} {backend} CPU: {cpu} core-s/GB vs best DataLoader {tcpu} (target <= half) -> "
                           f"{'met' if cpu <= tcpu / 2 else 'MISSED'}")
            if cold and disk:
                v, d = cold[0]["gb_per_s"], disk[0]["gb_per_s"]
                out.append(f"{ds} {backend} cold: {v} GB/s = {v / d:.0%} of O_DIRECT {d} (target 90 %) -> "
                           f"{'met' if v >= 0.9 * d else 'MISSED'}")
            for r in measured(rows, dataset=ds, kind="step", backend=backend):
                wait = r.get("wait_fraction")
                if r.get("continuous"):
                    out.append(_continuous(ds, backend, r))
                    continue
                if wait is None:
                    out.append(f"{ds} {backend} stall with {r['config']}: not measured from outside in this run")
                    continue
                runs = r.get("wait_fraction_runs", [wait])
                rest, drift = r.get("first_pass_wait_fraction"), r.get("alone_drift_fraction")
                out.append(f"{ds} {backend} waiting with {r['config']}: {wait:.1%} of the pass beyond the steps "
                           f"alone, median ({_runs(runs)}"
                           + ("" if rest is None else f"; the pass from rest before them: {rest:.1%}")
                           + ("" if drift is None else f"; the steps alone timed again after them: {drift:+.1%}")
                           + f"; gdsload's own count of host waits: {r['stall_fraction']:.1%}; target <= 1 %) -> "
                           + ("met" if wait <= 0.01 else "MISSED"))
                if "wait_fraction_unslowed" in r:
                    out.append(_unslowed(ds, backend, r, auto))
            for r in measured(rows, dataset=ds, kind="startup", regime="warm-fresh", backend=backend):
                out.append(f"{ds} {backend} start in a fresh process, pages warm (median of {r['processes']}): "
                           f"import ({r['imports']}) {r['import_s']} s, open {r['open_s']} s (target <= 0.25 s), "
                           f"first batch {r['first_batch_s']} s (target <= 0.025 s) -> "
                           + ("met" if r["open_s"] <= 0.25 and r["first_batch_s"] <= 0.025 else "MISSED"))
    return out + [t for r in rows if r.get("kind") == "compressed" and "warm_epochs_gbps" in r
                  for t in _compressed(r)]


def _continuous(ds: str, backend: str, r: dict[str, Any]) -> str:
    wait = r["wait_fraction"]
    return (f"{ds} {backend} waiting with {r['config']}: {wait:.2%} over the epochs after the first, as one run "
            f"(each: {', '.join(f'{w:.2%}' for w in r['wait_fraction_runs'])}; the first epoch, from rest: "
            f"{r['first_pass_wait_fraction']:.2%}; the whole run: {r['whole_run_wait_fraction']:.2%}; pipelines "
            f"restarted: {r['pipeline_restarts']}; target <= 0.2 %) -> " + ("met" if wait <= 0.002 else "MISSED"))


def _unslowed(ds: str, backend: str, r: dict[str, Any], auto: str | None) -> str:
    u = r["wait_fraction_unslowed"]
    least = ", ".join("-" if s is None else f"{s:.2f}x" for s in r.get("canary_least_slowdown_runs") or [])
    head = (f"{ds} {backend} waiting with {r['config']}, the passes the machine did not slow down (least canary "
            f"slowdown per pass: {least or 'n/a'}; slowed: over {r.get('canary_threshold')}x): ")
    if u is None:
        return head + "no pass left: not measured"
    if backend != auto:
        return head + f"{u:.1%} (the 1.5 % target is `auto`'s backend's, {auto})"
    return head + f"{u:.1%} (target <= 1.5 %) -> " + ("met" if u <= 0.015 else "MISSED")


def _compressed(r: dict[str, Any]) -> list[str]:
    """A compressed store's targets: every epoch within 10 % of the best; warm (the median of the fresh-process
    runs' best epochs, where the row has runs) at least 80 % of nvCOMP's batch-decode ceiling (``kvikio``: 60 %);
    cold at least 0.8 x the raw store's cold rate / ratio (stored over decoded bytes)."""
    warm, head = r["warm_epochs_gbps"], f"{r['dataset']} {r['backend']} compressed (ratio {r['ratio']})"
    best, runs = max(warm), r.get("runs") or []
    first = r.get("first_batch_s")
    start = f" (the first from rest, its first batch after {first * 1e3:.1f} ms)" if first is not None else ""
    out = [f"{head}: epochs {', '.join(map(str, warm))} GB/s{start}, slowest {min(warm) / best:.0%} of the best "
           f"(target >= 90 %) -> " + ("met" if min(warm) >= 0.9 * best else "MISSED")]
    if runs:
        best = r["gb_per_s"]
        each = ", ".join(str(x["gb_per_s"]) for x in runs)
        what = f"the median of {len(runs)} fresh processes' best epochs ({each}; spread {r['runs_spread']:.0%})"
    else:
        what = "its best epoch"
    ceiling, share = r.get("decoder_ceiling_gbps"), CEILING_SHARE.get(r["backend"], 0.8)
    out.append(f"{head}: warm {best} GB/s, {what}, against nvCOMP's batch decode of the same chunks, "
               f"{r.get('decoder_lanes') or 1} window(s) at once as the decode step runs them, "
               + (f"{ceiling} GB/s = {best / ceiling:.0%} (target >= {share:.0%}) -> "
                  + ("met" if best >= share * ceiling else "MISSED") if ceiling
                  else f"not measured ({r.get('decoder_ceiling_why')})"))
    cold, raw = r.get("cold_gbps"), r.get("raw_cold_gbps")
    if cold is not None and raw:
        want = 0.8 * raw / r["ratio"]
        capped = f", capped at 0.8 x the decoder's {ceiling}" if ceiling and 0.8 * ceiling < want else ""
        want = min(want, 0.8 * ceiling) if ceiling else want  # "as far as the decoder's ceiling allows"
        out.append(f"{head}: cold {cold} GB/s decoded against raw cold {raw} GB/s: target >= 0.8 x raw / ratio"
                   f"{capped} = {want:.2f} -> " + ("met" if cold >= want else "MISSED"))
    else:
        out.append(f"{head}: cold not measured (the page cache could not be dropped)")
    return out


def _runs(fractions: list[float]) -> str:
    return "passes: " + ", ".join(f"{f:.1%}" for f in fractions)


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.1%}"


def _row(r: dict[str, Any]) -> str:
    head = f"| {r['dataset']} | {r['regime']} | {r['name']} | {r['config']} |"
    if "error" in r or "skipped" in r:
        why = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
        return f"{head} {why[:100]} | | | | | | |"
    stall = _pct(r.get("stall_fraction"))
    if r.get("steady_stall_fraction") is not None:
        stall += f" ({r['steady_stall_fraction']:.1%})"
    pinned = f"{r['peak_pinned_bytes'] / 2**20:.0f} MiB" if r.get("peak_pinned_bytes") else ""
    wait = _pct(r.get("wait_fraction"))
    if r.get("wait_fraction_runs"):
        wait += f" ({_runs(r['wait_fraction_runs'])})"
    if r.get("first_pass_wait_fraction") is not None:
        wait += f"; from rest {r['first_pass_wait_fraction']:.1%}"
    if r.get("alone_drift_fraction") is not None:
        wait += f"; steps alone again {r['alone_drift_fraction']:+.1%}"
    if r.get("wait_fraction_unslowed") is not None:
        wait += f"; passes not slowed by the machine {r['wait_fraction_unslowed']:.1%}"
    if r.get("continuous"):
        wait += f"; whole run {r['whole_run_wait_fraction']:.2%}; pipelines restarted {r['pipeline_restarts']}"
    cpu = "" if r.get("cpu_core_s_per_gb") is None else r["cpu_core_s_per_gb"]
    return (f"{head} {r['io_mode']} | {r['gb_per_s']} | {r.get('samples_per_s') or ''} | {cpu} | {stall} | "
            f"{wait} | {pinned} |")


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The headline figures as markdown: one line per run-wide figure, one table row per backend."""
    def v(x: Any) -> str:
        return "n/a" if x is None else str(x)

    lines = [f"Dataset {summary['dataset']}; backend `auto`: {v(summary['auto_backend'])}; raw KvikIO of the same "
             f"blocks, shuffled: {v(summary['raw_kvikio_shuffled_gbps'])} GB/s (whole files: "
             f"{v(summary['raw_kvikio_whole_files_gbps'])}); startup regime: {v(summary['startup_regime'])}. "
             f"n/a: not measured in this run.", "",
             "| backend | io mode | warm shuffled GB/s | waiting, step 1.5x, sync every step | open s "
             "| first batch s |", "|---|---|---:|---:|---:|---:|"]
    for b, mode in summary["io_mode"].items():
        wait = summary["stall_1p5x_sync_every_step"].get(b)
        lines.append(f"| {b} | {v(mode)} | {v(summary['warm_shuffled_gbps'].get(b))} | {_pct(wait) or 'n/a'} | "
                     f"{v(summary['open_s'].get(b))} | {v(summary['first_batch_s'].get(b))} |")
    if "startup" not in summary:  # a summary of schema 1
        return lines
    lines += ["", "| backend | fresh process: import s | open s | first batch s | waiting, 10 ms step, continuous: "
              "suite's process / fresh one | waiting, step 1.5x, passes not slowed |", "|---|---:|---:|---:|---:|---:|"]
    for b in summary["io_mode"]:
        fresh = summary["startup"].get(b) or {}
        cont = [(summary.get(k) or {}).get(b) for k in ("stall_10ms_continuous", "stall_10ms_continuous_fresh")]
        unslowed = summary["stall_1p5x_unslowed"].get(b)
        lines.append(f"| {b} | {v(fresh.get('import_s'))} | {v(fresh.get('open_s'))} | "
                     f"{v(fresh.get('first_batch_s'))} | {' / '.join('n/a' if c is None else f'{c:.2%}' for c in cont)}"
                     f" | {_pct(unslowed) or 'n/a'} |")
    for c in summary["compressed"] or []:
        lines += ["", f"Compressed {c['store']} on {c['backend']}: ratio {c['ratio']}, warm {v(c.get('gb_per_s'))} "
                     f"GB/s (runs spread {v(c.get('runs_spread'))}), epochs {c['warm_epochs_gbps']} GB/s (spread "
                     f"{v(c.get('epoch_spread'))}), cold {v(c['cold_gbps'])}, nvCOMP decode "
                     f"{v(c['decoder_ceiling_gbps'])} GB/s ({c.get('decoder_lanes')} lanes)."]
    return lines + fresh_tables(summary)


def fresh_tables(summary: dict[str, Any], keys: tuple[str, ...] = ("mixture", "first_epoch")) -> list[str]:
    """A table per key of ``keys`` measured in ``summary`` in benchmarks.mixture's shape (per backend a dict, its
    keys the columns); nothing for a key not measured."""
    out = []
    for key in keys:
        got = {b: r for b, r in (summary.get(key) or {}).items() if isinstance(r, dict)}
        cols = list(next(iter(got.values()), {}))
        out += ["", f"`{key}` (benchmarks.mixture: fresh processes, alternating; medians, spread [min, max]):", "",
                f"| backend | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"] + [
            f"| {b} | {' | '.join(str(r.get(c)) for c in cols)} |" for b, r in got.items()] if got else []
    return out


def markdown(doc: dict[str, Any]) -> str:
    m, s = doc["machine"], doc["settings"]
    rows = doc["results"]
    auto = doc.get("auto_backend") or {}
    gpu = (f"GPU {m['gpu']} (driver CUDA {m.get('driver')}, runtime {m.get('cuda_runtime')}, CuPy {m.get('cupy')}), "
           f"KvikIO {m.get('kvikio')}, GDS available: {m.get('is_gds_available')} -> io mode **{m.get('io_mode')}**"
           if m.get("gpu") else f"No GPU ({m.get('reason')})")
    lines = [f"# gdsload benchmark suite ({doc['mode']}), {doc['date']}", "",
             f"{gpu}; {m.get('cpu_cores')} cores; data on `{m.get('data_filesystem')}`; "
             f"batch {s['batch_size']} samples of {s['sample_bytes']} bytes; page cache dropped for cold runs: "
             f"{s['page_cache_dropped']}; run took {doc.get('elapsed_s')} s. Backend `auto` here: "
             + (f"{auto['backend']} ({auto.get('reason')})" if auto else "not recorded") + ". Best of the repeats.", ""]
    cut = doc.get("cut_short")
    if cut:
        lines += [f"**Cut short** by {cut['signal']} after {cut['after_s']} s ({cut['stage']}): the rows after that "
                  "point are missing, and the summary's figures come from the rows that are here.", ""]
    if doc.get("stage_seconds"):
        lines += ["Seconds per stage: " + ", ".join(f"{k} {v:g}" for k, v in doc["stage_seconds"].items()) + ".", ""]
    lines += [f"Note: {n}" for n in doc.get("notes", [])] + ([""] if doc.get("notes") else [])
    lines += ["Stall: gdsload's own count of the time its consumer blocked on the host for data, as a share of "
              "the pass (after the first batch in brackets). Waiting: with a training step, the pass's wall time "
              "beyond the same steps run alone, as a share of the pass: it also sees device-side waits (best "
              "pass; every pass in brackets; training-step rows: the median of the passes after the one from "
              "rest, as epochs after the first run, and that first pass, with the pipeline's start, after them). "
              "Pinned: gdsload's peak pinned host memory (mmap: the dataset's files, locked once read).", "",
              "| dataset | cache | what | config | io mode | GB/s | samples/s | CPU core-s/GB | stall | waiting "
              "| pinned |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(r) for r in rows if r.get("kind") not in ("startup", "compressed")]
    lines += _section("Startup", "Seconds to open the dataset (`describe()['open_s']`) and to its first batch "
                      "(`stats.first_batch_s`), and from the constructor's call to the first batch in hand. Cache "
                      "warm-fresh: each a new process (medians), timing its imports, the open and the first batch on "
                      "its own clock.", "| dataset | cache | backend | io mode | import s | open s | first batch s | "
                      "total s |", "|---|---|---|---|---:|---:|---:|---:|", "open_s",
                      [r for r in rows if r.get("kind") == "startup"],
                      lambda r: f"| {r['dataset']} | {r['regime']} | {r['backend']} |",
                      lambda r: f" {r['io_mode']} | {r.get('import_s', '')} | {r['open_s']} | {r['first_batch_s']} | "
                                f"{r['seconds']} |")
    lines += _section("Compressed", "The stores of `benchmarks.compression`, zstd: ratio (stored / decoded bytes); "
                      "warm: the median of fresh processes' best epochs (each run's best beside it), then the median "
                      "run's every epoch in a row; cold (raw store's cold beside it); nvCOMP's batch decode alone on "
                      "the same chunks.", "| store | backend | ratio | warm GB/s (runs) | warm GB/s per epoch | cold "
                      "GB/s | raw cold GB/s | nvCOMP decode GB/s |", "|---|---|---:|---|---|---:|---:|---:|",
                      "warm_epochs_gbps", [r for r in rows if r.get("kind") == "compressed"],
                      lambda r: f"| {r['dataset']} | {r['backend']} |",
                      lambda r: f" {r['ratio']} | {r.get('gb_per_s')} "
                                f"({', '.join(str(x['gb_per_s']) for x in r.get('runs') or [])}) | "
                                f"{', '.join(map(str, r['warm_epochs_gbps']))} | {r['cold_gbps']} | "
                                f"{r['raw_cold_gbps']} | "
                                f"{r['decoder_ceiling_gbps'] or 'n/a: ' + str(r['decoder_ceiling_why'])} |")
    lines += ["", "## Summary (summary.json)", ""] + summary_table(summarize(doc))
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(doc)]
    return "\n".join(lines) + "\n"


def _section(title: str, intro: str, header: str, align: str, measured: str, rows: list[dict[str, Any]],
             lead: Callable[[dict[str, Any]], str], cells: Callable[[dict[str, Any]], str]) -> list[str]:
    """A titled table of ``rows`` (nothing without rows): ``lead(r)`` then ``cells(r)`` where ``r`` has
    ``measured``, else why it failed and blank cells."""
    blanks = " |" * (header.count("|") - lead(rows[0]).count("|") - 1) if rows else ""
    return ["", f"## {title}", "", intro, "", header, align] + [
        lead(r) + (cells(r) if measured in r else f" failed: {r.get('error') or r.get('skipped')} |{blanks}")
        for r in rows] if rows else []


def plot(doc: dict[str, Any], png: str) -> None:
    """Bar charts of GB/s and CPU core-s/GB on the main dataset. Raises ImportError without matplotlib."""
    plt = pyplot()
    main = main_dataset(doc["results"])
    rows = [r for r in doc["results"] if "gb_per_s" in r and r["dataset"] in ("-", main) and r.get("kind") != "step"]
    labels = [f"{r['name']} [{r['regime']}] {r['config']}" for r in rows]
    colors = ["#888888" if r.get("kind") == "ceiling" else "#2b7bba" if r.get("kind") == "gdsload" else "#e08a2b"
              for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.32 * len(rows) + 1.8), sharey=True)
    axes[0].barh(range(len(rows)), [r["gb_per_s"] for r in rows], color=colors)
    axes[0].set_xlabel("GB/s into device memory (grey: ceilings / raw KvikIO)")
    axes[1].barh(range(len(rows)), [r.get("cpu_core_s_per_gb") or 0 for r in rows], color=colors)
    axes[1].set_xlabel("CPU core-seconds per GB")
    axes[0].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[0].invert_yaxis()
    m = doc["machine"]
    fig.suptitle(f"{m.get('gpu')}, io mode {m.get('io_mode')}, dataset {main}, batch "
                 f"{doc['settings']['batch_size']}, {doc['date']} ({doc['mode']})", fontsize=10)
    save_figure(fig, png)


def load(path: str) -> dict[str, Any]:
    """A suite JSON, refused unless it has this module's shape (``schema``)."""
    return load_result(path, lambda doc: None if doc.get("schema") in READS
                       else f"not a suite result of schema {' or '.join(map(str, READS))} "
                            f"(found {doc.get('schema')!r})")


def render(path: str) -> list[str]:
    """Write the markdown (and PNG, and ``summary.json`` beside it) of the suite JSON at ``path``; returns
    the files written. Without matplotlib the PNG is left out, and said so."""
    doc = load(path)
    return write_report(path, markdown(doc), lambda png: plot(doc, png), "python -m benchmarks.report") + [
        write_json(os.path.join(os.path.dirname(path), "summary.json"), summarize(doc))]


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("wrote", ", ".join(render(p)))
