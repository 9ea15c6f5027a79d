"""The images an image conversion reads, listed from its inputs: an ImageFolder tree, a list file, or WebDataset tars.

Listing opens no image: each :class:`ImageItem` says where its bytes lie (a file, or a range of a tar) and its
label. A problem of one sample (a tar sample without its label) travels with it as ``problem``, to be listed and
skipped; a problem of the input itself (a list line that does not parse, a compressed tar) is a ConversionError
naming it. The rules of each kind of input: docs/images.md, "Converting".
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConversionError
from .source_types import input_error

#: Extensions of image files in an ImageFolder tree and of image members of a WebDataset sample.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
#: A WebDataset sample's image member, by preference.
TAR_IMAGE_KEYS = ("jpg", "jpeg", "png")
#: The largest ``cls`` member read: a label is a short line of text.
MAX_CLS_BYTES = 4096


@dataclass(slots=True)
class ImageItem:
    """One sample: ``origin`` names it in messages; its bytes are ``size`` bytes of ``file`` from ``offset``
    (``size`` None: the whole file, its size read when scanned); ``problem`` says why it cannot be used."""

    origin: str
    file: str
    label: int
    offset: int = 0
    size: int | None = None
    problem: str | None = None


@dataclass
class ImageListing:
    """The samples of the inputs in order, and how many files were passed over as not images."""

    items: list[ImageItem]
    ignored: int = 0
    kind: str = ""


def list_images(inputs: Sequence[str]) -> ImageListing:
    """The samples of ``inputs``: one directory (ImageFolder), one list file, or one or more ``.tar``."""
    if not inputs:
        raise ConversionError("no image inputs given (expected a folder, a list file or .tar shards)")
    for p in inputs:
        if not os.path.exists(p):
            raise ConversionError(f"{p}: input does not exist")
    tars = [p for p in inputs if p.endswith(".tar")]
    if tars and len(tars) != len(inputs):
        raise ConversionError(f"{inputs[0]}: image inputs mix .tar shards with other inputs (expected one folder, "
                              f"one list file, or .tar shards only)")
    if tars:
        listing = ImageListing([], 0, "webdataset")
        for p in tars:
            listing.items += _tar_items(p)
        return listing
    if len(inputs) > 1:
        raise ConversionError(f"{inputs[1]}: more than one image input (expected one folder or one list file, "
                              f"or several .tar shards)")
    path = inputs[0]
    if os.path.isdir(path):
        return _folder_items(path)
    return ImageListing(_list_items(path), 0, "list")


def _folder_items(root: str) -> ImageListing:
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise input_error(root, "cannot list the directory", e) from e
    classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    ignored = sum(1 for e in entries if not e.is_dir())
    if not classes:
        raise ConversionError(f"{root}: no class folders (an ImageFolder tree holds one sub-folder per class)")
    items: list[ImageItem] = []
    for label, name in enumerate(classes):
        files: list[str] = []
        walk_errors: list[OSError] = []
        for folder, dirs, names in os.walk(os.path.join(root, name), onerror=walk_errors.append, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for n in names:
                if n.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(os.path.join(folder, n))
                else:
                    ignored += 1
        if walk_errors:
            e = walk_errors[0]
            raise input_error(e.filename or os.path.join(root, name), "cannot list the directory", e) from e
        items += [ImageItem(f, f, label) for f in sorted(files)]
    if not items:
        raise ConversionError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) under its class folders")
    return ImageListing(items, ignored, "folder")


def _list_items(path: str) -> list[ImageItem]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise input_error(path, "cannot read the list file", e) from e
    base = os.path.dirname(os.path.abspath(path))
    items = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.rsplit(None, 1)
        if len(parts) != 2 or not _is_int(parts[1]):
            raise ConversionError(f"{path}:{number}: expected 'PATH LABEL' (an integer label after the path), "
                                  f"found {text[:80]!r}")
        file = parts[0] if os.path.isabs(parts[0]) else os.path.join(base, parts[0])
        items.append(ImageItem(file, file, int(parts[1])))
    if not items:
        raise ConversionError(f"{path}: the list file names no images (empty input)")
    return items


def _is_int(text: str) -> bool:
    return text.lstrip("+-").isdigit() and -2**63 <= int(text) < 2**63


def _tar_items(path: str) -> list[ImageItem]:
    try:
        tf = tarfile.open(path, mode="r:")
    except (OSError, tarfile.TarError) as e:
        raise input_error(path, "not an uncompressed tar file", e) from e
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tf:
            for m in tf:
                if not m.isfile():
                    continue
                folder, base = os.path.split(m.name)
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                samples.setdefault(os.path.join(folder, stem), {})[ext.lower()] = m
            items = [_tar_item(path, tf, key, members) for key, members in samples.items()]
    except (OSError, tarfile.TarError, EOFError) as e:
        raise input_error(path, "cannot read the tar file", e) from e
    if not items:
        raise ConversionError(f"{path}: the tar file holds no samples (empty input)")
    return items


def _tar_item(path: str, tf: tarfile.TarFile, key: str, members: dict[str, tarfile.TarInfo]) -> ImageItem:
    origin = f"{path}:{key}"
    image = next((members[k] for k in TAR_IMAGE_KEYS if k in members), None)
    if image is not None:
        origin = f"{path}:{image.name}"
    cls = members.get("cls")
    problem = None
    label = 0
    if image is None:
        problem = f"no image member ({', '.join('.' + k for k in TAR_IMAGE_KEYS)}) in the sample"
    elif cls is None:
        problem = "no .cls member (the label) in the sample"
    elif cls.size > MAX_CLS_BYTES:
        problem = f"its .cls member is {cls.size} bytes (expected an integer label)"
    else:
        stream = tf.extractfile(cls)
        text = stream.read().decode("utf-8", "replace").strip() if stream is not None else ""
        if _is_int(text):
            label = int(text)
        else:
            problem = f"its .cls member holds {text[:40]!r} (expected an integer label)"
    if image is None:
        return ImageItem(origin, path, 0, 0, 0, problem)
    return ImageItem(origin, path, label, image.offset_data, image.size, problem)
