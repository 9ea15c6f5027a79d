"""Image fields decoded into one batch tensor: the batch step the assembler runs before it hands a batch on.

A batch arrives from the gathers with each image field as its encoded bytes back to back plus offsets (a
variable-length field). :class:`ImageStep` replaces them with the decoded, transformed batch of one shape
(:class:`~gdsload.codecs.image_params.ImageSpec`): uint8 ``(B, H, W, 3)``, or float32 ``(B, 3, H, W)``
normalised. It runs on the assembler's thread inside the batch's scope (for a GPU backend, the assembler's
stream is current), so the batch's ready event comes after it.

Decoders: on the ``cpu`` backend Pillow, one image after another; on a GPU backend nvImageCodec
(:mod:`gdsload.codecs.image_cuda`), batched on the device. Crops, flips and the resize are the same on
both (:mod:`gdsload.codecs.image_params`). An image that does not decode is a ReadError naming the dataset,
the field, the global sample index and why.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

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


class ImageStep:
    """Decodes the image fields of each batch (see the module's doc). ``specs``: field -> ImageSpec."""

    def __init__(self, path: str, specs: Mapping[str, ImageSpec], seed: int):
        self.path, self.specs, self.seed = path, {n: s.check(n) for n, s in specs.items()}, seed
        self._device: Any = None  # the GPU decoder, made at the first device batch

    def __call__(self, ops: Any, epoch: int, samples: np.ndarray, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with each image field's bytes and offsets replaced by its decoded batch, allocated with
        ``ops.empty`` (fenced) and written on the assembler's stream; ``samples``: global sample indices."""
        for name, spec in self.specs.items():
            values, offsets = batch.pop(name), batch.pop(f"{name}/offsets")
            shape, dtype = output_shape(spec, len(samples))
            out = ops.empty(shape, dtype)
            ops.fence()
            if ops.xp is np:
                decode_host(self.path, name, spec, values, np.asarray(offsets), self.seed, epoch, samples, out)
            else:
                if self._device is None:
                    from .image_cuda import DeviceImageDecoder

                    self._device = DeviceImageDecoder(self.path)
                self._device.decode(name, spec, values, offsets, self.seed, epoch, samples, out)
            batch[name] = out
        return batch
