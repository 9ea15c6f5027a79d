"""Every wait on a decode is bounded (GDSLOAD_DECODE_WAIT_S): the host's polling wait on a CUDA event
(gdsload.cuda.runtime.wait_event), a decoder that stops while a lane is still busy (Decoder.quiesce and close),
and, on a GPU, a damaged frame in a store without checksums, which ends in an error or a sample, never a hang."""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest
from zarr.codecs import ZstdCodec

from gdsload import DecodeError
from gdsload.codecs.decode import Decoder
from gdsload.cuda.runtime import wait_event
from gdsload.errors import ReadError
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.pipeline.window import WindowBuffer, WindowMap

from test_compression import FakeZstd, HostOps, read_all, rows, store


class Event:
    """A CUDA event as CuPy has it (``done``: a query, never blocking), done after ``polls`` queries (None:
    never, a decode hung on the device)."""

    def __init__(self, polls: int | None = None):
        self.polls, self.queries = polls, 0

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls

    def synchronize(self) -> None:
        raise AssertionError("a wait without a bound")


def test_the_wait_on_an_event_gives_up_after_its_bound_and_never_blocks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not done after 0.2 s"):
        wait_event(Event(None), 0.2)
    assert 0.2 <= time.monotonic() - start < 2
    soon = Event(3)
    wait_event(soon, 5.0)
    assert soon.queries == 4


class BusyLane(HostOps):
    """A lane whose stream never drains: each window's event is ``Event(polls)`` (None: never done), and
    ``quiesce`` gives up after the bound it is given, as DecodeDevice's does."""

    def __init__(self, polls: list[int | None]):
        super().__init__()
        self.polls, self.bounds, self.closed = list(polls), [], False

    def done(self, keep):
        self.kept.append(keep)
        return Event(self.polls.pop(0))

    def quiesce(self, timeout_s=None):
        self.bounds.append(timeout_s)
        raise TimeoutError(f"not done after {timeout_s:g} s")

    def close(self):
        self.closed = True


def _window(layout, meta, blocks):
    """Field z's window of ``blocks``, read into a host window buffer: (work, buffer)."""
    from gdsload.backends.cpu import CpuBackend

    wl = WindowMap([meta.fields["z"]], len(blocks), samples_per_block=meta.samples_per_block,
                   chunk_lengths=layout.chunk_lengths)
    wb, work = WindowBuffer(np.zeros(wl.nbytes, np.uint8)), wl.work(layout, np.asarray(blocks))
    backend = CpuBackend()
    backend.prepare(layout.files)
    try:
        backend.load(wb.buffer, work.requests, threading.Event())
    finally:
        backend.close()
    return work, wb


def test_a_decoder_stopping_while_a_lane_is_busy_raises_a_decode_error_naming_the_window(tmp_path, monkeypatch):
    """Two windows decode on one lane; the first one's event has passed, the second one's never does: the
    decoder's quiesce waits the bound (GDSLOAD_DECODE_WAIT_S), then names the file, the second window's
    chunks and the bound, and says the process may have to exit; close raises it too and keeps the lane's
    scratch memory and stream (the device may still write them)."""
    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "0.25")
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    meta = read_metadata(path)
    lane = BusyLane([0, None])
    with DatasetLayout(meta) as layout:
        decoder = Decoder(layout, True, 0, ["z"], threads=1, nvcomp=FakeZstd(), ops=[lane])
        for blocks in ([0, 1], [4, 5, 6]):
            work, wb = _window(layout, meta, blocks)
            decoder.decode(wb, work, None, threading.Event())[1].confirm()
        loc = layout.locate("z", 4)
        msg = (rf"^{re.escape(loc.path)}: chunk 4 of array 'z' \(.*\) does not decode: the decode of its window "
               rf"\(chunks 4, 5, 6\) on decode lane 0 is still running after 0.25 s \(GDSLOAD_DECODE_WAIT_S\) .*"
               rf"the process may have to exit$")
        with pytest.raises(DecodeError, match=msg):
            decoder.quiesce()
        with pytest.raises(DecodeError, match=msg):
            decoder.close()
        assert lane.bounds == [0.25, 0.25]
        assert not lane.closed and decoder.scratch_bytes > 0


