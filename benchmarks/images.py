"""Encoded JPEGs to 224x224 training batches, images/s: gdsload per backend against nvImageCodec's batched decode
(the ceiling), torchvision's GPU decode, a PIL DataLoader and DALI (docs/images.md).

    python -m benchmarks.images                          # GPU machine: every row (root for the cold rows)
    python -m benchmarks.images --tiny --backends cpu    # anywhere: a smoke test of the gdsload rows"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

import numpy as np

from benchmarks.common import RESULTS_DIR, add_options, describe_machine, results_dir, today, write_json
from gdsload import GDSDataset, ImageSpec, convert_images
from gdsload.tools.measure import cold_pass, time_pass

SIZE = 224
CROP = (0.08, 1.0)


def _write_class(args: tuple[str, int, int, int]) -> int:
    """Write images ``first .. first + count - 1`` of class folder ``folder`` (one process each)."""
    from PIL import Image

    folder, first, count, seed = args
    os.makedirs(folder, exist_ok=True)
    nbytes = 0
    for i in range(first, first + count):
        rng = np.random.default_rng((seed, i))
        h, w = int(375 * rng.uniform(0.9, 1.1)), int(500 * rng.uniform(0.9, 1.1))
        base = Image.fromarray(rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8))
        img = np.asarray(base.resize((w, h), Image.BICUBIC), dtype=np.int16)
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        with open(os.path.join(folder, f"{i:08d}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        nbytes += buf.tell()
    return nbytes


def make_images(data_dir: str, count: int, classes: int = 100) -> tuple[str, str, int]:
    """The ImageFolder tree and its dataset (made once per count); their JPEG bytes in all."""
    tree = os.path.join(data_dir, f"images-{count}")
    gds = tree + ".gds"
    if not os.path.exists(gds):
        per = -(-count // classes)
        jobs = [(os.path.join(tree, f"c{c:03d}"), c * per, min(per, count - c * per), 0) for c in range(classes)
                if c * per < count]
        with ProcessPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
            list(pool.map(_write_class, jobs))
        convert_images([tree], gds, progress=False)
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tree) for f in fs)
    return tree, gds, nbytes


def gdsload_rows(gds: str, backends: list[str], batch: int, cold: bool, min_seconds: float
                 ) -> dict[str, dict[str, float]]:
    spec = ImageSpec(SIZE, crop=CROP, flip=True)
    out: dict[str, dict[str, float]] = {}
    for backend in backends:
        with GDSDataset(gds, batch_size=batch, backend=backend, shuffle=True, images={"image": spec}) as ds:
            time_pass(ds)  # warms the page cache, the kernels and the decoder
            warm = time_pass(ds, min_seconds=min_seconds)
            out[backend] = {"warm": warm.samples / warm.seconds}
            if cold:
                try:
                    res = cold_pass(ds)
                    out[backend]["cold"] = res.samples / res.seconds
                except PermissionError as e:
                    out[backend]["cold_skipped"] = str(e)  # type: ignore[assignment]
        print(f"gdsload {backend}: {out[backend]}", flush=True)
    return out


def _files(tree: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(tree) for f in fs if f.endswith(".jpg"))


def _timed(fn: Callable[[], int], min_seconds: float = 5.0) -> float:
    """Images/s of ``fn`` (returning images done), repeated to fill ``min_seconds`` after one warm-up call."""
    fn()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        done += fn()
    return done / (time.perf_counter() - t0)


def ceiling_row(tree: str, batch: int) -> float:
    """nvImageCodec's batched decode, full size, of JPEG bytes already in host memory."""
    import cupy
    from nvidia import nvimgcodec

    blobs = [nvimgcodec.CodeStream(np.fromfile(f, np.uint8).tobytes()) for f in _files(tree)]  # docs/images.md
    decoder = nvimgcodec.Decoder()
    stream = cupy.cuda.Stream(non_blocking=True)

    def run() -> int:
        for i in range(0, len(blobs), batch):
            decoder.decode(blobs[i:i + batch], cuda_stream=stream.ptr)
        stream.synchronize()
        return len(blobs)

    return _timed(run)


