"""What the benchmarks share and the library does not: synthetic datasets, the machine's description, fresh
processes, and writing results (JSON first, then markdown and plots rendered from it)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import textwrap
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


def results_dir(out: str, info: dict[str, Any]) -> str:
    """``out/<machine>``, created: the GPU's name without "NVIDIA ", spaces as dashes (``H100-80GB-HBM3``);
    ``cpu-only`` without a GPU."""
    gpu = info.get("gpu")
    path = os.path.join(out, gpu.replace("NVIDIA ", "").strip().replace(" ", "-") if gpu else "cpu-only")
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


def add_options(ap: argparse.ArgumentParser, **options: Any) -> argparse.ArgumentParser:
    """``--name`` (``_`` as ``-``) per keyword: its default, or (default, help[, type]); the type is the default's
    (False: a switch; None: a string) unless given."""
    for name, spec in options.items():
        default, text, kind = (*spec, None)[:3] if isinstance(spec, tuple) else (spec, None, None)
        kind = kind or type("" if default is None else default)
        how = {"action": "store_true"} if default is False else {"type": kind}
        ap.add_argument("--" + name.replace("_", "-"), default=default, help=text, **how)
    return ap


def probe_args(description: str, argv: list[str] | None, size_gib: float = 4.0, **options: Any) -> argparse.Namespace:
    """The options every probe takes (dataset, output, a tag for the file name, Python's thread switch interval,
    applied here) and ``options`` (:func:`add_options`), parsed from ``argv``."""
    ap = add_options(argparse.ArgumentParser(description=description), data=DATA_DIR, size_gib=size_gib,
                     out=RESULTS_DIR, tag=("", "added to the result file's name"),
                     switch_interval=(None, "sys.setswitchinterval for this run (s)", float), **options)
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


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (Agg); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, png: str, dpi: int = 100) -> None:
    """Lay ``fig`` out, write it to ``png`` and free it (pyplot keeps every open figure otherwise)."""
    plt = pyplot()
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


#: Line styles of :func:`gbps_plot`'s ceilings, in turn (a colour each from matplotlib's cycle after the bars').
CEILING_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def line_label(what: str, io_mode: str | None) -> str:
    """A ceiling's name on the plot: its row's name without ``ceiling: ``, with its io mode where it has one."""
    return what.removeprefix("ceiling: ") + (f" ({io_mode})" if io_mode else "")


def gbps_plot(json_path: str, title: str, groups: dict[str, dict[str, float | None]],
              ceilings: dict[str, float | None]) -> str | None:
    """The PNG beside a probe's JSON (:func:`write_probe_table`): bars per group (a series one colour
    throughout), ceilings as lines, None named as not run; its path, or None without matplotlib (said so)."""
    out = os.path.splitext(json_path)[0] + ".png"
    try:
        plt = pyplot()
    except ImportError as e:
        print(f"no plot ({e}): install matplotlib (pip install 'gdsload[bench]') and run again for {out}", flush=True)
        return None
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) * max(1, len(series)) + 2), 5.0))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, values in enumerate(groups.values())
              if values.get(name) is not None]
        ys = [values[name] for values in groups.values() if values.get(name) is not None]
        bars = ax.bar(xs, ys, width, label=name, color=colours[i % len(colours)])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for j, (name, value) in enumerate(ceilings.items()):
        style = CEILING_STYLES[j % len(CEILING_STYLES)]
        colour = colours[(len(series) + j) % len(colours)]
        if value is None:
            ax.plot([], [], linestyle=style, color=colour, label=f"{name}: not run")
        else:
            ax.axhline(value, linestyle=style, color=colour, label=f"{name}: {value:.2f}")
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, 22) for g in groups], fontsize=8)
    ax.set_ylabel("GB/s (GB = 1e9 bytes)")
    ax.set_title(title, fontsize=10)
    drawn = [v for values in groups.values() for v in values.values() if v is not None]
    drawn += [v for v in ceilings.values() if v is not None]
    ax.set_ylim(0, 1.5 * max(drawn) if drawn else 1.0)  # head room: the legend above the bars and lines
    ax.legend(fontsize=7, loc="upper left", ncol=2 if len(series) + len(ceilings) > 3 else 1)
    save_figure(fig, out)
    print("wrote", out, flush=True)
    return out
