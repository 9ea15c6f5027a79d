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
from .sources import RaggedSource, Source, open_field, open_input, open_ragged

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


def _check_name(name: str, origin: str) -> None:
    if not name or "/" in name or name.startswith(".") or name.startswith("__"):
        raise ConversionError(f"{origin}: invalid field name '{name}'")


def _validate_ragged(name: str, r: RaggedSource) -> int:
    """Check a variable-length field; returns its number of samples."""
    _check_name(name, r.origin)
    _check_dtype(r.values)
    off = r.offsets
    if off.ndim != 1 or len(off) < 2:
        raise ConversionError(f"{r.origin}: holds no samples (empty input)")
    if off[0] != 0 or (np.diff(off) < 0).any():
        raise ConversionError(f"{r.origin}: offsets must start at 0 and never decrease (found {off[:4]}...)")
    if len(r.values.shape) == 0 or off[-1] != r.values.shape[0]:
        raise ConversionError(f"{r.origin}: offsets end at {off[-1]} but there are "
                              f"{r.values.shape[0] if r.values.shape else 0} values (expected equal)")
    if 0 in r.values.shape[1:]:
        raise ConversionError(f"{r.origin}: zero-size elements (element shape {r.values.shape[1:]})")
    return len(off) - 1


def _validate(sources: Mapping[str, Source], ragged: Mapping[str, RaggedSource] | None = None) -> int:
    ragged = ragged or {}
    if not sources and not ragged:
        raise ConversionError("no input arrays (empty input)")
    twice = sorted(set(sources) & set(ragged))
    if twice:
        raise ConversionError(f"{ragged[twice[0]].origin}: field '{twice[0]}' given twice")
    counts = {name: _validate_ragged(name, r) for name, r in ragged.items()}
    for name, src in sources.items():
        _check_name(name, src.origin)
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


def _write_shard(path: str, src: Source, dtype: np.dtype, first_sample: int, stop_sample: int, block_bytes: int,
                 blocks_per_shard: int, slice_samples: int, progress: Callable[[int], None]) -> None:
    """Write one shard file: whole blocks back to back (the last padded with zeros), then the index."""
    n_bytes = 0
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
        pad = -n_bytes % block_bytes
        if pad:
            f.write(bytes(pad))  # the fill value is zero: pad the final partial block to full size
        n_blocks = (n_bytes + pad) // block_bytes
        table = np.full((blocks_per_shard, 2), MAX_UINT_64, dtype=np.uint64)
        table[:n_blocks, 0] = np.arange(n_blocks, dtype=np.uint64) * np.uint64(block_bytes)
        table[:n_blocks, 1] = block_bytes
        f.write(encode_shard_index(table))


def write_dataset(
    out: str | os.PathLike[str],
    sources: Mapping[str, Source],
    *,
    ragged: Mapping[str, RaggedSource] | None = None,
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
    ragged = dict(ragged or {})
    num_samples = _validate(sources, ragged)
    arrays: dict[str, Source] = dict(sources)  # every sharded array, by its path in the group
    arrays.update({f"{n}/values": r.values for n, r in ragged.items()})
    dtypes = {n: _check_dtype(s) for n, s in arrays.items()}
    row_bytes = {n: dtypes[n].itemsize * int(np.prod(s.shape[1:], dtype=np.int64)) for n, s in arrays.items()}
    # a variable-length field counts with its mean sample size when choosing samples per block
    sample_bytes = [row_bytes[n] for n in sources] + [
        max(1, row_bytes[f"{n}/values"] * int(r.offsets[-1]) // num_samples) for n, r in ragged.items()]
    if samples_per_block is None:
        spb = choose_samples_per_block(sample_bytes, block_bytes, num_samples)
    elif samples_per_block < 1:
        raise ConversionError(f"samples_per_block must be at least 1 (found {samples_per_block})")
    else:
        spb = samples_per_block

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    total = sum(row_bytes[n] * s.shape[0] for n, s in arrays.items())
    try:
        fields_attr = {n: {"kind": "fixed"} for n in sources}
        fields_attr.update({n: {"kind": "ragged"} for n in ragged})
        group = zarr.open_group(tmp, mode="w", zarr_format=3)
        group.attrs[ATTRS_KEY] = {"format": FORMAT_VERSION, "num_samples": num_samples,
                                  "samples_per_block": spb, "fields": fields_attr}
        for name, r in ragged.items():
            sub = group.create_group(name)
            off = sub.create_array("offsets", shape=r.offsets.shape, dtype=np.int64, compressors=None)
            off[:] = r.offsets
        with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(out),
                  disable=None if progress is None else not progress) as bar:
            for key, src in arrays.items():
                rows = src.shape[0]
                # samples of a fixed field; for values, rows per chunk chosen like samples per block
                per_chunk = spb if key in sources else choose_samples_per_block(
                    [row_bytes[key]], block_bytes, max(1, rows))
                _write_array(group, tmp, key, src, dtypes[key], rows, per_chunk, row_bytes[key] * per_chunk,
                             shard_bytes, slice_bytes, bar.update)
        read_metadata(tmp)  # the result must parse before it may replace anything
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
        for src in arrays.values():
            src.close()
    return read_metadata(out)


def _write_array(group, tmp: str, key: str, src: Source, dtype: np.dtype, rows: int, per_chunk: int,
                 chunk_bytes: int, shard_bytes: int, slice_bytes: int, progress: Callable[[int], None]) -> None:
    """One sharded array: metadata through zarr, then its shard files streamed chunk by chunk."""
    shape = src.shape[1:]
    num_chunks = -(-rows // per_chunk)
    cps = max(1, min(shard_bytes // chunk_bytes, num_chunks))
    group.create_array(key, shape=(rows, *shape), dtype=dtype, chunks=(per_chunk, *shape),
                       shards=(per_chunk * cps, *shape), fill_value=0, compressors=None, filters=None)
    slice_rows = max(per_chunk, (slice_bytes // chunk_bytes) * per_chunk)
    for shard in range(-(-num_chunks // cps)):
        path = os.path.join(tmp, *key.split("/"), "c", str(shard), *(["0"] * len(shape)))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        first = shard * cps * per_chunk
        _write_shard(path, src, dtype, first, min(first + cps * per_chunk, rows), chunk_bytes, cps, slice_rows,
                     progress)


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def convert(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    named: Mapping[str, str] | None = None,
    ragged: Mapping[str, str] | None = None,
    **options: object,
) -> DatasetMeta:
    """Convert input paths (fields named after files/keys), ``named`` fields (name -> path) and
    variable-length ``ragged`` fields (name -> directory of per-sample .npy, or .npz with values and
    offsets) to ``out``."""
    out = os.fspath(out)
    named = dict(named or {})
    ragged = dict(ragged or {})
    all_paths = list(inputs) + [p.rsplit(":", 1)[0] if not os.path.exists(p) else p for p in named.values()]
    all_paths += list(ragged.values())
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
    return write_dataset(out, sources, ragged={n: open_ragged(p) for n, p in ragged.items()},
                         **options)  # type: ignore[arg-type]
