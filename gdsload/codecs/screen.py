"""Screening zstd frames before nvCOMP decodes them: each chunk's crc32c (when its codecs end with one) and its
magic number, checked on the device in the decoder's stream order, with nothing waiting on the host.

nvCOMP checks neither, and a damaged frame can make its decode run on without end. A chunk that fails is not
handed to nvCOMP: its entry in the call's table is pointed at :data:`STAND_IN`, a valid one-byte frame, and
why it failed comes back with nvCOMP's statuses, with its first four bytes, so the window's check names it
(:class:`gdsload.codecs.nvcomp.DecodeCheck`). Checking on the host first would make every window's decode wait
for the device: the checks of one window queue behind the decode of the one before.

A call's table is one device array: :data:`ROWS` rows of ``m`` uint64 (compressed address and size, cell size
and address, the chunk's CRC pad, then the decoded sizes nvCOMP writes), followed by ``m`` int32 statuses
(nvCOMP's), ``m`` int32 reasons and ``m`` uint32 heads (this module's). :func:`screen_host` does on host memory
what the kernel does, for the tests of the device path without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..format.arrays import CRC_BYTES
from . import checksum

#: The table's rows, in order.
SRC, LEN, CAP, CELL, PAD, OUT = range(6)
ROWS = 6
#: Why a chunk was not handed to nvCOMP (0: it was).
NOT_ZSTD, CRC_MISMATCH = 1, 2
#: The first four bytes of every zstd frame, read as a little-endian uint32.
ZSTD_MAGIC = 0xFD2FB528
#: What nvCOMP decodes in place of a chunk that failed: a zstd frame of one zero byte (every cell holds one).
STAND_IN = bytes.fromhex("28b52ffd200109000000")
#: Bytes after the rows: statuses, reasons, heads.
TAIL_ITEM_BYTES = 12

#: The screening kernel (CUDA C++), the table's layout written in.
KERNEL_SOURCE = r"""
extern "C" __global__ void screen_frames(unsigned long long* t, int m, int crc, const unsigned int* got,
                                         const unsigned int* t0, const unsigned int* powers,
                                         unsigned long long stand_in, unsigned long long stand_in_bytes)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(t[SRC * m + i]);
    const unsigned long long n = t[LEN * m + i];
    unsigned int head = 0;
    for (unsigned long long k = 0; k < 4 && k < n; ++k) head |= static_cast<unsigned int>(p[k]) << (8 * k);
    int reason = 0;
    if (crc) {  // the stored crc32c after the frame, turned into what the crc kernel computed (checksum.py's
                // device_expected): the initial value carried over the frame's n bytes, both over its pad
        unsigned int v = static_cast<unsigned int>(p[n]) | static_cast<unsigned int>(p[n + 1]) << 8
                         | static_cast<unsigned int>(p[n + 2]) << 16 | static_cast<unsigned int>(p[n + 3]) << 24;
        unsigned int key = 0xffffffffu;
        int k = 0;
        for (unsigned long long b = n; b; ++k, b >>= 1) {
            if (b & 1) {
                const unsigned int* s = powers + k * 1024;
                key = s[key & 0xff] ^ s[256 + ((key >> 8) & 0xff)] ^ s[512 + ((key >> 16) & 0xff)]
                      ^ s[768 + (key >> 24)];
            }
        }
        key ^= 0xffffffffu;
        for (unsigned long long b = t[PAD * m + i]; b; --b) {
            v = (v >> 8) ^ t0[v & 0xff];
            key = (key >> 8) ^ t0[key & 0xff];
        }
        if ((v ^ key) != got[i]) reason = CRC_MISMATCH;
    }
    if (!reason && head != ZSTD_MAGICu) reason = NOT_ZSTD;
    if (reason) {
        t[SRC * m + i] = stand_in;
        t[LEN * m + i] = stand_in_bytes;
    }
    int* tail = reinterpret_cast<int*>(t + ROWS * m);
    tail[m + i] = reason;
    reinterpret_cast<unsigned int*>(tail)[2 * m + i] = head;
}
"""
for _name, _value in dict(SRC=SRC, LEN=LEN, PAD=PAD, ROWS=ROWS, NOT_ZSTD=NOT_ZSTD,
                          CRC_MISMATCH=CRC_MISMATCH, ZSTD_MAGIC=ZSTD_MAGIC).items():
    KERNEL_SOURCE = KERNEL_SOURCE.replace(_name, str(_value))


def table(base: int, lo: np.ndarray, hi: np.ndarray, cell_bytes: int, dest: np.ndarray) -> np.ndarray:
    """The rows of a call's table (:data:`ROWS` x m uint64) for frames at ``[lo, hi)`` of a window buffer at address
    ``base``, decoded into cells of ``cell_bytes`` at ``dest`` of the same buffer."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    rows = np.zeros((ROWS, len(lo)), np.uint64)
    rows[SRC], rows[LEN], rows[CAP] = base + lo, hi - lo, cell_bytes
    rows[CELL], rows[PAD] = base + np.asarray(dest, np.int64), -hi % checksum.WORD_BYTES
    return rows


