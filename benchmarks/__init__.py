"""gdsload's benchmarks, run as modules from the repository root (``python -m benchmarks.suite --quick``).

suite (the benchmark of record; report renders its JSON), sweep (tunables by name), scaling (ranks),
shuffle_quality (no I/O), verify_cost (what ``verify`` costs). Measuring primitives that work on any dataset
live in :mod:`gdsload.tools.measure`; results go to ``benchmarks/results/<machine>/``.
"""
