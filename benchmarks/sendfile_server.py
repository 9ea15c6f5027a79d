"""A small threaded HTTP/1.1 file server for the remote benchmarks: ranged GETs answered with ``os.sendfile`` from
the files (the page cache), so the server copies no byte through Python and is not what is measured.

    python -m benchmarks.sendfile_server ROOT [--port 0]

prints ``PORT`` (one line, flushed) once it listens on 127.0.0.1, then serves until killed: the files under ROOT
(symbolic links followed) at their paths; HEAD and GET with ``Content-Length``, a strong ``ETag`` of the file's
size and modification time, ``Range: bytes=a-b`` / ``a-`` / ``-n`` answered 206 with ``Content-Range``, an
unsatisfiable range 416, an ``If-Match`` naming another ETag 412, a missing file 404; kept-alive connections,
a thread each. Requests are not authenticated: an S3 client reaches it path-style (``/BUCKET/KEY`` is
``ROOT/BUCKET/KEY``), its signature ignored. Standard library only; not gdsload's test server (tests/), which
holds its objects in memory and injects faults.
"""

from __future__ import annotations

import argparse
import email.utils
import http.server
import os
import re
import socket
import sys
import threading
import time
import urllib.parse

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    root = "."

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _plain(self, status: int, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        full = os.path.realpath(os.path.join(self.root, path.lstrip("/")))
        try:
            fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._plain(404)
            return
        try:
            st = os.fstat(fd)
            if not os.path.isfile(full):
                self._plain(404)
                return
            size, etag = st.st_size, '"%x-%x"' % (st.st_size, st.st_mtime_ns)
            wanted = self.headers.get("If-Match")
            if wanted is not None and wanted.strip() not in ("*", etag):
                self._plain(412, {"ETag": etag})
                return
            lo, hi, status = 0, size, 200
            spec = self.headers.get("Range")
            if spec:
                m = _RANGE.match(spec.strip())
                if m is None or m.group(1) == m.group(2) == "":
                    self._plain(416, {"Content-Range": f"bytes */{size}"})
                    return
                a, b = m.group(1), m.group(2)
                lo, hi = (max(0, size - int(b)), size) if a == "" else (int(a), min(size, int(b) + 1 if b else size))
                if lo >= size or hi <= lo:
                    self._plain(416, {"Content-Range": f"bytes */{size}"})
                    return
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(hi - lo))
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            if status == 206:
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
            self.end_headers()
            if body:
                self.wfile.flush()
                _send(self.connection, fd, lo, hi)
        finally:
            os.close(fd)


def _send(sock: socket.socket, fd: int, lo: int, hi: int) -> None:
    """Bytes ``lo .. hi`` of ``fd`` into ``sock`` by ``sendfile`` (the kernel copies them)."""
    out = sock.fileno()
    while lo < hi:
        n = os.sendfile(out, fd, lo, min(hi - lo, 1 << 30))
        if n == 0:
            raise ConnectionError("the client went away")
        lo += n


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    Handler.root = os.path.abspath(args.root)
    server = Server(("127.0.0.1", args.port), Handler)
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
