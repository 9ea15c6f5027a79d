"""GDSDataset: the user-facing iterable over batches of a gdsload dataset."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from . import _fork
from .backends import make_backend, resolve
from .errors import BackendUnavailable, GDSLoadError, ReadError
from .format import DatasetLayout, read_metadata
from .ragged import capacity_rows
from .pipeline import EpochStats, Pipeline, ResidentField, WindowLayout, WindowSlot
from .plan import EpochPlan, PlanConfig, epoch_plan
from . import resume

_STATE_KEYS = resume.STATE_KEYS  # the format, its checks and resumed plans: resume.py


def _distributed() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else RANK / WORLD_SIZE, else (0, 1).
    torch is never imported for this: a process group needs torch imported already (importing it costs
    seconds, more with a cold page cache)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class GDSDataset:
    """Batches of a gdsload dataset, read ahead into device (or host) window buffers.

    Parameters
    ----------
    path : dataset directory written by ``scripts/shard.py``.
    batch_size : samples per batch; the last batch of an epoch may be smaller unless ``drop_last``.
    fields : fields to read (default: all).
    backend : ``"auto"`` (kvikio with GPUDirect Storage; else pinned; cpu without a GPU), ``"kvikio"``,
        ``"pinned"``, ``"mmap"`` or ``"cpu"``. ``"mmap"`` is for datasets that fit in RAM: it maps the shard
        files and locks them in memory once, at open (reading a cold dataset whole), then copies near the
        host-to-device ceiling (51-53 GB/s warm on the H100, where kvikio read 33-44). It holds the
        dataset's size in locked RAM until ``close()``; ``backend_options={"max_bytes": ...}`` caps it
        (default half of RAM). Never truncate its shard files in place while it is open (SIGBUS, as with
        any memory-mapped file); replacing the dataset with ``shard.py --overwrite`` is safe.
    shuffle, seed : permute blocks per epoch and samples inside each window; same seed, same order.
    window_blocks : blocks read together into one window buffer. Default: enough for a batch and about the
        backend's preferred window size (64-256 MiB). Memory held is about ``prefetch`` windows.
    prefetch : windows read ahead of the consumer's current one(s); their reads are queued back to back, so
        the readers never wait at a window boundary. Window buffers held: ``prefetch`` + the windows one
        batch spans (usually 1-2). Warm, on the H100, 4 buffers of 256 MiB reached 92-95 % of raw KvikIO
        and 2 buffers (the classic double buffer) about 60 % (benchmarks/results/tune-*.json).
    batches_ahead : batches gathered ahead of the consumer by a background thread, so ``next()`` only hands
        over a finished batch (each one is a fresh allocation of a batch's size). Default: the backend's
        (4 for pinned, whose driver thread makes the gathering thread's turns jittery: with training steps
        of 1.1 and 1.6 ms and a sync after each, the GPU's mean idle time per step fell from 203-425 to
        119-265 us, H100, benchmarks/results/probe-overhead-*-ahead-*.json; 2 for the others, for which
        4 did no better).
    prefetch_next_epoch : once a pass has begun, read on into the next one, so it does not start by
        waiting for its first windows: epoch + 1 once ``set_epoch`` has been called (a loop calling it each
        epoch), else the same epoch again (without shuffle every epoch is the same). The threads then
        outlive a pass run to its end, holding no more than within a pass; ``stop()`` or ``close()`` ends
        them, and a pass that asks for another epoch or a resumed position starts afresh.
    output : ``"numpy"`` / ``"torch"`` for the cpu backend, ``"cupy"`` (default) / ``"torch"`` on GPU.
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
        backends), raising :class:`ReadError` naming the file, field, block and offset of a bad block before
        any of its samples is served. Default (None): off, because its measured cost is above 5 % of warm
        throughput (see docs and benchmarks/results/verify-cost-*.md). True for a dataset without checksums
        (written by an older converter, or by plain zarr) is a ValueError.

    Notes
    -----
    Blocks are the unit of reading: a block size that is a multiple of 4 KiB keeps reads aligned for GDS
    and O_DIRECT. Yielded arrays are fresh allocations, never overwritten by later reads, and ready on the
    consumer's current stream.
    """

    def __init__(self, path: str | os.PathLike[str], batch_size: int, fields: Sequence[str] | None = None, *,
                 backend: str = "auto", shuffle: bool = False, seed: int = 0, window_blocks: int | None = None,
                 prefetch: int = 2, batches_ahead: int | None = None, prefetch_next_epoch: bool = True,
                 drop_last: bool = False, output: str | None = None,
                 rank: int | None = None, world_size: int | None = None, device: int | None = None, resident_bytes: int = 64 << 20,
                 pad_to: int | str | dict[str, int | str] | None = None, pad_value: Any = 0,
                 backend_options: dict[str, Any] | None = None, verify: bool | None = None):
        started = time.perf_counter()
        _check_int("batch_size", batch_size, 1)
        _check_int("prefetch", prefetch, 1)
        _check_int("resident_bytes", resident_bytes, 0)
        for name, value in (("window_blocks", window_blocks), ("batches_ahead", batches_ahead), ("rank", rank),
                            ("world_size", world_size), ("device", device)):
            if value is not None:
                _check_int(name, value, 1 if name in ("window_blocks", "batches_ahead", "world_size") else 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int (found {type(seed).__name__})")
        if verify not in (None, True, False):
            raise TypeError(f"verify must be True, False or None (found {verify!r})")
        if isinstance(fields, str):
            fields = (fields,)
        if backend_options is not None and not isinstance(backend_options, dict):
            raise TypeError(f"backend_options must be a dict (found {type(backend_options).__name__})")
        self.backend_name, self.backend_reason = resolve(backend)
        on_gpu = self.backend_name != "cpu"
        output = output or ("cupy" if on_gpu else "numpy")
        allowed = ("cupy", "torch") if on_gpu else ("numpy", "torch")
        if output not in allowed:
            raise ValueError(f"output {output!r} does not fit backend {self.backend_name!r} (expected one of {allowed})")
        if output == "torch":
            _require_torch()
        self.output = output
        self.meta = read_metadata(path)
        self.layout = DatasetLayout(self.meta, tuple(fields) if fields is not None else None)
        self.fields = self.layout.fields
        if verify and not self.layout.has_checksums:
            self.layout.close()
            raise ValueError(f"verify=True: {self.meta.path} has no block checksums for field(s) "
                             f"{[f for f in self.fields if f not in self.layout.checksums]} (convert it again "
                             f"with 'gdsload shard' to add them, or pass verify=False)")
        self.verify = bool(verify)
        self.device = int(os.environ.get("LOCAL_RANK", 0)) if device is None else device
        if rank is None or world_size is None:
            env_rank, env_world = _distributed()
            rank = env_rank if rank is None else rank
            world_size = env_world if world_size is None else world_size
        try:
            self.backend = make_backend(self.backend_name, self.device, **(backend_options or {}))
        except BaseException:
            self.layout.close()
            raise
        try:
            spb = self.meta.samples_per_block
            fixed = [f for f in self.fields if f in self.meta.fields]
            self.ragged_fields = tuple(f for f in self.fields if f in self.meta.ragged)
            field_bytes = {f: self.meta.fields[f].block_bytes * self.meta.num_blocks for f in fixed}
            self.resident_fields = tuple(f for f in fixed if field_bytes[f] <= resident_bytes)
            self.windowed_fields = tuple(f for f in fixed if f not in self.resident_fields)
            ragged_block_bytes = {f: self.meta.ragged[f].values.sample_bytes * int(self.layout.offsets[f][-1])
                                  // self.meta.num_blocks for f in self.ragged_fields}  # mean bytes per block
            if window_blocks is None:
                block_bytes = max(1, sum(self.meta.fields[f].block_bytes for f in self.windowed_fields)
                                  + sum(ragged_block_bytes.values()))
                by_size = max(1, self.backend.window_bytes_hint // block_bytes)
                per_rank = -(-self.meta.num_blocks // max(1, world_size))
                window_blocks = max(1, min(max(-(-batch_size // spb), by_size), per_rank))
            self.config = PlanConfig(num_samples=self.meta.num_samples, samples_per_block=spb, batch_size=batch_size,
                                     window_blocks=window_blocks, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                     rank=rank, world_size=world_size)
            self.prefetch = prefetch
            self.batches_ahead = self.backend.batches_ahead_hint if batches_ahead is None else batches_ahead
            self.prefetch_next_epoch = prefetch_next_epoch
            capacity = {f: (self.meta.ragged[f], capacity_rows(self.layout.offsets[f], spb, window_blocks))
                        for f in self.ragged_fields}
            self.window_layout = WindowLayout([self.meta.fields[f] for f in self.windowed_fields], window_blocks,
                                              capacity)
            self.pad = _pad_spec(pad_to, pad_value, self.ragged_fields)
            from .verify import make_verifier

            self._verifier = make_verifier(self.layout, on_gpu, self.device) if self.verify else None
            # Last: a backend may read the whole dataset here (mmap), which a bad argument must not cost.
            self.backend.prepare(self.layout.files)
        except BaseException:
            self.backend.close()  # a bad argument must not leave pinned memory or threads behind
            self.layout.close()
            raise
        self._resident: dict[str, ResidentField] = {}  # filled on the first pass, emptied by close()
        self._resident_loaded = False
        self.epoch = 0
        self._epochs_set = False  # set_epoch() was called: the user numbers the epochs, else each pass does
        self._passes = 0  # passes begun
        self.stats: EpochStats | None = None
        self._resume: tuple[int, int] | None = None  # (epoch, batches already yielded)
        self._batches_yielded = 0
        self._plan_cache: tuple[int, EpochPlan] | None = None
        self._slots: list[WindowSlot] = []
        self._active: list[Pipeline] = []  # at most one; a list so the finalizer can see it without self
        # close() may come from any thread: it sets _closing at once (a resident load or a backend call in
        # progress stops early), then takes _lock, which starting a pass holds, so no pass starts after it.
        self._closing = threading.Event()
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _shutdown, self._active, self.backend, self._slots,
                                           self._resident, self.layout, self._closing)
        _fork.track(self)
        self.open_s = time.perf_counter() - started

    def describe(self) -> dict[str, Any]:
        """How this dataset reads, JSON-ready: backend and why, io mode, window size and buffers, read-ahead
        depths, resident fields, seconds the constructor took, and the backend's own settings and counters."""
        return {"backend": self.backend_name, "backend_reason": self.backend_reason, "io_mode": self.io_mode,
                "window_blocks": self.config.window_blocks, "window_bytes": self.window_layout.nbytes,
                "window_buffers": len(self._slots), "prefetch": self.prefetch, "batches_ahead": self.batches_ahead,
                "resident_fields": list(self.resident_fields), "open_s": self.open_s,
                "backend_stats": self.backend.stats()}

    # -- properties ------------------------------------------------------------------------------------
    @property
    def io_mode(self) -> str:
        """How bytes move: "gds", "kvikio-compat", "pinned", "pinned-odirect", "mmap-registered" or "cpu"."""
        return self.backend.io_mode

    @property
    def num_samples(self) -> int:
        return self.meta.num_samples

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return self._plan(self.epoch).num_batches

    def __repr__(self) -> str:
        c = self.config
        return (f"GDSDataset({self.meta.path!r}, batch_size={c.batch_size}, fields={list(self.fields)}, "
                f"backend={self.backend_name!r}, io_mode={self.io_mode!r}, rank={c.rank}/{c.world_size})")

    # -- epochs and resume -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (a resumed epoch keeps its position)."""
        self.epoch = int(epoch)
        self._epochs_set = True

    _cursor: resume.Cursor | None = None  # the epoch _batches_yielded counts in, and its earlier legs
    _fingerprint: resume.Fingerprint | None = None  # made on first use

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: epoch, batches yielded in it (in its current leg), the legs it was read in
        before under other world_size / batch_size / window_blocks, the config the order depends on and a
        fingerprint of the dataset. Plain and small; every rank's is the same but for ``rank``."""
        self._fingerprint = self._fingerprint or resume.fingerprint(self.meta, self.layout)
        here = self._cursor is not None and self._cursor.epoch == self.epoch
        return resume.make_state(self.config, self._fingerprint, self.epoch, self._batches_yielded if here else 0,
                                 self._cursor.hops if here else ())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, saved by any rank (all ranks' agree; ``resume.merge_states`` checks it):
        the next iteration yields exactly the batches not yet yielded. Under another world_size, batch_size
        or window_blocks the ranks share out the rest of the epoch, every sample once (docs/multi-gpu.md).
        Raises TypeError for a non-dict and ValueError naming the key for a malformed state or one of
        another dataset, seed, shuffle or drop_last; nothing changes then."""
        self._fingerprint = self._fingerprint or resume.fingerprint(self.meta, self.layout)
        cursor, start = resume.resume(state, self.config, self._fingerprint)
        self.epoch = cursor.epoch
        self._batches_yielded = start
        self._cursor = cursor
        self._resume = (cursor.epoch, start)

    def _plan(self, epoch: int) -> EpochPlan:
        cursor = self._cursor
        if cursor is not None and cursor.epoch == epoch and cursor.plan is not None:
            return cursor.plan  # the current leg of an epoch read before under other settings
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            self._plan_cache = (epoch, epoch_plan(self.config, epoch))
        return self._plan_cache[1]

    # -- iteration -------------------------------------------------------------------------------------
    def _ops(self) -> Any:
        if self.backend_name == "cpu":
            from .device import HostOps, TorchHostOps

            return TorchHostOps() if self.output == "torch" else HostOps()
        from .device import CudaOps

        return CudaOps(self.device, self.output)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        _fork.check(self)
        with self._lock:
            if not self._finalizer.alive:
                raise GDSLoadError(f"{self.meta.path}: the dataset was closed (open a new GDSDataset)")
            return self._begin()

    def _begin(self) -> Iterator[dict[str, Any]]:
        if not self._epochs_set and self._passes and not self._resume:
            self.epoch += 1  # without set_epoch, every new pass is a new epoch (as DataLoader(shuffle=True))
        self._passes += 1
        epoch = self.epoch
        resumed = self._resume if self._resume and self._resume[0] == epoch else None
        self._resume = None
        start = resumed[1] if resumed else 0
        cursor = self._cursor if resumed and self._cursor is not None else resume.Cursor(epoch)
        self._cursor, self._batches_yielded = cursor, start
        # A resumed leg after others has a plan of its own: never the one read ahead.
        if self._active and not cursor.hops and self._active[0].continues_with(epoch, start,
                                                                                any_epoch=not self.config.shuffle):
            pipeline = self._active[0]  # this pass was read ahead while the last one ran
        else:
            pipeline = self._start(epoch, start)
        self.stats = pipeline.stats
        return self._run(pipeline, start)

    def _start(self, epoch: int, start: int) -> Pipeline:
        """A new pipeline from batch ``start`` of ``epoch`` (any running one is stopped first)."""
        self._close_active()
        plan = self._plan(epoch)
        # The consumer holds the windows of its current batch while ``prefetch`` more are being read.
        needed = self.prefetch + plan.max_windows_per_batch()
        while len(self._slots) < needed:
            self._slots.append(WindowSlot(self.backend.allocate(self.window_layout.nbytes)))
        first_load = not self._resident_loaded
        resident = self._load_resident()
        pipeline = Pipeline(self.backend, self._ops(), self.layout, self.window_layout, self._slots, plan, epoch,
                            start, self.fields, resident, self.pad, ahead=self.batches_ahead,
                            plans=functools.partial(epoch_plan, self.config) if self.prefetch_next_epoch else None,
                            epoch_step=1,
                            bytes_before=sum(r.array.nbytes for r in resident.values()) if first_load else 0,
                            verifier=self._verifier)
        self._active.append(pipeline)
        return pipeline

    def _load_resident(self) -> dict[str, ResidentField]:
        """Read the small fields whole, once, through the same backend."""
        if not self._resident_loaded:
            loaded = {}
            for name in self.resident_fields:
                f = self.meta.fields[name]
                single = WindowLayout([f], self.meta.num_blocks)
                buf = self.backend.allocate(single.nbytes)
                blocks = np.arange(self.meta.num_blocks)
                try:
                    event = self.backend.fill(buf, single.requests(self.layout, blocks), self._closing)
                    if self._closing.is_set():
                        raise GDSLoadError(f"{self.meta.path}: the dataset was closed while loading field '{name}'")
                    if self._verifier is not None:
                        event = self._verifier.check(buf, single.checks(self.layout, blocks), event)
                except ReadError as e:
                    raise ReadError(f"{e} (reading resident field '{name}')") from e
                if event is not None:
                    event.synchronize()
                loaded[name] = ResidentField(f, single.view(buf, name))
            self._resident.update(loaded)
            self._resident_loaded = True
        return self._resident

    def _run(self, pipeline: Pipeline, start: int) -> Iterator[dict[str, Any]]:
        self._batches_yielded = start
        try:
            for batch in pipeline.batches():
                self._batches_yielded += 1
                yield batch
        finally:
            # A pass left early (or failed) has closed its pipeline; one run to its end reads on.
            if pipeline.closed:
                with contextlib.suppress(ValueError):  # close() from another thread may have taken it
                    self._active.remove(pipeline)

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


def _pad_spec(pad_to: Any, pad_value: Any, ragged: tuple[str, ...]) -> dict[str, tuple[int | None, Any]]:
    """pad_to as given by the user -> {field: (width or None for the batch's longest, pad value)}."""
    if pad_to is None:
        return {}
    per_field = pad_to if isinstance(pad_to, dict) else {f: pad_to for f in ragged}
    spec = {}
    for name, width in per_field.items():
        if name not in ragged:
            raise ValueError(f"pad_to names {name!r}, which is not a variable-length field read here {list(ragged)}")
        if width is None:
            continue
        if width != "max" and (not isinstance(width, int) or width < 0):
            raise ValueError(f"pad_to for {name!r} must be a non-negative int or 'max' (found {width!r})")
        spec[name] = (None if width == "max" else width, pad_value)
    return spec


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int (found {type(value).__name__} {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum} (found {value})")


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"output='torch' needs PyTorch, which is not installed ({e}); install it with "
                                 f"pip install 'gdsload[torch]', or use the default output") from e


def _shutdown(active: list[Pipeline], backend: Any, slots: list[WindowSlot],
              resident: dict[str, ResidentField], layout: DatasetLayout, closing: threading.Event) -> None:
    closing.set()
    while active:
        active.pop().close()
    backend.close()
    slots.clear()
    resident.clear()
    layout.close()
