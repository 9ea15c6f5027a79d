"""How slices of the sources' batches become one mixture batch.

:func:`assemble` lays out each key's slices in order (a variable-length field's values cut by its offsets,
the offsets themselves rebased) and hands them to a joiner, chosen by the arrays' kind:

- :class:`gdsload.mixture.joiners.DeviceJoiner` (CuPy arrays, torch CUDA tensors): each output is allocated by
  the arrays' own library on the consumer's current stream and filled by one device-to-device copy per slice,
  issued on a non-blocking stream of the mixture's own. That stream first waits for an event recorded on the consumer's
  stream after the allocation (the memory may be memory the consumer freed while its queued work still
  reads it), and the consumer's stream then waits for an event after the copies. So the consumer's stream
  gets two event operations per batch and no kernel: work on the legacy default stream (the default of
  CuPy and torch) would serialize with KvikIO's compat-mode copies, which run on blocking streams, and a
  library's concatenate launches an indexing kernel where a copy engine moves contiguous bytes faster.
- :class:`LibraryJoiner` (numpy, JAX, torch on the host, and slices that are not contiguous): the library's
  own concatenate.

Nothing is copied per sample, and nothing between host and device: the ``source`` index of each sample comes
from a device array kept per distinct set of counts (a few per set of weights), copied like a slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

SOURCE_KEY = "source"  # batch[SOURCE_KEY]: each sample's source, an index into Mixture.sources
IDS_KEPT = 256  # distinct runs of source indices kept on the device before the cache starts afresh


ROWS, VALUES, OFFSETS = 0, 1, 2  # how a key is cut: by samples, by a variable-length field's offsets, or rebased


class Key(NamedTuple):
    """One key of a source's batch, prepared once per batch for cutting: its name in the mixture, the array,
    how it is cut, the bytes of one row along axis 0 (-1: not contiguous, joined by its library), and for a
    variable-length field's values and offsets the offsets, on the host."""

    name: str
    array: Any
    kind: int
    row_bytes: int
    offsets: np.ndarray | None


class Piece(NamedTuple):
    """Samples ``[lo, hi)`` of one of a source's batches (``length`` samples)."""

    batch: dict[str, Any]  # the source's batch as its dataset gave it
    keys: tuple[Key, ...]  # its keys, prepared (:func:`cut_keys`)
    lo: int
    hi: int
    length: int


class Span(NamedTuple):
    """Rows ``[lo, hi)`` (along axis 0) of one of a source's arrays; ``shift`` is added to every value (a
    variable-length field's offsets, rebased), else 0."""

    array: Any
    lo: int
    hi: int
    shift: int
    row_bytes: int


Runs = tuple[tuple[int, int], ...]  # (source index, samples), in batch order


class Counts(Protocol):
    """Where assemble counts a source's share of a batch (:class:`gdsload.mixture.source.SourceStats`)."""

    samples: int
    bytes: int


class Joiner(Protocol):
    def join(self, spans: dict[str, list[Span]], tails: dict[str, int], runs: Runs) -> dict[str, Any]: ...

    def ids(self, runs: Runs, like: Any) -> Any: ...

    def drain(self) -> None: ...


def cut_keys(batch: dict[str, Any], out_key: Callable[[str], str]) -> tuple[Key, ...]:
    """``batch``'s keys prepared for cutting (once per source batch): a variable-length field's offsets are
    copied to the host, which on a GPU waits for the work queued before (pad such fields to avoid it)."""
    offsets = {key[:-8]: to_host(a) for key, a in batch.items() if key.endswith("/offsets") and key[:-8] in batch}
    keys = []
    for key, a in batch.items():
        rows = int(a.shape[0])
        row_bytes = nbytes(a) // rows if rows else 0
        if not _contiguous(a):
            row_bytes = -1
        if key.endswith("/offsets") and key[:-8] in offsets:
            keys.append(Key(out_key(key), a, OFFSETS, row_bytes, offsets[key[:-8]]))
        elif key in offsets:
            keys.append(Key(out_key(key), a, VALUES, row_bytes, offsets[key]))
        else:
            keys.append(Key(out_key(key), a, ROWS, row_bytes, None))
    return tuple(keys)


