"""Train a small ResNet (examples/model.py) on a dataset converted with ``gdsload shard``, fed by gdsload or by a
torch DataLoader over the same shard files, and report images/s and how long the GPU waited for data.

    python examples/make_data.py /tmp/synth.gds
    python examples/train.py --data /tmp/synth.gds --loader gdsload
    python examples/train.py --data /tmp/synth.gds --loader dataloader --workers 8
    torchrun --nproc_per_node 2 examples/train.py --data /tmp/synth.gds          # DDP, one process per GPU
    python examples/train.py --data /tmp/synth.gds --backend cpu --steps 5       # on the CPU (also without a GPU)

    # exact resume: stop after 30 steps (as if interrupted), then go on from the last checkpoint
    python examples/train.py --data /tmp/synth.gds --checkpoint ck.pt --checkpoint-every 20 --stop-after 30
    python examples/train.py --data /tmp/synth.gds --resume ck.pt

Training: bf16 autocast, the model and its inputs in channels-last memory format, SGD with Nesterov momentum,
DDP under torchrun (WORLD_SIZE > 1: NCCL process group, one GPU per LOCAL_RANK; each GDSDataset reads its
rank's share). Without a GPU, or with ``--backend cpu``, the same loop runs on the CPU in float32 (gloo for
DDP), fed by gdsload's cpu backend; the GPU's waiting is then not measured. Full batches only. gdsload
shuffles every epoch (``set_epoch``); the DataLoader shuffles with a DistributedSampler.

Checkpoints (``--checkpoint PATH``, rank 0 writes, every ``--checkpoint-every`` steps and at the end of each
epoch) hold the model, the optimizer, the epoch, the steps taken in it and the gdsload position
(``ds.state_dict()``). ``--resume PATH`` loads them: with gdsload the resumed epoch yields exactly the batches
not yet trained on, in the same order (the labels digest printed per epoch shows it: the digests of the two
parts of an interrupted epoch add up to the uninterrupted one's). With ``--loader dataloader`` the model and
epoch are restored but the data of a partly trained epoch starts over (a DataLoader has no position to save).

The DataLoader's Dataset reads sample i with one ``pread`` per field from the shard files gdsload wrote (where
each block lies: ``gdsload.tools.measure.block_locations``; the rows inside a block are consecutive), in
``--workers`` processes, with ``pin_memory`` and a non-blocking copy to the GPU: a fair per-sample reader of
the same bytes. (zarr-python's ``array[i]`` would read the whole block holding sample i.)

What "GPU waited for data" means. Every step, one CUDA event is recorded on the training stream just before
the loader is asked for the batch (A) and another just after the batch is usable on that stream (B: for
gdsload after ``next()``, which makes the stream wait for the batch to be ready; for the DataLoader after
``next()`` and the copy to the GPU, queued on the same stream). The GPU time from A to B is time in which
the stream had finished the previous step and ran nothing of the model: it waited for the host to come back
from ``next()``, for the batch to be ready, or for its copy. The waiting fraction is the sum of these gaps
over the GPU time from the epoch's first A to the end of its last step. When the host runs ahead of the GPU
(``next()`` returns while the previous step still runs), the gap is zero however long ``next()`` took: only
waits the GPU sees count. Also printed: the host's time blocked in ``next()``, as a share of the epoch's wall
time. Rank 0 reports its own figures; images/s counts all ranks. The first epoch includes CUDA and cuDNN
start-up; compare the later ones (the last line sums them).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import common
import feeds


def build_parser() -> Any:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="where to save checkpoints (rank 0)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save every this many steps (0: at the end "
                                                                   "of each epoch only)")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this many steps in all, without a final "
                                                             "checkpoint, as if interrupted (to try --resume)")
    p.add_argument("--log-every", type=int, default=50, help="print the loss every this many steps (a host sync)")
    return p


class GdsFeed:
    """Batches from a GDSDataset: already on the GPU and ready on the current stream when ``next()`` returns
    (moved to ``device`` only where gdsload read them on the host: the cpu backend beside a GPU torch)."""

    def __init__(self, ds: Any, fields: common.Fields, device: Any):
        self.ds, self.fields, self.device = ds, fields, device

    def __len__(self) -> int:
        return len(self.ds)

    def epoch(self, epoch: int) -> Any:
        self.ds.set_epoch(epoch)  # a resumed epoch keeps its position
        for batch in self.ds:
            yield (batch[self.fields.images].to(self.device, non_blocking=True),
                   batch[self.fields.labels].to(self.device, non_blocking=True))

    def state(self) -> dict[str, Any] | None:
        return self.ds.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        self.ds.load_state_dict(state)

    def close(self) -> None:
        self.ds.close()


class TorchFeed:
    """Batches from a torch DataLoader (:func:`feeds.shard_dataloader`), copied to the GPU without blocking the
    host."""

    def __init__(self, loader: Any, fields: common.Fields, device: Any):
        self.loader, self.fields, self.device = loader, fields, device

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int) -> Any:
        self.loader.sampler.set_epoch(epoch)
        for batch in self.loader:
            yield (batch[self.fields.images].to(self.device, non_blocking=True),
                   batch[self.fields.labels].to(self.device, non_blocking=True))

    def state(self) -> None:
        return None

    def load(self, state: Any) -> None:
        pass

    def close(self) -> None:
        pass


class WaitMeter:
    """The GPU's waits for data in one epoch, as the module docstring defines them (not on the CPU), and the
    host's time blocked in ``next()``."""

    def __init__(self, torch: Any, on_gpu: bool):
        self.gaps, self.host_s = feeds.GpuGaps(torch) if on_gpu else None, 0.0

    def take(self, it: Any) -> Any:
        """``next(it)`` inside a gap; StopIteration passes through (leaving the gap open: not counted)."""
        if self.gaps is not None:
            self.gaps.open_gap()
        t0 = time.perf_counter()
        batch = next(it)
        self.host_s += time.perf_counter() - t0
        if self.gaps is not None:
            self.gaps.close_gap()
        return batch

    def finish(self) -> str:
        """What the epoch waited for data (synchronizes): the GPU's share and the host's."""
        gpu = "" if self.gaps is None else f"GPU waited for data {self.gaps.fraction():.1%} of the time, "
        return f"{gpu}host blocked in next() {{:.1%}}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from model import forward_loss, make_model

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = common.pick_device(args, torch, local)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    torch.backends.cudnn.benchmark = True
    fields = common.inspect(args.data, args.images, args.labels)
    model = make_model(fields.num_classes, device)
    net = DistributedDataParallel(model, device_ids=[local] if on_gpu else None) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
    loader, about = feeds.open_loader(args, fields, rank, world, local if on_gpu else None)
    feed = GdsFeed(loader, fields, device) if args.loader == "gdsload" else TorchFeed(loader, fields, device)
    say = print if rank == 0 else (lambda *a, **k: None)
    where = f"{world} GPU(s)" if on_gpu else f"{world} CPU process(es)"
    say(f"loader: {about}; {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, batch "
        f"{args.batch_size} per rank, {where}, {len(feed)} steps per epoch", flush=True)
    start_epoch, done_in_epoch = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if ck["loader"] is not None and args.loader == "gdsload":
            feed.load(ck["loader"])
        start_epoch, done_in_epoch = ck["epoch"], ck["step_in_epoch"]
        say(f"resumed from {args.resume}: epoch {start_epoch} after step {done_in_epoch}", flush=True)

    def save(epoch: int, step_in_epoch: int) -> None:
        state = feed.state()
        if rank == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": state, "epoch": epoch,
                        "step_in_epoch": step_in_epoch}, tmp)
            os.replace(tmp, args.checkpoint)
        if world > 1:
            dist.barrier()

    taken, later_images, later_s = 0, 0, 0.0
    for epoch in range(start_epoch, args.epochs):
        first = done_in_epoch if epoch == start_epoch else 0
        limit = args.steps - first if args.steps else None
        meter, it, steps, loss = WaitMeter(torch, on_gpu), feed.epoch(epoch), 0, None
        digest = torch.zeros((), dtype=torch.int64, device=device)
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while limit is None or steps < limit:
            try:
                images, labels = meter.take(it)
            except StopIteration:
                break
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on_gpu):
                loss = forward_loss(net, images, labels, fields.nhwc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            digest += (labels * torch.arange(1, labels.numel() + 1, device=device)).sum()
            steps, taken = steps + 1, taken + 1
            if args.log_every and taken % args.log_every == 0:
                say(f"  step {taken}: loss {loss.item():.3f}", flush=True)
            if args.checkpoint and args.checkpoint_every and taken % args.checkpoint_every == 0:
                save(epoch, first + steps)
            if args.stop_after and taken >= args.stop_after:
                break
        it.close()  # a pass left early stops its readers
        waited = meter.finish()
        seconds = time.perf_counter() - t0
        images = steps * args.batch_size * world
        if epoch > start_epoch:
            later_images, later_s = later_images + images, later_s + seconds
        say(common.rate_line(epoch, steps, images, seconds, world,
                             f"{waited.format(meter.host_s / seconds)}, loss "
                             f"{'-' if loss is None else f'{loss.item():.3f}'}, labels digest {int(digest)}",
                             on_gpu),
            flush=True)
        if args.stop_after and taken >= args.stop_after:
            say(f"stopped after {taken} steps", flush=True)
            break
        if args.checkpoint:
            save(epoch + 1, 0)  # this epoch is done (or cut by --steps): a resume starts the next one
    if later_s > 0:
        say(f"epochs after the first: {later_images / later_s:,.0f} images/s", flush=True)
    feed.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
