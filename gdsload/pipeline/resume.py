"""Resume state: what a checkpoint holds, how it is checked, and the plan of a partly read epoch (pure numpy).

An epoch is read in *legs*: a leg runs under one set of (world_size, batch_size, window_blocks); a resume
under other values ends the leg and starts the next one, recorded as a *hop*. The state holds the epoch,
the batches each rank yielded in the current leg, and one small hop per earlier leg of the epoch — never a
sample list: every leg's plans are recomputed from the config, as the first leg's always were.

The next leg's plans are built from what the last one left: each old rank's stream positions not yet
consumed (padding excluded), concatenated rank after rank. That is the epoch's global order — ranks split
the block order into consecutive shares, so rank 0's stream precedes rank 1's — and the new ranks split it
again into consecutive shares of equal size (a block on a boundary is read by both ranks, each taking its
own samples). Every unconsumed sample thus lands in exactly one new rank's stream; ranks are padded to equal
length (or, with ``drop_last``, the tail of the remainder is dropped) as a fresh epoch does. Each share is
read in windows of at most ``window_blocks`` blocks: the rests of old windows, packed in order, an old
window split only when it holds more blocks than a new window may, and every window taking its samples in
their old order. A window may pick only some samples of a block (``EpochPlan.positions`` names each one).

Padding and dropping per leg: without ``drop_last`` a leg repeats at most ``world_size - 1`` samples (the
shorter ranks repeat samples of their own last window; a rank left with none, the remainder's last sample);
with ``drop_last`` it drops fewer than ``world_size * batch_size`` of the remainder's last samples. Later
epochs are planned afresh. docs/multi-gpu.md gives the state format and a worked example.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .cursor import Cursor
from ..errors import GDSLoadError, warn
from .plan import EpochPlan, PlanConfig, block_sizes, epoch_plan

if TYPE_CHECKING:
    from ..format.layout import DatasetLayout
    from ..format.meta import DatasetMeta

STATE_FORMAT = 2  # bumped whenever the state's keys or the plan functions change meaning
CONTENT_FREE_FORMAT = 1  # before content_sha256: the same plans; resumed, warning that the content is unchecked
MAX_HOPS = 64  # legs one epoch may be read in: a checkpoint stays small whatever a job does
STATE_KEYS = ("state_format", "epoch", "batches_yielded", "hops", "num_samples", "samples_per_block", "batch_size",
              "window_blocks", "shuffle", "seed", "drop_last", "rank", "world_size", "fields", "index_sha256",
              "content_sha256", "exact_shares")
CONTENT_FREE_KEYS = STATE_KEYS[:-2]  # the keys of a state of CONTENT_FREE_FORMAT (exact_shares: False)
HOP_KEYS = ("world_size", "batch_size", "window_blocks", "batches")
FIXED_KEYS = ("num_samples", "samples_per_block", "shuffle", "seed", "drop_last", "exact_shares")  # fixed per epoch


class StateError(GDSLoadError, ValueError):
    """A resume state that is malformed, or does not fit the dataset it is loaded into."""


@dataclass(frozen=True)
class Hop:
    """An earlier leg of the epoch: the settings it ran under and the batches every rank took in it."""

    world_size: int
    batch_size: int
    window_blocks: int
    batches: int


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a dataset's samples: every field's kind, dtype and sample shape; per field read, a
    sha256 of its layout (``index_sha256``: its chunks' offsets and, for a variable-length field, its
    offsets) and one of its content (``content_sha256``, see :func:`fingerprint`)."""

    fields: dict[str, str]
    index_sha256: dict[str, str]
    content_sha256: dict[str, str]


@dataclass(frozen=True)
class SavedState:
    """A state dict, checked: every key present, of its type and in its range."""

    epoch: int
    batches_yielded: int
    hops: tuple[Hop, ...]
    num_samples: int
    samples_per_block: int
    batch_size: int
    window_blocks: int
    shuffle: bool
    seed: int
    drop_last: bool
    rank: int
    world_size: int
    fields: dict[str, str]
    index_sha256: dict[str, str]
    content_sha256: dict[str, str] | None  # None: a state of CONTENT_FREE_FORMAT
    exact_shares: bool = False

    @property
    def leg(self) -> tuple[int, int, int]:
        return self.world_size, self.batch_size, self.window_blocks


