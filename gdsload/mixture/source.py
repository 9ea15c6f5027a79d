"""One source of a mixture: its dataset, its position (a :class:`Stretch`, the same on every rank) and its
counters; :meth:`SourceStream.locate` turns a position into where this rank's dataset stands. The pipeline that
reads every source is gdsload/pipeline/mixed.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..pipeline import resume
from .schedule import Stretch
from ..pipeline.plan import MAX_INT
from ..pipeline.resume import EXACT_HOP_KEYS, StateError

if TYPE_CHECKING:
    from ..dataset import GDSDataset

#: What identifies a source's dataset and its order, of its GDSDataset state: a mixture state's ``datasets``.
FINGERPRINT_KEYS = ("num_samples", "samples_per_block", "shuffle", "seed", "fields", "index_sha256", "content_sha256")


@dataclass
class SourceStats:
    """One source, over the mixture's passes: samples and bytes it gave (in batches yielded), bytes read from
    it (windows read so far, ahead of the batches), passes of its dataset begun (the mixture waits for batches,
    not for a source: ``stall_s`` stays 0, the mixture's own counts it)."""

    samples: int = 0
    bytes: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0
    passes: int = 0


class Placement(NamedTuple):
    """Where one rank's dataset stands, as :meth:`GDSDataset.place` takes it: ``samples`` of its share of the leg
    of ``epoch`` after ``legs`` (hop dicts)."""

    epoch: int
    legs: tuple[dict[str, int], ...]
    samples: int


class SourceStream:
    """One source: its dataset, its position and its counters."""

    def __init__(self, name: str, ds: GDSDataset, rename: dict[str, str]):
        self.name, self.ds, self.rename = name, ds, rename
        self.fingerprint = record_digest(dataset_record(ds))  # whose positions this stream's are, with its name
        c = ds.config
        self.stretch = Stretch(0, (), c.world_size, c.window_blocks, 0, name, self.fingerprint)
        self.stats = SourceStats()

    def locate(self, stretch: Stretch, check: bool = True) -> tuple[Placement, Stretch]:
        """Where this rank's dataset stands at ``stretch`` (what :meth:`GDSDataset.place` takes), and the stretch
        from there. Under the stretch's world size and window that is this rank's own position in it
        (:meth:`Stretch.rank_position`); under others, the leg the old ranks read is closed exactly where each
        of them stood (:meth:`Stretch.end_hop`), the rest of that epoch is dealt out to the new ranks, and a new
        stretch begins there. StateError for a stretch the dataset cannot be at (its hops checked unless
        ``check`` is False: a stretch this stream made itself).

        Derived from the stretch, never from the dataset's own ``state_dict()``: that counts whole batches and
        differs from rank to rank under exact shares, where a stretch is exact to the sample and the same on
        every rank."""
        c = self.ds.config
        stretch = dataclasses.replace(stretch, source=self.name, fingerprint=self.fingerprint)  # this stream's now
        if stretch.world_size > c.num_blocks:
            raise StateError(f"state key 'world_size': expected at most {c.num_blocks} (the dataset's blocks), found "
                             f"{stretch.world_size}")
        if check:
            self._check_hops(stretch)
        if (stretch.world_size, stretch.window_blocks) == (c.world_size, c.window_blocks):
            epoch, taken = stretch.rank_position(c.rank, c.num_samples)
            _check_epoch(epoch, stretch)
            hops = stretch.hops if epoch == stretch.epoch else ()
            return Placement(epoch, hops, taken), stretch
        epoch, hops = stretch.end_hop(c.num_samples)
        _check_epoch(epoch, stretch)
        if len(hops) > resume.MAX_HOPS:
            raise StateError(f"state key 'hops': epoch {epoch} was already read in {resume.MAX_HOPS + 1} legs, the "
                             "most a state records; finish it under the world size and window it was saved with")
        return Placement(epoch, hops, 0), Stretch(epoch, hops, c.world_size, c.window_blocks, 0, self.name,
                                                  self.fingerprint)

    def _check_hops(self, stretch: Stretch) -> None:
        """StateError naming the key for hops the dataset cannot have read (checked before anything changes)."""
        if not stretch.hops:
            return
        c = self.ds.config
        cfg = dataclasses.replace(c, world_size=stretch.world_size, window_blocks=stretch.window_blocks,
                                  batch_size=1, rank=0)
        resume.leg_plans(cfg, stretch.epoch, resume.parse_hops(stretch.hops, EXACT_HOP_KEYS, c.num_blocks))


def _check_epoch(epoch: int, stretch: Stretch) -> None:
    """StateError where a stretch puts a rank in an epoch beyond :data:`MAX_INT` (what GDSDataset takes)."""
    if epoch > MAX_INT:
        raise StateError(f"state key 'samples': {stretch.samples} samples from epoch {stretch.epoch} reach epoch "
                         f"{epoch}, beyond {MAX_INT} (expected a position from Mixture.state_dict())")


def dataset_record(ds: GDSDataset) -> dict[str, Any]:
    """What identifies a source's dataset and its order: :data:`FINGERPRINT_KEYS` of its GDSDataset state."""
    state = ds.state_dict()
    return {k: state[k] for k in FINGERPRINT_KEYS}


def record_digest(record: Any) -> str:
    """The sha256 hex digest of a dataset record as sorted JSON (the same after a JSON round trip)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()
