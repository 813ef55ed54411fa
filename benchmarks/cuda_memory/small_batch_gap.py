"""Why does ResNet-101's dp_ga fit peak ~0.2 GB above the cost model at small micro-batches? (a diagnostic)

Written 2026-11-24 and NOT RUN YET (no GPU was lent that session). The committed single-GPU run
(``../results/gpu_validation_nvidia_h100_80gb_hbm3.json``) predicts ResNet-101 0.04-0.27 GB under
the measured peak at m <= 96 (m = 24, s = 1: -5.0% in every run); the micro-batch's own input,
which the profiler counts since that day, is 14 MB of it at m = 24 (``replay_input_bytes.py``).
The rest is close to one gradient size (0.18 GB), as if DDP's first bucket set were still alive at
the peak. This script, each part in a forked process of its own as ``gpu_validation.py`` runs them:

1. profiles ResNet-101 as ``gpu_validation.py`` does (sizes 16, 32, 64, 128: the profile the
   predictions come from) and once more with 24 and 48 among the sizes, so the profiler's own peak
   at an unprofiled size is measured, not interpolated;
2. fits ``dp_ga`` plans (and the same micro-batch with Lightning's single-device strategy, no DDP)
   with the caching allocator's trace on, and records per optimizer step the peak, the bytes
   allocated when the step began, and at the whole fit's peak what was alive, grouped by the
   Python line that allocated it (``torch.cuda.memory._record_memory_history``, a private API).

Run from the repository root on a CUDA machine:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/small_batch_gap.py`` (output: $OUT/small_batch_gap.json,
else /tmp); about 3 minutes expected on an H100.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("small_batch_gap.py needs a CUDA GPU, and torch sees none here. HINT: run it on a machine with an NVIDIA GPU (benchmarks/cuda_memory/README.md); replay_input_bytes.py is the one that needs none.")
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import gpu_validation as gv  # noqa: E402
from lightning_distplan.bench._runner import build_strategy, settle_cuda_memory  # noqa: E402
from lightning_distplan.costmodel import Hardware, predict  # noqa: E402
from lightning_distplan.plan import Plan  # noqa: E402
from lightning_distplan.profile import Profile  # noqa: E402
from lightning_distplan.profiling import profile_module  # noqa: E402
from lightning_distplan.profiling._overhead import QUIET_FIT  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
GB = 1e9
NAME = "resnet101"
STEPS = 6


def _profile(sizes: list[int] | None) -> dict:
    spec = gv.MODELS[NAME](False)
    module = gv._seeded(spec.make_module)()
    loader = gv._loader_factory(spec, "cuda", 8)(spec.loader_batch)
    loader.dataset.length = 1 << 20
    profile = profile_module(module, loader, device="cuda", micro_batch_sizes=sizes, progress=lambda msg: None)
    mem = profile.memory
    return {"sizes": sizes, "profile": profile.to_dict(), "measured_peak_gb": {m: p / GB for m, p in mem.measured_peak_bytes.items()},
            "line_gb": {m: (mem.param_bytes + mem.optimizer_state_bytes + mem.activation(m)) / GB for m in mem.measured_peak_bytes},
            "cudnn_benchmark": torch.backends.cudnn.benchmark}


class Steps(Callback):
    """Per optimizer step: bytes allocated when its first micro-batch began, and its peak."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def _close(self) -> None:
        torch.cuda.synchronize()
        self.rows[-1].update(peak_gb=torch.cuda.max_memory_allocated() / GB, allocated_at_end_gb=torch.cuda.memory_allocated() / GB)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.rows and self.rows[-1]["global_step"] == trainer.global_step:
            return  # another micro-batch of the same optimizer step
        if self.rows:
            self._close()
        torch.cuda.synchronize()
        self.rows.append({"global_step": trainer.global_step, "allocated_at_start_gb": torch.cuda.memory_allocated() / GB})
        torch.cuda.reset_peak_memory_stats()

    def on_before_backward(self, trainer, module, loss):
        self.rows[-1].setdefault("allocated_before_first_backward_gb", torch.cuda.memory_allocated() / GB)

    def on_train_end(self, trainer, module):
        self._close()


