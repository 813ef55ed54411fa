"""Does the cheap in-fit profile still predict the step time at micro-batch sizes it did not time?

Profiles Lightning's demo Transformer in one process exactly as ``auto_plan`` does inside ``fit``
(sizes b/4, b/2, b; one repeat; FLOPs at one size), then times hook-free forward+backward steps
at unprofiled sizes and compares them with the step fit t(m) = α·m + β (seed 000 §III-B)::

    python benchmarks/auto_plan_prediction_check.py --sizes 12 24 32

Prints one JSON line (load averages before/after included: the host is shared).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from auto_plan_overhead import OfflineTransformer  # noqa: E402

from lightning_distplan.demos import RandomTokenData  # noqa: E402
from lightning_distplan.profiling import profile_module  # noqa: E402
from lightning_distplan.strategies._auto_planning import in_fit_micro_batch_sizes  # noqa: E402


def measured_step_s(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], m: int, runs: int) -> float:
    """Median hook-free forward+backward time of ``training_step`` on ``m`` samples (one warm-up)."""
    x, y = batch[0][:m], batch[1][:m]
    times = []
    for i in range(runs + 1):
        model.zero_grad(set_to_none=True)
        a = time.perf_counter()
        loss = model.training_step((x, y), 0)
        loss.backward()
        if i:
            times.append(time.perf_counter() - a)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16, help="loader batch b (profiled: b/4, b/2, b)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[12, 24, 32], help="unprofiled sizes to check")
    parser.add_argument("--runs", type=int, default=7, help="timed steps per checked size (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="profiler repeats (auto_plan uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    torch.manual_seed(0)
    model = OfflineTransformer(1000, 128, 2)
    data = RandomTokenData(vocab_size=1000, block_size=32, batch_size=args.batch_size, num_samples=512)
    sizes = in_fit_micro_batch_sizes(args.batch_size)
    t0 = time.perf_counter()
    extra = {"flop_sizes": 1} if "flop_sizes" in inspect.signature(profile_module).parameters else {}  # older versions: 2 sizes
    profile = profile_module(model, data.train_dataloader(), micro_batch_sizes=sizes, device="cpu", repeats=args.repeats, measure_links=False, **extra)
    profiling_s = time.perf_counter() - t0
    big = max(args.sizes)
    loader = torch.utils.data.DataLoader(data.dataset, batch_size=big)
    batch = next(iter(loader))
    model.train()
    rows = []
    for m in args.sizes:
        predicted = profile.step.forward(m) + profile.step.backward(m)
        measured = measured_step_s(model, batch, m, args.runs)
        rows.append({"m": m, "predicted_s": round(predicted, 5), "measured_s": round(measured, 5), "error": round(predicted / measured - 1, 4)})
    print(json.dumps({
        "profiled_sizes": list(profile.micro_batch_sizes),
        "profiling_s": round(profiling_s, 3),
        "step_fit": {"alpha_s": profile.step.forward.alpha + profile.step.backward.alpha, "beta_s": profile.step.forward.beta + profile.step.backward.beta},
        "checks": rows,
        "threads": args.threads,
        "profiler_repeats": args.repeats,
        "loadavg_start": [round(v, 2) for v in load0],
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