# -- the dataset's fingerprint -------------------------------------------------------------------------
def fingerprint(meta: DatasetMeta, layout: DatasetLayout) -> Fingerprint:
    """The fingerprint of an open dataset, from what its open read (:meth:`DatasetLayout.digests`, no read of
    its own). Fields cover the whole dataset, whatever was selected; the hashes cover the fields read. Limit:
    without block checksums (a foreign store) only shapes and the chunk table are hashed, so two such stores of
    equal shapes and raw chunks (or compressed chunks of equal lengths) fingerprint alike (docs/multi-gpu.md)."""
    fields = {name: f"{f.dtype.name} {tuple(f.sample_shape)}" for name, f in meta.fields.items()}
    fields.update({name: f"ragged {r.values.dtype.name} {tuple(r.values.sample_shape)}"
                   for name, r in meta.ragged.items()})
    digests = layout.digests()
    return Fingerprint(fields, {f: d[0] for f, d in digests.items()}, {f: d[1] for f, d in digests.items()})


# -- the state dict ------------------------------------------------------------------------------------
def make_state(config: PlanConfig, fp: Fingerprint, epoch: int, batches_yielded: int,
               hops: Sequence[Hop] = ()) -> dict[str, Any]:
    """The state of a rank that has yielded ``batches_yielded`` batches of the current leg of ``epoch``
    (plain ints, bools, strings, lists and dicts: it survives JSON and ``torch.save``)."""
    state: dict[str, Any] = {"state_format": STATE_FORMAT, "epoch": int(epoch), "batches_yielded": int(batches_yielded),
                             "hops": [dataclasses.asdict(h) for h in hops]}
    for key in ("num_samples", "samples_per_block", "batch_size", "window_blocks", "shuffle", "seed", "drop_last",
                "rank", "world_size"):
        state[key] = getattr(config, key)
    state["fields"] = dict(fp.fields)
    state["index_sha256"] = dict(fp.index_sha256)
    state["content_sha256"] = dict(fp.content_sha256)
    state["exact_shares"] = config.exact_shares
    return state


