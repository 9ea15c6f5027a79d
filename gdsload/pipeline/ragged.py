"""Variable-length fields: where a window's values go, and where each sample's values lie (pure numpy).

A window buffer holds, per variable-length field, the values of its blocks back to back in window order.
Everything here derives from the offsets array (sample i is ``values[offsets[i]:offsets[i+1]]``) and
the epoch plan, so the consumer only slices precomputed arrays.
"""

from __future__ import annotations

import numpy as np

from .plan import EpochPlan


def block_value_rows(offsets: np.ndarray, blocks: np.ndarray, samples_per_block: int) -> tuple[np.ndarray, np.ndarray]:
    """First and end value rows of each block (the last block of the dataset may hold fewer samples)."""
    n = len(offsets) - 1
    first = blocks * samples_per_block
    return offsets[first], offsets[np.minimum(first + samples_per_block, n)]


def capacity_rows(offsets: np.ndarray, samples_per_block: int, window_blocks: int) -> int:
    """Value rows a window buffer must hold for any window of any epoch: the W largest blocks together."""
    n_blocks = -(-(len(offsets) - 1) // samples_per_block)
    start, stop = block_value_rows(offsets, np.arange(n_blocks), samples_per_block)
    sizes = np.sort(stop - start)[::-1]
    return max(1, int(sizes[:window_blocks].sum()))


def window_dest_rows(offsets: np.ndarray, blocks: np.ndarray, samples_per_block: int) -> np.ndarray:
    """Row in the window buffer where each block's values start (exclusive prefix sum of their sizes)."""
    start, stop = block_value_rows(offsets, blocks, samples_per_block)
    sizes = stop - start
    return np.cumsum(sizes) - sizes


def epoch_value_index(plan: EpochPlan, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each stream position of the epoch: the window-buffer row where its sample's values start, and
    how many rows it has."""
    k = plan.config.samples_per_block
    if not plan.windows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    flat = np.concatenate(plan.windows)
    dest = np.concatenate([window_dest_rows(offsets, w, k) for w in plan.windows])
    base = np.cumsum([0] + [len(w) for w in plan.windows[:-1]])
    at = base[plan.window_of] + plan.positions // k
    block = flat[at]
    sample = block * k + plan.positions % k
    start = dest[at] + offsets[sample] - offsets[block * k]
    return start.astype(np.int64), (offsets[sample + 1] - offsets[sample]).astype(np.int64)


def gather(xp, take, values, starts, lengths, out) -> None:
    """Concatenate ``values[starts[i]:starts[i] + lengths[i]]`` for every i into ``out`` (on device or host).

    Element e of the output belongs to sample i = searchsorted(ends, e, 'right'), so one index array and
    one take do the whole batch, whatever the lengths (zero included)."""
    total = out.shape[0]
    if total == 0:
        return
    ends = xp.cumsum(lengths)
    e = xp.arange(total, dtype=ends.dtype)
    i = xp.searchsorted(ends, e, side="right")
    take(values, starts[i] + e - (ends[i] - lengths[i]), out)


def pad(xp, flat, lengths, pad_value, out) -> None:
    """Write each sample's values into ``out`` (B, width, ...), cut at ``width`` and filled with ``pad_value``."""
    width = out.shape[1]
    out.fill(pad_value)
    if flat.shape[0] == 0 or width == 0:
        return
    ends = xp.cumsum(lengths)
    e = xp.arange(flat.shape[0], dtype=ends.dtype)
    row = xp.searchsorted(ends, e, side="right")
    col = e - (ends[row] - lengths[row])
    keep = col < width
    out[row[keep], col[keep]] = flat[keep]
