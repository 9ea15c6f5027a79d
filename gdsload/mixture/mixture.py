"""Mixture: several datasets in one stream of batches, at exact proportions that may change at any step.

Each source is a :class:`GDSDataset` of its own, read in exact shares (``PlanConfig.exact_shares``); the
schedule (:mod:`gdsload.mixture.schedule`) says how many samples each source gives each batch, and one pipeline
(gdsload/pipeline/mixed.py) serves every source. Its threads stop on ``close()``, on leaving a pass early and on
an error. docs/mixtures.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .._tasks import Closing
from ..backends import info
from ..cuda.ops import CudaOps, host_ops
from ..dataset import GDSDataset
from ..errors import GDSLoadError
from ..integrations import LoaderProtocols, refuse_collation, refuse_worker
from ..pipeline.assembler import GROUP_BYTES
from ..pipeline.mixed import MAX_GROUP, Mixed, MixedPipeline
from ..pipeline.steps import Step, Steps
from .source import Placement, SourceStats, SourceStream
from .specs import check_fields, named, source_specs
from .schedule import Schedule, exact_weights, next_counts, schedule_state
from .state import MIXTURE_FORMAT, check_state, dataset_record
from ..options import check_int, rank_and_world



@dataclass
class MixtureStats:
    """The mixture's passes: batches, samples and bytes yielded, wall time, the seconds the consumer waited
    for batches made ahead, and per source its share; ``gb_per_s`` is bytes yielded per second of wall time,
    overall or per source."""

    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    sources: dict[str, SourceStats] = field(default_factory=dict)

    def gb_per_s(self, source: str | None = None) -> float:
        got = self.bytes if source is None else self.sources[source].bytes
        return got / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "samples": self.samples, "bytes": self.bytes, "wall_s": self.wall_s,
                "stall_s": self.stall_s, "gb_per_s": self.gb_per_s(),
                "sources": {n: {**dataclasses.asdict(s), "gb_per_s": self.gb_per_s(n)}
                            for n, s in self.sources.items()}}


class Mixture(LoaderProtocols, Closing):
    """Batches drawn from several datasets at exact, changeable proportions, resumable at any step.

    Parameters
    ----------
    sources : dict of name -> path, or name -> dict of options with ``"path"`` (and any GDSDataset option:
        ``backend``, ``window_blocks``, ``pad_to``, ...; ``batch_size``: with ``whole_batches``, the
        samples of its batches, default the mixture's). ``"fields"``: names to read, or a dict
        {field: name in the mixture}
        to rename.
        The order sets each source's index in ``batch["source"]``.
    weights : dict of name -> number >= 0 (any scale; a float counts as the decimal it prints as), or a
        function of the step returning one (called once per step, in order, up to 128 steps ahead of
        the batch being yielded: it must depend on the step alone; a change starts a new segment). Default: in
        proportion to the sources' sizes.
    batch_size : samples per batch.
    seed : breaks ties in the schedule, and is each source's ``seed`` unless its options give one.
    num_batches : batches per pass (then ``len(mix)``); default: endless. Passes cover steps
        ``[k * num_batches, (k + 1) * num_batches)``; one begun mid-way (after a break or a resume) yields the
        rest of it.
    whole_batches : each batch is one whole batch of one source (sources may then have different fields),
        and the schedule counts batches instead of samples.
    rank, world_size : this process's share (default: torch.distributed, else RANK / WORLD_SIZE).
    read_ahead : batches assembled ahead of the consumer (default: the first source's ``batches_ahead``; 0 counts
        as 1). A weight change or a loaded state drops what was read ahead.
    **options : GDSDataset options for every source (a source's own options win).

    Each batch is ``{field: array}`` as the sources' datasets give it (every source gives arrays of one output
    on one device, whatever its backend: one pipeline serves them all), samples grouped by source in source order, plus
    ``batch["source"]`` (int64, one per sample, same kind and device). Sources mixed by sample must read
    the same fields (names, dtypes, sample shapes; variable-length fields with the same padding, not
    ``"max"``), else a ValueError names the source and the field.

    Notes
    -----
    Guarantees (docs/mixtures.md): since the start or the last weight change, each source's count stays within
    one of ``weight * samples`` after every batch (within two over any run of batches); every sample of a
    source once per epoch of that source across ranks; a weight change skips and repeats nothing; a state
    resumes batch for batch, on another number of ranks as a GDSDataset does, per source. Each sample is
    gathered once, from its source's window straight into the batch.
    """

    def __init__(self, sources: Mapping[str, Any], weights: Any = None, *, batch_size: int, seed: int = 0,
                 num_batches: int | None = None, whole_batches: bool = False, rank: int | None = None,
                 world_size: int | None = None, read_ahead: int | None = None, **options: Any):
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.num_batches = check_int("num_batches", num_batches, 1, none_ok=True)
        read_ahead = check_int("read_ahead", read_ahead, 0, none_ok=True)
        if not isinstance(whole_batches, bool):
            raise TypeError(f"whole_batches must be True or False (found {whole_batches!r})")
        self.whole_batches = bool(whole_batches)
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self._closed = False
        self._pipe: MixedPipeline | None = None
        specs = source_specs(sources, options)
        self.sources = tuple(specs)
        self._sources: list[SourceStream] = []
        self._weights_fn: Callable[[int], Any] | None = None
        try:
            for name, (path, fields, rename, kwargs) in specs.items():
                if "batch_size" in kwargs and not self.whole_batches:
                    raise ValueError(f"source {name!r}: batch_size is the mixture's when sources mix by sample (a "
                                     "source's own sizes its whole batches, with whole_batches=True)")
                kwargs = {"batch_size": self.batch_size, "seed": self.seed, **kwargs}
                try:
                    ds = GDSDataset(path, fields=fields, rank=self.rank, world_size=self.world_size,
                                    exact_shares=True, **kwargs)
                except (TypeError, ValueError, GDSLoadError) as e:
                    raise named(e, f"source {name!r}: {e}") from e
                self._sources.append(SourceStream(name, ds, rename))
            check_fields(self._sources, specs, self.whole_batches)
            self.read_ahead = max(1, self._sources[0].ds.batches_ahead if read_ahead is None else read_ahead)
            self._weights_fn, exact = self._weights_at(weights, 0)
            self._schedule = Schedule.begin(0, exact)
        except BaseException:
            self.close()
            raise
        self.datasets = {s.name: s.ds for s in self._sources}
        self._step = 0
        self._at = tuple(s.stretch for s in self._sources)  # every source's position after the batches yielded
        self._placed: list[Placement | None] = [None] * len(self._sources)  # a loaded state's
        self._counted = [(0, 0)] * len(self._sources)  # per source, bytes read and passes of pipelines stopped
        self._stats = MixtureStats(sources={s.name: s.stats for s in self._sources})

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
        self._halt()  # batches read ahead under the old weights are dropped
        self._weights_fn, exact = self._weights_at(weights, self._step)
        self._schedule = self._schedule.reweighted(exact, self._step)

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
                item, batch, waited = self._pipeline().next()
                self._take(item, waited)
                now = time.perf_counter()
                self._stats.wall_s, last = self._stats.wall_s + now - last, now
                yield batch
        except BaseException as e:  # left early, or failed: the pipeline stops
            if not self._closed:
                self.stop()
            elif isinstance(e, GDSLoadError) and "closed" not in str(e):
                raise GDSLoadError(f"mixture of {list(self.sources)}: it was closed while a pass was read") from e
            raise
        finally:
            self._stats.wall_s += time.perf_counter() - last

    def _pipeline(self) -> MixedPipeline:
        """The pipeline reading from where the batches yielded leave every source (started here if none runs)."""
        if self._pipe is not None:
            return self._pipe
        if self._closed:
            raise GDSLoadError(f"mixture of {list(self.sources)}: it was closed (open a new Mixture)")
        feeds = []
        for i, (s, at) in enumerate(zip(self._sources, self._at)):
            placed, self._placed[i] = self._placed[i], None
            s.ds.place(*(placed if placed is not None else s.locate(at, check=False)[0]))
            feeds.append(s.ds.feed(s.name, s.rename))
        first = self._sources[0].ds
        ops = CudaOps(first.device, first.output) if info(first.backend_name).on_device else host_ops(first.output)
        ops.decodes = any(f.reader.device_decoded for f in feeds)
        make = _maker(self._schedule, self._weights_fn, self.sources, self.seed, self.whole_batches,
                      self.batch_size, tuple(s.ds.config.batch_size for s in self._sources))
        group = 1
        if not self.whole_batches and not any(s.ds.ragged_fields for s in self._sources):
            row = sum(f.sample_bytes for f in _fixed_fields(first))
            group = max(1, min(MAX_GROUP, GROUP_BYTES // max(1, row * self.batch_size)))
        # Each source reads ahead prefetch - 1 windows beyond those a group touches (its next one among them).
        extra = [max(0, s.ds.prefetch - 1) for s in self._sources]
        self._pipe = MixedPipeline(ops, feeds, Steps(make, self._step), self._step, self.read_ahead, group, extra)
        for s in self._sources:
            s.ds.lend(self._pipe)  # closing a source's dataset closes the pipeline first
        return self._pipe

    def _take(self, item: Mixed, waited: float) -> None:
        """The consumer's side: the mixture now stands after batch ``item``."""
        assert item.step == self._step, f"batch {item.step} read for step {self._step}"
        self._step, self._schedule = item.step + 1, item.after
        self._at = tuple(at.taken(c) if c else at for at, c in zip(self._at, item.counts))
        pipe = self._pipe
        for i, (s, samples, size) in enumerate(zip(self._sources, item.counts, item.nbytes)):
            s.stats.samples += samples
            s.stats.bytes += size
            if pipe is not None:
                s.stats.bytes_read = self._counted[i][0] + pipe.bytes_read[i]
                s.stats.passes = self._counted[i][1] + pipe.passes_begun[i]
        self._stats.bytes += sum(item.nbytes)
        self._stats.batches += 1
        self._stats.samples += sum(item.counts)
        self._stats.stall_s += waited

    def _halt(self) -> None:
        """Stop the pipeline (what it read ahead is dropped); the next batch starts a new one from the position
        of the batches yielded."""
        pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        pipe.close()
        for i, s in enumerate(self._sources):
            s.ds.lend(None, pipe)
            self._counted[i] = (self._counted[i][0] + pipe.bytes_read[i], self._counted[i][1] + pipe.passes_begun[i])

    @property
    def stats(self) -> MixtureStats:
        """Counters since the mixture opened (per source: see :class:`SourceStats`)."""
        return self._stats

    def stop(self) -> None:
        """End the current pass's reading ahead (the pipeline's threads stop); the next pass goes on from here."""
        self._halt()

    def close(self) -> None:
        """Stop the pipeline and close every source's dataset (buffers, files). Idempotent, from any thread."""
        self._closed = True
        pipe = getattr(self, "_pipe", None)
        if pipe is not None:
            pipe.close()
        for s in getattr(self, "_sources", []):
            s.ds.close()

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
        self._halt()  # what was read ahead is dropped, whether the state is taken or not
        checked = check_state(state, self._sources, self.seed, self.batch_size, self.whole_batches)
        self._placed = [placement for placement, _ in checked.sources]
        self._at = tuple(stretch for _, stretch in checked.sources)
        self._schedule, self._step = checked.schedule, checked.step


def _maker(schedule: Schedule, fn: Callable[[int], Any] | None, names: tuple[str, ...], seed: int, whole: bool,
           batch_size: int, sizes: tuple[int, ...]) -> Callable[[int], Step]:
    """The schedule's steps from ``schedule`` on, one call per step, in order (gdsload.pipeline.steps). It holds
    nothing of the mixture's, so an abandoned mixture is collected while its pipeline's threads run."""
    at = [schedule]

    def make(step: int) -> Step:
        current = at[0]
        if fn is not None:
            current = current.reweighted(exact_weights(fn(step), names), step)
        counts, after = next_counts(current, 1 if whole else batch_size, seed)
        if whole:
            counts = tuple(c * b for c, b in zip(counts, sizes))
        at[0] = after
        return Step(counts, after)
    return make


def _fixed_fields(ds: GDSDataset) -> list[Any]:
    """The metadata of a dataset's fixed-size fields it reads."""
    return [ds.meta.fields[f] for f in ds.fields if f in ds.meta.fields]
