"""Compressed chunks: which codecs gdsload reads, and the decode step that turns a window's compressed bytes
into its decoded slots.

A compressed field's window region has two parts (:class:`gdsload.window.WindowLayout`): its decoded slots,
laid out exactly as a raw field's (so the row mapping and the assembler do not change), and a region for the
window's compressed chunks, back to back. Reads carry the compressed chunks into that region like any other
bytes; then, in the completer thread, after the window's reads have finished and before the verifier, this
module's decode step writes each chunk, decoded, into its slot, and returns the event after which the decoded
window is there (GPU backends) or None (cpu: it is there when the call returns). Where each field's bytes go:

- ``zstd`` on a GPU backend with nvCOMP installed (``gdsload[nvcomp]``, in ``gdsload[gpu]`` too; off with
  ``GDSLOAD_NVCOMP=0``): the compressed region lies in the device
  window buffer (kvikio reads it straight there, pinned stages and copies it, mmap copies it from its
  locked pages); one batched nvCOMP call per field and window decodes every chunk on the device
  (:mod:`gdsload.decode_nvcomp`).
- any other codec on a GPU backend (and ``zstd`` without nvCOMP, after a one-time warning): the compressed
  region lies in a pinned *host* buffer of the window, read by threaded POSIX reads; CPU threads decode each
  chunk into a host mirror of the field's slots, and one host-to-device copy per field moves them. Reading
  them into device memory would only make the CPU copy them back before it could decode them.
- the cpu backend: the compressed region lies in the (host) window buffer, and CPU threads decode straight
  into the slots.

CPU decoding goes through the codec classes zarr uses (numcodecs); nothing is reimplemented. A ``crc32c``
codec after a compressor is verified. Errors: a chunk that does not decode (or decodes to the wrong size, or
fails its crc32c) raises :class:`ReadError` naming the file, offset, array, chunk and codec; a codec that
cannot be read raises :class:`FormatError` (from :func:`check_codec`) naming the codec and the array.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import numpy as np

from ._zarr_json import exc_text, fail, show
from .backends.base import TaskGroup, drain
from .errors import ChecksumError, ReadError

#: CPU threads that decode chunks (numcodecs releases the GIL while it decompresses).
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))
#: The codec chains nvCOMP decodes on the device: zstd frames, optionally followed by their crc32c.
NVCOMP_CHAINS = (("zstd",), ("zstd", "crc32c"))
#: ``GDSLOAD_NVCOMP=0`` turns the device path off: zstd is then decoded by CPU threads, as without nvCOMP.
NVCOMP_ENV = "GDSLOAD_NVCOMP"
#: What the warning about CPU decoding of zstd suggests.
NVCOMP_HINT = ("install gdsload[nvcomp] (nvidia-nvcomp-cu13, under NVIDIA's licence; also in gdsload[gpu]; for "
               "CUDA 12, gdsload[nvcomp-cu12]) to decode them on the GPU")
_warned = threading.Event()


# -- codecs ------------------------------------------------------------------------------------------
def check_codec(where: str, name: Any, cfg: dict[str, Any]) -> None:
    """Refuse, naming the codec and the array (``where``: its ``zarr.json``), a chunk codec after ``bytes``
    that gdsload cannot decode: unknown to zarr's codec registry, not bytes-to-bytes (``transpose`` and other
    array-to-array codecs), or a configuration zarr or numcodecs refuses."""
    if name == "crc32c":
        return
    import zarr.registry
    from zarr.abc.codec import BytesBytesCodec

    try:
        cls = zarr.registry.get_codec_class(str(name))
    except Exception:
        raise fail(where, f"unknown codec {show(name)} (not in zarr's codec registry); gdsload cannot decode "
                          f"its chunks: convert the store with 'gdsload shard'") from None
    if not (isinstance(cls, type) and issubclass(cls, BytesBytesCodec)):
        raise fail(where, f"codec {show(name)} after 'bytes' is not a bytes-to-bytes codec (a filter that "
                          f"changes the array), which gdsload does not read; convert the store with "
                          f"'gdsload shard'")
    try:
        host_codec(str(name), cfg)
    except Exception as e:
        raise fail(where, f"codec {show(name)} with configuration {show(cfg)} cannot be decoded ({exc_text(e)})"
                   ) from None


def host_codec(name: str, cfg: dict[str, Any]) -> Any:
    """The numcodecs codec zarr's own codec class of that name decodes with (``decode(buf)`` -> bytes)."""
    import numcodecs

    if name == "zstd":
        from zarr.codecs import ZstdCodec

        z = ZstdCodec.from_dict({"name": name, "configuration": cfg})
        return numcodecs.Zstd(level=z.level)
    if name == "gzip":
        from zarr.codecs import GzipCodec

        return numcodecs.GZip(level=GzipCodec.from_dict({"name": name, "configuration": cfg}).level)
    if name == "blosc":
        from zarr.codecs import BloscCodec

        BloscCodec.from_dict({"name": name, "configuration": cfg})  # zarr's check of the configuration
        return numcodecs.Blosc()  # blosc frames carry what decoding needs
    if name.startswith("numcodecs."):
        return numcodecs.get_codec({**cfg, "id": name[len("numcodecs."):]})
    raise ValueError(f"no decoder for codec {name!r}")


