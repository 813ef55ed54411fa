"""The noise and profile figures the README quotes for CPU cluster sweeps, read from their result files.

For the given sweeps, pooled, this prints:

* the spread of each plan's pass medians (largest over smallest): median, p90 and the largest,
  with the plan it came from;
* the range of timed steps per pass;
* the pipelining runtime's profiled slot cost over every stored profile: range and median;
* the host checks (the profiled step timed again after each pass, as a ratio of the profile).

The errors and picks come from ``benchmarks/readme_table.py`` and ``benchmarks/replay_sweep.py``.

Run:  python benchmarks/sweep_stats.py benchmarks/results/cpu_cluster_sweep*.json

(a stopped sweep's ``.partial.json`` beside them is left out, and named).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import read_sweeps  # noqa: E402


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def sweep_stats(docs: list[dict]) -> dict:
    """Pass-median spreads, timed steps, slot costs and host checks over the settings of ``docs``."""
    spreads: list[tuple[float, str]] = []
    steps: list[int] = []
    slots: list[float] = []
    hosts: list[float] = []
    for run, doc in enumerate(docs, 1):
        for setting in doc["settings"]:
            for rec in setting.get("plans", []):
                medians = [t for t in rec.get("measured_pass_step_times_s") or [] if t]
                if len(medians) > 1:
                    where = f"run {run}, {setting['model_key']} @ {setting['rate']}, {rec['plan']}"
                    spreads.append((max(medians) / min(medians), where))
                if rec.get("timed_steps_per_pass"):
                    steps.append(rec["timed_steps_per_pass"])
            if "profile" in setting or "profiles" in setting:
                for profile in setting.get("profiles") or [setting["profile"]]:
                    slot = profile["framework"].get("pipeline_slot_s")
                    if slot is not None:
                        slots.append(slot)
            hosts += [check["ratio"] for check in setting.get("host_checks", [])]
    ratios = [r for r, _ in spreads]
    return {
        "spread_median": statistics.median(ratios), "spread_p90": p90(ratios), "spread_max": max(spreads),
        "timed_steps": (min(steps), max(steps)) if steps else None,
        "slot_s": (min(slots), statistics.median(slots), max(slots), len(slots)) if slots else None,
        "host_checks": (min(hosts), max(hosts)) if hosts else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep result JSON files")
    args = parser.parse_args(argv)
    s = sweep_stats([doc for _, doc in read_sweeps(args.sweeps, script="sweep_stats")])
    worst, where = s["spread_max"]
    print(f"pass-median spread: median {s['spread_median']:.2f}x, p90 {s['spread_p90']:.2f}x, largest {worst:.2f}x ({where})")
    if s["timed_steps"]:
        print(f"timed steps per pass: {s['timed_steps'][0]}-{s['timed_steps'][1]}")
    if s["slot_s"]:
        lo, mid, hi, n = s["slot_s"]
        print(f"pipeline slot: {lo * 1e3:.2f}-{hi * 1e3:.2f} ms, median {mid * 1e3:.2f} ms over {n} profiles")
    if s["host_checks"]:
        print(f"host checks: {s['host_checks'][0]:.2f}x-{s['host_checks'][1]:.2f}x the profile's step time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
