"""gdsload doctor: parsing of recorded system files, the verdicts they lead to, and the command on this
machine (CPU only). The GPU side (a real live read, real nvidia-fs counters) is checked on a GPU machine."""

from __future__ import annotations

import io
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from gdsload.tools.doctor import diagnose, gather, main, render
from gdsload.tools.doctor_probe import HostProbes, LiveRead, Target, cufile_version, o_direct_read
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.conversion.source_types import ArraySource
from gdsload.system.sysfiles import (SystemFiles, cufile_settings, find_mount, fs_support, iommu_mode,
                                     kvikio_compat_env, parse_cufile_json, parse_mountinfo, parse_nvfs_stats,
                                     strip_json_comments)
from gdsload.conversion.writer import write_dataset

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "doctor")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS = "proc/driver/nvidia-fs/stats"
GDS_KVIKIO = {"kvikio": "25.10.00", "compat_mode_preferred": False, "is_gds_available": True, "io_mode": "gds"}
COMPAT_KVIKIO = {"kvikio": "25.10.00", "compat_mode_preferred": True, "is_gds_available": False,
                 "io_mode": "kvikio-compat"}


def fixture(*parts: str) -> str:
    return os.path.join(FIXTURES, *parts)


def read_fixture(*parts: str) -> str:
    with open(fixture(*parts)) as f:
        return f.read()


class Machine:
    """A GPU machine as the doctor's probes see it; the system files come from a fixture root. A live read
    copies ``after`` over the root's nvidia-fs stats file, as a read through nvidia-fs would move them."""

    def __init__(self, root: str, kvikio: dict | None = None, after: str | None = None,
                 o_direct: tuple[bool, str] = (True, "opened with O_DIRECT and read 1048576 bytes"),
                 backend: tuple[str, str] = ("kvikio", "GPUDirect Storage is available")) -> None:
        self.root, self.after, self._o_direct, self._backend = root, after, o_direct, backend
        self._kvikio = dict(GDS_KVIKIO if kvikio is None else kvikio)
        self.reads: list[list[str]] = []

    def gpu(self) -> dict:
        return {"gpu": "NVIDIA H100 80GB HBM3", "device_count": 8, "driver": "12.8", "cuda_runtime": "12.8",
                "cupy": "13.6.0"}

    def kvikio(self, gpu: bool) -> dict:
        return self._kvikio

    nvcomp_info = {"nvcomp": "6.0.0", "path": "/venv/site-packages/nvidia/libnvcomp/lib64/libnvcomp.so.6"}

    def nvcomp(self) -> dict:
        return self.nvcomp_info

    def libcufile(self) -> dict:
        return {"path": "/usr/local/cuda-12.8/lib64/libcufile.so.0",
                "file": "/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcufile.so.1.13.1", "version": "1.13"}

    def backend(self, dataset_bytes: int | None = None, path: str | None = None) -> tuple[str, str]:
        self.asked_bytes = dataset_bytes  # what auto was told of the dataset's size
        return self._backend

    def machine(self) -> str:
        return "x86_64"

    def inspect(self, path: str) -> Target:
        return Target(path, path, "dataset", [f"{path}/image/c/0", f"{path}/label/c/0"], 3 << 30, True, True,
                      "all 768 stored blocks of 2 array(s) start and end on 4 KiB")

    def o_direct(self, path: str) -> tuple[bool, str]:
        return self._o_direct

    def live_read(self, files: list[str], limit: int) -> LiveRead:
        self.reads.append(files)
        if self.after is not None:
            shutil.copyfile(self.after, os.path.join(self.root, STATS))
        return LiveRead(limit, 0.05, None, files)


def scenario(tmp_path, name: str, env: dict | None = None) -> SystemFiles:
    """A writable copy of a fixture root (the live read rewrites its stats file)."""
    root = tmp_path / name
    shutil.copytree(fixture(name), root)
    return SystemFiles(str(root), env={} if env is None else env)


def report(files: SystemFiles, path: str | None, **machine: object) -> dict:
    return diagnose(gather(path, files, Machine(files.root, **machine)))


def check(rep: dict, name: str) -> dict:
    return next(c for c in rep["checks"] if c["name"] == name)


