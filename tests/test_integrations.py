"""gdsload under torch, Lightning, torchdata and JAX (gdsload.integrations, output="jax"): on the CPU where the
packages are installed (the test extra installs them), the GPU variants under ``-m gpu``."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from _helpers import labelled
from gdsload import BackendUnavailable, GDSDataset, GDSLoadError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
N = 200


@pytest.fixture
def data(make_dataset) -> tuple[str, dict[str, np.ndarray]]:
    arrays = labelled(N, shape=(4,))
    return make_dataset(arrays, samples_per_block=10), arrays


def opened(path: str, **kw) -> GDSDataset:
    kw = {"batch_size": 16, "backend": "cpu", "shuffle": True, "seed": 3, "resident_bytes": 0, **kw}
    return GDSDataset(path, **kw)


def host(a) -> np.ndarray:
    """A batch's array on the host: a CUDA tensor or a CuPy array copied back, a host array as it is."""
    return a.cpu().numpy() if hasattr(a, "cpu") else a.get() if hasattr(a, "get") else np.asarray(a)


def ids(batches) -> list[list[int]]:
    return [[int(i) for i in host(b["idx"])] for b in batches]


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV,
                          timeout=300)


# -- torch: an IterableDataset, without importing torch ---------------------------------------------------------
def test_importing_gdsload_imports_no_torch_and_the_dataset_is_an_iterable_dataset_whenever_torch_comes(data):
    """torch imported before gdsload, after it, or after the dataset was opened: isinstance holds every way,
    and the finder that waited for torch is gone from sys.meta_path once it has registered."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    path, _ = data
    check = (f"ds = GDSDataset({path!r}, batch_size=8, backend='cpu')\n"
             "from torch.utils.data import IterableDataset\n"
             "assert isinstance(ds, IterableDataset) and issubclass(GDSDataset, IterableDataset)\n"
             "from gdsload.integrations import RegisterOnImport\n"
             "assert not any(isinstance(f, RegisterOnImport) for f in sys.meta_path), sys.meta_path\n")
    for code in ("import sys\nimport gdsload\nassert 'torch' not in sys.modules\nfrom gdsload import GDSDataset\n"
                 + check,
                 "import sys, torch\nfrom gdsload import GDSDataset\n" + check,
                 f"import sys\nfrom gdsload import GDSDataset\nimport numpy\n{check.splitlines()[0]}\n"
                 "assert 'torch' not in sys.modules\nimport torch\n" + "\n".join(check.splitlines()[1:])):
        done = python(code)
        assert done.returncode == 0, code + done.stderr[-3000:]


def test_a_dataloader_with_batch_size_none_hands_the_batches_on(data):
    """It failed with "'GDSDataset' object is not subscriptable" (taken for a map-style dataset)."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    import torch
    from torch.utils.data import DataLoader

    path, arrays = data
    with opened(path) as direct:
        want = ids(direct)
    for output in ("torch", "numpy"):
        with opened(path, output=output) as ds:
            loader = DataLoader(ds, batch_size=None)
            assert len(loader) == len(ds) == len(want)
            got = list(loader)
        assert ids(got) == want, output
        for b in got:  # tensors (numpy arrays: converted by torch, sharing their memory), exact samples
            assert isinstance(b["x"], torch.Tensor) and isinstance(b["idx"], torch.Tensor)
            np.testing.assert_array_equal(b["x"].numpy(), arrays["x"][b["idx"].numpy()])
    with opened(path, output="torch") as ds:  # what the loader does to each batch leaves its tensors as they are
        batch = next(iter(ds))
        handed_on = DataLoader(ds, batch_size=None).collate_fn(batch)
    assert handed_on.keys() == batch.keys() and all(handed_on[k] is batch[k] for k in batch)


