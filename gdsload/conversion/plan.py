"""The plan of a conversion: every number the written files depend on, from the sources' metadata alone.

A single conversion (:mod:`gdsload.conversion.writer`) and a conversion in parts (:mod:`gdsload.conversion.parts`)
both follow it, so processes that plan the same inputs with the same options write the same bytes for every
shard. Planning reads no sample (a variable-length field's offsets excepted; with ``--compress auto``, a few
chunks of each fixed field).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._units import ALIGN
from ..errors import ConversionError
from ..format.arrays import shard_files
from .auto_compress import worth_compressing
from .checks import check_dtype, check_sources
from .source_types import RaggedSource, Source

DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_SLICE_BYTES = 64 << 20
#: Inner chunk (= block) of compressed datasets. Smaller than raw blocks: chunks decode in parallel (CPU
#: threads, or nvCOMP's batch), so a few large chunks leave the decoders underused.
DEFAULT_CHUNK_BYTES = 512 << 10


def choose_samples_per_block(sample_bytes: Sequence[int], block_bytes: int, num_samples: int) -> int:
    """Samples per block: as many of the largest sample as fit in ``block_bytes``, rounded down so the
    largest field's block is a multiple of :data:`~gdsload._units.ALIGN` (4 KiB) when that leaves at least
    one sample, and never more than the dataset holds."""
    largest = max(sample_bytes)
    k = max(1, block_bytes // largest)
    step = ALIGN // math.gcd(largest, ALIGN)
    if k >= step:
        k -= k % step
    return max(1, min(k, num_samples))


def parse_compress(text: str | None) -> int | None:
    """``"zstd"`` or ``"zstd:LEVEL"`` (or ``"auto"``, ``"auto:LEVEL"``) -> the zstd level (3 by default); None ->
    None. ValueError otherwise."""
    if text is None:
        return None
    name, _, level = text.partition(":")
    if name not in ("zstd", AUTO) or (level and not level.lstrip("-").isdigit()):
        raise ValueError(f"--compress takes zstd, zstd:LEVEL, auto or auto:LEVEL (found {text!r})")
    value = int(level) if level else 3
    if not -131072 <= value <= 22:
        raise ValueError(f"zstd level must be at most 22 (found {value})")
    return value


#: ``--compress auto``: each fixed field zstd-compressed only where that saves enough (:mod:`.auto_compress`).
AUTO = "auto"


@dataclass(frozen=True, eq=False)
class ArrayPlan:
    """One sharded array: ``key`` is its path in the group (``FIELD`` or ``FIELD/values``), ``field`` the field
    whose checksums its bytes feed. Its bytes, row after row, form a stream in which block ``b`` covers
    ``[bounds[b], bounds[b + 1])`` (a fixed field's blocks are its inner chunks, padding included)."""

    key: str
    field: str
    ragged: bool
    rows: int
    shape: tuple[int, ...]
    dtype: np.dtype
    row_bytes: int
    per_chunk: int
    chunks_per_shard: int
    level: int | None
    bounds: np.ndarray

    @property
    def chunk_bytes(self) -> int:
        return self.row_bytes * self.per_chunk

    @property
    def num_shards(self) -> int:
        return shard_files(self.rows, self.per_chunk, self.chunks_per_shard)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """The rows shard file ``shard`` holds: ``first`` to ``stop``."""
        first = shard * self.chunks_per_shard * self.per_chunk
        return first, min(first + self.chunks_per_shard * self.per_chunk, self.rows)

    def shard_key(self, shard: int) -> str:
        """The shard file's path in the dataset, ``/``-separated."""
        return "/".join([self.key, "c", str(shard), *(["0"] * len(self.shape))])

    def describe(self) -> dict[str, Any]:
        """What the array's files depend on, as plain JSON values (bounds: their sum and count)."""
        return {"key": self.key, "field": self.field, "ragged": self.ragged, "rows": self.rows,
                "shape": list(self.shape), "dtype": self.dtype.str, "per_chunk": self.per_chunk,
                "chunks_per_shard": self.chunks_per_shard, "level": self.level,
                "stream_bytes": int(self.bounds[-1]), "bounds_digest": _digest(self.bounds)}


@dataclass(frozen=True, eq=False)
class ConversionPlan:
    """The whole dataset: fields in order (fixed, then variable-length), samples, blocks and every array."""

    fixed: tuple[str, ...]
    ragged: tuple[str, ...]
    num_samples: int
    samples_per_block: int
    level: int | None
    arrays: tuple[ArrayPlan, ...]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)

    @property
    def fields(self) -> tuple[str, ...]:
        return self.fixed + self.ragged

    def array(self, key: str) -> ArrayPlan:
        return next(a for a in self.arrays if a.key == key)

    def describe(self) -> dict[str, Any]:
        """Everything the written files depend on, as plain JSON values: equal descriptions, equal files."""
        return {"fixed": list(self.fixed), "ragged": list(self.ragged), "num_samples": self.num_samples,
                "samples_per_block": self.samples_per_block, "level": self.level,
                "arrays": [a.describe() for a in self.arrays]}


def _digest(values: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(values, dtype="<i8").tobytes()).hexdigest()[:32]


