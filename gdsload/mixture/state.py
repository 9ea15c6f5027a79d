"""A mixture's state dict: its keys, how a state is checked against the mixture, and whose each position is.

Each source's position (a :class:`~gdsload.mixture.schedule.Stretch`) is saved under its source's name with that
name and the digest of its dataset's fingerprint, so positions swapped between sources, or taken from another
state, are refused naming the source. Every number is range-checked (up to 2**63 - 1), and the whole state is
checked before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import warn
from ..pipeline.resume import StateError, state_int
from .schedule import Schedule, Stretch, parse_schedule, parse_stretch
from .source import FINGERPRINT_KEYS, Placement, SourceStream, dataset_record, record_digest

MIXTURE_FORMAT = 3  # bumped when the state's keys or the schedule change meaning
UNBOUND_FORMAT = 2  # before positions named their source: resumed, warning that whose they are goes unchecked
PADDED_REST_FORMAT = 1  # before: a position with hops read a padded rest; one without means what it means now
STATE_KEYS = ("mixture_format", "step", "seed", "batch_size", "whole_batches", "sources", "schedule", "positions",
              "datasets", "rank", "world_size")


@dataclass(frozen=True)
class Resumed:
    """A state checked against a mixture: its step and segment, and per source (in order) where its dataset is
    placed and its position from there."""

    step: int
    schedule: Schedule
    sources: tuple[tuple[Placement, Stretch], ...]


def check_state(state: Mapping[str, Any], sources: Sequence[SourceStream], seed: int, batch_size: int,
                whole_batches: bool) -> Resumed:
    """``state`` checked whole against a mixture of ``sources`` (nothing is changed here): StateError (a
    ValueError) naming the key for a malformed state, another source list or seed, a source whose data or
    order differ, or a position saved for another source. Warns where the resume is exact but not batch for
    batch (another ``batch_size`` or ``whole_batches``), and for a state too old to say whose its positions are."""
    names = [s.name for s in sources]
    fmt = state.get("mixture_format")
    if sorted(state) != sorted(STATE_KEYS) or isinstance(fmt, bool) or fmt not in (MIXTURE_FORMAT, UNBOUND_FORMAT,
                                                                                   PADDED_REST_FORMAT):
        raise StateError(f"state keys: expected {list(STATE_KEYS)} with mixture_format {MIXTURE_FORMAT} (a state "
                         f"from Mixture.state_dict() of this gdsload version), found {sorted(state)} with "
                         f"mixture_format {fmt!r}"[:400])
    if not isinstance(state["sources"], (list, tuple)) or list(state["sources"]) != names:
        raise StateError(f"state key 'sources': saved {state['sources']!r}, now {names} (a mixture resumes with the "
                         "same sources, in the same order)"[:400])
    if state["seed"] != seed:
        raise StateError(f"state key 'seed': saved {state['seed']!r}, now {seed}"[:300])
    step = state_int(state["step"], "step", 0)
    state_int(state["rank"], "rank", 0, state_int(state["world_size"], "world_size", 1) - 1)
    if not isinstance(state["whole_batches"], bool):
        raise StateError(f"state key 'whole_batches': expected True or False, found {state['whole_batches']!r}")
    saved_size = state_int(state["batch_size"], "batch_size", 1)
    schedule = parse_schedule(state["schedule"], names, step, 1 if state["whole_batches"] else saved_size)
    for key in ("positions", "datasets"):
        if not isinstance(state[key], Mapping) or sorted(state[key]) != sorted(names):
            raise StateError(f"state key '{key}': expected a dict keyed by the sources {names}, found "
                             f"{state[key]!r}"[:300])
    if fmt == PADDED_REST_FORMAT:  # its positions without hops mean what they mean now
        padded = [n for n, p in state["positions"].items() if isinstance(p, Mapping) and p.get("hops")]
        if padded:
            raise StateError(f"state key 'positions[{padded[0]!r}]': a position of mixture_format "
                             f"{PADDED_REST_FORMAT} inside the rest of an epoch dealt out with padding (an earlier "
                             "gdsload's), which this version deals out without: its samples are not this version's "
                             "(resume it with the version that saved it, or from a state outside such an epoch; "
                             f"expected mixture_format {MIXTURE_FORMAT})")
    records = {s.name: dataset_record(s.ds) for s in sources}
    located = tuple(_locate(s, state, records, fmt) for s in sources)
    if (saved_size, state["whole_batches"]) != (batch_size, whole_batches):
        schedule = Schedule.begin(step, schedule.weights)  # counts in other units: a new segment
        warn(f"mixture state saved with batch_size={saved_size}, whole_batches={state['whole_batches']}, resumed "
             f"with batch_size={batch_size}, whole_batches={whole_batches}: from step {step} the batches differ "
             "from the saved run's, and the weights' segment begins anew there (its counts were in the old units); "
             "every source goes on from its own position, no sample skipped or repeated", UserWarning)
    if fmt != MIXTURE_FORMAT:
        warn(f"mixture state of mixture_format {fmt} (saved before positions named their source): whose each "
             "position is cannot be checked (a position swapped between sources would go unnoticed); resuming. "
             "States saved from now on carry each position's source and fingerprint", UserWarning)
    return Resumed(step, schedule, located)


def _locate(s: SourceStream, state: Mapping[str, Any], records: dict[str, dict[str, Any]],
            fmt: int) -> tuple[Placement, Stretch]:
    """Source ``s``'s part of the state, checked: its dataset, its position and whose that is; then where its
    dataset resumes (:meth:`SourceStream.locate`)."""
    where = f"datasets[{s.name!r}]"
    saved, now = state["datasets"][s.name], records[s.name]
    if not isinstance(saved, Mapping) or sorted(saved) != sorted(FINGERPRINT_KEYS):
        raise StateError(f"state key '{where}': expected a dict with keys {list(FINGERPRINT_KEYS)}, found "
                         f"{saved!r}"[:300])
    for key in FINGERPRINT_KEYS:
        a, b = saved[key], now[key]
        if key.endswith("sha256") and isinstance(a, Mapping):  # digests of the fields read then and now
            a, b = ({f: d[f] for f in sorted(a.keys() & b.keys())} for d in (a, b))
        if a != b:
            others = [n for n, r in records.items() if n != s.name and r == dict(saved)]
            hint = f"; it is source {others[0]!r}'s (swapped?)" if others else ""
            raise StateError(f"state key '{where}.{key}': saved {a!r}, now {b!r} (source {s.name!r} is another "
                             f"dataset, or its data or order changed since{hint})"[:600])
    key = f"positions[{s.name!r}]"
    stretch = parse_stretch(state["positions"][s.name], key, unbound=fmt != MIXTURE_FORMAT)
    if fmt == MIXTURE_FORMAT:
        _check_owner(stretch, s.name, state, key)
    try:
        return s.locate(stretch)
    except StateError as e:
        raise StateError(f"source {s.name!r}'s position (state key '{key}'): {e}") from None


def _check_owner(stretch: Stretch, name: str, state: Mapping[str, Any], key: str) -> None:
    """StateError unless ``stretch`` was saved as source ``name``'s, for the dataset ``datasets[name]`` names."""
    if stretch.source != name:
        whose = (f"source {stretch.source!r}'s" if stretch.source in state["sources"]
                 else f"that of {stretch.source!r}, a source this mixture does not have")
        raise StateError(f"state key '{key}.source': this position is {whose}, not {name!r}'s (positions swapped or "
                         "moved between sources: each source resumes only from its own)"[:400])
    digest = record_digest(state["datasets"][name])
    if stretch.fingerprint != digest:
        owners = [n for n in state["sources"] if record_digest(state["datasets"][n]) == stretch.fingerprint]
        whose = f"source {owners[0]!r}'s dataset" if owners else "a dataset this state does not hold"
        raise StateError(f"state key '{key}.fingerprint': {stretch.fingerprint[:16]!r}... is the fingerprint of "
                         f"{whose}, not of source {name!r}'s (datasets[{name!r}]: {digest[:16]}...): the position "
                         "was saved for another dataset (a state put together from others?)"[:400])
