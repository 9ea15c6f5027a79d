"""CUDA helpers below every layer that touches the device: events, enum values, compiled kernels, the
assembler's gathers. CuPy is imported inside the functions, so importing this package costs nothing."""
