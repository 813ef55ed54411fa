"""Optuna's search vs the exhaustive optimum of the same space (the tuner's acceptance benchmark).

For every time weight w of seed 000 §IV-D the script prices the whole space (instance type ×
count × every plan that factors the global batch) with the cost model, then runs
:func:`lightning_distplan.tuner.tune` with a trial budget of ``--budget-fraction`` of the space
for several seeds, and records how far each search's best C + w·T is from the exhaustive optimum.
It also times a default 300-trial search (the ``distplan tune`` acceptance: < 30 s on CPU).

    python benchmarks/tuner_vs_exhaustive.py --profile P --out benchmarks/results/tuner_vs_exhaustive.json

Without ``--profile`` it uses benchmarks/results/tuner_vs_exhaustive_profile.json (committed next
to the result so the run can be repeated). Without ``--out`` it writes benchmarks/results/tuner_vs_exhaustive.json,
the committed result the README's table reads, and says so before it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PROFILE = HERE / "results" / "tuner_vs_exhaustive_profile.json"
sys.path.insert(0, str(HERE))
from _results import result_path, write_result  # noqa: E402


def _versions() -> dict[str, str]:
    import optuna

    out = {"python": platform.python_version(), "optuna": optuna.__version__}
    try:
        out["lightning_distplan_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["lightning_distplan_commit"] = "unknown"
    return out


def main(argv: list[str] | None = None) -> int:
    from lightning_distplan.errors import DistPlanError

    try:
        with tempfile.TemporaryDirectory(prefix="distplan-bench-") as tmp:  # the searches' SQLite studies, gone afterwards
            return _main(argv, tmp)
    except DistPlanError as err:  # a bad profile, catalog or batch: its sentence and HINT, not a traceback
        raise SystemExit(f"tuner_vs_exhaustive: {err}") from None


def _main(argv: list[str] | None, tmp: str) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--catalog", default="alicloud-2023")
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--max-instances", type=int, default=32)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 2.0**8, 2.0**12, 2.0**16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--budget-fraction", type=float, default=0.10)
    parser.add_argument("--tolerance-pct", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/tuner_vs_exhaustive.json, the committed result)")
    args = parser.parse_args(argv)
    args.out = result_path(args.out, HERE / "results" / "tuner_vs_exhaustive.json", script="tuner_vs_exhaustive")

    from lightning_distplan.profile import Profile
    from lightning_distplan.tuner import exhaustive, load_catalog, tune

    profile = Profile.load(args.profile)
    catalog = load_catalog(args.catalog)
    runs = []
    for w in args.weights:
        ex = exhaustive(profile, catalog, global_batch_size=args.global_batch_size, time_weight=w, max_instances=args.max_instances)
        space = ex.n_evaluations
        budget = int(args.budget_fraction * space)
        entry = {
            "time_weight": w,
            "space_size": space,
            "space_feasible": ex.n_feasible,
            "exhaustive_s": round(ex.elapsed_s, 3),
            "optimum": ex.best.to_dict(),
            "trial_budget": budget,
            # True when the optimum is one of the corner trials tune() starts from (2 per instance type):
            # then the initial design, not the sampler, found it.
            "optimum_in_initial_design": ex.best.count in (1, args.max_instances) and ex.best.plan.strategy == "dp_ga"
            and ex.best.plan.micro_batch_size in ((args.global_batch_size if ex.best.count == 1 else 1),),
            "searches": [],
        }
        for seed in args.seeds:
            url = f"sqlite:///{tmp}/w{w:g}-s{seed}.db"
            r = tune(profile, catalog=catalog, global_batch_size=args.global_batch_size, time_weight=w, n_trials=budget, storage=url,
                     study_name="bench", seed=seed, max_instances=args.max_instances, progress=False)
            gap = 100.0 * (r.best.objective / ex.best.objective - 1.0)
            entry["searches"].append(
                {
                    "seed": seed,
                    "trials": r.n_trials,
                    "distinct_configurations_evaluated": r.n_evaluations,
                    "trials_pct_of_space": round(100.0 * r.n_trials / space, 2),
                    "evaluations_pct_of_space": round(100.0 * r.n_evaluations / space, 2),
                    "best_objective": r.best.objective,
                    "gap_pct": round(gap, 4),
                    "within_tolerance": gap <= args.tolerance_pct,
                    "elapsed_s": round(r.elapsed_s, 2),
                    "best": {k: r.best.to_dict()[k] for k in ("instance_type", "count", "strategy", "dp", "pp", "micro_batch_size", "accumulation")},
                }
            )
            print(f"w={w:g} seed={seed}: gap {gap:.3f}% with {r.n_trials} trials / {r.n_evaluations} evaluations of {space}", flush=True)
        runs.append(entry)

    # The CLI acceptance: 300 trials with the defaults, timed in-process (import time excluded, reported separately).
    t0 = time.perf_counter()
    r300 = tune(profile, catalog=catalog, global_batch_size=args.global_batch_size, time_weight=4096, n_trials=300,
                storage=f"sqlite:///{tmp}/t300.db", study_name="t300", max_instances=8, progress=False)
    t300 = time.perf_counter() - t0

    searches = [s for run in runs for s in run["searches"]]
    result = {
        "benchmark": "tuner_vs_exhaustive",
        "question": f"Is Optuna's best C + w*T within {args.tolerance_pct}% of the exhaustive optimum using <= {100 * args.budget_fraction:g}% of the space as trials?",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "note": "shared 2-core VM; other jobs were running, so wall times are upper bounds"},
        "profile": {"path": os.path.relpath(args.profile, HERE.parent) if Path(args.profile).is_absolute() else args.profile,
                    "model": profile.model, "device": profile.device.name, "device_type": profile.device.type, "layers": len(profile.layers)},
        "catalog": catalog.name,
        "global_batch_size": args.global_batch_size,
        "max_instances": args.max_instances,
        "sampler": "TPESampler(seed) default settings after a deterministic initial design of 2 corner trials per instance type (tune(initial_design=True)); trial params: instance_type, n_instances (log), strategy, pp (log), micro_batch_size (log), mapped to the nearest valid plan",
        "runs": runs,
        "summary": {
            "searches": len(searches),
            "within_tolerance": sum(s["within_tolerance"] for s in searches),
            "worst_gap_pct": max(s["gap_pct"] for s in searches),
            "max_trials_pct_of_space": max(s["trials_pct_of_space"] for s in searches),
            "max_evaluations_pct_of_space": max(s["evaluations_pct_of_space"] for s in searches),
        },
        "tune_300_trials": {"elapsed_s_in_process": round(t300, 2), "space_size": r300.space_size, "n_evaluations": r300.n_evaluations,
                            "note": "tune() wall time incl. projection, 300 TPE trials and the SQLite write; excludes interpreter + package import"},
    }
    write_result(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"300-trial tune: {t300:.2f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
