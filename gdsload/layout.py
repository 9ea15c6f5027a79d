"""DatasetLayout: where every block of an open dataset lies, and the shard files that hold them, held open.

At open, every shard file of the selected arrays is opened once (:mod:`gdsload.files`) and its index read
and checked through that descriptor (:mod:`gdsload.shard_index`); the offsets of variable-length fields and
the block checksums are read whole. After that, turning (field, block) into (file, offset, nbytes) is
arithmetic on arrays held here: no zarr, no metadata, no path lookups, and the bytes come from the very
inodes whose index was checked.

Error contract: as :mod:`gdsload.format` (FormatError for the dataset on disk, ReadError for an I/O failure),
and nothing stays open when opening fails.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ._zarr_json import MAX_DIMENSIONS, check_whole_array, exc_text, fail
from .errors import FormatError
from .files import ShardFiles, not_regular, refusal
from .shard_index import chunk_offsets, read_shard_index

if TYPE_CHECKING:
    from .format import DatasetMeta, FieldMeta, RaggedMeta


class BlockLocation(NamedTuple):
    """Where the raw bytes of one block of one field lie."""

    path: str
    offset: int
    nbytes: int


class RowPiece(NamedTuple):
    """Rows [row_start, row_stop) of an array that lie in one chunk: where to read them (None: never
    written, fill value)."""

    location: BlockLocation | None
    row_start: int
    row_stop: int


def _stored_chunks(array_dir: str) -> int:
    """Count the chunk files under an array read through zarr, refusing first anything zarr would block on
    (a FIFO) or trip over (a device, a symlink loop)."""
    count, todo = 0, [(array_dir, 0)]
    while todo:
        directory, depth = todo.pop()
        try:
            with os.scandir(directory) as it:
                entries = [e.path for e in it if not (depth == 0 and e.name == "zarr.json")]
        except OSError as e:
            raise fail(directory, f"cannot list the array's chunks ({e.strerror or e})") from None
        for entry in entries:
            try:
                mode = os.stat(entry).st_mode
            except OSError as e:
                raise refusal(entry, "chunk file", e) from None
            if stat.S_ISDIR(mode):
                if depth > MAX_DIMENSIONS + 2:
                    raise fail(entry, "chunk directories nest deeper than any chunk key")
                todo.append((entry, depth + 1))
            elif stat.S_ISREG(mode):
                count += 1
            else:
                raise not_regular(entry, "chunk file", mode)
    return count


def _memory_bytes() -> int:
    """Physical memory of this machine: an array needing more is refused before it is allocated."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


