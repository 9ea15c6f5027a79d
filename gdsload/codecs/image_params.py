"""The transforms of decoded images, as pure numpy: what to crop, whether to flip, and the resize's taps.

Every random choice is a function of ``(seed, epoch, global sample index)`` alone (:func:`uniforms`), never of
a generator's state. The CPU and GPU paths share :func:`crop_boxes` (torchvision's ``RandomResizedCrop`` rule)
and :func:`resize_taps` (antialiased bilinear as Pillow's ``BILINEAR``; output pixel ``i`` samples around
``start + (i + 0.5) * length / out``), so they differ only by their decoders (docs/images.md, "Decoding").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Tries of torchvision's random-resized-crop before its fallback.
CROP_TRIES = 10
#: Draws per sample: two per try (area, log ratio), two for the place, one for the flip.
DRAWS = 2 * CROP_TRIES + 3
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class ImageSpec:
    """How an image field comes out of the pipeline: every image decoded to RGB, then

    - ``size``: output height and width (an int: square). Without ``crop`` the whole image is resized to it
      (the aspect ratio is not kept); with ``crop=(lo, hi)``, a random-resized-crop of area fraction in
      ``[lo, hi]`` and aspect ratio in ``ratio`` is resized to it.
    - ``flip``: a horizontal flip with probability 0.5.
    - ``normalize=(mean, std)``: per channel, in units of 0..1 (``(0.485, 0.456, 0.406), (0.229, 0.224, 0.225)``
      for ImageNet): the batch is float32 ``(B, 3, H, W)`` of ``(x / 255 - mean) / std``. Without it, uint8
      ``(B, H, W, 3)``.
    """

    size: int | tuple[int, int]
    crop: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    normalize: tuple[Sequence[float], Sequence[float]] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """Output (height, width)."""
        return (self.size, self.size) if isinstance(self.size, int) else (int(self.size[0]), int(self.size[1]))

    def check(self, name: str) -> ImageSpec:
        """The spec, checked: a ValueError naming the field and the value otherwise."""
        h, w = self.shape
        if not (0 < h <= 65535 and 0 < w <= 65535):
            raise ValueError(f"images[{name!r}].size must be 1 to 65535 (found {self.size!r})")
        if self.crop is not None and not (0 < self.crop[0] <= self.crop[1] <= 1):
            raise ValueError(f"images[{name!r}].crop must be (lo, hi) with 0 < lo <= hi <= 1 (found {self.crop!r})")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"images[{name!r}].ratio must be (lo, hi) with 0 < lo <= hi (found {self.ratio!r})")
        if self.normalize is not None:
            mean, std = self.normalize
            if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
                raise ValueError(f"images[{name!r}].normalize must be (mean, std) of 3 values each, std > 0 "
                                 f"(found {self.normalize!r})")
        return self


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, samples: np.ndarray, draws: int = DRAWS) -> np.ndarray:
    """``(len(samples), draws)`` floats in [0, 1): a pure function of (seed, epoch, sample, draw)."""
    with np.errstate(over="ignore"):
        key = _mix(_mix(np.array([seed], np.uint64) & _M64) ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
        per = _mix(key ^ np.asarray(samples, dtype=np.int64).astype(np.uint64))[:, None]
        x = _mix(per ^ np.arange(1, draws + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def crop_boxes(heights: np.ndarray, widths: np.ndarray, u: np.ndarray, scale: tuple[float, float],
               ratio: tuple[float, float]) -> np.ndarray:
    """``(B, 4)`` int64 boxes ``(top, left, height, width)`` of a random-resized-crop of each image, from its
    draws ``u`` (:func:`uniforms`)."""
    H, W = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    area = (H * W).astype(np.float64)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    boxes = np.zeros((len(H), 4), np.int64)
    done = np.zeros(len(H), bool)
    for t in range(CROP_TRIES):
        target = area * (scale[0] + (scale[1] - scale[0]) * u[:, 2 * t])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 2 * t + 1])
        w = np.round(np.sqrt(target * aspect)).astype(np.int64)
        h = np.round(np.sqrt(target / aspect)).astype(np.int64)
        ok = ~done & (w > 0) & (h > 0) & (w <= W) & (h <= H)
        top = np.floor(u[:, -3] * (H - h + 1)).astype(np.int64)
        left = np.floor(u[:, -2] * (W - w + 1)).astype(np.int64)
        boxes[ok] = np.stack([top, left, h, w], axis=1)[ok]
        done |= ok
    # torchvision's fallback: the centre crop, its aspect ratio clamped to ``ratio``
    in_ratio = W / np.maximum(H, 1)
    w = np.where(in_ratio < ratio[0], W, np.where(in_ratio > ratio[1], np.round(H * ratio[1]), W)).astype(np.int64)
    h = np.where(in_ratio < ratio[0], np.round(W / ratio[0]), H).astype(np.int64)
    h = np.minimum(np.maximum(h, 1), H)
    w = np.minimum(np.maximum(w, 1), W)
    fallback = np.stack([(H - h) // 2, (W - w) // 2, h, w], axis=1)
    boxes[~done] = fallback[~done]
    return boxes


def transform_params(spec: ImageSpec, seed: int, epoch: int, samples: np.ndarray, heights: np.ndarray,
                     widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each image's box ``(top, left, height, width)`` (the whole image without ``spec.crop``) and whether it
    is flipped, for global sample indices ``samples`` of ``epoch``."""
    H, W = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    u = uniforms(seed, epoch, samples)
    if spec.crop is None:
        boxes = np.stack([np.zeros_like(H), np.zeros_like(W), H, W], axis=1)
    else:
        boxes = crop_boxes(H, W, u, spec.crop, spec.ratio)
    flips = (u[:, -1] < 0.5) if spec.flip else np.zeros(len(H), bool)
    return boxes, flips


