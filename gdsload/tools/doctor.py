"""``gdsload doctor [PATH] [--json]``: whether GPUDirect Storage serves PATH and, if not, the first reason and fix.

:func:`gather` collects :class:`Facts` through a :class:`~gdsload.system.sysfiles.SystemFiles` and a probes
object (:class:`~gdsload.tools.doctor_probe.HostProbes`); the pure :func:`checks` and :func:`diagnose` turn them
into checks and a verdict; :func:`render` prints one screen. "GDS: active" is said only when observed: the
nvidia-fs driver's read counters rose during the live read.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..backends.registry import io_mode as backend_io_mode
from .doctor_probe import LIVE_READ_BYTES, HostProbes, LiveRead, PathError, Target
from ..system.env import CONNECTIONS_ENV, CONNECTIONS_FIX, connections_note
from ..errors import printable
from ..remote.objects import is_remote
from ..system.placement import placement_report
from ..system.sysfiles import (NVFS_DIR, NVFS_RW_STATS_PARAM, NVFS_STATS, FsSupport, Iommu, Mount, NvfsStats,
                               SystemFiles, cufile_json_path, cufile_settings, find_mount, iommu_mode,
                               kvikio_compat_env, mount_support, nvfs_version, parse_cufile_json, parse_mountinfo,
                               parse_nvfs_stats)

MARKS = {True: "✔", False: "✘", None: "–"}
_ENV = ("KVIKIO_COMPAT_MODE", "CUFILE_ENV_PATH_JSON", "CUFILE_FORCE_COMPAT_MODE", CONNECTIONS_ENV)
_COUNTERS_FIX = f"echo 1 | sudo tee {NVFS_RW_STATS_PARAM}, then run the doctor again"


@dataclass
class Check:
    """One line of the report. ``ok``: True ✔, False ✘, None – (skipped or for information). ``rank`` orders
    the ✘ lines as reasons GDS is not used (lowest first); 0: never a reason."""

    name: str
    ok: bool | None
    found: str
    fix: str = ""
    rank: int = 0
    section: str = "stack"


@dataclass
class Facts:
    """Everything :func:`gather` observed; the checks are pure functions of it."""

    gpu: dict[str, Any]
    kvikio: dict[str, Any]
    libcufile: dict[str, Any]
    machine: str
    env: dict[str, str | None]
    cufile: dict[str, Any]  # path, source, present, settings, error
    nvfs_loaded: bool
    nvfs_version: str | None
    nvfs_devices: list[str]
    nvfs_stats: NvfsStats | None
    udev_readable: bool
    wsl: bool
    container: str | None
    iommu: Iommu
    backend: tuple[str, str]
    numa: tuple[bool | None, str, str] = (None, "not observed", "")
    nvcomp: dict[str, Any] = field(default_factory=dict)
    target: Target | None = None
    mount: Mount | None = None
    mount_error: str | None = None
    device: str | None = None
    fs: FsSupport | None = None
    o_direct: tuple[bool, str] | None = None
    live: LiveRead | None = None
    live_skipped: str | None = None
    nvfs_after: NvfsStats | None = None


def _stats(files: SystemFiles) -> NvfsStats | None:
    text = files.read(NVFS_STATS)
    return parse_nvfs_stats(text) if text is not None else None


def _container(files: SystemFiles, mounts: list[Mount]) -> str | None:
    """A hint that this process runs in a container, or None."""
    if files.exists("/.dockerenv"):
        return "docker (/.dockerenv)"
    if files.exists("/run/.containerenv"):
        return "podman (/run/.containerenv)"
    if files.getenv("KUBERNETES_SERVICE_HOST"):
        return "kubernetes (KUBERNETES_SERVICE_HOST)"
    root = find_mount(mounts, "/")
    return "a container (/ is overlayfs)" if root is not None and root.fstype == "overlay" else None


def gather(path: str | None, files: SystemFiles, probes: Any) -> Facts:
    """Observe the machine (through ``files`` and ``probes``) and PATH; PathError for a bad PATH, raised
    before anything slow runs."""
    target = probes.inspect(path) if path is not None else None
    gpu = probes.gpu()
    kvikio = probes.kvikio(bool(gpu.get("gpu")))
    env = {k: files.getenv(k) for k in _ENV}
    cj_path, cj_source = cufile_json_path(env)
    cj_text = files.read(cj_path)
    cufile: dict[str, Any] = {"path": cj_path, "source": cj_source, "present": cj_text is not None,
                              "settings": {}, "error": None}
    try:
        cufile["settings"] = cufile_settings(parse_cufile_json(cj_text, cj_path)) if cj_text is not None else {}
    except ValueError as e:
        cufile["error"] = str(e)
    mounts: list[Mount] = []
    mount_error = None
    try:
        mounts = parse_mountinfo(files.read("/proc/self/mountinfo") or "")
    except ValueError as e:
        mount_error = str(e)
    groups = files.listdir("/sys/kernel/iommu_groups")
    types = [t.strip() for t in (files.read(f"/sys/kernel/iommu_groups/{g}/type") for g in groups) if t]
    stats = _stats(files)
    facts = Facts(
        gpu=gpu, kvikio=kvikio, libcufile=probes.libcufile(), machine=probes.machine(), env=env, cufile=cufile,
        nvfs_loaded=files.exists(NVFS_DIR),
        nvfs_version=nvfs_version(files.read(NVFS_DIR + "/version")) or (stats.driver if stats else None),
        nvfs_devices=[d for d in files.listdir("/dev") if d.startswith("nvidia-fs")], nvfs_stats=stats,
        udev_readable=files.readable_dir("/run/udev"),
        wsl="microsoft" in (files.read("/proc/sys/kernel/osrelease") or "").lower(),
        container=_container(files, mounts),
        iommu=iommu_mode(files.read("/proc/cmdline"), types, bool(groups)), backend=_auto(probes, target),
        numa=placement_report(files, gpu.get("pci_bus_id")), target=target, mount_error=mount_error,
        nvcomp=probes.nvcomp())
    if target is None:
        return facts
    facts.mount = find_mount(mounts, target.real)
    if facts.mount is None and mount_error is None:
        facts.mount_error = f"no mount in /proc/self/mountinfo holds {target.real}"
    if facts.mount is not None:
        facts.device, facts.fs = mount_support(facts.mount, files)
    if target.files:
        facts.o_direct = probes.o_direct(target.files[0])
    if not gpu.get("gpu"):
        facts.live_skipped = "no GPU"
    elif not kvikio.get("kvikio"):
        facts.live_skipped = "KvikIO not installed"
    elif not target.files:
        facts.live_skipped = "the dataset has no shard files"
    else:
        facts.live = probes.live_read(target.files, LIVE_READ_BYTES)
        facts.nvfs_after = _stats(files)
    return facts


# -- checks ----------------------------------------------------------------------------------------
def _gpu_check(f: Facts) -> Check:
    g = f.gpu
    if not g.get("gpu"):
        return Check("GPU", False, f"none ({g.get('reason', 'CuPy sees no device')})",
                     "GDS needs an NVIDIA GPU and CuPy here: pip install 'gdsload[gpu]'; in a container, start "
                     "it with --gpus all", rank=10)
    return Check("GPU", True, f"{g['gpu']}, driver CUDA {g.get('driver')}, runtime {g.get('cuda_runtime')}, "
                              f"CuPy {g.get('cupy')}")


def _kvikio_check(f: Facts) -> Check:
    k = f.kvikio
    if not k.get("kvikio"):
        return Check("KvikIO", False, f"not installed ({k.get('kvikio_error', 'import failed')})",
                     "pip install 'gdsload[gpu]' (CUDA 13) or 'gdsload[gpu-cu12]'", rank=20)
    if "io_mode" not in k:
        return Check("KvikIO", None, f"{k['kvikio']} installed; not asked without a GPU")
    if k["io_mode"] == "gds":
        return Check("KvikIO", True, f"{k['kvikio']}: cuFile driver reports GDS, compat mode not preferred")
    errors = "; ".join(str(k[e]) for e in ("gds_error", "compat_mode_error") if k.get(e))
    return Check("KvikIO", False, f"{k['kvikio']}: compat mode (cuFile driver reports GDS: "
                                  f"{k.get('is_gds_available')}, compat mode preferred: "
                                  f"{k.get('compat_mode_preferred')}){'; ' + errors if errors else ''}",
                 "the other ✘ lines name the causes; if there are none, run gdscheck -p (CUDA's gds/tools) "
                 "and read cufile.log in the working directory", rank=110)


def _nvcomp_check(f: Facts) -> Check:
    n = f.nvcomp
    if n.get("nvcomp"):
        return Check("nvCOMP", True, f"{n['nvcomp']} ({n.get('path')}): GPU backends decode zstd chunks on the GPU")
    why = n.get("nvcomp_error", "not asked")
    fix = ("unset GDSLOAD_NVCOMP" if "GDSLOAD_NVCOMP" in why else
           "pip install 'gdsload[nvcomp]' (CUDA 13) or 'gdsload[nvcomp-cu12]'")
    return Check("nvCOMP", None, f"not loaded ({why}): zstd chunks decode on CPU threads", fix)


def _libcufile_check(f: Facts) -> Check:
    lib = f.libcufile
    if lib.get("path"):
        version = lib.get("version") or "version unknown (no cuFileGetVersion)"
        return Check("libcufile", True, f"{version}: {lib.get('file') or lib['path']}")
    return Check("libcufile", False, f"not found ({lib.get('error')})", "pip install nvidia-cufile (CUDA 13) or "
                 "nvidia-cufile-cu12, or the CUDA toolkit's GDS package: without it KvikIO runs in compat mode",
                 rank=40)


def _nvfs_check(f: Facts) -> Check:
    if not f.nvfs_loaded:
        if f.cufile["settings"].get("use_pci_p2pdma") is True:
            return Check("nvidia-fs", None, "not loaded; cufile.json sets use_pci_p2pdma (the kernel's PCI "
                                            "P2PDMA, no nvidia-fs): no read counters to observe GDS by")
        return Check("nvidia-fs", False, f"not loaded ({NVFS_DIR} is missing)",
                     "load the driver on the host: sudo modprobe nvidia_fs (package nvidia-fs-dkms or "
                     "nvidia-gds); a container shares the host's kernel, so load it there", rank=50)
    version = f.nvfs_version or "version unknown"
    if not f.nvfs_devices:
        return Check("nvidia-fs", False, f"{version} loaded, but no /dev/nvidia-fs* device is visible here",
                     "pass the devices into the container: docker run --device /dev/nvidia-fs0 ... (each "
                     "/dev/nvidia-fs* of the host)", rank=50)
    stats = f.nvfs_stats
    counters = ("read counters on" if stats and stats.reads is not None else
                f"read counters off ({NVFS_RW_STATS_PARAM} is 0): the live read cannot observe GDS")
    return Check("nvidia-fs", True, f"{version} loaded, {len(f.nvfs_devices)} device(s), {counters}")


def _cufile_json_check(f: Facts) -> Check:
    c, s = f.cufile, f.cufile["settings"]
    where = f"{c['path']}" + (" (CUFILE_ENV_PATH_JSON)" if c["source"] != "default" else "")
    force_env = (f.env.get("CUFILE_FORCE_COMPAT_MODE") or "").strip().lower() in ("1", "true", "yes", "on")
    if c["error"]:
        return Check("cufile.json", False, c["error"], "repair the file (// comments are fine)", rank=70)
    if not c["present"] and c["source"] != "default":
        return Check("cufile.json", False, f"{where}: missing", "point CUFILE_ENV_PATH_JSON at an existing "
                                                                "file, or unset it", rank=70)
    if force_env or s.get("force_compat_mode") is True:
        why = "CUFILE_FORCE_COMPAT_MODE is set" if force_env else f"{where} sets properties.force_compat_mode"
        return Check("cufile.json", False, f"{why}: cuFile always uses compat mode",
                     "unset CUFILE_FORCE_COMPAT_MODE / set force_compat_mode to false", rank=70)
    if not c["present"]:
        return Check("cufile.json", True, f"{where}: absent (cuFile's defaults)")
    keys = ", ".join(f"{k}={json.dumps(s.get(k)) if s.get(k) is not None else 'unset'}"
                     for k in ("allow_compat_mode", "use_pci_p2pdma", "max_direct_io_size_kb"))
    note = ("; allow_compat_mode=false: cuFile fails, instead of falling back, where GDS cannot work"
            if s.get("allow_compat_mode") is False else "")
    return Check("cufile.json", True, f"{where}: {keys}{note}")


def _kvikio_env_check(f: Facts) -> Check:
    raw = f.env.get("KVIKIO_COMPAT_MODE")
    mode = kvikio_compat_env(raw)
    if mode == "on":
        return Check("KVIKIO_COMPAT_MODE", False, f"{raw}: KvikIO reads with POSIX calls, never through cuFile",
                     "unset KVIKIO_COMPAT_MODE (or set it to AUTO)", rank=30)
    if mode == "invalid":
        return Check("KVIKIO_COMPAT_MODE", False, f"{raw!r}: not ON, OFF or AUTO", "set ON, OFF or AUTO", rank=30)
    return Check("KVIKIO_COMPAT_MODE", True, "unset (AUTO)" if raw is None else f"{raw} ({mode.upper()})")


def _connections_check(f: Facts) -> Check:
    """Not a reason GDS is unused, but what the training step pays beside any backend (gdsload.system.env)."""
    note = connections_note(f.env)
    if note is not None:
        return Check("CUDA queues", False, note, CONNECTIONS_FIX)
    raw = f.env.get(CONNECTIONS_ENV)
    return Check("CUDA queues", True, f"{CONNECTIONS_ENV} unset (CUDA's default)" if raw is None else
                 f"{CONNECTIONS_ENV}={raw}")


def _numa_check(f: Facts) -> Check:
    """Not a reason GDS is unused (rank 0): where the rank's pinned buffers and reader threads belong."""
    ok, found, fix = f.numa
    return Check("NUMA", ok, found, fix)


