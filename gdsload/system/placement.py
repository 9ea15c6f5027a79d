"""Placing a rank's reader threads and staging memory on its GPU's NUMA node (Linux only).

:func:`plan` (pure) picks the CPUs: the GPU's node's, intersected with the CPUs this process may use, or none
with the reason. A :class:`Placer` applies it with ``os.sched_setaffinity`` on the calling thread alone: a thread
binds itself as it starts (:meth:`Placer.bind_thread`), or a creating thread around a creation
(:meth:`Placer.around`), getting its mask back after. Nothing here raises for a placement that cannot be done:
it is recorded (:meth:`Placer.describe`). ``GDSLOAD_NUMA=0`` switches placement off. Why affinity:
docs/design.md, "NUMA placement".
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

from .numa import allowed_cpus, format_cpulist, gpu_bus_ids, gpu_numa, normalize_bus_id, numa_report, visible_gpu
from .sysfiles import SystemFiles

ENV_NUMA = "GDSLOAD_NUMA"
_NONE: frozenset[int] = frozenset()


class Placement(NamedTuple):
    """Where a rank's threads and memory go: ``cpus`` (the GPU's node's CPUs this process may use), or
    none (empty ``cpus``), ``why`` then saying why."""

    bus_id: str | None
    node: int | None
    cpus: frozenset[int]
    why: str = ""

    @property
    def active(self) -> bool:
        return bool(self.cpus)


def plan(files: SystemFiles, bus_id: str | None, allowed: frozenset[int] | set[int]) -> Placement:
    """The placement for the GPU at PCI ``bus_id`` (CUDA's form or /sys's) of a process allowed on
    ``allowed`` CPUs, from ``files``. None placed on one node, an unknown node (-1 or missing files) or when
    the process may use none of the node's CPUs (that mismatch is the doctor's to fix: binding elsewhere
    would only move the cost)."""
    if not bus_id:
        return Placement(None, None, _NONE, "the GPU's PCI bus id unknown: nothing placed")
    g = gpu_numa(files, bus_id, allowed)
    if g.node is None:
        return Placement(g.bus_id, None, _NONE, g.why)
    if not g.usable:
        return Placement(g.bus_id, g.node, _NONE,
                         f"this process may run on none of node {g.node}'s CPUs ({format_cpulist(g.node_cpus)}; "
                         f"it may use {format_cpulist(g.allowed)}): nothing placed (gdsload doctor: the fix)")
    return Placement(g.bus_id, g.node, g.usable)


def for_process(bus_id: str | None, files: SystemFiles | None = None,
                environ: Mapping[str, str] | None = None) -> Placement:
    """:func:`plan` for this process: its affinity as the allowed CPUs, the real /sys (or ``files``);
    none placed off Linux or with ``GDSLOAD_NUMA=0``."""
    env = os.environ if environ is None else environ
    if env.get(ENV_NUMA, "").strip() == "0":
        return Placement(bus_id, None, _NONE, f"switched off ({ENV_NUMA}=0)")
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return Placement(bus_id, None, _NONE, f"not Linux ({sys.platform}): nothing placed")
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except OSError as e:
        return Placement(bus_id, None, _NONE, f"this process's CPUs unknown ({e})")
    return plan(files or SystemFiles(), bus_id, allowed)


def device_bus_id(device: Any) -> str | None:
    """The PCI bus id of a CuPy device (``Device.pci_bus_id``), normalized; None when it cannot tell."""
    try:
        return normalize_bus_id(str(device.pci_bus_id))
    except Exception:  # no CUDA, an old CuPy, a stand-in device: no placement
        return None


@contextmanager
def bound(cpus: frozenset[int] | set[int]) -> Iterator[str | None]:
    """Run the calling thread on ``cpus`` inside the block and give it its own mask back after (threads it
    starts meanwhile keep ``cpus``). Yields None once bound, else why not (nothing changed)."""
    if not cpus:
        yield "no CPUs to bind to"
        return
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError, ValueError) as e:
        yield f"sched_setaffinity failed ({type(e).__name__}: {e})"
        return
    try:
        yield None
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError:  # a cgroup shrank meanwhile: the thread keeps the node's CPUs
            pass


class Placer:
    """One backend's placement and the record of what it placed (``describe``); thread-safe."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self._lock = threading.Lock()
        self._placed: dict[str, int] = {}
        self._not: dict[str, str] = {}

    def note(self, what: str, why: str | None) -> None:
        """Record ``what`` as placed (``why`` None) or not, and why (counted per kind when placed)."""
        with self._lock:
            if why is None:
                self._placed[what] = self._placed.get(what, 0) + 1
            else:
                self._not[what] = why

    def bind_thread(self, what: str) -> bool:
        """From inside a thread at its start: bind it to the node's CPUs for good (nothing when inactive)."""
        if not self.placement.active:
            return False
        try:
            os.sched_setaffinity(0, self.placement.cpus)
        except (OSError, AttributeError, ValueError) as e:
            self.note(what, f"sched_setaffinity failed ({type(e).__name__}: {e})")
            return False
        self.note(what, None)
        return True

    @contextmanager
    def around(self, what: str) -> Iterator[None]:
        """Bind the calling thread for a creation (threads started and pages faulted in there land on the
        node), its mask restored after; ``what`` is recorded as placed once the block succeeds."""
        if not self.placement.active:
            yield
            return
        with bound(self.placement.cpus) as failed:
            yield
        self.note(what, failed)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the node, the CPUs bound to (count and list), what was placed (kind -> times), what was
        not and why, and ``why`` nothing was placed at all ("" when placement is on)."""
        p = self.placement
        with self._lock:
            placed, not_placed = dict(self._placed), dict(self._not)
        return {"node": p.node, "cpus": len(p.cpus), "cpulist": format_cpulist(p.cpus), "bus_id": p.bus_id,
                "placed": placed, "not_placed": not_placed, "why": p.why}


def placement_report(files: SystemFiles, gpu_bus_id: str | None = None) -> tuple[bool | None, str, str]:
    """The doctor's NUMA line (:func:`gdsload.system.numa.numa_report`) and what gdsload places itself, or
    cannot: the mismatch's fix stays ``numactl``/``taskset``, since gdsload binds only its own threads and
    buffers, never the rest of the process (the training step's threads, the page cache)."""
    ok, found, fix = numa_report(files, gpu_bus_id)
    if ok is None:
        return ok, found, fix
    bus = normalize_bus_id(gpu_bus_id) if gpu_bus_id else visible_gpu(files, gpu_bus_ids(files))
    p = plan(files, bus, allowed_cpus(files) or _NONE)
    said = "its reader threads and pinned buffers"
    if (files.getenv(ENV_NUMA) or "").strip() == "0":
        return ok, f"{found}; gdsload places nothing ({ENV_NUMA}=0)", fix
    if not p.active:
        return ok, f"{found}; gdsload cannot place {said} on node {p.node}: none of its CPUs is allowed", fix
    if ok:
        return ok, (f"{found}; gdsload binds {said} to node {p.node}'s CPUs ({ENV_NUMA}=0: off), not pages "
                    f"already in the page cache"), fix
    return ok, (f"{found}; gdsload binds {said} to the {len(p.cpus)} of node {p.node}'s CPUs it may use "
                f"({format_cpulist(p.cpus)}), not the rest of the process"), fix


def for_device(device: Any) -> Placer:
    """The placer of a backend on CuPy ``device``: this process's placement for that GPU (:func:`for_process`)."""
    return Placer(for_process(device_bus_id(device)))


def inactive(why: str) -> Placer:
    """A placer that places nothing (stand-ins, and backends built without a device)."""
    return Placer(Placement(None, None, _NONE, why))
