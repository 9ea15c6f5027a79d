"""Weighted mixtures of datasets: the schedule (pure), one source's stream, and :class:`Mixture`, with the
``merge_states`` that checks its ranks' states agree."""

from .mixture import Mixture, merge_states

__all__ = ["Mixture", "merge_states"]
