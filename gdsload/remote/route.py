"""The route of a remote dataset's shards: ``"direct"`` (KvikIO's ``RemoteFile`` reads each window's byte ranges
straight into device memory, gdsload/backends/remote_direct.py) or ``"cached"`` (through the node's shard cache,
:mod:`gdsload.remote.shard_fetch`). The rule is pure (:func:`choose_route`, :func:`direct_usable`); the backend
source (gdsload/backends/source.py) gathers the facts and makes the backend the route reads with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

DIRECT, CACHED = "direct", "cached"
KVIKIO_MISSING = "KvikIO is not installed (pip install 'gdsload[gpu]')"


class Route(NamedTuple):
    """``name``: ``"direct"`` or ``"cached"``; ``reason``: why, in words (``describe()["remote"]``)."""

    name: str
    reason: str


def choose_route(backend: str, on_device: bool, locks_named: bool, cache_option: str | None,
                 usable: tuple[bool, str]) -> Route:
    """The route of a remote dataset read by ``backend`` (pure: the rule, tested without a GPU).
    ``locks_named``: the backend locks every file in RAM and was asked for by name; ``cache_option``: the
    cache option given (``"cache_dir"``, ``"cache_bytes"``), else None; ``usable``: :func:`direct_usable`."""
    if not on_device:
        return Route(CACHED, f"the {backend} backend reads into host memory: shards come through the node's cache")
    if cache_option is not None:
        return Route(CACHED, f"{cache_option} was given: shards are fetched into the node's cache ahead of the reads")
    if locks_named:
        return Route(CACHED, f"the {backend} backend was asked for by name: the shard files it locks in memory "
                             f"are fetched into the node's cache")
    ok, why = usable
    if not ok:
        return Route(CACHED, f"the direct route is not usable here ({why}): shards come through the node's cache")
    return Route(DIRECT, "a GPU backend and no cache_dir: KvikIO's RemoteFile reads each window's byte ranges in "
                         "parallel straight into device memory")


def direct_usable(url: str, env: Mapping[str, str], kvikio: tuple[bool, bool]) -> tuple[bool, str]:
    """Whether KvikIO's RemoteFile can read ``url`` into device memory, and why not (pure). ``kvikio``: (installed,
    built with remote file support). KvikIO's S3 takes region and keys from the environment only (not from
    ``~/.aws`` or an instance role), and its multi-poll remote backend reads into host memory only."""
    installed, remote = kvikio
    if not installed:
        return False, KVIKIO_MISSING
    if not remote:
        return False, "this KvikIO was built without remote file support (libcurl)"
    io = env.get("KVIKIO_REMOTE_IO_BACKEND", "").strip().lower()
    if io not in ("", "easy_threadpool"):
        return False, f"KVIKIO_REMOTE_IO_BACKEND={io} reads into host memory only"
    if url.lower().startswith("s3://"):
        missing = [k for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not env.get(k)]
        if not (env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION")):
            missing.append("AWS_DEFAULT_REGION")
        if missing:
            return False, f"KvikIO's S3 takes credentials from the environment only: {', '.join(missing)} not set"
        if env["AWS_ACCESS_KEY_ID"].startswith("ASIA") and not env.get("AWS_SESSION_TOKEN"):
            return False, "temporary AWS credentials (ASIA...) without AWS_SESSION_TOKEN"
    return True, ""


def kvikio_remote() -> tuple[bool, bool]:
    """(KvikIO is installed, it was built with remote file support); needs no GPU."""
    try:
        import kvikio  # noqa: F401
    except Exception:
        return False, False
    try:
        from kvikio.remote_file import is_remote_file_available

        return True, bool(is_remote_file_available())
    except Exception:
        return True, False
