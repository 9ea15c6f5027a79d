"""Format reader: metadata validation, shard index parsing, block locations, damaged files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr

from conftest import zarr_dataset_with_missing_block
from gdsload import FormatError, GDSDataset, read_metadata
from gdsload.format import MAX_UINT_64, DatasetLayout, encode_shard_index, parse_shard_index


def test_index_round_trip_and_missing_chunk():
    table = np.array([[0, 64], [64, 64], [MAX_UINT_64, MAX_UINT_64]], dtype=np.uint64)
    index = parse_shard_index(encode_shard_index(table), 3, "f")
    assert index.get_chunk_slice(1) == (64, 128)
    assert index.get_chunk_slice(2) is None


def test_index_checksum_and_size_are_checked():
    raw = bytearray(encode_shard_index(np.array([[0, 8]], dtype=np.uint64)))
    raw[0] ^= 1
    with pytest.raises(FormatError, match=r"shard/0: shard index checksum mismatch \(expected crc32c"):
        parse_shard_index(bytes(raw), 1, "shard/0")
    with pytest.raises(FormatError, match=r"is 20 bytes \(expected 36\)"):
        parse_shard_index(bytes(raw), 2, "shard/0")


def test_layout_locates_blocks_like_zarr_writes_them(make_dataset):
    path = make_dataset({"x": np.zeros((25, 4), np.float32)}, samples_per_block=4, shard_bytes=64 * 3)
    meta = read_metadata(path)
    layout = DatasetLayout(meta)
    assert (meta.num_blocks, meta.fields["x"].blocks_per_shard, meta.num_shards("x")) == (7, 3, 3)
    loc = layout.locate("x", 4)
    assert loc.path == os.path.join(path, "x", "c", "1", "0") and (loc.offset, loc.nbytes) == (64, 64)


def test_dataset_written_by_zarr_with_missing_chunks_reads_fill_value(tmp_path):
    """zarr skips chunks equal to the fill value; those read back as the fill value."""
    path = str(tmp_path / "z.gds")
    data = zarr_dataset_with_missing_block(path)
    layout = DatasetLayout(read_metadata(path))
    assert layout.locate("x", 1) is None and layout.locate("x", 0) is not None
    with GDSDataset(path, batch_size=5, backend="cpu") as ds:
        got = np.concatenate([b["x"] for b in ds])
    np.testing.assert_array_equal(got, data)


def test_not_a_dataset(tmp_path):
    with pytest.raises(FormatError, match="no such dataset directory"):
        read_metadata(tmp_path / "nope")
    zarr.open_group(str(tmp_path / "plain"), mode="w")
    with pytest.raises(FormatError, match="lack the 'gdsload' entry"):
        read_metadata(tmp_path / "plain")


def test_compressed_chunks_are_refused(tmp_path):
    g = zarr.open_group(str(tmp_path / "c.gds"), mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 8, "samples_per_block": 4, "fields": {"x": {}}}
    g.create_array("x", shape=(8,), dtype="f4", chunks=(4,), shards=(8,))  # default compressor: zstd
    with pytest.raises(FormatError, match=r"x/zarr.json: inner chunks must be raw \('bytes' codec only\)"):
        read_metadata(tmp_path / "c.gds")


def test_mismatched_sample_count_is_refused(tmp_path):
    g = zarr.open_group(str(tmp_path / "m.gds"), mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 9, "samples_per_block": 4, "fields": {"x": {}}}
    g.create_array("x", shape=(8,), dtype="f4", chunks=(4,), shards=(8,), compressors=None)
    with pytest.raises(FormatError, match=r"expected 9 samples on axis 0, found shape \(8,\)"):
        read_metadata(tmp_path / "m.gds")


def shard0(path: str) -> str:
    return os.path.join(path, "x", "c", "0", "0")


def test_missing_truncated_and_corrupt_shards_name_the_file(make_dataset):
    arrays = {"x": np.ones((16, 4), np.float32)}
    missing = make_dataset(arrays, samples_per_block=4)
    os.remove(shard0(missing))
    with pytest.raises(FormatError, match=f"{shard0(missing)}: shard file is missing"):
        GDSDataset(missing, batch_size=4, backend="cpu")

    corrupt = make_dataset(arrays, samples_per_block=4)
    with open(shard0(corrupt), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff")
    with pytest.raises(FormatError, match=f"{shard0(corrupt)}: shard index checksum mismatch"):
        GDSDataset(corrupt, batch_size=4, backend="cpu")

    tiny = make_dataset(arrays, samples_per_block=4)
    with open(shard0(tiny), "r+b") as f:
        f.truncate(10)
    with pytest.raises(FormatError, match=f"{shard0(tiny)}: shard file is 10 bytes, smaller than its index"):
        GDSDataset(tiny, batch_size=4, backend="cpu")


def test_unknown_field(make_dataset):
    path = make_dataset({"x": np.ones((4, 2), np.float32)})
    with pytest.raises(FormatError, match=r"no field \['y'\] \(fields: \['x'\]\)"):
        GDSDataset(path, batch_size=2, fields=["y"], backend="cpu")


def test_errors_are_also_the_builtins_they_resemble(tmp_path):
    from gdsload import BackendUnavailable, ConversionError, GDSLoadError, ReadError

    for error, builtin in ((FormatError, ValueError), (ConversionError, ValueError), (ReadError, OSError),
                           (BackendUnavailable, RuntimeError)):
        assert issubclass(error, GDSLoadError) and issubclass(error, builtin)
        e = error("some/path: what is wrong (expected 1, found 2)")
        assert str(e) == "some/path: what is wrong (expected 1, found 2)"  # OSError keeps a one-argument message
    try:  # a handler written against the built-in catches gdsload's error
        read_metadata(tmp_path / "nope")
    except ValueError as e:
        assert isinstance(e, FormatError)
