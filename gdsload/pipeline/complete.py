"""The completer thread's loop, one for the pipelines of one source and of several: submitted windows finished in
order, each handed on with its data's event and its check, and, after an error or a stop, everything still
submitted drained, so that no read writes into a buffer once the thread has ended."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from ..backends.handoff import get
from ..errors import DecodeError
from ..errors import GDSLoadError, ReadError, with_context


def complete(submitted: queue.Queue[Any], ready: queue.Queue[Any], halt: threading.Event, end: object,
             failed: type, on_error: Callable[[Any, BaseException], Any], on_filled: Callable[[Any, Any], Any]) -> None:
    """Take items from ``submitted`` until ``end``: a ``failed`` item (the submitter's error) stops reading and goes
    on to ``ready`` as it is; any other is finished (``item.inflight.finish(halt)``) and ``on_filled(item, filled)``
    goes on, or ``on_error(item, error)`` where finishing failed. After ``halt`` nothing more goes on, but every
    item is still finished or drained (``finish`` leaves no read in flight either way)."""
    while True:
        item = submitted.get()
        if item is end:
            if not halt.is_set():
                ready.put(end)
            return
        if isinstance(item, failed):
            halt.set()
            ready.put(item)
            continue
        try:
            filled = item.inflight.finish(halt)
        except BaseException as e:
            if not halt.is_set():
                halt.set()
                ready.put(on_error(item, e))
            continue
        if not halt.is_set():
            ready.put(on_filled(item, filled))


def raise_failure(error: BaseException, path: str, where: str, cause: BaseException | None = None) -> NoReturn:
    """Raise a reader's ``error`` in the assembler, saying what was read (``where``): a GDSLoadError (its message
    starts with its file) with that context added, anything else as a ReadError naming ``path``; chained to
    ``cause`` (default: ``error``; the error as the reader raised it, where ``error`` is it renamed)."""
    if isinstance(error, GDSLoadError):
        raise with_context(error, f"reading {where}") from (cause or error)
    raise ReadError(f"{path}: reading {where} failed ({type(error).__name__}: {error})") from (cause or error)


def take_ready(ready: queue.Queue[Any], stop: threading.Event, end: object, failed: type, what: str,
               on_failure: Callable[[Any], NoReturn]) -> Any:
    """The assembler's next item from ``ready``: None once ``stop`` is set, ``on_failure(item)`` for a ``failed``
    one (it raises), a ReadError naming ``what`` ended early where ``end`` comes before the batches are done."""
    item = get(ready, stop)
    if item is None:
        return None
    if item is end:
        raise ReadError(f"internal error: the {what} finished before the batches did")
    if isinstance(item, failed):
        on_failure(item)
    return item


def settle(threads: Any, ops: Any, readers: Any, buffers: Any) -> None:
    """A stopping pipeline's end, once its threads were told to stop: ``threads`` joined (all but the caller's),
    what its ``readers``' backends do ahead of reads ended, then the GPU work it queued ends before anything it
    used changes hands (its gathers and uploads, whose memory is handed out again at once, and copies still
    writing into window buffers the next pipeline fills on another stream), then ``buffers`` are marked free of
    it. A decode still
    running after its bound is a DecodeError, raised here and kept as each reader's ``unsettled`` for its close()
    to raise again (a pass left by a break stops its pipeline in a generator's finalizer, where nobody sees an
    error); any other failure means the interpreter or the CUDA context is shutting down, with nothing left to
    order against."""
    for t in threads:
        if t.is_alive() and t is not threading.current_thread():
            t.join()
    for reader in readers:
        reader.idle()  # no read is in flight any more
    try:
        ops.quiesce()
        for reader in readers:
            reader.quiesce()
    except DecodeError as e:
        for reader in readers:
            reader.unsettled = e
        raise
    except Exception:
        return
    for b in buffers:
        b.released = None  # nothing of this pipeline reads them any more
