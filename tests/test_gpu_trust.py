"""Trust on the GPU backends: the device crc32c kernel, verify on read, fill ordering, threads after
close, close from another thread, forked DataLoader workers, and a new order per pass under Lightning.

Skipped without a CUDA GPU and CuPy. Run on the GPU machine with ``python3 -m pytest -m gpu``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _helpers import labelled, threads_left_after_use, wait_no_readers
from gdsload import ChecksumError, GDSDataset, GDSLoadError, ReadError
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset

Dataset = functools.partial(GDSDataset, resident_bytes=32 << 10)
pytestmark = pytest.mark.gpu
BACKENDS = ["kvikio", "pinned", "mmap"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def small(tmp_path):
    data = labelled(1999, shape=(7, 9), dtype="float32")
    path = str(tmp_path / "small.gds")
    write_dataset(path, {k: ArraySource(k, v) for k, v in data.items()}, samples_per_block=16,
                  shard_bytes=16 * 252 * 8, progress=False)
    return path, data


def test_device_kernel_matches_crc32c_on_odd_segments():
    import cupy

    from gdsload.codecs import checksum as C
    from gdsload.codecs.checksum_cuda import DeviceCrc

    rng = np.random.default_rng(0)
    host = rng.integers(0, 256, 9 << 20, dtype=np.uint8)
    host[1 << 20:2 << 20] = 0
    lo = np.array([0, 1, 17, 4096, 100003, 1 << 20, 3 << 20, 5000], dtype=np.int64)
    hi = np.array([16, 2, 70000, 8192, 4 << 20, (1 << 20) + 77, 9 << 20, 5001], dtype=np.int64)
    crc = DeviceCrc(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    got = crc.launch(cupy.asarray(host), lo, hi, stream).get(stream=stream)
    want = C.device_expected(C.host_crcs(host, lo, hi), lo, hi)
    np.testing.assert_array_equal(got, want)


def flip_byte(path: str, field: str, block: int) -> str:
    with DatasetLayout(read_metadata(path), (field,)) as layout:
        loc = layout.locate(field, block)
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset + 3)
        b = f.read(1)
        f.seek(loc.offset + 3)
        f.write(bytes([b[0] ^ 1]))
    return loc.path


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_on_the_device(small, backend):
    import cupy

    path, data = small
    with Dataset(path, 64, backend=backend, shuffle=True, verify=True) as ds:
        assert ds.verify
        for b in ds:
            np.testing.assert_array_equal(cupy.asnumpy(b["x"]), data["x"][cupy.asnumpy(b["idx"])])
    shard = flip_byte(path, "x", 40)
    with Dataset(path, 64, backend=backend, shuffle=True, verify=True) as ds, pytest.raises(ReadError) as e:
        for _ in ds:
            pass
    assert str(e.value).startswith(f"{shard}: block 40 of field 'x'") and "crc32c" in str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_is_on_by_default_and_no_batch_of_a_bad_window_is_handed_on(small, backend):
    """The device check runs beside the gathers; still, every batch served before the error is exact."""
    import cupy

    path, data = small
    shard = flip_byte(path, "x", 77)
    served = 0
    with Dataset(path, 64, backend=backend, shuffle=True, window_blocks=2) as ds, \
            pytest.raises(ChecksumError) as e:
        assert ds.verify
        for b in ds:
            np.testing.assert_array_equal(cupy.asnumpy(b["x"]), data["x"][cupy.asnumpy(b["idx"])])
            served += 1
    assert str(e.value).startswith(f"{shard}: block 77 of field 'x'") and served < 1999 // 64


@pytest.mark.parametrize("codecs", ["raw+crc32c", "zstd+crc32c"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_foreign_stores_chunk_crc32c_is_checked_on_the_device(tmp_path, backend, codecs):
    from test_foreign_checksums import CHUNK, build, damage, served_until_error

    path = str(tmp_path / "s.zarr")
    x = build(path, codecs, True)
    for resident_bytes in (0, 1 << 20):  # windowed, and read whole at the first pass
        assert served_until_error(path, x, backend, resident_bytes=resident_bytes) is None
    shard = damage(path, "flip")
    for resident_bytes in (0, 1 << 20):
        e = served_until_error(path, x, backend, verify=False, resident_bytes=resident_bytes)
        assert isinstance(e, ChecksumError) and str(e).startswith(f"{shard}: chunk {CHUNK}"), e


@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_values_are_written_before_the_gather(tmp_path, backend):
    """A never-written block's fill must land before any gather reads the window (pinned queued it on a
    stream the window's 'filled' event did not cover). The fill's stream is kept busy first."""
    import cupy
    import zarr

    path = str(tmp_path / "holes.gds")
    g = zarr.open_group(path, mode="w", zarr_format=3)
    g.attrs["gdsload"] = {"format": 1, "num_samples": 64, "samples_per_block": 4,
                          "fields": {"x": {"kind": "fixed"}}}
    a = g.create_array("x", shape=(64, 1024), dtype="int32", chunks=(4, 1024), shards=(16, 1024), fill_value=-5,
                       compressors=None)
    data = np.arange(64 * 1024, dtype=np.int32).reshape(64, 1024) + 1
    for blk in range(0, 16, 2):  # equal to the fill value: zarr never writes these blocks
        data[blk * 4:(blk + 1) * 4] = -5
    a[:] = data
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long ns) {
        long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        long long t = t0; while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }''', "spin")
    with Dataset(path, 8, backend=backend, window_blocks=2, verify=False, missing_chunks="fill") as ds:
        for epoch in range(3):  # later epochs: the window buffers hold other blocks' data
            ds.set_epoch(epoch)
            stream = getattr(ds._reader.backend, "stream", None)
            if stream is not None:
                with stream:
                    spin((1,), (1,), (np.int64(50_000_000),))  # 50 ms
            got = np.concatenate([cupy.asnumpy(b["x"]) for b in ds])  # in order: no shuffle
            np.testing.assert_array_equal(got, data, err_msg=f"epoch {epoch}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_python_thread_survives_close(small, backend):
    path, _ = small
    left = threads_left_after_use(Dataset(path, 64, backend=backend, shuffle=True))
    assert not left, [(t.name, getattr(t, "_target", None)) for t in left]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02])
def test_close_from_another_thread(small, backend, delay_s):
    path, _ = small
    ds = Dataset(path, 8, backend=backend, window_blocks=1)
    closer = threading.Thread(target=lambda: (time.sleep(delay_s), ds.close()))
    closer.start()
    t0 = time.monotonic()
    try:
        for _ in ds:
            pass
    except GDSLoadError as e:
        assert "closed" in str(e)
    assert time.monotonic() - t0 < 1.0
    closer.join()
    assert wait_no_readers() == []


_FORK_SCRIPT = r"""
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from gdsload import GDSDataset
ds = GDSDataset(sys.argv[1], 64, backend=sys.argv[2], shuffle=True, output="torch")
it = iter(ds); next(it); next(it)  # threads reading ahead, events and streams alive
loader = DataLoader(TensorDataset(torch.arange(4000)), batch_size=100, num_workers=4,
                    multiprocessing_context="fork")
