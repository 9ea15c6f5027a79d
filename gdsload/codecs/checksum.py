"""crc32c of block data: the host check, and the GF(2) algebra the device kernel is built on (pure numpy).

On the host, ``crc32c.crc32c`` per block (the CPU's CRC instruction, GIL released). On the device the kernel
of :mod:`gdsload.codecs.checksum_cuda` joins per-word raw CRCs by shifts (the algebra: docs/design.md,
"Verification"); :func:`reference_device_crcs` runs that exact algorithm in numpy, so its math is tested
without a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import crc32c
import numpy as np

POLY = 0x82F63B78  # Castagnoli, bit-reflected
WORD_BYTES = 16  # the kernel reads 16-byte words
THREADS = 256  # threads per kernel block: consecutive words go to consecutive threads
TILE_WORDS = 4096  # words per kernel block (64 KiB): tiles of one block run on many SMs at once
SHIFT_LEVELS = 40  # shifts by up to 2**40 - 1 bytes


def _byte_table() -> np.ndarray:
    """T0[b]: raw CRC state after one byte b from state 0 (the classic reflected table)."""
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> 1) ^ np.uint32(POLY), c >> 1).astype(np.uint32)
    return c


T0 = _byte_table()


def _one_zero_byte(c: np.ndarray) -> np.ndarray:
    return (c >> np.uint32(8)) ^ T0[c & np.uint32(0xFF)]


_BITS = np.uint32(1) << np.arange(32, dtype=np.uint32)


def _apply(op: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Apply a linear operator (32 images of the basis bits) to an array of states: the XOR of the images
    of each state's set bits, in one pass over (states, 32) (the kernel's tables are made in every open)."""
    c = np.asarray(c, dtype=np.uint32)
    picked = np.where((c[..., None] & _BITS) != 0, op, np.uint32(0))
    return np.bitwise_xor.reduce(picked, axis=-1).astype(np.uint32)


@functools.lru_cache(maxsize=None)
def _power_op(k: int) -> np.ndarray:
    """The operator advancing a state over 2**k zero bytes (by repeated squaring)."""
    if k == 0:
        return _one_zero_byte(np.uint32(1) << np.arange(32, dtype=np.uint32))
    half = _power_op(k - 1)
    return _apply(half, half)


@functools.lru_cache(maxsize=256)
def _shift_op(n: int) -> np.ndarray:
    op = np.uint32(1) << np.arange(32, dtype=np.uint32)  # identity
    k = 0
    while n:
        if n & 1:
            op = _apply(_power_op(k), op)
        n >>= 1
        k += 1
    return op


def byte_tables(op: np.ndarray) -> np.ndarray:
    """(4, 256) tables: ``op(c) = t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][...] ^ t[3][c >> 24]``."""
    v = np.arange(256, dtype=np.uint32)
    return np.stack([_apply(op, v << np.uint32(8 * i)) for i in range(4)])


def shift(c: np.ndarray | int, n: int) -> np.ndarray:
    """Raw CRC states ``c`` advanced over ``n`` zero bytes."""
    return _apply(_shift_op(int(n)), np.asarray(c, dtype=np.uint32))


def slice_tables() -> np.ndarray:
    """(16, 256): the raw CRC of a 16-byte word from state 0 is the XOR of ``t[k][byte k]``."""
    return np.stack([_apply(_shift_op(WORD_BYTES - 1 - k), T0) for k in range(WORD_BYTES)])


