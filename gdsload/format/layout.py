"""DatasetLayout: where every chunk of an open dataset lies, and the files that hold them, held open.

At open every shard (or chunk) file of the selected arrays is opened once (:mod:`gdsload.format.files`) and its
index read and checked through that descriptor (:mod:`gdsload.format.shard_index`); the offsets of
variable-length fields and the block checksums are read whole. After that, (array, chunk) -> (file, offset,
nbytes) is arithmetic on arrays held here. Errors as :mod:`gdsload.format.meta`; nothing stays open when opening
fails.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._tasks import Closing
from .zarr_json import MAX_DIMENSIONS, check_whole_array, exc_text, fail
from .arrays import read_array
from ..errors import FormatError
from .files import ShardFiles, not_regular, refusal, reserve_descriptors
from .missing import MissingChunks, check_missing_chunks, missing_in
from .missing import refusal as missing_refusal
from .shard_index import chunk_table, read_shard_index
from .zarr_store import present_shards

if TYPE_CHECKING:
    from .meta import DatasetMeta, RaggedMeta
    from .arrays import FieldMeta


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


def _read_whole(where: str, length: int, failure: str) -> np.ndarray:
    """A 1-D array of ``length`` values (offsets, checksums) read whole, once :func:`_stored_chunks` checked
    its files. Stored as one raw chunk of exactly its length (as the converter writes checksums), its chunk
    file is read here: opening a dataset then needs no zarr, whose import costs a fresh process tenths of a
    second. Stored any other way (compressed, in chunks, in a chunk longer than the array, which zarr stores
    whole, with extensions), or written nowhere (fill values), zarr reads it.
    ``failure`` begins the message of a read that fails."""
    try:
        fm = read_array(where, os.path.basename(where), f"{failure}: no zarr.json", strict=False)
    except FormatError:
        fm = None  # zarr says what is wrong with it
    if (fm is not None and not (fm.sharded or fm.compressed or fm.chunk_checksum or fm.sample_shape)
            and fm.num_rows == length == fm.samples_per_block):
        path, want = fm.shard_path(0), length * fm.dtype.itemsize
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                values = np.fromfile(f, dtype=fm.dtype, count=length) if size == want else None
        except FileNotFoundError:
            values = None  # never written: zarr gives its fill values
        except OSError as e:
            raise fail(where, f"{failure} ({exc_text(e)})") from None
        else:
            if values is None or len(values) != length:
                raise fail(where, f"{failure} ({path} is {size} bytes, expected {want}: {length} raw "
                                  f"{fm.dtype.name} values)")
            return values
    import zarr

    try:
        return np.asarray(zarr.open_array(where, mode="r", zarr_format=3)[:])
    except Exception as e:
        raise fail(where, f"{failure} ({exc_text(e)})") from None


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


def _absent_chunks(where: str, what: str) -> list[MissingChunks]:
    """The chunk files an unsharded array read whole (offsets) lacks, from its directory listing (zarr reads
    each as the fill value); nothing for a sharded one, or one whose metadata zarr will judge."""
    try:
        fm = read_array(where, os.path.basename(where), "no zarr.json", strict=False)
    except FormatError:
        return []
    if fm.sharded:
        return []
    held = np.full(fm.num_chunks, -1, dtype=np.int64)
    held[list(present_shards(fm))] = 0
    return missing_in([], fm.shard_path, what, held, held, 1, False)


def _memory_bytes() -> int:
    """Physical memory of this machine: an array needing more is refused before it is allocated."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


