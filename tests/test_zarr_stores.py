"""Zarr v3 stores written by zarr-python (no gdsload attribute) read exactly: groups of arrays with chunks of
their own sizes, sharded and unsharded, every chunk key encoding, partial writes, nested arrays, a single
array, field selection, compressed chunks (zstd, zstd + crc32c, gzip, blosc, numcodecs' zlib); unreadable
arrays refused by name.

Every sample is checked against the numpy data it was written from, by a per-sample label (the ``id``
array, or the content itself), and every pass's order against the plan. Parametrized over ``backend``:
the GPU backends are marked ``gpu`` (skipped without a GPU; run them with ``python3 -m pytest -m gpu``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec

from _helpers import in_thread, open_fds, rewrite_index, window_map

try:
    from zarr.codecs.numcodecs import Delta, Zlib
except ImportError:  # zarr versions that leave them to numcodecs
    from numcodecs.zarr3 import Delta, Zlib
from gdsload import FormatError, GDSDataset
from gdsload.cuda.ops import HostOps
from gdsload.format.shard_index import MAX_UINT_64, encode_shard_index, parse_shard_index
from gdsload.format.meta import read_metadata
from gdsload.pipeline.plan import epoch_plan
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset
from gdsload.tools.cli import main as cli_main

N = 613  # not a multiple of any chunk size below: every array has a partial last chunk
BACKENDS = ["cpu", *(pytest.param(b, marks=pytest.mark.gpu) for b in ("pinned", "kvikio", "mmap"))]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def content(n: int, tail: tuple[int, ...], dtype: str) -> np.ndarray:
    """Sample i holds i * 1000 + 0, 1, ... (uint8: a pattern of i): any row says which sample it is."""
    ids = np.arange(n, dtype=np.int64).reshape(-1, *([1] * len(tail)))
    cells = np.arange(int(np.prod(tail, dtype=np.int64)), dtype=np.int64).reshape(tail)
    if dtype == "uint8":
        return ((ids * 7 + cells) % 256).astype(dtype)
    return (ids * 1000 + cells).astype(dtype)


def write(group, key: str, rows: int, tail=(), dtype="int32", shards=None, fill=0, written=None, **options):
    """Write array ``key`` in chunks of ``rows`` (shards of ``shards`` rows, or unsharded), only the row ranges
    in ``written`` (default: all); return what a reader must see: the data, and the fill value elsewhere."""
    data = content(N, tail, dtype)
    shard_spec = None if shards is None else (shards, *tail)
    if isinstance(shards, dict):
        shard_spec = {**shards, "shape": (shards["shape"], *tail)}
    options.setdefault("compressors", None)
    a = group.create_array(key, shape=(N, *tail), dtype=dtype, chunks=(rows, *tail), shards=shard_spec,
                           fill_value=fill, **options)
    expected = np.full_like(data, fill)
    for lo, hi in written or [(0, N)]:
        a[lo:hi] = data[lo:hi]
        expected[lo:hi] = data[lo:hi]
    np.testing.assert_array_equal(a[:], expected)  # zarr reads back what gdsload must
    return expected


def store(tmp_path_factory, name: str, build) -> tuple[str, dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("zarr") / name)
    group = zarr.create_group(path)
    return path, build(group)


# Each store: sample ids come from "id" (written whole); every other array is compared with its expected data.
STORES = {
    # chunks of 5, 6, 10 and 15 rows: K = lcm = 30, and every array's chunks tile the blocks
    "lcm": lambda g: {
        "id": write(g, "id", 5, dtype="int64", shards=20),
        "a": write(g, "a", 6, (3,), "float32", shards=30),
        "b": write(g, "b", 10, (2, 2), "uint8", shards=40),
        "c": write(g, "c", 15, (5,), "int64", shards=45),
    },
    # inner chunks of 7, 10 and 64 rows: lcm 2240 is too large, K = 64; 7 and 10 straddle blocks
    "max": lambda g: {
        "id": write(g, "id", 5, dtype="int64", shards=35),
        "a": write(g, "a", 7, (3,), "float64", shards=28),
        "b": write(g, "b", 10, (4,), "int32", shards=50),
        "c": write(g, "c", 64, (2, 3), "uint8", shards=128),
    },
    # a file per chunk, under every chunk key encoding
    "unsharded": lambda g: {
        "id": write(g, "id", 9, dtype="int64"),
        "slash": write(g, "slash", 7, (2,), "int32"),
        "dot": write(g, "dot", 12, (3,), "float32", chunk_key_encoding={"name": "default", "separator": "."}),
        "v2dot": write(g, "v2dot", 9, (2, 2), "uint32", chunk_key_encoding={"name": "v2", "separator": "."}),
        "v2slash": write(g, "v2slash", 18, (1,), "int64", chunk_key_encoding={"name": "v2", "separator": "/"}),
    },
    # chunks and whole shards (or chunk files) never written, fill values other than 0; an index at the start;
    # inner chunks followed by a crc32c
    "partial": lambda g: {
        "id": write(g, "id", 8, dtype="int64", shards={"shape": 32, "index_location": "start"}),
        "holes": write(g, "holes", 7, (3,), "float32", shards=28, fill=2.5,
                       written=[(0, 40), (100, 101), (250, 400), (590, N)]),
        "files": write(g, "files", 10, (2,), "int16", fill=-3, written=[(35, 120), (300, 310)]),
        "start": write(g, "start", 5, (2,), "int32", shards={"shape": 20, "index_location": "start"}, fill=9,
                       written=[(0, 3), (60, 200)]),
        "crc": write(g, "crc", 11, (), "int64", shards=44, fill=-1, compressors=[Crc32cCodec()],
                     written=[(0, 100), (400, N)]),
    },
    # compressed chunks (zarr-python's default is zstd), sharded and unsharded, each array its own chunk rows,
    # partial writes, a crc32c after the compressor, one compressed array and one raw beside them
    "zstd": lambda g: {
        "id": write(g, "id", 16, dtype="int64", compressors=[ZstdCodec()]),
        "img": write(g, "img", 12, (4, 3), "uint8", shards=48, compressors=[ZstdCodec(level=5)]),
        "f16": write(g, "f16", 9, (5,), "float16", compressors=[ZstdCodec(level=1)], fill=1.5,
                     written=[(0, 100), (250, 400)]),
        "crc": write(g, "crc", 20, (2,), "int32", shards={"shape": 60, "index_location": "start"},
                     compressors=[ZstdCodec(), Crc32cCodec()], fill=-4, written=[(30, 500)]),
        "raw": write(g, "raw", 32, (2,), "int16"),
    },
    "codecs": lambda g: {
        "id": write(g, "id", 10, dtype="int64", compressors=[GzipCodec(level=1)]),
        "gzip": write(g, "gzip", 6, (3,), "float32", shards=24, compressors=[GzipCodec()]),
        "blosc": write(g, "blosc", 15, (2, 2), "int64", compressors=[BloscCodec(cname="lz4", shuffle="shuffle")]),
        "bloscz": write(g, "bloscz", 30, (4,), "uint16", shards=90, compressors=[BloscCodec(cname="zstd")],
                        written=[(0, 200), (400, N)]),
        "zlib": write(g, "zlib", 8, (2,), "int32", compressors=[Zlib(level=2)]),
    },
    # nested groups: fields "a/b", "a/c/d", "e"
    "nested": lambda g: {
        "id": write(g, "id", 13, dtype="int64"),
        "a/b": write(g, "a/b", 8, (2,), "int32", shards=24),
        "a/c/d": write(g, "a/c/d", 4, (3,), "float64"),
        "e": write(g, "e", 16, (2,), "uint16"),
    },
}


#: The stores with chunks never written: read with missing_chunks="fill" (a missing chunk fails the open by default).
SPARSE = ("partial", "zstd", "codecs")


@pytest.fixture(scope="module", params=list(STORES))
def foreign(request, tmp_path_factory):
    return store(tmp_path_factory, f"{request.param}.zarr", STORES[request.param])


def fill(path: str) -> dict[str, str]:
    """The option a store of :data:`SPARSE` is read with (none for the others: the default reads them)."""
    return {"missing_chunks": "fill"} if os.path.basename(path)[:-len(".zarr")] in SPARSE else {}


def to_host(backend, a):
    if backend == "cpu":
        return np.asarray(a)
    import cupy

    return cupy.asnumpy(a)


def check(backend, batch, expected, label="id"):
    """Every field of the batch against the data at its samples; returns the samples' ids."""
    labels = to_host(backend, batch[label])
    ids = labels.reshape(len(labels), -1)[:, 0].astype(np.int64) // 1000  # row i starts with i * 1000
    assert set(batch) == set(expected)
    for name, data in expected.items():
        np.testing.assert_array_equal(to_host(backend, batch[name]), data[ids], err_msg=name)
    return ids


