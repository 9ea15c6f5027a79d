"""Helpers the test modules share (imported as ``from _helpers import ...``; fixtures live in conftest)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable

import numpy as np
import zarr

from gdsload.format.layout import DatasetLayout
from gdsload.format.shard_index import encode_shard_index, parse_shard_index
from gdsload.format.meta import read_metadata
from gdsload.pipeline.window import WindowMap
from gdsload.conversion.source_types import ArraySource, RaggedSource


def labelled(n: int, shape: tuple[int, ...] = (3, 5), dtype: str = "float32") -> dict[str, np.ndarray]:
    """Samples whose content is derived from their index, so any batch can be checked on its own."""
    idx = np.arange(n, dtype=np.int64)
    x = (idx.reshape(-1, *([1] * len(shape))) * 1000 + np.arange(int(np.prod(shape))).reshape(shape)).astype(dtype)
    return {"x": x, "idx": idx}


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gdsload-reader")]


def break_then_close(ds, check: Callable[[dict], object] = lambda b: None, stop_after: int = 4):
    """Leave a pass early (break), start another, take one batch, close the dataset: no reader thread
    may outlive either exit. Returns the second iterator, still unfinished."""
    for i, b in enumerate(ds):
        check(b)
        if i + 1 == stop_after:
            assert reader_threads(), "a reader runs ahead while the consumer works"
            break
    assert wait_no_readers() == []
    it = iter(ds)
    next(it)
    ds.close()
    assert wait_no_readers() == []
    return it


def wait_no_readers(timeout_s: float = 2.0) -> list[threading.Thread]:
    """Reader threads still alive after ``timeout_s`` (should be none)."""
    deadline = time.monotonic() + timeout_s
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return reader_threads()


def threads_left_since(before: set[threading.Thread], timeout_s: float = 5.0) -> list[str]:
    """Names of threads started since ``before`` (a ``set(threading.enumerate())``) still alive after
    ``timeout_s``: clean-up after ``gc`` runs on the reaper thread, soon after, and threads of other tests may
    end meanwhile, so counts alone would race. The reaper lives as long as the process: whichever test starts
    it first is not to blame."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [t.name for t in threading.enumerate()
                if t not in before and t.is_alive() and t.name != "gdsload-reaper"]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)


def files_below(path: str) -> dict[str, bytes]:
    """Every file below ``path``, by its path relative to it."""
    found = {}
    for folder, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(folder, n), "rb") as f:
                found[os.path.relpath(os.path.join(folder, n), path)] = f.read()
    return found


class FakeStream:
    """A CUDA stream for tests that replace CuPy on the host: every operation returns at once."""

    def __init__(self, non_blocking: bool = False):
        self.ptr = id(self)

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record(self, event: object = None) -> object:
        return event

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def zarr_dataset_with_missing_block(path: str) -> np.ndarray:
    """A dataset written by plain zarr, whose block 1 equals the fill value (-5) and so is never written;
    returns the data it holds."""
    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 12, "samples_per_block": 3, "fields": {"x": {"kind": "fixed"}}}
    a = g.create_array("x", shape=(12, 2), dtype="int16", chunks=(3, 2), shards=(6, 2), fill_value=-5,
                       compressors=None)
    data = np.arange(24, dtype=np.int16).reshape(12, 2)
    data[3:6] = -5
    a[:] = data
    return data


def threads_left_after_use(ds) -> set[threading.Thread]:
    """Leave a pass early, run one to its end, close: the threads started meanwhile still alive 2 s later."""
    before = set(threading.enumerate())
    with ds:
        for i, _ in enumerate(ds):
            if i == 3:
                break
        list(ds)
    deadline = time.monotonic() + 2
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return set(threading.enumerate()) - before


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


def rewrite_index(path: str, field, edit) -> None:
    """Change a shard's index table with ``edit(table)`` and store it with a valid crc32c, so only the
    layout checks can catch what was changed."""
    size, n = os.path.getsize(path), field.index_bytes
    pos = size - n if field.index_location == "end" else 0
    with open(path, "r+b") as f:
        f.seek(pos)
        table = parse_shard_index(f.read(n), field.blocks_per_shard, path).offsets_and_lengths.copy()
        edit(table)
        f.seek(pos)
        f.write(encode_shard_index(table))


def index_edit_refused(meta, field, shard: str, original: bytes) -> Callable[[Callable, str], None]:
    """``refused(edit, message)``: ``shard`` restored to ``original``, its index changed by ``edit`` (with a
    valid crc32c), opening the layout of ``meta`` fails with a FormatError starting ``SHARD: message``."""
    import pytest

    from gdsload import FormatError

    def refused(edit: Callable, message: str) -> None:
        with open(shard, "wb") as f:
            f.write(original)
        rewrite_index(shard, field, edit)
        with pytest.raises(FormatError, match=f"^{shard}: {message}"):
            DatasetLayout(meta)
    return refused


