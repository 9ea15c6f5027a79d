"""A mixture's batches gathered on the GPU by its one pipeline (gdsload/pipeline/mixed.py) are the batches the
cpu backend gives, byte for byte: every source on each GPU backend and on two or three backends at once, fixed
(gathered several batches at a time), resident and variable-length fields, CuPy and torch outputs, the consumer
on the default stream or on a stream of its own, every batch kept to the end (no memory handed out twice)."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import ragged_source, sequences
from gdsload.conversion.source_types import ArraySource
from gdsload.conversion.writer import write_dataset
from gdsload.mixture.mixture import Mixture

SIZES = {"a": 37, "b": 23, "c": 11}
WEIGHTS = {"a": 3, "b": 2, "c": 1}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("mixgpu")
    out = {}
    for i, (name, n) in enumerate(SIZES.items()):
        seqs = sequences(n, seed=i)
        out[name] = str(d / f"{name}.gds")
        x = (np.arange(n * 12, dtype=np.float32).reshape(n, 3, 4) + 1000 * i)
        write_dataset(out[name], {"idx": ArraySource("idx", np.arange(n) + 100 * i), "x": ArraySource("x", x)},
                      ragged={"tokens": ragged_source(seqs)}, samples_per_block=4, progress=False)
    return out


def batches(paths, backends, output, batches=25, **kw):
    sources = {n: {"path": p, "backend": b} for (n, p), b in zip(paths.items(), backends)}
    kw = {"resident_bytes": 0, **kw}
    with Mixture(sources, WEIGHTS, batch_size=9, seed=3, shuffle=True, output=output, **kw) as mix:
        return [b for _, b in zip(range(batches), mix)]


def host(batch) -> dict[str, np.ndarray]:
    return {k: (a.cpu().numpy() if hasattr(a, "cpu") else a.get() if hasattr(a, "get") else np.asarray(a))
            for k, a in batch.items()}


BACKENDS = [["mmap"] * 3, ["pinned"] * 3, ["kvikio"] * 3, ["mmap", "pinned", "pinned"], ["mmap", "pinned", "kvikio"]]


@pytest.mark.gpu
@pytest.mark.parametrize("backends", BACKENDS, ids="-".join)
@pytest.mark.parametrize("fields", [None, ["idx", "x"]], ids=["ragged", "fixed"])
@pytest.mark.parametrize("resident_bytes", [0, 1 << 20], ids=["windowed", "resident"])
def test_every_sample_on_each_backend_and_mixed_equals_the_cpu_backends(paths, backends, fields, resident_bytes):
    """Three sources on one GPU backend, or on two or three: every batch (so every sample, its source index and
    a variable-length field's offsets) equals the cpu backend's; fixed fields alone are gathered several batches
    at a time, resident ones (``idx``, with ``resident_bytes``) from each source's own resident array."""
    kw = {"fields": fields, "resident_bytes": resident_bytes}
    expected = [host(b) for b in batches(paths, ["cpu"] * 3, "numpy", 40, **kw)]
    got = [host(b) for b in batches(paths, backends, "cupy", 40, **kw)]
    assert len(got) == len(expected) == 40
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            np.testing.assert_array_equal(g[k], e[k], err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("read_ahead", [0, 3])
@pytest.mark.parametrize("output", ["cupy", "torch"])
@pytest.mark.parametrize("own_stream", [False, True])
def test_batches_on_three_gpu_backends_equal_the_cpu_backends_on_any_stream(paths, output, own_stream, read_ahead):
    import cupy

    if output == "torch":
        torch = pytest.importorskip("torch")
    expected = [host(b) for b in batches(paths, ["cpu"] * 3, "numpy")]
    stream = cupy.cuda.Stream(non_blocking=True) if own_stream else cupy.cuda.Stream.null
    if output == "torch":
        ts = torch.cuda.Stream() if own_stream else torch.cuda.default_stream()
        with torch.cuda.stream(ts):
            got = batches(paths, ["mmap", "pinned", "kvikio"], "torch", read_ahead=read_ahead)
            assert all(a.is_cuda for b in got for a in b.values())
            got = [host(b) for b in got]
    else:
        with stream:
            got = batches(paths, ["mmap", "pinned", "kvikio"], "cupy", read_ahead=read_ahead)
            assert all(isinstance(a, cupy.ndarray) for b in got for a in b.values())
            got = [host(b) for b in got]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            np.testing.assert_array_equal(g[k], e[k], err_msg=k)
    assert any(len(set(e["source"].tolist())) > 1 for e in expected), "batches mixed by sample were joined"


@pytest.mark.gpu
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_whole_batches_and_padded_fields_on_the_device(paths, read_ahead):
    expected = [host(b) for b in batches(paths, ["cpu"] * 3, "numpy", pad_to=6, whole_batches=True)]
    got = [host(b) for b in batches(paths, ["pinned"] * 3, "cupy", pad_to=6, whole_batches=True,
                                    read_ahead=read_ahead)]
    for g, e in zip(got, expected):
        for k in e:
            np.testing.assert_array_equal(g[k], e[k], err_msg=k)


def test_sources_with_reader_pools_of_their_own_share_the_default_threads():
    """Three pinned sources reading through Python threads would each start a pool sized for the process alone;
    they split it instead (one pool's worth in all), unless a source sets num_threads. Readers the process shares
    (the native stager, the kvikio backend's KvikIO pool) and backends without a pool of their own are left be."""
    from gdsload.backends import info
    from gdsload.backends.sizing import DEFAULT_THREADS
    from gdsload.mixture.specs import MIN_THREADS, source_specs

    own = {"reader": "threads"}
    assert info("pinned").threads(own) == DEFAULT_THREADS
    specs = source_specs({"a": {"path": "a.gds", "backend_options": own},
                          "b": {"path": "b.gds", "backend_options": {**own, "pool_bytes": 1 << 26}},
                          "c": {"path": "c.gds", "backend_options": {**own, "num_threads": 7}}}, {"backend": "pinned"})
    got = {n: kw["backend_options"] for n, (_, _, _, kw) in specs.items()}
    share = max(MIN_THREADS, DEFAULT_THREADS // 2)
    assert got == {"a": {**own, "num_threads": share}, "b": {**own, "pool_bytes": 1 << 26, "num_threads": share},
                   "c": {**own, "num_threads": 7}}
    for backend in ("kvikio", "mmap", "cpu", "auto"):
        specs = source_specs({"a": "a.gds", "b": "b.gds"}, {"backend": backend})
        assert all("backend_options" not in kw for (_, _, _, kw) in specs.values()), backend
    assert info("pinned").threads({"reader": "native"}) is None  # one stager per process, shared
    specs = source_specs({"a": "a.gds", "b": "b.gds"}, {"backend": "pinned", "backend_options": {"reader": "native"}})
    assert all(kw["backend_options"] == {"reader": "native"} for (_, _, _, kw) in specs.values())


@pytest.mark.gpu
def test_sources_of_other_kinds_are_refused_naming_them(paths):
    """One pipeline reads every source: host and device arrays in one mixture are refused, whole batches too."""
    sources = {n: {"path": p, "backend": "pinned"} for n, p in paths.items()}
    with Mixture(sources, WEIGHTS, batch_size=9) as mix:
        assert mix.read_ahead == mix.datasets["a"].batches_ahead
    mixed = {**sources, "a": {"path": paths["a"], "backend": "cpu"}}
    for whole in (False, True):
        with pytest.raises(ValueError, match="source 'b' gives cupy arrays on device 0, source 'a' numpy arrays on "
                                             "the host .one pipeline reads every source"):
            Mixture(mixed, WEIGHTS, batch_size=9, whole_batches=whole)


@pytest.mark.gpu
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_batches_dropped_as_they_are_used_are_never_overwritten_under_the_consumers_work(paths, read_ahead):
    """The consumer's stream runs late (a 2 ms spin before each use) and drops every batch at once: memory it
    frees goes back to the pool while its queued work still reads it; nothing may write there before."""
    import cupy

    from gdsload.tools.steps import Spin

    expected = [float(host(b)["x"].astype(np.float64).sum()) for b in batches(paths, ["cpu"] * 3, "numpy", 40)]
    spin, sums = Spin(2.0), []
    stream = cupy.cuda.Stream(non_blocking=True)
    sources = {n: {"path": p, "backend": b} for (n, p), b in zip(paths.items(), ["mmap", "pinned", "kvikio"])}
    with stream, Mixture(sources, WEIGHTS, batch_size=9, seed=3, shuffle=True, resident_bytes=0,
                         read_ahead=read_ahead) as mix:
        for _, b in zip(range(40), mix):
            spin.launch()
            sums.append(b["x"].astype(cupy.float64).sum())
            del b
        got = [float(x) for x in sums]
    assert got == expected