def resize_taps(size: int, out: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Antialiased bilinear taps of one axis: ``(out, K)`` int32 input indices and float32 weights (rows
    summing to 1; unused taps weigh 0 and point at a valid index) resizing ``[start, start + length)`` of an
    axis of ``size`` pixels to ``out`` pixels."""
    first, weight, _ = _axis_taps(np.array([size]), out, np.array([start]), np.array([length]))
    idx = np.minimum(first[0][:, None] + np.arange(weight.shape[2]), size - 1)
    return idx.astype(np.int32), weight[0]


def _axis_taps(sizes: np.ndarray, out: int, starts: np.ndarray,
               lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`resize_taps` of ``B`` images at once: each output pixel's first index ``(B, out)`` int64 (tap
    ``j`` reads ``first + j``), the weights ``(B, out, K)`` float32, K the batch's largest tap count, and
    whether each weighs (> 0), tap-major ``(K, B, out)``. Image ``b``'s weights are bit for bit
    ``resize_taps(sizes[b], out, starts[b], lengths[b])``'s, then 0 up to K. Pixel indices are computed as
    whole float64s (exact): the same values as in int64."""
    size, start, length = (np.asarray(a, np.int64).reshape(-1, 1) for a in (sizes, starts, lengths))
    scale = length / out
    support = np.maximum(scale, 1.0)
    centers = (np.arange(out, dtype=np.float64) + 0.5) * scale
    centers += start.astype(np.float64)
    lo = np.floor(centers - support + 0.5)
    np.maximum(lo, 0.0, out=lo)
    np.minimum(lo, size - 1.0, out=lo)
    count = np.floor(centers + support + 0.5)
    np.maximum(count, lo + 1.0, out=count)
    np.minimum(count, size.astype(np.float64), out=count)
    count -= lo
    k = count.max(axis=1)
    weight = np.empty((int(k.max(initial=1)), *lo.shape))
    at, short = lo + 0.5, count.min(initial=1.0)  # tap j's index plus 0.5, exact
    for j, plane in enumerate(weight):  # one pass per tap: the batch's pixels are the long axis
        np.subtract(at, centers, out=plane)
        at += 1.0
        np.divide(plane, support, out=plane)
        np.clip(plane, -1.0, 1.0, out=plane)  # then 1 - |d|: max(0, 1 - |d|), exactly
        np.abs(plane, out=plane)
        np.subtract(1.0, plane, out=plane)
        if j >= short:
            plane *= j < count  # past the row's own taps: 0
    sums = _tap_sums(weight, k.astype(np.int64))
    np.maximum(sums, 1e-12, out=sums)  # the nearest pixel always weighs > 0
    taps = np.empty((*lo.shape, len(weight)), np.float32)
    for j, plane in enumerate(weight):  # in float64, then rounded, as resize_taps always did
        np.divide(plane, sums, out=taps[:, :, j], casting="same_kind")
    # ``weight > 0`` is where ``taps > 0``: a positive weight is at least 2**-53 / K, far above float32's least
    return lo.astype(np.int64), taps, weight > 0


def _tap_sums(weight: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``(B, out)`` sums of each output pixel's taps ``weight`` ``(K, B, out)``, each as numpy sums the
    ``(out, k[b])`` array of image ``b`` alone: fewer than 8 terms in order, so a running sum is the same;
    past that its pairwise summation depends on the row's length, so images go group by group of one tap
    count, unpadded."""
    if len(weight) < 8:
        sums = weight[0].copy()
        for plane in weight[1:]:
            sums += plane
        return sums
    sums = np.empty(weight.shape[1:])
    for n in np.unique(k):
        sel = np.flatnonzero(k == n)
        sums[sel] = weight[:n, sel].transpose(1, 2, 0).copy().sum(axis=2)
    return sums


def resize_hwc(image: np.ndarray, box: Sequence[int], shape: tuple[int, int], flip: bool) -> np.ndarray:
    """``image`` (H, W, C) uint8: the box ``(top, left, height, width)`` resized to ``shape`` (float32, HWC),
    flipped left-right if ``flip``; rows first, then columns, with :func:`resize_taps`."""
    top, left, h, w = (int(v) for v in box)
    ry, wy = resize_taps(image.shape[0], shape[0], top, h)
    rx, wx = resize_taps(image.shape[1], shape[1], left, w)
    rows = np.einsum("ok,okwc->owc", wy, image[ry].astype(np.float32))
    out = np.einsum("pk,opkc->opc", wx, rows[:, rx])
    return out[:, ::-1] if flip else out


@dataclass(frozen=True)
class BatchTaps:
    """A batch's resize as tables (the GPU kernel's input): per image its decode region ``(y0, x0, y1, x1)``,
    the rows and columns its taps read; the taps ``(B, out, K)`` as indices relative to that region (unused
    taps: index 0, weight 0); and whether it is flipped."""

    regions: np.ndarray
    ry: np.ndarray
    wy: np.ndarray
    rx: np.ndarray
    wx: np.ndarray
    flips: np.ndarray

    def whole(self, i: int) -> None:
        """Image ``i`` was decoded whole, not by region: its taps become relative to the image's origin."""
        y0, x0 = int(self.regions[i, 0]), int(self.regions[i, 1])
        used_y, used_x = self.wy[i] != 0, self.wx[i] != 0
        self.ry[i][used_y] += y0
        self.rx[i][used_x] += x0
        self.regions[i, :2] = 0


def batch_taps(spec: ImageSpec, seed: int, epoch: int, samples: np.ndarray, heights: np.ndarray,
               widths: np.ndarray) -> BatchTaps:
    """The tables of :class:`BatchTaps` for images of these sizes: the same boxes, flips and taps as
    :func:`resize_hwc` on the host (per image, :func:`resize_taps`'s taps, padded to the batch's largest tap
    count), the region being the rows and columns the taps read."""
    boxes, flips = transform_params(spec, seed, epoch, samples, heights, widths)
    (oh, ow) = spec.shape
    top, wy, used_y = _axis_taps(heights, oh, boxes[:, 0], boxes[:, 2])
    left, wx, used_x = _axis_taps(widths, ow, boxes[:, 1], boxes[:, 3])
    (y0, y1, ry), (x0, x1, rx) = _relative(top, used_y), _relative(left, used_x)
    return BatchTaps(np.stack([y0, x0, y1, x1], axis=1), ry, wy, rx, wx, flips)


def _relative(first: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From :func:`_axis_taps`'s first indices and weighed taps: per image the first and one past the last
    index its weighed taps read, and its ``(B, out, K)`` int32 indices relative to the first (taps of weight
    0: index 0)."""
    # A row's weighed taps are consecutive (the tent is positive on an interval, cut where the row's taps end):
    # they start after its leading unweighed taps and number ``used.sum``.
    lead, before = np.zeros(first.shape, np.int64), np.ones(first.shape, bool)
    for plane in used:
        np.greater(before, plane, out=before)  # no weighed tap yet
        if not before.any():
            break
        lead += before
    lowest = first + lead
    lo = lowest.min(axis=1)
    lowest += used.sum(axis=0, dtype=np.min_scalar_type(-len(used)))
    start = (first - lo[:, None]).astype(np.int32)
    rel = np.empty((*first.shape, len(used)), np.int32)
    for j, plane in enumerate(used):
        rel[:, :, j] = np.multiply(start, plane)
        start += 1
    return lo, lowest.max(axis=1), rel
