"""The one alignment unit of gdsload: 4 KiB.

Reads that bypass the page cache (``O_DIRECT``) and GPUDirect Storage (cuFile) need file offsets, sizes
and buffer addresses that are multiples of 4 KiB: ``O_DIRECT`` refuses anything else (EINVAL), and cuFile
takes it only through its own bounce buffers instead of reading straight into GPU memory. Layouts that
are to be read that way (block sizes chosen by the converter, positions of fields in a window buffer,
staging slots) are therefore rounded to this unit. Every such rounding uses :data:`ALIGN` and
:func:`align_up`, never a literal 4096.
"""

from __future__ import annotations

#: Alignment, in bytes, of offsets and sizes read with O_DIRECT or GPUDirect Storage.
ALIGN = 4096


def align_up(n: int) -> int:
    """The smallest multiple of :data:`ALIGN` that is at least ``n`` (``n`` >= 0; 0 stays 0)."""
    return -(-n // ALIGN) * ALIGN
