"""Converter: round trips through gdsload and plain zarr, input kinds, bad input, atomicity, memory."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import zarr

from gdsload import ConversionError, GDSDataset
from gdsload.format.meta import read_metadata
from gdsload.tools.cli import shard_main
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import choose_samples_per_block, convert, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_all(path: str, **kw: object) -> dict[str, np.ndarray]:
    with GDSDataset(path, batch_size=kw.pop("batch_size", 7), backend="cpu", **kw) as ds:
        batches = list(ds)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def assert_same(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Equal through gdsload and through plain zarr, dtype and shape included."""
    got = read_all(path)
    group = zarr.open_group(path, mode="r")
    for name, want in arrays.items():
        want = np.asarray(want)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        via_zarr = group[name][:]
        assert via_zarr.dtype == want.dtype
        np.testing.assert_array_equal(via_zarr, want, err_msg=f"zarr {name}")


def test_round_trip_many_dtypes_multidim_partial_block(make_dataset):
    rng = np.random.default_rng(0)
    n = 1003  # prime: never a multiple of the block
    arrays = {
        "u8": rng.integers(0, 256, (n, 4, 6, 3), dtype=np.uint8),
        "i64": rng.integers(-2**62, 2**62, (n,), dtype=np.int64),
        "f16": rng.standard_normal((n, 5)).astype(np.float16),
        "f32": rng.standard_normal((n, 2, 3)).astype(np.float32),
        "flag": rng.random(n) > 0.5,
    }
    path = make_dataset(arrays, block_bytes=2048, shard_bytes=16 << 10)
    meta = read_metadata(path)
    assert meta.num_samples == n and meta.num_blocks > 1 and meta.num_samples % meta.samples_per_block
    assert meta.num_shards("u8") > 1
    assert_same(path, arrays)


def test_single_sample(make_dataset):
    arrays = {"x": np.arange(12, dtype=np.float32).reshape(1, 3, 4), "y": np.array([7], dtype=np.int64)}
    path = make_dataset(arrays)
    assert read_metadata(path).samples_per_block == 1
    assert_same(path, arrays)


def test_zero_block_reads_back(make_dataset):
    x = np.ones((40, 16), dtype=np.int32)
    x[8:16] = 0  # one whole block equal to the fill value
    path = make_dataset({"x": x}, samples_per_block=8)
    assert (read_metadata(path).num_blocks, read_metadata(path).samples_per_block) == (5, 8)
    assert_same(path, {"x": x})


def test_big_endian_input_is_stored_little_endian(make_dataset):
    x = np.arange(100, dtype=">f8").reshape(50, 2)
    path = make_dataset({"x": x}, samples_per_block=4)
    got = read_all(path)["x"]
    assert got.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(got, x)


def test_block_choice_is_aligned():
    # 224*224*3 bytes: 4 samples make a whole number of 4 KiB pages.
    k = choose_samples_per_block([150528, 8], 4 << 20, 10**6)
    assert (k * 150528) % 4096 == 0 and k * 150528 <= 4 << 20 and k == 24
    assert choose_samples_per_block([7], 4 << 20, 10) == 10  # capped by the dataset
    assert choose_samples_per_block([10 << 20], 4 << 20, 5) == 1  # a sample larger than a block


def test_inputs_npz_dirs_zarr_and_named_fields(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 100, (30, 4), dtype=np.int16)
    b = rng.standard_normal(30).astype(np.float32)
    np.savez(tmp_path / "plain.npz", a=a, b=b)
    np.savez_compressed(tmp_path / "packed.npz", a=a, b=b)
    (tmp_path / "dir").mkdir()
    for i in range(3):  # sorted name order: part0, part1, part2
        np.save(tmp_path / "dir" / f"part{i}.npy", a[i * 10:(i + 1) * 10])
    (tmp_path / "npzdir").mkdir()
    for i in range(2):
        np.savez(tmp_path / "npzdir" / f"s{i}.npz", a=a[i * 15:(i + 1) * 15], b=b[i * 15:(i + 1) * 15])
    z = zarr.open_group(str(tmp_path / "src.zarr"), mode="w")
    z.create_array("a", shape=a.shape, dtype=a.dtype, chunks=(7, 4))[:] = a
    z.create_array("b", shape=b.shape, dtype=b.dtype, chunks=(11,))[:] = b

    for src in ("plain.npz", "packed.npz", "npzdir", "src.zarr"):
        meta = convert([str(tmp_path / src)], tmp_path / f"{src}.gds", samples_per_block=4, progress=False)
        assert sorted(meta.fields) == ["a", "b"], src
        assert_same(meta.path, {"a": a, "b": b})
    meta = convert([str(tmp_path / "dir")], tmp_path / "dir.gds", {"b": f"{tmp_path}/packed.npz:b"},
                   samples_per_block=4, progress=False)
    assert sorted(meta.fields) == ["b", "dir"]
    assert_same(meta.path, {"dir": a, "b": b})
    meta = convert([], tmp_path / "named.gds", {"img": str(tmp_path / "src.zarr" / "a")}, progress=False)
    assert_same(meta.path, {"img": a})


