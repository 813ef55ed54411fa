"""Reproduce seed 000's data-parallel finding on its own catalog: gradient accumulation buys cheaper steps.

Seed 000 (§III-A, §V-A) argues that with accumulation (s > 1) a data-parallel job needs fewer
workers for the same global batch, so less is spent on slow inter-instance all-reduce, and the
cheapest configuration *with* GA costs less than the cheapest one *without* it (s = 1), at some
extra time: on AliCloud FaaS −31.2% cost at +17.3% time on average, on IaaS −3.8% to −21.5% cost
with up to +75.4% time (seed 000 §V-A). This script asks the same question of our cost model over
``alicloud-2023`` (seed 000 Table III, IaaS GPU instances, 2.5–25 Gbit/s networks).

THE PROFILE IS ANALYTICAL, NOT MEASURED. No GPU is used. It is BERT-Large (one of seed 000's four
workloads, SQuAD fine-tuning, sequence length 384), built from published sizes:

* architecture: 24 encoder layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522, 512
  positions (Devlin et al., "BERT", NAACL 2019, Table "BERT-LARGE": L=24, H=1024, A=16, 340M);
* parameters per encoder layer 12·H² + 13·H = 12,596,224 (4 attention + 2 FFN matrices, biases,
  2 LayerNorms), 4 bytes each (fp32) → 24 layers = 1,209 MB = 1,153 MiB — seed 000 Table II lists
  1153 MB for BERT-Large; the embeddings (31.8 M parameters) come on top;
* activation saved for backward: seed 000 Table II, 263 MB per sample, split evenly over the 24
  layers (the embedding and head are small and get none); the table's "MB" are MiB (its 170 MB for
  ResNet-101 is 169.9 MiB, its 1153 MB above 1,153 MiB), so 263 MiB = 263 · 2^20 bytes;
* FLOPs per sample and layer (forward): 2·(4H² + 2·H·F)·S + 4·S²·H = 10.27 GFLOP at S=384 (matmuls
  only, the usual 2 FLOPs per multiply-add); backward = 2 × forward;
* times "as if profiled" on a Tesla T4 in fp32: t(m) = α·m + β with α = FLOPs / (50% of the T4's
  8.1 TFLOP/s fp32 peak, NVIDIA T4 datasheet; 50% is an ASSUMED efficiency) and β = 0.3 ms per
  layer and pass (ASSUMED kernel-launch overhead); other GPUs by the cost model's roofline
  projection (costmodel/projection.py);
* AdamW: state = 2 × parameters; its step reads/writes ~16 bytes per parameter from T4 memory
  (320 GB/s datasheet) → ASSUMED 0.0167 s; fixed memory overhead ASSUMED 600 MB (CUDA context,
  workspace).

So the numbers below are what our model predicts for such a workload — a check that the product
reproduces the paper's *mechanism*, not a measurement. Run::

    .venv/bin/python benchmarks/reproduce_seed000_ga.py            # writes benchmarks/results/seed000_ga.{json,png}

(the committed result the README's table reads; it says so before replacing it). ``--out FILE.json`` keeps
it: the figure then goes beside that file (``FILE.png``) unless ``--figure`` names another.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_distplan.profile import DeviceProfile, LayerProfile, LinearFit, MemoryProfile, OptimizerProfile, Profile, StepProfile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _results import figure_path, result_path, write_result  # noqa: E402

# -- the analytical BERT-Large profile (every number and its source in the module docstring) ------
L, H, A, F, S, VOCAB, POS = 24, 1024, 16, 4096, 384, 30522, 512  # source: Devlin et al. 2019 (BERT-Large); S=384: SQuAD fine-tuning as in seed 000 §IV-A
BYTES = 4  # fp32
T4_FP32_FLOPS = 8.1e12  # source: NVIDIA T4 datasheet (8.1 TFLOPS FP32)
T4_MEM_BW = 320e9  # source: NVIDIA T4 datasheet (320 GB/s)
EFFICIENCY = 0.5  # ASSUMED fraction of fp32 peak reached by the encoder's matmuls
LAUNCH_S = 3e-4  # ASSUMED fixed time per layer and pass
ACT_PER_SAMPLE_TOTAL = 263 * 2**20  # source: seed 000 Table II (BERT-Large, 263 "MB" per sample: MiB, as the table's parameter sizes show)
FIXED_OVERHEAD = 600 * 2**20  # ASSUMED CUDA context + workspace


def bert_large_profile() -> Profile:
    layer_params = 12 * H * H + 13 * H
    emb_params = (VOCAB + POS + 2) * H + 2 * H
    head_params = 2 * H + 2  # SQuAD span head: start/end logits
    fwd_flops_layer = 2 * (4 * H * H + 2 * H * F) * S + 4 * S * S * H
    boundary = S * H * BYTES  # hidden states passed between layers, per sample

    def timed(name: str, params: int, flops_fwd: float, act: float) -> LayerProfile:
        return LayerProfile(
            name=name,
            forward=LinearFit(alpha=flops_fwd / (EFFICIENCY * T4_FP32_FLOPS), beta=LAUNCH_S),
            backward=LinearFit(alpha=2 * flops_fwd / (EFFICIENCY * T4_FP32_FLOPS), beta=LAUNCH_S),
            param_count=params,
            param_bytes=params * BYTES,
            activation_bytes_per_sample=act,
            output_bytes_per_sample=boundary,
            flops_forward_per_sample=flops_fwd,
            flops_backward_per_sample=2 * flops_fwd,
        )

    # Embedding lookup: no matmul; its time is memory-bound and small — 2·S·H adds as FLOPs.
    layers = [timed("bert.embeddings", emb_params, 2 * S * H, 0.0)]
    layers += [timed(f"bert.encoder.layer.{i}", layer_params, fwd_flops_layer, ACT_PER_SAMPLE_TOTAL / L) for i in range(L)]
    layers += [timed("qa_outputs", head_params, 2 * S * H * 2, 0.0)]
    params = sum(x.param_bytes for x in layers)
    fa = sum(x.forward.alpha for x in layers), sum(x.forward.beta for x in layers)
    ba = sum(x.backward.alpha for x in layers), sum(x.backward.beta for x in layers)
    optimizer_step_s = 16 * sum(x.param_count for x in layers) / T4_MEM_BW  # ASSUMED 16 B/param moved by AdamW
    return Profile(
        model="analytical:BERT-Large (seq 384, fp32) — see benchmarks/reproduce_seed000_ga.py",
        device=DeviceProfile(type="cuda", name="Tesla T4", total_memory_bytes=16 * 2**30, memory_source="NVIDIA T4 datasheet", dtype="float32"),
        micro_batch_sizes=(1, 2, 4, 8),
        step=StepProfile(forward=LinearFit(alpha=fa[0], beta=fa[1]), backward=LinearFit(alpha=ba[0], beta=ba[1])),
        layers=tuple(layers),
        optimizer=OptimizerProfile(name="AdamW", state_bytes=2 * params, step_time_s=optimizer_step_s),
        memory=MemoryProfile(
            param_bytes=params,
            grad_bytes=params,
            optimizer_state_bytes=2 * params,
            activation=LinearFit(alpha=ACT_PER_SAMPLE_TOTAL, beta=0.0),
            fixed_overhead_bytes=FIXED_OVERHEAD,
            device_total_bytes=16 * 2**30,
            device_total_source="NVIDIA T4 datasheet",
        ),
        splittable=True,
        split_reason="analytical profile",
        versions={"source": "analytical (published sizes), not measured"},
        created="analytical",
    )


# -- the experiment -------------------------------------------------------------------------------


def _row(c: Any) -> dict[str, Any]:
    return {
        "instance_type": c.instance_type,
        "gpu": c.gpu,
        "count": c.count,
        **c.plan.layout(),
        "step_time_s": c.step_time_s,
        "step_time_band_s": list(c.step_time_band_s),
        "cost_per_step_rmb": c.cost_per_step,
        "breakdown_s": dict(c.breakdown),
        "peak_memory_bytes": c.peak_memory_bytes,
        "device_memory_bytes": c.device_memory_bytes,
    }


def run(global_batch_sizes: list[int], weights: list[float], max_instances: int) -> dict[str, Any]:
    from lightning_distplan.tuner import exhaustive

    profile = bert_large_profile()
    results = []
    for gbs in global_batch_sizes:
        started = time.perf_counter()
        ex = exhaustive(profile, "alicloud-2023", global_batch_size=gbs, time_weight=0.0, max_instances=max_instances, strategies=("dp_ga",))
        feasible = [c for c in ex.configs if c.feasible and math.isfinite(c.cost_per_step)]
        with_ga = [c for c in feasible if c.plan.accumulate_grad_batches > 1]
        without = [c for c in feasible if c.plan.accumulate_grad_batches == 1]
        entry: dict[str, Any] = {
            "global_batch_size": gbs,
            "n_configurations": len(ex.configs),
            "n_feasible": len(feasible),
            "n_feasible_with_ga": len(with_ga),
            "n_feasible_without_ga": len(without),
            "elapsed_s": round(time.perf_counter() - started, 3),
            "by_weight": [],
        }
        for w in weights:
            # seed 000 §IV-C: "with GA" excludes the s = 1 settings; objective C + w·T (§IV-D)
            best_with = min(with_ga, key=lambda c: (c.cost_per_step + w * c.step_time_s, c.step_time_s), default=None)
            best_without = min(without, key=lambda c: (c.cost_per_step + w * c.step_time_s, c.step_time_s), default=None)
            item: dict[str, Any] = {"time_weight": w, "with_ga": _row(best_with) if best_with else None, "without_ga": _row(best_without) if best_without else None}
            if best_with and best_without:
                item["cost_change_pct"] = 100 * (best_with.cost_per_step / best_without.cost_per_step - 1)
                item["time_change_pct"] = 100 * (best_with.step_time_s / best_without.step_time_s - 1)
                item["workers_with_ga"] = best_with.plan.dp
                item["workers_without_ga"] = best_without.plan.dp
            entry["by_weight"].append(item)
        # The same question with the instance type held fixed (w = 0): where the mechanism operates.
        per_type = []
        for itype in sorted({c.instance_type for c in feasible}):
            bw = min((c for c in with_ga if c.instance_type == itype), key=lambda c: (c.cost_per_step, c.step_time_s), default=None)
            bo = min((c for c in without if c.instance_type == itype), key=lambda c: (c.cost_per_step, c.step_time_s), default=None)
            row: dict[str, Any] = {"instance_type": itype, "with_ga": _row(bw) if bw else None, "without_ga": _row(bo) if bo else None}
            if bw and bo:
                row["cost_change_pct"] = 100 * (bw.cost_per_step / bo.cost_per_step - 1)
                row["time_change_pct"] = 100 * (bw.step_time_s / bo.step_time_s - 1)
            per_type.append(row)
        entry["w0_per_instance_type"] = per_type
        results.append(entry)
    return {"profile": profile, "results": results}


def _figure(results: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    from lightning_distplan._files import save_figure_atomic

    w0 = [(r["global_batch_size"], next(i for i in r["by_weight"] if i["time_weight"] == 0.0)) for r in results]
    w0 = [(b, i) for b, i in w0 if i["with_ga"] and i["without_ga"]]
    fig = Figure(figsize=(12, 4.8), dpi=110, layout="constrained")
    ax_c, ax_t, ax_w = fig.subplots(1, 3)
    xs = list(range(len(w0)))
    width = 0.38
    for ax, key, label in ((ax_c, "cost_per_step_rmb", "cost per step (RMB)"), (ax_t, "step_time_s", "time per step (s)")):
        ax.bar([x - width / 2 for x in xs], [i["without_ga"][key] for _, i in w0], width, color="#D55E00", label="cheapest w/o GA (s=1)")
        ax.bar([x + width / 2 for x in xs], [i["with_ga"][key] for _, i in w0], width, color="#0072B2", label="cheapest with GA (s>1)")
        ax.set_xticks(xs, [str(b) for b, _ in w0])
        ax.set_xlabel("global batch size")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    for x, (_, i) in zip(xs, w0):
        ax_c.annotate(f"{i['cost_change_pct']:+.1f}%", (x + width / 2, i["with_ga"]["cost_per_step_rmb"]), ha="center", va="bottom", fontsize=8)
        ax_t.annotate(f"{i['time_change_pct']:+.1f}%", (x + width / 2, i["with_ga"]["step_time_s"]), ha="center", va="bottom", fontsize=8)
    ax_c.legend(fontsize=8)
    ax_w.bar([x - width / 2 for x in xs], [i["workers_without_ga"] for _, i in w0], width, color="#D55E00")
    ax_w.bar([x + width / 2 for x in xs], [i["workers_with_ga"] for _, i in w0], width, color="#0072B2")
    for x, (_, i) in zip(xs, w0):
        ax_w.annotate(i["without_ga"]["instance_type"], (x - width / 2, i["workers_without_ga"]), ha="center", va="bottom", fontsize=6, rotation=90)
        ax_w.annotate(i["with_ga"]["instance_type"], (x + width / 2, i["workers_with_ga"]), ha="center", va="bottom", fontsize=6, rotation=90)
    ax_w.set_xticks(xs, [str(b) for b, _ in w0])
    ax_w.set_xlabel("global batch size")
    ax_w.set_ylabel("data-parallel workers (instances)")
    ax_w.grid(axis="y", alpha=0.3)
    ax_w.margins(y=0.35)
    fig.suptitle("Seed 000 §III-A on alicloud-2023, w = 0: cheapest DP plan with vs without gradient accumulation\n(analytical BERT-Large profile, model predictions — not measurements)", fontsize=10)
    save_figure_atomic(fig, path)


def _versions() -> dict[str, str]:
    import optuna

    import lightning_distplan

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"python": platform.python_version(), "lightning_distplan": lightning_distplan.__version__, "git_commit": commit, "optuna": optuna.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--global-batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 2.0**8, 2.0**12, 2.0**16])
    parser.add_argument("--max-instances", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/seed000_ga.json, the committed result)")
    parser.add_argument("--figure", type=Path, default=None, help="PNG (default: beside --out, same name; without --out benchmarks/results/seed000_ga.png)")
    args = parser.parse_args(argv)
    args.out = result_path(args.out, ROOT / "results" / "seed000_ga.json", script="reproduce_seed000_ga")
    # beside the JSON by default (as cpu_cluster_sweep.py's plot): with only --out, a fixed default replaced the
    # committed figure, which then no longer matched the committed JSON that --out had kept
    args.figure = figure_path(args.figure or args.out.with_suffix(".png"), script="reproduce_seed000_ga", option="--figure")
    out = run(args.global_batch_sizes, args.weights, args.max_instances)
    profile: Profile = out["profile"]
    results = out["results"]
    w0 = [next(i for i in r["by_weight"] if i["time_weight"] == 0.0) for r in results]
    w0 = [i for i in w0 if "cost_change_pct" in i]
    summary = {
        "w0_mean_cost_change_pct": sum(i["cost_change_pct"] for i in w0) / len(w0) if w0 else None,
        "w0_mean_time_change_pct": sum(i["time_change_pct"] for i in w0) / len(w0) if w0 else None,
        "w0_with_ga_cheaper_and_fewer_workers_in": [r["global_batch_size"] for r, i in zip(results, w0) if i["cost_change_pct"] < 0 and i["workers_with_ga"] < i["workers_without_ga"]],
        "paper": {
            "DP_FaaS_average": {"cost_change_pct": -31.2, "time_change_pct": 17.3},
            "DP_IaaS_range": {"cost_change_pct": [-21.5, -3.8], "time_change_pct_max": 75.4},
            "source": "seed 000 §V-A",
        },
    }
    doc = {
        "what": "Cheapest data-parallel plan with gradient accumulation (s>1) vs without (s=1) on catalog alicloud-2023, per global batch size and time weight w (objective C + w*T, seed 000 §IV-D), priced by lightning_distplan.tuner.exhaustive (the full dp_ga space up to --max-instances instances).",
        "profile_kind": "ANALYTICAL (published sizes + stated assumptions), not measured; see the script's docstring",
        "profile_numbers": {
            "model": profile.model,
            "layers": len(profile.layers),
            "param_bytes": profile.memory.param_bytes,
            "activation_bytes_per_sample": profile.memory.activation.alpha,
            "forward_flops_per_sample": sum(x.flops_forward_per_sample for x in profile.layers),
            "step_time_on_T4_fp32_s(m=1)": profile.step.time(1),
            "optimizer_step_s_on_T4": profile.optimizer.step_time_s,
            "sources": {
                "architecture": "Devlin et al. 2019, BERT-Large (L=24, H=1024, A=16)",
                "param_bytes_check": "seed 000 Table II: 1153 MB (our 24 encoder layers: 1153 MiB; + embeddings)",
                "activation_bytes_per_sample": "seed 000 Table II: 263 MB (the table's MB are MiB: 263 * 2**20 bytes)",
                "T4_fp32_peak": "NVIDIA T4 datasheet: 8.1 TFLOPS, 320 GB/s",
                "assumed": {"matmul_efficiency": EFFICIENCY, "per_layer_launch_s": LAUNCH_S, "fixed_overhead_bytes": FIXED_OVERHEAD, "adamw_bytes_per_param": 16},
            },
        },
        "results": results,
        "summary": summary,
        "provenance": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
            "catalog": "alicloud-2023 (seed 000 Table III, RMB/hour)",
        },
    }
    write_result(args.out, doc)
    _figure(results, args.figure)
    for r in results:
        for i in r["by_weight"]:
            if "cost_change_pct" not in i:
                print(f"B={r['global_batch_size']:4d} w={i['time_weight']:>7g}: no feasible pair (with GA: {bool(i['with_ga'])}, without: {bool(i['without_ga'])})")
                continue
            a, b = i["without_ga"], i["with_ga"]
            print(
                f"B={r['global_batch_size']:4d} w={i['time_weight']:>7g}: w/o GA {a['count']:2d}x {a['instance_type']:<18} m={a['micro_batch_size']:<3} "
                f"{a['step_time_s']:.3f}s {a['cost_per_step_rmb']:.5f} RMB | with GA {b['count']:2d}x {b['instance_type']:<18} m={b['micro_batch_size']:<3} s={b['accumulate_grad_batches']:<3} "
                f"{b['step_time_s']:.3f}s {b['cost_per_step_rmb']:.5f} RMB | cost {i['cost_change_pct']:+.1f}% time {i['time_change_pct']:+.1f}%"
            )
    print("w=0, instance type held fixed (cheapest with GA vs cheapest without; '-' = no feasible s=1 plan within --max-instances):")
    for r in results:
        cells = []
        for row in r["w0_per_instance_type"]:
            if "cost_change_pct" in row:
                cells.append(f"{row['instance_type']} {row['without_ga']['dp']}->{row['with_ga']['dp']}w {row['cost_change_pct']:+.1f}%/{row['time_change_pct']:+.0f}%")
            else:
                cells.append(f"{row['instance_type']} -")
        print(f"  B={r['global_batch_size']}: " + "; ".join(cells))
    print(f"w=0 mean: cost {summary['w0_mean_cost_change_pct']:+.1f}%, time {summary['w0_mean_time_change_pct']:+.1f}% (paper DP-FaaS: -31.2% / +17.3%)")
    print(f"wrote {args.out} and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
