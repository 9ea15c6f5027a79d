"""Writing datasets: metadata through zarr, shard files streamed block by block.

zarr writes the group and array metadata; the shard files are written here, sequentially, in exactly the
sharding codec's layout (why: docs/design.md, "The converter"). A crc32c of every block, computed as the bytes
stream past, goes into ``_checksums/FIELD`` (docs/format.md, "Block checksums: _checksums/FIELD"). Every
number the files depend on comes from :mod:`gdsload.conversion.plan`; a conversion in parts writes with
:func:`write_shards` and :func:`write_metadata`, the same bytes. Sources are checked before anything is written
(:mod:`gdsload.conversion.checks`) and the output is published atomically (:mod:`gdsload.conversion.publish`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import crc32c
import numpy as np

from .checks import NAME_MAX_BYTES, RESERVED_NAMES
from ..errors import ConversionError
from ..format.arrays import CRC_BYTES
from ..format.meta import ATTRS_KEY, CHECKSUM_ALGORITHM, CHECKSUMS_GROUP, FORMAT_VERSION, DatasetMeta, read_metadata
from ..format.shard_index import MAX_UINT_64
from .publish import (RENAME_EXCHANGE, RENAME_NOREPLACE, Interrupted, Target, check_output, input_paths, on_signal,
                      protected, remove_stale_temps, rename_exchange, rename_noreplace, reset_signals, staged_output)
from ..format.shard_index import encode_shard_index
from .plan import (DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES, DEFAULT_SLICE_BYTES, ArrayPlan,
                   ConversionPlan, choose_samples_per_block, parse_compress, plan_dataset)
from .source_types import RaggedSource, Source, as_source
from .sources import open_field, open_input, open_ragged

__all__ = [
    # defined here
    "write_dataset", "convert", "write_metadata", "write_shards", "write_checksums", "open_inputs", "input_list",
    "order_notes",
    # re-exported from the module named after each line
    "choose_samples_per_block", "parse_compress", "DEFAULT_BLOCK_BYTES", "DEFAULT_SHARD_BYTES",
    "DEFAULT_SLICE_BYTES", "DEFAULT_CHUNK_BYTES",  # gdsload.conversion.plan
    "Interrupted", "on_signal", "reset_signals", "check_output", "remove_stale_temps", "rename_noreplace",
    "rename_exchange", "RENAME_NOREPLACE", "RENAME_EXCHANGE",  # gdsload.conversion.publish
    "RESERVED_NAMES", "NAME_MAX_BYTES",  # gdsload.conversion.checks
    "CHECKSUMS_GROUP", "CHECKSUM_ALGORITHM",  # gdsload.format.meta
]

# -- checksums -------------------------------------------------------------------------------------
class _BlockCrc:
    """crc32c of consecutive byte ranges of a stream fed in order: block ``b`` is bytes
    ``[b * block_bytes, (b + 1) * block_bytes)``, or ``[bounds[b], bounds[b + 1])`` where blocks differ in
    size. Bytes past the last block are ignored."""

    def __init__(self, num_blocks: int, block_bytes: int = 0, bounds: np.ndarray | None = None):
        self.block_bytes, self.bounds = block_bytes, bounds
        self.crcs = np.zeros(num_blocks, dtype=np.uint32)
        self.pos = 0

    def _start(self, b: int) -> int:
        return b * self.block_bytes if self.bounds is None else int(self.bounds[b])

    def update(self, buf: memoryview) -> None:
        start, end = self.pos, self.pos + len(buf)
        if self.bounds is None:
            b = start // self.block_bytes
        else:  # the last block starting at or before ``start`` (empty blocks share their start)
            b = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while b < len(self.crcs) and self._start(b) < end:
            lo, hi = max(start, self._start(b)), min(end, self._start(b + 1))
            if hi > lo:
                self.crcs[b] = crc32c.crc32c(buf[lo - start:hi - start], int(self.crcs[b]))
            b += 1
        self.pos = end


# -- writing ---------------------------------------------------------------------------------------
def _write_all(f, buf: memoryview, target: Target, path: str) -> None:
    try:
        while len(buf):
            n = f.write(buf)
            buf = buf[n:]
    except OSError as e:
        raise target.error(e, path) from e


def _write_shard(path: str, src: Source, dtype: np.dtype, first_sample: int, stop_sample: int, block_bytes: int,
                 blocks_per_shard: int, slice_samples: int, progress: Callable[[int], None], crc: _BlockCrc,
                 target: Target, encoder: _Encoder | None = None) -> None:
    """Write one shard file: whole blocks back to back (the last padded with zeros), each raw or, with an
    ``encoder``, compressed; then the index. Every byte of the blocks, as read (decoded), also goes through
    ``crc``. Source errors pass through as they are; errors of the output become ConversionError naming it."""
    lengths: list[int] = []
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "wb", buffering=0)  # unbuffered: no flush at close that could fail after the fact
    except OSError as e:
        raise target.error(e, path) from e
    with f:
        pos = first_sample
        while pos < stop_sample:
            end = min(pos + slice_samples, stop_sample)
            data = np.ascontiguousarray(src.read(pos, end), dtype=dtype).reshape(-1).view(np.uint8)
            progress(len(data))
            if end == stop_sample and len(data) % block_bytes:  # the fill value is zero: pad the final block
                data = np.concatenate([data, np.zeros(-len(data) % block_bytes, np.uint8)])
            buf = memoryview(data)
            crc.update(buf)
            pieces = [buf] if encoder is None else encoder.encode(buf, block_bytes)
            for piece in pieces:
                _write_all(f, piece, target, path)
            lengths += [block_bytes] * (len(buf) // block_bytes) if encoder is None else [len(p) for p in pieces]
            pos = end
        table = np.full((blocks_per_shard, 2), MAX_UINT_64, dtype=np.uint64)
        table[:len(lengths), 1] = lengths
        table[:len(lengths), 0] = np.cumsum(lengths, dtype=np.uint64) - table[:len(lengths), 1]
        _write_all(f, memoryview(encode_shard_index(table)), target, path)


class _Encoder:
    """zstd at ``level``, then the crc32c of the compressed bytes, on a few threads: a slice of whole blocks
    in, each block encoded out. The bytes are those of zarr's ``[ZstdCodec(level=...), Crc32cCodec()]`` (the
    numcodecs codec it encodes with, then 4 little-endian bytes), so zarr reads them. The crc32c lets a
    damaged chunk be found before it is decoded: nvCOMP's decode of a damaged zstd frame may never return
    (docs/benchmarks.md), and the blocks' own checksums cover the decoded bytes, checked only after."""

    def __init__(self, level: int):
        import numcodecs

        self.codec = numcodecs.Zstd(level=level)
        self.pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="gdsload-compress")

    def _encode(self, block: memoryview) -> bytes:
        frame = bytes(self.codec.encode(block))
        return frame + crc32c.crc32c(frame).to_bytes(CRC_BYTES, "little")

    def encode(self, buf: memoryview, block_bytes: int) -> list[memoryview]:
        blocks = [buf[o:o + block_bytes] for o in range(0, len(buf), block_bytes)]
        return [memoryview(b) for b in self.pool.map(self._encode, blocks)]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def close_all(sources: Mapping[str, object]) -> None:
    for src in sources.values():
        src.close()  # type: ignore[attr-defined]


