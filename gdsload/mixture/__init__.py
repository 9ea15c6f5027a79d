"""Weighted mixtures of datasets: the schedule (pure), one source's stream, and :class:`Mixture`.
``merge_states`` (gdsload.merge_states, for a Mixture's states as for a GDSDataset's) is here too."""

from ..pipeline.resume import merge_states
from .mixture import Mixture

__all__ = ["Mixture", "merge_states"]
