"""Hostile datasets: damaged metadata and shard files, files that are not files, and a mutation fuzz.

The contract under test: opening a dataset (``read_metadata`` then ``DatasetLayout``) either succeeds or
raises a GDSLoadError -- a FormatError (also a ValueError) for what is on disk, a ReadError (also an
OSError) for a failed read -- whose one-line message starts with the offending path and ': '; never an
exception of json, numpy or zarr, never a hang, never a descriptor left open.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

from gdsload import GDSLoadError, ReadError
from gdsload.errors import ChecksumError, FormatError
from gdsload.format.shard_index import MAX_UINT_64
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.conversion.source_types import ArraySource, RaggedSource
from gdsload.conversion.writer import write_dataset
from _helpers import add_checksums, in_thread, open_fds, rewrite_index

SHARDS = ("x/c/0/0", "x/c/1/0", "idx/c/0", "idx/c/1", "idx/c/2", "tok/values/c/0")
METADATA = ("zarr.json", "x/zarr.json", "idx/zarr.json", "tok/values/zarr.json", "tok/offsets/zarr.json",
            "_checksums/x/zarr.json", "_checksums/tok/zarr.json")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A tiny dataset with every kind of part: a uint8 field in two shards of two blocks, an int64 field
    in three shards, a variable-length field (values and offsets), and checksum arrays for two fields."""
    path = str(tmp_path_factory.mktemp("hostile") / "ds.gds")
    lengths = np.arange(10) % 4
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.arange(int(offsets[-1]), dtype=np.int32)
    write_dataset(path, {"x": ArraySource("x", np.arange(30, dtype=np.uint8).reshape(10, 3)),
                         "idx": ArraySource("idx", np.arange(10))},
                  ragged={"tok": RaggedSource("tok", ArraySource("tok", values), offsets)},
                  samples_per_block=4, shard_bytes=24, progress=False)
    add_checksums(path, ["x", "tok"])
    for rel in SHARDS + METADATA:
        assert os.path.isfile(os.path.join(path, rel)), rel
    return path


def open_dataset(path: str) -> None:
    """What opening a dataset does to its files: the metadata, then every shard index, offsets and checksums."""
    with DatasetLayout(read_metadata(path)) as layout:
        assert layout.has_checksums is False and set(layout.checksums) == {"x", "tok"}


def test_pristine_dataset_opens(pristine):
    open_dataset(pristine)


# -- helpers that damage a copy -------------------------------------------------------------------------
def edit_json(rel: str, change: Callable[[dict], object]) -> Callable[[str], None]:
    """A mutation: load the JSON at ``rel`` and ``change`` it in place (what it returns is ignored)."""
    def mutate(path: str) -> None:
        p = os.path.join(path, rel)
        with open(p) as f:
            doc = json.load(f)
        change(doc)
        with open(p, "w") as f:
            json.dump(doc, f)
    return mutate


def gds(change: Callable[[dict], object]) -> Callable[[str], None]:
    """A mutation of the group's gdsload attribute."""
    return edit_json("zarr.json", lambda d: change(d["attributes"]["gdsload"]))


def write_text(rel: str, text: str | bytes) -> Callable[[str], None]:
    def mutate(path: str) -> None:
        with open(os.path.join(path, rel), "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
    return mutate


def replace_with(rel: str, make: Callable[[str], None]) -> Callable[[str], None]:
    """Remove the file at ``rel`` and let ``make(full_path)`` put something else there."""
    def mutate(path: str) -> None:
        p = os.path.join(path, rel)
        os.remove(p)
        make(p)
    return mutate


def index_edit(rel: str, change: Callable[[np.ndarray], None]) -> Callable[[str], None]:
    """Change a shard's index table and store it with a valid crc32c."""
    def mutate(path: str) -> None:
        key = rel.split("/c/")[0]
        rewrite_index(os.path.join(path, rel), read_metadata(path).array(key), change)
    return mutate


def set_entry(chunk: int, column: int, value: int) -> Callable[[np.ndarray], None]:
    return lambda t: t.__setitem__((chunk, column), value)


def codec(doc: dict) -> dict:
    return doc["codecs"][0]["configuration"]


def both(*mutations: Callable[[str], None]) -> Callable[[str], None]:
    def mutate(path: str) -> None:
        for m in mutations:
            m(path)
    return mutate


def deep(n: int) -> str:
    return '{"a": ' * n + "1" + "}" * n


def shape_1e15(doc: dict) -> None:
    doc["shape"] = [10**15, 3]


def blocks_of(doc: dict, rows: int) -> None:
    """Inner chunks of ``rows`` samples, as many per shard as before."""
    grid, chunk = doc["chunk_grid"]["configuration"]["chunk_shape"], codec(doc)["chunk_shape"]
    grid[0], chunk[0] = grid[0] // chunk[0] * rows, rows


def flip_crc(rel: str) -> Callable[[str], None]:
    def mutate(path: str) -> None:
        with open(os.path.join(path, rel), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x40]))
    return mutate


