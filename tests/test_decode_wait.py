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
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata

from test_compression import FakeZstd, HostOps, one_window, store


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
            _, work, wb = one_window(layout, meta, blocks)
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


def test_the_submitters_wait_for_a_window_buffer_is_bounded(monkeypatch):
    """The pipeline waits for a window buffer's last gather (CudaOps.synchronize) before reading into it again;
    where a reader decodes on the device, gathers wait on their window's decode, so a decode that never ends is a
    DecodeError after the bound, and an event already passed is not waited on at all. Without a device decode
    the wait blocks (no poll on the submitter's path)."""
    from gdsload.cuda.ops import CudaOps

    monkeypatch.setenv("GDSLOAD_DECODE_WAIT_S", "0.2")
    ops = object.__new__(CudaOps)  # the wait needs no device of its own: the event is the seam
    ops.decodes = False

    class Blocking(Event):
        waited = False

        def synchronize(self) -> None:
            self.waited = True
    blocking = Blocking(None)
    ops.synchronize(blocking)
    assert blocking.waited and blocking.queries == 0
    ops.decodes = True
    ops.synchronize(None)
    ops.synchronize(Event(0))
    start = time.monotonic()
    with pytest.raises(DecodeError, match=r"^a window buffer's last gather is still queued after 0.2 s "
                                          r"\(GDSLOAD_DECODE_WAIT_S\).*may have to exit$"):
        ops.synchronize(Event(None))
    assert time.monotonic() - start < 2


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


#: A read of a store in a process of its own, so a decode left running on the GPU ends with it: the outcome
#: as JSON, then ``os._exit`` (no teardown that would wait for the device).
CHILD = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
from test_compression import read_all, rows
t0 = time.monotonic()
try:
    got = read_all({path!r}, {backend!r}, resident_bytes=0)["z"]
    out = {{"error": None, "exact": bool((got == rows()).all())}}
except BaseException as e:
    out = {{"error": type(e).__name__, "message": str(e)}}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _read_in_child(path: str, backend: str, bound_s: float) -> dict:
    import json
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "GDSLOAD_DECODE_WAIT_S": str(bound_s), "GDSLOAD_NVCOMP": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(tests), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests, path=path, backend=backend)], env=env,
                          capture_output=True, text=True, timeout=4 * bound_s + 60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_on_the_device_damaged_entropy_data_without_a_checksum_ends_within_the_bound(tmp_path, backend):
    """A frame whose structure is sound but whose block bytes are inverted (what the walk cannot see, in a store
    without a crc32c), read in a process of its own with a 5 s bound: the read ends within a few bounds, in an
    error naming chunk 4 (nvCOMP's status or a wrong size: a ReadError), in a DecodeError naming the bound, or
    in samples (unchecked: docs/format.md says so); never a hang. The store mended, a new process reads it
    exactly on the device."""
    from gdsload.codecs.chunks import load_nvcomp
    from test_zstd_walk import put_frame, stored_frame

    if load_nvcomp() is None:
        pytest.skip("needs libnvcomp (nvidia-libnvcomp-cu13, gdsload[nvcomp])")
    path, loc, frame, at = stored_frame(tmp_path, 4)
    body = at + 3 + (len(frame) - at - 3) // 4  # inside the first block's bytes
    put_frame(loc, frame[:body] + bytes(b ^ 0xFF for b in frame[body:body + 16]) + frame[body + 16:])
    got = _read_in_child(path, backend, 5.0)
    assert got["seconds"] < 4 * 5.0 + 30, got
    if got["error"] == "DecodeError":
        # the decode's own check names the chunk; a wait queued behind it (gathers, a buffer's reuse) the bound
        assert re.search(r"after 5 s \(GDSLOAD_DECODE_WAIT_S\).*may have to exit", got["message"]), got
    elif got["error"] is not None:
        assert got["error"] == "ReadError" and "chunk 4 of array 'z'" in got["message"], got
    put_frame(loc, frame)
    again = _read_in_child(path, backend, 5.0)
    assert again["error"] is None and again["exact"], again
