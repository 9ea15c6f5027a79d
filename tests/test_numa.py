"""gdsload.system.numa: a GPU's NUMA node, its CPUs and this process's CPUs, from recorded system-file trees
(tests/fixtures/doctor/numa_2socket: 8 GPUs, 0-3 on node 0 and 4-7 on node 1; numa_1node: one node)."""

from __future__ import annotations

import os
import shutil

import pytest

from gdsload.system.numa import (allowed_cpus, format_cpulist, gpu_bus_ids, gpu_numa, gpus_by_node, normalize_bus_id,
                                 numa_report, parse_cpulist, visible_gpu)
from gdsload.system.sysfiles import SystemFiles

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "doctor")
NODE0 = parse_cpulist("0-55,112-167")
NODE1 = parse_cpulist("56-111,168-223")
ALL = NODE0 | NODE1
GPU0, GPU5 = "0000:18:00.0", "0000:ab:00.0"


def tree(name: str, env: dict | None = None) -> SystemFiles:
    return SystemFiles(os.path.join(FIXTURES, name), env={} if env is None else env)


def copy(tmp_path, name: str, env: dict | None = None) -> SystemFiles:
    """A writable copy of a fixture tree, to edit or remove files in."""
    root = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), root)
    return SystemFiles(str(root), env={} if env is None else env)


def test_cpulists_parse_and_format():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == frozenset()
    assert len(NODE0) == len(NODE1) == 112 and not NODE0 & NODE1
    assert format_cpulist(NODE1) == "56-111,168-223" and format_cpulist({7}) == "7" and format_cpulist(set()) == ""
    assert format_cpulist({1, 3, 4, 5, 9}) == "1,3-5,9"
    for bad in ("0-", "a", "5-2", "1;2"):
        with pytest.raises(ValueError, match=r"^not a CPU list \(expected e\.g\. 0-55,112-167"):
            parse_cpulist(bad)


def test_bus_ids_as_sys_names_them():
    assert normalize_bus_id("00000000:AB:00.0") == GPU5 == normalize_bus_id("ab:00.0") == normalize_bus_id(GPU5)
    ids = gpu_bus_ids(tree("numa_2socket"))
    assert len(ids) == 8 and ids[0] == GPU0 and ids[5] == GPU5 and ids == sorted(ids)
    assert gpus_by_node(tree("numa_2socket"), ids) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def test_visible_gpu_follows_cuda_visible_devices():
    ids = gpu_bus_ids(tree("numa_2socket"))
    assert visible_gpu(tree("numa_2socket"), ids) == GPU0
    assert visible_gpu(tree("numa_2socket", {"CUDA_VISIBLE_DEVICES": "5,6"}), ids) == GPU5
    assert visible_gpu(tree("numa_2socket", {"CUDA_VISIBLE_DEVICES": "GPU-5f2c0a1e-0006"}), ids) == "0000:ba:00.0"
    assert visible_gpu(tree("numa_2socket", {"CUDA_VISIBLE_DEVICES": "8"}), ids) is None
    assert visible_gpu(tree("numa_2socket", {"CUDA_VISIBLE_DEVICES": "GPU-nope"}), ids) is None


def test_allowed_cpus_from_proc_self_status(tmp_path):
    assert allowed_cpus(tree("numa_2socket")) == ALL and allowed_cpus(tree("numa_1node")) == set(range(32))
    assert allowed_cpus(SystemFiles(str(tmp_path))) is None  # no /proc/self/status


def test_process_only_on_the_gpus_node_is_placed():
    g = gpu_numa(tree("numa_2socket"), GPU0, NODE0)
    assert (g.nodes, g.node, g.node_cpus, g.usable, g.outside, g.placed) == (2, 0, NODE0, NODE0, frozenset(), True)
    g = gpu_numa(tree("numa_2socket"), "0000:DB:00.0", set(range(60, 70)))  # a few of node 1's CPUs
    assert (g.bus_id, g.node, g.usable, g.outside, g.placed) == ("0000:db:00.0", 1, set(range(60, 70)), set(), True)


def test_unpinned_process_may_use_the_whole_node():
    g = gpu_numa(tree("numa_2socket"), GPU5, ALL)
    assert g.node == 1 and g.usable == NODE1 and g.outside == NODE0 and g.placed is True


def test_process_on_the_other_node_only_is_a_mismatch():
    g = gpu_numa(tree("numa_2socket"), GPU5, set(range(56)))
    assert g.node == 1 and g.usable == frozenset() and g.outside == set(range(56)) and g.placed is False


def test_partial_overlap_across_nodes_is_a_mismatch():
    g = gpu_numa(tree("numa_2socket"), GPU5, set(range(64)))
    assert g.usable == set(range(56, 64)) and g.outside == set(range(56)) and g.placed is False


def test_one_node_host_has_nothing_to_place():
    g = gpu_numa(tree("numa_1node"), "0000:04:00.0", set(range(32)))
    assert (g.nodes, g.node, g.placed, g.why) == (1, None, None, "one NUMA node: nothing to place")


def test_numa_node_minus_one_and_missing_files_are_unknown(tmp_path):
    files = copy(tmp_path, "numa_2socket")
    with open(files.path(f"/sys/bus/pci/devices/{GPU5}/numa_node"), "w") as f:
        f.write("-1\n")
    g = gpu_numa(files, GPU5, ALL)
    assert g.node is None and g.placed is None and "numa_node -1" in g.why
    g = gpu_numa(files, "0000:e1:00.0", ALL)  # a device /sys does not list
    assert g.node is None and g.why == "/sys/bus/pci/devices/0000:e1:00.0/numa_node missing: NUMA node unknown"
    os.remove(files.path("/sys/devices/system/node/node1/cpulist"))
    g = gpu_numa(files, "0000:ba:00.0", ALL)
    assert g.node is None and g.why == "/sys/devices/system/node/node1/cpulist missing: the node's CPUs unknown"
    assert gpu_numa(files, GPU0, NODE0).placed is True  # node 0 is still known


def test_report_lines():
    ok, found, fix = numa_report(tree("numa_2socket", {"CUDA_VISIBLE_DEVICES": "5"}))
    assert ok is True and fix == "" and found == (
        "GPU 5 (0000:ab:00.0) is on NUMA node 1 (CPUs 56-111,168-223); this process may run on all 224 CPUs "
        "(not pinned); GPUs by node: node 0: 0-3, node 1: 4-7")
    assert numa_report(tree("numa_1node")) == (None, "one NUMA node: nothing to place", "")
    ok, found, _ = numa_report(tree("numa_2socket"), "00000000:5D:00.0")  # CuPy's form of GPU 3's bus id
    assert ok is True and found.startswith("GPU 3 (0000:5d:00.0) is on NUMA node 0 (CPUs 0-55,112-167)")


def test_report_on_missing_files_is_unknown(tmp_path):
    assert numa_report(SystemFiles(str(tmp_path), env={})) == (
        None, "no GPU listed in /proc/driver/nvidia/gpus: its NUMA node unknown", "")
    files = copy(tmp_path, "numa_2socket")
    os.remove(files.path("/proc/self/status"))
    assert numa_report(files) == (None, "GPU 0 (0000:18:00.0): /proc/self/status has no Cpus_allowed_list: this "
                                        "process's CPUs unknown", "")
