"""NUMA placement (gdsload.system.placement): the pure plan on recorded trees (tests/fixtures/doctor/numa_2socket:
8 GPUs, 0-3 on node 0 and 4-7 on node 1; numa_1node; tests/fixtures/numa/sparse_nodes), then its application on
this machine's real CPUs: a fake two-node /sys whose "node 1" is this machine's last CPU, so binding to it is a real
``sched_setaffinity`` that the threads' masks must show. This machine has one NUMA node: nothing here measures
what placement gains."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import types

import numpy as np
import pytest

from _helpers import FakeStream
from gdsload.system import placement as pl
from gdsload.system.numa import parse_cpulist
from gdsload.system.placement import ENV_NUMA, Placement, Placer, bound, for_process, plan, placement_report
from gdsload.system.sysfiles import SystemFiles

HERE = os.path.dirname(os.path.abspath(__file__))
DOCTOR = os.path.join(HERE, "fixtures", "doctor")
NUMA = os.path.join(HERE, "fixtures", "numa")
NODE0 = parse_cpulist("0-55,112-167")
NODE1 = parse_cpulist("56-111,168-223")
GPU0, GPU5 = "0000:18:00.0", "0000:ab:00.0"
MINE = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
needs_two_cpus = pytest.mark.skipif(not sys.platform.startswith("linux") or len(MINE) < 2,
                                    reason="binding needs Linux and two CPUs this process may use")


def tree(root: str, name: str, env: dict | None = None) -> SystemFiles:
    return SystemFiles(os.path.join(root, name), env={} if env is None else env)


# -- the plan, pure ----------------------------------------------------------------------------------------
def test_two_socket_host_places_each_gpu_on_its_node():
    files = tree(DOCTOR, "numa_2socket")
    assert plan(files, GPU0, NODE0 | NODE1) == Placement(GPU0, 0, NODE0, "")
    assert plan(files, "00000000:AB:00.0", NODE0 | NODE1) == Placement(GPU5, 1, NODE1, "")  # CUDA's form of the id
    for gpu, node in (("0000:2a:00.0", 0), ("0000:5d:00.0", 0), ("0000:9a:00.0", 1), ("0000:db:00.0", 1)):
        p = plan(files, gpu, NODE0 | NODE1)
        assert p.active and p.node == node and p.cpus == (NODE0, NODE1)[node]


def test_the_cpus_are_the_nodes_intersected_with_the_allowed():
    files = tree(DOCTOR, "numa_2socket")
    p = plan(files, GPU5, set(range(40, 80)))  # across both nodes: only node 1's part is bound to
    assert p.active and p.node == 1 and p.cpus == set(range(56, 80))
    p = plan(files, GPU5, {60, 200})
    assert p.cpus == {60, 200} and p.why == ""


def test_cpus_allowed_only_on_the_other_node_place_nothing():
    p = plan(tree(DOCTOR, "numa_2socket"), GPU5, set(range(56)))
    assert not p.active and p.node == 1 and p.cpus == frozenset()
    assert p.why == ("this process may run on none of node 1's CPUs (56-111,168-223; it may use 0-55): nothing "
                     "placed (gdsload doctor: the fix)")


def test_one_node_host_places_nothing():
    p = plan(tree(DOCTOR, "numa_1node"), "0000:04:00.0", set(range(32)))
    assert p == Placement("0000:04:00.0", None, frozenset(), "one NUMA node: nothing to place")


def test_node_minus_one_unknown_device_and_unknown_bus_id_place_nothing():
    files = tree(NUMA, "sparse_nodes")
    p = plan(files, "0000:86:00.0", set(range(10)))
    assert not p.active and p.node is None and "numa_node -1" in p.why
    p = plan(files, "0000:99:00.0", set(range(10)))
    assert not p.active and p.why == "/sys/bus/pci/devices/0000:99:00.0/numa_node missing: NUMA node unknown"
    assert plan(files, None, set(range(10))).why == "the GPU's PCI bus id unknown: nothing placed"


def test_sparse_node_ids_and_cpulist_forms():
    files = tree(NUMA, "sparse_nodes")
    p = plan(files, "0000:3b:00.0", set(range(10)))  # node 2, cpulist "1,3,7-9" without a final newline
    assert p.active and p.node == 2 and p.cpus == {1, 3, 7, 8, 9}
    assert plan(files, "3b:00.0", {0, 2, 3, 4}).cpus == {3}  # no domain in the id; one CPU of the node allowed


def test_a_malformed_cpulist_is_an_unknown_not_an_error(tmp_path):
    shutil.copytree(os.path.join(NUMA, "sparse_nodes"), tmp_path / "t")
    (tmp_path / "t/sys/devices/system/node/node2/cpulist").write_text("1-x\n")
    p = plan(SystemFiles(str(tmp_path / "t"), env={}), "0000:3b:00.0", set(range(10)))
    assert not p.active and p.why == "/sys/devices/system/node/node2/cpulist missing: the node's CPUs unknown"


def test_process_level_switch_and_platform():
    files = tree(DOCTOR, "numa_2socket")
    off = for_process(GPU0, files, {ENV_NUMA: "0"})
    assert not off.active and off.why == "switched off (GDSLOAD_NUMA=0)"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl.sys, "platform", "darwin")
        assert for_process(GPU0, files, {}).why == "not Linux (darwin): nothing placed"


@pytest.mark.skipif(not MINE, reason="Linux only")
def test_process_level_uses_this_process_affinity():
    files = tree(DOCTOR, "numa_2socket")
    p = for_process(GPU0, files, {ENV_NUMA: "1"})
    assert p.active and p.cpus == NODE0 & MINE  # this machine's CPUs are low numbers: node 0's
    p = for_process(GPU5, files, {})
    assert not p.active and p.node == 1 and "none of node 1's CPUs" in p.why


def test_device_bus_id_is_duck_typed():
    assert pl.device_bus_id(types.SimpleNamespace(pci_bus_id="00000000:C1:00.0")) == "0000:c1:00.0"
    assert pl.device_bus_id(object()) is None


# -- the doctor's line -------------------------------------------------------------------------------------
def test_doctor_line_says_what_gdsload_places():
    ok, found, fix = placement_report(tree(DOCTOR, "numa_2socket", {"CUDA_VISIBLE_DEVICES": "5"}))
    assert ok is True and fix == "" and found.endswith(
        "; gdsload binds its reader threads and pinned buffers to node 1's CPUs (GDSLOAD_NUMA=0: off), not pages "
        "already in the page cache")
    ok, found, _ = placement_report(tree(DOCTOR, "numa_2socket", {"CUDA_VISIBLE_DEVICES": "5", ENV_NUMA: "0"}))
    assert ok is True and found.endswith("; gdsload places nothing (GDSLOAD_NUMA=0)")
    assert placement_report(tree(DOCTOR, "numa_1node")) == (None, "one NUMA node: nothing to place", "")


def test_doctor_line_on_a_mismatch_keeps_the_fix(tmp_path):
    shutil.copytree(os.path.join(DOCTOR, "numa_2socket"), tmp_path / "t")
    (tmp_path / "t/proc/self/status").write_text("Cpus_allowed_list:\t0-55\n")
    ok, found, fix = placement_report(SystemFiles(str(tmp_path / "t"), env={"CUDA_VISIBLE_DEVICES": "7"}))
    assert ok is False and found.endswith("; gdsload cannot place its reader threads and pinned buffers on node 1: "
                                          "none of its CPUs is allowed")
    assert fix.startswith("run this rank on its GPU's node: numactl --cpunodebind=1 --membind=1")


# -- applying it on this machine ---------------------------------------------------------------------------
def thread_mask(tid: int) -> frozenset[int]:
    """A thread's affinity as the kernel reports it (/proc/self/task/<tid>/status)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
    return parse_cpulist(line.split(":", 1)[1])


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """A fake two-node /sys: node 1 is this machine's last CPU, node 0 the others, GPU 0000:c1:00.0 on node 1;
    :func:`for_process` reads it in place of /sys. Returns node 1's CPUs."""
    last = max(MINE)
    root = tmp_path / "sys2"
    for node, cpus in ((0, ",".join(str(c) for c in sorted(MINE - {last}))), (1, str(last))):
        (root / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (root / f"sys/devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    (root / "sys/bus/pci/devices/0000:c1:00.0").mkdir(parents=True)
    (root / "sys/bus/pci/devices/0000:c1:00.0/numa_node").write_text("1\n")
    monkeypatch.setattr(pl, "SystemFiles", lambda: SystemFiles(str(root), env={}))
    monkeypatch.delenv(ENV_NUMA, raising=False)
    return frozenset({last})


@needs_two_cpus
def test_a_python_thread_binds_itself_and_the_creator_is_untouched(two_nodes):
    placer = Placer(for_process("00000000:C1:00.0"))
    assert placer.placement.cpus == two_nodes and placer.placement.node == 1
    seen: list = []
    t = threading.Thread(target=lambda: seen.append((placer.bind_thread("reader threads"), os.sched_getaffinity(0))))
    t.start()
    t.join()
    assert seen == [(True, set(two_nodes))] and os.sched_getaffinity(0) == MINE
    d = placer.describe()
    assert (d["node"], d["cpus"], d["placed"], d["not_placed"], d["why"]) == (1, 1, {"reader threads": 1}, {}, "")


@needs_two_cpus
def test_stager_threads_inherit_the_mask_and_the_creator_gets_its_own_back(two_nodes):
    from gdsload.backends.native.stager import Stager, load

    if load() is None:
        pytest.skip("the native stager does not build here")
    placer = Placer(for_process("0000:c1:00.0"))
    before = set(os.listdir("/proc/self/task"))
    with placer.around("native stager threads and buffers"):
        st = Stager("host", num_threads=3, buf_bytes=1 << 16)
        assert os.sched_getaffinity(0) == two_nodes  # bound while creating
    try:
        assert os.sched_getaffinity(0) == MINE, "the creating thread's mask is restored"
        workers = set(os.listdir("/proc/self/task")) - before
        assert len(workers) == 3 and all(thread_mask(int(t)) == two_nodes for t in workers)
        assert placer.describe()["placed"] == {"native stager threads and buffers": 1}
    finally:
        st.close()


@needs_two_cpus
def test_switched_off_places_nothing(two_nodes, monkeypatch):
    from gdsload.backends.native.stager import Stager, load

    monkeypatch.setenv(ENV_NUMA, "0")
    placer = Placer(for_process("0000:c1:00.0"))
    seen: list = []
    t = threading.Thread(target=lambda: seen.append((placer.bind_thread("reader threads"), os.sched_getaffinity(0))))
    t.start()
    t.join()
    assert seen == [(False, set(MINE))]
    if load() is not None:
        before = set(os.listdir("/proc/self/task"))
        with placer.around("native stager threads and buffers"):
            st = Stager("host", num_threads=2, buf_bytes=1 << 16)
        workers = set(os.listdir("/proc/self/task")) - before
        assert all(thread_mask(int(w)) == MINE for w in workers)
        st.close()
    assert placer.describe() == {"node": None, "cpus": 0, "cpulist": "", "bus_id": "0000:c1:00.0", "placed": {},
                                 "not_placed": {}, "why": "switched off (GDSLOAD_NUMA=0)"}


@needs_two_cpus
def test_a_placement_that_cannot_be_done_is_recorded_not_raised():
    with bound({1 << 16}) as failed:  # a CPU no machine here has
        assert failed is not None and failed.startswith("sched_setaffinity failed (")
        assert os.sched_getaffinity(0) == MINE
    placer = Placer(Placement("0000:c1:00.0", 1, frozenset({1 << 16})))
    out: list = []
    t = threading.Thread(target=lambda: out.append(placer.bind_thread("reader threads")))
    t.start()
    t.join()
    with placer.around("staging pool"):
        pass
    d = placer.describe()
    assert out == [False] and d["placed"] == {} and set(d["not_placed"]) == {"reader threads", "staging pool"}
    assert os.sched_getaffinity(0) == MINE


# -- the backends, CUDA replaced ---------------------------------------------------------------------------
class _Runtime:
    """The CUDA calls the pinned (threads reader) and mmap backends make, on host memory; each registration
    records the mask of the thread that made it (the thread that faulted the pages in, for PinnedHost)."""

    def __init__(self):
        self.registered: dict[int, tuple[int, frozenset[int]]] = {}

    def hostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = (nbytes, frozenset(os.sched_getaffinity(0)))

    def hostUnregister(self, ptr):
        self.registered.pop(ptr, None)

    def setDevice(self, i):
        pass


class _Device(contextlib.nullcontext):
    pci_bus_id = "00000000:C1:00.0"

    def __init__(self, i=0):
        super().__init__()


@pytest.fixture
def fake_cupy(monkeypatch):
    runtime = _Runtime()
    cuda = types.SimpleNamespace(runtime=runtime, Device=_Device, Stream=FakeStream, Event=lambda **kw: object())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, uint8=np.uint8))
    return runtime