def test_workers_are_refused_saying_why_and_what_to_do(data):
    """A forked worker (Linux's default) fails its first batch with the reason; a spawned one is refused while
    the loader pickles the dataset, in the parent; copies are refused the same way."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    from torch.utils.data import DataLoader

    path, _ = data
    code = ("from torch.utils.data import DataLoader\nfrom gdsload import GDSDataset, GDSLoadError\n"
            f"ds = GDSDataset({path!r}, batch_size=8, backend='cpu')\n"
            "try:\n    next(iter(DataLoader(ds, batch_size=None, num_workers=1)))\n"
            "except GDSLoadError as e:\n    print(str(e).splitlines()[-1])\n")
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip()
    assert last.startswith(f"gdsload.errors.GDSLoadError: {path}: iterated in DataLoader worker process 0 "
                           "(num_workers > 0)"), last
    assert "num_workers=0 (the default)" in last, last
    with opened(path) as ds:
        with pytest.raises(TypeError, match=r"cannot be pickled or copied: .* num_workers=0 \(the default\)"):
            next(iter(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")))
        for refuse in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="GDSDataset cannot be pickled or copied"):
                refuse(ds)
        assert sum(1 for _ in ds) == len(ds)  # still usable here


def test_a_worker_check_outside_torch_workers_is_silent(data, monkeypatch):
    from gdsload import integrations

    path, _ = data
    with opened(path) as ds:
        integrations.refuse_worker(ds)  # torch not imported, or no worker: nothing to say
        fake = type(sys)("torch.utils.data")
        fake.get_worker_info = lambda: type("Info", (), {"id": 3})()
        monkeypatch.setitem(sys.modules, "torch.utils.data", fake)
        with pytest.raises(GDSLoadError, match=r"worker process 3 \(num_workers > 0\)"):
            iter(ds)
        fake.get_worker_info = lambda: None
        assert sum(1 for _ in ds) == len(ds)


# -- Lightning ------------------------------------------------------------------------------------------------
class Stop(Exception):
    """Ends a fit as an interruption would."""


def lightning_fit(path: str, ckpt_dir: str, seen: list, stop_after: int | None = None,
                  ckpt_path: str | None = None, accelerator: str = "cpu", output: str = "torch",
                  backend: str = "cpu", make=None) -> None:
    """Trainer.fit(model, train_dataloaders=ds) for 2 epochs, a checkpoint after every step and at each epoch's
    end; ``seen`` gets (Lightning's epoch, sample ids) per step; ``stop_after`` steps raise Stop."""
    import torch

    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (the test extra installs it)")

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if stop_after is not None and len(seen) == stop_after:
                raise Stop
            seen.append((self.current_epoch, [int(i) for i in batch["idx"].cpu()]))
            return self.lin(batch["x"]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    steps = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    epochs = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir + "-epochs", every_n_epochs=1, save_top_k=-1,
                                          save_on_train_epoch_end=True)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[steps, epochs])
    with (make() if make is not None else opened(path, output=output, backend=backend)) as ds:
        trainer.fit(Model(), train_dataloaders=ds, ckpt_path=ckpt_path)


def step_of(name: str) -> int:
    return int(name.split("step=")[1].split(".")[0].split("-")[0])


def check_lightning_resumes_exactly(path: str, tmp_path, **kw) -> None:
    whole: list = []
    lightning_fit(path, str(tmp_path / "whole"), whole, **kw)
    per_epoch = len(whole) // 2
    assert [e for e, _ in whole] == [0] * per_epoch + [1] * per_epoch
    assert whole[:per_epoch] != whole[per_epoch:]  # a new order each epoch
    part: list = []
    with pytest.raises(Stop):
        lightning_fit(path, str(tmp_path / "part"), part, stop_after=per_epoch + 4, **kw)
    last = max(os.listdir(tmp_path / "part"), key=step_of)
    assert step_of(last) == per_epoch + 4
    # Stopped mid-epoch; a step checkpoint at an epoch's last batch; a checkpoint of an epoch's end.
    for ckpt in (tmp_path / "part" / last, tmp_path / "whole" / f"epoch=0-step={per_epoch}.ckpt",
                 tmp_path / "whole-epochs" / f"epoch=0-step={per_epoch}.ckpt"):
        rest: list = []
        lightning_fit(path, str(tmp_path / "rest"), rest, ckpt_path=str(ckpt), **kw)
        assert rest == whole[step_of(ckpt.name):], ckpt


