"""Image fields decoded in the pipeline (cpu backend, Pillow): the transforms' parameters as pure functions of
(seed, epoch, sample), the resize against Pillow's, batches of one shape, resume, and decode-failure messages."""

from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest

from gdsload import GDSDataset, ImageSpec, ReadError, convert_images
from gdsload.codecs.image_host import decode_host
from gdsload.codecs.image_params import (batch_taps, crop_boxes, resize_hwc, resize_taps, transform_params,
                                        uniforms)

from _helpers import write_images

Image = pytest.importorskip("PIL.Image")


def encode(h: int, w: int, seed: int, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)  # smooth: JPEG keeps it well
    img = Image.fromarray(base).resize((w, h), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def pillow(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# -- pure parameters ---------------------------------------------------------------------------------
def test_draws_are_a_function_of_seed_epoch_and_sample_alone():
    u = uniforms(7, 3, np.array([5, 9, 2]))
    assert u.shape[0] == 3 and (u >= 0).all() and (u < 1).all()
    assert np.array_equal(uniforms(7, 3, np.array([2, 5]))[1], u[0])  # whatever batch it is in
    assert not np.array_equal(uniforms(7, 4, np.array([5]))[0], u[0])
    assert not np.array_equal(uniforms(8, 3, np.array([5]))[0], u[0])
    assert not np.array_equal(uniforms(7, 3, np.array([6]))[0], u[0])
    big = uniforms(0, 0, np.arange(20000))
    assert abs(big.mean() - 0.5) < 0.01 and abs((big < 0.25).mean() - 0.25) < 0.01


def _torchvision_box(H, W, u, scale, ratio):
    """torchvision's RandomResizedCrop.get_params, one image, with the same draws."""
    for t in range(10):
        target = H * W * (scale[0] + (scale[1] - scale[0]) * u[2 * t])
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[2 * t + 1])
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= W and 0 < h <= H:
            return int(u[-3] * (H - h + 1)), int(u[-2] * (W - w + 1)), h, w
    in_ratio = W / H
    if in_ratio < ratio[0]:
        w, h = W, int(round(W / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = H, int(round(H * ratio[1]))
    else:
        w, h = W, H
    h, w = min(max(h, 1), H), min(max(w, 1), W)  # gdsload's one departure: never an empty box
    return (H - h) // 2, (W - w) // 2, h, w


@pytest.mark.parametrize("scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (2.0, 3.0))])
def test_crop_boxes_are_torchvisions_given_the_same_draws(scale, ratio):
    rng = np.random.default_rng(0)
    H, W = rng.integers(1, 600, 500), rng.integers(1, 600, 500)
    H[:3], W[:3] = (1, 1000, 7), (1000, 1, 7)  # shapes where only the fallback fits
    u = uniforms(1, 2, np.arange(500))
    boxes = crop_boxes(H, W, u, scale, ratio)
    for i in range(500):
        assert tuple(boxes[i]) == _torchvision_box(int(H[i]), int(W[i]), u[i], scale, ratio), i
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= H).all() and (left + w <= W).all()


def test_without_crop_the_box_is_the_image_and_flips_are_about_half():
    spec = ImageSpec(8, flip=True)
    boxes, flips = transform_params(spec, 0, 0, np.arange(1000), np.full(1000, 30), np.full(1000, 40))
    assert (boxes == [0, 0, 30, 40]).all()
    assert 400 < flips.sum() < 600
    _, none = transform_params(ImageSpec(8), 0, 0, np.arange(10), np.full(10, 3), np.full(10, 3))
    assert not none.any()


def test_resize_taps_sum_to_one_and_the_same_size_is_the_identity():
    idx, w = resize_taps(500, 224, 13, 400)
    assert np.allclose(w.sum(axis=1), 1) and idx.min() >= 0 and idx.max() < 500
    img = np.random.default_rng(0).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    assert np.array_equal(np.rint(resize_hwc(img, (0, 0, 9, 11), (9, 11), False)), img)
    assert np.array_equal(np.rint(resize_hwc(img, (0, 0, 9, 11), (9, 11), True)), img[:, ::-1])


@pytest.mark.parametrize("box, out", [((0, 0, 375, 500), (224, 224)), ((40, 60, 200, 150), (224, 224)),
                                      ((0, 0, 375, 500), (600, 700))])
def test_resize_matches_pillows_bilinear(box, out):
    img = pillow(encode(375, 500, 3))
    top, left, h, w = box
    ref = np.asarray(Image.fromarray(img).resize((out[1], out[0]), Image.BILINEAR, box=(left, top, left + w, top + h)))
    got = np.rint(resize_hwc(img, box, out, False))
    # Pillow rounds to uint8 between its two passes (and computes in fixed point): a level or two apart
    assert np.abs(got - ref.astype(np.float64)).max() <= 2


def test_bad_specs_are_refused_naming_the_field():
    for spec, what in [(ImageSpec(0), "size"), (ImageSpec(8, crop=(0.5, 0.1)), "crop"),
                       (ImageSpec(8, normalize=((0, 0), (1, 1))), "normalize")]:
        with pytest.raises(ValueError, match=rf"images\['x'\].{what}"):
            spec.check("x")


# -- through the dataset -----------------------------------------------------------------------------
@pytest.fixture
def images_ds(tmp_path) -> tuple[str, list[bytes]]:
    data = []
    for i in range(12):
        data.append(encode(40 + (i % 3) * 8, 48 + (i % 4) * 4, i, "PNG" if i % 5 == 4 else "JPEG"))
        os.makedirs(tmp_path / "t" / f"c{i % 2}", exist_ok=True)
        (tmp_path / "t" / f"c{i % 2}" / f"{i:02d}.{'png' if i % 5 == 4 else 'jpg'}").write_bytes(data[-1])
    path = str(tmp_path / "o.gds")
    convert_images([str(tmp_path / "t")], path, progress=False, samples_per_block=4)
    return path, data


def _epoch(ds) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v) for k, v in b.items()} for b in ds]