class Chain:
    """The CPU decoder of one array's chunks: its codecs undone in reverse order."""

    def __init__(self, codecs: Sequence[tuple[str, Any]]):
        self.names = [n for n, _ in codecs]
        self._steps = [(n, None if n == "crc32c" else host_codec(n, cfg)) for n, cfg in reversed(codecs)]

    def decode(self, data: Any, nbytes: int) -> np.ndarray:
        """Chunk bytes as stored -> ``nbytes`` decoded bytes (uint8); ValueError saying what is wrong."""
        buf = data
        for name, codec in self._steps:
            if codec is None:
                view = np.frombuffer(buf, dtype=np.uint8)
                if len(view) < 4:
                    raise ValueError(f"{len(view)} bytes, too short for a crc32c")
                stored = int.from_bytes(view[-4:].tobytes(), "little")
                computed = crc32c.crc32c(view[:-4])
                if computed != stored:
                    raise CrcMismatch(f"crc32c mismatch (stored {stored:#010x}, computed {computed:#010x})")
                buf = view[:-4]
            else:
                try:
                    buf = codec.decode(buf)
                except Exception as e:
                    raise ValueError(f"{name}: {exc_text(e)}") from None
        out = np.frombuffer(buf, dtype=np.uint8)
        if len(out) != nbytes:
            raise ValueError(f"decodes to {len(out)} bytes (expected {nbytes})")
        return out


def device_decodable(codecs: Sequence[tuple[str, Any]]) -> bool:
    return tuple(n for n, _ in codecs) in NVCOMP_CHAINS


def load_nvcomp() -> Any:
    """``nvidia.nvcomp`` when it is installed and not switched off (``GDSLOAD_NVCOMP=0``), else None
    (imported only when a dataset needs it)."""
    if os.environ.get(NVCOMP_ENV) == "0":
        return None
    try:
        from nvidia import nvcomp
    except Exception:
        return None
    return nvcomp


def device_fields(fields: Sequence[Any], on_gpu: bool, nvcomp: Any = None) -> tuple[list[str], list[str]]:
    """Split the compressed ``fields`` (FieldMeta) of a dataset into those decoded on the device (GPU backend,
    nvCOMP installed, a chain in :data:`NVCOMP_CHAINS`) and those decoded by CPU threads from a host buffer
    (the rest, on a GPU backend; none on cpu, which decodes in its own buffer). Warns once per process when
    zstd is decoded on the CPU for want of nvCOMP (not when switched off with ``GDSLOAD_NVCOMP=0``)."""
    compressed = [f for f in fields if f.compressed]
    if not on_gpu or not compressed:
        return [], []
    zstd = [f.name for f in compressed if device_decodable(f.codecs)]
    if zstd and nvcomp is None and load_nvcomp() is None:
        if not _warned.is_set() and os.environ.get(NVCOMP_ENV) != "0":
            _warned.set()
            warnings.warn(f"zstd chunks of {zstd} are decoded by CPU threads: {NVCOMP_HINT}",
                          RuntimeWarning, stacklevel=4)
        zstd = []
    return zstd, [f.name for f in compressed if f.name not in zstd]


# -- the decode step -----------------------------------------------------------------------------------
class CrcMismatch(ValueError):
    """A chunk's bytes differ from the crc32c its ``crc32c`` codec stored."""


def chunk_error(layout: Any, name: str, chunk: int, codecs: Sequence[str], why: str,
                checksum: bool = False) -> ReadError:
    """``FILE: chunk C of array 'A' (N bytes at offset O, codecs [...]) does not decode: WHY``; a
    :class:`ChecksumError` when ``checksum`` (its crc32c codec does not match)."""
    loc = layout.locate(name, chunk)
    where = f"{loc.path}: chunk {chunk}" if loc is not None else f"{layout.meta.path}: chunk {chunk}"
    at = f"{loc.nbytes} bytes at offset {loc.offset}, " if loc is not None else ""
    error = ChecksumError if checksum else ReadError
    return error(f"{where} of array '{name}' ({at}codecs {['bytes', *codecs]}) does not decode: {why}")