# -- parsing ---------------------------------------------------------------------------------------
def test_mountinfo_fields_escapes_and_longest_prefix():
    mounts = parse_mountinfo(read_fixture("gds_host", "proc", "self", "mountinfo"))
    spaced = find_mount(mounts, "/mnt/fast scratch/train.gds")
    assert spaced.mount_point == "/mnt/fast scratch" and spaced.fstype == "ext4" and spaced.optional == ("shared:66",)
    assert find_mount(mounts, "/raid").mount_point == "/raid"
    assert find_mount(mounts, "/raid/a/b.gds").source == "/dev/nvme1n1"
    assert find_mount(mounts, "/raidz/a").mount_point == "/"  # a prefix of the name is not a parent directory
    assert find_mount(mounts, "/dev/shm/x").fstype == "tmpfs" and find_mount(mounts, "/dev/null").fstype == "devtmpfs"
    vast = find_mount(mounts, "/mnt/vast/x")
    assert (vast.fstype, vast.source, vast.dev) == ("nfs", "vast-vip:/datasets", "0:53")
    assert "proto=rdma" in vast.all_options() and vast.options == "rw,relatime"
    container = parse_mountinfo(read_fixture("container", "proc", "self", "mountinfo"))
    data = find_mount(container, "/data/train.gds")
    assert (data.root, data.optional, data.fstype) == ("/datasets", (), "ext4")
    with pytest.raises(ValueError, match=r"^mnt:2: not a mountinfo line"):
        parse_mountinfo("30 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw\n31 30 0:5 / /x rw shared:1 ext4 /dev/x rw\n",
                        "mnt")


@pytest.mark.parametrize("fstype, options, device, gds, said", [
    ("ext4", ["rw", "data=ordered"], "nvme1n1", True, "data=ordered, on NVMe device nvme1n1"),
    ("ext4", ["rw"], "nvme0n1p2", True, "data=ordered (no data= option)"),
    ("ext4", ["rw", "data=journal"], "nvme1n1", False, "data=journal"),
    ("xfs", ["rw"], "md127", False, "md RAID (level unknown)"),
    ("ext4", ["rw"], "vda", False, "virtio disk vda"),
    ("xfs", ["rw"], "sdb1", False, "SCSI/SATA disk"),
    ("ext4", ["rw"], "dm-0", False, "device-mapper"),
    ("ext4", ["rw"], None, None, "block device unknown"),
    ("nfs4", ["rw", "vers=4.2"], None, False, "nfs4 over tcp"),
    ("nfs", ["rw", "proto=rdma", "port=20049"], None, True, "over RDMA"),
    ("gpfs", ["rw"], None, True, "IBM Spectrum Scale"),
    ("wekafs", ["rw"], None, True, "WekaFS"),
    ("beegfs", ["rw"], None, True, "BeeGFS"),
    ("overlay", ["rw", "lowerdir=/a"], None, False, "overlayfs"),
    ("zfs", ["rw"], None, False, "ZFS"),
    ("btrfs", ["rw"], "nvme0n1", False, "Btrfs"),
    ("fuse.sshfs", ["rw"], None, False, "FUSE (fuse.sshfs)"),
    ("9p", ["rw"], None, False, "not among the file systems GDS reads directly"),
])
def test_fs_support_matrix(fstype, options, device, gds, said):
    verdict = fs_support(fstype, options, device)
    assert verdict.gds is gds and said in verdict.what
    assert bool(verdict.fix) == (gds is not True)


def test_cufile_json_comments_and_settings():
    cfg = parse_cufile_json(read_fixture("gds_host", "etc", "cufile.json"), "/etc/cufile.json")
    assert cufile_settings(cfg) == {"allow_compat_mode": True, "force_compat_mode": None, "use_pci_p2pdma": False,
                                    "max_direct_io_size_kb": 16384}
    assert cfg["logging"] == {"level": "ERROR"}  # the commented-out "dir" is gone
    strict = parse_cufile_json(read_fixture("cufile", "no_compat.json"), "no_compat.json")
    assert strict["logging"]["dir"] == "/var/log//cufile"  # "//" inside a string is not a comment
    assert cufile_settings(strict)["allow_compat_mode"] is False
    assert strip_json_comments('{"a": "x\\"//y", /* c */ "b": [1,2,],}') == '{"a": "x\\"//y",  "b": [1,2]}'
    with pytest.raises(ValueError, match=r"^bad\.json: not valid JSON once comments are removed"):
        parse_cufile_json('{"properties": {"allow_compat_mode": tru}}', "bad.json")


