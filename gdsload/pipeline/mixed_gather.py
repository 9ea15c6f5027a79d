"""A group of a mixture's steps gathered from its sources' windows, each sample once, source after source.

Runs on the assembler thread of pipeline/mixed.py, inside the ops' scope; no threads here.
"""

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
        #: Every field of every source sits at its plan position or is resident (no variable-length or own-row
        #: field, no step after): a group is then one launch per output field (:meth:`gather_by_rows`).
        self.by_rows = all(not a.ragged and not a.mapped and a.step is None for a in asm)
        self._sources: Any = None  # by_rows: each source's index, a row each, where the source column is taken
        # Per source: (its keys, with their names in the output) and the bytes of a sample of its fixed fields.
        self._names = [([(n, f.out_name(n)) for n in (*a.shapes, *(f"{r}{x}" for r in a.ragged
                                                                  for x in ("", "/offsets", "/lengths")))],
                        sum(m.sample_bytes for m in a.shapes.values())) for f, a in zip(feeds, asm)]
        # by_rows, per source: its (field, output name) pairs gathered from windows, and those of resident fields.
        self._split = [([(n, o) for n, o in names if n not in a.resident],
                        [(n, o) for n, o in names if n in a.resident]) for (names, _), a in zip(self._names, asm)]

    def gather(self, batches: list[tuple[int, Step, list[list[Part]]]], held: dict[Key, WindowBuffer],
                waited: set[tuple[int, int]]) -> list[tuple[int, Step, dict[str, Any], tuple[int, ...]]]:
        """Queue the gathers of a group of steps into fresh arrays (inside the ops' scope); each step's arrays
        (views of the group's) with its bytes per source."""
        if self.by_rows:
            return self.gather_by_rows(batches, held)
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

    def gather_by_rows(self, batches: list[tuple[int, Step, list[list[Part]]]], held: dict[Key, WindowBuffer]
                       ) -> list[tuple[int, Step, dict[str, Any], tuple[int, ...]]]:
        """:meth:`gather` where every field sits at its plan position: each output field (the source index too)
        taken in one ``ops.take_rows`` for the whole group, its rows listed on the host from the plans."""
        ops = self.ops
        sizes = [sum(st.counts) for _, st, _ in batches]
        first = next((i for _, _, parts in batches for i, ps in enumerate(parts) if ps), 0)  # whole batches: its own
        rows = sum(sizes)
        out = {self.feeds[first].out_name(n): ops.empty((rows, *m.sample_shape), m.dtype)
               for n, m in self.asm[first].shapes.items()}
        out[SOURCE_KEY] = ops.empty((rows,), np.dtype(np.int64))
        if self._sources is None:
            ids = ops.xp.asarray(np.arange(len(self.feeds), dtype=np.int64))
            self._sources = [ids[i:i + 1] for i in range(len(self.feeds))]
        ops.fence()
        taken: dict[str, list[tuple[Any, np.ndarray]]] = {o: [] for o in out}
        made, at = [], 0
        for (s, st, parts), size in zip(batches, sizes):
            lo, nbytes = at, []
            for i, ps in enumerate(parts):
                row_bytes, resident = self._names[i][1], self.asm[i].resident
                windowed, kept = self._split[i]
                n_source = 0
                for part in ps:
                    k, starts, positions = part.p.k, part.p.starts, part.p.plan.positions
                    for w in part.windows():
                        a, b = max(part.a, int(starts[w])), min(part.b, int(starts[w + 1]))
                        views = held[(i, k, w)].views(self.feeds[i].reader.window_map)
                        for n, o in windowed:
                            if o in taken:
                                taken[o].append((views[n], positions[a:b]))
                    for n, o in kept:  # resident fields: rows by global sample id (made with the pass's index)
                        if o in taken:
                            taken[o].append((resident[n].array, part.p.index.ids[part.a:part.b]))
                    n_source += part.b - part.a
                if n_source:
                    taken[SOURCE_KEY].append((self._sources[i], np.zeros(n_source, np.int64)))
                at += n_source
                nbytes.append(n_source * row_bytes)
            arrays = out if len(batches) == 1 else {n: a[lo:lo + size] for n, a in out.items()}
            made.append((s, st, arrays, tuple(nbytes)))
        for o, parts_of in taken.items():
            ops.take_rows(parts_of, out[o])
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
