"""The resize tables of a batch (``batch_taps``, vectorized over the batch) against a plain per-image
reference built from the one-image formula: bit for bit, same dtypes and shapes, for random sizes, boxes and
specs and for the edges (1-pixel axes, boxes touching the image's edges, downscales of many taps)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsload import ImageSpec
from gdsload.codecs.image_params import batch_taps, resize_taps, transform_params


def reference_taps(size: int, out: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """One axis of one image, the formula written out (antialiased bilinear, as Pillow's BILINEAR)."""
    scale = length / out
    support = max(scale, 1.0)
    centers = start + (np.arange(out, dtype=np.float64) + 0.5) * scale
    lo = np.clip(np.floor(centers - support + 0.5).astype(np.int64), 0, size - 1)
    hi = np.clip(np.floor(centers + support + 0.5).astype(np.int64), lo + 1, size)
    k = int((hi - lo).max())
    idx = lo[:, None] + np.arange(k)[None, :]
    valid = idx < hi[:, None]
    weight = np.where(valid, np.maximum(0.0, 1.0 - np.abs((idx + 0.5 - centers[:, None]) / support)), 0.0)
    weight = weight / np.maximum(weight.sum(axis=1, keepdims=True), 1e-12)
    return np.minimum(idx, size - 1).astype(np.int32), weight.astype(np.float32)


def reference_batch(spec: ImageSpec, seed: int, epoch: int, samples: np.ndarray, heights: np.ndarray,
                    widths: np.ndarray) -> dict[str, np.ndarray]:
    """batch_taps image by image: each image's taps, its region (the rows and columns of its weighed taps),
    its taps relative to the region, padded to the batch's largest tap count with index 0, weight 0."""
    boxes, flips = transform_params(spec, seed, epoch, samples, heights, widths)
    (oh, ow), out = spec.shape, {}
    rows = [reference_taps(int(heights[i]), oh, int(boxes[i, 0]), int(boxes[i, 2])) for i in range(len(samples))]
    cols = [reference_taps(int(widths[i]), ow, int(boxes[i, 1]), int(boxes[i, 3])) for i in range(len(samples))]
    regions = np.array([(r[wr > 0].min(), c[wc > 0].min(), r[wr > 0].max() + 1, c[wc > 0].max() + 1)
                        for (r, wr), (c, wc) in zip(rows, cols)], np.int64).reshape(-1, 4)
    for name, tables, axis in (("y", rows, 0), ("x", cols, 1)):
        k = max(idx.shape[1] for idx, _ in tables)
        idx = np.zeros((len(tables), tables[0][0].shape[0], k), np.int32)
        wgt = np.zeros(idx.shape, np.float32)
        for b, (i, w) in enumerate(tables):
            idx[b, :, :i.shape[1]] = np.where(w > 0, i - regions[b, axis], 0)
            wgt[b, :, :w.shape[1]] = w
        out["r" + name], out["w" + name] = idx, wgt
    return {"regions": regions, "flips": flips, **out}


def assert_identical(spec: ImageSpec, heights: np.ndarray, widths: np.ndarray, seed: int = 5, epoch: int = 1,
                     samples: np.ndarray | None = None) -> None:
    samples = np.arange(len(heights)) * 7919 if samples is None else samples
    heights, widths = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    got = batch_taps(spec, seed, epoch, samples, heights, widths)
    want = reference_batch(spec, seed, epoch, samples, heights, widths)
    for name, expected in want.items():
        value = getattr(got, name)
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        assert value.tobytes() == expected.tobytes(), name  # bit for bit
        assert value.flags.c_contiguous, name


specs = st.builds(
    lambda h, w, crop, ratio, flip: ImageSpec((h, w), crop=crop, ratio=ratio, flip=flip),
    st.integers(1, 300), st.integers(1, 300),
    st.one_of(st.none(), st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)).map(lambda c: tuple(sorted(c)))),
    st.sampled_from([(3 / 4, 4 / 3), (1.0, 1.0), (0.2, 5.0)]), st.booleans())


@settings(max_examples=150, deadline=None)
@given(specs, st.lists(st.tuples(st.integers(1, 900), st.integers(1, 900)), min_size=1, max_size=12),
       st.integers(0, 2**32 - 1), st.integers(0, 50))
def test_batch_taps_match_the_per_image_reference(spec, sizes, seed, epoch):
    heights, widths = zip(*sizes)
    assert_identical(spec, np.array(heights), np.array(widths), seed, epoch)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 400), st.data())
def test_resize_taps_match_the_reference(size, out, data):
    start = data.draw(st.integers(0, size - 1))
    length = data.draw(st.integers(1, size - start))
    for got, want in zip(resize_taps(size, out, start, length), reference_taps(size, out, start, length)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("spec", [ImageSpec(224, crop=(0.08, 1.0), flip=True), ImageSpec(224),
                                  ImageSpec((1, 1)), ImageSpec((1, 300), crop=(0.5, 1.0)),
                                  ImageSpec((37, 5), crop=(1.0, 1.0), flip=True)])
def test_edges(spec):
    # 1-pixel images and axes, one image, boxes touching both edges (no crop: the whole image)
    assert_identical(spec, np.array([1]), np.array([1]))
    assert_identical(spec, np.array([1, 1, 2, 3]), np.array([1, 500, 1, 2]))
    # a typical batch: ~500x375 photos
    i = np.arange(64)
    assert_identical(spec, 375 - 16 * (i % 3), 500 - 24 * (i % 4))
    # upscaling (support 1) next to a downscale of many taps (8 and more: numpy's pairwise summation)
    assert_identical(spec, np.array([2, 3000, 7, 1900, 40, 2500]), np.array([3, 2900, 5, 4000, 60, 17]))


def test_batches_of_mixed_tap_counts_sum_each_image_as_alone():
    # tap counts from 2 to over 128 in one batch (padded rows summed as their image's own rows)
    heights = np.array([10, 100, 450, 900, 2000, 5000, 20000, 3, 1200])
    assert_identical(ImageSpec(16), heights, heights[::-1].copy())
    assert_identical(ImageSpec(16, crop=(0.3, 1.0)), heights, heights[::-1].copy())
    assert_identical(ImageSpec((8, 5)), np.array([40, 57, 64, 71, 80, 95, 120]), np.array([9, 16, 24, 32, 40, 47, 3]))


def test_an_empty_batch_has_empty_tables():
    taps = batch_taps(ImageSpec((4, 6)), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert taps.regions.shape == (0, 4) and taps.ry.shape == (0, 4, 1) and taps.wx.shape == (0, 6, 1)


@pytest.mark.parametrize("k", range(1, 8))
def test_numpy_sums_fewer_than_8_terms_in_order(k):
    # what batch_taps relies on to sum padded rows by a running sum: numpy's sum of a row of k < 8 terms
    rows = np.random.default_rng(k).random((4000, k)) ** 3
    running = rows[:, 0].copy()
    for j in range(1, k):
        running += rows[:, j]
    assert running.tobytes() == rows.sum(axis=1).tobytes()
