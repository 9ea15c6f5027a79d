"""Format reader: metadata validation, shard index parsing, block locations, damaged files."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import zarr

from _helpers import (add_checksums, in_thread, index_edit_refused, open_fds, rewrite_index,
                      zarr_dataset_with_missing_block)
from gdsload import FormatError, GDSDataset
from gdsload.format.meta import read_metadata
from gdsload.format.shard_index import MAX_UINT_64, encode_shard_index, parse_shard_index
from gdsload.format.layout import DatasetLayout


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
    """zarr skips chunks equal to the fill value: an open refuses them by default; with
    ``missing_chunks="fill"`` they read back as the fill value."""
    path = str(tmp_path / "z.gds")
    data = zarr_dataset_with_missing_block(path)
    with pytest.raises(FormatError, match="shard index marks chunk 1 of field 'x' as never written"):
        DatasetLayout(read_metadata(path))
    layout = DatasetLayout(read_metadata(path), missing_chunks="fill")
    assert layout.locate("x", 1) is None and layout.locate("x", 0) is not None
    layout.close()
    with GDSDataset(path, batch_size=5, backend="cpu", missing_chunks="fill") as ds:
        got = np.concatenate([b["x"] for b in ds])
    np.testing.assert_array_equal(got, data)


def test_not_a_dataset(tmp_path):
    with pytest.raises(FormatError, match="no such dataset directory"):
        read_metadata(tmp_path / "nope")
    zarr.open_group(str(tmp_path / "plain"), mode="w")
    with pytest.raises(FormatError, match="a Zarr v3 group without arrays .*'gdsload shard'"):
        read_metadata(tmp_path / "plain")


def test_converter_datasets_compress_with_zstd_only(tmp_path):
    g = zarr.open_group(str(tmp_path / "c.gds"), mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 8, "samples_per_block": 4, "fields": {"x": {}}}
    g.create_array("x", shape=(8,), dtype="f4", chunks=(4,), shards=(8,), compressors=[zarr.codecs.GzipCodec()])
    with pytest.raises(FormatError, match=r"x/zarr.json: inner chunks must be raw \('bytes' codec only\) or 'bytes' "
                                          r"then 'zstd' \(then 'crc32c'\), found \['bytes', 'gzip'\]"):
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


# -- files.py: shard files opened safely and held ----------------------------------------------------------

def test_open_shard_holds_a_regular_file(tmp_path):
    from gdsload.format.files import open_shard

    p = tmp_path / "s"
    p.write_bytes(b"abcdef")
    f = open_shard(str(p))
    try:
        st = os.stat(p)
        assert (f.path, f.size, f.dev, f.ino, f.mtime_ns) == (str(p), 6, st.st_dev, st.st_ino, st.st_mtime_ns)
        assert os.pread(f.fd, 3, 2) == b"cde"
        import fcntl

        flags = fcntl.fcntl(f.fd, fcntl.F_GETFL)
        assert not flags & os.O_NONBLOCK and fcntl.fcntl(f.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(f.fd)


def test_open_shard_refuses_what_is_not_a_regular_file(tmp_path):
    from gdsload.format.files import open_shard

    fifo, loop, sub = str(tmp_path / "fifo"), str(tmp_path / "loop"), str(tmp_path / "dir")
    os.mkfifo(fifo)
    os.symlink(loop, loop)
    os.mkdir(sub)
    before = open_fds()
    cases = {fifo: "is a FIFO (expected a regular file)", loop: "is a symlink loop",
             sub: "is a directory (expected a regular file)", str(tmp_path / "gone"): "shard file is missing",
             "/dev/null": "is a character device (expected a regular file)"}
    for path, what in cases.items():
        with pytest.raises(FormatError) as info:
            in_thread(lambda path=path: open_shard(path))
        assert str(info.value).startswith(f"{path}: ") and what in str(info.value)
    assert open_fds() == before


def test_fifo_swapped_in_after_the_stat_does_not_block(tmp_path, monkeypatch):
    """The pre-open stat says "regular file" (a swap between stat and open): the open itself must still
    return at once (O_NONBLOCK) and the fstat refuse the FIFO."""
    from gdsload.format.files import open_shard

    fifo = str(tmp_path / "fifo")
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(regular if p == fifo else p, *a, **k))
    with pytest.raises(FormatError, match=f"^{fifo}: shard file is a FIFO"):
        in_thread(lambda: open_shard(fifo))


def test_open_errors_map_to_format_errors(tmp_path, monkeypatch):
    import errno

    from gdsload.format.files import open_shard

    p = tmp_path / "s"
    p.write_bytes(b"x")
    if os.geteuid() != 0:  # root reads a mode-000 file anyway
        p.chmod(0)
        with pytest.raises(FormatError, match=f"^{p}: shard file is not readable \\(permission denied\\)"):
            open_shard(str(p))
        p.chmod(0o644)
    for code, what in ((errno.EACCES, "is not readable (permission denied)"),
                       (errno.EPERM, "is not readable (permission denied)"),
                       (errno.EISDIR, "is a directory"), (errno.ELOOP, "is a symlink loop"),
                       (errno.EIO, "cannot open shard file (Input/output error)")):
        def refuse(path, flags, *a, code=code):
            raise OSError(code, os.strerror(code), path)

        monkeypatch.setattr(os, "open", refuse)
        with pytest.raises(FormatError) as info:
            open_shard(str(p))
        assert str(info.value).startswith(f"{p}: ") and what in str(info.value)
        monkeypatch.undo()


def test_shard_files_hold_and_close(tmp_path):
    from gdsload import ReadError
    from gdsload.format.files import ShardFiles

    paths = []
    for i in range(3):
        p = tmp_path / f"s{i}"
        p.write_bytes(bytes([i]) * 8)
        paths.append(str(p))
    before = open_fds()
    files = ShardFiles.open(paths + paths[:1])  # a repeated path is opened once
    assert open_fds() == before + 3 and len(files) == 3 and list(files) == paths
    assert paths[1] in files and str(tmp_path / "other") not in files
    assert os.pread(files.fd(paths[2]), 1, 0) == b"\x02" and files.get(paths[0]).size == 8
    assert files.get("nope") is None
    with pytest.raises(ReadError, match="nope: not an open shard file"):
        files.fd("nope")
    files.close()
    files.close()  # idempotent
    assert files.closed and open_fds() == before and len(files) == 0
    with pytest.raises(ReadError, match=f"{paths[0]}: not an open shard file .*were closed"):
        files.fd(paths[0])

    ShardFiles.open(paths)  # dropped without close(): collected, its descriptors closed
    import gc

    gc.collect()
    assert open_fds() == before


def test_shard_files_opened_so_far_are_closed_when_one_fails(tmp_path):
    from gdsload.format.files import ShardFiles

    good = []
    for i in range(3):
        (tmp_path / f"s{i}").write_bytes(b"x")
        good.append(str(tmp_path / f"s{i}"))
    os.mkfifo(tmp_path / "fifo")
    before = open_fds()
    with pytest.raises(FormatError, match="fifo: shard file is a FIFO") as info:
        ShardFiles.open(good + [str(tmp_path / "fifo")] + good)
    assert info.traceback and open_fds() == before


# -- DatasetLayout: files held, shard index checks, checksums ----------------------------------------------

def test_layout_reads_the_files_it_opened_after_they_are_replaced(make_dataset, tmp_path):
    path = make_dataset({"x": np.ones((16, 4), np.float32)}, samples_per_block=4)
    other = make_dataset({"x": np.full((16, 4), 7, np.float32)}, samples_per_block=4)
    layout = DatasetLayout(read_metadata(path))
    loc = layout.locate("x", 1)
    fd = layout.files.fd(loc.path)
    assert loc.path == shard0(path) and loc.path in layout.files and list(layout.files) == layout.shard_paths()
    before = os.pread(fd, loc.nbytes, loc.offset)
    os.rename(shard0(other), shard0(path))  # a shard replaced by rename, different content
    with open(shard0(path), "rb") as f:
        f.seek(loc.offset)
        assert f.read(loc.nbytes) != before
    assert os.pread(fd, loc.nbytes, loc.offset) == before == np.ones((4, 4), np.float32).tobytes()
    os.rename(path, str(tmp_path / "moved"))  # the whole dataset moved away
    assert os.pread(layout.files.fd(loc.path), loc.nbytes, loc.offset) == before
    layout.close()
    layout.close()
    assert layout.closed


def test_layout_is_a_context_manager_and_holds_one_descriptor_per_shard(make_dataset):
    path = make_dataset({"x": np.ones((25, 4), np.float32), "y": np.arange(25)}, samples_per_block=4,
                        shard_bytes=64 * 3)
    meta = read_metadata(path)
    before = open_fds()
    with DatasetLayout(meta) as layout:
        assert len(layout.files) == len(layout.shard_paths()) == meta.num_shards("x") + meta.num_shards("y")
        assert open_fds() == before + len(layout.files)
    assert open_fds() == before and layout.closed
    with DatasetLayout(meta, ("y",)) as layout:
        assert set(layout.files) == {meta.shard_path("y", s) for s in range(meta.num_shards("y"))}


def test_fifo_in_place_of_a_shard_is_refused_promptly(make_dataset):
    path = make_dataset({"x": np.ones((16, 4), np.float32)}, samples_per_block=4)
    os.remove(shard0(path))
    os.mkfifo(shard0(path))
    for open_it in (lambda: DatasetLayout(read_metadata(path)), lambda: GDSDataset(path, 4, backend="cpu")):
        with pytest.raises(FormatError, match=f"^{shard0(path)}: shard file is a FIFO \\(expected a regular file\\)"):
            in_thread(open_it)


def test_a_failed_open_closes_every_file_it_opened(make_dataset):
    path = make_dataset({"x": np.ones((25, 4), np.float32)}, samples_per_block=4, shard_bytes=64 * 3)
    meta = read_metadata(path)
    last = meta.shard_path("x", meta.num_shards("x") - 1)
    with open(last, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")  # a bad crc32c in the last shard read
    before = open_fds()
    with pytest.raises(FormatError, match=f"{last}: shard index checksum mismatch") as info:
        DatasetLayout(meta)
    assert info.traceback  # holds the half-built layout: its files are closed, not merely collectable
    assert open_fds() == before


def test_a_shape_far_beyond_the_shard_files_fails_before_any_allocation(make_dataset):
    import json
    import time

    path = make_dataset({"x": np.ones((16, 4), np.float32)}, samples_per_block=4)
    for name in ("zarr.json", "x/zarr.json"):
        with open(os.path.join(path, name)) as f:
            doc = json.load(f)
        if name == "zarr.json":
            doc["attributes"]["gdsload"]["num_samples"] = 10**15
        else:
            doc["shape"][0] = 10**15
        with open(os.path.join(path, name), "w") as f:
            json.dump(doc, f)
    meta = read_metadata(path)
    t0 = time.monotonic()
    with pytest.raises(FormatError, match=rf"^{path}/x/zarr.json: expected 62500000000000 shard files, found 1 "):
        DatasetLayout(meta)
    assert time.monotonic() - t0 < 1.0


def test_chunks_overlapping_the_index_or_each_other_are_refused(make_dataset, tmp_path):
    path = make_dataset({"x": np.ones((16, 4), np.float32)}, samples_per_block=4)
    meta = read_metadata(path)
    fm, shard = meta.fields["x"], shard0(path)
    size = os.path.getsize(shard)
    assert (fm.block_bytes, fm.blocks_per_shard, size) == (64, 4, 4 * 64 + 4 * 16 + 4)
    original = open(shard, "rb").read()

    refused = index_edit_refused(meta, fm, shard, original)

    refused(lambda t: t.__setitem__((3, 0), 256 - 63),
            r"chunk 3 \(bytes 193..257\) overlaps the shard index \(bytes 256..324\)")
    refused(lambda t: t.__setitem__((1, 0), 300), r"chunk 1 ends at byte 364, past the end of the file \(324 bytes\)")
    refused(lambda t: t.__setitem__((2, 0), 32),
            r"chunks 0 and 2 overlap \(chunk 2 starts at byte 32, before chunk 0 ends at byte 64\)")
    refused(lambda t: t.__setitem__((0, 0), 128),
            r"chunks 0 and 2 overlap \(chunk 2 starts at byte 128, before chunk 0 ends at byte 192\)")
    refused(lambda t: t.__setitem__((2, 1), 65), r"chunk 2 is 65 bytes \(expected 64: raw, uncompressed\)")
    refused(lambda t: t.fill(MAX_UINT_64), r"shard index marks all 4 chunks as never written")
    # In a dataset with the gdsload attribute the chunks tile the file in order (test_tiling.py); in a foreign
    # store two chunks may share nothing but may lie in any order, with gaps.
    scattered = [[192, 64], [0, 64], [MAX_UINT_64] * 2, [64, 64]]
    refused(lambda t: t.__setitem__(slice(None), scattered),
            r"chunk 0, the first written, does not start the data region \(expected byte 0, found byte 192\)")
    group_json = os.path.join(path, "zarr.json")
    with open(group_json) as f:
        doc = json.load(f)
    del doc["attributes"]["gdsload"]
    with open(group_json, "w") as f:
        json.dump(doc, f)
    shutil.rmtree(os.path.join(path, "_checksums"))  # else refused: a gdsload dataset whose attribute went
    foreign = read_metadata(path, fields=["x"])
    assert foreign.foreign
    with DatasetLayout(foreign, missing_chunks="fill") as layout:
        assert layout.block_offsets["x"].tolist() == [192, 0, -1, 64]

    # index_location "start": chunks must begin after the index.
    z = str(tmp_path / "start.gds")
    g = zarr.open_group(z, mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 12, "samples_per_block": 3, "fields": {"x": {}}}
    a = g.create_array("x", shape=(12, 2), dtype="int16", chunks=(3, 2),
                       shards={"shape": (6, 2), "index_location": "start"}, compressors=None)
    a[:] = np.arange(24).reshape(12, 2)
    zmeta = read_metadata(z)
    assert zmeta.fields["x"].index_location == "start"
    assert DatasetLayout(zmeta).block_offsets["x"].tolist() == [36, 48, 36, 48]
    rewrite_index(shard0(z), zmeta.fields["x"], lambda t: t.__setitem__((0, 0), 35))
    with pytest.raises(FormatError,
                       match=rf"^{shard0(z)}: chunk 0 \(bytes 35..47\) overlaps the shard index \(bytes 0..36\)"):
        DatasetLayout(zmeta)


def ragged_arrays(n: int = 11):
    from gdsload.conversion.source_types import ArraySource, RaggedSource

    lengths = np.arange(n) % 4
    values = np.arange(int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {"tok": RaggedSource("<tok>", ArraySource("<tok>", values), offsets)}


def test_checksums_are_parsed_and_read_whole(make_dataset):
    path = make_dataset({"x": np.arange(11 * 3, dtype=np.uint8).reshape(11, 3), "idx": np.arange(11)},
                        samples_per_block=4, ragged=ragged_arrays())
    written = read_metadata(path)  # the converter's checksums equal those recomputed from the shard files
    assert written.checksums == {f: f"_checksums/{f}" for f in ("x", "idx", "tok")}
    with DatasetLayout(written) as layout:
        assert layout.has_checksums
        by_converter = {f: a.copy() for f, a in layout.checksums.items()}
    recomputed = add_checksums(path)
    for f in ("x", "idx", "tok"):
        np.testing.assert_array_equal(by_converter[f], recomputed[f])
    g = zarr.open_group(path, mode="r+")
    attrs = dict(g.attrs["gdsload"])
    del attrs["checksums"]
    g.attrs["gdsload"] = attrs
    with pytest.raises(FormatError, match="names no checksum array for field"):
        read_metadata(path)  # _checksums/ is still there: the metadata would switch verification off
    shutil.rmtree(os.path.join(path, "_checksums"))
    plain = read_metadata(path)
    assert plain.checksums == {} and DatasetLayout(plain).checksums == {} and not DatasetLayout(plain).has_checksums
    sums = add_checksums(path, ["x", "tok"])
    meta = read_metadata(path)
    assert meta.checksums == {"x": "_checksums/x", "tok": "_checksums/tok"}
    with DatasetLayout(meta) as layout:
        assert set(layout.checksums) == {"x", "tok"} and not layout.has_checksums  # idx has none
        for name in ("x", "tok"):
            assert layout.checksums[name].dtype == np.uint32 and layout.checksums[name].shape == (3,)
            np.testing.assert_array_equal(layout.checksums[name], sums[name])
    with DatasetLayout(meta, ("x", "tok")) as layout:
        assert layout.has_checksums
    with DatasetLayout(meta, ("idx",)) as layout:
        assert layout.checksums == {} and not layout.has_checksums
    # the final block of x: three samples and one of zero padding, as stored
    import crc32c

    assert sums["x"][2] == crc32c.crc32c(bytes(range(24, 33)) + bytes(3))


# -- opening without zarr ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, fill", [("uint8", 0), ("int64", -5), ("uint64", 2**64 - 1), ("float32", 1.5),
                                         ("float16", 2), ("float64", -0.0), ("bool", True)])
def test_a_plain_fill_value_is_read_as_zarr_reads_it(tmp_path, dtype, fill):
    from gdsload.format.arrays import array_fill_value, zarr_fill_value
    from gdsload.format.zarr_json import read_json

    zarr.create_array(str(tmp_path / "a"), shape=(3, 2), chunks=(1, 2), dtype=dtype, fill_value=fill)
    where = str(tmp_path / "a" / "zarr.json")
    doc = read_json(where)
    ours = array_fill_value(where, doc, (3, 2), np.dtype(dtype))
    theirs = zarr_fill_value(where, (3, 2), np.dtype(dtype))
    assert type(ours) is type(theirs) and ours == theirs and np.signbit(ours) == np.signbit(theirs)


@pytest.mark.parametrize("change", [
    lambda d: d.update(fill_value="NaN"),  # spellings zarr reads
    lambda d: d.update(fill_value="0x7fc00000"),
    lambda d: d.update(extension={"must_understand": True}),  # an extension: zarr judges it
    lambda d: d.update(dimension_names=["a"]),  # of the wrong length
    lambda d: d.update(fill_value=1e39),  # out of float32's range
])
def test_any_other_fill_value_or_document_goes_to_zarr(tmp_path, change):
    """The document given says 0 (then changed), the file zarr opens says 5: 5 is zarr's answer."""
    from gdsload.format import arrays
    from gdsload.format.zarr_json import read_json

    zarr.create_array(str(tmp_path / "a"), shape=(3, 2), chunks=(1, 2), dtype="float32", fill_value=5)
    where = str(tmp_path / "a" / "zarr.json")
    doc = read_json(where)
    doc["fill_value"] = 0  # read here, were the change not one for zarr to judge
    assert arrays.array_fill_value(where, doc, (3, 2), np.dtype("float32")) == 0
    change(doc)
    assert arrays.array_fill_value(where, doc, (3, 2), np.dtype("float32")) == 5


