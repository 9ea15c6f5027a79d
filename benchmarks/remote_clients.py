"""The CPU route's client, chosen by measurement: the same ranged reads of one object through each candidate
client, against local servers this script starts.

    python -m benchmarks.remote_clients [--size-gib 1] [--ranges 4MiB,16MiB] [--threads 1,8] [--repeats 3]

Servers, each in a process of its own (so the clients' CPU time and GIL are theirs alone):
``aiohttp`` serves the object from a file with sendfile (``web.FileResponse``: Range, ETag, If-Match), at
``http://HOST/bench/OBJECT`` and, path-style, as ``s3://bench/OBJECT`` (a static server answers a GetObject as
S3 does: 206, Content-Range, ETag), so every client reads the same bytes from a server that is not the
bottleneck; ``moto`` is moto's S3 server (S3's semantics, signed requests, its own Python overhead).
Clients: gdsload's ``HttpClient`` and ``S3Client``, raw botocore ``get_object(Range=...)``, fsspec's http
filesystem (``cat_file``), and s3fs and obstore where importable (else a row says they were not measured).

Every client reads the same ranges (range-aligned offsets covering ``--bytes-per-case``, shuffled with seed
0), sequentially or on N threads, each read checked for its length and the first of each case for its bytes.
A case is timed ``--repeats`` times, the clients in a rotated order each time; rows keep every run's GB/s, the
median and best, and the client process's CPU seconds per GB (user + system, the best run's). Writes
``results/<machine>/remote-clients[-TAG].json`` and a markdown table beside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gdsload.tools.cli import parse_bytes

from .common import Rows, parse_probe_args, probe_parser, write_probe_table

BUCKET = "bench"
#: Fake keys for the local servers (moto checks none; botocore wants some to sign with).
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
Read = Callable[[int, int], Any]  # (offset, nbytes) -> the bytes


# -- servers, each in its own process -----------------------------------------------------------------------
def _serve_files(root: str, conn: Any) -> None:
    """aiohttp serving ``root``'s files (sendfile, Range, ETag) on 127.0.0.1; sends its port down ``conn``."""
    serve_files_on(root, 0, conn)