def heads(gather: Callable[[np.ndarray], Any], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Each segment's first four bytes as a little-endian uint32, zero past its end; ``gather(index)``
    returns the buffer's bytes at ``index`` (a host array)."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    idx = lo[:, None] + np.arange(4)
    inside = idx < hi[:, None]
    got = np.asarray(gather(np.where(inside, idx, 0).reshape(-1)), np.uint8).reshape(-1, 4)  # 0: any valid index
    return np.ascontiguousarray(np.where(inside, got, 0).astype(np.uint8)).view("<u4").reshape(-1)


def screen_host(buffer: np.ndarray, tab: np.ndarray, lo: np.ndarray, hi: np.ndarray, crc: bool,
                got: np.ndarray | None, stand_in: int) -> None:
    """What the kernel does, on a host window buffer: ``tab`` is the call's table (uint8, as uploaded), ``lo`` and
    ``hi`` each frame's place in ``buffer``, ``got`` the crc kernel's results (its numpy reference) when ``crc``,
    ``stand_in`` the address of :data:`STAND_IN`."""
    m = len(lo)
    rows = tab[:ROWS * m * 8].view(np.uint64).reshape(ROWS, m)
    tail = tab[ROWS * m * 8:].view(np.int32)
    head = heads(lambda idx: buffer[idx], lo, hi)
    reason = np.zeros(m, np.int32)
    if crc:
        idx = (np.asarray(hi, np.int64)[:, None] + np.arange(CRC_BYTES)).reshape(-1)
        stored = np.ascontiguousarray(buffer[idx], np.uint8).view("<u4").astype(np.uint32)
        reason[checksum.device_expected(stored, lo, hi) != got] = CRC_MISMATCH
    reason[(reason == 0) & (head != ZSTD_MAGIC)] = NOT_ZSTD
    bad = reason != 0
    rows[SRC][bad], rows[LEN][bad] = stand_in, len(STAND_IN)
    tail[m:2 * m] = reason
    tail[2 * m:3 * m] = head.view(np.int32)


class DeviceScreen:
    """The screening kernel on one device, with :data:`STAND_IN` and the CRC byte table in device memory, and the
    crc kernel (:class:`gdsload.codecs.checksum_cuda.DeviceCrc`) it follows, whose tables of shifts by ``2**k``
    bytes it also reads (each frame's key)."""

    def __init__(self, device_id: int):
        import cupy

        from ..cuda.kernels import load_module
        from .checksum_cuda import DeviceCrc

        self.cupy = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            module = load_module(cupy, KERNEL_SOURCE, device_id, probe="screen_frames")
            self.kernel = module.get_function("screen_frames")
            self.t0 = cupy.asarray(checksum.T0)
            self.stand_in = cupy.asarray(np.frombuffer(STAND_IN, np.uint8))
        self.crc = DeviceCrc(device_id)

    def launch(self, buffer: Any, tab: Any, lo: np.ndarray, hi: np.ndarray, crc: bool, stream: Any) -> Any:
        """Queue the screening of a call's ``m = len(lo)`` frames on ``stream``: their crc32c (``crc``) and magic
        numbers, writing ``tab``'s reasons and heads and pointing failing entries at :data:`STAND_IN`. Returns
        what must live until the stream has passed it."""
        m = len(lo)
        got = self.crc.launch(buffer, lo, hi, stream) if crc else None
        with self.device, stream:
            self.kernel(((m + 127) // 128,), (128,),
                        (tab, np.int32(m), np.int32(crc), got if got is not None else np.uint64(0), self.t0,
                         self.crc.powers, np.uint64(int(self.stand_in.data.ptr)), np.uint64(len(STAND_IN))))
        return got
