"""One pipeline serving several sources (a mixture's): three threads, whatever the number of sources.

The submitter walks the steps (steps.py) a group at a time and submits the windows they touch in the order the
batches need them, each through its source's reader into one of that source's buffers; the completer
finishes them in that order; the assembler gathers each batch straight from the windows (mixed_gather.py) and
releases the windows it is done with. A source holds the buffers a group needs plus ``extra`` (no wait can
deadlock). Stopping and hand-off as in pipeline.py; the design: docs/mixtures.md, "One pipeline for every
source".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn


from ..backends.handoff import POLL_S, Handoff
from ..codecs.verify import Verdict
from ..cuda.ops import Ops
from ..errors import GDSLoadError, with_context
from .assembler import Assembler
from .complete import complete, raise_failure, settle, take_ready
from .feeds import Feed, FeedPass, Part, Passes, Walk
from .mixed_gather import GroupGather, Key
from .pacing import Pacer
from .steps import Step, Steps
from .reader import InFlight
from .window import WindowBuffer

_END = object()
_CLOSED = "this iterator was closed (the mixture was closed or a new pass over it started)"
#: Steps the submitter walks ahead of the assembler at most (it also waits for window buffers): the schedule
#: is made that far ahead.
LEAD_STEPS = 128
#: Steps gathered together at most (small samples): a group holds every window it touches until it is gathered.
MAX_GROUP = 32


class _Failure(NamedTuple):
    error: BaseException
    feed: int = -1
    where: str = ""


class _Submitted(NamedTuple):
    feed: int
    p: FeedPass
    window: int
    buffer: WindowBuffer
    inflight: InFlight


class _Filled(NamedTuple):
    key: Key
    buffer: WindowBuffer
    event: Any
    verdict: Verdict | None


class Mixed(NamedTuple):
    """A batch: step ``step``, each source's ``counts`` and ``nbytes``, the schedule after it (``after``)."""

    step: int
    arrays: dict[str, Any]
    counts: tuple[int, ...]
    nbytes: tuple[int, ...]
    after: Any
    ready: Any