def test_nvfs_stats_counters_and_versions():
    before = parse_nvfs_stats(read_fixture("gds_host", *STATS.split("/")))
    after = parse_nvfs_stats(read_fixture("nvidia-fs", "stats_after_read"))
    off = parse_nvfs_stats(read_fixture("nvidia-fs", "stats_disabled"))
    assert (before.io_stats, before.reads, before.reads_ok, before.read_errors, before.read_mib, before.driver) == \
        (True, 1204, 1204, 0, 4816, "2.28.4")
    assert (after.reads - before.reads, after.read_mib - before.read_mib) == (64, 256)
    assert off.io_stats is False and off.reads is None and off.read_mib is None and off.read_errors == 0


@pytest.mark.parametrize("cmdline, types, groups, mode", [
    ("ro amd_iommu=off", [], False, "off"),
    ("ro iommu=pt", ["identity", "identity"], True, "passthrough"),
    ("ro intel_iommu=on", ["DMA-FQ"], True, "translated"),
    ("ro iommu=pt", [], True, "passthrough"),
    ("ro", [], True, "translated"),
])
def test_iommu_mode(cmdline, types, groups, mode):
    assert iommu_mode(cmdline, types, groups).mode == mode


@pytest.mark.parametrize("value, mode", [(None, "auto"), ("ON", "on"), ("true", "on"), ("1", "on"), ("off", "off"),
                                         ("No", "off"), ("AUTO", "auto"), ("maybe", "invalid")])
def test_kvikio_compat_env(value, mode):
    assert kvikio_compat_env(value) == mode


# -- verdicts from recorded system files -----------------------------------------------------------
@pytest.mark.parametrize("path, fs_type, device, said", [
    ("/raid/imagenet.gds", "ext4", "/dev/nvme1n1", "ext4, data=ordered, on NVMe device nvme1n1"),
    ("/home/me/train.gds", "ext4", "/dev/nvme0n1p2", "ext4, data=ordered (no data= option), on NVMe device"),
    ("/xfs/train.gds", "xfs", "/dev/nvme3n1", "xfs, on NVMe device nvme3n1"),
    ("/md/train.gds", "xfs", "/dev/md127", "md RAID raid0 md127"),
    ("/mnt/vast/train.gds", "nfs", "vast-vip:/datasets", "nfs over RDMA"),
    ("/lustre/project/train.gds", "lustre", "172.16.0.2@o2ib:/exafs", "Lustre"),
])
def test_gds_capable_mounts_read_through_nvidia_fs_are_active(tmp_path, path, fs_type, device, said):
    files = scenario(tmp_path, "gds_host")
    rep = report(files, path, after=fixture("nvidia-fs", "stats_after_read"))
    assert rep["verdict"] == "GDS: active" and rep["reasons"] == []
    assert rep["gds_available"] is True and rep["gds_active"] is True and rep["io_mode"] == "gds"
    assert rep["filesystem"]["type"] == fs_type and rep["filesystem"]["device"] == device
    assert check(rep, "filesystem")["ok"] is True and said in check(rep, "filesystem")["found"]
    live = check(rep, "live read")
    assert live["ok"] is True and "nvidia-fs counted 64 reads, 256 MiB: GDS active" in live["found"]
    assert all(c["ok"] is not False for c in rep["checks"])


@pytest.mark.parametrize("path, first_reason, fix", [
    ("/scratch/train.gds", "filesystem: ext4 mounted data=writeback", "mount it with -o data=ordered"),
    ("/dev/shm/train.gds", "filesystem: tmpfs (RAM): cuFile reads it only in compat mode", "backend='mmap'"),
    ("/mnt/home/train.gds", "filesystem: nfs4 over tcp", "proto=rdma"),
])
def test_compat_only_mounts_name_the_file_system(tmp_path, path, first_reason, fix):
    files = scenario(tmp_path, "gds_host")
    rep = report(files, path)  # the live read moves no nvidia-fs counter
    assert rep["verdict"].startswith(f"GDS: not used — {first_reason}") and fix in rep["verdict"].split("; fix: ")[1]
    assert rep["reasons"][0].startswith(first_reason) and rep["reasons"][1].startswith("live read:")
    assert check(rep, "live read")["found"].endswith("nvidia-fs counted no reads: cuFile used its compat path")
    assert rep["gds_available"] is False and rep["gds_active"] is False and rep["io_mode"] == "kvikio-compat"
    assert [c["name"] for c in rep["checks"] if c["ok"] is False] == ["filesystem", "live read"]


