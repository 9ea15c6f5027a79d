"""A server's metadata is hostile input (gdsload/remote/skeleton.py, mirror.py): types checked, sizes capped and
shapes bounded before anything is built from them, each refused as a FormatError naming the URL and the key;
a failed request while the skeleton is fetched says what failed (the URL and the HTTP status), the disk only for
a disk error; no password in a URL is ever printed. Real servers serving doctored documents
(tests/remote_servers.py)."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

from gdsload import GDSDataset, ReadError
from gdsload.errors import FormatError
from gdsload.remote.mirror import Version, named, open_version

from remote_servers import client_for_server, upload

N = 600


@pytest.fixture
def local(make_dataset) -> str:
    data = {"x": np.arange(N * 6, dtype=np.float32).reshape(N, 6), "idx": np.arange(N)}
    return make_dataset(data, samples_per_block=16, shard_bytes=4 * 16 * 6 * 4)


@pytest.fixture
def fast(srv):
    with client_for_server(srv, retries=2, backoff_s=0.01, timeout_s=2) as client:
        yield client


def _doctor(store, key: str, change) -> None:
    """Serve ``key`` (a zarr.json under d.gds) as ``change`` leaves its JSON."""
    path = f"d.gds/{key}"
    current = store.objects[f"/{path}"] if hasattr(store, "objects") else \
        store.client.get_object(Bucket=store.bucket, Key=path)["Body"].read()
    doc = json.loads(current)
    change(doc)
    store.put(path, json.dumps(doc).encode())


def _attrs(doc: dict) -> dict:
    return doc["attributes"]["gdsload"]


CASES = {
    "fields as a list": (lambda d: _attrs(d).update(fields=["x", "idx"]), r"gdsload\.fields must be an object"),
    "a field entry as a string": (lambda d: _attrs(d)["fields"].update(x="fixed"),
                                  r"gdsload\.fields\.x must be an object \(found 'fixed'\)"),
    "checksums as a string": (lambda d: _attrs(d).update(checksums="crc32c"),
                              r"gdsload\.checksums must be an object \(found 'crc32c'\)"),
    "checksum arrays as a list": (lambda d: _attrs(d)["checksums"].update(arrays=["_checksums/x"]),
                                  r"gdsload\.checksums\.arrays must be an object"),
    "attributes as a list": (lambda d: d.update(attributes=["gdsload"]), r"attributes must be an object"),
    "the attribute as a list": (lambda d: d["attributes"].update(gdsload=[1]),
                                r"attribute 'gdsload' must be an object"),
    "a field name that leaves the folder": (lambda d: _attrs(d)["fields"].update({"../x": {}}), r"invalid field name"),
    "a checksum path that leaves the folder": (lambda d: _attrs(d)["checksums"]["arrays"].update(x="../../etc"),
                                               r"checksum array of field 'x' must be a relative path"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_root_document_of_the_wrong_types_is_a_format_error_naming_the_url_and_key(local, srv, tmp_path, case):
    change, message = CASES[case]
    url = upload(srv, local)
    _doctor(srv, "zarr.json", change)
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/zarr\.json: {message}"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    assert [n for n in os.listdir(tmp_path / "c") if not n.endswith(".lock")] == [], "nothing left"


def test_a_root_document_that_is_not_an_object_is_a_format_error(local, srv, tmp_path):
    url = upload(srv, local)
    srv.put("d.gds/zarr.json", b"[1, 2]")
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/zarr\.json: the metadata must be an object"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("server", ["http", "s3"])
def test_a_shape_of_10_15_samples_is_a_quick_format_error_naming_the_url_and_shape(local, server, request, tmp_path):
    store = request.getfixturevalue("srv" if server == "http" else "s3")
    url = upload(store, local)
    _doctor(store, "zarr.json", lambda d: _attrs(d).update(num_samples=10**15))
    _doctor(store, "x/zarr.json", lambda d: d.update(shape=[10**15, 6]))
    t0 = time.monotonic()
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/x/zarr\.json: shape \(1000000000000000, \.\.\.\) in "
                                          rf"chunks of 16 rows needs \d+ bytes of tables, more than this machine's"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    assert time.monotonic() - t0 < 10


def test_a_shape_of_more_shard_files_than_the_process_may_open_is_refused_before_a_key_is_made(local, srv,
                                                                                                tmp_path):
    import resource

    url = upload(srv, local)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if limit == resource.RLIM_INFINITY or limit > 10**8:
        pytest.skip("no descriptor limit to exceed here")
    rows = (limit + 1) * 64  # shards of 64 rows: one more file than the hard limit, well within memory
    _doctor(srv, "zarr.json", lambda d: _attrs(d).update(num_samples=rows))
    _doctor(srv, "x/zarr.json", lambda d: d.update(shape=[rows, 6]))
    srv.reset_log()
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/x/zarr\.json: shape \({rows}, \.\.\.\) in shards of "
                                          rf"64 rows makes \d+ shard files in all, more than this process may open"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    assert not [r for r in srv.requests if "/c/" in r.path], "no shard was asked for"


def test_s3_a_shape_beyond_the_listing_is_refused_as_expected_shard_files(local, s3, tmp_path):
    url = upload(s3, local)
    rows = 10**9  # 15625000 shards of 64 rows: fits in memory, far more than the listing holds
    _doctor(s3, "zarr.json", lambda d: _attrs(d).update(num_samples=rows))
    _doctor(s3, "x/zarr.json", lambda d: d.update(shape=[rows, 6]))
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/x/zarr\.json: expected 15625000 shard files, found "
                                          rf"10 \(shape \({rows}, \.\.\.\)"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))


def test_a_zarr_json_larger_than_a_local_one_may_be_is_refused_by_its_size_unread(local, srv, tmp_path):
    url = upload(srv, local)
    big = json.loads(srv.objects["/d.gds/x/zarr.json"])
    big["attributes"] = {"padding": "x" * (17 << 20)}
    srv.put("d.gds/x/zarr.json", json.dumps(big).encode())
    srv.reset_log()
    with pytest.raises(FormatError, match=rf"^{re.escape(url)}/x/zarr\.json: \d+ bytes, more than a zarr\.json may "
                                          rf"be \(16777216 bytes\)"):
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    assert not [r for r in srv.requests if r.method == "GET" and r.path == "/d.gds/x/zarr.json"]


@pytest.mark.parametrize("server", ["http", "s3"])
def test_checksum_arrays_the_metadata_does_not_name_come_whole_into_the_cache(local, server, request, tmp_path):
    """A root document without its ``checksums`` entry still has ``_checksums/`` beside it: the cache's copy of
    each checksum array is whole (its bytes are read at open, never through the shard cache), not a sparse
    file of holes that would read as zeros."""
    store = request.getfixturevalue("srv" if server == "http" else "s3")
    url = upload(store, local)
    _doctor(store, "zarr.json", lambda d: _attrs(d).pop("checksums"))
    version = open_version(url, str(tmp_path / "c"))
    with open(os.path.join(local, "_checksums", "x", "c", "0"), "rb") as f:
        want = f.read()
    with open(os.path.join(version.root, "_checksums", "x", "c", "0"), "rb") as f:
        assert f.read() == want
    assert not [p for p in version.shards if "_checksums" in p], "not a shard the cache fetches later"
    # and so the open sees what a local one would: checksums on disk the metadata does not name are refused
    with pytest.raises(FormatError, match=r"zarr\.json.*_checksums"):
        GDSDataset(url, batch_size=8, backend="cpu", cache_dir=str(tmp_path / "c"))


# -- failures while the skeleton is fetched --------------------------------------------------------------
@pytest.mark.parametrize("status", [503, 412])
def test_an_http_failure_mid_skeleton_names_the_url_and_status_not_the_disk(local, srv, fast, tmp_path, status):
    """The first request (the root's HEAD) is held back until the failures are set: every later request of
    the skeleton's fetch then fails with ``status``."""
    url = upload(srv, local)
    srv.delay_next(1, 1.0)
    timer = threading.Timer(0.3, srv.fail_next, (1000, status))
    timer.start()
    try:
        with pytest.raises(ReadError) as e:
            GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    finally:
        timer.join()
        srv.clear_faults()
    message = str(e.value)
    assert re.match(rf"^{re.escape(url)}/\S+: .*HTTP {status}", message), message
    assert "free space" not in message and "cannot write" not in message
    assert [n for n in os.listdir(tmp_path / "c") if not n.endswith(".lock")] == []


def test_a_missing_array_document_is_not_found_naming_its_url(local, srv, tmp_path):
    url = upload(srv, local)
    srv.delete("d.gds/idx/zarr.json")
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(url)}/idx/zarr\.json: HTTP 404 .*named by the "
                                                rf"dataset's metadata") as e:
        GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    assert "free space" not in str(e.value)