class DatasetLayout:
    """Block locations of every selected array, the offsets of variable-length fields and the block
    checksums, all read once at open, and the shard files themselves, held open.

    Every shard file of the selected arrays is opened here (:mod:`gdsload.files`) and kept in ``files``
    until :meth:`close` (idempotent; also ``with DatasetLayout(...) as layout``); its index is read through
    that descriptor. Readers read data through ``files.fd(path)``, so the bytes come from the inodes whose
    index was checked even if the dataset is replaced (renamed over) later. If opening fails, every file
    opened so far is closed before the error propagates.

    Sizes are checked as Python ints before anything is allocated: an array whose shape implies more shard
    files than its chunk directory holds is refused before any is opened.
    """

    def __init__(self, meta: DatasetMeta, fields: tuple[str, ...] | None = None):
        self.meta = meta
        self.fields = tuple(fields) if fields is not None else tuple(meta.names)
        unknown = [f for f in self.fields if f not in meta.fields and f not in meta.ragged]
        if unknown:
            raise FormatError(f"{meta.path}: no field {unknown} (fields: {meta.names})")
        self.keys = tuple(f"{f}/values" if f in meta.ragged else f for f in self.fields)
        self.files = ShardFiles()
        try:
            self._paths = {k: self._shard_paths(k) for k in self.keys}  # every count checked before any open
            for k in self.keys:
                for p in self._paths[k]:
                    self.files.add(p)
            # block_offsets[key][c] is the byte offset of chunk c in its shard file, -1 if never written.
            self.block_offsets: dict[str, np.ndarray] = {k: self._scan(meta.array(k)) for k in self.keys}
            self.offsets: dict[str, np.ndarray] = {f: self._read_offsets(meta.ragged[f]) for f in self.fields
                                                   if f in meta.ragged}
            # checksums[field][b]: crc32c of block b's bytes (see DatasetMeta), for fields that have them.
            self.checksums: dict[str, np.ndarray] = {f: self._read_checksums(f, meta.checksums[f])
                                                     for f in self.fields if f in meta.checksums}
        except BaseException:
            self.files.close()
            raise

    @property
    def has_checksums(self) -> bool:
        """Every selected field has a checksum per block."""
        return bool(self.fields) and all(f in self.checksums for f in self.fields)

    @property
    def closed(self) -> bool:
        return self.files.closed

    def close(self) -> None:
        """Close the shard files (stop every reader first). Idempotent."""
        self.files.close()

    def __enter__(self) -> DatasetLayout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shard_paths(self, key: str) -> list[str]:
        """The shard files of an array, once its chunk directory is seen to hold at least as many entries
        as the metadata implies (a shape of 10**15 fails here, before anything is allocated)."""
        fm = self.meta.array(key)
        n = fm.num_shards
        if n:
            array_dir = os.path.join(self.meta.path, *key.split("/"))
            if fm.key_separator == "/":
                directory, prefix = os.path.join(array_dir, "c"), ""
            else:
                directory, prefix = array_dir, "c."
            try:
                with os.scandir(directory) as it:
                    found = sum(1 for e in it if e.name.startswith(prefix))
            except (FileNotFoundError, NotADirectoryError):
                found = 0
            except OSError as e:
                raise fail(directory, f"cannot list shard files ({e.strerror or e})") from None
            if found < n:
                raise fail(os.path.join(array_dir, "zarr.json"),
                           f"expected {n} shard files, found {found} (shape ({fm.num_rows}, ...) in shards of "
                           f"{fm.blocks_per_shard * fm.samples_per_block} rows, under {directory})")
        return [self.meta.shard_path(key, s) for s in range(n)]

    def _scan(self, field: FieldMeta) -> np.ndarray:
        bps, parts = field.blocks_per_shard, []
        for shard, path in enumerate(self._paths[field.name]):
            index, size = read_shard_index(self.files[path], field)
            n = min(bps, field.num_chunks - shard * bps)
            parts.append(chunk_offsets(path, index.offsets_and_lengths[:n], size, field))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _read_offsets(self, r: RaggedMeta) -> np.ndarray:
        import zarr

        where = os.path.join(self.meta.path, r.name, "offsets")
        n = self.meta.num_samples + 1
        if n * 8 > _memory_bytes():
            raise fail(os.path.join(where, "zarr.json"), f"{n} offsets need {n * 8} bytes, more than this "
                                                         f"machine's memory ({_memory_bytes()} bytes)")
        _stored_chunks(where)
        try:
            offsets = np.asarray(zarr.open_array(where, mode="r", zarr_format=3)[:]).astype(np.int64)
        except Exception as e:
            raise fail(where, f"cannot read the offsets ({exc_text(e)})") from None
        if offsets.shape != (n,):
            raise fail(where, f"expected {n} offsets, found shape {offsets.shape}")
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != r.values.num_rows:
            raise FormatError(f"{where}: offsets must start at 0, never decrease and end at the number of "
                              f"values ({r.values.num_rows}); found {offsets[0]}..{offsets[-1]}")
        return offsets

    def _read_checksums(self, name: str, key: str) -> np.ndarray:
        """A field's checksum array, read whole: uint32, one per block."""
        import zarr

        where = os.path.join(self.meta.path, *key.split("/"))
        n = self.meta.num_blocks
        check_whole_array(os.path.join(where, "zarr.json"), f"field '{name}' names it as its checksum array",
                          f"the checksums of field '{name}': ({n},) uint32", n, ("uint32",))
        if _stored_chunks(where) == 0:
            raise fail(where, f"checksum array of field '{name}' holds no stored chunks (expected its values)")
        try:
            values = np.asarray(zarr.open_array(where, mode="r", zarr_format=3)[:])
        except Exception as e:
            raise fail(where, f"cannot read the checksum array of field '{name}' ({exc_text(e)})") from None
        if values.dtype != np.uint32 or values.shape != (n,):
            raise fail(where, f"expected the checksums of field '{name}': ({n},) uint32, found {values.shape} "
                              f"{values.dtype}")
        return values.astype(np.uint32)

    def locate(self, key: str, block: int) -> BlockLocation | None:
        """File, offset and size of a chunk, or None if it was never written (reads as fill value)."""
        offset = int(self.block_offsets[key][block])
        if offset < 0:
            return None
        fm = self.meta.array(key)
        return BlockLocation(self._paths[key][block // fm.blocks_per_shard], offset, fm.block_bytes)

    def block_runs(self, key: str, blocks: np.ndarray) -> list[tuple[str | None, int, int, int]]:
        """Blocks read back to back into a buffer, as runs ``(path, offset, nbytes, first)``: ``first`` is the
        run's position in ``blocks``; each run is one read of consecutive bytes of one file, or one block
        never written (``path`` None). One numpy pass instead of a lookup per block: this runs on a reader
        thread, where a long stretch of Python holds the GIL the training loop waits for."""
        fm = self.meta.array(key)
        bb = fm.block_bytes
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(blocks) == 0:
            return []
        offsets = self.block_offsets[key][blocks]
        shards = blocks // fm.blocks_per_shard
        missing = offsets < 0
        start = np.ones(len(blocks), dtype=bool)
        start[1:] = (shards[1:] != shards[:-1]) | (offsets[1:] != offsets[:-1] + bb) | missing[1:] | missing[:-1]
        firsts = np.flatnonzero(start)
        counts = np.diff(np.append(firsts, len(blocks)))
        paths = self._paths[key]
        return [(None if off < 0 else paths[shard], off, n * bb, first)
                for first, n, off, shard in zip(firsts.tolist(), counts.tolist(), offsets[firsts].tolist(),
                                                shards[firsts].tolist())]

    def locate_rows(self, key: str, row_start: int, row_stop: int) -> list[RowPiece]:
        """Where rows [row_start, row_stop) of an array lie, one piece per chunk they touch."""
        fm = self.meta.array(key)
        k, rb = fm.samples_per_block, fm.sample_bytes
        pieces = []
        for c in range(row_start // k, -(-row_stop // k)):
            a, b = max(row_start, c * k), min(row_stop, (c + 1) * k)
            loc = self.locate(key, c)
            if loc is not None:
                loc = BlockLocation(loc.path, loc.offset + (a - c * k) * rb, (b - a) * rb)
            pieces.append(RowPiece(loc, a, b))
        return pieces

    def shard_paths(self) -> list[str]:
        return [p for k in self.keys for p in self._paths[k]]
