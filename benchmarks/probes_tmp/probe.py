"""Scratch probe (not committed): loop a workload for N seconds, printing per-pass GB/s."""
import json, sys, time, os
kind, backend, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
from gdsload import GDSDataset, Mixture
def loop(it, label):
    rates = []; end = time.time() + secs
    while time.time() < end:
        t0 = time.perf_counter(); n = 0
        for b in it:
            n += sum(a.nbytes for a in b.values())
        if backend != "cpu":
            import cupy; cupy.cuda.runtime.deviceSynchronize()
        rates.append(n / (time.perf_counter() - t0) / 1e9)
    print(label, backend, "passes", len(rates), "GB/s", [round(r, 1) for r in rates], flush=True)
if kind == "comp":
    with GDSDataset("/tmp/cz/tokens-zstd.gds", 256, backend=backend, shuffle=True) as ds:
        loop(ds, "comp")
elif kind == "single":
    with GDSDataset(sys.argv[4], 256, backend=backend, shuffle=True, seed=0) as ds:
        loop(ds, "single")
else:
    single, srcs = json.load(open(sys.argv[4]))
    with GDSDataset(single, 256, backend=backend) as s: n = len(s)
    from benchmarks.mixture import SHARES as shares
    with Mixture(srcs, {k: shares[k] for k in srcs}, batch_size=256, num_batches=n, backend=backend, shuffle=True, seed=0) as mix:
        loop(mix, "mix")
