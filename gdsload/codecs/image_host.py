"""Image fields decoded on the host with Pillow (the ``cpu`` backend's path, and the GPU path's fallback
without nvImageCodec): each image decoded to RGB, then cropped, resized, flipped and laid out as the batch
tensor (:mod:`gdsload.codecs.image_params`)."""

from __future__ import annotations

import io

import numpy as np

from ..errors import ReadError
from .image_params import ImageSpec, resize_hwc, transform_params


def decode_error(path: str, name: str, sample: int, why: str) -> ReadError:
    return ReadError(f"{path}: field '{name}', sample {sample}: the image does not decode ({why})")


def pillow_decode(data: bytes) -> np.ndarray:
    """One encoded image as RGB uint8 ``(H, W, 3)``; any failure of Pillow passes (the caller names it)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def finish(pixels: np.ndarray, spec: ImageSpec, out: np.ndarray) -> None:
    """Resized float pixels ``(H, W, 3)`` into ``out``'s layout: uint8 HWC (rounded, clamped) or float32 CHW
    normalised."""
    if spec.normalize is None:
        np.copyto(out, np.clip(np.rint(pixels), 0, 255), casting="unsafe")
        return
    mean, std = (np.asarray(v, np.float32) for v in spec.normalize)
    np.copyto(out, ((pixels / np.float32(255) - mean) / std).transpose(2, 0, 1), casting="unsafe")


def output_shape(spec: ImageSpec, batch: int) -> tuple[tuple[int, ...], np.dtype]:
    h, w = spec.shape
    if spec.normalize is None:
        return (batch, h, w, 3), np.dtype(np.uint8)
    return (batch, 3, h, w), np.dtype(np.float32)


def decode_host(path: str, name: str, spec: ImageSpec, values: np.ndarray, offsets: np.ndarray, seed: int,
                epoch: int, samples: np.ndarray, out: np.ndarray) -> None:
    """Decode a batch's images with Pillow and transform them into ``out`` (host memory)."""
    images = []
    for i, sample in enumerate(samples.tolist()):
        try:
            images.append(pillow_decode(values[int(offsets[i]):int(offsets[i + 1])].tobytes()))
        except Exception as e:  # Pillow raises several types for a damaged file
            raise decode_error(path, name, sample, f"{type(e).__name__}: {e}") from e
    heights = np.array([im.shape[0] for im in images], np.int64)
    widths = np.array([im.shape[1] for im in images], np.int64)
    boxes, flips = transform_params(spec, seed, epoch, samples, heights, widths)
    for i, im in enumerate(images):
        finish(resize_hwc(im, boxes[i], spec.shape, bool(flips[i])), spec, out[i])
