"""Resume state: what a checkpoint holds, how it is checked, and where a resumed rank continues.

A state holds the epoch, the batches each rank yielded in the current leg and one small hop per earlier leg,
never a sample list: every leg's plans are recomputed from the config (:mod:`gdsload.pipeline.legs`). States
read in exact shares have their own format (:data:`EXACT_FORMAT`): an older one in the middle of a dealt-out
rest is refused, one without hops resumes. The format and a worked example: docs/multi-gpu.md.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GDSLoadError
from .legs import Hop, RankPlan, first_leg, most_batches, next_leg
from .plan import MAX_INT, EpochPlan, PlanConfig, epoch_plan

if TYPE_CHECKING:
    from ..format.layout import DatasetLayout
    from ..format.meta import DatasetMeta

STATE_FORMAT = 2  # bumped whenever the state's keys or the plan functions change meaning
EXACT_FORMAT = 3  # a state under exact_shares: hops with a 'shift', the rest dealt out without padding
CONTENT_FREE_FORMAT = 1  # before content_sha256: the same plans; resumed, warning that the content is unchecked
MAX_HOPS = 64  # legs one epoch may be read in: a checkpoint stays small whatever a job does
STATE_KEYS = ("state_format", "epoch", "batches_yielded", "hops", "num_samples", "samples_per_block", "batch_size",
              "window_blocks", "shuffle", "seed", "drop_last", "rank", "world_size", "fields", "index_sha256",
              "content_sha256", "exact_shares")
CONTENT_FREE_KEYS = STATE_KEYS[:-2]  # the keys of a state of CONTENT_FREE_FORMAT (exact_shares: False)
HOP_KEYS = ("world_size", "batch_size", "window_blocks", "batches")
EXACT_HOP_KEYS = (*HOP_KEYS, "shift")  # the hops of an EXACT_FORMAT state
FIXED_KEYS = ("num_samples", "samples_per_block", "shuffle", "seed", "drop_last", "exact_shares")  # fixed per epoch


class StateError(GDSLoadError, ValueError):
    """A resume state that is malformed, or does not fit the dataset it is loaded into."""


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
    exact = config.exact_shares
    state: dict[str, Any] = {"state_format": EXACT_FORMAT if exact else STATE_FORMAT, "epoch": int(epoch),
                             "batches_yielded": int(batches_yielded), "hops": [h.as_dict(exact) for h in hops]}
    for key in ("num_samples", "samples_per_block", "batch_size", "window_blocks", "shuffle", "seed", "drop_last",
                "rank", "world_size"):
        state[key] = getattr(config, key)
    state["fields"] = dict(fp.fields)
    state["index_sha256"] = dict(fp.index_sha256)
    state["content_sha256"] = dict(fp.content_sha256)
    state["exact_shares"] = config.exact_shares
    return state


def state_int(value: Any, key: str, lo: int, hi: int | None = None, why: str = "") -> int:
    """An int entry of a state from ``lo`` to ``hi``, never above :data:`MAX_INT` (the bound of GDSDataset's
    arguments): StateError naming the key and what it allows otherwise."""
    top = MAX_INT if hi is None else min(hi, MAX_INT)
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if integral and lo <= value <= top:
        return int(value)
    bounded = hi is not None or (integral and value > top)
    allowed = (f"an int from {lo} to {top}" if bounded else f"an int >= {lo}") + (f", {why}" if why else "")
    found = f"{int(value)}" if integral else f"{value!r} ({type(value).__name__})"
    raise StateError(f"state key '{key}': expected {allowed}, found {found}")


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
    exact = not content_free and isinstance(state["exact_shares"], (bool, np.bool_)) and bool(state["exact_shares"])
    fmt = state["state_format"]
    if exact and fmt == STATE_FORMAT and not isinstance(fmt, bool) and state["hops"]:
        raise StateError(f"state key 'state_format': {STATE_FORMAT} with exact_shares and hops: saved by an earlier "
                         "gdsload inside the rest of an epoch dealt out with padding, which this version deals out "
                         "without, so its batches are not this version's (resume it with the version that saved it, "
                         f"or from a state outside such an epoch; expected {EXACT_FORMAT})")
    if exact and (fmt not in (EXACT_FORMAT, STATE_FORMAT) or isinstance(fmt, bool)):
        raise StateError(f"state key 'state_format': expected {EXACT_FORMAT} (or {STATE_FORMAT} without hops) with "
                         f"exact_shares, found {fmt!r} (saved by another gdsload version, whose plans may differ)")
    if not exact and fmt != STATE_FORMAT and not content_free:
        raise StateError(f"state key 'state_format': expected {STATE_FORMAT} (or {CONTENT_FREE_FORMAT}), found "
                         f"{fmt!r} (saved by another gdsload version, whose plans may differ)")
    hop_keys = EXACT_HOP_KEYS if exact and fmt == EXACT_FORMAT else HOP_KEYS
    world_why = "the dataset's blocks" if num_blocks is not None else ""
    world_size = state_int(state["world_size"], "world_size", 1, num_blocks, world_why)
    hops = parse_hops(state["hops"], hop_keys, num_blocks)
    fields = _str_dict(state["fields"], "fields")
    hashes = {}
    for key in ("index_sha256",) if content_free else ("index_sha256", "content_sha256"):
        hashes[key] = _str_dict(state[key], key, hex_digest=True)
        if not hashes[key].keys() <= fields.keys():
            raise StateError(f"state key '{key}': expected digests of fields in 'fields' {sorted(fields)}, found "
                             f"{sorted(hashes[key])}")
    return SavedState(
        epoch=state_int(state["epoch"], "epoch", 0),
        batches_yielded=state_int(state["batches_yielded"], "batches_yielded", 0, None, "batches yielded in the epoch"),
        hops=hops,
        num_samples=state_int(state["num_samples"], "num_samples", 1),
        samples_per_block=state_int(state["samples_per_block"], "samples_per_block", 1),
        batch_size=state_int(state["batch_size"], "batch_size", 1),
        window_blocks=state_int(state["window_blocks"], "window_blocks", 1),
        shuffle=_bool(state["shuffle"], "shuffle"),
        seed=state_int(state["seed"], "seed", 0),
        drop_last=_bool(state["drop_last"], "drop_last"),
        exact_shares=False if content_free else _bool(state["exact_shares"], "exact_shares"),
        rank=state_int(state["rank"], "rank", 0, world_size - 1, "below the state's world_size"),
        world_size=world_size,
        fields=fields,
        index_sha256=hashes["index_sha256"],
        content_sha256=hashes.get("content_sha256"),
    )


def parse_hops(raw: Any, hop_keys: Sequence[str] = HOP_KEYS, num_blocks: int | None = None) -> tuple[Hop, ...]:
    """A state's ``hops`` checked: at most :data:`MAX_HOPS` dicts of exactly ``hop_keys`` (:data:`EXACT_HOP_KEYS`
    under exact shares), each entry in its range, world sizes at most ``num_blocks``; StateError naming the key."""
    world_why = "the dataset's blocks" if num_blocks is not None else ""
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_HOPS:
        raise StateError(f"state key 'hops': expected a list of at most {MAX_HOPS} dicts with keys {list(hop_keys)}, "
                         f"found {raw!r}"[:400])
    hops = []
    for i, h in enumerate(raw):
        where = f"hops[{i}]"
        if not isinstance(h, Mapping):
            raise StateError(f"state key '{where}': expected a dict with keys {list(hop_keys)}, found {h!r}")
        _keys(h, hop_keys, f"state key '{where}'")
        hop_world = state_int(h["world_size"], f"{where}.world_size", 1, num_blocks, world_why)
        shift = (state_int(h["shift"], f"{where}.shift", 0, hop_world - 1, "below that leg's world_size")
                 if "shift" in hop_keys else 0)
        hops.append(Hop(hop_world, state_int(h["batch_size"], f"{where}.batch_size", 1),
                        state_int(h["window_blocks"], f"{where}.window_blocks", 1),
                        state_int(h["batches"], f"{where}.batches", 1, None, "batches taken in that leg"), shift))
    return tuple(hops)


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


def batch_size_change(saved: SavedState, config: PlanConfig) -> str:
    """What a resume under another batch_size changes, said in a warning: the resume is exact (every sample of
    the epoch once), but the batches, and with another window size the order, are not the saved run's."""
    if saved.batches_yielded or saved.hops:
        what = (f"the rest of epoch {saved.epoch} is dealt out anew in batches of {config.batch_size} (every sample "
                "not yet yielded once, none twice), not in the batches the saved run would have yielded")
    else:
        what = f"epoch {saved.epoch} (not begun) and the later ones come in batches of {config.batch_size}"
    if saved.window_blocks != config.window_blocks:
        what += (f"; window_blocks is {config.window_blocks}, saved {saved.window_blocks} (its default depends on "
                 "batch_size), so the order of samples differs too (pass window_blocks to keep it)")
    return (f"resume state saved with batch_size={saved.batch_size}, resumed with batch_size={config.batch_size}: "
            f"{what}")


