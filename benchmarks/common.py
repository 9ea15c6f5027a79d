"""What the benchmarks share and the library does not: synthetic datasets, the machine's description, fresh
processes, and writing results (JSON first, then markdown and plots rendered from it)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from gdsload.system.env import system_info

#: Samples of the synthetic image dataset: 224x224x3 uint8 (JPEG-decoded ImageNet size) and an int64 label.
IMAGE_SHAPE = (224, 224, 3)
SAMPLE_BYTES = int(np.prod(IMAGE_SHAPE))
BATCH = 256
DATA_DIR = "/root/gdsload-bench"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Generated:
    """A gdsload source whose rows ``read(start, stop)`` makes on demand: synthetic data, never held whole."""

    def __init__(self, origin: str, dtype: Any, shape: tuple[int, ...], read: Callable[[int, int], np.ndarray]):
        self.origin, self.dtype, self.shape, self.read = origin, np.dtype(dtype), shape, read

    def close(self) -> None:
        pass


def random_images(n: int) -> Generated:
    """``n`` noise images (incompressible, like decoded data), generated slice by slice."""
    rng = np.random.default_rng(0)
    return Generated("<random>", np.uint8, (n, *IMAGE_SHAPE),
                     lambda a, b: rng.integers(0, 256, (b - a, *IMAGE_SHAPE), dtype=np.uint8))


def labels(n: int) -> Generated:
    """Label i = i: a reader's output can be checked against the sample ids it claims."""
    return Generated("<labels>", np.int64, (n,), lambda a, b: np.arange(a, b, dtype=np.int64))


def dataset_tag(size_gib: float, block_bytes: int) -> str:
    """``1GiB-4MiB``: the name results give a synthetic dataset (size, block size)."""
    block = f"{block_bytes >> 20}MiB" if block_bytes >= 1 << 20 else f"{block_bytes >> 10}KiB"
    return f"{size_gib:g}GiB-{block}"