def truncate(rel: str, size: int) -> Callable[[str], None]:
    return lambda path: os.truncate(os.path.join(path, rel), size)


def unreadable(rel: str) -> Callable[[str], None]:
    """chmod 000. Root reads such a file anyway, so as root the open is also made to fail as it would for
    anyone else (EACCES), which is what the check is about: how the refusal reads."""
    def mutate(path: str) -> None:
        p = os.path.join(path, rel)
        os.chmod(p, 0)
        if os.geteuid() == 0:
            real_open = os.open

            def refusing_open(name, flags, *args, **kwargs):
                if os.fspath(name) == p:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
                return real_open(name, flags, *args, **kwargs)

            PATCHES.append((os, "open", real_open))
            os.open = refusing_open
    return mutate


def failing_read(rel: str) -> Callable[[str], None]:
    """Reads of one shard fail with EIO (a dying disk): an I/O error, so a ReadError."""
    def mutate(path: str) -> None:
        p = os.path.realpath(os.path.join(path, rel))
        real_pread = os.pread

        def pread(fd, n, offset):
            if os.readlink(f"/proc/self/fd/{fd}") == p:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_pread(fd, n, offset)

        PATCHES.append((os, "pread", real_pread))
        os.pread = pread
    return mutate


PATCHES: list[tuple[object, str, object]] = []  # undone after each case

X, G, OFF, CX = "x/zarr.json", "zarr.json", "tok/offsets/zarr.json", "_checksums/x/zarr.json"

