"""Shard files of a converter-written dataset must be laid out exactly as the writer lays them out.

With ``verify`` off nothing reads a block's checksum, so the open's check of the shard index is all that
stands between a damaged file and a wrong sample. The index alone (read once at open) says where every
chunk lies; in a dataset with the ``gdsload`` attribute the chunks must tile the data region in order and
the file must be exactly its chunks plus its index, so a byte inserted, deleted or appended anywhere fails
the open with a FormatError naming the shard file. Foreign stores keep the looser rules (test_format.py).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import zarr

from _helpers import index_edit_refused, rewrite_index
from gdsload import FormatError, GDSDataset
from gdsload.format.shard_index import MAX_UINT_64
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.format.shard_index import chunk_table
from gdsload.conversion.source_types import ArraySource, RaggedSource
from gdsload.conversion.writer import write_dataset


def write(path: str, compress: str | None) -> str:
    """Ten samples, four per block: a uint8 field in shards of two blocks, an int64 field, and a
    variable-length field (its values stay raw even with ``compress``)."""
    lengths = np.arange(10) % 4
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.arange(int(offsets[-1]), dtype=np.int32)
    x = (np.arange(30, dtype=np.uint8) * 7).reshape(10, 3)
    write_dataset(path, {"x": ArraySource("x", x), "idx": ArraySource("idx", np.arange(10) * 3)},
                  ragged={"tok": RaggedSource("tok", ArraySource("tok", values), offsets)},
                  samples_per_block=4, shard_bytes=24, compress=compress, chunk_bytes=12 if compress else None,
                  progress=False)
    return path


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["raw", "zstd"])
def pristine(request, tmp_path_factory) -> str:
    path = write(str(tmp_path_factory.mktemp("tiling") / "ds.gds"), request.param)
    meta = read_metadata(path)
    assert meta.fields["x"].compressed == (request.param is not None)
    return path


def shard_files(path: str) -> list[str]:
    with DatasetLayout(read_metadata(path)) as layout:
        return layout.shard_paths()


def open_fails(path: str, shard: str, what: str, meta=None) -> str:
    """Opening ``path`` (its metadata ``meta`` if given) must fail with a FormatError naming ``shard``;
    returns the message."""
    with pytest.raises(FormatError) as e:
        with DatasetLayout(meta or read_metadata(path)):
            pass
    msg = str(e.value)
    assert msg.startswith(f"{shard}: ") and "\n" not in msg, f"{what}: {msg}"
    return msg


def test_pristine_datasets_open(pristine):
    meta = read_metadata(pristine)
    with DatasetLayout(meta) as layout:
        assert len(layout.shard_paths()) == sum(meta.array(k).num_shards for k in ("x", "idx", "tok/values"))
        assert all((layout.block_offsets[k] >= 0).all() for k in layout.keys)  # the converter writes every chunk


def test_a_byte_inserted_anywhere_in_a_shard_fails_the_open(pristine, tmp_path):
    """Every position of every shard file (data region, index region, and appended at the end), with a
    zero byte and with a copy of the byte before it: without the tiling check, a byte inserted into the
    data region opened and was served."""
    path = str(tmp_path / "ds.gds")
    shutil.copytree(pristine, path)
    meta = read_metadata(path)
    caught = {"data": 0, "index": 0, "end": 0}
    for shard in shard_files(path):
        original = open(shard, "rb").read()
        index_bytes = meta.array(os.path.relpath(shard, path).split("/c/")[0]).index_bytes
        for pos in range(len(original) + 1):
            for byte in (b"\x00", original[pos - 1:pos] or b"\xff"):
                with open(shard, "wb") as f:
                    f.write(original[:pos] + byte + original[pos:])
                open_fails(path, shard, f"{byte!r} inserted at byte {pos} of {shard}", meta)
                where = "end" if pos == len(original) else "index" if pos > len(original) - index_bytes else "data"
                caught[where] += 1
        with open(shard, "wb") as f:
            f.write(original)
    assert min(caught.values()) > 0, caught
    with DatasetLayout(read_metadata(path)):  # restored: opens again
        pass


def test_a_byte_deleted_anywhere_in_a_shard_fails_the_open(pristine, tmp_path):
    path = str(tmp_path / "ds.gds")
    shutil.copytree(pristine, path)
    meta = read_metadata(path)
    for shard in shard_files(path):
        original = open(shard, "rb").read()
        for pos in range(len(original)):
            with open(shard, "wb") as f:
                f.write(original[:pos] + original[pos + 1:])
            open_fails(path, shard, f"byte {pos} of {shard} deleted", meta)
        with open(shard, "wb") as f:
            f.write(original)


def test_appended_index_copy_and_grown_data_region_are_caught(pristine, tmp_path):
    """Bytes that leave a valid index at the end of the file: a copy of the index appended (the old one now
    lies in the data region), and a block of bytes inserted before the index."""
    path = str(tmp_path / "ds.gds")
    shutil.copytree(pristine, path)
    shard = os.path.join(path, "x", "c", "0", "0")
    original = open(shard, "rb").read()
    ib = read_metadata(path).fields["x"].index_bytes
    with open(shard, "ab") as f:
        f.write(original[-ib:])
    msg = open_fails(path, shard, "index appended twice")
    assert f"file is {len(original) + ib} bytes, more than its chunks and index (expected {len(original)} bytes" in msg
    with open(shard, "wb") as f:
        f.write(original[:-ib] + bytes(4096) + original[-ib:])
    with pytest.raises(FormatError, match=f"^{shard}: file is {len(original) + 4096} bytes, more than its chunks"):
        GDSDataset(path, batch_size=2, backend="cpu")


def test_chunks_out_of_order_or_with_gaps_are_refused(tmp_path):
    """Index entries rewritten with a valid crc32c, each chunk still inside the data region and overlapping
    none: the layout the writer never produces is refused, naming the chunk."""
    path = write(str(tmp_path / "ds.gds"), None)
    meta = read_metadata(path)
    fm = meta.fields["x"]
    shard = os.path.join(path, "x", "c", "0", "0")
    original = open(shard, "rb").read()
    bb = fm.stored_bytes  # 12

    refused = index_edit_refused(meta, fm, shard, original)

    refused(lambda t: t.__setitem__(slice(None), [[bb, bb], [0, bb]]),
            rf"chunk 0, the first written, does not start the data region \(expected byte 0, found byte {bb}\)")
    refused(lambda t: t.__setitem__(slice(None), [[0, bb], [MAX_UINT_64, MAX_UINT_64]]),
            rf"file is {len(original)} bytes, more than its chunks and index \(expected {len(original) - bb} bytes: "
            rf"chunk 0, the last written, ends at byte {bb}")
    refused(lambda t: t.__setitem__(slice(None), [[MAX_UINT_64, MAX_UINT_64], [bb, bb]]),
            r"chunk 1, the first written, does not start the data region \(expected byte 0, found byte 12\)")
    # The last shard of x holds one chunk of two: its second index entry must stay never written.
    last = os.path.join(path, "x", "c", "1", "0")
    tail = open(last, "rb").read()
    rewrite_index(last, fm, lambda t: t.__setitem__(1, [0, bb]))
    with open(shard, "wb") as f:
        f.write(original)
    with pytest.raises(FormatError, match=rf"^{last}: index entry 1 lies past the array's last chunk \(expected never "
                                          rf"written, found offset 0, nbytes {bb}\)"):
        DatasetLayout(meta)
    with open(last, "wb") as f:
        f.write(tail)
    with DatasetLayout(meta) as layout:
        assert layout.block_offsets["x"].tolist() == [0, bb, 0]


def test_chunk_table_tiling_rules():
    """The rules on tables alone: a gap between chunks, chunks in another order, a never-written chunk
    between written ones (zarr's, for a chunk equal to the fill value), the index at the start."""
    import dataclasses

    from gdsload.format.arrays import FieldMeta

    fm = FieldMeta(name="x", dtype=np.dtype("uint8"), sample_shape=(4,), fill_value=0, samples_per_block=2,
                   blocks_per_shard=3, index_location="end", key_separator="/", num_rows=6)
    ib, M = fm.index_bytes, MAX_UINT_64  # 52 bytes; chunks of 8
    t = np.array

    def table(rows):
        return t(rows, dtype=np.uint64)

    offsets, lengths = chunk_table("s", table([[0, 8], [8, 8], [16, 8]]), 24 + ib, fm, tiled=True)
    assert offsets.tolist() == [0, 8, 16] and lengths.tolist() == [8, 8, 8]
    offsets, _ = chunk_table("s", table([[0, 8], [M, M], [8, 8]]), 16 + ib, fm, tiled=True)
    assert offsets.tolist() == [0, -1, 8]
    with pytest.raises(FormatError, match=r"^s: chunk 2 does not start where chunk 1 ends \(expected byte 16, found "
                                          r"byte 17\)"):
        chunk_table("s", table([[0, 8], [8, 8], [17, 8]]), 25 + ib, fm, tiled=True)
    with pytest.raises(FormatError, match=r"^s: chunk 1 does not start where chunk 0 ends \(expected byte 8, found "
                                          r"byte 16\)"):
        chunk_table("s", table([[0, 8], [16, 8], [8, 8]]), 24 + ib, fm, tiled=True)
    # foreign rules: the same tables are fine
    assert chunk_table("s", table([[0, 8], [16, 8], [8, 8]]), 24 + ib, fm)[0].tolist() == [0, 16, 8]
    assert chunk_table("s", table([[0, 8], [8, 8], [17, 8]]), 25 + ib, fm)[0].tolist() == [0, 8, 17]
    # the index at the start: the data region begins after it
    start = dataclasses.replace(fm, index_location="start")
    assert chunk_table("s", table([[ib, 8], [ib + 8, 8], [M, M]]), ib + 16, start, n_chunks=2,
                       tiled=True)[0].tolist() == [ib, ib + 8]
    with pytest.raises(FormatError, match=rf"^s: file is {ib + 17} bytes, more than its chunks and index \(expected "
                                          rf"{ib + 16} bytes: chunk 1, the last written, ends at byte {ib + 16}, the "
                                          r"index precedes the chunks\)"):
        chunk_table("s", table([[ib, 8], [ib + 8, 8], [M, M]]), ib + 17, start, n_chunks=2, tiled=True)


def test_zarr_written_gdsload_dataset_tiles(tmp_path):
    """zarr's sharding codec lays shards out as the converter does (index at the end or the start, chunks
    equal to the fill value never written), compressed or not, even after partial writes."""
    path = str(tmp_path / "z.gds")
    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 14, "samples_per_block": 2,
                          "fields": {"a": {}, "b": {}}}
    a = g.create_array("a", shape=(14, 2), dtype="int16", chunks=(2, 2), shards={"shape": (8, 2), "index_location":
                                                                                  "start"}, fill_value=0,
                       compressors=None)
    b = g.create_array("b", shape=(14,), dtype="int32", chunks=(2,), shards=(8,), fill_value=0,
                       compressors=[zarr.codecs.ZstdCodec()])
    data = np.arange(28, dtype=np.int16).reshape(14, 2) + 1
    data[2:4] = 0  # never written
    for lo in (6, 0, 10, 2, 4, 12, 8):  # chunk by chunk, out of order: zarr rewrites each shard whole
        a[lo:lo + 2] = data[lo:lo + 2]
        b[lo:lo + 2] = np.arange(lo, lo + 2) * 1001
    meta = read_metadata(path)
    assert not meta.foreign
    with DatasetLayout(meta, missing_chunks="fill") as layout:
        assert layout.block_offsets["a"][1] == -1 and (layout.block_offsets["a"] >= 0).sum() == 6
        assert (layout.chunk_lengths["b"] > 0).all()


def test_the_check_reads_nothing_more(pristine, monkeypatch):
    """The tiling check works on the index read at open: one read per shard file, as before."""
    import gdsload.format.files as files

    calls: list[str] = []
    real = files.os.pread

    def counting(fd, n, offset):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, n, offset)

    meta = read_metadata(pristine)
    monkeypatch.setattr(files.os, "pread", counting)
    with DatasetLayout(meta) as layout:
        paths = layout.shard_paths()
    monkeypatch.undo()
    shards = sorted(os.path.realpath(p) for p in paths)
    assert sorted(c for c in calls if c in shards) == shards