def test_lightning_resumes_a_fit_with_exactly_the_remaining_batches(data, tmp_path):
    """Lightning saves and restores the dataset's state in its checkpoints; from a checkpoint at an epoch's
    end (and one at its last batch) the next epoch's pass read gdsload's finished epoch again, or nothing:
    Lightning now gives the epoch to ds.sampler.set_epoch."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    check_lightning_resumes_exactly(data[0], tmp_path)


# -- a Mixture under torch ---------------------------------------------------------------------------------------
def mixed(path: str, **kw):
    from gdsload import Mixture

    return Mixture({"a": path, "b": path}, {"a": 3, "b": 1}, batch_size=8, num_batches=6, backend="cpu",
                   resident_bytes=0, shuffle=True, seed=3, **kw)


def sourced(batches) -> list[list[tuple[int, int]]]:
    return [list(zip(host(b["source"]).tolist(), host(b["idx"]).tolist())) for b in batches]


def test_a_mixture_is_an_iterable_dataset_that_a_dataloader_hands_on(data):
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    from torch.utils.data import DataLoader, IterableDataset

    with mixed(data[0]) as mix:
        want = sourced(mix)
    with mixed(data[0]) as mix:
        assert isinstance(mix, IterableDataset)
        loader = DataLoader(mix, batch_size=None)
        assert len(loader) == 6
        assert sourced(loader) == want
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(mix)


def test_a_dataloader_that_batches_is_refused_saying_to_use_batch_size_none(data):
    """DataLoader(ds, batch_size=32) failed inside torch's collate at the epoch's last, shorter batch (and
    batch_size=2 stacked two batches into one, saying nothing): the dataset yields whole batches, so a loader
    that batches again (its default batch_size is 1) is refused when it starts, saying what to pass, for
    torch's DataLoader and torchdata's StatefulDataLoader, a GDSDataset and a Mixture; batch_size=None works."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    import torchdata.stateful_dataloader as sdl
    from torch.utils.data import DataLoader

    path, _ = data
    with opened(path) as ds, mixed(path) as mix:
        for dataset, where in ((ds, path), (mix, "Mixture(")):
            for loader in (DataLoader(dataset, batch_size=32), DataLoader(dataset), DataLoader(dataset, batch_size=2),
                           sdl.StatefulDataLoader(dataset, batch_size=4)):
                with pytest.raises(ValueError) as info:
                    next(iter(loader))
                assert str(info.value).startswith(f"{where}") and "iterated by a torch DataLoader that batches" in \
                    str(info.value) and str(info.value).endswith("use DataLoader(ds, batch_size=None) and set the "
                                                                 "batch size on the dataset")
            assert sum(1 for _ in DataLoader(dataset, batch_size=None)) == len(dataset)


def test_the_dataloader_check_keeps_no_variable_of_its_caller_alive(data):
    """The check looks at the frames above __iter__ for a DataLoader's fetcher: reading any other frame's
    locals would keep them alive, so that a dataset iterated with torch imported was never freed by ``del``
    (its reader threads outliving it)."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    import gc
    import weakref

    import torch.utils.data  # noqa: F401 - a DataLoader could be there

    path, _ = data
    ds = opened(path)
    assert sum(1 for _ in ds) == len(ds)
    ref = weakref.ref(ds)
    del ds
    gc.collect()
    assert ref() is None, "the dataset outlived its last reference"


def test_a_mixtures_epochs_are_its_passes_for_lightnings_set_epoch(data):
    """Epoch e is the pass over steps [6e, 6e + 6): the epoch it stands in is accepted, any other refused
    saying where it stands; an endless mixture has none."""
    with mixed(data[0]) as mix:
        mix.sampler.set_epoch(0)
        assert len(list(mix)) == 6 and mix.step == 6
        mix.sampler.set_epoch(1)
        with pytest.raises(ValueError, match=r"set_epoch\(3\): this Mixture stands at step 6, in epoch 1"):
            mix.set_epoch(3)
        state = mix.state_dict()
    with mixed(data[0]) as mix:
        mix.load_state_dict(state)
        mix.set_epoch(1)  # a resumed mixture is in the epoch its state says
    from gdsload import Mixture

    with Mixture({"a": data[0]}, batch_size=8, backend="cpu") as endless:
        with pytest.raises(TypeError, match="endless"):
            endless.set_epoch(0)


def test_lightning_resumes_a_mixtures_fit_from_its_step_checkpoints(data, tmp_path):
    """Lightning's step checkpoints hold the mixture's state: a fit resumed from one (mid-epoch, or at an
    epoch's last batch) reads exactly the rest. A checkpoint of an epoch's end restores no loader state, and a
    mixture cannot be moved to an epoch by set_epoch: that resume is refused, never read from elsewhere."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")

    def make():
        return mixed(data[0], output="torch")

    whole: list = []
    lightning_fit(data[0], str(tmp_path / "whole"), whole, make=make)
    assert [e for e, _ in whole] == [0] * 6 + [1] * 6
    part: list = []
    with pytest.raises(Stop):
        lightning_fit(data[0], str(tmp_path / "part"), part, stop_after=9, make=make)
    for ckpt in (tmp_path / "part" / max(os.listdir(tmp_path / "part"), key=step_of),
                 tmp_path / "whole" / "epoch=0-step=6.ckpt"):
        rest: list = []
        lightning_fit(data[0], str(tmp_path / "rest"), rest, ckpt_path=str(ckpt), make=make)
        assert rest == whole[step_of(ckpt.name):], ckpt
    with pytest.raises(ValueError, match=r"set_epoch\(1\): this Mixture stands at step 0"):
        lightning_fit(data[0], str(tmp_path / "rest"), [], ckpt_path=str(tmp_path / "whole-epochs" /
                                                                         "epoch=0-step=6.ckpt"), make=make)


