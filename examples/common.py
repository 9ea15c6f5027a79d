"""What examples/train.py and examples/lightning_train.py share besides the model (examples/model.py) and their
loaders (examples/feeds.py): their common options, what the dataset holds, opening it with gdsload, and the line
that reports images/s.

Nothing here imports torch at module level, so ``--help`` works on a machine without it. Without a GPU (or with
``--backend cpu``) both scripts train on the CPU, fed by gdsload's cpu backend.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from gdsload.tools.cli import HelpFormatter

BACKENDS = ("auto", "kvikio", "pinned", "mmap", "cpu")


class Help(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The description as written, each option's default after its help."""


def parser(description: str) -> argparse.ArgumentParser:
    """The options both scripts take."""
    p = argparse.ArgumentParser(description=description, formatter_class=Help)
    p.add_argument("--data", required=True, help="a dataset written by 'gdsload shard' (or examples/make_data.py)")
    p.add_argument("--images", default="images", help="the image field: uint8, N x H x W x 3 or N x 3 x H x W")
    p.add_argument("--labels", default="labels", help="the label field: integers, N")
    p.add_argument("--loader", choices=("gdsload", "dataloader"), default="gdsload",
                   help="gdsload, or a torch DataLoader reading each sample from the same shard files")
    p.add_argument("--workers", type=int, default=8, help="DataLoader worker processes (--loader dataloader)")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per epoch (0: whole epochs)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per batch, per GPU (or process)")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (SGD, Nesterov momentum 0.9)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="gdsload backend; cpu (also what auto picks without a GPU): the model trains on the CPU")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed")
    return p


@dataclass(frozen=True)
class Fields:
    """What the training loop needs to know about the dataset: field names, image layout, classes."""

    images: str
    labels: str
    nhwc: bool  # stored N x H x W x 3 (else N x 3 x H x W)
    num_classes: int
    num_samples: int


def inspect(path: str, images: str, labels: str) -> Fields:
    """Read the two fields' metadata (and the labels, for the number of classes) with zarr-python: a gdsload
    dataset is a plain Zarr v3 group. Exits with a message naming what does not fit."""
    import zarr

    group = zarr.open_group(path, mode="r")
    img, lab = group[images], group[labels]
    if str(img.dtype) != "uint8" or img.ndim != 4 or 3 not in (img.shape[1], img.shape[3]):
        raise SystemExit(f"{path}/{images}: expected uint8 images N x H x W x 3 or N x 3 x H x W "
                         f"(found {img.dtype} {img.shape})")
    if lab.ndim != 1 or lab.dtype.kind not in "iu" or lab.shape[0] != img.shape[0]:
        raise SystemExit(f"{path}/{labels}: expected {img.shape[0]} integer labels (found {lab.dtype} {lab.shape})")
    return Fields(images, labels, img.shape[3] == 3, int(lab[:].max()) + 1, int(img.shape[0]))


def pick_device(args: argparse.Namespace, torch: Any, local_rank: int) -> Any:
    """Where the model trains: GPU ``local_rank`` when torch sees one and ``--backend`` is not cpu, else the
    CPU."""
    if args.backend != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def open_gdsload(args: argparse.Namespace, fields: Fields, device: int | None) -> Any:
    """The training set as a GDSDataset of torch tensors on GPU ``device`` (None: the CPU, read by the cpu
    backend), shuffled, full batches only. Its rank and world size come from torch.distributed when
    initialised, else from RANK / WORLD_SIZE (torchrun)."""
    from gdsload import GDSDataset

    backend = "cpu" if device is None and args.backend == "auto" else args.backend
    return GDSDataset(args.data, batch_size=args.batch_size, fields=[fields.images, fields.labels],
                      backend=backend, shuffle=True, seed=args.seed, drop_last=True, output="torch",
                      device=device)


def rate_line(epoch: int, steps: int, images: int, seconds: float, ranks: int, extra: str = "",
              on_gpu: bool = True) -> str:
    """``epoch 1: 78 steps, 19,968 images in 1.52 s: 13,137 images/s on 1 GPU(s)`` + ``extra`` (``CPU
    process(es)`` for training on the CPU)."""
    rate = images / seconds if seconds > 0 else 0.0
    return (f"epoch {epoch}: {steps} steps, {images:,} images in {seconds:.2f} s: {rate:,.0f} images/s on "
            f"{ranks} {'GPU(s)' if on_gpu else 'CPU process(es)'}" + (f", {extra}" if extra else ""))
