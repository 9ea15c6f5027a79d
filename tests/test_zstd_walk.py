"""The zstd frame walk that screens every chunk before nvCOMP sees it (gdsload.codecs.screen.walk_frame, and the
screening kernel's ``walk``, its CUDA twin): sound frames from numcodecs pass; truncated frames, inflated block
sizes, garbage headers and trailing bytes are stopped, each at the byte where the structure breaks."""

from __future__ import annotations

import os
import re

import numcodecs
import numpy as np
import pytest
from zarr.codecs import ZstdCodec

from gdsload.codecs.screen import BLOCK_MAX, KERNEL_SOURCE, walk_frame
from gdsload.errors import ReadError
from gdsload.format.layout import BlockLocation, DatasetLayout
from gdsload.format.meta import read_metadata

rng = np.random.default_rng(7)
PAYLOADS = {
    "empty": b"",
    "one byte": b"x",
    "text": b"the quick brown fox jumps over the lazy dog " * 50,
    "zeros, 300 KiB (RLE or compressed blocks)": bytes(300 * 1024),
    "noise, 300 KiB (raw blocks)": rng.integers(0, 256, 300 * 1024, dtype=np.uint8).tobytes(),
    "tokens, 1 MiB": rng.zipf(1.3, 256 * 1024).astype(np.int32).tobytes(),
}


def frames() -> list[tuple[str, bytes, int]]:
    """(name, frame, decoded size) from numcodecs' Zstd (what zarr-python writes), with and without a content
    checksum, at a fast and a strong level."""
    out = []
    for name, data in PAYLOADS.items():
        for level in (1, 19):
            for checksum in (False, True):
                codec = numcodecs.Zstd(level=level, checksum=checksum)
                out.append((f"{name}, level {level}, checksum {checksum}", bytes(codec.encode(data)), len(data)))
    return out


FRAMES = frames()


@pytest.mark.parametrize("name, frame, size", FRAMES, ids=[f[0] for f in FRAMES])
def test_every_frame_zstd_writes_passes_and_decodes(name, frame, size):
    assert walk_frame(frame, len(frame), max(size, 1)) is None
    if size:  # numcodecs refuses to decode the empty frame it writes
        assert bytes(numcodecs.Zstd().decode(frame)) == PAYLOADS[name.split(", level")[0]]


def _blocks(frame: bytes) -> list[int]:
    """The offsets of a sound frame's block headers."""
    fhd = frame[4]
    fcs_flag, single, did = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (4 if did == 3 else did) + (single if fcs_flag == 0 else (2, 4, 8)[fcs_flag - 1])
    out = []
    while True:
        out.append(pos)
        h = int.from_bytes(frame[pos:pos + 3], "little")
        pos += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)
        if h & 1:
            return out


MULTI = next(f for n, f, _ in FRAMES if n.startswith("noise") and n.endswith("level 1, checksum True"))


def test_the_multi_block_frame_has_several_blocks():
    assert len(_blocks(MULTI)) >= 3


def test_every_truncation_is_stopped():
    cap = len(PAYLOADS["noise, 300 KiB (raw blocks)"])
    for n in range(len(MULTI)):
        assert walk_frame(MULTI, n, cap) is not None, n


def test_trailing_bytes_after_the_frame_are_stopped_where_the_frame_ends():
    cap = len(PAYLOADS["noise, 300 KiB (raw blocks)"])
    longer = MULTI + b"\0" * 8
    assert walk_frame(longer, len(longer), cap) == len(MULTI)


def stored_frame(tmp_path, chunk: int, level: int = 3) -> tuple[str, BlockLocation, bytes, int]:
    """test_compression's store of field z in zstd chunks without a checksum: (its path, chunk ``chunk``'s
    location, that chunk's frame, where the frame's first block header starts)."""
    from test_compression import store

    path = store(tmp_path, z=(10, 40, [ZstdCodec(level=level)]))
    with DatasetLayout(read_metadata(path)) as layout:
        loc = layout.locate("z", chunk)
    with open(loc.path, "rb") as f:
        frame = os.pread(f.fileno(), loc.nbytes, loc.offset)
    return path, loc, frame, _blocks(frame)[0]