def write_metadata(root: str, plan: ConversionPlan, ragged: Mapping[str, RaggedSource],
                   field_attrs: Mapping[str, Mapping[str, object]] | None = None):
    """Every ``zarr.json`` of the dataset planned, and the variable-length fields' offsets, through zarr at
    ``root``; returns the zarr group (the checksums follow once the blocks are written). ``field_attrs``:
    more keys of a field's entry in the metadata (an image field's formats). OSError passes."""
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    fields_attr = {n: {"kind": "fixed"} for n in plan.fixed}
    fields_attr.update({n: {"kind": "ragged"} for n in plan.ragged})
    for n, extra in (field_attrs or {}).items():
        fields_attr[n].update(extra)
    checksums_attr = {"algorithm": CHECKSUM_ALGORITHM, "arrays": {n: f"{CHECKSUMS_GROUP}/{n}" for n in fields_attr}}
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.attrs[ATTRS_KEY] = {"format": FORMAT_VERSION, "num_samples": plan.num_samples,
                              "samples_per_block": plan.samples_per_block, "fields": fields_attr,
                              "checksums": checksums_attr}
    for name in plan.ragged:
        sub = group.create_group(name)
        # Every chunk written, zeros too (zarr skips a chunk equal to the fill value): a missing one is damage.
        off = sub.create_array("offsets", shape=ragged[name].offsets.shape, dtype=np.int64, compressors=None,
                               config={"write_empty_chunks": True})
        off[:] = ragged[name].offsets
    for a in plan.arrays:
        group.create_array(a.key, shape=(a.rows, *a.shape), dtype=a.dtype, chunks=(a.per_chunk, *a.shape),
                           shards=(a.per_chunk * a.chunks_per_shard, *a.shape), fill_value=0, filters=None,
                           compressors=None if a.level is None else [ZstdCodec(level=a.level), Crc32cCodec()])
    return group


