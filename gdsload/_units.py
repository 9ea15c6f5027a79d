"""The one alignment rule: offsets and sizes that are multiples of 4 KiB.

O_DIRECT reads and GPUDirect Storage need file offsets, sizes and (host) buffer addresses aligned to the
filesystem's logical block, 4 KiB on every filesystem gdsload targets; the converter lays blocks out on
this boundary where it can, and buffers place each region on it.
"""

ALIGN = 4096


def align_up(n: int) -> int:
    """The smallest multiple of :data:`ALIGN` that is at least ``n``."""
    return -(-n // ALIGN) * ALIGN
