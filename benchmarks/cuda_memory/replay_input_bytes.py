"""Replay committed GPU runs with the micro-batch's input counted in the profile (no GPU needed).

Until 2026-11-24 the profiler measured a micro-batch's CUDA working set as the step's peak less what
was allocated before the step, and the micro-batch itself was among the latter (the profiler keeps
it on the device between runs), while a fit copies every micro-batch to the device anew. Today the
profiler counts it. This script adds exactly that (the bytes of one collated sample of each
benchmark model's data, as ``device_bytes`` counts them) to each stored profile's per-sample
activation slope, predicts every measured point again and sets old and new errors side by side.
A replay, not a measurement: the measured peaks are the committed ones.

Run from the repository root:
``python benchmarks/cuda_memory/replay_input_bytes.py [--out FILE]`` (writes
``benchmarks/results/cuda_memory_replay_input_bytes_h100.json``, the committed result, and says so first).
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_validation as gv  # noqa: E402
from _results import result_path, shown, write_result  # noqa: E402
from lightning_distplan.costmodel import Hardware, predict  # noqa: E402
from lightning_distplan.plan import Plan  # noqa: E402
from lightning_distplan.profile import Profile  # noqa: E402
from lightning_distplan.profiling._batches import device_bytes  # noqa: E402

RUNS = ["benchmarks/results/gpu_validation_nvidia_h100_80gb_hbm3.json",
        "benchmarks/results/earlier/gpu_validation_nvidia_h100_80gb_hbm3_two_gradient_sets.json"]
OUT = ROOT / "benchmarks/results/cuda_memory_replay_input_bytes_h100.json"


def input_bytes_per_sample(name: str) -> float:
    """Bytes one collated sample of the benchmark's data holds (as on the device after the copy)."""
    data = gv.MODELS[name](False).make_base(4)
    return device_bytes(default_collate([data[i] for i in range(4)]), torch.device("cpu")) / 4


def with_input(profile: Profile, per_sample: float) -> Profile:
    act = profile.memory.activation
    return dataclasses.replace(profile, memory=dataclasses.replace(profile.memory, activation=dataclasses.replace(act, alpha=act.alpha + per_sample)))


def replay(path: str) -> dict:
    run = json.loads((ROOT / path).read_text())
    rows = []
    for name, model in run["models"].items():
        per = input_bytes_per_sample(name)
        old_profile = Profile.from_dict(model["profile"])
        new_profile = with_input(old_profile, per)
        for point in model.get("points", []):
            if point.get("error_message") or not point.get("measured_peak_memory_bytes"):
                continue  # ran out of memory: no peak to compare
            m, s = point["micro_batch_size"], point["accumulate_grad_batches"]
            plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
            measured = point["measured_peak_memory_bytes"]
            old = predict(old_profile, plan, Hardware.from_profile(old_profile, warn_default_links=False)).peak_memory_bytes
            new = predict(new_profile, plan, Hardware.from_profile(new_profile, warn_default_links=False)).peak_memory_bytes
            rows.append({"model": name, "micro_batch_size": m, "accumulate_grad_batches": s, "input_bytes_per_sample": per,
                         "measured_peak_memory_bytes": measured, "predicted_before": old, "predicted_with_input": new,
                         "error_before": (old - measured) / measured, "error_with_input": (new - measured) / measured})

    def stats(key: str) -> dict:
        errors = [abs(r[key]) for r in rows]
        return {"median_abs": statistics.median(errors), "max_abs": max(errors), "within_5pct": sum(e <= 0.05 for e in errors), "points": len(errors)}

    return {"run": path, "run_date": run.get("date"), "device": run.get("device", {}).get("name"),
            "before": stats("error_before"), "with_input": stats("error_with_input"), "points": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/cuda_memory_replay_input_bytes_h100.json, the committed result)")
    args = parser.parse_args(argv)
    out = result_path(args.out, OUT, script="replay_input_bytes")
    result = {"benchmark": "replay_input_bytes", "command": shlex.join(["python", "benchmarks/cuda_memory/replay_input_bytes.py", *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.date.today().isoformat(), "what": __doc__.split("\n\n")[0], "replays": [replay(p) for p in RUNS]}
    write_result(out, result)
    for r in result["replays"]:
        print(f"{r['run']}: before {r['before']}, with input {r['with_input']}")
        for p in r["points"]:
            if abs(p["error_before"]) > 0.045 or abs(p["error_with_input"]) > 0.045:
                print(f"   {p['model']} m={p['micro_batch_size']} s={p['accumulate_grad_batches']}: "
                      f"{p['error_before']:+.2%} -> {p['error_with_input']:+.2%}")
    print("wrote", shown(out))


if __name__ == "__main__":
    main()
