"""Errors the profiler raises on bad input (all ``ValueError`` subclasses with a HINT)."""

from __future__ import annotations

from lightning_distplan.errors import DistPlanError

__all__ = ["ProfilingError", "DataLoadingError"]


class ProfilingError(DistPlanError, ValueError):
    """The module or its data cannot be profiled as given (no parameters, no batches, ...)."""


class DataLoadingError(ProfilingError):
    """Reading batches from the user's data loader failed (missing download, broken dataset, ...)."""
