"""Whether the RAM tier can serve a batch with no thread beside the consumer: one kernel that reads the batch's
samples straight from the locked, registered file pages (zero-copy), launched from the consumer's own
``next()`` a few batches ahead.

    python -m benchmarks.diagnostics.probe_zero_copy [--factor 1.5] [--passes 5] [--repeats 2]

On the suite's warm image dataset opened with ``mmap`` (every range locked first), per repeat:

- **rate**: a pass with no step, zero-copy at several grid sizes (blocks over the whole GPU), beside the
  library's own pass and a plain copy of the same bytes (4 MiB ``cudaMemcpyAsync`` from the locked pages);
- **waiting** at ``--factor`` x a batch's read time, sync every step (probe_floor's stamped ``Spin``, one
  thread): ``alone``, ``base`` (the library), ``zc`` (zero-copy, one launch per batch) and ``zc-g4`` (one
  launch per four batches);
- **the step's own slowdown** when it fills the GPU: the step made of ``--full-kernels`` short kernels that
  each occupy every multiprocessor, waiting for ``alone``, ``base`` and ``zc`` (a zero-copy gather holds
  multiprocessors for as long as its bytes cross the bus, a copy engine holds none).

Nothing in the library changes. GPU only. Writes ``results/<machine>/probe-zero-copy[-TAG].json``.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from gdsload import GDSDataset
from gdsload.measure import read_files, shard_paths, time_pass
from gdsload.plan import epoch_plan
from gdsload.steps import Spin

from .probe_floor import Stamped, passes, time_alone
from ..common import BATCH, Rows, add_step_options, make_dataset, parse_probe_args, probe_parser, step_ms, write_probe

SOURCE = r"""
extern "C" __global__ void gather_host(const unsigned long long* __restrict__ src, uint4* __restrict__ out,
                                       long long rows, long long words) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4* s = (const uint4*)src[r];
        uint4* o = out + r * words;
        #pragma unroll 4
        for (long long c = threadIdx.x; c < words; c += blockDim.x) o[c] = s[c];
    }
}
extern "C" __global__ void fill_sms(unsigned long long ns, unsigned long long* stamps, int first, int last) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    if (stamps && threadIdx.x == 0 && blockIdx.x == 0) {
        if (first) stamps[0] = t0;
        if (last) stamps[1] = t;
    }
}
"""
THREADS = 256


class FullStep:
    """A step of ``kernels`` back-to-back kernels, each holding every multiprocessor (8 blocks of 256 threads
    each, 2048 threads: a full SM) for ``ms / kernels``; stamps like :class:`Spin` (first start, last end)."""

    def __init__(self, module: Any, ms: float, kernels: int, sm_count: int):
        import cupy

        self.cupy, self.fn, self.kernels = cupy, module.get_function("fill_sms"), kernels
        self.ns = np.uint64(round(ms * 1e6 / kernels))
        self.grid = sm_count * 8

    def launch(self, stamps: np.uint64 | None = None) -> None:
        s = np.uint64(0) if stamps is None else stamps
        for k in range(self.kernels):
            self.fn((self.grid,), (THREADS,), (self.ns, s, np.int32(k == 0), np.int32(k == self.kernels - 1)))

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


def device_pointer_check(ptr: int) -> str:
    """What the driver says about reaching registered host memory at ``ptr`` from a kernel."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dptr = ctypes.c_uint64()
    rc = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(ptr), 0)
    if rc != 0:
        return f"cuMemHostGetDevicePointer failed ({rc})"
    return "same" if dptr.value == ptr else f"differs ({dptr.value:#x} for {ptr:#x})"