# id: (mutation, path the message starts with, fragment it holds, error type)
CASES: dict[str, tuple[Callable[[str], None], str, str, type]] = {
    # the group's zarr.json
    "group not json": (write_text(G, '{"zarr_format": 3,'), G, "not valid JSON (JSONDecodeError", FormatError),
    "group not utf-8": (write_text(G, b"\xff\xfe{}"), G, "not valid JSON", FormatError),
    "group a json list": (write_text(G, "[]"), G, "the metadata must be an object (found [])", FormatError),
    "group nested too deep": (write_text(G, deep(100_000)), G, "not valid JSON (RecursionError", FormatError),
    "group missing": (lambda p: os.remove(os.path.join(p, G)), G, "missing (not a Zarr v3 group or array; ",
                      FormatError),
    "group too large": (write_text(G, " " * (17 << 20)), G, "zarr.json is 17825792 bytes (expected at most",
                        FormatError),
    "group is a fifo": (replace_with(G, os.mkfifo), G, "zarr.json is a FIFO", FormatError),
    "zarr v2": (edit_json(G, lambda d: d.update(zarr_format=2)), G, "not a Zarr v3 group", FormatError),
    "node type array": (edit_json(G, lambda d: d.update(node_type="array")), G, "shape must be a list", FormatError),
    "attributes a list": (edit_json(G, lambda d: d.update(attributes=[])), G, "attributes must be an object",
                          FormatError),
    "no gdsload entry": (edit_json(G, lambda d: d["attributes"].pop("gdsload")), G,
                         "a group without the 'gdsload' attribute holding _checksums/, a gdsload dataset's",
                         FormatError),
    "gdsload a string": (edit_json(G, lambda d: d["attributes"].update(gdsload="1")), G,
                         "attribute 'gdsload' must be an object", FormatError),
    "format 2": (gds(lambda a: a.update(format=2)), G, "unsupported format version (expected 1, found 2)", FormatError),
    "format true": (gds(lambda a: a.update(format=True)), G, "unsupported format version (expected 1, found True)",
                    FormatError),
    "num_samples a string": (gds(lambda a: a.update(num_samples="10")), G,
                             "gdsload.num_samples must be an integer (found '10')", FormatError),
    "num_samples true": (gds(lambda a: a.update(num_samples=True)), G, "num_samples must be an integer (found True)",
                         FormatError),
    "num_samples float": (gds(lambda a: a.update(num_samples=10.0)), G, "must be an integer (found 10.0)", FormatError),
    "num_samples nan": (gds(lambda a: a.update(num_samples=float("nan"))), G, "must be an integer (found nan)",
                        FormatError),
    "num_samples negative": (gds(lambda a: a.update(num_samples=-3)), G, "must be at least 1 (found -3)", FormatError),
    "num_samples missing": (gds(lambda a: a.pop("num_samples")), G, "must be an integer (found None)", FormatError),
    "num_samples not the arrays'": (gds(lambda a: a.update(num_samples=9)), X,
                                    "expected 9 samples on axis 0, found shape (10, 3)", FormatError),
    "samples_per_block 0": (gds(lambda a: a.update(samples_per_block=0)), G, "samples_per_block must be at least 1",
                            FormatError),
    "samples_per_block not the chunks'": (gds(lambda a: a.update(samples_per_block=2)), X,
                                          "inner chunk shape must be (2, 3), found (4, 3)", FormatError),
    "fields empty": (gds(lambda a: a.update(fields={})), G, "gdsload.fields is empty", FormatError),
    "fields a list": (gds(lambda a: a.update(fields=["x"])), G, "gdsload.fields must be an object", FormatError),
    "field kind unknown": (gds(lambda a: a["fields"].update(x={"kind": "jagged"})), G,
                           "field 'x' has unknown kind 'jagged'", FormatError),
    "field entry a number": (gds(lambda a: a["fields"].update(x=3)), G, "gdsload.fields.x must be an object",
                             FormatError),
    "field name escapes": (gds(lambda a: a["fields"].update({"../x": {}})), G, "invalid field name '../x'",
                           FormatError),
    "field without array": (gds(lambda a: a["fields"].update(ghost={})), "ghost/zarr.json",
                            "missing (field 'ghost' is listed in the group attributes", FormatError),
    "checksum algorithm": (gds(lambda a: a["checksums"].update(algorithm="md5")), G,
                           "unsupported checksum algorithm 'md5' (expected 'crc32c')", FormatError),
    "checksum unknown field": (gds(lambda a: a["checksums"]["arrays"].update(y="_checksums/x")), G,
                               "checksums names an unknown field 'y'", FormatError),
    "checksum path escapes": (gds(lambda a: a["checksums"]["arrays"].update(x="../../etc")), G,
                              "checksum array of field 'x' must be a relative path inside the dataset", FormatError),
    "checksum path a number": (gds(lambda a: a["checksums"]["arrays"].update(x=5)), G,
                               "must be a relative path inside the dataset (found 5)", FormatError),
    "checksums a list": (gds(lambda a: a.update(checksums=[])), G, "gdsload.checksums must be an object", FormatError),
    # a key the format does not know is refused, never ignored: a misspelled 'checksums' read as "no checksums"
    "checksums misspelled": (gds(lambda a: a.update(checksum=a.pop("checksums"))), G,
                             "attribute 'gdsload' has unknown key 'checksum' (expected keys among ['format', "
                             "'num_samples', 'samples_per_block', 'fields', 'checksums']", FormatError),
    "unknown top-level key": (gds(lambda a: a.update(shuffle_hint=1)), G,
                              "attribute 'gdsload' has unknown key 'shuffle_hint'", FormatError),
    "field entry unknown key": (gds(lambda a: a["fields"]["x"].update(knd="ragged")), G,
                                "gdsload.fields.x has unknown key 'knd' (expected keys among ['kind', 'image']",
                                FormatError),
    "checksums unknown key": (gds(lambda a: a["checksums"].update(array={"x": "_checksums/x"})), G,
                              "gdsload.checksums has unknown key 'array' (expected keys among ['algorithm', "
                              "'arrays']", FormatError),
    # an array's zarr.json
    "array not json": (write_text(X, "{"), X, "not valid JSON", FormatError),
    "array shape missing": (edit_json(X, lambda d: d.pop("shape")), X, "shape must be a list", FormatError),
    "array shape negative": (edit_json(X, lambda d: d.update(shape=[-10, 3])), X, "shape must be a list", FormatError),
    "array shape of 1e15": (both(gds(lambda a: a.update(num_samples=10**15)), edit_json(X, shape_1e15),
                                 edit_json("idx/zarr.json", lambda d: d.update(shape=[10**15])),
                                 gds(lambda a: a.pop("checksums")), gds(lambda a: a["fields"].pop("tok")),
                                 lambda p: shutil.rmtree(os.path.join(p, "_checksums"))),
                            X, "expected 125000000000000 shard files, found 2", FormatError),
    "array unknown dtype": (edit_json(X, lambda d: d.update(data_type="float128")), X,
                            "unsupported data type 'float128'", FormatError),
    "array dtype an object": (edit_json(X, lambda d: d.update(data_type={"name": "uint8"})), X,
                              "unsupported data type {'name': 'uint8'}", FormatError),
    "array node type group": (edit_json(X, lambda d: d.update(node_type="group")), X, "not a Zarr v3 array",
                              FormatError),
    "inner chunk 0": (edit_json(X, lambda d: codec(d).update(chunk_shape=[0, 3])), X,
                      "inner chunk_shape must be a list of 2 integers of at least 1", FormatError),
    "shard not whole blocks": (edit_json(X, lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[6, 3])), X,
                               "shards must split axis 0 only, in whole blocks of 4", FormatError),
    "shard shape 0": (edit_json(X, lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[0, 3])), X,
                      "chunk_grid chunk_shape must be a list of 2 integers of at least 1", FormatError),
    "fill value nan for uint8": (edit_json(X, lambda d: d.update(fill_value="NaN")), X, "zarr refuses the array",
                                 FormatError),
    "fill value a word": (edit_json(X, lambda d: d.update(fill_value="abc")), X, "zarr refuses the array",
                          FormatError),
    "compressed chunks": (edit_json(X, lambda d: codec(d)["codecs"].append({"name": "gzip"})), X,
                          "inner chunks must be raw ('bytes' codec only) or 'bytes' then 'zstd'", FormatError),
    "no sharding codec": (edit_json(X, lambda d: d.update(codecs=[{"name": "bytes"}])), X,
                          "expected one sharding_indexed codec, found ['bytes']", FormatError),
    "codecs not a list": (edit_json(X, lambda d: d.update(codecs="sharding_indexed")), X, "codecs must be a list",
                          FormatError),
    "index without crc": (edit_json(X, lambda d: codec(d)["index_codecs"].pop()), X,
                          "shard index codecs must be ['bytes', 'crc32c'], found ['bytes']", FormatError),
    "index big endian": (edit_json(X, lambda d: codec(d)["index_codecs"][0].update(configuration={"endian": "big"})),
                         X, "shard index must be little endian", FormatError),
    "values big endian": (edit_json("idx/zarr.json",
                                    lambda d: codec(d)["codecs"][0].update(configuration={"endian": "big"})),
                          "idx/zarr.json", "inner chunks must be little endian, found big", FormatError),
    "index location unknown": (edit_json(X, lambda d: codec(d).update(index_location="middle")), X,
                               "index_location must be 'end' or 'start'", FormatError),
    "chunk key encoding v2": (edit_json(X, lambda d: d.update(chunk_key_encoding={"name": "v2"})), X,
                              "expected the default chunk key encoding, found 'v2'", FormatError),
    "chunk key separator": (edit_json(X, lambda d: d["chunk_key_encoding"].update(configuration={"separator": "-"})),
                            X, "chunk key separator must be '/' or '.'", FormatError),
    "storage transformer": (edit_json(X, lambda d: d.update(storage_transformers=[{"name": "x"}])), X,
                            "storage transformers are not supported", FormatError),
    "blocks of 3e30 bytes": (both(gds(lambda a: a.update(samples_per_block=10**30)),
                                  edit_json(X, lambda d: blocks_of(d, 10**30)),
                                  edit_json("idx/zarr.json", lambda d: blocks_of(d, 10**30))),
                             "x/c/0/0", f"chunk 0 is 12 bytes (expected {3 * 10**30}: raw", FormatError),
    "zero-size samples": (both(edit_json(X, lambda d: d.update(shape=[10, 0])),
                               edit_json(X, lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[8, 0])),
                               edit_json(X, lambda d: codec(d).update(chunk_shape=[4, 0]))),
                          X, "chunk_grid chunk_shape must be a list of 2 integers of at least 1", FormatError),
    # offsets of the variable-length field
    "offsets wrong length": (edit_json(OFF, lambda d: d.update(shape=[12])), OFF, "expected 11 integer offsets",
                             FormatError),
    "offsets float": (edit_json(OFF, lambda d: d.update(data_type="float64")), OFF, "expected 11 integer offsets",
                      FormatError),
    "offsets huge chunks": (edit_json(OFF, lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[10**12])),
                            OFF, "chunks of 1000000000000 elements for an array of 11", FormatError),
    "offsets decreasing": (lambda p: _write_offsets(p, [0, 1, 3, 2, 3, 4, 6, 9, 9, 10, 12]), "tok/offsets",
                           "offsets must start at 0, never decrease", FormatError),
    "offsets chunk a fifo": (replace_with("tok/offsets/c/0", os.mkfifo), "tok/offsets/c/0", "chunk file is a FIFO",
                             FormatError),
    "offsets chunk garbage": (write_text("tok/offsets/c/0", b"\x00" * 5), "tok/offsets", "cannot read the offsets",
                              FormatError),
    # checksum arrays
    "checksums uint64": (edit_json(CX, lambda d: d.update(data_type="uint64")), CX,
                         "expected the checksums of field 'x': (3,) uint32, found shape [3] of 'uint64'", FormatError),
    "checksums wrong shape": (edit_json(CX, lambda d: d.update(shape=[4])), CX, "found shape [4] of 'uint32'",
                              FormatError),
    "checksums chunk gone": (lambda p: os.remove(os.path.join(p, "_checksums/x/c/0")), "_checksums/x",
                             "holds no stored chunks", FormatError),
    "checksums array gone": (lambda p: shutil.rmtree(os.path.join(p, "_checksums/x")), CX,
                             "missing (field 'x' names it as its checksum array)", FormatError),
    # shard files
    "shard missing": (lambda p: os.remove(os.path.join(p, "x/c/1/0")), "x/c/1/0", "shard file is missing",
                      FormatError),
    "shard files missing": (lambda p: shutil.rmtree(os.path.join(p, "idx/c")), "idx/zarr.json",
                            "expected 3 shard files, found 0", FormatError),
    "shard smaller than index": (truncate("x/c/0/0", 10), "x/c/0/0",
                                 "shard file is 10 bytes, smaller than its index (36 bytes)", FormatError),
    "shard empty": (truncate("idx/c/1", 0), "idx/c/1", "shard file is 0 bytes", FormatError),
    "shard index crc": (flip_crc("x/c/1/0"), "x/c/1/0", "shard index checksum mismatch", ChecksumError),
    "shard chunk past end": (index_edit("idx/c/0", set_entry(0, 0, 40)), "idx/c/0",
                             "chunk 0 ends at byte 72, past the end of the file (52 bytes)", FormatError),
    "shard chunk over index": (index_edit("x/c/0/0", set_entry(1, 0, 13)), "x/c/0/0",
                               "chunk 1 (bytes 13..25) overlaps the shard index (bytes 24..60)", FormatError),
    "shard chunks overlap": (index_edit("x/c/0/0", set_entry(1, 0, 6)), "x/c/0/0",
                             "chunks 0 and 1 overlap (chunk 1 starts at byte 6, before chunk 0 ends at byte 12)",
                             FormatError),
    "shard chunk wrong size": (index_edit("x/c/0/0", set_entry(0, 1, 11)), "x/c/0/0",
                               "chunk 0 is 11 bytes (expected 12", FormatError),
    "shard chunk offset max": (index_edit("x/c/0/0", set_entry(0, 0, MAX_UINT_64)), "x/c/0/0",
                               f"chunk 0 ends at byte {MAX_UINT_64 + 12}, past the end", FormatError),
    "shard all chunks missing": (index_edit("tok/values/c/0", lambda t: t.fill(MAX_UINT_64)), "tok/values/c/0",
                                 "shard index marks all 1 chunks as never written", FormatError),
    "shard is a fifo": (replace_with("x/c/0/0", os.mkfifo), "x/c/0/0", "shard file is a FIFO (expected a regular file)",
                        FormatError),
    "shard is a directory": (replace_with("idx/c/2", os.mkdir), "idx/c/2", "shard file is a directory", FormatError),
    "shard is a symlink loop": (replace_with("idx/c/0", lambda p: os.symlink(p, p)), "idx/c/0",
                                "shard file is a symlink loop", FormatError),
    "shard is a device": (replace_with("idx/c/0", lambda p: os.symlink("/dev/zero", p)), "idx/c/0",
                          "shard file is a character device (expected a regular file)", FormatError),
    "shard unreadable": (unreadable("x/c/1/0"), "x/c/1/0", "shard file is not readable (permission denied)",
                         FormatError),
    "shard read fails": (failing_read("idx/c/1"), "idx/c/1",
                         "read of 20 bytes at offset 32 failed (OSError: [Errno 5] Input/output error)", ReadError),
}


