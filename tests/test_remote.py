"""The remote object clients (``gdsload.remote``): HttpClient against a real HTTP/1.1 server with ranges, ETags
and injected faults (tests/remote_servers.RangeServer), S3Client against moto's S3 server mode. No mocks of
the clients: every byte crosses a socket."""

from __future__ import annotations

import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gdsload.errors import ReadError
from gdsload.remote.objects import NotFound, ObjectChanged, ObjectInfo, is_remote, join
from remote_servers import RangeServer

# client_for is the package's (gdsload/remote/__init__.py), not objects.py's
from gdsload.remote import client_for

KiB = 1024


def _blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _names(err: BaseException, url: str, status: int | None = None) -> None:
    """``err``'s message names ``url`` and, where given, the HTTP status as a number of its own."""
    msg = str(err)
    assert url in msg, f"the message does not name {url}: {msg}"
    if status is not None:
        assert re.search(rf"(?<!\d){status}(?!\d)", msg), f"the message does not name status {status}: {msg}"


# -- helpers of the package --------------------------------------------------------------------------------
def test_is_remote_knows_the_schemes_and_nothing_else():
    import pathlib

    for url in ("s3://bucket/key", "http://host/a", "https://host:8443/a/b", "S3://B/k", "HTTPS://h/x"):
        assert is_remote(url), url
    for path in ("/data/d.gds", "d.gds", "file:///data/d.gds", "gs://bucket/key", "s3:/bucket/key", "s3//b/k", "",
                 pathlib.Path("/data/d.gds"), pathlib.Path("s3://bucket/key"), None, b"s3://bucket/key", 3):
        assert not is_remote(path), path


def test_join_appends_path_segments():
    assert join("s3://b/d.gds", "x", "c/0") == "s3://b/d.gds/x/c/0"
    assert join("s3://b/d.gds/", "/x/", "zarr.json") == "s3://b/d.gds/x/zarr.json"
    assert join("http://h:8/d.gds", "", "zarr.json") == "http://h:8/d.gds/zarr.json"
    assert join("https://h/d") == "https://h/d"


def _do(client, op: str, info: ObjectInfo, offset: int, nbytes: int) -> object:
    """``client.head``/``get`` of ``info.url``, or ``client.read`` of ``info``'s bytes ``offset..+nbytes``."""
    return client.read(info, offset, nbytes) if op == "read" else getattr(client, op)(info.url)


# -- HTTP ------------------------------------------------------------------------------------------------
def _http(**kw: float):
    from gdsload.remote.http import HttpClient

    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return HttpClient(**kw)


DATA = _blob(300 * KiB + 7)
RANGES = [(0, 1), (0, 4096), (1, 1), (4095, 2), (123_457, 65_536), (len(DATA) - 1, 1), (len(DATA) - 5000, 5000),
          (0, len(DATA))]


def test_http_head_gives_size_and_etag(srv):
    url = srv.put("/d/a.bin", DATA)
    info = _http().head(url)
    assert info == ObjectInfo(url, len(DATA), srv.etag("/d/a.bin"))
    assert [(r.method, r.path, r.status) for r in srv.requests] == [("HEAD", "/d/a.bin", 200)]


def test_http_ranged_reads_are_exact_and_pinned_by_if_match(srv):
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    srv.reset_log()
    for off, n in RANGES:
        assert client.read(info, off, n) == DATA[off:off + n], (off, n)
    assert len(srv.requests) == len(RANGES), "one GET a range, no retries"
    for r, (off, n) in zip(srv.requests, RANGES):
        assert r.method == "GET" and r.status == 206
        assert r.header("Range") == f"bytes={off}-{off + n - 1}"
        assert r.header("If-Match") == info.etag
    assert client.read(info, 10, 0) == b""


def test_http_get_is_the_whole_object(srv):
    url = srv.put("/m/zarr.json", DATA)
    assert _http().get(url) == DATA
    assert srv.put("/empty", b"") and _http().get(srv.url("/empty")) == b""


def test_http_keeps_the_connection_alive(srv):
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    for off, n in RANGES * 3:
        client.read(info, off, n)
    assert srv.connections == 1, f"{srv.connections} TCP connections for {srv.count} requests of one thread"


