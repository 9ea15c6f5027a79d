"""The model of examples/train.py under PyTorch Lightning's Trainer, fed by a GDSDataset passed straight to
``trainer.fit(train_dataloaders=...)``.

    python examples/make_data.py /tmp/synth.gds
    python examples/lightning_train.py --data /tmp/synth.gds --epochs 3
    torchrun --nproc_per_node 2 examples/lightning_train.py --data /tmp/synth.gds       # DDP

Lightning accepts any iterable as ``train_dataloaders``, not only a DataLoader. ``use_distributed_sampler=False``
keeps it from trying to wrap a sampler: the GDSDataset reads its own rank's share (its rank and world size
come from torchrun's RANK / WORLD_SIZE, its GPU from LOCAL_RANK). Every new pass over a GDSDataset is the next
epoch when ``set_epoch`` is never called, so the data is reshuffled every epoch with no code of ours. Batches
come as torch tensors already on the rank's GPU; Lightning's move to the device leaves them there.

Multi-GPU runs go through torchrun: Lightning then takes the process layout from torchrun's environment
(``devices`` = LOCAL_WORLD_SIZE, ``num_nodes`` = WORLD_SIZE / LOCAL_WORLD_SIZE, as it requires). Lightning's
own launcher would start the other ranks after this script built the dataset without their rank.

Before training, Lightning calls ``iter()`` once on an iterable that is not a DataLoader, to check it is one.
On a GDSDataset that begins a pass (then dropped), so Lightning's epoch 0 reads gdsload's epoch 1; each
epoch is still a fresh shuffle. The line printed per epoch names both. Precision is ``bf16-mixed`` (autocast
to bf16), the model channels-last (examples/model.py). No checkpoints are written; train.py shows resuming.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import common


def main(argv: list[str] | None = None) -> int:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    import torch

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    from model import forward_loss, make_model

    world = int(os.environ.get("WORLD_SIZE", 1))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fields = common.inspect(args.data, args.images, args.labels)
    ds = common.open_gdsload(args, fields, int(os.environ.get("LOCAL_RANK", 0)))

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(fields.num_classes)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return forward_loss(self.model, batch[fields.images], batch[fields.labels], fields.nhwc)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-5)

    class Rate(pl.Callback):
        """Images/s of each epoch, on the host clock with the GPU synchronized at both ends."""

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            torch.cuda.synchronize()
            self.steps, self.t0 = 0, time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.steps += 1

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            torch.cuda.synchronize()
            if trainer.is_global_zero:
                seconds = time.perf_counter() - self.t0
                print(common.rate_line(trainer.current_epoch, self.steps, self.steps * args.batch_size * world,
                                       seconds, world, f"gdsload epoch {ds.epoch}"), flush=True)

    if int(os.environ.get("RANK", 0)) == 0:
        print(f"loader: gdsload, backend {ds.backend_name} ({ds.backend_reason}), io mode {ds.io_mode}; "
              f"{len(ds)} steps per epoch", flush=True)
    trainer = pl.Trainer(accelerator="gpu", devices=per_node, num_nodes=max(1, world // per_node),
                         strategy="ddp" if world > 1 else "auto", precision="bf16-mixed", max_epochs=args.epochs,
                         limit_train_batches=args.steps or 1.0, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[Rate()])
    trainer.fit(Classifier(), train_dataloaders=ds)
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
