"""Converting encoded images (JPEG, PNG) into a dataset, bytes unchanged: ``gdsload shard --images``.

The inputs are listed (:mod:`gdsload.conversion.image_inputs`) and each image's header read
(:mod:`gdsload.format.image_header`); nothing is decoded. The dataset holds a variable-length uint8 field of the
encoded bytes (``image`` by default, its formats in the field's metadata) and fixed fields ``label``, ``height``
and ``width``, written by :func:`gdsload.conversion.writer.write_dataset` a slice at a time and published
atomically. An unreadable image is skipped (listed in the result, logged, counted in a warning) or, with
``strict``, refused, naming the first; none is dropped silently (docs/images.md, "Converting").
"""

from __future__ import annotations

import array
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from ..errors import ConversionError, warn
from ..format.image_header import ImageHeaderError, probe
from ..format.meta import DatasetMeta
from .image_inputs import ImageItem, list_images
from .publish import check_output
from .source_types import ArraySource, RaggedSource, input_error
from .writer import write_dataset


@dataclass(frozen=True)
class Skipped:
    """An input image left out, and why."""

    origin: str
    why: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.why}"


@dataclass
class ImageConversion:
    """What :func:`convert_images` wrote (``meta``), the images it skipped, and the files under an
    ImageFolder tree passed over as not images (by extension)."""

    meta: DatasetMeta
    skipped: list[Skipped] = field(default_factory=list)
    ignored: int = 0


class _Files:
    """One input file open at a time (the stream goes through them in order); reads at an offset."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.f: BinaryIO | None = None

    def open(self, path: str) -> BinaryIO:
        if path != self.path:
            self.close()
            self.f = open(path, "rb")
            self.path = path
        assert self.f is not None
        return self.f

    def read(self, path: str, offset: int, count: int) -> bytes:
        f = self.open(path)
        f.seek(offset)
        return f.read(count)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        self.f = self.path = None


def scan(items: Sequence[ImageItem], strict: bool) -> tuple[list[ImageItem], np.ndarray, set[str], list[Skipped]]:
    """The items whose header reads (each with its size set), their (height, width) as int32 ``(n, 2)`` and
    the formats seen, and the items skipped; with ``strict`` the first bad one is a ConversionError naming it."""
    files = _Files()
    good: list[ImageItem] = []
    sizes = array.array("i")
    formats: set[str] = set()
    skipped: list[Skipped] = []
    try:
        for item in items:
            why = item.problem
            if why is None:
                try:
                    if item.size is None:
                        item.size = os.stat(item.file).st_size
                    end, base = item.size, item.offset
                    info = probe(lambda o, n: files.read(item.file, base + o, max(0, min(n, end - o))), end)
                    sizes.extend((info.height, info.width))
                    formats.add(info.format)
                    good.append(item)
                    continue
                except ImageHeaderError as e:
                    why = str(e)
                except OSError as e:
                    why = f"cannot read ({e.strerror or type(e).__name__})"
            if strict:
                raise ConversionError(f"{item.origin}: {why} (strict: no image is skipped)")
            skipped.append(Skipped(item.origin, why))
    finally:
        files.close()
    return good, np.frombuffer(sizes, np.int32).reshape(-1, 2), formats, skipped


@dataclass
class ImageBytesSource:
    """The images' bytes back to back, a uint8 array of ``offsets[-1]`` rows read in ranges: the values of
    the image field. A file whose bytes differ in length from when it was scanned is a ConversionError."""

    origin: str
    items: list[ImageItem]
    offsets: np.ndarray

    def __post_init__(self) -> None:
        self.shape = (int(self.offsets[-1]),)
        self.dtype = np.dtype(np.uint8)
        self._files = _Files()

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.uint8)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            item, first = self.items[i], int(self.offsets[i])
            lo, hi = pos - first, min(stop, int(self.offsets[i + 1])) - first
            try:
                data = self._files.read(item.file, item.offset + lo, hi - lo)
            except OSError as e:
                raise input_error(item.origin, "cannot read", e) from e
            if len(data) != hi - lo:
                raise ConversionError(f"{item.origin}: file changed during the conversion (expected {item.size} "
                                      f"bytes, as when its header was read)")
            out[pos - start:pos - start + len(data)] = np.frombuffer(data, np.uint8)
            pos += len(data)
            i += 1
        return out

    def close(self) -> None:
        self._files.close()


def convert_images(inputs: Sequence[str], out: str | os.PathLike[str], *, strict: bool = False,
                   field_name: str = "image", log: Callable[[str], None] | None = None,
                   **options: object) -> ImageConversion:
    """Convert images (an ImageFolder folder, a list file of ``PATH LABEL`` lines, or WebDataset ``.tar``
    shards; :mod:`gdsload.conversion.image_inputs`) into a dataset at ``out``: field ``field_name`` holds
    each image's encoded bytes unchanged, ``label``, ``height`` and ``width`` beside it. ``options`` are
    :func:`gdsload.conversion.writer.write_dataset`'s. Images that cannot be used are skipped (listed in the
    result, on ``log`` and counted in a warning) or, with ``strict``, refused: ConversionError naming one."""
    out = os.fspath(out)
    if field_name in ("label", "height", "width"):
        raise ConversionError(f"{out}: image field name {field_name!r} is taken by another field")
    inputs = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    listing = list_images(inputs)
    check_output(os.path.abspath(out), bool(options.get("overwrite", False)), list(inputs))
    good, hw, formats, skipped = scan(listing.items, strict)
    if not good:
        raise ConversionError(f"{out}: no readable image among the {len(listing.items)} input(s) "
                              f"(first: {skipped[0] if skipped else inputs[0]})")
    sizes = np.array([item.size for item in good], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    values = ImageBytesSource(f"{inputs[0]}:{field_name}", good, offsets)
    fixed = {"label": np.array([item.label for item in good], dtype=np.int64),
             "height": np.ascontiguousarray(hw[:, 0]), "width": np.ascontiguousarray(hw[:, 1])}
    try:
        meta = write_dataset(out, {n: ArraySource(f"{inputs[0]}:{n}", a) for n, a in fixed.items()},
                             ragged={field_name: RaggedSource(values.origin, values, offsets)},
                             field_attrs={field_name: {"image": {"formats": sorted(formats)}}},
                             **options)  # type: ignore[arg-type]
    finally:
        values.close()
    result = ImageConversion(meta, skipped, listing.ignored)
    for line in report_lines(result) if log is not None else ():
        log(line)
    if skipped:
        warn(f"{out}: {len(skipped)} image(s) skipped (unreadable, damaged or unlabelled), first "
             f"{skipped[0]}; the result's 'skipped' lists them all (strict=True / --strict refuses them)",
             UserWarning)
    return result


def report_lines(result: ImageConversion) -> list[str]:
    """One line per skipped image, then a count of images written, skipped and files passed over."""
    lines = [f"SKIPPED {s}" for s in result.skipped]
    note = f"; {result.ignored} file(s) not named .jpg/.jpeg/.png passed over" if result.ignored else ""
    lines.append(f"{result.meta.path}: {result.meta.num_samples} images written, {len(result.skipped)} "
                 f"skipped{note}")
    return lines
