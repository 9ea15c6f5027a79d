"""One compressed chunk at a time, on the host: the codec chain that undoes a chunk's codecs (numcodecs, as
zarr decodes; a ``crc32c`` after a compressor checked), the error that names a chunk that does not decode,
and which compressed fields nvCOMP decodes on the device. Pure: bytes in, bytes out; nothing is read here."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from ..errors import ChecksumError, ReadError, warn
from ..format.chunk_codecs import host_codec
from ..format.zarr_json import exc_text

#: CPU threads that decode chunks (numcodecs releases the GIL while it decompresses).
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))
#: The codec chains nvCOMP decodes on the device: zstd frames, optionally followed by their crc32c.
NVCOMP_CHAINS = (("zstd",), ("zstd", "crc32c"))
#: ``GDSLOAD_NVCOMP=0`` turns the device path off: zstd is then decoded by CPU threads, as without nvCOMP.
NVCOMP_ENV = "GDSLOAD_NVCOMP"
#: What the warning about CPU decoding of zstd suggests.
NVCOMP_HINT = ("install gdsload[nvcomp] (nvidia-libnvcomp-cu13, under NVIDIA's licence; also in gdsload[gpu]; for "
               "CUDA 12, gdsload[nvcomp-cu12]) to decode them on the GPU")
_warned = threading.Event()


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
    """nvCOMP's zstd decoder (:class:`gdsload.codecs.nvcomp_lib.ZstdLib`) when libnvcomp is installed and
    not switched off (``GDSLOAD_NVCOMP=0``), else None (loaded only when a dataset needs it, once)."""
    if os.environ.get(NVCOMP_ENV) == "0":
        return None
    return _zstd_lib()


@functools.cache
def _zstd_lib() -> Any:
    from .nvcomp_lib import load

    return load()


def device_fields(fields: Sequence[Any], on_gpu: bool, nvcomp: Any = None) -> tuple[list[str], list[str]]:
    """Split the compressed ``fields`` (FieldMeta) of a dataset into those decoded on the device (GPU backend,
    nvCOMP installed, a chain in :data:`NVCOMP_CHAINS`, buffers as aligned as nvCOMP asks: :func:`misaligned`)
    and those decoded by CPU threads from a host buffer (the rest, on a GPU backend; none on cpu, which
    decodes in its own buffer). Warns once per process when zstd is decoded on the CPU for want of nvCOMP (not
    when switched off with ``GDSLOAD_NVCOMP=0``), and whenever a field is for want of alignment."""
    compressed = [f for f in fields if f.compressed]
    if not on_gpu or not compressed:
        return [], []
    zstd = [f for f in compressed if device_decodable(f.codecs)]
    lib = nvcomp if nvcomp is not None or not zstd else load_nvcomp()
    if zstd and lib is None:
        if not _warned.is_set() and os.environ.get(NVCOMP_ENV) != "0":
            _warned.set()
            warn(f"zstd chunks of {[f.name for f in zstd]} are decoded by CPU threads: {NVCOMP_HINT}",
                 RuntimeWarning)
        zstd = []
    names = []
    for f in zstd:
        why = misaligned(f, lib)
        if why:
            warn(f"zstd chunks of '{f.name}' are decoded by CPU threads: {why}", RuntimeWarning)
        else:
            names.append(f.name)
    return names, [f.name for f in compressed if f.name not in names]


def misaligned(field: Any, lib: Any) -> str | None:
    """Why nvCOMP cannot decode ``field``'s chunks where the window buffer holds them, or None. Its zstd
    decoder states the alignment it needs of each chunk's input and output (``lib.alignments``): a chunk's
    compressed bytes start wherever the store put them (any byte), and its cell at the field's region (on
    4 KiB) plus a whole number of decoded chunks."""
    need_in, need_out = getattr(lib, "alignments", (1, 1, 1))[:2]
    if need_in > 1:
        return (f"nvCOMP {getattr(lib, 'version', '')} needs its inputs on {need_in}-byte boundaries, and a "
                "store's chunks start at any byte")
    if need_out > 1 and field.block_bytes % need_out:
        return (f"nvCOMP {getattr(lib, 'version', '')} needs its outputs on {need_out}-byte boundaries, and the "
                f"chunks decode to {field.block_bytes} bytes each")
    return None


class CrcMismatch(ValueError):
    """A chunk's bytes differ from the crc32c its ``crc32c`` codec stored."""


def chunk_error(layout: Any, name: str, chunk: int, codecs: Sequence[str], why: str,
                checksum: bool = False, error: type[ReadError] | None = None) -> ReadError:
    """``FILE: chunk C of array 'A' (N bytes at offset O, codecs [...]) does not decode: WHY``; a
    :class:`ChecksumError` when ``checksum`` (its crc32c codec does not match), else ``error`` (ReadError)."""
    loc = layout.locate(name, chunk)
    where = f"{loc.path}: chunk {chunk}" if loc is not None else f"{layout.meta.path}: chunk {chunk}"
    at = f"{loc.nbytes} bytes at offset {loc.offset}, " if loc is not None else ""
    error = ChecksumError if checksum else (error or ReadError)
    return error(f"{where} of array '{name}' ({at}codecs {['bytes', *codecs]}) does not decode: {why}")