def test_attributes_and_layout_match_design(make_dataset):
    path = make_dataset({"x": np.zeros((10, 3), np.float32)}, samples_per_block=4, shard_bytes=96)
    attrs = json.load(open(os.path.join(path, "zarr.json")))["attributes"]["gdsload"]
    assert attrs == {"format": 1, "num_samples": 10, "samples_per_block": 4, "fields": {"x": {"kind": "fixed"}},
                     "checksums": {"algorithm": "crc32c", "arrays": {"x": "_checksums/x"}}}
    shard = os.path.join(path, "x", "c", "0", "0")
    # 2 blocks of 4*3*4 bytes, then 2 x (offset, nbytes) and a crc32c
    assert os.path.getsize(shard) == 2 * 48 + 2 * 16 + 4


# -- bad input -------------------------------------------------------------------------------------
def run_shard(args: list[str], capsys) -> tuple[int, str]:
    code = shard_main([str(a) for a in args] + ["--quiet"])
    return code, capsys.readouterr().err


@pytest.fixture
def bad_inputs(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((10, 2), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((11, 2), np.float32))
    np.save(tmp_path / "obj.npy", np.array([{"k": 1}] * 4, dtype=object), allow_pickle=True)
    np.save(tmp_path / "rec.npy", np.zeros(4, dtype=[("x", "f4"), ("y", "i4")]))
    np.save(tmp_path / "empty.npy", np.zeros((0, 3), np.float32))
    np.save(tmp_path / "zerosize.npy", np.zeros((5, 0), np.float32))
    (tmp_path / "emptydir").mkdir()
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["missing.npy"], "missing.npy: input does not exist"),
    (["a.npy", "b.npy"], "fields have different sample counts (a=10, b=11"),
    (["obj.npy"], "obj.npy: unsupported dtype object"),
    (["rec.npy"], "rec.npy: unsupported dtype"),
    (["empty.npy"], "empty.npy: holds no samples (empty input)"),
    (["emptydir"], "emptydir: directory holds no .npy or .npz files (empty input)"),
    (["zerosize.npy"], "zerosize.npy: zero-size samples"),
])
def test_bad_input_messages(bad_inputs, capsys, args, message):
    out = bad_inputs / "out.gds"
    code, err = run_shard([bad_inputs / a for a in args] + ["-o", out], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()
    assert not [p for p in os.listdir(bad_inputs) if ".tmp-" in p]


def test_object_dtype_from_zarr_or_memory_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="unsupported dtype"):
        write_dataset(tmp_path / "o.gds", {"s": ArraySource("<s>", np.array(["a", "b"]))})
    assert not (tmp_path / "o.gds").exists()


def test_output_inside_input_is_refused(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "x.npy", np.zeros((4, 2)))
    code, err = run_shard([tmp_path / "data", "-o", tmp_path / "data" / "out.gds"], capsys)
    assert code == 2 and "output path is inside input" in err
    assert sorted(os.listdir(tmp_path / "data")) == ["x.npy"]


def test_refuses_overwrite_then_replaces_atomically(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10))
    out = tmp_path / "o.gds"
    assert run_shard([tmp_path / "x.npy", "-o", out], capsys)[0] == 0
    code, err = run_shard([tmp_path / "x.npy", "-o", out], capsys)
    assert code == 2 and "output exists (pass --overwrite" in err
    np.save(tmp_path / "x.npy", np.arange(20))
    assert run_shard([tmp_path / "x.npy", "-o", out, "--overwrite"], capsys)[0] == 0
    assert read_metadata(out).num_samples == 20
    assert sorted(os.listdir(tmp_path)) == ["o.gds", "x.npy"]


