"""``gdsload verify``: re-read a whole dataset or Zarr store and check every checksum it carries, on threads.

Block checksums, a Zarr store's ``crc32c`` codec and every shard index's crc32c; what cannot be checked is
named, and every missing chunk (:mod:`gdsload.format.missing`) counted and named. A remote dataset is checked as
its server holds it now: its skeleton in a temporary folder, the blocks read from the objects, pinned by ETag.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..codecs.checksum import Checks, host_crcs
from ..errors import FormatError, ReadError
from ..format.files import pread_exact
from ..format.layout import DatasetLayout
from ..format.missing import MissingChunks
from ..remote.objects import is_remote
from ..codecs.verify import describe_block, mismatch, unchecked_fields

#: ``read(path, offset, nbytes)``: bytes of one of the layout's files (a ReadError naming it if it fails).
Reads = Callable[[str, int, int], bytes]


class BadBlock(NamedTuple):
    where: str  # describe_block(...), or the shard file whose index fails its check
    message: str


class Report(NamedTuple):
    """What :func:`verify_dataset` found: ``checked`` units (``unit``: "block" for a gdsload dataset's block
    checksums, "chunk" for a Zarr store's crc32c codec), the bad ones, the fields that carry no checksum and
    so were not checked, and the chunks missing from the store (never checked: counted apart)."""

    checked: int
    bad: list[BadBlock]
    unchecked: list[str]
    unit: str
    missing: tuple[MissingChunks, ...] = ()

    @property
    def missing_chunks(self) -> int:
        return sum(len(m.chunks) for m in self.missing)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[tuple[str, Reads | None, Callable[[str], str]]]:
    """``(root, reads, name)`` of the dataset at ``path``: a local one as it is (``reads`` None: its files);
    a remote one's skeleton in a temporary folder (:func:`gdsload.remote.mirror.open_version`), removed on
    exit, with ``reads`` of its shards' bytes from the objects and ``name`` turning a message's local paths
    back into the URL's (its password redacted). A temporary folder, not the node's cache: what is shown and
    checked is what the server holds now, and nothing is left behind."""
    if not is_remote(path):
        yield path, None, lambda text: text
        return
    from ..remote.mirror import as_urls, open_version
    from ..remote import client_for

    with tempfile.TemporaryDirectory(prefix="gdsload-remote-") as tmp:
        version = open_version(path, tmp)
        client, root = client_for(path), version.root

        def reads(where: str, offset: int, nbytes: int) -> bytes:
            entry = version.shards.get(where)
            if entry is None:  # fetched whole with the skeleton
                with open(where, "rb") as f:
                    f.seek(offset)
                    data = f.read(nbytes)
                if len(data) == nbytes:
                    return data
                raise ReadError(f"{where}: file ends before byte {offset + nbytes}")
            return client.read(entry.info, offset, nbytes)

        yield root, reads, lambda text: as_urls(text, version)


def verify_dataset(path: str, num_threads: int = 8, progress: bool | None = None) -> Report:
    """Re-read a whole dataset and check everything it carries: a gdsload dataset's block checksums, a Zarr
    store's crc32c codec on every written chunk (raw: its 4 stored bytes; compressed: as it decodes), and
    every shard index's crc32c; every missing chunk is listed apart. A data file the layout cannot open (an
    index that fails its check, a chunk file of the wrong size) is reported as bad, and nothing behind it
    read. ``path`` may be a remote dataset's URL (:func:`local_copy`): messages then name its objects.

    Reads go through the files the layout opened (a remote dataset: ranged reads of its objects), on
    ``num_threads`` threads; a block or chunk that cannot be read or decoded is listed as bad with the
    error. Metadata gdsload cannot read is a FormatError.
    """
    with local_copy(path) as (root, reads, name):
        report = _verify(root, num_threads, progress, reads)
    if root == path:
        return report
    return report._replace(bad=[BadBlock(name(b.where), name(b.message)) for b in report.bad],
                           missing=tuple(m._replace(path=name(m.path)) for m in report.missing))


def _verify(path: str, num_threads: int, progress: bool | None, reads: Reads | None) -> Report:
    from tqdm import tqdm

    from ..format.meta import read_metadata

    meta = read_metadata(path)
    unit = "chunk" if meta.foreign else "block"
    try:
        layout = DatasetLayout(meta, missing_chunks="fill")  # missing chunks: counted below
    except (FormatError, ReadError) as e:  # the data files (an index, a chunk file's size): damaged
        return Report(0, [BadBlock(str(e).split(": ", 1)[0], str(e))], [], unit)
    with layout:
        read = reads or (lambda where, offset, nbytes: pread_exact(layout.files[where], offset, nbytes))
        unchecked = unchecked_fields(layout)
        keys = [k for f, k in zip(layout.fields, layout.keys) if f not in unchecked]
        if meta.foreign:
            jobs = [(k, int(c)) for k in keys for c in np.flatnonzero(layout.block_offsets[k] >= 0)]
            check, size = _chunk_check(layout, read), lambda job: int(layout.locate(*job).nbytes)  # type: ignore
        else:  # a missing block of a fixed field is counted as missing, not read as its fill value
            jobs = [(k, b) for k in keys for b in range(meta.num_blocks)
                    if k not in meta.fields or layout.block_offsets[k][b] >= 0]
            check, size = _block_check(layout, read), lambda job: _block_span(layout, *job)[2]
        bad = []
        with ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-verify") as pool, \
                tqdm(total=sum(size(j) for j in jobs), unit="B", unit_scale=True, desc=os.path.basename(meta.path),
                     disable=None if progress is None else not progress) as bar:
            for job, result in zip(jobs, pool.map(check, jobs)):
                bar.update(size(job))
                if result is not None:
                    bad.append(result)
        return Report(len(jobs), bad, unchecked, unit, tuple(layout.missing))


def _block_check(layout: DatasetLayout, read: Reads) -> Any:
    """(key, block) -> None, or the BadBlock of a block that fails its block checksum or cannot be read."""
    chains = _chains(layout)

    def check(job: tuple[str, int]) -> BadBlock | None:
        key, b = job
        field = key.rsplit("/", 1)[0] if key.endswith("/values") else key
        try:
            data = _read_block(layout, key, b, read, chains.get(key))
        except ReadError as e:
            return BadBlock(describe_block(layout, key, b), str(e))
        got = host_crcs(data, np.array([0]), np.array([len(data)]))
        want = np.array([layout.checksums[field][b]], np.uint32)
        err = mismatch(layout, Checks(np.array([0]), np.array([len(data)]), want, (key,), np.array([b])), got)
        return None if err is None else BadBlock(describe_block(layout, key, b), str(err))
    return check


def _chunk_check(layout: DatasetLayout, read: Reads) -> Any:
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
                _read_block(layout, key, c, read, chains[key])
                return None
            stored = read(loc.path, loc.offset, fm.stored_bytes)
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


def _read_block(layout: DatasetLayout, key: str, block: int, read: Reads, chain: Any = None) -> np.ndarray:
    """A block's bytes as the pipeline would put them in a window buffer (fill value where never written),
    read by ``read``; ``chain`` decodes the block of a compressed array."""
    from ..backends.base import FillRequest, fill_pattern

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
        stored = np.frombuffer(read(loc.path, loc.offset, loc.nbytes), np.uint8)
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
            out[at:at + n] = np.frombuffer(read(loc.path, loc.offset, n), np.uint8)
    return out
