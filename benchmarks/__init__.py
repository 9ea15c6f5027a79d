"""gdsload's benchmarks, run as modules from the repository root (``python -m benchmarks.suite --quick``). Results
go to ``benchmarks/results/<machine>/``; docs/benchmarks.md says how each is measured."""
