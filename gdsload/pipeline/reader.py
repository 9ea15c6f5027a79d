"""The reader: everything an open dataset reads with, and the one place where "these blocks into this buffer"
becomes backend calls.

A :class:`Reader` owns the dataset's metadata and block layout (format/), the window map (window.py), the
backend (backends/), the decoder and the verifier (codecs/). The pipeline's windows, the first window read at
open and the resident fields all go through :meth:`Reader.submit` / :meth:`Reader.load`, so each is read,
decoded and checked the same way. Opening is two steps: :meth:`Reader.open` reads the metadata and makes the
backend (cheap; a bad argument found next costs nothing more), then :meth:`Reader.start` maps windows of the
size the plan chose and prepares the backend (mmap may read the whole dataset there).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._tasks import Pending, Queued, drain
from ..backends import info, make_backend, resolve
from ..backends.base import Backend, ReadRequest
from ..backends.cpu import CpuBackend
from ..codecs.decode import WindowDecoder, all_of
from ..codecs.verify import Verdict, Verification, carries_trailers, unchecked_fields
from ..errors import GDSLoadError, ReadError, with_context
from ..format.layout import DatasetLayout
from ..format.meta import DatasetMeta, read_metadata
from ..remote.mirror import named
from ..remote.objects import DEFAULT_TIMEOUT_S, is_remote
from ..system.env import cache_dir as env_cache_dir
from ..system.env import warn_few_connections
from .assembler import ResidentField
from .plan import DEFAULT_RESIDENT_BYTES, EpochPlan, blocks_per_rank, resident_fields, window_blocks_for
from .ragged import capacity_rows
from .window import WindowBuffer, WindowMap, Work, cell_rows

if TYPE_CHECKING:
    from ..remote.shard_fetch import RemoteShards, Ticket

class Filled(NamedTuple):
    """A window read, decoded and its check started: its data is there after ``event`` (None: already),
    and ``verdict`` (None: nothing to check) must be confirmed before a batch drawn from it is handed on."""

    event: Any
    verdict: Verdict | None


class InFlight:
    """One window's reads in flight: :meth:`finish` waits for them, decodes and starts the check;
    :meth:`drain` waits for them after an error elsewhere. Either, once, leaves no read writing the buffer."""

    def __init__(self, reader: Reader, buf: WindowBuffer, work: Work, pending: Pending, host: Pending | None,
                 checks: Any, ticket: Any = None, opened: bool = False):
        """``opened``: the buffer held the window since the dataset's open (nothing was read now)."""
        self.reader, self.buf, self.work, self.checks, self.opened = reader, buf, work, checks, opened
        self._pending: Pending | None = pending
        self._host = host
        self._ticket = ticket  # a remote dataset's shards this window reads, pinned in the cache until drained

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
            if self.checks is not None and len(self.checks.lo) and not stop.is_set():
                verdict = r.verification.start(self.buf.buffer, self.checks, event)  # type: ignore[union-attr]
            verdict = all_of([decoded, verdict])
        finally:
            self.drain()
        return Filled(event, verdict)

    def drain(self) -> None:
        try:
            for name in ("_pending", "_host"):
                pending = getattr(self, name)
                setattr(self, name, None)
                if pending is not None:
                    drain(pending)
        finally:
            ticket, self._ticket = self._ticket, None
            if ticket is not None:
                self.reader.remote.release(ticket)  # type: ignore[union-attr]


