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


# -- files.py: shard files opened safely and held ----------------------------------------------------------
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def in_thread(fn, timeout_s: float = 5.0):
    """Run ``fn`` on a daemon thread: its result or exception, or a test failure if it does not return in
    time (a regression that blocks fails instead of hanging the suite)."""
    import threading

    out: dict[str, object] = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} still blocked after {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_open_shard_holds_a_regular_file(tmp_path):
    from gdsload.files import open_shard

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
    from gdsload.files import open_shard

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
    from gdsload.files import open_shard

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

    from gdsload.files import open_shard

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
    from gdsload.files import ShardFiles

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
    from gdsload.files import ShardFiles

    good = []
    for i in range(3):
        (tmp_path / f"s{i}").write_bytes(b"x")
        good.append(str(tmp_path / f"s{i}"))
    os.mkfifo(tmp_path / "fifo")
    before = open_fds()
    with pytest.raises(FormatError, match="fifo: shard file is a FIFO"):
        ShardFiles.open(good + [str(tmp_path / "fifo")] + good)
    assert open_fds() == before