def test_writeback_mount_options_in_json(tmp_path):
    rep = report(scenario(tmp_path, "gds_host"), "/scratch/train.gds")
    assert rep["filesystem"] == {"type": "ext4", "device": "/dev/nvme2n1", "source": "/dev/nvme2n1", "dev": "259:4",
                                 "mount_point": "/scratch", "mount_options": "rw,noatime,data=writeback",
                                 "gds": False}
    assert rep["o_direct"] is True and rep["aligned"] is True


def test_container_without_nvidia_fs_or_udev(tmp_path):
    files = scenario(tmp_path, "container")
    rep = report(files, "/data/train.gds", kvikio=COMPAT_KVIKIO,
                 backend=("pinned", "GDS unavailable: pinned staging read by KvikIO's threads"))
    assert rep["verdict"].startswith("GDS: not used — nvidia-fs: not loaded (/proc/driver/nvidia-fs is missing)")
    assert "sudo modprobe nvidia_fs" in rep["verdict"]
    assert [r.split(":")[0] for r in rep["reasons"]] == ["nvidia-fs", "container", "IOMMU", "KvikIO", "live read"]
    assert check(rep, "filesystem")["ok"] is True and rep["filesystem"]["device"] == "/dev/nvme1n1"
    udev = check(rep, "container")
    assert "docker (/.dockerenv); /run/udev not readable" in udev["found"] and "/run/udev:/run/udev:ro" in udev["fix"]
    assert check(rep, "IOMMU")["found"].startswith("translated: 3 IOMMU group(s), types DMA-FQ (intel_iommu=on)")
    assert check(rep, "cufile.json")["found"] == "/etc/cufile.json: absent (cuFile's defaults)"
    live = check(rep, "live read")  # no counters, but KvikIO itself says this process reads in compat mode
    assert live["ok"] is False and "compat mode: KvikIO prefers compat mode" in live["found"]
    assert rep["io_mode"] == "pinned" and rep["gds_available"] is False
    overlay = report(files, "/workspace/train.gds", kvikio=COMPAT_KVIKIO)
    fs = check(overlay, "filesystem")
    assert fs["ok"] is False and fs["found"].startswith("overlayfs (a container's own file system)")
    assert "docker run -v /nvme/data:/data" in fs["fix"]


def test_kvikio_compat_mode_on_comes_first(tmp_path):
    files = scenario(tmp_path, "gds_host", env={"KVIKIO_COMPAT_MODE": "ON"})
    rep = report(files, "/raid/imagenet.gds", kvikio=COMPAT_KVIKIO)
    assert rep["verdict"] == ("GDS: not used — KVIKIO_COMPAT_MODE: ON: KvikIO reads with POSIX calls, never "
                              "through cuFile; fix: unset KVIKIO_COMPAT_MODE (or set it to AUTO)")
    assert [r.split(":")[0] for r in rep["reasons"]] == ["KVIKIO_COMPAT_MODE", "KvikIO", "live read"]
    assert check(rep, "filesystem")["ok"] is True