def make_dataset(data_dir: str, size_gib: float, block_bytes: int = 4 << 20) -> str:
    """The synthetic image dataset of ``size_gib`` GiB in blocks of about ``block_bytes``, written under
    ``data_dir`` unless already there; returns its path. Synced to disk: no writeback runs under a timing."""
    from gdsload import write_dataset

    path = os.path.join(data_dir, dataset_tag(size_gib, block_bytes) + ".gds")
    if os.path.exists(path):
        return path
    os.makedirs(data_dir, exist_ok=True)
    n = max(1, int(size_gib * 2**30 // SAMPLE_BYTES))
    t0 = time.perf_counter()
    write_dataset(path, {"image": random_images(n), "label": labels(n)}, block_bytes=block_bytes, progress=False)
    os.sync()
    print(f"wrote {path}: {n} samples in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def describe_machine(data_dir: str | None = None) -> dict[str, Any]:
    """:func:`gdsload.system.env.system_info` plus the file system holding ``data_dir`` (``df -h``)."""
    info = system_info()
    if data_dir is not None:
        df = subprocess.run(["df", "-h", data_dir], capture_output=True, text=True).stdout.strip().splitlines()
        info["data_filesystem"] = " ".join(df[-1].split()) if df else None
    return info


def machine_name(info: dict[str, Any]) -> str:
    """The results folder of a machine: its GPU's name without "NVIDIA ", spaces as dashes
    (``H100-80GB-HBM3``); ``cpu-only`` without a GPU."""
    gpu = info.get("gpu")
    return gpu.replace("NVIDIA ", "").strip().replace(" ", "-") if gpu else "cpu-only"


def results_dir(out: str, info: dict[str, Any]) -> str:
    """``out/<machine>``, created."""
    path = os.path.join(out, machine_name(info))
    os.makedirs(path, exist_ok=True)
    return path


def write_json(path: str, doc: Any) -> str:
    """Write ``doc`` as indented JSON, replacing ``path`` whole (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_result(path: str, refusal: Callable[[Any], str | None]) -> dict[str, Any]:
    """The result JSON at ``path``; a ValueError naming ``path`` when ``refusal(doc)`` says why it is not one."""
    with open(path) as f:
        doc = json.load(f)
    why = refusal(doc)
    if why:
        raise ValueError(f"{path}: {why}")
    return doc


def run_fresh(code: str, what: str) -> Any:
    """Run ``code`` in a new interpreter and return its last line of output, as JSON; a RuntimeError naming
    ``what`` and ending with the process's last lines of stderr when it fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"{what}: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(what: str, module: str, function: str, *args: Any) -> Any:
    """``module.function(*args)`` in a new interpreter that has opened and read nothing before, as a training
    script starts (:func:`run_fresh`; ``args`` as their ``repr``); its JSON result."""
    code = (f"import json, sys\nsys.path.insert(0, {ROOT!r})\nfrom {module} import {function}\n"
            f"print(json.dumps({function}(*{args!r})))\n")
    return run_fresh(code, what)


class Rows(list):
    """Result rows, each printed as a JSON line as it is added (a run cut short still shows its figures)."""

    def emit(self, row: dict[str, Any]) -> dict[str, Any]:
        self.append(row)
        print(json.dumps(row), flush=True)
        return row


def free_device_memory() -> None:
    """Give CuPy's cached device blocks back between contenders (nothing without CuPy)."""
    try:
        import cupy
    except ImportError:
        return
    cupy.get_default_memory_pool().free_all_blocks()


def open_and_pass(path: str, batch_size: int, **options: Any) -> Any:
    """A fresh ``GDSDataset(path, batch_size, **options)``'s open and first pass from rest, as one
    :class:`~gdsload.tools.measure.PassResult` (the open added to its seconds, first batch and stall)."""
    from gdsload import GDSDataset
    from gdsload.tools.measure import time_pass

    t0 = time.perf_counter()
    with GDSDataset(path, batch_size=batch_size, **options) as ds:
        opened = time.perf_counter() - t0
        r = time_pass(ds)
    r.seconds += opened
    r.first_batch_s = (r.first_batch_s or 0.0) + opened
    r.stall_s = (r.stall_s or 0.0) + opened
    return r


def device_used_bytes(gpu: bool) -> int | None:
    """Bytes in use on the current GPU, every allocator's: total less free (None without a GPU). Taken around a
    measurement, it shows whether memory stays bounded."""
    if not gpu:
        return None
    import cupy

    cupy.cuda.Device().synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def probe_parser(description: str, size_gib: float = 4.0) -> argparse.ArgumentParser:
    """The options every probe takes: dataset, output, a tag for the file name, and Python's thread switch
    interval (:func:`parse_probe_args` applies it)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data", default=DATA_DIR)
    ap.add_argument("--size-gib", type=float, default=size_gib)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tag", default="", help="added to the result file's name")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for this run (s)")
    return ap


def parse_probe_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    return args


def write_probe_table(args: argparse.Namespace, name: str, rows: list[dict[str, Any]], table: str,
                      **extra: Any) -> str:
    """A probe's rows with the machine described, as ``OUT/<machine>/<name>[-<tag>].json``, and ``table`` (the
    rows as markdown) beside it as ``.md``, printed."""
    info = describe_machine(args.data)
    out = os.path.join(results_dir(args.out, info), name + (f"-{args.tag}" if args.tag else "") + ".json")
    write_json(out, {"benchmark": name, "date": today(), "machine": info, **extra, "results": rows})
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    print("wrote", out, flush=True)
    print(table, flush=True)
    return out


def save_figure(fig: Any, png: str, dpi: int = 100) -> None:
    """Lay ``fig`` out, write it to ``png`` and free it (pyplot keeps every open figure otherwise)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


def write_report(json_path: str, text: str, plot: Callable[[str], None], command: str) -> list[str]:
    """``text`` as ``<json_path without .json>.md`` and ``plot(png_path)`` beside it; the files written. Without
    matplotlib the PNG is left out, and ``command`` named to make it."""
    base = os.path.splitext(json_path)[0]
    with open(base + ".md", "w") as f:
        f.write(text)
    written = [base + ".md"]
    try:
        plot(base + ".png")
        written.append(base + ".png")
    except ImportError as e:
        print(f"no plot ({e}): run '{command} {json_path}' where matplotlib is installed")
    return written
