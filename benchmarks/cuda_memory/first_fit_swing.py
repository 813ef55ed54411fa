"""Does the run-to-run swing of one gradient size in a dp_ga fit's CUDA peak come from NCCL keeping
the first step's DDP buckets alive? (a diagnostic, written 2026-11-23, run on an H100 on 2026-11-24:
``../results/cuda_memory_first_fit_swing_h100.json``, ``--variants default,no_release --plans
24x1,24x4,48x4 --reps 3 --budget-s 240``; its answer is in ``README.md`` beside this file).

The single-GPU validation (``../gpu_validation.py``) misses peak memory by more than 5% at 2 of 22
points per run, and not at the same points: the same plan, each time the first fit of a fresh
process group, peaked one gradient size apart (``bucket_view.py``). A lead from torch's source, not
measured: ProcessGroupNCCL keeps a collective's input tensors alive until ``work.wait()``, and
DDP's reducer waits on futures, not on the works, so the bucket set allocated when DDP wraps the
model (replaced by the rebuilt set after the first step) may stay allocated until the watchdog
drops the work, which may or may not happen before the step's peak.

Every repetition here is one fit in a process of its own (fresh CUDA context, first group). The
variants change one thing each:

- ``default``: a barrier on the group once the first optimizer step is done (``release.py`` saw a
  barrier free the leftover at once), in ``DPGAStrategy.optimizer_step`` as it was tried there on
  2026-11-24 (``ReleasingDPGA`` below; the strategy did not keep it);
- ``no_release``: ``DPGAStrategy`` as it is, as ``gpu_validation.py`` runs;
- ``record_streams``: ``TORCH_NCCL_AVOID_RECORD_STREAMS=0``;
- ``avoid_record_streams``: ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``.

Per repetition it records the peak and, per training batch, the bytes allocated at its start and
end and the running peak, so the place of the peak shows. If one variant has no swing and its
peak is the lower one, that is the fix to try in ``DPGAStrategy`` on CUDA, then re-run
``gpu_validation.py``.

Run from the repository root on a CUDA machine:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/first_fit_swing.py --out $OUT/first_fit_swing.json``
(BERT-Large, m=24 with s=1 and s=4, 4 repetitions per variant: about 32 fits of ~15 s each).
``--device cpu --tiny`` runs the same plumbing on a CPU (no CUDA numbers) to check the script.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no_release": {},
    "record_streams": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"},
    "avoid_record_streams": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One fit in this process; returns its peak and per-batch allocation timeline."""
    import lightning.pytorch as pl
    import torch

    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    import gpu_validation as gv

    from lightning_distplan.plan import Plan
    from lightning_distplan.profiling._overhead import QUIET_FIT
    from lightning_distplan.strategies import DPGAStrategy

    gv._quiet_lightning()
    cuda = args.device == "cuda"
    if cuda:
        torch.set_float32_matmul_precision("high")
    spec = gv._bert(args.tiny)
    make_loader = gv._loader_factory(spec, args.device, args.steps)
    module = gv._seeded(spec.make_module)()
    timeline: list[dict[str, Any]] = []

    def now() -> dict[str, int | None]:
        if not cuda:
            return {"allocated": None, "peak": None}
        return {"allocated": int(torch.cuda.memory_allocated()), "peak": int(torch.cuda.max_memory_allocated())}

    class Timeline(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            timeline.append({"batch": batch_idx, "at": "start", "global_step": trainer.global_step, **now()})

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            timeline.append({"batch": None, "at": "before_optimizer_step", "global_step": trainer.global_step, **now()})

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
            timeline.append({"batch": batch_idx, "at": "end", "global_step": trainer.global_step, **now()})

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = now()
    class ReleasingDPGA(DPGAStrategy):
        """DPGAStrategy waiting on a barrier once, after the fit's first optimizer step (the "default" variant as run)."""

        released = False

        def optimizer_step(self, *a: Any, **k: Any) -> Any:
            output = super().optimizer_step(*a, **k)
            if not self.released:
                self.released = True
                self.barrier("release_first_buckets")
            return output

    plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=args.m, accumulate_grad_batches=args.s, global_batch_size=args.m * args.s)
    strategy = (DPGAStrategy if args.variant == "no_release" else ReleasingDPGA)(plan=plan)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, max_steps=args.steps, max_epochs=-1,
        callbacks=[Timeline()], **QUIET_FIT,
    )
    trainer.fit(module, train_dataloaders=make_loader(args.m * args.s))
    end = now()
    return {
        "variant": args.variant, "m": args.m, "s": args.s, "steps": trainer.global_step,
        "base_allocated_bytes": base["allocated"], "peak_bytes": end["peak"], "allocated_after_fit_bytes": end["allocated"],
        "grad_bytes": sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad),
        "env": {k: os.environ.get(k) for k in ("TORCH_NCCL_AVOID_RECORD_STREAMS",)},
        "timeline": timeline,
    }


def _versions() -> dict[str, str | None]:
    import lightning
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": lightning.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer BERT (plumbing check)")
    parser.add_argument("--plans", default="24x1,24x4", help="comma-separated MxS (default 24x1,24x4)")
    parser.add_argument("--reps", type=int, default=4, help="fits per variant and plan (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per fit (default 4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting fits after this many seconds (default 540)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=24, help=argparse.SUPPRESS)
    parser.add_argument("--s", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("first_fit_swing.py needs a CUDA GPU with --device cuda (the default), and torch sees none here. "
                     "HINT: run it on a machine with an NVIDIA GPU, or pass --device cpu for a plumbing check.")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    plans = [tuple(int(x) for x in p.split("x")) for p in args.plans.split(",")]
    record: dict[str, Any] = {
        "benchmark": "cuda_memory/first_fit_swing", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": _versions(), "device": args.device, "tiny": args.tiny, "runs": [],
    }
    if args.device == "cuda":
        import torch

        record["device"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    # rep outermost and variants interleaved, so a drift over time does not pass for a variant's effect
    for rep in range(args.reps):
        for m, s in plans:
            for variant in variants:
                if time.time() - t0 > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent; stopping", flush=True)
                    break
                cmd = [sys.executable, __file__, "--child", "--out", args.out, "--device", args.device, "--variant", variant,
                       "--m", str(m), "--s", str(s), "--steps", str(args.steps), *(["--tiny"] if args.tiny else [])]
                env = {**os.environ, **VARIANTS[variant]}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    run = {"variant": variant, "m": m, "s": s, "rep": rep, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    run = {**json.loads(lines[-1][len("RESULT "):]), "rep": rep}
                record["runs"].append(run)
                peak = run.get("peak_bytes")
                shown = "n/a" if peak is None else f"{peak / 2**30:.2f} GiB"
                print(f"rep {rep} m={m} s={s} {variant:25s} peak {shown}" + (f"  ERROR {run['error']}" if "error" in run else ""), flush=True)
                with open(args.out, "w") as f:
                    json.dump(record, f, indent=1)
    print("\nsummary (peaks per variant and plan, GiB):")
    for m, s in plans:
        for variant in variants:
            peaks = [r["peak_bytes"] for r in record["runs"] if r["variant"] == variant and (r["m"], r["s"]) == (m, s) and r.get("peak_bytes")]
            if peaks:
                grad = next(r["grad_bytes"] for r in record["runs"] if r.get("grad_bytes"))
                print(f"  m={m} s={s} {variant:25s} {[round(p / 2**30, 2) for p in peaks]}  swing {(max(peaks) - min(peaks)) / grad:.2f} gradient sizes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
