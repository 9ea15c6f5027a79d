"""``--compress auto``: whether zstd is worth it for a fixed field, judged on a sample of its chunks.

Pure: a source's rows in, a decision out. A field whose sampled chunks zstd shrinks by less than
:data:`MIN_SAVING` is stored raw; the sample is a fixed set of chunks spread evenly over the field (so every
process of a conversion in parts decides alike), each compressed as the writer compresses it (docs/format.md,
"Compressed chunks").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.arrays import CRC_BYTES

#: The least share of a field's bytes zstd must save (over the sampled chunks) for it to be stored compressed.
MIN_SAVING = 0.10
#: Chunks sampled per field, spread evenly from its first to its last.
SAMPLE_CHUNKS = 8


def sample_chunks(num_chunks: int, count: int = SAMPLE_CHUNKS) -> np.ndarray:
    """``count`` chunk numbers spread evenly over ``num_chunks`` (the first and the last among them; all of
    them when there are no more)."""
    if num_chunks <= count:
        return np.arange(num_chunks)
    return np.unique(np.linspace(0, num_chunks - 1, count).round().astype(np.int64))


def zstd_saving(src: Any, dtype: np.dtype, rows: int, per_chunk: int, level: int) -> float:
    """The share of bytes zstd at ``level`` (with each chunk's crc32c) saves over :func:`sample_chunks` of a
    field of ``rows`` rows in chunks of ``per_chunk`` rows, read from ``src`` (``read(start, stop)``); the last
    chunk is sampled without the padding the writer adds."""
    import numcodecs

    codec = numcodecs.Zstd(level=level)
    raw = stored = 0
    for c in sample_chunks(-(-rows // per_chunk)).tolist():
        data = np.ascontiguousarray(src.read(c * per_chunk, min((c + 1) * per_chunk, rows)), dtype=dtype)
        raw += data.nbytes
        stored += len(codec.encode(data.reshape(-1).view(np.uint8))) + CRC_BYTES
    return 0.0 if raw == 0 else 1.0 - stored / raw


def worth_compressing(src: Any, dtype: np.dtype, rows: int, per_chunk: int, level: int) -> bool:
    """Whether zstd saves at least :data:`MIN_SAVING` of the field's sampled bytes (:func:`zstd_saving`)."""
    return zstd_saving(src, dtype, rows, per_chunk, level) >= MIN_SAVING
