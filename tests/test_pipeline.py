"""The iterator through the cpu backend: content, scheduling, resume, lifecycle and reader errors."""

from __future__ import annotations

import functools
import itertools
import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gdsload.dataset
from _helpers import break_then_close, labelled, reader_threads, threads_left_since, wait_no_readers
from gdsload import GDSDataset, GDSLoadError, ReadError
from gdsload.backends.handoff import Handoff
from gdsload.backends.registry import info
from gdsload.format.layout import DatasetLayout
from gdsload.pipeline import pipeline as pipeline_module
from gdsload.pipeline.pipeline import Pipeline
from gdsload.pipeline.plan import epoch_plan

# Small enough that "idx" is resident and "x" is read window by window: every test covers both paths.
Dataset = functools.partial(GDSDataset, resident_bytes=32 << 10)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_batch(batch: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(batch["x"], data["x"][batch["idx"]])


@pytest.fixture
def data_path(make_dataset):
    data = labelled(997)
    return make_dataset(data, samples_per_block=8, shard_bytes=8 * 60 * 10), data


@pytest.fixture
def pipelines(monkeypatch) -> list[Pipeline]:
    """Every pipeline the datasets start from then on, in order: the last one is the one running."""
    made: list[Pipeline] = []

    class Recorded(Pipeline):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(gdsload.dataset, "Pipeline", Recorded)
    return made


@pytest.mark.parametrize("options", [
    {},
    {"window_blocks": 1, "prefetch": 1},
    {"window_blocks": 1, "batch_size": 50},  # every batch spans several windows
    {"shuffle": True, "seed": 5, "window_blocks": 3},
    {"shuffle": True, "window_blocks": 4, "drop_last": True},
    {"prefetch": 4, "window_blocks": 2, "backend_options": {"num_threads": 3, "task_bytes": 100}},
    {"batches_ahead": 1, "window_blocks": 2},
    {"batches_ahead": 8, "shuffle": True, "window_blocks": 1, "prefetch": 1},  # assembler far ahead
])
def test_epoch_matches_source_and_plan(data_path, options):
    path, data = data_path
    options = {"batch_size": 32, **options}
    with Dataset(path, backend="cpu", **options) as ds:
        batches = list(ds)  # every batch kept alive to the end
        assert len(batches) == len(ds)
        for b in batches:
            check_batch(b, data)
        got = np.concatenate([b["idx"] for b in batches])
        np.testing.assert_array_equal(got, epoch_plan(ds.config, 0).sample_ids())
        if not options.get("drop_last"):
            assert sorted(got.tolist()) == list(range(997))
        assert ds.stats.batches == len(batches) and ds.stats.samples == len(got)
        assert ds.stats.bytes_read >= data["x"][:len(got)].nbytes
        assert ds.io_mode == "cpu"


def test_batches_are_assembled_ahead_of_the_consumer(data_path, monkeypatch):
    """While the consumer holds batch N, the assembler has the next ``batches_ahead`` ones ready, no more."""
    handoffs: list[Handoff] = []

    class Recorded(Handoff):
        def __init__(self, ahead: int):
            super().__init__(ahead)
            handoffs.append(self)

    monkeypatch.setattr(pipeline_module, "Handoff", Recorded)  # each pipeline's: assembler -> consumer
    path, data = data_path
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2, batches_ahead=3) as ds:
        it = iter(ds)
        check_batch(next(it), data)
        [assembled] = handoffs  # the running pipeline's batches assembled, not taken yet
        deadline = time.monotonic() + 5
        while len(assembled) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(assembled) == 3
        time.sleep(0.1)
        assert len(assembled) == 3, "bounded: the assembler waits for the consumer"
        for b in it:
            check_batch(b, data)
        assert ds.stats.batches == len(ds)


def test_batches_are_fresh_arrays(data_path):
    path, data = data_path
    with Dataset(path, batch_size=16, backend="cpu", window_blocks=2) as ds:
        it = iter(ds)
        first = next(it)
        keep = {k: v.copy() for k, v in first.items()}
        first["x"][:] = -1  # the user owns the batch: scribbling on it changes nothing else
        rest = list(it)
        np.testing.assert_array_equal(keep["x"], data["x"][keep["idx"]])
        for b in rest:
            check_batch(b, data)
        again = list(ds)
        np.testing.assert_array_equal(again[0]["x"], keep["x"])


