"""Time bounds and messages of remote datasets (issue 58): one ``timeout_s`` bounds every remote wait. Servers
that stall (a process stopped with SIGSTOP), trickle a byte a second, accept and never answer, answer bytes
that are not HTTP, or die; ``close()`` and ``break`` while fetches wait on a stopped server; a wait for another
process's fetch that stops moving; ``cache_bytes`` too small for one read (CacheFull at open); ``get``'s
``max_bytes``; passwords in URLs. The servers run in processes of their own (tests/range_server_proc.py, moto's
``moto_server``), so stopping one stops nothing of the test's; every one is continued and killed in a finally."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from gdsload import FormatError, GDSDataset, GDSLoadError, ReadError
from gdsload.remote.shard_cache import CacheFull
from gdsload.remote import client_for
from gdsload.remote.http import HttpClient

from remote_servers import RangeServer, moto_server, upload

T = 4.0  # the timeout_s of these tests: every bound below is T + 10 %
BOUND = T * 1.1
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "range_server_proc.py")
N, SPB = 600, 16


class Proc:
    """A server process: its URL, and SIGSTOP / SIGCONT / SIGKILL."""

    def __init__(self, proc: subprocess.Popen, base: str):
        self.proc, self.base = proc, base

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}"

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.cont()
        self.proc.kill()
        self.proc.wait(10)


def _port_line(proc: subprocess.Popen, what: str) -> int:
    if not select.select([proc.stdout], [], [], 30)[0]:
        proc.kill()
        pytest.fail(f"{what} did not start")
    return int(proc.stdout.readline())  # type: ignore[union-attr]


@contextlib.contextmanager
def server(root: str, mode: str = "serve", *extra: str) -> Iterator[Proc]:
    """tests/range_server_proc.py serving ``root`` in ``mode``, in a process of its own."""
    proc = subprocess.Popen([sys.executable, SCRIPT, root, "--mode", mode, *extra], stdout=subprocess.PIPE, text=True)
    srv = Proc(proc, "")
    try:
        srv.base = f"http://127.0.0.1:{_port_line(proc, 'the range server')}"
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def local(make_dataset) -> str:
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    return make_dataset(data, samples_per_block=SPB, shard_bytes=4 * SPB * 6 * 4)


def _open(url: str, cache: str, **kw) -> GDSDataset:
    kw = {"backend": "cpu", "resident_bytes": 0, "window_blocks": 1, "prefetch": 1, "cache_dir": cache,
          "timeout_s": T, **kw}
    return GDSDataset(url, 32, **kw)


def _fetch_threads(seconds: float = 2.0) -> list[str]:
    """Names of gdsload's fetch, watch and S3 threads still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = [t.name for t in threading.enumerate() if t.name in ("gdsload-fetch", "gdsload-http-watch")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _raises_within(fn, bound: float) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    with pytest.raises(ReadError) as e:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed <= bound, f"{elapsed:.2f} s > {bound:.2f} s: {e.value}"
    return e.value, elapsed


def _stop_mid_epoch(srv: Proc, url: str, cache: str) -> None:
    """Read 5 batches of ``url``, stop the server's process (SIGSTOP): the epoch's rest is a ReadError naming
    an object of ``url`` and "no response for T s" within the bound, and the close after it takes under 1 s."""
    with _open(url, cache) as ds:
        it = iter(ds)
        for _ in range(5):
            next(it)
        srv.stop()
        e, _ = _raises_within(lambda: [None for _ in it], BOUND)
        assert str(e).startswith(url + "/") and f"no response for {T:g} s" in str(e), e
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0, "close after the error"


# -- a stopped server -----------------------------------------------------------------------------------
def test_a_stopped_server_is_a_read_error_naming_the_url_and_no_response_within_the_bound(local, tmp_path):
    root, name = os.path.split(local)
    with server(root) as srv:
        url = srv.url(name)
        _stop_mid_epoch(srv, url, str(tmp_path / "c"))
        assert not _fetch_threads()