def serve_files_on(root: str, port: int, conn: Any) -> None:
    """aiohttp serving ``root``'s files (``web.FileResponse``: sendfile, Range, ETag, If-Match) on 127.0.0.1:``port``
    (0: a free one), its socket bound with ``SO_REUSEPORT`` so that several such processes share one port (the
    kernel spreads the connections over them); sends the port down ``conn`` and serves until killed."""
    import asyncio
    import socket

    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        path = os.path.join(root, request.match_info["tail"])
        if not os.path.isfile(path):
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/{tail:.+}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(runner, sock, backlog=1024).start()
        conn.send(sock.getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(run())


def _serve_moto(conn: Any) -> None:
    """moto's S3 server on 127.0.0.1; sends its port down ``conn`` and serves until killed."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port()[1])
    threading.Event().wait()


@contextlib.contextmanager
def server(target: Callable[..., None], *args: Any) -> Iterator[str]:
    """``target`` started in a process of its own; yields ``http://127.0.0.1:PORT``, stops it after."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{target.__name__}: no port within 60 s")
        yield f"http://127.0.0.1:{parent.recv()}"
    finally:
        proc.terminate()
        proc.join(10)


@contextlib.contextmanager
def servers(target: Callable[..., None], workers: int, *args: Any) -> Iterator[str]:
    """``workers`` processes of ``target(*args, port, conn)`` (:func:`serve_files_on`): the first on a free port,
    the others on the same one (``SO_REUSEPORT``: the kernel spreads the connections over them). Yields
    ``http://127.0.0.1:PORT`` once all listen; stops them after."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    try:
        port = 0
        for _ in range(max(1, workers)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args, port, child), daemon=True)
            proc.start()
            procs.append(proc)
            if not parent.poll(60):
                raise RuntimeError(f"{target.__name__}: no port within 60 s")
            port = parent.recv()
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)


# -- the object --------------------------------------------------------------------------------------------
def make_object(root: str, size: int) -> str:
    """A file of ``size`` random bytes at ``root/bench/object-SIZE.bin`` (kept when already there)."""
    path = os.path.join(root, BUCKET, f"object-{size}.bin")
    if os.path.exists(path) and os.path.getsize(path) == size:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(0)
    with open(path + ".tmp", "wb") as f:
        for off in range(0, size, 16 << 20):
            f.write(rng.randbytes(min(16 << 20, size - off)))
    os.replace(path + ".tmp", path)
    return path


# -- the clients -------------------------------------------------------------------------------------------
def _gdsload_http(url: str, **_: Any) -> Read:
    from gdsload.remote.http import HttpClient

    client = HttpClient()
    info = client.head(url)
    return lambda off, n: client.read(info, off, n)


def _gdsload_s3(url: str, endpoint: str, **_: Any) -> Read:
    from gdsload.remote.s3 import S3Client

    client = S3Client(endpoint_url=endpoint)
    info = client.head(url)
    return lambda off, n: client.read(info, off, n)


def _botocore(url: str, endpoint: str, **_: Any) -> Read:
    import botocore.session
    from botocore.config import Config

    s3 = botocore.session.get_session().create_client("s3", endpoint_url=endpoint,
                                                      config=Config(max_pool_connections=64))
    bucket, key = url[len("s3://"):].split("/", 1)
    return lambda off, n: s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"].read()


def _fsspec_http(url: str, **_: Any) -> Read:
    import fsspec

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    return lambda off, n: fs.cat_file(url, start=off, end=off + n)


def _s3fs(url: str, endpoint: str, **_: Any) -> Read:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=FAKE_AWS["AWS_ACCESS_KEY_ID"], skip_instance_cache=True,
                           secret=FAKE_AWS["AWS_SECRET_ACCESS_KEY"])
    return lambda off, n: fs.cat_file(url, start=off, end=off + n)


def _obstore_http(url: str, **_: Any) -> Read:
    import obstore
    from obstore.store import HTTPStore

    base, name = url.rsplit("/", 1)
    store = HTTPStore.from_url(base, client_options={"allow_http": True})
    return lambda off, n: obstore.get_range(store, name, start=off, end=off + n)


def _obstore_s3(url: str, endpoint: str, **_: Any) -> Read:
    import obstore
    from obstore.store import S3Store

    bucket, key = url[len("s3://"):].split("/", 1)
    store = S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
                    secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"], client_options={"allow_http": True})
    return lambda off, n: obstore.get_range(store, key, start=off, end=off + n)


#: name -> (scheme, the module it needs, the factory).
CLIENTS: dict[str, tuple[str, str, Callable[..., Read]]] = {
    "gdsload HttpClient": ("http", "gdsload", _gdsload_http),
    "gdsload S3Client (botocore)": ("s3", "botocore", _gdsload_s3),
    "botocore get_object": ("s3", "botocore", _botocore),
    "fsspec http": ("http", "fsspec", _fsspec_http),
    "s3fs": ("s3", "s3fs", _s3fs),
    "obstore http": ("http", "obstore", _obstore_http),
    "obstore s3": ("s3", "obstore", _obstore_s3),
}


def versions() -> dict[str, str | None]:
    """The installed version of every package a client or server here uses (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("botocore", "fsspec", "aiohttp", "s3fs", "obstore", "moto"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# -- timing ------------------------------------------------------------------------------------------------
def ranges(size: int, range_bytes: int, total: int) -> list[int]:
    """Offsets of ``range_bytes`` ranges covering ``total`` bytes (at most the object), shuffled with seed 0."""
    offsets = list(range(0, size - range_bytes + 1, range_bytes))
    random.Random(0).shuffle(offsets)
    return offsets[:max(1, min(len(offsets), total // range_bytes))]


def time_case(read: Read, offsets: list[int], n: int, threads: int, expect: bytes) -> tuple[float, float]:
    """Seconds and client CPU seconds to read every ``offsets`` range (``n`` bytes) on ``threads`` threads;
    each read's length checked, the first's bytes against ``expect``."""
    def one(off: int) -> int:
        got = read(off, n)
        if len(got) != n:
            raise RuntimeError(f"{len(got)} bytes at {off} (expected {n})")
        return len(got)

    if bytes(read(offsets[0], n)[:64]) != expect:
        raise RuntimeError(f"the bytes at {offsets[0]} differ from the object's")
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        list(pool.map(one, offsets) if pool else map(one, offsets))
        took, cpu1 = time.perf_counter() - t0, time.process_time()
    finally:
        if pool:
            pool.shutdown()
    return took, cpu1 - cpu0


def measure(server_name: str, clients: dict[str, Read], path: str, cases: list[tuple[int, int]], total: int,
            repeats: int, rows: Rows) -> None:
    """Every case for every client of one server, clients rotated each repeat; a row per (client, case)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for range_bytes, threads in cases:
            offsets = ranges(size, range_bytes, total)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
            errors: dict[str, str] = {}
            names = list(clients)
            for rep in range(repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    if name in errors:
                        continue
                    try:
                        runs[name].append(time_case(clients[name], offsets, range_bytes, threads,
                                                    os.pread(f.fileno(), 64, offsets[0])))
                    except Exception as e:
                        errors[name] = f"{type(e).__name__}: {e}"
            for name in names:
                row: dict[str, Any] = {"server": server_name, "client": name, "range_bytes": range_bytes,
                                       "threads": threads, "requests": len(offsets),
                                       "bytes": len(offsets) * range_bytes}
                if name in errors:
                    row["error"] = errors[name][:300]
                else:
                    gbps = [row["bytes"] / s / 1e9 for s, _ in runs[name]]
                    best = max(range(len(gbps)), key=gbps.__getitem__)
                    row.update(gb_per_s=round(gbps[best], 3), gb_per_s_median=round(statistics.median(gbps), 3),
                               gb_per_s_runs=[round(g, 3) for g in gbps],
                               cpu_s_per_gb=round(runs[name][best][1] / (row["bytes"] / 1e9), 3))
                rows.emit(row)


def setup(names: list[str], urls: dict[str, str], endpoint: str, server_name: str, rows: Rows) -> dict[str, Read]:
    """The clients of ``names`` that can run (one warm-up read each); a row for each that cannot."""
    made = {}
    for name in names:
        scheme, module, factory = CLIENTS[name]
        if importlib.util.find_spec(module) is None:
            rows.emit({"server": server_name, "client": name, "skipped": f"{module} is not installed: not measured"})
            continue
        try:
            read = factory(urls[scheme], endpoint=endpoint)
            read(0, 1)
            made[name] = read
        except Exception as e:
            rows.emit({"server": server_name, "client": name, "error": f"{type(e).__name__}: {e}"[:300]})
    return made


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def markdown(rows: list[dict[str, Any]], cases: list[tuple[int, int]], repeats: int) -> str:
    """A table per server: GB/s (median and best of ``repeats``) and the client's CPU s/GB, a column per case."""
    heads = [f"{_mib(r)} x{t} thread{'s' if t > 1 else ''}" for r, t in cases]
    out = [f"Each cell: GB/s median / best of {repeats} runs, then the client's CPU seconds per GB (best run); "
           "ranged GETs of one object from a local server in another process.", ""]
    for server_name in dict.fromkeys(r["server"] for r in rows):
        out += [f"### {server_name}", "", "| client | " + " | ".join(heads) + " |",
                "|---|" + "---:|" * len(heads)]
        mine = [r for r in rows if r["server"] == server_name]
        for name in sorted(dict.fromkeys(r["client"] for r in mine), key=list(CLIENTS).index):
            got = [r for r in mine if r["client"] == name]
            if "skipped" in got[0] or ("error" in got[0] and "range_bytes" not in got[0]):
                out.append(f"| {name} | " + " | ".join(["not measured"] * len(heads)) + " |")
                continue
            cells = []
            for rb, t in cases:
                r = next((x for x in got if x.get("range_bytes") == rb and x.get("threads") == t), None)
                cells.append("-" if r is None else "error" if "error" in r else
                             f"{r['gb_per_s_median']:.2f} / {r['gb_per_s']:.2f}, {r['cpu_s_per_gb']:.2f}")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    notes = [f"- {r['server']} / {r['client']}: {r.get('skipped') or r.get('error')}" for r in rows
             if "skipped" in r or "error" in r]
    return "\n".join(out + (["Not measured or failed:", *notes, ""] if notes else []))


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__.splitlines()[0], size_gib=1.0)
    ap.add_argument("--ranges", default="4MiB,16MiB", help="range sizes, comma-separated")
    ap.add_argument("--threads", default="1,8", help="thread counts, comma-separated")
    ap.add_argument("--bytes-per-case", type=parse_bytes, default=parse_bytes("512MiB"),
                    help="bytes each client reads per case (at most the object)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--servers", default="aiohttp,moto", help="aiohttp (sendfile, no bottleneck), moto (S3)")
    ap.add_argument("--moto-bytes", type=parse_bytes, default=parse_bytes("128MiB"),
                    help="moto's object and bytes per case: moto copies the object per ranged GET, so it is slow")
    args = parse_probe_args(ap, argv)
    os.environ.update(FAKE_AWS)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(k, None)
    size = int(args.size_gib * 2**30)
    root = os.path.join(args.data, "remote-clients")
    path = make_object(root, size)
    key = f"{BUCKET}/{os.path.basename(path)}"
    cases = [(parse_bytes(r), int(t)) for r in args.ranges.split(",") for t in args.threads.split(",")]
    cases = [(min(r, size), t) for r, t in cases]
    rows = Rows()
    for server_name in args.servers.split(","):
        if server_name == "aiohttp":
            with server(_serve_files, root) as endpoint:
                urls = {"http": f"{endpoint}/{key}", "s3": f"s3://{key}"}
                clients = setup([n for n in CLIENTS], urls, endpoint, "aiohttp (sendfile)", rows)
                measure("aiohttp (sendfile)", clients, path, cases, args.bytes_per_case, args.repeats, rows)
        elif server_name == "moto":
            with server(_serve_moto) as endpoint:
                import boto3

                s3 = boto3.client("s3", endpoint_url=endpoint)
                s3.create_bucket(Bucket=BUCKET)
                small = make_object(root, min(size, args.moto_bytes))
                s3.upload_file(small, BUCKET, os.path.basename(small))
                names = [n for n, (scheme, _, _) in CLIENTS.items() if scheme == "s3"]
                clients = setup(names, {"s3": f"s3://{BUCKET}/{os.path.basename(small)}"}, endpoint,
                                "moto (S3 server)", rows)
                measure("moto (S3 server)", clients, small, cases, min(args.bytes_per_case, args.moto_bytes),
                        args.repeats, rows)
        else:
            ap.error(f"--servers: unknown server {server_name!r} (expected aiohttp, moto)")
    write_probe_table(args, "remote-clients", rows, markdown(rows, cases, args.repeats), object_bytes=size,
                      moto_object_bytes=min(size, args.moto_bytes),
                      cases=[{"range_bytes": r, "threads": t} for r, t in cases], repeats=args.repeats,
                      bytes_per_case=args.bytes_per_case, cpu_count=os.cpu_count(), versions=versions(),
                      method=__doc__.split("\n\n")[2] + "\n\n" + __doc__.split("\n\n")[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