def test_few_cuda_queues_are_named_without_changing_the_gds_verdict(tmp_path):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (as Megatron-LM sets it) puts the loader's copies in the training step's
    hardware queue: the doctor says so and how to fix it, and GDS's verdict is the same as without it."""
    after = fixture("nvidia-fs", "stats_after_read")
    plain = report(scenario(tmp_path, "gds_host"), "/raid/imagenet.gds", after=after)
    assert plain["verdict"] == "GDS: active"
    for value, ok in (("1", False), ("2", False), ("4", True), ("32", True)):
        files = scenario(tmp_path / value, "gds_host", env={"CUDA_DEVICE_MAX_CONNECTIONS": value})
        rep = report(files, "/raid/imagenet.gds", after=after)
        queues = check(rep, "CUDA queues")
        assert queues["ok"] is ok, value
        if ok:
            assert queues["found"] == f"CUDA_DEVICE_MAX_CONNECTIONS={value}" and queues["fix"] == ""
        else:
            assert queues["found"].startswith(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: CUDA gives this process")
            assert queues["fix"].startswith("unset CUDA_DEVICE_MAX_CONNECTIONS or set it to 4 or more")
            assert f"fix: {queues['fix']}" in render(rep)
        assert (rep["verdict"], rep["reasons"]) == (plain["verdict"], plain["reasons"])


def test_cufile_json_from_env_without_compat_mode(tmp_path):
    files = scenario(tmp_path, "gds_host", env={"CUFILE_ENV_PATH_JSON": "/opt/strict/cufile.json"})
    os.makedirs(files.path("/opt/strict"))
    shutil.copyfile(fixture("cufile", "no_compat.json"), files.path("/opt/strict/cufile.json"))
    rep = report(files, "/dev/shm/train.gds")
    cj = check(rep, "cufile.json")
    assert cj["ok"] is True and cj["found"].startswith("/opt/strict/cufile.json (CUFILE_ENV_PATH_JSON): "
                                                       "allow_compat_mode=false, use_pci_p2pdma=unset, "
                                                       "max_direct_io_size_kb=4096")
    assert "allow_compat_mode=false, so cuFile refuses it" in check(rep, "filesystem")["found"]
    missing = report(SystemFiles(files.root, env={"CUFILE_ENV_PATH_JSON": "/nowhere.json"}), "/raid/x.gds")
    assert missing["verdict"].startswith("GDS: not used — cufile.json: /nowhere.json (CUFILE_ENV_PATH_JSON): missing")
    forced = report(SystemFiles(files.root, env={"CUFILE_FORCE_COMPAT_MODE": "true"}), "/raid/x.gds")
    assert forced["reasons"][0] == "cufile.json: CUFILE_FORCE_COMPAT_MODE is set: cuFile always uses compat mode"


def test_nvidia_fs_counters_off_cannot_confirm(tmp_path):
    files = scenario(tmp_path, "gds_host")
    shutil.copyfile(fixture("nvidia-fs", "stats_disabled"), files.path("/" + STATS))
    rep = report(files, "/raid/imagenet.gds", after=fixture("nvidia-fs", "stats_disabled"))
    assert rep["verdict"] == ("GDS: not confirmed — nvidia-fs read counters are off; fix: echo 1 | sudo tee "
                              "/sys/module/nvidia_fs/parameters/rw_stats_enabled, then run the doctor again")
    assert rep["reasons"] == [] and rep["gds_available"] is True and rep["gds_active"] is False
    assert "read counters off" in check(rep, "nvidia-fs")["found"]


def test_no_path_reports_the_stack_only(tmp_path):
    rep = report(scenario(tmp_path, "gds_host"), None)
    assert rep["verdict"] == "GDS: not confirmed — no PATH to read; fix: run gdsload doctor PATH"
    assert [c["name"] for c in rep["checks"]] == ["GPU", "KvikIO", "libcufile", "nvidia-fs", "cufile.json",
                                                  "KVIKIO_COMPAT_MODE", "container", "IOMMU", "CUDA queues",
                                                  "NUMA", "nvCOMP", "backend auto"]
    assert check(rep, "NUMA")["ok"] is None  # gds_host has no /proc/driver/nvidia: the GPU's node is unknown
    assert check(rep, "CUDA queues") == {"name": "CUDA queues", "ok": True, "fix": "", "section": "stack",
                                         "found": "CUDA_DEVICE_MAX_CONNECTIONS unset (CUDA's default)"}
    assert check(rep, "nvidia-fs")["found"] == "2.28 loaded, 4 device(s), read counters on"
    assert check(rep, "IOMMU")["found"] == "off: no IOMMU groups (amd_iommu=off)"
    assert rep["filesystem"] is None and rep["o_direct"] is None and rep["aligned"] is None


def test_render_one_screen(tmp_path):
    rep = report(scenario(tmp_path, "container"), "/data/train.gds", kvikio=COMPAT_KVIKIO)
    text = render(rep)
    lines = text.splitlines()
    assert lines[0] == "gdsload doctor: /data/train.gds (dataset)" and lines[-1] == rep["verdict"]
    assert len(lines) <= 30 and {"stack", "path", "live read"} <= set(lines)
    assert "  ✘ nvidia-fs           not loaded (/proc/driver/nvidia-fs is missing)" in lines
    assert "  ✔ filesystem          ext4, data=ordered (no data= option), on NVMe device nvme1n1; ext4 " \
           "/dev/nvme1n1 at /data (rw,relatime,stripe=32)" in lines
    fixes = [i for i, line in enumerate(lines) if line.lstrip().startswith("fix: ")]
    assert len(fixes) == sum(1 for c in rep["checks"] if c["ok"] is not True and c["fix"]) > 0
    assert all(lines[i - 1][2] in "✘–" for i in fixes)


def numa_host(tmp_path, cpus: str, env: dict | None = None) -> SystemFiles:
    """The 2-socket fixture with this process allowed to run on ``cpus`` (its /proc/self/status)."""
    files = scenario(tmp_path, "numa_2socket", env)
    with open(files.path("/proc/self/status"), "w") as f:
        f.write(f"Name:\tpython3\nCpus_allowed_list:\t{cpus}\n")
    return files


def test_numa_mismatch_is_a_warning_not_a_reason(tmp_path):
    on_node = report(numa_host(tmp_path / "a", "56-111,168-223", {"CUDA_VISIBLE_DEVICES": "5"}), None)
    off_node = report(numa_host(tmp_path / "b", "0-63", {"CUDA_VISIBLE_DEVICES": "5"}), None)
    assert check(on_node, "NUMA")["ok"] is True and "may run on only its node's CPUs" in check(on_node, "NUMA")["found"]
    assert check(off_node, "NUMA") == {
        "name": "NUMA", "ok": False, "section": "stack",
        "found": "GPU 5 (0000:ab:00.0) is on NUMA node 1 (CPUs 56-111,168-223); this process may run on CPUs 0-63: "
                 "8 of the node's, 56 on node 0; GPUs by node: node 0: 0-3, node 1: 4-7; gdsload binds its reader "
                 "threads and pinned buffers to the 8 of node 1's CPUs it may use (56-63), not the rest of the process",
        "fix": "run this rank on its GPU's node: numactl --cpunodebind=1 --membind=1 ... (or taskset -c "
               "56-111,168-223 ...)"}
    assert off_node["verdict"] == on_node["verdict"] and off_node["reasons"] == on_node["reasons"]
    assert off_node["gds_available"] == on_node["gds_available"]
    assert not any(r.startswith("NUMA") for r in off_node["reasons"])
    lines = render(off_node).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("  ✘ NUMA "))
    assert lines[i + 1].strip().startswith("fix: run this rank on its GPU's node: numactl --cpunodebind=1")


