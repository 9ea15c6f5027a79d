"""The decode step: a window's compressed chunks, already read, turned into its decoded cells.

It runs in the completer thread after the window's reads and before the verifier, and returns the event after
which the decoded window is there (GPU backends) or None (cpu). ``zstd`` on a GPU backend with nvCOMP decodes on
the device (:mod:`gdsload.codecs.nvcomp`), successive windows taking turns on :data:`DECODE_LANES` streams; any
other codec is decoded by CPU threads through numcodecs (where each field's bytes go, and why: docs/format.md,
"Compressed chunks"). A chunk that does not decode, decodes to the wrong size or fails its crc32c is a
ReadError naming the file, offset, array, chunk and codec; a codec that cannot be read is a FormatError
(:func:`gdsload.format.chunk_codecs.check_codec`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from .._tasks import TaskGroup
from ..cuda.runtime import decode_wait_s
from ..errors import DecodeError
from .chunks import DECODE_THREADS, Chain, CrcMismatch, chunk_error, load_nvcomp

if TYPE_CHECKING:
    from .nvcomp import DecodeOps, NvcompBatch

#: Streams a GPU decoder's windows take turns on. nvCOMP's batched zstd decode takes about as long for a few
#: hundred chunks as for a thousand (one thread block decodes a chunk, mostly serially), so a window decoded
#: while the one before still decodes adds its chunks to the GPU's work at little cost in time. Each lane holds
#: its own scratch memory (about three times a window's decoded bytes).
DECODE_LANES = 2


# -- the decode step -----------------------------------------------------------------------------------
class WindowDecoder(Protocol):
    """What the reader asks of a decoder: a host buffer for chunks CPU threads decode, the decode of a window
    whose reads are done (returning the event after which its decoded cells are there), and a wait for its
    device work. :class:`Decoder` keeps it."""

    scratch_bytes: int

    def host_buffer(self, nbytes: int) -> Any: ...
    def decode(self, wb: Any, work: Any, filled: Any, stop: threading.Event) -> tuple[Any, Any]: ...
    def quiesce(self) -> None: ...
    def close(self) -> None: ...


class Decoder:
    """Decodes the compressed fields of an open dataset's windows (see the module's docstring).

    ``device``: the fields nvCOMP decodes on the device (:func:`gdsload.codecs.chunks.device_fields`); ``on_gpu``: the
    window buffers are device memory. Holds a pool of :data:`DECODE_THREADS` threads and, on a GPU backend,
    ``lanes`` streams (:class:`Lane`) that successive windows take turns on; :meth:`close` stops them. It reads
    nothing: the reader (gdsload.pipeline.reader) hands it windows whose reads are done. The pinned host buffers
    it gives windows belong to their window buffers and go with them.
    """

    def __init__(self, layout: Any, on_gpu: bool, device_id: int = 0, device: Sequence[str] = (),
                 threads: int = DECODE_THREADS, nvcomp: Any = None, ops: Sequence[DecodeOps] | None = None,
                 lanes: int = DECODE_LANES):
        """``nvcomp`` and ``ops`` (one per lane) replace libnvcomp (:class:`gdsload.codecs.nvcomp_lib.ZstdLib`)
        and the CUDA side (:class:`gdsload.codecs.nvcomp.DecodeDevice`), for tests of the device path without a
        GPU."""
        self.layout, self.on_gpu, self.device_id = layout, on_gpu, device_id
        metas = {k: layout.meta.array(k) for k in layout.keys}
        self.chains = {k: Chain(m.codecs) for k, m in metas.items() if m.compressed and k not in device}
        self.metas = metas
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gdsload-decode")
        self._lock = threading.Lock()  # the completer and a resident load may decode at once
        self.lanes: list[Lane] = []
        self._turn = 0  # the lane the next window decodes on
        if on_gpu:
            from .nvcomp import DecodeDevice, NvcompBatch

            if ops is None:
                ops = [DecodeDevice(device_id) for _ in range(max(1, lanes) if device else 1)]
            lib = (nvcomp if nvcomp is not None else load_nvcomp()) if device else None
            self.lanes = [Lane(gpu, NvcompBatch(lib, gpu) if device else None, deque(maxlen=QUEUED_KEPT))
                          for gpu in ops]

    @property
    def scratch_bytes(self) -> int:
        """Device memory nvCOMP's decode holds as scratch, over every lane (0 where nothing decodes on the
        device)."""
        return sum(lane.batch.temp_bytes for lane in self.lanes if lane.batch is not None)

    def host_buffer(self, nbytes: int) -> Any:
        """A host buffer for a window's compressed chunks that CPU threads decode: pinned on a GPU backend
        (its decoded cells are copied to the device from it)."""
        return self.lanes[0].gpu.pinned(nbytes) if self.lanes else np.empty(nbytes, np.uint8)

    def decode(self, wb: Any, work: Any, filled: Any, stop: threading.Event) -> tuple[Any, Any]:
        """Decode every compressed chunk of ``work`` into its cell (the window's reads are done, or queued
        before ``filled``); return the event after which the cells hold them (None on cpu), and the check of
        the device's decode to confirm before a sample of the window is handed on (None: none queued). Once
        ``stop`` is set, chunks not yet started are skipped."""
        host_jobs = [j for j in work.jobs if j.name in self.chains]
        self._decode_host(wb, host_jobs, stop)
        if not self.lanes:
            return filled, None
        with self._lock:
            lane = self.lanes[self._turn % len(self.lanes)]
            self._turn += 1
            gpu = lane.gpu
            with gpu.ordered(filled):  # the lane's device work on its stream, after ``filled``
                for job in host_jobs:
                    if job.copy is not None:
                        h, d, n = job.copy
                        gpu.to_device(wb.buffer, d, wb.host, h, n)
                checks = [lane.batch.decode(wb.buffer, j, self.layout)  # type: ignore[union-attr]
                          for j in work.jobs if j.name not in self.chains]
                checks = [c for c in checks if c is not None]
                event = gpu.done([c.keep for c in checks])
                lane.queued.append((event, work))
                while lane.queued and getattr(lane.queued[0][0], "done", False):
                    lane.queued.popleft()  # its decode has ended
                return event, all_of(checks)

    def _decode_host(self, wb: Any, jobs: list[Any], stop: threading.Event) -> None:
        tasks: list[Callable[[], None]] = []
        for job in jobs:
            buf = wb.host if job.host else wb.buffer  # compressed bytes and decoded cells alike
            chain, bb = self.chains[job.name], self.metas[job.name].block_bytes
            for lo, hi in _groups(len(job.chunks), self.threads * 4):
                tasks.append(self._task(job, chain, bb, buf, lo, hi))
        TaskGroup(self.pool, tasks, stop).finish()  # the first error, once every task has stopped

    def _task(self, job: Any, chain: Chain, bb: int, buf: Any, lo: int, hi: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(lo, hi):
                s, n, d = int(job.src[i]), int(job.nbytes[i]), int(job.dest[i])
                try:
                    out = chain.decode(buf[s:s + n], bb)
                except ValueError as e:
                    raise chunk_error(self.layout, job.name, int(job.chunks[i]), chain.names, str(e),
                                      isinstance(e, CrcMismatch)) from None
                buf[d:d + bb] = out
        return run

    def quiesce(self) -> None:
        """Wait until no device work of this decoder still writes into a window buffer (a pipeline stops), each
        lane for at most :func:`gdsload.cuda.runtime.decode_wait_s`: a lane still busy after that raises the
        :class:`DecodeError` of the oldest window it may still decode (:meth:`_hung`)."""
        bound = decode_wait_s()
        for i, lane in enumerate(self.lanes):
            try:
                lane.gpu.quiesce(bound)
            except TimeoutError:
                raise self._hung(i, lane, bound) from None

    def _hung(self, i: int, lane: Lane, bound: float) -> DecodeError:
        """The DecodeError of lane ``i`` still busy after ``bound`` s: the file, the first chunk and the chunks of
        the oldest window queued on it whose decode is not known to have ended (else the dataset's path)."""
        tail = (f"still running after {bound:g} s (GDSLOAD_DECODE_WAIT_S) as the decoder stops: a damaged frame can "
                f"hang nvCOMP; the GPU may stay busy with it, so the process may have to exit")
        with self._lock:
            queued = [w for e, w in lane.queued if not getattr(e, "done", False)]
        jobs = [j for w in queued[:1] for j in w.jobs if len(j.chunks)]
        if not jobs:
            return DecodeError(f"{self.layout.meta.path}: the device work of decode lane {i} is {tail}")
        job = next((j for j in jobs if j.name not in self.chains), jobs[0])
        chunks = [int(c) for c in job.chunks[:8]]
        more = ", ..." if len(job.chunks) > 8 else ""
        names = [n for n, _ in self.metas[job.name].codecs]
        return chunk_error(self.layout, job.name, chunks[0], names, f"the decode of its window (chunks "
                           f"{str(chunks)[1:-1]}{more}) on decode lane {i} is {tail}", error=DecodeError)

    def close(self) -> None:
        """Stop the threads, drain every lane (a DecodeError when one stays busy past the bound: then its scratch
        memory and streams are kept, never handed on while the device may still write them), then free them."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.quiesce()
        for lane in self.lanes:
            if lane.batch is not None:
                lane.batch.close()  # nvCOMP's scratch memory back to the pool: the stream has passed every use of it
            lane.gpu.close()  # then the pool's blocks of the lane's streams are released


class Lane(NamedTuple):
    """One stream of a GPU decoder (its device side) and the nvCOMP batch that decodes on it, with its own
    scratch memory (None where no field decodes on the device); ``queued``: (event, work) of the last windows
    queued on it, those whose event has passed dropped, to name a window whose decode does not end."""

    gpu: DecodeOps
    batch: NvcompBatch | None
    queued: deque[tuple[Any, Any]]


#: Windows a lane remembers (a pipeline has a few in flight; older ones have been confirmed).
QUEUED_KEPT = 16


class AllOf:
    """Checks of one window confirmed together, in order (a Verdict's ``confirm``)."""

    def __init__(self, checks: Sequence[Any]):
        self.checks, self.confirmed = list(checks), False

    def confirm(self) -> None:
        if not self.confirmed:
            self.confirmed = True
            for c in self.checks:
                c.confirm()


def all_of(checks: Sequence[Any]) -> Any:
    """One check for ``checks`` (skipping None): None when there is none, the check itself when one."""
    checks = [c for c in checks if c is not None]
    return None if not checks else checks[0] if len(checks) == 1 else AllOf(checks)


def _groups(n: int, parts: int) -> list[tuple[int, int]]:
    """``range(n)`` cut into at most ``parts`` consecutive pieces (a task per piece)."""
    parts = max(1, min(n, parts))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
