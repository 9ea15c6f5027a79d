"""Checking data against the checksums a store carries, before any sample of it is served.

The converter's block crc32c (when ``verify`` is on) and zarr's ``crc32c`` codec (always): a raw chunk's 4
stored bytes are read beside it (:func:`read_trailers`) and checked here, a compressed chunk's as it decodes
(:mod:`gdsload.codecs.decode`), a shard index's as it is read (:mod:`gdsload.format.shard_index`). A window's
checks (:class:`WindowChecks`) run on a host thread or a device stream and return at once; the assembler confirms
the :class:`Verdict` before it hands on a batch of the window or releases it. A mismatch is a
:class:`ChecksumError` naming the file, field, block or chunk, and offset (docs/design.md, "Verification").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from .checksum import Checks, concat, device_expected, host_crcs
from ..errors import ChecksumError, DecodeError
from ..format.files import pread_exact
from ..format.layout import DatasetLayout
from ..format.arrays import CRC_BYTES

class WindowRegions(Protocol):
    """Where a window's blocks land in its buffer (:class:`gdsload.pipeline.window.WindowMap` is one): what
    the checks of a window are cut from."""

    fields: Mapping[str, Any]  # name -> its region (``block_bytes``, ``chunk_checksum``)

    def checks(self, layout: DatasetLayout, blocks: np.ndarray) -> Checks: ...

    def chunk_starts(self, layout: DatasetLayout, name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


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

    def __init__(self, layout: DatasetLayout, window_map: WindowRegions, blocks: bool,
                 passed: Passed | None = None):
        self.layout, self.wl, self.blocks, self.passed = layout, window_map, blocks, passed
        self.trailed = [name for name, f in window_map.fields.items() if f.chunk_checksum]

    def __bool__(self) -> bool:
        return self.blocks or bool(self.trailed)

    def __call__(self, blocks: np.ndarray) -> Checks:
        """The checks of the window holding ``blocks`` (the trailers are read here, before its data), less
        those already passed where checks are kept (``passed``)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        parts = [self.wl.checks(self.layout, blocks)] if self.blocks else []
        if self.passed is not None and parts:
            parts[0] = self.passed.left(parts[0])
        for name in self.trailed:
            chunks, lo = self.wl.chunk_starts(self.layout, name, blocks)
            if self.passed is not None:  # before their trailers are read
                keep = ~self.passed.done(name)[chunks]
                chunks, lo = chunks[keep], lo[keep]
            bb = self.wl.fields[name].block_bytes
            parts.append(Checks(lo, lo + bb, read_trailers(self.layout, name, chunks), (name,) * len(chunks), chunks))
        return concat(parts)


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
        keep = np.ones(len(keys), dtype=bool)
        for k in set(checks.keys):
            sel = keys == k
            keep[sel] = ~self._done[k][checks.blocks[sel]]
        if keep.all():
            return checks
        return Checks(checks.lo[keep], checks.hi[keep], checks.expected[keep], tuple(keys[keep]), checks.blocks[keep])

    def mark(self, checks: Checks) -> None:
        keys = np.array(checks.keys, dtype=object)
        for k in set(checks.keys):
            self._done[k][checks.blocks[keys == k]] = True


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


class Verifier(Protocol):
    """Checks a window buffer against its checks after ``filled``, returning at once with a :class:`Verdict`
    to confirm later. :class:`HostVerifier` (a thread of its own) and :class:`DeviceVerifier` (a kernel on
    a stream of its own) keep it."""

    def start(self, buf: Any, checks: Checks, filled: Any) -> Verdict: ...
    def quiesce(self) -> None: ...
    def close(self) -> None: ...


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
        # (event, buffers) of checks queued: their output and pinned result live until the stream has passed
        # the event, also when their verdict is dropped unconfirmed (a pipeline closed).
        self._queued: deque[tuple[Any, tuple[Any, ...]]] = deque()

    def start(self, buf: Any, checks: Checks, filled: Any) -> Verdict:
        """Queue the checks of ``buf`` after ``filled``: a kernel, then a copy of its CRCs to pinned memory,
        then an event the verdict waits for."""
        from ..cuda.runtime import D2H, pinned_array, record_event

        full = checks.hi > checks.lo
        got = np.zeros(len(checks.lo), dtype=np.uint32)  # an empty segment's CRC is 0
        if not full.any():
            return Verdict(self.layout, checks, lambda: got)
        expected = checks.expected.copy()
        expected[full] = device_expected(checks.expected[full], checks.lo[full], checks.hi[full])
        host = pinned_array(int(full.sum()), np.uint32)
        with self._lock, self.crc.device:
            while self._queued and self._queued[0][0].done:
                self._queued.popleft()
            if filled is not None:
                self.stream.wait_event(filled)
            out = self.crc.launch(buf, checks.lo[full], checks.hi[full], self.stream)
            self.cupy.cuda.runtime.memcpyAsync(host.ctypes.data, out.data.ptr, host.nbytes, D2H, self.stream.ptr)
            event = record_event(self.stream)
            self._queued.append((event, (out, host)))

        def collect() -> np.ndarray:
            event.synchronize()
            got[full] = host
            return got
        return Verdict(self.layout, checks._replace(expected=expected), collect)

    def quiesce(self) -> None:
        """Wait for the checks queued so far, within :func:`gdsload.cuda.runtime.decode_wait_s`: they follow
        their window's decode in stream order, and a decode that does not end is a :class:`DecodeError`."""
        from ..cuda.runtime import decode_wait_s, wait_stream

        bound = decode_wait_s()
        with self._lock, self.crc.device:
            try:
                wait_stream(self.stream, bound)
            except TimeoutError:
                raise DecodeError(f"{self.layout.meta.path}: the checks queued after a window's decode are still "
                                  f"waiting after {bound:g} s (GDSLOAD_DECODE_WAIT_S): a decode that does not end (a "
                                  f"damaged frame can hang nvCOMP) holds them; the GPU may stay busy with it, so "
                                  f"the process may have to exit") from None
            self._queued.clear()

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
    return any(layout.meta.array(k).chunk_checksum for k in layout.keys)


class Verification:
    """What an open dataset checks, and the verifier (host or device) that checks it: the block checksums
    when ``blocks``, and every raw chunk's crc32c codec. One per dataset; its pipelines and resident loads
    share it."""

    def __init__(self, layout: DatasetLayout, blocks: bool, on_device: bool, device_id: int, once: bool = False):
        """``once``: the backend reads from memory it locked for the dataset's life (:class:`Passed`)."""
        self.layout, self.blocks = layout, blocks
        self.verifier: Verifier = (DeviceVerifier(layout, device_id) if on_device
                                                        else HostVerifier(layout))
        self.passed = Passed(layout) if once else None

    def checks(self, window_map: WindowRegions) -> WindowChecks:
        """The checks of windows laid out by ``window_map``."""
        return WindowChecks(self.layout, window_map, self.blocks, self.passed)

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