def _int(value: Any, key: str, lo: int, hi: int | None = None, why: str = "") -> int:
    allowed = f"an int from {lo} to {hi}" if hi is not None else f"an int >= {lo}"
    if why:
        allowed += f", {why}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StateError(f"state key '{key}': expected {allowed}, found {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        raise StateError(f"state key '{key}': expected {allowed}, found {int(value)}")
    return int(value)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise StateError(f"state key '{key}': expected True or False, found {value!r} ({type(value).__name__})")
    return bool(value)


def _str_dict(value: Any, key: str, hex_digest: bool = False) -> dict[str, str]:
    what = "field name -> sha256 hex digest" if hex_digest else "field name -> 'dtype (shape)'"
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise StateError(f"state key '{key}': expected a dict of {what}, found {value!r}")
    if hex_digest:
        for k, v in value.items():
            if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
                raise StateError(f"state key '{key}': expected a sha256 hex digest for {k!r}, found {v!r}")
    return dict(value)


def _keys(value: Mapping[Any, Any], expected: Sequence[str], where: str) -> None:
    missing = [k for k in expected if k not in value]
    unknown = [k for k in value if k not in expected]
    if missing or unknown:
        parts = ([f"lacks {missing}"] if missing else []) + ([f"has unknown keys {unknown}"] if unknown else [])
        raise StateError(f"{where} {' and '.join(parts)} (expected exactly {list(expected)}; a state from "
                         "GDSDataset.state_dict() of this gdsload version)")


def parse_state(state: Any, num_blocks: int | None = None) -> SavedState:
    """Check a state dict strictly: TypeError if it is not a dict; StateError (a ValueError) naming the key
    and what it allows for a missing, unknown, mistyped or out-of-range entry. ``num_blocks`` (the dataset's)
    bounds the world sizes. Whether it fits a dataset is :func:`check_matches`'s part."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a resume state must be a dict from GDSDataset.state_dict(), found {type(state).__name__}")
    content_free = state.get("state_format") == CONTENT_FREE_FORMAT and not isinstance(state["state_format"], bool)
    _keys(state, CONTENT_FREE_KEYS if content_free else STATE_KEYS, "state")
    if state["state_format"] != STATE_FORMAT and not content_free:
        raise StateError(f"state key 'state_format': expected {STATE_FORMAT} (or {CONTENT_FREE_FORMAT}), found "
                         f"{state['state_format']!r} (saved by another gdsload version, whose plans may differ)")
    max_world = num_blocks if num_blocks is not None else None
    world_why = "the dataset's blocks" if max_world is not None else ""
    world_size = _int(state["world_size"], "world_size", 1, max_world, world_why)
    raw_hops = state["hops"]
    if not isinstance(raw_hops, (list, tuple)) or len(raw_hops) > MAX_HOPS:
        raise StateError(f"state key 'hops': expected a list of at most {MAX_HOPS} dicts with keys {list(HOP_KEYS)}, "
                         f"found {raw_hops!r}"[:400])
    hops = []
    for i, h in enumerate(raw_hops):
        where = f"hops[{i}]"
        if not isinstance(h, Mapping):
            raise StateError(f"state key '{where}': expected a dict with keys {list(HOP_KEYS)}, found {h!r}")
        _keys(h, HOP_KEYS, f"state key '{where}'")
        hops.append(Hop(_int(h["world_size"], f"{where}.world_size", 1, max_world, world_why),
                        _int(h["batch_size"], f"{where}.batch_size", 1),
                        _int(h["window_blocks"], f"{where}.window_blocks", 1),
                        _int(h["batches"], f"{where}.batches", 1, None, "batches taken in that leg")))
    fields = _str_dict(state["fields"], "fields")
    hashes = {}
    for key in ("index_sha256",) if content_free else ("index_sha256", "content_sha256"):
        hashes[key] = _str_dict(state[key], key, hex_digest=True)
        if not hashes[key].keys() <= fields.keys():
            raise StateError(f"state key '{key}': expected digests of fields in 'fields' {sorted(fields)}, found "
                             f"{sorted(hashes[key])}")
    return SavedState(
        epoch=_int(state["epoch"], "epoch", 0),
        batches_yielded=_int(state["batches_yielded"], "batches_yielded", 0, None, "batches yielded in the epoch"),
        hops=tuple(hops),
        num_samples=_int(state["num_samples"], "num_samples", 1),
        samples_per_block=_int(state["samples_per_block"], "samples_per_block", 1),
        batch_size=_int(state["batch_size"], "batch_size", 1),
        window_blocks=_int(state["window_blocks"], "window_blocks", 1),
        shuffle=_bool(state["shuffle"], "shuffle"),
        seed=_int(state["seed"], "seed", 0),
        drop_last=_bool(state["drop_last"], "drop_last"),
        exact_shares=False if content_free else _bool(state["exact_shares"], "exact_shares"),
        rank=_int(state["rank"], "rank", 0, world_size - 1, "below the state's world_size"),
        world_size=world_size,
        fields=fields,
        index_sha256=hashes["index_sha256"],
        content_sha256=hashes.get("content_sha256"),
    )


def check_matches(saved: SavedState, config: PlanConfig, fp: Fingerprint) -> None:
    """Refuse a state of another dataset, or of another seed, shuffle or drop_last: those fix which samples
    an epoch holds and in which order, so no remainder of one is a remainder of the other."""
    diffs = [f"{k}: saved {getattr(saved, k)!r}, now {getattr(config, k)!r}" for k in FIXED_KEYS
             if getattr(saved, k) != getattr(config, k)]
    for name in sorted(saved.fields.keys() | fp.fields.keys()):
        a, b = saved.fields.get(name), fp.fields.get(name)
        if a != b:
            diffs.append(f"fields[{name!r}]: saved {a or 'absent'}, now {b or 'absent'}")
    for key, why in (("index_sha256", "its shard indexes differ: another dataset, or rewritten since"),
                     ("content_sha256", "its block checksums or chunk sizes differ: another dataset of the same "
                                        "shapes and layout, or rewritten since")):
        saved_hashes, hashes = getattr(saved, key) or {}, getattr(fp, key)
        for name in sorted(saved_hashes.keys() & hashes.keys()):
            a, b = saved_hashes[name], hashes[name]
            if a != b:
                diffs.append(f"{key}[{name!r}]: saved {a[:12]}..., now {b[:12]}... ({why})")
    if diffs:
        raise StateError(f"state does not match this dataset's configuration ({'; '.join(diffs)}): the dataset, "
                         "seed, shuffle and drop_last fix an epoch's samples and order, so they cannot change "
                         "mid-epoch (world_size, batch_size and window_blocks can)")


def resume(state: Any, config: PlanConfig, fp: Fingerprint) -> Cursor:
    """Where ``config``'s rank continues from ``state``: the epoch, its earlier legs and the batch to start
    at, as a fixed cursor (the next pass starts exactly there).

    Under the state's own world_size, batch_size and window_blocks this continues the current leg (the plain
    resume: the same plan, from the next batch). Under others, the leg is closed as a hop and the next one
    starts at batch 0 of its own plan, made from what the state's ranks left; a leg in which nothing was
    yielded is simply replaced, so a state taken at an epoch's start resumes as that epoch, fresh.
    """
    saved = parse_state(state, config.num_blocks)
    check_matches(saved, config, fp)
    if saved.content_sha256 is None:
        warn(f"resume state of state_format {CONTENT_FREE_FORMAT} (saved before gdsload fingerprinted a "
                      "dataset's content): its dataset's shapes and shard layout match, its content cannot be "
                      "checked; resuming. States saved from now on carry 'content_sha256'", UserWarning)
    legs = _legs(config, saved.epoch, saved.hops, saved.leg)
    batches = max(leg.plan.num_batches for leg in legs)  # ranks' exact shares may differ by a batch
    if saved.batches_yielded > batches:
        raise StateError(f"state key 'batches_yielded': expected an int from 0 to {batches}, the batches of epoch "
                         f"{saved.epoch}'s current leg (world_size, batch_size, window_blocks = {saved.leg}), found "
                         f"{saved.batches_yielded}")
    now = (config.world_size, config.batch_size, config.window_blocks)
    if now == saved.leg:
        plan = legs[config.rank].plan if saved.hops else None
        return Cursor(saved.epoch, saved.batches_yielded, saved.hops, plan, fixed=True)
    if saved.batches_yielded == 0:  # nothing read in that leg: the new one replaces it
        plan = resumed_plan(config, saved.epoch, saved.hops) if saved.hops else None
        return Cursor(saved.epoch, 0, saved.hops, plan, fixed=True)
    if len(saved.hops) == MAX_HOPS:
        raise StateError(f"state key 'hops': epoch {saved.epoch} was already read in {MAX_HOPS + 1} legs, the most "
                         "a state records; finish it under the settings it was saved with "
                         f"(world_size, batch_size, window_blocks = {saved.leg})")
    hops = (*saved.hops, Hop(*saved.leg, saved.batches_yielded))
    rest = _remaining(legs, saved.batches_yielded * saved.batch_size, config.samples_per_block)
    return Cursor(saved.epoch, 0, hops, _deal(rest, config)[config.rank].plan, fixed=True)


def merge_states(states: Sequence[Any]) -> dict[str, Any]:
    """One state from every rank's: checks there is one per rank and that they agree on everything but the
    rank (with synchronous training every rank has yielded the same batches), and returns it. Any one
    rank's state resumes the whole job; this is the check that they really are the same."""
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not states:
        raise TypeError("merge_states takes a non-empty list of states, one per rank")
    parsed = [parse_state(s) for s in states]
    world = parsed[0].world_size
    ranks = sorted(p.rank for p in parsed)
    if ranks != list(range(world)):
        raise StateError(f"state key 'rank': expected one state per rank 0..{world - 1}, found ranks {ranks}")
    first = min(range(len(parsed)), key=lambda i: parsed[i].rank)
    ref = states[first]
    for s, p in zip(states, parsed):
        differ = [k for k in dict.fromkeys([*ref, *s]) if k != "rank" and s.get(k) != ref.get(k)]
        if differ:
            detail = ", ".join(f"{k}: {ref.get(k, 'absent')!r} against {s.get(k, 'absent')!r}" for k in differ)
            hint = (" (the ranks stopped at different batches; checkpoint every rank after the same step)"
                    if "batches_yielded" in differ else "")
            raise StateError(f"rank {p.rank}'s state differs from rank 0's ({detail}){hint}")
    return {**ref, "rank": 0}


