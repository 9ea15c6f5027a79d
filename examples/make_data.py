"""Write a synthetic image dataset for the examples: uint8 images whose class sets their colour (so the model
has something to learn) and int64 labels, converted with ``gdsload.write_dataset``.

    python examples/make_data.py /tmp/synth.gds                          # 20,000 images of 64 x 64 x 3 (246 MB)
    python examples/make_data.py /tmp/big.gds --samples 100000 --size 128 --nchw

Images are stored N x H x W x 3 (``--nchw``: N x 3 x H x W), in fields ``images`` and ``labels``, the names
``gdsload shard images.npy labels.npy`` would give them. They are generated slice by slice as the writer asks
for them, so memory stays at one slice whatever ``--samples``. Needs numpy and gdsload only (no torch).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

CLASSES = 10


def labels_of(start: int, stop: int) -> np.ndarray:
    """The label of samples [start, stop): a fixed scramble of the index (no run of one class)."""
    idx = np.arange(start, stop, dtype=np.uint64)
    return ((idx * np.uint64(2654435761)) % np.uint64(2**32) >> np.uint64(7)).astype(np.int64) % CLASSES


class Rows:
    """An array-like of ``shape`` whose rows are made on demand by ``make(start, stop)``: what
    ``gdsload.ArraySource`` reads in slices along axis 0."""

    def __init__(self, shape: tuple[int, ...], dtype: str, make):
        self.shape, self.dtype, self.make = shape, np.dtype(dtype), make

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        return self.make(start, stop)


def images_maker(size: int, nchw: bool, seed: int):
    palette = np.random.default_rng(seed).integers(48, 208, (CLASSES, 3))

    def make(start: int, stop: int) -> np.ndarray:
        noise = np.random.default_rng([seed, start]).integers(-48, 48, (stop - start, size, size, 3))
        images = np.clip(palette[labels_of(start, stop)][:, None, None, :] + noise, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(images.transpose(0, 3, 1, 2)) if nchw else images

    return make


def build_parser() -> argparse.ArgumentParser:
    from gdsload.tools.cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("output", help="dataset directory to write (e.g. /tmp/synth.gds)")
    p.add_argument("--samples", type=int, default=20_000, help="images (and labels) to write")
    p.add_argument("--size", type=int, default=64, help="image height and width")
    p.add_argument("--nchw", action="store_true", help="store images N x 3 x H x W")
    p.add_argument("--seed", type=int, default=0, help="seed of the class colours and the noise")
    p.add_argument("--overwrite", action="store_true", help="replace an existing gdsload dataset")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from gdsload import ArraySource, write_dataset

    n, s = args.samples, args.size
    shape = (n, 3, s, s) if args.nchw else (n, s, s, 3)
    images = Rows(shape, "uint8", images_maker(s, args.nchw, args.seed))
    meta = write_dataset(args.output, {"images": ArraySource("<synthetic images>", images),
                                       "labels": ArraySource("<synthetic labels>", Rows((n,), "int64", labels_of))},
                         overwrite=args.overwrite)
    print(f"wrote {meta.path}: {n:,} images {'x'.join(map(str, shape[1:]))} uint8 and labels of {CLASSES} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
