"""``gdsload bench PATH``: how fast each backend reads *your* dataset here, beside ceilings taken on the same files.

Rows, regimes, timing and ceilings: docs/benchmarks.md, "gdsload bench and the training examples". Beyond it:
a backend that failed once is not tried again; a cold ``mmap`` row is the open (which locks the dataset) plus
the pass; each ceiling's first read picks by its rate how many bytes fill ``seconds`` (:func:`sized`), passed
over for at least :data:`MIN_TIMED_S` except a cold KvikIO read. Exit 0 when it ran (failed rows included); 2,
with one line on stderr, for a path that is not a dataset or a ``--json`` file whose folder does not exist.
Every figure printed is measured in the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends import BACKENDS, info, resolve
from ..backends.registry import runnable
from ..system.env import gpu_available, kvikio_installed, memory_available, system_info
from ..errors import GDSLoadError, one_line
from ..remote.objects import is_remote
from .measure import (PassResult, best, block_locations, cold_pass, cpu_seconds, drop_page_cache, figures, num,
                      pinned_h2d_gbps, raw_kvikio_blocks, read_files, save_report, shard_paths, take_batches,
                      time_pass)

DEFAULT_SECONDS = 2.0
DEFAULT_BATCH = 256
PROBE_BYTES = 64 << 20  # a ceiling's first read: at least this much, to time a rate rather than a latency
#: A ceiling's timed stretch lasts at least this long (passes over the same bytes back to back: warm, or through
#: O_DIRECT, which the page cache does not serve), so a small dataset is timed at its rate, not at the cost
#: of starting the reads.
MIN_TIMED_S = 0.2
Row = dict[str, Any]
FIGURES = ("io_mode", "gbps", "samples_per_s", "cpu_s_per_gb")  # None in a row that says why it has no figures


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options (``gdsload bench --help``)."""
    p.add_argument("path", help="a gdsload dataset (or any Zarr v3 store gdsload reads)")
    p.add_argument("--backends", type=backend_list, default=None, metavar="LIST",
                   help="comma list of auto,kvikio,pinned,mmap,cpu (default: auto and every backend that can run "
                        "here); one that cannot run gives a row saying why")
    p.add_argument("--cold", action="store_true",
                   help="also cold rows: page cache dropped before each measurement (needs root), and the disk "
                        "read through O_DIRECT")
    p.add_argument("--seconds", type=positive_float, default=DEFAULT_SECONDS, metavar="N",
                   help=f"length of each measurement (default {DEFAULT_SECONDS:g}); the run takes about N times "
                        f"the number of rows, plus opening each backend and reading the dataset once")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help=f"samples per batch ({DEFAULT_BATCH})")
    p.add_argument("--json", metavar="FILE", help="also write the rows, settings and machine as JSON")


def backend_list(text: str) -> list[str]:
    """``--backends``: names from :data:`BACKENDS`, comma separated, each once, in the order given."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"not backends: {bad or text!r} (choose from {','.join(BACKENDS)})")
    return names


def positive_float(text: str) -> float:
    """``--seconds``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 (found {text!r})")
    return value


@dataclass
class Target:
    """The dataset under test: its shard files, their total size, its samples. ``files`` are the files the
    measured datasets read (they read every field), and the ones the file ceilings read."""

    path: str
    files: list[str]
    nbytes: int
    samples: int

    @classmethod
    def open(cls, path: str) -> Target:
        from ..format.meta import read_metadata

        meta = read_metadata(path)
        files = shard_paths(path)
        return cls(meta.path, files, sum(os.path.getsize(f) for f in files), meta.num_samples)


class Bounded:
    """A dataset whose passes end once ``seconds`` have passed since its first batch was asked for, so that
    ``time_pass`` over a large dataset lasts about ``seconds``. Everything else is the dataset's."""

    def __init__(self, ds: Any, seconds: float):
        self.ds, self.seconds = ds, seconds
        self.deadline: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ds, name)

    def __len__(self) -> int:
        return len(self.ds)

    def __iter__(self) -> Iterator[Any]:
        if self.deadline is None:
            self.deadline = time.perf_counter() + self.seconds
        it = iter(self.ds)
        try:
            for batch in it:
                yield batch
                if time.perf_counter() >= self.deadline:
                    return
        finally:
            it.close()  # a pass left early stops its readers now, inside the timing