def merge_states(states: Sequence[Any]) -> dict[str, Any]:
    """One state from every rank's, of a GDSDataset or of a Mixture: checks there is one per rank and that they
    agree on everything but the rank (with synchronous training every rank has yielded the same batches), and
    returns it. Any one rank's state resumes the whole job; this is the check that they really are the same. A
    GDSDataset's states are checked entry by entry first (:func:`parse_state`); a Mixture's (keyed
    ``mixture_format``) are checked whole when loaded."""
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not states:
        raise TypeError("merge_states takes a non-empty list of states, one per rank")
    if not all(isinstance(s, Mapping) for s in states):
        raise TypeError("merge_states takes a list of state dicts (from state_dict()), one per rank")
    ranks = []
    for s in states:
        if "mixture_format" in s:  # a Mixture's: its rank and world size are all this needs of it
            world = state_int(s.get("world_size"), "world_size", 1)
            ranks.append(state_int(s.get("rank"), "rank", 0, world - 1, "below the state's world_size"))
        else:
            ranks.append(parse_state(s).rank)
    world = int(states[0]["world_size"])  # checked above
    ranks.sort()
    if world != len(states) or ranks != list(range(world)):  # no list of `world` ranks before it is known small
        raise StateError(f"state key 'rank': expected one state per rank 0..{world - 1}, found ranks {ranks}")
    ref = next(s for s in states if s["rank"] == 0)
    for s in states:
        differ = [k for k in dict.fromkeys([*ref, *s]) if k != "rank" and s.get(k) != ref.get(k)]
        if differ:
            detail = ", ".join(f"{k}: {ref.get(k, 'absent')!r} against {s.get(k, 'absent')!r}" for k in differ)
            hint = (" (the ranks stopped at different batches; checkpoint every rank after the same step)"
                    if "batches_yielded" in differ or "step" in differ else "")
            raise StateError(f"rank {s['rank']}'s state differs from rank 0's ({detail[:600]}){hint}")
    return {**ref, "rank": 0}