def add_checksums(path: str, fields=None) -> dict[str, np.ndarray]:
    """Add checksum arrays as the converter is to write them (attrs["gdsload"]["checksums"], one uint32
    array per field at _checksums/FIELD), computed here from the shard files; returns them."""
    import crc32c

    meta = read_metadata(path)
    k, n = meta.samples_per_block, meta.num_samples
    sums = {}
    with DatasetLayout(meta) as layout:
        def stored(key, piece_rows, loc):
            fm = meta.array(key)
            if loc is None:
                return fm.fill_bytes() * (piece_rows * fm.sample_bytes // fm.dtype.itemsize)
            return os.pread(layout.files.fd(loc.path), loc.nbytes, loc.offset)

        for name in fields or meta.names:
            out = np.empty(meta.num_blocks, dtype=np.uint32)
            for b in range(meta.num_blocks):
                if name in meta.fields:
                    data = stored(name, k, layout.locate(name, b))
                else:
                    offsets = layout.offsets[name]
                    a, z = int(offsets[b * k]), int(offsets[min((b + 1) * k, n)])
                    data = b"".join(stored(f"{name}/values", p.row_stop - p.row_start, p.location)
                                    for p in layout.locate_rows(f"{name}/values", a, z))
                out[b] = crc32c.crc32c(data)
            sums[name] = out
    for name in meta.names:  # the converter's own of the fields left out: gone, as if never written
        if name not in sums:
            shutil.rmtree(os.path.join(path, "_checksums", name), ignore_errors=True)
    g = zarr.open_group(path, mode="r+")
    for name, values in sums.items():
        g.create_array(f"_checksums/{name}", shape=values.shape, dtype="uint32", chunks=values.shape,
                       compressors=None, overwrite=True)[:] = values  # the converter's own, rewritten
    attrs = dict(g.attrs["gdsload"])
    attrs["checksums"] = {"algorithm": "crc32c", "arrays": {name: f"_checksums/{name}" for name in sums}}
    g.attrs["gdsload"] = attrs
    return sums


def sequences(n: int, seed: int = 0, elem: tuple[int, ...] = ()) -> list[np.ndarray]:
    """Sample i: rows i*1000 + 0, 1, ...; lengths 0..40, some empty."""
    lengths = np.random.default_rng(seed).integers(0, 41, n)
    lengths[::17] = 0
    size = int(np.prod(elem, dtype=np.int64))
    return [(i * 1000 + np.arange(n_i * size, dtype=np.int64)).astype(np.int32).reshape(n_i, *elem)
            for i, n_i in enumerate(lengths)]


def ragged_source(seqs: list[np.ndarray]) -> RaggedSource:
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    return RaggedSource("<tokens>", ArraySource("<tokens>", np.concatenate(seqs)), offsets)


def write_images(path: str, images: list[bytes], fmt: str = "jpeg", **options: object) -> str:
    """Write ``images`` (encoded files of format ``fmt``) as a dataset's image field "image", beside "label"
    (0, 1, ...); ``options`` go to write_dataset. Returns ``path``."""
    from gdsload import write_dataset

    write_dataset(path, {"label": ArraySource("l", np.arange(len(images)))}, progress=False,
                  ragged={"image": ragged_source([np.frombuffer(d, np.uint8) for d in images])},
                  field_attrs={"image": {"image": {"formats": [fmt]}}}, **options)
    return path


def assert_epochs_once(reads: dict[int, list[int]], end, n: int, name: str = "the source") -> None:
    """``reads`` (epoch -> the samples read in it) of a source of ``n`` samples now at the stretch ``end``
    (gdsload.mixture.schedule.Stretch): every epoch all ranks have finished holds every sample exactly once, a
    later one no sample twice."""
    done = min(end.rank_position(r, n)[0] for r in range(end.world_size))
    for epoch in range(max(reads, default=-1) + 1):
        got = sorted(reads.get(epoch, []))
        if epoch < done:
            assert got == list(range(n)), f"{name}: epoch {epoch} holds every sample once"
        else:
            assert len(set(got)) == len(got), f"{name}: epoch {epoch} holds no sample twice"


def flip_byte(path: str, at: int, mask: int = 0xFF) -> None:
    """Flip the bits of ``mask`` in byte ``at`` of ``path``, in place (a damaged disk, as a test makes one)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def window_map(ds, layout: DatasetLayout | None = None) -> WindowMap:
    """The window map of an open dataset without variable-length fields, made as its reader makes it
    (gdsload/pipeline/reader.py, ``Reader``; ``layout``'s chunk lengths size the compressed fields); its
    window is the one the dataset reports, so it is the map the dataset reads with."""
    wm = WindowMap([ds.meta.fields[f] for f in ds.windowed_fields], ds.config.window_blocks,
                   samples_per_block=ds.meta.samples_per_block,
                   chunk_lengths=layout.chunk_lengths if layout is not None else None)
    assert wm.window_blocks == ds.describe()["window_blocks"] and wm.nbytes == ds.describe()["window_bytes"]
    return wm


def host_batches(ds) -> list[dict[str, np.ndarray]]:
    """Every batch of a new pass over ``ds``, as numpy (CuPy arrays copied to the host)."""
    return [{k: v.get() if hasattr(v, "get") else np.asarray(v) for k, v in b.items()} for b in ds]


def assert_same_batches(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    """``got`` is ``want``: as many batches, each with the same fields, every field equal."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in w:
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)
