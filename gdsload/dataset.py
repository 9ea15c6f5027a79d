"""GDSDataset: the user-facing iterable over batches of a gdsload dataset. It checks arguments, keeps the
position (epochs, state and resume) and manages the pipeline; what it reads with is its reader."""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from . import _fork
from ._tasks import REAPER, Closing, close_each
from .errors import GDSLoadError, warn
from .format.missing import check_missing_chunks
from .integrations import LoaderProtocols, refuse_collation, refuse_worker
from .cuda.ops import CudaOps, host_ops
from .options import check_choices, check_int, device_id, field_names, output_kind, pad_spec, rank_and_world
from .options import check_bool, image_specs
from .codecs.image_params import ImageSpec
from .codecs.images import ImageStep
from .pipeline import resume
from .pipeline.feeds import Feed
from .pipeline.position import Cursor, Position
from .pipeline.pipeline import Pipeline
from .pipeline.plan import PlanConfig, check_yields, epoch_plan, window_buffers_for
from .pipeline.reader import DEFAULT_RESIDENT_BYTES, Reader
from .backends.source import open_source
from .pipeline.stats import EpochStats
from .remote.objects import DEFAULT_TIMEOUT_S, check_timeout
from .pipeline.window import WindowBuffer


class GDSDataset(LoaderProtocols, Closing):
    """Batches of a gdsload dataset, read ahead into device (or host) window buffers.

    Parameters (every one in full: docs/api.md)
    ----------
    path : a dataset written by ``gdsload shard``, or any Zarr v3 group of arrays of one length along axis 0
        (or one such array), raw or compressed chunks holding whole samples (docs/format.md); or an ``s3://``
        or ``https://`` URL of one, its shards fetched into ``cache_dir`` as they are read (docs/remote.md).
    batch_size : samples per batch; the last of an epoch may be smaller unless ``drop_last``.
    fields : a name or names to read (default: all).
    backend : ``"auto"`` (``backend_reason`` says what it chose and why), ``"kvikio"``, ``"pinned"``,
        ``"mmap"`` (the RAM tier: shard files locked in memory once) or ``"cpu"``.
    shuffle, seed : permute blocks per epoch and samples inside each window; same seed, same order.
    window_blocks, prefetch, batches_ahead, prefetch_next_epoch : read-ahead: blocks per window buffer,
        windows read ahead, batches gathered ahead, and reading on into the next epoch.
    output : ``"cupy"`` (default on GPU), ``"numpy"`` (default on cpu), ``"torch"`` or ``"jax"``.
    rank, world_size, exact_shares : this process's share of each epoch (default: torch.distributed, else
        RANK / WORLD_SIZE); with ``exact_shares`` every sample once, none repeated or dropped.
    device : CUDA device id (default: LOCAL_RANK, else 0).
    pad_to, pad_value : how variable-length fields come out (values + offsets, or padded).
    images : image field -> ``ImageSpec``: decoded in the pipeline to one batch tensor (docs/images.md).
    resident_bytes : fields of at most this size are read once, whole, and kept.
    backend_options : passed to the backend (e.g. ``num_threads``, ``pool_bytes``, ``max_bytes``).
    verify : check every block against the converter's crc32c before a sample of it is served (default: on
        where the dataset has block checksums). A store's own checksums are always checked.
    cache_dir, cache_bytes : a remote dataset's node cache (default: gdsload's cache folder) and its LRU bound.
    missing_chunks : ``"error"`` (default): a chunk missing from the store (a shard's index or a file) fails the
        open, naming it; ``"fill"``: it reads as the array's fill value, as zarr reads it.
    timeout_s : the bound of every remote wait (30 s): a request with its retries, a wait for another's fetch.

    Epochs: without ``set_epoch``, every new pass is the next epoch; with it, a pass reads the epoch set.
    ``state_dict()`` / ``load_state_dict()`` save and restore the position, also under another world size;
    ``place(epoch, legs, samples)`` puts it at a position given in counts.
    Yielded arrays are fresh allocations, ready on the consumer's current stream. With torch installed this
    is a torch IterableDataset (:mod:`gdsload.integrations`). Bad arguments are ValueErrors naming them.
    """

    def __init__(self, path: str | os.PathLike[str], batch_size: int, fields: Sequence[str] | None = None, *,
                 backend: str = "auto", shuffle: bool = False, seed: int = 0, window_blocks: int | None = None,
                 prefetch: int = 2, batches_ahead: int | None = None, prefetch_next_epoch: bool = True,
                 drop_last: bool = False, output: str | None = None, rank: int | None = None,
                 world_size: int | None = None, device: int | None = None, resident_bytes: int = DEFAULT_RESIDENT_BYTES,
                 pad_to: int | str | dict[str, int | str] | None = None, pad_value: Any = 0,
                 backend_options: dict[str, Any] | None = None, verify: bool | None = None, exact_shares: bool = False,
                 cache_dir: str | os.PathLike[str] | None = None, cache_bytes: int | None = None,
                 missing_chunks: str = "error", timeout_s: float = DEFAULT_TIMEOUT_S,
                 images: dict[str, ImageSpec] | None = None):
        started = time.perf_counter()
        # Integers become Python ints here, RANK / WORLD_SIZE / LOCAL_RANK are read here: no numpy scalar goes on.
        batch_size, prefetch = check_int("batch_size", batch_size, 1), check_int("prefetch", prefetch, 1)
        resident_bytes, seed = check_int("resident_bytes", resident_bytes, 0), check_int("seed", seed, 0)
        window_blocks = check_int("window_blocks", window_blocks, 1, none_ok=True)
        batches_ahead = check_int("batches_ahead", batches_ahead, 1, none_ok=True)
        shuffle, drop_last, exact_shares, prefetch_next_epoch = (check_bool(n, v) for n, v in (
            ("shuffle", shuffle), ("drop_last", drop_last), ("exact_shares", exact_shares),
            ("prefetch_next_epoch", prefetch_next_epoch)))
        device, (rank, world_size) = device_id(device), rank_and_world(rank, world_size)
        check_choices(backend, output, verify, backend_options)
        check_missing_chunks(missing_chunks)
        timeout_s = check_timeout(timeout_s)
        fields = field_names(fields)  # read once: an iterator would be used up by the metadata's checks

        def chosen(name: str) -> None:
            self.output = output_kind(output, name)  # before the backend is made: a bad output costs nothing

        source = open_source(path, cache_dir, cache_bytes, timeout_s)  # a remote one: its skeleton in the cache
        opened = Reader.open(source, fields, backend, device, resident_bytes, verify, backend_options, chosen,
                             missing_chunks)
        for name in ("meta", "fields", "resident_fields", "ragged_fields", "windowed_fields", "backend_name",
                     "backend_reason", "device", "verify"):
            setattr(self, name, getattr(opened, name))
        try:
            if window_blocks is None:
                window_blocks = opened.window_blocks(batch_size, world_size)
            elif window_blocks > self.meta.num_blocks:  # no window of this dataset can be that: say what it is
                warn(f"{self.meta.path}: window_blocks={window_blocks} is more than the dataset's "
                     f"{self.meta.num_blocks} blocks; a window holds at most a rank's share, so windows of "
                     f"{opened.max_window_blocks(world_size)} blocks are read", UserWarning)
            self.config = PlanConfig(num_samples=self.meta.num_samples, samples_per_block=self.meta.samples_per_block,
                                     batch_size=batch_size, window_blocks=min(window_blocks,  # no window holds more
                                                                              opened.max_window_blocks(world_size)),
                                     shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size,
                                     exact_shares=exact_shares)
            check_yields(self.config)
            self._pad = pad_spec(pad_to, pad_value, self.ragged_fields)
            specs = image_specs(images, self.meta, self.fields, self._pad)
            self._images = ImageStep(self.meta.path, specs, seed) if specs else None
            self.prefetch, self.prefetch_next_epoch = prefetch, prefetch_next_epoch
            self.batches_ahead = opened.backend.batches_ahead_hint if batches_ahead is None else batches_ahead
            self._reader = reader = opened.start(self.config.window_blocks)
            first_plan = epoch_plan(self.config, 0)
            self._buffers: list[WindowBuffer] = [reader.load_first(first_plan)]
        except BaseException:
            getattr(self, "_reader", opened).close()  # a bad argument must leave no pinned memory or threads behind
            raise
        self._position = Position(self.config, first_plan, lambda: resume.fingerprint(reader.meta, reader.layout))
        self.stats: EpochStats | None = None
        self._active: list[Pipeline] = []  # at most one; a list so the finalizer can see it without self
        # close() may come from any thread: it sets _closing at once (a resident load or a backend call in
        # progress stops early), then takes _lock, which starting a pass holds, so no pass starts after it.
        self._closing = threading.Event()
        self._lock = threading.RLock()
        # What close() frees; never self.
        self._parts = (self._active, reader, self._buffers, self._closing, self._images)
        REAPER.start()  # if the collector finds this dataset unclosed, its clean-up runs there (_tasks.Reaper)
        self._finalizer = weakref.finalize(self, REAPER, _shutdown, *self._parts)
        _fork.track(self)
        self.open_s = time.perf_counter() - started

    # -- properties ------------------------------------------------------------------------------------
    @property
    def io_mode(self) -> str:
        """How bytes move: "gds", "kvikio-compat", "pinned", "pinned-odirect", "mmap", "remote-kvikio" or "cpu"."""
        return self._reader.io_mode

    @property
    def num_samples(self) -> int:
        return self.meta.num_samples

    @property
    def epoch(self) -> int:
        """The epoch of the current pass (or of the next, once set with ``set_epoch`` or a loaded state)."""
        return self._position.cursor.epoch

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return self._position.plan(self.epoch).num_batches

    def __repr__(self) -> str:
        c = self.config
        return (f"GDSDataset({self.meta.path!r}, batch_size={c.batch_size}, fields={list(self.fields)}, "
                f"backend={self.backend_name!r}, io_mode={self.io_mode!r}, rank={c.rank}/{c.world_size})")

    def describe(self) -> dict[str, Any]:
        """How this dataset reads, JSON-ready: backend and why, io mode, samples per block, how each field is
        gathered (``"positions"``: at its plan positions, one copy per run of consecutive ones; ``"rows"``:
        by rows of its own, a foreign store's array whose chunks do not divide the block; ``"resident"``;
        ``"variable-length"``) and decoded, window size and buffers, read-ahead depths, resident fields,
        seconds the constructor took, and the backend's own settings and counters."""
        return {**self._reader.describe(), "samples_per_block": self.config.samples_per_block,
                "window_blocks": self.config.window_blocks, "window_buffers": len(self._buffers),
                "prefetch": self.prefetch, "batches_ahead": self.batches_ahead, "open_s": self.open_s}

    # -- epochs and resume -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass follows (a resumed epoch keeps its position)."""
        self._position.set_epoch(check_int("epoch", epoch, 0))

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: epoch, batches yielded in it (in its current leg), the legs it was read in
        before under other world_size / batch_size / window_blocks, the config the order depends on and a
        fingerprint of the dataset. Plain and small; every rank's is the same but for ``rank``."""
        return self._position.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, saved by any rank (all ranks' agree; ``gdsload.merge_states`` checks it):
        the next pass yields exactly the batches not yet yielded. Under another world_size, batch_size or
        window_blocks the ranks share out the rest of the epoch, every sample once (docs/multi-gpu.md); another
        batch_size is warned about, saying what changes. Raises TypeError for a non-dict and ValueError naming
        the key for a malformed state or one of another dataset, seed, shuffle or drop_last; nothing changes
        then."""
        self._position.load(state)

    def place(self, epoch: int, legs: Sequence[dict[str, int]] = (), samples: int = 0) -> None:
        """Put the position at ``samples`` of this rank's share of epoch ``epoch``: of its current leg, the one
        read under this dataset's world_size, batch_size and window_blocks after ``legs``, the legs the epoch
        was read in before (hop dicts as a state's ``hops`` holds them, docs/multi-gpu.md; none: the epoch's
        ordinary plan). The next pass (or a mixture's feed) starts exactly there, as after ``load_state_dict``
        of the state saying so; ``place(e)`` is epoch e from its start. A pass of the dataset's own yields whole
        batches, so it refuses a position inside one (``samples`` not a multiple of batch_size), as
        ``state_dict()`` does; a mixture's feed reads from any sample. A StateError (a ValueError) names what is
        out of range (hops the epoch cannot have been read in, samples beyond the share); nothing changes then."""
        try:
            self._position.place(epoch, legs, samples)
        except resume.StateError as e:
            raise resume.StateError(f"{self.meta.path}: place(epoch={epoch!r}, samples={samples!r}): {e}") from None

    # -- iteration -------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """A pass over the next epoch (see the class notes). The pass begins at the first ``next()``:
        an iterator that is made and never used (as frameworks do to probe an iterable) reads nothing and
        counts as no pass."""
        refuse_worker(self)  # first: a forked worker is also refused by _fork, with less to say
        refuse_collation(self)
        _fork.check(self)
        if not self._finalizer.alive:
            raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
        return self._pass()

    def _pass(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            if not self._finalizer.alive:
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
            placed = self._position.cursor
            if placed.fixed and placed.skip:
                raise resume.StateError(f"{self.meta.path}: placed {placed.skip} samples into batch {placed.batch} "
                                        f"of epoch {placed.epoch}; a pass yields whole batches (place it at a "
                                        f"multiple of batch_size={self.config.batch_size})")
            start = self._position.begin()
            ahead = self._active[0].upcoming() if self._active else None
            read_ahead = ahead is not None and ahead.reads_as(start, self.config.shuffle)
            pipeline = self._active[0] if read_ahead else self._start(start)  # read ahead while the last one ran
            self.stats = pipeline.stats
            self.stats.read_ahead = read_ahead
        yield from self._run(pipeline, start)

    def _start(self, start: Cursor) -> Pipeline:
        """A new pipeline from ``start`` (any running one is stopped first)."""
        self._close_active()
        plan = self._position.plan(start.epoch)
        while len(self._buffers) < window_buffers_for(self.prefetch, plan):
            self._buffers.append(self._reader.allocate())
        resident, read_before = self._reader.resident(self._closing)  # read whole on the first pass, then kept
        ops = CudaOps(self.device, self.output) if self._reader.on_device else host_ops(self.output)
        ops.decodes = bool(self._reader.device_decoded)
        # Nothing the pipeline holds may refer to the dataset: an abandoned dataset must be collectable.
        pipeline = Pipeline(self._reader, ops, self._buffers, start, plan, self.fields, resident, self._pad,
                            ahead=self.batches_ahead, bytes_before=read_before, step=self._images,
                            plans=functools.partial(epoch_plan, self.config) if self.prefetch_next_epoch else None)
        self._active.append(pipeline)
        return pipeline

    def _run(self, pipeline: Pipeline, start: Cursor) -> Iterator[dict[str, Any]]:
        try:
            for batch in pipeline.batches():
                self._position.count(start)
                yield batch
        except GDSLoadError as e:
            named = self._reader.named(e)  # a remote dataset's: its URLs, not the node's cache files
            if named is e:
                raise
            raise named from e
        finally:
            # A pass left early (or failed) has closed its pipeline; one run to its end reads on.
            if pipeline.closed and pipeline in self._active:
                try:
                    self._active.remove(pipeline)
                except ValueError:  # close() from another thread took it meanwhile
                    pass

    def feed(self, name: str, names: dict[str, str]) -> Feed:
        """This dataset's stream for a pipeline serving several sources (a Mixture's): from where it was placed
        (:meth:`place`), with its reader, window buffers (borrowed; the pipeline may add to them), resident fields
        and padding; ``names`` renames fields in the output. Any pipeline of its own is stopped first."""
        with self._lock:
            if not self._finalizer.alive:
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
            self._close_active()
            start = self._position.begin()
            resident, _ = self._reader.resident(self._closing)
            return Feed(name, self._reader, self._buffers, self._reader.allocate, start,
                        self._position.plan(start.epoch), functools.partial(epoch_plan, self.config),
                        self.fields, dict(names), resident, self._pad)

    def lend(self, pipeline: Any, gone: Any = None) -> None:
        """Record ``pipeline`` as reading through this dataset (closing the dataset closes it first); with
        ``gone``, forget that one instead."""
        with self._lock:
            if gone is not None:
                if gone in self._active:
                    self._active.remove(gone)
            elif pipeline is not None:
                self._active.append(pipeline)

    def _close_active(self) -> None:
        while self._active:
            self._active.pop().close()

    def stop(self) -> None:
        """Stop reading ahead: the background threads end and what they read ahead is dropped; buffers and
        file handles stay, and the next pass starts afresh. ``close()`` also frees those."""
        self._close_active()

    def close(self) -> None:
        """Stop background readers and free buffers and file handles. Idempotent, from any thread: a pass
        in progress (or starting) in another thread ends with a GDSLoadError saying the dataset was closed."""
        self._closing.set()
        with self._lock:
            if self._finalizer.detach() is not None:  # None once closed (or collected)
                _shutdown(*self._parts)


def _shutdown(active: list[Pipeline], reader: Reader, buffers: list[WindowBuffer], closing: threading.Event,
              images: ImageStep | None) -> None:
    closing.set()
    pipelines = [active.pop() for _ in range(len(active))]
    # The image decoder's device memory goes while the streams it was made on still exist.
    close_each((*(p.close for p in pipelines), *([images.close] if images else ()), reader.close, buffers.clear))
