"""The direct route of a remote dataset: KvikIO ``RemoteFile`` ranged GETs straight into the window buffer.

:mod:`gdsload.remote.route` chooses the route; the dataset's source (backends/source.py) then makes
:class:`RemoteDirectBackend` in place of the backend ``auto`` or the user chose. One RemoteFile per object, opened
with its pinned size and kept; after a window's reads (or a failed one) every object read is checked once more,
one byte pinned to the skeleton's size and ETag, so a replaced object is ``ObjectChanged`` and the window is not
served. KvikIO's timeouts are set process-wide to fit ``timeout_s`` (:func:`kvikio_http`); a window that has not
moved for ``timeout_s`` is a ReadError. Why: docs/remote.md, "Routes: direct or cached" and "Time bounds".
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._tasks import Pending
from ..errors import ReadError
from ..format.files import read_error
from ..remote import client_for
from ..remote.objects import DEFAULT_TIMEOUT_S, ObjectChanged, ObjectInfo, redact
from .base import Backend, FileHandles, FillRequest, ReadRequest, Request, coalesce, fill_pattern
from .cuda import CudaBackend, KvikioPool
from .kvikio import DEFAULT_MAX_READ_BYTES, DEFAULT_TASK_BYTES, default_threads

#: The registry's name of the direct route's backend (chosen by a remote dataset's route, never by ``backend=``).
BACKEND = "remote"
IO_MODE = "remote-kvikio"
#: Threads that confirm, after a window's reads, that the objects read are still the ones pinned at open.
CHECK_THREADS = 16
#: The backend options the direct backend takes from those given for the backend it replaces.
OPTIONS = ("num_threads", "task_bytes", "max_read_bytes", "check_threads")
#: KvikIO's pauses between the tries of a request (0.5 s, doubling up to 4 s), which its tries' time includes.
KVIKIO_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
_SOURCE = re.compile(r"(KvikIO failure at: )?\S*[/\\][\w.+-]+\.(?:cpp|hpp|cu|cuh|h|pyx):\d+: ")
_attempts: list[int] = []  # KvikIO's http_max_attempts before gdsload set it, and what gdsload set


def object_map(shards: Mapping[str, Any]) -> dict[str, ObjectInfo]:
    """A version's shard files (local path -> :class:`gdsload.remote.mirror.Entry`) as the objects to read: local
    path -> the object's URL, size and ETag pinned when the skeleton was made."""
    return {path: entry.info for path, entry in shards.items()}