def test_numa_line_for_gpus_on_either_node(tmp_path):
    other = report(numa_host(tmp_path / "a", "0-55"), None)  # GPU 0 is on node 0: no mismatch
    assert check(other, "NUMA")["ok"] is True
    wrong = report(numa_host(tmp_path / "b", "0-55", {"CUDA_VISIBLE_DEVICES": "7"}), None)
    assert check(wrong, "NUMA")["found"].endswith("this process may run on CPUs 0-55 (node 0 only); GPUs by node: "
                                                  "node 0: 0-3, node 1: 4-7; gdsload cannot place its reader threads "
                                                  "and pinned buffers on node 1: none of its CPUs is allowed")

    class ProbedBus(Machine):  # CuPy told the doctor its device's bus id: it wins over CUDA_VISIBLE_DEVICES
        def gpu(self) -> dict:
            return dict(super().gpu(), pci_bus_id="00000000:2A:00.0")

    files = numa_host(tmp_path / "c", "56-111", {"CUDA_VISIBLE_DEVICES": "7"})
    rep = diagnose(gather(None, files, ProbedBus(files.root)))
    assert check(rep, "NUMA")["found"].startswith("GPU 1 (0000:2a:00.0) is on NUMA node 0")
    assert check(rep, "NUMA")["ok"] is False


def test_numa_line_on_a_one_node_host(tmp_path):
    rep = report(scenario(tmp_path, "numa_1node"), None)
    assert check(rep, "NUMA") == {"name": "NUMA", "ok": None, "found": "one NUMA node: nothing to place", "fix": "",
                                  "section": "stack"}
    assert "  – NUMA                one NUMA node: nothing to place" in render(rep).splitlines()


# -- this machine ----------------------------------------------------------------------------------
def kernel_mount(path: str) -> tuple[str, str]:
    """The file system type and mount point the kernel reports for ``path`` (findmnt, util-linux)."""
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "--target", path], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], out[1]