def test_subset_of_fields(data_path):
    path, data = data_path
    with Dataset(path, batch_size=100, fields=["idx"], backend="cpu") as ds:
        batches = list(ds)
    assert set(batches[0]) == {"idx"}
    np.testing.assert_array_equal(np.concatenate([b["idx"] for b in batches]), np.arange(997))


def test_epochs_shuffle_differently_and_reproducibly(data_path):
    path, _ = data_path

    def order(epoch: int, seed: int = 0) -> list[int]:
        with Dataset(path, batch_size=64, backend="cpu", shuffle=True, seed=seed, window_blocks=4) as ds:
            ds.set_epoch(epoch)
            return np.concatenate([b["idx"] for b in ds]).tolist()

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0) != order(0, seed=1)
    assert sorted(order(1)) == list(range(997))


# -- resume ----------------------------------------------------------------------------------------
def collect(ds: GDSDataset, epochs: range) -> list[list[int]]:
    out = []
    for e in epochs:
        ds.set_epoch(e)
        out.append([i for b in ds for i in b["idx"].tolist()])
    return out


@pytest.mark.parametrize("cut", [1, 5, 12, 31, 32])  # first batch, mid-window, window edge, last, epoch end
def test_resume_yields_exactly_the_rest(data_path, cut):
    path, _ = data_path
    opts = dict(batch_size=32, backend="cpu", shuffle=True, seed=9, window_blocks=3)
    with Dataset(path, **opts) as ref:
        full = collect(ref, range(3))
        assert len(ref) == 32
    with Dataset(path, **opts) as first:
        first.set_epoch(1)
        seen = []
        for i, b in enumerate(first):
            seen.extend(b["idx"].tolist())
            if i + 1 == cut:
                state = first.state_dict()
                break
    assert state["epoch"] == 1 and state["batches_yielded"] == cut
    json.dumps(state)  # small and plain
    with Dataset(path, **opts) as second:
        second.load_state_dict(state)
        rest = collect(second, range(1, 3))
    assert seen + rest[0] == full[1]
    assert rest[1] == full[2]


def test_resume_in_a_fresh_process(data_path):
    path, _ = data_path
    script = (
        "import json, sys, numpy as np\n"
        "from gdsload import GDSDataset\n"
        "ds = GDSDataset(sys.argv[1], batch_size=40, backend='cpu', shuffle=True, seed=2, window_blocks=2)\n"
        "ds.load_state_dict(json.loads(sys.argv[2]))\n"
        "print(json.dumps(np.concatenate([b['idx'] for b in ds]).tolist()))\n"
    )
    with Dataset(path, batch_size=40, backend="cpu", shuffle=True, seed=2, window_blocks=2) as ds:
        full = np.concatenate([b["idx"] for b in ds]).tolist()
        ds.set_epoch(0)
        it = iter(ds)
        head = [next(it)["idx"].tolist() for _ in range(7)]
        state = ds.state_dict()
        del it
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", script, path, json.dumps(state)], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath})
    assert sum(head, []) + json.loads(out.stdout) == full


def test_state_from_another_config_is_refused(data_path):
    path, _ = data_path
    # batch_size, window_blocks and world_size may change (tests/test_resume.py); the seed may not
    with Dataset(path, batch_size=32, backend="cpu", shuffle=True, seed=1) as a, \
            Dataset(path, batch_size=16, backend="cpu", shuffle=True, seed=2) as b:
        with pytest.raises(ValueError, match="seed: saved 1, now 2"):
            b.load_state_dict(a.state_dict())


def test_ranks_cover_the_epoch_once(data_path):
    path, _ = data_path
    per_rank = []
    for rank in range(3):
        with Dataset(path, batch_size=10, backend="cpu", shuffle=True, rank=rank, world_size=3) as ds:
            per_rank.append([b["idx"] for b in ds])
    assert len({len(r) for r in per_rank}) == 1
    allidx = np.concatenate([np.concatenate(r) for r in per_rank])
    assert set(allidx.tolist()) == set(range(997)) and len(allidx) - 997 < 3 * 8


def test_rank_from_environment(data_path, monkeypatch):
    path, _ = data_path
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with Dataset(path, batch_size=10, backend="cpu") as ds:
        assert (ds.config.rank, ds.config.world_size) == (1, 2)