total = sum(int(b[0].sum()) for b in loader)
assert total == sum(range(4000)), total
rest = sum(1 for _ in it)
ds.close()
print("ok", rest)
"""


def _fork_run(path: str, backend: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", _FORK_SCRIPT, path, backend], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forked_dataloader_workers_never_touch_cuda(small, backend):
    pytest.importorskip("torch")
    path, _ = small
    out = _fork_run(path, backend)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout
    assert "cudaError" not in out.stderr and "Traceback" not in out.stderr, out.stderr


_LIGHTNING_SCRIPT = r"""
import sys, json, torch
import pytorch_lightning as pl
from gdsload import GDSDataset

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.first = []
        self.seen = []
    def training_step(self, batch, i):
        idx = batch["idx"]
        if i == 0:
            self.first.append(idx[:8].tolist())
        self.seen.append(idx.cpu())
        return (self.w * batch["x"].float().mean()).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

ds = GDSDataset(sys.argv[1], 64, backend=sys.argv[2], shuffle=True, output="torch")
m = Model()
pl.Trainer(max_epochs=3, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(m, train_dataloaders=ds)
per_epoch = len(ds)
ids = torch.cat(m.seen).tolist()
epochs = [sorted(ids[e * 1999:(e + 1) * 1999]) for e in range(3)]
print(json.dumps({"first": m.first, "complete": all(e == list(range(1999)) for e in epochs)}))
"""


def test_lightning_reshuffles_every_epoch(small):
    pytest.importorskip("pytorch_lightning")
    import json

    path, _ = small
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _LIGHTNING_SCRIPT, path, "pinned"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    first = result["first"]
    assert len(first) == 3 and len({tuple(f) for f in first}) == 3, first
    assert result["complete"]