def test_whole_images_at_their_own_size_come_out_as_pillow_decodes_them(tmp_path):
    data = [encode(24, 32, i) for i in range(6)]
    path = write_images(str(tmp_path / "o.gds"), data)
    with GDSDataset(path, batch_size=4, backend="cpu", images={"image": ImageSpec((24, 32))}) as ds:
        batches = _epoch(ds)
    assert [b["image"].shape for b in batches] == [(4, 24, 32, 3), (2, 24, 32, 3)]
    got = np.concatenate([b["image"] for b in batches])
    assert np.array_equal(got, np.stack([pillow(d) for d in data]))


def test_crops_and_flips_repeat_with_the_seed_change_with_the_epoch_and_survive_a_resume(images_ds):
    path, _ = images_ds
    spec = {"image": ImageSpec(16, crop=(0.08, 1.0), flip=True)}
    kw = dict(batch_size=3, backend="cpu", shuffle=True, seed=5, images=spec)
    with GDSDataset(path, **kw) as ds:
        first, second = _epoch(ds), _epoch(ds)
    with GDSDataset(path, **kw) as ds:
        assert all(np.array_equal(a["image"], b["image"]) for a, b in zip(first, _epoch(ds)))
        it = iter(ds)
        next(it)
        state = ds.state_dict()
    assert not all(np.array_equal(a["image"], b["image"]) for a, b in zip(first, second))
    with GDSDataset(path, **kw) as ds:
        ds.load_state_dict(state)
        rest = _epoch(ds)
    assert len(rest) == len(second) - 1
    for a, b in zip(rest, second[1:]):
        assert np.array_equal(a["label"], b["label"]) and np.array_equal(a["image"], b["image"])


def test_the_same_sample_gets_the_same_crop_whatever_the_batch(images_ds):
    path, data = images_ds
    spec = ImageSpec(12, crop=(0.2, 0.6), flip=True, normalize=((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)))
    out = {}
    for batch_size, shuffle in ((5, False), (2, True)):
        with GDSDataset(path, batch_size=batch_size, backend="cpu", shuffle=shuffle, fields=["image", "height"],
                        images={"image": spec}) as ds:
            rows = []
            for b in ds:
                rows += list(zip(b["height"].tolist(), b["image"]))
            out[batch_size] = rows
    assert out[5][0][1].shape == (3, 12, 12) and out[5][0][1].dtype == np.float32
    # unshuffled, the order is the samples' (sample i of the dataset is its i-th image in sorted order)
    assert sorted(np.round(x.sum(), 3) for _, x in out[5]) == sorted(np.round(x.sum(), 3) for _, x in out[2])


