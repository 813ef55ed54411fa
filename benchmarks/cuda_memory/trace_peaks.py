"""Where is the whole-run CUDA peak of a dp_ga fit, and what is alive there? (a diagnostic, as run)

Records the caching allocator's trace (``torch.cuda.memory._record_memory_history``, a private
API), fits BERT-Large and GPT-2 ``dp_ga`` plans one after another in one process group (as the
committed GPU run before 2026-11-23 did), then replays the trace: each run's own peak (only blocks
it allocated), the phase it fell in (marker allocations from Lightning hooks), what was alive
there grouped by the allocating source line, and the bytes left allocated after the fit over 2 s.

Run on an NVIDIA H100 on 2026-11-23 from the repository root:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/trace_peaks.py``; its output (written to $OUT,
else /tmp) is ``benchmarks/results/cuda_memory_trace_peaks_h100.json``. At that time
``settle_cuda_memory`` had no barrier yet and polled the allocated bytes until they were
unchanged for 0.5 s (at most 5 s); today it is the barrier alone. See ``benchmarks/cuda_memory/README.md``.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("trace_peaks.py needs a CUDA GPU, and torch sees none here. HINT: run it on a machine with an NVIDIA GPU (benchmarks/cuda_memory/README.md); replay_input_bytes.py is the one that needs none.")
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import gpu_validation as gv  # noqa: E402
from lightning_distplan.bench._runner import build_strategy  # noqa: E402
from lightning_distplan.costmodel import Hardware, predict  # noqa: E402
from lightning_distplan.plan import Plan  # noqa: E402
from lightning_distplan.profiling import profile_module  # noqa: E402
from lightning_distplan.profiling._overhead import QUIET_FIT  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
MARK_BASE = 7 * 512  # marker allocations: unique odd sizes, freed at once
PHASES = ["batch_start", "before_zero_grad", "before_backward", "after_backward", "before_opt_step", "batch_end", "run_start", "run_end",
          "prof_fwd", "prof_bwd", "prof_end"]
GB = 1e9


def mark(phase: str) -> None:
    i = PHASES.index(phase)
    t = torch.empty(MARK_BASE + 512 * i, dtype=torch.uint8, device="cuda")
    del t


def marker_phase(size: int, e: dict | None = None) -> str | None:
    if e is not None and not any(f.get("name") == "mark" for f in e.get("frames", [])):
        return None
    i = (size - MARK_BASE) // 512
    if size >= MARK_BASE and (size - MARK_BASE) % 512 == 0 and i < len(PHASES):
        return PHASES[i]
    return None


class Phases(Callback):
    def on_train_batch_start(self, *a, **k): mark("batch_start")
    def on_before_zero_grad(self, *a, **k): mark("before_zero_grad")
    def on_before_backward(self, *a, **k): mark("before_backward")
    def on_after_backward(self, *a, **k): mark("after_backward")
    def on_before_optimizer_step(self, *a, **k): mark("before_opt_step")
    def on_train_batch_end(self, *a, **k): mark("batch_end")


def category(frames: list[dict]) -> str:
    names = [(f.get("filename", ""), f.get("name", ""), f.get("line", 0)) for f in frames]
    for fn, name, line in names:  # innermost first
        if "torch/optim" in fn:
            return "optimizer"
        if "autograd/__init__" in fn or ("_tensor.py" in fn and name == "backward"):
            return "backward"
        if "nn/parallel/distributed" in fn:
            return f"ddp:{name}:{line}"
        if "transformers/" in fn:
            return "forward:" + fn.split("transformers/")[-1] + f":{name}:{line}"
        if "torch/nn/functional" in fn or "torch/nn/modules" in fn:
            continue
        if "lightning_distplan" in fn or "mem_diag" in fn:
            return f"ours:{os.path.basename(fn)}:{name}:{line}"
        if "lightning/" in fn:
            return f"lightning:{os.path.basename(fn)}:{name}:{line}"
    return "other:" + ("|".join(f"{os.path.basename(fn)}:{name}:{line}" for fn, name, line in names[:3]))


def coarse(cat: str) -> str:
    return cat.split(":")[0] if not cat.startswith("forward") else "forward"


def replay(trace: list[dict], start: int, end: int, live0: dict | None = None):
    """Replay alloc/free from start to end over live0 (blocks alive before, tagged pre-run).

    Returns (peak of this window's own blocks, index, phase at that peak, live at that peak, live at end, total at end)."""
    live: dict[int, tuple[int, object, bool]] = {a: (v[0], v[1], True) for a, v in (live0 or {}).items()}
    total = sum(v[0] for v in live.values())
    own = 0
    peak, peak_i, phase, peak_phase, step = 0, start, None, None, 0
    peak_live = {}
    for i in range(start, end):
        e = trace[i]
        act = e["action"]
        if act == "alloc":
            ph = marker_phase(e["size"], e)
            if ph is not None:
                phase = ph
                if ph == "batch_start":
                    step += 1
                continue
            live[e["addr"]] = (e["size"], e, False)
            total += e["size"]
            own += e["size"]
            if own > peak:
                peak, peak_i, peak_phase = own, i, f"{phase} (batch {step})"
                peak_live = dict(live)
        elif act == "free_requested":
            got = live.pop(e["addr"], None)
            if got is not None:
                total -= got[0]
                if not got[2]:
                    own -= got[0]
    return peak, peak_i, peak_phase, peak_live, live, total


def summarize(live: dict[int, tuple[int, str]], top: int = 14) -> dict:
    by = collections.Counter()
    byc = collections.Counter()
    for size, e, pre in live.values():
        cat = ("pre-run " if pre else "") + (e if isinstance(e, str) else category(e.get("frames", [])))
        by[cat] += size
        byc[coarse(cat)] += size
    return {"total_gb": sum(by.values()) / GB, "coarse_gb": {k: round(v / GB, 4) for k, v in byc.most_common()},
            "top_gb": {k: round(v / GB, 4) for k, v in by.most_common(top)}}


def trace_len() -> int:
    snap = torch.cuda.memory._snapshot()
    n = len(snap["device_traces"][0])
    if n >= 2_990_000:
        print("WARNING: trace ring buffer full; indices unreliable", flush=True)
    return n


def drain_curve() -> list:
    t0 = time.perf_counter()
    got = []
    for t in (0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0):
        while time.perf_counter() - t0 < t:
            time.sleep(0.01)
        gc.collect()
        torch.cuda.synchronize()
        got.append((t, round(torch.cuda.memory_allocated() / GB, 4)))
    return got


def main() -> None:
    from lightning_distplan.bench._runner import settle_cuda_memory
    torch.set_float32_matmul_precision("high")
    gv._quiet_lightning()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    grid = {"bert_large": [(12, 1), (12, 4), (48, 1), (48, 4), (96, 1), (96, 4)], "gpt2": [(6, 1), (6, 4), (24, 1), (24, 4)]}
    for name, points in grid.items():
        spec = gv.MODELS[name](False)
        make_module = gv._seeded(spec.make_module)
        make_loader = gv._loader_factory(spec, "cuda", 6)
        module = make_module()
        loader = make_loader(spec.loader_batch)
        loader.dataset.length = 1 << 20
        profile = profile_module(module, loader, device="cuda", progress=lambda m: None)
        del module, loader
        gc.collect()
        hw = Hardware.from_profile(profile)
        print(name, "profiled; allocated after", torch.cuda.memory_allocated() / GB, flush=True)
        for m, s in points:
            t = time.perf_counter()
            base_settled = settle_cuda_memory(torch.device("cuda", 0))
            settle_s = time.perf_counter() - t
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base_alloc = torch.cuda.memory_allocated()
            start = trace_len()
            snap = torch.cuda.memory._snapshot()
            tr = snap["device_traces"][0]
            *_, live_now, _ = replay(tr, 0, len(tr))
            plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
            module = make_module()
            trainer = pl.Trainer(accelerator="cuda", devices=1, num_nodes=1, strategy=build_strategy(plan), max_steps=4, max_epochs=-1,
                                 callbacks=[Phases()], **QUIET_FIT)
            trainer.fit(module, train_dataloaders=make_loader(m * s))
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()
            module = trainer = None
            curve = drain_curve()
            snap = torch.cuda.memory._snapshot()
            tr = snap["device_traces"][0]
            peak, pi, pphase, plive, end_live, _ = replay(tr, start, len(tr), {a: v[:2] for a, v in live_now.items()})
            pred = predict(profile, plan, hw)
            rec = {"model": name, "m": m, "s": s, "settled_baseline_gb": base_settled / GB, "settle_s": round(settle_s, 2),
                   "baseline_allocated_gb": base_alloc / GB, "measured_max_allocated_gb": measured / GB,
                   "measured_minus_baseline_gb": (measured - base_alloc) / GB, "own_peak_gb": peak / GB,
                   "predicted_gb": pred.peak_memory_bytes / GB, "own_peak_error": (pred.peak_memory_bytes - peak) / peak,
                   "predicted_breakdown_gb": {k: round(v / GB, 4) for k, v in pred.memory_breakdown.items()},
                   "peak_phase": pphase, "at_peak": summarize(plive, 10), "drain_after_run": curve,
                   "left_after_run": summarize(end_live, 4), "trace_events": len(tr) - start}
            out["runs"].append(rec)
            print(json.dumps({k: rec[k] for k in ("model", "m", "s", "settled_baseline_gb", "settle_s", "baseline_allocated_gb", "measured_max_allocated_gb",
                                                 "measured_minus_baseline_gb", "own_peak_gb", "predicted_gb", "own_peak_error", "peak_phase", "drain_after_run")}), flush=True)
            print("   at peak:", json.dumps(rec["at_peak"]["coarse_gb"]), flush=True)
            json.dump(out, open(os.path.join(OUT, "mem_diag.json"), "w"), indent=1)
        profile = None
        gc.collect()
    torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
