"""zstd frames screened on the device before nvCOMP decodes them: crc32c, magic number and block structure.

In the decoder's stream order, nothing waiting on the host. A chunk that fails is not handed to nvCOMP: its
table entry points at :data:`STAND_IN`, a valid one-byte frame, and why it failed (with its first four bytes, or
where the walk stopped) comes back with nvCOMP's statuses (:class:`gdsload.codecs.nvcomp.DecodeCheck`). A call's
table is one device array: :data:`ROWS` rows of ``m`` uint64 (compressed address and size, cell size and
address, the chunk's CRC pad, the decoded sizes), then ``m`` int32 statuses, ``m`` int32 reasons and ``m``
uint32 heads. :func:`screen_host` does the same on host memory, for tests without a GPU. Why: docs/format.md,
"Compressed chunks".
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
NOT_ZSTD, CRC_MISMATCH, FRAME_BROKEN = 1, 2, 3
#: The largest block a zstd frame may hold (RFC 8878, Block_Maximum_Size): a larger stated size is damage.
BLOCK_MAX = 128 * 1024
#: The first four bytes of every zstd frame, read as a little-endian uint32.
ZSTD_MAGIC = 0xFD2FB528
#: What nvCOMP decodes in place of a chunk that failed: a zstd frame of one zero byte (every cell holds one).
STAND_IN = bytes.fromhex("28b52ffd200109000000")
#: Bytes after the rows: statuses, reasons, heads.
TAIL_ITEM_BYTES = 12

#: The screening kernel (CUDA C++), the table's layout written in.
KERNEL_SOURCE = r"""
// Where the walk of a frame of n bytes stopped (a byte offset), or WALK_OK: walk_frame() in screen.py, line
// for line. Every byte is read only below n; each turn of the loop moves on by at least 3 bytes.
__device__ unsigned long long walk(const unsigned char* p, unsigned long long n, unsigned long long cap)
{
    if (n < 5) return n;
    const unsigned int fhd = p[4];
    if (fhd & 0x08) return 4;  // the reserved bit
    const unsigned int fcs_flag = fhd >> 6, single = (fhd >> 5) & 1, did_flag = fhd & 3;
    unsigned long long pos = 5 + (single ? 0 : 1) + (did_flag == 3 ? 4 : did_flag);
    const unsigned long long fcs_bytes = fcs_flag == 0 ? single : (fcs_flag == 1 ? 2 : (fcs_flag == 2 ? 4 : 8));
    if (pos + fcs_bytes > n) return n;
    unsigned long long fcs = 0;
    for (unsigned long long k = 0; k < fcs_bytes; ++k) fcs |= static_cast<unsigned long long>(p[pos + k]) << (8 * k);
    if (fcs_bytes == 2) fcs += 256;
    if (fcs_bytes && fcs > cap) return pos;
    pos += fcs_bytes;
    unsigned long long decoded = 0;
    for (;;) {
        if (pos + 3 > n) return pos;
        const unsigned int h = p[pos] | static_cast<unsigned int>(p[pos + 1]) << 8
                               | static_cast<unsigned int>(p[pos + 2]) << 16;
        const unsigned int type = (h >> 1) & 3, size = h >> 3;
        if (type == 3 || size > BLOCK_MAX) return pos;
        if (type != 2) {
            decoded += size;
            if (decoded > cap) return pos;
        }
        const unsigned long long body = type == 1 ? 1 : size;
        if (pos + 3 + body > n) return pos;
        pos += 3 + body;
        if (h & 1) break;
    }
    if (fhd & 0x04) pos += 4;  // the content checksum
    return pos == n ? WALK_OK : pos;
}

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
    if (!reason) {  // the frame's structure, as walk_frame() walks it: on failure, head is where it stopped
        const unsigned long long at = walk(p, n, t[CAP * m + i]);
        if (at != WALK_OK) {
            reason = FRAME_BROKEN;
            head = static_cast<unsigned int>(at);
        }
    }
    if (reason) {
        t[SRC * m + i] = stand_in;
        t[LEN * m + i] = stand_in_bytes;
    }
    int* tail = reinterpret_cast<int*>(t + ROWS * m);
    tail[m + i] = reason;
    reinterpret_cast<unsigned int*>(tail)[2 * m + i] = head;
}
"""
#: What the walk returns for a sound frame (no offset is this large).
WALK_OK = 2**64 - 1
for _name, _value in dict(SRC=SRC, LEN=LEN, CAP=CAP, PAD=PAD, ROWS=ROWS, NOT_ZSTD=NOT_ZSTD, CRC_MISMATCH=CRC_MISMATCH,
                          FRAME_BROKEN=FRAME_BROKEN, ZSTD_MAGIC=ZSTD_MAGIC, BLOCK_MAX=BLOCK_MAX,
                          WALK_OK=WALK_OK).items():
    KERNEL_SOURCE = KERNEL_SOURCE.replace(_name, f"{_value}ull" if _name == "WALK_OK" else str(_value))


def walk_frame(p: Any, n: int, cap: int) -> int | None:
    """Where the walk of the zstd frame ``p[:n]`` stops: None for a frame whose structure is sound (RFC 8878:
    magic number checked before; header with no reserved bit, content size within ``cap``; blocks of no
    reserved type and at most :data:`BLOCK_MAX`, raw and RLE blocks within ``cap`` together, the last one
    followed by the checksum its header announces, ending exactly at ``n``), else the byte offset of what is
    wrong. A frame that passes may still hold damaged entropy data: only a crc32c catches that. The kernel's
    ``walk`` is this function in CUDA."""
    if n < 5:
        return n
    fhd = int(p[4])
    if fhd & 0x08:
        return 4
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (4 if did_flag == 3 else did_flag)
    fcs_bytes = single if fcs_flag == 0 else (2, 4, 8)[fcs_flag - 1]
    if pos + fcs_bytes > n:
        return n
    fcs = int.from_bytes(bytes(p[pos:pos + fcs_bytes]), "little") + (256 if fcs_bytes == 2 else 0)
    if fcs_bytes and fcs > cap:
        return pos
    pos += fcs_bytes
    decoded = 0
    while True:
        if pos + 3 > n:
            return pos
        h = int(p[pos]) | int(p[pos + 1]) << 8 | int(p[pos + 2]) << 16
        kind, size = (h >> 1) & 3, h >> 3
        if kind == 3 or size > BLOCK_MAX:
            return pos
        if kind != 2:
            decoded += size
            if decoded > cap:
                return pos
        body = 1 if kind == 1 else size
        if pos + 3 + body > n:
            return pos
        pos += 3 + body
        if h & 1:
            break
    if fhd & 0x04:
        pos += 4
    return None if pos == n else pos


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
    for i in np.flatnonzero(reason == 0):
        at = walk_frame(buffer[int(lo[i]):int(hi[i])], int(hi[i] - lo[i]), int(rows[CAP][i]))
        if at is not None:
            reason[i], head[i] = FRAME_BROKEN, at
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
        """Queue the screening of a call's ``m = len(lo)`` frames on ``stream``: their crc32c (``crc``), magic
        numbers and structure, writing ``tab``'s reasons and heads and pointing failing entries at
        :data:`STAND_IN`. Returns what must live until the stream has passed it."""
        m = len(lo)
        got = self.crc.launch(buffer, lo, hi, stream) if crc else None
        with self.device, stream:
            self.kernel(((m + 127) // 128,), (128,),
                        (tab, np.int32(m), np.int32(crc), got if got is not None else np.uint64(0), self.t0,
                         self.crc.powers, np.uint64(int(self.stand_in.data.ptr)), np.uint64(len(STAND_IN))))
        return got
