"""Which NUMA node a GPU sits on, and whether this process may run on that node's CPUs.

It only finds the facts, from system files read through a :class:`~gdsload.system.sysfiles.SystemFiles` (tests
use recorded trees); it places nothing (:mod:`gdsload.system.placement` does). Formats:
``/proc/driver/nvidia/gpus/<bus id>/information`` (the driver's ``Bus Location:`` and ``GPU UUID:``),
``/sys/bus/pci/devices/<bus id>/numa_node`` (``-1``: none given; sysfs-bus-pci), node ``cpulist`` and
``Cpus_allowed_list:`` (the kernel's CPU list format; cputopology.rst, proc(5)).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .sysfiles import SystemFiles

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
NODES = "/sys/devices/system/node"


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list (``0-3,8,10-11``; empty text: none). ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ValueError(f"not a CPU list (expected e.g. 0-55,112-167, found {text.strip()[:80]!r})")
        cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    return frozenset(cpus)


def format_cpulist(cpus: frozenset[int] | set[int]) -> str:
    """The kernel's CPU-list form of ``cpus``: ascending ranges, ``0-55,112-167``; "" for none."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI bus id as /sys names it: lower case, a 4-digit domain (CUDA and nvidia-smi print
    ``00000000:C1:00.0``)."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:  # no domain given: "c1:00.0"
        parts = ["0000"] + parts
    if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{1,8}", parts[0]):
        return bus_id.strip().lower()
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def gpu_bus_ids(files: SystemFiles) -> list[str]:
    """The PCI bus ids of the NVIDIA driver's GPUs, in nvidia-smi's order; [] without the driver's files."""
    return sorted(normalize_bus_id(d) for d in files.listdir(NVIDIA_GPUS))