def read_epochs(ds, backend, expected, epochs=(0, 1), label="id"):
    """Read ``epochs`` (each checked against its plan); return every epoch's ids."""
    out = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        ids = np.concatenate([check(backend, b, expected, label) for b in ds])
        np.testing.assert_array_equal(ids, epoch_plan(ds.config, epoch).sample_ids())
        out.append(ids)
    return out


OPTIONS = [
    {"batch_size": 32},
    {"batch_size": 50, "shuffle": True, "seed": 1, "window_blocks": 2},
    {"batch_size": 7, "shuffle": True, "seed": 2, "window_blocks": 1, "drop_last": True},
    {"batch_size": 100, "shuffle": True, "seed": 3, "window_blocks": 3, "resident_bytes": 0},
    {"batch_size": 64, "shuffle": True, "seed": 4, "resident_bytes": 1 << 30},  # every array read whole
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS)
def test_every_sample_exactly(foreign, backend, options):
    path, expected = foreign
    with GDSDataset(path, backend=backend, **{"resident_bytes": 2048, **options, **fill(path)}) as ds:
        assert ds.meta.foreign and list(ds.fields) == sorted(expected)
        first, second = read_epochs(ds, backend, expected)
        if not options.get("drop_last"):
            np.testing.assert_array_equal(np.sort(first), np.arange(N))
        if options.get("shuffle"):
            assert not np.array_equal(first, second)


