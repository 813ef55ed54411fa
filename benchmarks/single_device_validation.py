"""Single-device validation: predicted vs measured optimizer-step time at UNPROFILED settings.

For each model it profiles with ``distplan``'s profiler at the default micro-batch sizes, then
trains with a real Lightning ``Trainer`` (strategy ``dp_ga`` on one device) at three micro-batch
sizes that were NOT profiled × two accumulation settings, measures the median time per optimizer
step, and prints it beside the cost model's prediction for the same ``Plan``.

Acceptance (issue 2): the median |error| over the 12 points (2 models × 3 sizes × 2 accumulations)
is ≤ 15%.

Run:  .venv/bin/python benchmarks/single_device_validation.py [--device cpu|cuda] [--out FILE]
Result: benchmarks/results/single_device_validation_<device>.json (provenance included), the committed result the
README's table reads (it says so before replacing it; ``--out FILE`` writes elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.transformer import LightningTransformer

import lightning_distplan
from lightning_distplan.costmodel import Hardware, predict
from lightning_distplan.demos import RandomImageData, RandomTokenData, TorchvisionClassifier
from lightning_distplan.plan import Plan
from lightning_distplan.profiling import StepTimer, profile_module
from lightning_distplan.strategies import DPGAStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import positive_ints, result_path, write_result  # noqa: E402


class OfflineTransformer(LightningTransformer):
    """Lightning's demo Transformer unchanged, minus the WikiText2 download in ``prepare_data`` (no internet)."""

    def prepare_data(self) -> None:
        pass


MODELS = ("demo_transformer", "resnet18")


def _model(name: str):
    if name == "demo_transformer":
        return OfflineTransformer(), lambda m, n: RandomTokenData(batch_size=m, num_samples=n)
    if name == "resnet18":
        return TorchvisionClassifier("resnet18", num_classes=100), lambda m, n: RandomImageData(
            num_classes=100, image_size=64, batch_size=m, num_samples=n
        )
    raise ValueError(name)


def _measure(name: str, m: int, s: int, steps: int, warmup: int, accelerator: str) -> float:
    torch.manual_seed(0)
    model, data = _model(name)
    dm = data(m, m * s * (steps + warmup))
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=DPGAStrategy(plan=Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)),
        max_steps=steps + warmup,
        accumulate_grad_batches=s,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=dm)
    return statistics.median(timer.step_times[warmup:])


def _unprofiled_sizes(profiled: list[int]) -> list[int]:
    """Three sizes between/around the profiled ones that were not profiled themselves."""
    candidates = []
    for a, b in zip(profiled, profiled[1:]):
        mid = (a + b) // 2
        if mid not in profiled and mid > 0:
            candidates.append(mid)
    candidates = sorted(set(candidates))
    step = 1
    while len(candidates) < 3:  # then just past the largest profiled size (1.5x, 2x, ...)
        candidates.append(profiled[-1] + max(1, profiled[-1] // 2) * step)
        step += 1
    # spread: smallest, middle, largest
    return [candidates[0], candidates[len(candidates) // 2], candidates[-1]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--models", default="demo_transformer,resnet18", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--accumulations", type=positive_ints, default=[1, 4], help="comma-separated, e.g. 1,4")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (profiling and training alike); 1 keeps timings stable on a shared host")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/single_device_validation_<device>.json, the committed result)")
    args = parser.parse_args()
    unknown = [n for n in args.models.split(",") if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    out = result_path(args.out, Path(__file__).parent / "results" / f"single_device_validation_{device}.json", script="single_device_validation")
    accelerator = "gpu" if device == "cuda" else "cpu"
    if device == "cpu":
        # Lightning's DDP-family strategies call torch.set_num_threads(cpu_count // processes) unless
        # OMP_NUM_THREADS is set; pin it so profiling and training use the same thread count.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    accumulations = args.accumulations

    load_at_start = list(os.getloadavg())
    rows = []
    profiles = {}
    for name in args.models.split(","):
        model, data = _model(name)
        dm = data(8, 256)
        dm.setup("fit")
        t0 = time.perf_counter()
        profile = profile_module(model, dm.train_dataloader(), device=device, progress=lambda msg: print(f"  [{name}] {msg}", flush=True))
        took = time.perf_counter() - t0
        profiled = sorted(profile.micro_batch_sizes)
        profiles[name] = {"micro_batch_sizes": profiled, "profiling_time_s": took,
                          "step_fit_r2": {"forward": profile.step.forward.r2, "backward": profile.step.backward.r2}}
        hardware = Hardware.from_profile(profile)
        print(f"{name}: profiled m={profiled} in {took:.1f}s (fit R² fwd {profile.step.forward.r2:.3f}, bwd {profile.step.backward.r2:.3f})", flush=True)
        for m in _unprofiled_sizes(profiled):
            for s in accumulations:
                plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
                predicted = predict(profile, plan, hardware).step_time_s
                measured = _measure(name, m, s, args.steps, args.warmup, accelerator)
                error = (predicted - measured) / measured
                rows.append({"model": name, "micro_batch_size": m, "accumulate_grad_batches": s,
                             "predicted_step_time_s": predicted, "measured_step_time_s": measured, "error": error})
                print(f"  m={m:3d} s={s}  predicted {predicted*1e3:8.1f} ms   measured {measured*1e3:8.1f} ms   error {error:+6.1%}", flush=True)

    abs_errors = [abs(r["error"]) for r in rows]
    median = statistics.median(abs_errors)
    result = {
        "benchmark": "single_device_validation",
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_at_start,
        "load_average_at_end": list(os.getloadavg()),
        "device": {"type": device, "name": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine(),
                   "torch_threads": torch.get_num_threads()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "lightning": L.__version__,
                     "lightning_distplan": lightning_distplan.__version__},
        "steps": args.steps, "warmup": args.warmup,
        "profiles": profiles,
        "points": rows,
        "median_abs_error": median,
        "max_abs_error": max(abs_errors),
        "target_median_abs_error": 0.15,
        "passed": median <= 0.15,
    }
    write_result(out, result, indent=2)
    print(f"\nmedian |error| over {len(rows)} points: {median:.1%} (max {max(abs_errors):.1%}); target ≤ 15% -> {'PASS' if median <= 0.15 else 'FAIL'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