def _not_found(client, op: str, url: str) -> None:
    """``client.head`` or ``.get`` of a missing ``url``: NotFound (a ReadError and a FileNotFoundError)
    naming the URL and 404."""
    with pytest.raises(NotFound) as e:
        getattr(client, op)(url)
    assert isinstance(e.value, ReadError) and isinstance(e.value, FileNotFoundError)
    _names(e.value, url, 404)


@pytest.mark.parametrize("op", ["head", "get"])
def test_http_missing_object_is_not_found_naming_url_and_404(srv, op):
    _not_found(_http(), op, srv.url("/no/such.bin"))
    assert srv.count == 1, "a 404 is not retried"


def test_http_403_is_a_read_error_not_retried(srv):
    url = srv.put("/secret.bin", DATA)
    client = _http(retries=3)
    srv.fail_next(1, 403)
    with pytest.raises(ReadError) as e:
        client.head(url)
    assert not isinstance(e.value, FileNotFoundError)
    _names(e.value, url, 403)
    assert srv.count == 1, "4xx is not retried"
    info = client.head(url)
    srv.reset_log()
    srv.fail_next(1, 403)
    with pytest.raises(ReadError) as e:
        client.read(info, 0, 100)
    _names(e.value, url, 403)
    assert srv.count == 1


def _opened(srv, retries: int):
    """DATA served at /a.bin, a client of ``retries`` retries, the object's info; the server's log cleared."""
    url = srv.put("/a.bin", DATA)
    client = _http(retries=retries)
    info = client.head(url)
    srv.reset_log()
    return url, client, info


@pytest.mark.parametrize("op", ["head", "read", "get"])
def test_http_two_503_then_success_is_a_success_after_three_requests(srv, op):
    url, client, info = _opened(srv, retries=2)
    srv.fail_next(2, 503)
    got = _do(client, op, info, 1000, 5000)
    assert got == {"head": info, "read": DATA[1000:6000], "get": DATA}[op]
    assert [r.status for r in srv.requests] == [503, 503, 200 if op != "read" else 206]


@pytest.mark.parametrize("op", ["head", "read", "get"])
def test_http_always_503_is_a_read_error_after_retries_plus_one_requests(srv, op):
    url, client, info = _opened(srv, retries=3)
    srv.fail_next(100, 503)
    with pytest.raises(ReadError) as e:
        _do(client, op, info, 0, 10)
    assert not isinstance(e.value, (NotFound, ObjectChanged))
    _names(e.value, url, 503)
    assert srv.count == 4, f"retries=3: 4 requests, found {srv.count}"


def test_http_500_and_504_are_retried_too(srv):
    url, client, info = _opened(srv, retries=2)
    srv.fail_next(1, 500)
    srv.fail_next(1, 504)
    assert client.read(info, 5, 50) == DATA[5:55]
    assert [r.status for r in srv.requests] == [500, 504, 206]


def test_http_retries_zero_makes_one_request(srv):
    url = srv.put("/a.bin", DATA)
    srv.fail_next(1, 503)
    with pytest.raises(ReadError) as e:
        _http(retries=0).head(url)
    _names(e.value, url, 503)
    assert srv.count == 1


def _read_after_overwrite(put, client, grow: int, before_read=lambda: None):
    """DATA put and opened, then another object of ``grow`` more bytes put at its key: a read of the opened
    object is ObjectChanged (a ReadError) naming the URL. Returns the URL and the info opened."""
    url = put(DATA)
    info = client.head(url)
    put(_blob(len(DATA) + grow, seed=1))
    before_read()
    with pytest.raises(ObjectChanged) as e:
        client.read(info, 0, 1000)
    assert isinstance(e.value, ReadError)
    _names(e.value, url)
    return url, info


@pytest.mark.parametrize("size", ["same", "other"])
def test_http_object_changed_after_head_is_object_changed_by_if_match(srv, size):
    client = _http()
    url, info = _read_after_overwrite(lambda d: srv.put("/a.bin", d), client, 0 if size == "same" else 100,
                                      srv.reset_log)
    assert [(r.header("If-Match"), r.status) for r in srv.requests] == [(info.etag, 412)], \
        "the change is found by the server's If-Match (412), not retried"
    assert client.head(url).etag == srv.etag("/a.bin") != info.etag, "a new head sees the new object"


