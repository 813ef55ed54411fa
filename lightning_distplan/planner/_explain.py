"""A human-readable ranking: aligned table plus one line on why the winner wins."""

from __future__ import annotations

import math
from typing import Sequence

from lightning_distplan.costmodel import BREAKDOWN_KEYS
from lightning_distplan.planner._rank import NEAR_TIE, Candidate, comparable, twin_key

__all__ = ["explain", "why_winner", "closest_to_fitting"]

_SHORT = {"compute": "compute", "p2p": "p2p", "bubble": "bubble", "exposed_comm": "comm", "optimizer": "optim", "framework": "loop", "sync_wait": "sync"}


def _s(x: float) -> str:
    return f"{x:.4g}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def _apart(a: float, b: float, fmt=lambda x, d: f"{x:.{d}g}", digits: int = 4) -> tuple[str, str]:
    """``a`` and ``b`` printed with ``digits`` digits, or as many more as it takes to print them apart: a claim that one
    is smaller, next to "0.4559 s vs 0.4559 s", contradicts itself."""
    for d in range(digits, digits + 9):
        sa, sb = fmt(a, d), fmt(b, d)
        if sa != sb:
            break
    return sa, sb


def _gib_apart(a: int, b: int) -> tuple[str, str]:
    """Two byte counts in GiB (3 decimals, more where it takes them to print apart)."""
    return _apart(a / 2**30, b / 2**30, lambda x, d: f"{x:.{d}f}", 3)


def _pct(frac: float) -> str:
    """A predicted difference (a fraction above 0) to the nearest 0.1%, and "under 0.1%" where that would print 0.0%:
    "predicted 0.0% faster" reads as no difference, yet the ranking saw one."""
    text = f"{frac:.1%}"
    return "under 0.1%" if frac > 0 and float(text[:-1]) == 0 else text


def _within(frac: float) -> str:
    """A bound on a difference (a fraction above 0), rounded *up* to 0.1%: "within 0.7%" said of 0.74%, or "within 0.0%"
    said of a plan that is slower, would state less than the difference it stands for."""
    return f"{max(1, math.ceil(frac * 1000 - 1e-9)) / 10:.1f}%"


