"""``gdsload doctor URL``: whether a remote dataset is reachable, a small GET's latency and a large range's rate.

Through the CPU route's clients (:mod:`gdsload.remote`), and for S3 where the endpoint and credentials came from
(never the secrets). Every request is made once, bounded by ``timeout_s``: the doctor reports what it saw. A
root ``zarr.json`` out of reach is a bad PATH, one line ``URL: what; fix: ...`` and exit 2 (:class:`Unreachable`);
a later step that fails is a ✘ line with its fix (exit 0).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, TextIO

from ..errors import GDSLoadError, ReadError, printable
from ..format.meta import ATTRS_KEY
from ..remote.http import HttpClient
from ..remote.objects import ObjectClient, ObjectInfo, join
from ..remote.s3 import S3Client
from .doctor_probe import PathError

#: Seconds one request may take (connecting, or waiting for the next bytes) before the doctor gives up.
TIMEOUT_S = 10.0
#: The latency probe: this many ranged GETs of this many bytes, spread over the largest object.
LATENCY_GETS, LATENCY_BYTES = 8, 4096
#: The throughput probe: one ranged GET of this many bytes (or the whole object, if smaller).
THROUGHPUT_BYTES = 64 << 20
_MARKS = {True: "✔", False: "✘", None: "–"}
_CREDENTIALS = {"env": "environment (AWS_ACCESS_KEY_ID)", "shared-credentials-file": "shared credentials file",
                "config-file": "AWS config file", "iam-role": "instance role (IMDS)",
                "container-role": "container role", "assume-role": "assumed role (AWS config file)",
                "assume-role-with-web-identity": "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)", "sso": "SSO",
                "custom-process": "credential_process (AWS config file)"}


class Unreachable(PathError):
    """The root ``zarr.json`` could not be fetched: one line naming its URL, what happened and the fix."""


@dataclass
class Line:
    """One line of the report: ✔ (True), ✘ (False) or – (None), what was found, the fix under a ✘."""

    name: str
    ok: bool | None
    found: str
    fix: str = ""


def _bounded_s3(timeout_s: float) -> S3Client:
    """The library's S3 client (its reads, pinning and errors) with the doctor's bounds: one attempt per request,
    ``timeout_s`` to connect and between bytes."""
    try:
        return S3Client(retries=0, timeout_s=timeout_s, max_connections=8)
    except ReadError as e:
        raise Unreachable(f"s3:// needs botocore; fix: pip install 'gdsload[s3]' ({e})") from None


def s3_sources(client: S3Client) -> dict[str, Any]:
    """Where the endpoint, region and credentials of ``client`` came from (names and sources, no secrets)."""
    session, env = client.session, os.environ
    scoped = session.get_scoped_config() or {}
    if env.get("AWS_ENDPOINT_URL_S3"):
        endpoint_source = "AWS_ENDPOINT_URL_S3 (environment)"
    elif env.get("AWS_ENDPOINT_URL"):
        endpoint_source = "AWS_ENDPOINT_URL (environment)"
    elif scoped.get("endpoint_url") or (scoped.get("s3") or {}).get("endpoint_url"):
        endpoint_source = "endpoint_url of the profile (AWS config file)"
    else:
        endpoint_source = "AWS's default for the region"
    try:
        creds = session.get_credentials()
    except Exception as e:  # a broken profile or credential_process: said, not raised
        creds, cred_error = None, f"{type(e).__name__}: {e}"
    else:
        cred_error = None
    profile = session.profile or env.get("AWS_PROFILE") or "default"
    method = getattr(creds, "method", None)
    return {"endpoint": client.s3.meta.endpoint_url, "endpoint_source": endpoint_source,
            "region": client.s3.meta.region_name, "profile": profile,
            "credentials": None if creds is None else _CREDENTIALS.get(str(method), str(method)),
            "credentials_error": cred_error}


def classify(e: BaseException, url: str, timeout_s: float, sources: dict[str, Any] | None) -> tuple[str, str]:
    """``e`` as one line naming ``url``, and its fix: an HTTP status, missing credentials, a name that does not
    resolve, a refused connection, a timeout, a TLS failure, else the error as it came."""
    chain, seen, cur = [], set(), e  # the error and what caused it (S3Client raises "from None": __context__)
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__ or getattr(cur, "kwargs", {}).get("error")
    text = " | ".join(f"{type(c).__name__}: {c}" for c in chain)
    low, names = text.lower(), {type(c).__name__ for c in chain}
    s3 = url.startswith("s3://")
    host = urllib.parse.urlsplit(sources["endpoint"] if s3 and sources else url).netloc or "?"
    msg = printable(str(e) or text)
    line = msg if msg.startswith(("s3://", "http://", "https://")) else f"{url}: {msg}"
    status = re.search(r"HTTP (\d{3})", str(e))
    if status:
        code = int(status.group(1))
        if code == 404:
            return line, ("no dataset at this URL: check the " + ("bucket and the " if s3 else "") + "path (it "
                          "names the folder holding zarr.json); an upload cut short has no root zarr.json: run the "
                          "same gdsload shard -o URL again")
        if code in (401, 403):
            who = (f"the credentials ({sources.get('credentials') or 'none found'}, profile {sources['profile']})"
                   if s3 and sources else "gdsload's HTTP client (it sends no credentials)")
            grant = ("grant s3:GetObject and s3:ListBucket on the prefix, or choose a profile that may "
                     "(AWS_PROFILE)" if s3 else "let the server serve it without credentials, or use s3://")
            return line, f"{who} may not read it: {grant}"
        if code in (301, 307, 308, 302):
            return line, ("the bucket answers in another region: set AWS_DEFAULT_REGION to it" if s3 else
                          "the server redirects, and gdsload's HTTP client follows no redirects: give the final URL")
        if code == 429 or code >= 500:
            return line, ("the server failed or throttled (the library retries these with backoff, the doctor "
                          "does not): run it again; if it persists, the server's logs say why")
        return line, f"the server refused the request with HTTP {code}: see its documentation for that status"
    if "NoCredentialsError" in names or "unable to locate credentials" in low:
        return line, ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                      "or run where an instance or container role applies")
    if "gaierror" in names or any(m in low for m in ("name or service not known", "name resolution",
                                                      "nodename nor servname", "no address associated")):
        return f"{url}: the host name {host} does not resolve", (
            f"check the host in the URL{' and AWS_ENDPOINT_URL' if s3 else ''}, and this machine's DNS")
    if "ConnectionRefusedError" in names or "connection refused" in low:
        return f"{url}: connection to {host} refused", (
            f"nothing listens at {host}: start the server, or fix the port in the URL" +
            (" (AWS_ENDPOINT_URL for an S3-compatible store)" if s3 else ""))
    if names & {"TimeoutError", "timeout", "ReadTimeoutError", "ConnectTimeoutError"} or "timed out" in low:
        return f"{url}: no answer from {host} within {timeout_s:g} s", (
            "check the network path (firewall, proxy, VPC endpoint) and the server; --timeout SECONDS waits longer")
    if "certificate" in low or "ssl" in low:
        return line, "the TLS certificate is not trusted here: install the CA (AWS_CA_BUNDLE for S3) or fix the server"
    return line, "see the error; the library retries dropped connections, the doctor does not"


def _client(url: str, timeout_s: float) -> tuple[ObjectClient, dict[str, Any] | None, str]:
    """The doctor's client for ``url``, where its settings came from (S3), and what it is."""
    if url.lower().startswith("s3://"):
        import botocore

        client = _bounded_s3(timeout_s)
        return client, s3_sources(client), f"S3Client (botocore {botocore.__version__})"
    return HttpClient(retries=0, timeout_s=timeout_s), None, "HttpClient (Python's http.client)"


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    got = fn(*args)
    return got, time.perf_counter() - t0


