"""nvCOMP's batched zstd decoder, called through its C API (``libnvcomp`` of the ``nvidia-libnvcomp`` wheel) by ctypes.

The declarations follow ``nvcomp/zstd.h`` and ``nvcomp/shared_types.h`` of nvCOMP 6 (the wheel ships them). Why
the C API rather than nvCOMP's Python API: docs/format.md, "Compressed chunks".
"""

from __future__ import annotations

import ctypes
from typing import Any

#: The names of ``nvcompStatus_t``'s values.
STATUS = {0: "nvcompSuccess", 10: "nvcompErrorInvalidValue", 11: "nvcompErrorNotSupported",
          12: "nvcompErrorCannotDecompress", 13: "nvcompErrorBadChecksum", 14: "nvcompErrorCannotVerifyChecksums",
          15: "nvcompErrorOutputBufferTooSmall", 16: "nvcompErrorWrongHeaderLength", 17: "nvcompErrorAlignment",
          18: "nvcompErrorChunkSizeTooLarge", 19: "nvcompErrorCannotCompress", 20: "nvcompErrorWrongInputLength",
          21: "nvcompErrorBatchSizeTooLarge", 22: "nvcompErrorSubChunkCountTooLarge",
          23: "nvcompErrorSubChunkCountTooSmall", 24: "nvcompErrorOutputBufferAlignmentTooSmall",
          1000: "nvcompErrorCudaError", 10000: "nvcompErrorInternal"}
SONAME = "libnvcomp.so.6"


def status_name(code: int) -> str:
    return STATUS.get(int(code), f"nvcompStatus {int(code)}")


class DecompressOpts(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t``: the backend (0: nvCOMP picks) and 60 reserved zero bytes."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class Alignments(ctypes.Structure):
    """``nvcompAlignmentRequirements_t``."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


_size, _ptr = ctypes.c_size_t, ctypes.c_void_p


class Properties(ctypes.Structure):
    """``nvcompProperties_t``: the library's version as ``major * 1000 + minor * 100 + patch``, and CUDA's."""

    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


class ZstdLib:
    """The three calls of libnvcomp's batched zstd decoder that gdsload makes. Every pointer is a device address
    (an int); ``stream`` is a CUDA stream's handle. ``version``: the library's ("6.0.0"); ``path``: its file."""

    def __init__(self, lib: Any, path: str = "?"):
        self.lib, self.path = lib, path
        props = Properties()
        _check(lib.nvcompGetProperties(ctypes.pointer(props)), "properties")
        v = int(props.version)
        self.version = f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
        lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [_size, _size, DecompressOpts, ctypes.POINTER(_size),
                                                                _size, _ptr]
        lib.nvcompBatchedZstdDecompressAsync.argtypes = [_ptr, _ptr, _ptr, _ptr, _size, _ptr, _size, _ptr,
                                                          DecompressOpts, _ptr, _ptr]
        lib.nvcompBatchedZstdDecompressGetRequiredAlignments.argtypes = [DecompressOpts, ctypes.POINTER(Alignments)]
        for name in ("nvcompBatchedZstdDecompressGetTempSize", "nvcompBatchedZstdDecompressAsync",
                     "nvcompBatchedZstdDecompressGetRequiredAlignments"):
            getattr(lib, name).restype = ctypes.c_int
        self.opts = DecompressOpts()
        got = Alignments()
        _check(lib.nvcompBatchedZstdDecompressGetRequiredAlignments(self.opts, ctypes.pointer(got)), "alignments")
        self.alignments = (got.input, got.output, got.temp)

    def temp_bytes(self, chunks: int, chunk_bytes: int, total_bytes: int) -> int:
        """Scratch memory a call of ``chunks`` chunks, each at most ``chunk_bytes`` decoded, needs."""
        got = _size()
        _check(self.lib.nvcompBatchedZstdDecompressGetTempSize(chunks, chunk_bytes, self.opts, ctypes.byref(got),
                                                                total_bytes, None), "temp size")
        return int(got.value)

    def decompress(self, src_ptrs: int, src_bytes: int, cell_bytes: int, decoded_bytes: int, chunks: int,
                   temp: int, temp_bytes: int, cell_ptrs: int, statuses: int, stream: int) -> int:
        """Queue the decode of ``chunks`` chunks on ``stream`` (each argument but the counts is the device
        address of an array of ``chunks`` entries: size_t, or int32 statuses); the launch's status."""
        return int(self.lib.nvcompBatchedZstdDecompressAsync(src_ptrs, src_bytes, cell_bytes, decoded_bytes, chunks,
                                                             temp, temp_bytes, cell_ptrs, self.opts, statuses,
                                                             stream))


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"libnvcomp: {what}: {status_name(code)}")


class DlInfo(ctypes.Structure):
    """``Dl_info`` of ``<dlfcn.h>``."""

    _fields_ = [("fname", ctypes.c_char_p), ("fbase", _ptr), ("sname", ctypes.c_char_p), ("saddr", _ptr)]


def loaded_from(function: Any) -> str:
    """The file the dynamic loader took ``function`` (a ctypes function) from, as ``dladdr`` says; "?" if not."""
    info = DlInfo()
    try:
        found = ctypes.CDLL(None).dladdr(ctypes.cast(function, _ptr), ctypes.pointer(info))
    except (AttributeError, OSError):
        return "?"
    return info.fname.decode(errors="replace") if found and info.fname else "?"


def load() -> ZstdLib | None:
    """libnvcomp from the ``nvidia-libnvcomp`` wheel (or the system's), or None when it cannot be loaded."""
    lib: Any = None
    try:
        from nvidia.libnvcomp import load_library

        lib = load_library()
    except Exception:
        lib = None
    if lib is None:
        try:
            lib = ctypes.CDLL(SONAME, ctypes.RTLD_LOCAL)
        except OSError:
            return None
    try:
        return ZstdLib(lib, loaded_from(lib.nvcompGetProperties))
    except (AttributeError, RuntimeError):  # too old a libnvcomp: its zstd calls differ
        return None


def describe(lib: ZstdLib | None, switched_off: bool = False) -> dict[str, Any]:
    """What ``gdsload doctor`` shows of nvCOMP: its version and file, or why zstd decodes on CPU threads."""
    if switched_off:
        return {"nvcomp": None, "nvcomp_error": "switched off (GDSLOAD_NVCOMP=0)"}
    if lib is None:
        return {"nvcomp": None, "nvcomp_error": f"{SONAME} not found, nor the nvidia-libnvcomp wheel's"}
    return {"nvcomp": lib.version, "path": lib.path}
