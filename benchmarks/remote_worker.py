"""One measurement of benchmarks/remote.py in a process of its own (no pool or connection carries over): a plain
client's sweep (``client``), or a gdsload route: ``direct``, ``cached`` (cold open and pass, then warm) or one
``node`` of many (``RANK``, ``WORLD_SIZE``: the open and one epoch, its wall-clock start and end).

    python -m benchmarks.remote_worker JSON    # {"case": ..., settings}; the last line printed is RESULT {...}"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

#: KvikIO's sweep: (num_threads, task_size) pairs.
KVIKIO_SETTINGS = ((16, 4 << 20), (32, 4 << 20), (64, 4 << 20), (32, 16 << 20), (64, 16 << 20))
#: KvikIO ``pread`` sizes tried: per range, and 64 MiB pieces of each object (KvikIO splits them in tasks).
KVIKIO_PIECE_BYTES = 64 << 20


class Range(NamedTuple):
    """Bytes ``offset .. offset + nbytes`` of the object at ``url`` (of ``size`` bytes), read into ``dest``."""

    url: str
    size: int
    offset: int
    nbytes: int
    dest: int


def ranges_of(blocks: Sequence[Any]) -> list[Range]:
    """The ranges of gdsload's ``RemoteBlock`` list, back to back in one buffer."""
    starts = np.cumsum([0] + [b.nbytes for b in blocks])
    return [Range(b.info.url, b.info.size, b.offset, b.nbytes, int(at)) for b, at in zip(blocks, starts)]


def host_buffer(nbytes: int) -> tuple[np.ndarray, str]:
    """A host buffer of ``nbytes`` (uint8): pinned where CuPy has a GPU; and what it is."""
    try:
        import cupy
        import cupyx

        cupy.cuda.runtime.getDeviceCount()
        return cupyx.empty_pinned((nbytes,), dtype=np.uint8), "pinned host"
    except Exception:  # noqa: BLE001 - no GPU here: pageable memory
        return np.empty(nbytes, dtype=np.uint8), "host"


def _fill(view: memoryview, read_into: Callable[[memoryview], int]) -> None:
    got = 0
    while got < len(view):
        n = read_into(view[got:])
        if not n:
            raise OSError(f"the body ended after {got} of {len(view)} bytes")
        got += n


def _http_client(ranges: Sequence[Range], buf: np.ndarray, threads: int) -> Callable[[int], None]:
    local, mv = threading.local(), memoryview(buf).cast("B")

    def one(i: int) -> None:
        r = ranges[i]
        parts = urllib.parse.urlsplit(r.url)
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("GET", parts.path, headers={"Range": f"bytes={r.offset}-{r.offset + r.nbytes - 1}"})
        resp = conn.getresponse()
        if resp.status != 206:
            raise OSError(f"{r.url}: HTTP {resp.status}")
        _fill(mv[r.dest:r.dest + r.nbytes], resp.readinto)
        resp.read()
    return one


def _urllib3(ranges: Sequence[Range], buf: np.ndarray, threads: int) -> Callable[[int], None]:
    import urllib3

    pool, mv = urllib3.PoolManager(maxsize=threads, block=True, retries=False), memoryview(buf).cast("B")

    def one(i: int) -> None:
        r = ranges[i]
        resp = pool.request("GET", r.url, headers={"Range": f"bytes={r.offset}-{r.offset + r.nbytes - 1}"},
                            preload_content=False)
        try:
            if resp.status != 206:
                raise OSError(f"{r.url}: HTTP {resp.status}")
            _fill(mv[r.dest:r.dest + r.nbytes], resp.readinto)
        finally:
            resp.release_conn()
    return one


def _botocore(ranges: Sequence[Range], buf: np.ndarray, threads: int) -> Callable[[int], None]:
    import botocore.session
    from botocore.config import Config

    endpoint = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(ranges[0].url))
    s3 = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(max_pool_connections=threads, s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def one(i: int) -> None:
        r = ranges[i]
        bucket, key = urllib.parse.urlsplit(r.url).path.lstrip("/").split("/", 1)
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={r.offset}-{r.offset + r.nbytes - 1}")["Body"]
        buf[r.dest:r.dest + r.nbytes] = np.frombuffer(body.read(), dtype=np.uint8)
    return one


def _obstore(ranges: Sequence[Range], buf: np.ndarray, threads: int, s3: bool = False) -> Callable[[int], None]:
    import obstore
    from obstore.store import HTTPStore, S3Store

    parts = urllib.parse.urlsplit(ranges[0].url)
    endpoint, bucket = f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/").split("/", 1)[0]
    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id="bench", secret_access_key="bench",
                    virtual_hosted_style_request=False, client_options={"allow_http": True}) if s3 else \
        HTTPStore.from_url(endpoint, client_options={"allow_http": True})
    skip = len(bucket) + 1 if s3 else 0  # S3 keys are below the bucket

    def one(i: int) -> None:
        r = ranges[i]
        data = obstore.get_range(store, urllib.parse.urlsplit(r.url).path.lstrip("/")[skip:], start=r.offset,
                                 end=r.offset + r.nbytes)
        buf[r.dest:r.dest + r.nbytes] = np.frombuffer(memoryview(data), dtype=np.uint8)
    return one


#: name -> the maker of one request's reader (threads: the concurrency).
THREADED: dict[str, Callable[[Sequence[Range], np.ndarray, int], Callable[[int], None]]] = {
    "http.client": _http_client, "urllib3": _urllib3, "botocore": _botocore, "obstore": _obstore,
    "obstore-s3": functools.partial(_obstore, s3=True)}
#: Every client's name, in the order measured.
CLIENTS = (*THREADED, "fsspec", "kvikio")


