"""How well the windowed shuffle mixes a dataset stored sorted by class, per window size, against a full
permutation: pure computation on the read plan (docs/shuffling.md).

    python -m benchmarks.shuffle_quality
    python benchmarks/shuffle_quality.py --samples 20000 --classes 100 --out /tmp/shuffle   # as a file too"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from gdsload.tools.cli import HelpFormatter
from gdsload.pipeline.plan import PlanConfig, epoch_plan

if not __package__:  # run as a file: its package (benchmarks) from the checkout it lies in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from .common import RESULTS_DIR, pyplot, save_figure, write_json  # noqa: E402


def metrics(order: np.ndarray, k: int, batch: int, classes: int, n: int) -> dict[str, float]:
    """The four mixing metrics of one epoch's sample order (module docstring)."""
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(len(order))
    rho = float(np.corrcoef(np.arange(n), pos)[0, 1])  # both are ranks: Pearson on ranks = Spearman
    label = order * classes // n  # sorted by class: equal-size class runs
    nb = len(order) // batch
    b = order[: nb * batch].reshape(nb, batch)
    lab = label[: nb * batch].reshape(nb, batch)
    blocks = b // k
    same_block = same_pairs = 0
    distinct, entropy = [], []
    for row_blocks, row_lab in zip(blocks, lab):
        _, c = np.unique(row_blocks, return_counts=True)
        same_block += int((c * (c - 1) // 2).sum())
        vals, cl = np.unique(row_lab, return_counts=True)
        distinct.append(len(vals))
        p = cl / batch
        entropy.append(float(-(p * np.log(p)).sum()))
    same_pairs = nb * batch * (batch - 1) // 2
    ideal_entropy = np.log(min(classes, batch))
    return {"rank_correlation": round(abs(rho), 4), "same_block_pairs": round(same_block / same_pairs, 5),
            "classes_per_batch": round(float(np.mean(distinct)), 2),
            "class_entropy_fraction": round(float(np.mean(entropy)) / ideal_entropy, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000, help="samples of the modelled dataset")
    ap.add_argument("--samples-per-block", type=int, default=64, help="samples per block (K)")
    ap.add_argument("--batch-size", type=int, default=256, help="samples per batch")
    ap.add_argument("--classes", type=int, default=1000, help="classes, stored sorted (equal runs)")
    ap.add_argument("--windows", default="1,4,16,64,256,1024", help="window sizes in blocks (comma list)")
    ap.add_argument("--out", default=RESULTS_DIR, help="folder for shuffle-quality.json, .md and .png")
    args = ap.parse_args(argv)
    n, k, bs = args.samples, args.samples_per_block, args.batch_size
    blocks = -(-n // k)
    rows = []
    for w in (int(w) for w in args.windows.split(",")):
        cfg = PlanConfig(num_samples=n, samples_per_block=k, batch_size=bs, window_blocks=w, shuffle=True, seed=0)
        order = epoch_plan(cfg, 0).sample_ids()
        rows.append({"window_blocks": w, "window_samples": w * k, **metrics(order, k, bs, args.classes, n)})
    full = np.random.default_rng(0).permutation(n)
    rows.append({"window_blocks": "full permutation", "window_samples": n, **metrics(full, k, bs, args.classes, n)})
    seq = np.arange(n)
    rows.append({"window_blocks": "no shuffle", "window_samples": 0, **metrics(seq, k, bs, args.classes, n)})
    for r in rows:
        print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "shuffle-quality")
    doc = {"samples": n, "samples_per_block": k, "blocks": blocks, "batch_size": bs, "classes": args.classes,
           "data_order": "sorted by class", "results": rows}
    write_json(base + ".json", doc)
    lines = [f"# Windowed shuffle quality ({n} samples sorted by class, {args.classes} classes, K={k}, "
             f"batch {bs})", "",
             "| window (blocks) | window (samples) | rank corr. | same-block pairs | classes/batch | class entropy |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['window_blocks']} | {r['window_samples']} | {r['rank_correlation']} | "
                     f"{r['same_block_pairs']} | {r['classes_per_batch']} | {r['class_entropy_fraction']} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot(rows, k, base + ".png")
    except ImportError as e:
        print(f"no plot ({e})")
    print(f"wrote {base}.json, .md (.png with matplotlib)")
    return 0


def plot(rows: list[dict], k: int, png: str) -> None:
    plt = pyplot()
    ws = [r for r in rows if isinstance(r["window_blocks"], int)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.semilogx([r["window_blocks"] for r in ws], [r["class_entropy_fraction"] for r in ws], "o-",
                label="class entropy per batch (fraction of ideal)")
    ax.semilogx([r["window_blocks"] for r in ws], [r["same_block_pairs"] * 10 for r in ws], "s-",
                label="same-block pairs x10")
    full_row = next(r for r in rows if r["window_blocks"] == "full permutation")
    ax.axhline(full_row["class_entropy_fraction"], color="grey", ls="--", label="full permutation (entropy)")
    ax.set_xlabel(f"window_blocks (K={k} samples per block)")
    ax.set_title("Mixing of the windowed shuffle, data sorted by class")
    ax.legend(fontsize=8)
    save_figure(fig, png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