class Exploding:
    """A source that fails part-way, like a disk error in the middle of a conversion."""

    origin = "<exploding>"
    shape = (1000, 16)
    dtype = np.dtype("float32")

    def read(self, start: int, stop: int) -> np.ndarray:
        if stop > 500:
            raise OSError("simulated read failure")
        return np.zeros((stop - start, 16), np.float32)

    def close(self) -> None:
        pass


def test_failed_conversion_leaves_nothing_and_keeps_old_output(tmp_path, make_dataset):
    out = tmp_path / "o.gds"
    with pytest.raises(OSError, match="simulated"):
        write_dataset(out, {"x": Exploding()}, samples_per_block=10, slice_bytes=4096, progress=False)
    assert os.listdir(tmp_path) == []
    write_dataset(out, {"x": ArraySource("<x>", np.ones((5, 16), np.float32))}, progress=False)
    with pytest.raises(OSError, match="simulated"):
        write_dataset(out, {"x": Exploding()}, samples_per_block=10, overwrite=True, progress=False)
    assert os.listdir(tmp_path) == ["o.gds"] and read_metadata(out).num_samples == 5


def test_truncated_npy_is_reported(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((100, 8), np.float64))
    with open(tmp_path / "x.npy", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "x.npy") - 100)
    code, err = run_shard([tmp_path / "x.npy", "-o", tmp_path / "o.gds"], capsys)
    assert code == 2 and "x.npy: file ends early" in err
    assert not (tmp_path / "o.gds").exists()


def _npy(path, array: np.ndarray, version: tuple[int, int]) -> None:
    """``array`` saved as a .npy file of format ``version``; a version numpy does not write gets a 2.0 file
    whose magic string says ``version``."""
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version if version in ((1, 0), (2, 0), (3, 0)) else (2, 0))
    if version not in ((1, 0), (2, 0), (3, 0)):
        with open(path, "r+b") as f:
            f.seek(6)  # after b"\x93NUMPY": major, minor
            f.write(bytes(version))


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_of_every_version_numpy_writes_is_read(tmp_path, version):
    data = np.arange(24, dtype=np.int32).reshape(12, 2)
    _npy(tmp_path / "x.npy", data, version)
    convert([str(tmp_path / "x.npy")], tmp_path / "o.gds", samples_per_block=4, progress=False)
    assert np.array_equal(read_all(str(tmp_path / "o.gds"))["x"], data)


def _npy_header(path, header: bytes, version: tuple[int, int] = (1, 0), data: bytes = b"\0" * 64) -> None:
    """A .npy file with ``header`` (the dictionary's text) as it is, padded as numpy pads it."""
    size = 2 if version == (1, 0) else 4
    body = header + b" " * (-(10 + size - 4 + len(header) + 1) % 64) + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY" + bytes(version) + len(body).to_bytes(size, "little") + body + data)


@pytest.mark.parametrize("write, message", [
    (lambda p: _npy(p, np.zeros((4, 2), np.float32), (9, 9)),
     "unsupported format version 9.9; expected 1.0, 2.0 or 3.0"),
    (lambda p: _npy(p, np.zeros((4, 2), np.float32), (1, 1)), "unsupported format version 1.1"),
    (lambda p: _npy(p, np.zeros((4, 2), np.float32), (4, 0)), "unsupported format version 4.0"),
    (lambda p: _npy_header(p, b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), 'extra': 1}"),
     "Header does not contain the correct keys"),
    (lambda p: _npy_header(p, b"{'descr': '<f4', 'fortran_order': 0, 'shape': (4, 2)}"),
     "fortran_order is not a valid bool"),
    (lambda p: _npy_header(p, b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2.0)}"), "shape is not valid"),
    (lambda p: _npy_header(p, b"{'descr': 'float99', 'fortran_order': False, 'shape': (4,)}"),
     "descr is not a valid dtype descriptor"),
    (lambda p: _npy_header(p, b"{'descr': '<f4', 'fortran_order': False, 'shape': (4,)}", version=(7, 0)),
     "unsupported format version 7.0"),
])
def test_npy_header_is_checked_as_numpy_checks_it(tmp_path, capsys, write, message):
    """A header numpy would refuse (a format version it does not know included) is a ConversionError naming
    the file, before anything is written; as one member of a .npz, too."""
    write(tmp_path / "x.npy")
    with pytest.raises(ValueError):
        np.load(tmp_path / "x.npy")  # numpy's own verdict
    code, err = run_shard([tmp_path / "x.npy", "-o", tmp_path / "o.gds"], capsys)
    assert code == 2 and err.startswith(f"shard.py: error: {tmp_path}/x.npy: not a valid .npy array")
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o.gds").exists()
    with zipfile.ZipFile(tmp_path / "a.npz", "w") as z:
        z.write(tmp_path / "x.npy", "x.npy")
    with pytest.raises(ConversionError, match=re.escape(f"{tmp_path}/a.npz:x: not a valid .npy array")):
        convert([str(tmp_path / "a.npz")], tmp_path / "o.gds", progress=False)


