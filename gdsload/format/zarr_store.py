"""Foreign stores: Zarr v3 groups and arrays written by zarr-python, tensorstore or any other writer.

A group without the ``gdsload`` attribute is a dataset whose fields are its arrays (a nested one is ``a/b``); an
array path is a dataset of one field. Arrays of a type gdsload does not read are skipped with a warning
(:func:`skipped_arrays`), or refused when asked for; :func:`block_rows` chooses the plan's block for arrays of
different rows per chunk; :func:`present_shards` lists the files that exist, so its cost is bounded by what is
on disk. What is accepted: docs/format.md, "Reading existing Zarr stores". Errors as :mod:`gdsload.format.meta`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

from .zarr_json import fail, is_int, read_json, show, valid_name
from .arrays import FieldMeta, read_array, unreadable_data_type
from ..errors import FormatError, warn

#: What a refusal of a path that is no Zarr v3 store suggests.
NOT_A_STORE = "gdsload reads Zarr v3 groups and arrays; convert .npy, .npz or Zarr v2 data with 'gdsload shard'"
#: Groups nested deeper than this are refused (a symlink loop among directories ends here too).
MAX_GROUP_DEPTH = 32
#: K is the least common multiple of the arrays' rows per chunk only when it is at most this many times the
#: largest, and one block of every array read by blocks (not held whole) is at most :data:`MAX_BLOCK_BYTES`.
MAX_LCM_FACTOR = 8
MAX_BLOCK_BYTES = 64 << 20
# A chunk index as a key writes it: decimal, no leading zero; 19 digits hold any int64.
_INDEX = re.compile(r"0|[1-9][0-9]{0,18}")


def read_store(path: str, is_array: bool, fields: Sequence[str] | None) -> tuple[dict[str, FieldMeta], int]:
    """The selected arrays of the foreign store at ``path`` (all when ``fields`` is None), checked, and
    their common length along axis 0."""
    where = os.path.join(path, "zarr.json")
    arrays = {os.path.basename(os.path.abspath(path)): path} if is_array else find_arrays(path)
    if not arrays:
        raise fail(where, f"a Zarr v3 group without arrays (nothing to read; {NOT_A_STORE})")
    names = list(arrays) if fields is None else list(dict.fromkeys(fields))
    unknown = [n for n in names if n not in arrays]
    if unknown:
        raise FormatError(f"{path}: no field {unknown} (fields: {list(arrays)})")
    if not names:
        raise FormatError(f"{path}: no field selected (fields: {list(arrays)})")
    skipped = skipped_arrays(arrays) if fields is None and not is_array else {}
    if skipped:
        names = [n for n in names if n not in skipped]
        if not names:  # nothing else to read: the first one's refusal says why
            read_array(arrays[next(iter(skipped))], next(iter(skipped)), "found while listing the group", False)
        warn(f"{path}: skipped array(s) {skip_listing(skipped)}: data types gdsload does not read; "
                      f"reading {names}; pass fields= to choose the arrays", UserWarning)
    metas = {n: read_array(arrays[n], n, "found while listing the group", False) for n in names}
    lengths = {n: m.num_rows for n, m in metas.items()}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{n} ({rows})" for n, rows in lengths.items())
        raise fail(where, f"arrays differ in length along axis 0: {listing}; select arrays of one length with "
                          f"fields=")
    return metas, next(iter(lengths.values()))


def find_arrays(path: str) -> dict[str, str]:
    """Every array under the group at ``path``: its key (``a/b``) and directory, sorted by key. A
    subdirectory without ``zarr.json`` is not a node and is passed over, as zarr does."""
    found: dict[str, str] = {}
    todo = [("", path, 0)]
    while todo:
        prefix, directory, depth = todo.pop()
        try:
            with os.scandir(directory) as it:
                names = sorted(e.name for e in it if valid_name(e.name) and e.is_dir())
        except OSError as e:
            raise fail(directory, f"cannot list the group ({e.strerror or e})") from None
        for name in names:
            sub = os.path.join(directory, name)
            where = os.path.join(sub, "zarr.json")
            if not os.path.lexists(where):
                continue
            doc = read_json(where)
            fmt, node = doc.get("zarr_format"), doc.get("node_type")
            if not (is_int(fmt) and fmt == 3 and node in ("group", "array")):
                raise fail(where, f"not a Zarr v3 node (expected zarr_format 3 and node_type 'group' or 'array', "
                                  f"found {show(fmt)} and {show(node)})")
            if node == "array":
                found[prefix + name] = sub
            elif depth >= MAX_GROUP_DEPTH:
                raise fail(sub, f"groups nest deeper than {MAX_GROUP_DEPTH} levels")
            else:
                todo.append((f"{prefix}{name}/", sub, depth + 1))
    return dict(sorted(found.items()))


def skipped_arrays(arrays: dict[str, str]) -> dict[str, str]:
    """Those of ``arrays`` (key to directory) whose data type gdsload does not read, key to data type (as
    messages show it): what a group read without ``fields`` passes over."""
    out = {}
    for key, directory in arrays.items():
        shown = unreadable_data_type(read_json(os.path.join(directory, "zarr.json")))
        if shown is not None:
            out[key] = shown
    return out


def skip_listing(skipped: dict[str, str]) -> str:
    """``'text' (data type 'string'), ...``."""
    return ", ".join(f"'{key}' (data type {shown})" for key, shown in skipped.items())


def block_rows(arrays: Sequence[FieldMeta], num_samples: int) -> int:
    """K, the samples per block of a foreign store read as ``arrays`` (those read block by block).

    The least common multiple L of their rows per chunk, when every chunk then lies in one block (L is
    the largest rows per chunk), or when L is at most :data:`MAX_LCM_FACTOR` times the largest, no more
    than the samples, and one block of all of them at most :data:`MAX_BLOCK_BYTES`: each array's chunks then
    tile the blocks, and a window holds each block's rows at its plan positions (copied in runs). Else the
    largest rows per chunk: an array whose chunks do not divide K reads, per block, the chunks covering it
    (one straddling two blocks is read for each) and is gathered by rows of its own.
    """
    if not arrays:
        return 1
    rows = [a.samples_per_block for a in arrays]
    largest, lcm = max(rows), math.lcm(*rows)
    fits = (lcm <= MAX_LCM_FACTOR * largest and lcm <= num_samples
            and lcm * sum(a.sample_bytes for a in arrays) <= MAX_BLOCK_BYTES)
    return lcm if lcm == largest or fits else largest


def present_shards(fm: FieldMeta) -> dict[int, str]:
    """The files of a foreign array that exist: shard (or, unsharded, chunk) number to path, in order.

    Found from one directory listing (the one holding the keys' first varying part); names that are no
    key of this array's grid are passed over, as zarr passes them over.
    """
    sep, v2 = fm.key_separator, fm.key_encoding == "v2"
    listed = fm.directory if (sep == "." or v2) else os.path.join(fm.directory, "c")
    head = "" if (v2 or sep == "/") else "c."
    try:
        with os.scandir(listed) as it:
            names = [e.name for e in it]
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        raise fail(listed, f"cannot list the array's chunk files ({e.strerror or e})") from None
    out = {}
    for name in names:
        first = name[len(head):].split(sep, 1)[0] if name.startswith(head) else ""
        if not _INDEX.fullmatch(first) or int(first) >= fm.num_shards:
            continue
        shard = int(first)
        if sep == "." and name != fm.shard_key(shard):
            continue
        path = fm.shard_path(shard)
        if os.path.lexists(path):
            out[shard] = path
    return dict(sorted(out.items()))
