"""What examples/train.py and examples/lightning_train.py share about feeding the model: the two loaders they
compare (a GDSDataset, or a torch DataLoader reading each sample from the same shard files) and how the GPU's
idle time between CUDA events on the training stream becomes a share of an epoch.

Nothing here imports torch at module level, so the scripts still answer ``--help`` without it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import common


class ShardSamples:
    """A map-style dataset over the shard files: sample i of each field read with one ``os.preadv`` into a fresh
    numpy array, wrapped as a torch tensor. Files are opened lazily in each process (DataLoader workers are
    forked)."""

    def __init__(self, path: str, names: tuple[str, ...]):
        import zarr

        from gdsload.tools.measure import block_locations

        self.fields = []
        for name in names:
            array = zarr.open_array(os.path.join(path, name), mode="r")
            rows = array.chunks[0]
            places = [(b.path, b.offset) for b in block_locations(path, (name,))]
            if len(places) != -(-array.shape[0] // rows):
                raise SystemExit(f"{path}/{name}: some blocks were never written; use --loader gdsload")
            self.fields.append((name, array.dtype, tuple(array.shape[1:]), rows, places))
        self.length = int(array.shape[0])
        self._fds: dict[str, int] = {}
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        import numpy as np
        import torch

        if self._pid != os.getpid():
            self._fds, self._pid = {}, os.getpid()
        sample = {}
        for name, dtype, shape, rows, places in self.fields:
            path, offset = places[i // rows]
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            out = np.empty(shape, dtype)
            where = offset + (i % rows) * out.nbytes
            if os.preadv(self._fds[path], [out.reshape(-1).view(np.uint8)], where) != out.nbytes:
                raise OSError(f"{path}: short read of sample {i} at offset {where}")
            sample[name] = torch.from_numpy(out)
        return sample


def shard_dataloader(args: argparse.Namespace, fields: common.Fields, rank: int, world: int, pin: bool) -> Any:
    """A torch DataLoader of dict batches (host tensors, pinned with ``pin``) over :class:`ShardSamples`: this
    rank's share through a ``DistributedSampler`` that shuffles by ``set_epoch`` (the caller's, or Lightning's,
    at each epoch), full batches only, ``--workers`` persistent worker processes."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = ShardSamples(args.data, (fields.images, fields.labels))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    return DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=pin,
                      drop_last=True, persistent_workers=args.workers > 0)


def open_loader(args: argparse.Namespace, fields: common.Fields, rank: int, world: int,
                device: int | None) -> tuple[Any, str]:
    """The loader ``--loader`` names, and a line describing it: a GDSDataset of torch tensors on GPU ``device``
    (None: on the CPU; :func:`common.open_gdsload`) or :func:`shard_dataloader` (pinned for a GPU)."""
    if args.loader == "gdsload":
        ds = common.open_gdsload(args, fields, device)
        return ds, f"gdsload, backend {ds.backend_name} ({ds.backend_reason}), io mode {ds.io_mode}"
    pin = device is not None
    return (shard_dataloader(args, fields, rank, world, pin),
            f"torch DataLoader, {args.workers} workers{', pin_memory' if pin else ''}, one pread per field and "
            f"sample")


def idle_fraction(gaps_ms: Sequence[float], total_ms: float) -> float:
    """The share of an epoch's GPU time (``total_ms``) that its gaps take, each gap the GPU time from the event
    that opened it to the one that closed it; 0.0 for an epoch of no GPU time. Raises ValueError for a negative
    gap (its events not in the order one stream runs them)."""
    if any(gap < 0 for gap in gaps_ms):
        raise ValueError(f"a gap of negative GPU time ({min(gaps_ms)} ms): events recorded on different streams?")
    return sum(gaps_ms) / total_ms if total_ms > 0 else 0.0


class GpuGaps:
    """Gaps in the GPU's work on the current stream during one epoch, timed by CUDA events.

    ``open_gap()`` records an event where the stream may fall idle (the work queued so far is a whole step),
    ``close_gap()`` one where the next work is about to be queued; the GPU time between an open and the next
    close is a gap. The epoch's GPU time runs from the first event recorded to the one :meth:`fraction`
    records, whichever kind the first is. A gap still open then (a fetch that ended the epoch) is not counted;
    a close with no open gap counts nothing.
    """

    def __init__(self, torch: Any):
        self._torch = torch
        self._origin: Any = None
        self._opened: Any = None
        self._gaps: list[tuple[Any, Any]] = []

    def _record(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = event
        return event

    def open_gap(self) -> None:
        self._opened = self._record()

    def close_gap(self) -> None:
        closed = self._record()
        if self._opened is not None:
            self._gaps.append((self._opened, closed))
            self._opened = None

    def fraction(self) -> float:
        """The gaps' share of the epoch (:func:`idle_fraction`); waits for the stream to reach this point."""
        end = self._record()
        end.synchronize()
        return idle_fraction([a.elapsed_time(b) for a, b in self._gaps], self._origin.elapsed_time(end))