def _write_offsets(path: str, values: list[int]) -> None:
    import zarr

    zarr.open_array(os.path.join(path, "tok", "offsets"), mode="r+")[:] = np.array(values, dtype=np.int64)


BUILTIN = {FormatError: ValueError, ReadError: OSError, ChecksumError: ValueError}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_dataset(case, pristine, tmp_path):
    mutate, rel, fragment, error = CASES[case]
    path = str(tmp_path / "ds.gds")
    shutil.copytree(pristine, path, symlinks=True)
    before = open_fds()
    try:
        mutate(path)
        with pytest.raises(GDSLoadError) as info:
            in_thread(lambda: open_dataset(path))
    finally:
        while PATCHES:
            owner, name, real = PATCHES.pop()
            setattr(owner, name, real)
    e, msg = info.value, str(info.value)
    assert type(e) is error and isinstance(e, BUILTIN[error]), f"{type(e).__name__}: {msg}"
    assert msg.startswith(os.path.join(path, rel) + ": "), msg
    assert fragment in msg and "\n" not in msg, msg
    assert open_fds() == before


def test_at_least_thirty_distinct_hostile_datasets():
    assert len(CASES) >= 30


# -- mutation fuzz --------------------------------------------------------------------------------------
ODD_VALUES = [None, True, False, 0, -1, 1, 2, 3, 4, 7, 2**31, 2**63, 2**64, 10**15, -10**15, 10**30, 1.5, -0.0,
              float("nan"), float("inf"), "", "x", "NaN", "uint8", "int64", "uint32", "float32", "bytes", "crc32c",
              "sharding_indexed", "regular", "default", "end", "start", "/", ".", "..", "../x", "fixed", "ragged",
              [], [1], [0, 0], [4, 3], [10**15], [-1], {}, {"name": "bytes"}, {"kind": "ragged"}]


