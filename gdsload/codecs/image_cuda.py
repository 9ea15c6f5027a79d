"""Image fields decoded on the device by nvImageCodec, then cropped, resized, flipped and laid out by one kernel.

One batched decode per batch on the assembler's stream; the batch's encoded bytes are copied to the host first
(nvImageCodec's Python API takes host buffers), and only the region the resize taps read is decoded where the
decoder can. Crops, flips and taps are :mod:`gdsload.codecs.image_params`'s, as on the host path. The decoded
images are kept until an event after the kernel has passed. Without nvImageCodec the batch is decoded on the
host (Pillow) and copied, with one warning (docs/images.md, "Decoding").
"""

from __future__ import annotations

import os

from typing import Any

import numpy as np

from ..errors import warn
from ..format.image_header import ImageHeaderError, probe
from .image_params import BatchTaps, ImageSpec, batch_taps
from .image_host import decode_error, decode_host, output_shape

_KERNEL = r"""
extern "C" __global__ void resize_images(
    const unsigned long long* srcs, const long long* pitches, const int* ry, const float* wy, int ky,
    const int* rx, const float* wx, int kx, const unsigned char* flips, int B, int OH, int OW,
    const float* mean, const float* inv_std, int to_float, void* out) {
  long long n = (long long)B * OH * OW;
  for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
       t += (long long)gridDim.x * blockDim.x) {
    int x = (int)(t % OW);
    int y = (int)((t / OW) % OH);
    int b = (int)(t / ((long long)OW * OH));
    int xs = flips[b] ? OW - 1 - x : x;
    const unsigned char* src = (const unsigned char*)srcs[b];
    long long pitch = pitches[b];
    float a0 = 0.f, a1 = 0.f, a2 = 0.f;
    for (int i = 0; i < ky; i++) {
      float w1 = wy[((long long)b * OH + y) * ky + i];
      if (w1 == 0.f) continue;
      const unsigned char* row = src + (long long)ry[((long long)b * OH + y) * ky + i] * pitch;
      for (int j = 0; j < kx; j++) {
        float w = w1 * wx[((long long)b * OW + xs) * kx + j];
        if (w == 0.f) continue;
        const unsigned char* p = row + 3LL * rx[((long long)b * OW + xs) * kx + j];
        a0 += w * p[0]; a1 += w * p[1]; a2 += w * p[2];
      }
    }
    if (to_float) {
      long long plane = (long long)OH * OW;
      float* o = (float*)out + (long long)b * 3 * plane + (long long)y * OW + x;
      o[0] = (a0 / 255.f - mean[0]) * inv_std[0];
      o[plane] = (a1 / 255.f - mean[1]) * inv_std[1];
      o[2 * plane] = (a2 / 255.f - mean[2]) * inv_std[2];
    } else {
      unsigned char* o = (unsigned char*)out + t * 3;
      o[0] = (unsigned char)fminf(fmaxf(rintf(a0), 0.f), 255.f);
      o[1] = (unsigned char)fminf(fmaxf(rintf(a1), 0.f), 255.f);
      o[2] = (unsigned char)fminf(fmaxf(rintf(a2), 0.f), 255.f);
    }
  }
}
"""


#: ``1`` turns on nvImageCodec's decode (experimental: docs/images.md); else Pillow on the CPU, copied over.
NVIMGCODEC_ENV = "GDSLOAD_NVIMGCODEC"