def test_opening_a_converted_dataset_imports_no_zarr(make_dataset):
    """The converter's datasets (fixed-size fields, checksums) open and read without zarr, whose import costs a
    fresh process tenths of a second; their checksums are those zarr reads."""
    import subprocess
    import sys

    path = make_dataset({"x": np.arange(60, dtype=np.float32).reshape(20, 3), "y": np.arange(20)},
                        samples_per_block=4)
    sums = add_checksums(path)
    code = ("import sys, gdsload, numpy as np\n"
            "from gdsload.format.layout import DatasetLayout\n"
            f"ds = gdsload.GDSDataset({path!r}, batch_size=8, backend='cpu', verify=True)\n"
            "n = sum(len(b['y']) for b in ds)\n"
            "with DatasetLayout(ds.meta, ds.fields) as layout:  # the checksums as the dataset reads them\n"
            "    sums = [int(layout.checksums[f].sum()) for f in ('x', 'y')]\n"
            "print(n, 'zarr' in sys.modules, *sums)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": root}).stdout.split()
    assert out == ["20", "False", str(int(sums["x"].sum())), str(int(sums["y"].sum()))]


def test_a_raw_checksum_chunk_of_the_wrong_size_is_named(make_dataset):
    path = make_dataset({"x": np.zeros((20, 3), np.float32)}, samples_per_block=4)
    add_checksums(path)
    chunk = os.path.join(path, "_checksums", "x", "c", "0")
    with open(chunk, "r+b") as f:
        f.truncate(12)
    with pytest.raises(FormatError, match=rf"cannot read the checksum array of field 'x' \({chunk} is 12 bytes, "
                                          rf"expected 20: 5 raw uint32 values\)"):
        GDSDataset(path, backend="cpu", batch_size=4)


