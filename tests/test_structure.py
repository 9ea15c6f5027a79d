"""The structure the rest builds on: public exports, the position cursor, KvikIO's shared pool, stats that
describe what the consumer got, describe(), module sizes."""

from __future__ import annotations

import os
import sys
import types
import warnings

import numpy as np
import pytest

import gdsload
from gdsload import GDSDataset
from gdsload.pipeline.position import Cursor

from _helpers import labelled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_package_exports_what_users_need_and_no_internals():
    for name in gdsload.__all__:
        assert hasattr(gdsload, name), name
    assert {"GDSDataset", "EpochStats", "ReadError", "FormatError", "ConversionError", "BackendUnavailable",
            "GDSLoadError", "ArraySource", "RaggedSource", "convert", "write_dataset"} <= set(gdsload.__all__)
    assert not {"DatasetLayout", "DatasetMeta", "FieldMeta", "read_metadata"} & set(gdsload.__all__)


def test_no_library_module_is_over_450_lines():
    sizes = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "gdsload")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    sizes[os.path.relpath(os.path.join(folder, f), ROOT)] = sum(1 for _ in fh)
    assert sizes and max(sizes.values()) <= 450, {k: v for k, v in sizes.items() if v > 450}


def test_benchmark_docs_and_results_stay_within_bounds():
    """docs/benchmarks.md explains today's figures (at most 400 lines) and benchmarks/results keeps the latest
    run per machine of what the docs cite (at most 20 files): older runs, probes and A/Bs live in git history,
    as the module size cap keeps modules small (both had grown to 637 lines and 41 files)."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as fh:
        lines = sum(1 for _ in fh)
    results = [os.path.relpath(os.path.join(folder, f), ROOT)
               for folder, _, files in os.walk(os.path.join(ROOT, "benchmarks", "results")) for f in files]
    assert 0 < lines <= 400, f"docs/benchmarks.md: {lines} lines (at most 400)"
    assert 0 < len(results) <= 20, f"benchmarks/results: {len(results)} files (at most 20): {sorted(results)}"


def test_benchmarks_stay_within_4000_lines():
    """benchmarks/ is at most 4,000 lines of Python (it had grown to 6,200): measurements whose question is
    answered leave with their code to git history, and what the benchmarks share lives in benchmarks/common.py."""
    lines = 0
    for folder, _, files in os.walk(os.path.join(ROOT, "benchmarks")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), encoding="utf-8") as fh:
                    lines += sum(1 for _ in fh)
    assert 0 < lines <= 4000, f"benchmarks/: {lines} lines of Python (at most 4,000)"


def test_no_code_line_is_over_120_characters():
    """The project's line limit for its Python: 120 characters, in the library, its benchmarks and its tests
    (long lines had crept into docstrings and argument lists)."""
    long = []
    for top in ("gdsload", "benchmarks", "tests"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(folder, f), encoding="utf-8") as fh:
                        long += [f"{os.path.relpath(os.path.join(folder, f), ROOT)}:{n}"
                                 for n, line in enumerate(fh, 1) if len(line.rstrip("\n")) > 120]
    assert not long, long


def test_cursor_next_pass():
    assert Cursor().next_pass(began=False, numbered=False) == Cursor(), "the first pass is epoch 0"
    assert Cursor(3, 7).next_pass(began=True, numbered=False) == Cursor(4), "without set_epoch: the next epoch"
    assert Cursor(3, 7).next_pass(began=True, numbered=True) == Cursor(3), "with set_epoch: the epoch set, again"
    fixed = Cursor(5, 2, fixed=True)
    assert fixed.next_pass(began=True, numbered=False) == Cursor(5, 2), "a fixed cursor starts exactly there"
    assert Cursor(1).reads_as(Cursor(2), shuffle=False) and not Cursor(1).reads_as(Cursor(2), shuffle=True)
    assert not Cursor(1, 3).reads_as(Cursor(1), shuffle=False)


def test_stats_count_what_the_consumer_got_when_every_field_is_resident(make_dataset):
    """All fields resident: from the second epoch nothing is read, yet data still reaches the consumer,
    and gb_per_s says how fast (it was 0 when it counted bytes read)."""
    data = labelled(300, shape=(4,))
    path = make_dataset(data, samples_per_block=10)
    with GDSDataset(path, batch_size=32, backend="cpu") as ds:
        assert set(ds.resident_fields) == {"x", "idx"}
        expected = sum(a.nbytes for a in data.values())
        for epoch in range(3):
            assert sum(len(b["idx"]) for b in ds) == 300
            s = ds.stats
            assert s.bytes_delivered == expected and s.gb_per_s > 0
            assert s.bytes_read == (expected if epoch == 0 else 0)


def test_describe_is_json_ready(make_dataset):
    import json

    path = make_dataset(labelled(100), samples_per_block=10)
    with GDSDataset(path, batch_size=8, backend="cpu", resident_bytes=0) as ds:
        next(iter(ds))
        d = json.loads(json.dumps(ds.describe()))
    assert d["backend"] == "cpu" and d["io_mode"] == "cpu" and d["window_buffers"] >= 3
    assert d["open_s"] > 0 and d["backend_stats"] == {"num_threads": 8, "task_bytes": 4 << 20}


@pytest.fixture
def fake_kvikio(monkeypatch):
    """A stand-in for kvikio.defaults that records every setting of the pool, and a fresh KvikioPool."""
    calls = []
    now = {"num_threads": 1, "task_size": 4 << 20, "bounce_buffer_size": 16 << 20}  # KvikIO's own defaults

    def set_(d):
        calls.append(dict(d))
        now.update(d)

    defaults = types.SimpleNamespace(set=set_, get=now.__getitem__)
    kvikio = types.ModuleType("kvikio")
    kvikio.defaults = defaults
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    from gdsload.backends.cuda import KvikioPool

    monkeypatch.setattr(KvikioPool, "_users", 0)
    monkeypatch.setattr(KvikioPool, "_settings", None)
    return KvikioPool, calls


def test_kvikio_pool_is_set_once_and_a_conflicting_request_warns(fake_kvikio):
    pool, calls = fake_kvikio
    pool.acquire(16, 4 << 20)
    pool.acquire(16, 4 << 20)  # the same settings: nothing to do
    assert calls == [{"num_threads": 16, "task_size": 4 << 20, "bounce_buffer_size": 4 << 20}]
    with pytest.warns(RuntimeWarning, match="in use with 16 threads"):
        pool.acquire(8, 1 << 20)
    assert len(calls) == 1, "a pool in use is never restarted under its readers"
    for _ in range(3):
        pool.release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.acquire(8, 1 << 20)
    assert calls[-1] == {"num_threads": 8, "task_size": 1 << 20, "bounce_buffer_size": 1 << 20}, \
        "once free, the next user's settings apply"


def test_kvikio_pool_set_by_other_code_since_is_set_again(fake_kvikio):
    """A benchmark's raw reads (or the user) may set KvikIO's pool between two datasets: the next dataset
    must get the pool it asks for (it kept the other's, while its stats reported its own)."""
    pool, calls = fake_kvikio
    pool.acquire(14, 4 << 20)
    pool.release()
    sys.modules["kvikio"].defaults.set({"num_threads": 16, "task_size": 4 << 20})  # not through the pool
    pool.acquire(14, 4 << 20)
    assert calls[-1] == {"num_threads": 14, "task_size": 4 << 20, "bounce_buffer_size": 4 << 20}
    pool.release()
    n = len(calls)
    pool.acquire(14, 4 << 20)
    assert len(calls) == n, "a pool already set as asked is not restarted"


def test_raw_kvikio_reads_hold_the_pool_without_restarting_a_datasets(fake_kvikio):
    """The raw KvikIO ceiling sets the pool through KvikioPool: alone it gets the pool it asks for and gives
    it back; beside a dataset open with other settings it refuses, leaving that dataset's pool as it is (it
    restarted the pool under the dataset, which then read with threads it did not report), and beside one
    with the same settings it reads."""
    from gdsload.tools.measure import kvikio_pool

    pool, calls = fake_kvikio
    with kvikio_pool(16):
        assert calls[-1] == {"num_threads": 16, "task_size": 4 << 20, "bounce_buffer_size": 4 << 20}
    assert pool._users == 0
    pool.acquire(14, 4 << 20)  # a dataset opens
    n = len(calls)
    with pytest.raises(RuntimeError, match="in use with 14 threads .* 16 and 4194304 were asked for: close"):
        with kvikio_pool(16):
            pass
    assert len(calls) == n and pool._users == 1, "the dataset's pool was not touched"
    with kvikio_pool(14):
        assert pool._users == 2
    assert pool._users == 1


def test_positions_are_rows_of_the_window():
    from gdsload.pipeline.plan import PlanConfig, epoch_plan

    plan = epoch_plan(PlanConfig(num_samples=95, samples_per_block=10, batch_size=7, window_blocks=3,
                                 shuffle=True, seed=1), 0)
    k = 10
    for w, blocks in enumerate(plan.windows):
        rows = plan.positions[plan.window_of == w]
        assert (rows // k < len(blocks)).all()
        ids = np.asarray(blocks)[rows // k] * k + rows % k
        assert (ids < 95).all()


def test_an_iterator_never_used_reads_nothing_and_is_no_pass(make_dataset):
    """Frameworks (PyTorch Lightning) call iter() on an iterable once to probe it: that must not start a
    pass, read ahead, or move the epoch on (it did: the first real pass then read epoch 1)."""
    path = make_dataset(labelled(200), samples_per_block=10)
    opts = dict(batch_size=16, backend="cpu", shuffle=True, seed=5, resident_bytes=0)
    with GDSDataset(path, **opts) as ref:
        want = [b["idx"].tolist() for b in ref]
    with GDSDataset(path, **opts) as ds:
        buffers = ds.describe()["window_buffers"]  # the first, read at open
        probe = iter(ds)
        assert ds.stats is None and ds.describe()["window_buffers"] == buffers == 1, "nothing started, nothing read"
        del probe
        assert [b["idx"].tolist() for b in ds] == want and ds.epoch == 0

