"""Conversion spread over N processes: part I of N writes its share of the shard files, one step publishes.

Every part plans the whole dataset (:mod:`gdsload.conversion.plan`) and writes the whole shard files
:func:`assign` gives it into ``STAGING/part-I-of-N/data/`` with the writer's own code (part 0 the metadata too),
beside ``pieces.npy`` (:mod:`gdsload.conversion.spans`) and ``part.json`` (its shards, files and a fingerprint);
a part is renamed into place once complete. :func:`read_parts` refuses, naming it, a part missing, damaged, or of
another N or fingerprint; :func:`assemble` hard-links (else copies) the parts into one tree and writes the
checksum arrays; :func:`publish_parts` publishes it atomically. Why the result is bit-identical to one
conversion: docs/remote.md, "Conversion at scale".
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConversionError
from ..format.arrays import shard_files
from ..format.meta import DatasetMeta, read_metadata
from .spans import SpanCrc, join_spans
from .plan import DEFAULT_SLICE_BYTES, ConversionPlan, plan_dataset
from .publish import (Target, check_output, make_temp, protected, remove_empty, remove_stale_temps, rename_exchange,
                      rename_noreplace, staged_output, sync_tree)
from .spelling import overwrite_option
from .writer import close_all, open_inputs, input_list, write_checksums, write_metadata, write_shards

#: A part's files. The spans' file keeps its earlier name, so that parts already written still read.
RECORD, SPANS, DATA = "part.json", "pieces.npy", "data"
RECORD_FORMAT = 1
_PART = re.compile(r"part-([0-9]+)-of-([0-9]+)")


def parse_part(text: str, env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``--part I/N`` (0 <= I < N) or ``auto``: ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` (less
    ``SLURM_ARRAY_TASK_MIN``), else torchrun's ``RANK`` / ``WORLD_SIZE``. ValueError naming what is wrong."""
    if text == "auto":
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
            values = [env[n] for n in names] + [env.get("SLURM_ARRAY_TASK_MIN", "0")]
        elif "RANK" in env and "WORLD_SIZE" in env:
            names, values = ("RANK", "WORLD_SIZE"), [env["RANK"], env["WORLD_SIZE"], "0"]
        else:
            raise ValueError("--part auto needs SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT (a Slurm array) or "
                             "RANK and WORLD_SIZE (torchrun) in the environment")
        if not all(v.strip().isdigit() for v in values):
            raise ValueError(f"--part auto: {names[0]}={values[0]!r}, {names[1]}={values[1]!r} (expected integers)")
        index, count = int(values[0]) - int(values[2]), int(values[1])
        shown = f"auto ({names[0]}={values[0]}, {names[1]}={values[1]})"
    else:
        m = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", text)
        if not m:
            raise ValueError(f"--part takes I/N (part I of N, from 0) or auto (found {text!r})")
        index, count, shown = int(m.group(1)), int(m.group(2)), text
    if not 0 <= index < count:
        raise ValueError(f"--part {shown}: expected 0 <= I < N (parts are numbered from 0)")
    return index, count


def staging_dir(out: str, staging: str | None) -> str:
    """Where the parts lie: ``staging``, else ``OUT.parts`` beside a local output."""
    if staging is not None:
        return os.path.abspath(staging)
    if "://" in out:
        raise ConversionError(f"{out}: --part and --publish-parts with a remote output need --staging DIR, a folder "
                              f"every process can reach")
    return os.path.abspath(out).rstrip(os.sep) + ".parts"


def part_name(index: int, count: int) -> str:
    return f"part-{index}-of-{count}"


