"""Command line: ``gdsload info``, ``demo``, ``shard``, ``verify``, ``doctor``, ``bench`` and ``cache``.

Every command ends an expected error (a GDSLoadError, an argument check's ValueError or TypeError, an OSError on
a path the user gave) with one line ``gdsload CMD: error: message`` on stderr and exit status 2 (:func:`fail`),
as argparse's usage errors do; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from .._units import human_bytes
from ..backends import BACKENDS
from ..errors import GDSLoadError, printable

#: What a command ends with one line on stderr and exit 2 rather than a traceback: gdsload's own errors, an
#: argument's (ValueError, TypeError) and the OS's on a path the user gave.
EXPECTED_ERRORS = (GDSLoadError, ValueError, TypeError, OSError)


def error_message(e: BaseException, path: str | None = None) -> str:
    """``e`` on one line, printable: an OSError of the OS as ``FILE: reason`` (``path`` when it names no
    file), anything else as its message."""
    if isinstance(e, OSError) and not isinstance(e, GDSLoadError):
        where = e.filename if e.filename is not None else path
        reason = e.strerror or str(e) or type(e).__name__
        return printable(f"{where}: {reason}" if where is not None else reason)
    return printable(str(e) or type(e).__name__)


def fail(prog: str, e: BaseException, path: str | None = None) -> int:
    """Print ``PROG: error: message`` (one line) on stderr; the exit status of an expected error, 2."""
    print(f"{prog}: error: {error_message(e, path)}", file=sys.stderr)
    return 2

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def parse_bytes(text: str) -> int:
    """'4MiB', '4M', '512k', '1GiB', '4096' -> bytes (binary units unless 'kB/MB/GB')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 4MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