def sample_pointers(ds: GDSDataset, epoch: int, name: str) -> np.ndarray:
    """The host address of every sample of ``epoch``'s stream for field ``name`` (in the locked mappings)."""
    layout, backend = ds._layout, ds._backend
    f = ds.meta.fields[name]
    ids = epoch_plan(ds.config, epoch).sample_ids()
    chunk = ids // f.samples_per_block
    offsets = layout.block_offsets[name][chunk]
    if (offsets < 0).any():
        raise SystemExit(f"field {name}: chunks never written; zero-copy needs every chunk stored")
    bases = np.array([backend._maps[p].ptr for p in layout.paths(name)], np.uint64)
    ptrs = bases[layout.chunk_files[name][chunk]] + (offsets + (ids % f.samples_per_block) * f.sample_bytes).astype(
        np.uint64)
    return ptrs


class ZeroCopy:
    """Batches of one field gathered straight from the locked pages by a kernel launched from ``next()``,
    ``ahead`` batches before they are taken, ``group`` batches per launch."""

    def __init__(self, ds: GDSDataset, module: Any, name: str, blocks: int, ahead: int = 4, group: int = 1):
        import cupy

        self.cupy, self.ds, self.name = cupy, ds, name
        self.kernel = module.get_function("gather_host")
        self.f = ds.meta.fields[name]
        if self.f.sample_bytes % 16:
            raise SystemExit(f"field {name}: {self.f.sample_bytes} bytes a sample is not whole 16-byte words")
        self.blocks, self.ahead, self.group = blocks, ahead, group
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fence = cupy.cuda.Event(disable_timing=True)
        self.epoch = 0
        self.ptrs: dict[int, Any] = {}

    def table(self, epoch: int) -> Any:
        if epoch not in self.ptrs:
            host = sample_pointers(self.ds, epoch, self.name)
            if (host % 16).any():
                raise SystemExit(f"field {self.name}: sample addresses not 16-byte aligned")
            self.ptrs = {epoch: self.cupy.asarray(host)}
        return self.ptrs[epoch]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        cupy, f = self.cupy, self.f
        ptrs = self.table(self.epoch)
        self.epoch += 1
        n = int(ptrs.shape[0])
        nb = -(-n // BATCH)
        words = f.sample_bytes // 16
        pending: collections.deque[tuple[Any, Any]] = collections.deque()
        consumer = cupy.cuda.get_current_stream()
        issued = 0

        def issue() -> int:
            first, stop = issued, min(nb, issued + self.group)
            lo, hi = first * BATCH, min(n, stop * BATCH)
            with self.stream:
                out = cupy.empty((hi - lo, *f.sample_shape), f.dtype)
                self.stream.wait_event(consumer.record(self.fence))  # memory the consumer dropped
                self.kernel((min(self.blocks, hi - lo),), (THREADS,),
                            (ptrs[lo:hi], out, np.int64(hi - lo), np.int64(words)))
                ev = self.stream.record(cupy.cuda.Event(disable_timing=True))
            for i in range(first, stop):
                pending.append((out[i * BATCH - lo:min(n, (i + 1) * BATCH) - lo], ev))
            return stop

        for i in range(nb):
            while issued < nb and issued < i + self.ahead:
                issued = issue()
            out, ev = pending.popleft()
            consumer.wait_event(ev)
            yield {self.name: out}


def copy_rate(ds: GDSDataset) -> float:
    """GB/s of 4 MiB copies of every shard file's locked pages to one device buffer (the H2D rate itself)."""
    import cupy

    maps = list(ds._backend._maps.values())
    dst = cupy.empty(4 << 20, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    total = 0
    t0 = time.perf_counter()
    for m in maps:
        for off in range(0, m.size - (4 << 20) + 1, 4 << 20):
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, m.ptr + off, 4 << 20, 1, stream.ptr)
            total += 4 << 20
    stream.synchronize()
    return total / (time.perf_counter() - t0) / 1e9


def pass_rate(batches: Any) -> float:
    import cupy

    t0, nbytes = time.perf_counter(), 0
    for b in batches:
        nbytes += sum(a.nbytes for a in b.values())
    cupy.cuda.get_current_stream().synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    import cupy

    from gdsload.kernel_cache import load_module

    ap = probe_parser(__doc__.splitlines()[0])
    add_step_options(ap)
    ap.add_argument("--grids", default="16,32,66,132,264", help="zero-copy grid sizes for the rate rows")
    ap.add_argument("--blocks", type=int, default=132, help="zero-copy grid size for the waiting rows")
    ap.add_argument("--full-kernels", type=int, default=24)
    args = parse_probe_args(ap, argv)
    rows = Rows()
    path = make_dataset(args.data, args.size_gib)
    read_files(shard_paths(path))
    ds = GDSDataset(path, batch_size=BATCH, backend="mmap", shuffle=True, fields=["image"])
    time_pass(ds)
    backend = ds._backend
    backend._loader.wait(list(backend._ranges), None)  # every range locked: the steady state
    first = next(iter(backend._maps.values()))
    dev = cupy.cuda.Device()
    attr = cupy.cuda.runtime.deviceGetAttribute(91, dev.id)  # cudaDevAttrCanUseHostPointerForRegisteredMem
    check = device_pointer_check(first.ptr)
    print("host pointer usable:", attr, "device pointer:", check, flush=True)
    if not check.startswith("same"):
        raise SystemExit("registered pages are not reachable at their host address; this probe needs that")
    module = load_module(cupy, SOURCE, dev.id, probe="gather_host")
    sm = int(cupy.cuda.runtime.deviceGetAttribute(16, dev.id))

    # correctness: a zero-copy pass equals the library's pass of the same epoch
    zc = ZeroCopy(ds, module, "image", args.blocks)
    lib = [b["image"] for b in ds]
    zc.epoch = ds._cursor.epoch  # the epoch that pass read
    ds.stop()
    for i, b in enumerate(zc):
        if not bool((b["image"] == lib[i]).all()):
            raise SystemExit(f"zero-copy batch {i} differs from the library's")
    del lib
    print("zero-copy pass equals the library's", flush=True)

    r = time_pass(ds, min_seconds=0.5)
    nb = len(ds)
    ms = step_ms(r, args.factor)
    spin = Stamped(Spin(ms, 1), nb + 1)
    full = Stamped(FullStep(module, ms, args.full_kernels, sm), nb + 1)  # type: ignore[arg-type]
    for s in (spin, full):
        for _ in range(2 * nb):
            s.spin.launch()
        s.spin.synchronize()
        s.gaps_us()
    zcs = {"zc": ZeroCopy(ds, module, "image", args.blocks),
           "zc-g4": ZeroCopy(ds, module, "image", args.blocks, ahead=8, group=4)}

    for rep in range(args.repeats):
        ds.stop()
        rates = {"copy-4MiB": copy_rate(ds), "library": pass_rate(ds)}
        ds.stop()
        for g in args.grids.split(","):
            rates[f"zc-{g}"] = pass_rate(ZeroCopy(ds, module, "image", int(g)))
        rows.emit({"kind": "rate", "repeat": rep, "gb_per_s": {k: round(v, 2) for k, v in rates.items()}})
        print("rates", rates, flush=True)
        for step_name, step in (("spin", spin), ("full", full)):
            alone_s = time_alone(step, nb)
            names = ["alone", "base", "zc", "zc-g4"] if step_name == "spin" else ["alone", "base", "zc"]
            for name in names if rep % 2 == 0 else names[::-1]:
                if name == "alone":
                    got = passes(lambda: range(nb), step, args.passes, alone_s)
                elif name == "base":
                    ds.stop()
                    got = passes(lambda: ds, step, args.passes, alone_s)
                else:
                    ds.stop()  # nothing of the library reads beside it
                    got = passes(lambda z=zcs[name]: z, step, args.passes, alone_s)
                rows.emit({"kind": "waiting", "step": step_name, "variant": name, "repeat": rep,
                           "step_ms": round(ms, 3), "batches": nb, "alone_s": round(alone_s, 4), **got})
                print(step_name, name, got, flush=True)
    ds.close()
    print("wrote", write_probe(args, "probe-zero-copy", rows, host_pointer=check), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
