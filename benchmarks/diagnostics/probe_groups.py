"""What gathering batches in groups buys: warm GB/s of small and large samples, and a training step's waiting,
with batches gathered one by one (``--groups 1``) and in groups of up to N bytes (``gdsload.assembler.GROUP_BYTES``).

    python -m benchmarks.diagnostics.probe_groups [--groups 1,8388608] [--backends kvikio,pinned,mmap]

Datasets (written under the benchmark data folder unless there): float16 rows of 1,024 values (2 KiB samples,
raw and zstd), 3 x 64 x 64 uint8 images, and the suite's 1 GiB of 224 x 224 x 3 images. Warm throughput is the
best of ``--repeats`` stretches of ``--seconds``; waiting is the suite's step row (a GPU step 1.5x a batch's
read time, sync after every step), every repeat kept. Writes ``results/<machine>/probe-groups[-TAG].json``.
GPU only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from gdsload import GDSDataset, assembler, write_dataset
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import BATCH, make_dataset, parse_probe_args, probe_parser, step_ms, write_probe


def small_datasets(data_dir: str) -> dict[str, str]:
    rng = np.random.default_rng(0)
    out = {}
    t = np.linspace(0, 8 * np.pi, 1024, dtype=np.float32)
    n = 256 << 10  # 512 MiB of float16
    f16 = (np.sin(t[None, :] * rng.uniform(0.5, 2, (n, 1))) + rng.normal(0, 0.01, (n, 1024))).astype(np.float16)
    images = rng.integers(0, 256, (20000, 3, 64, 64), dtype=np.uint8)
    for tag, fields, opts in (("f16-raw", {"float16": f16}, {}), ("f16-zstd", {"float16": f16}, {"compress": "zstd:3"}),
                              ("img64", {"images": images}, {})):
        path = os.path.join(data_dir, f"probe-groups-{tag}.gds")
        if not os.path.exists(path):
            labels = np.arange(len(next(iter(fields.values()))), dtype=np.int64)
            write_dataset(path, {**fields, "label": labels}, progress=False, **opts)
        out[tag] = path
    os.sync()
    return out


def warm(path: str, backend: str, seconds: float, repeats: int) -> float:
    with GDSDataset(path, batch_size=BATCH, backend=backend, shuffle=True) as ds:
        time_pass(ds, min_seconds=0.2)
        return max(time_pass(ds, min_seconds=seconds).gb_per_s for _ in range(repeats))


def waiting(path: str, backend: str, repeats: int, ahead: int | None) -> dict[str, Any]:
    with GDSDataset(path, batch_size=BATCH, backend=backend, shuffle=True, batches_ahead=ahead) as ds:
        time_pass(ds)
        r = time_pass(ds, min_seconds=0.5)
        ms = step_ms(r, 1.5)
        step = Spin(ms, 1)
        time_pass(ds, step)
        runs = [time_pass(ds, step, min_seconds=0.5) for _ in range(repeats)]
        fracs = sorted(x.wait_s / x.seconds for x in runs)
        return {"batches_ahead": ds.batches_ahead, "step_ms": round(ms, 3),
                "wait_fraction_runs": [round(f, 4) for f in fracs], "median": round(fracs[len(fracs) // 2], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, size_gib=1.0)
    ap.add_argument("--groups", default=f"1,{assembler.GROUP_BYTES}")
    ap.add_argument("--backends", default="kvikio,pinned,mmap")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ahead", type=lambda s: [None if x == "default" else int(x) for x in s.split(",")],
                    default=[None], help="batches_ahead values for the step rows (default: the backend's)")
    args = parse_probe_args(ap, argv)
    data_dir = args.data
    paths = small_datasets(data_dir)
    paths["img224"] = make_dataset(data_dir, args.size_gib)
    for p in paths.values():
        read_files(shard_paths(p))
    rows = []
    for g in [int(x) for x in args.groups.split(",")]:
        assembler.GROUP_BYTES = g
        for tag, path in paths.items():
            for backend in args.backends.split(","):
                row: dict[str, Any] = {"group_bytes": g, "dataset": tag, "backend": backend,
                                       "warm_gbps": round(warm(path, backend, args.seconds, args.repeats), 2)}
                if tag == "img224":
                    row["steps"] = [waiting(path, backend, args.repeats, a) for a in args.ahead]
                print(row, flush=True)
                rows.append(row)
    write_probe(args, "probe-groups", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