def assign(plan: ConversionPlan, count: int) -> list[list[tuple[str, int]]]:
    """Each part's shards (array key, shard): every shard to exactly one part, in runs of consecutive shards
    balanced by bytes (a shard goes to the part its middle byte falls in)."""
    units = [(a.key, s, (a.shard_rows(s)[1] - a.shard_rows(s)[0]) * a.row_bytes)
             for a in plan.arrays for s in range(a.num_shards)]
    total, done = max(1, sum(n for _, _, n in units)), 0
    out: list[list[tuple[str, int]]] = [[] for _ in range(count)]
    for key, shard, nbytes in units:
        out[min(count - 1, (2 * done + nbytes) * count // (2 * total))].append((key, shard))
        done += nbytes
    return out


def _identity(paths: Sequence[str]) -> list[Any]:
    """Each input path with its size and modification time (a directory: of every file below it)."""
    found: list[Any] = []
    for p in paths:
        ap = os.path.abspath(p)
        if not os.path.isdir(ap):
            st = os.stat(ap)
            found.append([ap, st.st_size, st.st_mtime_ns])
            continue
        files = []
        for folder, dirs, names in os.walk(ap):
            dirs.sort()
            for n in sorted(names):
                st = os.stat(os.path.join(folder, n))
                files.append([os.path.relpath(os.path.join(folder, n), ap), st.st_size, st.st_mtime_ns])
        found.append([ap, files])
    return found


def fingerprint(plan: ConversionPlan, paths: Sequence[str]) -> dict[str, Any]:
    """What parts of one conversion share: the plan, the inputs and the software that writes the bytes; its
    ``digest`` names them in one string."""
    import numcodecs
    import zarr

    doc = {"plan": plan.describe(), "inputs": _identity(paths),
           "software": {"zarr": zarr.__version__, "numcodecs": numcodecs.__version__ if plan.level is not None
                        else None, "record": RECORD_FORMAT}}
    doc["digest"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return doc


def survey(inputs: Sequence[str], out: str, named: Mapping[str, str], ragged: Mapping[str, str],
           **options: Any) -> dict[str, Any]:
    """The fingerprint of converting these inputs with these options (the inputs opened, planned, closed)."""
    paths = input_list(inputs, named, ragged)
    sources, rag, _ = open_inputs(inputs, named, ragged)
    try:
        options.pop("slice_bytes", None)
        return fingerprint(plan_dataset(out, sources, rag, **options), paths)
    finally:
        close_all(sources)
        close_all(rag)


def write_part(inputs: Sequence[str], out: str, named: Mapping[str, str], ragged: Mapping[str, str], index: int,
               count: int, *, staging: str | None = None, overwrite: bool = False, progress: bool | None = None,
               slice_bytes: int = DEFAULT_SLICE_BYTES, **options: Any) -> str:
    """Write part ``index`` of ``count`` of converting the inputs to ``out``; returns its directory. Refused
    when that part is already written (``overwrite`` replaces it) or, for a local ``out``, when the output
    could not be published (it exists without ``overwrite``, or is no dataset to replace)."""
    from tqdm import tqdm

    paths = input_list(inputs, named, ragged)
    if not paths:
        raise ConversionError(f"{out}: no inputs given (empty input)")
    where = staging_dir(out, staging)
    if "://" not in out:
        out = os.path.abspath(out)
        check_output(out, overwrite, paths)
    final = os.path.join(where, part_name(index, count))
    sources, rag, _ = open_inputs(inputs, named, ragged)
    try:
        plan = plan_dataset(out, sources, rag, **options)
        doc = fingerprint(plan, paths)
        if os.path.lexists(final) and not overwrite:
            raise ConversionError(f"{final}: part {index}/{count} is already written (publish the parts with "
                                  f"--publish-parts, or pass {overwrite_option()} to write it again)")
        remove_stale_temps(final)
        with protected():
            tmp, made = make_temp(final)
        target = Target(final, os.path.join(tmp, DATA))
        try:
            if index == 0:
                with protected():
                    try:
                        write_metadata(target.tmp, plan, rag)
                    except OSError as e:
                        raise target.error(e) from e
            mine = assign(plan, count)[index]
            arrays = {**sources, **{f"{n}/values": r.values for n, r in rag.items()}}
            spans: list[list[int]] = []
            total = sum((a.shard_rows(s)[1] - a.shard_rows(s)[0]) * a.row_bytes
                        for a in plan.arrays for k, s in mine if k == a.key)
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"{os.path.basename(out)} part {index}/{count}",
                      disable=None if progress is None else not progress) as bar:
                for f, a in enumerate(plan.arrays):
                    crcs: list[SpanCrc] = []

                    def crc_for(shard: int, a=a, crcs=crcs) -> SpanCrc:
                        crcs.append(SpanCrc(a.bounds, a.shard_rows(shard)[0] * a.row_bytes))
                        return crcs[-1]

                    write_shards(target, a, arrays[a.key], [s for k, s in mine if k == a.key], slice_bytes,
                                 bar.update, crc_for)
                    spans += [[f, *row] for c in crcs for row in c.rows()]
            with protected():
                _finish(tmp, final, index, count, doc, mine, spans, overwrite)
        except BaseException:
            with protected():
                shutil.rmtree(tmp, ignore_errors=True)
                remove_empty(made)
            raise
    finally:
        close_all(sources)
        close_all(rag)
    return final


def _finish(tmp: str, final: str, index: int, count: int, doc: dict[str, Any], mine: list[tuple[str, int]],
            spans: list[list[int]], overwrite: bool) -> None:
    """The part's spans and record beside its data, flushed, then the part renamed into place."""
    data = os.path.join(tmp, DATA)
    files = {}
    for folder, _, names in os.walk(data):
        for n in names:
            path = os.path.join(folder, n)
            files[os.path.relpath(path, data).replace(os.sep, "/")] = os.path.getsize(path)
    np.save(os.path.join(tmp, SPANS), np.array(spans, dtype=np.uint64).reshape(-1, 5))
    record = {"format": RECORD_FORMAT, "part": index, "parts": count, **doc, "shards": mine, "files": files}
    with open(os.path.join(tmp, RECORD), "w") as f:
        json.dump(record, f)
    sync_tree(tmp)
    if overwrite and os.path.lexists(final):
        rename_exchange(tmp, final)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        rename_noreplace(tmp, final)
    except FileExistsError:
        raise ConversionError(f"{final}: part {index}/{count} was written by another run meanwhile") from None


@dataclass(frozen=True)
class Parts:
    """The complete parts of one conversion in ``where``: their records, in part order."""

    where: str
    records: list[dict[str, Any]]

    def folder(self, index: int) -> str:
        return os.path.join(self.where, part_name(index, len(self.records)))


def _first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """The first difference of two JSON values (plain entries before nested ones, digests last), as a phrase."""
    if isinstance(want, dict) and isinstance(got, dict):
        def order(k: str) -> tuple[bool, bool, str]:
            return isinstance(want.get(k), (dict, list)), str(k).endswith("digest"), str(k)

        for k in sorted(set(want) | set(got), key=order):
            d = _first_difference(want.get(k), got.get(k), f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return next((d for i, (w, g) in enumerate(zip(want, got))
                     if (d := _first_difference(w, g, f"{path}[{i}]"))), None)
    return None if want == got else f"{path} is {json.dumps(got)[:200]} (expected {json.dumps(want)[:200]})"


def read_parts(where: str, expect: dict[str, Any] | None = None) -> Parts:
    """The parts in ``where``, checked: all N present and complete, of one fingerprint (``expect``'s, where
    given), each shard of the plan in exactly one, every file listed present at its size. ConversionError
    naming the part and what is wrong otherwise."""
    try:
        names = os.listdir(where)
    except OSError as e:
        raise ConversionError(f"{where}: no parts to publish ({e.strerror or e}; run 'gdsload shard ... --part I/N' "
                              f"first)") from None
    found = {(int(m.group(1)), int(m.group(2))) for n in names if (m := _PART.fullmatch(n))}
    counts = sorted({c for _, c in found})
    if not counts:
        raise ConversionError(f"{where}: holds no parts (run 'gdsload shard ... --part I/N' for every I first)")
    if len(counts) > 1:
        raise ConversionError(f"{where}: holds parts of conversions in {' and '.join(map(str, counts))} parts "
                              f"(remove those of the other conversion)")
    count = counts[0]
    for i in range(count):
        if (i, count) not in found:
            busy = [n for n in names if n.startswith(f".{part_name(i, count)}.tmp-")]
            why = f" (being written, or its process died: {busy[0]})" if busy else ""
            raise ConversionError(f"{os.path.join(where, part_name(i, count))}: part {i}/{count} is missing{why}; "
                                  f"run 'gdsload shard ... --part {i}/{count}'")
    records = [_record(where, i, count) for i in range(count)]
    digests = collections.Counter(r["digest"] for r in records)
    want = expect if expect is not None else next(r for r in records if r["digest"] == digests.most_common(1)[0][0])
    for r in records:
        if r["digest"] != want["digest"]:
            whose = "the inputs and options given" if expect is not None else "the other parts"
            diff = _first_difference({k: want[k] for k in ("plan", "inputs", "software")},
                                     {k: r.get(k) for k in ("plan", "inputs", "software")})
            raise ConversionError(f"{os.path.join(where, part_name(r['part'], count))}: part {r['part']}/{count} "
                                  f"is of another conversion than {whose}: {diff}")
    plan = records[0]["plan"]
    owner: dict[tuple[str, int], int] = {}
    for r in records:
        for key, shard in r["shards"]:
            if (key, shard) in owner:
                raise ConversionError(f"{where}: shard {key}/c/{shard} is in parts {owner[key, shard]} and "
                                      f"{r['part']} (expected one)")
            owner[key, shard] = r["part"]
    for a in plan["arrays"]:
        for s in range(shard_files(a["rows"], a["per_chunk"], a["chunks_per_shard"])):
            if (a["key"], s) not in owner:
                raise ConversionError(f"{where}: no part holds shard {a['key']}/c/{s}: a part is damaged")
    return Parts(where, records)


def _record(where: str, index: int, count: int) -> dict[str, Any]:
    folder = os.path.join(where, part_name(index, count))
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
        spans = np.load(os.path.join(folder, SPANS), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{folder}: part {index}/{count} is damaged (cannot read its record: {e}); "
                              f"write it again with {overwrite_option()}") from None
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("part") != index
            or record.get("parts") != count or spans.ndim != 2 or spans.shape[1] != 5):
        raise ConversionError(f"{folder}: not the record of part {index}/{count} of this gdsload (format "
                              f"{RECORD_FORMAT}); write it again with {overwrite_option()}")
    for rel, size in record["files"].items():
        path = os.path.join(folder, DATA, *rel.split("/"))
        try:
            got = os.stat(path).st_size
        except OSError:
            got = None
        if got != size:
            raise ConversionError(f"{path}: {'missing' if got is None else f'{got} bytes'} (part {index}/{count} "
                                  f"recorded {size} bytes): the part is damaged; write it again with "
                                  f"{overwrite_option()}")
    record["spans"] = spans
    return record


def assemble(parts: Parts, dest: str) -> None:
    """The dataset of ``parts`` in the empty directory ``dest`` on the parts' file system: their files
    hard-linked (copied where links fail), then the checksum arrays; it must parse as a dataset."""
    import zarr

    for r in parts.records:
        for rel in r["files"]:
            src = os.path.join(parts.folder(r["part"]), DATA, *rel.split("/"))
            dst = os.path.join(dest, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
    plan = parts.records[0]["plan"]
    num_blocks = -(-plan["num_samples"] // plan["samples_per_block"])
    checksums = {}
    for f, a in enumerate(plan["arrays"]):
        rows = [r["spans"][r["spans"][:, 0] == f][:, 1:] for r in parts.records]
        checksums[a["field"]] = join_spans(parts.where, a["field"], rows, num_blocks, a["stream_bytes"])
    write_checksums(zarr.open_group(dest, mode="r+"), checksums, num_blocks)
    read_metadata(dest)  # the result must parse before it may replace anything


def remove_parts(parts: Parts) -> None:
    """The parts, once published, and the staging folder where nothing else is left in it."""
    for i in range(len(parts.records)):
        shutil.rmtree(parts.folder(i), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(parts.where)


def publish_parts(out: str, *, staging: str | None = None, overwrite: bool = False,
                  expect: dict[str, Any] | None = None) -> DatasetMeta:
    """Publish the parts at ``out`` (a local folder) as one dataset, atomically and under the overwrite rules
    of a conversion; the parts are removed once it is published."""
    out = os.path.abspath(out)
    parts = read_parts(staging_dir(out, staging), expect)
    check_output(out, overwrite, [i[0] for i in parts.records[0]["inputs"]])
    remove_stale_temps(out)
    with staged_output(out, overwrite) as target, protected():
        try:
            assemble(parts, target.tmp)
        except OSError as e:
            raise target.error(e) from e
    remove_parts(parts)
    return read_metadata(out)
