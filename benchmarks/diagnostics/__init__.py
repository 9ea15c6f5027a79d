"""Diagnostics for questions that come back, run one at a time on the GPU machine:

    python -m benchmarks.diagnostics.probe_step          # where a training step's extra time goes, per batch
    python -m benchmarks.diagnostics.probe_bursts        # passes that wait more: the loader's or the machine's
    python -m benchmarks.diagnostics.probe_startup       # open and first batch per backend (--fresh: new processes)
    python -m benchmarks.diagnostics.verify_cost         # what verify and zarr's crc32c codec cost each backend
    python -m benchmarks.diagnostics.probe_copy_engines  # does a device copy wait behind host-to-device copies

They use gdsload's public API only (``from gdsload import ...``, ``describe()``, ``stats``, constructor
options) and the measuring tools that ``benchmarks.common`` imports; none reads a private name of the library
or patches it. What the removed probes found is in docs/benchmarks.md; their code is in git history.
"""
