"""Checking blocks against their stored crc32c: after each window lands (every backend), and whole datasets.

A window's checks are segments of its buffer (one per block and field, where that block's bytes landed)
with the CRC the converter stored for them. The host verifier computes them with ``crc32c``; the device
verifier with a kernel on a stream of its own that waits on the window's "filled" event, copying back only
the CRCs. Either raises :class:`ReadError` naming the file, field, block and offset of the first bad block,
before any sample of that window is handed on.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from .checksum import device_expected, host_crcs
from .errors import ReadError
from .format import DatasetLayout


class Checks(NamedTuple):
    """Segments [lo, hi) of a buffer that must have the standard crc32c ``expected``; ``keys`` and
    ``blocks`` say which array and block each one is (for the error message)."""

    lo: np.ndarray
    hi: np.ndarray
    expected: np.ndarray
    keys: tuple[str, ...]
    blocks: np.ndarray


def concat(parts: list[Checks]) -> Checks:
    if not parts:
        empty = np.zeros(0, np.int64)
        return Checks(empty, empty, np.zeros(0, np.uint32), (), empty)
    return Checks(np.concatenate([c.lo for c in parts]), np.concatenate([c.hi for c in parts]),
                  np.concatenate([c.expected for c in parts]), sum((c.keys for c in parts), ()),
                  np.concatenate([c.blocks for c in parts]))


def describe_block(layout: DatasetLayout, key: str, block: int) -> str:
    """``PATH: block B of field 'F' (N bytes at offset O)`` for the file holding a block's first byte."""
    meta = layout.meta
    field = key.rsplit("/", 1)[0] if key.endswith("/values") else key
    if key in meta.fields:
        loc = layout.locate(key, block)
        if loc is None:
            return f"{meta.path}: block {block} of field '{field}' (never written: fill value)"
        return f"{loc.path}: block {block} of field '{field}' ({loc.nbytes} bytes at offset {loc.offset})"
    offsets = layout.offsets[field]
    k = meta.samples_per_block
    first, end = int(offsets[block * k]), int(offsets[min((block + 1) * k, meta.num_samples)])
    pieces = layout.locate_rows(key, first, end)
    loc = next((p.location for p in pieces if p.location is not None), None)
    if loc is None:
        return f"{meta.path}: block {block} of field '{field}' (values {first}..{end}, never written)"
    return f"{loc.path}: block {block} of field '{field}' (values {first}..{end}, from offset {loc.offset})"


def mismatch(layout: DatasetLayout, checks: Checks, got: np.ndarray) -> ReadError | None:
    """The error for the first segment whose CRC differs, or None."""
    bad = np.flatnonzero(got != checks.expected)
    if len(bad) == 0:
        return None
    i = int(bad[0])
    more = f"; {len(bad) - 1} more bad block(s) in this read" if len(bad) > 1 else ""
    return ReadError(f"{describe_block(layout, checks.keys[i], int(checks.blocks[i]))} fails its crc32c check "
                     f"(expected {int(checks.expected[i]):#010x}, found {int(got[i]):#010x}){more}")


class HostVerifier:
    """crc32c of host buffers (numpy), on the calling thread."""

    def __init__(self, layout: DatasetLayout):
        self.layout = layout

    def check(self, buf: Any, checks: Checks, filled: Any) -> Any:
        error = mismatch(self.layout, checks, host_crcs(buf, checks.lo, checks.hi))
        if error is not None:
            raise error
        return filled


class DeviceVerifier:
    """crc32c of device buffers by a kernel on the verifier's own stream, after the data's event."""

    def __init__(self, layout: DatasetLayout, device_id: int):
        import cupy

        from .checksum_cuda import DeviceCrc

        self.layout, self.cupy = layout, cupy
        self.crc = DeviceCrc(device_id)
        with self.crc.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()  # the completer and a resident load may check at once

    def check(self, buf: Any, checks: Checks, filled: Any) -> Any:
        from ._cuda import record_event

        with self._lock, self.crc.device:
            if filled is not None:
                self.stream.wait_event(filled)
            full = checks.hi > checks.lo
            got = np.zeros(len(checks.lo), dtype=np.uint32)  # an empty segment's CRC is 0
            expected = checks.expected.copy()
            if full.any():
                out = self.crc.launch(buf, checks.lo[full], checks.hi[full], self.stream)
                got[full] = out.get(stream=self.stream)  # waits for the kernel: only the CRCs come back
                expected[full] = device_expected(checks.expected[full], checks.lo[full], checks.hi[full])
            error = mismatch(self.layout, checks._replace(expected=expected), got)
            if error is not None:
                raise error
            return record_event(self.stream)


def make_verifier(layout: DatasetLayout, on_device: bool, device_id: int) -> Any:
    return DeviceVerifier(layout, device_id) if on_device else HostVerifier(layout)


# -- whole datasets ----------------------------------------------------------------------------------
class BadBlock(NamedTuple):
    where: str  # describe_block(...)
    message: str


def verify_dataset(path: str, num_threads: int = 8, progress: bool | None = None) -> tuple[int, list[BadBlock]]:
    """Re-read every block of every field of a dataset and check it against its stored crc32c.

    Returns (blocks checked, bad blocks). Reads go through the files the layout opened, on ``num_threads``
    threads; a block that cannot be read is listed as bad with the read error.
    """
    from tqdm import tqdm

    from .errors import FormatError
    from .format import read_metadata

    meta = read_metadata(path)
    with DatasetLayout(meta) as layout:
        missing = [f for f in layout.fields if f not in layout.checksums]
        if missing:
            raise FormatError(f"{meta.path}: no checksums for field(s) {missing} (written before checksums "
                              f"existed: convert it again with 'gdsload shard')")
        jobs = [(key, b) for key in layout.keys for b in range(meta.num_blocks)]
        chains = _chains(layout)
        total = sum(_block_span(layout, key, b)[2] for key, b in jobs)

        def check(job: tuple[str, int]) -> tuple[int, BadBlock | None]:
            key, b = job
            field = key.rsplit("/", 1)[0] if key.endswith("/values") else key
            _, _, nbytes = _block_span(layout, key, b)
            try:
                data = _read_block(layout, key, b, chains.get(key))
            except ReadError as e:
                return nbytes, BadBlock(describe_block(layout, key, b), str(e))
            got = host_crcs(data, np.array([0]), np.array([len(data)]))
            want = np.array([layout.checksums[field][b]], np.uint32)
            err = mismatch(layout, Checks(np.array([0]), np.array([len(data)]), want, (key,), np.array([b])), got)
            return nbytes, None if err is None else BadBlock(describe_block(layout, key, b), str(err))

        bad = []
        with ThreadPoolExecutor(num_threads, thread_name_prefix="gdsload-verify") as pool, \
                tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(meta.path),
                     disable=None if progress is None else not progress) as bar:
            for nbytes, result in pool.map(check, jobs):
                bar.update(nbytes)
                if result is not None:
                    bad.append(result)
        return len(jobs), bad


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
        from .decode import chunk_error

        loc = layout.locate(key, block)
        if loc is None:
            fill_pattern(out, FillRequest(0, nbytes, fm.fill_bytes()))
            return out
        stored = np.empty(loc.nbytes, np.uint8)
        pread_full(layout.files.fd(loc.path), memoryview(stored), loc.offset, loc.path)
        try:
            return chain.decode(stored, nbytes)
        except ValueError as e:
            raise chunk_error(layout, key, block, [n for n, _ in fm.codecs], str(e)) from None
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