def _container_check(f: Facts) -> Check:
    where = f.container or "no container detected"
    if f.wsl:
        return Check("container", False, "WSL: KvikIO's AUTO mode always uses compat mode there",
                     "run on Linux directly for GDS", rank=60)
    if not f.udev_readable:
        return Check("container", False, f"{where}; /run/udev not readable: KvikIO's AUTO mode falls back to "
                                          "compat mode, and cuFile looks block devices up there",
                     "start the container with --volume /run/udev:/run/udev:ro", rank=60)
    return Check("container", True, f"{where}; /run/udev readable")


def _iommu_check(f: Facts) -> Check:
    mode, why = f.iommu
    if mode == "off":
        return Check("IOMMU", True, f"off: {why}")
    if mode == "passthrough":
        return Check("IOMMU", True, f"passthrough: {why} (NVIDIA: supported on some platforms, off is safest)")
    if f.machine == "aarch64":
        return Check("IOMMU", True, f"translated: {why} (Grace platforms want it on for GDS)")
    return Check("IOMMU", False, f"translated: {why}; PCIe peer traffic goes through the CPU's root ports",
                 "add amd_iommu=off or intel_iommu=off (or iommu=off) to the kernel command line (NVIDIA's GDS "
                 "installation guide)", rank=100)


def _path_checks(f: Facts) -> list[Check]:
    t = f.target
    assert t is not None
    out = []
    if f.mount is None or f.fs is None:
        out.append(Check("filesystem", False, f.mount_error or "unknown",
                         "check that /proc/self/mountinfo is readable here", rank=80))
    else:
        m, fs = f.mount, f.fs
        opts = ",".join(o if len(o) <= 40 else o.partition("=")[0] + "=…" for o in m.all_options())
        where = f"{m.fstype} {m.source} at {m.mount_point} ({opts})"
        refuse = ("; allow_compat_mode=false, so cuFile refuses it" if fs.gds is False
                  and f.cufile["settings"].get("allow_compat_mode") is False else "")
        out.append(Check("filesystem", fs.gds, f"{fs.what}{refuse}; {where}", fs.fix,
                         rank=80 if fs.gds is False else 0))
    if f.o_direct is None:
        out.append(Check("O_DIRECT", None, "no file to open"))
    else:
        ok, said = f.o_direct
        out.append(Check("O_DIRECT", ok, said, "" if ok else "GDS needs O_DIRECT: keep the dataset on a file "
                                                             "system that allows it (ext4 or xfs on NVMe)", rank=90))
    out.append(Check("alignment", t.align_ok, t.align_note, "" if t.align_ok is not False else
                     "rewrite with gdsload shard --block-bytes set to a multiple of 4 KiB (and a sample size that "
                     "divides it): cuFile reads unaligned blocks through bounce buffers (slower, still GDS)"))
    return [Check(c.name, c.ok, c.found, c.fix, c.rank, "path") for c in out]


