"""A Range server in a process of its own, for the tests that stop it (SIGSTOP), kill it, or need it to misbehave
where a thread of the test's process could not (the test's own threads keep running when a server stops).

    python tests/range_server_proc.py ROOT [--mode serve|trickle|silent|garbage] [--trickle-over BYTES]
                                           [--user USER:PASSWORD]

prints ``PORT`` (one line, flushed) once it listens on 127.0.0.1, then serves until killed:

- ``serve``: the files under ROOT at their paths, as benchmarks/sendfile_server.py's ``RangeHandler`` answers
  them (ETags, ranges, If-Match; HTTP/1.1, kept alive). With ``--user``, a request without that HTTP Basic
  authentication is 401.
- ``trickle``: as ``serve``, but every body longer than ``--trickle-over`` bytes (0) one byte a second.
- ``silent``: accepts every connection and never sends a byte.
- ``garbage``: answers every connection with bytes that are not HTTP, then closes it.

Standard library only (and the checkout's benchmarks/sendfile_server.py): it runs wherever the tests do."""

from __future__ import annotations

import argparse
import base64
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's benchmarks
from benchmarks.sendfile_server import RangeHandler, serve_forever  # noqa: E402


class Handler(RangeHandler):
    """The benchmarks' Range semantics, with HTTP Basic authentication and trickling bodies."""

    trickle: int | None = None  # bodies longer than this trickle
    user: str | None = None

    def allowed(self) -> bool:
        sent = self.headers.get("Authorization", "")
        if self.user is None or sent == "Basic " + base64.b64encode(self.user.encode()).decode():
            return True
        self.plain(401, {"WWW-Authenticate": 'Basic realm="test"'})
        return False

    def send_body(self, path: str, lo: int, hi: int) -> None:
        with open(path, "rb") as f:
            f.seek(lo)
            data = f.read(hi - lo)
        if self.trickle is None or len(data) <= self.trickle:
            self.wfile.write(data)
            return
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(1.0)


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
    serve_forever(Handler)


if __name__ == "__main__":
    sys.exit(main())
