"""The planner: enumerate the plans that keep the user's global batch, price them, rank them.

Pure Python over a saved :class:`~lightning_distplan.profile.Profile` (DESIGN §3.6): no torch, no
lightning.

Example:
    >>> from lightning_distplan.planner import explain, rank_plans
    >>> candidates = rank_plans(profile, world_size=8, global_batch_size=256)  # doctest: +SKIP
    >>> print(explain(candidates, top=5))  # doctest: +SKIP
"""

from __future__ import annotations

from lightning_distplan.planner._enumerate import PIN_KEYS, check_batch_before_profiling, check_pins_before_profiling, enumerate_plans, nearest_valid_batch_sizes, satisfies_pins
from lightning_distplan.planner._explain import closest_to_fitting, explain, why_winner
from lightning_distplan.planner._rank import NEAR_TIE, Candidate, near_tie_order, rank_order, rank_plans

__all__ = [
    "Candidate",
    "enumerate_plans",
    "check_pins_before_profiling",
    "check_batch_before_profiling",
    "satisfies_pins",
    "rank_plans",
    "rank_order",
    "near_tie_order",
    "NEAR_TIE",
    "explain",
    "why_winner",
    "closest_to_fitting",
    "nearest_valid_batch_sizes",
    "PIN_KEYS",
]