def _auto(probes: Any, target: Target | None) -> tuple[str, str]:
    """What ``auto`` picks for PATH: told the dataset's size (the RAM tier) and where its files lie (GDS)."""
    if target is None:
        return probes.backend()
    return probes.backend(target.nbytes if target.kind == "dataset" else None,
                          target.files[0] if target.files else None)


def _live_check(f: Facts) -> Check:
    live = f.live
    if live is None:
        return Check("live read", None, f"skipped: {f.live_skipped}", section="live")
    rate = (f"{live.nbytes / 2**20:.1f} MiB of {len(live.files)} file(s) in {live.seconds:.3f} s "
            f"({live.nbytes / max(live.seconds, 1e-9) / 1e9:.2f} GB/s)")
    if live.error:
        return Check("live read", False, f"failed after {rate}: {live.error}", "with allow_compat_mode=false "
                     "cuFile refuses files it cannot read directly: see the filesystem line", 130, "live")
    before, after = f.nvfs_stats, f.nvfs_after
    if before is None or after is None:
        if f.kvikio.get("compat_mode_preferred") is True or not f.nvfs_loaded:
            why = ("KvikIO prefers compat mode in this process, so it read with POSIX calls into its bounce "
                   "buffer, not through cuFile" if f.kvikio.get("compat_mode_preferred") is True else
                   "without the nvidia-fs driver cuFile can only use its compat path")
            return Check("live read", False, f"{rate}; compat mode: {why}",
                         "the ✘ lines above name the causes", 135, "live")
        return Check("live read", None, f"{rate}; no nvidia-fs counters to tell GDS from compat mode", section="live")
    if before.reads is None or after.reads is None:
        return Check("live read", None, f"{rate}; nvidia-fs read counters are off", _COUNTERS_FIX, section="live")
    reads, mib = after.reads - before.reads, (after.read_mib or 0) - (before.read_mib or 0)
    if reads > 0:
        return Check("live read", True, f"{rate}; nvidia-fs counted {reads} reads, {mib} MiB: GDS active",
                     section="live")
    return Check("live read", False, f"{rate}; nvidia-fs counted no reads: cuFile used its compat path",
                 "the ✘ lines above name the causes; cuFile's own reason is in cufile.log in the working "
                 "directory", 130, "live")


