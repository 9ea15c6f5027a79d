"""Render a suite JSON (the one shape ``benchmarks.suite`` writes): a markdown table with the targets
checked, a PNG (when matplotlib imports), and ``summary.json`` with the headline figures. Nothing here
measures anything.

    python -m benchmarks.report benchmarks/results/H100-80GB-HBM3/suite.json
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Version of the JSON shape; ``report`` refuses another.
SCHEMA = 1
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
    return {"schema": SCHEMA, "date": doc["date"], "mode": doc["mode"], "gpu": doc["machine"].get("gpu"),
            "dataset": main, "auto_backend": auto.get("backend"),
            "io_mode": {b: next((r["io_mode"] for r in gds if r["backend"] == b), None) for b in backends},
            "warm_shuffled_gbps": per_backend("gb_per_s", kind="gdsload", regime="warm", shuffle=True, default=True),
            "raw_kvikio_shuffled_gbps": raw and raw["gb_per_s"],
            "raw_kvikio_whole_files_gbps": raw_files and raw_files["gb_per_s"],
            "stall_1p5x_sync_every_step": per_backend("wait_fraction", kind="step", step_factor=1.5, sync_every=1),
            "startup_regime": warm_or_cold,
            "open_s": per_backend("open_s", kind="startup", regime=warm_or_cold),
            "first_batch_s": per_backend("first_batch_s", kind="startup", regime=warm_or_cold),
            "open_s_cold": per_backend("open_s", kind="startup", regime="cold"),
            "first_batch_s_cold": per_backend("first_batch_s", kind="startup", regime="cold")}


def targets(doc: dict[str, Any]) -> list[str]:
    """The issue's targets, checked against this run's own numbers (or said to be unmeasured)."""
    rows, out = doc["results"], []
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
             "| first batch s |",
             "|---|---|---:|---:|---:|---:|"]
    for b, mode in summary["io_mode"].items():
        wait = summary["stall_1p5x_sync_every_step"].get(b)
        lines.append(f"| {b} | {v(mode)} | {v(summary['warm_shuffled_gbps'].get(b))} | {_pct(wait) or 'n/a'} | "
                     f"{v(summary['open_s'].get(b))} | {v(summary['first_batch_s'].get(b))} |")
    return lines


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
    lines += [f"Note: {n}" for n in doc.get("notes", [])] + ([""] if doc.get("notes") else [])
    lines += ["Stall: gdsload's own count of the time its consumer blocked on the host for data, as a share of "
              "the pass (after the first batch in brackets). Waiting: with a training step, the pass's wall time "
              "beyond the same steps run alone, as a share of the pass: it also sees device-side waits (best "
              "pass; every pass in brackets; training-step rows: the median of the passes after the one from "
              "rest, as epochs after the first run, and that first pass, with the pipeline's start, after them). "
              "Pinned: gdsload's peak pinned host memory (mmap: the dataset's files, locked once read).", "",
              "| dataset | cache | what | config | io mode | GB/s | samples/s | CPU core-s/GB | stall | waiting "
              "| pinned |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(r) for r in rows if r.get("kind") != "startup"]
    startup = [r for r in rows if r.get("kind") == "startup"]
    if startup:
        lines += ["", "## Startup", "", "Seconds to open the dataset (`describe()['open_s']`) and to its first "
                  "batch (`stats.first_batch_s`), and from the constructor's call to the first batch in hand.", "",
                  "| dataset | cache | backend | io mode | open s | first batch s | total s |",
                  "|---|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['dataset']} | {r['regime']} | {r['backend']} | " + (
            f"{r['io_mode']} | {r['open_s']} | {r['first_batch_s']} | {r['seconds']} |" if "open_s" in r
            else f"failed: {r.get('error') or r.get('skipped')} | | | |") for r in startup]
    lines += ["", "## Summary (summary.json)", ""] + summary_table(summarize(doc))
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(doc)]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], png: str) -> None:
    """Bar charts of GB/s and CPU core-s/GB on the main dataset. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

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
    from .common import load_result

    return load_result(path, lambda doc: None if doc.get("schema") == SCHEMA
                       else f"not a suite result of schema {SCHEMA} (found {doc.get('schema')!r})")


def render(path: str, summary: bool = True) -> list[str]:
    """Write the markdown (and PNG, and ``summary.json`` beside it) of the suite JSON at ``path``; returns
    the files written. Without matplotlib the PNG is left out, and said so."""
    from .common import write_json, write_report

    doc = load(path)
    extra = [write_json(os.path.join(os.path.dirname(path), "summary.json"), summarize(doc))] if summary else []
    return write_report(path, markdown(doc), lambda png: plot(doc, png), "python -m benchmarks.report") + extra


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("wrote", ", ".join(render(p, summary=not os.path.basename(p).startswith("stall"))))