def kernel_o_direct(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


@pytest.fixture(params=["tmp", "shm"])
def dataset_dir(request, tmp_path):
    """A directory for a test dataset: pytest's tmp_path, and one in /dev/shm (tmpfs) where there is one."""
    if request.param == "tmp":
        yield str(tmp_path)
        return
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="gdsload-doctor-")
    try:
        yield d
    finally:
        shutil.rmtree(d)


def test_doctor_on_this_machine(dataset_dir):
    path = os.path.join(dataset_dir, "d.gds")
    write_dataset(path, {"x": ArraySource("<x>", np.arange(8000, dtype=np.float32).reshape(1000, 8))},
                  block_bytes=8192, progress=False)
    res = subprocess.run([sys.executable, "-m", "gdsload", "doctor", path, "--json"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    real = os.path.realpath(path)
    fstype, mount_point = kernel_mount(real)
    st = os.stat(real)
    assert rep["filesystem"]["type"] == fstype and rep["filesystem"]["mount_point"] == mount_point
    assert rep["filesystem"]["dev"] == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    with DatasetLayout(read_metadata(real)) as layout:
        first = layout.shard_paths()[0]
    assert rep["o_direct"] is kernel_o_direct(first) and o_direct_read(first)[0] is rep["o_direct"]
    assert rep["aligned"] is True and rep["kind"] == "dataset"
    assert rep["verdict"].startswith("GDS: ") and {c["name"] for c in rep["checks"]} >= {"filesystem", "O_DIRECT"}
    text = subprocess.run([sys.executable, "-m", "gdsload", "doctor", path], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert text.returncode == 0 and text.stdout.splitlines()[-1] == rep["verdict"]


def test_unaligned_dataset_and_plain_file(make_dataset, tmp_path):
    path = make_dataset({"x": np.zeros((300, 7), np.uint8)}, samples_per_block=10)

    def doctor_json(p: str, resident_bytes: int | None = None) -> dict:
        out = io.StringIO()
        assert main(p, as_json=True, probes=HostProbes(resident_bytes), out=out) == 0
        return json.loads(out.getvalue())

    small = doctor_json(path)  # a field this small is read whole at open: its blocks are never read singly
    assert small["aligned"] is False and check(small, "alignment")["ok"] is None
    assert "read whole at open (at most resident_bytes=67108864)" in check(small, "alignment")["found"]
    rep = doctor_json(path, resident_bytes=0)  # as a dataset opened with resident_bytes=0 reads it
    align = check(rep, "alignment")
    assert rep["aligned"] is False and align["ok"] is False and "array 'x': 30 of 30 blocks unaligned" in align["found"]
    assert "multiple of 4 KiB" in align["fix"]
    assert "alignment" not in [r.split(":")[0] for r in rep["reasons"]]  # slower through bounce buffers, still GDS
    plain = tmp_path / "blob.bin"
    plain.write_bytes(b"\0" * 10000)
    rep = doctor_json(str(plain))
    assert rep["kind"] == "file" and rep["aligned"] is False and check(rep, "alignment")["ok"] is None


@pytest.mark.parametrize("make, message", [
    (lambda tmp: str(tmp / "missing.gds"), "{path}: does not exist"),
    (lambda tmp: str(tmp), "{path}: not a readable gdsload dataset ({path}/zarr.json: missing"),
])
def test_bad_path_exit_2(tmp_path, make, message):
    path = make(tmp_path)
    res = subprocess.run([sys.executable, "-m", "gdsload", "doctor", path], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("gdsload doctor: error: " + message.format(path=path))


def test_cufile_version_decoding():
    class Lib:
        """Stands in for a loaded libcufile: cuFileGetVersion writes 1000 * major + 10 * minor."""

        @staticmethod
        def cuFileGetVersion(ref):
            ref.contents.value = 1150
            return type("CUfileError", (), {"err": 0})()

    assert cufile_version(Lib()) == "1.15"
    assert cufile_version(object()) is None  # a libcufile older than cuFileGetVersion


def test_auto_is_asked_with_the_datasets_size(tmp_path):
    """The doctor's "backend auto" must be what GDSDataset would pick for this dataset: auto's RAM tier
    depends on the dataset's size, so the doctor passes it (it asked without one, and could disagree)."""
    files = scenario(tmp_path, "gds_host")
    machine = Machine(files.root)
    gather("/data/train.gds", files, machine)
    assert machine.asked_bytes == 3 << 30
    gather(None, files, machine)
    assert machine.asked_bytes is None


def test_alignment_calls_small_what_gdsdataset_holds_whole(tmp_path):
    """The doctor judged a field "read whole at open" by block bytes times the dataset's blocks; GDSDataset
    holds whole by its chunks. In a foreign store whose chunks are smaller than the block they disagreed."""
    import zarr

    path = str(tmp_path / "s.zarr")
    g = zarr.create_group(path)
    g.create_array("a", shape=(700, 1000), dtype="uint8", chunks=(7, 1000), compressors=None)[:] = 1
    g.create_array("b", shape=(700, 1024), dtype="uint8", chunks=(64, 1024), compressors=None)[:] = 2
    out = io.StringIO()
    assert main(path, as_json=True, probes=HostProbes(resident_bytes=100_000), out=out) == 0  # 'a': 700,000 bytes
    found = check(json.loads(out.getvalue()), "alignment")
    assert found["ok"] is False and "array 'a'" in found["found"] and "read whole" not in found["found"]


def test_the_nvcomp_line_says_where_zstd_chunks_decode(tmp_path):
    """nvCOMP loaded: its version and file, zstd on the GPU. Missing or switched off: a neutral line saying zstd
    decodes on CPU threads, with the extra to install; never a reason GDS is not used."""
    files = scenario(tmp_path, "gds_host")
    line = check(report(files, None), "nvCOMP")
    assert line["ok"] is True and line["found"].startswith("6.0.0 (/venv/") and "on the GPU" in line["found"]
    for info, fix in (({"nvcomp": None, "nvcomp_error": "libnvcomp.so.6 not found"}, "pip install 'gdsload[nvcomp]'"),
                      ({"nvcomp": None, "nvcomp_error": "switched off (GDSLOAD_NVCOMP=0)"}, "unset GDSLOAD_NVCOMP")):
        machine = Machine(files.root)
        machine.nvcomp_info = info
        rep = diagnose(gather(None, files, machine))
        line = check(rep, "nvCOMP")
        assert line["ok"] is None and info["nvcomp_error"] in line["found"] and "CPU threads" in line["found"]
        assert line["fix"].startswith(fix) and not any(r.startswith("nvCOMP") for r in rep["reasons"])
        assert f"fix: {fix}" in render(rep)


def test_nvcomp_is_described_from_its_library_properties():
    """libnvcomp's version comes from nvcompGetProperties (major * 1000 + minor * 100 + patch)."""
    from types import SimpleNamespace

    from gdsload.codecs.nvcomp_lib import ZstdLib, describe

    def properties(ref):
        ref.contents.version, ref.contents.cudart_version = 6012, 13040
        return 0

    def alignments(opts, ref):
        ref.contents.input, ref.contents.output, ref.contents.temp = 1, 1, 8
        return 0

    fns = {"nvcompGetProperties": properties, "nvcompBatchedZstdDecompressGetRequiredAlignments": alignments,
           "nvcompBatchedZstdDecompressGetTempSize": lambda *a: 0, "nvcompBatchedZstdDecompressAsync": lambda *a: 0}
    lib = ZstdLib(SimpleNamespace(**fns), "/x/libnvcomp.so.6")
    assert (lib.version, lib.path, lib.alignments) == ("6.0.12", "/x/libnvcomp.so.6", (1, 1, 8))
    assert describe(lib) == {"nvcomp": "6.0.12", "path": "/x/libnvcomp.so.6"}
    assert describe(None)["nvcomp"] is None and "not found" in describe(None)["nvcomp_error"]
    assert describe(lib, switched_off=True)["nvcomp_error"] == "switched off (GDSLOAD_NVCOMP=0)"


def test_the_library_file_is_the_one_the_loader_took_the_function_from():
    """``loaded_from`` asks the dynamic loader (dladdr) where a function came from: libc's printf, here."""
    import ctypes
    import os

    from gdsload.codecs.nvcomp_lib import loaded_from

    path = loaded_from(ctypes.CDLL(None).printf)
    assert os.path.isfile(path) and "libc" in os.path.basename(path), path