# -- the next epoch, read ahead ---------------------------------------------------------------------
def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_next_epoch_is_read_ahead_and_exact(data_path, pipelines):
    path, data = data_path
    opts = dict(batch_size=32, backend="cpu", shuffle=True, seed=3, window_blocks=3)
    with Dataset(path, **opts) as ref:
        want = collect(ref, range(3))  # one fresh pipeline per epoch: nothing read ahead
    pipelines.clear()
    with Dataset(path, **opts) as ds:
        got = []
        for e in range(3):
            ds.set_epoch(e)
            it = iter(ds)
            if e > 0:  # read while the last pass ran (or since): data waits before the first next()
                assert wait_for(lambda: pipelines[-1].stats.bytes_read > 0), "the next epoch is read ahead"
            first = next(it)
            assert ds.stats.read_ahead == (e > 0), "the stats say whether the pass was read ahead"
            got.append([i for b in itertools.chain([first], it) for i in (check_batch(b, data), b["idx"].tolist())[1]])
        assert len(pipelines) == 1, "one pipeline ran the three epochs"
        assert len(reader_threads()) == 3  # reading epoch 3 ahead
    assert got == want
    assert wait_no_readers() == []


def test_other_epoch_or_resume_starts_afresh(data_path):
    path, _ = data_path
    opts = dict(batch_size=32, backend="cpu", shuffle=True, seed=3, window_blocks=3)
    with Dataset(path, **opts) as ref:
        want = collect(ref, [0, 5])
        ref.set_epoch(1)
        state, head = None, []
        for i, b in enumerate(ref):
            head.extend(b["idx"].tolist())
            if i == 6:
                state = ref.state_dict()
                break
        ref.set_epoch(1)
        epoch1 = [i for b in ref for i in b["idx"].tolist()]
    with Dataset(path, **opts) as ds:
        assert collect(ds, [0, 5]) == want  # epoch 1 was read ahead; 5 was asked for
        list(ds)  # epoch 5 again: its pass read epoch 6 ahead
        ds.load_state_dict(state)
        assert head + [i for b in ds for i in b["idx"].tolist()] == epoch1


def test_without_shuffle_every_epoch_continues(data_path, pipelines):
    path, data = data_path
    with Dataset(path, batch_size=32, backend="cpu", window_blocks=3) as ds:
        first = [b["idx"].tolist() for b in ds]
        [pipeline] = pipelines
        second = [b["idx"].tolist() for b in ds]  # no set_epoch: without shuffle every epoch is the same
        assert pipelines == [pipeline] and not pipeline.closed and first == second


def test_without_set_epoch_every_pass_is_a_new_epoch(data_path, pipelines):
    """As DataLoader(shuffle=True): a loop that never calls set_epoch (PyTorch Lightning's) still gets a new
    order every pass, read ahead, and the state says which epoch it is in."""
    path, _ = data_path
    with Dataset(path, batch_size=32, backend="cpu", shuffle=True, window_blocks=3) as ds:
        first = [b["idx"].tolist() for b in ds]
        [pipeline] = pipelines
        second = [b["idx"].tolist() for b in ds]  # epoch 1, read ahead while epoch 0 ran
        assert pipelines == [pipeline] and not pipeline.closed and first != second and ds.epoch == 1
        np.testing.assert_array_equal(np.concatenate(second), epoch_plan(ds.config, 1).sample_ids())
        it = iter(ds)  # epoch 2, left after 3 batches: the state resumes it exactly
        taken = [next(it)["idx"].tolist() for _ in range(3)]
        state = ds.state_dict()
        assert state["epoch"] == 2 and state["batches_yielded"] == 3
    with Dataset(path, batch_size=32, backend="cpu", shuffle=True, window_blocks=3) as ds:
        ds.load_state_dict(state)
        rest = [b["idx"].tolist() for b in ds]
        np.testing.assert_array_equal(np.concatenate(taken + rest), epoch_plan(ds.config, 2).sample_ids())
        ds.set_epoch(7)  # set_epoch is respected from then on
        assert np.array_equal(np.concatenate([b["idx"] for b in ds]), epoch_plan(ds.config, 7).sample_ids())


def test_prefetch_next_epoch_off(data_path):
    path, _ = data_path
    with Dataset(path, batch_size=32, backend="cpu", window_blocks=3, prefetch_next_epoch=False) as ds:
        assert len(list(ds)) == len(ds)
        assert wait_no_readers() == []
        assert len(list(ds)) == len(ds) and not ds.stats.read_ahead