def test_http_object_deleted_after_head_is_object_changed(srv):
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    srv.delete("/a.bin")
    with pytest.raises(ObjectChanged) as e:
        client.read(info, 0, 1000)
    _names(e.value, url)
    assert srv.count == 2


def test_http_without_etags_a_grown_object_is_object_changed(srv):
    srv.send_etags = False
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    assert info == ObjectInfo(url, len(DATA), None)
    assert client.read(info, 100, 100) == DATA[100:200]
    srv.put("/a.bin", DATA + b"more")
    with pytest.raises(ObjectChanged) as e:
        client.read(info, 100, 100)
    _names(e.value, url)


def test_http_without_etags_a_shrunk_object_is_object_changed(srv):
    """The server answers 416 with ``Content-Range: bytes */NEW``: the size check fails, as the ObjectInfo
    contract says (only the size is checked without an ETag)."""
    srv.send_etags = False
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    srv.put("/a.bin", DATA[:1000])
    with pytest.raises(ObjectChanged) as e:
        client.read(info, 5000, 100)
    _names(e.value, url)


def test_http_a_server_ignoring_range_still_reads_exactly(srv):
    srv.honour_range = False
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    for off, n in RANGES[:4]:
        assert client.read(info, off, n) == DATA[off:off + n]
    assert {r.status for r in srv.requests if r.method == "GET"} == {200}


def test_http_truncated_body_is_retried_then_exact(srv):
    url, client, info = _opened(srv, retries=2)
    srv.truncate_next(1, keep=1000)
    assert client.read(info, 0, 100_000) == DATA[:100_000]
    assert srv.count == 2, "the dropped connection was retried once"


@pytest.mark.parametrize("op", ["read", "get"])
def test_http_always_truncated_body_is_a_read_error_not_short_bytes(srv, op):
    url, client, info = _opened(srv, retries=2)
    srv.truncate_next(100, keep=1000)
    with pytest.raises(ReadError) as e:
        client.read(info, 0, 100_000) if op == "read" else client.get(url)
    _names(e.value, url)
    assert srv.count == 3


def test_http_range_past_the_end_is_a_read_error(srv):
    url = srv.put("/a.bin", DATA)
    client = _http()
    info = client.head(url)
    for off, n in [(len(DATA) - 10, 11), (len(DATA), 1), (len(DATA) + 100, 10), (-1, 2)]:
        with pytest.raises(ReadError) as e:
            client.read(info, off, n)
        assert not isinstance(e.value, ObjectChanged), (off, n)
        _names(e.value, url)


def test_http_a_timeout_is_retried(srv):
    url = srv.put("/a.bin", DATA)
    client = _http(retries=2, timeout_s=0.3)
    info = client.head(url)
    srv.reset_log()
    srv.delay_next(1, 3.0)
    assert client.read(info, 10, 20_000) == DATA[10:20_010]
    assert srv.count == 2, "the stalled request timed out and was tried again"


def test_http_always_timing_out_is_a_read_error_naming_url_and_cause(srv):
    url = srv.put("/a.bin", DATA)
    client = _http(retries=2, timeout_s=0.2)
    srv.delay_next(3, 3.0)
    with pytest.raises(ReadError) as e:
        client.head(url)
    _names(e.value, url)
    assert re.search(r"time", str(e.value), re.I), f"the cause (a timeout) is not named: {e.value}"
    assert "no response for 0.2 s" in str(e.value)
    assert srv.count == 2, "two tries of timeout_s / 2 each: all the tries of a request end within timeout_s"


