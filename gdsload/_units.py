"""The one alignment unit of gdsload, 4 KiB, and sizes as people read them.

Layouts read through O_DIRECT or GPUDirect Storage (block sizes, field regions of a window buffer, staging
slots) are rounded to it with :data:`ALIGN` and :func:`align_up`, never a literal 4096 (why 4 KiB:
docs/design.md, "Glossary", unit).
"""

from __future__ import annotations

#: Alignment, in bytes, of offsets and sizes read with O_DIRECT or GPUDirect Storage.
ALIGN = 4096


def align_up(n: int) -> int:
    """The smallest multiple of :data:`ALIGN` that is at least ``n`` (``n`` >= 0; 0 stays 0)."""
    return -(-n // ALIGN) * ALIGN


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: ``512 B``, ``4.0 KiB``, ``1.5 GiB`` (binary units, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
