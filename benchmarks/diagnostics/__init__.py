"""Diagnostics behind the defaults, run one at a time on the GPU machine:

    python -m benchmarks.diagnostics.probe_step       # per-batch timeline of the consumer beside a step
    python -m benchmarks.diagnostics.probe_overhead   # each step timed on GPU and host, piece by piece
    python -m benchmarks.diagnostics.probe_mmap       # the mmap backend: open, copy streams, consumer stream
    python -m benchmarks.diagnostics.verify_cost      # what verify=True costs each backend
    python -m benchmarks.diagnostics.profile passes   # passes to sample with py-spy; 'summary' reads its output
    python -m benchmarks.diagnostics.probe_startup    # open and first batch per backend, warm, with cProfile
    python -m benchmarks.diagnostics.probe_nvcomp     # nvCOMP's Codec beside CuPy: threads, streams, views
    python -m benchmarks.diagnostics.probe_pinned_alloc  # cudaHostAlloc against registered pages: setup, H2D

They use only gdsload's public surface (``GDSDataset``, ``describe()``, ``stats``, ``backend_options``) and
:mod:`gdsload.measure`; none reads private attributes or patches the library.
"""
