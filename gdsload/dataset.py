"""GDSDataset: the user-facing iterable over batches of a gdsload dataset."""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from . import _fork, resume
from .integrations import LoaderProtocols, refuse_worker
from .assembler import ResidentField
from .backends import BACKENDS, make_backend, resolve
from .cursor import Cursor
from .env import warn_few_connections
from .errors import GDSLoadError
from .format import DatasetLayout, read_metadata
from .options import (DEFAULT_RESIDENT_BYTES, check_int, check_output, device_id, field_names, output_kind, pad_spec,
                      rank_and_world, resident_fields)
from .pipeline import Pipeline
from .resident import read_resident
from .plan import (EpochPlan, PlanConfig, blocks_per_rank, check_yields, epoch_plan, window_blocks_for,
                   window_buffers_for)
from .ragged import capacity_rows
from .stats import EpochStats
from .verify import Verification, carries_trailers, unchecked_fields
from .window import WindowBuffer, WindowLayout, slot_rows


class GDSDataset(LoaderProtocols):
    """Batches of a gdsload dataset, read ahead into device (or host) window buffers.

    Parameters
    ----------
    path : dataset directory written by ``gdsload shard``; or any Zarr v3 group of arrays that share their
        length along axis 0 (the fields are its arrays, nested ones named ``a/b``), or one such array (one
        field, named after its directory). Chunks must hold whole samples, raw or compressed (``zstd``,
        decoded on the GPU by nvCOMP when installed, else by CPU threads; ``gzip``, ``blosc`` and numcodecs'
        codecs by CPU threads); chunks never written, and missing chunk or shard files, read as the array's
        fill value (docs/format.md).
    batch_size : samples per batch; the last batch of an epoch may be smaller unless ``drop_last`` (then one
        that leaves a rank no batch in some epoch is a ValueError).
    fields : fields to read (default: all): a name, or any iterable of distinct names (read once; empty is a
        ValueError). In a Zarr group without gdsload's attribute, only these arrays must be readable and of
        one length.
    backend : ``"auto"`` (mmap when the dataset fits in its RAM budget; else kvikio with GPUDirect Storage;
        else pinned; cpu without a GPU; ``backend_reason`` says which), ``"kvikio"``, ``"pinned"``,
        ``"mmap"`` or ``"cpu"``. ``"mmap"`` is for datasets that fit in RAM: it maps the shard files and
        locks them in memory once (the first window's ranges at open, the rest in the background), then
        every read is a host-to-device DMA copy. It holds the dataset's size in locked RAM until ``close()``;
        ``backend_options={"max_bytes": ...}`` caps it (default half of RAM). Never truncate its shard files
        in place while it is open (SIGBUS, as with any memory-mapped file); replacing the dataset with
        ``gdsload shard --overwrite`` is safe.
    shuffle, seed : permute blocks per epoch and samples inside each window; same seed, same order.
    window_blocks : blocks read together into one window buffer. Default: enough for a batch and about the
        backend's preferred window size (64-256 MiB). Memory held is about ``prefetch`` windows. The open
        reads the window a pass from the dataset's start reads first (that pass does not read it again).
        A value above the blocks a rank holds is clamped to them (``config`` and ``describe()`` say so).
    prefetch : windows read ahead of the consumer's current one(s); their reads are queued back to back, so
        the readers never wait at a window boundary. Window buffers held: ``prefetch`` + the windows one
        batch spans (usually 1-2).
    batches_ahead : batches gathered ahead of the consumer by a background thread, so ``next()`` only hands
        over a finished batch (each one is a fresh allocation of a batch's size). Default: the backend's
        (4 for pinned, 2 for the others; docs/design.md says why).
    prefetch_next_epoch : once a pass has begun, read on into the next epoch, so the next pass does not
        start by waiting for its first windows. The threads then outlive a pass run to its end, holding no
        more than within a pass; ``stop()`` or ``close()`` ends them, and a pass that asks for another epoch
        or a resumed position starts afresh.
    output : ``"numpy"`` / ``"torch"`` for the cpu backend, ``"cupy"`` (default) / ``"torch"`` on GPU; or
        ``"jax"``: jax arrays on the jax device of the batch's memory (zero-copy through DLPack where jax can).
    rank, world_size : this process's share of each epoch (default: torch.distributed, else RANK /
        WORLD_SIZE). With ``drop_last=False`` shorter ranks repeat a few samples so all ranks yield the
        same batches; with ``drop_last=True`` the remainder is dropped instead.
    device : CUDA device id (default: LOCAL_RANK, else 0).
    pad_to, pad_value : how variable-length fields come out. None (default): ``batch[NAME]`` holds the
        batch's values back to back and ``batch[NAME + "/offsets"]`` (B + 1, int64) where each sample
        starts. An int: ``batch[NAME]`` is (B, pad_to, ...) filled with ``pad_value`` (longer samples cut),
        plus ``batch[NAME + "/lengths"]``; ``"max"``: padded to the batch's longest sample. A dict sets
        this per field.
    resident_bytes : fields whose whole array is at most this size (labels, ids) are read once and kept in
        device memory instead of being read block by block (tiny reads cost as much as large ones).
    backend_options : passed to the backend (e.g. ``num_threads``, ``task_bytes``, ``pool_bytes``).
    verify : check every block read against the crc32c the converter stored for it (on the GPU for GPU
        backends, beside the gathers), raising :class:`ChecksumError` (a ReadError) naming the file, field,
        block and offset of a bad block before any of its samples is served. Default (None): on wherever
        the dataset has block checksums (docs/benchmarks.md gives the cost per backend). Whatever ``verify``
        says, a store's own checksums are always checked: a shard index's crc32c at open, and the
        ``crc32c`` codec of a Zarr store's chunks (raw or compressed) before a sample of the chunk is served.
        True where a field carries no checksum of any kind is a ValueError naming it.
    exact_shares : each rank reads its share of every epoch's samples, none repeated or dropped (as a Mixture does).

    Integer arguments may be numpy integers; one out of range, or a malformed RANK, WORLD_SIZE or
    LOCAL_RANK, is a ValueError naming it.

    Epochs: without ``set_epoch``, every new pass is the next epoch (as a shuffling DataLoader); with it,
    a pass reads the epoch set. ``state_dict()`` / ``load_state_dict()`` save and restore the position.
    With torch installed this is a torch IterableDataset (:mod:`gdsload.integrations`).

    Notes
    -----
    Blocks are the unit of reading: a block size that is a multiple of 4 KiB keeps reads aligned for GDS
    and O_DIRECT. Yielded arrays are fresh allocations, never overwritten by later reads, and ready on the
    consumer's current stream.
    """

    def __init__(self, path: str | os.PathLike[str], batch_size: int, fields: Sequence[str] | None = None, *,
                 backend: str = "auto", shuffle: bool = False, seed: int = 0, window_blocks: int | None = None,
                 prefetch: int = 2, batches_ahead: int | None = None, prefetch_next_epoch: bool = True,
                 drop_last: bool = False, output: str | None = None, rank: int | None = None,
                 world_size: int | None = None, device: int | None = None, resident_bytes: int = DEFAULT_RESIDENT_BYTES,
                 pad_to: int | str | dict[str, int | str] | None = None, pad_value: Any = 0,
                 backend_options: dict[str, Any] | None = None, verify: bool | None = None, exact_shares: bool = False):
        started = time.perf_counter()
        # Integers become Python ints here, RANK / WORLD_SIZE / LOCAL_RANK are read here: no numpy scalar goes on.
        batch_size, prefetch = check_int("batch_size", batch_size, 1), check_int("prefetch", prefetch, 1)
        resident_bytes, seed = check_int("resident_bytes", resident_bytes, 0), check_int("seed", seed, 0)
        window_blocks = check_int("window_blocks", window_blocks, 1, none_ok=True)
        batches_ahead = check_int("batches_ahead", batches_ahead, 1, none_ok=True)
        device, (rank, world_size) = device_id(device), rank_and_world(rank, world_size)
        if verify not in (None, True, False):
            raise TypeError(f"verify must be True, False or None (found {verify!r})")
        fields = field_names(fields)  # read once: an iterator would be used up by the metadata's checks
        if backend_options is not None and not isinstance(backend_options, dict):
            raise TypeError(f"backend_options must be a dict (found {type(backend_options).__name__})")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (expected one of {BACKENDS})")
        check_output(output)
        meta = read_metadata(path, fields)
        names = tuple(fields) if fields is not None else tuple(meta.names)
        self.resident_fields = resident_fields(meta, names, resident_bytes)
        # A foreign store's block: chosen for the arrays read block by block (the others are read whole).
        self.meta = meta.with_block([f for f in names if f in meta.fields and f not in self.resident_fields])
        self._layout = layout = DatasetLayout(self.meta, tuple(fields) if fields is not None else None)
        self.fields = layout.fields
        try:
            # auto may pick the RAM tier: it needs the size of what this dataset reads.
            paths = list(layout.files)
            self.backend_name, self.backend_reason = resolve(backend, sum(layout.files.get(p).size for p in paths),
                                                             paths[0] if paths else None)
            self.output = output_kind(output, self.backend_name)
            unchecked = unchecked_fields(layout) if verify else []
            if unchecked:
                kind = ("its chunks have no crc32c codec" if self.meta.foreign
                        else "written by a converter without block checksums")
                raise ValueError(f"verify=True: {self.meta.path}: field(s) {unchecked} carry no checksum ({kind}); "
                                 f"convert it with 'gdsload shard' to add them, or pass verify=False")
        except BaseException:
            layout.close()
            raise
        on_gpu = self.backend_name != "cpu"
        self.verify = layout.has_checksums if verify is None else verify
        self.device = device
        try:
            self._backend = make_backend(self.backend_name, self.device, **(backend_options or {}))
        except BaseException:
            layout.close()
            raise
        if on_gpu:
            warn_few_connections()  # the steps would wait behind this dataset's copies
        try:
            self._configure(batch_size, window_blocks, shuffle, seed, drop_last, rank, world_size, pad_to, pad_value,
                            exact_shares)
            check_yields(self.config)
            self.prefetch = prefetch
            self.batches_ahead = self._backend.batches_ahead_hint if batches_ahead is None else batches_ahead
            self.prefetch_next_epoch = prefetch_next_epoch
            blocks = self.verify and layout.has_checksums
            once = self._backend.reads_locked_memory  # each block checked the first time it is read
            self._verification = (Verification(layout, blocks, on_gpu, self.device, once)
                                  if blocks or carries_trailers(layout) else None)
            self._decoder = None
            if any(meta.array(k).compressed for k in layout.keys):
                from .decode import Decoder

                self._decoder = Decoder(layout, on_gpu, self.device, self._device_decoded)
            # Last: a backend may read the whole dataset here (mmap), which a bad argument must not cost.
            self._backend.prepare(layout.files)
            first_plan = epoch_plan(self.config, 0)
            buffers = [self._load_first_window(first_plan)]
        except BaseException:
            self._backend.close()  # a bad argument must not leave pinned memory or threads behind
            for part in (getattr(self, "_decoder", None), getattr(self, "_verification", None)):
                if part is not None:
                    part.close()
            layout.close()
            raise
        self._resident: dict[str, ResidentField] = {}  # filled on the first pass, emptied by close()
        self._resident_loaded = False
        # Position: the cursor says where the current pass began (or, fixed, where the next one begins);
        # _yielded counts the batches that pass has yielded since.
        self._cursor = Cursor()
        self._yielded = 0
        self._epochs_set = False  # set_epoch() was called: the user numbers the epochs
        self._passes = 0  # passes begun
        self._fingerprint: resume.Fingerprint | None = None  # made on first use
        self._plan_cache: tuple[int, EpochPlan] | None = (0, first_plan)
        self.stats: EpochStats | None = None
        self._buffers: list[WindowBuffer] = buffers
        self._active: list[Pipeline] = []  # at most one; a list so the finalizer can see it without self
        # close() may come from any thread: it sets _closing at once (a resident load or a backend call in
        # progress stops early), then takes _lock, which starting a pass holds, so no pass starts after it.
        self._closing = threading.Event()
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _shutdown, self._active, self._backend, self._buffers,
                                           self._resident, layout, self._closing, self._decoder,
                                           self._verification)
        _fork.track(self)
        self.open_s = time.perf_counter() - started

    def _load_first_window(self, plan: EpochPlan) -> WindowBuffer:
        """The first window buffer, holding the window a pass from the dataset's start reads first (which
        that pass then does not read again): the backend's own start (threads, buffers, locked ranges) and
        that window's reads happen in the open instead of under the first batch, and a file they cannot
        read fails the open, naming it."""
        buffer = WindowBuffer(self._backend.allocate(self._window_layout.nbytes))
        requests = self._window_layout.first_requests(self._layout, plan)
        if requests:
            filled = self._backend.load(buffer.buffer, requests, threading.Event())
            if filled is not None:
                filled.synchronize()  # there when the open returns (copies still queued would hold up the pass)
            buffer.loaded = requests
        return buffer

    def _configure(self, batch_size: int, window_blocks: int | None, shuffle: bool, seed: int, drop_last: bool,
                   rank: int, world_size: int, pad_to: Any, pad_value: Any, exact_shares: bool) -> None:
        """Which fields are windowed or variable-length (the resident ones are chosen before the block is);
        the plan's config; the window layout."""
        meta, layout = self.meta, self._layout
        spb = meta.samples_per_block
        fixed = [f for f in self.fields if f in meta.fields]
        self.ragged_fields = tuple(f for f in self.fields if f in meta.ragged)
        self.windowed_fields = tuple(f for f in fixed if f not in self.resident_fields)
        if window_blocks is None:
            # A fixed field counts with its slot per block; a variable-length field with its mean bytes per block.
            block_bytes = (sum(slot_rows(spb, meta.fields[f].samples_per_block) * meta.fields[f].sample_bytes
                               for f in self.windowed_fields)
                           + sum(meta.ragged[f].values.sample_bytes * int(layout.offsets[f][-1]) // meta.num_blocks
                                 for f in self.ragged_fields))
            window_blocks = window_blocks_for(block_bytes, self._backend.window_bytes_hint, batch_size, spb,
                                              meta.num_blocks, world_size)
        window_blocks = min(window_blocks, blocks_per_rank(meta.num_blocks, world_size))  # no window holds more
        self.config = PlanConfig(num_samples=meta.num_samples, samples_per_block=spb, batch_size=batch_size,
                                 window_blocks=window_blocks, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                 rank=rank, world_size=world_size, exact_shares=exact_shares)
        capacity = {f: (meta.ragged[f], capacity_rows(layout.offsets[f], spb, window_blocks))
                    for f in self.ragged_fields}
        from .decode import device_fields

        # Compressed fields: decoded on the device by nvCOMP, or by CPU threads from a host buffer (GPU backends).
        self._device_decoded, self._host_decoded = device_fields([meta.fields[f] for f in fixed],
                                                                 self.backend_name != "cpu")
        self._window_layout = WindowLayout([meta.fields[f] for f in self.windowed_fields], window_blocks, capacity,
                                           samples_per_block=spb, chunk_lengths=layout.chunk_lengths,
                                           host_fields=self._host_decoded)
        self._pad = pad_spec(pad_to, pad_value, self.ragged_fields)

    # -- properties ------------------------------------------------------------------------------------
    @property
    def io_mode(self) -> str:
        """How bytes move: "gds", "kvikio-compat", "pinned", "pinned-odirect", "mmap" or "cpu"."""
        return self._backend.io_mode

    @property
    def num_samples(self) -> int:
        return self.meta.num_samples

    @property
    def epoch(self) -> int:
        """The epoch of the current pass (or of the next, once set with ``set_epoch`` or a loaded state)."""
        return self._cursor.epoch

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return self._plan(self.epoch).num_batches

    def __repr__(self) -> str:
        c = self.config
        return (f"GDSDataset({self.meta.path!r}, batch_size={c.batch_size}, fields={list(self.fields)}, "
                f"backend={self.backend_name!r}, io_mode={self.io_mode!r}, rank={c.rank}/{c.world_size})")

    def describe(self) -> dict[str, Any]:
        """How this dataset reads, JSON-ready: backend and why, io mode, samples per block, how each field is
        gathered (``"positions"``: at its plan positions, one copy per run of consecutive ones; ``"rows"``:
        by rows of its own, a foreign store's array whose chunks do not divide the block; ``"resident"``;
        ``"variable-length"``), window size and buffers, read-ahead depths, resident fields, seconds the
        constructor took, and the backend's own settings and counters."""
        wl = self._window_layout
        gather = {f: "resident" if f in self.resident_fields else "variable-length" if f in wl.ragged
                  else "positions" if wl.direct(f) else "rows" for f in self.fields}
        decode = {f: "device (nvCOMP)" if f in self._device_decoded else "cpu threads" for f in self.fields
                  if f in self.meta.fields and self.meta.fields[f].compressed}
        return {"backend": self.backend_name, "backend_reason": self.backend_reason, "io_mode": self.io_mode,
                "foreign_store": self.meta.foreign, "samples_per_block": self.config.samples_per_block,
                "gather": gather, "decode": decode,
                "window_blocks": self.config.window_blocks, "window_bytes": self._window_layout.nbytes,
                "window_buffers": len(self._buffers), "prefetch": self.prefetch, "batches_ahead": self.batches_ahead,
                "resident_fields": list(self.resident_fields), "open_s": self.open_s,
                "backend_stats": self._backend.stats()}

    # -- epochs and resume -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass follows (a resumed epoch keeps its position)."""
        epoch = check_int("epoch", epoch, 0)
        self._epochs_set = True
        if not (self._cursor.fixed and self._cursor.epoch == epoch):
            self._cursor, self._yielded = Cursor(epoch, fixed=True), 0

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: epoch, batches yielded in it (in its current leg), the legs it was read in
        before under other world_size / batch_size / window_blocks, the config the order depends on and a
        fingerprint of the dataset. Plain and small; every rank's is the same but for ``rank``."""
        self._fingerprint = self._fingerprint or resume.fingerprint(self.meta, self._layout)
        c = self._cursor
        return resume.make_state(self.config, self._fingerprint, c.epoch, c.batch + (0 if c.fixed else self._yielded),
                                 c.hops)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, saved by any rank (all ranks' agree; ``resume.merge_states`` checks it):
        the next pass yields exactly the batches not yet yielded. Under another world_size, batch_size or
        window_blocks the ranks share out the rest of the epoch, every sample once (docs/multi-gpu.md).
        Raises TypeError for a non-dict and ValueError naming the key for a malformed state or one of
        another dataset, seed, shuffle or drop_last; nothing changes then."""
        self._fingerprint = self._fingerprint or resume.fingerprint(self.meta, self._layout)
        self._cursor, self._yielded = resume.resume(state, self.config, self._fingerprint), 0

    def _plan(self, epoch: int) -> EpochPlan:
        c = self._cursor
        if c.epoch == epoch and c.plan is not None:
            return c.plan  # the current leg of an epoch read before under other settings
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            self._plan_cache = (epoch, epoch_plan(self.config, epoch))
        return self._plan_cache[1]

    # -- iteration -------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """A pass over the next epoch (see the class notes). The pass begins at the first ``next()``:
        an iterator that is made and never used (as frameworks do to probe an iterable) reads nothing and
        counts as no pass."""
        refuse_worker(self)  # first: a forked worker is also refused by _fork, with less to say
        _fork.check(self)
        if not self._finalizer.alive:
            raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
        return self._pass()

    def _pass(self) -> Iterator[dict[str, Any]]:
        yield from self._begin()

    def _begin(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            if not self._finalizer.alive:
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
            start = self._cursor.next_pass(began=self._passes > 0, numbered=self._epochs_set)
            self._passes += 1
            self._cursor, self._yielded = start, 0
            ahead = self._active[0].upcoming() if self._active else None
            if ahead is not None and ahead.reads_as(start, self.config.shuffle):
                pipeline = self._active[0]  # this pass was read ahead while the last one ran
            else:
                pipeline = self._start(start)
            self.stats = pipeline.stats
            return self._run(pipeline, start)

    def _start(self, start: Cursor) -> Pipeline:
        """A new pipeline from ``start`` (any running one is stopped first)."""
        self._close_active()
        plan = self._plan(start.epoch)
        while len(self._buffers) < window_buffers_for(self.prefetch, plan):
            self._buffers.append(WindowBuffer(self._backend.allocate(self._window_layout.nbytes)))
        first_load = not self._resident_loaded
        resident = self._load_resident()
        # Nothing the pipeline holds may refer to the dataset: an abandoned dataset must be collectable.
        pipeline = Pipeline(self._backend, self._ops(), self._layout, self._window_layout, self._buffers, start, plan,
                            self.fields, resident, self._pad, ahead=self.batches_ahead,
                            plans=functools.partial(epoch_plan, self.config) if self.prefetch_next_epoch else None,
                            bytes_before=sum(r.array.nbytes for r in resident.values()) if first_load else 0,
                            verification=self._verification, decoder=self._decoder)
        self._active.append(pipeline)
        return pipeline

    def _ops(self) -> Any:
        from .device import CudaOps, host_ops

        if self.backend_name == "cpu":
            return host_ops(self.output)

        return CudaOps(self.device, self.output)

    def _load_resident(self) -> dict[str, ResidentField]:
        """Read the small fields whole, once, through the same backend."""
        if not self._resident_loaded:
            for name in self.resident_fields:
                self._resident[name] = read_resident(self.meta.fields[name], self._backend, self._layout,
                                                     self._decoder, self._verification, self._host_decoded,
                                                     self._closing)
            self._resident_loaded = True
        return self._resident

    def _run(self, pipeline: Pipeline, start: Cursor) -> Iterator[dict[str, Any]]:
        try:
            for batch in pipeline.batches():
                if self._cursor is start:  # not once set_epoch / load_state_dict moved the cursor
                    self._yielded += 1
                yield batch
        finally:
            # A pass left early (or failed) has closed its pipeline; one run to its end reads on.
            if pipeline.closed and pipeline in self._active:
                try:
                    self._active.remove(pipeline)
                except ValueError:  # close() from another thread took it meanwhile
                    pass

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
            self._finalizer()

    def __enter__(self) -> GDSDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(active: list[Pipeline], backend: Any, buffers: list[WindowBuffer],
              resident: dict[str, ResidentField], layout: DatasetLayout, closing: threading.Event,
              decoder: Any = None, verification: Verification | None = None) -> None:
    closing.set()
    while active:
        active.pop().close()
    backend.close()
    for part in (decoder, verification):
        if part is not None:
            part.close()
    buffers.clear()
    resident.clear()
    layout.close()
