"""The reader: what an open dataset reads with, and the one place where blocks for a buffer become backend calls.

:meth:`Reader.open` reads the metadata and has the dataset's source make the backend (cheap);
:meth:`Opened.start` builds the :class:`Reader` in one step once the windows' size is known. The pipeline's
windows, the first window and the resident fields all go through :meth:`Reader.submit`,
:meth:`Reader.load_first` and :meth:`Reader.read_resident`, so each is read, decoded and checked the same way.
Not thread-safe by itself; its life and its callers: docs/design.md, "The reader".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._tasks import Pending, Queued, close_each, drain
from ..backends import info, resolve
from ..backends.base import Backend, Request
from ..backends.cpu import CpuBackend
from ..backends.source import Source
from ..codecs.decode import WindowDecoder, all_of
from ..codecs.verify import Verdict, Verification, carries_trailers, unchecked_fields
from ..errors import GDSLoadError, ReadError, with_context
from ..format.layout import DatasetLayout
from ..format.meta import DatasetMeta, read_metadata
from ..system.env import warn_few_connections
from .assembler import ResidentField
from .plan import DEFAULT_RESIDENT_BYTES, EpochPlan, blocks_per_rank, resident_fields, window_blocks_for
from .ragged import capacity_rows
from .window import WindowBuffer, WindowMap, Work, cell_rows

#: Windows of the first epoch whose reads the backend checks at open for what one read holds at once.
ROOM_WINDOWS = 256


class Filled(NamedTuple):
    """A window read, decoded and its check started: its data is there after ``event`` (None: already),
    and ``verdict`` (None: nothing to check) must be confirmed before a batch drawn from it is handed on."""

    event: Any
    verdict: Verdict | None


class InFlight:
    """One window's reads in flight: :meth:`finish` waits for them, decodes and starts the check;
    :meth:`drain` waits for them after an error elsewhere. Either, once, leaves no read writing the buffer."""

    def __init__(self, reader: Reader, buf: WindowBuffer, work: Work, pending: Pending, host: Pending | None,
                 checks: Any, opened: bool = False):
        """``opened``: the buffer held the window since the dataset's open (nothing was read now)."""
        self.reader, self.buf, self.work, self.checks, self.opened = reader, buf, work, checks, opened
        self._pending: Pending | None = pending
        self._host = host

    @property
    def read_bytes(self) -> int:
        return self.work.read_bytes

    def finish(self, stop: threading.Event) -> Filled:
        r, verdict = self.reader, None
        try:
            pending, self._pending = self._pending, None
            event = pending.finish() if pending is not None else None
            decoded = None  # the device decode's check, confirmed before the blocks' own
            if r.decoder is not None and not stop.is_set():
                host, self._host = self._host, None
                if host is not None:
                    host.finish()
                event, decoded = r.decoder.decode(self.buf, self.work, event, stop)
            if r.verification is not None and self.checks is not None and len(self.checks.lo) and not stop.is_set():
                verdict = r.verification.start(self.buf.buffer, self.checks, event)
            verdict = all_of([decoded, verdict])
        finally:
            self.drain()
        return Filled(event, verdict)

    def drain(self) -> None:
        for name in ("_pending", "_host"):
            pending = getattr(self, name)
            setattr(self, name, None)
            if pending is not None:
                drain(pending)


class Opened:
    """A dataset opened for reading, its windows not yet sized: the metadata, the block layout (its shard files
    held open), the backend made by ``source`` (where the files are: gdsload/backends/source.py).
    :meth:`start` makes the :class:`Reader`; :meth:`close` frees what was opened."""

    def __init__(self, meta: DatasetMeta, layout: DatasetLayout, resident: tuple[str, ...], backend: Backend,
                 backend_name: str, backend_reason: str, device: int, verify: bool | None, source: Source):
        self.meta, self.layout, self.resident_fields, self.source = meta, layout, resident, source
        self.backend, self.device = backend, device
        self.backend_name, self.backend_reason = backend_name, backend_reason
        self.fields = layout.fields
        self.verify = layout.has_checksums if verify is None else verify
        self.ragged_fields = tuple(f for f in self.fields if f in meta.ragged)
        self.windowed_fields = tuple(f for f in self.fields if f in meta.fields and f not in resident)
        self.on_device = info(backend_name).on_device

    def window_blocks(self, batch_size: int, world_size: int) -> int:
        """The default blocks per window: enough for a batch and about the backend's preferred window size."""
        meta, spb = self.meta, self.meta.samples_per_block
        # A fixed field counts with its cell per block; a variable-length field with its mean bytes per block.
        block_bytes = (sum(cell_rows(spb, meta.fields[f].samples_per_block) * meta.fields[f].sample_bytes
                           for f in self.windowed_fields)
                       + sum(meta.ragged[f].values.sample_bytes * int(self.layout.offsets[f][-1]) // meta.num_blocks
                             for f in self.ragged_fields))
        return window_blocks_for(block_bytes, self.backend.window_bytes_hint, batch_size, spb, meta.num_blocks,
                                 world_size)

    def max_window_blocks(self, world_size: int) -> int:
        return blocks_per_rank(self.meta.num_blocks, world_size)

    def start(self, window_blocks: int) -> Reader:
        """The reader of windows of ``window_blocks`` blocks (on an error, this stays open: close it)."""
        return Reader(self, window_blocks)

    def named(self, e: GDSLoadError) -> GDSLoadError:
        """``e`` naming the files as the user knows them (the source's names for them)."""
        return self.source.named(e)

    def close(self) -> None:
        """Free the backend, the file handles and the source, each even where one before failed (the first error
        is raised after). Idempotent."""
        close_each((self.backend.close, self.layout.close, self.source.close))


