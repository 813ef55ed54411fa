"""Score the current cost model against the measurements of committed CPU cluster sweeps.

A sweep (``benchmarks/cpu_cluster_sweep.py``) stores each setting's profile next to the measured
step time of every plan. This script predicts each measured plan again from that stored profile
with the cost model and planner as they are now. It prints the sweep's summary: median and p90
|error|, the share of settings where the new pick ran within 5% of the measured best, and the
median signed error by rate and strategy.

The measurements stay the sweep's; only the predictions are new. So a change to ``costmodel/``
or ``planner/`` is scored in seconds against every stored sweep, instead of one noisy 20-minute
re-run. What it cannot score: changes to the profiler or the bench runner. Those need a new sweep.

Usage::

    python benchmarks/replay_sweep.py benchmarks/results/cpu_cluster_sweep.json benchmarks/results/cpu_cluster_sweep_run2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import read_sweeps  # noqa: E402
from cpu_cluster_sweep import confirmed_picks, summarize_sweep  # noqa: E402

from lightning_distplan.bench import first_profile_view, predict_ranked, relative_error, summarize  # noqa: E402
from lightning_distplan.plan import Plan  # noqa: E402
from lightning_distplan.planner import NEAR_TIE  # noqa: E402
from lightning_distplan.profile import Profile, pool_profiles  # noqa: E402


def stored_profiles(setting: dict[str, Any]) -> list[dict[str, Any]]:
    """The stored profiles a setting's predictions come from: each one taken (``profiles``), or the one ``profile`` of sweeps that stored one."""
    return setting.get("profiles") or [setting["profile"]]


def replay_setting(setting: dict[str, Any], *, tie: float = NEAR_TIE) -> dict[str, Any]:
    """The setting with every measured plan predicted again; planner ranks follow the new predictions.

    Predictions come from the mean of the setting's profiles (``profiles``: taken before the runs
    and after each pass) or, in sweeps that stored one, from ``profile``; ``first_profile`` and
    ``summary_first_profile`` hold the first profile's, when there were several.
    ``tie``: the planner's near-tie margin (:func:`~lightning_distplan.planner.near_tie_order`); 0 ranks by predicted time alone.
    The plans are priced with the ranks per machine the bench recorded (``ranks_per_host``); a setting from before it was
    recorded is priced as one machine of all the ranks, as its replay always was.
    """
    source = f"{setting.get('model_key')}@{setting.get('rate')}"
    rounds = [Profile.from_dict(p, source=source) for p in stored_profiles(setting)]
    measured = [r for r in setting["plans"] if r.get("measured_step_time_s") is not None]
    plans = [Plan.from_dict(r["plan_json"]) for r in measured]

    def grade(profile: Profile) -> list[dict[str, Any]]:
        out = []
        for rec, (pred, rank) in zip(measured, predict_ranked(profile, plans, tie=tie, ranks_per_host=setting.get("ranks_per_host"))):
            err = relative_error(pred.step_time_s, rec["measured_step_time_s"])
            out.append({"rank": rank, "predicted_step_time_s": pred.step_time_s, "predicted_peak_memory_bytes": pred.peak_memory_bytes,
                        "feasible": pred.feasible, "step_time_error": err, "abs_step_time_error": abs(err)})
        return out

    records = [{**rec, **new} for rec, new in zip(measured, grade(pool_profiles(rounds)))]
    replayed = {**setting, "plans": records, "summary": summarize(records)}
    if len(rounds) > 1:
        for rec, first in zip(records, grade(rounds[0])):
            rec["first_profile"] = first
        replayed["summary_first_profile"] = summarize(first_profile_view(records))
    return replayed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", help="sweep result JSON files (with stored profiles)")
    parser.add_argument("--tie", type=float, default=NEAR_TIE,
                        help=f"the planner's near-tie margin (default {NEAR_TIE}); 0 ranks by predicted time alone")
    args = parser.parse_args(argv)
    pooled: list[dict[str, Any]] = []
    rates: list[str] = []
    for path, doc in read_sweeps(args.sweeps, script="replay_sweep"):  # a stopped sweep's partial file left out
        settings = [s for s in doc["settings"] if "profile" in s and "summary" in s]
        if not settings:
            raise SystemExit(f"{path}: no setting with a stored profile and measurements; it cannot be replayed.")
        sweep_rates = doc.get("provenance", {}).get("rates") or list(dict.fromkeys(s["rate"] for s in settings))
        rates += [r for r in sweep_rates if r not in rates]
        replayed = [replay_setting(s, tie=args.tie) for s in settings]
        pooled += replayed
        summary, _ = summarize_sweep(replayed, sweep_rates)
        old = doc.get("summary", {})
        print(f"{path}: median |error| {summary['median_abs_error']:.1%} (recorded {old.get('median_abs_error', float('nan')):.1%}), "
              f"p90 {summary['p90_abs_error']:.1%} (recorded {old.get('p90_abs_error', float('nan')):.1%}), "
              f"pick within 5% {summary['pick_within_5pct_rate']:.0%} (recorded {old.get('pick_within_5pct_rate', float('nan')):.0%}) "
              f"over {summary['n_points']} runs")
    summary, _ = summarize_sweep(pooled, rates)
    print(f"all: median |error| {summary['median_abs_error']:.1%}, p90 {summary['p90_abs_error']:.1%}, "
          f"pick within 5% in {round(summary['pick_within_5pct_rate'] * summary['n_settings_done'])}/{summary['n_settings_done']} settings"
          + (f" ({confirmed_picks(summary)} with a confirmed verdict judged on the confirmation passes)" if confirmed_picks(summary) else ""))
    for key, row in summary["by_rate_and_strategy"].items():
        print(f"  {key:22s} n={row['n']:3d}  signed {row['median_signed_error']:+.1%}  |e| {row['median_abs_error']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
