"""Backend conformance suite (issue 43, item 5): one set of tests that every backend must pass.

``BackendConformance`` holds the tests, as zarr-python's ``StoreTests`` does; each ``Test*`` subclass names a
backend. The cpu one runs in CI; the GPU ones carry ``@pytest.mark.gpu`` (conftest skips them without a
GPU; run them with ``python3 -m pytest -m gpu tests/test_conformance.py``). Only the public API is used, and
every expectation is computed from the numpy arrays written.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from gdsload import ArraySource, ChecksumError, GDSDataset, GDSLoadError, RaggedSource, ReadError, write_dataset
from gdsload.errors import FormatError

from _helpers import assert_same_batches, flip_byte

N = 196  # 4 * 7 * 7: batch sizes 14 and 49 divide it, 8 and 30 do not; 24.5 blocks of 8 (a short last block)
SPB = 8
# "idx" (1.5 KiB) and "m" (1 KiB) are read whole (resident); "x" and "y" window by window; "tokens" is ragged.
RESIDENT_BYTES = 2048


@dataclass(frozen=True)
class Source:
    """A dataset on disk and the arrays it was written from."""

    path: str
    arrays: dict[str, np.ndarray]  # fixed-size fields, sample i at row i
    seqs: list[np.ndarray]  # the variable-length field "tokens": sample i's values


def write_source(path: str) -> Source:
    """Write the suite's dataset: fixed fields of four dtypes and shapes, and one variable-length field."""
    idx = np.arange(N, dtype=np.int64)
    arrays = {
        "x": (idx.reshape(-1, 1, 1) * 1000 + np.arange(15).reshape(3, 5)).astype(np.float32),
        "y": (idx.reshape(-1, 1, 1) * 7 - np.arange(12).reshape(2, 6)).astype(np.int16),
        "m": ((idx.reshape(-1, 1) * 3 + np.arange(5)) % 251).astype(np.uint8),
        "idx": idx,
    }
    lengths = np.random.default_rng(0).integers(0, 9, N)
    lengths[::17] = 0  # some empty samples
    seqs = [(i * 100 + np.arange(n)).astype(np.int32) for i, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = RaggedSource("<tokens>", ArraySource("<tokens>", np.concatenate(seqs)), offsets)
    # 4 blocks of "x" per shard: 7 shard files, so a window's file is not the first window's.
    write_dataset(path, {k: ArraySource(f"<{k}>", v) for k, v in arrays.items()}, ragged={"tokens": tokens},
                  samples_per_block=SPB, shard_bytes=4 * SPB * 60, progress=False)
    return Source(path, arrays, seqs)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    """The suite's dataset, shared by the tests that only read it."""
    return write_source(str(tmp_path_factory.mktemp("conformance") / "ds.gds"))


@pytest.fixture
def fresh(source: Source, tmp_path: Any) -> Source:
    """A private copy of the dataset, for the tests that damage it."""
    path = str(tmp_path / "copy.gds")
    shutil.copytree(source.path, path)
    return Source(path, source.arrays, source.seqs)


def shard_files(path: str, key: str) -> list[str]:
    """The shard files of array ``key`` (``x``, ``tokens/values``), in shard order."""
    root = os.path.join(path, key, "c")
    found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
    return sorted(found, key=lambda p: tuple(int(part) for part in os.path.relpath(p, root).split(os.sep)))




def new_threads(before: set[threading.Thread], timeout_s: float = 3.0) -> set[threading.Thread]:
    """Threads started since ``before`` that are still alive after up to ``timeout_s`` (should be none)."""
    deadline = time.monotonic() + timeout_s
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return set(threading.enumerate()) - before


class BackendConformance:
    """The tests every backend (and every reader of the pinned backend) passes. A subclass sets ``backend``
    and, for one reader, ``backend_options``."""

    backend: str = ""
    backend_options: dict[str, Any] | None = None

    # -- helpers ---------------------------------------------------------------------------------------
    def open(self, path: str, batch_size: int, **options: Any) -> GDSDataset:
        options.setdefault("resident_bytes", RESIDENT_BYTES)
        if self.backend_options is not None:
            options.setdefault("backend_options", dict(self.backend_options))
        return GDSDataset(path, batch_size, backend=self.backend, **options)

    @staticmethod
    def to_numpy(batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """A batch's arrays on the host as numpy, whatever the backend and output (numpy, cupy, torch)."""
        out = {}
        for name, a in batch.items():
            if isinstance(a, np.ndarray):
                out[name] = a
            elif hasattr(a, "get"):  # cupy
                out[name] = a.get()
            elif hasattr(a, "cpu"):  # torch
                out[name] = a.cpu().numpy()
            else:
                out[name] = np.asarray(a)
        return out

    def take(self, ds: GDSDataset | Iterable[dict[str, Any]], count: int | None = None) -> list[dict[str, np.ndarray]]:
        """Up to ``count`` batches (all with None) of a new pass over ``ds``, as numpy."""
        out = []
        for b in ds:
            out.append(self.to_numpy(b))
            if count is not None and len(out) == count:
                break
        return out

    @staticmethod
    def check(batch: dict[str, np.ndarray], src: Source) -> np.ndarray:
        """Every field of ``batch`` equals the source's rows of the batch's samples; returns their ids."""
        ids = batch["idx"]
        assert ids.dtype == np.int64 and ids.ndim == 1
        for name, data in src.arrays.items():
            assert batch[name].dtype == data.dtype and batch[name].shape == (len(ids), *data.shape[1:]), name
            np.testing.assert_array_equal(batch[name], data[ids], err_msg=name)
        off = batch["tokens/offsets"]
        assert off.shape == (len(ids) + 1,) and off[0] == 0 and off[-1] == len(batch["tokens"])
        assert batch["tokens"].dtype == np.int32
        for j, i in enumerate(ids.tolist()):
            np.testing.assert_array_equal(batch["tokens"][off[j]:off[j + 1]], src.seqs[i])
        return ids

    def ids_of(self, batches: list[dict[str, np.ndarray]], src: Source) -> np.ndarray:
        return np.concatenate([self.check(b, src) for b in batches]) if batches else np.empty(0, np.int64)

    # -- exact samples ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("batch_size,drop_last,shuffle,window_blocks", [
        (14, False, False, None),  # divides N
        (49, False, True, 2),  # divides N; each batch spans several windows
        (8, False, False, 1),  # does not divide N
        (30, False, True, 3),
        (30, True, False, 3),
        (8, True, True, 1),
        (14, True, False, 2),  # divides N: drop_last drops nothing
    ])
    def test_every_sample_once_with_source_values(self, source: Source, batch_size: int, drop_last: bool,
                                                  shuffle: bool, window_blocks: int | None) -> None:
        """Two passes: each yields len(ds) batches of batch_size (a short last one unless drop_last), every
        field equal to the source, each sample once (in order without shuffle); drop_last drops N % B."""
        kept = N // batch_size * batch_size if drop_last else N
        with self.open(source.path, batch_size, shuffle=shuffle, seed=2, drop_last=drop_last,
                       window_blocks=window_blocks) as ds:
            for _ in range(2):  # the second pass was read ahead while the first ran
                batches = self.take(ds)
                assert len(batches) == len(ds) == -(-kept // batch_size)
                assert [len(b["idx"]) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
                assert len(batches[-1]["idx"]) == (batch_size if drop_last or N % batch_size == 0
                                                   else N % batch_size)
                ids = self.ids_of(batches, source)
                assert len(ids) == kept and len(set(ids.tolist())) == kept
                if not shuffle:
                    np.testing.assert_array_equal(ids, np.arange(kept))
                elif not drop_last:
                    np.testing.assert_array_equal(np.sort(ids), np.arange(N))

    def test_batches_are_numpy_on_host(self, source: Source) -> None:
        """to_numpy hands back numpy arrays of every field (cpu: the batch's own numpy arrays)."""
        with self.open(source.path, 16) as ds:
            batch = next(iter(ds))
            host = self.to_numpy(batch)
        assert set(host) == {"x", "y", "m", "idx", "tokens", "tokens/offsets"}
        assert all(isinstance(a, np.ndarray) for a in host.values())
        if self.backend == "cpu":
            assert all(isinstance(a, np.ndarray) for a in batch.values())

    @pytest.mark.parametrize("pad_to", [5, "max"])
    def test_padded_variable_length_field(self, source: Source, pad_to: int | str) -> None:
        """pad_to: tokens come as (B, width) rows cut to the width and filled with pad_value, plus lengths."""
        with self.open(source.path, 16, shuffle=True, window_blocks=2, pad_to=pad_to, pad_value=-7) as ds:
            batches = self.take(ds)
        seen = []
        for b in batches:
            ids = b["idx"].tolist()
            width = b["tokens"].shape[1]
            assert width == (5 if pad_to == 5 else max(len(source.seqs[i]) for i in ids))
            for j, i in enumerate(ids):
                n = min(width, len(source.seqs[i]))
                assert b["tokens/lengths"][j] == n
                np.testing.assert_array_equal(b["tokens"][j, :n], source.seqs[i][:n])
                assert (b["tokens"][j, n:] == -7).all()
            seen += ids
        assert sorted(seen) == list(range(N))

    # -- shuffle ---------------------------------------------------------------------------------------
    def test_shuffle_is_a_seeded_permutation_per_epoch(self, source: Source) -> None:
        """Shuffled epochs are permutations of all samples; same seed and epoch: same order; another seed
        or epoch: another order; without set_epoch each new pass is the next epoch."""
        def order(seed: int, epoch: int) -> list[int]:
            with self.open(source.path, 16, shuffle=True, seed=seed, window_blocks=3) as ds:
                ds.set_epoch(epoch)
                return self.ids_of(self.take(ds), source).tolist()

        first = order(1, 0)
        assert sorted(first) == list(range(N)) and first != list(range(N))
        assert order(1, 0) == first
        assert order(2, 0) != first
        second = order(1, 1)
        assert second != first and sorted(second) == list(range(N))
        with self.open(source.path, 16, shuffle=True, seed=1, window_blocks=3) as ds:
            assert [self.ids_of(self.take(ds), source).tolist() for _ in range(2)] == [first, second]

    # -- resume ----------------------------------------------------------------------------------------
    RESUME = dict(shuffle=True, seed=3, window_blocks=2)  # 16 per batch: 13 batches, the last of 4

    @pytest.mark.parametrize("cut", [1, 6, 13])  # first batch, mid-epoch, last batch
    def test_resume_yields_exactly_the_remaining_batches(self, source: Source, cut: int) -> None:
        """state_dict() after ``cut`` batches; a new dataset given it yields the rest of that epoch (equal
        arrays, all fields), then the next epoch as an uninterrupted run does."""
        with self.open(source.path, 16, **self.RESUME) as ref:
            full = [self.take(ref) for _ in range(2)]
        with self.open(source.path, 16, **self.RESUME) as first:
            head = self.take(first, cut)
            state = json.loads(json.dumps(first.state_dict()))  # plain data
        with self.open(source.path, 16, **self.RESUME) as second:
            second.load_state_dict(state)
            rest = self.take(second)
            after = self.take(second)
        assert len(rest) == len(full[0]) - cut
        assert_same_batches(head + rest, full[0])
        assert_same_batches(after, full[1])
        self.ids_of(rest + after, source)

    def test_resume_across_an_epoch_boundary(self, source: Source) -> None:
        """A state saved 4 batches into epoch 1 (after all of epoch 0) resumes epoch 1 there, then goes on
        to epoch 2, as an uninterrupted run."""
        with self.open(source.path, 16, **self.RESUME) as ref:
            full = [self.take(ref) for _ in range(3)]
        with self.open(source.path, 16, **self.RESUME) as first:
            assert_same_batches(self.take(first), full[0])
            head = self.take(first, 4)
            state = first.state_dict()
        assert state["epoch"] == 1
        with self.open(source.path, 16, **self.RESUME) as second:
            second.load_state_dict(state)
            rest = self.take(second)
            after = self.take(second)
        assert_same_batches(head + rest, full[1])
        assert_same_batches(after, full[2])

    # -- ranks -----------------------------------------------------------------------------------------
    @pytest.mark.parametrize("exact_shares", [True, False])
    def test_two_ranks_cover_the_epoch(self, source: Source, exact_shares: bool) -> None:
        """rank 0 and 1 of 2 together yield every sample (once each with exact_shares; else the same number
        of batches, a few samples repeated), with source values."""
        per_rank = []
        for rank in (0, 1):
            with self.open(source.path, 10, shuffle=True, seed=5, window_blocks=2, rank=rank, world_size=2,
                           exact_shares=exact_shares) as ds:
                batches = self.take(ds)
                assert len(batches) == len(ds)
                per_rank.append(self.ids_of(batches, source))
        both = np.concatenate(per_rank)
        assert set(both.tolist()) == set(range(N))
        if exact_shares:
            assert len(both) == N and not set(per_rank[0].tolist()) & set(per_rank[1].tolist())
        else:
            assert len(per_rank[0]) == len(per_rank[1]) and len(both) - N < 2 * SPB

    # -- close and break -------------------------------------------------------------------------------
    def test_close_from_another_thread_ends_the_pass(self, source: Source) -> None:
        """close() from another thread after a batch: the pass ends with a GDSLoadError saying so, no thread
        is left, close() again (any thread) is a no-op, and a new pass is refused."""
        before = set(threading.enumerate())
        ds = self.open(source.path, 8, shuffle=True, window_blocks=1)
        it = iter(ds)
        self.check(self.to_numpy(next(it)), source)
        closer = threading.Thread(target=ds.close)
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "close() blocked"
        got = 0
        with pytest.raises(GDSLoadError, match="closed"):
            for _ in it:
                got += 1
        assert got < len(ds) - 1
        ds.close()
        again = threading.Thread(target=ds.close)
        again.start()
        again.join(5)
        with pytest.raises(GDSLoadError, match="closed"):
            iter(ds)
        assert new_threads(before) == set()

    def test_close_while_a_pass_is_running(self, source: Source) -> None:
        """close() from another thread while the consumer is taking batches: the pass ends with a
        GDSLoadError within a second and every thread the dataset started ends."""
        before = set(threading.enumerate())
        ds = self.open(source.path, 4, window_blocks=1, prefetch=1)
        started = threading.Event()

        def close_soon() -> None:
            started.wait(5)
            ds.close()

        closer = threading.Thread(target=close_soon)
        closer.start()
        t0 = time.monotonic()
        got = 0
        with pytest.raises(GDSLoadError, match="closed"):
            for b in ds:
                self.check(self.to_numpy(b), source)
                got += 1
                started.set()
                time.sleep(0.002)
        assert time.monotonic() - t0 < 2.0 and got < len(ds)
        closer.join(5)
        assert not closer.is_alive()
        ds.close()
        assert new_threads(before) == set()

    def test_break_then_new_pass(self, source: Source) -> None:
        """Leaving a pass early, then starting another: the new pass is the next epoch, complete and equal
        to the source (as set_epoch gives it); an iterator left mid-pass is closed by the next pass."""
        with self.open(source.path, 8, shuffle=True, seed=1, window_blocks=2) as ref:
            ref.set_epoch(1)
            epoch1 = self.take(ref)
            ref.set_epoch(3)
            epoch3 = self.take(ref)
        before = set(threading.enumerate())
        with self.open(source.path, 8, shuffle=True, seed=1, window_blocks=2) as ds:
            head = self.take(ds, 3)
            self.ids_of(head, source)
            assert_same_batches(self.take(ds), epoch1)
            old = iter(ds)
            next(old)  # epoch 2, left mid-pass
            assert_same_batches(self.take(ds), epoch3)
            with pytest.raises(GDSLoadError):
                next(old)
        assert new_threads(before) == set()

    # -- error paths -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("key", ["x", "tokens/values"])
    def test_truncated_file_is_a_read_error_naming_it(self, fresh: Source, key: str) -> None:
        """A data file truncated after open: the pass raises ReadError naming the file, after the batches
        before it arrived with source values; no thread is left."""
        before = set(threading.enumerate())
        victim = shard_files(fresh.path, key)[-1]
        with self.open(fresh.path, 8, window_blocks=1) as ds:
            os.truncate(victim, 100)
            got = []
            with pytest.raises(ReadError) as info:
                for b in ds:
                    got.append(self.to_numpy(b))
            assert str(info.value).startswith(f"{victim}: "), str(info.value)
            self.ids_of(got, fresh)
            assert got, "the batches before the damaged block arrive"
        assert new_threads(before) == set()

    def test_file_deleted_after_open_is_still_read(self, fresh: Source) -> None:
        """Shard files are held open from the open: deleting one later changes nothing that is served."""
        with self.open(fresh.path, 8, window_blocks=1) as ds:
            os.remove(shard_files(fresh.path, "x")[-1])
            ids = self.ids_of(self.take(ds), fresh)
        np.testing.assert_array_equal(ids, np.arange(N))

    def test_file_deleted_before_open_is_a_format_error_naming_it(self, fresh: Source) -> None:
        """A shard file of a converted dataset missing at open: a FormatError naming it."""
        victim = shard_files(fresh.path, "x")[-1]
        os.remove(victim)
        with pytest.raises(FormatError, match=f"^{victim}: "):
            self.open(fresh.path, 8)

    @pytest.mark.parametrize("key,field,at", [("x", "x", 5), ("tokens/values", "tokens", 300), ("idx", "idx", 300)])
    def test_corrupted_byte_is_a_checksum_error_naming_the_file(self, fresh: Source, key: str, field: str,
                                                                at: int) -> None:
        """One byte flipped in a block (windowed, variable-length, resident): a ChecksumError (a ReadError)
        naming the file and the field, before any sample of that block is served."""
        victim = shard_files(fresh.path, key)[-1]
        flip_byte(victim, at, 0x40)
        got = []
        with pytest.raises(ChecksumError) as info:
            with self.open(fresh.path, 8, shuffle=True, window_blocks=1) as ds:
                for b in ds:
                    got.append(self.to_numpy(b))
        msg = str(info.value)
        assert isinstance(info.value, ReadError)
        assert msg.startswith(f"{victim}: ") and f"field '{field}'" in msg and "crc32c" in msg, msg
        self.ids_of(got, fresh)  # what was served before it is intact

    @pytest.mark.parametrize("name,value", [("batch_size", 0), ("prefetch", 0), ("window_blocks", 0), ("seed", -1)])
    def test_bad_argument_is_a_value_error_naming_it(self, source: Source, name: str, value: int) -> None:
        """An integer argument out of range: ValueError naming it, and no thread left behind."""
        before = set(threading.enumerate())
        args = {"batch_size": 8, name: value}
        with pytest.raises(ValueError, match=f"^{name} must be"):
            self.open(source.path, **args)
        assert new_threads(before) == set()


class TestCpu(BackendConformance):
    backend = "cpu"


@pytest.mark.gpu
class TestMmap(BackendConformance):
    backend = "mmap"


@pytest.mark.gpu
class TestPinned(BackendConformance):
    backend = "pinned"


@pytest.mark.gpu
class TestPinnedNative(BackendConformance):
    backend, backend_options = "pinned", {"reader": "native"}


@pytest.mark.gpu
class TestPinnedThreads(BackendConformance):
    backend, backend_options = "pinned", {"reader": "threads"}


@pytest.mark.gpu
class TestKvikio(BackendConformance):
    backend = "kvikio"
