"""Converting encoded images (``gdsload shard --images``): ImageFolder trees, list files and WebDataset tars,
their bytes stored unchanged with label, height and width from the header; damaged images listed and skipped,
or refused with ``--strict``."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile

import numpy as np
import pytest
import zarr

from gdsload import ConversionError, GDSDataset
from gdsload.conversion.images import convert_images
from gdsload.errors import FormatError
from gdsload.format.image_header import ImageHeaderError, probe_bytes
from gdsload.tools.cli import shard_main

Image = pytest.importorskip("PIL.Image")


def encode(h: int, w: int, fmt: str = "JPEG", seed: int = 0, **kw) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt, **kw)
    return buf.getvalue()


def put(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def samples(path: str) -> list[bytes]:
    g = zarr.open_group(path, mode="r")
    values, offsets = g["image/values"][:], g["image/offsets"][:]
    return [values[offsets[i]:offsets[i + 1]].tobytes() for i in range(len(offsets) - 1)]


def test_header_gives_format_and_size_without_decoding():
    info = probe_bytes(encode(37, 53, progressive=True, exif=b"Exif\x00\x00" + b"\x00" * 5000))
    assert (info.format, info.height, info.width) == ("jpeg", 37, 53)
    info = probe_bytes(encode(9, 11, "PNG"))
    assert (info.format, info.height, info.width) == ("png", 9, 11)


@pytest.mark.parametrize("data, why", [
    (b"hello world", "not a JPEG or PNG file"),
    (encode(20, 20)[:300], "truncated JPEG"),
    (encode(20, 20, "PNG")[:-20], "truncated PNG"),
    (b"\xff\xd8\xff\xe0\x00\x01" + b"\x00" * 100 + b"\xff\xd9", "has length 1"),
    (b"\xff\xd8\xff\xe0\x00\x04AB\x12\x34" + b"\x00" * 100 + b"\xff\xd9", "where a marker (0xff) was expected"),
    (b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x10\x03" + b"\x00" * 80 + b"\xff\xd9", "DNL"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDX" + b"\x00" * 40 + b"IEND", "expected IHDR"),
], ids=["text", "cut-jpeg", "cut-png", "short-segment", "no-marker", "dnl", "no-ihdr"])
def test_a_bad_header_says_what_is_wrong(data, why):
    with pytest.raises(ImageHeaderError, match=re.escape(why)):
        probe_bytes(data)


def test_image_folder_labels_are_sorted_class_indexes_and_bytes_are_kept(tmp_path):
    root = tmp_path / "train"
    files = {put(root / "zebra" / "a.jpg", encode(20, 30, seed=1)): 2,
             put(root / "ant" / "x" / "b.JPEG", encode(21, 31, seed=2)): 0,
             put(root / "bee" / "c.png", encode(22, 32, "PNG", seed=3)): 1,
             put(root / "ant" / "a.jpg", encode(23, 33, seed=4)): 0}
    put(root / "ant" / "notes.txt", b"not an image")
    result = convert_images([str(root)], tmp_path / "o.gds", progress=False)
    order = sorted(files, key=lambda f: (files[f], f))
    assert result.meta.num_samples == 4 and result.skipped == [] and result.ignored == 1
    g = zarr.open_group(str(tmp_path / "o.gds"), mode="r")
    assert g["label"][:].tolist() == [files[f] for f in order]
    assert g["label"].dtype == np.int64
    heights = [Image.open(f).size[1] for f in order]
    assert g["height"][:].tolist() == heights
    assert g["width"][:].tolist() == [Image.open(f).size[0] for f in order]
    assert samples(str(tmp_path / "o.gds")) == [open(f, "rb").read() for f in order]
    entry = g.attrs["gdsload"]["fields"]["image"]
    assert entry == {"kind": "ragged", "image": {"formats": ["jpeg", "png"]}}
    assert result.meta.ragged["image"].image_formats == ("jpeg", "png")


def test_list_file_paths_relative_to_it_with_spaces_comments_and_a_missing_file(tmp_path):
    a = put(tmp_path / "imgs" / "with space.jpg", encode(10, 12, seed=5))
    b = put(tmp_path / "elsewhere" / "b.png", encode(11, 13, "PNG", seed=6))
    lst = tmp_path / "imgs" / "train.txt"
    lst.write_text(f"# a comment\n\nwith space.jpg 7\n{b}   -3\nmissing.jpg 1\n")
    with pytest.warns(UserWarning, match="1 image.s. skipped"):
        result = convert_images([str(lst)], tmp_path / "o.gds", progress=False)
    assert [s.origin for s in result.skipped] == [str(tmp_path / "imgs" / "missing.jpg")]
    assert "cannot read" in result.skipped[0].why
    g = zarr.open_group(str(tmp_path / "o.gds"), mode="r")
    assert g["label"][:].tolist() == [7, -3]
    assert samples(str(tmp_path / "o.gds")) == [open(a, "rb").read(), open(b, "rb").read()]


def test_a_list_line_that_does_not_parse_is_refused_naming_its_line(tmp_path):
    lst = tmp_path / "train.txt"
    lst.write_text("a.jpg 1\nb.jpg cat\n")
    with pytest.raises(ConversionError, match=r"train.txt:2: expected 'PATH LABEL'"):
        convert_images([str(lst)], tmp_path / "o.gds", progress=False)
    assert not os.path.exists(tmp_path / "o.gds")


def _tar(path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def test_webdataset_shards_group_members_by_key_and_take_the_label_from_cls(tmp_path):
    imgs = [encode(12 + i, 14 + i, "PNG" if i == 2 else "JPEG", seed=i) for i in range(4)]
    t0 = _tar(tmp_path / "s0.tar", [("d/0001.jpg", imgs[0]), ("d/0001.cls", b"4\n"), ("d/0001.json", b"{}"),
                                    ("d/0002.cls", b"5"), ("d/0002.jpeg", imgs[1])])
    t1 = _tar(tmp_path / "s1.tar", [("0003.png", imgs[2]), ("0003.cls", b"6"), ("0004.jpg", imgs[3]),
                                    ("0005.cls", b"1"), ("0006.jpg", imgs[0]), ("0006.cls", b"dog")])
    with pytest.warns(UserWarning, match="3 image.s. skipped"):
        result = convert_images([t0, t1], tmp_path / "o.gds", progress=False)
    assert samples(str(tmp_path / "o.gds")) == imgs[:3]
    g = zarr.open_group(str(tmp_path / "o.gds"), mode="r")
    assert g["label"][:].tolist() == [4, 5, 6]
    assert g["height"][:].tolist() == [12, 13, 14]
    why = {s.origin: s.why for s in result.skipped}
    assert "no .cls member" in why[f"{t1}:0004.jpg"]
    assert "no image member" in why[f"{t1}:0005"]
    assert "'dog' (expected an integer label)" in why[f"{t1}:0006.jpg"]


def test_a_compressed_tar_is_refused(tmp_path):
    with tarfile.open(tmp_path / "s.tar", "w:gz") as tf:
        info = tarfile.TarInfo("0.cls")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ConversionError, match="s.tar: not an uncompressed tar file"):
        convert_images([str(tmp_path / "s.tar")], tmp_path / "o.gds", progress=False)


def _damaged_tree(root) -> dict[str, str]:
    put(root / "a" / "good.jpg", encode(16, 16))
    return {put(root / "a" / "cut.jpg", encode(40, 40)[:500]): "truncated JPEG",
            put(root / "b" / "text.jpg", b"plain text, not an image"): "not a JPEG or PNG file",
            put(root / "b" / "header.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40): "bad PNG header"}


def test_damaged_images_are_listed_and_skipped_with_a_warning(tmp_path):
    bad = _damaged_tree(tmp_path / "t")
    lines: list[str] = []
    with pytest.warns(UserWarning, match="3 image.s. skipped"):
        result = convert_images([str(tmp_path / "t")], tmp_path / "o.gds", progress=False, log=lines.append)
    assert result.meta.num_samples == 1
    assert {s.origin: s.why for s in result.skipped}.keys() == bad.keys()
    for s in result.skipped:
        assert bad[s.origin] in s.why
        assert f"SKIPPED {s.origin}: {s.why}" in lines
    assert lines[-1].endswith("1 images written, 3 skipped")


def test_cli_strict_refuses_naming_the_file_and_writes_nothing(tmp_path, capsys):
    bad = _damaged_tree(tmp_path / "t")
    code = shard_main(["--images", "--strict", str(tmp_path / "t"), "-o", str(tmp_path / "o.gds"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "(strict: no image is skipped)" in err
    assert any(f in err for f in bad)
    assert not os.path.exists(tmp_path / "o.gds")


def test_cli_without_strict_prints_each_skipped_file(tmp_path, capsys):
    bad = _damaged_tree(tmp_path / "t")
    with pytest.warns(UserWarning):
        code = shard_main(["--images", str(tmp_path / "t"), "-o", str(tmp_path / "o.gds"), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    for f in bad:
        assert f"SKIPPED {f}: " in out
    assert "1 images written, 3 skipped" in out


def test_nothing_readable_is_an_error_naming_a_file(tmp_path):
    put(tmp_path / "t" / "a" / "x.jpg", b"nope")
    with pytest.raises(ConversionError, match=r"no readable image .*x.jpg: not a JPEG"):
        convert_images([str(tmp_path / "t")], tmp_path / "o.gds", progress=False)


def test_read_back_through_gdsdataset_gives_the_files(tmp_path):
    root = tmp_path / "t"
    files = [put(root / f"c{i % 3}" / f"{i}.jpg", encode(8 + i, 9, seed=i)) for i in range(10)]
    convert_images([str(root)], tmp_path / "o.gds", progress=False, samples_per_block=3)
    expect = {open(f, "rb").read() for f in files}
    got = set()
    with GDSDataset(str(tmp_path / "o.gds"), batch_size=4, backend="cpu", shuffle=True) as ds:
        for batch in ds:
            off = batch["image/offsets"]
            got |= {batch["image"][off[i]:off[i + 1]].tobytes() for i in range(len(off) - 1)}
    assert got == expect


def test_an_image_entry_on_a_fixed_field_is_refused(tmp_path):
    put(tmp_path / "t" / "a" / "x.jpg", encode(8, 8))
    convert_images([str(tmp_path / "t")], tmp_path / "o.gds", progress=False)
    where = tmp_path / "o.gds" / "zarr.json"
    doc = json.loads(where.read_text())
    doc["attributes"]["gdsload"]["fields"]["label"]["image"] = {"formats": ["jpeg"]}
    where.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="only a variable-length field holds encoded images"):
        GDSDataset(str(tmp_path / "o.gds"), batch_size=1, backend="cpu")


_PEAK = """
import resource, sys
from gdsload.conversion.images import convert_images
convert_images([sys.argv[1]], sys.argv[2], block_bytes=1 << 20, shard_bytes=64 << 20, slice_bytes=8 << 20,
               progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def _fake_jpegs(root, count: int, nbytes: int) -> None:
    """Files the header reader takes as JPEGs (SOI, a frame header, filler, EOI): the converter never decodes."""
    head = b"\xff\xd8\xff\xc0\x00\x11\x08\x01\x00\x01\x40\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    filler = np.random.default_rng(0).integers(0, 255, nbytes - len(head) - 2, dtype=np.uint8).tobytes()
    for i in range(count):
        put(root / f"c{i % 2}" / f"{i:04d}.jpg", head + filler + b"\xff\xd9")


def test_peak_memory_is_bounded_by_the_slice_not_the_images(tmp_path):
    """Converting 256 MiB of images in 8 MiB slices costs about what converting 8 MiB does."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _fake_jpegs(tmp_path / "small", 2, 4 << 20)
    _fake_jpegs(tmp_path / "big", 64, 4 << 20)

    def peak(src: str, out: str) -> int:
        res = subprocess.run([sys.executable, "-c", _PEAK, src, out], capture_output=True, text=True, cwd=root,
                             check=True)
        return int(res.stdout.strip())

    baseline = peak(str(tmp_path / "small"), str(tmp_path / "s.gds"))
    big = peak(str(tmp_path / "big"), str(tmp_path / "b.gds"))
    assert big - baseline < 48, (baseline, big)
    g = zarr.open_group(str(tmp_path / "b.gds"), mode="r")
    assert g["height"][:].tolist() == [256] * 64 and g["width"][:].tolist() == [320] * 64
    assert int(g["image/offsets"][-1]) == 64 * (4 << 20)
