"""What examples/train.py and examples/lightning_train.py share besides the model (examples/model.py) and their
loaders (examples/feeds.py): their common options, what the dataset holds, opening it with gdsload, and the line
that reports images/s.

Nothing here imports torch at module level, so ``--help`` works on a machine without it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """The options both scripts take."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a dataset written by 'gdsload shard' (or examples/make_data.py)")
    p.add_argument("--images", default="images", help="the image field: uint8, N x H x W x 3 or N x 3 x H x W")
    p.add_argument("--labels", default="labels", help="the label field: integers, N")
    p.add_argument("--loader", choices=("gdsload", "dataloader"), default="gdsload",
                   help="gdsload, or a torch DataLoader reading each sample from the same shard files")
    p.add_argument("--workers", type=int, default=8, help="DataLoader worker processes (--loader dataloader)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per epoch (0: whole epochs)")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--backend", default="auto", help="gdsload backend (auto, kvikio, pinned, mmap)")
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


def open_gdsload(args: argparse.Namespace, fields: Fields, device: int) -> Any:
    """The training set as a GDSDataset of torch tensors on ``device``, shuffled, full batches only. Its rank
    and world size come from torch.distributed when initialised, else from RANK / WORLD_SIZE (torchrun)."""
    from gdsload import GDSDataset

    return GDSDataset(args.data, batch_size=args.batch_size, fields=[fields.images, fields.labels],
                      backend=args.backend, shuffle=True, seed=args.seed, drop_last=True, output="torch",
                      device=device)


def rate_line(epoch: int, steps: int, images: int, seconds: float, gpus: int, extra: str = "") -> str:
    """``epoch 1: 78 steps, 19,968 images in 1.52 s: 13,137 images/s on 1 GPU(s)`` + ``extra``."""
    rate = images / seconds if seconds > 0 else 0.0
    return (f"epoch {epoch}: {steps} steps, {images:,} images in {seconds:.2f} s: {rate:,.0f} images/s on "
            f"{gpus} GPU(s)" + (f", {extra}" if extra else ""))
