"""Money per step and the time/cost objective (seed 000 §IV-D)."""

from __future__ import annotations

import math

from lightning_distplan.errors import CatalogError

__all__ = ["cost_per_step", "objective"]


def cost_per_step(step_time_s: float, *, instances: int, price_per_hour: float) -> float:
    """Cost of one optimizer step on ``instances`` rented instances.

    seed 000 §IV-D: C = instances · price_per_s · T, with price_per_s = price_per_hour / 3600.

    Example:
        >>> cost_per_step(2.0, instances=4, price_per_hour=3.6)
        0.008
    """
    if not isinstance(instances, int) or instances < 1:
        raise CatalogError(f"`instances` must be a positive integer, got {instances!r}.", hint="Count the rented instances.")
    if not math.isfinite(price_per_hour) or price_per_hour < 0:
        raise CatalogError(f"`price_per_hour` must be a non-negative number, got {price_per_hour!r}.", hint="Use the catalog's hourly price.")
    return instances * (price_per_hour / 3600.0) * step_time_s


def objective(cost: float, time_s: float, time_weight: float) -> float:
    """The scalar the tuner and planner minimise: C + w·T (seed 000 §IV-D, w ∈ {0, 2^8, 2^12, 2^16}).

    Example:
        >>> objective(0.5, 2.0, 256)
        512.5
    """
    if not math.isfinite(time_weight) or time_weight < 0:
        raise CatalogError(f"`time_weight` must be a non-negative number, got {time_weight!r}.", hint="Use e.g. 0, 256, 4096 or 65536.")
    return cost + time_weight * time_s