def test_a_mixture_round_trips_through_torchdatas_stateful_dataloader(data):
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    import json

    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (the test extra installs it)")
    with mixed(data[0]) as mix:
        whole = sourced(sdl.StatefulDataLoader(mix, batch_size=None))
    with mixed(data[0]) as mix:
        loader = sdl.StatefulDataLoader(mix, batch_size=None)
        it = iter(loader)
        head = sourced(next(it) for _ in range(2))
        loader_state = json.loads(json.dumps(loader.state_dict()))
    assert head == whole[:2]
    with mixed(data[0]) as mix:
        loader = sdl.StatefulDataLoader(mix, batch_size=None)
        loader.load_state_dict(loader_state)
        assert sourced(loader) == whole[2:]


# -- torchdata ------------------------------------------------------------------------------------------------
def check_stateful_dataloader_round_trips(path: str, **kw) -> None:
    import json

    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (the test extra installs it)")
    with opened(path, **kw) as ds:
        whole = ids(sdl.StatefulDataLoader(ds, batch_size=None))
    with opened(path, **kw) as ds:
        loader = sdl.StatefulDataLoader(ds, batch_size=None)
        it = iter(loader)
        head = ids(next(it) for _ in range(5))
        state = json.loads(json.dumps(loader.state_dict()))
    assert head == whole[:5]
    with opened(path, **kw) as ds:
        loader = sdl.StatefulDataLoader(ds, batch_size=None)
        loader.load_state_dict(state)
        assert ids(loader) == whole[5:]
        assert len(ids(loader)) == len(whole)  # then the next epoch, whole


def test_torchdata_stateful_dataloader_round_trips_the_state(data):
    """It failed: taken for a map-style dataset ('not subscriptable')."""
    pytest.importorskip("torch", reason="needs torch (the test extra installs the CPU build)")
    check_stateful_dataloader_round_trips(data[0])


# -- JAX ------------------------------------------------------------------------------------------------------
def test_output_jax_gives_jax_arrays_without_copying(data):
    jax = pytest.importorskip("jax", reason="needs jax (the test extra installs the CPU build)")
    from gdsload.cuda.ops import JaxHostOps

    path, arrays = data
    with opened(path, output="jax") as ds:
        assert ds.output == "jax"
        batches = list(ds)
    assert len(batches) == len(ds)
    for b in batches:
        assert isinstance(b["x"], jax.Array) and b["x"].devices() == {jax.devices("cpu")[0]}
        assert b["x"].dtype == np.float32 and b["x"].shape[1:] == (4,)
        np.testing.assert_array_equal(np.asarray(b["x"]), arrays["x"][np.asarray(b["idx"])])
    ops = JaxHostOps()
    for dtype, shape in ((np.float32, (7, 3)), (np.uint8, (5, 1, 3)), (np.float16, (0, 2))):
        host = ops.empty(shape, np.dtype(dtype))
        host[...] = 1
        out = ops.export({"a": host})["a"]
        assert out.shape == shape and out.dtype == dtype
        if host.size:
            assert out.unsafe_buffer_pointer() == host.ctypes.data  # zero-copy: the same memory


def x64(jax):
    """JAX's 64-bit types on, for a ``with`` block (the context manager's name moved between JAX releases)."""
    return jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64()