@dataclass(frozen=True)
class Machine:
    """What a run's plan depends on (the plan itself is pure: :meth:`Bench.tasks`): a GPU, KvikIO, the
    memory available, whether the page cache can be dropped (root), ``auto``'s pick and why, and the backends
    that can run for the dataset. :meth:`here` probes this machine."""

    gpu: bool
    kvikio: bool
    memory: int
    can_drop: bool
    auto: tuple[str | None, str]
    runnable: tuple[str, ...]

    @classmethod
    def here(cls, target: Target) -> Machine:
        try:
            first = target.files[0] if target.files else None
            auto: tuple[str | None, str] = resolve("auto", target.nbytes, first)
        except ValueError as e:  # GDSLOAD_BACKEND names no backend
            auto = (None, str(e))
        return cls(gpu_available(), kvikio_installed(), memory_available(),
                   os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK), auto,
                   tuple(runnable(target.nbytes)))


@dataclass
class Task:
    """One step of the run: ``run()`` gives the figures of the row labelled ``where`` (None: no row)."""

    label: str
    run: Callable[[], PassResult | None]
    where: Row = field(default_factory=dict)


class Bench:
    """Plans and runs the measurements of one ``gdsload bench`` invocation; ``machine`` (default: this one,
    probed) is what the plan is made for."""

    def __init__(self, target: Target, requested: Sequence[str] | None, cold: bool, seconds: float,
                 batch_size: int, machine: Machine | None = None):
        self.target, self.cold, self.seconds, self.batch_size = target, cold, seconds, batch_size
        self.machine = machine = Machine.here(target) if machine is None else machine
        self.gpu, self.auto, self.can_drop = machine.gpu, machine.auto, machine.can_drop
        names = list(requested) if requested else ["auto", *machine.runnable]
        self.backends = list(dict.fromkeys(self.auto[0] if n == "auto" else n for n in names))
        self.fits = target.nbytes <= machine.memory

    # -- the plan --------------------------------------------------------------------------------------
    def tasks(self) -> list[Task]:
        warm = "warm" if self.fits else "uncached"
        gpu, kvikio = self.gpu, self.gpu and self.machine.kvikio
        plan: list[Task] = []
        if None in self.backends:
            plan.append(Task("auto", lambda: _raise(GDSLoadError(self.auto[1])),
                             {"backend": "auto", "regime": "-", "shuffle": None}))
        if gpu:
            plan.append(Task("pinned H2D copy", self.h2d, ceiling("pinned H2D copy", "-")))
        if self.fits:
            plan.append(Task("reading the dataset into the page cache", self.warm_cache))
            plan.append(Task("page cache", lambda: self.files(pinned=gpu),
                             ceiling(f"page cache -> {'pinned' if gpu else 'host'} memory", "warm")))
        if kvikio:
            plan.append(Task("raw KvikIO", self.raw_kvikio, ceiling("raw KvikIO, same blocks", warm, True)))
        plan += self.backend_tasks(warm)
        if not self.cold:
            return plan
        plan.append(Task("O_DIRECT disk read", lambda: self.files(direct=True), ceiling("O_DIRECT disk read", "cold")))
        if not self.can_drop:
            no_root = PermissionError("cannot drop the page cache (needs root): no cold rows")
            plan.append(Task("cold", lambda: _raise(no_root), {"backend": None, "regime": "cold", "shuffle": None}))
            return plan
        if kvikio:
            plan.append(Task("raw KvikIO cold", lambda: self.raw_kvikio(cold=True),
                             ceiling("raw KvikIO, same blocks", "cold", True)))
        return plan + self.backend_tasks("cold")

    def backend_tasks(self, regime: str) -> list[Task]:
        """Each backend in ``regime``, in order then shuffled."""
        return [Task(f"{b} {regime}{' shuffled' if shuffle else ''}", self.measure(b, shuffle, regime == "cold"),
                     {"backend": b, "auto": b == self.auto[0], "regime": regime, "shuffle": shuffle})
                for b in self.backends if b is not None for shuffle in (False, True)]

    def run(self) -> list[Row]:
        """Every task in order, under a progress bar; a failure becomes a row with the reason."""
        from tqdm import tqdm

        rows: list[Row] = []
        broken: dict[str, str] = {}
        plan = self.tasks()
        with tqdm(total=len(plan), desc="gdsload bench", unit="step", disable=None, file=sys.stderr) as bar:
            for task in plan:
                bar.set_postfix_str(task.label)
                backend = task.where.get("backend")
                if backend in broken:
                    bar.update()
                    continue
                try:
                    result = task.run()
                except Exception as e:  # a backend or ceiling that cannot run here is a row, not a crash
                    why = one_line(f"{type(e).__name__}: {e}")
                    rows.append({**task.where, **dict.fromkeys(FIGURES), "error": why})
                    if backend is not None:
                        broken[backend] = why
                else:
                    if result is not None:
                        rows.append({**task.where, **figures(result)})
                finally:
                    _free_device_memory()
                bar.update()
        return rows

    # -- measurements ----------------------------------------------------------------------------------
    def open(self, backend: str, shuffle: bool) -> Any:
        from ..dataset import GDSDataset

        return GDSDataset(self.target.path, batch_size=self.batch_size, backend=backend, shuffle=shuffle, seed=0)

    def measure(self, backend: str, shuffle: bool, cold: bool) -> Callable[[], PassResult]:
        def run() -> PassResult:
            if cold and info(backend).locks_dataset:
                return self.locked_cold(backend, shuffle)
            with self.open(backend, shuffle) as ds:
                # Buffers, streams and kernels are set up by a first pass: never inside a timed one, cold
                # or warm (cold_pass stops the dataset and drops the cache after this).
                take_batches(ds)
                if cold:
                    return cold_pass(Bounded(ds, self.seconds))
                return time_pass(Bounded(ds, self.seconds), min_seconds=self.seconds)

        return run

    def locked_cold(self, backend: str, shuffle: bool) -> PassResult:
        """A backend that locks the dataset in RAM (mmap) from a dropped cache: opening reads and locks the whole
        dataset, so the figure is open + pass."""
        if not drop_page_cache():
            raise PermissionError("cannot drop the page cache (needs root)")
        c0, t0 = cpu_seconds(), time.perf_counter()
        with self.open(backend, shuffle) as ds:
            opened = time.perf_counter() - t0
            r = time_pass(Bounded(ds, self.seconds))
        r.seconds += opened
        r.cpu_s = cpu_seconds() - c0
        return r

    def warm_cache(self) -> None:
        """Read every shard file once (no row): the warm regime's precondition."""
        read_files(self.target.files, pinned=self.gpu)

    def h2d(self) -> PassResult:
        nbytes = 256 << 20
        return PassResult(bytes=nbytes, seconds=nbytes / (pinned_h2d_gbps(nbytes) * 1e9), io_mode="cuda-memcpy")

    def files(self, direct: bool = False, pinned: bool = False) -> PassResult:
        """The files the dataset reads (``target.files``), read whole: all of them when the page cache's rate
        reads them in ``seconds``, else as many, in order (:func:`sized`)."""
        paths = self.target.files
        return sized(paths, [os.path.getsize(p) for p in paths], self.seconds,
                     lambda chosen: read_files(chosen, direct=direct, pinned=pinned, min_seconds=MIN_TIMED_S),
                     repeat=not direct)

    def raw_kvikio(self, cold: bool = False) -> PassResult:
        """One KvikIO read per block, of blocks picked at random (as a shuffled pass reads them), into a device
        buffer of at most half the free device memory."""
        import cupy

        blocks = block_locations(self.target.path)
        blocks = [blocks[i] for i in np.random.default_rng(0).permutation(len(blocks))]
        sizes = np.cumsum([b.nbytes for b in blocks])
        cap = cupy.cuda.runtime.memGetInfo()[0] // 2
        keep = max(1, int(np.searchsorted(sizes, cap, side="right")))
        blocks, sizes = blocks[:keep], sizes[:keep]
        dest = cupy.empty(int(sizes[-1]), dtype=cupy.uint8)
        if cold and not drop_page_cache():
            raise PermissionError("cannot drop the page cache (needs root)")
        return sized(blocks, [b.nbytes for b in blocks], self.seconds,
                     lambda chosen: raw_kvikio_blocks(chosen, dest, min_seconds=0.0 if cold else MIN_TIMED_S),
                     repeat=not cold)