class Reader:
    """What an open dataset reads with (see the module's docstring). Not thread-safe by itself: the
    pipeline's submitter and completer use it in order, and resident loads before any pipeline runs."""

    def __init__(self, meta: DatasetMeta, layout: DatasetLayout, resident: tuple[str, ...], backend_name: str,
                 backend_reason: str, device: int, verify: bool | None):
        self.meta, self.layout, self.resident_fields = meta, layout, resident
        self.backend_name, self.backend_reason, self.device = backend_name, backend_reason, device
        self.fields = layout.fields
        self.verify = layout.has_checksums if verify is None else verify
        self.ragged_fields = tuple(f for f in self.fields if f in meta.ragged)
        self.windowed_fields = tuple(f for f in self.fields if f in meta.fields and f not in resident)
        self.backend: Any = None
        self.on_device = False
        self.window_map: WindowMap | None = None
        self.verification: Verification | None = None
        self.decoder: WindowDecoder | None = None
        self.device_decoded: list[str] = []
        self.host_decoded: list[str] = []
        self._checks: Any = None
        self._host_reader: Backend | None = None
        self._resident: dict[str, ResidentField] | None = None  # read on first use, kept until close()
        self.remote: RemoteShards | None = None  # a remote dataset's shards in the node's cache (the cached route)
        self._skeleton: RemoteShards | None = None  # a remote dataset's version, whichever the route
        self.route: tuple[str, str] = ("", "")  # a remote dataset's route and why (backends/remote_direct.py)
        self._whole: Ticket | None = None  # every shard, pinned for the dataset's life (the mmap backend)

    @classmethod
    def open(cls, path: str | os.PathLike[str], fields: Sequence[str] | None, backend: str, device: int,
             resident_bytes: int, verify: bool | None, backend_options: dict[str, Any] | None,
             on_resolved: Callable[[str], None] = lambda name: None, cache_dir: str | None = None,
             cache_bytes: int | None = None, missing_chunks: str = "error",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Reader:
        """Read the metadata, choose and make the backend (``on_resolved`` checks arguments that depend on
        which, before it is made). A remote dataset's skeleton is fetched into ``cache_dir`` (default: the
        ``datasets`` folder of gdsload's cache); its shards are read straight from the objects (the direct route)
        or fetched into the cache as they are read, the node's cache holding at most ``cache_bytes`` of them
        (None: no bound; docs/remote.md, "Routes"), each remote wait within ``timeout_s``. ``missing_chunks``: see
        :class:`~gdsload.format.layout.DatasetLayout`. Nothing is left open on an error."""
        remote = None
        if is_remote(path):
            from ..remote.shard_fetch import RemoteShards

            remote = RemoteShards.open(str(path), os.fspath(cache_dir) if cache_dir else
                                       os.path.join(env_cache_dir(), "datasets"), cache_bytes, timeout_s)
            path = remote.root
        cache_option = "cache_dir" if cache_dir is not None else "cache_bytes" if cache_bytes is not None else None
        try:
            reader = cls._open(path, fields, backend, device, resident_bytes, verify, backend_options, on_resolved,
                               remote, cache_option, missing_chunks)
        except BaseException as e:
            if remote is not None:
                remote.close()
                if isinstance(e, GDSLoadError):
                    raise named(e, remote.version, remote.cache.cache_dir) from e
            raise
        if reader.on_device:
            warn_few_connections()  # the steps would wait behind this dataset's copies
        return reader

    @classmethod
    def _open(cls, path: str | os.PathLike[str], fields: Sequence[str] | None, backend: str, device: int,
              resident_bytes: int, verify: bool | None, backend_options: dict[str, Any] | None,
              on_resolved: Callable[[str], None], remote: RemoteShards | None, cache_option: str | None,
              missing_chunks: str = "error") -> Reader:
        meta = read_metadata(path, fields)
        names = tuple(fields) if fields is not None else tuple(meta.names)
        resident = resident_fields(meta, names, resident_bytes)
        # A foreign store's block: chosen for the arrays read block by block (the others are read whole).
        meta = meta.with_block([f for f in names if f in meta.fields and f not in resident])
        layout = DatasetLayout(meta, tuple(fields) if fields is not None else None, missing_chunks)
        try:
            paths = list(layout.files)
            # auto may pick the RAM tier: it needs the size of what this dataset reads (a remote one's fetched
            # whole for it: not where the cache's bound is smaller).
            size = sum(layout.files.get(p).size for p in paths)
            bound = remote.cache.cache_bytes if remote is not None else None
            name, reason = resolve(backend, size if bound is None or bound >= size else None,
                                   paths[0] if paths else None)
            on_resolved(name)
            route = ("", "")
            if remote is not None:  # the direct route reads with its own backend, in place of this one
                from ..backends.remote_direct import routed

                name, reason, backend_options, route = routed(remote, backend, name, reason, backend_options,
                                                              cache_option)
            direct = route[0] == "direct"
            unchecked = unchecked_fields(layout) if verify else []
            if unchecked:
                kind = ("its chunks have no crc32c codec" if meta.foreign
                        else "written by a converter without block checksums")
                raise ValueError(f"verify=True: {meta.path}: field(s) {unchecked} carry no checksum ({kind}); "
                                 f"convert it with 'gdsload shard' to add them, or pass verify=False")
            reader = cls(meta, layout, resident, name, reason, device, verify)
            reader.route, reader._skeleton = route, remote
            reader.remote = None if direct else remote  # the direct route fetches nothing into the cache
            if reader.remote is not None:  # shards cut into pieces at their chunks: a rank fetches what it reads
                reader.remote.divide(layout)
            reader.on_device = info(name).on_device
            reader.backend = make_backend(name, device, **(backend_options or {}))
        except BaseException:
            layout.close()
            raise
        return reader

    # -- windows -----------------------------------------------------------------------------------------
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

    def start(self, window_blocks: int) -> None:
        """Map windows of ``window_blocks`` blocks, make the verifier and decoder, and prepare the backend
        (last: mmap may read the whole dataset there)."""
        from ..codecs.chunks import device_fields

        meta, layout = self.meta, self.layout
        fixed = [meta.fields[f] for f in self.fields if f in meta.fields]
        # Compressed fields: decoded on the device by nvCOMP, or by CPU threads from a host buffer (GPU backends).
        self.device_decoded, self.host_decoded = device_fields(fixed, self.on_device)
        capacity = {f: (meta.ragged[f], capacity_rows(layout.offsets[f], meta.samples_per_block, window_blocks))
                    for f in self.ragged_fields}
        self.window_map = WindowMap([meta.fields[f] for f in self.windowed_fields], window_blocks, capacity,
                                    samples_per_block=meta.samples_per_block, chunk_lengths=layout.chunk_lengths,
                                    host_fields=self.host_decoded)
        blocks = self.verify and layout.has_checksums
        once = self.backend.reads_locked_memory  # each block checked the first time it is read
        if blocks or carries_trailers(layout):
            self.verification = Verification(layout, blocks, self.on_device, self.device, once)
            checks = self.verification.checks(self.window_map)
            self._checks = checks if checks else None
        if any(meta.array(k).compressed for k in layout.keys):
            from ..codecs.decode import Decoder

            self.decoder = Decoder(layout, self.on_device, self.device, self.device_decoded)
        if self.remote is not None and self.backend.reads_locked_memory:  # it locks every file: all fetched now
            self.remote.check_room([list(layout.files)])
            self._whole = self.remote.acquire(list(layout.files), threading.Event())
            self.remote.stop()
        self.backend.prepare(layout.files)

    def allocate(self) -> WindowBuffer:
        return WindowBuffer(self.backend.allocate(self.window_map.nbytes))  # type: ignore[union-attr]

    def submit(self, buf: WindowBuffer, blocks: np.ndarray, stop: threading.Event,
               pace: Callable[[], None] = lambda: None) -> InFlight:
        """Start reading ``blocks`` into ``buf`` (nothing, where it holds them since the open). ``pace`` is
        called between the longer pieces of Python work (gdsload.pipeline.pacing)."""
        wm = self.window_map
        work = wm.work(self.layout, blocks)  # type: ignore[union-attr]
        pace()
        checks = self._checks(blocks) if self._checks is not None else None
        pace()
        loaded = buf.take_loaded(work.requests)
        ticket = None
        if self.remote is not None:  # wait until the window's shards are in the node's cache, pinned
            if loaded:
                self.remote.passed(_paths(work))
            else:
                ticket = self.remote.acquire(_paths(work), stop)
                if ticket.stopped:
                    return InFlight(self, buf, work, Queued(None), None, None)  # reading stops: nothing read
        try:
            pending = Queued(None) if loaded else self.backend.submit(buf.buffer, work.requests, stop)
        except BaseException:
            if ticket is not None:
                self.remote.release(ticket)  # type: ignore[union-attr]
            raise
        try:
            host = self._submit_host(buf, work, stop)
        except BaseException:
            InFlight(self, buf, work, pending, None, None, ticket).drain()  # reads over before the error goes on
            raise
        return InFlight(self, buf, work, pending, host, checks, ticket, opened=loaded)

    def expect(self, windows: Sequence[np.ndarray]) -> None:
        """The windows :meth:`submit` is given next, in order (from the pipeline): a remote dataset's shards
        are fetched ahead of them on the cached route (nothing is fetched on the direct route)."""
        if self.remote is not None:
            self.remote.expect(windows, lambda blocks: _paths(self.window_map.work(self.layout, blocks)))

    def stop_fetching(self) -> None:
        """A pipeline stopped: a remote dataset's fetcher threads end and its shards are unpinned (cached route)."""
        if self.remote is not None:
            self.remote.stop()

    def _pinned(self, paths: Sequence[str], stop: threading.Event) -> Ticket | None:
        """Outside the pipeline (the first window, resident fields): the shards of ``paths``, pinned."""
        if self.remote is None:
            return None
        ticket = self.remote.acquire(paths, stop)
        if ticket.stopped:
            raise GDSLoadError(f"{self.meta.path}: the dataset was closed while it was read")
        return ticket

    def _submit_host(self, wb: WindowBuffer, work: Work, stop: threading.Event) -> Pending | None:
        """The reads of compressed chunks decoded by CPU threads, into the window's host buffer (made on first
        use) by threaded POSIX reads over the dataset's open files."""
        if work.host_nbytes and (wb.host is None or len(wb.host) < work.host_nbytes):
            wb.host = self.decoder.host_buffer(work.host_nbytes)
        if not work.host_requests:
            return None
        if self._host_reader is None:
            # The direct route reads remote objects: the cache's files hold no shard data.
            self._host_reader = getattr(self.backend, "host_reader", CpuBackend)()
            self._host_reader.prepare(self.layout.files)
        return self._host_reader.submit(wb.host, work.host_requests, stop)

    def load_first(self, plan: EpochPlan) -> WindowBuffer:
        """The first window buffer, holding the window a pass from the dataset's start reads first (which that
        pass then does not read again): the backend's own start and that window's reads happen in the open,
        and a file they cannot read fails the open, naming it."""
        if self.remote is not None:  # a bound that cannot hold one read's shards: CacheFull now, not after waits
            self.remote.check_room(self._pinned_at_once(plan))
        buf = self.allocate()
        requests = self.window_map.first_requests(self.layout, plan)  # type: ignore[union-attr]
        if requests:
            try:
                ticket = self._pinned(_paths(requests), threading.Event())
                try:
                    filled = self.backend.load(buf.buffer, requests, threading.Event())
                    if filled is not None:
                        filled.synchronize()  # there when the open returns (copies queued would hold up the pass)
                finally:
                    if ticket is not None:
                        self.remote.release(ticket)  # type: ignore[union-attr]
                        self.remote.stop()  # type: ignore[union-attr]  # no fetcher thread while no pass runs
            except GDSLoadError as e:
                raise self.named(e) from e
            buf.loaded = requests
        return buf

    def _pinned_at_once(self, plan: EpochPlan) -> list[list[str]]:
        """The files each read pins together: the first windows of ``plan``, and each resident field whole."""
        from ..remote.shard_fetch import ROOM_WINDOWS

        reads = [_paths(self.window_map.work(self.layout, b)) for b in plan.windows[:ROOM_WINDOWS]]  # type: ignore
        return reads + [_paths(self._whole_field(n).work(self.layout, np.arange(self.meta.fields[n].num_chunks)))
                        for n in self.resident_fields]

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
            self.stop_fetching()
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
            ticket = self._pinned(_paths(work), closing)
            try:
                pending = Queued(self.backend.load(wb.buffer, work.requests, closing))
            except BaseException:
                if ticket is not None:
                    self.remote.release(ticket)  # type: ignore[union-attr]
                raise
            host = self._submit_host(wb, work, closing) if f.compressed else None
            checks = self.verification.checks(single)(blocks) if self.verification is not None else None
            filled = InFlight(self, wb, work, pending, host, checks, ticket).finish(closing)
            if closing.is_set():  # before anything is decoded from a read cut short
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed while loading field '{name}'")
            if filled.verdict is not None:
                filled.verdict.confirm()
        except ReadError as e:
            raise with_context(self.named(e), f"reading resident field '{name}'") from e
        if filled.event is not None:
            filled.event.synchronize()
        return ResidentField(f, single.view(wb.buffer, name))

    def named(self, e: GDSLoadError) -> GDSLoadError:
        """``e`` naming a remote dataset's URLs in place of their copies in the node's cache (``e`` for a local one)."""
        return e if self._skeleton is None else named(e, self._skeleton.version, self._skeleton.cache.cache_dir)

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
                  else "positions" if wm.direct(f) else "rows" for f in self.fields}  # type: ignore[union-attr]
        decode = {f: "device (nvCOMP)" if f in self.device_decoded else "cpu threads" for f in self.fields
                  if f in self.meta.fields and self.meta.fields[f].compressed}
        return {"backend": self.backend_name, "backend_reason": self.backend_reason, "io_mode": self.io_mode,
                "foreign_store": self.meta.foreign, "gather": gather, "decode": decode,
                "decode_scratch_bytes": self.decoder.scratch_bytes if self.decoder is not None else 0,
                "window_bytes": wm.nbytes, "resident_fields": list(self.resident_fields),  # type: ignore[union-attr]
                "backend_stats": self.backend.stats(), **self._describe_remote()}

    def _describe_remote(self) -> dict[str, Any]:
        """A remote dataset's route (``"direct"``, ``"cached"``, or ``"whole"``: every shard fetched at open, for
        a backend that locks every file; docs/remote.md), why, and the cache's counters."""
        if self._skeleton is None:
            return {}
        route, why = self.route
        if self._whole:
            route, why = "whole", f"the {self.backend_name} backend locks every shard file in memory; {why}"
        return {"remote": {"route": route, "route_reason": why, **self._skeleton.describe()}}

    def close(self) -> None:
        """Free the backend, decoder, verifier and file handles. Idempotent; parts never made are skipped."""
        for part in (self.backend, self._host_reader, self.decoder, self.verification):
            if part is not None:
                part.close()
        self._resident = {}
        self.layout.close()
        if self._skeleton is not None:
            self._skeleton.close()  # its threads end, its pins (the whole dataset's too) are dropped


def _paths(work: Work | Sequence[Any]) -> list[tuple[str, int, int]]:
    """The byte ranges a window's reads (or a list of requests) read from files: (path, offset, nbytes)."""
    requests = [*work.requests, *work.host_requests] if isinstance(work, Work) else work
    return [(r.path, r.offset, r.nbytes) for r in requests if isinstance(r, ReadRequest)]
