"""The model of examples/train.py under PyTorch Lightning's Trainer, fed by gdsload or by a torch DataLoader over
the same shard files, either passed straight to ``trainer.fit(train_dataloaders=...)``; reports images/s and the
GPU's idle share between steps per epoch, and the wall time of the whole fit.

    python examples/make_data.py /tmp/synth.gds
    python examples/lightning_train.py --data /tmp/synth.gds --epochs 3
    python examples/lightning_train.py --data /tmp/synth.gds --epochs 3 --loader dataloader --workers 8
    torchrun --nproc_per_node 2 examples/lightning_train.py --data /tmp/synth.gds       # DDP
    python examples/lightning_train.py --data /tmp/synth.gds --backend cpu --steps 5   # on the CPU

Loaders (examples/feeds.py, as in train.py). Lightning accepts any iterable as ``train_dataloaders``, not only a
DataLoader. ``use_distributed_sampler=False`` keeps it from replacing a sampler: each loader reads its own
rank's share (rank and world size from torchrun's RANK / WORLD_SIZE, the GPU from LOCAL_RANK). gdsload:
Lightning gives each epoch's number to ``ds.sampler.set_epoch``, as it does for a DistributedSampler, so the
data is reshuffled every epoch with no code of ours (and a fit resumed from a checkpoint, which restores the
dataset's position through its ``state_dict`` / ``load_state_dict``, reads on exactly where it stopped);
batches come as torch tensors already on the rank's GPU, and Lightning's move to the device leaves them there.
DataLoader: a ``DistributedSampler``, which Lightning's fit loop gives the epoch (``set_epoch``) at the start
of each epoch; pinned host batches, which Lightning copies to the GPU without blocking the host.

Epochs. Before training, Lightning calls ``iter()`` once on an iterable that is not a DataLoader, to check it is
one, and drops the iterator. A GDSDataset's pass begins at the iterator's first ``next()``, not at ``iter()``:
an iterator never advanced reads nothing and counts as no pass; Lightning's epoch N reads gdsload's epoch N
(each epoch line names gdsload's).

GPU idle between steps. A callback records a CUDA event on the current stream at ``on_train_batch_end`` (step n
is queued: forward, backward, optimizer step) and another at the next ``on_train_batch_start`` (batch n+1 is
there and on the device, step n+1 about to be queued). The GPU time from the one to the other is a gap; the
idle share is the sum of the gaps over the epoch's GPU time, from its first ``on_train_batch_start`` event to
an event recorded at ``on_train_epoch_end``, after the last step. A gap holds everything between two steps that
gives the stream no work: Lightning's own per-step work (its hooks, loop bookkeeping, schedulers), the fetch of
the next batch (``next()`` on the loader; for gdsload it also makes the stream wait until the batch is ready)
and its move to the device (nothing for gdsload; a copy queued on the stream for the DataLoader). When the host
runs ahead of the GPU, a gap is zero however long those took. It is therefore an upper bound of the GPU's
waiting for data, measured the same way for both loaders (train.py, with no framework between steps, measures
the waiting alone).

Also printed, by rank 0: ``open:`` the time to construct the loader (for gdsload the GDSDataset; DataLoader
workers start in the first epoch), and ``fit:`` the wall time of the ``trainer.fit`` call (Lightning's set-up,
CUDA and cuDNN start-up, every epoch, tear-down), so a fit with each loader can be compared end to end. Images/s
counts all ranks; the first epoch includes start-up, compare the later ones.

Multi-GPU runs go through torchrun: Lightning then takes the process layout from torchrun's environment
(``devices`` = LOCAL_WORLD_SIZE, ``num_nodes`` = WORLD_SIZE / LOCAL_WORLD_SIZE, as it requires). Lightning's
own launcher would start the other ranks after this script built the loader without their rank. Precision is
``bf16-mixed`` (autocast to bf16), the model channels-last (examples/model.py). Without a GPU, or with
``--backend cpu``, the fit runs on the CPU in float32, fed by gdsload's cpu backend, and the GPU's idle share is
not measured. No checkpoints are written; train.py shows resuming.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import common
import feeds


def main(argv: list[str] | None = None) -> int:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    import torch

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    from model import forward_loss, make_model

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    say = print if rank == 0 else (lambda *a, **k: None)
    fields = common.inspect(args.data, args.images, args.labels)
    local = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = common.pick_device(args, torch, local).type == "cuda"
    t0 = time.perf_counter()
    loader, about = feeds.open_loader(args, fields, rank, world, local if on_gpu else None)
    say(f"loader: {about}; {len(loader)} steps per epoch", flush=True)
    say(f"open: {time.perf_counter() - t0:.2f} s (constructing the loader)", flush=True)

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(fields.num_classes)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return forward_loss(self.model, batch[fields.images], batch[fields.labels], fields.nhwc)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-5)

    class Report(pl.Callback):
        """Per epoch, on rank 0: images/s on the host clock with the GPU synchronized at both ends, and the GPU's
        idle share between steps (the module docstring says what it holds)."""

        def __init__(self) -> None:
            super().__init__()
            self.epochs = 0

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            if on_gpu:
                torch.cuda.synchronize()
            self.steps, self.t0 = 0, time.perf_counter()
            self.gaps = feeds.GpuGaps(torch) if on_gpu else None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if self.gaps is not None:
                self.gaps.close_gap()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.gaps is not None:
                self.gaps.open_gap()
            self.steps += 1

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            said = [] if self.gaps is None else [f"GPU idle between steps {self.gaps.fraction():.1%} of the time"]
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.t0
            self.epochs += 1
            if args.loader == "gdsload":
                said.append(f"gdsload epoch {loader.epoch}")
            if trainer.is_global_zero:
                print(common.rate_line(trainer.current_epoch, self.steps, self.steps * args.batch_size * world,
                                       seconds, world, ", ".join(said), on_gpu), flush=True)

    report = Report()
    trainer = pl.Trainer(accelerator="gpu" if on_gpu else "cpu", devices=per_node, num_nodes=max(1, world // per_node),
                         strategy="ddp" if world > 1 else "auto", precision="bf16-mixed" if on_gpu else "32-true",
                         max_epochs=args.epochs,
                         limit_train_batches=args.steps or 1.0, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[report])
    t0 = time.perf_counter()
    trainer.fit(Classifier(), train_dataloaders=loader)
    say(f"fit: {report.epochs} epochs in {time.perf_counter() - t0:.2f} s (wall, Trainer.fit call)", flush=True)
    if args.loader == "gdsload":
        loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
