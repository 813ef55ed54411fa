"""Wall time of the CLI commands, as a user runs them (interpreter start included).

1. ``distplan profile`` of Lightning's demo Transformer on this machine (issue 2: ≤ 30 s);
2. ``distplan tune`` with 300 trials over ``alicloud-2023`` on that profile (issue 5: < 30 s);
3. ``distplan plan`` of that profile on 8 devices (no target: it imports neither torch nor lightning).

Each runs through the console script's entry point (``_distplan_cli.main``, what ``distplan`` calls).

Run:  python benchmarks/cli_timings.py   ->  benchmarks/results/cli_timings_<device>.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISTPLAN = [sys.executable, "-c", "import sys, _distplan_cli; sys.exit(_distplan_cli.main())"]


def _run(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(DISTPLAN + args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"distplan {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return wall, done.stdout


def main() -> int:
    load_start = list(os.getloadavg())
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
    import torch

    result = {
        "benchmark": "cli_timings",
        "command": "python benchmarks/cli_timings.py",
        "entry_point": "_distplan_cli.main (the distplan console script)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": doc["device"],
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "load_average_at_start": load_start,
        "load_average_at_end": list(os.getloadavg()),
        "profile": {
            "wall_s": round(profile_wall, 2),
            "profiling_time_s_reported": float(reported.group(1)) if reported else doc.get("profiling_time_s"),
            "micro_batch_sizes": doc["micro_batch_sizes"],
            "step_fit_r2": {"forward": doc["step"]["forward"]["r2"], "backward": doc["step"]["backward"]["r2"]},
            "target_s": 30.0,
        },
        "tune_300_trials": {"wall_s": round(tune_wall, 2), "target_s": 30.0},
        "plan_8_devices": {"wall_s": round(plan_wall, 2)},
    }
    device = doc["device"]["type"]
    out_path = ROOT / "benchmarks" / "results" / f"cli_timings_{device}.json"
    out_path.write_text(json.dumps(result, indent=2))
    print(f"distplan profile: {profile_wall:.1f} s wall (profiling {result['profile']['profiling_time_s_reported']} s); "
          f"distplan tune 300 trials: {tune_wall:.1f} s wall; distplan plan: {plan_wall:.1f} s wall -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