def test_a_stopped_moto_server_is_a_read_error_naming_the_url_within_the_bound(local, tmp_path, monkeypatch):
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv = Proc(proc, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{srv.base}/moto-api/data.json", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "moto_server did not start"
                time.sleep(0.1)
        with moto_server(monkeypatch, endpoint=srv.base) as s3:
            url = upload(s3, local)
            _stop_mid_epoch(srv, url, str(tmp_path / "c"))
            srv.cont()  # moto answers again, so botocore's calls given up end (they hold no state of gdsload's)
    finally:
        srv.kill()


def test_a_server_killed_outright_is_a_clear_read_error_in_seconds(local, tmp_path):
    root, name = os.path.split(local)
    with server(root) as srv:
        url = srv.url(name)
        with _open(url, str(tmp_path / "c"), timeout_s=30) as ds:
            it = iter(ds)
            next(it)
            srv.kill()
            e, _ = _raises_within(lambda: [None for _ in it], 10)
            assert str(e).startswith(url + "/") and "ConnectionRefusedError" in str(e), e


# -- servers that trickle, never answer, answer no HTTP -------------------------------------------------
@pytest.mark.parametrize("mode, words", [("trickle", "no complete response within"), ("silent", "no response for")])
def test_an_open_from_a_server_that_trickles_or_never_answers_fails_within_the_bound(local, tmp_path, mode, words):
    root, name = os.path.split(local)
    with server(root, mode) as srv:
        url = srv.url(name)
        e, _ = _raises_within(lambda: _open(url, str(tmp_path / "c")), BOUND)
        # (in the message of the skeleton's fetch: gdsload/remote/mirror.py words that)
        assert f"{url}/zarr.json: {words} {T:g} s" in str(e), e


def test_a_trickling_body_read_fails_within_the_bound(tmp_path):
    data = bytes(range(256)) * 16
    root = tmp_path / "objects"
    root.mkdir()
    (root / "a.bin").write_bytes(data)
    with server(str(root), "trickle", "--trickle-over", "100") as srv:
        client = HttpClient(timeout_s=T)
        info = client.head(srv.url("a.bin"))
        assert client.read(info, 0, 100) == data[:100], "a short body is not trickled"
        e, _ = _raises_within(lambda: client.read(info, 0, 1000), BOUND)
        assert str(e).startswith(srv.url("a.bin") + f": no complete response within {T:g} s"), e


def test_bytes_that_are_not_http_are_a_one_line_read_error_naming_the_url(tmp_path):
    with server(str(tmp_path), "garbage") as srv:
        url = srv.url("d.gds")
        t0 = time.monotonic()
        with pytest.raises(ReadError) as e:
            _open(url, str(tmp_path / "c"))
        assert time.monotonic() - t0 < 1.0, "not retried: no try helps"
        msg = str(e.value)
        assert "\n" not in msg and f"{url}/zarr.json: the server's answer is not HTTP (it began 'SSH-2.0-OpenSSH_9.6" \
            in msg, msg


# -- close() and break while fetches wait on a stopped server ---------------------------------------------
def test_break_and_close_from_another_thread_return_within_a_second_while_fetches_wait(local, tmp_path):
    root, name = os.path.split(local)
    with server(root) as srv:
        url = srv.url(name)
        with _open(url, str(tmp_path / "c"), timeout_s=60) as ds:
            srv.stop()
            it = iter(ds)
            next(it)  # the first window, read at the open; the fetcher threads now wait on the server
            time.sleep(0.5)
            assert _fetch_threads(0), "fetches wait on the stopped server"
            t0 = time.monotonic()
            it.close()  # what a break does
            assert time.monotonic() - t0 < 1.0, "break"
            assert not _fetch_threads(1.0)

            got: list[BaseException] = []

            def consume() -> None:
                try:
                    for _ in ds:
                        pass
                except BaseException as e:  # noqa: BLE001 - checked below
                    got.append(e)

            consumer = threading.Thread(target=consume)
            consumer.start()
            time.sleep(0.5)  # the consumer waits for a window whose shards wait on the server
            assert consumer.is_alive() and _fetch_threads(0)
            t0 = time.monotonic()
            ds.close()
            assert time.monotonic() - t0 < 1.0, "close() from another thread"
            consumer.join(1.0)
            assert not consumer.is_alive() and isinstance(got[0], GDSLoadError), got
        assert not _fetch_threads(1.0)


# -- another process's fetch --------------------------------------------------------------------------
_OWNER = """
import sys
from gdsload import GDSDataset
GDSDataset(sys.argv[1], 32, backend="cpu", resident_bytes=0, window_blocks=1, cache_dir=sys.argv[2],
           timeout_s=float(sys.argv[3]))
"""


@pytest.fixture
def big(make_dataset) -> str:
    """A dataset whose shards' data (64 KiB each) is larger than anything its skeleton fetches whole."""
    return make_dataset({"x": np.arange(4096 * 64, dtype=np.uint8).reshape(4096, 64), "idx": np.arange(4096)},
                        samples_per_block=256, shard_bytes=64 << 10)


def _fill_appears(cache: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for folder in [os.path.join(cache, d) for d in os.listdir(cache) if d.endswith(".shards")] \
                if os.path.isdir(cache) else []:
            if any(f.endswith(".fill") for f in os.listdir(folder)):
                return
        time.sleep(0.02)
    pytest.fail("the other process never began a fetch")


def test_a_wait_for_a_stopped_process_s_fetch_ends_within_the_bound_naming_it(big, tmp_path):
    root, name = os.path.split(big)
    cache = str(tmp_path / "c")
    with server(root, "trickle", "--trickle-over", str(16 << 10)) as srv:
        url = srv.url(name)
        owner = subprocess.Popen([sys.executable, "-c", _OWNER, url, cache, "60"], stderr=subprocess.DEVNULL)
        try:
            _fill_appears(cache)  # its open fetches the first window's shards, slowly: it holds their locks
            os.kill(owner.pid, signal.SIGSTOP)
            e, _ = _raises_within(lambda: _open(url, cache), BOUND + 0.5)  # the open reads the same window
            assert str(e).startswith(url + "/") and f"no response for {T:g} s: its fetch by process {owner.pid} " \
                                                    "has not moved" in str(e), e
        finally:
            os.kill(owner.pid, signal.SIGCONT)
            owner.kill()
            owner.wait(10)


def test_a_fetch_waited_on_that_fails_is_the_waiter_s_error_at_once(big, tmp_path):
    root, name = os.path.split(big)
    cache = str(tmp_path / "c")
    with server(root, "trickle", "--trickle-over", str(16 << 10)) as srv:
        url = srv.url(name)
        owner = subprocess.Popen([sys.executable, "-c", _OWNER, url, cache, str(T)], stderr=subprocess.PIPE,
                                 text=True)
        try:
            _fill_appears(cache)
            # this one would wait 10 s for a fetch of its own; the owner's fails within T and is this one's error
            e, _ = _raises_within(lambda: _open(url, cache, timeout_s=10), BOUND + 1.0)
            assert f"no complete response within {T:g} s" in str(e) and f"(in process {owner.pid}, whose fetch " \
                                                                       "this one waited on)" in str(e), e
            assert owner.wait(10) != 0 and "no complete response" in owner.communicate()[1]
        finally:
            owner.kill()
            owner.wait(10)


# -- cache_bytes too small: at open ---------------------------------------------------------------------
def test_a_bound_too_small_for_one_window_is_cache_full_at_open(local, tmp_path):
    with RangeServer() as srv:
        url = upload(srv, local)
        with _open(url, str(tmp_path / "probe"), window_blocks=8) as probe:
            version = probe.describe()["remote"]["version"]
        from gdsload.remote.mirror import open_version

        shards = open_version(url, str(tmp_path / "probe")).shards
        assert version
        biggest = max(e.data_bytes for e in shards.values())
        t0 = time.monotonic()
        with pytest.raises(CacheFull, match=rf"cache_bytes={biggest} is too small: one read of this dataset pins "
                                            r"\d+ pieces of shards at once \((\d+) bytes of data, e\.g\. "
                                            r"http://.*\); raise cache_bytes to at least \1") as e:
            _open(url, str(tmp_path / "c"), window_blocks=8, cache_bytes=biggest)
        assert time.monotonic() - t0 < 5 and e.value.need > biggest
        assert not _fetch_threads(1.0)


# -- max_bytes ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _raw_server(answer: bytes) -> Iterator[str]:
    """A server in a thread that answers each connection ``answer`` and then holds it open, silent."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)
            conn.recv(65536)
            conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/zarr.json"
    finally:
        sock.close()
        for c in held:
            c.close()


def test_get_refuses_an_object_over_max_bytes_without_reading_it(s3):
    client = HttpClient(timeout_s=T)
    with _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 8589934592\r\n\r\n{") as url:
        t0 = time.monotonic()
        with pytest.raises(FormatError, match=rf"^{url}: too large to read whole \(at most {64 << 20} bytes, found "
                                              r"8589934592 bytes\)$"):
            client.get(url)  # the default bound: metadata
        assert time.monotonic() - t0 < 1.0, "refused by its Content-Length, nothing read"
    chunk = b"1000\r\n" + b"x" * 4096 + b"\r\n"
    with _raw_server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 4) as url:
        with pytest.raises(FormatError, match=rf"^{url}: too large to read whole \(at most 10000 bytes, found a body "
                                              r"that ran past it\)$"):
            client.get(url, max_bytes=10_000)
    url = s3.put("big.json", b"{" * 1000)
    with pytest.raises(FormatError, match=rf"^{url}: too large to read whole \(at most 100 bytes, found 1000 bytes"):
        client_for(url, T).get(url, max_bytes=100)
    assert client_for(url, T).get(url, max_bytes=1000) == b"{" * 1000


# -- passwords in URLs --------------------------------------------------------------------------------
def test_a_url_with_a_password_reads_with_it_and_no_message_shows_it(local, tmp_path):
    root, name = os.path.split(local)
    with server(root, "serve", "--user", "alice:s3cret") as srv:
        url = srv.url(name).replace("http://", "http://alice:s3cret@")
        with _open(url, str(tmp_path / "c")) as ref_free:
            got = sum(len(b["idx"]) for b in ref_free)
            assert got == N and "s3cret" not in str(ref_free.describe())
        wrong = url.replace("s3cret", "wrong")
        with pytest.raises(ReadError) as e:
            _open(wrong, str(tmp_path / "c"))
        assert "HTTP 401" in str(e.value) and "wrong" not in str(e.value) and "alice:***@" in str(e.value)
        with _open(url, str(tmp_path / "c2"), timeout_s=30) as ds:
            it = iter(ds)
            next(it)
            srv.kill()
            with pytest.raises(ReadError) as e:
                list(it)
            assert "s3cret" not in str(e.value) and "alice:***@127.0.0.1" in str(e.value), e.value
    with pytest.raises(ValueError, match=r"s3://key:\*\*\*@bucket/d\.gds/zarr\.json: credentials in an s3:// URL "
                                         r"are not used"):
        client_for("s3://key:secret@bucket/d.gds").head("s3://key:secret@bucket/d.gds/zarr.json")


# -- timeout_s itself ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, kind", [(0, ValueError), (-1, ValueError), (float("inf"), ValueError),
                                       (float("nan"), ValueError), ("5", TypeError), (True, TypeError)])
def test_timeout_s_must_be_a_positive_finite_number(local, bad, kind):
    with pytest.raises(kind, match="timeout_s must be"):
        GDSDataset(local, 32, backend="cpu", timeout_s=bad)


def test_timeout_s_reaches_the_cache_and_its_clients(local, tmp_path):
    with RangeServer() as srv:
        url = upload(srv, local)
        with _open(url, str(tmp_path / "c"), timeout_s=7) as ds:
            assert ds.describe()["remote"]["timeout_s"] == 7.0
        assert client_for(url, 7).timeout_s == 7.0 and client_for(url).timeout_s == 30.0


# -- the direct route (KvikIO's RemoteFile, on a GPU) -----------------------------------------------------
def test_kvikio_s_tries_end_within_timeout_s_and_its_source_path_leaves_its_messages():
    from gdsload.backends.remote_direct import KVIKIO_BACKOFF_S, kvikio_http, kvikio_words

    for timeout in (0.5, 1, 2, 2.5, 5, 10, 30, 60):
        for attempts in (1, 3, 5):
            got = kvikio_http(timeout, attempts)
            tries, each = got["http_max_attempts"], got["http_timeout"]
            assert 1 <= tries <= attempts and isinstance(each, int) and each >= 1
            spent = tries * each + sum(KVIKIO_BACKOFF_S[min(i, 3)] for i in range(tries - 1))
            assert spent <= max(timeout, 1), (timeout, attempts, got)
    assert kvikio_http(30, 3) == {"http_timeout": 9, "http_max_attempts": 3}
    assert kvikio_http(2, 3) == {"http_timeout": 2, "http_max_attempts": 1}
    text = ("RuntimeError: KvikIO failure at: /__w/kvikio/kvikio/cpp/src/shim/libcurl.cpp:188: curl_easy_perform() "
            "error (Failed to connect to 127.0.0.1 port 1: Connection refused)")
    assert kvikio_words(text) == ("RuntimeError: curl_easy_perform() error (Failed to connect to 127.0.0.1 port 1: "
                                  "Connection refused)")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["kvikio", "pinned"])
def test_a_stopped_server_is_a_read_error_within_the_bound_on_the_direct_route(local, tmp_path, monkeypatch,
                                                                               backend):
    monkeypatch.setenv("GDSLOAD_CACHE_DIR", str(tmp_path / "gdsload-cache"))
    root, name = os.path.split(local)
    with server(root) as srv:
        url = srv.url(name)
        with GDSDataset(url, 32, backend=backend, resident_bytes=0, window_blocks=1, prefetch=1, timeout_s=T) as ds:
            assert ds.describe()["remote"]["route"] == "direct"
            stats = ds.describe()["backend_stats"]  # KvikIO's tries, each and all, within timeout_s
            assert 1 <= stats["http_timeout"] * stats["http_max_attempts"] <= T, stats
            it = iter(ds)
            for _ in range(5):
                next(it)
            srv.stop()
            e, _ = _raises_within(lambda: [None for _ in it], BOUND)
            msg = str(e)
            assert msg.startswith(url + "/") and f"no response for {T:g} s" in msg and ".cpp:" not in msg, msg
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 1.0, "close after the error"


def test_a_mixture_passes_timeout_s_to_its_sources(local, tmp_path):
    from gdsload import Mixture

    with pytest.raises(ValueError, match="source 'a': timeout_s must be"):
        Mixture({"a": local}, batch_size=8, backend="cpu", timeout_s=0)
    with server(str(tmp_path), "silent") as srv:
        url = srv.url("d.gds")
        e, _ = _raises_within(lambda: Mixture({"a": url}, batch_size=8, backend="cpu", cache_dir=str(tmp_path / "c"),
                                               timeout_s=T), BOUND)
        assert f"{url}/zarr.json: no response for {T:g} s" in str(e), e


class _Urllib:
    """A stand-in for KvikIO's RemoteFile on the CPU: each ``pread`` a ranged GET on a thread, bounded by its own
    timeout (KvikIO's ``http_timeout``), its future with ``done()`` and ``get()`` as KvikIO's IOFuture."""

    pool = None

    def __init__(self, info, timeout: float = 2 * T):
        from concurrent.futures import ThreadPoolExecutor

        self.url, self.timeout = info.url, timeout
        _Urllib.pool = _Urllib.pool or ThreadPoolExecutor(4, thread_name_prefix="test-kvikio")

    def pread(self, buf, size: int, offset: int):
        def read() -> int:
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={offset}-{offset + size - 1}"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    body = resp.read()
            except OSError as e:
                raise RuntimeError("curl_easy_perform() error (Failure when receiving data from the peer)") from e
            buf[:len(body)] = np.frombuffer(body, dtype=np.uint8)
            return size

        future = self.pool.submit(read)
        future.get = future.result  # type: ignore[attr-defined]
        return future


def test_direct_reads_that_do_not_move_are_no_response_for_timeout_s_naming_the_url(local, tmp_path):
    from gdsload.backends import remote_direct as rd
    from gdsload.backends.base import ReadRequest
    from gdsload.remote.mirror import open_version

    root, name = os.path.split(local)
    with server(root) as srv:
        url = srv.url(name)
        version = open_version(url, str(tmp_path / "c"), T)
        path, entry = sorted(version.shards.items())[0]
        reads = rd.DirectReads(rd.object_map(version.shards), _Urllib, check_threads=2, timeout_s=T)
        try:
            buf = np.zeros(entry.keep_lo, dtype=np.uint8)
            reads.submit(buf, [ReadRequest(path, 0, entry.keep_lo, 0)], threading.Event()).finish()
            srv.stop()
            t0 = time.monotonic()
            with pytest.raises(ReadError) as e:
                reads.submit(buf, [ReadRequest(path, 0, entry.keep_lo, 0)], threading.Event()).finish()
            elapsed = time.monotonic() - t0
            assert str(e.value) == (f"{entry.info.url}: no response for {T:g} s (read of {entry.keep_lo} bytes at "
                                    f"offset 0; raised once KvikIO's requests in flight ended)")
            assert 2 * T - 0.5 < elapsed < 2 * T + 1, "raised once the read in flight ended: none writes after"
        finally:
            srv.cont()
            reads.close()
            if _Urllib.pool is not None:
                _Urllib.pool.shutdown(wait=True)
                _Urllib.pool = None


def test_a_direct_read_kvikio_timed_out_is_no_response_for_timeout_s_without_another_request(tmp_path):
    from gdsload.backends import remote_direct as rd
    from gdsload.backends.base import ReadRequest
    from gdsload.remote.objects import ObjectInfo

    with RangeServer({"/o": b"x" * 100}) as srv:
        info = ObjectInfo(srv.url("/o"), 100, srv.etag("/o"))
        reads = rd.DirectReads({"/p": info}, lambda i: None, timeout_s=T)
        try:
            cause = RuntimeError("KvikIO failure at: /w/cpp/src/shim/libcurl.cpp:184: KvikIO: HTTP request reached "
                                 "maximum number of attempts (1). Reason: Operation timed out.")
            got = reads.failed(ReadRequest("/p", 0, 10, 0), info, cause)
            assert str(got) == (f"{info.url}: no response for {T:g} s (read of 10 bytes at offset 0: RuntimeError: "
                                "KvikIO: HTTP request reached maximum number of attempts (1). Reason: Operation timed "
                                "out.)")
            assert srv.count == 0, "a stalled server: no pin check that would wait as long again"
            other = reads.failed(ReadRequest("/p", 0, 10, 0), info, RuntimeError(cause.args[0].replace(
                "Operation timed out.", "Got HTTP code 503.")))
            assert str(other).endswith("failed (RuntimeError: KvikIO: HTTP request reached maximum number of attempts "
                                       "(1). Reason: Got HTTP code 503.)") and srv.count == 1
        finally:
            reads.close()
