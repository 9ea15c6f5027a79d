"""Row gathers on the device, by index or by row address, on a bounded grid that leaves room for the step.

The kernels run a few blocks per multiprocessor, each looping over its rows (:func:`launch_shape`), so a
kernel of the consumer's stream starts beside a gather rather than after it; rows move as words of up to 16
bytes (:func:`word_bytes`). A gather by pointers reads each row's address from a pinned host table in place
(:meth:`Gather.by_pointers`): rows of several arrays in one launch. The launch arithmetic is pure (tested on
the CPU); only :class:`Gather` touches the device. Why: docs/design.md, "Threads and events".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .runtime import DEV_ATTR_MULTIPROCESSOR_COUNT

#: Threads per block, and blocks per multiprocessor at most: 512 of the 2048 threads an SM can hold.
THREADS = 256
BLOCKS_PER_SM = 2
#: Rows of at least this many words get a block each (coalesced along the row); narrower rows are spread
#: one word per thread over the whole gather.
WIDE_ROW_WORDS = 64

_CTYPES = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_ITYPES = {4: "int", 8: "long long"}

_TEMPLATES = r"""
template <typename WORD, typename INDEX>
__device__ __forceinline__ void wide(const WORD* __restrict__ src, const INDEX* __restrict__ idx,
                                     WORD* __restrict__ out, long long rows, long long words) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const WORD* s = src + (long long)idx[r] * words;
        WORD* o = out + r * words;
        #pragma unroll 4
        for (long long c = threadIdx.x; c < words; c += blockDim.x) o[c] = s[c];
    }
}
template <typename WORD, typename INDEX>
__device__ __forceinline__ void narrow(const WORD* __restrict__ src, const INDEX* __restrict__ idx,
                                       WORD* __restrict__ out, long long rows, long long words) {
    const long long total = rows * words;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long r = t / words;
        out[t] = src[(long long)idx[r] * words + (t - r * words)];
    }
}
template <typename WORD>
__device__ __forceinline__ void wide_ptr(const unsigned long long* __restrict__ ptrs, WORD* __restrict__ out,
                                         long long rows, long long words) {
    __shared__ const WORD* row;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        if (threadIdx.x == 0) row = reinterpret_cast<const WORD*>(ptrs[r]);
        __syncthreads();
        const WORD* s = row;
        WORD* o = out + r * words;
        #pragma unroll 4
        for (long long c = threadIdx.x; c < words; c += blockDim.x) o[c] = s[c];
        __syncthreads();
    }
}
template <typename WORD>
__device__ __forceinline__ void narrow_ptr(const unsigned long long* __restrict__ ptrs, WORD* __restrict__ out,
                                           long long rows, long long words) {
    const long long total = rows * words;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long r = t / words;
        out[t] = reinterpret_cast<const WORD*>(ptrs[r])[t - r * words];
    }
}
"""
_ENTRY = """extern "C" __global__ void gather_{kind}_{word}_{index}(const {w}* __restrict__ src,
    const {i}* __restrict__ idx, {w}* __restrict__ out, long long rows, long long words) {{
    {kind}<{w}, {i}>(src, idx, out, rows, words);
}}
"""
_PTR_ENTRY = """extern "C" __global__ void gather_{kind}_ptr_{word}_8(const unsigned long long* __restrict__ ptrs,
    {w}* __restrict__ out, long long rows, long long words) {{
    {kind}_ptr<{w}>(ptrs, out, rows, words);
}}
"""
#: Every kernel in one module (``gather_<wide|narrow>_<word bytes>_<index bytes>``, and by pointers
#: ``gather_<wide|narrow>_ptr_<word bytes>_8``): one file to load.
SOURCE = _TEMPLATES + "".join(_ENTRY.format(kind=k, word=word, index=index, w=w, i=i)
                              for k in ("wide", "narrow") for word, w in _CTYPES.items()
                              for index, i in _ITYPES.items()) + \
    "".join(_PTR_ENTRY.format(kind=k, word=word, w=w) for k in ("wide", "narrow") for word, w in _CTYPES.items())


def word_bytes(row_bytes: int, *pointers: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) dividing a row and every pointer."""
    for size in (16, 8, 4, 2):
        if row_bytes % size == 0 and all(p % size == 0 for p in pointers):
            return size
    return 1


