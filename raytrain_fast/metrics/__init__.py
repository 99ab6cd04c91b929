"""Metrics read from the training loop at the log cadence."""

from raytrain_fast.metrics.progress import Progress

__all__ = ["Progress"]
