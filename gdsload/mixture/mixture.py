"""Mixture: several datasets in one stream of batches, at exact proportions that may change at any step.

Each source is a :class:`GDSDataset` of its own (its own backend and options, this process's rank and world
size), read in exact shares (``PlanConfig.exact_shares``): across ranks, every sample of a source once per epoch
of that source, and a source that runs out begins its next epoch while the others go on. The schedule
(gdsload/mixture_plan.py) says how many samples each source gives to each batch; they are cut, in order, from
that source's batches as slices (no copy per sample), and each field is put together with one concatenation
per batch (none where a batch is one slice). Where every source gives host arrays, or every one CuPy arrays or
torch tensors on one device, the batches are made ``read_ahead`` ahead on a thread of the mixture's own
(gdsload/mixture/ahead.py), so the consumer's loop takes a finished one between its steps; sources of mixed
kinds are joined in the consumer's thread. Every thread (the sources' readers, the mixture's maker) stops on
``close()``, on leaving a pass early and on an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .._tasks import Closing
from ..backends import info
from ..dataset import GDSDataset
from ..errors import GDSLoadError
from ..integrations import LoaderProtocols, refuse_collation, refuse_worker
from .ahead import Ahead, Made
from .assemble import assemble
from .joiners import DeviceJoiner, Joiners
from .source import SourceStats, SourceStream
from .specs import check_fields, named, source_batches, source_specs
from .schedule import Schedule, exact_weights, next_counts, schedule_state
from .state import MIXTURE_FORMAT, check_state, dataset_record, merge_states  # noqa: F401 - merge_states: here too
from ..options import check_int, rank_and_world

READ_AHEAD = 2  # batches made ahead by default, where the sources' arrays can be joined on the maker's thread


@dataclass
class MixtureStats:
    """The mixture's passes: batches, samples and bytes yielded, wall time, the seconds the consumer waited
    for batches made ahead, and per source its share; ``gb_per_s`` is bytes yielded per second of wall time,
    overall or per source."""

    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    sources: dict[str, SourceStats] = field(default_factory=dict)

    def gb_per_s(self, source: str | None = None) -> float:
        got = self.bytes if source is None else self.sources[source].bytes
        return got / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "samples": self.samples, "bytes": self.bytes, "wall_s": self.wall_s,
                "wait_s": self.wait_s, "gb_per_s": self.gb_per_s(),
                "sources": {n: {**dataclasses.asdict(s), "gb_per_s": self.gb_per_s(n)}
                            for n, s in self.sources.items()}}


class Mixture(LoaderProtocols, Closing):
    """Batches drawn from several datasets at exact, changeable proportions, resumable at any step.

    Parameters
    ----------
    sources : dict of name -> path, or name -> dict of options with ``"path"`` (and any GDSDataset option:
        ``backend``, ``window_blocks``, ``pad_to``, ...; ``batch_size``: samples its dataset gathers at once,
        default :func:`~gdsload.mixture.specs.source_batches` times the mixture's (16 on ``kvikio``, else 4), the
        mixture's with ``whole_batches``). ``"fields"``: names to read, or a dict {field: name in the mixture}
        to rename.
        The order sets each source's index in ``batch["source"]``.
    weights : dict of name -> number >= 0 (any scale; a float counts as the decimal it prints as), or a
        function of the step returning one (checked every batch; a change starts a new segment). Default: in
        proportion to the sources' sizes.
    batch_size : samples per batch.
    seed : breaks ties in the schedule, and is each source's ``seed`` unless its options give one.
    num_batches : batches per pass (then ``len(mix)``); default: endless. Passes cover steps
        ``[k * num_batches, (k + 1) * num_batches)``; one begun mid-way (after a break or a resume) yields the
        rest of it.
    whole_batches : each batch is one whole batch of one source (sources may then have different fields),
        and the schedule counts batches instead of samples.
    rank, world_size : this process's share (default: torch.distributed, else RANK / WORLD_SIZE).
    read_ahead : batches made ahead on a thread of the mixture's own (default 2 where every source gives host
        arrays, or every one CuPy arrays or torch tensors on one device; else 0, joined in your thread, the
        only value taken there). A weight change drops what was made ahead.
    **options : GDSDataset options for every source (a source's own options win).

    Each batch is ``{field: array}`` as the sources' datasets give it (same backend kind, device and output
    for all sources unless ``whole_batches``), samples grouped by source in source order, plus
    ``batch["source"]`` (int64, one per sample, same kind and device). Sources mixed by sample must read
    the same fields (names, dtypes, sample shapes; variable-length fields with the same padding, not
    ``"max"``), else a ValueError names the source and the field.

    Notes
    -----
    Guarantees (docs/mixtures.md): since the start or the last weight change, each source's count stays within
    one of ``weight * samples`` after every batch (within two over any run of batches); every sample of a
    source once per epoch of that source across ranks; a weight change skips and repeats nothing; a state
    resumes batch for batch, on another number of ranks as a GDSDataset does, per source. A batch costs one
    concatenation per field (a variable-length field's offsets and ``source`` are put together on the host
    and copied over once each).
    """

    def __init__(self, sources: Mapping[str, Any], weights: Any = None, *, batch_size: int, seed: int = 0,
                 num_batches: int | None = None, whole_batches: bool = False, rank: int | None = None,
                 world_size: int | None = None, read_ahead: int | None = None, **options: Any):
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.num_batches = check_int("num_batches", num_batches, 1, none_ok=True)
        if not isinstance(whole_batches, bool):
            raise TypeError(f"whole_batches must be True or False (found {whole_batches!r})")
        self.whole_batches = bool(whole_batches)
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self._closed = False
        self._join = Joiners()
        specs = source_specs(sources, options)
        self.sources = tuple(specs)
        self._sources: list[SourceStream] = []
        self._weights_fn: Callable[[int], Any] | None = None
        try:
            for name, (path, fields, rename, kwargs) in specs.items():
                # mixing by sample, the mixture cuts its batches from the sources' whatever their size
                own = self.batch_size * (1 if self.whole_batches else source_batches(kwargs))
                kwargs = {"batch_size": own, "seed": self.seed, **kwargs}
                try:
                    ds = GDSDataset(path, fields=fields, rank=self.rank, world_size=self.world_size,
                                    exact_shares=True, **kwargs)
                except (TypeError, ValueError, GDSLoadError) as e:
                    raise named(e, f"source {name!r}: {e}") from e
                self._sources.append(SourceStream(name, ds, rename))
            check_fields(self._sources, specs, self.whole_batches)
            self.read_ahead = self._read_ahead(read_ahead)
            self._weights_fn, exact = self._weights_at(weights, 0)
            self._schedule = Schedule.begin(0, exact)
        except BaseException:
            self.close()
            raise
        self.datasets = {s.name: s.ds for s in self._sources}
        self._step = 0
        self._at = tuple(s.stretch for s in self._sources)  # every source's position after the batches yielded
        self._made_to = (self._step, self._schedule)  # where the next batch made begins
        self._ahead: Ahead | None = None
        self._device: DeviceJoiner | None = None  # device arrays made ahead: the joiner on the maker's thread
        self._stats = MixtureStats(sources={s.name: s.stats for s in self._sources})

    def _read_ahead(self, read_ahead: int | None) -> int:
        on_device = [s.name for s in self._sources if info(s.ds.backend_name).on_device]
        kinds = {(s.ds.output, s.ds.device, info(s.ds.backend_name).on_device) for s in self._sources}
        joinable = not on_device or (len(kinds) == 1 and next(iter(kinds))[0] in ("cupy", "torch"))
        if read_ahead is None:
            return READ_AHEAD if joinable else 0
        read_ahead = check_int("read_ahead", read_ahead, 0)
        if read_ahead and not joinable:
            raise ValueError(f"read_ahead={read_ahead}: batches of device arrays are made ahead where every source "
                             f"gives CuPy arrays or torch tensors on one device (found (output, device, on the "
                             f"device) {sorted(kinds, key=str)}); pass read_ahead=0")
        return read_ahead

    # -- weights ---------------------------------------------------------------------------------------
    def _weights_at(self, weights: Any, step: int) -> tuple[Callable[[int], Any] | None, tuple[Fraction, ...]]:
        """(the schedule function or None, the exact weights for ``step``) from weights as the user gives them."""
        fn = weights if callable(weights) and not isinstance(weights, Mapping) else None
        if fn is not None:
            weights = fn(step)
        elif weights is None:
            weights = {s.name: s.ds.num_samples for s in self._sources}
        return fn, exact_weights(weights, self.sources)

    def set_weights(self, weights: Any) -> None:
        """New weights from the next batch on: a dict as in the constructor (a new segment starts unless the
        proportions are the same), or a function of the step (replacing any function set before)."""
        self._rewind()  # batches made ahead under the old weights are dropped (the maker stopped first)
        self._weights_fn, exact = self._weights_at(weights, self._step)
        self._schedule = self._schedule.reweighted(exact, self._step)
        self._made_to = (self._step, self._schedule)

    @property
    def weights(self) -> dict[str, float]:
        """The current weights, normalised to sum 1."""
        return {n: float(w) for n, w in zip(self.sources, self._schedule.normalised())}

    @property
    def step(self) -> int:
        """Batches yielded since the start (the index of the next batch)."""
        return self._step

    # -- iteration -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("this Mixture is endless (pass num_batches=... for passes of a fixed length)")
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """What Lightning calls each epoch (``loader.sampler.set_epoch``): epoch e is the pass over steps
        ``[e * num_batches, (e + 1) * num_batches)``. A mixture reads on from where it stands, so the epoch it
        is in (or about to begin) is accepted and any other is a ValueError saying where it stands
        (``load_state_dict`` moves it); an endless mixture has no epochs (TypeError)."""
        epoch = check_int("epoch", epoch, 0)
        if self.num_batches is None:
            raise TypeError("this Mixture is endless: it has no epochs (pass num_batches=... for passes of a fixed "
                            "length)")
        here = self._step // self.num_batches
        if epoch != here:
            raise ValueError(f"set_epoch({epoch}): this Mixture stands at step {self._step}, in epoch {here} "
                             f"(passes of {self.num_batches} batches); it reads on from there: load_state_dict() "
                             f"moves it")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        refuse_worker(self)
        refuse_collation(self)
        if self._closed:
            raise GDSLoadError(f"mixture of {list(self.sources)}: it was closed (open a new Mixture)")
        return self._pass()

    def _pass(self) -> Iterator[dict[str, Any]]:
        n = self.num_batches
        stop = None if n is None else (self._step // n + 1) * n
        last = time.perf_counter()
        try:
            while stop is None or self._step < stop:
                batch = self._take(self._next_made())
                now = time.perf_counter()
                self._stats.wall_s, last = self._stats.wall_s + now - last, now
                yield batch
        except BaseException:  # left early, or failed: every source's readers stop
            if not self._closed:
                self.stop()
            raise
        finally:
            self._stats.wall_s += time.perf_counter() - last

    def _next_made(self) -> Made:
        if not self.read_ahead:
            return self._make()
        if self._ahead is None:
            first = self._sources[0].ds
            if info(first.backend_name).on_device:  # the joiner joins on the maker's thread from now on
                self._device = self._join.device(str(first.output), first.device)
                self._device.make_ahead()
            self._ahead = Ahead(self._make, self.read_ahead, "gdsload-reader-mixture",
                                f"mixture of {list(self.sources)}")
        started = time.perf_counter()
        try:
            return self._ahead.next()
        except Exception as e:
            if self._closed:  # close() from another thread: whatever the maker met, that is the reason
                raise GDSLoadError(f"mixture of {list(self.sources)}: it was closed while a pass was read") from e
            raise
        finally:
            self._stats.wait_s += time.perf_counter() - started

    def _make(self) -> Made:
        """The batch after the last one made (on the maker's thread when reading ahead)."""
        step, schedule = self._made_to
        if self._weights_fn is not None:
            schedule = schedule.reweighted(self._weights_at(self._weights_fn, step)[1], step)
        unit = 1 if self.whole_batches else self.batch_size
        counts, after = next_counts(schedule, unit, self.seed)
        if self.whole_batches:
            counts = tuple(c * s.ds.config.batch_size for c, s in zip(counts, self._sources))
        # each source's share of this batch, added to its counters when the batch is yielded, not when made
        tallies, device = [SourceStats() for _ in self._sources], self._device
        with device.taking() if device is not None else contextlib.nullcontext():  # sources hand over to it
            batch = assemble([(t, s.take(c)) for t, s, c in zip(tallies, self._sources, counts)], self._join,
                             as_is=device is None)  # made ahead, device arrays are copied even when whole
        self._made_to = (step + 1, after)
        return Made(batch, step, after, tuple(s.stretch for s in self._sources),
                    tuple(t.samples for t in tallies), tuple(t.bytes for t in tallies),
                    None if device is None else device.ready)

    def _take(self, made: Made) -> dict[str, Any]:
        """The consumer's side: the mixture now stands after ``made``."""
        assert made.step == self._step, f"batch {made.step} made for step {self._step}"
        if made.ready is not None:
            self._device.hand_over(made.ready)  # type: ignore[union-attr]
        self._step, self._schedule, self._at = made.step + 1, made.schedule, made.stretches
        for s, samples, size in zip(self._sources, made.samples, made.bytes):
            s.stats.samples += samples
            s.stats.bytes += size
        self._stats.bytes = sum(s.stats.bytes for s in self._sources)
        self._stats.batches += 1
        self._stats.samples += sum(made.samples)
        return made.batch

    def _rewind(self, every: bool = False) -> None:
        """Stop making batches ahead and move each source back to where the batches yielded leave it (all of
        them with ``every``, which also ends their passes: their reader threads stop)."""
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None
        self._made_to = (self._step, self._schedule)
        self._join.drain()  # no copy still reads a source's batch when its pipeline goes
        for s, at in zip(self._sources, self._at):
            if every or s.stretch != at:
                s.park(at)

    @property
    def stats(self) -> MixtureStats:
        """Counters since the mixture opened (per source: see :class:`SourceStats`)."""
        return self._stats

    def stop(self) -> None:
        """End every source's current pass and the making of batches ahead (their threads stop); the next pass
        goes on from here."""
        self._rewind(every=True)

    def close(self) -> None:
        """Close every source's dataset (threads, buffers, files) and stop making batches ahead. Idempotent,
        from any thread."""
        self._closed = True
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.stop(join=False)  # it may be waiting for a source's reads: the close below ends those
        for s in getattr(self, "_sources", []):
            s.ds.close()
        if ahead is not None:
            ahead.stop()
        if hasattr(self, "_join"):
            self._join.drain()
        for s in getattr(self, "_sources", []):
            s.drop()

    def __repr__(self) -> str:
        return (f"Mixture({list(self.sources)}, batch_size={self.batch_size}, weights={self.weights}, "
                f"step={self._step}, rank={self.rank}/{self.world_size})")

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the mixture stands: the step, the weights' segment, every source's position (the same on
        every rank, saved with its source's name and fingerprint) and each source's dataset fingerprint (keys:
        docs/mixtures.md). Plain and small; every rank's is the same but for ``rank``."""
        return {"mixture_format": MIXTURE_FORMAT, "step": self._step, "seed": self.seed,
                "batch_size": self.batch_size, "whole_batches": self.whole_batches, "sources": list(self.sources),
                "schedule": schedule_state(self._schedule, self.sources),
                "positions": {s.name: at.as_dict() for s, at in zip(self._sources, self._at)},
                "datasets": {s.name: dataset_record(s.ds) for s in self._sources},
                "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state`` (saved by any rank, on any number of ranks): the next batch is the one the
        saved run would have yielded next. Checked whole before anything changes
        (:func:`gdsload.mixture.state.check_state`): TypeError for a non-dict, StateError (a ValueError) naming
        the key for a malformed state, another source list, another seed, a source whose data differs, or a
        position saved for another source."""
        if not isinstance(state, Mapping):
            raise TypeError(f"a mixture state must be a dict from Mixture.state_dict(), found {type(state).__name__}")
        self._rewind()  # the sources where the batches yielded leave them, whether the state is taken or not
        checked = check_state(state, self._sources, self.seed, self.batch_size, self.whole_batches)
        for s, (gds_state, skip, stretch) in zip(self._sources, checked.sources):
            s.drop()
            s.ds.load_state_dict(gds_state)
            s.stretch, s.skip = stretch, skip
        self._schedule, self._step = checked.schedule, checked.step
        self._at, self._made_to = tuple(s.stretch for s in self._sources), (self._step, self._schedule)