def category(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        fn, name, line = f.get("filename", ""), f.get("name", ""), f.get("line", 0)
        if "torch/optim" in fn:
            return "optimizer"
        if "nn/parallel/distributed" in fn:
            return f"ddp:{name}:{line}"
        if "autograd/__init__" in fn or "autograd/graph" in fn or ("_tensor.py" in fn and name == "backward"):
            return "backward"
        if "torchvision/" in fn:
            return "forward:" + fn.split("torchvision/")[-1] + f":{name}"
        if "lightning_distplan" in fn:
            return f"ours:{os.path.basename(fn)}:{name}:{line}"
        if "lightning/" in fn and "torch/" not in fn:
            return f"lightning:{os.path.basename(fn)}:{name}:{line}"
    return "other:" + "|".join(f"{os.path.basename(f.get('filename', ''))}:{f.get('name', '')}:{f.get('line', 0)}" for f in frames[:3])


def peak_composition(trace: list[dict]) -> dict:
    """Replay the trace: the peak of live bytes, and what was alive there (by allocating line)."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = peak_i = 0
    at_peak: dict = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, peak_i = total, i
                at_peak = dict(live)
        elif e["action"] == "free_requested":
            got = live.pop(e["addr"], None)
            if got:
                total -= got[0]
    by = collections.Counter()
    count = collections.Counter()
    for size, frames in at_peak.values():
        c = category(frames)
        by[c] += size
        count[c] += 1
    coarse = collections.Counter()
    for c, v in by.items():
        coarse[c.split(":")[0]] += v
    return {"replayed_peak_gb": peak / GB, "event_index": peak_i, "events": len(trace),
            "coarse_gb": {k: round(v / GB, 4) for k, v in coarse.most_common()},
            "top_gb": {f"{k} (x{count[k]})": round(v / GB, 4) for k, v in by.most_common(16)}}


def _fit(m: int, s: int, strategy: str) -> dict:
    spec = gv.MODELS[NAME](False)
    make_loader = gv._loader_factory(spec, "cuda", STEPS * s)
    settle_cuda_memory(torch.device("cuda", 0))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
    steps = Steps()
    kwargs = {"strategy": build_strategy(plan)} if strategy == "dp_ga" else {"strategy": "auto", "accumulate_grad_batches": s}
    module = gv._seeded(spec.make_module)()
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=STEPS, max_epochs=-1, callbacks=[steps], **QUIET_FIT, **kwargs)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=make_loader(m * s if strategy == "dp_ga" else m))  # dp_ga splits the loader's batch
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    comp = peak_composition(snap["device_traces"][0])
    del module, trainer
    gc.collect()
    return {"m": m, "s": s, "strategy": strategy, "fit_s": round(time.perf_counter() - t0, 2),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "steps": steps.rows,
            "last_step_peak_gb": steps.rows[-1].get("peak_gb"), "composition": comp, "whole_fit_peak_gb": max(r.get("peak_gb", 0.0) for r in steps.rows)}


def main() -> None:
    torch.set_float32_matmul_precision("high")
    gv._quiet_lightning()
    out: dict = {"script": "benchmarks/cuda_memory/small_batch_gap.py", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}

    def save() -> None:
        with open(os.path.join(OUT, "small_batch_gap.json"), "w") as f:
            json.dump(out, f, indent=1)

    base = gv.isolated("fork", _profile, None)
    extra = gv.isolated("fork", _profile, [16, 24, 32, 48, 64, 128])
    out["profiles"] = {"default": base, "with_24_48": extra}
    print("profile default sizes: peaks", json.dumps(base["measured_peak_gb"]), "line", json.dumps(base["line_gb"]), flush=True)
    print("profile with 24, 48: peaks", json.dumps(extra["measured_peak_gb"]), "line", json.dumps(extra["line_gb"]), flush=True)
    save()
    profile = Profile.from_dict(base["profile"])
    hw = Hardware.from_profile(profile)
    out["fits"] = []
    for m, s, strat in [(24, 1, "dp_ga"), (24, 1, "single"), (48, 1, "dp_ga"), (48, 1, "single"), (24, 4, "dp_ga"), (192, 1, "dp_ga")]:
        try:
            got = gv.isolated("fork", _fit, m, s, strat)
        except RuntimeError as err:
            got = {"m": m, "s": s, "strategy": strat, "error": str(err)}
        plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
        pred = predict(profile, plan, hw)
        got["predicted_gb"] = pred.peak_memory_bytes / GB
        got["predicted_breakdown_gb"] = {k: round(v / GB, 4) for k, v in pred.memory_breakdown.items()}
        out["fits"].append(got)
        save()
        print(json.dumps({k: got.get(k) for k in ("m", "s", "strategy", "whole_fit_peak_gb", "predicted_gb", "cudnn_benchmark", "error")}), flush=True)
        for row in got.get("steps", []):
            print("   step", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if "composition" in got:
            print("   at peak:", json.dumps(got["composition"]["coarse_gb"]), flush=True)
            print("   top:", json.dumps(got["composition"]["top_gb"]), flush=True)


if __name__ == "__main__":
    main()
