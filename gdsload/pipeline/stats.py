"""What one pass over the data cost, as the consumer saw it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EpochStats:
    """One pass: batches and samples yielded, bytes read from storage and bytes handed to the consumer,
    wall time, and the time the consumer waited for data.

    ``bytes_read`` counts what the pass read (resident fields count on the first pass only: they are read
    once); ``bytes_delivered`` counts the batches' bytes, so ``gb_per_s`` is the rate data reached the
    consumer whichever tier it came from. ``stall_s`` is time spent blocked in ``next()``;
    ``first_batch_s`` is the part of it spent waiting for the pass's first batch; ``read_ahead``: the pass was
    read ahead while the one before it ran (its pipeline went on into it; no new start)."""

    io_mode: str
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0
    bytes_delivered: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    first_batch_s: float = 0.0
    read_ahead: bool = False

    @property
    def gb_per_s(self) -> float:
        """Bytes delivered per second of the pass's wall time, in GB/s."""
        return self.bytes_delivered / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"io_mode": self.io_mode, "batches": self.batches, "samples": self.samples,
                "bytes_read": self.bytes_read, "bytes_delivered": self.bytes_delivered, "wall_s": self.wall_s,
                "stall_s": self.stall_s, "first_batch_s": self.first_batch_s, "read_ahead": self.read_ahead,
                "gb_per_s": self.gb_per_s}
