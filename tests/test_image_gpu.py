"""Image fields decoded on the GPU (nvImageCodec) against the cpu backend (Pillow): the same crops, flips and
resize, so lossless PNGs agree to a level (float rounding of the resize), and JPEGs within the two JPEG
decoders' difference (nvJPEG's IDCT and upsampling against libjpeg-turbo's: a few levels)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from gdsload import GDSDataset, ImageSpec

from _helpers import write_images

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.gpu

#: Stated tolerance for JPEG: mean absolute difference per pixel value, and the 99th percentile, in levels.
JPEG_MEAN, JPEG_P99 = 1.5, 6


def _images(n: int, fmt: str) -> list[bytes]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        h, w = 375 - 16 * (i % 3), 500 - 24 * (i % 4)
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(base).resize((w, h), Image.BILINEAR).save(buf, format=fmt,
                                                                  **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buf.getvalue())
    return out


def _dataset(tmp_path, fmt: str, n: int = 24) -> str:
    return write_images(str(tmp_path / f"{fmt}.gds"), _images(n, fmt), fmt.lower(), samples_per_block=5)


def _read(path: str, backend: str, spec: ImageSpec) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    with GDSDataset(path, batch_size=8, backend=backend, shuffle=True, seed=3, images={"image": spec}) as ds:
        for _ in range(2):  # two epochs: other crops
            for b in ds:
                img = b["image"]
                images.append(img.get() if hasattr(img, "get") else np.asarray(img))
                lab = b["label"]
                labels.append(lab.get() if hasattr(lab, "get") else np.asarray(lab))
    return np.concatenate(images), np.concatenate(labels)


@pytest.fixture(autouse=True, params=["pillow", "nvimgcodec"])
def _codec(request, monkeypatch):
    """The default device path (Pillow, copied over) always; nvImageCodec's only where GDSLOAD_TEST_NVIMGCODEC=1
    asks for it: its decode crashed the process (SIGSEGV) on an H200 in the PNG test (docs/images.md)."""
    if request.param == "pillow":
        monkeypatch.delenv("GDSLOAD_NVIMGCODEC", raising=False)
    else:
        if os.environ.get("GDSLOAD_TEST_NVIMGCODEC") != "1":
            pytest.skip("nvImageCodec's decode is experimental: GDSLOAD_TEST_NVIMGCODEC=1 tests it")
        pytest.importorskip("nvidia.nvimgcodec")
        monkeypatch.setenv("GDSLOAD_NVIMGCODEC", "1")
    return request.param


@pytest.mark.parametrize("spec", [ImageSpec(224, crop=(0.08, 1.0), flip=True), ImageSpec((160, 96), flip=True),
                                  ImageSpec(64, crop=(0.5, 1.0), normalize=((0.485, 0.456, 0.406),
                                                                             (0.229, 0.224, 0.225)))])
def test_png_crops_flips_and_resize_match_the_cpu_path(tmp_path, spec):
    path = _dataset(tmp_path, "PNG")
    gpu, gpu_labels = _read(path, "pinned", spec)
    cpu, cpu_labels = _read(path, "cpu", spec)
    assert np.array_equal(gpu_labels, cpu_labels) and gpu.shape == cpu.shape and gpu.dtype == cpu.dtype
    if spec.normalize is None:
        assert np.abs(gpu.astype(np.int16) - cpu).max() <= 1
    else:
        assert np.abs(gpu - cpu).max() <= 1.01 / 255 / 0.224


def test_jpeg_pixels_match_pillow_within_the_decoders_tolerance(tmp_path):
    path = _dataset(tmp_path, "JPEG")
    spec = ImageSpec(224, crop=(0.08, 1.0), flip=True)
    gpu, _ = _read(path, "pinned", spec)
    cpu, _ = _read(path, "cpu", spec)
    diff = np.abs(gpu.astype(np.int16) - cpu)
    assert diff.mean() <= JPEG_MEAN and np.percentile(diff, 99) <= JPEG_P99, (diff.mean(), np.percentile(diff, 99))


def test_a_damaged_jpeg_names_the_sample_on_the_gpu(tmp_path):
    data = _images(4, "JPEG")
    data[2] = data[2][:200] + b"\x00" * (len(data[2]) - 202) + b"\xff\xd9"  # header kept, scan data zeroed
    path = write_images(str(tmp_path / "bad.gds"), data)
    from gdsload import ReadError

    with GDSDataset(path, batch_size=4, backend="pinned", images={"image": ImageSpec(32)}) as ds:
        try:
            list(ds)
        except ReadError as e:
            assert "field 'image', sample 2: the image does not decode" in str(e)
        else:  # a decoder may decode zeroed scan data as flat blocks without an error: then nothing to name
            pytest.skip("nvImageCodec decoded the zeroed scan without an error")
