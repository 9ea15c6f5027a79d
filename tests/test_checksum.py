"""crc32c algebra and the device kernel's algorithm, checked against the crc32c package on the CPU."""

from __future__ import annotations

import time

import crc32c
import numpy as np
import pytest

from gdsload.codecs import checksum as C


def raw(data: bytes) -> np.uint32:
    return np.uint32(crc32c.crc32c(data) ^ crc32c.crc32c(bytes(len(data))))


def test_raw_crc_is_linear_and_ignores_leading_zeros():
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (100, 37))
    assert raw(a + b) == C.shift(raw(a), len(b)) ^ raw(b)
    assert raw(bytes(13) + a) == raw(a)
    assert C.shift(raw(a), 0) == raw(a)
    assert raw(a + bytes(5)) == C.shift(raw(a), 5)


def test_the_initial_value_carried_over_zeros_is_the_crc32c_of_zeros():
    """What device_expected relies on: the standard CRC of ``n`` zero bytes is ``shift(~0, n) ^ ~0``."""
    n = np.array([0, 1, 15, 16, (1 << 20) + 3])
    ones = np.full(len(n), 0xFFFFFFFF, np.uint32)
    np.testing.assert_array_equal(C.shift_each(ones, n) ^ ones, [crc32c.crc32c(bytes(int(k))) for k in n])


def test_byte_tables_apply_the_operator():
    tables = C.byte_tables(C._shift_op(4096))
    c = np.uint32(0xDEADBEEF)
    via_tables = tables[0][c & 255] ^ tables[1][(c >> 8) & 255] ^ tables[2][(c >> 16) & 255] ^ tables[3][c >> 24]
    assert via_tables == C.shift(c, 4096)


@pytest.mark.parametrize("segments", [
    [(0, 16)], [(3, 4)], [(17, 70000)], [(1000, 1500)], [(5000, 5001)], [(100003, 299999)],
    [(0, 16), (16, 4096 * 16 * 3 + 5)],  # several tiles in one segment, back to back with another
])
def test_device_algorithm_in_numpy_matches_crc32c(segments):
    rng = np.random.default_rng(len(segments))
    buf = rng.integers(0, 256, 300000, dtype=np.uint8)
    buf[1000:2000] = 0
    lo, hi = (np.array(x) for x in zip(*segments))
    p = C.tiles(lo, hi)
    assert (p.table[:, 1] <= C.TILE_WORDS).all() and (p.table[:, 1] > 0).all()
    got = C.reference_device_crcs(buf, p)
    want = C.device_expected(C.host_crcs(buf, lo, hi), lo, hi)
    np.testing.assert_array_equal(got, want)


def test_pieces_cover_each_segment_once():
    lo, hi = np.array([5, 70000]), np.array([70000 + 17, 70001])
    p = C.tiles(lo, hi)
    for seg in range(2):
        rows = p.table[p.table[:, 2] == seg]
        words = np.concatenate([np.arange(f, f + n) for f, n, _ in rows])
        np.testing.assert_array_equal(words, np.arange(lo[seg] // 16, -(-hi[seg] // 16)))


def test_device_expected_detects_a_flipped_bit():
    buf = np.arange(4096, dtype=np.uint8)
    lo, hi = np.array([7]), np.array([4000])
    good = C.host_crcs(buf, lo, hi)
    buf[100] ^= 4
    p = C.tiles(lo, hi)
    assert C.reference_device_crcs(buf, p)[0] != C.device_expected(good, lo, hi)[0]


def test_device_expected_for_segments_of_many_lengths_and_alignments():
    """A window of compressed chunks: every length and end alignment differs, as they do on disk."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 5000, 300)
    hi = np.cumsum(sizes + rng.integers(0, 40, 300))
    lo = hi - sizes
    buf = rng.integers(0, 256, int(hi[-1]) + 16, dtype=np.uint8)
    got = C.reference_device_crcs(buf, C.tiles(lo, hi))
    np.testing.assert_array_equal(got, C.device_expected(C.host_crcs(buf, lo, hi), lo, hi))


def test_shift_each_matches_shift_one_by_one():
    rng = np.random.default_rng(3)
    c = rng.integers(0, 1 << 32, 50, dtype=np.uint64).astype(np.uint32)
    n = np.concatenate([[0, 1, 15, 16, 1 << 20, (1 << 33) + 5], rng.integers(0, 1 << 24, 44)])
    np.testing.assert_array_equal(C.shift_each(c, n), [C.shift(x, int(k)) for x, k in zip(c, n)])
    assert C.shift_each(c[:0], n[:0]).shape == (0,)


def test_device_expected_costs_no_pass_per_distinct_length():
    """The decode step checks each window's chunks, each of its own length, before nvCOMP may start: a
    pass per length (the crc32c of that many zeros, masks over the window) held the decoder idle for longer
    than its decode. One pass per bit of the longest length keeps it to milliseconds for the lot."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(1 << 19, 1 << 20, 8000)
    hi = np.cumsum(sizes + 4)
    lo = hi - sizes
    std = rng.integers(0, 1 << 32, 8000, dtype=np.uint64).astype(np.uint32)
    C.device_expected(std[:2], lo[:2], hi[:2])  # the tables, built once per process
    t0 = time.perf_counter()
    C.device_expected(std, lo, hi)
    assert time.perf_counter() - t0 < 0.05  # a pass per length: about 0.3 s here; one per bit: a few ms