def row_pointers(parts: list[tuple[int, np.ndarray]], row_bytes: int, out: np.ndarray) -> int:
    """Fill ``out[:n]`` with the address of every row of ``parts`` in order (part = (address of the array's row
    0, the rows taken, host int array)): ``address + row * row_bytes``; returns n. Pure: the table a gather by
    pointers reads."""
    at = 0
    for base, rows in parts:
        n = len(rows)
        view = out[at:at + n]
        np.multiply(rows, row_bytes, out=view, casting="unsafe")
        view += np.uint64(base)
        at += n
    return at


def launch_shape(rows: int, words: int, sm_count: int) -> tuple[str, int]:
    """(kernel, blocks) for ``rows`` rows of ``words`` words: a block per row for wide rows, a thread per
    word for narrow ones, never more than ``BLOCKS_PER_SM`` blocks per multiprocessor (nor more than
    there is work for)."""
    cap = max(1, BLOCKS_PER_SM * sm_count)
    if words >= WIDE_ROW_WORDS:
        return "gather_wide", max(1, min(rows, cap))
    return "gather_narrow", max(1, min(-(-rows * words // THREADS), cap))


class Gather:
    """The kernels for one device, loaded on first use (:mod:`gdsload.cuda.kernels`)."""

    def __init__(self, cupy: Any, device: Any):
        self.cupy = cupy
        # One attribute, not Device.attributes (which queries every one): this runs as a dataset opens.
        self.sm_count = int(cupy.cuda.runtime.deviceGetAttribute(DEV_ATTR_MULTIPROCESSOR_COUNT, device.id))
        self.device_id = int(device.id)
        self._module: Any = None
        self._kernels: dict[tuple[str, int, int], Any] = {}

    def _kernel(self, name: str, word: int, index: int) -> Any:
        kernel = self._kernels.get((name, word, index))
        if kernel is None:
            if self._module is None:
                from .kernels import load_module

                self._module = load_module(self.cupy, SOURCE, self.device_id, probe="gather_wide_16_8")
            kernel = self._kernels[(name, word, index)] = self._module.get_function(f"{name}_{word}_{index}")
        return kernel

    def __call__(self, src: Any, idx: Any, out: Any) -> bool:
        """Queue ``out[:] = src[idx]`` (rows along axis 0) on the current stream: True, or False (nothing queued)
        when an array is not contiguous or the index is not int32/int64 (the caller gathers otherwise).
        Indices are trusted: the plan made them within ``src``."""
        rows = int(out.shape[0])
        if rows == 0:
            return True
        if (not src.flags.c_contiguous or not out.flags.c_contiguous or not idx.flags.c_contiguous
                or idx.dtype.itemsize not in _ITYPES or idx.dtype.kind not in "iu" or idx.shape[0] != rows):
            return False
        row_bytes = out.nbytes // rows
        if src.shape[0] and src.nbytes // src.shape[0] != row_bytes:
            return False
        word = word_bytes(row_bytes, src.data.ptr, out.data.ptr)
        words = row_bytes // word
        name, blocks = launch_shape(rows, words, self.sm_count)
        kernel = self._kernel(name, word, idx.dtype.itemsize)
        kernel((blocks,), (THREADS,), (src, idx, out, np.int64(rows), np.int64(words)))
        return True

    def by_pointers(self, table: int, align: int, out: Any) -> None:
        """Queue ``out[r] = row at table[r]`` on the current stream: ``table`` the address of a host table of
        ``len(out)`` row addresses (uint64, in pinned memory the device reads where it lies), ``align`` every
        address of it OR-ed together (the word size follows from it). The table must stay until the kernel ran."""
        rows = int(out.shape[0])
        if rows == 0:
            return
        row_bytes = out.nbytes // rows
        word = word_bytes(row_bytes, out.data.ptr, align)
        name, blocks = launch_shape(rows, row_bytes // word, self.sm_count)
        kernel = self._kernel(name + "_ptr", word, 8)
        kernel((blocks,), (THREADS,), (np.uint64(table), out, np.int64(rows), np.int64(row_bytes // word)))
