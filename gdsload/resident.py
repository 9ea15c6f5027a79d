"""Resident fields: small fields read whole, once, through the dataset's backend, and kept for its life."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .assembler import ResidentField
from .errors import GDSLoadError, ReadError
from .format import FieldMeta
from .verify import Verification
from .window import WindowBuffer, WindowLayout


def read_resident(f: FieldMeta, backend: Any, layout: Any, decoder: Any, verification: Verification | None,
                  host_decoded: Any, closing: threading.Event) -> ResidentField:
    """Field ``f`` whole: every chunk back to back, a block per chunk, so row i holds sample i whatever the
    plan's block is; decoded and checked as windows are. A ReadError names the field; a close while it
    loads is a GDSLoadError."""
    single = WindowLayout([f], f.num_chunks, samples_per_block=f.samples_per_block,
                          chunk_lengths=layout.chunk_lengths, host_fields=host_decoded)
    wb = WindowBuffer(backend.allocate(single.nbytes))  # held until the end: its host buffer feeds copies
    buf = wb.buffer
    blocks = np.arange(f.num_chunks)
    try:
        work = single.work(layout, blocks)
        event = backend.load(buf, work.requests, closing)
        if not closing.is_set() and f.compressed:
            event = decoder.start(wb, work, closing).finish(event)
        if closing.is_set():  # before anything is decoded from a read cut short
            raise GDSLoadError(f"{layout.meta.path}: the dataset was closed while loading field '{f.name}'")
        checks = verification.checks(single)(blocks) if verification is not None else None
        if checks is not None and len(checks.lo):
            event = verification.check(buf, checks, event)  # type: ignore[union-attr]
    except ReadError as e:
        raise type(e)(f"{e} (reading resident field '{f.name}')") from e
    if event is not None:
        event.synchronize()
    return ResidentField(f, single.view(buf, f.name))
