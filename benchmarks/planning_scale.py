"""How long planning takes for deep models on many devices (``planner.rank_plans``, every plan priced).

Hand-built profiles (``costmodel.synthetic_profile``: stated layer fits, no measurement) of 32 to
96 layers, planned for 16 to 128 devices; each pipeline plan's step is simulated stage by stage
(``costmodel._schedule``), which is what grows with stages × micro-batches. Each case is planned
twice: links as over gloo (one TCP stream per pair: 1F1B takes the event queue) and as over NCCL.

Run:  python benchmarks/planning_scale.py [--out FILE]   ->  benchmarks/results/planning_scale_cpu.json
(the committed result the README's table reads; it says so before replacing it)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import result_path, shown, write_result  # noqa: E402
from lightning_distplan.costmodel import Hardware  # noqa: E402
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile  # noqa: E402
from lightning_distplan.planner import rank_plans  # noqa: E402

CASES = [(32, 16, 256), (64, 64, 512), (96, 128, 1024), (96, 64, 2048)]  # layers, devices, global batch
RESULT = ROOT / "benchmarks" / "results" / "planning_scale_cpu.json"


def _profile(n_layers: int):
    # three kinds of layer in turn, so that stages differ and the split has work to do
    layers = [
        LayerSpec(
            fwd_alpha=1e-3 * (1 + i % 3), fwd_beta=1e-4, bwd_alpha=2e-3 * (1 + i % 3), bwd_beta=1e-4,
            param_bytes=4 << 20, activation_bytes_per_sample=1e6, output_bytes_per_sample=1e5,
        )
        for i in range(n_layers)
    ]
    return synthetic_profile(layers, micro_batch_sizes=(1, 2, 4, 8, 16), device_memory_bytes=80 << 30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"result JSON (default {shown(RESULT)}, the committed result)")
    args = parser.parse_args(argv)
    out = result_path(args.out, RESULT, script="planning_scale")
    load_start = list(os.getloadavg())
    cases = []
    for n_layers, world, batch in CASES:
        profile = _profile(n_layers)
        base = Hardware.from_profile(profile, warn_default_links=False)
        for link, one_stream in (("gloo", True), ("nccl", False)):
            hw = dataclasses.replace(base, p2p_one_stream=one_stream)
            t0 = time.perf_counter()
            ranked = rank_plans(profile, world_size=world, global_batch_size=batch, hardware=hw)
            wall = time.perf_counter() - t0
            pipelines = [c for c in ranked if c.plan.pp > 1]
            case = {
                "layers": n_layers, "world_size": world, "global_batch_size": batch, "links": link,
                "plans": len(ranked), "pipeline_plans": len(pipelines),
                "largest_schedule": max((f"{c.plan.pp} stages × {c.plan.n_microbatches} micro-batches" for c in pipelines), default=None,
                                        key=lambda s: int(s.split()[0]) * int(s.split()[3])),
                "wall_s": round(wall, 3), "best": ranked[0].plan.describe(),
            }
            cases.append(case)
            print(f"{n_layers} layers, {world} devices, B={batch}, {link}: {len(ranked)} plans in {wall:.2f} s; best {case['best']}", flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "benchmark": "planning_scale",
        "command": shlex.join(["python", "benchmarks/planning_scale.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": "cpu", "what": "planning runs on the host CPU (one thread, pure Python)"},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "versions": {"python": platform.python_version()},
        "load_average_at_start": load_start,
        "load_average_at_end": list(os.getloadavg()),
        "cases": cases,
        "max_wall_s": max(c["wall_s"] for c in cases),
    }
    write_result(out, result, indent=2)
    print(f"slowest: {result['max_wall_s']:.2f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