def checks(f: Facts) -> list[Check]:
    """Every check, in the order shown."""
    out = [_gpu_check(f), _kvikio_check(f), _libcufile_check(f), _nvfs_check(f), _cufile_json_check(f),
           _kvikio_env_check(f), _container_check(f), _iommu_check(f), _connections_check(f),
           _numa_check(f), _nvcomp_check(f)]
    if f.target is not None:
        out += _path_checks(f) + [_live_check(f)]
    return out


def diagnose(f: Facts) -> dict[str, Any]:
    """The report: the checks, the reasons GDS is not used (first first), the verdict and the JSON fields."""
    cs = checks(f)
    reasons = sorted((c for c in cs if c.ok is False and c.rank), key=lambda c: c.rank)
    live = next((c for c in cs if c.name == "live read"), None)
    active = live is not None and live.ok is True
    gds = active or (not reasons and f.kvikio.get("io_mode") == "gds")
    name, why = f.backend
    io_mode = backend_io_mode(name, gds)
    cs.append(Check("backend auto", None, f"{name} ({why}); io mode for this path: {io_mode}", section="path"
                    if f.target is not None else "stack"))
    if active:
        verdict = "GDS: active"
    elif reasons:
        verdict = f"GDS: not used — {reasons[0].name}: {reasons[0].found}; fix: {reasons[0].fix}"
    elif f.target is None:
        verdict = "GDS: not confirmed — no PATH to read; fix: run gdsload doctor PATH"
    elif live is not None and live.fix:
        verdict = f"GDS: not confirmed — nvidia-fs read counters are off; fix: {live.fix}"
    else:
        verdict = "GDS: not confirmed — nothing observed the reads; fix: see the – lines above"
    m, t = f.mount, f.target
    fs = None if m is None else {"type": m.fstype, "device": f"/dev/{f.device}" if f.device else m.source,
                                 "source": m.source, "dev": m.dev, "mount_point": m.mount_point,
                                 "mount_options": ",".join(m.all_options()), "gds": f.fs.gds if f.fs else None}
    return {
        "path": t.path if t else None, "kind": t.kind if t else None, "gds_available": gds, "gds_active": active,
        "io_mode": io_mode, "backend": {"name": name, "reason": why}, "verdict": verdict,
        "reasons": [f"{c.name}: {c.found}" for c in reasons], "filesystem": fs,
        "o_direct": f.o_direct[0] if f.o_direct else None, "aligned": t.aligned if t else None,
        "live_read": None if f.live is None else {"bytes": f.live.nbytes, "seconds": round(f.live.seconds, 6),
                                                  "error": f.live.error},
        "checks": [{"name": c.name, "ok": c.ok, "found": c.found, "fix": c.fix, "section": c.section} for c in cs],
    }