def test_block_choice_and_gathers(foreign):
    """K is the lcm of the chunk rows when that is small, else the largest; a field whose chunks divide K is
    gathered at its plan positions, any other by rows of its own."""
    path, _ = foreign
    rows = {name: f.samples_per_block for name, f in read_metadata(path).fields.items()}
    with GDSDataset(path, batch_size=16, backend="cpu", resident_bytes=0, **fill(path)) as ds:
        k, gather = ds.config.samples_per_block, ds.describe()["gather"]
    if os.path.basename(path) == "lcm.zarr":
        assert k == 30
    if os.path.basename(path) == "max.zarr":
        assert k == 64
    for name, c in rows.items():
        assert gather[name] == ("positions" if k % c == 0 else "rows"), (name, c, k)
    assert ds.describe()["foreign_store"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_share_every_sample(foreign, backend):
    path, expected = foreign
    seen = []
    for rank in (0, 1):
        with GDSDataset(path, batch_size=24, backend=backend, shuffle=True, seed=5, rank=rank, world_size=2,
                        resident_bytes=0, window_blocks=2, **fill(path)) as ds:
            seen.append(read_epochs(ds, backend, expected, epochs=(3,))[0])
    assert len(seen[0]) == len(seen[1])
    np.testing.assert_array_equal(np.unique(np.concatenate(seen)), np.arange(N))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cut", [1, 5])
def test_resume_mid_epoch(foreign, backend, cut):
    path, expected = foreign
    opts = dict(batch_size=40, backend=backend, shuffle=True, seed=6, window_blocks=2, resident_bytes=0, **fill(path))
    with GDSDataset(path, **opts) as ref:
        ref.set_epoch(2)
        full = np.concatenate([check(backend, b, expected) for b in ref])
    with GDSDataset(path, **opts) as a:
        a.set_epoch(2)
        head = []
        for i, b in enumerate(a):
            head.append(check(backend, b, expected))
            if i + 1 == cut:
                state = json.loads(json.dumps(a.state_dict()))
                break
    with GDSDataset(path, **opts) as b:
        b.load_state_dict(state)
        tail = [check(backend, x, expected) for x in b]
    np.testing.assert_array_equal(np.concatenate(head + tail), full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_single_array(tmp_path, backend):
    path = str(tmp_path / "images")
    a = zarr.create_array(path, shape=(N, 4, 3), dtype="uint16", chunks=(9, 4, 3), shards=(27, 4, 3),
                          compressors=None, config={"order": "F"})
    data = (np.arange(N).reshape(-1, 1, 1) * 100 + np.arange(12).reshape(4, 3)).astype("uint16")
    a[:] = data
    with GDSDataset(path, batch_size=32, backend=backend, shuffle=True, window_blocks=2, resident_bytes=0) as ds:
        assert ds.fields == ("images",)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            got = np.concatenate([to_host(backend, b["images"]) for b in ds])
            ids = epoch_plan(ds.config, epoch).sample_ids()
            np.testing.assert_array_equal(got, data[ids])


def test_field_selection(tmp_path):
    """fields= reads some arrays; the others may have other lengths, or be unreadable; a selection of
    arrays of different lengths names them."""
    path = str(tmp_path / "g.zarr")
    g = zarr.create_group(path)
    x = write(g, "x", 10, (2,), "int32")
    idx = write(g, "idx", 7, (), "int64")
    g.create_array("short", shape=(5,), dtype="int8", chunks=(5,), compressors=None)
    g.create_array("packed", shape=(N, 2), dtype="int32", chunks=(10, 2), filters=[TransposeCodec(order=(1, 0))])
    with GDSDataset(path, batch_size=50, fields=["idx", "x"], backend="cpu", shuffle=True) as ds:
        assert ds.fields == ("idx", "x")
        read_epochs(ds, "cpu", {"x": x, "idx": idx}, label="idx")
    where = re.escape(path)
    with pytest.raises(FormatError, match=rf"^{where}/zarr.json: arrays differ in length along axis 0: "
                                          rf"short \(5\), x \({N}\); select arrays of one length"):
        GDSDataset(path, batch_size=5, fields=["short", "x"], backend="cpu")
    with pytest.raises(FormatError, match=rf"^{where}/packed/zarr.json: chunks use a 'transpose' codec"):
        GDSDataset(path, batch_size=5, backend="cpu")
    with pytest.raises(FormatError, match=r"no field \['y'\] \(fields: \['idx', 'packed', 'short', 'x'\]\)"):
        GDSDataset(path, batch_size=5, fields=["y"], backend="cpu")


@pytest.mark.parametrize("make, fragment", [
    (lambda g: g.create_array("a", shape=(N, 2), dtype="int32", chunks=(10, 2), shards=(20, 2), compressors=None,
                              filters=[Delta(dtype="int32")]),
     r"inner chunks use array-to-array codec 'numcodecs.delta' \(before 'bytes'\), which gdsload does not read"),
    (lambda g: g.create_array("a", shape=(N, 2), dtype="int32", chunks=(10, 2), compressors=None,
                              filters=[TransposeCodec(order=(1, 0))]), r"chunks use a 'transpose' codec"),
    (lambda g: g.create_array("a", shape=(N, 4), dtype="int32", chunks=(10, 2), compressors=None),
     r"chunks of shape \(10, 2\) split the samples of shape \(4,\)"),
    (lambda g: g.create_array("a", shape=(N, 4), dtype="int32", chunks=(10, 2), shards=(20, 4), compressors=None),
     r"inner chunks of shape \(10, 2\) split the samples"),
    (lambda g: g.create_array("a", shape=(N, 2), dtype="int32", chunks=(10, 2), compressors=None,
                              serializer=BytesCodec(endian="big")), r"chunks hold big-endian data"),
    (lambda g: g.create_array("a", shape=(N,), dtype="datetime64[s]", chunks=(10,), compressors=None),
     r"unsupported data type"),
])
def test_unreadable_arrays_are_named(tmp_path, make, fragment):
    path = str(tmp_path / "bad.zarr")
    make(zarr.create_group(path))
    with pytest.raises(FormatError, match=rf"^{re.escape(path)}/a/zarr.json: {fragment}"):
        GDSDataset(path, batch_size=4, backend="cpu")


def test_arrays_of_data_types_gdsload_does_not_read_are_skipped_with_a_warning_or_refused_by_name(tmp_path):
    """A group holding one string array did not open at all, and the message did not suggest fields=."""
    path = str(tmp_path / "mixed.zarr")
    g = zarr.create_group(path)
    x = np.arange(N * 2, dtype=np.int32).reshape(N, 2)
    g.create_array("x", shape=x.shape, dtype="int32", chunks=(50, 2))[:] = x
    g.create_array("text", shape=(N,), dtype=str, chunks=(50,))[:] = np.array([f"s{i}" for i in range(N)])
    g.create_array("when", shape=(N,), dtype="datetime64[s]", chunks=(50,))
    with pytest.warns(UserWarning, match=re.escape(
            f"{path}: skipped array(s) 'text' (data type 'string'), 'when' (data type 'numpy.datetime64'): data "
            "types gdsload does not read; reading ['x']; pass fields= to choose the arrays")) as caught:
        ds = GDSDataset(path, batch_size=100, backend="cpu")
    assert len(caught) == 1 and caught[0].filename == __file__  # pointing at the user's line
    with ds:
        assert ds.fields == ("x",)
        np.testing.assert_array_equal(np.concatenate([b["x"] for b in ds]), x)
    with pytest.raises(FormatError, match=rf"^{re.escape(path)}/text/zarr.json: unsupported data type 'string' of "
                                          r"field 'text' \(expected one of \['bool', .*\]: gdsload reads numbers and "
                                          r"bools\); leave the field out of fields=$"):
        GDSDataset(path, batch_size=100, fields=["x", "text"], backend="cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fields chosen: nothing skipped, nothing said
        GDSDataset(path, batch_size=100, fields=["x"], backend="cpu").close()
    only = str(tmp_path / "only.zarr")  # nothing gdsload reads: the first one's refusal
    zarr.create_group(only).create_array("text", shape=(N,), dtype=str, chunks=(50,))
    with pytest.raises(FormatError, match=rf"^{re.escape(only)}/text/zarr.json: unsupported data type 'string'"):
        GDSDataset(only, batch_size=100, backend="cpu")


def test_storage_transformers_are_refused(tmp_path):
    path = str(tmp_path / "st.zarr")
    zarr.create_group(path).create_array("a", shape=(N,), dtype="int32", chunks=(10,), compressors=None)
    meta = os.path.join(path, "a", "zarr.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["storage_transformers"] = [{"name": "some_transformer"}]
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(FormatError, match=rf"^{re.escape(meta)}: storage transformers are not supported"):
        read_metadata(path)


def test_what_is_no_zarr_v3_store_points_at_the_converter(tmp_path):
    npy = tmp_path / "npys"
    npy.mkdir()
    np.save(npy / "x.npy", np.zeros(3))
    with pytest.raises(FormatError, match=r"zarr.json: missing \(not a Zarr v3 group or array; .*'gdsload shard'"):
        read_metadata(npy)
    with pytest.raises(FormatError, match=r"x.npy: a file, not a dataset directory \(.*'gdsload shard'"):
        read_metadata(npy / "x.npy")
    v2 = str(tmp_path / "v2.zarr")
    zarr.open_group(v2, mode="w", zarr_format=2).create_array("a", shape=(4,), dtype="int8", chunks=(2,))
    with pytest.raises(FormatError, match=r"missing \(not a Zarr v3 group or array; .*Zarr v2 data"):
        read_metadata(v2)


def test_too_many_chunk_files_for_the_descriptor_limit(tmp_path):
    """A file per chunk beyond the hard RLIMIT_NOFILE is refused with advice; beyond only the soft one, the
    soft limit is raised and the store reads."""
    path = str(tmp_path / "many.zarr")
    g = zarr.create_group(path)
    g.create_array("a", shape=(600,), dtype="int32", chunks=(1,), compressors=None)[:] = np.arange(1, 601)
    script = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        from gdsload import FormatError, GDSDataset
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if sys.argv[1] == "hard":
            resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
            try:
                GDSDataset({path!r}, batch_size=10, backend="cpu")
            except FormatError as e:
                print("refused:", e)
        else:
            resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
            with GDSDataset({path!r}, batch_size=10, backend="cpu") as ds:
                got = np.concatenate([b["a"] for b in ds])
            assert (got == np.arange(1, 601)).all()
            print("read, soft limit now", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    hard = subprocess.run([sys.executable, "-c", script, "hard"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert hard.returncode == 0, hard.stderr
    refused = f"refused: {path}: needs 600 open files, more than this process may open"
    assert hard.stdout.startswith(refused), hard.stdout
    assert "'gdsload shard'" in hard.stdout
    soft = subprocess.run([sys.executable, "-c", script, "soft"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert soft.returncode == 0, soft.stderr
    assert soft.stdout.startswith("read, soft limit now") and int(soft.stdout.split()[-1]) > 600


def test_converter_datasets_keep_their_path(tmp_path, monkeypatch):
    """A dataset the converter wrote: K is every field's chunk, every windowed field is gathered at its plan
    positions, an unshuffled pass copies runs (no gather by index), and a missing shard is still an error."""
    path = str(tmp_path / "c.gds")
    data = {"x": content(N, (3,), "float32"), "idx": content(N, (), "int64")}
    write_dataset(path, {k: ArraySource(k, v) for k, v in data.items()}, samples_per_block=16, progress=False)
    calls = {"copy": 0, "take": 0}
    copy, take = HostOps.copy_rows, HostOps.take

    def counting(kind, real):
        def call(self, *args):
            calls[kind] += 1
            return real(self, *args)
        return call

    monkeypatch.setattr(HostOps, "copy_rows", counting("copy", copy))
    monkeypatch.setattr(HostOps, "take", counting("take", take))
    with GDSDataset(path, batch_size=32, backend="cpu", resident_bytes=0) as ds:
        assert not ds.meta.foreign
        assert ds.config.samples_per_block == 16 == ds.meta.fields["x"].samples_per_block
        assert ds.describe()["gather"] == {"x": "positions", "idx": "positions"}
        assert window_map(ds).rows["x"] == 16 * ds.config.window_blocks
        read_epochs(ds, "cpu", data, epochs=(0,), label="idx")
    assert calls["copy"] > 0 and calls["take"] == 0
    os.remove(os.path.join(path, "x", "c", "0", "0"))
    with pytest.raises(FormatError, match="shard file is missing"):
        GDSDataset(path, batch_size=32, backend="cpu")


def test_straddling_fields_always_gather_by_index(tmp_path, monkeypatch):
    """A field whose chunks do not divide K is never copied by plan positions, even unshuffled."""
    path = str(tmp_path / "s.zarr")
    g = zarr.create_group(path)
    expected = {"id": write(g, "id", 64, dtype="int64"), "a": write(g, "a", 9, (2,), "int32", shards=27)}
    copied = []
    copy = HostOps.copy_rows
    monkeypatch.setattr(HostOps, "copy_rows", lambda self, src, first, out: (copied.append(src.shape), copy(
        self, src, first, out)))
    with GDSDataset(path, batch_size=32, backend="cpu", resident_bytes=0, window_blocks=3) as ds:
        assert ds.config.samples_per_block == 64 and ds.describe()["gather"] == {"a": "rows", "id": "positions"}
        assert window_map(ds).rows["a"] == 72 * 3  # a block of 64 rows touches at most 8 chunks of 9
        read_epochs(ds, "cpu", expected, epochs=(0,))
    assert copied and all(shape[1:] == () for shape in copied)  # only "id" was copied


# -- hostile foreign stores: refused at open with the path first, nothing left open, never a hang -----------
def _damaged(tmp_path, damage):
    path = str(tmp_path / "h.zarr")
    g = zarr.create_group(path)
    g.create_array("u", shape=(40,), dtype="int32", chunks=(10,), compressors=None)[:] = np.arange(1, 41)
    g.create_array("s", shape=(40,), dtype="int32", chunks=(5,), shards=(20,), compressors=None)[:] = np.arange(1, 41)
    damage(path)
    return path


def _set_json(rel, **changes):
    def damage(path):
        with open(os.path.join(path, rel)) as f:
            doc = json.load(f)
        doc.update(changes)
        with open(os.path.join(path, rel), "w") as f:
            json.dump(doc, f)
    return damage


def _index(rel, edit):
    def damage(path):
        rewrite_index(os.path.join(path, rel), read_metadata(path, ["s"]).fields["s"], edit)
    return damage


def _replace(rel, make):
    def damage(path):
        os.remove(os.path.join(path, rel))
        make(os.path.join(path, rel))
    return damage


def _truncate(rel, size):
    return lambda path: os.truncate(os.path.join(path, rel), size)


def _flip_last(path, rel):
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


HOSTILE = {
    "chunk file short": (_truncate("u/c/1", 3), "u/c/1", "chunk file is 3 bytes (expected 40: raw, uncompressed)"),
    "chunk file a fifo": (_replace("u/c/2", os.mkfifo), "u/c/2", "chunk file is a FIFO (expected a regular file)"),
    "chunk file a directory": (_replace("u/c/0", os.mkdir), "u/c/0", "chunk file is a directory"),
    "shard a fifo": (_replace("s/c/0", os.mkfifo), "s/c/0", "shard file is a FIFO"),
    "shard index crc": (lambda p: _flip_last(p, "s/c/1"), "s/c/1", "shard index checksum mismatch"),
    "shard chunk wrong size": (_index("s/c/0", lambda t: t.__setitem__((1, 1), 19)), "s/c/0",
                               "chunk 1 is 19 bytes (expected 20: raw, uncompressed)"),
    "shard chunk past end": (_index("s/c/0", lambda t: t.__setitem__((0, 0), 1000)), "s/c/0",
                             "past the end of the file"),
    "shape of 1e15": (_set_json("u/zarr.json", shape=[10**15], chunk_grid={
        "name": "regular", "configuration": {"chunk_shape": [1]}}), "u/zarr.json", "more than this machine's memory"),
    "groups in a loop": (lambda p: os.symlink(p, os.path.join(p, "loop")), "", "groups nest deeper than 32 levels"),
    "chunk key encoding unknown": (_set_json("u/zarr.json", chunk_key_encoding={"name": "v3000"}), "u/zarr.json",
                                   "expected 'default' or 'v2' chunk key encoding, found 'v3000'"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_foreign_store(tmp_path, case):
    damage, rel, fragment = HOSTILE[case]
    path = _damaged(tmp_path, damage)
    before = open_fds()
    with pytest.raises(FormatError) as info:
        in_thread(lambda: GDSDataset(path, batch_size=4, backend="cpu", fields=None if rel == "" else [rel[0]]))
    msg = str(info.value)
    assert msg.startswith(os.path.join(path, rel) if rel else path) and fragment in msg and "\n" not in msg, msg
    assert open_fds() == before


def _sparse(tmp_path):
    """A store written by zarr-python, raw + crc32c, every chunk written, then damaged: shard ``s/c/1`` (chunks
    4..7) marked never written in its index, chunk 1 of shard ``s/c/0`` too, and chunk file ``u/c/3`` deleted.
    Returns the path and what zarr reads from it (the fill values where chunks are missing)."""
    path = str(tmp_path / "f.zarr")
    g = zarr.create_group(path)
    u = g.create_array("u", shape=(40,), dtype="int32", chunks=(10,), compressors=[Crc32cCodec()], fill_value=-7)
    s = g.create_array("s", shape=(40,), dtype="int32", chunks=(5,), shards=(20,), compressors=[Crc32cCodec()],
                       fill_value=-8)
    u[:], s[:] = np.arange(1, 41), np.arange(1, 41)
    os.remove(os.path.join(path, "u", "c", "3"))
    _index("s/c/1", lambda t: t.fill(MAX_UINT_64))(path)
    _index("s/c/0", lambda t: t.__setitem__(1, MAX_UINT_64))(path)
    want = {"u": u[:], "s": s[:]}
    assert (want["u"][30:] == -7).all() and (want["s"][20:] == -8).all() and (want["s"][5:10] == -8).all()
    return path, want


def test_a_missing_chunk_fails_the_open_naming_the_file_field_and_chunks(tmp_path):
    """Chunks missing from a store (a file deleted, index entries marked never written) would read as the fill
    value: by default the open refuses them, one line naming the file, the field and the chunks, and all of
    them counted; nothing is left open."""
    path, _ = _sparse(tmp_path)
    before = open_fds()
    with pytest.raises(FormatError) as info:
        GDSDataset(path, batch_size=8, backend="cpu")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(os.path.join(path, "s", "c", "0") + ": "), msg
    assert "shard index marks chunk 1 of field 's' as never written" in msg, msg
    assert "6 missing chunks in all, in 3 files (of field 's', field 'u' in " in msg, msg
    assert 'missing_chunks="fill"' in msg, msg
    with pytest.raises(FormatError, match=re.escape(os.path.join(path, "u", "c", "3")) +
                       r": chunk file missing \(chunk 3 of field 'u'\); a missing chunk is an error"):
        GDSDataset(path, batch_size=8, backend="cpu", fields=["u"])
    shutil.rmtree(os.path.join(path, "s", "c"))  # every shard file of s gone
    with pytest.raises(FormatError, match=re.escape(os.path.join(path, "s", "c", "0")) +
                       r": shard file missing \(chunks 0..3 of field 's'\); 8 missing chunks in all, in 2 files"):
        GDSDataset(path, batch_size=8, backend="cpu", fields=["s"])
    assert open_fds() == before


@pytest.mark.parametrize("value", ["zeros", None, True, "Error"])
def test_missing_chunks_takes_error_or_fill(tmp_path, value):
    path, _ = _sparse(tmp_path)
    with pytest.raises(ValueError, match=r"missing_chunks must be one of \['error', 'fill'\] \(found "):
        GDSDataset(path, batch_size=8, backend="cpu", missing_chunks=value)


def test_missing_chunks_fill_reads_the_fill_value_as_zarr_does(tmp_path):
    """``missing_chunks="fill"``: a store may lack any chunk or shard file, and a shard may mark every chunk
    never written: all of it reads as the fill value, exactly as zarr reads it."""
    path, want = _sparse(tmp_path)
    with GDSDataset(path, batch_size=8, backend="cpu", resident_bytes=0, missing_chunks="fill") as ds:
        got = list(ds)
    for name in ("u", "s"):
        np.testing.assert_array_equal(np.concatenate([b[name] for b in got]), want[name])
    shutil.rmtree(os.path.join(path, "s", "c"))
    with GDSDataset(path, batch_size=8, backend="cpu", fields=["s"], missing_chunks="fill") as ds:
        assert (np.concatenate([b["s"] for b in ds]) == -8).all()


def test_gdsload_verify_reports_missing_chunks_and_exits_1(tmp_path, capsys):
    path, _ = _sparse(tmp_path)
    assert cli_main(["verify", path, "--quiet"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"MISSING {os.path.join(path, 's', 'c', '0')}: shard index marks chunk 1 of field 's' as never written" \
        in out, out
    assert f"MISSING {os.path.join(path, 's', 'c', '1')}: shard index marks chunks 4..7 of field 's' as never " \
           f"written" in out, out
    assert f"MISSING {os.path.join(path, 'u', 'c', '3')}: chunk file missing (chunk 3 of field 'u')" in out, out
    # Every chunk written is checked: 3 of s's 8, 3 of u's 4.
    assert out[-1] == f"{path}: 6 chunk(s) checked, 0 bad, 6 missing", out
    os.remove(os.path.join(path, "s", "c", "1"))
    assert cli_main(["verify", path, "--quiet"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"MISSING {os.path.join(path, 's', 'c', '1')}: shard file missing (chunks 4..7 of field 's')" in out, out


def test_a_converter_written_dataset_with_a_chunk_or_offsets_missing_is_refused(tmp_path):
    """The converter writes every chunk (the offsets of a variable-length field too, zeros included): one
    missing is damage, refused by default even with verify off (where the fill value would be served)."""
    from gdsload.conversion.source_types import RaggedSource

    values = np.arange(1, 301, dtype=np.int32)
    offsets = np.concatenate([np.zeros(30000, np.int64), np.linspace(0, 300, 30001).astype(np.int64)])
    path = str(tmp_path / "d.gds")
    write_dataset(path, {"x": ArraySource("<x>", np.arange(1, 60001, dtype=np.int64))},
                  ragged={"r": RaggedSource("<r>", ArraySource("<v>", values), offsets)}, samples_per_block=1000,
                  shard_bytes=16000 * 4, progress=False)
    off_dir = os.path.join(path, "r", "offsets", "c")
    assert len(os.listdir(off_dir)) > 1 and "0" in os.listdir(off_dir), "several chunks, the first (zeros) written"
    with GDSDataset(path, batch_size=1000, backend="cpu", verify=False) as ds:
        assert sum(len(b["x"]) for b in ds) == 60000
    os.rename(os.path.join(off_dir, "0"), str(tmp_path / "o0"))
    with pytest.raises(FormatError, match=re.escape(os.path.join(off_dir, "0")) +
                       r": chunk file missing \(chunk 0 of the offsets of field 'r'\)"):
        GDSDataset(path, batch_size=1000, backend="cpu", verify=False)
    os.rename(str(tmp_path / "o0"), os.path.join(off_dir, "0"))
    # The last chunk of shard 1 cut out and its index entry marked never written (a valid crc32c), so the
    # shard is still laid out as the converter lays it out: only the missing entry is wrong.
    shard, fm = os.path.join(path, "x", "c", "1"), read_metadata(path).fields["x"]
    with open(shard, "rb") as f:
        whole = f.read()
    table = parse_shard_index(whole[-fm.index_bytes:], fm.blocks_per_shard, shard).offsets_and_lengths.copy()
    last = fm.blocks_per_shard - 1
    cut = int(table[last, 0])
    table[last] = MAX_UINT_64
    with open(shard, "wb") as f:
        f.write(whole[:cut] + encode_shard_index(table))
    with pytest.raises(FormatError, match=re.escape(shard) + f": shard index marks chunk {2 * last + 1} of field "
                                                             f"'x' as never written"):
        GDSDataset(path, batch_size=1000, backend="cpu", verify=False)