def _ranges_on_threads(client, url: str, data: bytes, reads: int, most: int, threads: int, seed: int) -> int:
    """``reads`` random ranges of ``url`` read on ``threads`` threads at once, started together; asserts
    each equals ``data``'s bytes and returns how many were read."""
    info = client.head(url)
    rng = random.Random(seed)
    jobs = []
    for _ in range(reads):
        off = rng.randrange(len(data))
        jobs.append((off, rng.randint(1, min(most, len(data) - off))))
    start = threading.Barrier(threads)

    def work(part: list[tuple[int, int]]) -> list[bool]:
        start.wait()
        return [client.read(info, off, n) == data[off:off + n] for off, n in part]

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(work, [jobs[i::threads] for i in range(threads)]))
    assert [ok for part in results for ok in part] == [True] * len(jobs)
    return len(jobs)


def test_http_many_threads_reading_one_object_all_exact(srv):
    data = _blob(2 * 1024 * KiB, seed=7)
    reads = _ranges_on_threads(_http(), srv.put("/big.bin", data), data, 256, 48 * KiB, 16, seed=3)
    assert srv.count == 1 + reads


def test_http_has_no_listing(srv):
    url = srv.url("/d.gds/")
    with pytest.raises(ReadError) as e:
        _http().list(url)
    assert url.rstrip("/") in str(e.value)


def test_client_for_http_is_one_client_a_host(srv, monkeypatch):
    import gdsload.remote as remote
    from gdsload.remote.http import HttpClient

    remote.forget_clients()
    a = client_for(srv.url("/a"))
    assert isinstance(a, HttpClient)
    assert client_for(srv.url("/b/c")) is a
    with RangeServer() as other:
        assert client_for(other.url("/a")) is not a
    with pytest.raises(ValueError):
        client_for("/data/d.gds")
    mine = HttpClient(retries=0)
    assert remote.use_client(srv.url("/x"), mine) is a and client_for(srv.url("/y")) is mine
    assert remote.use_client(srv.url("/x"), None) is mine
    made = client_for(srv.url("/y"))
    assert made is not mine and made is not a, "None goes back to a default client, made on next use"
    remote.forget_clients()
    assert client_for(srv.url("/y")) is not made


# -- S3 (moto's server) ------------------------------------------------------------------------------------
def _s3(**kw: object):
    from gdsload.remote.s3 import S3Client

    return S3Client(**kw)


def test_s3_head_gives_size_and_etag(s3):
    url = s3.put("sets/d.gds/a.bin", DATA)
    info = _s3().head(url)  # no arguments: endpoint, keys and region from the AWS_* environment
    want = s3.client.head_object(Bucket=s3.bucket, Key="sets/d.gds/a.bin")["ETag"]
    assert info == ObjectInfo(url, len(DATA), want)


def test_s3_ranged_reads_are_exact(s3):
    url = s3.put("a.bin", DATA)
    client = _s3()
    info = client.head(url)
    for off, n in RANGES:
        assert client.read(info, off, n) == DATA[off:off + n], (off, n)
    assert client.read(info, 0, 0) == b""


def test_s3_get_is_the_whole_object(s3):
    assert _s3().get(s3.put("d.gds/zarr.json", DATA)) == DATA


def test_s3_list_is_sorted_urls_under_the_prefix(s3):
    keys = ["p/b/d/e", "p/a", "pz/x", "p/b/c", "q/y", "p/b/a"]
    for k in keys:
        s3.put(k, k.encode())
    client = _s3()
    under_p = [s3.url(k) for k in ("p/a", "p/b/a", "p/b/c", "p/b/d/e")]
    assert client.list(s3.url("p")) == under_p, "nested keys, sorted; p's sibling pz is not under p"
    assert client.list(s3.url("p/")) == under_p
    assert client.list(s3.url("p/b")) == under_p[1:]
    assert client.list(f"s3://{s3.bucket}") == sorted(s3.url(k) for k in keys)
    assert client.list(s3.url("nothing")) == []


@pytest.mark.parametrize("op", ["head", "get"])
def test_s3_missing_key_is_not_found_naming_url_and_404(s3, op):
    _not_found(_s3(), op, s3.url("no/such.bin"))


def test_s3_missing_bucket_is_a_read_error_naming_the_url(s3):
    url = "s3://no-such-bucket-here/k"
    with pytest.raises(ReadError) as e:
        _s3().head(url)
    _names(e.value, url, 404)


@pytest.mark.parametrize("size", ["same", "other"])
def test_s3_object_overwritten_after_head_is_object_changed(s3, size):
    _read_after_overwrite(lambda d: s3.put("a.bin", d), _s3(), 0 if size == "same" else 10)