# -- the plan of a resumed leg --------------------------------------------------------------------------
def resumed_plan(config: PlanConfig, epoch: int, hops: Sequence[Hop] = ()) -> EpochPlan:
    """``config.rank``'s plan of the leg of ``epoch`` that follows ``hops`` (the ordinary plan without)."""
    if not hops:
        return epoch_plan(config, epoch)
    return leg_plans(config, epoch, hops)[config.rank]


def leg_plans(config: PlanConfig, epoch: int, hops: Sequence[Hop] = ()) -> list[EpochPlan]:
    """Every rank's plan of the leg of ``epoch`` that follows ``hops``, under ``config``'s world_size,
    batch_size and window_blocks (``config.rank`` is ignored)."""
    return [leg.plan for leg in _legs(config, epoch, tuple(hops), (config.world_size, config.batch_size,
                                                                   config.window_blocks))]


@dataclass(frozen=True)
class _RankPlan:
    plan: EpochPlan
    real: int  # stream positions before the padding (every one a different sample)


@dataclass(frozen=True)
class _Rest:
    """The unconsumed samples of a leg, in order: each one's id, the old window it was read in (numbered
    across ranks, non-decreasing) and its block's position in that window."""

    ids: np.ndarray
    window: np.ndarray
    position: np.ndarray