class MixedPipeline:
    """Batches of ``steps`` from ``start`` on, read from ``feeds`` (see the module's docstring); ``ahead``
    batches are assembled before the consumer takes them, ``group`` steps at a time (one allocation and one
    gather per field for the group where every field is fixed; 1 where a field has variable length); ``extra``:
    per source, window buffers beyond those a group needs (default none)."""

    def __init__(self, ops: Ops, feeds: Sequence[Feed], steps: Steps, start: int, ahead: int = 2, group: int = 1,
                 extra: Sequence[int] = ()):
        self.ops, self.feeds, self.steps, self.start = ops, list(feeds), steps, start
        #: Per source, window buffers beyond those a group needs: windows read ahead while its others are gathered.
        self.extra = list(extra) or [0] * len(self.feeds)
        self.group = max(1, group)
        self.asm = [Assembler(ops, f.reader.window_map, f.reader.layout.offsets, f.fields, dict(f.resident), f.pad)
                    for f in self.feeds]
        self._threads: list[threading.Thread] = []
        self.passes = [Passes(f, a, lambda: threading.current_thread() in self._threads)
                       for f, a in zip(self.feeds, self.asm)]
        self.bytes_read = [0] * len(self.feeds)  # per source, by the completer
        self.passes_begun = [0] * len(self.feeds)  # per source, as the assembler enters them
        self._stop, self._halt = threading.Event(), threading.Event()
        self._free: list[queue.Queue[WindowBuffer | None]] = [queue.Queue() for _ in self.feeds]
        for q, f in zip(self._free, self.feeds):
            for b in f.buffers:
                q.put(b)
        self._inflight: queue.Queue[Any] = queue.Queue()
        self._ready: queue.Queue[Any] = queue.Queue()
        self._assembled = Handoff(max(1, ahead))
        self._progress = threading.Condition()
        self._assembled_to = start  # the first step the assembler has not gathered
        self._resume_at: int | None = None  # the step the submitter waits for the assembler to reach
        self._forgot = [0] * len(self.feeds)  # per source, the passes before it are forgotten
        self._sub_pass = [0] * len(self.feeds)  # the pass each source's submitter walk is in
        self._closed = False
        self._gather = GroupGather(ops, self.feeds, self.asm)
        self._threads += [threading.Thread(target=self._submit_loop, name="gdsload-reader-submit", daemon=True),
                          threading.Thread(target=self._complete_loop, name="gdsload-reader-complete", daemon=True),
                          threading.Thread(target=self._assemble_loop, name="gdsload-reader-assemble", daemon=True)]
        ops.begin()
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- reader threads ------------------------------------------------------------------------------
    def _group(self, walks: list[Walk], step: int, pace: Pacer | None = None
               ) -> list[tuple[int, Step, list[list[Part]]]]:
        """Steps ``step .. step + group - 1``: each with its schedule step and every source's parts (``pace``
        called after each: the submitter makes the schedule ahead beside the consumer's steps)."""
        out = []
        for s in range(step, step + self.group):
            if pace is not None:
                pace()
            st = self.steps.get(s)
            out.append((s, st, [w.take(c) for w, c in zip(walks, st.counts)]))
        return out

    def _submit_loop(self) -> None:
        walks = [Walk(p) for p in self.passes]
        last: list[tuple[int, int]] = [(-1, -1)] * len(walks)  # per source, the last window submitted
        expected = [-1] * len(walks)
        pace, step, where = Pacer(), self.start, (-1, "")
        try:
            while self._may_walk(step):
                touched: list[dict[tuple[int, int], FeedPass]] = [{} for _ in walks]
                pace.start()
                for _, _, parts in self._group(walks, step, pace):
                    for i, ps in enumerate(parts):
                        for part in ps:
                            for w in part.windows():
                                touched[i][(part.p.k, w)] = part.p
                for i, windows in enumerate(touched):
                    self._sub_pass[i] = walks[i].k
                    for (k, w), p in windows.items():
                        if (k, w) <= last[i]:
                            continue
                        where = (i, p.describe(w))
                        if expected[i] != k:  # a remote dataset's shards: fetched ahead of this pass's windows
                            self.feeds[i].reader.expect(p.plan.windows[w:])
                            expected[i] = k
                        buf = self._next_free(i, len(windows))
                        if buf is None:
                            return
                        self.ops.synchronize(buf.released)  # the last gather from it is done
                        pace.start()
                        inflight = self.feeds[i].reader.submit(buf, p.plan.windows[w], self._halt, pace)
                        self._inflight.put(_Submitted(i, p, w, buf, inflight))
                        last[i] = (k, w)
                step += self.group
        except BaseException as e:
            self._inflight.put(_Failure(e, *where))
        finally:
            self._inflight.put(_END)

    def _may_walk(self, step: int) -> bool:
        """Wait, once ``step`` is :data:`LEAD_STEPS` ahead of the assembler, until it is half that (the
        assembler wakes this thread once then, not every step); False once reading stops."""
        if step - self._assembled_to <= LEAD_STEPS:
            return not self._halt.is_set()
        with self._progress:
            self._resume_at = step - LEAD_STEPS // 2
            while self._assembled_to < self._resume_at:
                if self._halt.is_set():
                    return False
                self._progress.wait(POLL_S)
            self._resume_at = None
        return not self._halt.is_set()

    def _next_free(self, i: int, need: int) -> WindowBuffer | None:
        """A free window buffer of source ``i``: a new one where the group being submitted touches ``need`` of its
        windows (the one it starts in, partly taken, among them) and it has fewer than that plus its ``extra``
        (the assembler holds every window of a group at once: fewer could deadlock); else one the assembler
        releases (any other it holds is done with before this group). None once reading stops."""
        f, free = self.feeds[i], self._free[i]
        while not self._halt.is_set():
            try:
                return free.get_nowait()
            except queue.Empty:
                pass
            if len(f.buffers) < need + self.extra[i]:
                buf = f.allocate()
                f.buffers.append(buf)
                return buf
            try:
                return free.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def _complete_loop(self) -> None:
        def filled(item: _Submitted, done: Any) -> _Filled:
            self.bytes_read[item.feed] += item.inflight.read_bytes
            return _Filled((item.feed, item.p.k, item.window), item.buffer, done.event, done.verdict)
        complete(self._inflight, self._ready, self._halt, _END, _Failure,
                 lambda item, e: _Failure(e, item.feed, item.p.describe(item.window)), filled)

    # -- assembler thread ----------------------------------------------------------------------------
    def _take_ready(self) -> _Filled | None:
        """The next filled window, or None once the pipeline stops; a reader's error raised with its context."""
        return take_ready(self._ready, self._stop, _END, _Failure, "readers", self._raise)

    def _raise(self, item: _Failure) -> NoReturn:
        feed = self.feeds[item.feed] if item.feed >= 0 else self.feeds[0]
        e = item.error
        raise_failure(feed.reader.named(e) if isinstance(e, GDSLoadError) else e, feed.reader.meta.path,
                      f"source {feed.name!r}" + (f", {item.where}" if item.where else ""), e)

    def _assemble_loop(self) -> None:
        held: dict[Key, WindowBuffer] = {}
        verdicts: dict[Key, Verdict] = {}
        waited: set[tuple[int, int]] = set()
        walks = [Walk(p) for p in self.passes]
        step, first = self.start, True

        def confirm(key: Key) -> None:
            verdict = verdicts.pop(key, None)
            if verdict is not None:
                try:
                    verdict.confirm()
                except GDSLoadError as e:
                    raise with_context(e, f"reading source {self.feeds[key[0]].name!r}") from e
        try:
            while not self._stop.is_set():
                batches = self._group(walks, step)
                for key in [(i, part.p.k, w) for _, _, parts in batches for i, ps in enumerate(parts)
                            for part in ps for w in part.windows()]:
                    while key not in held:  # windows arrive in the order the batches need them
                        got = self._take_ready()
                        if got is None:
                            return
                        self.ops.wait(got.event)
                        held[got.key] = got.buffer
                        if got.verdict is not None and not got.verdict.confirmed:
                            verdicts[got.key] = got.verdict
                with self.ops.scope():
                    outs = self._gather.gather(batches, held, waited)
                    for i, walk in enumerate(walks):  # windows wholly taken go back to their source's readers
                        for key in [k for k in held if k[0] == i and _done(k, walk)]:
                            confirm(key)
                            buf = held.pop(key)
                            buf.released = self.ops.record()
                            self._free[i].put(buf)
                for key in list(verdicts):
                    confirm(key)
                ready = self.ops.record()
                for s, st, arrays, nbytes in outs:
                    if not self._assembled.put(Mixed(s, arrays, st.counts, nbytes, st.after, ready), self._stop):
                        return
                if first:  # what a backend kept back (mmap's bulk load) no longer competes with the first batch
                    for f in self.feeds:
                        f.reader.started()
                    first = False
                step += self.group
                self._passed(step, walks)
        except BaseException as e:
            self._halt.set()
            self._assembled.put(_Failure(e), self._stop)

    def _passed(self, step: int, walks: list[Walk]) -> None:
        """The assembler is done with the steps before ``step``: the submitter may walk on, and passes and
        steps no thread asks for again are dropped."""
        self._assembled_to = step
        if self._resume_at is not None and step >= self._resume_at:
            with self._progress:
                self._progress.notify_all()
        self.steps.forget(step)
        for i, (walk, passes) in enumerate(zip(walks, self.passes)):
            self.passes_begun[i] = walk.entered + 1
            low = min(walk.k, self._sub_pass[i])
            if low > self._forgot[i]:
                passes.forget(low)
                self._forgot[i] = low

    # -- consumer ------------------------------------------------------------------------------------
    def next(self) -> tuple[Mixed, dict[str, Any], float]:
        """The next batch (its arrays ready on the consumer's current stream) and the seconds waited for it."""
        if self._closed:
            raise GDSLoadError(_CLOSED)
        waited = 0.0
        try:
            item = self._assembled.take_ready()
        except queue.Empty:
            t0 = time.perf_counter()
            item = self._assembled.get(self._stop)
            waited = time.perf_counter() - t0
        if item is None or self._closed:
            raise GDSLoadError(_CLOSED)
        if isinstance(item, _Failure):
            raise item.error
        self.ops.hand_over(item.ready)
        batch = self.ops.export(item.arrays)
        self._assembled.release()  # last: the assembler wakes as the consumer's step starts
        return item, batch, waited

    def close(self) -> None:
        """Stop the threads and wait for them; idempotent, safe from any thread but the pipeline's own."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._halt.set()
        for q in self._free:
            q.put(None)  # the submitter, for a window buffer
        self._ready.put(None)  # the assembler, for a window
        self._assembled.clear()  # the assembler, to hand a batch to a full queue
        settle(self._threads, self.ops, [f.reader for f in self.feeds], [b for f in self.feeds for b in f.buffers])


def _done(key: Key, walk: Walk) -> bool:
    """Whether a walk has taken every sample of window ``key``."""
    _, k, w = key
    if k != walk.k:
        return k < walk.k
    return int(walk.current.starts[w + 1]) <= walk.pos


