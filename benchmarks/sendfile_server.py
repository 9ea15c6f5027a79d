"""A threaded HTTP/1.1 file server for the remote benchmarks: ranged GETs answered with ``os.sendfile`` from the
page cache, so the server copies no byte through Python and is not what is measured.

    python -m benchmarks.sendfile_server ROOT [--port 0]    # prints PORT, then serves until killed

The files under ROOT (links followed) at their paths; an S3 client reaches it path-style, its signature ignored.
:class:`RangeHandler` (the HTTP semantics) is shared with the tests' fault-injecting server. Standard library
only."""

from __future__ import annotations

import argparse
import email.utils
import http.server
import os
import re
import sys
import threading
import time
import urllib.parse

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def byte_range(spec: str | None, size: int) -> tuple[int, int, bool] | None:
    """``(lo, hi, partial)`` that a ``Range`` header (``bytes=a-b`` / ``a-`` / ``-n``) asks of ``size`` bytes: the
    whole object, not partial, without a header or with one this does not parse; None when unsatisfiable (416)."""
    m = _RANGE.match((spec or "").strip())
    if m is None or not (m.group(1) or m.group(2)):
        return 0, size, False
    a, b = m.group(1), m.group(2)
    lo, hi = (int(a), min(int(b) + 1, size) if b else size) if a else (max(size - int(b), 0), size)
    return None if lo >= size or hi <= lo else (lo, hi, True)


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """HEAD and GET of the files under ``root``: a strong ``ETag`` of size and modification time, ``If-Match``
    naming another ETag 412, ranges 206 with ``Content-Range``, an unsatisfiable one 416, a missing file 404;
    kept-alive connections. Subclasses send the body (:meth:`send_body`)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    root = "."

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.serve(body=False)

    def do_GET(self) -> None:
        self.serve(body=True)

    def plain(self, status: int, extra: dict[str, str] | None = None) -> None:
        """A status without content: ``"<status>\\n"`` as the body of a GET."""
        payload = f"{status}\n".encode() if self.command != "HEAD" else b""
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def allowed(self) -> bool:
        """Whether the request may be answered (subclasses check credentials; a refusal is sent there)."""
        return True

    def serve(self, body: bool) -> None:
        if not self.allowed():
            return
        path = os.path.join(self.root, urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/"))
        full = os.path.realpath(path)
        if not os.path.isfile(full):
            self.plain(404)
            return
        st = os.stat(full)
        size, etag = st.st_size, f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        match = self.headers.get("If-Match")
        if match is not None and match.strip() != "*" and etag not in [t.strip() for t in match.split(",")]:
            self.plain(412, {"ETag": etag})
            return
        wanted = byte_range(self.headers.get("Range"), size)
        if wanted is None:
            self.plain(416, {"Content-Range": f"bytes */{size}", "ETag": etag, "Accept-Ranges": "bytes"})
            return
        lo, hi, partial = wanted
        self.send_response(206 if partial else 200)
        self.send_header("Content-Length", str(hi - lo))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if partial:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
        self.end_headers()
        if body:
            self.send_body(full, lo, hi)

    def send_body(self, path: str, lo: int, hi: int) -> None:
        """Bytes ``lo .. hi`` of the file at ``path`` into the connection, by ``sendfile`` (the kernel copies)."""
        self.wfile.flush()
        with open(path, "rb") as f:
            out = self.connection.fileno()
            while lo < hi:
                n = os.sendfile(out, f.fileno(), lo, min(hi - lo, 1 << 30))
                if n == 0:
                    raise ConnectionError("the client went away")
                lo += n


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


def serve_forever(handler: type[RangeHandler], port: int = 0) -> None:
    """Listen on 127.0.0.1 (``port`` 0: any), print the port (one line, flushed), serve until killed."""
    server = Server(("127.0.0.1", port), handler)
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    RangeHandler.root = os.path.abspath(args.root)
    serve_forever(RangeHandler, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
