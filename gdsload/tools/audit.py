"""``gdsload verify``: re-read a whole dataset or Zarr store and check every checksum it carries, on threads.

A gdsload dataset's blocks against their block checksums; a Zarr store's written chunks against their
``crc32c`` codec (raw: the 4 bytes stored after the chunk; compressed: as the chunk decodes); every shard
index's crc32c as the layout opens. What cannot be checked is named, not skipped silently.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..codecs.checksum import Checks, host_crcs
from ..errors import FormatError, ReadError
from ..format.files import pread_exact
from ..format.layout import DatasetLayout
from ..codecs.verify import describe_block, mismatch, unchecked_fields


class BadBlock(NamedTuple):
    where: str  # describe_block(...), or the shard file whose index fails its check
    message: str


class Report(NamedTuple):
    """What :func:`verify_dataset` found: ``checked`` units (``unit``: "block" for a gdsload dataset's block
    checksums, "chunk" for a Zarr store's crc32c codec), the bad ones, and the fields that carry no
    checksum and so were not checked."""

    checked: int
    bad: list[BadBlock]
    unchecked: list[str]
    unit: str


def verify_dataset(path: str, num_threads: int = 8, progress: bool | None = None) -> Report:
    """Re-read a whole dataset and check everything it carries: a gdsload dataset's block checksums, a Zarr
    store's crc32c codec on every written chunk (raw: its 4 stored bytes; compressed: as it decodes), and
    every shard index's crc32c. A data file the layout cannot open (an index that fails its check, a chunk
    file of the wrong size) is reported as bad, and nothing behind it read.

    Reads go through the files the layout opened, on ``num_threads`` threads; a block or chunk that cannot
    be read or decoded is listed as bad with the error. Metadata gdsload cannot read is a FormatError.
    """
    from tqdm import tqdm

    from ..format.meta import read_metadata

    meta = read_metadata(path)
    unit = "chunk" if meta.foreign else "block"
    try:
        layout = DatasetLayout(meta)
    except (FormatError, ReadError) as e:  # the data files (an index, a chunk file's size): damaged
        return Report(0, [BadBlock(str(e).split(": ", 1)[0], str(e))], [], unit)
    with layout:
        unchecked = unchecked_fields(layout)
        keys = [k for f, k in zip(layout.fields, layout.keys) if f not in unchecked]
        if meta.foreign:
            jobs = [(k, int(c)) for k in keys for c in np.flatnonzero(layout.block_offsets[k] >= 0)]
            check, size = _chunk_check(layout), lambda job: int(layout.locate(*job).nbytes)  # type: ignore[union-attr]
        else:
            jobs = [(k, b) for k in keys for b in range(meta.num_blocks)]
            check, size = _block_check(layout), lambda job: _block_span(layout, *job)[2]
        bad = []
        with ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-verify") as pool, \
                tqdm(total=sum(size(j) for j in jobs), unit="B", unit_scale=True, desc=os.path.basename(meta.path),
                     disable=None if progress is None else not progress) as bar:
            for job, result in zip(jobs, pool.map(check, jobs)):
                bar.update(size(job))
                if result is not None:
                    bad.append(result)
        return Report(len(jobs), bad, unchecked, unit)


def _block_check(layout: DatasetLayout) -> Any:
    """(key, block) -> None, or the BadBlock of a block that fails its block checksum or cannot be read."""
    chains = _chains(layout)

    def check(job: tuple[str, int]) -> BadBlock | None:
        key, b = job
        field = key.rsplit("/", 1)[0] if key.endswith("/values") else key
        try:
            data = _read_block(layout, key, b, chains.get(key))
        except ReadError as e:
            return BadBlock(describe_block(layout, key, b), str(e))
        got = host_crcs(data, np.array([0]), np.array([len(data)]))
        want = np.array([layout.checksums[field][b]], np.uint32)
        err = mismatch(layout, Checks(np.array([0]), np.array([len(data)]), want, (key,), np.array([b])), got)
        return None if err is None else BadBlock(describe_block(layout, key, b), str(err))
    return check


def _chunk_check(layout: DatasetLayout) -> Any:
    """(key, chunk) -> None, or the BadBlock of a written chunk that fails its crc32c codec (or does not
    decode, or cannot be read)."""
    chains = _chains(layout)

    def check(job: tuple[str, int]) -> BadBlock | None:
        key, c = job
        loc = layout.locate(key, c)
        assert loc is not None
        fm = layout.meta.array(key)
        try:
            if key in chains:  # compressed: its chain checks the crc32c as it decodes
                _read_block(layout, key, c, chains[key])
                return None
            stored = pread_exact(layout.files[loc.path], loc.offset, fm.stored_bytes)
        except ReadError as e:
            return BadBlock(describe_block(layout, key, c), str(e))
        data = np.frombuffer(stored, np.uint8)
        bb = fm.block_bytes
        want = np.frombuffer(stored[bb:], "<u4").astype(np.uint32)
        err = mismatch(layout, Checks(np.array([0]), np.array([bb]), want, (key,), np.array([c])),
                       host_crcs(data, np.array([0]), np.array([bb])))
        return None if err is None else BadBlock(describe_block(layout, key, c), str(err))
    return check


def _block_span(layout: DatasetLayout, key: str, block: int) -> tuple[int, int, int]:
    """Rows [first, end) of array ``key`` that block ``block`` stores or owns, and their bytes."""
    meta = layout.meta
    fm = meta.array(key)
    if key in meta.fields:
        return block * fm.samples_per_block, (block + 1) * fm.samples_per_block, fm.block_bytes
    offsets = layout.offsets[key.rsplit("/", 1)[0]]
    k = meta.samples_per_block
    first, end = int(offsets[block * k]), int(offsets[min((block + 1) * k, meta.num_samples)])
    return first, end, (end - first) * fm.sample_bytes


def _chains(layout: DatasetLayout) -> dict[str, Any]:
    """The codec chain of every compressed array, made once (building one sets up its codecs)."""
    from ..codecs.chunks import Chain

    metas = {key: layout.meta.array(key) for key in layout.keys}
    return {key: Chain(fm.codecs) for key, fm in metas.items() if key in layout.meta.fields and fm.compressed}


def _read_block(layout: DatasetLayout, key: str, block: int, chain: Any = None) -> np.ndarray:
    """A block's bytes as the pipeline would put them in a window buffer (fill value where never written);
    ``chain`` decodes the block of a compressed array."""
    from ..backends.base import FillRequest, fill_pattern, pread_full

    meta = layout.meta
    fm = meta.array(key)
    first, end, nbytes = _block_span(layout, key, block)
    out = np.empty(nbytes, np.uint8)
    if chain is not None:  # a compressed block: its chunk read and decoded
        from ..codecs.chunks import CrcMismatch, chunk_error

        loc = layout.locate(key, block)
        if loc is None:
            fill_pattern(out, FillRequest(0, nbytes, fm.fill_bytes()))
            return out
        stored = np.empty(loc.nbytes, np.uint8)
        pread_full(layout.files.fd(loc.path), memoryview(stored), loc.offset, loc.path)
        try:
            return chain.decode(stored, nbytes)
        except ValueError as e:
            names = [n for n, _ in fm.codecs]
            raise chunk_error(layout, key, block, names, str(e), isinstance(e, CrcMismatch)) from None
    if key in meta.fields:
        pieces = [(layout.locate(key, block), 0, nbytes)]
    else:
        pieces = [(p.location, (p.row_start - first) * fm.sample_bytes, (p.row_stop - p.row_start) * fm.sample_bytes)
                  for p in layout.locate_rows(key, first, end)]
    for loc, at, n in pieces:
        if loc is None:
            fill_pattern(out, FillRequest(at, n, fm.fill_bytes()))
        else:
            pread_full(layout.files.fd(loc.path), memoryview(out)[at:at + n], loc.offset, loc.path)
    return out
