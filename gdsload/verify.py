"""Checking data against the checksums a store carries, before any sample of it is served.

Two kinds of checksum: the crc32c the converter stores for every block of a gdsload dataset (checked when
``verify`` is on), and the crc32c codec zarr writes after each chunk (``bytes`` then ``crc32c``; always
checked, as zarr-python does). A compressed chunk's codec is checked as it is decoded (:mod:`gdsload.decode`);
a raw chunk's 4 stored bytes are read beside it (:func:`read_trailers`) and its data checked here. A shard
index's crc32c is checked as the index is read (:mod:`gdsload.shard_index`).

A window's checks (:class:`WindowChecks`) are segments of its buffer, each with the CRC stored for it. The
host verifier computes them with ``crc32c`` on the calling thread. The device verifier queues a kernel on a
stream of its own after the window's "filled" event and copies back only the CRCs, then returns at once: the
assembler gathers the window meanwhile (both only read it) and confirms the verdict (:class:`Verdict`)
before it hands on any batch drawn from the window, and before the window buffer is released for reuse.
A mismatch is a :class:`ChecksumError` (a ReadError) naming the file, field, block or chunk, and offset.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .checksum import Checks, concat, device_expected, host_crcs
from .errors import ChecksumError, FormatError, ReadError
from .files import pread_exact
from .format import DatasetLayout
from .shard_index import CRC_BYTES

if TYPE_CHECKING:
    from .window import WindowLayout


def describe_block(layout: DatasetLayout, key: str, block: int) -> str:
    """``PATH: block B of field 'F' (N bytes at offset O)`` for the file holding a block's first byte; for
    a foreign store, whose checks are per chunk, ``PATH: chunk C of field 'F' (...)``."""
    meta = layout.meta
    field = key.rsplit("/", 1)[0] if key.endswith("/values") else key
    if key in meta.fields:
        unit = "chunk" if meta.foreign else "block"
        loc = layout.locate(key, block)
        if loc is None:
            return f"{meta.path}: {unit} {block} of field '{field}' (never written: fill value)"
        return f"{loc.path}: {unit} {block} of field '{field}' ({loc.nbytes} bytes at offset {loc.offset})"
    offsets = layout.offsets[field]
    k = meta.samples_per_block
    first, end = int(offsets[block * k]), int(offsets[min((block + 1) * k, meta.num_samples)])
    pieces = layout.locate_rows(key, first, end)
    loc = next((p.location for p in pieces if p.location is not None), None)
    if loc is None:
        return f"{meta.path}: block {block} of field '{field}' (values {first}..{end}, never written)"
    return f"{loc.path}: block {block} of field '{field}' (values {first}..{end}, from offset {loc.offset})"


def mismatch(layout: DatasetLayout, checks: Checks, got: np.ndarray) -> ChecksumError | None:
    """The error for the first segment whose CRC differs, or None."""
    bad = np.flatnonzero(got != checks.expected)
    if len(bad) == 0:
        return None
    i = int(bad[0])
    more = f"; {len(bad) - 1} more bad in this read" if len(bad) > 1 else ""
    return ChecksumError(f"{describe_block(layout, checks.keys[i], int(checks.blocks[i]))} fails its crc32c check "
                         f"(expected {int(checks.expected[i]):#010x}, found {int(got[i]):#010x}){more}")


def read_trailers(layout: DatasetLayout, key: str, chunks: np.ndarray) -> np.ndarray:
    """The crc32c the ``crc32c`` codec stored after each of ``chunks`` (raw, written) of array ``key``,
    read through the layout's open files; a short read is a ReadError naming the file and offset."""
    bb = layout.meta.array(key).block_bytes
    offsets, files = layout.block_offsets[key][chunks], layout.chunk_files[key][chunks]
    paths = layout.paths(key)
    out = np.empty(len(chunks), dtype=np.uint32)
    for i, (file, offset) in enumerate(zip(files.tolist(), offsets.tolist())):
        out[i] = int.from_bytes(pread_exact(layout.files[paths[file]], offset + bb, CRC_BYTES), "little")
    return out


