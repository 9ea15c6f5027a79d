"""How many reader threads, and how large a staging buffer, a backend makes by default: from this rank's share
of the cores (:func:`gdsload.system.env.rank_cores`) and the ranks on the machine."""

from __future__ import annotations

#: The readers' default where cores allow, as KvikIO's pool by default (the pinned backend's other readers too).
DEFAULT_THREADS = 16
#: Threads of the pipeline busy beside the native readers (submitter, completer, assembler, the consumer):
#: the native reader's default leaves them their cores, since its workers spin while their copies run and
#: readers on every core starve those threads (docs/design.md, "pinned and the staging pool").
PIPELINE_THREADS = 4
# The native stager's buffers: two per thread, smaller where other ranks of the job stage on the same
# machine, whose staging shares the host's caches and memory bandwidth (docs/benchmarks.md, "Multi-GPU").
NATIVE_BUF_BYTES = 4 << 20
NATIVE_SHARED_BUF_BYTES = 2 << 20
NATIVE_BUFS_PER_THREAD = 2


def reader_threads(cores: int, reserved: int) -> int:
    """Reader threads by default on ``cores`` cores (this rank's share, :func:`gdsload.system.env.rank_cores`):
    ``DEFAULT_THREADS`` at most, ``reserved`` cores left to the pipeline's own threads, two readers at least."""
    return max(2, min(DEFAULT_THREADS, cores - reserved))


def native_threads(cores: int) -> int:
    """The native reader's default thread count on ``cores`` cores: the pipeline's busy threads
    (``PIPELINE_THREADS``) keep their cores."""
    return reader_threads(cores, PIPELINE_THREADS)


def native_buf_bytes(ranks: int) -> int:
    """The native reader's default buffer size with ``ranks`` processes of the job on this machine."""
    return NATIVE_BUF_BYTES if ranks <= 1 else NATIVE_SHARED_BUF_BYTES