def visible_gpu(files: SystemFiles, bus_ids: list[str]) -> str | None:
    """The bus id of CUDA device 0 of this process, from the first entry of ``CUDA_VISIBLE_DEVICES`` (an
    index in PCI order, or a ``GPU-`` UUID matched against the driver's information files); without it,
    the first GPU. None when it names no GPU listed."""
    first = (files.getenv("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    if not first:
        return bus_ids[0] if bus_ids else None
    if first.isdigit():
        return bus_ids[int(first)] if int(first) < len(bus_ids) else None
    for b in bus_ids:
        m = re.search(r"GPU UUID:\s*(\S+)", files.read(f"{NVIDIA_GPUS}/{b}/information") or "")
        if m and m.group(1).startswith(first):
            return b
    return None


def allowed_cpus(files: SystemFiles) -> frozenset[int] | None:
    """The CPUs this process may run on (``Cpus_allowed_list`` of /proc/self/status, which is its
    affinity, ``os.sched_getaffinity(0)``); None when the file or line is missing or malformed."""
    m = re.search(r"^Cpus_allowed_list:\s*(\S*)", files.read("/proc/self/status") or "", re.M)
    try:
        return parse_cpulist(m.group(1)) if m else None
    except ValueError:
        return None


def node_ids(files: SystemFiles) -> list[int]:
    """The host's NUMA nodes (``node<N>`` directories); [] when /sys does not say."""
    return sorted(int(d[4:]) for d in files.listdir(NODES) if re.fullmatch(r"node\d+", d))


def node_cpus(files: SystemFiles, node: int) -> frozenset[int] | None:
    """The CPUs of NUMA node ``node``; None when its cpulist is missing or malformed."""
    text = files.read(f"{NODES}/node{node}/cpulist")
    try:
        return None if text is None else parse_cpulist(text)
    except ValueError:
        return None


def pci_node(files: SystemFiles, bus_id: str) -> int | None:
    """The NUMA node of a PCI device: -1 when the kernel has none for it, None when the file is missing
    or malformed."""
    text = (files.read(f"/sys/bus/pci/devices/{normalize_bus_id(bus_id)}/numa_node") or "").strip()
    return int(text) if re.fullmatch(r"-?\d+", text) else None


class GpuNuma(NamedTuple):
    """Where a GPU sits and where this process may run. ``node`` None: unknown or nothing to place (then
    ``why`` says which); ``usable``: the node's CPUs this process may use; ``outside``: the CPUs it may use
    off the node."""

    bus_id: str
    nodes: int  # NUMA nodes of the host; 0 when /sys does not say
    node: int | None
    node_cpus: frozenset[int]
    allowed: frozenset[int]
    usable: frozenset[int]
    outside: frozenset[int]
    why: str = ""

    @property
    def placed(self) -> bool | None:
        """True: the process may run on the node's CPUs and either only there or on all of them (no
        pinning yet); False, a mismatch: none of the node's CPUs, or some of them and CPUs of another node;
        None: unknown or one node."""
        if self.node is None:
            return None
        if not self.usable:
            return False
        return not self.outside or self.usable == self.node_cpus


def gpu_numa(files: SystemFiles, bus_id: str, allowed: frozenset[int] | set[int]) -> GpuNuma:
    """The NUMA facts of the GPU at ``bus_id`` for a process allowed to run on ``allowed`` CPUs. Missing
    files give an unknown (``node`` None, ``why`` naming the file), never an error."""
    bus_id, allowed = normalize_bus_id(bus_id), frozenset(allowed)
    nodes = node_ids(files)
    empty: frozenset[int] = frozenset()

    def unknown(why: str) -> GpuNuma:
        return GpuNuma(bus_id, len(nodes), None, empty, allowed, empty, empty, why)

    if len(nodes) == 1:
        return unknown("one NUMA node: nothing to place")
    node = pci_node(files, bus_id)
    if node is None:
        return unknown(f"/sys/bus/pci/devices/{bus_id}/numa_node missing: NUMA node unknown")
    if node < 0:
        return unknown("no NUMA node for the device (numa_node -1): one node, nothing to place")
    cpus = node_cpus(files, node)
    if cpus is None:
        return unknown(f"{NODES}/node{node}/cpulist missing: the node's CPUs unknown")
    return GpuNuma(bus_id, len(nodes), node, cpus, allowed, cpus & allowed, allowed - cpus)


def gpus_by_node(files: SystemFiles, bus_ids: list[str]) -> dict[int, list[int]]:
    """GPU indices (nvidia-smi's order) by NUMA node, for the GPUs whose node is known (>= 0)."""
    out: dict[int, list[int]] = {}
    for i, b in enumerate(bus_ids):
        node = pci_node(files, b)
        if node is not None and node >= 0:
            out.setdefault(node, []).append(i)
    return out


def _indices(ids: list[int]) -> str:
    return format_cpulist(set(ids))  # the same range form: "0-3"


def numa_report(files: SystemFiles, gpu_bus_id: str | None = None) -> tuple[bool | None, str, str]:
    """The doctor's NUMA line for this process's GPU (``gpu_bus_id``, else :func:`visible_gpu`): ok (True
    ✔, False ✘ a mismatch, None –), what was found, the fix."""
    bus_ids = gpu_bus_ids(files)
    bus = normalize_bus_id(gpu_bus_id) if gpu_bus_id else visible_gpu(files, bus_ids)
    if len(node_ids(files)) == 1:
        return None, "one NUMA node: nothing to place", ""
    if bus is None:
        return None, f"no GPU listed in {NVIDIA_GPUS}: its NUMA node unknown", ""
    label = f"GPU {bus_ids.index(bus)} ({bus})" if bus in bus_ids else f"GPU {bus}"
    allowed = allowed_cpus(files)
    if allowed is None:
        return None, f"{label}: /proc/self/status has no Cpus_allowed_list: this process's CPUs unknown", ""
    g = gpu_numa(files, bus, allowed)
    if g.node is None:
        return None, f"{label}: {g.why}", ""
    by_node = gpus_by_node(files, bus_ids)
    layout = ", ".join(f"node {n}: {_indices(ids)}" for n, ids in sorted(by_node.items()))
    where = f"{label} is on NUMA node {g.node} (CPUs {format_cpulist(g.node_cpus)})"
    fix = (f"run this rank on its GPU's node: numactl --cpunodebind={g.node} --membind={g.node} ... "
           f"(or taskset -c {format_cpulist(g.node_cpus)} ...)")
    if g.placed:
        only = "only its node's CPUs" if not g.outside else f"all {len(g.allowed)} CPUs (not pinned)"
        return True, f"{where}; this process may run on {only}; GPUs by node: {layout}", ""
    others = sorted({n for n in node_ids(files) if (node_cpus(files, n) or frozenset()) & g.outside})
    off = f"node {', '.join(map(str, others))}" if others else "other nodes"
    if not g.usable:
        said = f"this process may run on CPUs {format_cpulist(g.allowed)} ({off} only)"
    else:
        said = (f"this process may run on CPUs {format_cpulist(g.allowed)}: {len(g.usable)} of the node's, "
                f"{len(g.outside)} on {off}")
    return False, f"{where}; {said}; GPUs by node: {layout}", fix
