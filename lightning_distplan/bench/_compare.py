"""Predicted vs measured: per-plan errors and the planner's report card (pure Python, no torch).

Errors are relative to the measurement: ``(predicted − measured) / measured``, so +0.2 means the
model said 20% slower than it ran. The *pick* is the best-ranked plan among those measured (the
planner's rank 1 whenever it was run); the *regret* is how much slower the pick ran than the
fastest measured plan: ``measured(pick) / measured(best) − 1``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from lightning_distplan.costmodel import Prediction
    from lightning_distplan.plan import Plan
    from lightning_distplan.profile import Profile

__all__ = ["relative_error", "percentile", "summarize", "predict_ranked", "first_profile_view", "confirm_candidates", "WITHIN", "CONFIRM_BAND", "CONFIRM_LIMIT"]

WITHIN = 0.05
"""The pick counts as good when it ran within 5% of the measured best (issue 6 target)."""

CONFIRM_BAND = 0.10
"""Plans measured within this fraction of the fastest are contenders for the measured best (see :func:`confirm_candidates`)."""

CONFIRM_LIMIT = 4
"""At most this many contenders are run again (the picks and the measured best always are, even past it)."""


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``(predicted − measured) / measured``, or ``None`` when either is missing or measured is not positive."""
    if predicted is None or measured is None or not measured > 0 or not math.isfinite(predicted):
        return None
    return (predicted - measured) / measured


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) like ``numpy.percentile``; ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def predict_ranked(profile: Profile, plans: Sequence[Plan], *, tie: float | None = None,
                   ranks_per_host: int | None = None) -> list[tuple[Prediction, int]]:
    """Each plan's prediction from ``profile`` and its planner rank among ``plans`` (1 = the planner's choice).

    Plans are priced as given (their stage boundaries as run) on the hardware
    :func:`~lightning_distplan.planner.rank_plans` prices them on (a CPU profile's host RAM shared by the
    ``ranks_per_host`` ranks on one machine, default the world size, one machine; over several machines the stages
    of a hybrid dp×pp on one machine share its link, ``Hardware.devices_per_link``) and ordered as it orders them;
    ``tie`` is the near-tie margin (default the planner's, :data:`~lightning_distplan.planner.NEAR_TIE`; 0 ranks by
    predicted time alone).
    """
    from lightning_distplan.costmodel import Hardware, predict
    from lightning_distplan.planner import NEAR_TIE, rank_order

    # one Hardware for all the plans: a profile without a measured link is said once, and only where a link is used; a CPU
    # profile's host RAM shared by the plans' ranks, as rank_plans (the bench's planner) and predict share it
    world = max((plan.world_size for plan in plans), default=1)
    hw = Hardware.from_profile(profile, warn_default_links=any(plan.world_size > 1 for plan in plans),
                               ranks_per_host=world if ranks_per_host is None else ranks_per_host, world_size=world)
    preds = [predict(profile, plan, hw) for plan in plans]
    ranks = [0] * len(plans)
    for position, i in enumerate(rank_order(plans, preds, tie=NEAR_TIE if tie is None else tie), 1):
        ranks[i] = position
    return list(zip(preds, ranks))