def _nodes(doc, at=()):
    """Every (path, value) in a JSON document, the root included."""
    yield at, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, at + (i,))


def _odd(rng: np.random.Generator):
    return ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]


def mutate_json(raw: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One random change of a zarr.json: its text damaged, or one node removed, replaced, bent or grown."""
    if rng.random() < 0.1:
        text = bytearray(raw)
        op = int(rng.integers(3))
        i = int(rng.integers(len(text)))
        if op == 0:
            text[i] ^= 1 << int(rng.integers(8))
            return bytes(text), f"flip a bit of byte {i}"
        if op == 1:
            return bytes(text[:i]), f"cut at byte {i}"
        return bytes(text[:i]) + b'{"[' + bytes(text[i:]), f"insert garbage at byte {i}"
    doc = json.loads(raw)
    nodes = list(_nodes(doc))
    at, value = nodes[int(rng.integers(len(nodes)))]
    op = int(rng.integers(4))
    if op == 0 and at:
        new = "<removed>"
    elif op == 1 and isinstance(value, (int, float)) and not isinstance(value, bool):
        new = [value + 1, value - 1, -value, value * 1000, 0, value * 10**13][int(rng.integers(6))]
    elif op == 2 and isinstance(value, (dict, list)):
        new = value.copy()
        if isinstance(new, dict):
            new[str(_odd(rng))] = _odd(rng)
        elif new and rng.random() < 0.5:
            new.pop(int(rng.integers(len(new))))
        else:
            new.append(_odd(rng))
    else:
        new = _odd(rng)
    if not at:
        doc = new if new != "<removed>" else None
    else:
        parent = doc
        for k in at[:-1]:
            parent = parent[k]
        if new == "<removed>":
            del parent[at[-1]]
        else:
            parent[at[-1]] = new
    return json.dumps(doc).encode(), f"{'/'.join(map(str, at))} -> {_show(new)}"


def _show(v) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def mutate_shard(raw: bytes, index_bytes: int, rng: np.random.Generator) -> tuple[bytes, str]:
    """One random change of a shard file: bits of its index flipped, cut, grown, or an entry of the index
    changed and the crc32c recomputed (so the layout's own checks must catch it)."""
    import crc32c

    op = int(rng.integers(5))
    data = bytearray(raw)
    if op == 0:
        i = len(data) - 1 - int(rng.integers(min(index_bytes, len(data))))
        data[i] ^= 1 << int(rng.integers(8))
        return bytes(data), f"flip a bit of byte {i}"
    if op == 1:
        n = int(rng.integers(len(data)))
        return bytes(data[:n]), f"cut to {n} bytes"
    if op == 2:
        n = int(rng.integers(1, 100))
        return bytes(data) + rng.bytes(n), f"grow by {n} bytes"
    table = np.frombuffer(bytes(data[-index_bytes:-4]), dtype="<u8").reshape(-1, 2).copy()
    if op == 3:
        chunk, col = int(rng.integers(len(table))), int(rng.integers(2))
        choices = [0, 1, 12, 13, 20, 32, 36, 52, len(data), len(data) - index_bytes, MAX_UINT_64, MAX_UINT_64 - 1,
                   2**63, int(table[chunk, col]) + 1, int(table[chunk, col]) - 1]
        table[chunk, col] = choices[int(rng.integers(len(choices)))] % 2**64
        what = f"index entry ({chunk}, {col}) -> {int(table[chunk, col])}"
    else:
        table = table[rng.permutation(len(table))]
        what = "index entries shuffled"
    body = table.astype("<u8").tobytes()
    return bytes(data[:-index_bytes]) + body + struct.pack("<I", crc32c.crc32c(body)), what


SIZES = [1, 2, 3, 5, 9, 11, 16, 10**6, 2**32 + 1, 10**15, 2**63, 10**30]


def mutate_coherent(docs: dict[str, dict], rng: np.random.Generator) -> tuple[dict[str, bytes], str]:
    """One size changed consistently in every zarr.json that states it (sample count, samples per block,
    blocks per shard, or a sample shape), so the change gets past the cross-checks to the layout's."""
    docs = json.loads(json.dumps(docs))  # a deep copy
    gds, x, idx = docs["zarr.json"]["attributes"]["gdsload"], docs["x/zarr.json"], docs["idx/zarr.json"]
    size = SIZES[int(rng.integers(len(SIZES)))]
    op = int(rng.integers(4))
    grids = [d["chunk_grid"]["configuration"]["chunk_shape"] for d in (x, idx)]
    inner = [d["codecs"][0]["configuration"]["chunk_shape"] for d in (x, idx)]
    if op == 0:
        what = f"num_samples -> {size}"
        gds["num_samples"] = x["shape"][0] = idx["shape"][0] = size
        docs["tok/offsets/zarr.json"]["shape"] = [size + 1]
    elif op == 1:
        what = f"samples_per_block -> {size}"
        for grid, chunk in zip(grids, inner):
            grid[0] = grid[0] // chunk[0] * size
            chunk[0] = size
        gds["samples_per_block"] = size
    elif op == 2:
        what = f"blocks per shard of idx -> {size}"
        grids[1][0] = inner[1][0] * size
    else:
        what = f"sample shape of x -> ({size},)"
        x["shape"][1] = grids[0][1] = inner[0][1] = size
    blocks = -(-gds["num_samples"] // gds["samples_per_block"])
    for rel in ("_checksums/x/zarr.json", "_checksums/tok/zarr.json"):
        docs[rel]["shape"] = docs[rel]["chunk_grid"]["configuration"]["chunk_shape"] = [blocks]
    return {rel: json.dumps(doc).encode() for rel, doc in docs.items()}, what


def fuzz(pristine: str, work: str, seed: int, count: int, per_case_s: float = 5.0) -> dict[str, int]:
    """``count`` mutations of a copy of ``pristine``, each applied alone and undone; returns outcome counts,
    and fails on the first outcome outside the contract (naming seed, case and mutation to replay it)."""
    path = os.path.join(work, "ds.gds")
    shutil.copytree(pristine, path)
    meta = read_metadata(path)
    index_bytes = {rel: meta.array(rel.split("/c/")[0]).index_bytes for rel in SHARDS}
    originals = {rel: open(os.path.join(path, rel), "rb").read() for rel in SHARDS + METADATA}
    docs = {rel: json.loads(originals[rel]) for rel in METADATA}
    outcomes = {"opened": 0}
    before = open_fds()
    with ThreadPoolExecutor(1, thread_name_prefix="fuzz") as pool:
        for case in range(count):
            rng = np.random.default_rng([seed, case])
            kind = rng.random()
            if kind < 0.5:
                rel = METADATA[int(rng.integers(len(METADATA)))]
                mutated, what = mutate_json(originals[rel], rng)
                changed = {rel: mutated}
            elif kind < 0.65:
                changed, what = mutate_coherent(docs, rng)
                rel = "metadata"
            else:
                rel = SHARDS[int(rng.integers(len(SHARDS)))]
                mutated, what = mutate_shard(originals[rel], index_bytes[rel], rng)
                changed = {rel: mutated}
            where = f"seed {seed} case {case}: {rel}: {what}"
            for name, data in changed.items():
                with open(os.path.join(path, name), "wb") as f:
                    f.write(data)
            t0 = time.monotonic()
            future = pool.submit(_open_and_close, path)
            try:
                future.result(timeout=per_case_s)
                outcomes["opened"] += 1
            except FutureTimeout:
                pytest.fail(f"{where}: still opening after {per_case_s} s")
            except GDSLoadError as e:
                msg = str(e)
                assert "\n" not in msg and msg.startswith(path) and ": " in msg, f"{where}: message {msg!r}"
                outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
            except BaseException as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"{where}: {type(e).__name__} escaped: {e}\n{traceback.format_exc()}")
            assert time.monotonic() - t0 < per_case_s, where
            for name in changed:
                with open(os.path.join(path, name), "wb") as f:
                    f.write(originals[name])
    assert open_fds() == before, "descriptors left open"
    return outcomes


def _open_and_close(path: str) -> None:
    with DatasetLayout(read_metadata(path)):
        pass


def test_mutation_fuzz(pristine, tmp_path):
    outcomes = fuzz(pristine, str(tmp_path), seed=20240611, count=300)
    caught = {name: outcomes.get(name, 0) for name in ("FormatError", "ReadError", "ChecksumError")}
    assert outcomes["opened"] + sum(caught.values()) == 300
    # most mutations break something, and are caught as such (a ChecksumError is also a FormatError)
    assert caught["FormatError"] + caught["ChecksumError"] > 150


@pytest.mark.slow
def test_mutation_fuzz_long(pristine, tmp_path, request):
    if "slow" not in (request.config.getoption("markexpr") or "") and not os.environ.get("GDSLOAD_SLOW"):
        pytest.skip("10,000 mutations: run with -m slow (or GDSLOAD_SLOW=1)")
    seed = int(os.environ.get("GDSLOAD_FUZZ_SEED", "7"))  # another seed explores further
    outcomes = fuzz(pristine, str(tmp_path), seed=seed, count=10_000)
    assert sum(outcomes.values()) == 10_000