def test_s3_object_deleted_after_head_is_changed_or_not_found(s3):
    url = s3.put("a.bin", DATA)
    client = _s3()
    info = client.head(url)
    s3.delete("a.bin")
    with pytest.raises((ObjectChanged, NotFound)) as e:
        client.read(info, 0, 1000)
    _names(e.value, url)


def test_s3_range_past_the_end_is_a_read_error(s3):
    url = s3.put("a.bin", DATA)
    client = _s3()
    info = client.head(url)
    for off, n in [(len(DATA) - 10, 11), (len(DATA), 1), (-1, 2)]:
        with pytest.raises(ReadError) as e:
            client.read(info, off, n)
        _names(e.value, url)


def test_s3_endpoint_url_overrides_the_environment(s3):
    """AWS_ENDPOINT_URL names moto; ``endpoint_url`` sends the client to another server, a RangeServer: a 403
    there is a ReadError naming the s3 URL and 403, after one request (4xx is not retried)."""
    url = s3.put("a.bin", DATA)
    with RangeServer() as other:
        other.fail_next(1, 403)
        with pytest.raises(ReadError) as e:
            _s3(retries=2, endpoint_url=other.url()).head(url)
        _names(e.value, url, 403)
        assert other.count == 1, "the request went to endpoint_url, not to AWS_ENDPOINT_URL; 403 not retried"


@pytest.mark.parametrize("status,retries,op", [(500, 1, "head"), (503, 0, "get")])
def test_s3_always_5xx_is_a_read_error_after_retries_plus_one_requests(s3, status, retries, op):
    """(botocore backs off up to 2**(n-1) seconds before the n-th retry: few retries here, to stay fast.)"""
    url = s3.url("a.bin")
    with RangeServer() as other:
        other.fail_next(100, status)
        with pytest.raises(ReadError) as e:
            getattr(_s3(retries=retries, endpoint_url=other.url()), op)(url)
        _names(e.value, url, status)
        assert other.count == retries + 1, f"{op}, retries={retries}: {retries + 1} requests, found {other.count}"


def test_s3_5xx_then_success_is_a_success_after_two_requests(s3):
    """A RangeServer at endpoint_url stands for S3 (path-style ``/bucket/key``, HEAD and ranged GET with ETag
    and Content-Range are all botocore needs for head_object and get_object): a 500, then the answer."""
    with RangeServer({"/bkt/a.bin": DATA}) as other:
        client = _s3(retries=1, endpoint_url=other.url())
        info = client.head("s3://bkt/a.bin")
        assert info == ObjectInfo("s3://bkt/a.bin", len(DATA), other.etag("/bkt/a.bin"))
        other.reset_log()
        other.fail_next(1, 500)
        assert client.read(info, 7, 70_000) == DATA[7:70_007]
        assert [r.status for r in other.requests] == [500, 206]
        assert other.requests[-1].header("If-Match") == info.etag


def test_s3_credentials_and_endpoint_come_from_the_environment(s3, monkeypatch):
    url = s3.put("a.bin", DATA)
    assert _s3().get(url) == DATA
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find either
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    with pytest.raises(ReadError) as e:  # the keys were the environment's: without them, no signed request
        _s3(retries=0).head(url)
    _names(e.value, url)
    assert re.search("credential", str(e.value), re.I), e.value
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    with pytest.raises(ReadError) as e:
        _s3(retries=0).head(url)
    _names(e.value, url)


def test_client_for_s3_is_one_shared_client(s3):
    from gdsload.remote.s3 import S3Client

    a = client_for(s3.url("a.bin"))
    assert isinstance(a, S3Client)
    assert client_for("s3://another-bucket/x/y") is a
    assert client_for(s3.put("b.bin", DATA)).get(s3.url("b.bin")) == DATA


def test_s3_many_threads_reading_one_object_all_exact(s3):
    data = _blob(1024 * KiB, seed=9)
    assert _ranges_on_threads(_s3(), s3.put("big.bin", data), data, 160, 64 * KiB, 8, seed=5) == 160
