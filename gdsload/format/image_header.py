"""An encoded image's format and size from its header, and whether its end is there (pure Python, no decode).

Height and width come from the JPEG frame header (the SOF segment) or the PNG ``IHDR`` chunk, found by walking
the markers or chunks; a file must end as its format ends (JPEG ``FFD9``, PNG ``IEND``), which catches one cut
short. Anything else is an :class:`ImageHeaderError` saying what is wrong, for the caller to name the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: The image formats the converter stores, by the name recorded in the dataset's metadata.
FORMATS = ("jpeg", "png")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SOI = b"\xff\xd8"
JPEG_EOI = b"\xff\xd9"
#: Start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic): not DHT (C4),
#: JPG (C8) or DAC (CC), which share the range.
SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
#: Markers without a length field: TEM, RST0-7, SOI.
STANDALONE = frozenset({0x01, *range(0xD0, 0xD8), 0xD8})
#: How far from the end the end marker may lie (some writers pad a file after it).
END_SLACK = 64


class ImageHeaderError(ValueError):
    """Not a complete JPEG or PNG file; the message says why."""


@dataclass(frozen=True)
class ImageInfo:
    """What the header says: the format (one of :data:`FORMATS`), height and width in pixels."""

    format: str
    height: int
    width: int


Read = Callable[[int, int], bytes]  # (offset, count) -> at most count bytes from offset


def sniff(head: bytes) -> str | None:
    """The format whose signature ``head`` starts with, or None."""
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head.startswith(JPEG_SOI + b"\xff"):
        return "jpeg"
    return None


def probe(read: Read, size: int) -> ImageInfo:
    """Format, height and width of the ``size`` bytes that ``read`` gives, checked to end as the format ends;
    :class:`ImageHeaderError` otherwise."""
    head = read(0, 32)
    kind = sniff(head)
    if kind is None:
        raise ImageHeaderError(f"not a JPEG or PNG file (starts with {head[:8].hex() or 'nothing'}; "
                               f"{size} bytes)")
    info = _png(head, size) if kind == "png" else _jpeg(read, size)
    tail = read(max(0, size - END_SLACK), END_SLACK)
    if kind == "jpeg" and JPEG_EOI not in tail:
        raise ImageHeaderError(f"truncated JPEG: no end-of-image marker (FFD9) in its last {END_SLACK} bytes "
                               f"({size} bytes)")
    if kind == "png" and b"IEND" not in tail:
        raise ImageHeaderError(f"truncated PNG: no IEND chunk in its last {END_SLACK} bytes ({size} bytes)")
    return info


def probe_bytes(data: bytes) -> ImageInfo:
    """:func:`probe` of bytes in memory."""
    return probe(lambda offset, count: data[offset:offset + count], len(data))


def _png(head: bytes, size: int) -> ImageInfo:
    """The IHDR chunk, which must come first: length 13, then width and height (big-endian, at least 1)."""
    if len(head) < 24 or size < 33:
        raise ImageHeaderError(f"truncated PNG: {size} bytes, shorter than a signature and IHDR chunk (33)")
    if int.from_bytes(head[8:12], "big") != 13 or head[12:16] != b"IHDR":
        raise ImageHeaderError(f"bad PNG header: the first chunk is {head[12:16]!r} of length "
                               f"{int.from_bytes(head[8:12], 'big')} (expected IHDR of length 13)")
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if not (0 < width < 2**31 and 0 < height < 2**31):
        raise ImageHeaderError(f"bad PNG header: size {width}x{height} (expected 1 to 2**31 - 1 each)")
    return ImageInfo("png", height, width)


def _jpeg(read: Read, size: int) -> ImageInfo:
    """Walk the marker segments from SOI to the first start-of-frame; its height and width."""
    pos = 2
    while True:
        head = read(pos, 2)
        if len(head) < 2:
            raise ImageHeaderError(f"truncated JPEG: no frame header (SOF) before the end ({size} bytes)")
        if head[0] != 0xFF:
            raise ImageHeaderError(f"bad JPEG header: byte {head[0]:#04x} at offset {pos} where a marker "
                                   f"(0xff) was expected")
        marker = head[1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in STANDALONE:
            pos += 2
            continue
        if marker in (0xD9, 0xDA):
            what = "end of image" if marker == 0xD9 else "scan data"
            raise ImageHeaderError(f"bad JPEG header: {what} at offset {pos} before any frame header (SOF)")
        seg = read(pos + 2, 8)
        if len(seg) < 2:
            raise ImageHeaderError(f"truncated JPEG: marker {marker:#04x} at offset {pos} has no length")
        length = int.from_bytes(seg[:2], "big")
        if length < 2:
            raise ImageHeaderError(f"bad JPEG header: marker {marker:#04x} at offset {pos} has length {length}")
        if marker in SOF_MARKERS:
            if length < 8 or len(seg) < 7:
                raise ImageHeaderError(f"bad JPEG header: frame header at offset {pos} of length {length} "
                                       f"(expected at least 8)")
            height, width = int.from_bytes(seg[3:5], "big"), int.from_bytes(seg[5:7], "big")
            if height == 0 or width == 0:
                raise ImageHeaderError(f"bad JPEG header: size {width}x{height} in the frame header (a height "
                                       f"given later by a DNL marker is not supported)")
            return ImageInfo("jpeg", height, width)
        pos += 2 + length