def plan_dataset(out: str, sources: Mapping[str, Source], ragged: Mapping[str, RaggedSource], *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, samples_per_block: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, compress: str | None = None,
                 chunk_bytes: int | None = None) -> ConversionPlan:
    """The plan of converting ``sources`` and ``ragged`` to ``out`` with these options, every source checked
    first (:mod:`gdsload.conversion.checks`); ConversionError naming the input or option that is wrong. With
    ``compress="auto[:LEVEL]"``, a few chunks of each fixed field are read and compressed to decide whether it
    is stored compressed (:func:`gdsload.conversion.auto_compress.worth_compressing`: the same decision in
    every process)."""
    if not sources and not ragged:
        raise ConversionError(f"{out}: no input arrays (empty input)")
    block_bytes, shard_bytes = _size(out, "block_bytes", block_bytes), _size(out, "shard_bytes", shard_bytes)
    chunk_bytes = None if chunk_bytes is None else _size(out, "chunk_bytes", chunk_bytes)
    auto = compress is not None and compress.partition(":")[0] == AUTO
    try:
        level = parse_compress(compress)
    except ValueError as e:
        raise ConversionError(f"{out}: {e}") from None
    if chunk_bytes is not None and level is None:
        raise ConversionError(f"{out}: chunk_bytes (--chunk-bytes) sets the inner chunks of compressed fields: "
                              f"it needs compress (--compress zstd)")
    if level is not None:
        block_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    num_samples = check_sources(sources, ragged)
    arrays: dict[str, Source] = dict(sources)
    arrays.update({f"{n}/values": r.values for n, r in ragged.items()})
    dtypes = {n: check_dtype(s) for n, s in arrays.items()}
    row_bytes = {n: dtypes[n].itemsize * math.prod(s.shape[1:]) for n, s in arrays.items()}
    # a variable-length field counts with its mean sample size when choosing samples per block
    sample_bytes = [row_bytes[n] for n in sources] + [
        max(1, row_bytes[f"{n}/values"] * int(r.offsets[-1]) // num_samples) for n, r in ragged.items()]
    if samples_per_block is None:
        spb = choose_samples_per_block(sample_bytes, block_bytes, num_samples)
    elif samples_per_block < 1:
        raise ConversionError(f"{out}: samples_per_block must be at least 1 (found {samples_per_block})")
    else:
        spb = min(samples_per_block, num_samples)  # more would only write padding
    num_blocks = -(-num_samples // spb)
    first_samples = np.minimum(np.arange(num_blocks + 1, dtype=np.int64) * spb, num_samples)
    plans = []
    for key, src in arrays.items():
        rows, fixed = src.shape[0], key in sources
        if fixed:  # a block is an inner chunk, exactly as stored (padding included)
            per_chunk = spb
            bounds = np.arange(num_blocks + 1, dtype=np.int64) * (row_bytes[key] * spb)
        else:  # values: rows per chunk chosen like samples per block; a block is its samples' rows
            per_chunk = choose_samples_per_block([row_bytes[key]], block_bytes, max(1, rows))
            bounds = ragged[key.rsplit("/", 1)[0]].offsets[first_samples] * row_bytes[key]
        num_chunks = -(-rows // per_chunk)
        cps = max(1, min(shard_bytes // (row_bytes[key] * per_chunk), num_chunks))
        chosen = level if fixed and (not auto or level is None or
                                     worth_compressing(src, dtypes[key], rows, per_chunk, level)) else None
        plans.append(ArrayPlan(key, key if fixed else key.rsplit("/", 1)[0], not fixed, rows, tuple(src.shape[1:]),
                               dtypes[key], row_bytes[key], per_chunk, cps, chosen, bounds))
    _check_shard_bytes(out, shard_bytes, plans)
    return ConversionPlan(tuple(sources), tuple(ragged), num_samples, spb, level, tuple(plans))


def _size(out: str, name: str, value: Any) -> int:
    """A size argument as an int of at least 1 byte: TypeError or ConversionError (a ValueError) naming it and
    its flag. A block holds as many whole samples as fit in its target, at least one, so every positive target
    means something (1: a sample per block, as samples_per_block=1); 0 or less asks for blocks of nothing."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{out}: {name} ({flag}) must be an int, in bytes (found {type(value).__name__} {value!r})")
    if value < 1:
        raise ConversionError(f"{out}: {name} ({flag}) must be at least 1 byte (found {value})")
    return int(value)


def _check_shard_bytes(out: str, shard_bytes: int, arrays: Sequence[ArrayPlan]) -> None:
    """Refuse a shard target below every array's block: a shard holds whole blocks, at least one, so no shard
    could be that small, and each would hold a single block (a file per block), which was surely not meant.
    A target below some arrays' blocks only is met where it can be (those get a block per shard)."""
    smallest = min(arrays, key=lambda a: a.chunk_bytes)
    if shard_bytes < smallest.chunk_bytes:
        raise ConversionError(f"{out}: shard_bytes (--shard-bytes) {shard_bytes} is less than any array's "
                              f"block (the smallest: {smallest.chunk_bytes} bytes, of {smallest.key!r}): a shard "
                              f"holds whole blocks, at least one (expected at least {smallest.chunk_bytes}, or the "
                              f"default {DEFAULT_SHARD_BYTES})")
