"""The training examples: they compile and answer --help without torch, make_data writes what they read, the
DataLoader's per-sample reader reads what zarr reads, the GPU's idle share adds up its gaps (everywhere); on a
GPU with torch they train a few steps with both loaders, resume exactly from a checkpoint, and run both loaders
under Lightning when it is installed."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import subprocess
import sys
import types
from collections.abc import Callable

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
SCRIPTS = ("make_data.py", "train.py", "lightning_train.py", "model.py", "common.py", "feeds.py")
RATE = re.compile(r"^epoch (\d+): (\d+) steps, [\d,]+ images in [\d.]+ s: [\d,]+ images/s on \d+ "
                  r"(GPU\(s\)|CPU process\(es\))(.*)$", re.M)


def example(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=timeout)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


@pytest.fixture(scope="module")
def examples_path():
    sys.path.insert(0, EXAMPLES)
    yield EXAMPLES
    sys.path.remove(EXAMPLES)


def test_examples_compile_and_answer_help_without_importing_torch(tmp_path):
    for script in SCRIPTS:
        py_compile.compile(os.path.join(EXAMPLES, script), cfile=str(tmp_path / (script + "c")), doraise=True)
    for script in ("make_data.py", "train.py", "lightning_train.py"):
        out = ok(example(script, "--help", timeout=60))
        assert out.startswith("usage:"), out


@pytest.mark.parametrize("nchw", [False, True])
def test_make_data_writes_what_the_examples_read(tmp_path, examples_path, nchw):
    import common

    from gdsload import GDSDataset

    path = str(tmp_path / "synth.gds")
    out = ok(example("make_data.py", path, "--samples", "700", "--size", "8", *(["--nchw"] if nchw else [])))
    assert out.startswith(f"wrote {path}: 700 images")
    fields = common.inspect(path, "images", "labels")
    assert fields == common.Fields("images", "labels", not nchw, 10, 700)
    with GDSDataset(path, batch_size=700, backend="cpu") as ds:
        batch = next(iter(ds))
    images, labels = batch["images"], batch["labels"]
    colour = images.reshape(700, 3, -1).mean(2) if nchw else images.reshape(700, -1, 3).mean(1)
    assert np.bincount(labels, minlength=10).min() > 20
    means = np.stack([colour[labels == c].mean(0) for c in range(10)])
    nearest = np.linalg.norm(colour[:, None, :] - means[None], axis=2).argmin(1)
    assert (nearest == labels).all(), "each class has a colour of its own: the model has something to learn"


def test_the_dataloader_reader_reads_each_sample_as_zarr_does(tmp_path, examples_path, monkeypatch):
    import zarr

    if importlib.util.find_spec("torch") is None:  # the reader only wraps its arrays with torch.from_numpy
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_numpy=lambda a: a))
    import feeds

    path = str(tmp_path / "synth.gds")
    ok(example("make_data.py", path, "--samples", "1500", "--size", "8"))
    samples = feeds.ShardSamples(path, ("images", "labels"))
    group = zarr.open_group(path, mode="r")
    assert len(samples) == 1500
    for i in (0, 1, 340, 341, 777, 1499):
        got = samples[i]
        assert np.array_equal(np.asarray(got["images"]), group["images"][i])
        assert int(np.asarray(got["labels"])) == int(group["labels"][i])


def test_idle_fraction_is_the_gaps_share_of_the_epoch(examples_path):
    import feeds

    assert feeds.idle_fraction([1.0, 0.5, 0.0], 10.0) == pytest.approx(0.15)
    assert feeds.idle_fraction([], 10.0) == 0.0
    assert feeds.idle_fraction([], 0.0) == 0.0  # an epoch with no GPU time: nothing waited
    assert feeds.idle_fraction([4.0], 4.0) == 1.0
    with pytest.raises(ValueError, match="negative GPU time"):  # events on two streams, out of order
        feeds.idle_fraction([1.0, -0.5], 10.0)


class FakeEvent:
    """A CUDA event on a fake clock: ``record()`` takes the clock's time, ``elapsed_time`` subtracts."""

    clock = [0.0]

    def __init__(self, enable_timing: bool):
        assert enable_timing
        self.t: float | None = None

    def record(self) -> None:
        self.t = FakeEvent.clock[0]

    def synchronize(self) -> None:
        assert self.t is not None

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def test_gpu_gaps_count_open_to_close_over_first_event_to_the_end(examples_path):
    """As the Lightning callback drives it: a close opens the epoch, then steps end (open) and the next batch
    is there (close); the gap after the last step and a close with no open gap are not counted."""
    import feeds

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=FakeEvent))
    gaps = feeds.GpuGaps(fake)

    def at(t: float, mark: Callable[[], None]) -> None:
        FakeEvent.clock[0] = t
        mark()

    at(100.0, gaps.close_gap)  # first on_train_batch_start: the epoch's origin
    at(110.0, gaps.open_gap)  # step 0 done
    at(112.0, gaps.close_gap)  # batch 1 there: a 2 ms gap
    at(120.0, gaps.open_gap)
    at(121.0, gaps.close_gap)  # 1 ms
    at(125.0, gaps.close_gap)  # no open gap: nothing counted
    at(130.0, gaps.open_gap)  # the last step done; never closed
    FakeEvent.clock[0] = 140.0
    assert gaps.fraction() == pytest.approx(3.0 / 40.0)
    # As train.py drives it: the first open is the origin; an open left by StopIteration is not counted.
    gaps = feeds.GpuGaps(fake)
    at(0.0, gaps.open_gap)
    at(5.0, gaps.close_gap)
    at(20.0, gaps.open_gap)
    FakeEvent.clock[0] = 25.0
    assert gaps.fraction() == pytest.approx(5.0 / 25.0)
    empty = feeds.GpuGaps(fake)
    assert empty.fraction() == 0.0


