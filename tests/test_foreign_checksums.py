"""A Zarr store's own checksums are honoured: the ``crc32c`` codec of raw and compressed chunks, and the
sharding index's crc32c, checked before a sample is served, whatever ``verify`` says (as zarr-python
does); ``gdsload verify`` checks whatever a store carries.

The corruption matrix: stores written by zarr-python (raw + crc32c, zstd + crc32c; sharded and unsharded)
with one chunk flipped, a byte inserted into it, or the file truncated, and a sharded store whose index is
flipped. Every one either fails with a GDSLoadError or serves exact data: a damaged sample is never served.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from gdsload import ChecksumError, GDSDataset, GDSLoadError
from gdsload.tools.cli import main as cli_main
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata

N, ROWS, TAIL = 96, 8, (16,)
CODECS = {"raw+crc32c": [Crc32cCodec()], "zstd+crc32c": [ZstdCodec(level=1), Crc32cCodec()]}
DAMAGE = ["flip", "insert", "truncate"]
CHUNK = 5  # the damaged chunk of "x"


def build(path: str, codecs: str, sharded: bool) -> np.ndarray:
    """A group of ``x`` (with the codec chain ``codecs``) and ``id`` (no checksum); returns x's data."""
    g = zarr.create_group(path)
    x = (np.arange(N, dtype=np.int32)[:, None] * 1000 + np.arange(TAIL[0], dtype=np.int32)).astype(np.int32)
    a = g.create_array("x", shape=x.shape, dtype="int32", chunks=(ROWS, *TAIL),
                       shards=(ROWS * 4, *TAIL) if sharded else None, compressors=CODECS[codecs])
    a[:] = x
    ids = g.create_array("id", shape=(N,), dtype="int64", chunks=(ROWS,), compressors=None)
    ids[:] = np.arange(N)
    return x


def damage(path: str, how: str) -> str:
    """Damage chunk CHUNK of ``x``: flip or insert a byte inside its stored bytes, or cut the file it lies in
    by 7 bytes (a sharded file loses part of its index, an unsharded one part of the chunk). Returns the file."""
    with DatasetLayout(read_metadata(path, ["x"]), ("x",)) as layout:
        loc = layout.locate("x", CHUNK)
    with open(loc.path, "r+b") as f:
        data = bytearray(f.read())
        at = loc.offset + 3
        if how == "flip":
            data[at] ^= 0x20
        elif how == "insert":
            data[at:at] = b"\x5a"
        elif how == "index":  # the shard index sits at the end of the file
            data[-9] ^= 0x01
        else:
            del data[-7:]
        f.seek(0)
        f.truncate()
        f.write(bytes(data))
    return loc.path


def host(a):
    """A batch's array on the host (a CuPy array from a GPU backend copied back)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def served_until_error(path: str, x: np.ndarray, backend: str = "cpu", **options) -> GDSLoadError | None:
    """Iterate the store; every sample served must be exact. Returns the error that ended it, if any."""
    try:
        with GDSDataset(path, batch_size=12, fields=["x", "id"], backend=backend, shuffle=True, **options) as ds:
            for batch in ds:
                np.testing.assert_array_equal(host(batch["x"]), x[host(batch["id"])])
    except GDSLoadError as e:
        return e
    return None


@pytest.fixture(params=[True, False], ids=["sharded", "unsharded"])
def sharded(request):
    return request.param


@pytest.mark.parametrize("resident_bytes", [0, 1 << 20], ids=["windowed", "resident"])
@pytest.mark.parametrize("codecs", list(CODECS))
@pytest.mark.parametrize("verify", [None, False])
def test_a_flipped_chunk_is_a_checksum_error_naming_file_field_and_chunk(tmp_path, codecs, sharded, verify,
                                                                         resident_bytes):
    path = str(tmp_path / "s.zarr")
    x = build(path, codecs, sharded)
    assert served_until_error(path, x, resident_bytes=resident_bytes) is None  # sound: read exactly
    shard = damage(path, "flip")
    e = served_until_error(path, x, verify=verify, resident_bytes=resident_bytes)
    assert isinstance(e, ChecksumError), e
    msg = str(e)
    assert msg.startswith(f"{shard}: chunk {CHUNK}"), msg
    assert "'x'" in msg and "offset" in msg and "crc32c" in msg and "\n" not in msg


@pytest.mark.parametrize("how", ["insert", "truncate"])
@pytest.mark.parametrize("codecs", list(CODECS))
def test_inserted_or_truncated_bytes_never_serve_a_wrong_sample(tmp_path, codecs, sharded, how):
    path = str(tmp_path / "s.zarr")
    x = build(path, codecs, sharded)
    shard = damage(path, how)
    e = served_until_error(path, x, resident_bytes=0)
    assert e is not None and str(e).startswith(shard), e


def test_a_flipped_shard_index_is_a_checksum_error_at_open(tmp_path):
    path = str(tmp_path / "s.zarr")
    build(path, "raw+crc32c", True)
    shard = damage(path, "index")
    with pytest.raises(ChecksumError, match=f"^{shard}: shard index checksum mismatch"):
        GDSDataset(path, batch_size=12, backend="cpu")


@pytest.mark.parametrize("how", [*DAMAGE, "index"])
@pytest.mark.parametrize("codecs", list(CODECS))
def test_gdsload_verify_finds_every_damage_and_names_fields_without_checksums(tmp_path, codecs, sharded, how,
                                                                              capsys):
    if how == "index" and not sharded:
        pytest.skip("an unsharded array has no index")
    path = str(tmp_path / "s.zarr")
    build(path, codecs, sharded)
    assert cli_main(["verify", path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "field(s) ['id'] carry no checksum: not checked" in out
    chunks = N // ROWS
    assert f"{chunks} chunk(s) checked, 0 bad" in out
    shard = damage(path, how)
    assert cli_main(["verify", path, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {shard}" in out, out
    if how == "flip":
        assert f"BAD {shard}: chunk {CHUNK} of" in out and "crc32c" in out


def test_verify_true_names_the_fields_that_carry_no_checksum(tmp_path):
    path = str(tmp_path / "s.zarr")
    x = build(path, "raw+crc32c", True)
    with pytest.raises(ValueError, match=r"field\(s\) \['id'\] carry no checksum \(its chunks have no crc32c"):
        GDSDataset(path, batch_size=12, backend="cpu", verify=True)
    with GDSDataset(path, batch_size=12, fields=["x"], backend="cpu", verify=True) as ds:
        got = np.concatenate([b["x"] for b in ds])
    np.testing.assert_array_equal(got, x)


def test_the_stored_checksum_itself_flipped_is_caught(tmp_path):
    """The 4 bytes after a raw chunk are its crc32c: damage there is caught as well as in the data."""
    path = str(tmp_path / "s.zarr")
    x = build(path, "raw+crc32c", False)
    with DatasetLayout(read_metadata(path, ["x"]), ("x",)) as layout:
        loc = layout.locate("x", CHUNK)
    with open(loc.path, "r+b") as f:
        f.seek(os.path.getsize(loc.path) - 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    assert isinstance(served_until_error(path, x, resident_bytes=0), ChecksumError)