def put_frame(loc: BlockLocation, frame: bytes) -> None:
    """Write ``frame`` over the chunk at ``loc`` (a damaged one, or the sound one back)."""
    with open(loc.path, "r+b") as f:
        os.pwrite(f.fileno(), frame, loc.offset)


def _set_block(frame: bytes, at: int, kind: int | None = None, size: int | None = None) -> bytes:
    h = int.from_bytes(frame[at:at + 3], "little")
    kind = (h >> 1) & 3 if kind is None else kind
    size = h >> 3 if size is None else size
    h = (h & 1) | kind << 1 | size << 3
    return frame[:at] + h.to_bytes(3, "little") + frame[at + 3:]


@pytest.mark.parametrize("block", [0, 1, -1])
def test_an_inflated_or_shrunk_block_size_is_stopped(block):
    cap = len(PAYLOADS["noise, 300 KiB (raw blocks)"])
    at = _blocks(MULTI)[block]
    size = int.from_bytes(MULTI[at:at + 3], "little") >> 3
    for new in (size + 1, size - 1, size + 4096):
        bad = _set_block(MULTI, at, size=new)
        assert walk_frame(bad, len(bad), cap) is not None, new


def test_a_block_larger_than_the_format_allows_is_stopped_at_its_header():
    at = _blocks(MULTI)[0]
    bad = _set_block(MULTI, at, size=BLOCK_MAX + 1)
    assert walk_frame(bad, len(bad), 10**9) == at


def test_a_reserved_block_type_is_stopped_at_its_header():
    at = _blocks(MULTI)[1]
    bad = _set_block(MULTI, at, kind=3)
    assert walk_frame(bad, len(bad), 10**9) == at


def test_a_reserved_header_bit_is_stopped():
    bad = MULTI[:4] + bytes([MULTI[4] | 0x08]) + MULTI[5:]
    assert walk_frame(bad, len(bad), 10**9) == 4


def test_a_frame_that_states_more_than_its_cell_holds_is_stopped():
    data = PAYLOADS["text"]
    frame = bytes(numcodecs.Zstd(level=1).encode(data))  # its header states its content size
    assert walk_frame(frame, len(frame), len(data)) is None
    assert walk_frame(frame, len(frame), len(data) - 1) is not None
    raw = _blocks(MULTI)  # raw blocks count against the cell too, with or without a stated size
    assert walk_frame(MULTI, len(MULTI), 300 * 1024 - 1) is not None and raw


def test_the_walk_reads_no_byte_past_the_frame_whatever_follows_the_magic_number():
    """Random bytes after the magic number, in an array of exactly the frame's length (a read past it raises
    IndexError): the walk, as the kernel, reads only below n and stops within the frame, or finds it sound."""
    for seed in range(500):
        g = np.random.default_rng(seed)
        junk = np.frombuffer(bytes.fromhex("28b52ffd") + g.integers(0, 256, int(g.integers(0, 80)), np.uint8).tobytes(),
                             np.uint8)
        at = walk_frame(junk, len(junk), 1 << 20)
        assert at is None or 4 <= at <= len(junk), (seed, at)


def test_the_kernel_walks_as_the_host_does():
    """The CUDA twin: every check of walk_frame is there, with the constants substituted."""
    walk = KERNEL_SOURCE[KERNEL_SOURCE.index("__device__ unsigned long long walk"):
                         KERNEL_SOURCE.index('extern "C"')]
    for needle in ("fhd & 0x08", "type == 3", f"size > {BLOCK_MAX}", "decoded > cap", "fcs > cap",
                   "pos + 3 > n", "pos + 3 + body > n", "fhd & 0x04", "pos == n ?"):
        assert needle in walk, needle
    assert re.search(r"\b(WALK_OK|BLOCK_MAX|FRAME_BROKEN|CAP)\b", KERNEL_SOURCE) is None