def first_profile_view(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records with their ``first_profile`` rank and predictions in place of the pooled ones (for :func:`summarize`)."""
    return [{**r, **r["first_profile"]} for r in records if r.get("first_profile")]


def confirm_candidates(records: Sequence[Mapping[str, Any]], *, band: float = CONFIRM_BAND, limit: int = CONFIRM_LIMIT) -> list[int]:
    """Indices of the records to run again in confirmation passes, in order of measured time.

    The fastest of a dozen noisy measurements is, by chance, faster than that plan really runs
    (the winner's curse), so a regret against it counts noise as the planner's fault. Confirmation
    passes run the contenders again and judge the pick on those runs alone. The contenders: the
    pick (best rank), the first profile's pick when records carry ``first_profile``, the measured
    best, and the other plans measured within ``band`` of it, fastest first, up to ``limit`` plans
    in all (the picks and the best always go, even past ``limit``). Failed plans are never contenders.
    """
    measured = [i for i, r in enumerate(records) if r.get("measured_step_time_s") is not None]
    if not measured:
        return []
    by_time = sorted(measured, key=lambda i: records[i]["measured_step_time_s"])
    fastest = records[by_time[0]]["measured_step_time_s"]
    must = {min(measured, key=lambda i: records[i]["rank"]), by_time[0]}
    firsts = [i for i in measured if records[i].get("first_profile")]
    if firsts:
        must.add(min(firsts, key=lambda i: records[i]["first_profile"]["rank"]))
    extra = [i for i in by_time if i not in must and records[i]["measured_step_time_s"] <= fastest * (1 + band)]
    chosen = must | set(extra[: max(0, limit - len(must))])
    return [i for i in by_time if i in chosen]


def summarize(records: Sequence[Mapping[str, Any]], *, within: float = WITHIN, confirm_stopped: str | None = None) -> dict[str, Any]:
    """Summary over per-plan records.

    Each record needs ``rank`` (planner rank, 1 = best predicted), ``plan`` (a short description),
    ``predicted_step_time_s`` and ``measured_step_time_s`` (``None`` when the run failed), and may
    have ``predicted_peak_memory_bytes`` / ``measured_peak_memory_bytes``.

    Returns:
        ``n_plans``, ``n_measured``, ``median_abs_error`` / ``p90_abs_error`` / ``mean_signed_error``
        of the step time, the same ``*_memory_*`` for memory when measured, ``pick`` and
        ``measured_best`` (rank, plan, predicted, measured), ``pick_ran`` (whether the best-ranked plan
        that ran is rank 1, the planner's choice; with ``--plans top:K`` it may not be once the
        predictions are final), ``pick_failed`` (the pick ran but gave no measurement: out of memory,
        an error; then ``pick_is_best`` and ``pick_within`` are False and ``regret`` None), ``pick_is_best``,
        ``pick_within`` (``within`` of the best), ``regret`` and ``spearman`` (rank correlation of predicted vs measured).
        ``confirmed``: when the pick carries ``confirm_step_time_s`` (its median in confirmation
        passes, :func:`confirm_candidates`), the pick judged against the contenders on those runs
        alone: ``n_plans``, ``pick``, ``pick_failed``, ``measured_best``, ``pick_is_best``, ``pick_within``,
        ``regret``; when the pick failed in those passes (``confirm_error``), ``pick_failed`` True and
        ``error``; else ``None``. ``confirm_stopped``: why the confirmation passes stopped before every contender
        ran them (a rank failing alone): then ``confirmed`` is ``None``, as those passes give no verdict (the
        contenders run before the stop would judge the pick against part of the field), and
        ``confirmed_withheld`` says why (``None`` otherwise).
    """
    measured = [r for r in records if r.get("measured_step_time_s") is not None]
    errors = [relative_error(r["predicted_step_time_s"], r["measured_step_time_s"]) for r in measured]
    abs_err = [abs(e) for e in errors if e is not None]
    mem_err = [
        abs(e)
        for r in measured
        if (e := relative_error(r.get("predicted_peak_memory_bytes"), r.get("measured_peak_memory_bytes"))) is not None
    ]
    out: dict[str, Any] = {
        "n_plans": len(records),
        "n_measured": len(measured),
        "median_abs_error": percentile(abs_err, 50),
        "p90_abs_error": percentile(abs_err, 90),
        "max_abs_error": max(abs_err) if abs_err else None,
        "mean_signed_error": sum(e for e in errors if e is not None) / len(abs_err) if abs_err else None,
        "median_abs_memory_error": percentile(mem_err, 50),
        "p90_abs_memory_error": percentile(mem_err, 90),
        "within": within,
        "pick": None,
        "pick_ran": None,
        "pick_failed": None,
        "measured_best": None,
        "pick_is_best": None,
        "pick_within": None,
        "regret": None,
        "spearman": None,
        "confirmed": None,
        "confirmed_withheld": None if confirm_stopped is None else f"the confirmation passes stopped early, so they give no verdict: {confirm_stopped}",
    }
    if not records:
        return out

    def brief(r: Mapping[str, Any]) -> dict[str, Any]:
        return {k: r.get(k) for k in ("rank", "plan", "predicted_step_time_s", "measured_step_time_s")}

    # The pick is the best-ranked plan that was run: when it failed (out of memory where the model said it fits),
    # the planner's choice did not work, whatever the other plans measured.
    pick = min(records, key=lambda r: r["rank"])
    out.update(pick=brief(pick), pick_ran=pick["rank"] == 1, pick_failed=pick.get("measured_step_time_s") is None)
    if out["pick_failed"]:
        out.update(pick_is_best=False, pick_within=False)
    if not measured:
        return out
    best = min(measured, key=lambda r: r["measured_step_time_s"])
    out.update(
        measured_best=brief(best),
        spearman=_spearman([r["predicted_step_time_s"] for r in measured], [r["measured_step_time_s"] for r in measured]),
    )
    if out["pick_failed"]:
        return out
    regret = pick["measured_step_time_s"] / best["measured_step_time_s"] - 1.0
    out.update(pick_is_best=pick is best, pick_within=regret <= within + 1e-12, regret=regret)
    contenders = [r for r in measured if r.get("confirm_step_time_s") is not None]
    if confirm_stopped is not None:
        pass  # no verdict from an incomplete confirmation (confirmed_withheld says why)
    elif pick.get("confirm_error"):  # the pick ran out of memory (or failed) in the confirmation passes
        out["confirmed"] = {"n_plans": len(contenders) + 1, "pick": brief(pick), "pick_failed": True, "error": pick["confirm_error"],
                            "measured_best": None, "pick_is_best": False, "pick_within": False, "regret": None}
    elif any(r is pick for r in contenders):
        fastest = min(contenders, key=lambda r: r["confirm_step_time_s"])
        again = pick["confirm_step_time_s"] / fastest["confirm_step_time_s"] - 1.0

        def brief_again(r: Mapping[str, Any]) -> dict[str, Any]:
            return {**brief(r), "confirm_step_time_s": r["confirm_step_time_s"]}

        out["confirmed"] = {
            "n_plans": len(contenders),
            "pick": brief_again(pick),
            "pick_failed": False,
            "measured_best": brief_again(fastest),
            "pick_is_best": fastest is pick,
            "pick_within": again <= within + 1e-12,
            "regret": again,
        }
    return out


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their average rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def _spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va > 0 and vb > 0 else None