def test_a_damaged_image_names_the_dataset_field_and_sample(tmp_path):
    data = [encode(16, 16, i) for i in range(5)]
    data[3] = b"\xff\xd8\xff\xe0\x00\x10JFIF" + b"\x07" * 300 + b"\xff\xd9"
    path = write_images(str(tmp_path / "o.gds"), data)
    with GDSDataset(path, batch_size=2, backend="cpu", images={"image": ImageSpec(8)}) as ds:
        with pytest.raises(ReadError, match=r"o.gds: field 'image', sample 3: the image does not decode \(\w+"):
            _epoch(ds)


def test_images_must_name_an_image_field_read_and_unpadded(images_ds):
    path, _ = images_ds
    with pytest.raises(ValueError, match="'label', which is not an image field read here"):
        GDSDataset(path, batch_size=2, backend="cpu", images={"label": ImageSpec(8)})
    with pytest.raises(ValueError, match="not padded"):
        GDSDataset(path, batch_size=2, backend="cpu", pad_to="max", images={"image": ImageSpec(8)})
    with pytest.raises(TypeError, match="must be a gdsload.ImageSpec"):
        GDSDataset(path, batch_size=2, backend="cpu", images={"image": 224})


def _kernel(images: list[np.ndarray], taps, normalize) -> np.ndarray:
    """The GPU kernel's arithmetic (gdsload/codecs/image_cuda.py), in numpy: each output pixel the sum over
    its row and column taps of the weighted pixels of the decoded region, the column mirrored if flipped."""
    b, oh, _ = taps.ry.shape
    ow = taps.rx.shape[1]
    out = np.zeros((b, oh, ow, 3), np.float32)
    for i, img in enumerate(images):
        cols = np.arange(ow)[::-1] if taps.flips[i] else np.arange(ow)
        w = taps.wy[i][:, None, :, None] * taps.wx[i][cols][None, :, None, :]  # (oh, ow, ky, kx)
        px = img[taps.ry[i][:, None, :, None], taps.rx[i][cols][None, :, None, :]].astype(np.float32)
        out[i] = (w[..., None] * px).sum(axis=(2, 3))
    if normalize is None:
        return np.clip(np.rint(out), 0, 255).astype(np.uint8)
    mean, std = (np.asarray(v, np.float32) for v in normalize)
    return ((out / 255 - mean) / std).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("spec", [ImageSpec(24, crop=(0.08, 1.0), flip=True), ImageSpec((20, 36), flip=True),
                                  ImageSpec(16, crop=(0.3, 0.9), normalize=((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)))])
@pytest.mark.parametrize("by_region", [True, False])
def test_the_gpu_paths_tables_give_the_cpu_paths_batch(spec, by_region):
    """The device path's tables (regions, relative taps; whole images when a region is not decoded) run through
    the kernel's arithmetic give what the host path gives, from lossless images."""
    data = [encode(40 + 7 * i, 50 + 5 * i, i, "PNG") for i in range(6)]
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in data])])
    values = np.frombuffer(b"".join(data), np.uint8)
    samples = np.array([11, 3, 7, 0, 42, 5])
    shape, dtype = ((6, *spec.shape, 3), np.uint8) if spec.normalize is None else ((6, 3, *spec.shape), np.float32)
    host = np.empty(shape, dtype)
    decode_host("d.gds", "image", spec, values, offsets, 9, 2, samples, host)
    full = [pillow(d) for d in data]
    taps = batch_taps(spec, 9, 2, samples, np.array([f.shape[0] for f in full]), np.array([f.shape[1] for f in full]))
    images = []
    for i, img in enumerate(full):
        y0, x0, y1, x1 = taps.regions[i]
        if by_region:
            images.append(img[y0:y1, x0:x1])
        else:
            taps.whole(i)
            images.append(img)
    got = _kernel(images, taps, spec.normalize)
    if spec.normalize is None:
        assert np.abs(got.astype(np.int16) - host).max() <= 1
    else:
        assert np.abs(got - host).max() < 1e-4
