"""The consumer's turn, split: host time of ``next()`` and of the training step (launch and sync) per batch,
beside the waiting share of each pass (wall time beyond the same steps alone), for one backend, shuffled,
a step of ``--factor`` times a batch's read time synced every step. A step longer on the host than alone
is one the GPU started late (it waits on the batch's "ready" event, or its launch came late).

    python -m benchmarks.diagnostics.probe_turn [--backend mmap] [--factor 1.5] [--passes 5] [--repeats 2]
        [--control] [--affinity]

Per pass, beside the waiting: the longest steps and ``next()`` calls (batch index, us), the loader's own
stall count, the garbage collector's runs, the CPU time of each thread of the process, the kernel's memory
stall counters (/proc/vmstat) and the CPU time the hypervisor reports stolen: what a pass that waited more
than its neighbours spent its time on. ``--control`` times, after each pass, as many steps alone the same
way (the machine's own drift, pass by pass). ``--affinity`` runs three placements of the process's threads
in turn each repeat: ``free`` (every thread on the whole affinity mask), ``split`` (the consumer's thread on
one core, every other thread on the rest, off that core's SMT siblings) and ``consumer`` (the consumer's
thread on one core, the others free); the CPU topology is written beside the rows. GPU only. Writes
``results/<machine>/probe-turn[-TAG].json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.steps import Spin

from ..common import (BATCH, GcRuns, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, step_ms,
                      timed, write_probe)


def longest(a: list[float], n: int = 4) -> list[tuple[int, float]]:
    """The ``n`` largest of ``a`` as (index, us), largest first."""
    return [(int(i), round(1e6 * a[i], 1)) for i in np.argsort(a)[::-1][:n]]


def steal_s() -> float:
    """Seconds of CPU time the hypervisor gave others, all CPUs, since boot (/proc/stat), 0 where not said."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


VMSTAT_KEYS = ("allocstall", "compact_stall", "pgscan_direct", "pgsteal_direct", "thp_fault_alloc",
               "numa_pages_migrated", "pgmigrate_success", "pgmajfault", "pswpin", "workingset_refault")


def vmstat() -> dict[str, int]:
    """The kernel's counters of memory stalls (direct reclaim, compaction, migration, faults), summed by
    prefix (``allocstall`` is split by zone), from /proc/vmstat."""
    out = dict.fromkeys(VMSTAT_KEYS, 0)
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                for key in VMSTAT_KEYS:
                    if name.startswith(key):
                        out[key] += int(value)
    except (OSError, ValueError):
        pass
    return out


def thread_cpu_ns(field: int = 0) -> dict[str, int]:
    """CPU time (ns) of each thread of this process so far (/proc schedstat), by Python thread name where it
    has one, else by its kernel name and id; ``field`` 1: the time each waited on a run queue instead."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[field])
            if tid not in names:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[tid] = f"{f.read().strip()}-{tid}"
        except (OSError, ValueError):
            continue
        out[names[tid]] = out.get(names[tid], 0) + ns
    return out


def turns(ds: GDSDataset | range, step: Spin, alone_s: float) -> dict[str, object]:
    """One pass of ``ds`` (a range: steps alone, the control): its waiting share, the host times (us) of
    next() and of the step, the longest of each (batch index, us), and what the process and the machine did
    meanwhile (see the module notes)."""
    nexts: list[float] = []
    steps: list[float] = []
    stolen, cpu, vm = steal_s(), thread_cpu_ns(), vmstat()
    with GcRuns() as collected:
        start = time.perf_counter()
        for _batch in timed(ds, nexts):
            t0 = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t0)
        step.finish()
        wall = time.perf_counter() - start
    us = lambda a, q: round(1e6 * float(np.percentile(a, q)), 1)  # noqa: E731
    stall = ds.stats.stall_s if isinstance(ds, GDSDataset) else 0.0
    vm = {k: v - vm[k] for k, v in vmstat().items() if v != vm[k]}
    cpu_ms = {k: round((v - cpu.get(k, 0)) / 1e6, 1) for k, v in thread_cpu_ns().items()}
    busy = sorted(((k, v) for k, v in cpu_ms.items() if v >= 0.5), key=lambda kv: -kv[1])
    return {"wait_fraction": round((wall - len(steps) * alone_s) / wall, 4),
            "next_p50_us": us(nexts, 50), "next_p90_us": us(nexts, 90),
            "next_mean_us": round(1e6 * statistics.mean(nexts), 1),
            "step_p50_us": us(steps, 50), "step_mean_us": round(1e6 * statistics.mean(steps), 1),
            "step_alone_us": round(1e6 * alone_s, 1),
            "longest_steps": longest(steps), "longest_nexts": longest(nexts),
            "stall_ms": round(1e3 * stall, 2), "steal_ms": round(1e3 * (steal_s() - stolen), 1),
            "thread_cpu_ms": dict(busy), "vmstat": vm,
            "gc_runs": [(g, round((b - a) / 1e3)) for g, a, b in collected.runs if g > 0 or b - a > 200_000],
            "gc_gen0_runs": sum(1 for g, _, _ in collected.runs if g == 0)}


def siblings(cpu: int) -> set[int]:
    """``cpu`` and the logical CPUs sharing its core (SMT), from sysfs; just ``cpu`` where sysfs says nothing."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out | {cpu}


def place(variant: str, full: set[int], core: int) -> None:
    """Set every thread of this process to ``variant``'s placement (see the module notes)."""
    me = threading.get_native_id()
    rest = full - siblings(core) or full
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        if tid == me:
            mask = full if variant == "free" else {core}
        else:
            mask = rest if variant == "split" else full
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # a thread that ended meanwhile
            pass


def topology(full: set[int]) -> dict[str, object]:
    """The CPUs this process may use, each one's SMT siblings, and how many threads it has now."""
    return {"cpus": sorted(full), "siblings": {c: sorted(siblings(c)) for c in sorted(full)},
            "threads": len(os.listdir("/proc/self/task"))}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=8.0)
    add_step_options(ap)
    ap.add_argument("--batches-ahead", type=int, default=None)
    ap.add_argument("--affinity", action="store_true", help="free / split / consumer thread placements in turn")
    ap.add_argument("--control", action="store_true", help="after each pass, as many steps alone, timed alike")
    args = parse_probe_args(ap, argv)
    full = os.sched_getaffinity(0)
    core = max(full)
    variants = ["free", "split", "consumer"] if args.affinity else ["free"]
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    rows = Rows()
    with GDSDataset(path, batch_size=BATCH, backend=args.backend, shuffle=True,
                    batches_ahead=args.batches_ahead) as ds:
        for _ in range(2):  # the pipeline's start, and mmap's background load, out of the way
            time_pass(ds)
        r = time_pass(ds, min_seconds=0.5)
        step = Spin(step_ms(r, args.factor), 1)
        for repeat in range(args.repeats):
            for variant in variants:
                place(variant, full, core)
                alone = step.alone(200) / 200  # again each repeat: launch latency drifts within a run
                for p in range(args.passes):
                    place(variant, full, core)  # threads started since (none expected) placed too
                    rows.emit({"repeat": repeat, "variant": variant, "pass": p, "backend": args.backend,
                               **turns(ds, step, alone)})
                    if args.control:  # as many steps alone, timed the same way
                        rows.emit({"repeat": repeat, "variant": variant + "-alone", "pass": p,
                                   "backend": args.backend, **turns(range(len(ds)), step, alone)})
        topo = topology(full)
        place("free", full, core)
    print("wrote", write_probe(args, "probe-turn", rows, topology=topo), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
