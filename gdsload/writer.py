"""Writing datasets: metadata through zarr, shard files streamed block by block.

zarr writes the group and array metadata (so plain zarr opens the result); the shard files themselves are
written here, sequentially, because zarr rewrites a whole shard on every partial write: streaming blocks
keeps memory at one slice and each byte is written once. The layout is exactly the sharding codec's
(blocks back to back, index and crc32c at the end); the tests read every dataset back through zarr.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from typing import Callable

import numpy as np

from .errors import ConversionError
from .format import ATTRS_KEY, FORMAT_VERSION, MAX_UINT_64, DatasetMeta, encode_shard_index, read_metadata
from .sources import Source, open_field, open_input

DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_SLICE_BYTES = 64 << 20
ALIGN_BYTES = 4096


def choose_samples_per_block(sample_bytes: Sequence[int], block_bytes: int, num_samples: int) -> int:
    """Samples per block: as many of the largest sample as fit in ``block_bytes``, rounded down so the
    largest field's block is a multiple of 4 KiB when that leaves at least one sample, and never more
    than the dataset holds."""
    largest = max(sample_bytes)
    k = max(1, block_bytes // largest)
    step = ALIGN_BYTES // math.gcd(largest, ALIGN_BYTES)
    if k >= step:
        k -= k % step
    return max(1, min(k, num_samples))


def _check_dtype(src: Source) -> np.dtype:
    dt = src.dtype
    if dt.fields is not None or dt.kind == "V":
        raise ConversionError(f"{src.origin}: unsupported dtype {dt} (structured arrays: save each field separately)")
    if dt.kind not in "biufc":
        raise ConversionError(
            f"{src.origin}: unsupported dtype {dt} (expected bool, integer, float or complex; found kind '{dt.kind}')"
        )
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


def _validate(sources: Mapping[str, Source]) -> int:
    if not sources:
        raise ConversionError("no input arrays (empty input)")
    counts = {}
    for name, src in sources.items():
        if not name or "/" in name or name.startswith(".") or name.startswith("__"):
            raise ConversionError(f"{src.origin}: invalid field name '{name}'")
        _check_dtype(src)
        if len(src.shape) == 0:
            raise ConversionError(f"{src.origin}: is a scalar (expected an array with samples on axis 0)")
        if src.shape[0] == 0:
            raise ConversionError(f"{src.origin}: holds no samples (empty input)")
        if 0 in src.shape[1:]:
            raise ConversionError(f"{src.origin}: zero-size samples (sample shape {src.shape[1:]})")
        counts[name] = src.shape[0]
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{n}={c}" for n, c in counts.items())
        raise ConversionError(f"fields have different sample counts ({detail}; expected all equal)")
    return next(iter(counts.values()))


def _write_shard(path: str, src: Source, first_sample: int, stop_sample: int, block_bytes: int,
                 blocks_per_shard: int, slice_samples: int, progress: Callable[[int], None]) -> None:
    """Write one shard file: whole blocks back to back (the last padded with zeros), then the index."""
    spb_bytes = block_bytes
    n_bytes = 0
    dtype = _check_dtype(src)
    with open(path, "wb") as f:
        pos = first_sample
        while pos < stop_sample:
            end = min(pos + slice_samples, stop_sample)
            data = np.ascontiguousarray(src.read(pos, end), dtype=dtype)
            buf = memoryview(data.reshape(-1).view(np.uint8))
            f.write(buf)
            n_bytes += len(buf)
            progress(len(buf))
            pos = end
        pad = -n_bytes % spb_bytes
        if pad:
            f.write(bytes(pad))  # the fill value is zero: pad the final partial block to full size
        n_blocks = (n_bytes + pad) // spb_bytes
        table = np.full((blocks_per_shard, 2), MAX_UINT_64, dtype=np.uint64)
        table[:n_blocks, 0] = np.arange(n_blocks, dtype=np.uint64) * np.uint64(spb_bytes)
        table[:n_blocks, 1] = spb_bytes
        f.write(encode_shard_index(table))


def write_dataset(
    out: str | os.PathLike[str],
    sources: Mapping[str, Source],
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    samples_per_block: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    slice_bytes: int = DEFAULT_SLICE_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
) -> DatasetMeta:
    """Write ``sources`` (field name -> array source) as a gdsload dataset at ``out``, atomically.

    Everything goes to a temporary sibling directory that is renamed to ``out`` only once complete, so a
    failure or interruption leaves nothing at ``out`` (and an existing dataset there untouched).
    """
    import zarr
    from tqdm import tqdm

    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not overwrite:
        raise ConversionError(f"{out}: output exists (pass --overwrite to replace it)")
    num_samples = _validate(sources)
    dtypes = {n: _check_dtype(s) for n, s in sources.items()}
    sample_bytes = {n: dtypes[n].itemsize * int(np.prod(s.shape[1:], dtype=np.int64)) for n, s in sources.items()}
    if samples_per_block is None:
        spb = choose_samples_per_block(list(sample_bytes.values()), block_bytes, num_samples)
    elif samples_per_block < 1:
        raise ConversionError(f"samples_per_block must be at least 1 (found {samples_per_block})")
    else:
        spb = samples_per_block
    num_blocks = -(-num_samples // spb)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    total = sum(sample_bytes.values()) * num_samples
    try:
        fields_attr = {n: {"kind": "fixed"} for n in sources}
        group = zarr.open_group(tmp, mode="w", zarr_format=3)
        group.attrs[ATTRS_KEY] = {"format": FORMAT_VERSION, "num_samples": num_samples,
                                  "samples_per_block": spb, "fields": fields_attr}
        with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(out), disable=None if progress is None else not progress) as bar:
            for name, src in sources.items():
                shape = src.shape[1:]
                bbytes = sample_bytes[name] * spb
                bps = max(1, min(shard_bytes // bbytes, num_blocks))
                group.create_array(name, shape=(num_samples, *shape), dtype=dtypes[name], chunks=(spb, *shape),
                                   shards=(spb * bps, *shape), fill_value=0, compressors=None, filters=None)
                slice_samples = max(spb, (slice_bytes // bbytes) * spb)
                for shard in range(-(-num_blocks // bps)):
                    key = ["c", str(shard)] + ["0"] * len(shape)
                    path = os.path.join(tmp, name, *key)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    first = shard * bps * spb
                    _write_shard(path, src, first, min(first + bps * spb, num_samples), bbytes, bps,
                                 slice_samples, bar.update)
        meta = read_metadata(tmp)  # the result must parse before it may replace anything
        if os.path.exists(out):
            trash = f"{tmp}.old"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for src in sources.values():
            src.close()
    return DatasetMeta(path=out, num_samples=meta.num_samples, samples_per_block=meta.samples_per_block,
                       fields=meta.fields)


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def convert(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    named: Mapping[str, str] | None = None,
    **options: object,
) -> DatasetMeta:
    """Convert input paths (fields named after files/keys) and ``named`` fields (name -> path) to ``out``."""
    out = os.fspath(out)
    named = dict(named or {})
    all_paths = list(inputs) + [p.rsplit(":", 1)[0] if not os.path.exists(p) else p for p in named.values()]
    if not all_paths:
        raise ConversionError("no inputs given (empty input)")
    for p in all_paths:
        if not os.path.exists(p):
            raise ConversionError(f"{p}: input does not exist")
        if _inside(out, p):
            raise ConversionError(f"{out}: output path is inside input {p} (or the same); choose another output")
    sources: dict[str, Source] = {}
    for p in inputs:
        for name, src in open_input(p).items():
            if name in sources or name in named:
                raise ConversionError(f"{src.origin}: field '{name}' given twice (rename with --field NAME=PATH)")
            sources[name] = src
    for name, p in named.items():
        sources[name] = open_field(p)
    return write_dataset(out, sources, **options)  # type: ignore[arg-type]
