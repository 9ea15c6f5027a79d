"""Same-run A/B of two gdsload source trees (or, with ``--readers``, of the pinned backend's readers on one tree):
warm and cold GB/s and waiting beside a step, each figure a fresh process using the public API only, the arms
alternating (A B B A) so the machine's drift falls on all.

    python -m benchmarks.ab --trees BEFORE_DIR . --out DIR          # GPU machine; root for the cold rows
    python -m benchmarks.ab --readers native,threads --out DIR"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

BATCH = 256
SHAPE = (224, 224, 3)
STEPS = {"step 1.5x a batch's read": 1.5, "10 ms step": None}


# -- the worker: one measurement in a process of its own ------------------------------------------------
def _sync() -> None:
    if GPU:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


GPU = True  # the worker's backend is on the device (set by worker())


def _spin(ms: float) -> Any:
    """A kernel that keeps the consumer's stream busy for ``ms`` (a training step of known length)."""
    import cupy

    kernel = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    cycles = np.int64(ms * khz)
    return lambda: kernel((1,), (1,), (cycles,))


def _pass(ds: Any, step: Any = None) -> tuple[float, Any]:
    """One pass from rest: seconds, and the loader's stats (waiting is ``stall_s``)."""
    ds.stop()
    _sync()
    t0 = time.perf_counter()
    for _ in ds:
        if step is not None:
            step()
            _sync()  # the step's end, as a loop that reads its loss does
    _sync()
    return time.perf_counter() - t0, ds.stats


def worker(path: str, backend: str, mode: str, options: str = "{}") -> dict[str, Any]:
    """One measurement; ``options``: the backend's options as JSON (passed only when not empty)."""
    global GPU
    from gdsload import GDSDataset

    GPU = backend != "cpu"
    opts = {"backend_options": json.loads(options)} if json.loads(options) else {}

    if mode == "cold":
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
        t0 = time.perf_counter()
        with GDSDataset(path, BATCH, backend=backend, shuffle=True, **opts) as ds:
            nbytes = 0
            for b in ds:
                nbytes += sum(a.nbytes for a in b.values())
            _sync()
            return {"gbps": nbytes / (time.perf_counter() - t0) / 1e9, "io_mode": ds.io_mode}
    with GDSDataset(path, BATCH, backend=backend, shuffle=True, **opts) as ds:
        _pass(ds)  # warm-up: pages, pools, kernels
        runs = [_pass(ds) for _ in range(3)]
        rates = [s.bytes_delivered / t / 1e9 for t, s in runs]
        out: dict[str, Any] = {"gbps": max(rates), "io_mode": ds.io_mode}
        if mode == "warm":
            return out
        batch_s = min(t for t, _ in runs) / len(ds)
        ms = 10.0 if STEPS[mode] is None else STEPS[mode] * batch_s * 1e3
        step = _spin(ms) if GPU else (lambda: time.sleep(ms / 1e3))
        waits = []
        for _ in range(3):
            t, s = _pass(ds, step)
            waits.append(100 * s.stall_s / t)
        return {**out, "step_ms": ms, "waiting_pct": statistics.median(waits), "waits": waits}


# -- the orchestrator ------------------------------------------------------------------------------------
def make_data(tree: str, data: str, gib: float) -> str:
    path = os.path.join(data, f"ab-{gib:g}gib.gds")
    if not os.path.exists(path):
        code = ("import sys, numpy as np; from gdsload import write_dataset, ArraySource\n"
                f"n = int({gib} * 2**30) // {int(np.prod(SHAPE))}\n"
                f"x = np.frombuffer(np.random.default_rng(0).bytes(n * {int(np.prod(SHAPE))}), np.uint8)"
                f".reshape(n, *{SHAPE})\n"
                f"write_dataset({path!r}, {{'image': ArraySource('<images>', x), "
                "'label': ArraySource('<labels>', np.arange(n))}, progress=False)\n")
        subprocess.run([sys.executable, "-c", code], check=True, env=_env(tree), cwd="/")
    return path


def _env(tree: str) -> dict[str, str]:
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != os.getcwd()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*site, os.path.abspath(tree)])}


