"""One source of a mixture, and how slices of sources' batches become one batch.

A :class:`SourceStream` reads its dataset pass after pass (set to the next epoch as each one ends), and hands
out its samples in order as slices of the batches the dataset gives (:class:`Piece`), keeping the source's
position (a :class:`Stretch`, the same on every rank). :func:`assemble` puts the pieces of one batch together:
per key one concatenation by the arrays' own library (numpy, CuPy, torch or JAX), none where a key has one
piece; a variable-length field's offsets are rebased on the host, which holds a copy of every batch's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..pipeline import resume
from ..errors import GDSLoadError
from .schedule import Stretch
from ..pipeline.resume import StateError

if TYPE_CHECKING:
    from ..dataset import GDSDataset

SOURCE_KEY = "source"  # batch[SOURCE_KEY]: each sample's source, an index into Mixture.sources


@dataclass
class SourceStats:
    """One source, over the mixture's passes: samples and bytes it gave, bytes its dataset read (passes
    ended so far), seconds the mixture waited for its batches, passes its dataset began."""

    samples: int = 0
    bytes: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0
    passes: int = 0


class Piece(NamedTuple):
    batch: dict[str, Any]  # a source's batch as its dataset gave it
    offsets: dict[str, np.ndarray]  # its variable-length fields' offsets, on the host
    lo: int
    hi: int
    length: int  # samples in the batch


class SourceStream:
    """One source: its dataset, the pass being read, the batch being cut, its position and its counters."""

    def __init__(self, name: str, ds: GDSDataset, rename: dict[str, str]):
        self.name, self.ds, self.rename = name, ds, rename
        self.passing: Iterator[dict[str, Any]] | None = None
        self.batch: dict[str, Any] = {}
        self.offsets: dict[str, np.ndarray] = {}
        self.used = self.length = self.skip = 0
        c = ds.config
        self.stretch = Stretch(0, (), c.world_size, c.window_blocks, 0)
        self.leg_samples = 0  # of a stretch with hops: samples each rank reads in it
        self.stats = SourceStats()

    def take(self, n: int) -> list[Piece]:
        """The next ``n`` samples, as slices of one batch or more (into the next epoch where one ends)."""
        pieces = []
        while n:
            if self.used == self.length:
                self._next_batch()
            k = min(n, self.length - self.used)
            pieces.append(Piece(self.batch, self.offsets, self.used, self.used + k, self.length))
            self.used, n = self.used + k, n - k
            self.stretch = self.stretch.taken(k)
            if self.stretch.hops and self.stretch.samples == self.leg_samples:
                self.stretch = self.stretch.next_epoch()  # every rank ends the dealt-out rest here
        return pieces

    def _next_batch(self) -> None:
        for _ in range(3):  # a resumed pass may be empty (saved at its end); the next one is not
            if self.passing is None:
                self.passing = iter(self.ds)
                self.stats.passes += 1
            started = time.perf_counter()
            try:
                batch = next(self.passing)
            except StopIteration:
                self.stats.bytes_read += self.ds.stats.bytes_read if self.ds.stats is not None else 0
                self.passing = None
                self.ds.set_epoch(self.ds.epoch + 1)
                continue
            finally:
                self.stats.wait_s += time.perf_counter() - started
            self.batch, self.length, self.offsets = batch, batch_len(batch), {}
            for key, a in batch.items():
                if key.endswith("/offsets") and key[:-8] in batch:
                    self.offsets[key[:-8]] = to_host(a)
            self.used, self.skip = min(self.skip, self.length), 0
            if self.used < self.length:
                return
        raise GDSLoadError(f"{self.ds.meta.path}: source {self.name!r} yielded no sample in three passes")

    def drop(self) -> None:
        """End the pass being read and forget the batch being cut (the position is set anew after this)."""
        if self.passing is not None:
            self.passing.close()
        self.passing, self.batch, self.offsets, self.used, self.length = None, {}, {}, 0, 0

    def park(self) -> None:
        """End the pass being read (its reader threads stop); the next pass starts where this one was."""
        if self.passing is not None:
            state, skip, _ = self.locate(self.stretch)
            self.drop()
            self.ds.load_state_dict(state)
            self.skip = skip

    def locate(self, stretch: Stretch) -> tuple[dict[str, Any], int, Stretch | None]:
        """Where this rank's dataset stands at ``stretch``: the GDSDataset state to load, the samples of its
        first batch already taken, and the stretch from there (None: under another world size or window, so
        the dataset deals out the rest of the epoch and the stretch is what it makes of that). StateError
        for a stretch the dataset cannot be at.

        Derived, never the dataset's own ``state_dict()``: that counts the batch being cut, and under exact
        shares a rank may hold one more batch than rank 0, by which a GDSDataset state is bounded."""
        c = self.ds.config
        if stretch.world_size > c.num_blocks:
            raise StateError(f"state key 'world_size': expected at most {c.num_blocks} (the dataset's blocks), found "
                             f"{stretch.world_size}")
        if stretch.hops:
            rest = leg_samples(self.ds, stretch)
            if stretch.samples > rest:
                raise StateError(f"state key 'samples': expected at most {rest}, the rest of epoch "
                                 f"{stretch.epoch} each rank reads, found {stretch.samples}")
            stretch = stretch.next_epoch() if stretch.samples == rest else stretch
        same = (stretch.world_size, stretch.window_blocks) == (c.world_size, c.window_blocks)
        if stretch.hops:
            epoch, taken = stretch.epoch, stretch.samples
        else:
            epoch, taken = (stretch.rank_position(c.rank, c.num_samples) if same
                            else stretch.common_position(c.num_samples))
        batch = c.batch_size if same else 1  # another leg: exact to the sample, as a hop of batches of 1
        state = {**self.ds.state_dict(), "epoch": epoch, "batches_yielded": taken // batch,
                 "hops": [dict(h) for h in stretch.hops], "batch_size": batch, "world_size": stretch.world_size,
                 "window_blocks": stretch.window_blocks, "rank": c.rank if same else 0}
        resume.parse_state(state, c.num_blocks)
        return state, taken % batch, stretch if same else None

    def out_key(self, key: str) -> str:
        for suffix in ("", "/offsets", "/lengths"):
            base = key[:len(key) - len(suffix)]
            if key.endswith(suffix) and base in self.rename:
                return self.rename[base] + suffix
        return key


def assemble(cuts: list[tuple[SourceStream, list[Piece]]]) -> dict[str, Any]:
    """The batch of ``cuts`` (every source's pieces, in source order), plus each sample's source index: each
    key's slices in order, one concatenation each. A variable-length field's offsets are rebased slices of
    each piece's, on the device, from the host copy's values. Nothing is copied between host and device
    (which on a GPU would wait for the work already queued). Counts each source's samples and bytes."""
    given = [(i, s, cut) for i, (s, cut) in enumerate(cuts) if cut]
    first = given[0][2][0]
    if len(given) == 1 and len(given[0][2]) == 1 and first.hi - first.lo == first.length:
        source = given[0][1]  # one whole batch of one source: as its dataset gave it
        out = {source.out_key(k): a for k, a in first.batch.items()}
        _count(source, sum(nbytes(a) for a in out.values()), first.length)
    else:
        parts: dict[str, list[Any]] = {}
        ends: dict[str, int] = {}  # where each offsets key's values end so far
        for _, source, cut in given:
            got = 0
            for p in cut:
                for key, a in p.batch.items():
                    name = source.out_key(key)
                    if key.endswith("/offsets") and key[:-8] in p.offsets:
                        off = p.offsets[key[:-8]]
                        a = a[p.lo:p.hi] + (ends.get(name, 0) - int(off[p.lo]))
                        ends[name] = ends.get(name, 0) + int(off[p.hi] - off[p.lo])
                    elif key in p.offsets:
                        a = a[int(p.offsets[key][p.lo]):int(p.offsets[key][p.hi])]
                    else:
                        a = a[p.lo:p.hi]
                    parts.setdefault(name, []).append(a)
                    got += nbytes(a)
            _count(source, got, sum(p.hi - p.lo for p in cut))
        for name, end in ends.items():
            parts[name].append(full(1, end, parts[name][0]))
        out = {key: a[0] if len(a) == 1 else concat(a) for key, a in parts.items()}
    like = next(iter(out.values()))
    ids = [full(sum(p.hi - p.lo for p in cut), i, like) for i, _, cut in given]
    out[SOURCE_KEY] = ids[0] if len(ids) == 1 else concat(ids)
    return out


def leg_samples(ds: GDSDataset, stretch: Stretch) -> int:
    """Samples each rank reads in a stretch's rest of an epoch (every rank as many: the rest is padded)."""
    cfg = dataclasses.replace(ds.config, world_size=stretch.world_size, window_blocks=stretch.window_blocks,
                              batch_size=1, rank=0)
    saved = resume.parse_state({**ds.state_dict(), "epoch": stretch.epoch, "hops": [dict(h) for h in stretch.hops],
                                "batches_yielded": 0, "batch_size": 1, "world_size": stretch.world_size,
                                "window_blocks": stretch.window_blocks, "rank": 0}, ds.config.num_blocks)
    return len(resume.leg_plans(cfg, stretch.epoch, saved.hops)[0].positions)


def _count(source: SourceStream, size: int, samples: int) -> None:
    source.stats.samples += samples
    source.stats.bytes += size


def batch_len(batch: dict[str, Any]) -> int:
    for key, a in batch.items():
        if key.endswith("/offsets"):
            return int(a.shape[0]) - 1
        if f"{key}/offsets" not in batch:
            return int(a.shape[0])
    return 0


def kind_of(a: Any) -> str:
    return type(a).__module__.partition(".")[0]


def concat(parts: list[Any]) -> Any:
    """One concatenation, by the arrays' own library (numpy, CuPy, torch or JAX)."""
    kind = kind_of(parts[0])
    if kind == "torch":
        import torch

        return torch.cat(parts)
    if kind == "cupy":
        import cupy

        return cupy.concatenate(parts)
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.concatenate(parts)
    return np.concatenate(parts)


def full(n: int, value: int, like: Any) -> Any:
    """An int64 array of ``n`` times ``value``, of ``like``'s kind and on its device, made there (JAX: its
    default integer type)."""
    kind = kind_of(like)
    if kind == "torch":
        import torch

        return torch.full((n,), value, dtype=torch.int64, device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.full(n, value, dtype=np.int64)
    if kind in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp

        return jax.device_put(jnp.full(n, value), next(iter(like.devices())))
    return np.full(n, value, dtype=np.int64)


def to_host(a: Any) -> np.ndarray:
    kind = kind_of(a)
    if kind == "torch":
        return a.cpu().numpy()
    if kind == "cupy":
        return a.get()
    return np.asarray(a)


def nbytes(a: Any) -> int:
    return int(a.element_size() * a.nelement()) if kind_of(a) == "torch" else int(a.nbytes)