@functools.lru_cache(maxsize=1)
def device_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's tables: slicing-by-16, the shift by one round of all threads' words, and shifts by
    2**k bytes."""
    stride = byte_tables(_shift_op(THREADS * WORD_BYTES))
    powers = np.stack([byte_tables(_power_op(k)) for k in range(SHIFT_LEVELS)])
    return slice_tables(), stride, powers


class Tiles(NamedTuple):
    """The kernel's work list: segment ``i`` is bytes [lo[i], hi[i]) of the buffer, read as the 16-byte
    words from ``lo // 16`` to ``ceil(hi / 16)`` (bytes outside the segment count as zero), cut into tiles
    of at most TILE_WORDS words. ``table`` has one row per tile: first word, words, segment."""

    lo: np.ndarray
    hi: np.ndarray
    end: np.ndarray  # ceil(hi / 16) * 16: where the raw CRC the kernel computes ends
    table: np.ndarray  # (tiles, 3) int64


def tiles(lo: np.ndarray, hi: np.ndarray) -> Tiles:
    """Cut segments (non-empty, ``lo < hi``) into the kernel's tiles."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    w0, w1 = lo // WORD_BYTES, -(-hi // WORD_BYTES)
    count = -(-(w1 - w0) // TILE_WORDS)
    seg = np.repeat(np.arange(len(lo), dtype=np.int64), count)
    k = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    first = w0[seg] + k * TILE_WORDS
    nwords = np.minimum(TILE_WORDS, w1[seg] - first)
    return Tiles(lo, hi, w1 * WORD_BYTES, np.stack([first, nwords, seg], axis=1))


def shift_each(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Raw CRC states ``c[i]`` each advanced over its own ``n[i]`` zero bytes (at most ``2**SHIFT_LEVELS - 1``):
    one pass per bit of the largest ``n``, through the kernel's byte tables of shifts by ``2**k`` bytes, so a
    window of chunks of many different lengths costs as little as one of equal blocks."""
    out = np.array(c, dtype=np.uint32, copy=True).reshape(-1)
    n = np.asarray(n, dtype=np.int64).reshape(-1)
    powers = device_tables()[2]
    for k in range(int(n.max()).bit_length() if len(n) else 0):
        sel = np.flatnonzero((n >> k) & 1)
        if len(sel):
            v, t = out[sel], powers[k]
            out[sel] = t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24]
    return out


def device_expected(std: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """What the kernel computes for segments whose standard crc32c is ``std``: the raw CRC, advanced
    over the zero bytes that pad each segment to a whole 16-byte word. The standard CRC of ``n`` bytes is
    their raw CRC XOR that of ``n`` zero bytes, ``shift(~0, n) ^ ~0`` (the initial value carried over them)."""
    std, lo, hi = np.asarray(std, np.uint32), np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    ones = np.full(len(std), 0xFFFFFFFF, dtype=np.uint32)
    raw = std ^ shift_each(ones, hi - lo) ^ ones
    return shift_each(raw, -hi % WORD_BYTES)


def reference_device_crcs(buf: np.ndarray, p: Tiles) -> np.ndarray:
    """The device kernel's algorithm, step for step, in numpy (for tests; slow)."""
    slices, stride, powers = device_tables()
    words = np.asarray(buf, np.uint8)
    out = np.zeros(len(p.lo), dtype=np.uint32)
    for first, nwords, seg in p.table.tolist():
        lo, hi, end = int(p.lo[seg]), int(p.hi[seg]), int(p.end[seg])
        for t in range(min(THREADS, nwords)):
            acc, last = np.uint32(0), -1
            for j in range(t, nwords, THREADS):
                a = (first + j) * WORD_BYTES
                word = np.zeros(WORD_BYTES, np.uint8)
                s, e = max(a, lo), min(a + WORD_BYTES, hi)
                word[s - a:e - a] = words[s:e]
                c = np.bitwise_xor.reduce(slices[np.arange(WORD_BYTES), word])
                acc = _apply_tables(stride, acc) ^ c
                last = a
            out[seg] ^= _shift_by_powers(powers, acc, end - (last + WORD_BYTES))
    return out


def _apply_tables(t: np.ndarray, c: np.uint32) -> np.uint32:
    c = int(c)
    return np.uint32(t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24])


def _shift_by_powers(powers: np.ndarray, c: np.uint32, n: int) -> np.uint32:
    k = 0
    while n:
        if n & 1:
            c = _apply_tables(powers[k], c)
        n >>= 1
        k += 1
    return c


class Checks(NamedTuple):
    """Segments [lo, hi) of a buffer that must have the standard crc32c ``expected``; ``keys`` and
    ``blocks`` say which array and block each one is (for the error message)."""

    lo: np.ndarray
    hi: np.ndarray
    expected: np.ndarray
    keys: tuple[str, ...]
    blocks: np.ndarray


def concat(parts: list[Checks]) -> Checks:
    if not parts:
        empty = np.zeros(0, np.int64)
        return Checks(empty, empty, np.zeros(0, np.uint32), (), empty)
    return Checks(np.concatenate([c.lo for c in parts]), np.concatenate([c.hi for c in parts]),
                  np.concatenate([c.expected for c in parts]), sum((c.keys for c in parts), ()),
                  np.concatenate([c.blocks for c in parts]))


def host_crcs(buf: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Standard crc32c of each segment of a host buffer."""
    view = memoryview(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))
    return np.array([crc32c.crc32c(view[a:b]) for a, b in zip(np.asarray(lo).tolist(), np.asarray(hi).tolist())],
                    dtype=np.uint32)