def ceiling(name: str, regime: str, shuffle: bool | None = None) -> Row:
    return {"ceiling": name, "backend": None, "regime": regime, "shuffle": shuffle}


def sized(units: Sequence[Any], sizes: Sequence[int], seconds: float,
          measure: Callable[[Sequence[Any]], PassResult], repeat: bool = True) -> PassResult:
    """``measure`` the ``units`` (files or blocks of the dataset, in order, of ``sizes`` bytes) that a ceiling
    reads in about ``seconds``.

    A probe measures the first units (at least :data:`PROBE_BYTES`, or one unit). If units remain and one
    pass over the probe's units is less than a quarter of what its rate reads in ``seconds``, that rate
    picks the units measured: warm (``repeat``), counting from the first unit, so a dataset read whole in
    ``seconds`` is measured whole; cold, from the first unit the probe did not read, so a cold read stays
    cold, and the probe's figure stands where those hold fewer bytes than the probe's units. With ``repeat``
    the last measurement is repeated while the repeats fill less than ``seconds`` (at most 5), and the best
    is reported."""
    total = np.cumsum(sizes)
    first = min(len(units), max(1, int(np.searchsorted(total, PROBE_BYTES, side="left")) + 1))
    chosen, runs = units[:first], [measure(units[:first])]
    probe_bytes = int(total[first - 1]) if first else 0
    budget = runs[0].bytes / max(runs[0].seconds, 1e-9) * seconds
    if first < len(units) and probe_bytes < budget / 4:
        if repeat:
            chosen = units[:max(first, int(np.searchsorted(total, budget, side="right")))]
            runs = [measure(chosen)]
        else:
            rest_sizes = np.cumsum(sizes[first:])
            n = max(1, int(np.searchsorted(rest_sizes, budget, side="right")))
            if int(rest_sizes[n - 1]) >= probe_bytes:
                chosen = units[first:first + n]
                runs = [measure(chosen)]
    while repeat and len(runs) < 5 and sum(r.seconds for r in runs) < seconds:
        runs.append(measure(chosen))
    return best(runs)