class DatasetLayout(Closing):
    """Chunk locations of every selected array, the offsets of variable-length fields and the block
    checksums, all read once at open, and the shard (or chunk) files themselves, held open.

    Every file of the selected arrays is opened here (:mod:`gdsload.format.files`, after making room for them
    under ``RLIMIT_NOFILE``) and kept in ``files`` until :meth:`close` (idempotent; also ``with
    DatasetLayout(...) as layout``); its index is read through that descriptor. Readers read data through
    ``files.fd(path)``, so the bytes come from the inodes whose index was checked even if the dataset is
    replaced (renamed over) later. If opening fails, every file opened so far is closed before the error
    propagates.

    A dataset the converter wrote must have every shard file. A chunk that is missing (a file absent, or an
    index entry never written: ``block_offsets`` -1), and an absent chunk of a variable-length field's
    offsets, is listed in ``missing`` (:mod:`gdsload.format.missing`); with ``missing_chunks="error"`` (the
    default) any is a FormatError naming it, with ``"fill"`` it reads as the fill value. Sizes are checked as
    Python ints before anything is allocated: an array whose shape implies more shard files than its chunk
    directory holds (converter), or a chunk table larger than this machine's memory (foreign), is refused
    before any file is opened.
    """

    def __init__(self, meta: DatasetMeta, fields: tuple[str, ...] | None = None, missing_chunks: str = "error"):
        self.meta, self.missing_chunks = meta, check_missing_chunks(missing_chunks)
        self.missing: list[MissingChunks] = []
        self.fields = tuple(fields) if fields is not None else tuple(meta.names)
        unknown = [f for f in self.fields if f not in meta.fields and f not in meta.ragged]
        if unknown:
            raise FormatError(f"{meta.path}: no field {unknown} (fields: {meta.names})")
        self.keys = tuple(f"{f}/values" if f in meta.ragged else f for f in self.fields)
        self.files = ShardFiles()
        try:
            # Each array's files as (shard, path), every count checked before any open.
            shards = {k: self._foreign_shards(k) if meta.foreign else self._shard_paths(k) for k in self.keys}
            self._paths = {k: [p for _, p in shards[k]] for k in self.keys}
            reserve_descriptors(sum(len(p) for p in self._paths.values()), meta.path)
            for k in self.keys:
                what = "shard file" if meta.array(k).sharded else "chunk file"
                for p in self._paths[k]:
                    self.files.add(p, what)
            # block_offsets[key][c]: the byte offset of chunk c in its file, -1 if never written (or no file);
            # chunk_files[key][c]: that file's index in the array's paths; chunk_lengths[key][c], for a
            # compressed array only: chunk c's stored length (0 if never written); index_crcs[key][i], for a
            # sharded array whose index ends with a crc32c: the one stored in file paths(key)[i].
            self.block_offsets: dict[str, np.ndarray] = {}
            self.chunk_files: dict[str, np.ndarray] = {}
            self.chunk_lengths: dict[str, np.ndarray] = {}
            self.index_crcs: dict[str, np.ndarray] = {}
            for k in self.keys:
                self.block_offsets[k], self.chunk_files[k], lengths, crcs = self._scan(meta.array(k), shards[k])
                if meta.array(k).compressed:
                    self.chunk_lengths[k] = lengths
                if crcs is not None:
                    self.index_crcs[k] = crcs
                fm = meta.array(k)
                what = f"field '{k}'" if k in meta.fields else f"the values of field '{k.rsplit('/', 1)[0]}'"
                self.missing += missing_in(self._paths[k], fm.shard_path, what, self.block_offsets[k],
                                           self.chunk_files[k], fm.blocks_per_shard, fm.sharded)
            self._refuse_missing()
            self.offsets: dict[str, np.ndarray] = {f: self._read_offsets(meta.ragged[f]) for f in self.fields
                                                   if f in meta.ragged}
            # checksums[field][b]: crc32c of block b's bytes (see DatasetMeta), for fields that have them.
            self.checksums: dict[str, np.ndarray] = {f: self._read_checksums(f, meta.checksums[f])
                                                     for f in self.fields if f in meta.checksums}
        except BaseException:
            self.files.close()
            raise

    def _refuse_missing(self) -> None:
        if self.missing and self.missing_chunks == "error":
            raise FormatError(missing_refusal(self.meta.path, self.missing))

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

    def _shard_paths(self, key: str) -> list[tuple[int, str]]:
        """The shard files of an array, once its chunk directory is seen to hold at least as many entries
        as the metadata implies (a shape of 10**15 fails here, before anything is allocated)."""
        fm = self.meta.array(key)
        n = fm.num_shards
        if n:
            array_dir = fm.directory
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
        return [(s, self.meta.shard_path(key, s)) for s in range(n)]

    def _foreign_shards(self, key: str) -> list[tuple[int, str]]:
        """The files of a foreign array that exist, once its chunk table and the plan's per-sample arrays are
        seen to fit in this machine's memory (a shape of 10**15 in chunks of one fails here)."""
        fm = self.meta.array(key)
        need = max(fm.num_chunks * 24, fm.num_rows * 8)
        if need > _memory_bytes():
            raise fail(os.path.join(fm.directory, "zarr.json"),
                       f"shape ({fm.num_rows}, ...) in chunks of {fm.samples_per_block} rows needs {need} bytes of "
                       f"tables, more than this machine's memory ({_memory_bytes()} bytes)")
        return list(present_shards(fm).items())

    def _scan(self, field: FieldMeta, shards: list[tuple[int, str]]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Each chunk's offset in its file (-1: never written), that file's index in ``shards``, the chunk's
        stored length (0: never written), and the crc32c stored in each file's shard index (None: the
        array's indexes have none, or it is unsharded).

        In a dataset with the ``gdsload`` attribute every shard must be laid out as the converter writes it
        (:func:`~gdsload.format.shard_index.chunk_table`, ``tiled``): checked here, once per file, from the index
        just read, so a byte inserted or removed anywhere in a shard fails the open."""
        bps, foreign = field.blocks_per_shard, self.meta.foreign
        offsets = np.full(field.num_chunks if foreign else 0, -1, dtype=np.int64)
        lengths = np.zeros(len(offsets), dtype=np.int64)
        files = np.full(len(offsets), -1, dtype=np.int32)
        crcs = np.zeros(len(shards), dtype=np.uint32) if field.sharded and field.index_checksum else None
        parts = []
        for i, (shard, path) in enumerate(shards):
            f = self.files[path]
            n = min(bps, field.num_chunks - shard * bps)
            if field.sharded:
                index, size = read_shard_index(f, field)
                part = chunk_table(path, index.offsets_and_lengths, size, field, allow_empty=foreign, n_chunks=n,
                                   tiled=not foreign)
                if crcs is not None:
                    crcs[i] = index.checksum
            elif field.compressed and f.size > 0:
                part = (np.zeros(1, dtype=np.int64), np.full(1, f.size, dtype=np.int64))
            elif f.size != field.stored_bytes or field.compressed:
                expected = "at least 1: compressed" if field.compressed else f"{field.stored_bytes}: raw, uncompressed"
                raise FormatError(f"{path}: chunk file is {f.size} bytes (expected {expected})")
            else:
                part = (np.zeros(1, dtype=np.int64), np.full(1, f.size, dtype=np.int64))
            if foreign:
                offsets[shard * bps:shard * bps + n], lengths[shard * bps:shard * bps + n] = part
                files[shard * bps:shard * bps + n] = i
            else:
                parts.append(part)
        if not foreign and parts:
            offsets = np.concatenate([p[0] for p in parts])
            lengths = np.concatenate([p[1] for p in parts])
            files = np.repeat(np.arange(len(parts), dtype=np.int32), [len(p[0]) for p in parts])
        return offsets, files, lengths, crcs

    def _read_offsets(self, r: RaggedMeta) -> np.ndarray:
        where = os.path.join(self.meta.path, r.name, "offsets")
        n = self.meta.num_samples + 1
        if n * 8 > _memory_bytes():
            raise fail(os.path.join(where, "zarr.json"), f"{n} offsets need {n * 8} bytes, more than this "
                                                         f"machine's memory ({_memory_bytes()} bytes)")
        _stored_chunks(where)
        self.missing += _absent_chunks(where, f"the offsets of field '{r.name}'")
        self._refuse_missing()  # before a chunk of zeros is read as offsets
        offsets = _read_whole(where, n, "cannot read the offsets").astype(np.int64)
        if offsets.shape != (n,):
            raise fail(where, f"expected {n} offsets, found shape {offsets.shape}")
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != r.values.num_rows:
            raise FormatError(f"{where}: offsets must start at 0, never decrease and end at the number of "
                              f"values ({r.values.num_rows}); found {offsets[0]}..{offsets[-1]}")
        return offsets

    def _read_checksums(self, name: str, key: str) -> np.ndarray:
        """A field's checksum array, read whole: uint32, one per block."""
        where = os.path.join(self.meta.path, *key.split("/"))
        n = self.meta.num_blocks
        check_whole_array(os.path.join(where, "zarr.json"), f"field '{name}' names it as its checksum array",
                          f"the checksums of field '{name}': ({n},) uint32", n, ("uint32",))
        if _stored_chunks(where) == 0:
            raise fail(where, f"checksum array of field '{name}' holds no stored chunks (expected its values)")
        values = _read_whole(where, n, f"cannot read the checksum array of field '{name}'")
        if values.dtype != np.uint32 or values.shape != (n,):
            raise fail(where, f"expected the checksums of field '{name}': ({n},) uint32, found {values.shape} "
                              f"{values.dtype}")
        return values.astype(np.uint32)

    def digests(self) -> dict[str, tuple[str, str]]:
        """Per field read, two sha256 hex digests of what the open read (nothing is read here): of where its
        data lies (every chunk's offset in its file, -1 if never written, and a variable-length field's
        offsets), and of what it holds (its block checksums, the crc32c stored in each of its shard indexes,
        its compressed chunks' stored lengths; each part tagged and counted, so which parts a field has is
        part of the digest). Without block checksums, the second depends on the data only through the
        lengths of compressed chunks: an index's crc32c is a hash of its own entries."""
        out = {}
        for name, key in zip(self.fields, self.keys):
            where = hashlib.sha256(np.ascontiguousarray(self.block_offsets[key], dtype="<i8").tobytes())
            if name in self.offsets:
                where.update(np.ascontiguousarray(self.offsets[name], dtype="<i8").tobytes())
            what = hashlib.sha256()
            for tag, values, dtype in (("block crc32c", self.checksums.get(name), "<u4"),
                                       ("index crc32c", self.index_crcs.get(key), "<u4"),
                                       ("chunk nbytes", self.chunk_lengths.get(key), "<i8")):
                if values is not None:
                    what.update(f"{tag} {len(values)}:".encode())
                    what.update(np.ascontiguousarray(values, dtype=dtype).tobytes())
            out[name] = (where.hexdigest(), what.hexdigest())
        return out

    def paths(self, key: str) -> list[str]:
        """The files of an array (``chunk_files`` indexes them)."""
        return self._paths[key]

    def locate(self, key: str, chunk: int) -> BlockLocation | None:
        """File, offset and size of a chunk's data (of a compressed chunk: its stored bytes), or None if it
        was never written (reads as fill value)."""
        offset = int(self.block_offsets[key][chunk])
        if offset < 0:
            return None
        lengths = self.chunk_lengths.get(key)
        return BlockLocation(self._paths[key][int(self.chunk_files[key][chunk])], offset,
                             self.meta.array(key).block_bytes if lengths is None else int(lengths[chunk]))

    def block_runs(self, key: str, chunks: np.ndarray,
                   cells: np.ndarray | None = None) -> list[tuple[str | None, int, int, int]]:
        """Chunks read into a buffer region, chunk ``chunks[i]`` into cell ``cells[i]`` (a cell holds one
        chunk's data; default: cell i, back to back), as runs ``(path, offset, nbytes, first cell)``: each
        run is one read of consecutive bytes of one file into consecutive cells, or one chunk never written
        (``path`` None); raw arrays only. One numpy pass instead of a lookup per chunk: this runs on a reader
        thread, where a long stretch of Python holds the GIL the training loop waits for."""
        bb = self.meta.array(key).block_bytes
        chunks = np.asarray(chunks, dtype=np.int64)
        if len(chunks) == 0:
            return []
        cells = np.arange(len(chunks)) if cells is None else cells
        offsets = self.block_offsets[key][chunks]
        files = self.chunk_files[key][chunks]
        missing = offsets < 0
        start = np.ones(len(chunks), dtype=bool)
        start[1:] = ((files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + bb) | (cells[1:] != cells[:-1] + 1)
                     | missing[1:] | missing[:-1])
        firsts = np.flatnonzero(start)
        counts = np.diff(np.append(firsts, len(chunks)))
        paths = self._paths[key]
        return [(None if off < 0 else paths[file], off, n * bb, cell)
                for n, off, file, cell in zip(counts.tolist(), offsets[firsts].tolist(), files[firsts].tolist(),
                                              cells[firsts].tolist())]

    def locate_rows(self, key: str, row_start: int, row_stop: int) -> list[RowPiece]:
        """Where rows [row_start, row_stop) of a raw array lie, one piece per chunk they touch."""
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