def _leg_config(base: PlanConfig, world_size: int, batch_size: int, window_blocks: int, rank: int) -> PlanConfig:
    return dataclasses.replace(base, world_size=world_size, batch_size=batch_size, window_blocks=window_blocks,
                               rank=rank)


def _legs(base: PlanConfig, epoch: int, hops: tuple[Hop, ...], last: tuple[int, int, int]) -> list[_RankPlan]:
    """Every rank's plan of the leg after ``hops``, run under ``last`` = (world_size, batch_size, W)."""
    settings = [(h.world_size, h.batch_size, h.window_blocks) for h in hops] + [last]
    legs = []
    for r in range(settings[0][0]):
        plan = epoch_plan(_leg_config(base, *settings[0], r), epoch)
        blocks = np.concatenate(plan.windows) if plan.windows else np.zeros(0, np.int64)
        real = min(len(plan.positions), int(block_sizes(blocks, base.num_samples, base.samples_per_block).sum()))
        legs.append(_RankPlan(plan, real))
    for i, hop in enumerate(hops):
        batches = legs[0].plan.num_batches
        if hop.batches > batches:
            raise StateError(f"state key 'hops[{i}].batches': expected an int from 1 to {batches}, the batches of "
                             f"that leg of epoch {epoch}, found {hop.batches}")
        rest = _remaining(legs, hop.batches * hop.batch_size, base.samples_per_block)
        legs = _deal(rest, _leg_config(base, *settings[i + 1], 0))
    return legs