def test_the_device_path_names_a_damaged_frame_and_never_hands_it_to_nvcomp(tmp_path):
    """A store without checksums whose zstd chunk has a block size inflated: the screen stops it before the
    (fake) nvCOMP; the error names the file, the chunk and the walk."""
    from test_compression import FakeZstd, HostOps

    path, loc, frame, at = stored_frame(tmp_path, 5, level=0)  # zarr's default level
    bad = _set_block(frame, at, size=(int.from_bytes(frame[at:at + 3], "little") >> 3) + 2)
    put_frame(loc, bad)
    fake = FakeZstd()
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 5 of array 'z' .*does not decode: a damaged "
                                        rf"zstd frame: .* \(the walk stopped at byte {at}\)"):
        from test_compression import _device_windows as run  # the decode step as a GPU backend runs it
        run(path, ["z"], [], fake, HostOps())
    assert bad not in fake.frames


class _NeverDone:
    """A CUDA event whose work never ends (a decode hung on the device)."""

    done = False  # as CuPy's Event.done

    def synchronize(self) -> None:
        raise AssertionError("a wait without a bound")


def test_a_decode_still_running_after_the_bound_is_a_decode_error_naming_the_chunk(tmp_path, monkeypatch):
    """The readback of a window's second nvCOMP call never completes: confirm gives up after the bound with a
    DecodeError naming the file, the call's first chunk and the bound, and says the process may have to exit."""
    import time

    from gdsload import DecodeError
    from gdsload.codecs.nvcomp import Readback
    from test_compression import FakeZstd, HostOps, _device_windows, store

    class HungSecondCall(HostOps):
        downloads = 0

        def download(self, arr, lo, hi):
            HungSecondCall.downloads += 1
            return Readback(arr[lo:hi].copy(), _NeverDone() if HungSecondCall.downloads == 2 else None)

    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "0.3")
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    start = time.monotonic()
    with pytest.raises(DecodeError, match=r"chunk \d+ of array 'z' .*still running after 0.3 s "
                                          r"\(GDSLOAD_DECODE_WAIT_S\).*the process may have to exit"):
        _device_windows(path, ["z"], [], FakeZstd(), HungSecondCall(), window_blocks=6, call_bytes=3 * 40)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_the_decode_bound_from_the_environment_is_checked(monkeypatch, value):
    from gdsload.codecs.nvcomp import decode_wait_s

    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", value)
    with pytest.raises(ValueError, match="GDSLOAD_DECODE_WAIT_S must be a number of seconds above 0"):
        decode_wait_s()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pinned", "kvikio", "mmap"])
def test_on_the_device_a_damaged_frame_without_a_checksum_is_an_error_not_a_hang(tmp_path, backend, monkeypatch):
    """nvCOMP on a real GPU: a zstd chunk with no crc32c whose block size is inflated ends in the walk's
    ReadError, in a thread that is watched, and the next dataset on the device still decodes exactly."""
    import threading

    from gdsload.codecs.chunks import load_nvcomp
    from test_compression import read_all, rows

    monkeypatch.setenv("GDSLOAD_NVCOMP", "1")
    if load_nvcomp() is None:
        pytest.skip("needs libnvcomp (nvidia-libnvcomp-cu13, gdsload[nvcomp])")
    path, loc, frame, at = stored_frame(tmp_path, 4)
    put_frame(loc, _set_block(frame, at, size=(int.from_bytes(frame[at:at + 3], "little") >> 3) + 64))
    caught: list[BaseException] = []

    def read() -> None:
        try:
            read_all(path, backend, resident_bytes=0)
        except BaseException as e:  # handed to the test's thread
            caught.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the decode of a damaged frame hung"
    assert len(caught) == 1 and isinstance(caught[0], ReadError), caught
    assert re.search(r"chunk 4 of array 'z' .*a damaged zstd frame", str(caught[0])), caught[0]
    put_frame(loc, frame)
    np.testing.assert_array_equal(read_all(path, backend, resident_bytes=0)["z"], rows())