class Decoder:
    """Decodes the compressed fields of an open dataset's windows (see the module's docstring).

    ``device``: the fields nvCOMP decodes on the device (:func:`device_fields`); ``on_gpu``: the window
    buffers are device memory. Holds a pool of :data:`DECODE_THREADS` threads, on a GPU backend a stream
    and a reader of host buffers; :meth:`close` stops them. The pinned host buffers it gives windows belong
    to their window buffers and go with them.
    """

    def __init__(self, layout: Any, on_gpu: bool, device_id: int = 0, device: Sequence[str] = (),
                 threads: int = DECODE_THREADS, nvcomp: Any = None, ops: Any = None):
        """``nvcomp`` and ``ops`` replace ``nvidia.nvcomp`` and the CUDA side
        (:class:`gdsload.decode_nvcomp.CupyOps`), for tests of the device path without a GPU."""
        self.layout, self.on_gpu, self.device_id = layout, on_gpu, device_id
        metas = {k: layout.meta.array(k) for k in layout.keys}
        self.chains = {k: Chain(m.codecs) for k, m in metas.items() if m.compressed and k not in device}
        self.metas = metas
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gdsload-decode")
        self._reader: Any = None
        self._lock = threading.Lock()  # the completer and a resident load may decode at once
        self.gpu: Any = None
        self.batch: Any = None
        if on_gpu:
            from .decode_nvcomp import CupyOps, NvcompBatch

            self.gpu = ops if ops is not None else CupyOps(device_id)
            if device:
                self.batch = NvcompBatch(nvcomp or load_nvcomp(), self.gpu, device_id)

    def reader(self) -> Any:
        """Threaded POSIX reads into host buffers, over the dataset's open files (made on first use)."""
        if self._reader is None:
            from .backends.cpu import CpuBackend

            self._reader = CpuBackend()
            self._reader.prepare(self.layout.files)
        return self._reader

    def start(self, wb: Any, work: Any, stop: threading.Event) -> WindowDecode:
        """Submit the reads of ``work`` into ``wb``'s host buffer (allocated on first use); the returned
        object decodes the window once its reads are done."""
        if work.host_nbytes and (wb.host is None or len(wb.host) < work.host_nbytes):
            wb.host = self.gpu.pinned(work.host_nbytes) if self.gpu is not None else np.empty(work.host_nbytes,
                                                                                                np.uint8)
        pending = self.reader().submit(wb.host, work.host_requests, stop) if work.host_requests else None
        return WindowDecode(self, wb, work, pending, stop)

    def decode(self, wb: Any, work: Any, filled: Any, stop: threading.Event) -> Any:
        """Decode every compressed chunk of ``work`` into its slot (the window's reads are done, or queued
        before ``filled``); return the event after which the slots hold them (None on cpu). Once ``stop`` is
        set, chunks not yet started are skipped."""
        host_jobs = [j for j in work.jobs if j.name in self.chains]
        self._decode_host(wb, host_jobs, stop)
        if self.gpu is None:
            return filled
        gpu = self.gpu
        with self._lock, gpu.ordered(filled):  # the device's work on the decoder's stream, after ``filled``
            for job in host_jobs:
                if job.copy is not None:
                    h, d, n = job.copy
                    gpu.to_device(wb.buffer, d, wb.host, h, n)
            outs = [self.batch.decode(wb.buffer, j, self.layout) for j in work.jobs if j.name not in self.chains]
            return gpu.done(outs)

    def _decode_host(self, wb: Any, jobs: list[Any], stop: threading.Event) -> None:
        tasks: list[Callable[[], None]] = []
        for job in jobs:
            buf = wb.host if job.host else wb.buffer  # compressed bytes and decoded slots alike
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
        """Wait until no device work of this decoder still writes into a window buffer (a pipeline stops)."""
        if self.gpu is not None:
            self.gpu.quiesce()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._reader is not None:
            self._reader.close()
        if self.gpu is not None:
            self.gpu.close()  # the stream drained, nvCOMP's outputs freed
        if self.batch is not None:
            self.batch.close()  # the codec destroyed before its stream


class WindowDecode:
    """One window's decode step: its host reads (if any) in flight until :meth:`finish` or :meth:`drain`."""

    def __init__(self, decoder: Decoder, wb: Any, work: Any, pending: Any, stop: threading.Event):
        self.decoder, self.wb, self.work, self.pending, self.stop = decoder, wb, work, pending, stop

    def finish(self, filled: Any) -> Any:
        """Wait for the host reads, decode, and return the event after which the decoded window is there."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finish()
        return self.decoder.decode(self.wb, self.work, filled, self.stop)

    def drain(self) -> None:
        """After an error elsewhere: wait for the host reads still writing into the window, ignoring theirs."""
        pending, self.pending = self.pending, None
        if pending is not None:
            drain(pending)


def _groups(n: int, parts: int) -> list[tuple[int, int]]:
    """``range(n)`` cut into at most ``parts`` consecutive pieces (a task per piece)."""
    parts = max(1, min(n, parts))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
