"""The command line and what only it uses: benchmarks, doctor, the audit behind ``gdsload verify``,
bandwidth measures and simulated steps. Nothing in the loader imports this package."""