# -- info ------------------------------------------------------------------------------------------
def describe_dataset(path: str) -> str:
    """A dataset's summary (of a remote one's URL: as its server holds it now, its skeleton fetched into a
    temporary folder); for a file (.npy, .npz), what it holds and the command that converts it."""
    import warnings

    from ..format.layout import DatasetLayout
    from ..format.meta import read_metadata
    from ..format.zarr_store import find_arrays, skip_listing, skipped_arrays
    from .audit import local_copy

    if os.path.exists(path) and not os.path.isdir(path):
        return describe_input(path)
    with local_copy(path) as (root, _, name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # arrays skipped: listed below instead
            meta = read_metadata(root)
        skipped = skipped_arrays(find_arrays(root)) if meta.foreign else {}
        # Every shard file held open, closed once described; missing chunks are counted, not refused.
        with DatasetLayout(meta, missing_chunks="fill") as layout:
            text = name(_describe(meta, layout))
    if skipped:
        text += (f"\nskipped: {skip_listing(skipped)}: data types gdsload does not read (read the others, or "
                 f"choose with fields=)")
    return text


def describe_input(path: str) -> str:
    """What a converter input file holds (its arrays' shapes and data types) and the command converting it;
    ConversionError for a file that is no input gdsload converts."""
    from ..conversion.sources import open_input

    sources = open_input(path)
    try:
        lines = [f"{path}: not a dataset but a file of {len(sources)} array(s), which 'gdsload shard' converts:"]
        lines += [f"  {name}: shape {s.shape}, dtype {s.dtype.str} ({s.dtype.name})" for name, s in sources.items()]
    finally:
        for s in sources.values():
            s.close()
    stem = os.path.splitext(os.path.basename(path))[0] or "data"
    lines.append(f"convert it: gdsload shard {path} -o {stem}.gds   (fields named after the file or its keys; "
                 f"'gdsload shard --help' lists the options)")
    return "\n".join(lines)


def _describe(meta, layout) -> str:
    lines = [f"dataset: {meta.path}", f"samples: {meta.num_samples}   samples_per_block: {meta.samples_per_block}"
             f"   blocks: {meta.num_blocks}"]
    total = 0
    for name, f in meta.fields.items():
        shards = meta.num_shards(name)
        missing = int((layout.block_offsets[name] < 0).sum())
        nbytes = f.sample_bytes * meta.num_samples
        total += nbytes
        lines.append(f"  {name}: dtype {f.dtype.str} ({f.dtype.name}), sample shape {f.sample_shape}, "
                     f"block {human_bytes(f.block_bytes)}, {shards} shard(s) of {f.blocks_per_shard} blocks, "
                     f"{human_bytes(nbytes)}" + (f", {missing} chunk(s) missing (an error unless missing_chunks="
                                            f"'fill': 'gdsload verify' names them)" if missing else "")
                     + _codecs(f, layout.chunk_lengths.get(name), f.num_chunks - missing))
    for name, r in meta.ragged.items():
        v = r.values
        lengths = np.diff(layout.offsets[name])
        nbytes = v.sample_bytes * v.num_rows
        total += nbytes
        lines.append(f"  {name}: variable length, dtype {v.dtype.str} ({v.dtype.name}), element shape "
                     f"{v.sample_shape}, {v.num_rows} elements (per sample {int(lengths.min())}..{int(lengths.max())}, "
                     f"mean {lengths.mean():.1f}), chunk {human_bytes(v.block_bytes)}, {v.num_shards} shard(s), "
                     f"{human_bytes(nbytes)}")
    lines.append(f"fields: {len(meta.names)}   shards: {len(layout.shard_paths())}   bytes: {human_bytes(total)}")
    return "\n".join(lines)


def _codecs(f, lengths, written: int) -> str:
    """``, codecs [...]`` and, for compressed chunks, ``ratio R`` (stored bytes / decoded bytes of the chunks
    written, from the chunk table)."""
    text = f", codecs {f.codec_names}"
    if lengths is not None and written:
        text += f", ratio {int(lengths.sum()) / (written * f.block_bytes):.3f} (stored / decoded)"
    return text


def describe_system() -> str:
    from ..backends import resolve
    from ..system.env import CONNECTIONS_FIX, connections_note, system_info

    info = system_info()
    if info.get("gpu"):
        from .measure import pinned_h2d_gbps

        try:
            info["pinned_h2d_gbps"] = round(pinned_h2d_gbps(), 1)
        except Exception as e:
            info["pinned_h2d_error"] = f"{type(e).__name__}: {e}"
    shared = (f" (readers count on {info['rank_cores']}: one of {info['local_ranks']} ranks on this machine)"
              if info["local_ranks"] > 1 else "")
    lines = [f"gdsload {info.get('gdsload')}  python {info['python']}  numpy {info['numpy']}  zarr {info['zarr']}"
             f"  cores {info['cpu_cores']}{shared}"]
    if not info.get("gpu"):
        lines.append(f"GPU: none ({info.get('reason')})")
    else:
        lines.append(f"GPU: {info['gpu']} ({info['memory_gib']} GiB, {info['device_count']} device(s))  "
                     f"driver CUDA {info['driver']}  runtime {info['cuda_runtime']}  CuPy {info['cupy']}")
        if info.get("kvikio"):
            lines.append(f"KvikIO {info['kvikio']}: GDS driver available: {info.get('is_gds_available')}  "
                         f"nvidia-fs loaded: {info.get('nvidia_fs_loaded')}  compat mode preferred: "
                         f"{info.get('compat_mode_preferred')}  -> io mode {info['io_mode']}")
        else:
            lines.append(f"KvikIO: not installed ({info.get('kvikio_error')})")
        if "pinned_h2d_gbps" in info:
            lines.append(f"pinned host->device copy: {info['pinned_h2d_gbps']} GB/s")
        else:
            lines.append(f"pinned host->device copy: failed ({info.get('pinned_h2d_error')})")
        note = connections_note()
        if note is not None:
            lines.append(f"warning: {note}; fix: {CONNECTIONS_FIX}")
    name, why = resolve("auto")
    lines.append(f"backend auto -> {name} ({why})")
    return "\n".join(lines)


# -- verify ----------------------------------------------------------------------------------------
def run_verify(path: str, threads: int, progress: bool) -> int:
    from ..remote.objects import redact
    from .audit import verify_dataset

    if threads < 1:
        raise ValueError(f"--threads must be at least 1 (found {threads})")
    report = verify_dataset(path, threads, progress=None if progress else False)
    path = redact(path)
    for b in report.bad:
        print(f"BAD {b.message}")
    for m in report.missing:
        print(f"MISSING {m.describe()}")
    if report.unchecked:
        print(f"{path}: field(s) {report.unchecked} carry no checksum: not checked")
    missing = f", {report.missing_chunks} missing" if report.missing else ""
    print(f"{path}: {report.checked} {report.unit}(s) checked, {len(report.bad)} bad{missing}")
    return 1 if report.bad or report.missing else 0


# -- demo ------------------------------------------------------------------------------------------
def run_demo(samples: int, backend: str, batch_size: int, workdir: str | None) -> str:
    from .. import GDSDataset
    from ..conversion.source_types import ArraySource
    from ..conversion.writer import write_dataset

    # Checked before anything is written: a bad option costs no conversion.
    for flag, value in (("--samples", samples), ("--batch-size", batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1 (found {value})")
    if workdir is not None and not os.path.isdir(workdir):
        raise ValueError(f"{workdir}: --workdir must be an existing directory")
    labels = np.arange(samples, dtype=np.int64)
    # Image i is filled with (i % 251): every batch can be checked against its labels.
    images = np.broadcast_to((labels % 251).astype(np.uint8)[:, None, None, None], (samples, 64, 64, 3))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = os.path.join(tmp, "demo.gds")
        write_dataset(path, {"image": ArraySource("demo:image", images), "label": ArraySource("demo:label", labels)},
                      block_bytes=1 << 20, progress=False)
        with GDSDataset(path, batch_size=batch_size, backend=backend, shuffle=True, seed=0) as ds:
            lines = [f"backend {ds.backend_name} ({ds.backend_reason}), io mode {ds.io_mode}"]
            for epoch in range(2):  # the first pass also pays for CUDA start-up and CuPy kernel compilation
                ds.set_epoch(epoch)
                t0 = time.perf_counter()
                batches = list(ds)
                _synchronize(batches)
                wall = time.perf_counter() - t0
                seen = 0
                for batch in batches:
                    img, lab = batch["image"], batch["label"]
                    ok = (img[:, 0, 0, 0].astype(np.int64) == lab % 251).all() and (img == img[:, :1, :1, :1]).all()
                    if not bool(ok):
                        raise GDSLoadError(f"{path}: demo batch content does not match its labels")
                    seen += int(lab.shape[0])
                if seen != samples:
                    raise GDSLoadError(f"{path}: demo read {seen} samples (expected {samples})")
                nbytes = ds.stats.bytes_delivered if ds.stats else 0
                lines.append(f"epoch {epoch}: {samples} samples ({human_bytes(nbytes)}) in {wall:.3f} s: "
                             f"{samples / wall:,.0f} samples/s, {nbytes / wall / 1e9:.2f} GB/s, consumer stalled "
                             f"{ds.stats.stall_s:.3f} s" + (" (includes start-up)" if epoch == 0 else ""))
            lines.append("every batch checked against its labels")
            lines.append(f"these figures are not a benchmark: epochs of {human_bytes(nbytes)} are too short to time "
                         f"(they vary many times over between runs); time your own dataset with 'gdsload bench PATH'")
            return "\n".join(lines)


def _synchronize(batches: list[dict]) -> None:
    """Wait until device batches are complete, so the timing covers the copies too."""
    for a in (batches[-1].values() if batches else ()):
        if hasattr(a, "device") and hasattr(a, "data") and type(a).__module__.startswith("cupy"):
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return


# -- shard -----------------------------------------------------------------------------------------
def shard_parser(prog: str = "shard.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, description="Convert .npy / .npz / "
                                "directories of them / zarr arrays into a gdsload dataset (a Zarr v3 group of sharded "
                                "arrays). Over N processes: --part I/N for every I (same inputs and options), then "
                                "--publish-parts once; the dataset is the same, byte for byte.")
    p.add_argument("inputs", nargs="*", help="input paths; one field per array, named after the file or key")
    p.add_argument("-o", "--output", required=True, help="dataset directory to write (e.g. mydata.gds), or "
                   "s3://BUCKET/PREFIX/NAME.gds: converted locally, uploaded, its root zarr.json last")
    p.add_argument("--part", metavar="I/N|auto", help="write part I of N (from 0) into the staging folder; auto: "
                   "SLURM_ARRAY_TASK_ID/_COUNT, else RANK/WORLD_SIZE")
    p.add_argument("--publish-parts", action="store_true", help="check all N parts (same inputs and options; inputs "
                   "given must match) and publish them as one dataset")
    p.add_argument("--staging", metavar="DIR", help="folder of the parts (default: OUTPUT.parts; needed for s3://) "
                   "and of an s3:// output before upload (default: system temp)")
    p.add_argument("--field", action="append", default=[], metavar="NAME=PATH",
                   help="add a field with an explicit name (PATH may be FILE.npz:KEY)")
    p.add_argument("--images", action="store_true", help="inputs are JPEG/PNG images, kept encoded: one ImageFolder "
                   "folder, one list file ('PATH LABEL' lines) or WebDataset .tar shards (docs/images.md)")
    p.add_argument("--strict", action="store_true", help="with --images: refuse a damaged image (default: skip it)")
    p.add_argument("--ragged", action="append", default=[], metavar="NAME=PATH",
                   help="add a variable-length field: a directory of per-sample .npy files (in natural order "
                        "of their names: 2.npy before 10.npy), "
                        "or a .npz holding 'values' and 'offsets'")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--block-bytes", type=parse_bytes, default=None,
                      help="target block size (default 4MiB); whole samples, 4 KiB aligned where possible")
    size.add_argument("--samples-per-block", type=int, default=None,
                      help="samples per block, exactly (default: from --block-bytes)")
    p.add_argument("--compress", default=None, metavar="zstd[:LEVEL]|auto[:LEVEL]",
                   help="store every fixed field's blocks as zstd inner chunks (level 3 by default), which zarr "
                        "reads and gdsload decodes on the GPU with nvCOMP (gdsload[nvcomp]) or on CPU threads; "
                        "auto: only fields where zstd saves at least 10%% on a sample of their chunks, the rest "
                        "raw; default: raw")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=None,
                   help="with --compress: target inner chunk (= block) size (default 512KiB, provisional: smaller "
                        "chunks keep a GPU decoder busy)")
    p.add_argument("--shard-bytes", type=parse_bytes, default=None, help="target shard file size (default 1GiB)")
    p.add_argument("--slice-bytes", type=parse_bytes, default=None,
                   help="input read size (bounds memory; default 64MiB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing gdsload dataset (never a file or another directory); with --part, "
                        "a part already written")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def shard_main(argv: Sequence[str] | None = None, prog: str = "shard.py") -> int:
    """``shard.py``: 0 on success; 2 with one line ``PROG: error: PATH: what is wrong`` on any failure;
    128 + the signal number when SIGINT, SIGTERM or SIGHUP stopped it (nothing is left at the output)."""
    from ..conversion.command import conversion_signals, run_shard
    from ..conversion.publish import reset_signals

    args = shard_parser(prog).parse_args(argv)
    named: dict[str, dict[str, str]] = {"--field": {}, "--ragged": {}}
    for flag, specs in (("--field", args.field), ("--ragged", args.ragged)):
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                print(f"{prog}: error: {flag} expects NAME=PATH (found {printable(repr(spec))})", file=sys.stderr)
                return 2
            named[flag][name] = path
    if args.compress is not None and args.block_bytes is not None:
        print(f"{prog}: error: --block-bytes does not apply with --compress (a block is then one inner chunk: "
              f"use --chunk-bytes)", file=sys.stderr)
        return 2
    options = {k: v for k, v in {"block_bytes": args.block_bytes, "samples_per_block": args.samples_per_block,
                                 "shard_bytes": args.shard_bytes, "slice_bytes": args.slice_bytes,
                                 "compress": args.compress, "chunk_bytes": args.chunk_bytes}.items()
               if v is not None}
    notes: list[str] = []
    done = False
    try:
        with conversion_signals():
            if args.strict and not args.images:
                raise ValueError("--strict applies to --images only")
            options.update({"images": True, "strict": args.strict} if args.images else {})
            meta = run_shard(args.inputs, args.output, named["--field"], named["--ragged"], part=args.part,
                             publish=args.publish_parts, staging=args.staging, overwrite=args.overwrite,
                             progress=False if args.quiet else None, log=notes.append, **options)
            late, done = reset_signals(), True  # a signal during the final rename: the output is complete
    except KeyboardInterrupt as e:  # SIGINT, or writer.Interrupted for SIGTERM / SIGHUP
        reset_signals()
        signum = int(getattr(e, "signum", signal.SIGINT))
        what = f"{args.output} is complete" if done else f"nothing written to {args.output}"
        print(f"{prog}: interrupted; {printable(what)}", file=sys.stderr)
        return 128 + signum
    except EXPECTED_ERRORS as e:  # every converter error should be a ConversionError; an OSError is the backstop
        return fail(prog, e, args.output)
    if meta is not None:
        print(describe_dataset(meta.path))
    for line in notes:
        print(printable(line))
    if late:
        print(f"{prog}: interrupted; {printable(args.output)} is complete", file=sys.stderr)
        return 128 + late
    return 0


# -- entry point -----------------------------------------------------------------------------------
class HelpFormatter(argparse.HelpFormatter):
    """Help texts that end with the option's default, where it has one (not None, False or empty) that the
    text does not already give."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, [], argparse.SUPPRESS)
                and "default" not in text and f"({default})" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """``gdsload``'s parser, every command's included (``shard`` parses its own: :func:`shard_parser`)."""
    from .. import __version__

    p = argparse.ArgumentParser(prog="gdsload", description="Sharded datasets from NVMe into GPU memory.",
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"gdsload {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                              formatter_class=HelpFormatter)

    info = command("info", "GPU, CUDA, KvikIO and GDS status; with PATH, a dataset summary")
    info.add_argument("path", nargs="?", help="a dataset or Zarr v3 store to summarise, or an s3:// or http(s):// "
                                              "dataset URL (a .npy or .npz file: what it holds and how to convert "
                                              "it); none: this machine's status")
    demo = command("demo", "write a small synthetic dataset and read two epochs of it, checking every batch (a "
                           "check of the install, not a benchmark)")
    demo.add_argument("--samples", type=int, default=8192, help="samples of 64x64x3 uint8 images and labels")
    demo.add_argument("--batch-size", type=int, default=256, help="samples per batch")
    demo.add_argument("--backend", default="auto", choices=list(BACKENDS), help="the backend to read with")
    demo.add_argument("--workdir", default=None, help="where the temporary dataset goes (default: system temp)")
    command("shard", "convert arrays into a dataset (see 'gdsload shard --help')")
    verify = command("verify", "re-read a whole dataset and check every block against its crc32c; exit 1 if any "
                               "block is bad or any chunk missing")
    verify.add_argument("path", help="a dataset or Zarr v3 store, or an s3:// or http(s):// dataset URL (read "
                                     "from its objects)")
    verify.add_argument("--threads", type=int, default=8, help="reader threads")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    doctor = command("doctor", "is GPUDirect Storage used for PATH, and if not, why: each check, what it found and "
                               "the fix")
    doctor.add_argument("path", nargs="?", help="a dataset directory or any file; or an s3:// or http(s):// "
                                                "dataset URL: its reachability, latency and throughput")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="for a URL: seconds each request may take (default 10)")
    from .cache_cmd import add_arguments as cache_arguments

    cache_arguments(command("cache", "the versions of remote datasets in a cache folder (ls), and the removal of "
                                     "those no dataset has open (clear)"))
    from .bench import add_arguments as bench_arguments

    bench_arguments(command("bench", "each backend's GB/s and samples/s on PATH, warm (and cold), shuffled and "
                                     "not, beside this machine's ceilings"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["shard"]:
        return shard_main(argv[1:], prog="gdsload shard")
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.cmd == "bench":
            from .bench import main as bench_main

            return bench_main(args)
        if args.cmd == "cache":
            from .cache_cmd import main as cache_main

            return cache_main(args)
        if args.cmd == "doctor":
            from .doctor import main as doctor_main

            return doctor_main(args.path, args.json, timeout_s=args.timeout)
        if args.cmd == "info":
            print(describe_dataset(args.path) if args.path else describe_system())
        elif args.cmd == "demo":
            print(run_demo(args.samples, args.backend, args.batch_size, args.workdir))
        elif args.cmd == "verify":
            return run_verify(args.path, args.threads, not args.quiet)
    except EXPECTED_ERRORS as e:
        return fail(f"gdsload {args.cmd}", e, getattr(args, "path", None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
