"""Price every candidate plan with the cost model and order them (DESIGN §2, §3.4)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from lightning_distplan.costmodel import Hardware, Prediction, cost_per_step, objective, predict
from lightning_distplan.planner._enumerate import enumerate_plans
from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES, Plan

if TYPE_CHECKING:
    from lightning_distplan.profile import Profile

__all__ = ["Candidate", "rank_plans", "rank_order", "near_tie_order", "NEAR_TIE"]

NEAR_TIE = 0.02
"""Plans whose objective is within this fraction of the best remaining one count as tied (see :func:`near_tie_order`)."""


@dataclass(frozen=True)
class Candidate:
    """One ranked plan with its prediction.

    ``plan`` carries the stage boundaries the prediction used, so running it runs what was priced.
    """

    plan: Plan
    prediction: Prediction
    objective: float
    """What the ranking minimised: predicted seconds per step, or C + w·T when a price is given (at a price of 0 with no
    ``time_weight``, where C + w·T is 0 for every plan, the step time)."""
    rank: int
    """1 = best; feasible plans always rank above infeasible ones."""
    cost_per_step: float | None = None
    """Money per step (seed 000 §IV-D) when a price was given, else None."""
    skipped_samples: int = 0
    """Samples per epoch and replica this plan's steps would leave untrained of the run's loader (a pipeline's steps of
    ``m·n`` samples that the epoch's last ones do not fill), which a run of the loader as it is trains; 0: none, or not
    known. auto_plan sets it where it ranks such a plan behind the plans that train them all (``whole_epochs_first``),
    so that :func:`why_winner` says why a slower plan won."""
    skipped_samples_differ: bool = False
    """Whether the replicas skip different numbers of samples (each reading data of its own, of different sizes), so that
    ``skipped_samples`` is the most any replica skips, said as "up to" it."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON record of ``distplan plan --format json`` (DESIGN §5 field names)."""
        plan, pred = self.plan, self.prediction
        return {
            "rank": self.rank,
            **plan.layout(),
            "predicted_step_time_s": pred.step_time_s,
            "predicted_peak_memory_bytes": pred.peak_memory_bytes,
            "feasible": pred.feasible,
            "reason": pred.reason,
            "breakdown": dict(pred.breakdown),
            "memory_breakdown": dict(pred.memory_breakdown),
            "stage_times_s": list(pred.stage_times_s),
            "stage_memory_bytes": list(pred.stage_memory_bytes),
            "predicted_cost_per_step": self.cost_per_step,
            "objective": self.objective,
            "plan": plan.to_dict(),
        }


def rank_plans(
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    hardware: Hardware | None = None,
    price_per_hour: float | None = None,
    time_weight: float = 0.0,
    pins: dict[str, Any] | None = None,
    strategies: Sequence[str] = STRATEGIES,
    max_pp: int | None = None,
) -> list[Candidate]:
    """Every plan for ``global_batch_size`` on ``world_size`` devices, best first.

    Feasible plans come first, ordered by objective — predicted step time, or
    C + w·T (seed 000 §IV-D) with C = world_size · price_per_hour/3600 · T when ``price_per_hour``
    is given (one device per instance; a price of 0 with no ``time_weight`` ranks by step time, at cost 0) —
    then by lower peak memory (so 1F1B beats an equally fast GPipe); within 2% of the best remaining objective the
    larger micro-batch goes first (:func:`near_tie_order`). Infeasible plans follow, marked, with their reason.

    Args:
        profile: the measured profile.
        world_size: devices in total.
        global_batch_size: samples per optimizer step.
        hardware: target devices; default :meth:`Hardware.from_profile` (for a CPU profile, the host's RAM shared by
            the ``world_size`` ranks).
        price_per_hour: price of one device (instance) per hour.
        time_weight: w in C + w·T (only with a price).
        pins: see :func:`enumerate_plans`.
        strategies: which strategies to consider.
        max_pp: the most pipeline stages to consider.

    Raises:
        InfeasiblePlanError: ``world_size`` or ``global_batch_size`` below 1, an impossible pin, or a ``time_weight``
            without a price.
        BatchNotFactorableError: the global batch cannot be factored (with the nearest valid sizes).

    Example:
        >>> best = rank_plans(profile, world_size=4, global_batch_size=64)[0]  # doctest: +SKIP
        >>> best.plan.describe(), best.prediction.step_time_s  # doctest: +SKIP
    """
    if time_weight and price_per_hour is None:  # as `distplan plan` refuses it: a weight without a price ranked by time alone
        raise InfeasiblePlanError(
            f"`time_weight` ({time_weight}) weighs time against cost, and without `price_per_hour` there is no cost.",
            hint="Pass price_per_hour= (one device's price per hour), or leave time_weight at 0 to rank by step time.",
        )
    plans = enumerate_plans(
        profile, world_size=world_size, global_batch_size=global_batch_size, strategies=strategies, max_pp=max_pp, pins=pins
    )
    hw = hardware if hardware is not None else Hardware.from_profile(  # one device: no link; CPU ranks share the host's RAM
        profile, warn_default_links=world_size > 1, ranks_per_host=world_size)
    priced: list[tuple[Plan, Prediction, float, float | None]] = []
    for plan in plans:
        pred = predict(profile, plan, hw)
        if pred.stage_boundaries != plan.stage_boundaries:
            plan = replace(plan, stage_boundaries=pred.stage_boundaries)
        cost = None
        if price_per_hour is not None:
            cost = cost_per_step(pred.step_time_s, instances=plan.world_size, price_per_hour=price_per_hour)
            # free devices (on-prem) and no weight: C + w·T is 0 for every plan, and ranked by that the pick fell to the
            # lowest peak and the largest micro-batch, a plan 2x slower first; "cost nothing" ranks by time, at cost 0
            score = objective(cost, pred.step_time_s, time_weight) if price_per_hour or time_weight else pred.step_time_s
        else:
            score = pred.step_time_s
        priced.append((plan, pred, score, cost))
    order = rank_order([p[0] for p in priced], [p[1] for p in priced], [p[2] for p in priced])
    return [
        Candidate(plan=plan, prediction=pred, objective=score, rank=i + 1, cost_per_step=cost)
        for i, (plan, pred, score, cost) in enumerate(priced[j] for j in order)
    ]


def comparable(score: float) -> float:
    """``score`` to 12 significant digits: two predictions that differ only in the order their terms were summed compare equal.

    Example:
        >>> comparable(0.1 + 0.2) == comparable(0.3)
        True
    """
    return float(f"{score:.12g}")


def twin_key(plan: Plan) -> tuple[int, int, int]:
    """dp, pp and micro-batch: plans with equal keys differ at most in their schedule (:func:`near_tie_order`'s ``layouts``)."""
    return plan.dp, plan.pp, plan.micro_batch_size


def rank_order(
    plans: Sequence[Plan], predictions: Sequence[Prediction], scores: Sequence[float] | None = None, *, tie: float = NEAR_TIE
) -> list[int]:
    """Indices of ``plans`` best first, as :func:`rank_plans` orders them.

    Feasible before infeasible, then by ``scores`` (default: predicted step time; compared through
    :func:`comparable`, so the order in which a prediction summed its terms cannot break a tie),
    lower peak memory, fewer stages and the plan's description; then near ties go to the larger
    micro-batch, and at equal micro-batches to 1F1B over GPipe (:func:`near_tie_order`, margin
    ``tie``; 0 orders by score alone).
    """
    if scores is None:
        scores = [pred.step_time_s for pred in predictions]
    keys = [
        (not pred.feasible, comparable(score), pred.peak_memory_bytes, plan.pp, plan.describe())
        for plan, pred, score in zip(plans, predictions, scores)
    ]
    by_key = sorted(range(len(keys)), key=keys.__getitem__)
    near = near_tie_order(
        [scores[i] for i in by_key],
        [plans[i].micro_batch_size for i in by_key],
        [predictions[i].feasible for i in by_key],
        tie=tie,
        preferred=[plans[i].strategy == "1f1b" for i in by_key],
        layouts=[twin_key(plans[i]) for i in by_key],
    )
    return [by_key[j] for j in near]


def near_tie_order(
    scores: Sequence[float],
    micro_batch_sizes: Sequence[int],
    feasible: Sequence[bool],
    *,
    tie: float = NEAR_TIE,
    preferred: Sequence[bool] | None = None,
    layouts: Sequence[Hashable] | None = None,
) -> list[int]:
    """Ranking order of plans already sorted best first: near ties go to the larger micro-batch, then to 1F1B.

    Each next rank goes to the plan with the largest micro-batch among the remaining ones whose
    objective is within ``tie`` (2%) of the best remaining objective (feasible plans before
    infeasible ones), the earlier in the given order among equal sizes; but a near-tied
    ``preferred`` plan of the same layout (``layouts``; default: the micro-batch) goes before it
    (:func:`rank_order` marks 1F1B, and a layout is dp, pp and micro-batch: 1F1B before the GPipe
    of the same split). Why the micro-batch: every micro-batch is one more pass
    through the training loop or the pipeline runtime, and part of that per-pass cost is not in the
    model (the pipelining runtime's own work is, as profiled, but not what a real stage's
    bookkeeping adds to it), so a near tie goes to fewer passes. Why 1F1B over GPipe of the same
    split: it holds fewer activations, and its runtime measured cheaper per micro-batch than
    GPipe's (``benchmarks/pipeline_slot_overhead.py``: 0.90 against 1.46 ms over gloo), while the
    model charges both schedules the one profiled slot.

    Replayed with today's cost model on the CPU cluster sweeps (``benchmarks/replay_sweep.py [--tie
    0]`` and ``benchmarks/replay_variants.py no-1f1b-preference``), the settings whose pick ran within
    5% of the measured best, with this rule / without its 1F1B preference / in the plain order
    (``--tie 0``): in ``benchmarks/results/earlier/``, K to V (108 settings) 103 / 103 / 101; W to C2
    and Z (63) 58 each; D2 to F2 (27) 26 / 25 / 25, and 24 / 25 / 24 judged on their confirmation
    passes; G2 to I2 (27) 26 each; J2 to L2 (27) 27 / 27 / 26, and 24 each on confirmation; M2 to O2
    (27) 24 / 23 / 23, and 25 / 24 / 24 on confirmation; the three committed sweeps
    (``benchmarks/results/``) 25 / 25 / 24, and on confirmation 24 / 24 of 27 and 22 of the 26 whose
    plain-order pick was confirmed. They were made at a41b298, whose rule put 1F1B before any plan of
    its micro-batch, not only before the GPipe of its split; both forms pick the same in them, and
    over all 34 runs 289 of 306 settings (157 against 158 of 171 on confirmation).

    Example:
        >>> near_tie_order([1.00, 1.01, 1.10], [4, 8, 16], [True, True, True])
        [1, 0, 2]
        >>> near_tie_order([1.00, 1.05], [4, 8], [True, True])  # 5% apart: not a tie
        [0, 1]
    """
    same = micro_batch_sizes if layouts is None else layouts
    left = list(range(len(scores)))
    order: list[int] = []
    while left:
        pool = [i for i in left if feasible[i]] or left
        best = scores[pool[0]]
        near = [i for i in pool if scores[i] <= best + tie * abs(best)]
        head = max(near, key=lambda i: (micro_batch_sizes[i], -i))  # equal sizes: the earlier in the given order
        if preferred is not None and not preferred[head]:  # a near-tied preferred twin of the same layout first
            twins = [i for i in near if preferred[i] and same[i] == same[head]]
            head = min(twins, default=head)
        order.append(head)
        left.remove(head)
    return order