def assemble(cuts: list[tuple[Counts, list[Piece]]], joiner_for: Callable[[Any], Joiner],
             as_is: bool = True) -> dict[str, Any]:
    """The batch of ``cuts`` (every source's pieces, in source order) plus ``SOURCE_KEY``. One whole batch of
    one source goes out as its dataset gave it (renamed) where ``as_is``; otherwise each key's spans are joined. A
    variable-length field's offsets are rebased from the host copy's values. Counts each source's samples
    and bytes into its ``Counts``."""
    given = [(i, s, cut) for i, (s, cut) in enumerate(cuts) if cut]
    runs = tuple((i, sum(p.hi - p.lo for p in cut)) for i, _, cut in given)
    first = given[0][2][0]
    if as_is and len(given) == 1 and len(given[0][2]) == 1 and first.hi - first.lo == first.length:
        out = {k.name: k.array for k in first.keys}
        _count(given[0][1], sum(nbytes(a) for a in out.values()), first.length)
        like = first.keys[0].array
        out[SOURCE_KEY] = joiner_for(like).ids(runs, like)
        return out
    spans: dict[str, list[Span]] = {}
    tails: dict[str, int] = {}  # an offsets key's last value so far: where its values end
    for _, source, cut in given:
        got = 0
        for p in cut:
            for k in p.keys:
                if k.kind == ROWS:
                    span = Span(k.array, p.lo, p.hi, 0, k.row_bytes)
                elif k.kind == VALUES:
                    span = Span(k.array, int(k.offsets[p.lo]), int(k.offsets[p.hi]), 0, k.row_bytes)  # type: ignore
                else:
                    end = tails.get(k.name, 0)
                    span = Span(k.array, p.lo, p.hi, end - int(k.offsets[p.lo]), k.row_bytes)  # type: ignore
                    tails[k.name] = end + int(k.offsets[p.hi] - k.offsets[p.lo])  # type: ignore
                spans.setdefault(k.name, []).append(span)
                got += (span.hi - span.lo) * max(k.row_bytes, 0)
        _count(source, got, sum(p.hi - p.lo for p in cut))
    return joiner_for(first.keys[0].array).join(spans, tails, runs)


def _count(counts: Counts, size: int, samples: int) -> None:
    counts.samples += samples
    counts.bytes += size


class LibraryJoiner:
    """Joins by the arrays' own library: one concatenation per key (none for a key of one span)."""

    def join(self, spans: dict[str, list[Span]], tails: dict[str, int], runs: Runs) -> dict[str, Any]:
        out = {}
        for key, parts in spans.items():
            arrays = [s.array[s.lo:s.hi] + s.shift if s.shift else s.array[s.lo:s.hi] for s in parts]
            if key in tails:
                arrays.append(full(1, tails[key], arrays[0]))
            out[key] = arrays[0] if len(arrays) == 1 else concat(arrays)
        out[SOURCE_KEY] = self.ids(runs, next(iter(out.values())))
        return out

    def ids(self, runs: Runs, like: Any) -> Any:
        parts = [full(n, i, like) for i, n in runs]
        return parts[0] if len(parts) == 1 else concat(parts)

    def drain(self) -> None:
        pass


def _contiguous(a: Any) -> bool:
    kind = kind_of(a)
    if kind == "torch":
        return bool(a.is_contiguous())
    if kind in ("numpy", "cupy"):
        return bool(a.flags.c_contiguous)
    return True  # JAX arrays are joined by their library


def batch_len(batch: dict[str, Any]) -> int:
    for key, a in batch.items():
        if key.endswith("/offsets"):
            return int(a.shape[0]) - 1
        if f"{key}/offsets" not in batch:
            return int(a.shape[0])
    return 0


def kind_of(a: Any) -> str:
    return type(a).__module__.partition(".")[0]


def concat(parts: list[Any]) -> Any:
    """One concatenation, by the arrays' own library (numpy, CuPy, torch or JAX)."""
    kind = kind_of(parts[0])
    if kind == "torch":
        import torch

        return torch.cat(parts)
    if kind == "cupy":
        import cupy

        return cupy.concatenate(parts)
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.concatenate(parts)
    return np.concatenate(parts)


def full(n: int, value: int, like: Any) -> Any:
    """An int64 array of ``n`` times ``value``, of ``like``'s kind and on its device, made there (JAX: its
    default integer type)."""
    kind = kind_of(like)
    if kind == "torch":
        import torch

        return torch.full((n,), value, dtype=torch.int64, device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.full(n, value, dtype=np.int64)
    if kind in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp

        return jax.device_put(jnp.full(n, value), next(iter(like.devices())))
    return np.full(n, value, dtype=np.int64)


def to_host(a: Any) -> np.ndarray:
    kind = kind_of(a)
    if kind == "torch":
        return a.cpu().numpy()
    if kind == "cupy":
        return a.get()
    return np.asarray(a)


def nbytes(a: Any) -> int:
    return int(a.element_size() * a.nelement()) if kind_of(a) == "torch" else int(a.nbytes)
