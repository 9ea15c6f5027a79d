"""Device row gathers (gdsload.cuda.gather): the launch arithmetic on the CPU; on the GPU, every row
gathered exactly, and a gather that leaves room for a kernel of another stream to start at once."""

from __future__ import annotations

import numpy as np
import pytest

from gdsload.cuda.gather import BLOCKS_PER_SM, THREADS, WIDE_ROW_WORDS, launch_shape, row_pointers, word_bytes
from gdsload.cuda.ops import HostOps


@pytest.mark.parametrize("row_bytes, pointers, expected", [
    (150528, (0, 256), 16), (24, (0, 8), 8), (24, (0, 4), 4), (12, (16, 32), 4), (6, (0,), 2), (7, (0,), 1),
    (16, (0, 3), 1),  # a misaligned pointer decides, whatever the row
])
def test_the_word_is_the_widest_dividing_the_row_and_every_pointer(row_bytes, pointers, expected):
    assert word_bytes(row_bytes, *pointers) == expected


def test_the_grid_is_bounded_per_multiprocessor_and_never_larger_than_the_work():
    sms = 132
    assert launch_shape(1000, 9408, sms) == ("gather_wide", BLOCKS_PER_SM * sms)  # image rows
    assert launch_shape(10, 9408, sms) == ("gather_wide", 10)  # a block per row, no idle blocks
    assert launch_shape(256, WIDE_ROW_WORDS - 1, sms) == ("gather_narrow", -(-256 * (WIDE_ROW_WORDS - 1) // THREADS))
    assert launch_shape(256, 1, sms) == ("gather_narrow", 1)  # labels: one block
    assert launch_shape(10**7, 1, sms) == ("gather_narrow", BLOCKS_PER_SM * sms)
    assert launch_shape(1, 1, 0) == ("gather_narrow", 1)
    for rows, words in [(1, 1), (3, 64), (10**6, 10**4), (7, 5)]:
        _, blocks = launch_shape(rows, words, sms)
        assert 1 <= blocks <= BLOCKS_PER_SM * sms


def test_row_pointers_list_every_row_of_every_part_in_order():
    table = np.full(8, 7, np.uint64)
    n = row_pointers([(1 << 40, np.array([3, 0], np.int32)), (4096, np.array([], np.int64)),
                      (1 << 20, np.array([5, 1, 2], np.int64))], 24, table)
    assert n == 5
    assert table.tolist() == [(1 << 40) + 72, 1 << 40, (1 << 20) + 120, (1 << 20) + 24, (1 << 20) + 48, 7, 7, 7]


def test_host_take_rows_takes_each_part_in_turn_and_refuses_a_short_fill():
    a, b = np.arange(12).reshape(6, 2), np.arange(100, 108).reshape(4, 2)
    out = np.empty((5, 2), a.dtype)
    HostOps().take_rows([(a, np.array([5, 0])), (b, np.array([3, 3, 1]))], out)
    assert out.tolist() == [[10, 11], [0, 1], [106, 107], [106, 107], [102, 103]]
    with pytest.raises(ValueError, match="2 rows taken into 5"):
        HostOps().take_rows([(a, np.array([1, 2]))], out)


@pytest.mark.gpu
@pytest.mark.parametrize("row_shape, dtype", [((), np.int64), ((3,), np.uint8), ((7, 9), np.float32),
                                              ((3, 224, 224), np.uint8), ((5,), np.uint16)])
def test_rows_of_several_arrays_taken_by_pointers_exactly(row_shape, dtype):
    """One launch reading its row addresses from a pinned host table, over many calls (the table ring reused)."""
    import cupy

    from gdsload.cuda.ops import TABLES, CudaOps

    rng = np.random.default_rng(1)
    hosts = [rng.integers(0, 250, size=(n, *row_shape)).astype(dtype) for n in (50, 1, 300)]
    devs = [cupy.asarray(h) for h in hosts]
    cupy.cuda.Device().synchronize()
    ops = CudaOps(0, "cupy")
    outs, expected = [], []
    for _ in range(2 * TABLES + 3):
        parts = [(i, rng.integers(0, len(hosts[i]), size=int(rng.integers(0, 90)))) for i in (2, 0, 1, 2)]
        out = cupy.empty((sum(len(r) for _, r in parts), *row_shape), dtype=dtype)
        with ops.scope():
            ops.take_rows([(devs[i], r) for i, r in parts], out)
        outs.append(out)
        expected.append(np.concatenate([hosts[i][r] for i, r in parts]))
    ops.work.synchronize()
    for out, want in zip(outs, expected):
        np.testing.assert_array_equal(cupy.asnumpy(out), want)


@pytest.mark.gpu
@pytest.mark.parametrize("row_shape, dtype", [((), np.int64), ((3,), np.uint8), ((7, 9), np.float32),
                                              ((3, 224, 224), np.uint8), ((5,), np.uint16), ((130,), np.uint8)])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_every_row_is_gathered_exactly(row_shape, dtype, index_dtype):
    import cupy

    from gdsload.cuda.ops import CudaOps

    rng = np.random.default_rng(0)
    src_host = rng.integers(0, 250, size=(300, *row_shape)).astype(dtype)
    idx_host = rng.integers(0, 300, size=257).astype(index_dtype)
    ops = CudaOps(0, "cupy")
    src, idx = cupy.asarray(src_host), cupy.asarray(idx_host)
    out = cupy.empty((257, *row_shape), dtype=dtype)
    part = out[100:200]  # a slice of rows, as a batch spanning windows is written
    cupy.cuda.Device().synchronize()  # the uploads ran on the null stream; the gather's stream does not wait for it
    with ops.scope():
        assert ops.gather(src, idx, out)
        ops.take(src, idx[::2][:100], part)  # a strided index: CuPy's take, same result
    ops.work.synchronize()
    expected = src_host[idx_host]
    expected[100:200] = src_host[idx_host[::2][:100]]
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)


@pytest.mark.gpu
def test_a_kernel_of_another_stream_starts_while_a_large_gather_runs():
    """The defect: a gather launched as one thread per word filled the GPU with blocks, and the consumer's
    next kernel (on its own stream) started only once they were all dispatched, near the gather's end."""
    import cupy

    from gdsload.cuda.ops import CudaOps
    from gdsload.tools.steps import Spin

    ops = CudaOps(0, "cupy")
    src = cupy.zeros((1024, 3, 224, 224), dtype=cupy.uint8)  # 154 MB of rows
    idx = cupy.asarray(np.random.default_rng(1).permutation(1024).astype(np.int32))
    out = cupy.empty_like(src)
    cupy.cuda.Device().synchronize()  # the uploads ran on the null stream; the gather's stream does not wait for it
    stamp = Spin(0.001)
    stamps = cupy.zeros(6, dtype=cupy.uint64)
    ptr = stamps.data.ptr
    consumer = cupy.cuda.Stream(non_blocking=True)
    starts = []
    for _ in range(5):  # the first compiles and warms up
        with ops.scope():
            stamp.launch(np.uint64(ptr))  # the gather's start, on its stream
            ops.take(src, idx, out)
            stamp.launch(np.uint64(ptr + 16))  # and its end
        with consumer:
            stamp.launch(np.uint64(ptr + 32))  # the consumer's kernel, launched while the gather runs
        ops.work.synchronize()
        consumer.synchronize()
        t = cupy.asnumpy(stamps).astype(np.int64)
        starts.append((t[4] - t[1]) / max(1, t[2] - t[1]))  # where in the gather the consumer's kernel began
    assert np.median(starts[1:]) < 0.5, starts
