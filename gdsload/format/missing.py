"""Chunks a dataset lacks: never written in a shard's index, or in a shard (or chunk) file that does not exist.

Pure logic over the chunk tables :class:`gdsload.format.layout.DatasetLayout` reads at open; no I/O. An open
refuses them by default (``missing_chunks="error"``), naming the file, the field and the chunks;
``missing_chunks="fill"`` reads the fill value, as zarr does. Why: docs/format.md, "Reading existing Zarr
stores" (Missing data).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

#: The values of ``missing_chunks``: refuse a missing chunk at open (the default), or read its fill value.
MISSING_CHUNKS = ("error", "fill")
#: Chunk numbers and files a message lists before it says how many more there are.
SHOWN = 6


def check_missing_chunks(value: Any) -> str:
    """``value`` if it is one of :data:`MISSING_CHUNKS`; ValueError naming ``missing_chunks`` otherwise."""
    if not isinstance(value, str) or value not in MISSING_CHUNKS:
        raise ValueError(f"missing_chunks must be one of {list(MISSING_CHUNKS)} (found {value!r})")
    return value


class MissingChunks(NamedTuple):
    """Chunks of one array that one file lacks: ``path`` (the file), ``what`` (the array, as messages name it:
    ``field 'x'``, ``the offsets of field 'r'``), the chunk numbers, and whether the file itself is absent
    (else its shard index marks them never written)."""

    path: str
    what: str
    chunks: np.ndarray
    absent: bool
    sharded: bool

    def describe(self) -> str:
        """``PATH: shard file missing (chunks 8..15 of field 's')`` or ``PATH: shard index marks chunk(s) ...
        of field 's' as never written``."""
        listed = chunk_list(self.chunks)
        plural = "chunks" if len(self.chunks) > 1 else "chunk"
        if self.absent:
            kind = "shard file" if self.sharded else "chunk file"
            return f"{self.path}: {kind} missing ({plural} {listed} of {self.what})"
        return f"{self.path}: shard index marks {plural} {listed} of {self.what} as never written"


def chunk_list(chunks: np.ndarray) -> str:
    """Ascending chunk numbers as runs: ``0..3, 7, 9..12`` (the first :data:`SHOWN` runs, then how many more
    chunks)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    if len(chunks) == 0:
        return ""
    edges = [0, *(np.flatnonzero(np.diff(chunks) != 1)[:SHOWN] + 1).tolist(), len(chunks)][:SHOWN + 1]
    runs = [(int(chunks[a]), int(chunks[b - 1])) for a, b in zip(edges, edges[1:])]
    shown = edges[-1]
    text = ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)
    return text + (f" and {len(chunks) - shown} more" if len(chunks) > shown else "")


def missing_in(paths: list[str], shard_path: Any, what: str, offsets: np.ndarray, files: np.ndarray,
               per_file: int, sharded: bool) -> list[MissingChunks]:
    """The missing chunks of one array, file by file: ``offsets[c]`` < 0 for a chunk never written,
    ``files[c]`` its file's index in ``paths`` (< 0: no file), ``shard_path(s)`` the path file ``s`` would
    have, ``per_file`` chunks per file."""
    miss = np.flatnonzero(np.asarray(offsets) < 0)
    if len(miss) == 0:
        return []
    held = np.asarray(files)[miss]
    # One entry per file, in chunk order: a file absent is keyed by its shard number, a file held by its path.
    keys = np.where(held < 0, -1 - miss // per_file, held)
    out = []
    for key in dict.fromkeys(keys.tolist()):
        chunks = miss[keys == key]
        absent = key < 0
        path = shard_path(-1 - key) if absent else paths[key]
        out.append(MissingChunks(path, what, chunks, absent, sharded))
    return out


def refusal(dataset: str, missing: list[MissingChunks]) -> str:
    """The one-line message of an open refused for ``missing`` (not empty): the first file's, then how many
    chunks and files in all, then what to pass to read the fill value instead."""
    first = missing[0]
    total = sum(len(m.chunks) for m in missing)
    text = first.describe()
    if len(missing) > 1:
        arrays = list(dict.fromkeys(m.what for m in missing))
        text += (f"; {total} missing chunks in all, in {len(missing)} files (of {', '.join(arrays[:SHOWN])}"
                 + (f" and {len(arrays) - SHOWN} more" if len(arrays) > SHOWN else "") + f" in {dataset})")
    return (text + "; a missing chunk is an error: pass missing_chunks=\"fill\" to read it as the fill value, as "
                   "zarr does (zarr-python writes no chunk equal to the fill value unless write_empty_chunks is on)")
