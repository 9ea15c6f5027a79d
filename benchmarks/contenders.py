"""The loaders gdsload is compared with on the same dataset: torch DataLoader, zarr-python, ``np.fromfile`` per
shard file, DALI. Each ``*_run`` returns a callable timing one pass (a ``PassResult``), into device memory with
``gpu``, cut after ``max_s`` where given; one that cannot run here raises from it (ImportError: not installed)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.tools.measure import PassResult, cpu_seconds
from gdsload.tools.steps import Step

Run = Callable[[], PassResult]


def _device(gpu: bool) -> tuple[Callable[[Any], Any], Callable[[], None]]:
    """(put: a host array into the destination memory, sync: wait until every put has landed)."""
    if not gpu:
        return (lambda x: x), (lambda: None)
    import cupy

    return cupy.asarray, cupy.cuda.runtime.deviceSynchronize


class TorchBlocks:
    """Map-style torch dataset of the same blocks: item i is block i of the image and label fields, read
    with ``os.preadv`` (descriptors opened per worker process on first use), and its sample count."""

    def __init__(self, path: str):
        meta = read_metadata(path)
        with DatasetLayout(meta, ("image", "label")) as layout:
            self.items = [(layout.locate("image", b), layout.locate("label", b),
                           min(meta.samples_per_block, meta.num_samples - b * meta.samples_per_block))
                          for b in range(meta.num_blocks)]
        self.fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _read(self, loc: Any) -> Any:
        import torch

        fd = self.fds.get(loc.path)
        if fd is None:
            fd = self.fds[loc.path] = os.open(loc.path, os.O_RDONLY)
        buf = np.empty(loc.nbytes, dtype=np.uint8)
        os.preadv(fd, [buf], loc.offset)
        return torch.from_numpy(buf)

    def __getitem__(self, i: int) -> tuple[Any, Any, int]:
        image, label, n = self.items[i]
        return self._read(image), self._read(label), n


def _over(t0: float, max_s: float | None) -> bool:
    """The pass begun at ``t0`` has used up its ``max_s`` seconds (None: it reads everything). Asked once a pass
    has read something."""
    return max_s is not None and time.perf_counter() - t0 >= max_s


def torch_run(path: str, workers: int, gpu: bool, step: Step | None = None, shuffle: bool = False,
              max_s: float | None = None) -> Run:
    """torch DataLoader over the blocks (batch = one block, ``num_workers`` processes); on a GPU with
    ``pin_memory=True`` and ``.to("cuda", non_blocking=True)``. ``stall_s``: time spent in ``next()``."""
    import torch
    from torch.utils.data import DataLoader

    if step is not None and max_s is not None:
        raise ValueError("a pass with a step runs whole: its waiting is its time beyond the steps alone")
    blocks = TorchBlocks(path)

    def run() -> PassResult:
        loader = DataLoader(blocks, batch_size=None, shuffle=shuffle, num_workers=workers, pin_memory=gpu,
                            prefetch_factor=4 if workers else None)
        nbytes, n, stall = 0, 0, 0.0
        alone = step.alone(len(blocks)) if step is not None else None
        c0, t0 = cpu_seconds(), time.perf_counter()
        it = iter(loader)
        while not (n and _over(t0, max_s)):
            w0 = time.perf_counter()
            try:
                image, label, count = next(it)
            except StopIteration:
                break
            stall += time.perf_counter() - w0
            if gpu:
                image = image.to("cuda", non_blocking=True)
                label = label.to("cuda", non_blocking=True)
            nbytes += image.numel() + label.numel()
            n += int(count)
            if step is not None:
                step()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        del it, loader  # workers joined: their CPU time is counted (RUSAGE_CHILDREN)
        return PassResult(bytes=nbytes, seconds=wall, io_mode="posix-pageable", samples=n,
                          cpu_s=cpu_seconds() - c0, stall_s=stall,
                          wait_s=max(0.0, wall - alone) if alone is not None else None, alone_s=alone)

    return run


def _read_pass(reads: Iterable[Callable[[], tuple[int, int]]], sync: Callable[[], None], io_mode: str,
               max_s: float | None) -> PassResult:
    """Each of ``reads`` in turn (its bytes and samples) until ``max_s`` has passed, then ``sync()``: the pass."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    nbytes = n = 0
    for read in reads:
        if nbytes and _over(t0, max_s):
            break
        b, k = read()
        nbytes, n = nbytes + b, n + k
    sync()
    return PassResult(bytes=nbytes, seconds=time.perf_counter() - t0, io_mode=io_mode, samples=n or None,
                      cpu_s=cpu_seconds() - c0)


def zarr_run(path: str, gpu: bool, gpu_buffers: bool = False, max_s: float | None = None) -> Run:
    """zarr-python reading shard-sized slices of the image and label arrays, then ``cupy.asarray`` (with
    ``gpu_buffers``: zarr's own GPU buffers, ``zarr.config.enable_gpu()``)."""
    import zarr

    put, sync = _device(gpu)

    def run() -> PassResult:
        with zarr.config.enable_gpu() if gpu_buffers else contextlib.nullcontext():
            g = zarr.open_group(path, mode="r")
            image, label = g["image"], g["label"]
            step = image.shards[0]

            def read(a: int) -> tuple[int, int]:
                x, y = put(image[a:a + step]), put(label[a:a + step])
                return x.nbytes + y.nbytes, y.shape[0]

            return _read_pass((lambda a=a: read(a) for a in range(0, image.shape[0], step)), sync,
                              "zarr-gpu-buffers" if gpu_buffers else "zarr-host", max_s)

    return run


def naive_run(paths: list[str], gpu: bool, max_s: float | None = None) -> Run:
    """What people write first: ``np.fromfile`` per shard file, then ``cupy.asarray`` (a pageable copy)."""
    put, sync = _device(gpu)
    reads = [lambda p=p: (put(np.fromfile(p, dtype=np.uint8)).nbytes, 0) for p in paths]
    return lambda: _read_pass(reads, sync, "posix-pageable", max_s)


def dali_run(paths: list[str], threads: int = 16, max_s: float | None = None) -> Run:
    """NVIDIA DALI's file reader over the shard files (one file per sample, whole), moved to the GPU by
    the pipeline (``.gpu()``): DALI's generic path for bytes it does not decode. GPU only."""
    import cupy
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=1, num_threads=threads, device_id=0, prefetch_queue_depth=2)
    def files() -> Any:
        data, _ = fn.readers.file(files=list(paths), random_shuffle=False, name="reader")
        return data.gpu()

    pipe = files()
    pipe.build()

    def read() -> tuple[int, int]:
        (out,) = pipe.run()
        return sum(int(np.prod(s)) for s in out.shape()), 0

    return lambda: _read_pass([read] * len(paths), cupy.cuda.runtime.deviceSynchronize, "dali-file-reader", max_s)