def _remaining(legs: list[_RankPlan], consumed: int, k: int) -> _Rest:
    """What ``legs`` leave once every rank has consumed ``consumed`` stream positions: the rest of each
    rank's stream without its padding, rank after rank."""
    ids, window, position, first = [], [], [], 0
    for leg in legs:
        lo, hi = min(consumed, leg.real), leg.real
        plan = leg.plan
        ids.append(plan.sample_ids()[lo:hi])
        window.append(plan.window_of[lo:hi] + first)
        position.append(plan.positions[lo:hi] // k)
        first += len(plan.windows)
    return _Rest(*(np.concatenate(a) if a else np.zeros(0, np.int64) for a in (ids, window, position)))


def _deal(rest: _Rest, cfg: PlanConfig) -> list[_RankPlan]:
    """Every rank's plan for ``rest`` under ``cfg`` (its rank ignored): consecutive equal shares, read in
    windows of at most ``cfg.window_blocks`` blocks, padded (or cut, with drop_last) to equal length."""
    k, world, total = cfg.samples_per_block, cfg.world_size, len(rest.ids)
    ranks = np.arange(world + 1)
    if cfg.drop_last:
        target = total // world // cfg.batch_size * cfg.batch_size
        bounds = ranks * target
    else:
        target = -(-total // world)
        bounds = ranks * (total // world) + np.minimum(ranks, total % world)
    out = []
    for r in range(world):
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        windows, window_of, positions = _windows(rest.ids[lo:hi], rest.window[lo:hi], rest.position[lo:hi], k,
                                             cfg.window_blocks)
        if hi - lo < target:  # pad as a fresh plan does: repeat the start of the rank's last window
            if windows:
                last = positions[window_of == len(windows) - 1]
                extra = last[np.arange(target - (hi - lo)) % len(last)]
                window_of = np.concatenate([window_of, np.full(len(extra), len(windows) - 1, dtype=np.int64)])
                positions = np.concatenate([positions, extra])
            else:  # fewer samples left than ranks: repeat the remainder's last one
                s = int(rest.ids[-1])
                windows = (np.array([s // k], dtype=np.int64),)
                window_of, positions = np.zeros(target, np.int64), np.full(target, s % k, dtype=np.int64)
        out.append(_RankPlan(EpochPlan(dataclasses.replace(cfg, rank=r), windows, window_of, positions), hi - lo))
    return out


def _windows(ids: np.ndarray, window: np.ndarray, position: np.ndarray, k: int,
             window_blocks: int) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """New windows reading ``ids`` (samples of old windows, in order). The blocks holding them are taken in
    order (old window by old window, each in its order) and packed into windows of at most ``window_blocks``:
    an old window's blocks go whole into the current new window if they fit, else start a new one, split
    every ``window_blocks`` blocks if there are more. Each new window takes its blocks' samples in their
    order, so the order changes only where an old window is split. Returns the windows' blocks and each
    stream position's window and position in it."""
    if not len(ids):
        return (), np.zeros(0, np.int64), np.zeros(0, np.int64)
    # The (old window, block position) pairs held, in order: a mark per pair, no sort of the samples.
    span = int(position.max()) + 1
    key = (window - window[0]) * span + position
    present = np.zeros(int(key[-1] // span + 1) * span, dtype=bool)
    present[key] = True
    held = np.flatnonzero(present)
    inverse = (np.cumsum(present) - 1)[key]
    blocks = np.empty(len(held), dtype=np.int64)
    blocks[inverse] = ids // k
    owner = held // span
    group_start = np.flatnonzero(np.diff(owner, prepend=-1))
    counts = np.diff(np.append(group_start, len(held)))
    # Packing is sequential: one step per old window, not per sample.
    w_max = min(window_blocks, len(held))  # an int64 however large the setting
    first_window, offset = np.empty(len(counts), np.int64), np.empty(len(counts), np.int64)
    current, fill = -1, w_max
    for g, c in enumerate(counts.tolist()):
        if c <= w_max - fill:  # fits beside the old windows already in the current one
            first_window[g], offset[g] = current, fill
            fill += c
        else:
            first_window[g], offset[g] = current + 1, 0
            n = -(-c // w_max)
            current, fill = current + n, c - (n - 1) * w_max
    group = np.repeat(np.arange(len(counts)), counts)
    at = offset[group] + np.arange(len(held)) - group_start[group]
    new_window = first_window[group] + at // w_max
    window_of = new_window[inverse]
    positions = (at % w_max)[inverse] * k + ids % k
    if (np.diff(window_of) < 0).any():  # an old window was split: window by window, each in the old order
        order = np.argsort(window_of, kind="stable")
        window_of, positions = window_of[order], positions[order]
    return tuple(np.split(blocks, np.flatnonzero(np.diff(new_window)) + 1)), window_of, positions
