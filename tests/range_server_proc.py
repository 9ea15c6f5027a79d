"""A Range server in a process of its own, for the tests that stop it (SIGSTOP), kill it, or need it to misbehave
where a thread of the test's process could not (the test's own threads keep running when a server stops).

    python tests/range_server_proc.py ROOT [--mode serve|trickle|silent|garbage] [--trickle-over BYTES]
                                           [--user USER:PASSWORD]

prints ``PORT`` (one line, flushed) once it listens on 127.0.0.1, then serves until killed:

- ``serve``: the files under ROOT at their paths: HEAD and GET with ``Content-Length``, an ``ETag`` of the file's
  size and modification time, ``Range: bytes=a-b`` / ``a-`` / ``-n`` answered 206 with ``Content-Range``, an
  unsatisfiable range 416, an ``If-Match`` naming another ETag 412, a missing file 404 (HTTP/1.1, kept alive,
  a thread per connection). With ``--user``, a request without that HTTP Basic authentication is 401.
- ``trickle``: as ``serve``, but every body longer than ``--trickle-over`` bytes (0) one byte a second.
- ``silent``: accepts every connection and never sends a byte.
- ``garbage``: answers every connection with bytes that are not HTTP, then closes it.

Standard library only: it runs wherever the tests do."""

from __future__ import annotations

import argparse
import base64
import http.server
import os
import re
import socket
import sys
import threading
import time

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    root = "."
    trickle: int | None = None  # bodies longer than this trickle
    user: str | None = None

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _plain(self, status: int, extra: dict[str, str] | None = None) -> None:
        payload = f"{status}\n".encode() if self.command != "HEAD" else b""
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload) if self.command != "HEAD" else 0))
        self.end_headers()
        self.wfile.write(payload)

    def _serve(self, body: bool) -> None:
        if self.user is not None:
            sent = self.headers.get("Authorization", "")
            if sent != "Basic " + base64.b64encode(self.user.encode()).decode():
                self._plain(401, {"WWW-Authenticate": 'Basic realm="test"'})
                return
        path = os.path.normpath(os.path.join(self.root, self.path.split("?", 1)[0].lstrip("/")))
        if not path.startswith(os.path.abspath(self.root)) or not os.path.isfile(path):
            self._plain(404)
            return
        st = os.stat(path)
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        match = self.headers.get("If-Match")
        if match is not None and match.strip() != "*" and etag not in [t.strip() for t in match.split(",")]:
            self._plain(412)
            return
        total, status, start, end = st.st_size, 200, 0, st.st_size
        extra = {"ETag": etag, "Accept-Ranges": "bytes"}
        m = _RANGE.match((self.headers.get("Range") or "").strip())
        if m and (m.group(1) or m.group(2)):
            a, b = m.group(1), m.group(2)
            start, end = (int(a), min(int(b) + 1, total) if b else total) if a else (max(total - int(b), 0), total)
            if start >= total or end <= start:
                self._plain(416, {"Content-Range": f"bytes */{total}", **extra})
                return
            status, extra["Content-Range"] = 206, f"bytes {start}-{end - 1}/{total}"
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        if self.trickle is None or len(data) <= self.trickle:
            self.wfile.write(data)
            return
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(1.0)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def raw(mode: str) -> None:
    """``silent`` or ``garbage``: a listening socket whose connections get nothing, or no HTTP."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    print(sock.getsockname()[1], flush=True)
    held = []
    while True:
        conn, _ = sock.accept()
        if mode == "silent":
            held.append(conn)  # kept open, never answered
            continue
        try:
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n")
        except OSError:
            pass
        finally:
            conn.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--mode", default="serve", choices=["serve", "trickle", "silent", "garbage"])
    p.add_argument("--trickle-over", type=int, default=0, help="trickle: only bodies longer than this")
    p.add_argument("--user", default=None, help="USER:PASSWORD that requests must send (HTTP Basic)")
    args = p.parse_args()
    if args.mode in ("silent", "garbage"):
        raw(args.mode)
        return
    Handler.root, Handler.user = os.path.abspath(args.root), args.user
    Handler.trickle = args.trickle_over if args.mode == "trickle" else None
    server = Server(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
