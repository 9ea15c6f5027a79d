"""crc32c of segments of a device buffer, computed by a CuPy kernel (no copy back of the data).

The algorithm and its algebra are in :mod:`gdsload.codecs.checksum`; this module is only its device half: one
kernel block per tile of at most ``TILE_WORDS`` 16-byte words, consecutive words on consecutive threads
(coalesced loads), each thread folding its words with one table shift per round (Horner), then moving its
sum to the segment's end and XORing it into the segment's result with one atomic per kernel block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import checksum as host

_SOURCE = r"""
extern "C" __global__ void crc32c_pieces(
    const unsigned char* __restrict__ buf, const long long* __restrict__ table, int num_pieces,
    const long long* __restrict__ seg_lo, const long long* __restrict__ seg_hi,
    const long long* __restrict__ seg_end, const unsigned int* __restrict__ slices,
    const unsigned int* __restrict__ stride, const unsigned int* __restrict__ powers,
    unsigned int* __restrict__ out)
{
    __shared__ unsigned int s16[16 * 256];
    __shared__ unsigned int sstride[4 * 256];
    __shared__ unsigned int partial[THREADS / 32];
    for (int i = threadIdx.x; i < 16 * 256; i += blockDim.x) s16[i] = slices[i];
    for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) sstride[i] = stride[i];
    __syncthreads();
    const int p = blockIdx.x;
    if (p >= num_pieces) return;
    const long long first = table[3 * p], nwords = table[3 * p + 1], seg = table[3 * p + 2];
    const long long lo = seg_lo[seg], hi = seg_hi[seg], end = seg_end[seg];
    unsigned int acc = 0;
    long long last = -1;
    for (long long j = threadIdx.x; j < nwords; j += THREADS) {
        const long long a = (first + j) * 16;
        const uint4 v = reinterpret_cast<const uint4*>(buf)[first + j];
        unsigned int w[4] = {v.x, v.y, v.z, v.w};
        if (a < lo || a + 16 > hi) {  // bytes outside the segment count as zero
            for (int k = 0; k < 16; ++k) {
                if (a + k < lo || a + k >= hi) w[k >> 2] &= ~(0xffu << (8 * (k & 3)));
            }
        }
        unsigned int c = 0;
        #pragma unroll
        for (int k = 0; k < 16; ++k) c ^= s16[k * 256 + ((w[k >> 2] >> (8 * (k & 3))) & 0xff)];
        acc = sstride[acc & 0xff] ^ sstride[256 + ((acc >> 8) & 0xff)] ^ sstride[512 + ((acc >> 16) & 0xff)]
              ^ sstride[768 + (acc >> 24)] ^ c;
        last = a;
    }
    if (last >= 0) {
        long long n = end - (last + 16);
        for (int k = 0; n; ++k, n >>= 1) {
            if (n & 1) {
                const unsigned int* t = powers + k * 1024;
                acc = t[acc & 0xff] ^ t[256 + ((acc >> 8) & 0xff)]
                    ^ t[512 + ((acc >> 16) & 0xff)] ^ t[768 + (acc >> 24)];
            }
        }
    }
    for (int o = 16; o; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int total = 0;
        for (int i = 0; i < THREADS / 32; ++i) total ^= partial[i];
        if (total) atomicXor(out + seg, total);
    }
}
"""


class DeviceCrc:
    """Computes segment CRCs of device buffers on one device; tables uploaded once."""

    def __init__(self, device_id: int):
        import cupy

        from ..cuda.kernels import load_module

        self.cupy = cupy
        self.device = cupy.cuda.Device(device_id)
        slices, stride, powers = host.device_tables()
        with self.device:
            self.kernel = load_module(cupy, _SOURCE.replace("THREADS", str(host.THREADS)), device_id,
                                      probe="crc32c_pieces").get_function("crc32c_pieces")
            self.slices, self.stride, self.powers = (cupy.asarray(t.reshape(-1)) for t in (slices, stride, powers))

    def launch(self, buf: Any, lo: np.ndarray, hi: np.ndarray, stream: Any) -> Any:
        """Queue the CRCs of non-empty segments [lo, hi) of ``buf`` (a device uint8 array) on ``stream``;
        returns a device uint32 array comparable with :func:`gdsload.codecs.checksum.device_expected`."""
        cp = self.cupy
        p = host.tiles(lo, hi)
        n, m = len(lo), p.table.size
        with self.device, stream:
            # One upload of the work list: the tile table, then lo, hi and end of every segment.
            packed = cp.asarray(np.concatenate([p.table.reshape(-1), p.lo, p.hi, p.end]))
            out = cp.zeros(n, dtype=cp.uint32)
            if len(p.table):
                self.kernel((len(p.table),), (host.THREADS,),
                            (buf, packed[:m], np.int32(len(p.table)), packed[m:m + n], packed[m + n:m + 2 * n],
                             packed[m + 2 * n:], self.slices, self.stride, self.powers, out))
        return out