def render(bench: Bench, rows: list[Row]) -> str:
    """The table printed on screen: a header, one line per row, reasons in the last column."""
    t = bench.target
    picked, why = bench.auto
    head = [f"{t.path}: {t.samples:,} samples, {t.nbytes / 1e9:.3f} GB in {len(t.files)} file(s); batch "
            f"{bench.batch_size}; each measurement about {bench.seconds:g} s",
            f"auto picks {picked}: {why}" if picked else f"auto: {why}"]
    if not bench.fits:
        head.append("the dataset does not fit in available memory: regime 'uncached' (not read beforehand)")
    table = [("what", "io mode", "regime", "shuffle", "GB/s", "samples/s", "CPU core-s/GB", "note")]
    for r in rows:
        what = f"ceiling: {r['ceiling']}" if r.get("ceiling") else (
            f"gdsload {r['backend']}" + (" (auto)" if r.get("auto") else "") if r.get("backend") else r["regime"])
        shuffle = "-" if r.get("shuffle") is None else "yes" if r["shuffle"] else "no"
        table.append((what, r.get("io_mode") or "-", r.get("regime") or "-", shuffle, num(r.get("gbps"), ".2f"),
                      num(r.get("samples_per_s"), ",.0f"), num(r.get("cpu_s_per_gb"), ".3f"), r.get("error", "")))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if 3 < i < 7 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             + ("  " + line[-1] if line[-1] else "") for line in table]
    return "\n".join(head + [""] + [ln.rstrip() for ln in lines])


def main(args: argparse.Namespace) -> int:
    """``gdsload bench``: 0 when it ran. A path that is not a dataset, a ``--json`` file whose folder does not
    exist or a bad option raises (GDSLoadError, OSError, ValueError) before anything is measured; the
    command line prints it as one line and exits 2 (:func:`gdsload.tools.cli.fail`)."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1 (found {args.batch_size})")
    if is_remote(args.path):  # s3:// or http(s)://: its route beside raw RemoteFile and the CPU client
        from .bench_remote import main as remote_main

        return remote_main(args, Bounded)
    target = Target.open(args.path)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise GDSLoadError(f"{args.json}: its folder does not exist")
    bench = Bench(target, args.backends, args.cold, args.seconds, args.batch_size)
    rows = bench.run()
    print(render(bench, rows), flush=True)
    if args.json:
        doc = {"command": "gdsload bench", "dataset": target.path, "samples": target.samples, "bytes": target.nbytes,
               "settings": {"backends": args.backends or "default", "cold": args.cold, "seconds": args.seconds,
                            "batch_size": args.batch_size},
               "auto": {"backend": bench.auto[0], "reason": bench.auto[1]}, "machine": system_info(), "rows": rows}
        save_report(args.json, doc)
    return 0


def _raise(e: BaseException) -> None:
    raise e


def _free_device_memory() -> None:
    """CuPy's cached device blocks back between measurements (nothing without CuPy loaded)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