def write_shards(target: Target, a: ArrayPlan, src: Source, shards: Sequence[int], slice_bytes: int,
                 progress: Callable[[int], None], crc_for: Callable[[int], object]) -> None:
    """Shard files ``shards`` of array ``a`` under ``target.tmp``, each streamed from ``src`` (its bytes fed to
    ``crc_for(shard)``, an object with ``update(memoryview)``): the same bytes whichever process writes them."""
    encoder = None if a.level is None else _Encoder(a.level)
    slice_rows = max(a.per_chunk, (slice_bytes // a.chunk_bytes) * a.per_chunk)
    try:
        for shard in shards:
            first, stop = a.shard_rows(shard)
            _write_shard(os.path.join(target.tmp, *a.shard_key(shard).split("/")), src, a.dtype, first, stop,
                         a.chunk_bytes, a.chunks_per_shard, slice_rows, progress, crc_for(shard),  # type: ignore
                         target, encoder)
    finally:
        if encoder is not None:
            encoder.close()


def write_dataset(
    out: str | os.PathLike[str],
    sources: Mapping[str, Source],
    *,
    ragged: Mapping[str, RaggedSource] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    samples_per_block: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    slice_bytes: int = DEFAULT_SLICE_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
    compress: str | None = None,
    chunk_bytes: int | None = None,
    field_attrs: Mapping[str, Mapping[str, object]] | None = None,
) -> DatasetMeta:
    """Write ``sources`` (field name -> array source) as a gdsload dataset at ``out``, atomically.

    Everything goes to a temporary sibling directory that is renamed to ``out`` only once complete, so a
    failure or interruption leaves nothing at ``out`` (and an existing dataset there untouched).
    ``overwrite`` replaces an existing gdsload dataset, and nothing else. ``samples_per_block`` larger than
    the dataset is capped at its number of samples. ``compress`` (``"zstd"`` or ``"zstd:LEVEL"``) stores
    every fixed field's blocks as zstd inner chunks (variable-length values stay raw); ``"auto"`` or
    ``"auto:LEVEL"`` only those of fields where zstd saves at least 10 % on a sample of their chunks (the rest
    raw, :mod:`gdsload.conversion.auto_compress`); a block is then an
    inner chunk of about ``chunk_bytes`` (:data:`DEFAULT_CHUNK_BYTES`) instead of ``block_bytes``. Block
    checksums cover the decoded blocks. ``field_attrs`` adds keys to fields' entries in the metadata (an
    image field's ``{"image": {"formats": [...]}}``). Failures of the inputs and of the output raise
    ConversionError naming the file; an error raised by a caller's own source passes through as it is.
    """
    from tqdm import tqdm

    out = os.path.abspath(os.fspath(out))
    ragged = dict(ragged or {})
    try:
        sources = {n: as_source(out, str(n), s) for n, s in sources.items()}
    except ConversionError:
        close_all({n: s for n, s in sources.items() if callable(getattr(s, "close", None))})
        raise
    arrays: dict[str, Source] = dict(sources)  # every sharded array, by its path in the group
    arrays.update({f"{n}/values": r.values for n, r in ragged.items()})
    closed = False
    try:
        if not sources and not ragged:
            raise ConversionError(f"{out}: no input arrays (empty input)")
        check_output(out, overwrite, input_paths(s.origin for s in [*sources.values(), *ragged.values()]))
        plan = plan_dataset(out, sources, ragged, block_bytes=block_bytes, samples_per_block=samples_per_block,
                            shard_bytes=shard_bytes, compress=compress, chunk_bytes=chunk_bytes)
        remove_stale_temps(out)
        total = sum(a.row_bytes * a.rows for a in plan.arrays)
        with staged_output(out, overwrite) as target:
            tmp = target.tmp
            with protected():
                try:
                    group = write_metadata(tmp, plan, ragged, field_attrs)
                except OSError as e:
                    raise target.error(e) from e
            checksums: dict[str, np.ndarray] = {}
            with tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(out),
                      disable=None if progress is None else not progress) as bar:
                for a in plan.arrays:
                    if a.ragged:
                        crc = _BlockCrc(plan.num_blocks, bounds=a.bounds)
                    else:
                        crc = _BlockCrc(plan.num_blocks, block_bytes=a.chunk_bytes)
                    write_shards(target, a, arrays[a.key], range(a.num_shards), slice_bytes, bar.update,
                                 lambda shard: crc)
                    checksums[a.field] = crc.crcs
            close_all(arrays)
            closed = True
            with protected():
                try:
                    write_checksums(group, checksums, plan.num_blocks)
                except OSError as e:
                    raise target.error(e) from e
                read_metadata(tmp)  # the result must parse before it may replace anything
    finally:
        if not closed:
            close_all(arrays)
    return read_metadata(out)


def write_checksums(group, checksums: Mapping[str, np.ndarray], num_blocks: int) -> None:
    """``_checksums/FIELD``: uint32 (num_blocks,), one uncompressed chunk, always written."""
    sub = group.create_group(CHECKSUMS_GROUP)
    for name, crcs in checksums.items():
        arr = sub.create_array(name, shape=(num_blocks,), chunks=(num_blocks,), dtype=np.uint32, fill_value=0,
                               compressors=None, filters=None, config={"write_empty_chunks": True})
        arr[:] = crcs


def input_list(inputs: Sequence[str], named: Mapping[str, str], ragged: Mapping[str, str]) -> list[str]:
    """The paths a conversion reads (``FILE.npz:KEY`` as ``FILE.npz``), each checked to exist."""
    paths = list(inputs) + [p.rsplit(":", 1)[0] if not os.path.exists(p) else p for p in named.values()]
    paths += list(ragged.values())
    for p in paths:
        if not os.path.exists(p):
            raise ConversionError(f"{p}: input does not exist")
    return paths


def open_inputs(inputs: Sequence[str], named: Mapping[str, str], ragged: Mapping[str, str]
                ) -> tuple[dict[str, Source], dict[str, RaggedSource], dict[str, tuple[str, ...]]]:
    """The sources of input paths (fields named after files/keys), ``named`` and ``ragged`` fields, and per
    directory input its files in the order used; ConversionError naming the input (nothing left open)."""
    sources: dict[str, Source] = {}
    ragged_sources: dict[str, RaggedSource] = {}
    orders: dict[str, tuple[str, ...]] = {}
    try:
        for p in inputs:
            for name, src in open_input(p).items():
                if name in sources or name in named:
                    src.close()
                    raise ConversionError(f"{src.origin}: field '{name}' given twice (rename with --field NAME=PATH)")
                sources[name] = src
                orders.setdefault(p, getattr(src, "files", ()))
        for name, p in named.items():
            sources[name] = open_field(p)
            orders.setdefault(p, getattr(sources[name], "files", ()))
        for name, p in ragged.items():
            ragged_sources[name] = open_ragged(p)
            orders.setdefault(p, getattr(ragged_sources[name].values, "files", ()))
    except BaseException:
        close_all(sources)
        close_all(ragged_sources)
        raise
    return sources, ragged_sources, orders


def order_notes(orders: Mapping[str, tuple[str, ...]]) -> list[str]:
    """One line per directory input naming its first and last file in the order used."""
    return [f"{p}: {len(files)} files in natural order, first {files[0]}, last {files[-1]}"
            for p, files in orders.items() if files]


def convert(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    named: Mapping[str, str] | None = None,
    ragged: Mapping[str, str] | None = None,
    *,
    log: Callable[[str], None] | None = None,
    **options: object,
) -> DatasetMeta:
    """Convert input paths (fields named after files/keys), ``named`` fields (name -> path) and
    variable-length ``ragged`` fields (name -> directory of per-sample .npy, or .npz with values and
    offsets) to ``out``. After a successful conversion ``log`` gets one line per directory input naming
    its first and last file in the order used (natural order: ``2.npy`` before ``10.npy``)."""
    out = os.fspath(out)
    named = dict(named or {})
    ragged = dict(ragged or {})
    all_paths = input_list(inputs, named, ragged)
    if not all_paths:
        raise ConversionError(f"{out}: no inputs given (empty input)")
    check_output(os.path.abspath(out), bool(options.get("overwrite", False)), all_paths)
    sources, ragged_sources, orders = open_inputs(inputs, named, ragged)
    meta = write_dataset(out, sources, ragged=ragged_sources, **options)  # type: ignore[arg-type]
    for line in order_notes(orders) if log is not None else ():
        log(line)
    return meta