def test_error_read_ahead_surfaces_in_the_pass_that_needs_it(data_path):
    path, _ = data_path
    with Dataset(path, batch_size=8, backend="cpu", window_blocks=2, prefetch=1) as ds:
        assert len(list(ds)) == len(ds)
        with DatasetLayout(ds.meta, ds.fields) as layout:
            shards = [p for p in layout.shard_paths() if "/x/" in p]  # in shard order
        last_shard = shards[-1]
        with open(last_shard, "r+b") as f:  # the last window: not read ahead yet (2 buffers of 2 blocks)
            f.truncate(100)
        got = []
        with pytest.raises(ReadError) as info:
            for b in ds:
                got.append(b)
        first_bad = (len(shards) - 1) * ds.meta.fields["x"].blocks_per_shard  # block, = batch (8 samples each)
        msg = str(info.value)  # the second pass is epoch 1: without set_epoch each pass is a new epoch
        assert msg.startswith(f"{last_shard}: ") and f"window {first_bad // 2} of epoch 1" in msg
        assert len(got) == first_bad, "every batch before it arrives"
        assert wait_no_readers() == []


def test_stop_ends_the_read_ahead_and_the_next_pass_restarts(data_path):
    path, data = data_path
    with Dataset(path, batch_size=32, backend="cpu", shuffle=True, window_blocks=3) as ds:
        list(ds)
        assert reader_threads()
        ds.stop()
        assert wait_no_readers() == []
        ds.set_epoch(1)
        batches = list(ds)
        assert sorted(i for b in batches for i in b["idx"].tolist()) == list(range(997))
        for b in batches:
            check_batch(b, data)
    assert wait_no_readers() == []


def test_reading_ahead_dataset_is_collected(data_path):
    path, _ = data_path
    before = set(threading.enumerate())
    ds = Dataset(path, batch_size=32, backend="cpu", window_blocks=3)
    list(ds)
    assert reader_threads()
    del ds
    gc.collect()
    assert wait_no_readers() == []
    assert threads_left_since(before) == []


# -- lifecycle -------------------------------------------------------------------------------------
def test_threads_stop_on_break_close_and_gc(data_path):
    path, _ = data_path
    before = set(threading.enumerate())
    ds = Dataset(path, batch_size=8, backend="cpu", window_blocks=1)
    it = break_then_close(ds)
    assert threads_left_since(before, timeout_s=0) == [], "close() stops the backend's pool too"
    with pytest.raises(GDSLoadError, match="iterator was closed"):
        next(it)
    with pytest.raises(GDSLoadError, match="the dataset was closed"):
        iter(ds)

    ds = Dataset(path, batch_size=8, backend="cpu", window_blocks=1)
    it = iter(ds)
    next(it)
    del ds, it
    gc.collect()  # the clean-up runs on the reaper thread (gdsload._tasks.Reaper), soon after
    assert wait_no_readers() == []
    assert threads_left_since(before) == []


def test_new_pass_closes_the_previous_one(data_path):
    path, data = data_path
    with Dataset(path, batch_size=8, backend="cpu", window_blocks=1) as ds:
        old = iter(ds)
        next(old)
        fresh = list(ds)
        assert len(fresh) == len(ds)
        for b in fresh:
            check_batch(b, data)
        with pytest.raises(GDSLoadError, match="iterator was closed"):
            next(old)
        assert len(reader_threads()) == 3, "the old pass's threads ended; the new one reads the next epoch"
        ds.stop()
        assert wait_no_readers() == []


def test_reader_error_surfaces_with_file_and_offset(data_path):
    path, _ = data_path
    before = set(threading.enumerate())
    shard = os.path.join(path, "x", "c", "1", "0, 0".replace(", ", os.sep))
    with Dataset(path, batch_size=8, backend="cpu", window_blocks=2) as ds:
        with open(shard, "r+b") as f:  # damage the file after the index was read
            f.truncate(100)
        got = []
        with pytest.raises(ReadError) as info:
            for b in ds:
                got.append(b)
        msg = str(info.value)
        assert shard in msg and "offset" in msg and "reading window" in msg
        assert got, "batches before the damaged block still arrive"
        assert wait_no_readers() == []
    assert threads_left_since(before, timeout_s=0) == []


def test_files_moved_after_open_are_still_read(data_path):
    """Shard files are opened with the dataset: what happens at their paths later does not matter."""
    path, data = data_path
    with Dataset(path, batch_size=8, backend="cpu") as ds:
        os.rename(os.path.join(path, "x"), os.path.join(path, "moved"))
        for b in ds:
            check_batch(b, data)