def _kind(doc: Any) -> tuple[str, list[str], bool]:
    """What a root zarr.json is, the arrays whose first chunk file to probe, and whether it is a dataset the
    library can open over HTTP (a group whose attributes name its arrays, or an array)."""
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
        return "not a Zarr v3 zarr.json", [], False
    if doc.get("node_type") == "array":
        return "a Zarr v3 array", [""], True
    attrs = (doc.get("attributes") or {}).get(ATTRS_KEY)
    if not isinstance(attrs, dict):
        return "a Zarr v3 group that is no gdsload dataset", [], False
    fields = attrs.get("fields") or {}
    names = [f"{n}/values" if (e or {}).get("kind") == "ragged" else n for n, e in fields.items()]
    return f"a gdsload dataset of {len(names)} field(s)", names, True


def _first_chunk(client: ObjectClient, url: str, prefix: str) -> ObjectInfo | None:
    """The first chunk (shard) file of the array at ``prefix``, from its zarr.json; None where there is none."""
    try:
        doc = json.loads(client.get(join(url, prefix, "zarr.json")))
        enc = doc.get("chunk_key_encoding") or {}
        sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name", "default") == "default"
                                                   else ".")
        ndim = len(doc.get("shape") or [])
        key = sep.join((["c"] if enc.get("name", "default") == "default" else []) + ["0"] * max(ndim, 1))
        return client.head(join(url, prefix, key))
    except (GDSLoadError, ValueError, AttributeError):
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def probe(url: str, timeout_s: float = TIMEOUT_S, throughput_bytes: int = THROUGHPUT_BYTES) -> dict[str, Any]:
    """The report on ``url`` (see the module's docstring); :class:`Unreachable` when its root zarr.json cannot be
    fetched."""
    url = url.rstrip("/")
    root_url = join(url, "zarr.json")
    try:
        client, sources, what = _client(url, timeout_s)
    except ValueError as e:  # s3:// without a bucket
        raise Unreachable(f"{printable(e)}") from None
    lines = [Line("client", True, f"{what}, the CPU route's; every request once, timeout {timeout_s:g} s")]
    if sources is not None:
        lines.append(Line("endpoint", True, f"{sources['endpoint']} from {sources['endpoint_source']}; region "
                                            f"{sources['region'] or 'unset'}"))
        cred = sources["credentials"]
        lines.append(Line("credentials", True if cred else False,
                          f"{cred or 'none found'}, profile {sources['profile']}" +
                          (f" ({sources['credentials_error']})" if sources["credentials_error"] else "") +
                          "; secrets not shown", "" if cred else "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                                                 "or AWS_PROFILE, or use an instance role"))
    try:
        info, head_s = _timed(client.head, root_url)
        body = client.get(root_url)
    except (ReadError, OSError) as e:
        line, fix = classify(e, root_url, timeout_s, sources)
        where = (f" (endpoint {sources['endpoint']} from {sources['endpoint_source']}, credentials "
                 f"{sources['credentials'] or 'none'})" if sources else "")
        raise Unreachable(f"{line}{where}; fix: {fix}") from None
    root = {"url": root_url, "status": 200, "etag": info.etag, "bytes": info.size, "ms": round(head_s * 1e3, 2)}
    lines.append(Line("reachable", True, f"{root_url}: HTTP 200, ETag {info.etag or 'none'}, {info.size} bytes, "
                                         f"HEAD in {head_s * 1e3:.1f} ms" +
                      ("" if info.etag else "; no ETag: every open gets a private copy of the skeleton")))
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    kind, arrays, opens = _kind(doc)
    objects: list[ObjectInfo] = []
    data: dict[str, Any] = {"kind": kind}
    if client.lists:
        try:
            listed = client.list_info(url)
            objects = [o for o in listed if not o.url.endswith("zarr.json")]
            data.update(objects=len(listed), bytes=sum(o.size for o in listed))
            lines.append(Line("dataset", opens or None, f"{kind}; {len(listed)} objects, {_mib(data['bytes'])} "
                                                        f"listed under the prefix"))
        except ReadError as e:
            line, fix = classify(e, url + "/", timeout_s, sources)
            lines.append(Line("listing", False, line, f"gdsload lists a dataset's objects at open: {fix}"))
    else:
        objects = [o for o in (_first_chunk(client, url, a) for a in arrays) if o is not None]
        lines.append(Line("dataset", opens, f"{kind}" + (f"; first chunk file of {len(objects)} array(s) found"
                                                         if arrays else ""),
                          "" if opens else "serve it from s3://, or convert it with gdsload shard: over HTTP only a "
                                           "gdsload dataset names its files"))
    target = max(objects, key=lambda o: o.size) if objects else info
    data["probed"] = {"url": target.url, "bytes": target.size}
    latency: dict[str, Any] | None = None
    n = min(LATENCY_BYTES, target.size)
    try:
        offsets = [(target.size - n) * i // max(1, LATENCY_GETS - 1) for i in range(LATENCY_GETS)]
        ms = [_timed(client.read, target, off, n)[1] * 1e3 for off in offsets]
        p90 = statistics.quantiles(ms, n=10, method="inclusive")[8]
        latency = {"median_ms": round(statistics.median(ms), 3), "p90_ms": round(p90, 3), "gets": len(ms),
                   "bytes": n, "url": target.url}
        lines.append(Line("latency", True, f"median {latency['median_ms']:.1f} ms, p90 {p90:.1f} ms: {len(ms)} "
                                           f"ranged GETs of {_mib(n)} of {target.url}"))
    except ReadError as e:
        lines.append(Line("latency", False, *classify(e, target.url, timeout_s, sources)))
    rate: dict[str, Any] | None = None
    n = min(throughput_bytes, target.size)
    try:
        _, took = _timed(client.read, target, 0, n)
        rate = {"bytes": n, "seconds": round(took, 6), "gb_per_s": round(n / max(took, 1e-9) / 1e9, 3),
                "url": target.url}
        small = n < 16 << 20
        lines.append(Line("throughput", None if small else True,
                          f"{rate['gb_per_s']:.2f} GB/s: one ranged GET of {_mib(n)} of {target.url} in {took:.3f} s" +
                          ("; under 16 MiB exist, so latency dominates: a lower bound" if small else "")))
    except ReadError as e:
        lines.append(Line("throughput", False, *classify(e, target.url, timeout_s, sources)))
    lines.append(Line("route", None, "measured with the client that fetches the skeleton (either route) and the "
                                     "cached route's shards; the direct route's KvikIO RemoteFile is not probed"))
    bad = next((ln for ln in lines if ln.ok is False), None)
    if bad is not None:
        verdict = f"remote: reachable, but {bad.name}: {bad.found}; fix: {bad.fix}"
    else:
        verdict = "remote: reachable" + (f"; latency median {latency['median_ms']:.1f} ms, p90 "
                                         f"{latency['p90_ms']:.1f} ms" if latency else "") + \
            (f"; one ranged GET {rate['gb_per_s']:.2f} GB/s" if rate else "")
    return {"path": url, "kind": "remote", "scheme": url.split("://", 1)[0].lower(), "client": what,
            "timeout_s": timeout_s, "sources": sources, "root": root, "dataset": data, "latency": latency,
            "throughput": rate, "verdict": verdict,
            "checks": [{"name": ln.name, "ok": ln.ok, "found": ln.found, "fix": ln.fix} for ln in lines]}


def render(report: dict[str, Any]) -> str:
    """One screen, as the local doctor's: a line per check, the fix under each ✘, the verdict last."""
    lines = [f"gdsload doctor: {report['path']} (remote, {report['scheme']})", "remote"]
    for c in report["checks"]:
        lines.append(f"  {_MARKS[c['ok']]} {c['name']:<19} {c['found']}")
        if c["fix"] and c["ok"] is not True:
            lines.append(f"  {'':<21} fix: {c['fix']}")
    lines.append(report["verdict"])
    return "\n".join(lines)


def main(url: str, as_json: bool = False, timeout_s: float | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    """``gdsload doctor URL``: the report (text or one JSON object) and 0; one line ``gdsload doctor: error: URL:
    what; fix: ...`` on stderr and 2 when the root zarr.json cannot be fetched."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        report = probe(url, TIMEOUT_S if timeout_s is None else timeout_s)
    except Unreachable as e:
        print(f"gdsload doctor: error: {printable(e)}", file=err)
        return 2
    print(json.dumps(report, indent=2) if as_json else render(report), file=out)
    return 0