def test_a_busy_lane_with_no_window_known_names_the_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "0.5")
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    with DatasetLayout(read_metadata(path)) as layout:
        decoder = Decoder(layout, True, 0, ["z"], threads=1, nvcomp=FakeZstd(), ops=[BusyLane([])])
        with pytest.raises(DecodeError, match=rf"^{re.escape(path)}: the device work of decode lane 0 is still "
                                              r"running after 0.5 s .*may have to exit$"):
            decoder.quiesce()


# -- on a GPU ------------------------------------------------------------------------------------------------
SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


@pytest.mark.gpu
def test_on_the_device_a_busy_decode_lane_ends_its_wait_at_the_bound(tmp_path, monkeypatch):
    """A kernel that runs for 3 s on a real lane's stream (a decode that does not end, as far as the host can
    tell): the decoder's quiesce gives up after the 0.5 s bound with the DecodeError, and a wait without a
    bound later finds the stream drained."""
    import cupy

    from gdsload.codecs.nvcomp import DecodeDevice

    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "0.5")
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    gpu = DecodeDevice(0)
    with DatasetLayout(read_metadata(path)) as layout:
        decoder = Decoder(layout, True, 0, [], threads=1, ops=[gpu])
        with gpu.device, gpu.stream:
            cupy.RawKernel(SPIN, "spin")((1,), (1,), (np.uint64(3_000_000_000),))
        start = time.monotonic()
        with pytest.raises(DecodeError, match=r"decode lane 0 is still running after 0.5 s"):
            decoder.quiesce()
        assert time.monotonic() - start < 2.5
        gpu.quiesce(None)
        decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_on_the_device_damaged_entropy_data_without_a_checksum_ends_within_the_bound(tmp_path, backend,
                                                                                    monkeypatch):
    """A frame whose structure is sound but whose compressed block bytes are inverted (what the walk cannot
    see, in a store without a crc32c): the read ends within the bound (5 s) plus its own time, in an error
    naming chunk 4 (nvCOMP's status, a wrong size, or the DecodeError) or in samples (unchecked: documented);
    never a hang. A store read after it still decodes exactly, unless the device is left busy."""
    from gdsload.codecs.chunks import load_nvcomp
    from test_zstd_walk import _blocks

    monkeypatch.setenv("GDSLOAD_NVCOMP", "1")
    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "5")
    if load_nvcomp() is None:
        pytest.skip("needs libnvcomp (nvidia-libnvcomp-cu13, gdsload[nvcomp])")
    path = store(tmp_path, z=(10, 40, [ZstdCodec(level=3)]))
    with DatasetLayout(read_metadata(path)) as layout:
        loc = layout.locate("z", 4)
    with open(loc.path, "rb") as f:
        frame = os.pread(f.fileno(), loc.nbytes, loc.offset)
    at = _blocks(frame)[0]
    body = at + 3 + (len(frame) - at - 3) // 4  # inside the first block's compressed bytes
    bad = frame[:body] + bytes(b ^ 0xFF for b in frame[body:body + 16]) + frame[body + 16:]
    with open(loc.path, "r+b") as f:
        os.pwrite(f.fileno(), bad, loc.offset)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            read_all(path, backend, resident_bytes=0)
        except BaseException as e:  # handed to the test's thread
            caught.append(e)

    t = threading.Thread(target=read, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(5 * 3 + 30)
    assert not t.is_alive(), "the decode of damaged entropy data hung past its bound"
    assert time.monotonic() - start < 5 * 3 + 30
    if caught:
        assert isinstance(caught[0], ReadError) and "chunk 4 of array 'z'" in str(caught[0]), caught
        if isinstance(caught[0], DecodeError):
            return  # the GPU may stay busy: nothing more is asked of it in this process
    with open(loc.path, "r+b") as f:
        os.pwrite(f.fileno(), frame, loc.offset)
    np.testing.assert_array_equal(read_all(path, backend, resident_bytes=0)["z"], rows())
