"""Weighted mixtures of datasets: the schedule (pure), one source's stream, and :class:`Mixture`."""