def test_output_jax_keeps_64_bit_fields_with_x64_and_says_so_without(data):
    """int64 labels arrived as int32, copied, while the docs said zero-copy: JAX's 64-bit types are off by
    default. Without them a pass says so once, naming each field narrowed and what x64 does; with them the
    fields keep their types, zero-copy, and nothing is said."""
    import warnings

    jax = pytest.importorskip("jax", reason="needs jax (the test extra installs the CPU build)")
    from gdsload.cuda.ops import JaxHostOps

    path, arrays = data
    with opened(path, output="jax") as ds:
        for first in (True, False):  # said at a pass's first batch; a pass read ahead by the last one: not again
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                batches = list(ds)
            said = [str(w.message) for w in caught]
            if not (first or said):
                continue
            assert len(said) == 1 and said[0].startswith("output='jax': field(s) 'idx' (int64 -> int32) arrive "
                                                         "narrowed and copied, not zero-copy: JAX's 64-bit types "
                                                         "are off (jax_enable_x64"), said
            assert "jax.config.update('jax_enable_x64', True)" in said[0]
            assert {b["idx"].dtype for b in batches} == {np.dtype("int32")}
        with x64(jax), warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = list(ds)
            host = JaxHostOps().empty((5,), np.dtype("int64"))
            host[:] = 2**40
            out = JaxHostOps().export({"a": host})["a"]
            assert out.dtype == np.int64 and out.unsafe_buffer_pointer() == host.ctypes.data  # zero-copy
    assert {b["idx"].dtype for b in batches} == {np.dtype("int64")} and {b["x"].dtype for b in batches} == {
        np.dtype("float32")}
    np.testing.assert_array_equal(np.concatenate([np.asarray(b["idx"]) for b in batches]) % N,
                                  np.concatenate([np.asarray(b["idx"]) for b in batches]))


def test_output_jax_is_refused_where_jax_cannot_take_the_arrays(data, monkeypatch):
    from gdsload.options import output_kind, require_jax

    path, _ = data
    with pytest.raises(ValueError, match=r"unknown output 'tensorflow' \(expected one of \['numpy', 'cupy', "
                                         r"'torch', 'jax'\], or None\)"):
        opened(path, output="tensorflow")
    if pytest.importorskip("jax").devices()[0].platform == "cpu":  # a CPU jax cannot take a GPU's arrays
        with pytest.raises(BackendUnavailable, match="output='jax' on a GPU backend needs JAX with GPU support"):
            require_jax(on_gpu=True)
    monkeypatch.setitem(sys.modules, "jax", None)  # as if not installed
    with pytest.raises(BackendUnavailable, match=r"output='jax' needs JAX, which is not installed .*'gdsload\[jax\]'"):
        output_kind("jax", "cpu")
    with pytest.raises(BackendUnavailable, match="needs JAX"):
        opened(path, output="jax")


# -- on the GPU -----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_dataloader_lightning_and_torchdata(data, tmp_path):
    """On the device: DataLoader(ds, batch_size=None) hands on CUDA tensors of exact samples; Lightning and
    torchdata resume exactly (each skipped, saying so, where the package is missing)."""
    torch = pytest.importorskip("torch", reason="needs torch with CUDA")
    from torch.utils.data import DataLoader

    path, arrays = data
    with opened(path, backend="pinned", output="torch") as ds:
        got = list(DataLoader(ds, batch_size=None))
    assert len(got) == -(-N // 16)
    for b in got:
        assert b["x"].is_cuda
        np.testing.assert_array_equal(b["x"].cpu().numpy(), arrays["x"][b["idx"].cpu().numpy()])
    check_stateful_dataloader_round_trips(path, backend="pinned", output="torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    check_lightning_resumes_exactly(path, tmp_path, accelerator="gpu", backend="pinned")


@pytest.mark.gpu
def test_gpu_output_jax_is_on_the_datasets_gpu(data):
    jax = pytest.importorskip("jax", reason="needs jax with CUDA (jax[cuda12] or jax[cuda13])")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"this jax has no GPU backend ({e})")
    path, arrays = data
    with opened(path, backend="pinned", output="jax", device=0) as ds:
        batches = list(ds)
    for b in batches:
        assert b["x"].devices() == {gpus[0]}
        np.testing.assert_array_equal(np.asarray(b["x"]), arrays["x"][np.asarray(b["idx"])])