def direct_options(options: Mapping[str, Any] | None, objects: Mapping[str, ObjectInfo],
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The direct backend's options: those of :data:`OPTIONS` given for the backend it replaces, the objects and
    the dataset's ``timeout_s``."""
    return {**{k: v for k, v in (options or {}).items() if k in OPTIONS}, "objects": dict(objects),
            "timeout_s": timeout_s}


def kvikio_words(text: object) -> str:
    """KvikIO's message without the C++ source file and line it names (``KvikIO failure at:
    .../cpp/src/shim/libcurl.cpp:188: ``), on one line: the cause stays."""
    return " ".join(_SOURCE.sub("", str(text)).split())


def kvikio_http(timeout_s: float, attempts: int) -> dict[str, int]:
    """KvikIO's ``http_timeout`` (whole seconds, per try) and ``http_max_attempts`` that end a request, its tries
    and the pauses between them, within ``timeout_s`` (pure): as many of ``attempts`` tries as fit with two
    seconds each (at least one try), sharing the time the pauses leave."""
    fit = max((a for a in range(1, max(1, attempts) + 1) if 2 * a + sum(_pauses(a)) <= timeout_s), default=1)
    return {"http_timeout": max(1, int((timeout_s - sum(_pauses(fit))) // fit)), "http_max_attempts": fit}


def _pauses(attempts: int) -> list[float]:
    return [KVIKIO_BACKOFF_S[min(i, len(KVIKIO_BACKOFF_S) - 1)] for i in range(attempts - 1)]


def set_kvikio_http(timeout_s: float) -> dict[str, int]:
    """Set KvikIO's ``http_timeout`` and ``http_max_attempts`` (process-wide: the last dataset opened wins) from
    ``timeout_s`` and the tries KvikIO allowed before gdsload set them (or since, where another set them);
    what was set ({} for a KvikIO without these settings)."""
    import kvikio.defaults

    try:
        now = int(kvikio.defaults.get("http_max_attempts"))
        if not _attempts or now != _attempts[1]:
            _attempts[:] = [now, now]
        settings = kvikio_http(timeout_s, _attempts[0])
        kvikio.defaults.set(settings)
    except (KeyError, ValueError, AttributeError, TypeError):
        return {}
    _attempts[1] = settings["http_max_attempts"]
    return settings


def open_remote_file(info: ObjectInfo) -> Any:
    """KvikIO's RemoteFile of ``info``'s object, its size given (so opening sends no request). S3 takes region,
    keys and endpoint from the environment as KvikIO does (``AWS_ENDPOINT_URL_S3`` first, as botocore)."""
    import kvikio

    if info.url.lower().startswith("s3://"):
        env = os.environ
        return kvikio.RemoteFile.open_s3_url(
            info.url, info.size, aws_region_name=env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or None,
            aws_endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None)
    return kvikio.RemoteFile.open_http(info.url, info.size)


class DirectReads:
    """Requests read from the objects of ``objects`` (local shard path -> pinned object) by handles ``opener``
    makes (one per object, kept until :meth:`close`), into any buffer ``pread`` takes (device or host); a path
    that is no shard (an object the skeleton holds whole) is read from ``local``. Thread-safe."""

    def __init__(self, objects: Mapping[str, ObjectInfo], opener: Callable[[ObjectInfo], Any],
                 local: FileHandles | None = None, check_threads: int = CHECK_THREADS,
                 max_read_bytes: int = DEFAULT_MAX_READ_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.objects, self._opener, self._local = dict(objects), opener, local
        self.max_read_bytes, self.timeout_s = max_read_bytes, timeout_s
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(check_threads, thread_name_prefix="gdsload-pin")
        self.read_bytes = self.reads = self.checks = 0

    def handle(self, info: ObjectInfo) -> Any:
        h = self._handles.get(info.url)
        if h is None:
            with self._lock:
                h = self._handles.get(info.url)
                if h is None:
                    try:
                        h = self._opener(info)
                    except Exception as e:
                        raise ReadError(redact(f"{info.url}: cannot open it with KvikIO ({type(e).__name__}: "
                                               f"{kvikio_words(e)})")) from e
                    self._handles[info.url] = h
        return h

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event, fills: Any = None) -> Pending:
        """Start the reads of ``requests`` into ``dest`` (fills are the caller's; ``fills`` its event) and return."""
        pending = _Reads(self, fills)
        for r in coalesce([r for r in requests if isinstance(r, ReadRequest)], self.max_read_bytes):
            if stop.is_set():
                break
            info = self.objects.get(r.path)
            try:
                view = dest[r.dest_offset:r.dest_offset + r.nbytes]
                if info is None:
                    if self._local is None:
                        raise ReadError(f"{r.path}: not a file of this remote dataset")
                    future = self._local.get(r.path).pread(view, r.nbytes, r.offset)
                else:
                    info.check_range(r.offset, r.nbytes)
                    future = self.handle(info).pread(view, r.nbytes, r.offset)
            except BaseException as e:
                pending.error = self.failed(r, info, e)
                break
            pending.futures.append((r, info, future))
        with self._lock:
            self.reads += len(pending.futures)
            self.read_bytes += sum(r.nbytes for r, _, _ in pending.futures)
        return pending

    def confirm(self, infos: Iterable[ObjectInfo]) -> None:
        """Every object of ``infos`` is still the one pinned (in parallel); else the first ObjectChanged."""
        futures = [self._pool.submit(self._check, i) for i in infos]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            first = next((e for e in errors if isinstance(e, ObjectChanged)), errors[0])
            raise first if isinstance(first, ReadError) else ReadError(f"{type(first).__name__}: {first}")

    def _check(self, info: ObjectInfo) -> None:
        with self._lock:
            self.checks += 1
        if info.size:  # one byte, pinned by If-Match and the size: 412, 404 or another size is ObjectChanged
            client_for(info.url, self.timeout_s).read(info, info.size - 1, 1)

    def failed(self, r: ReadRequest, info: ObjectInfo | None, cause: BaseException | None,
               got: int | None = None) -> ReadError:
        """The error of a read that failed (``cause``) or came short (``got`` bytes): ObjectChanged where its
        object changed, else a ReadError naming the URL and KvikIO's own words."""
        if info is None or isinstance(cause, ReadError):
            return read_error(r.path, r.offset, r.nbytes, cause=cause, got=got)
        what = f"read of {r.nbytes} bytes at offset {r.offset}"
        words = kvikio_words(cause) if cause is not None else ""
        if "timed out" in words.lower():  # a stalled server: another request would wait as long
            return ReadError(redact(f"{info.url}: no response for {self.timeout_s:g} s ({what}: "
                                    f"{type(cause).__name__}: {words})"))
        try:
            self._check(info)
        except ObjectChanged as e:
            return e
        except Exception:  # noqa: BLE001 - the server's state is unknown: the read's own error says more
            pass
        cause_text = f"{type(cause).__name__}: {words}" if cause is not None else f"{got} bytes came"
        return ReadError(redact(f"{info.url}: {what} failed ({cause_text})"))

    def stalled(self, r: ReadRequest, info: ObjectInfo | None) -> ReadError:
        """The error of a window whose reads did not move for ``timeout_s`` (``r``: the first still in flight)."""
        where = redact(info.url) if info is not None else r.path
        return ReadError(f"{where}: no response for {self.timeout_s:g} s (read of {r.nbytes} bytes at offset "
                         f"{r.offset}; raised once KvikIO's requests in flight ended)")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"objects_open": len(self._handles), "reads": self.reads, "read_bytes": self.read_bytes,
                    "pin_checks": self.checks}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for h in self._handles.values():
                close = getattr(h, "close", None)
                if close is not None:
                    close()
            self._handles.clear()


class _Reads(Pending):
    """One window's reads. ``finish`` waits for all of them (none then writes into the buffer), then confirms
    the objects read; the first error is raised once all are over."""

    def __init__(self, reads: DirectReads, fills: Any):
        self.reads, self.fills = reads, fills
        self.futures: list[tuple[ReadRequest, ObjectInfo | None, Any]] = []
        self.error: BaseException | None = None

    def finish(self) -> Any:
        error, read = self.error, {}
        futures, self.futures = self.futures, []
        late = _stalled(futures, self.reads.timeout_s)
        if late is not None and error is None:
            error = self.reads.stalled(late[0], late[1])
        for r, info, future in futures:  # all of them, whatever happened: none writes into the buffer after
            try:
                n = future.get()
            except BaseException as e:
                error = error or self.reads.failed(r, info, e)
                continue
            if n != r.nbytes and error is None:
                error = self.reads.failed(r, info, None, n)
            if info is not None:
                read[info.url] = info
        if error is None and read:
            self.reads.confirm(read.values())
        if error is not None:
            raise error
        return self.fills  # KvikIO's reads are complete in the buffer when their futures return


def _stalled(futures: list[tuple[ReadRequest, ObjectInfo | None, Any]], timeout_s: float
             ) -> tuple[ReadRequest, ObjectInfo | None, Any] | None:
    """Wait until every future is done: None; or the first still in flight once none has finished for
    ``timeout_s``. (A future without ``done()`` counts as done: its ``get()`` waits.)"""
    pending = [f for f in futures if hasattr(f[2], "done")]
    deadline, pause = time.monotonic() + timeout_s, 0.0002
    while pending:
        left = [f for f in pending if not f[2].done()]
        if len(left) < len(pending):
            deadline, pause = time.monotonic() + timeout_s, 0.0002
        pending = left
        if pending and time.monotonic() > deadline:
            return pending[0]
        if pending:
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
    return None


class RemoteDirectBackend(CudaBackend):
    """The direct route's backend: ``objects`` (local shard path -> pinned object, :func:`object_map`) read by
    KvikIO's RemoteFile into device window buffers. ``num_threads`` and ``task_bytes`` ask for KvikIO's
    process-wide pool (as the kvikio backend's); adjacent blocks merge into reads of up to ``max_read_bytes``;
    ``check_threads`` confirm the objects after each window."""

    name = BACKEND
    io_mode = IO_MODE
    window_bytes_hint = 256 << 20

    def __init__(self, device_id: int = 0, *, objects: Mapping[str, ObjectInfo], timeout_s: float,
                 num_threads: int | None = None, task_bytes: int = DEFAULT_TASK_BYTES,
                 max_read_bytes: int = DEFAULT_MAX_READ_BYTES, check_threads: int = CHECK_THREADS):
        import kvikio

        from ..system.env import rank_cores

        if num_threads is None:
            num_threads = default_threads(rank_cores())
        if min(num_threads, task_bytes, max_read_bytes, check_threads) < 1:
            raise ValueError(f"num_threads, task_bytes, max_read_bytes and check_threads must be positive (found "
                             f"{num_threads}, {task_bytes}, {max_read_bytes}, {check_threads})")
        super().__init__(device_id)
        self.num_threads, self.task_bytes, self.max_read_bytes = num_threads, task_bytes, max_read_bytes
        self.check_threads = check_threads
        self._files = FileHandles(opener=lambda path: kvikio.CuFile(path, "r"), closer=lambda f: f.close())
        self.reads = DirectReads(objects, open_remote_file, self._files, check_threads, max_read_bytes, timeout_s)
        self.http = set_kvikio_http(timeout_s)  # before the first remote read: KvikIO's tries end within timeout_s
        KvikioPool.acquire(num_threads, task_bytes)
        self._pool_held = True

    def stats(self) -> dict[str, Any]:
        return {"num_threads": self.num_threads, "task_bytes": self.task_bytes, "max_read_bytes": self.max_read_bytes,
                "check_threads": self.check_threads, "timeout_s": self.reads.timeout_s, **self.http,
                **self.reads.stats()}

    def handles(self) -> list[FileHandles]:
        return [self._files]

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        fills = self.write_fills(dest, requests)
        with self.device:
            return self.reads.submit(dest, requests, stop, fills)

    def host_reader(self) -> Backend:
        """What reads a window's host buffer (compressed chunks decoded by CPU threads): the same objects."""
        return HostReads(self)

    def close(self) -> None:
        self.reads.close()
        self._files.close()
        if self._pool_held:
            self._pool_held = False
            KvikioPool.release()


class HostReads(Backend):
    """Reads into host buffers by the direct route of ``owner`` (its handles, checks and counters)."""

    name = BACKEND
    io_mode = IO_MODE

    def __init__(self, owner: RemoteDirectBackend):
        self._owner = owner

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def submit(self, dest: Any, requests: Sequence[Request], stop: threading.Event) -> Pending:
        for r in requests:
            if isinstance(r, FillRequest):
                fill_pattern(dest, r)
        with self._owner.device:
            return self._owner.reads.submit(dest, requests, stop)
