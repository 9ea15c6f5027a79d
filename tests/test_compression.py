"""Compressed chunks: corrupt chunks named, unreadable codecs refused, the device path's batching and slot
mapping (nvCOMP replaced by a fake codec, CUDA by host stand-ins), the converter's ``--compress`` round trip
and ``gdsload info``, the compression benchmark on the cpu backend.

Reading compressed stores exactly (every codec, sharded and unsharded, partial writes, shuffled, two epochs,
every backend) is tests/test_zarr_stores.py's matrix (its ``zstd`` and ``codecs`` stores).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec, GzipCodec, ZstdCodec

from gdsload import FormatError, GDSDataset, GDSLoadError, ReadError, write_dataset
from gdsload.backends.cpu import CpuBackend
from gdsload.codecs.chunks import load_nvcomp
from gdsload.codecs.decode import Decoder
from gdsload.codecs.checksum import reference_device_crcs, tiles
from gdsload.codecs.nvcomp import NvcompBatch, Readback
from gdsload.codecs.screen import STAND_IN, ZSTD_MAGIC, heads, screen_host
from gdsload.format.layout import DatasetLayout
from gdsload.format.meta import read_metadata
from gdsload.conversion.source_types import ArraySource, RaggedSource
from gdsload.pipeline.reader import DEFAULT_RESIDENT_BYTES, Reader
from gdsload.pipeline.window import WindowBuffer, WindowMap

from _helpers import flip_byte

N = 300
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ["cpu", *(pytest.param(b, marks=pytest.mark.gpu) for b in ("pinned", "kvikio", "mmap"))]


def rows(n: int = N, tail: tuple[int, ...] = (3,), dtype: str = "int32") -> np.ndarray:
    return (np.arange(n).reshape(-1, *([1] * len(tail))) * 100 + np.arange(int(np.prod(tail))).reshape(tail)
            ).astype(dtype)


def store(tmp_path, **arrays) -> str:
    """A group of arrays ``name=(chunk rows, shard rows or None, compressors)``, each holding :func:`rows`."""
    path = str(tmp_path / "s.zarr")
    g = zarr.create_group(path)
    for name, (chunk, shard, compressors) in arrays.items():
        g.create_array(name, shape=(N, 3), dtype="int32", chunks=(chunk, 3), shards=None if shard is None else
                       (shard, 3), compressors=compressors)[:] = rows()
    return path


def read_all(path: str, backend: str = "cpu", **options) -> dict[str, np.ndarray]:
    with GDSDataset(path, batch_size=16, backend=backend, **options) as ds:
        batches = list(ds)
    out = {k: np.concatenate([np.asarray(b[k]) if backend == "cpu" else b[k].get() for b in batches])
           for k in batches[0]}
    return out


# -- errors ------------------------------------------------------------------------------------------------


def test_a_corrupt_chunk_names_file_array_chunk_and_codec(tmp_path):
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]), g=(12, None, [GzipCodec()]), c=(10, 40, [ZstdCodec(),
                                                                                              Crc32cCodec()]))
    layout = DatasetLayout(read_metadata(path))
    cases = {"z": 6, "g": 3, "c": 9}  # chunk 6 of z: its zstd magic number; chunk 3 of g; a byte inside chunk 9 of c
    for name, chunk in cases.items():
        loc = layout.locate(name, chunk)
        flip_byte(loc.path, loc.offset + (loc.nbytes // 2 if name != "z" else 0))
    layout.close()
    for name, chunk in cases.items():
        loc_path = read_metadata(path).fields[name].shard_path(chunk // (4 if name != "g" else 1))
        with pytest.raises(ReadError) as info:
            read_all(path, fields=[name], resident_bytes=0, window_blocks=2, shuffle=True)
        msg = str(info.value)
        codec = {"z": "zstd", "g": "gzip", "c": "crc32c"}[name]
        assert msg.startswith(f"{loc_path}: chunk {chunk} of array '{name}' ("), msg
        assert codec in msg and "does not decode" in msg, msg
    # Read whole (a resident field), the error says so too.
    with pytest.raises(ReadError, match=r"chunk 6 of array 'z' .*does not decode.*reading resident field 'z'"):
        read_all(path, fields=["z"], resident_bytes=1 << 30)


def test_a_truncated_compressed_chunk_file(tmp_path):
    path = store(tmp_path, g=(12, None, [GzipCodec()]))
    os.truncate(os.path.join(path, "g", "c", "2", "0"), 0)
    with pytest.raises(FormatError, match=r"g/c/2/0: chunk file is 0 bytes \(expected at least 1: compressed\)"):
        read_all(path)


@pytest.mark.parametrize("codecs, fragment", [
    ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "no-such-codec"}],
     r"unknown codec 'no-such-codec' \(not in zarr's codec registry\)"),
    ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "transpose",
                                                                 "configuration": {"order": [1, 0]}}],
     r"chunks use a 'transpose' codec"),
    ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 99}}],
     r"codec 'zstd' with configuration .* cannot be decoded"),
])
def test_unreadable_codecs_name_codec_and_array(tmp_path, codecs, fragment):
    path = store(tmp_path, a=(10, None, [ZstdCodec()]))
    meta = os.path.join(path, "a", "zarr.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["codecs"] = codecs
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(FormatError, match=rf"^{re.escape(meta)}: {fragment}"):
        GDSDataset(path, batch_size=4, backend="cpu")


# -- the device path, without a GPU ---------------------------------------------------------------------------
class FakeZstd:
    """libnvcomp's batched zstd decoder as gdsload calls it (gdsload.codecs.nvcomp_lib.ZstdLib), on host memory:
    the addresses are numpy buffers', read and written with ctypes, and each chunk decodes with numcodecs.
    ``status(i, frame)``: the status to give chunk i of a call instead of decoding it (0: decode it)."""

    def __init__(self, status=lambda i, frame: 0, shorten: int = 0, alignments=(1, 1, 1)):
        self.alignments, self.version = alignments, "6.0.0"  # input, output, scratch; as ZstdLib has them
        self.calls: list[int] = []  # chunks per call
        self.temps: list[tuple[int, int]] = []  # (the scratch memory's address, its size) per call
        self.streams: list[int] = []  # the stream of each call
        self.frames: list[bytes] = []  # every frame handed over, in order
        self.status, self.shorten = status, shorten

    def temp_bytes(self, chunks, chunk_bytes, total_bytes):
        return 3 * total_bytes + 64

    def decompress(self, src_ptrs, src_bytes, cell_bytes, decoded_bytes, chunks, temp, temp_bytes, cell_ptrs,
                   statuses, stream):
        assert temp_bytes >= self.temp_bytes(chunks, 0, 0)
        self.calls.append(chunks)
        self.streams.append(stream)
        self.temps.append((temp, temp_bytes))

        def table(at, dtype=np.uint64):
            return np.frombuffer(ctypes.string_at(at, chunks * np.dtype(dtype).itemsize), dtype)

        srcs, lens, caps, cells = (table(a) for a in (src_ptrs, src_bytes, cell_bytes, cell_ptrs))
        sizes, codes = np.zeros(chunks, np.uint64), np.zeros(chunks, np.int32)
        for i in range(chunks):
            frame = ctypes.string_at(int(srcs[i]), int(lens[i]))
            self.frames.append(frame)
            codes[i] = self.status(i, frame)
            if codes[i] == 0:
                out = numcodecs.Zstd().decode(frame)
                out = out[:len(out) - self.shorten]
                if len(out) > caps[i]:
                    codes[i] = 15
                    continue
                ctypes.memmove(int(cells[i]), out, len(out))
                sizes[i] = len(out)
        ctypes.memmove(decoded_bytes, sizes.ctypes.data, sizes.nbytes)
        ctypes.memmove(statuses, codes.ctypes.data, codes.nbytes)
        return 0


class HostOps:
    """The CUDA side (gdsload.codecs.nvcomp.DecodeDevice) on host arrays: copies are numpy assignments, device
    memory is numpy's."""

    stream_ptr = 0x5EED

    def __init__(self, stream_ptr: int = 0x5EED):
        self.stream_ptr = stream_ptr
        self.to_device_calls = []
        self.kept = []  # what each window's ``done`` was given to hold

    def pinned(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def ordered(self, filled):
        return contextlib.nullcontext()

    def to_device(self, buffer, dest, host, src, nbytes):
        self.to_device_calls.append(nbytes)
        buffer[dest:dest + nbytes] = host[src:src + nbytes]

    def done(self, keep):
        self.kept.append(keep)
        return "event"

    def address(self, arr):
        return arr.ctypes.data

    def empty(self, nbytes):
        return np.zeros(nbytes, np.uint8)

    def upload(self, data, extra):
        dev = np.zeros(len(data) + extra, np.uint8)
        dev[:len(data)] = data
        return dev, None

    def download(self, arr, lo, hi):
        return Readback(arr[lo:hi].copy())

    def screen(self, buffer, tab, lo, hi, crc):
        """As DecodeDevice screens: the crc kernel's algorithm (its numpy reference), then the screening kernel's
        (its numpy twin), the stand-in frame in host memory."""
        got = reference_device_crcs(buffer, tiles(lo, hi)) if crc else None
        stand_in = np.frombuffer(STAND_IN, np.uint8).copy()
        screen_host(buffer, tab, lo, hi, crc, got, stand_in.ctypes.data)
        return stand_in

    def close(self):
        pass

    def quiesce(self, timeout_s=None):
        pass

def _device_windows(path: str, device: list[str], host: list[str], fake: FakeZstd, ops: HostOps,
                    window_blocks: int = 3, call_bytes: int | None = None):
    """Every window of ``path`` (blocks in a shuffled order), carried in and decoded as on a GPU backend:
    backend requests into the window buffer, host requests into its host buffer, then the decode step."""
    meta = read_metadata(path)
    layout = DatasetLayout(meta, missing_chunks="fill")  # fill values where chunks were never written
    fields = [meta.fields[f] for f in meta.fields]
    wl = WindowMap(fields, window_blocks, samples_per_block=meta.samples_per_block,
                      chunk_lengths=layout.chunk_lengths, host_fields=host)
    backend = CpuBackend()
    backend.prepare(layout.files)
    decoder = Decoder(layout, True, 0, device, threads=2, nvcomp=fake, ops=[ops])
    if call_bytes is not None:
        decoder.lanes[0].batch.call_bytes = call_bytes
    wb = WindowBuffer(np.zeros(wl.nbytes, np.uint8))
    order = np.random.default_rng(0).permutation(meta.num_blocks)
    got = {f: np.zeros((meta.num_blocks * meta.samples_per_block, *meta.fields[f].sample_shape),
                       meta.fields[f].dtype) for f in meta.fields}
    stop = threading.Event()
    try:
        for w in range(0, len(order), window_blocks):
            blocks = order[w:w + window_blocks]
            work = wl.work(layout, blocks)
            event = backend.load(wb.buffer, work.requests, stop)
            if work.host_nbytes and wb.host is None:
                wb.host = decoder.host_buffer(work.host_nbytes)
            if work.host_requests:
                backend.load(wb.host, work.host_requests, stop)
            event, check = decoder.decode(wb, work, event, stop)
            assert event == "event"
            if check is not None:
                check.confirm()
            views = wb.views(wl)
            k = meta.samples_per_block
            for name in meta.fields:
                for i, b in enumerate(blocks.tolist()):
                    rows_ = wl.cell_rows[name]
                    first = i * rows_ + (b * k) % meta.fields[name].samples_per_block
                    got[name][b * k:(b + 1) * k] = views[name][first:first + k]
    finally:
        decoder.close()
        backend.close()
        layout.close()
    return {name: a[:meta.num_samples] for name, a in got.items()}, meta


def test_device_path_batches_one_call_per_field_and_window(tmp_path):
    """nvCOMP gets one batch per device-decoded field and window, every chunk of it in window order, and
    each output lands in its chunk's slot; host-decoded fields are decoded into the host mirror and copied to
    the device in one copy per field and window; fill values where chunks were never written."""
    path = str(tmp_path / "d.zarr")
    g = zarr.create_group(path)
    g.create_array("z", shape=(N, 3), dtype="int32", chunks=(10, 3), shards=(40, 3), compressors=[ZstdCodec()],
                   fill_value=-1)[:200] = rows()[:200]
    g.create_array("c", shape=(N, 3), dtype="int32", chunks=(7, 3), compressors=[ZstdCodec(), Crc32cCodec()]
                   )[:] = rows()
    g.create_array("g", shape=(N, 3), dtype="int32", chunks=(10, 3), compressors=[GzipCodec()])[:] = rows()
    fake, ops = FakeZstd(), HostOps()
    got, meta = _device_windows(path, ["z", "c"], ["g"], fake, ops)
    expected_z = rows()
    expected_z[200:] = -1
    np.testing.assert_array_equal(got["z"], expected_z)
    np.testing.assert_array_equal(got["c"], rows())
    np.testing.assert_array_equal(got["g"], rows())
    windows = -(-meta.num_blocks // 3)
    assert len(fake.calls) == 2 * windows  # one batched call per device field and window, never one per chunk
    assert len(ops.to_device_calls) == windows
    assert len(ops.kept) == windows and all(len(k) == 2 for k in ops.kept)  # each field's call, held by done()


def test_a_windows_chunks_go_to_nvcomp_in_calls_of_bounded_size_over_one_scratch_buffer(tmp_path):
    """A field's chunks of one window are decoded in calls of at most ``call_bytes`` decoded bytes; the
    scratch memory nvCOMP asks for is allocated once, grown only when a call needs more, and handed to
    every call."""
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))  # 120-byte chunks
    fake = FakeZstd()
    got, meta = _device_windows(path, ["z"], [], fake, HostOps(), window_blocks=8, call_bytes=3 * 120)
    np.testing.assert_array_equal(got["z"], rows())
    per_window = [len(b) for b in np.array_split(np.arange(meta.num_blocks), range(8, meta.num_blocks, 8))]
    assert fake.calls == [m for n in per_window for m in [3] * (n // 3) + ([n % 3] if n % 3 else [])]
    assert len({t for t, _ in fake.temps}) == 1 and max(n for _, n in fake.temps) == 3 * 360 + 64


def test_device_path_names_a_corrupt_chunk(tmp_path):
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    layout = DatasetLayout(read_metadata(path))
    loc = layout.locate("z", 5)
    layout.close()
    flip_byte(loc.path, loc.offset)  # its magic number: nvCOMP would not notice, the check before it does
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 5 of array 'z' \(.*codecs \['bytes', "
                                        rf"'zstd'\]\) does not decode: not a zstd frame \(it starts with "
                                        rf"0xfd2fb5d7, not the magic number 0xfd2fb528\)"):
        _device_windows(path, ["z"], [], FakeZstd(), HostOps())
    flip_byte(loc.path, loc.offset)
    with open(loc.path, "rb") as f:
        chunk5 = os.pread(f.fileno(), loc.nbytes, loc.offset)
    fake = FakeZstd(status=lambda i, frame: 12 if frame == chunk5 else 0)
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 5 of array 'z' .*does not decode: nvCOMP: "
                                        rf"nvcompErrorCannotDecompress"):
        _device_windows(path, ["z"], [], fake, HostOps())


def test_a_batch_nvcomp_refuses_to_start_names_its_chunks(tmp_path):
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    fake = FakeZstd()
    fake.decompress = lambda *args: 10
    with pytest.raises(ReadError, match=r"chunk \d+ of array 'z' .*does not decode: nvCOMP refused the batch of "
                                        r"chunks \[\d+, \d+, \d+\] \(nvcompErrorInvalidValue\)"):
        _device_windows(path, ["z"], [], fake, HostOps())


def test_zstd_frame_heads():
    """The four bytes each chunk starts with, as nvCOMP's batch would see them; zero past a short chunk."""
    buf = np.frombuffer(b"\x28\xb5\x2f\xfdxyz\x28\xb5", np.uint8)
    np.testing.assert_array_equal(heads(lambda i: buf[i], np.array([0, 4, 7]), np.array([4, 7, 9])),
                                  [ZSTD_MAGIC, int.from_bytes(b"xyz\0", "little"), 0xB528])
    assert heads(lambda i: buf[i], np.array([9]), np.array([9])).tolist() == [0]  # empty, at the buffer's end


def test_the_screening_kernels_crc_step_turns_a_stored_crc32c_into_what_the_crc_kernel_computes():
    """The screening kernel's crc step, loop for loop: the initial value carried over the frame's length by the
    crc kernel's power tables gives the key; the crc32c stored after the frame and the key, each advanced over
    the frame's pad one zero byte at a time, XOR to the crc kernel's result for the frame."""
    from gdsload.codecs.checksum import T0, WORD_BYTES, device_tables, host_crcs

    powers = device_tables()[2].reshape(-1)
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 3000, 60)
    hi = np.cumsum(sizes + 4 + rng.integers(0, 20, 60))
    lo = hi - sizes
    buf = rng.integers(0, 256, int(hi[-1]) + 4, dtype=np.uint8)
    turned = []
    for v, n, pad in zip(host_crcs(buf, lo, hi).tolist(), (hi - lo).tolist(), (-hi % WORD_BYTES).tolist()):
        key, k = 0xFFFFFFFF, 0
        while n:
            if n & 1:
                s = powers[k * 1024:]
                key = int(s[key & 0xFF] ^ s[256 + ((key >> 8) & 0xFF)] ^ s[512 + ((key >> 16) & 0xFF)]
                          ^ s[768 + (key >> 24)])
            k, n = k + 1, n >> 1
        key ^= 0xFFFFFFFF
        for _ in range(pad):
            v, key = (v >> 8) ^ int(T0[v & 0xFF]), (key >> 8) ^ int(T0[key & 0xFF])
        turned.append(v ^ key)
    np.testing.assert_array_equal(np.array(turned, np.uint32), reference_device_crcs(buf, tiles(lo, hi)))


def test_the_screening_kernel_is_written_with_the_tables_layout():
    """The kernel's source names the table's rows and the reasons as this module numbers them (substituted once):
    none is left for the compiler to reject, and the magic number is the one the host checks against."""
    from gdsload.codecs import screen

    for name in ("SRC", "LEN", "PAD", "ROWS", "NOT_ZSTD", "CRC_MISMATCH", "ZSTD_MAGIC"):
        assert re.search(rf"\b{name}\b", screen.KERNEL_SOURCE) is None, name
    assert f"head != {ZSTD_MAGIC}u" in screen.KERNEL_SOURCE and f"t + {screen.ROWS} * m" in screen.KERNEL_SOURCE


def test_the_stand_in_frame_decodes_to_one_byte():
    """What nvCOMP decodes in place of a screened-out chunk: a valid frame, so nothing of the damaged one is
    read, and one byte, which any cell holds."""
    assert int.from_bytes(STAND_IN[:4], "little") == ZSTD_MAGIC
    assert bytes(numcodecs.Zstd().decode(STAND_IN)) == b"\0"


def test_device_path_checks_crc32c_after_zstd(tmp_path):
    path = store(tmp_path, c=(10, None, [ZstdCodec(), Crc32cCodec()]))
    got, _ = _device_windows(path, ["c"], [], FakeZstd(), HostOps())
    np.testing.assert_array_equal(got["c"], rows())
    layout = DatasetLayout(read_metadata(path))
    loc = layout.locate("c", 7)
    layout.close()
    flip_byte(loc.path, loc.offset + loc.nbytes // 2)
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 7 of array 'c' .*crc32c mismatch"):
        _device_windows(path, ["c"], [], FakeZstd(), HostOps())


def test_device_path_names_a_chunk_too_short_for_its_crc32c(tmp_path):
    """A chunk of 3 bytes cannot hold the 4-byte crc32c after it: named as the CPU path names it, not checked
    against bytes outside it."""
    path = store(tmp_path, c=(10, None, [ZstdCodec(), Crc32cCodec()]))
    with DatasetLayout(read_metadata(path)) as layout:
        loc = layout.locate("c", 7)
    os.truncate(loc.path, 3)
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 7 of array 'c' .*does not decode: "
                                        rf"3 bytes, too short for a crc32c"):
        _device_windows(path, ["c"], [], FakeZstd(), HostOps())
    with pytest.raises(ReadError, match=r"chunk 7 of array 'c' .*does not decode: 3 bytes, too short for a crc32c"):
        read_all(path, "cpu", resident_bytes=0)


def test_nvcomp_batch_checks_the_decoded_size(tmp_path):
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    with pytest.raises(ReadError, match=r"chunk \d+ of array 'z' .*: nvCOMP decodes it to 119 bytes \(expected 120\)"):
        _device_windows(path, ["z"], [], FakeZstd(shorten=1), HostOps())
    with pytest.raises(ImportError, match=r"libnvcomp is not installed \(nvidia-libnvcomp-cu13\)"):
        NvcompBatch(None, HostOps())


def test_a_decode_is_checked_when_confirmed_not_when_queued(tmp_path):
    """The decode step returns once nvCOMP's call is queued: a chunk it fails on is an error when the
    window's check is confirmed (before a sample of it is handed on), and confirming again does nothing."""
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    meta = read_metadata(path)
    with DatasetLayout(meta) as layout:
        decoder = Decoder(layout, True, 0, ["z"], threads=1, nvcomp=FakeZstd(status=lambda i, f: 12 * (i == 2)),
                          ops=[HostOps()])
        try:
            _, work, wb = one_window(layout, meta)
            event, check = decoder.decode(wb, work, None, threading.Event())
            assert event == "event"
            with pytest.raises(ReadError, match=rf"chunk {int(work.jobs[0].chunks[2])} of array 'z' .*"
                                                r"nvcompErrorCannotDecompress"):
                check.confirm()
            check.confirm()
        finally:
            decoder.close()


class LoggedLane(HostOps):
    """A lane that logs its drain and its close in ``events``, each followed by ``note(lane)``."""

    def __init__(self, events: list[str], note: Callable[[HostOps], str], stream_ptr: int = 0x5EED):
        super().__init__(stream_ptr)
        self.events, self.note = events, note

    def quiesce(self, timeout_s=None):
        self.events.append(f"drained{self.note(self)}")

    def close(self):
        self.events.append(f"closed{self.note(self)}")


def test_a_closed_decoder_lets_its_scratch_memory_go_after_its_stream_is_drained(tmp_path):
    """nvCOMP's scratch memory may be in use by a decode still queued: a decoder that closes drains its
    stream first, then lets the memory go, and only then closes its device side (which releases the memory
    pool's blocks of its streams: the scratch memory must be among them)."""
    events: list[str] = []
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    meta = read_metadata(path)
    with DatasetLayout(meta) as layout:
        lane = LoggedLane(events, lambda _: f", scratch held: {decoder.scratch_bytes > 0}")
        decoder = Decoder(layout, True, 0, ["z"], threads=1, nvcomp=FakeZstd(), ops=[lane])
        wl, work, wb = one_window(layout, meta)
        decoder.decode(wb, work, None, threading.Event())[1].confirm()
        decoder.close()
    assert events == ["drained, scratch held: True", "closed, scratch held: False"]


def test_successive_windows_take_turns_on_the_lanes_each_with_its_own_scratch_memory(tmp_path):
    """A window's decode runs on its lane's stream, beside the previous window's on the other lane: each call
    goes to its lane's stream, with that lane's scratch memory (one lane's memory reused by the other while a
    decode may still run there would corrupt both), and closing drains and closes every lane."""
    events: list[str] = []
    path = store(tmp_path, z=(10, 40, [ZstdCodec()]))
    meta = read_metadata(path)
    lanes = [LoggedLane(events, lambda lane: f" {lane.stream_ptr:#x}", ptr) for ptr in (0xA, 0xB)]
    fake = FakeZstd()
    with DatasetLayout(meta) as layout:
        decoder = Decoder(layout, True, 0, ["z"], threads=1, nvcomp=fake, ops=lanes)
        for _ in range(4):
            wl, work, wb = one_window(layout, meta)
            decoder.decode(wb, work, None, threading.Event())[1].confirm()
            np.testing.assert_array_equal(wb.views(wl)["z"][:40], rows()[:40])
        assert decoder.scratch_bytes == sum(lane.batch.temp_bytes for lane in decoder.lanes) > 0
        decoder.close()
    assert fake.streams == [0xA, 0xB, 0xA, 0xB]
    assert [len(lane.kept) for lane in lanes] == [2, 2]
    scratch = {s: {t for t, st in zip(fake.temps, fake.streams) if st == s} for s in (0xA, 0xB)}
    assert len(scratch[0xA]) == len(scratch[0xB]) == 1 and scratch[0xA] != scratch[0xB]
    assert events == ["drained 0xa", "drained 0xb", "closed 0xa", "closed 0xb"]


def one_window(layout, meta, blocks: int | list[int] = 4):
    """Field z's window of ``blocks`` (a number: the first ones), read into a host window buffer:
    (map, work, buffer)."""
    blocks = np.arange(blocks) if isinstance(blocks, int) else np.asarray(blocks)
    wl = WindowMap([meta.fields["z"]], len(blocks), samples_per_block=meta.samples_per_block,
                   chunk_lengths=layout.chunk_lengths)
    wb = WindowBuffer(np.zeros(wl.nbytes, np.uint8))
    work = wl.work(layout, blocks)
    backend = CpuBackend()
    backend.prepare(layout.files)
    try:
        backend.load(wb.buffer, work.requests, threading.Event())
    finally:
        backend.close()
    return wl, work, wb


def test_zstd_decodes_on_cpu_threads_without_nvcomp(tmp_path):
    """Without nvCOMP, zstd fields on a GPU backend are decoded by CPU threads, after one warning naming the
    extra to install. In a process of its own (the warning is once per process) where the nvidia-libnvcomp
    wheel cannot load (a package of that name that fails comes first on its path)."""
    assert decode_fields_with(FakeZstd()) == (["z"], []), "with nvCOMP: on the device"
    shadow = tmp_path / "nvidia" / "libnvcomp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("def load_library():\n    raise OSError('no libnvcomp here')\n")
    script = """
import json, warnings
from gdsload.codecs import chunks as decode
if decode.load_nvcomp() is not None:
    print(json.dumps("libnvcomp is installed on this machine"))
    raise SystemExit
meta = type("M", (), {"name": "z", "compressed": True, "codecs": (("zstd", {}),)})()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    split = [decode.device_fields([meta], on_gpu) for on_gpu in (True, True, False)]
print(json.dumps([split, [str(w.message) for w in caught if w.category is RuntimeWarning]]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    if isinstance(result, str):
        pytest.skip(result)
    split, warned = result
    assert split == [[[], ["z"]], [[], ["z"]], [[], []]], "CPU threads on a GPU backend; nothing on cpu"
    assert len(warned) == 1 and "gdsload[nvcomp]" in warned[0], "warned once"


def decode_fields_with(nvcomp) -> tuple[list[str], list[str]]:
    """A zstd field's split on a GPU backend where ``nvcomp`` is the library."""
    from gdsload.codecs import chunks as decode

    meta = type("M", (), {"name": "z", "compressed": True, "codecs": (("zstd", {}),)})()
    return decode.device_fields([meta], True, nvcomp=nvcomp)


def test_zstd_decodes_on_cpu_threads_where_nvcomp_needs_alignment_the_window_cannot_give(tmp_path):
    """nvCOMP states the alignment its decoder needs of each chunk's input and output: a store's chunks start
    at any byte, and a chunk's cell follows whole decoded chunks. A field that cannot meet it is decoded by
    CPU threads, with a warning saying why; the others stay on the device."""
    from gdsload.codecs import chunks as decode

    g = zarr.create_group(str(tmp_path / "s.zarr"))
    g.create_array("w", shape=(40, 3), dtype="int32", chunks=(10, 3), compressors=[ZstdCodec()])[:] = 1  # 120 B
    g.create_array("b", shape=(40, 3), dtype="uint8", chunks=(5, 3), compressors=[ZstdCodec()])[:] = 1  # 15 B
    meta = read_metadata(str(tmp_path / "s.zarr"))
    fields = [meta.fields["w"], meta.fields["b"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode.device_fields(fields, True, nvcomp=FakeZstd(alignments=(1, 1, 8))) == (["w", "b"], [])
    with pytest.warns(RuntimeWarning, match=r"'b' are decoded by CPU threads: .*outputs on 8-byte boundaries, "
                                            r"and the chunks decode to 15 bytes each"):
        assert decode.device_fields(fields, True, nvcomp=FakeZstd(alignments=(1, 8, 8))) == (["w"], ["b"])
    with pytest.warns(RuntimeWarning, match=r"inputs on 4-byte boundaries, and a store's chunks start at any byte"):
        assert decode.device_fields(fields, True, nvcomp=FakeZstd(alignments=(4, 1, 8))) == ([], ["w", "b"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compressed_and_raw_fields_together(tmp_path, backend):
    path = store(tmp_path, z=(10, 40, [ZstdCodec(level=3)]), g=(12, None, [GzipCodec()]), r=(8, 32, None),
                 c=(9, None, [ZstdCodec(), Crc32cCodec()]))
    for resident in (0, 1 << 30):
        got = read_all(path, backend, resident_bytes=resident)
        for name in ("z", "g", "r", "c"):
            np.testing.assert_array_equal(got[name], rows(), err_msg=name)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gdsload", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)


def test_chunks_next_to_each_other_in_a_file_are_read_by_one_request(tmp_path):
    """A window's compressed chunks lie in its region in file order, so chunks that follow each other in a
    file follow each other in the buffer and the backend's merge reads them at once: an unshuffled window over
    one shard is one read; a shuffled window reads each chunk once, in fewer reads where its chunks meet; both
    decode exactly (the device path, decoded by the fake library)."""
    from gdsload.backends.base import ReadRequest, coalesce

    tokens = np.random.default_rng(2).zipf(1.5, (512, 64)).clip(0, 50000).astype(np.int32)
    out = str(tmp_path / "t.gds")
    write_dataset(out, {"tokens": ArraySource("tokens", tokens)}, compress="zstd:1", chunk_bytes=4 << 10,
                  progress=False)
    meta = read_metadata(out)
    with DatasetLayout(meta) as layout:
        f = meta.fields["tokens"]
        wl = WindowMap([f], 8, samples_per_block=meta.samples_per_block, chunk_lengths=layout.chunk_lengths)
        reads = coalesce(wl.work(layout, np.arange(8)).requests, 1 << 62)
        assert [type(r) for r in reads] == [ReadRequest]
        assert reads[0].nbytes == int(layout.chunk_lengths["tokens"][:8].sum())
        blocks = np.array([5, 0, 6, 1, 9, 2, 12, 3])
        work = wl.work(layout, blocks)
        job = work.jobs[0]
        assert sorted(job.chunks.tolist()) == sorted(blocks.tolist())
        reads = coalesce(work.requests, 1 << 62)
        assert len(reads) == 4  # 0-3, 5-6, 9, 12
        assert sum(r.nbytes for r in reads) == int(job.nbytes.sum())
    got, _ = _device_windows(out, ["tokens"], [], FakeZstd(), HostOps(), window_blocks=8)
    np.testing.assert_array_equal(got["tokens"], tokens)


# -- the converter ---------------------------------------------------------------------------------------------
def test_converter_compress_round_trip(tmp_path):
    """``gdsload shard --compress zstd:3``: zarr-python reads every array back exactly, so does gdsload
    (shuffled, verified against the decoded blocks' checksums), ``gdsload info`` shows codecs and ratio,
    ``gdsload verify`` checks decoded blocks and names a corrupt one."""
    n = 1000
    images = (np.arange(n)[:, None, None] % 7 * np.ones((1, 16, 16), np.uint8)).astype(np.uint8)
    tokens = np.random.default_rng(0).zipf(1.5, (n, 64)).clip(0, 50000).astype(np.int32)
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "label.npy", np.arange(n))
    out = str(tmp_path / "c.gds")
    done = cli("shard", str(tmp_path / "images.npy"), str(tmp_path / "tokens.npy"), str(tmp_path / "label.npy"),
               "-o", out, "--compress", "zstd:3", "--chunk-bytes", "16KiB", "--quiet")
    assert done.returncode == 0, done.stderr
    g = zarr.open_group(out, mode="r")
    for name, data in (("images", images), ("tokens", tokens), ("label", np.arange(n))):
        np.testing.assert_array_equal(g[name][:], data)
        assert [c.to_dict()["name"] for c in g[name].compressors] == ["zstd", "crc32c"]
        assert g[name].compressors[0].level == 3
    meta = read_metadata(out)
    assert meta.samples_per_block == 64  # 16 KiB of the largest sample (256 bytes)
    with GDSDataset(out, batch_size=50, backend="cpu", shuffle=True, verify=True, resident_bytes=0) as ds:
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            for b in ds:
                np.testing.assert_array_equal(b["images"], images[b["label"]])
                np.testing.assert_array_equal(b["tokens"], tokens[b["label"]])
    info = cli("info", out)
    assert info.returncode == 0, info.stderr
    assert re.search(r"images: .*codecs \['bytes', 'zstd', 'crc32c'\], ratio 0\.\d+ \(stored / decoded\)", info.stdout)
    assert re.search(r"tokens: .*codecs \['bytes', 'zstd', 'crc32c'\], ratio 0\.\d+", info.stdout), info.stdout
    ok = cli("verify", out, "--quiet")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("0 bad"), ok.stdout + ok.stderr
    with DatasetLayout(read_metadata(out)) as layout:
        loc = layout.locate("tokens", 3)
    flip_byte(loc.path, loc.offset)
    bad = cli("verify", out, "--quiet")
    assert bad.returncode == 1 and f"BAD {loc.path}: chunk 3 of array 'tokens'" in bad.stdout, bad.stdout


def test_a_converted_chunk_damaged_inside_is_found_before_it_is_decoded(tmp_path):
    """The converter stores a crc32c after each zstd chunk (zarr's crc32c codec): a chunk with a byte changed
    in the middle of its frame is an error naming it, and no decoder sees it: on the device path (nvCOMP's
    decode of such a frame did not return) it is screened out of the batch, replaced by a stand-in frame; on
    the CPU, where the blocks' own checksums would only be checked after the decode, it is never decoded."""
    tokens = np.random.default_rng(1).zipf(1.5, (400, 64)).clip(0, 50000).astype(np.int32)
    out = str(tmp_path / "t.gds")
    write_dataset(out, {"tokens": ArraySource("tokens", tokens)}, compress="zstd:3", chunk_bytes=16 << 10,
                  progress=False)
    with DatasetLayout(read_metadata(out)) as layout:
        loc = layout.locate("tokens", 2)
    flip_byte(loc.path, loc.offset + loc.nbytes // 2)
    with open(loc.path, "rb") as f:
        damaged = os.pread(f.fileno(), loc.nbytes - 4, loc.offset)  # the frame, without its crc32c
    fake = FakeZstd()
    with pytest.raises(ReadError, match=rf"^{re.escape(loc.path)}: chunk 2 of array 'tokens' .*crc32c mismatch"):
        _device_windows(out, ["tokens"], [], fake, HostOps(), window_blocks=8)
    assert len(fake.calls) == 1, "the damaged chunk's window is the first: its batch went to nvCOMP"
    assert damaged not in fake.frames and fake.frames.count(STAND_IN) == 1
    with pytest.raises(ReadError, match=r"chunk 2 of array 'tokens' .*crc32c mismatch"):
        read_all(out, "cpu", resident_bytes=0, verify=False)


def test_converter_compress_options_are_checked(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.float32))
    x, out = str(tmp_path / "x.npy"), str(tmp_path / "o.gds")
    for args, message in ((["--compress", "lz4"], "--compress takes zstd, zstd:LEVEL, auto or auto:LEVEL "
                                                  "(found 'lz4')"),
                          (["--compress", "zstd:23"], "zstd level must be at most 22"),
                          (["--chunk-bytes", "64KiB"], "--chunk-bytes) sets the inner chunks of compressed fields"),
                          (["--compress", "zstd", "--block-bytes", "1MiB"], "--block-bytes does not apply with "
                                                                              "--compress")):
        done = cli("shard", x, "-o", out, "--quiet", *args)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not os.path.exists(out)


def test_compressed_variable_length_values_are_refused(tmp_path):
    out = str(tmp_path / "r.gds")
    values = np.arange(40, dtype=np.int32)
    write_dataset(out, {"x": ArraySource("x", np.zeros((4, 2)))}, ragged={"t": RaggedSource(
        "t", ArraySource("t", values), np.array([0, 10, 20, 30, 40]))}, compress="zstd", progress=False)
    assert not read_metadata(out).ragged["t"].values.compressed  # the converter leaves values raw
    meta = os.path.join(out, "t", "values", "zarr.json")
    with open(meta) as f:
        doc = json.load(f)
    doc["codecs"][0]["configuration"]["codecs"].append({"name": "zstd", "configuration": {"level": 0}})
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(FormatError, match=rf"^{re.escape(meta)}: the values of variable-length field 't' must be raw"):
        read_metadata(out)


@contextlib.contextmanager
def dataset_reader(path: str, batch_size: int, resident_bytes: int) -> Iterator[Reader]:
    """What ``GDSDataset(path, batch_size, backend="cpu", resident_bytes=resident_bytes)`` reads with (its
    decoder, window map, layout and backend), opened and started as the dataset does; closed at the end."""
    opened = Reader.open(path, None, "cpu", 0, resident_bytes, None, None)
    try:
        reader = opened.start(min(opened.window_blocks(batch_size, 1), opened.max_window_blocks(1)))
    except BaseException:
        opened.close()
        raise
    try:
        yield reader
    finally:
        reader.close()


def test_a_stop_skips_the_chunks_not_yet_decoded(tmp_path):
    """A window's host decode is a task group that honours the stop (close, or another window's error):
    chunks not yet started are skipped, as reads are, instead of all being decoded before close returns."""
    import threading

    from gdsload.pipeline.window import WindowBuffer

    path = store(tmp_path, z=(10, 40, ZstdCodec(level=1)))
    with dataset_reader(path, batch_size=16, resident_bytes=0) as reader:
        dec, wl, layout = reader.decoder, reader.window_map, reader.layout
        calls = []
        chain = dec.chains["z"]
        real = chain.decode
        chain.decode = lambda data, n: (calls.append(1), real(data, n))[1]
        work = wl.work(layout, np.arange(wl.window_blocks))
        wb = WindowBuffer(reader.backend.allocate(wl.nbytes))
        reader.backend.load(wb.buffer, work.requests, threading.Event())
        stop = threading.Event()
        stop.set()
        dec.decode(wb, work, None, stop)
        assert calls == [], "nothing decoded once stopped"
        dec.decode(wb, work, None, threading.Event())
        assert len(calls) == wl.window_blocks


def test_a_failing_decode_setup_waits_for_the_windows_reads(tmp_path, monkeypatch, plug):
    """When the decode step cannot be set up for a window, the reads already submitted into its buffer are
    waited for before the error goes on (they were left running, writing into a buffer about to change
    hands), and the error reaches the consumer."""
    from gdsload.backends import info

    finished = []

    class Waited(info("cpu").backend_class):  # type: ignore[misc,valid-type]
        def submit(self, dest, requests, stop):
            pending = super().submit(dest, requests, stop)
            finish = pending.finish
            pending.finish = lambda: (finished.append(1), finish())[1]
            return pending

    monkeypatch.setattr(Reader, "_submit_host", lambda *a: (_ for _ in ()).throw(MemoryError("no host buffer")))
    path = store(tmp_path, z=(10, 40, ZstdCodec(level=1)))
    with GDSDataset(path, batch_size=16, backend=plug(Waited), resident_bytes=0) as ds:
        with pytest.raises(Exception, match="no host buffer"):
            list(ds)
    assert finished, "the submitted reads were waited for"


def test_a_resident_field_loaded_as_the_dataset_closes_is_not_decoded(tmp_path):
    """A close while a compressed resident field loads ends in 'the dataset was closed', never in a decode
    error about the chunks the cut-short read left unread."""
    import threading

    path = store(tmp_path, z=(10, 40, ZstdCodec(level=1)))
    with dataset_reader(path, batch_size=16, resident_bytes=DEFAULT_RESIDENT_BYTES) as reader:
        assert reader.resident_fields == ("z",)
        closing = threading.Event()
        closing.set()
        with pytest.raises(GDSLoadError, match="closed while loading field 'z'"):
            reader.read_resident("z", closing)


def test_benchmark_tokens_are_ids_of_real_text():
    """The compression benchmark's tokens: word ids by frequency rank (0 the commonest), within the
    vocabulary, the same on every call, and repeated to the size asked."""
    from benchmarks.compression import VOCAB, make_kind, text_ids

    ids = text_ids()
    assert len(ids) > 100_000 and ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < VOCAB
    counts = np.bincount(ids, minlength=VOCAB)
    assert counts[0] == counts[:VOCAB - 1].max()  # rank 0 is the commonest word
    tokens = make_kind("tokens", 8 << 20)
    assert tokens.shape == ((8 << 20) // (2048 * 4), 2048)
    np.testing.assert_array_equal(tokens.reshape(-1)[:len(ids)], ids[:tokens.size])
    np.testing.assert_array_equal(make_kind("tokens", 8 << 20), tokens)


GPU_BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) for b in ("pinned", "kvikio", "mmap")]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_nvcomp_decodes_on_the_device(tmp_path, backend, monkeypatch):
    """With nvCOMP installed and switched on, zstd chunks (with and without a crc32c) decode on the device,
    exactly, shuffled, over two epochs, datasets opened and dropped one after another; a corrupt chunk is
    named."""
    monkeypatch.setenv("GDSLOAD_NVCOMP", "1")
    if load_nvcomp() is None:
        pytest.skip("needs libnvcomp (nvidia-libnvcomp-cu13, gdsload[nvcomp])")
    path = store(tmp_path, z=(10, 40, [ZstdCodec(level=3)]), c=(9, None, [ZstdCodec(), Crc32cCodec()]),
                 r=(8, 32, None))
    for _ in range(3):  # each dataset's decoder torn down before the next opens
        got = read_all(path, backend, resident_bytes=0)
        for name in ("z", "c", "r"):
            np.testing.assert_array_equal(got[name], rows(), err_msg=name)
    with GDSDataset(path, batch_size=16, backend=backend, shuffle=True, resident_bytes=0) as ds:
        assert ds.describe()["decode"] == {"z": "device (nvCOMP)", "c": "device (nvCOMP)"}
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            seen = np.concatenate([b["z"].get() for b in ds])
            np.testing.assert_array_equal(np.sort(seen[:, 0]), rows()[:, 0])
        assert ds.describe()["decode_scratch_bytes"] > 0  # nvCOMP's scratch memory, held for the next window
    with DatasetLayout(read_metadata(path)) as layout:
        loc_z, loc_c = layout.locate("z", 6), layout.locate("c", 9)
    flip_byte(loc_z.path, loc_z.offset)
    with pytest.raises(ReadError, match=r"chunk 6 of array 'z' .*does not decode: not a zstd frame"):
        read_all(path, backend, resident_bytes=0)
    flip_byte(loc_z.path, loc_z.offset)
    flip_byte(loc_c.path, loc_c.offset + loc_c.nbytes // 2)
    with pytest.raises(ReadError, match=r"chunk 9 of array 'c' .*crc32c mismatch"):
        read_all(path, backend, resident_bytes=0)