# -- passwords -------------------------------------------------------------------------------------------
def test_a_password_in_the_url_is_never_in_an_error_of_the_open(srv, tmp_path):
    from gdsload.remote import use_client
    from gdsload.remote.http import HttpClient

    url = f"http://reader:s3cretpw@127.0.0.1:{srv.port}/d.gds"
    previous = use_client(url, HttpClient(retries=1, backoff_s=0.01, timeout_s=2))
    try:
        with pytest.raises(ReadError) as e:
            GDSDataset(url, 32, backend="cpu", cache_dir=str(tmp_path / "c"))
    finally:
        use_client(url, previous)
    assert "s3cretpw" not in str(e.value) and "reader:***@127.0.0.1" in str(e.value)
    with pytest.raises(ValueError, match=r"credentials in an s3:// URL are not used") as e:  # refused, redacted
        open_version(url.replace("http:", "s3:").replace("127.0.0.1", "bucket"), str(tmp_path / "c"))
    assert "s3cretpw" not in str(e.value)


def test_an_error_named_for_a_url_with_a_password_is_redacted(tmp_path):
    root = str(tmp_path / "c" / "abc-d.gds@0123")
    version = Version("https://reader:s3cretpw@host/d.gds", root, "0123", {})
    err = named(FormatError(f"{root}/x/c/3/0: shard index checksum mismatch"), version, str(tmp_path / "c"))
    assert type(err) is FormatError
    assert str(err).startswith("https://reader:***@host/d.gds/x/c/3/0: shard index checksum mismatch")
    assert "s3cretpw" not in str(err) and root not in str(err)