def explain(candidates: Sequence[Candidate], top: int = 10) -> str:
    """Render ranked candidates as an aligned text table and a "why the winner wins" line.

    Args:
        candidates: the output of :func:`rank_plans` (best first).
        top: how many rows to show (the summary always considers all candidates).
    """
    if not candidates:
        return "No candidate plans."
    priced = any(c.cost_per_step is not None for c in candidates)
    header = ["rank", "plan", "step s"] + [_SHORT[k] + " s" for k in BREAKDOWN_KEYS] + ["peak GiB"]
    if priced:
        header += ["cost/step", "objective"]
    header += ["feasible / why"]
    rows = []
    for cand in list(candidates)[: max(top, 1)]:
        pred = cand.prediction
        row = [str(cand.rank), cand.plan.describe(), _s(pred.step_time_s)]
        row += [_s(pred.breakdown.get(k, 0.0)) for k in BREAKDOWN_KEYS]
        row += [_gib(pred.peak_memory_bytes)]
        if priced:
            row += [_s(cand.cost_per_step or 0.0), _s(cand.objective)]
        row += ["yes" if pred.feasible else f"NO: {pred.reason}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    numeric = set(range(2, len(header) - 1))

    def fmt(row: list[str]) -> str:
        cells = [row[i].rjust(widths[i]) if i in numeric else row[i].ljust(widths[i]) for i in range(len(widths))]
        return "  ".join(cells + [row[-1]]).rstrip()

    lines = [fmt(header), fmt(["-" * w for w in widths] + ["-" * len(header[-1])])]
    lines += [fmt(r) for r in rows]
    if len(candidates) > len(rows):
        lines.append(f"... {len(candidates) - len(rows)} more")
    lines.append("")
    lines.append(why_winner(candidates))
    return "\n".join(lines)


def closest_to_fitting(candidates: Sequence[Candidate]) -> Candidate:
    """Of ranked candidates none of which fits, the one with the smallest predicted peak (the best ranked among equals).

    Infeasible plans rank by time, so the first is the fastest, not the one nearest to fitting: with 1 GiB devices
    a dp_ga plan of 5 GiB can rank above a 1F1B plan of 1.004 GiB.
    """
    return min(candidates, key=lambda c: c.prediction.peak_memory_bytes)


def _behind(win: Candidate, fastest: Candidate, of: str) -> str:
    """Why ``win`` ranks above ``fastest``, a plan predicted faster, said after the winner's description (``of`` names
    ``fastest``: "the fastest plan"): the near-tie rule that put it first, or, decided by none, only that it is slower."""
    # the near-tie sentences hold only of a near tie (near_tie_order's margin) that the ranking's rule decided: said of
    # any list why_winner is given (a caller's own order), "within 5.0% ... in a near tie" and "prefers 1F1B" of a
    # GPipe winner were printed
    near = win.objective <= fastest.objective + NEAR_TIE * abs(fastest.objective)
    within = f"is predicted within {_within(win.objective / fastest.objective - 1)} of {of} ({fastest.plan.describe()})"
    if near and twin_key(win.plan) == twin_key(fastest.plan) and (win.plan.strategy, fastest.plan.strategy) == ("1f1b", "gpipe"):
        # a near tie between GPipe and 1F1B of one layout, gone to 1F1B (near_tie_order). 1F1B holds fewer
        # micro-batches in flight only where there are more than the stages (min(n, p - k) against n): at n == pp the
        # peaks are equal, and "fewer activations (0.045 vs 0.045 GiB peak)" was said of them
        wm, fm = win.prediction.peak_memory_bytes, fastest.prediction.peak_memory_bytes
        wg, fg = _gib_apart(wm, fm)
        cheaper = "whose runtime measured cheaper per micro-batch than GPipe's"
        memory = (f"which holds fewer activations ({wg} vs {fg} GiB peak) and {cheaper}." if wm < fm
                  else f"{cheaper}; both peak at {_gib(wm)} GiB." if wm == fm
                  else f"{cheaper}, though this one needs more peak memory ({wg} vs {fg} GiB).")
        return f"{within}, with the same dp, pp and micro-batch; in a near tie the ranking prefers 1F1B, {memory}"
    if near and win.plan.micro_batch_size > fastest.plan.micro_batch_size:
        # a near tie that went to the larger micro-batch (near_tie_order)
        return (
            f"{within} and runs larger micro-batches ({win.plan.micro_batch_size} vs {fastest.plan.micro_batch_size}); in a "
            "near tie the ranking prefers them, since every micro-batch carries loop and pipeline-runtime cost the model does "
            "not fully price."
        )
    # ranked first for none of the reasons above: claim none
    return f"was ranked first, though predicted {_pct(win.objective / fastest.objective - 1)} slower than {of} ({fastest.plan.describe()})."


def why_winner(candidates: Sequence[Candidate]) -> str:
    """One sentence: what the best plan saves over the best plan of another strategy (or the runner-up); or, where a plan
    predicted faster ranks behind it, why (a second sentence where both a plan that skips samples and one that trains
    them all do)."""
    if not candidates:
        return "No candidate plans."
    win = candidates[0]
    if not win.prediction.feasible:
        closest = closest_to_fitting(candidates)
        return f"No plan fits in memory; the closest, {closest.plan.describe()}, fails because {closest.prediction.reason}"
    feasible = [c for c in candidates[1:] if c.prediction.feasible]
    if len(candidates) == 1:  # pins or one strategy can leave one plan: none was ruled out, least of all by memory
        return f"Why the winner wins: {win.plan.describe()} is the only candidate plan."
    if not feasible:
        return f"Why the winner wins: {win.plan.describe()} is the only plan that fits in memory."
    fastest = min(feasible, key=lambda c: c.objective)
    if comparable(fastest.objective) < comparable(win.objective) and fastest.skipped_samples and not win.skipped_samples:
        # moved behind the winner because it would leave samples of each epoch untrained (auto_plan's whole_epochs_first)
        faster = [c for c in feasible if comparable(c.objective) < comparable(win.objective) and c.skipped_samples and c is not fastest]
        plans = f"{len(faster)} more plan{'s' if len(faster) > 1 else ''} predicted faster"
        skips = sorted({c.skipped_samples for c in faster})
        like = f", like {plans}," if skips == [fastest.skipped_samples] else ""
        # plans of other dp split the loader otherwise, and skip other counts: say theirs, not the fastest plan's, with
        # the unit ("would skip 1, which a run of your loader trains" left the reader to guess 1 what)
        rest = "" if like or not faster else (f", and {plans} would skip {skips[0]}" + (f" to {skips[-1]}" if len(skips) > 1 else "")
                                                + f" sample{'s' if skips[-1] > 1 else ''}")
        n = fastest.skipped_samples
        # plans that train every sample can be faster too, where the winner took a near tie from them: unsaid, "like 1 more
        # plan predicted faster" read as if the skipping plans were the only faster ones, and why those lost went unsaid
        whole = min((c for c in feasible if not c.skipped_samples), key=lambda c: c.objective, default=None)
        also = ("" if whole is None or comparable(whole.objective) >= comparable(win.objective)
                else f" Of the plans that train every sample, it {_behind(win, whole, 'the fastest of them')}")
        return (
            f"Why the winner wins: {win.plan.describe()} trains every sample of the epoch, while the fastest plan "
            f"({fastest.plan.describe()}, predicted {_pct(1 - fastest.objective / win.objective)} faster){like} would skip "
            f"{'up to ' if fastest.skipped_samples_differ else ''}the epoch's "
            f"last {n} sample{'s' if n > 1 else ''} per replica{rest}, which a run of your loader trains.{also}"
        )
    if comparable(fastest.objective) < comparable(win.objective):
        return f"Why the winner wins: {win.plan.describe()} {_behind(win, fastest, 'the fastest plan')}"
    # Compare with the best plan of another layout (dp / pp / hybrid) first: "why pipelines over DP"
    # is the question users ask; GPipe vs 1F1B of the same layout differ only in memory.
    other = next(
        (c for c in feasible if c.plan.kind != win.plan.kind),
        next((c for c in feasible if c.plan.strategy != win.plan.strategy), feasible[0]),
    )
    if other.plan.kind != win.plan.kind:
        what = f"the best {other.plan.strategy} {other.plan.kind} plan"
    elif other.plan.strategy != win.plan.strategy:
        what = f"the best {other.plan.strategy} plan"
    else:
        what = "the runner-up"
    wt, ot = win.prediction.step_time_s, other.prediction.step_time_s
    if comparable(ot) > comparable(wt):
        diffs = {k: other.prediction.breakdown.get(k, 0.0) - win.prediction.breakdown.get(k, 0.0) for k in BREAKDOWN_KEYS}
        key = max(diffs, key=lambda k: diffs[k])
        wk, ok = _apart(win.prediction.breakdown.get(key, 0.0), other.prediction.breakdown.get(key, 0.0))
        because = f", mostly {_SHORT[key]} ({wk} s vs {ok} s)"
        # the speedup o/t said as such: "1.21x less than" left open what was 1.21x less, and a ratio of step times
        # is not a time saved. "1.00x faster" says nothing is gained: under 1.005x the time saved is said in percent
        faster = f"{ot / wt:.2f}x faster" if f"{ot / wt:.2f}" != "1.00" else f"{_pct(1 - wt / ot)} less"
        ws, os_ = _apart(wt, ot)
        return (
            f"Why the winner wins: {win.plan.describe()} takes {ws} s/step, {faster} than {what} "
            f"({other.plan.describe()}: {os_} s){because}."
        )
    # not faster, and no plan has a lower objective: a tie on time. Every plan of a ranking runs on its world_size devices
    # at one price and weight, so its objective is its time times one factor (at the factor 0, its time): no plan
    # has "the lower objective C + w·T" at a time no lower, nor the same objective at another time
    wm, om = win.prediction.peak_memory_bytes, other.prediction.peak_memory_bytes
    wg, og = _gib_apart(wm, om)
    tie = f"Why the winner wins: {win.plan.describe()} ties {what} ({other.plan.describe()}) at {_s(wt)} s/step"
    if wm < om:
        return f"{tie} and needs less peak memory ({wg} vs {og} GiB)."
    if wm > om and win.plan.micro_batch_size > other.plan.micro_batch_size:
        # a tie goes to the larger micro-batch before the lower peak (near_tie_order), e.g. dp_ga plans whose time does
        # not depend on m: "ties ... at 0.616 GiB peak memory" was said of a winner that needs more
        return (
            f"{tie} and runs larger micro-batches ({win.plan.micro_batch_size} vs {other.plan.micro_batch_size}), which in a "
            f"tie the ranking prefers, though it needs more peak memory ({wg} vs {og} GiB)."
        )
    if wm > om:  # no rule of the ranking puts it first: say what is known
        return f"{tie}; this one came first in the tie, though it needs more peak memory ({wg} vs {og} GiB)."
    # the same time and memory (the ranking's last key, the plan's description, decided): nothing to claim
    return f"{tie} and {_gib(wm)} GiB peak memory; either runs as predicted, this one came first in the tie."