def render(report: dict[str, Any]) -> str:
    """One screen: a line per check (✔/✘/–, name, what it found), the fix under each ✘, the verdict."""
    title = "gdsload doctor" + (f": {report['path']} ({report['kind']})" if report["path"] else "")
    lines = [title]
    for section in ("stack", "path", "live"):
        rows = [c for c in report["checks"] if c["section"] == section]
        if rows:
            lines.append({"stack": "stack", "path": "path", "live": "live read"}[section])
        for c in rows:
            lines.append(f"  {MARKS[c['ok']]} {c['name']:<19} {c['found']}")
            if c["fix"] and c["ok"] is not True:
                lines.append(f"  {'':<21} fix: {c['fix']}")
    lines.append(report["verdict"])
    return "\n".join(lines)


def main(path: str | None, as_json: bool = False, files: SystemFiles | None = None, probes: Any = None,
         out: TextIO | None = None, err: TextIO | None = None, timeout_s: float | None = None) -> int:
    """``gdsload doctor``: print the report (text or one JSON object); 0 when the checks ran, 2 with one
    line ``gdsload doctor: error: PATH: what is wrong`` on stderr for a bad PATH. An ``s3://`` or ``http(s)://``
    PATH is probed over the network instead (:mod:`gdsload.tools.doctor_remote`; ``timeout_s`` per request)."""
    out, err = out or sys.stdout, err or sys.stderr
    if path is not None and is_remote(path):
        from .doctor_remote import main as remote_main

        return remote_main(path, as_json, timeout_s, out, err)
    try:
        facts = gather(path, files or SystemFiles(), probes or HostProbes())
    except PathError as e:
        print(f"gdsload doctor: error: {printable(e)}", file=err)
        return 2
    report = diagnose(facts)
    print(json.dumps(report, indent=2) if as_json else render(report), file=out)
    return 0