def torchvision_row(tree: str, batch: int) -> float:
    """``decode_jpeg(device="cuda")`` on batches, then a random resized crop of each to 224 (torch ops)."""
    import torch
    import torchvision
    from torchvision.transforms.v2 import functional as F
    from torchvision.transforms.v2 import RandomResizedCrop

    datas = [torchvision.io.read_file(f) for f in _files(tree)]
    crop = RandomResizedCrop(SIZE, scale=CROP, antialias=True)

    def run() -> int:
        for i in range(0, len(datas), batch):
            imgs = torchvision.io.decode_jpeg(datas[i:i + batch], device="cuda")
            out = torch.stack([crop(im) for im in imgs])
            out = torch.where(torch.rand(len(imgs), 1, 1, 1, device="cuda") < 0.5, F.horizontal_flip(out), out)
        torch.cuda.synchronize()
        return len(datas)

    return _timed(run)


class _PilImages:
    """A map-style dataset: PIL decode, RandomResizedCrop(224), flip, uint8 CHW tensor."""

    def __init__(self, files: list[str]):
        from torchvision import transforms

        self.files = files
        self.tf = transforms.Compose([transforms.RandomResizedCrop(SIZE, scale=CROP),
                                      transforms.RandomHorizontalFlip(), transforms.PILToTensor()])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        from PIL import Image

        with Image.open(self.files[i]) as im:
            return self.tf(im.convert("RGB"))


def dataloader_row(tree: str, batch: int, workers: int = 8) -> float:
    import torch

    loader = torch.utils.data.DataLoader(_PilImages(_files(tree)), batch_size=batch, shuffle=True,
                                         num_workers=workers, pin_memory=True, persistent_workers=True)

    def run() -> int:
        n = 0
        for x in loader:
            x.cuda(non_blocking=True)
            n += len(x)
        torch.cuda.synchronize()
        return n

    return _timed(run)


def dali_row(tree: str, batch: int) -> float:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=8, device_id=0)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs, labels = fn.readers.file(file_root=tree, random_shuffle=True, name="r")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=SIZE, random_area=list(CROP))
        return fn.flip(images, horizontal=fn.random.coin_flip()), labels

    p = pipe()
    p.build()
    per_epoch = p.epoch_size("r")

    def run() -> int:
        for _ in range(-(-per_epoch // batch)):
            p.run()
        return per_epoch

    return _timed(run)


def contender(name: str, fn: Callable[[], float], rows: dict[str, Any]) -> None:
    """Run one contender row; one that cannot run here says why instead of a figure."""
    try:
        rows[name] = fn()
    except Exception as e:  # a contender missing here (DALI, torchvision's CUDA decode) is a note, not a failure
        rows[name] = None
        rows.setdefault("skipped", {})[name] = f"{type(e).__name__}: {e}"[:300]
    print(f"{name}: {rows[name]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = add_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                       data_dir=os.environ.get("GDSLOAD_BENCH_DIR", "/tmp/gdsload-bench"), out=RESULTS_DIR,
                       images=200_000, batch=256, backends="mmap,pinned,kvikio",
                       tiny=(False, "at most 2,000 images, gdsload rows only (a smoke test)"),
                       min_seconds=(5.0, "each gdsload warm row's timed stretch")).parse_args(argv)
    count = min(args.images, 2000) if args.tiny else args.images
    tree, gds, nbytes = make_images(args.data_dir, count)
    info = describe_machine(args.data_dir)
    rows: dict[str, Any] = {"gdsload": gdsload_rows(gds, args.backends.split(","), args.batch, not args.tiny,
                                                args.min_seconds)}
    if not args.tiny:
        contender("ceiling", lambda: ceiling_row(tree, args.batch), rows)
        contender("torchvision_gpu", lambda: torchvision_row(tree, args.batch), rows)
        contender("dataloader_pil", lambda: dataloader_row(tree, args.batch), rows)
        contender("dali", lambda: dali_row(tree, args.batch), rows)
    summary = {f"gdsload_{b}_{k}": round(v, 1) for b, r in rows["gdsload"].items() for k, v in r.items()
               if isinstance(v, float)}
    summary.update({k: (None if rows.get(k) is None else round(rows[k], 1))
                    for k in ("ceiling", "torchvision_gpu", "dataloader_pil", "dali") if k in rows})
    doc = {"benchmark": "images", "date": today(), "command": " ".join(["python -m benchmarks.images", *sys.argv[1:]]),
           "machine": info, "images": count, "jpeg_bytes": nbytes, "batch": args.batch, "size": SIZE,
           "crop": list(CROP), "summary": summary, "rows": rows}
    path = write_json(os.path.join(results_dir(args.out, info), "images.json"), doc)
    print(f"wrote {path}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