class WindowChecks:
    """What a window of an open dataset is checked against: the converter's block checksums when ``blocks``
    (``verify`` on), and, always, the crc32c codec of every raw field whose chunks carry one. False when
    there is nothing to check."""

    def __init__(self, layout: DatasetLayout, window_layout: WindowLayout, blocks: bool,
                 passed: Passed | None = None):
        self.layout, self.wl, self.blocks, self.passed = layout, window_layout, blocks, passed
        self.trailed = [name for name, f in window_layout.fields.items() if f.chunk_checksum and not f.compressed]

    def __bool__(self) -> bool:
        return self.blocks or bool(self.trailed)

    def __call__(self, blocks: np.ndarray) -> Checks:
        """The checks of the window holding ``blocks`` (the trailers are read here, before its data), less
        those already passed where checks are kept (``passed``)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        parts = [self.wl.checks(self.layout, blocks)] if self.blocks else []
        for name in self.trailed:
            chunks, lo = self.wl.chunk_starts(self.layout, name, blocks)
            if self.passed is not None:
                keep = ~self.passed.done(name)[chunks]
                chunks, lo = chunks[keep], lo[keep]
            bb = self.wl.fields[name].block_bytes
            parts.append(Checks(lo, lo + bb, read_trailers(self.layout, name, chunks), (name,) * len(chunks), chunks))
        checks = concat(parts)
        return checks if self.passed is None else self.passed.left(checks)


class Passed:
    """The checks a dataset's blocks (and chunks) have passed, kept where a backend reads from memory it
    locked for the dataset's life (``Backend.reads_locked_memory``): the bytes a check passed there are
    the bytes every later read copies, so each is checked once, the first time it is read. Marked only
    once a verdict is confirmed; threads may race to check one twice, never to skip one."""

    def __init__(self, layout: DatasetLayout):
        meta = layout.meta
        self._done = {k: np.zeros(max(meta.num_blocks, meta.array(k).num_chunks), dtype=bool) for k in layout.keys}

    def done(self, key: str) -> np.ndarray:
        return self._done[key]

    def left(self, checks: Checks) -> Checks:
        """``checks`` less the segments already passed."""
        keys = np.array(checks.keys, dtype=object)
        keep = np.array([not self._done[k][b] for k, b in zip(checks.keys, checks.blocks.tolist())], dtype=bool)
        if keep.all():
            return checks
        return Checks(checks.lo[keep], checks.hi[keep], checks.expected[keep], tuple(keys[keep]), checks.blocks[keep])

    def mark(self, checks: Checks) -> None:
        for k in set(checks.keys):
            sel = np.array([key == k for key in checks.keys], dtype=bool)
            self._done[k][checks.blocks[sel]] = True


class Verdict:
    """A window's check, maybe still running: :meth:`confirm` waits for it (``collect`` returns the CRCs it
    computed) and raises the ChecksumError of its first bad segment; later calls do nothing. Until
    confirmed, the check may still read the window buffer."""

    def __init__(self, layout: DatasetLayout | None = None, checks: Checks | None = None,
                 collect: Callable[[], np.ndarray] | None = None):
        self._layout, self._checks, self._collect = layout, checks, collect
        self.confirmed = collect is None
        self.passed: Passed | None = None  # where to record the checks once they pass

    def confirm(self) -> None:
        if self.confirmed:
            return
        layout, checks, collect = self._layout, self._checks, self._collect
        self._layout = self._checks = self._collect = None
        self.confirmed = True
        assert layout is not None and checks is not None and collect is not None
        error = mismatch(layout, checks, collect())
        if error is not None:
            raise error
        if self.passed is not None:
            self.passed.mark(checks)


class HostVerifier:
    """crc32c of host buffers on a thread of its own (``crc32c`` releases the GIL), so the assembler gathers
    from the window meanwhile. The thread starts on first use; :meth:`close` stops it."""

    def __init__(self, layout: DatasetLayout):
        self.layout = layout
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self, buf: Any, checks: Checks, filled: Any) -> Verdict:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="gdsload-verify")
            future = self._pool.submit(host_crcs, buf, checks.lo, checks.hi)
        return Verdict(self.layout, checks, future.result)

    def quiesce(self) -> None:
        """Wait for the checks started so far (one thread: they run in order)."""
        with self._lock:
            last = self._pool.submit(int) if self._pool is not None else None
        if last is not None:
            last.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class DeviceVerifier:
    """crc32c of device buffers by a kernel on the verifier's own stream, after the data's event; only the
    CRCs come back, into pinned host memory, without waiting."""

    def __init__(self, layout: DatasetLayout, device_id: int):
        import cupy

        from .checksum_cuda import DeviceCrc

        self.layout, self.cupy = layout, cupy
        self.crc = DeviceCrc(device_id)
        with self.crc.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()  # the completer and a resident load may check at once

    def start(self, buf: Any, checks: Checks, filled: Any) -> Verdict:
        """Queue the checks of ``buf`` after ``filled``: a kernel, then a copy of its CRCs to pinned memory,
        then an event the verdict waits for."""
        import cupyx

        from ._cuda import D2H, record_event

        full = checks.hi > checks.lo
        got = np.zeros(len(checks.lo), dtype=np.uint32)  # an empty segment's CRC is 0
        if not full.any():
            return Verdict(self.layout, checks, lambda: got)
        expected = checks.expected.copy()
        expected[full] = device_expected(checks.expected[full], checks.lo[full], checks.hi[full])
        host = cupyx.empty_pinned(int(full.sum()), dtype=np.uint32)
        with self._lock, self.crc.device:
            if filled is not None:
                self.stream.wait_event(filled)
            out = self.crc.launch(buf, checks.lo[full], checks.hi[full], self.stream)
            self.cupy.cuda.runtime.memcpyAsync(host.ctypes.data, out.data.ptr, host.nbytes, D2H, self.stream.ptr)
            event = record_event(self.stream)

        held = [out]  # the kernel's output, until the copy from it is over

        def collect() -> np.ndarray:
            event.synchronize()
            got[full] = host
            held.clear()
            return got
        return Verdict(self.layout, checks._replace(expected=expected), collect)

    def quiesce(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.quiesce()


def unchecked_fields(layout: DatasetLayout) -> list[str]:
    """The fields read that carry no checksum at all: no block checksums, and chunks without a crc32c codec."""
    def carried(field: str, key: str) -> bool:
        fm = layout.meta.array(key)
        return field in layout.checksums or fm.chunk_checksum or "crc32c" in (n for n, _ in fm.codecs)
    return [f for f, k in zip(layout.fields, layout.keys) if not carried(f, k)]


def carries_trailers(layout: DatasetLayout) -> bool:
    """Whether any array read stores a crc32c after each raw chunk (which is then always checked)."""
    return any(layout.meta.array(k).chunk_checksum and not layout.meta.array(k).compressed for k in layout.keys)


class Verification:
    """What an open dataset checks, and the verifier (host or device) that checks it: the block checksums
    when ``blocks``, and every raw chunk's crc32c codec. One per dataset; its pipelines and resident loads
    share it."""

    def __init__(self, layout: DatasetLayout, blocks: bool, on_device: bool, device_id: int, once: bool = False):
        """``once``: the backend reads from memory it locked for the dataset's life (:class:`Passed`)."""
        self.layout, self.blocks = layout, blocks
        self.verifier: HostVerifier | DeviceVerifier = (DeviceVerifier(layout, device_id) if on_device
                                                        else HostVerifier(layout))
        self.passed = Passed(layout) if once else None

    def checks(self, window_layout: WindowLayout) -> WindowChecks:
        """The checks of windows laid out by ``window_layout``."""
        return WindowChecks(self.layout, window_layout, self.blocks, self.passed)

    def start(self, buf: Any, checks: Checks, filled: Any) -> Verdict:
        verdict = self.verifier.start(buf, checks, filled)
        verdict.passed = self.passed
        return verdict

    def check(self, buf: Any, checks: Checks, filled: Any) -> Any:
        """Check now: raise on a mismatch, else return the event after which the data is there."""
        self.start(buf, checks, filled).confirm()
        return filled

    def quiesce(self) -> None:
        """Wait until no check still reads a window buffer or writes its result (a pipeline stops)."""
        self.verifier.quiesce()

    def close(self) -> None:
        """Stop the verifier's thread (host); the dataset closes. Idempotent."""
        self.verifier.close()


# -- whole datasets ----------------------------------------------------------------------------------
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

    from .format import read_metadata

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
    from .decode import Chain

    metas = {key: layout.meta.array(key) for key in layout.keys}
    return {key: Chain(fm.codecs) for key, fm in metas.items() if key in layout.meta.fields and fm.compressed}


def _read_block(layout: DatasetLayout, key: str, block: int, chain: Any = None) -> np.ndarray:
    """A block's bytes as the pipeline would put them in a window buffer (fill value where never written);
    ``chain`` decodes the block of a compressed array."""
    from .backends.base import FillRequest, fill_pattern, pread_full

    meta = layout.meta
    fm = meta.array(key)
    first, end, nbytes = _block_span(layout, key, block)
    out = np.empty(nbytes, np.uint8)
    if chain is not None:  # a compressed block: its chunk read and decoded
        from .decode import CrcMismatch, chunk_error

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
