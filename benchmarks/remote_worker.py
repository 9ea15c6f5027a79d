"""One measurement of benchmarks/remote.py in a process of its own (a fresh process per run: nothing one leaves
warm, KvikIO's pool or a client's connections, carries into the next).

    python -m benchmarks.remote_worker JSON

``JSON`` names the case and its settings; the last line printed is ``RESULT {...}``:

- ``{"case": "client", "client": NAME, "url", "skeleton", "concurrency"}``: a plain client's sweep
  (benchmarks/remote_ceiling.py) over every block of the dataset, shuffled;
- ``{"case": "direct", "url", "backend", "seconds", "batch_size"}``: the direct route (with ``backend_options``
  where given), a few batches untimed, then a pass of at least ``seconds``;
- ``{"case": "cached", ...,  "cache"}``: the cached route into the empty folder ``cache``: the open and first pass
  (cold), then a warm pass of at least ``seconds``;
- ``{"case": "node", ..., "cache"}``: one node of many (``RANK`` and ``WORLD_SIZE`` from the environment): the open
  and one epoch into its own empty cache folder, cold, no reading on into the next epoch; its wall-clock start
  and end (``time.time()``), the bytes it delivered and the bytes it fetched.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from typing import Any


def _dataset(url: str, c: dict[str, Any], **options: Any) -> Any:
    from gdsload import GDSDataset

    if c.get("backend_options"):
        options["backend_options"] = c["backend_options"]
    if c.get("resident_bytes") is not None:
        options["resident_bytes"] = c["resident_bytes"]
    return GDSDataset(url, batch_size=c["batch_size"], backend=c["backend"], shuffle=True, seed=0, **options)


def client(c: dict[str, Any]) -> dict[str, Any]:
    from gdsload.tools.bench_remote import remote_blocks

    from .remote_ceiling import ranges_of, sweep

    ranges = ranges_of(remote_blocks(c["url"], c["skeleton"]))
    return {"bytes": sum(r.nbytes for r in ranges), **sweep(c["client"], ranges, c["concurrency"])}


def direct(c: dict[str, Any]) -> dict[str, Any]:
    from gdsload.system.env import gpu_available
    from gdsload.tools.measure import take_batches, time_pass

    if not gpu_available():
        return {"skip": "no GPU here"}
    with _dataset(c["url"], c) as ds:
        route = ds.describe()["remote"]["route"]
        if route != "direct":
            return {"skip": f"took the {route} route: {ds.describe()['remote']['route_reason']}"}
        take_batches(ds)
        r = time_pass(ds, min_seconds=c["seconds"])
        return {"gbps": round(r.gb_per_s, 3), "io_mode": r.io_mode, "bytes": r.bytes}


def cached(c: dict[str, Any]) -> dict[str, Any]:
    from gdsload.tools.measure import time_pass

    started = time.perf_counter()
    with _dataset(c["url"], c, cache_dir=c["cache"]) as ds:
        opened = time.perf_counter() - started
        cold = time_pass(ds, from_rest=False)
        cold = dataclasses.replace(cold, seconds=time.perf_counter() - started)
        remote = ds.describe()["remote"]
        warm = time_pass(ds, min_seconds=c["seconds"])
    return {"cold_gbps": round(cold.gb_per_s, 3), "warm_gbps": round(warm.gb_per_s, 3), "open_s": round(opened, 3),
            "io_mode": warm.io_mode, "route": remote["route"], "fetched_bytes": remote["fetched_bytes"]}


def node(c: dict[str, Any]) -> dict[str, Any]:
    from gdsload.tools.measure import time_pass

    t0 = time.time()
    with _dataset(c["url"], c, cache_dir=c["cache"], prefetch_next_epoch=False) as ds:
        r = time_pass(ds, from_rest=False)
        t1 = time.time()
        remote = ds.describe()["remote"]
    return {"start": t0, "end": t1, "bytes": r.bytes, "fetched_bytes": remote["fetched_bytes"],
            "route": remote["route"]}


CASES = {"client": client, "direct": direct, "cached": cached, "node": node}


def main(argv: list[str] | None = None) -> int:
    c = json.loads((argv if argv is not None else sys.argv[1:])[0])
    try:
        out = CASES[c["case"]](c)
    except Exception as e:  # noqa: BLE001 - the row says why; the run goes on
        traceback.print_exc()
        out = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:400]}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
