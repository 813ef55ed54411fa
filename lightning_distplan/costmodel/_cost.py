"""Money per step and the time/cost objective (seed 000 §IV-D)."""

from __future__ import annotations

from lightning_distplan.costmodel._hardware import _is_finite_number
from lightning_distplan.errors import CatalogError

__all__ = ["cost_per_step", "objective"]


def cost_per_step(step_time_s: float, *, instances: int, price_per_hour: float) -> float:
    """Cost of one optimizer step on ``instances`` rented instances.

    seed 000 §IV-D: C = instances · price_per_s · T, with price_per_s = price_per_hour / 3600.

    Example:
        >>> cost_per_step(2.0, instances=4, price_per_hour=3.6)
        0.008
    """
    _check("step_time_s", step_time_s, "Pass the predicted seconds per optimizer step (Prediction.step_time_s).")
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise CatalogError(f"`instances` must be a positive integer, got {instances!r}.", hint="Count the rented instances.")
    _check("price_per_hour", price_per_hour, "Use the catalog's hourly price.")
    return instances * (price_per_hour / 3600.0) * step_time_s


def objective(cost: float, time_s: float, time_weight: float) -> float:
    """The scalar the tuner and planner minimise: C + w·T (seed 000 §IV-D, w ∈ {0, 2^8, 2^12, 2^16}).

    Example:
        >>> objective(0.5, 2.0, 256)
        512.5
    """
    _check("cost", cost, "Pass the cost per step (cost_per_step).")
    _check("time_s", time_s, "Pass the predicted seconds per optimizer step.")
    _check("time_weight", time_weight, "Use e.g. 0, 256, 4096 or 65536.")
    return cost + time_weight * time_s


def _check(name: str, value: object, hint: str) -> None:
    """Refuse what is not a finite number >= 0: a nan in would come out as a nan price, which ranks nowhere."""
    if not (_is_finite_number(value) and value >= 0):
        raise CatalogError(f"`{name}` must be a finite number >= 0, got {value!r}.", hint=hint)
