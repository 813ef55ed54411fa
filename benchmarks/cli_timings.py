"""Wall time of the CLI commands, as a user runs them (interpreter start included).

1. ``distplan profile`` of Lightning's demo Transformer on this machine (issue 2: ≤ 30 s);
2. ``distplan tune`` with 300 trials over ``alicloud-2023`` on that profile (issue 5: < 30 s);
3. ``distplan plan`` of that profile on 8 devices (no target: it imports neither torch nor lightning).

Each runs through the console script's entry point (``_distplan_cli.main``, what ``distplan`` calls).

Each command runs ``--runs`` times (default 3; a shared host varies by a third from one run to the
next: 25.7 s, then 18.7 s for the same profile on an idle machine); the JSON keeps every run and
the README shows the median and the range.

Run:  python benchmarks/cli_timings.py [--runs 3] [--out FILE]   ->  benchmarks/results/cli_timings_<device>.json
(the committed result the README's table reads; it says so before replacing it)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import result_path, write_result  # noqa: E402

DISTPLAN = [sys.executable, "-c", "import sys, _distplan_cli; sys.exit(_distplan_cli.main())"]


def _run(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(DISTPLAN + args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"distplan {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return wall, done.stdout


def _once() -> tuple[dict[str, float], dict]:
    """One run of the three commands: their wall times (and the profiling time the profile command reports), the profile."""
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        profile_wall, out = _run([
            "profile", "lightning.pytorch.demos.transformer:LightningTransformer",
            "--datamodule", "lightning_distplan.demos:RandomTokenData", "--out", str(profile),
        ])
        reported = re.search(r"profiling ([0-9.]+) s", out)
        doc = json.loads(profile.read_text())
        tune_wall, _ = _run([
            "tune", "--profile", str(profile), "--catalog", "alicloud-2023", "--global-batch-size", "256",
            "--time-weight", "4096", "--trials", "300", "--storage", f"sqlite:///{tmp}/tune.db",
            "--study-name", "timing", "--format", "json", "--no-progress",
        ])
        plan_wall, _ = _run(["plan", "--profile", str(profile), "--world-size", "8", "--global-batch-size", "256", "--format", "json"])
    profiling = float(reported.group(1)) if reported else doc.get("profiling_time_s")
    return {"profile": profile_wall, "profiling": profiling, "tune": tune_wall, "plan": plan_wall}, doc


def _stats(values: list[float]) -> dict[str, Any]:
    return {"runs_s": [round(v, 2) for v in values], "median_s": round(statistics.median(values), 2),
            "min_s": round(min(values), 2), "max_s": round(max(values), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Wall time of distplan profile / tune / plan.")
    parser.add_argument("--runs", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/cli_timings_<device>.json, the committed result)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"cli_timings: --runs must be >= 1, got {args.runs}. HINT: use e.g. --runs 3.")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where distplan profile profiles (CUDA when present)
    out_path = result_path(args.out, ROOT / "benchmarks" / "results" / f"cli_timings_{device}.json", script="cli_timings")
    load_start = list(os.getloadavg())
    runs = []
    for i in range(args.runs):
        walls, doc = _once()
        runs.append(walls)
        print(f"run {i + 1}/{args.runs}: profile {walls['profile']:.1f} s (profiling {walls['profiling']} s), "
              f"tune {walls['tune']:.1f} s, plan {walls['plan']:.1f} s", flush=True)
    column = {key: [r[key] for r in runs] for key in runs[0]}

    result = {
        "benchmark": "cli_timings",
        "command": shlex.join(["python", "benchmarks/cli_timings.py", *(sys.argv[1:] if argv is None else argv)]),
        "entry_point": "_distplan_cli.main (the distplan console script)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": doc["device"],
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "load_average_at_start": load_start,
        "load_average_at_end": list(os.getloadavg()),
        "runs": args.runs,
        "profile": {
            "wall_s": round(statistics.median(column["profile"]), 2),
            **_stats(column["profile"]),
            "profiling_time_s_reported": round(statistics.median(column["profiling"]), 2),
            "profiling_runs_s": column["profiling"],
            "micro_batch_sizes": doc["micro_batch_sizes"],
            "step_fit_r2": {"forward": doc["step"]["forward"]["r2"], "backward": doc["step"]["backward"]["r2"]},
            "target_s": 30.0,
        },
        "tune_300_trials": {"wall_s": round(statistics.median(column["tune"]), 2), **_stats(column["tune"]), "target_s": 30.0},
        "plan_8_devices": {"wall_s": round(statistics.median(column["plan"]), 2), **_stats(column["plan"])},
    }
    write_result(out_path, result, indent=2)
    print(f"medians of {args.runs}: distplan profile {result['profile']['wall_s']:.1f} s wall (profiling "
          f"{result['profile']['profiling_time_s_reported']} s); distplan tune 300 trials {result['tune_300_trials']['wall_s']:.1f} s; "
          f"distplan plan {result['plan_8_devices']['wall_s']:.1f} s -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