class Reader(Opened):
    """What an open dataset reads with (see the module's docstring). Not thread-safe by itself: the
    pipeline's submitter and completer use it in order, and resident loads before any pipeline runs."""

    def __init__(self, opened: Opened, window_blocks: int):
        """Map windows of ``window_blocks`` blocks, make the verifier and decoder, and prepare the backend
        (last: mmap may read the whole dataset there)."""
        from ..codecs.chunks import device_fields

        o = opened
        self.unsettled: BaseException | None = None  # a stopped pipeline's DecodeError, raised by close()
        super().__init__(o.meta, o.layout, o.resident_fields, o.backend, o.backend_name, o.backend_reason, o.device,
                         o.verify, o.source)
        meta, layout = self.meta, self.layout
        fixed = [meta.fields[f] for f in self.fields if f in meta.fields]
        # Compressed fields: decoded on the device by nvCOMP, or by CPU threads from a host buffer (GPU backends).
        self.device_decoded, self.host_decoded = device_fields(fixed, self.on_device)
        capacity = {f: (meta.ragged[f], capacity_rows(layout.offsets[f], meta.samples_per_block, window_blocks))
                    for f in self.ragged_fields}
        self.window_map = WindowMap([meta.fields[f] for f in self.windowed_fields], window_blocks, capacity,
                                    samples_per_block=meta.samples_per_block, chunk_lengths=layout.chunk_lengths,
                                    host_fields=self.host_decoded)
        self.verification: Verification | None = None
        self.decoder: WindowDecoder | None = None
        self._checks: Any = None
        self._host_reader: Backend | None = None
        self._resident: dict[str, ResidentField] | None = None  # read on first use, kept until close()
        try:
            blocks = self.verify and layout.has_checksums
            once = self.backend.reads_locked_memory  # each block checked the first time it is read
            if blocks or carries_trailers(layout):
                self.verification = Verification(layout, blocks, self.on_device, self.device, once)
                checks = self.verification.checks(self.window_map)
                self._checks = checks if checks else None
            if any(meta.array(k).compressed for k in layout.keys):
                from ..codecs.decode import Decoder

                self.decoder = Decoder(layout, self.on_device, self.device, self.device_decoded)
            self.backend.prepare(layout.files)
        except BaseException:
            for part in (self.decoder, self.verification):  # the opened parts are the caller's to close
                if part is not None:
                    part.close()
            raise

    @classmethod
    def open(cls, source: Source | str | os.PathLike[str], fields: Sequence[str] | None, backend: str, device: int,
             resident_bytes: int, verify: bool | None, backend_options: dict[str, Any] | None,
             on_resolved: Callable[[str], None] = lambda name: None, missing_chunks: str = "error") -> Opened:
        """Read the metadata at ``source`` (gdsload.backends.source.open_source; a path: local files) and have it
        choose and make the backend (``on_resolved`` checks arguments that depend on which, before it is made).
        ``missing_chunks``: see :class:`~gdsload.format.layout.DatasetLayout`. The source is the opened dataset's
        from now on; on an error it is closed here, nothing is left open, and the error names the files as the
        source does."""
        source = source if isinstance(source, Source) else Source(source)
        try:
            opened = cls._open(source, fields, backend, device, resident_bytes, verify, backend_options, on_resolved,
                               missing_chunks)
        except BaseException as e:
            source.close()
            named = source.named(e) if isinstance(e, GDSLoadError) else e
            if named is e:
                raise
            raise named from e
        if opened.on_device:
            warn_few_connections()  # the steps would wait behind this dataset's copies
        return opened

    @classmethod
    def _open(cls, source: Source, fields: Sequence[str] | None, backend: str, device: int, resident_bytes: int,
              verify: bool | None, backend_options: dict[str, Any] | None, on_resolved: Callable[[str], None],
              missing_chunks: str) -> Opened:
        meta = read_metadata(source.root, fields)
        names = tuple(fields) if fields is not None else tuple(meta.names)
        resident = resident_fields(meta, names, resident_bytes)
        # A foreign store's block: chosen for the arrays read block by block (the others are read whole).
        meta = meta.with_block([f for f in names if f in meta.fields and f not in resident])
        layout = DatasetLayout(meta, tuple(fields) if fields is not None else None, missing_chunks)
        try:
            paths = list(layout.files)
            # auto may pick the RAM tier: it needs the size of what this dataset reads (one the source bounds is
            # held whole for it only within the bound).
            size = sum(layout.files.get(p).size for p in paths)
            bound = source.bound
            name, reason = resolve(backend, size if bound is None or bound >= size else None,
                                   paths[0] if paths else None)
            on_resolved(name)
            unchecked = unchecked_fields(layout) if verify else []
            if unchecked:
                kind = ("its chunks have no crc32c codec" if meta.foreign
                        else "written by a converter without block checksums")
                raise ValueError(f"verify=True: {meta.path}: field(s) {unchecked} carry no checksum ({kind}); "
                                 f"convert it with 'gdsload shard' to add them, or pass verify=False")
            made = source.backend(backend, name, reason, backend_options, device, layout)
        except BaseException:
            layout.close()
            raise
        return Opened(meta, layout, resident, made.backend, made.name, made.reason, device, verify, source)

    # -- windows -----------------------------------------------------------------------------------------
    def allocate(self) -> WindowBuffer:
        return WindowBuffer(self.backend.allocate(self.window_map.nbytes))

    def submit(self, buf: WindowBuffer, blocks: np.ndarray, stop: threading.Event,
               pace: Callable[[], None] = lambda: None) -> InFlight:
        """Start reading ``blocks`` into ``buf`` (nothing, where it holds them since the open). ``pace`` is
        called between the longer pieces of Python work (gdsload.pipeline.pacing)."""
        work = self.window_map.work(self.layout, blocks)
        pace()
        checks = self._checks(blocks) if self._checks is not None else None
        pace()
        loaded = buf.take_loaded(work.requests)
        if loaded:
            self.backend.passed(work.requests)
        pending = Queued(None) if loaded else self.backend.submit(buf.buffer, work.requests, stop)
        try:
            host = self._submit_host(buf, work, stop)
        except BaseException:
            InFlight(self, buf, work, pending, None, None).drain()  # reads over before the error goes on
            raise
        return InFlight(self, buf, work, pending, host, checks, opened=loaded)

    def expect(self, windows: Sequence[np.ndarray]) -> None:
        """The windows :meth:`submit` is given next, in order (from the pipeline), for a backend that works ahead
        of its reads."""
        self.backend.expect(windows, self._reads)

    def idle(self) -> None:
        """A pipeline stopped, or a read outside one is over: what the backend did ahead of the reads stops."""
        self.backend.idle()

    def _reads(self, blocks: np.ndarray, window_map: WindowMap | None = None) -> list[Request]:
        """The requests a window of ``blocks`` makes, through the backend and its host reader."""
        work = (window_map or self.window_map).work(self.layout, blocks)
        return [*work.requests, *work.host_requests]

    def _submit_host(self, wb: WindowBuffer, work: Work, stop: threading.Event) -> Pending | None:
        """The reads of compressed chunks decoded by CPU threads, into the window's host buffer (made on first
        use): by the backend's host reader where it has one, else by threaded POSIX reads over the open files."""
        if work.host_nbytes and (wb.host is None or len(wb.host) < work.host_nbytes):
            wb.host = self.decoder.host_buffer(work.host_nbytes)
        if not work.host_requests:
            return None
        if self._host_reader is None:
            self._host_reader = getattr(self.backend, "host_reader", CpuBackend)()
            self._host_reader.prepare(self.layout.files)
        return self._host_reader.submit(wb.host, work.host_requests, stop)

    def load_first(self, plan: EpochPlan) -> WindowBuffer:
        """The first window buffer, holding the window a pass from the dataset's start reads first (which that
        pass then does not read again): the backend's own start and that window's reads happen in the open,
        and a file they cannot read fails the open, naming it. What the backend could never hold is refused
        first (:meth:`gdsload.backends.base.Backend.check_room`), not after waits."""
        self.backend.check_room(self._held_at_once(plan))
        buf = self.allocate()
        requests = self.window_map.first_requests(self.layout, plan)
        if requests:
            try:
                try:
                    filled = self.backend.load(buf.buffer, requests, threading.Event())
                    if filled is not None:
                        filled.synchronize()  # there when the open returns (copies queued would hold up the pass)
                finally:
                    self.idle()  # no pass runs yet
            except GDSLoadError as e:
                named = self.named(e)
                if named is e:
                    raise
                raise named from e
            buf.loaded = requests
        return buf

    def _held_at_once(self, plan: EpochPlan) -> Iterator[list[Request]]:
        """What each read holds at once (made as asked): the first windows of ``plan``, each resident field whole."""
        for blocks in plan.windows[:ROOM_WINDOWS]:
            yield self._reads(blocks)
        for n in self.resident_fields:
            yield self._reads(np.arange(self.meta.fields[n].num_chunks), self._whole_field(n))

    def _whole_field(self, name: str) -> WindowMap:
        """The window map of field ``name`` read whole: every chunk back to back, a block per chunk."""
        f = self.meta.fields[name]
        return WindowMap([f], f.num_chunks, samples_per_block=f.samples_per_block,
                         chunk_lengths=self.layout.chunk_lengths, host_fields=self.host_decoded)

    def resident(self, closing: threading.Event) -> tuple[dict[str, ResidentField], int]:
        """The resident fields, read whole on the first call (a close meanwhile stops it), then kept; and the
        bytes this call read (0 after the first)."""
        if self._resident is not None:
            return self._resident, 0
        try:
            self._resident = {name: self.read_resident(name, closing) for name in self.resident_fields}
        finally:
            self.idle()
        return self._resident, sum(r.array.nbytes for r in self._resident.values())

    def read_resident(self, name: str, closing: threading.Event) -> ResidentField:
        """Field ``name`` whole: every chunk back to back, a block per chunk, so row i holds sample i whatever
        the plan's block is; decoded and checked as windows are. A ReadError names the field; a close while it
        loads is a GDSLoadError."""
        f, single = self.meta.fields[name], self._whole_field(name)
        wb = WindowBuffer(self.backend.allocate(single.nbytes))  # held until the end: its host buffer feeds copies
        blocks = np.arange(f.num_chunks)
        try:
            work = single.work(self.layout, blocks)
            pending = Queued(self.backend.load(wb.buffer, work.requests, closing))
            host = self._submit_host(wb, work, closing) if f.compressed else None
            checks = self.verification.checks(single)(blocks) if self.verification is not None else None
            filled = InFlight(self, wb, work, pending, host, checks).finish(closing)
            if closing.is_set():  # before anything is decoded from a read cut short
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed while loading field '{name}'")
            if filled.verdict is not None:
                filled.verdict.confirm()
        except ReadError as e:
            raise with_context(self.named(e), f"reading resident field '{name}'") from e
        if filled.event is not None:
            filled.event.synchronize()
        return ResidentField(f, single.view(wb.buffer, name))

    # -- the rest ----------------------------------------------------------------------------------------
    @property
    def io_mode(self) -> str:
        return self.backend.io_mode

    def started(self) -> None:
        """The first batch is out: what the backend kept back (mmap's bulk load) may run now."""
        self.backend.started()

    def quiesce(self) -> None:
        """Wait until no read, decode or check this reader queued still touches a window buffer."""
        self.backend.quiesce()
        for part in (self.decoder, self.verification):
            if part is not None:
                part.quiesce()

    def describe(self) -> dict[str, Any]:
        """How each field is gathered and decoded, the window's size and the backend's own counters."""
        wm = self.window_map
        gather = {f: "resident" if f in self.resident_fields else "variable-length" if f in wm.ragged
                  else "positions" if wm.direct(f) else "rows" for f in self.fields}
        decode = {f: "device (nvCOMP)" if f in self.device_decoded else "cpu threads" for f in self.fields
                  if f in self.meta.fields and self.meta.fields[f].compressed}
        return {"backend": self.backend_name, "backend_reason": self.backend_reason, "io_mode": self.io_mode,
                "foreign_store": self.meta.foreign, "gather": gather, "decode": decode,
                "decode_scratch_bytes": self.decoder.scratch_bytes if self.decoder is not None else 0,
                "window_bytes": wm.nbytes, "resident_fields": list(self.resident_fields),
                "backend_stats": self.backend.stats(), **self.source.describe()}

    def close(self) -> None:
        """Free the backend, decoder, verifier, file handles and source, each even where one before failed (the
        first error is raised after). Idempotent; parts never made are skipped."""
        parts = [p.close for p in (self._host_reader, self.decoder, self.verification) if p is not None]
        self._resident = {}
        close_each((*parts, super().close, self._raise_unsettled))

    def _raise_unsettled(self) -> None:
        """Raise, once, the DecodeError a stopping pipeline met (:func:`gdsload.pipeline.complete.settle`)."""
        error, self.unsettled = self.unsettled, None
        if error is not None:
            raise error
