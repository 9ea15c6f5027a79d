"""Image fields decoded into one batch tensor: the batch step the assembler runs before it hands a batch on.

:class:`ImageStep` replaces an image field's encoded bytes and offsets with the decoded, transformed batch of one
shape (:class:`~gdsload.codecs.image_params.ImageSpec`: uint8 ``(B, H, W, 3)`` or float32 ``(B, 3, H, W)``), on
the assembler's thread inside the batch's scope, so the batch's ready event comes after it: Pillow on ``cpu``,
nvImageCodec on a GPU backend (:mod:`gdsload.codecs.image_cuda`). An image that does not decode is a ReadError
naming the dataset, the field, the global sample index and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .image_host import decode_host, output_shape
from .image_params import ImageSpec


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

    def close(self) -> None:
        """Free the GPU decoder's memory (call once no batch is being decoded; idempotent)."""
        if self._device is not None:
            self._device.close()