def test_writer_attribute_keys_are_the_ones_the_reader_accepts(make_dataset):
    """The reader refuses any key of the gdsload attribute it does not know: the writer's must be those."""
    from gdsload.format.meta import ATTRS_KEYS, CHECKSUMS_KEYS, FIELD_ENTRY_KEYS
    from gdsload.conversion.source_types import RaggedSource

    path = make_dataset({"x": np.zeros((10, 3), np.float32)}, samples_per_block=4,
                        ragged={"t": RaggedSource("t", ArraySource("t", np.arange(6)), np.array([0, 1, 3, 3, 4, 4, 5, 6,
                                                                                               6, 6, 6]))})
    attrs = json.load(open(os.path.join(path, "zarr.json")))["attributes"]["gdsload"]
    assert list(attrs) == list(ATTRS_KEYS)
    # an image field's entry adds "image" (tests/test_image_convert.py); these are "kind" alone
    assert all(list(entry) == ["kind"] and "kind" in FIELD_ENTRY_KEYS for entry in attrs["fields"].values())
    assert set(attrs["fields"]) == {"x", "t"} and list(attrs["checksums"]) == list(CHECKSUMS_KEYS)
    assert read_metadata(path).checksums == {"x": "_checksums/x", "t": "_checksums/t"}


# -- memory ----------------------------------------------------------------------------------------
_PEAK = """
import resource, sys
from gdsload.conversion.writer import convert
convert([sys.argv[1]], sys.argv[2], block_bytes=1 << 20, shard_bytes=64 << 20, slice_bytes=8 << 20, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def _peak_mib(src: str, out: str) -> int:
    res = subprocess.run([sys.executable, "-c", _PEAK, src, out], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return int(res.stdout.strip())


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_peak_memory_is_bounded_by_slice_not_input(tmp_path, kind):
    """Converting 384 MiB in 8 MiB slices costs about what converting 4 MiB does."""
    big = np.lib.format.open_memmap(tmp_path / "big.npy", "w+", np.float32, (96 * 1024, 1024))
    for i in range(0, big.shape[0], 8192):
        big[i:i + 8192] = i
    big.flush()
    del big
    np.save(tmp_path / "small.npy", np.zeros((1024, 1024), np.float32))
    if kind == "npz":
        for name in ("big", "small"):
            with zipfile.ZipFile(tmp_path / f"{name}.npz", "w") as zf:
                zf.write(tmp_path / f"{name}.npy", "x.npy")
    baseline = _peak_mib(str(tmp_path / f"small.{kind}"), str(tmp_path / "s.gds"))
    peak = _peak_mib(str(tmp_path / f"big.{kind}"), str(tmp_path / "b.gds"))
    assert os.path.getsize(tmp_path / "big.npy") > 40 * (8 << 20)
    assert peak - baseline < 48, (baseline, peak)
    meta = read_metadata(tmp_path / "b.gds")
    assert meta.num_samples == 96 * 1024
    z = zarr.open_group(str(tmp_path / "b.gds"), mode="r")["big" if kind == "npy" else "x"]
    assert float(z[8191, 0]) == 0 and float(z[8192, 5]) == 8192 and float(z[-1, -1]) == 90112


def test_write_dataset_takes_plain_arrays_and_names_what_it_cannot(tmp_path):
    """numpy (or zarr) arrays are what users have: they are written as they are; anything else is a
    ConversionError naming the field, not an AttributeError from deep inside the writer."""
    images = np.arange(40 * 6, dtype=np.uint8).reshape(40, 6)
    labels = zarr.create_array(zarr.storage.MemoryStore(), shape=(40,), dtype="int64", chunks=(7,))
    labels[:] = np.arange(40) * 3
    out = tmp_path / "o.gds"
    write_dataset(out, {"images": images, "labels": labels}, samples_per_block=8, progress=False)
    with GDSDataset(out, batch_size=40, backend="cpu") as ds:
        batch = next(iter(ds))
    np.testing.assert_array_equal(batch["images"], images)
    np.testing.assert_array_equal(batch["labels"], np.arange(40) * 3)

    closed = []

    class Kept(Exploding):
        origin = "<kept>"

        def close(self) -> None:
            closed.append(True)

    with pytest.raises(ConversionError, match=rf"^{re.escape(str(tmp_path / 'p.gds'))}: field 'bad': expected an "
                                              r"array .* found list"):
        write_dataset(tmp_path / "p.gds", {"kept": Kept(), "bad": [1, 2, 3]}, progress=False)
    assert closed == [True] and not (tmp_path / "p.gds").exists()


# -- sizes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, error, message", [
    ("block_bytes", 0, ConversionError, "block_bytes (--block-bytes) must be at least 1 byte (found 0)"),
    ("block_bytes", -4096, ConversionError, "block_bytes (--block-bytes) must be at least 1 byte (found -4096)"),
    ("block_bytes", "4MiB", TypeError, "block_bytes (--block-bytes) must be an int, in bytes (found str '4MiB')"),
    ("block_bytes", 4096.0, TypeError, "block_bytes (--block-bytes) must be an int"),
    ("shard_bytes", 0, ConversionError, "shard_bytes (--shard-bytes) must be at least 1 byte (found 0)"),
    ("shard_bytes", True, TypeError, "shard_bytes (--shard-bytes) must be an int, in bytes (found bool True)"),
    ("shard_bytes", 1, ConversionError, "shard_bytes (--shard-bytes) 1 is less than any array's block (the "
                                        "smallest: 400 bytes, of 'label'): a shard holds whole blocks"),
    ("shard_bytes", 399, ConversionError, "(expected at least 400, or the default 1073741824)"),
])
def test_sizes_that_cannot_be_meant_are_refused_naming_the_option(tmp_path, option, value, error, message):
    """--block-bytes 0 and --shard-bytes 1 were accepted: blocks of one sample, a file per block. A block target
    holds at least one whole sample, so any positive one means something; a shard holds whole blocks, so a
    target below every array's block cannot be met. Both refused naming the option, in Python and the CLI,
    before anything is written."""
    arrays = {"image": np.zeros((100, 8, 8), np.uint8), "label": np.arange(100)}  # 64 and 8 bytes a sample
    out = str(tmp_path / "d.gds")
    with pytest.raises(error) as info:
        write_dataset(out, {k: ArraySource(k, a) for k, a in arrays.items()}, samples_per_block=50, progress=False,
                      **{option: value})
    assert message in str(info.value) and str(info.value).startswith(f"{out}: ") and not os.path.exists(out)


def test_sizes_at_their_minimums_convert(tmp_path, capsys):
    """The least each size takes: a block target of 1 byte (a sample per block), a shard of the smallest array's
    block (a block per shard); and the command line says what the Python API says."""
    arrays = {"image": np.arange(800, dtype=np.uint8).reshape(100, 8), "label": np.arange(100)}
    out = str(tmp_path / "d.gds")
    meta = write_dataset(out, {k: ArraySource(k, a) for k, a in arrays.items()}, block_bytes=1, shard_bytes=8,
                         progress=False)
    assert meta.samples_per_block == 1 and meta.num_shards("label") == 100 and meta.num_shards("image") == 100
    assert_same(out, arrays)
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    for flags, message in ((["--block-bytes", "0"], "block_bytes (--block-bytes) must be at least 1 byte"),
                           (["--shard-bytes", "1"], "shard_bytes (--shard-bytes) 1 is less than any array's block")):
        code = shard_main([str(tmp_path / "image.npy"), str(tmp_path / "label.npy"), "-o", str(tmp_path / "c.gds"),
                           "--quiet", *flags], prog="gdsload shard")
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"gdsload shard: error: {tmp_path}/c.gds: ") and message in err
        assert err.count("\n") == 1 and not os.path.exists(tmp_path / "c.gds")
