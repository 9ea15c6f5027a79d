"""Real servers for the tests of ``gdsload.remote``: :class:`RangeServer`, an HTTP/1.1 object server with ranged
GETs, strong ETags, ``If-Match`` and faults a test can inject, and :func:`moto_server`, moto's S3 server mode
in-process, reached the standard way (``AWS_ENDPOINT_URL`` and the ``AWS_*`` keys).

Imported by test modules as ``from remote_servers import RangeServer, moto_server`` (``tests/`` is on the path
as for ``_helpers``)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import re
import socket
import threading
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from _helpers import files_below

__all__ = ["RangeServer", "Seen", "client_for_server", "etag_of", "MotoS3", "moto_endpoint", "moto_server", "upload"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def etag_of(data: bytes) -> str:
    """The strong ETag :class:`RangeServer` gives ``data`` (quoted, as on the wire)."""
    return '"%s"' % hashlib.sha256(data).hexdigest()[:32]


@dataclass
class Seen:
    """One request as the server saw it: method, path, headers (a plain dict; names as sent) and the status
    it answered (None for a request whose connection was dropped before an answer, e.g. a timed-out one)."""

    method: str
    path: str
    headers: dict[str, str]
    status: int | None = None
    connection: int = 0  # the index of the TCP connection it came on (keep-alive: the same for a thread's reads)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)


@dataclass
class _Faults:
    fail: list[int] = field(default_factory=list)  # statuses for the next requests, one each
    delays: list[float] = field(default_factory=list)  # seconds to stall the next requests before any answer
    truncate: list[int] = field(default_factory=list)  # body bytes to send before dropping the connection


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait on the client's delayed ACK
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.owner._lock:
            self.server.owner._connections += 1
            self._conn_index = self.server.owner._connections

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError, OSError):
            pass  # the client went away (a timeout it gave up on, a connection it dropped)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._seen.status = code
        super().send_response(code, message)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _simple(self, status: int, extra: Mapping[str, str] | None = None, body: bool = True) -> None:
        payload = f"{status} {http.HTTPStatus(status).phrase}\n".encode() if body else b""
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(payload)

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        self._seen = Seen(self.command, path, dict(self.headers.items()), connection=self._conn_index)
        with owner._lock:
            owner.requests.append(self._seen)
            fail = owner._faults.fail.pop(0) if owner._faults.fail else None
            delay = owner._faults.delays.pop(0) if owner._faults.delays else 0.0
            truncate = owner._faults.truncate.pop(0) if owner._faults.truncate else None
            data = owner.objects.get(path)
            send_etag = owner.send_etags
            honour_range = owner.honour_range
        if delay and owner._closing.wait(delay):
            return
        if fail is not None:
            self._simple(fail)
            return
        if data is None:
            self._simple(404)
            return
        etag = etag_of(data)
        if_match = self._seen.header("If-Match")
        if if_match is not None and if_match.strip() != "*" and etag not in [t.strip() for t in if_match.split(",")]:
            self._simple(412)
            return
        total, status, start, end = len(data), 200, 0, len(data)
        extra = {"Accept-Ranges": "bytes"}
        if send_etag:
            extra["ETag"] = etag
        rng = self._seen.header("Range") if honour_range else None
        m = _RANGE.match(rng.strip()) if rng else None
        if m and (m.group(1) or m.group(2)):
            a, b = m.group(1), m.group(2)
            if a:
                start, end = int(a), (min(int(b) + 1, total) if b else total)
            else:  # suffix: the last b bytes
                start, end = max(total - int(b), 0), total
            if start >= total or (a and b and int(b) < int(a)) or end <= start:
                self._simple(416, {"Content-Range": f"bytes */{total}", **extra})
                return
            status = 206
            extra["Content-Range"] = f"bytes {start}-{end - 1}/{total}"
        payload = data[start:end]
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not body:
            return
        if truncate is not None:
            self.wfile.write(payload[:truncate])
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(payload)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: RangeServer


class RangeServer:
    """An HTTP/1.1 server of in-memory objects (``path -> bytes``) on 127.0.0.1 at a free port, serving in a
    daemon thread: HEAD and GET with ``Content-Length``, a strong ``ETag`` (:func:`etag_of`), ``Range: bytes=a-b``
    (also ``a-`` and ``-n``) answered 206 with ``Content-Range: bytes a-b/total``, an unsatisfiable range 416,
    an ``If-Match`` that names another ETag 412, a missing path 404; kept-alive connections.

    Change objects at any time with ``put``/``delete`` (or ``objects[path] = data``). Faults, each for the next
    requests in arrival order (any method, any path): ``fail_next(n, status)``, ``delay_next(n, seconds)`` (the
    answer stalls, so a client with a shorter timeout gives up), ``truncate_next(n, keep)`` (headers with the full
    ``Content-Length``, then ``keep`` bytes of the body and the connection closed). ``send_etags=False`` serves
    without ETags, ``honour_range=False`` answers every GET whole (200). ``requests`` lists every request seen
    (:class:`Seen`), ``count`` their number, ``connections`` the TCP connections accepted.

    ``with RangeServer({"/a.bin": b"..."}) as srv: srv.url("/a.bin")``.
    """

    def __init__(self, objects: Mapping[str, bytes] | None = None):
        self._lock = threading.Lock()
        self.objects: dict[str, bytes] = {self._path(p): bytes(d) for p, d in (objects or {}).items()}
        self.requests: list[Seen] = []
        self.send_etags = True
        self.honour_range = True
        self._faults = _Faults()
        self._connections = 0
        self._closing = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-range-server", daemon=True)
        self._thread.start()

    # -- objects -------------------------------------------------------------------------------------------
    @staticmethod
    def _path(path: str) -> str:
        return "/" + path.lstrip("/")

    def put(self, path: str, data: bytes) -> str:
        """Serve ``data`` at ``path``; returns its URL."""
        with self._lock:
            self.objects[self._path(path)] = bytes(data)
        return self.url(path)

    def delete(self, path: str) -> None:
        with self._lock:
            del self.objects[self._path(path)]

    def etag(self, path: str) -> str:
        return etag_of(self.objects[self._path(path)])

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{self._path(path) if path else ''}"

    @property
    def base(self) -> str:
        return self.url()

    # -- faults and what was seen --------------------------------------------------------------------------
    def fail_next(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._faults.fail += [status] * n

    def delay_next(self, n: int, seconds: float) -> None:
        with self._lock:
            self._faults.delays += [seconds] * n

    def truncate_next(self, n: int, keep: int = 0) -> None:
        with self._lock:
            self._faults.truncate += [keep] * n

    def clear_faults(self) -> None:
        with self._lock:
            self._faults = _Faults()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    @property
    def connections(self) -> int:
        with self._lock:
            return self._connections

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- life ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()  # stalled answers give up
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> RangeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- S3: moto's server mode ------------------------------------------------------------------------------
@dataclass
class MotoS3:
    """What :func:`moto_server` yields: the endpoint, a fresh bucket on it and a boto3 client of it."""

    endpoint: str
    bucket: str
    client: Any

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return self.url(key)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)


#: The environment :func:`moto_server` sets (besides ``AWS_ENDPOINT_URL``): fake keys, a region, and no
#: profile or ``~/.aws`` file of the machine's that could change what botocore resolves.
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3",
          "AWS_REGION", "AWS_CA_BUNDLE")


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server, in-process on 127.0.0.1 at a free port (``ThreadedMotoServer(port=0)``; the port is read
    back with ``get_host_and_port``). Yields its endpoint URL; on exit moto's state is reset and it stops
    (half a second: werkzeug's shutdown polls), so share one across a module where tests allow it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        yield endpoint
    finally:
        with contextlib.suppress(Exception):
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=5)
        server.stop()


@contextlib.contextmanager
def moto_server(monkeypatch: Any = None, bucket: str | None = None, endpoint: str | None = None
                ) -> Iterator[MotoS3]:
    """An S3 bucket on moto's server reached the standard way: ``AWS_ENDPOINT_URL`` and :data:`FAKE_AWS` set
    (through ``monkeypatch`` where given, else in ``os.environ`` and restored after; the ``_UNSET`` variables
    removed), and a fresh bucket (``bucket`` or a random name) created with boto3. Runs on the server at
    ``endpoint`` (one from :func:`moto_endpoint`, kept running) or, without one, on its own server started here
    and stopped after. gdsload's clients are made anew for it, and again after. Yields :class:`MotoS3`."""
    import boto3

    from gdsload.remote import forget_clients

    with contextlib.nullcontext(endpoint) if endpoint else moto_endpoint() as ep:
        env = {"AWS_ENDPOINT_URL": ep, **FAKE_AWS}
        saved = {k: os.environ.get(k) for k in (*env, *_UNSET)}
        try:
            for k in _UNSET:
                if monkeypatch is not None:
                    monkeypatch.delenv(k, raising=False)
                else:
                    os.environ.pop(k, None)
            for k, v in env.items():
                if monkeypatch is not None:
                    monkeypatch.setenv(k, v)
                else:
                    os.environ[k] = v
            name = bucket or f"gds-{uuid.uuid4().hex[:12]}"
            client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id="testing",
                                  aws_secret_access_key="testing")
            client.create_bucket(Bucket=name)
            forget_clients()  # a client made before read another endpoint: the next use makes one for this
            yield MotoS3(ep, name, client)
        finally:
            forget_clients()
            if monkeypatch is None:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


@contextlib.contextmanager
def client_for_server(server: RangeServer, **options: Any) -> Iterator[Any]:
    """A :class:`gdsload.remote.http.HttpClient` with ``options`` (few retries, short backoff and timeout: what
    fault tests need) as the process's client for ``server``; the default again after."""
    from gdsload.remote import use_client
    from gdsload.remote.http import HttpClient

    client = HttpClient(**options)
    previous = use_client(server.base, client)
    try:
        yield client
    finally:
        use_client(server.base, previous)


def upload(store: RangeServer | MotoS3, path: str, prefix: str = "d.gds") -> str:
    """Every file of the dataset at ``path`` put under ``prefix`` of an HTTP server or an S3 bucket; the
    dataset's URL."""
    for key, data in files_below(path).items():
        store.put(f"{prefix}/{key}", data)
    return store.url(prefix)