def _timed(run: Callable[[], None], nbytes: int) -> float:
    t0 = time.perf_counter()
    run()
    return nbytes / (time.perf_counter() - t0) / 1e9


def threaded_rate(name: str, ranges: Sequence[Range], buf: np.ndarray, threads: int) -> float:
    """GB/s of client ``name`` reading every range once on ``threads`` threads (after one untimed request)."""
    one = THREADED[name](ranges, buf, threads)
    one(0)
    with ThreadPoolExecutor(threads) as pool:
        return _timed(lambda: list(pool.map(one, range(len(ranges)))), sum(r.nbytes for r in ranges))


def fsspec_rate(ranges: Sequence[Range], buf: np.ndarray, batch: int) -> float:
    """GB/s of fsspec's http filesystem reading every range by ``cat_ranges`` with ``batch`` in flight."""
    import fsspec

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    urls, starts = [r.url for r in ranges], [r.offset for r in ranges]
    ends = [r.offset + r.nbytes for r in ranges]

    def run() -> None:
        for r, data in zip(ranges, fs.cat_ranges(urls, starts, ends, batch_size=batch)):
            buf[r.dest:r.dest + r.nbytes] = np.frombuffer(data, dtype=np.uint8)

    fs.cat_file(urls[0], start=starts[0], end=ends[0])
    return _timed(run, sum(r.nbytes for r in ranges))


def kvikio_rate(ranges: Sequence[Range], threads: int, task_bytes: int, pieces: bool) -> float:
    """GB/s of KvikIO ``RemoteFile`` into device memory: a ``pread`` per range, or per 64 MiB piece
    (``pieces``), all in flight, on KvikIO's pool held with ``threads`` and ``task_bytes``."""
    import cupy
    import kvikio

    from gdsload.backends.cuda import KvikioPool

    reads = list(ranges)
    if pieces:
        per: dict[tuple[str, int], int] = {}
        for r in ranges:
            per[(r.url, r.size)] = per.get((r.url, r.size), 0) + r.nbytes
        reads, at = [], 0
        for (url, size), n in per.items():
            for off in range(0, min(n, size), KVIKIO_PIECE_BYTES):
                k = min(KVIKIO_PIECE_BYTES, min(n, size) - off)
                reads.append(Range(url, size, off, k, at))
                at += k
    dest = cupy.empty(sum(r.nbytes for r in reads), dtype=cupy.uint8)
    KvikioPool.acquire(threads, task_bytes, exact=True)
    handles: dict[str, Any] = {}
    try:
        handles.update({r.url: kvikio.RemoteFile.open_http(r.url, r.size) for r in reads})

        def run() -> None:
            futures = [handles[r.url].pread(dest[r.dest:r.dest + r.nbytes], r.nbytes, r.offset) for r in reads]
            if sum(f.get() for f in futures) != dest.nbytes:
                raise OSError("a short read")
            cupy.cuda.runtime.deviceSynchronize()

        handles[reads[0].url].pread(dest[:reads[0].nbytes], reads[0].nbytes, reads[0].offset).get()
        return _timed(run, dest.nbytes)
    finally:
        for h in handles.values():
            getattr(h, "close", lambda: None)()
        KvikioPool.release()


def sweep(name: str, ranges: Sequence[Range], concurrency: Sequence[int]) -> dict[str, Any]:
    """Client ``name`` over its sweep: ``{"gbps": best, "best": setting, "sweep": {setting: GB/s}, "memory"}``, or
    ``{"skip": why}`` where it cannot run here."""
    results: dict[str, float] = {}
    try:
        if name == "kvikio":
            from gdsload.system.env import gpu_available

            if not gpu_available():
                return {"skip": "no GPU here"}
            import kvikio  # noqa: F401

            for threads, task in KVIKIO_SETTINGS:
                for pieces in (False, True):
                    setting = f"num_threads={threads} task_size={task >> 20}MiB pread={'64MiB' if pieces else 'range'}"
                    results[setting] = kvikio_rate(ranges, threads, task, pieces)
            memory = "device"
        else:
            buf, memory = host_buffer(sum(r.nbytes for r in ranges))
            for c in concurrency:
                rate = fsspec_rate(ranges, buf, c) if name == "fsspec" else threaded_rate(name, ranges, buf, c)
                results[f"concurrency={c}"] = rate
    except ImportError as e:
        return {"skip": f"{e.name or e} is not importable"}
    best = max(results, key=results.__getitem__)
    return {"gbps": round(results[best], 3), "best": best, "memory": memory,
            "sweep": {k: round(v, 3) for k, v in results.items()}}


def _dataset(url: str, c: dict[str, Any], **options: Any) -> Any:
    from gdsload import GDSDataset

    if c.get("backend_options"):
        options["backend_options"] = c["backend_options"]
    if c.get("resident_bytes") is not None:
        options["resident_bytes"] = c["resident_bytes"]
    return GDSDataset(url, batch_size=c["batch_size"], backend=c["backend"], shuffle=True, seed=0, **options)


def client(c: dict[str, Any]) -> dict[str, Any]:
    from gdsload.tools.bench_remote import remote_blocks

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
    started = time.perf_counter()
    with _dataset(c["url"], c, cache_dir=c["cache"]):  # the cache complete, the device started: the open's own
        reopened = time.perf_counter() - started
    return {"cold_gbps": round(cold.gb_per_s, 3), "warm_gbps": round(warm.gb_per_s, 3), "open_s": round(opened, 3),
            "reopen_s": round(reopened, 3), "io_mode": warm.io_mode, "route": remote["route"],
            "fetched_bytes": remote["fetched_bytes"]}


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
