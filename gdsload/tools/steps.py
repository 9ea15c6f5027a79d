"""Simulated training steps for the benchmarks: a fixed duration of device work per batch, waited for every
``sync_every`` steps, so a loader's waiting can be timed beside work of known length (gdsload.tools.measure).
CuPy is imported by the GPU step only: the host step runs on a machine without a GPU."""

from __future__ import annotations

import time

import numpy as np


class Step:
    """A simulated training step of fixed duration per batch, with the host waiting for it after every
    ``sync_every`` steps (1: each step, as ``loss.item()``, the worst case for a loader, whose ``next()``
    then lies between two steps; more: the host runs ahead, as a loop that reads its loss now and then).
    Subclasses say how a step is launched and waited for."""

    def __init__(self, ms: float, sync_every: int = 1):
        if ms <= 0 or sync_every < 1:
            raise ValueError(f"step needs ms > 0 and sync_every >= 1 (found {ms}, {sync_every})")
        self.ms, self.sync_every = ms, sync_every
        self._calls = 0

    def launch(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def __call__(self) -> None:
        self.launch()
        self._calls += 1
        if self._calls % self.sync_every == 0:
            self.synchronize()

    def alone(self, steps: int) -> float:
        """Seconds ``steps`` steps take with no data to wait for, timed now. A pass's wall time beyond this
        is time spent waiting for data, seen from outside (host waits, device-side waits and gathers alike):
        time it right before the pass it is compared with, since launch latency drifts within a run."""
        self()
        self.finish()
        t0 = time.perf_counter()
        for _ in range(steps):
            self()
        self.finish()
        return time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for every step queued, and count the next ones from a fresh start: whatever was timed
        before, the steps that follow sync at the same points as the steps alone did."""
        self.synchronize()
        self._calls = 0


class Spin(Step):
    """The GPU step: one kernel on the current stream spinning on the GPU's nanosecond global timer (not on
    clock cycles, whose duration follows the clock the GPU happens to run at). ``launch(stamps)`` with a
    device uint64 pointer writes the kernel's start and end times there (two words)."""

    def __init__(self, ms: float, sync_every: int = 1):
        super().__init__(ms, sync_every)
        import cupy

        self.cupy = cupy
        self.ns = np.uint64(round(ms * 1e6))
        self.kernel = cupy.RawKernel(r"""
        extern "C" __global__ void spin(unsigned long long ns, unsigned long long* stamps) {
            unsigned long long t0, t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
            if (stamps) { stamps[0] = t0; stamps[1] = t; }
        }""", "spin")
        self._null = np.uint64(0)

    def launch(self, stamps: np.uint64 | None = None) -> None:
        self.kernel((1,), (1,), (self.ns, self._null if stamps is None else stamps))

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


class HostStep(Step):
    """The step without a GPU: a simulated device queue. A launch queues ``ms`` of work behind what is
    queued; a synchronize sleeps until the queue has drained (releasing the GIL, as a CUDA sync does)."""

    def __init__(self, ms: float, sync_every: int = 1):
        super().__init__(ms, sync_every)
        self._busy_until = 0.0

    def launch(self) -> None:
        self._busy_until = max(time.perf_counter(), self._busy_until) + self.ms / 1e3

    def synchronize(self) -> None:
        while (left := self._busy_until - time.perf_counter()) > 0:
            time.sleep(left)


def make_step(ms: float, sync_every: int = 1, gpu: bool = True) -> Step:
    """:class:`Spin` on a GPU, else :class:`HostStep`."""
    return Spin(ms, sync_every) if gpu else HostStep(ms, sync_every)