def test_torch_output_on_cpu(data_path):
    torch = pytest.importorskip("torch")
    path, data = data_path
    with Dataset(path, batch_size=50, backend="cpu", output="torch") as ds:
        b = next(iter(ds))
    assert isinstance(b["x"], torch.Tensor)
    np.testing.assert_array_equal(b["x"].numpy(), data["x"][b["idx"].numpy()])


def test_bad_arguments(data_path):
    path, _ = data_path
    with pytest.raises(ValueError, match="output 'cupy' does not fit backend 'cpu'"):
        Dataset(path, batch_size=8, backend="cpu", output="cupy")
    with pytest.raises(ValueError, match="unknown backend 'nvme'"):
        Dataset(path, batch_size=8, backend="nvme")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        Dataset(path, batch_size=0, backend="cpu")
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        Dataset(path, batch_size=8, backend="cpu", prefetch=0)
    with pytest.raises(ValueError, match="batches_ahead must be at least 1"):
        Dataset(path, batch_size=8, backend="cpu", batches_ahead=0)


def test_batches_ahead_defaults_to_the_backends(data_path):
    path, _ = data_path
    with Dataset(path, batch_size=8, backend="cpu") as ds:
        assert ds.batches_ahead == info(ds.backend_name).backend_class.batches_ahead_hint == 2
    with Dataset(path, batch_size=8, backend="cpu", batches_ahead=5) as ds:
        assert ds.batches_ahead == 5


def test_gpu_backend_without_gpu_is_a_clear_error(data_path):
    from gdsload.system.env import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    from gdsload import BackendUnavailable

    path, _ = data_path
    for name in ("pinned", "kvikio", "mmap"):
        with pytest.raises(BackendUnavailable, match=f"backend '{name}' needs a CUDA GPU"):
            Dataset(path, batch_size=8, backend=name)
    assert reader_threads() == []


