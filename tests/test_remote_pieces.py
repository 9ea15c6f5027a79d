"""The pieces of a remote dataset's shard files (gdsload/remote/pieces.py): pure, no server."""

from __future__ import annotations

import numpy as np

from gdsload.remote.mirror import Entry
from gdsload.remote.pieces import MIN_PIECE_BYTES, chunk_starts, covering, cut, pieces_of
from gdsload.remote.objects import ObjectInfo

K = MIN_PIECE_BYTES


def _entry(size: int, keep_lo: int, keep_hi: int) -> Entry:
    return Entry(ObjectInfo("http://h/d.gds/x/c/0/0", size, '"e"'), "x/c/0/0", "/c/x/c/0/0", keep_lo, keep_hi)


def test_a_shard_is_cut_at_its_chunks_and_its_index_is_no_piece():
    e = _entry(4 * K + 100, 4 * K, 4 * K + 100)  # 4 chunks of K, then the index
    pieces = pieces_of(e, cut(e, [0, K, 2 * K, 3 * K]))
    assert [(p.lo, p.hi) for p in pieces] == [(0, K), (K, 2 * K), (2 * K, 3 * K), (3 * K, 4 * K)]
    whole = pieces_of(e, cut(e, None))
    assert [(p.lo, p.hi) for p in whole] == [(0, 4 * K)], "not cut: one piece, all its data"
    front = _entry(100 + 2 * K, 0, 100)  # the index first
    assert [(p.lo, p.hi) for p in pieces_of(front, cut(front, [100, 100 + K]))] == [(100, 100 + K),
                                                                                     (100 + K, 100 + 2 * K)]


def test_small_chunks_are_joined_into_pieces_of_at_least_the_least_size_and_none_overlap():
    c = K // 4
    e = _entry(10 * c + 50, 10 * c, 10 * c + 50)
    pieces = pieces_of(e, cut(e, [i * c for i in range(10)]))
    assert [(p.lo, p.hi) for p in pieces] == [(0, 4 * c), (4 * c, 10 * c)], "the rest joined to the last"
    assert all(p.nbytes >= K for p in pieces)
    assert all(a.hi == b.lo for a, b in zip(pieces, pieces[1:]))


def test_covering_names_every_piece_a_range_touches():
    e = _entry(4 * K + 100, 4 * K, 4 * K + 100)
    pieces = pieces_of(e, cut(e, [0, K, 2 * K, 3 * K]))
    assert [p.lo for p in covering(pieces, K, K)] == [K]
    assert [p.lo for p in covering(pieces, K - 1, 2)] == [0, K]
    assert [p.lo for p in covering(pieces, 10, 3 * K)] == [0, K, 2 * K, 3 * K]
    assert covering(pieces, K, 0) == []


def test_chunk_starts_per_file_from_a_layouts_tables():
    offsets = {"x": np.array([0, 8, 16, 0, -1, 8], dtype=np.int64)}
    files = {"x": np.array([0, 0, 0, 1, 1, 1], dtype=np.int32)}
    got = chunk_starts(offsets, files, {"x": ["a", "b"]})
    assert {k: v.tolist() for k, v in got.items()} == {"a": [0, 8, 16], "b": [0, 8]}