class DeviceImageDecoder:
    """nvImageCodec's batched decode and the resize kernel, for one dataset (``path`` names it in errors)."""

    def __init__(self, path: str):
        import cupy

        self.path, self.cupy = path, cupy
        self.kernel = cupy.RawKernel(_KERNEL, "resize_images")
        self._held: list[tuple[Any, Any]] = []  # (event, what the kernel reads) until the event has passed
        if os.environ.get(NVIMGCODEC_ENV) != "1":
            self.codec = None
            warn(f"{path}: image fields are decoded with Pillow on the CPU and copied to the device: the nvImageCodec "
                 f"path is experimental (docs/images.md; {NVIMGCODEC_ENV}=1 turns it on)", UserWarning)
            return
        try:
            from nvidia import nvimgcodec
        except ImportError as e:
            self.codec = None
            warn(f"{path}: nvImageCodec is not installed ({e}): image fields are decoded with Pillow on the CPU and "
                 f"copied to the device (pip install nvidia-nvimgcodec-cu13, or gdsload[gpu])", UserWarning)
            return
        self.codec = nvimgcodec
        # Its own stream: nvImageCodec frees a decoded image on the stream it was decoded on, so that stream must
        # outlive the images (close() releases them first); a batch's kernel waits for it by an event.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.decoder = nvimgcodec.Decoder(device_id=cupy.cuda.Device().id, options=":fancy_upsampling=1")
        # EXIF orientation is not applied: Pillow's decode on the cpu backend does not apply it either.
        rgb = getattr(nvimgcodec.ColorSpec, "SRGB", None) or nvimgcodec.ColorSpec.RGB  # RGB before 0.6
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=rgb)

    def decode(self, name: str, spec: ImageSpec, values: Any, offsets: Any, seed: int, epoch: int,
               samples: np.ndarray, out: Any) -> None:
        """Decode and transform a batch's images into ``out`` (device memory) on the current stream."""
        cupy = self.cupy
        self._held = [(e, kept) for e, kept in self._held if not e.done]
        host, off = values.get(), offsets.get()  # waits for the gathers on this stream
        blobs = [host[int(off[i]):int(off[i + 1])] for i in range(len(samples))]
        if self.codec is None:
            staged = np.empty(*output_shape(spec, len(samples)))
            decode_host(self.path, name, spec, host, off, seed, epoch, samples, staged)
            out.set(staged)
            return
        sizes = np.zeros((len(blobs), 2), np.int64)
        for i, blob in enumerate(blobs):
            try:
                info = probe(lambda o, n, blob=blob: blob[o:o + n].tobytes(), len(blob))
            except ImageHeaderError as e:
                raise decode_error(self.path, name, int(samples[i]), str(e)) from e
            sizes[i] = info.height, info.width
        taps = batch_taps(spec, seed, epoch, samples, sizes[:, 0], sizes[:, 1])
        images = self._decode(name, samples, blobs, sizes, taps)
        decoded = cupy.cuda.Event(block=True, disable_timing=True)
        decoded.record(self.stream)
        cupy.cuda.get_current_stream().wait_event(decoded)
        (oh, ow), ky, kx = spec.shape, taps.ry.shape[2], taps.rx.shape[2]
        ptrs = np.array([img.__cuda_array_interface__["data"][0] for img in images], np.uint64)
        pitches = np.array([_pitch(img) for img in images], np.int64)
        mean, std = spec.normalize if spec.normalize is not None else ((0, 0, 0), (1, 1, 1))
        dev = [cupy.asarray(a) for a in (ptrs, pitches, taps.ry, taps.wy, taps.rx, taps.wx,
                                          taps.flips.astype(np.uint8), np.asarray(mean, np.float32),
                                          1 / np.asarray(std, np.float32))]
        n = len(blobs) * oh * ow
        self.kernel((min(4096, -(-n // 256)),), (256,),
                    (dev[0], dev[1], dev[2], dev[3], np.int32(ky), dev[4], dev[5], np.int32(kx), dev[6],
                     np.int32(len(blobs)), np.int32(oh), np.int32(ow), dev[7], dev[8],
                     np.int32(spec.normalize is not None), out))
        event = cupy.cuda.Event(block=True, disable_timing=True)
        event.record()
        self._held.append((event, (images, dev)))

    def close(self) -> None:
        """Wait for the device work on what it holds, then free it: decoded images before their stream.
        Idempotent; call once no batch is being decoded."""
        for event, _ in self._held:
            event.synchronize()
        self._held = []
        if self.codec is not None:
            self.stream.synchronize()
            self.codec = self.decoder = None

    def _decode(self, name: str, samples: np.ndarray, blobs: list[np.ndarray], sizes: np.ndarray,
                taps: BatchTaps) -> list[Any]:
        """Each image decoded on the current stream: by region (the rows and columns its taps read), else
        whole (its taps then made relative to the whole image); a ReadError naming the sample else."""
        nv, stream = self.codec, self.stream.ptr
        regions = [tuple(int(v) for v in reg) for reg in taps.regions]
        sources = [self._source(b, nv.Region(*reg)) for b, reg in zip(blobs, regions)]
        got = self.decoder.decode(sources, params=self.params, cuda_stream=stream)
        out: list[Any] = []
        for i, img in enumerate(got):
            (y0, x0, y1, x1), whole = regions[i], (int(sizes[i, 0]), int(sizes[i, 1]), 3)
            if img is not None and tuple(img.shape) == (y1 - y0, x1 - x0, 3):
                out.append(img)
                continue
            if img is None or tuple(img.shape) != whole:
                img = self.decoder.decode(self._source(blobs[i]), params=self.params, cuda_stream=stream)
            if img is None or tuple(img.shape) != whole:
                shape = None if img is None else tuple(img.shape)
                why = "nvImageCodec returned nothing" if img is None else f"decoded shape {shape}, expected {whole}"
                raise decode_error(self.path, name, int(samples[i]), why)
            taps.whole(i)
            out.append(img)
        return out

    def _source(self, blob: np.ndarray, region: Any = None) -> Any:
        """What the decoder takes: a CodeStream (cut to ``region``), or before nvImageCodec 0.6 a DecodeSource."""
        nv, data = self.codec, blob.tobytes()  # a copy nvImageCodec owns: a stream over a numpy view crashed it
        if hasattr(nv, "DecodeSource"):
            return nv.DecodeSource(data, region)
        stream = nv.CodeStream(data)
        return stream if region is None else stream.get_sub_code_stream(region=region)


def _pitch(img: Any) -> int:
    """Bytes from one row of a decoded HWC image to the next."""
    strides = img.__cuda_array_interface__.get("strides")
    return int(strides[0]) if strides else int(img.shape[1]) * int(img.shape[2])
