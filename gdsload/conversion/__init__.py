"""Writing datasets: sources, the converter, its checks and the atomic publication of its output."""
