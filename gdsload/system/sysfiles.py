"""The system files ``gdsload doctor`` reads, and what they say about GPUDirect Storage.

Parsing is pure: every function but :class:`SystemFiles`'s methods takes file contents and returns a value, so
tests drive it with recorded files. :class:`SystemFiles` is the one thin layer that reads files and environment
variables below a root directory (``SystemFiles("tests/fixtures/doctor/xfs")``). Formats: mountinfo, proc(5);
nvidia-fs stats, ``nvfs_stats_show`` in NVIDIA/gds-nvidia-fs ``src/nvfs-stat.c`` and the GDS troubleshooting
guide; the file systems GDS reads directly, :func:`fs_support`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

NVFS_DIR = "/proc/driver/nvidia-fs"
NVFS_STATS = NVFS_DIR + "/stats"
NVFS_RW_STATS_PARAM = "/sys/module/nvidia_fs/parameters/rw_stats_enabled"
DEFAULT_CUFILE_JSON = "/etc/cufile.json"


class SystemFiles:
    """Files and environment variables, read below ``root`` (``/`` for this machine). Every read returns
    None / False / [] for a file that is missing or unreadable: the doctor reports absence, it never fails
    on it."""

    def __init__(self, root: str = "/", env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.env = dict(os.environ if env is None else env)

    def path(self, name: str) -> str:
        """Where the absolute path ``name`` lies below the root."""
        return os.path.join(self.root, name.lstrip("/"))

    def read(self, name: str) -> str | None:
        try:
            with open(self.path(name), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path(name))

    def listdir(self, name: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(name)))
        except OSError:
            return []

    def readable_dir(self, name: str) -> bool:
        """A directory this process may list and enter (KvikIO's test of ``/run/udev``)."""
        p = self.path(name)
        return os.path.isdir(p) and os.access(p, os.R_OK | os.X_OK)

    def getenv(self, name: str) -> str | None:
        return self.env.get(name)


# -- mountinfo -------------------------------------------------------------------------------------
class Mount(NamedTuple):
    """One line of /proc/self/mountinfo, escapes decoded."""

    mount_id: int
    parent_id: int
    dev: str  # "major:minor"
    root: str
    mount_point: str
    options: str  # per-mount options
    optional: tuple[str, ...]  # "shared:1", "master:2", ...
    fstype: str
    source: str
    super_options: str  # per-superblock options (ext4's data=, NFS's proto=)

    def all_options(self) -> list[str]:
        """Per-mount then superblock options, each once."""
        seen: list[str] = []
        for o in (self.options + "," + self.super_options).split(","):
            if o and o not in seen:
                seen.append(o)
        return seen


_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """Decode the kernel's octal escapes (``\\040`` space, ``\\011`` tab, ``\\012`` newline, ``\\134``
    backslash)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str, where: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every mount, in file order. Raises ValueError naming ``where`` and the line for a malformed line."""
    mounts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        f = line.split(" ")
        sep = f.index("-", 6) if "-" in f[6:] else -1
        if sep < 0 or len(f) < sep + 3 or not f[0].isdigit() or not f[1].isdigit():
            raise ValueError(f"{where}:{lineno}: not a mountinfo line (expected 'ID PARENT MAJ:MIN ROOT "
                             f"MOUNTPOINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPEROPTIONS'): {line[:120]!r}")
        mounts.append(Mount(int(f[0]), int(f[1]), f[2], unescape(f[3]), unescape(f[4]), f[5], tuple(f[6:sep]),
                            unescape(f[sep + 1]), unescape(f[sep + 2]),
                            unescape(f[sep + 3]) if len(f) > sep + 3 else ""))
    return mounts


def find_mount(mounts: list[Mount], path: str) -> Mount | None:
    """The mount that holds the absolute, resolved ``path``: the longest mount point that is ``path`` or a
    parent directory of it; of equal ones the last listed (mounted on top)."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if mp == "/" or path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


def option(options: list[str], key: str) -> str | None:
    """The value of ``key=value`` in a mount's options; "" for a bare ``key``; None if absent."""
    for o in options:
        k, eq, v = o.partition("=")
        if k == key:
            return v if eq else ""
    return None


def devname_from_uevent(text: str | None) -> str | None:
    """``DEVNAME=`` of a /sys/dev/block/MAJ:MIN/uevent file."""
    for line in (text or "").splitlines():
        if line.startswith("DEVNAME="):
            return line[len("DEVNAME="):].strip() or None
    return None


def mount_device(m: Mount, files: SystemFiles) -> str | None:
    """The kernel's name of the block device under a mount ("nvme0n1p1", "dm-0"), from
    /sys/dev/block/MAJ:MIN (right also for /dev/root and /dev/mapper names); None for a mount without
    one (tmpfs, NFS, overlay)."""
    if not m.dev.startswith("0:"):
        name = devname_from_uevent(files.read(f"/sys/dev/block/{m.dev}/uevent"))
        if name:
            return name
    if m.source.startswith("/dev/") and m.source != "/dev/root":
        return m.source[len("/dev/"):]
    return None


# -- which file systems GDS reads directly ---------------------------------------------------------
class FsSupport(NamedTuple):
    """Whether GDS can DMA between this mount and GPU memory: True, False (cuFile reads it in its compat
    mode, through host bounce buffers), None (cannot tell); what it is, and the fix when False."""

    gds: bool | None
    what: str
    fix: str


_LOCAL_FIX = "put the dataset on an NVMe device formatted ext4 (data=ordered) or xfs"
# GDS DMAs straight into GPU memory only on these storage stacks. Sources:
# * nvidia-fs driver, "Key Features": NVMe and NVMe-oF block storage; EXT4 in ordered mode on NVMe and
#   NVMe-oF; XFS on NVMe and NVMe-oF; NFS over RDMA with MOFED 5.1 and later; RDMA-capable distributed
#   file systems, including DDN EXAScaler (Lustre), WekaFS, VAST, IBM Spectrum Scale and BeeGFS:
#   https://docs.nvidia.com/gpudirect-storage/nvidia_fs/index.html
#   (also https://github.com/NVIDIA/gds-nvidia-fs README: "XFS and EXT4 filesystem in ordered mode on
#   NVMe/NVMeOF/ScaleFlux CSD devices"; the support matrix referenced from the release notes,
#   https://docs.nvidia.com/gpudirect-storage/release-notes/index.html).
# * ext4 data=journal does not support O_DIRECT at all (kernel commit 56889787cfa7, "ext4: improve
#   handling of conflicting mount options"), and GDS lists only ordered mode.
# Everything else goes through cuFile's compat mode: tmpfs, overlayfs, ZFS, Btrfs, FUSE, virtio disks and
# NFS over TCP have no path for a device to DMA into GPU memory.
_NETWORK_GDS = {"lustre": "Lustre (DDN EXAScaler)", "gpfs": "IBM Spectrum Scale (GPFS)",
                "mmfs": "IBM Spectrum Scale (GPFS)", "wekafs": "WekaFS", "beegfs": "BeeGFS", "fhgfs": "BeeGFS"}
_COMPAT_ONLY = {
    "tmpfs": ("tmpfs (RAM)", "the files are in RAM already: read them with backend='mmap', or copy them "
                             "to an NVMe ext4/xfs mount for GDS"),
    "ramfs": ("ramfs (RAM)", "the files are in RAM already: read them with backend='mmap'"),
    "overlay": ("overlayfs (a container's own file system)", "bind-mount the host directory holding the "
                "dataset into the container (docker run -v /nvme/data:/data), so it is read through the "
                "host's ext4/xfs"),
    "zfs": ("ZFS (checksums and copies data in the kernel)", _LOCAL_FIX),
    "btrfs": ("Btrfs (checksums and copies data in the kernel)", _LOCAL_FIX),
    "squashfs": ("squashfs (compressed)", _LOCAL_FIX),
}


def block_device_support(device: str | None, md_level: str | None = None) -> tuple[bool | None, str]:
    """Whether GDS reads a block device directly, by its kernel name, and what it is."""
    if not device:
        return None, "block device unknown"
    name = device.rsplit("/", 1)[-1]
    if name.startswith("nvme"):
        return True, f"NVMe device {name}"
    if name.startswith("md"):
        return md_level == "raid0", f"md RAID {md_level or '(level unknown)'} {name} (GDS: RAID 0 of NVMe only)"
    kinds = (("vd", "virtio disk"), ("xvd", "Xen virtual disk"), ("sd", "SCSI/SATA disk"),
             ("dm-", "device-mapper volume (LVM, dm-crypt)"), ("loop", "loop device"))
    for prefix, what in kinds:
        if name.startswith(prefix):
            return False, f"{what} {name}"
    return None, f"block device {name} (not one GDS names)"


def fs_support(fstype: str, options: list[str], device: str | None, md_level: str | None = None) -> FsSupport:
    """Whether GDS can read files of this mount directly (see the sources above). ``options``: the mount's
    per-mount and superblock options; ``device``: the kernel's block device name, if any."""
    if fstype in ("ext4", "xfs"):
        data = option(options, "data") if fstype == "ext4" else None
        if data is not None and data != "ordered":
            return FsSupport(False, f"ext4 mounted data={data}: GDS supports ext4 only in data=ordered mode",
                             "mount it with -o data=ordered (the data mode cannot change on remount: unmount "
                             "and mount again, and fix the data= option in /etc/fstab)")
        ok, what = block_device_support(device, md_level)
        mode = "" if fstype == "xfs" else "data=ordered, " if data else "data=ordered (no data= option), "
        if ok:
            return FsSupport(True, f"{fstype}, {mode}on {what}", "")
        return FsSupport(ok, f"{fstype} on {what}: GDS reads ext4/xfs directly only on NVMe or NVMe-oF",
                         _LOCAL_FIX if ok is False else "check the device is NVMe (lsblk -o NAME,TRAN)")
    if fstype in ("nfs", "nfs4"):
        if option(options, "proto") == "rdma" or option(options, "rdma") is not None:
            return FsSupport(True, f"{fstype} over RDMA (proto=rdma): needs the NFS/RDMA client of MOFED/DOCA", "")
        proto = option(options, "proto") or "tcp"
        return FsSupport(False, f"{fstype} over {proto}: GDS reads NFS directly only over RDMA",
                         "mount with -o proto=rdma,port=20049 (an RDMA NIC and an NFS/RDMA server), or copy "
                         "the dataset to local NVMe")
    if fstype in _NETWORK_GDS:
        return FsSupport(True, f"{_NETWORK_GDS[fstype]}: needs the vendor's GDS-enabled client", "")
    if fstype in _COMPAT_ONLY:
        what, fix = _COMPAT_ONLY[fstype]
        return FsSupport(False, f"{what}: cuFile reads it only in compat mode", fix)
    if fstype.startswith("fuse") or fstype == "fuseblk":
        return FsSupport(False, f"FUSE ({fstype}): data passes through a user-space daemon, compat mode only",
                         _LOCAL_FIX)
    return FsSupport(False, f"{fstype} is not among the file systems GDS reads directly (ext4 data=ordered or "
                            "xfs on NVMe, NFS over RDMA, Lustre, GPFS, WekaFS, BeeGFS)", _LOCAL_FIX)


# -- cufile.json -----------------------------------------------------------------------------------
def mount_support(m: Mount, files: SystemFiles) -> tuple[str | None, FsSupport]:
    """A mount's block device name and whether GDS reads files on it directly."""
    device = mount_device(m, files)
    md_level = files.read(f"/sys/block/{device}/md/level") if (device or "").startswith("md") else None
    return device, fs_support(m.fstype, m.all_options(), device, md_level.strip() if md_level else None)


def path_support(path: str, files: SystemFiles | None = None) -> FsSupport | None:
    """Whether GDS reads the file at ``path`` directly, from the mount that holds it (None when the mount
    cannot be found). The one rule the doctor, backend ``auto`` and the kvikio backend's ``io_mode`` use."""
    return paths_support([path], files)[0]


def paths_support(paths: list[str], files: SystemFiles | None = None) -> list[FsSupport | None]:
    """:func:`path_support` of each of ``paths``, with the mount table read once and each mount judged once
    (a dataset's files are many, its mounts few)."""
    files = files or SystemFiles()
    try:
        mounts = parse_mountinfo(files.read("/proc/self/mountinfo") or "")
    except ValueError:
        return [None] * len(paths)
    judged: dict[int, FsSupport] = {}
    out: list[FsSupport | None] = []
    for path in paths:
        m = find_mount(mounts, os.path.realpath(path))
        if m is not None and id(m) not in judged:
            judged[id(m)] = mount_support(m, files)[1]
        out.append(None if m is None else judged[id(m)])
    return out


def strip_json_comments(text: str) -> str:
    """JSON text without // and /* */ comments (cufile.json carries them) and without trailing commas
    before } or ]; text inside strings is kept as it is."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    return re.sub(r",(\s*[}\]])", r"\1", "".join(out))


def parse_cufile_json(text: str, where: str) -> dict:
    """A cufile.json's settings as a dict; ValueError naming ``where`` if it is not JSON (once comments
    are removed) or not an object."""
    try:
        cfg = json.loads(strip_json_comments(text))
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON once comments are removed ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def cufile_settings(cfg: dict) -> dict:
    """The keys of a cufile.json that decide between GDS and compat mode (None: not set, cuFile's
    default applies)."""
    props = cfg.get("properties")
    props = props if isinstance(props, dict) else {}
    return {k: props.get(k) for k in ("allow_compat_mode", "force_compat_mode", "use_pci_p2pdma",
                                      "max_direct_io_size_kb")}


def cufile_json_path(env: Mapping[str, str | None]) -> tuple[str, str]:
    """The cufile.json cuFile reads, and why: ``CUFILE_ENV_PATH_JSON`` if set, else /etc/cufile.json."""
    p = env.get("CUFILE_ENV_PATH_JSON")
    return (p, "CUFILE_ENV_PATH_JSON") if p else (DEFAULT_CUFILE_JSON, "default")


# -- nvidia-fs -------------------------------------------------------------------------------------
class NvfsStats(NamedTuple):
    """What /proc/driver/nvidia-fs/stats says: read counters are None while the driver's
    ``rw_stats_enabled`` parameter is 0 (then the file has no ``n=`` on its Reads line)."""

    io_stats: bool | None  # the "IO stats: Enabled/Disabled" line
    reads: int | None  # Reads n=
    reads_ok: int | None
    read_errors: int | None
    read_mib: int | None  # Reads readMiB=
    driver: str | None


def parse_nvfs_stats(text: str) -> NvfsStats:
    """Parse the nvidia-fs stats file (format: ``nvfs_stats_show`` in src/nvfs-stat.c, see above)."""
    counters: dict[str, str] = {}
    io_stats = driver = None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        key = key.strip()
        if key == "Reads":
            counters.update(re.findall(r"([A-Za-z_]+)=(\d+)", rest))
        elif key == "IO stats":
            io_stats = rest.strip().lower().startswith("enabled")
        m = re.match(r"NVFS Driver\(version: ([0-9.:]+)\)", line.strip())
        if m:
            driver = m.group(1).replace(":", ".")

    def num(k: str) -> int | None:
        return int(counters[k]) if k in counters else None

    return NvfsStats(io_stats, num("n"), num("ok"), num("err"), num("readMiB"), driver)


def nvfs_version(text: str | None) -> str | None:
    """The ``version: 2.28`` line of /proc/driver/nvidia-fs/version."""
    m = re.search(r"version:\s*([0-9.]+)", text or "")
    return m.group(1) if m else None


# -- IOMMU -----------------------------------------------------------------------------------------
class Iommu(NamedTuple):
    mode: str  # "off", "passthrough", "translated"
    why: str


def iommu_mode(cmdline: str | None, group_types: list[str], has_groups: bool) -> Iommu:
    """The IOMMU's mode from the kernel command line (``iommu=``, ``intel_iommu=``, ``amd_iommu=``) and
    /sys/kernel/iommu_groups (groups exist only with an active IOMMU; each group's ``type`` is
    ``identity`` for passthrough, ``DMA``/``DMA-FQ`` for translated)."""
    args = [a for a in (cmdline or "").split() if a.split("=")[0] in ("iommu", "intel_iommu", "amd_iommu")]
    said = " ".join(args) or "no iommu option on the kernel command line"
    if not has_groups:
        return Iommu("off", f"no IOMMU groups ({said})")
    if group_types:
        translated = [t for t in group_types if t.startswith("DMA")]
        mode = "translated" if translated else "passthrough"
        return Iommu(mode, f"{len(group_types)} IOMMU group(s), types {', '.join(sorted(set(group_types)))} ({said})")
    values = {a.split("=", 1)[-1] for a in args}
    return Iommu("passthrough" if "pt" in values else "translated", f"IOMMU groups present ({said})")


def kvikio_compat_env(value: str | None) -> str:
    """``KVIKIO_COMPAT_MODE`` as KvikIO reads it: "on", "off", "auto" (also when unset), or "invalid"
    (KvikIO's docs/source/runtime_settings.rst: ON/TRUE/YES/1, OFF/FALSE/NO/0, AUTO; case-insensitive)."""
    if value is None:
        return "auto"
    v = value.strip().upper()
    if v in ("ON", "TRUE", "YES", "1"):
        return "on"
    if v in ("OFF", "FALSE", "NO", "0"):
        return "off"
    return "auto" if v == "AUTO" else "invalid"