# -- the plans of the legs ------------------------------------------------------------------------------
def resumed_plan(config: PlanConfig, epoch: int, hops: Sequence[Hop] = ()) -> EpochPlan:
    """``config.rank``'s plan of the leg of ``epoch`` that follows ``hops`` (the ordinary plan without)."""
    if not hops:
        return epoch_plan(config, epoch)
    return leg_plans(config, epoch, hops)[config.rank]


def leg_plans(config: PlanConfig, epoch: int, hops: Sequence[Hop] = ()) -> list[EpochPlan]:
    """Every rank's plan of the leg of ``epoch`` that follows ``hops``, under ``config``'s world_size,
    batch_size and window_blocks (``config.rank`` is ignored)."""
    return [leg.plan for leg in legs_after(config, epoch, tuple(hops), (config.world_size, config.batch_size,
                                                                   config.window_blocks))]


def legs_after(base: PlanConfig, epoch: int, hops: tuple[Hop, ...], last: tuple[int, int, int]) -> list[RankPlan]:
    """Every rank's plan of the leg after ``hops``, run under ``last`` = (world_size, batch_size, W). StateError
    for a hop that took more batches than its leg holds."""
    settings = [(h.world_size, h.batch_size, h.window_blocks) for h in hops] + [last]
    legs = first_leg(base, epoch, settings[0])
    for i, hop in enumerate(hops):
        batches = most_batches(base, epoch, legs, hop)
        if hop.batches > batches:
            raise StateError(f"state key 'hops[{i}].batches': expected an int from 1 to {batches}, the batches of "
                             f"that leg of epoch {epoch}, found {hop.batches}")
        legs = next_leg(base, epoch, legs, hop, settings[i + 1])
    return legs