def measure(tree: str, path: str, backend: str, mode: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    # Run as a script from /: neither the working directory nor this file's folder holds a gdsload package.
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path, backend, mode,
                           json.dumps(options or {})],
                          capture_output=True, text=True, env=_env(tree), cwd="/")
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=4, metavar=("PATH", "BACKEND", "MODE", "OPTIONS"), help=argparse.SUPPRESS)
    ap.add_argument("--trees", nargs=2, metavar=("A", "B"), default=None, help="two source trees (A: before)")
    ap.add_argument("--readers", default=None, help="the pinned backend's readers to compare on one tree (the "
                    "second of --trees, else .), e.g. native,threads; replaces the two trees' arms")
    ap.add_argument("--backends", default="kvikio,pinned,mmap")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2, help="A-B then B-A pairs per row")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-steps", action="store_true", help="no rows of waiting beside a step")
    ap.add_argument("--data", default="/root/gdsload-bench")
    ap.add_argument("--out", required=False, default=".")
    args = ap.parse_args(argv)
    if args.worker:
        import gdsload

        print(json.dumps({**worker(*args.worker), "gdsload": os.path.dirname(gdsload.__file__)}))
        return 0
    # An arm: its tree, and the backend options it adds (a reader of pinned's, with --readers).
    arms: dict[str, tuple[str, dict[str, Any]]]
    if args.readers:
        tree = args.trees[1] if args.trees else "."
        arms = {r: (tree, {"reader": r}) for r in args.readers.split(",")}
        backends = ["pinned"]
    elif not args.trees:
        ap.error("--trees A B (or --readers) is required")
    else:
        arms = {"A": (args.trees[0], {}), "B": (args.trees[1], {})}
        backends = args.backends.split(",")
    os.makedirs(args.data, exist_ok=True)
    path = make_data(list(arms.values())[-1][0], args.data, args.gib)
    modes = ["warm", *(["cold"] if not args.no_cold else []), *([] if args.no_steps else STEPS)]
    rows = []
    for backend in backends:
        for mode in modes:
            if mode in STEPS and backend == "kvikio":
                continue  # waiting is judged on auto's backends here (pinned, mmap)
            got: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
            for r in range(args.rounds):
                for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    got[a].append(measure(arms[a][0], path, backend, mode, arms[a][1]))
            rows.append({"backend": backend, "mode": mode, **got})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"trees": args.trees or [arms[next(iter(arms))][0]], "arms": list(arms),
           "labels": [f"`{t}`" + (f" reader={o['reader']}" if o else "") for t, o in arms.values()],
           "gib": args.gib, "batch": BATCH, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "ab.md"), "w") as f:
        f.write(table(doc))
    plot(doc, os.path.join(args.out, "ab.png"))
    print(table(doc))
    return 0


def plot(doc: dict[str, Any], png: str) -> None:
    """Bars of A's and B's median per row (GB/s rows and waiting rows side by side)."""
    from .common import pyplot, save_figure

    try:
        plt = pyplot()
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    arms, width = _arms(doc), 0.8 / len(_arms(doc))
    for ax, waiting in zip(axes, (False, True)):
        rows = [r for r in doc["rows"] if (r["mode"] in STEPS) == waiting]
        key = "waiting_pct" if waiting else "gbps"
        labels = [f"{r['backend']}\n{r['mode']}" for r in rows]
        for i, (side, label) in enumerate(arms.items()):
            vals = [statistics.median([x[key] for x in r[side] if key in x] or [0]) for r in rows]
            ax.bar(np.arange(len(rows)) + (i - (len(arms) - 1) / 2) * width, vals, width, label=f"{side}: {label}")
        ax.set_xticks(np.arange(len(rows)), labels, fontsize=7)
        ax.set_ylabel("waiting % (median of 3)" if waiting else "GB/s (best of 3)")
        ax.legend(fontsize=7)
    save_figure(fig, png)


def _figure(runs: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in runs if key in r]
    return " / ".join(f"{v:.2f}" for v in vals) if vals else "error: " + "; ".join(r.get("error", "") for r in runs)


def _arms(doc: dict[str, Any]) -> dict[str, str]:
    """Each arm's column name and what it ran (a doc written before ``arms`` has the two trees A and B)."""
    names = doc.get("arms", ["A", "B"])
    return dict(zip(names, doc.get("labels", [f"`{t}`" for t in doc["trees"]])))


def table(doc: dict[str, Any]) -> str:
    """Markdown: each row's figures for every arm (every run, in order), and each later arm's median against
    the first's (B / A)."""
    arms = _arms(doc)
    first, rest = next(iter(arms)), list(arms)[1:]
    lines = [", ".join(f"{a}: {label}" for a, label in arms.items())
             + f"; {doc['gib']:g} GiB, batch {doc['batch']}, shuffled", "",
             "| backend | io mode | row | figure | " + " | ".join([*arms, *(f"{a} / {first}" for a in rest)]) + " |",
             "|---|---|---|---|" + "---|" * len(arms) + "---:|" * len(rest)]
    for row in doc["rows"]:
        key = "waiting_pct" if row["mode"] in STEPS else "gbps"
        med = {a: statistics.median(v) if (v := [r[key] for r in row[a] if key in r]) else None for a in arms}
        ratios = [f"{med[a] / med[first]:.3f}" if med[a] is not None and med[first] else "–" for a in rest]
        io = next((r["io_mode"] for a in arms for r in row[a] if "io_mode" in r), "?")
        what = "waiting %" if key == "waiting_pct" else "GB/s"
        lines.append(f"| {row['backend']} | {io} | {row['mode']} | {what} | "
                     + " | ".join([*(_figure(row[a], key) for a in arms), *ratios]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