def test_backend_is_prepared_with_every_shard_it_may_read(data_path, plug):
    """A backend that maps files (mmap) gets them all at open, and a failure there leaves nothing running."""
    path, _ = data_path
    seen: list[list[str]] = []

    class Preparing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def prepare(self, files):
            seen.append(list(files))
            super().prepare(files)

    class Refusing(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def prepare(self, files):
            raise ReadError(f"{list(files)[0]}: refused")

    preparing = plug(Preparing)
    with Dataset(path, batch_size=8, backend=preparing, fields=["x"]) as ds, \
            DatasetLayout(ds.meta, ds.fields) as layout:
        want = layout.shard_paths()
    assert seen == [want] and want and all(os.path.isfile(p) and "/x/" in p for p in want)

    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        Dataset(path, batch_size=0, backend=preparing)
    assert len(seen) == 1, "arguments are checked before the backend reads anything"

    with pytest.raises(ReadError, match="refused"):
        Dataset(path, batch_size=8, backend=plug(Refusing))
    assert wait_no_readers() == [] and not [t for t in threading.enumerate() if t.name.startswith("gdsload-cpu")]


def test_resident_fields_are_read_once(data_path):
    path, data = data_path
    with Dataset(path, batch_size=64, backend="cpu", shuffle=True, window_blocks=2) as ds:
        assert ds.resident_fields == ("idx",) and ds.windowed_fields == ("x",)
        first = list(ds)
        first_bytes = ds.stats.bytes_read
        ds.set_epoch(1)
        second = list(ds)
        assert first_bytes - ds.stats.bytes_read == ds.meta.num_blocks * 8 * 8  # idx only in the first pass
    for b in first + second:
        check_batch(b, data)


def test_resident_read_error_names_field_and_file(data_path):
    path, _ = data_path
    shard = os.path.join(path, "idx", "c", "0")
    with Dataset(path, batch_size=8, backend="cpu") as ds:
        os.truncate(shard, 10)
        with pytest.raises(ReadError, match=rf"^{shard}: file ends at offset .* \(reading resident field 'idx'\)"):
            next(iter(ds))


def test_taking_a_batch_wakes_the_assembler_only_on_every_second_release():
    """The consumer's take leaves the assembler waiting until the consumer gives room back, two places at a
    time (one wake-up per two batches), so the assembler's next work starts after the consumer's own calls;
    it holds one batch more than ``ahead`` so that as many are ready after a take as before."""
    from gdsload.backends.handoff import Handoff

    stop = threading.Event()
    handoff = Handoff(1)
    assert handoff.capacity == 1 + Handoff.GROUP - 1 == 2
    assert handoff.put("a", stop) and handoff.put("b", stop)
    third = threading.Thread(target=handoff.put, args=("c", stop))
    third.start()
    assert handoff.get(stop) == "a"
    handoff.release()
    third.join(0.2)
    assert third.is_alive() and len(handoff) == 1, "one release gives no room back"
    assert handoff.get(stop) == "b"
    third.join(0.2)
    assert third.is_alive() and len(handoff) == 0, "room is given back by release(), not by the take"
    handoff.release()
    third.join(5)
    assert not third.is_alive() and handoff.get(stop) == "c"
    assert handoff.put("d", stop), "the second place given back is the producer's too"
    assert handoff.get(stop) == "d"
    stop.set()
    assert handoff.get(stop) is None, "stopped and empty"
    assert not handoff.put("e", stop), "stopped, no place given back: the producer gives up"


def test_a_stopped_producer_gives_up_at_once_even_where_room_was_given_back():
    """The defect: closing a pipeline whose assembler waited for room cleared the hand-off (room given back),
    the assembler gathered batches nobody would take until the room ran out again, then waited a whole poll
    (``POLL_S``) before it saw the stop; close() joined it 50 ms later (H100, probe_timeline)."""
    from gdsload.backends.handoff import POLL_S, Handoff

    stop = threading.Event()
    handoff = Handoff(1)
    assert handoff.put("a", stop) and handoff.put("b", stop)
    stop.set()
    handoff.clear()  # as close() does: room for a whole hand-off again
    t0 = time.perf_counter()
    assert not handoff.put("c", stop), "stopped: nothing more is queued"
    assert not handoff.put("d", stop)
    assert not handoff.put("e", stop)  # no room left here without the check: a poll's wait
    assert time.perf_counter() - t0 < POLL_S / 2
    assert len(handoff) == 0


def test_the_backend_is_told_once_that_the_first_batch_was_assembled(data_path, monkeypatch, plug):
    """Backend.started() (what the mmap backend's background load waits for) comes once per pipeline, right
    after its first batch was assembled (so that load does not compete with that batch), after the resident
    fields and the first window were read."""
    from gdsload.pipeline import pipeline as pipeline_module

    path, data = data_path
    calls: list[str] = []

    class Told(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def submit(self, *a, **k):
            calls.append("submit")
            return super().submit(*a, **k)

        def started(self):
            calls.append("started")

    put = pipeline_module.Handoff.put
    monkeypatch.setattr(pipeline_module.Handoff, "put", lambda self, item, stop: (calls.append("batch"),
                                                                                 put(self, item, stop))[1])
    with Dataset(path, backend=plug(Told), batch_size=32, window_blocks=2, prefetch_next_epoch=False) as ds:
        for b in ds:
            check_batch(b, data)
        assert calls.count("started") == 1
        i = calls.index("started")
        assert calls[i - 1] == "batch" and calls[:i].count("batch") == 1, calls[:i + 1]
        assert calls[:2] == ["submit", "submit"], "the first window at open, then the resident field"
        calls.clear()
        ds.set_epoch(1)
        assert len(list(ds)) == len(ds) and calls.count("started") == 1, "once per pipeline"


def test_the_pass_being_taken_never_waits_for_the_next_ones_plan(data_path, monkeypatch, pipelines):
    """The readers make the next epoch's plan while the consumer takes this one: asking for the pass it is
    in (its stats, a new batch) must not wait until that plan is made (it did: one lock for every pass)."""
    import gdsload.dataset as dataset_module

    path, data = data_path
    gate, making = threading.Event(), threading.Event()
    real = dataset_module.epoch_plan

    def slow(config, epoch, pace=None):
        if epoch >= 1:  # the next epoch's plan, made by a reader thread
            making.set()
            gate.wait(5)
        return real(config, epoch, pace)

    monkeypatch.setattr(dataset_module, "epoch_plan", slow)
    release = threading.Timer(4, gate.set)  # nothing hangs for good where the lock is shared
    release.start()
    try:
        with Dataset(path, batch_size=32, backend="cpu", shuffle=True, seed=1) as ds:
            it = iter(ds)
            check_batch(next(it), data)
            assert making.wait(5), "the readers went on to the next epoch's plan"
            t0 = time.perf_counter()
            pipeline = pipelines[-1]
            assert pipeline.stats.batches == 1
            rest = [check_batch(b, data) for b in it]
            took = time.perf_counter() - t0
            assert not gate.is_set() and took < 2, f"the pass waited {took:.2f} s for the next epoch's plan"
            assert len(rest) == -(-len(data["idx"]) // 32) - 1
            gate.set()
    finally:
        gate.set()
        release.cancel()
