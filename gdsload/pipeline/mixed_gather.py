"""Gathering a group of a mixture's steps from its sources' windows (gdsload/pipeline/mixed.py's assembler):
each step's batch is laid out source after source, each part gathered straight from its windows by that source's
:class:`Assembler`, with each sample's source index beside it. No threads here: it runs on the assembler thread,
inside the ops' scope."""

from __future__ import annotations

from typing import Any

import numpy as np

from .assembler import Assembler
from .feeds import Feed, Part
from .steps import Step
from .window import WindowBuffer

SOURCE_KEY = "source"  # batch[SOURCE_KEY]: each sample's source, an index into the mixture's sources
IDS_KEPT = 64  # distinct runs of counts whose source indices are kept made
Key = tuple[int, int, int]  # (feed, pass, window)


class GroupGather:
    """The group gathers of ``feeds``, each with its assembler (``asm``), on ``ops``."""

    def __init__(self, ops: Any, feeds: list[Feed], asm: list[Assembler]):
        self.ops, self.feeds, self.asm = ops, feeds, asm
        self._ids: dict[tuple[tuple[int, ...], ...], Any] = {}  # source_ids
        # Per source: (its keys, with their names in the output) and the bytes of a sample of its fixed fields.
        self._names = [([(n, f.out_name(n)) for n in (*a.shapes, *(f"{r}{x}" for r in a.ragged
                                                                  for x in ("", "/offsets", "/lengths")))],
                        sum(m.sample_bytes for m in a.shapes.values())) for f, a in zip(feeds, asm)]

    def gather(self, batches: list[tuple[int, Step, list[list[Part]]]], held: dict[Key, WindowBuffer],
                waited: set[tuple[int, int]]) -> list[tuple[int, Step, dict[str, Any], tuple[int, ...]]]:
        """Queue the gathers of a group of steps into fresh arrays (inside the ops' scope); each step's arrays
        (views of the group's) with its bytes per source."""
        ops = self.ops
        sizes = [sum(st.counts) for _, st, _ in batches]
        present = [i for _, _, parts in batches for i, ps in enumerate(parts) if ps]
        lead = self.asm[present[0] if present else 0]
        for _, _, parts in batches:
            for i, ps in enumerate(parts):
                for part in ps:
                    if (i, part.p.k) not in waited:  # the pass's index arrays are uploaded
                        ops.wait(part.p.index.ready)
                        waited.add((i, part.p.k))
        rows = sum(sizes)
        f0 = self.feeds[present[0] if present else 0]
        out = {f0.out_name(n): ops.empty((rows, *m.sample_shape), m.dtype) for n, m in lead.shapes.items()}
        ragged = {f0.out_name(n): n for n in lead.ragged}
        for name, src in ragged.items():
            lengths = [_lengths(src, part) for _, _, parts in batches
                       for i, ps in enumerate(parts) for part in ps]
            made = lead.ragged_outputs(src, np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
            out.update({f0.out_name(k): a for k, a in made.items()})
        out[SOURCE_KEY] = ops.empty((rows,), np.dtype(np.int64))
        ops.fence()
        self.source_ids(batches, out[SOURCE_KEY])
        for name in ragged:
            if f"{name}/offsets" in out:
                out[f"{name}/offsets"][:1] = 0
        made, at = [], 0
        for (s, st, parts), size in zip(batches, sizes):
            lo, nbytes = at, []
            value_at = dict.fromkeys(ragged, 0)
            for i, ps in enumerate(parts):
                got = 0
                for part in ps:
                    got += self.part(i, part, held, out, at, value_at)
                    at += part.b - part.a
                nbytes.append(got)
            arrays = out if len(batches) == 1 else {n: a[lo:lo + size] for n, a in out.items()}
            made.append((s, st, arrays, tuple(nbytes)))
        return made

    def source_ids(self, batches: list[tuple[int, Step, list[list[Part]]]], out: Any) -> None:
        """The group's source indices into ``out``: a copy of an array made once per distinct run of counts (a few
        per set of weights), so a batch costs one copy, not a fill per part. Inside the ops' scope, after the
        fence."""
        key = tuple(st.counts for _, st, _ in batches)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= IDS_KEPT:
                self._ids.clear()
            ids = self.ops.empty(out.shape, np.dtype(np.int64))
            self.ops.fence()  # the memory may be the consumer's, dropped while its queued work reads it
            at = 0
            for _, st, _ in batches:
                for i, c in enumerate(st.counts):
                    ids[at:at + c].fill(i)
                    at += c
            self._ids[key] = ids
        self.ops.copy_rows(ids, 0, out)

    def part(self, i: int, part: Part, held: dict[Key, WindowBuffer], out: dict[str, Any], at: int,
                     value_at: dict[str, int]) -> int:
        """Queue one part's gathers into rows ``at ..`` of ``out`` (and its source index); its bytes."""
        f, asm, (names, row_bytes) = self.feeds[i], self.asm[i], self._names[i]
        segments = part.p.segments(part.a, part.b)
        wl, k = f.reader.window_map, part.p.k
        views = {w: held[(i, k, w)].views(wl) for w, _, _, _ in segments}
        mine = {n: out[o] for n, o in names if o in out}
        asm.gather_part(part.p.index, segments, views, mine, at,
                        {n: value_at[f.out_name(n)] for n in asm.ragged} if asm.ragged else {})
        n = part.b - part.a
        got = n * row_bytes
        for name in asm.ragged:
            values = int(_lengths(name, part).sum())
            value_at[f.out_name(name)] += values
            got += values * asm.wl.ragged[name].values.sample_bytes
        return got


def _lengths(name: str, part: Part) -> np.ndarray:
    """The value lengths of a variable-length field's samples in ``part`` (host)."""
    return part.p.index.value_index[name][1][part.a:part.b]