@needs_two_cpus
def test_pinned_backend_places_its_pool_and_reader_threads(two_nodes, fake_cupy):
    from gdsload.backends.pinned.backend import PinnedBackend

    b = PinnedBackend(reader="threads", num_threads=2, slot_bytes=64 << 10, pool_bytes=128 << 10)
    try:
        assert os.sched_getaffinity(0) == MINE, "the constructing thread's mask is restored"
        assert [m for _, m in fake_cupy.registered.values()] == [two_nodes], "the pool was mapped while bound"
        both = threading.Barrier(2)  # two tasks at once: both reader threads start

        def mask() -> tuple[int, frozenset[int]]:
            both.wait(5)
            return threading.get_ident(), frozenset(os.sched_getaffinity(0))

        seen = [f.result() for f in [b._staging._executor.submit(mask) for _ in range(2)]]
        assert len({t for t, _ in seen}) == 2 and {m for _, m in seen} == {two_nodes}
        numa = b.stats()["numa"]
        assert numa["node"] == 1 and numa["cpus"] == 1 and numa["cpulist"] == str(max(MINE))
        assert numa["placed"] == {"staging pool": 1, "reader threads": 2} and numa["not_placed"] == {}
    finally:
        b.close()


@needs_two_cpus
def test_mmap_backend_loader_threads_run_on_the_node(two_nodes, fake_cupy, tmp_path):
    from gdsload.backends.mmap.backend import MmapBackend
    from gdsload.format.files import ShardFiles

    path = str(tmp_path / "f0")
    np.arange(256 << 10, dtype=np.uint8).tofile(path)
    files = ShardFiles.open([path])
    b = MmapBackend(register_threads=2)
    try:
        b.prepare(files)
        b.started()
        b._loader.wait(list(b._loader._units))
        # Every range but the open's probe page was locked on a loader thread, bound to the node.
        masks = {m for n, m in fake_cupy.registered.values()}
        assert masks == {two_nodes} and os.sched_getaffinity(0) == MINE
        numa = b.stats()["numa"]
        assert numa["node"] == 1 and 1 <= numa["placed"]["loader threads"] <= 2
        assert "page cache pages already cached" in numa["not_placed"]
    finally:
        b.close()
        files.close()
