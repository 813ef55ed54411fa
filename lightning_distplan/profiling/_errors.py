"""Errors the profiler raises on bad input (all ``ValueError`` subclasses with a HINT).

They live in :mod:`lightning_distplan.errors`, which imports neither torch nor lightning, so the
command line can name them without loading the profiler.
"""

from __future__ import annotations

from lightning_distplan.errors import DataLoadingError, ProfilingError

__all__ = ["ProfilingError", "DataLoadingError"]