def test_a_raw_whole_array_in_a_chunk_longer_than_itself_reads_as_zarr_reads_it(tmp_path):
    """zarr stores a chunk whole, past the array's end: a 1-D array of 5 values in a raw chunk of 8 holds 8
    values in its file, and reads as its first 5."""
    from gdsload.format.layout import _read_whole

    where = str(tmp_path / "a")
    a = zarr.create_array(where, shape=(5,), chunks=(8,), dtype="uint32", fill_value=0, compressors=None)
    a[:] = np.arange(5, dtype=np.uint32) + 7
    assert os.path.getsize(os.path.join(where, "c", "0")) == 8 * 4
    np.testing.assert_array_equal(_read_whole(where, 5, "cannot read"), np.arange(5, dtype=np.uint32) + 7)


def test_a_file_given_as_a_dataset_is_named_as_a_file(tmp_path):
    """GDSDataset('a.npy') said 'no such dataset directory' for a file that exists."""
    np.save(tmp_path / "a.npy", np.arange(4))
    with pytest.raises(FormatError, match=r"a\.npy: a file, not a dataset directory \(.*gdsload shard"):
        read_metadata(str(tmp_path / "a.npy"))
    with pytest.raises(FormatError, match="no such dataset directory"):
        read_metadata(str(tmp_path / "missing.gds"))
