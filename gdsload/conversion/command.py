"""What ``gdsload shard`` runs: one conversion, one part of one spread over processes, or the parts' publishing.

The command line (:mod:`gdsload.tools.cli`) parses and prints; this module picks
:func:`gdsload.conversion.writer.convert`, :func:`gdsload.conversion.parts.write_part` (``part="I/N"`` or
``auto``) or :func:`gdsload.conversion.parts.publish_parts` (``publish``; inputs given with it must match the
parts), each to a local folder or, through a local staging folder, uploaded to ``s3://``.
:func:`conversion_signals` makes SIGINT, SIGTERM and SIGHUP stop any of them cleanly (nothing half-written).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import ConversionError
from ..format.meta import DatasetMeta
from ..remote.objects import is_remote
from .parts import assemble, parse_part, publish_parts, read_parts, remove_parts, staging_dir, survey, write_part
from .publish import make_temp, on_signal, protected, remove_stale_temps, reset_signals
from .spelling import command_line
from .upload import upload_dataset
from .writer import convert


def _remote(out: str) -> bool:
    if is_remote(out) and not out.lower().startswith("s3://"):
        raise ConversionError(f"{out}: a conversion uploads to s3:// only (found another scheme)")
    return is_remote(out)


def run_shard(inputs: Sequence[str], out: str, named: Mapping[str, str], ragged: Mapping[str, str], *,
              part: str | None = None, publish: bool = False, staging: str | None = None, overwrite: bool = False,
              progress: bool | None = None, log: Callable[[str], None] = lambda line: None,
              **options: Any) -> DatasetMeta | None:
    """Run the conversion ``gdsload shard`` was asked for; the local dataset published, or None (a part, or an
    upload: ``log`` then says what was done). Errors are ConversionError (ValueError for ``part``), naming the
    command line's ``--overwrite`` where they suggest it."""
    with command_line():
        return _run(inputs, out, named, ragged, part=part, publish=publish, staging=staging, overwrite=overwrite,
                    progress=progress, log=log, **options)


def _run(inputs: Sequence[str], out: str, named: Mapping[str, str], ragged: Mapping[str, str], *,
         part: str | None, publish: bool, staging: str | None, overwrite: bool, progress: bool | None,
         log: Callable[[str], None], images: bool = False, strict: bool = False,
         **options: Any) -> DatasetMeta | None:
    remote = _remote(out)
    conv = convert
    if images:
        if part is not None or publish or named or ragged:
            raise ConversionError(f"{out}: --images converts its inputs alone, in one process (without --part, "
                                  f"--publish-parts, --field or --ragged)")
        conv = functools.partial(_convert_images, strict=strict)
    if part is not None and publish:
        raise ConversionError(f"{out}: --part writes one part and --publish-parts publishes them all: give one")
    if part is not None:
        index, count = parse_part(part)
        folder = write_part(inputs, out, named, ragged, index, count, staging=staging, overwrite=overwrite,
                            progress=progress, **options)
        log(f"{folder}: part {index}/{count} written; once all {count} are, publish them: gdsload shard "
            f"--publish-parts -o {out}" + (f" --staging {staging}" if staging else ""))
        return None
    if publish:
        expect = survey(inputs, out, named, ragged, **options) if inputs or named or ragged else None
        if not remote:
            return publish_parts(out, staging=staging, overwrite=overwrite, expect=expect)
        parts = read_parts(staging_dir(out, staging), expect)
        with _local_folder(parts.where, "publish") as tmp:
            with protected():
                assemble(parts, tmp)
            nbytes = upload_dataset(tmp, out, overwrite=overwrite, progress=progress)
        remove_parts(parts)
        log(f"{out}: {len(parts.records)} parts published, {nbytes} bytes uploaded (the root zarr.json last)")
        return None
    if remote:
        name = out.rstrip("/").rsplit("/", 1)[-1] or "dataset"
        with _local_folder(os.path.abspath(staging) if staging else tempfile.gettempdir(), name) as tmp:
            meta = conv(inputs, os.path.join(tmp, name), named, ragged, progress=progress, log=log, **options)
            nbytes = upload_dataset(meta.path, out, overwrite=overwrite, progress=progress)
        log(f"{out}: {meta.num_samples} samples, {nbytes} bytes uploaded (the root zarr.json last)")
        return None
    return conv(inputs, out, named, ragged, overwrite=overwrite, progress=progress, log=log, **options)


def _convert_images(inputs: Sequence[str], out: str, named: Mapping[str, str], ragged: Mapping[str, str], *,
                    strict: bool, **options: Any) -> DatasetMeta:
    """:func:`gdsload.conversion.images.convert_images`, called as :func:`convert` is."""
    from .images import convert_images

    return convert_images(inputs, out, strict=strict, **options).meta


_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def conversion_signals() -> Iterator[None]:
    """For the duration of a conversion: SIGINT, SIGTERM and SIGHUP stop it and clean up (unless ignored, as
    under nohup), and SIGXFSZ is ignored so that exceeding the file-size limit fails a write with EFBIG
    instead of killing the process. The previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    reset_signals()
    previous = {}
    for sig in _STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, on_signal)
    if hasattr(signal, "SIGXFSZ"):
        previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _local_folder:
    """A temporary folder ``.NAME.tmp-<pid>-<hex>`` in ``parent`` (a dead process's are removed first), removed
    on exit whatever happens."""

    def __init__(self, parent: str, name: str):
        self.base = os.path.join(parent, name)

    def __enter__(self) -> str:
        try:
            os.makedirs(os.path.dirname(self.base), exist_ok=True)
        except OSError as e:
            raise ConversionError(f"{os.path.dirname(self.base)}: cannot create the staging folder "
                                  f"({e.strerror or e})") from None
        remove_stale_temps(self.base)
        with protected():
            self.tmp, _ = make_temp(self.base)
        return self.tmp

    def __exit__(self, *exc: object) -> None:
        with protected(deliver=False):
            shutil.rmtree(self.tmp, ignore_errors=True)
