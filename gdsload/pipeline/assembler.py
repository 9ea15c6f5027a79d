"""Batch assembly: a batch's samples gathered out of window buffers into freshly allocated arrays.

No threads here: the pipeline runs :meth:`Assembler.batches` on its assembler thread and supplies the windows. A
batch is one segment per window it draws from; a field is gathered by plan positions (:meth:`WindowMap.direct`),
by rows of its own (:meth:`WindowMap.stream_rows`), by global sample id (resident fields), or concatenated or
padded (variable-length fields). Every output array is allocated before ``ops.fence()``: memory the consumer
freed is rewritten only after the work it queued (docs/design.md, "Memory reuse").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cuda.ops import Ops
from ..format.arrays import FieldMeta
from .plan import EpochPlan
from .ragged import epoch_value_index, gather
from .ragged import pad as pad_values
from .window import WindowMap


#: A step run on each batch last: (ops, epoch, global sample ids of the batch, arrays) -> arrays.
BatchStep = Callable[[Ops, int, np.ndarray, dict[str, Any]], dict[str, Any]]

#: Batches are gathered together up to this many output bytes. Each batch of a group is a view of the group's
#: arrays, so memory the consumer drops returns to the pool once every batch of its group is dropped: this
#: bounds what that holds back.
GROUP_BYTES = 64 << 20


@dataclass
class ResidentField:
    """A small field read once and kept whole: gathered by global sample index."""

    meta: FieldMeta
    array: Any  # (num_chunks * rows per chunk, *sample_shape): row i is sample i


class Assembler:
    """Gathers the batches of a pass with ``ops`` (host or device), fixed and variable-length fields alike."""

    def __init__(self, ops: Ops, window_map: WindowMap, ragged_offsets: dict[str, np.ndarray],
                 output_fields: Sequence[str], resident: dict[str, ResidentField],
                 pad: dict[str, tuple[int | None, Any]], group_bytes: int | None = None, step: BatchStep | None = None):
        """``ragged_offsets``: each variable-length field's offsets array; ``pad``: variable-length field ->
        (width, or None for the batch's longest; pad value); ``group_bytes``: batches smaller than this are
        gathered several at a time, up to this many bytes (1: one at a time; None: :data:`GROUP_BYTES`);
        ``step``: run on each batch last, inside its scope (image fields decoded: gdsload.codecs.images)."""
        self.ops, self.wl, self.step = ops, window_map, step
        self.ragged_offsets = ragged_offsets
        self.resident = resident
        self.pad = pad
        self.ragged = [n for n in output_fields if n in window_map.ragged]
        self.windowed = [n for n in output_fields if n not in resident and n not in window_map.ragged]
        #: Fields gathered by the plan's positions (one copy per run of consecutive ones); the others by rows
        #: of their own, always a gather by index.
        self.direct = [n for n in self.windowed if window_map.direct(n)]
        self.mapped = [n for n in self.windowed if n not in self.direct]
        self.shapes = {n: (resident[n].meta if n in resident else window_map.fields[n]) for n in output_fields
                       if n not in window_map.ragged}
        self.group_bytes = GROUP_BYTES if group_bytes is None else group_bytes

    def index(self, plan: EpochPlan, pace: Callable[[], None] | None = None) -> EpochIndex:
        """``plan``'s index arrays, uploaded now (``ops.upload``: on a stream of their own, with an event);
        ``pace`` (a :class:`gdsload.pipeline.pacing.Pacer`) is called between the steps.

        The pipeline asks for them when it makes a pass, before that pass's first read is submitted: an
        upload queued behind a window's host-to-device copies would wait for them (the copy engine serves
        them in order), and the pass's first batch with it."""
        pace = pace or _no_pace
        table = plan.segment_table()
        pace()
        value_index = {n: epoch_value_index(plan, self.ragged_offsets[n]) for n in self.ragged}  # host: sizes
        host: dict[Any, np.ndarray] = {}
        ids = plan.sample_ids() if self.resident else None
        if ids is not None:
            host["ids"] = _compact(ids)
        if self.direct:
            host["positions"] = _compact(plan.positions)
        for name in self.mapped:
            host["rows", name] = _compact(self.wl.stream_rows(plan, name))
        for name in self.ragged:
            host["starts", name], host["lengths", name] = value_index[name]
        last_batch = plan.last_batch_of_window()
        pace()
        dev, ready = self.ops.upload(host)
        return EpochIndex(plan, table, last_batch, value_index, dev, ready, ids)

    def batches(self, index: EpochIndex, start_batch: int, window: Callable[[int], dict[str, Any] | None],
                release: Callable[[int], None], stopped: Callable[[], bool]
                ) -> Iterator[tuple[int, dict[str, Any], int]]:
        """Yield ``(batch index, arrays, samples)`` of ``index.plan`` from ``start_batch`` on. ``window(w)``
        gives window ``w``'s field views once its data may be read on the assembler's stream (None: stop);
        ``release(w)`` is called, inside the batch's scope, after the last gather from window ``w``.

        Small batches are gathered in groups (:func:`batch_groups`): one allocation and one gather per
        field and window for the whole group, each batch a view of its rows. What a batch costs in Python
        (allocations, launches, events) is then paid once per group, not per batch."""
        ops, plan = self.ops, index.plan
        table, last_batch = index.table, index.last_batch
        waited = False
        per_group = 1 if self.ragged else max(1, self.group_bytes // max(1, self._batch_bytes(plan)))
        try:
            for first, stop in batch_groups(table, last_batch, start_batch, plan.num_batches, per_group):
                if stopped():
                    return
                rows = merge_segments([seg for i in range(first, stop) for seg in table[i]])
                views = {}
                for w, _, _, _ in rows:
                    got = window(w)
                    if got is None:
                        return
                    views[w] = got
                lo, hi = rows[0][1], rows[-1][2]
                with ops.scope():
                    if not waited:
                        ops.wait(index.ready)
                        waited = True
                    out = {n: ops.empty((hi - lo, *f.sample_shape), f.dtype) for n, f in self.shapes.items()}
                    for name in self.ragged:
                        out.update(self.ragged_outputs(name, index.value_index[name][1][lo:hi]))
                    ops.fence()
                    self._gather(rows, views, lo, out, index.dev)
                    for name in self.ragged:
                        self._gather_ragged(name, rows, views, index.value_index[name][1],
                                            (index.dev["starts", name], index.dev["lengths", name]), out)
                    for w, _, _, _ in rows:
                        if first <= last_batch[w] < stop:
                            release(w)
                    if self.step is not None:  # variable-length fields: one batch per group
                        ids = index.ids if index.ids is not None else plan.sample_ids()
                        index.ids = ids
                        out = self.step(ops, plan.epoch, ids[lo:hi], out)
                if stop - first == 1:
                    yield first, out, hi - lo
                    continue
                for i in range(first, stop):
                    b_lo, b_hi = plan.batch_bounds(i)
                    yield i, {n: a[b_lo - lo:b_hi - lo] for n, a in out.items()}, b_hi - b_lo
        finally:
            ops.retire(index.dev)

    def _batch_bytes(self, plan: EpochPlan) -> int:
        """Output bytes of one full batch of the fixed-size fields."""
        return plan.config.batch_size * sum(f.sample_bytes for f in self.shapes.values())

    def _gather(self, rows: list[tuple[int, int, int, int]], views: dict[int, dict[str, Any]], lo: int,
                out: dict[str, Any], dev: dict[Any, Any]) -> None:
        """Queue the gathers of the fixed-size fields of stream rows ``rows[0].start .. rows[-1].stop``."""
        ops = self.ops
        hi = rows[-1][2]
        for name, r in self.resident.items():
            if name in out:
                ops.take(r.array, dev["ids"][lo:hi], out[name])
        for w, start, stop, first in rows:
            part = slice(start - lo, stop - lo)
            if first >= 0:
                for name in self.direct:
                    ops.copy_rows(views[w][name], first, out[name][part])
            else:
                for name in self.direct:
                    ops.take(views[w][name], dev["positions"][start:stop], out[name][part])
            for name in self.mapped:
                ops.take(views[w][name], dev["rows", name][start:stop], out[name][part])

    def gather_part(self, index: EpochIndex, rows: list[tuple[int, int, int, int]], views: dict[Any, dict[str, Any]],
                    out: dict[str, Any], at: int, value_at: dict[str, int]) -> None:
        """Queue the gathers of stream rows ``rows[0].start .. rows[-1].stop`` of ``index``'s pass (segments as
        :meth:`EpochPlan.segment_table`'s, keyed in ``views`` by their window) into rows ``at ..`` of ``out``
        (keyed by this assembler's field names, as :meth:`ragged_outputs` and ``ops.empty`` made them, for a batch
        that other parts fill too): a variable-length field's values go from ``value_at[name]`` on, its offsets
        (``out[name + "/offsets"][0]`` being the caller's) counting on from there, or padded rows and lengths."""
        xp, lo, hi = self.ops.xp, rows[0][1], rows[-1][2]
        fixed = {n: a[at:at + hi - lo] for n, a in out.items() if n in self.shapes}
        self._gather(rows, views, lo, fixed, index.dev)
        for name in self.ragged:
            f = self.wl.ragged[name].values
            starts, lengths = index.dev["starts", name], index.dev["lengths", name]
            lengths_host = index.value_index[name][1]
            total = int(lengths_host[lo:hi].sum())
            padded = name in self.pad
            flat = xp.empty((total, *f.sample_shape), f.dtype) if padded else \
                out[name][value_at[name]:value_at[name] + total]
            pos = 0
            for w, start, stop, _ in rows:
                n = int(lengths_host[start:stop].sum())
                gather(xp, self.ops.take, views[w][name], starts[start:stop], lengths[start:stop], flat[pos:pos + n])
                pos += n
            if padded:
                rows_out = out[name][at:at + hi - lo]
                pad_values(xp, flat, lengths[lo:hi], self.pad[name][1], rows_out)
                xp.minimum(lengths[lo:hi], rows_out.shape[1], out=out[f"{name}/lengths"][at:at + hi - lo])
            else:
                offsets = out[f"{name}/offsets"][at + 1:at + 1 + hi - lo]
                xp.cumsum(lengths[lo:hi], out=offsets)
                offsets += value_at[name]

    def ragged_outputs(self, name: str, lengths: np.ndarray) -> dict[str, Any]:
        """A variable-length field's outputs for a batch whose samples have value ``lengths`` (host, in batch
        order): values back to back plus (B + 1) offsets, or (B, width, ...) padded values plus (B,) lengths."""
        ops, f = self.ops, self.wl.ragged[name].values
        if name in self.pad:
            width, _ = self.pad[name]
            width = int(lengths.max(initial=0)) if width is None else width
            return {name: ops.empty((len(lengths), width, *f.sample_shape), f.dtype),
                    f"{name}/lengths": ops.empty((len(lengths),), np.dtype(np.int64))}
        return {name: ops.empty((int(lengths.sum()), *f.sample_shape), f.dtype),
                f"{name}/offsets": ops.empty((len(lengths) + 1,), np.dtype(np.int64))}

    def _gather_ragged(self, name: str, rows: list[tuple[int, int, int, int]], views: dict[int, dict[str, Any]],
                       lengths_host: np.ndarray, index_dev: tuple[Any, Any], out: dict[str, Any]) -> None:
        """Fill a variable-length field's outputs (see ragged_outputs). Runs inside the batch's scope; the
        concatenated values of a padded field are scratch of the assembler's own."""
        ops, xp = self.ops, self.ops.xp
        f = self.wl.ragged[name].values
        starts, lengths = index_dev
        lo, hi = rows[0][1], rows[-1][2]
        padded = name in self.pad
        total = int(lengths_host[lo:hi].sum())
        flat = xp.empty((total, *f.sample_shape), f.dtype) if padded else out[name]
        pos = 0
        for w, start, stop, _ in rows:
            n = int(lengths_host[start:stop].sum())
            gather(xp, ops.take, views[w][name], starts[start:stop], lengths[start:stop], flat[pos:pos + n])
            pos += n
        batch_lengths = lengths[lo:hi]
        if padded:
            pad_values(xp, flat, batch_lengths, self.pad[name][1], out[name])
            # The lengths of the rows returned: a sample longer than the width was cut to it.
            xp.minimum(batch_lengths, out[name].shape[1], out=out[f"{name}/lengths"])
        else:
            offsets = out[f"{name}/offsets"]
            offsets[:1] = 0
            xp.cumsum(batch_lengths, out=offsets[1:])


@dataclass
class EpochIndex:
    """What gathering one epoch's batches needs, made once per pass (:meth:`Assembler.index`): the plan's
    segments and each window's last batch (host), each variable-length field's value index (host, for
    sizes), and the index arrays in the ops' memory (``dev``), usable on the assembler's stream after the
    ``ready`` event: sample positions in the windows, rows of fields gathered by rows of their own, global
    sample ids (resident fields), value starts and lengths (variable-length fields)."""

    plan: EpochPlan
    table: list[list[tuple[int, int, int, int]]]
    last_batch: np.ndarray
    value_index: dict[str, tuple[np.ndarray, np.ndarray]]
    dev: dict[Any, Any]
    ready: Any
    ids: np.ndarray | None = None  # global sample ids of the stream (host): made here with resident fields, else
    # at the first batch step that asks


def batch_groups(table: Sequence[Sequence[tuple[int, int, int, int]]], last_batch: np.ndarray, start: int,
                 stop: int, per_group: int) -> Iterator[tuple[int, int]]:
    """Batches ``start .. stop - 1`` as groups ``(first, stop)`` of at most ``per_group`` batches. A group
    ends with the last batch of a window, so it never waits for a window its first batches do not need,
    and every window is released as early as it was batch by batch."""
    first = start
    while first < stop:
        end = first
        while True:
            end += 1
            if end - first >= per_group or end >= stop or any(last_batch[w] == end - 1 for w, *_ in table[end - 1]):
                break
        yield first, end
        first = end


def merge_segments(rows: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Consecutive segments ``(window, start, stop, first_position)`` of the stream merged per window: one
    gather for the lot. The merged segment stays a copy (``first_position`` >= 0) only when its positions
    run on without a break."""
    out: list[tuple[int, int, int, int]] = []
    for w, start, stop, first in rows:
        if out and out[-1][0] == w and out[-1][2] == start:
            pw, pstart, _, pfirst = out[-1]
            run_on = pfirst >= 0 and first == pfirst + (start - pstart)
            out[-1] = (w, pstart, stop, pfirst if run_on else -1)
        else:
            out.append((w, start, stop, first))
    return out


def _no_pace() -> None:
    pass


def _compact(a: np.ndarray) -> np.ndarray:
    """int32 when it fits: half the bytes to upload and to read in each gather."""
    return a.astype(np.int32) if a.max(initial=0) < 2**31 else a
