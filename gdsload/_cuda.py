"""CUDA helpers shared by the backends, the staging pool, the assembler and the verifier: ordering events
and the runtime's enum values. CuPy is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

H2D = 1  # cudaMemcpyHostToDevice
D2D = 3  # cudaMemcpyDeviceToDevice
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def new_event(blocking: bool = True) -> Any:
    """A CuPy event for ordering only, without timing (timing events cost more to record, wait on and
    query; ``Stream.record()`` makes those). ``blocking``: a thread waiting on it sleeps instead of spinning
    in the driver, leaving the core to the consumer; without it, a waiting thread resumes sooner."""
    import cupy

    return cupy.cuda.Event(block=blocking, disable_timing=True)


def record_event(stream: Any) -> Any:
    """A :func:`new_event` recorded on ``stream``."""
    return stream.record(new_event())