# -- on the CPU (as CI runs them) and on a GPU, with torch ---------------------------------------------------
def needs_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (the test extra installs the CPU build)")


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("examples") / "synth.gds")
    ok(example("make_data.py", path, "--samples", "4096", "--size", "32"))
    return path


#: Where the examples train: ``--backend cpu`` (the CPU, on any machine: it failed without a GPU, on torch's
#: "Found no NVIDIA driver"), or as on a GPU machine by default.
WHERE = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def on(where: str) -> tuple[str, ...]:
    return ("--backend", "cpu") if where == "cpu" else ()


def epochs(out: str) -> dict[int, tuple[int, str]]:
    """epoch -> (steps, the rest of its line) from the printed images/s lines."""
    return {int(m.group(1)): (int(m.group(2)), m.group(4)) for m in RATE.finditer(out)}


def digest(rest: str) -> int:
    return int(re.search(r"labels digest (-?\d+)", rest).group(1))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("loader", ["gdsload", "dataloader"])
def test_train_runs_a_few_steps_with_each_loader(synth, loader, where):
    needs_torch()
    out = ok(example("train.py", "--data", synth, "--loader", loader, "--steps", "5", "--epochs", "2",
                     "--batch-size", "64", "--workers", "2", *on(where)))
    assert out.startswith(f"loader: {'gdsload' if loader == 'gdsload' else 'torch DataLoader'}")
    seen = epochs(out)
    assert sorted(seen) == [0, 1] and all(steps == 5 for steps, _ in seen.values()), out
    assert all(("GPU waited for data" in rest) == (where == "gpu") for _, rest in seen.values()), out
    assert all("host blocked in next()" in rest for _, rest in seen.values()), out
    assert all(m.group(3) == ("GPU(s)" if where == "gpu" else "CPU process(es)") for m in RATE.finditer(out))
    assert "epochs after the first:" in out and "images/s" in out


@pytest.mark.parametrize("where", WHERE)
def test_train_resumes_exactly_from_a_checkpoint(synth, tmp_path, where):
    """An epoch interrupted after 3 steps and resumed trains on exactly the batches of an uninterrupted one."""
    needs_torch()
    common_args = ("--data", synth, "--steps", "6", "--epochs", "1", "--batch-size", "64", *on(where))
    whole = epochs(ok(example("train.py", *common_args)))
    ck = str(tmp_path / "ck.pt")
    first = ok(example("train.py", *common_args, "--checkpoint", ck, "--checkpoint-every", "3", "--stop-after", "3"))
    assert "stopped after 3 steps" in first and os.path.exists(ck)
    second = ok(example("train.py", *common_args, "--resume", ck))
    assert "resumed from" in second and "epoch 0 after step 3" in second
    a, b = epochs(first)[0], epochs(second)[0]
    assert whole[0][0] == 6 and a[0] == 3 and b[0] == 3
    assert digest(a[1]) + digest(b[1]) == digest(whole[0][1]), (first, second)
    # A checkpoint written at the end of an epoch resumes at the next one.
    end = str(tmp_path / "end.pt")
    ok(example("train.py", *common_args, "--checkpoint", end))
    resumed = ok(example("train.py", "--data", synth, "--steps", "6", "--epochs", "2", "--batch-size", "64",
                         "--resume", end, *on(where)))
    assert sorted(epochs(resumed)) == [1], resumed


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("loader", ["gdsload", "dataloader"])
def test_lightning_trains_with_each_loader(synth, loader, where):
    """Both loaders under Trainer.fit: every epoch line has the GPU's idle share (on a GPU); gdsload's epochs
    are Lightning's (the iterator Lightning makes to probe the dataset starts no pass); the fit is timed."""
    needs_torch()
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("needs lightning or pytorch_lightning (the test extra installs lightning)")
    out = ok(example("lightning_train.py", "--data", synth, "--loader", loader, "--steps", "5", "--epochs", "2",
                     "--batch-size", "64", "--workers", "2", *on(where)))
    assert out.startswith(f"loader: {'gdsload' if loader == 'gdsload' else 'torch DataLoader'}"), out
    assert re.search(r"^open: [\d.]+ s", out, re.M), out
    seen = epochs(out)
    assert sorted(seen) == [0, 1] and all(steps == 5 for steps, _ in seen.values()), out
    for epoch, (_, rest) in seen.items():
        idle = re.search(r"GPU idle between steps ([\d.]+)% of the time", rest)
        assert (idle is not None) == (where == "gpu"), rest
        assert idle is None or 0.0 <= float(idle.group(1)) <= 100.0, rest
        assert (f"gdsload epoch {epoch}" in rest) == (loader == "gdsload"), rest
    assert re.search(r"^fit: 2 epochs in [\d.]+ s \(wall, Trainer\.fit call\)$", out, re.M), out


def test_every_option_of_the_examples_has_help_and_its_default(examples_path, monkeypatch):
    """make_data's --samples / --seed, train's --epochs / --lr and others had no help; --backend offered no cpu."""
    import common
    import make_data
    import train
    from test_cli import check_help

    monkeypatch.setenv("COLUMNS", "200")
    for script, parser, args in (("make_data.py", make_data.build_parser(), ["d.gds"]),
                                 ("train.py", train.build_parser(), ["--data", "d.gds"]),
                                 ("lightning_train.py", common.parser("-"), ["--data", "d.gds"])):
        defaults = vars(parser.parse_args(args))
        defaults.pop("data", None)  # required: given above
        check_help(ok(example(script, "--help", timeout=60)), defaults)
    text = ok(example("train.py", "--help", timeout=60))
    assert "--backend {auto,kvikio,pinned,mmap,cpu}" in text and "(default: auto)" in text
