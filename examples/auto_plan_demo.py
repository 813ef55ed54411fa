"""The main example: profile -> plan -> train -> tune, with one line of Lightning code.

What it does (``make example`` runs it):

1. trains Lightning's demo Transformer (synthetic tokens; no download) with
   ``Trainer(strategy="auto_plan")``: the strategy profiles the first batches on the real device,
   fits the time/memory model, picks data parallel + accumulation or a pipeline, and trains with
   that plan in the same processes (2 CPU processes, or every visible GPU);
2. prints the chosen plan, the alternatives and predicted vs observed step time;
3. searches cloud hardware for the same model with Optuna on the fitted model
   (catalog ``alicloud-2023``, objective cost + w·time), stores the study in SQLite, writes the
   Pareto-front and time-breakdown plots, and says how to open it in optuna-dashboard.

Run:  python examples/auto_plan_demo.py [--devices N] [--epochs E] [--trials K]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer

import lightning_distplan  # noqa: F401  (registers "auto_plan", "dp_ga", "gpipe", "1f1b")
from lightning_distplan.callbacks import StepTimeMonitor
from lightning_distplan.demos import RandomTokenData

# Lightning 2.6 calls a torch.utils._pytree check that torch 2.14 deprecates: nothing this demo's reader can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class DemoTransformer(LightningTransformer):
    """Lightning's demo model, a little smaller for a CPU demo and without the WikiText2 download."""

    def __init__(self, vocab_size: int = 2000, width: int = 128, layers: int = 2) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = Transformer(vocab_size=vocab_size, ninp=width, nhead=4, nhid=2 * width, nlayers=layers)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def prepare_data(self) -> None:  # the parent downloads WikiText2; our data is synthetic
        pass


class LossHistory(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))


def positive(text: str) -> int:
    """An argparse ``type``: a bad count is one line from argparse before the fit, not a traceback after it."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # "²" is a digit to str.isdigit, not to int()
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0 (currency per second of step time)")
    return value


def open_study_line(storage: str, artifact_dir: str | None) -> str:
    """How to open the study: ``distplan dashboard`` finds the plot artifacts next to the SQLite file by itself,
    ``optuna-dashboard`` serves them only when told where they are."""
    artifacts = "" if artifact_dir is None else f" --artifact-dir {shlex.quote(str(artifact_dir))}"
    url = shlex.quote(storage)
    return f"open the study:  distplan dashboard {url}   (or: optuna-dashboard {url}{artifacts})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=positive, default=None, help="default: all GPUs, else 2 CPU processes")
    parser.add_argument("--epochs", type=positive, default=1)
    # 8192 samples = 256 steps of 16 per process on 2 CPU processes: a short but real epoch, so the
    # planning overhead the run reports (a few seconds) is measured against a realistic fit
    parser.add_argument("--samples", type=positive, default=8192)
    parser.add_argument("--batch-size", type=positive, default=16, help="loader batch per process")
    parser.add_argument("--trials", type=positive, default=300)
    parser.add_argument("--time-weight", type=weight, default=4096.0)
    parser.add_argument("--root", default="runs/example")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    accelerator = "gpu" if gpu else "cpu"
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    if not gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    torch.manual_seed(0)

    model = DemoTransformer()
    data = RandomTokenData(vocab_size=2000, block_size=32, batch_size=args.batch_size, num_samples=args.samples)
    history = LossHistory()
    trainer = L.Trainer(
        strategy="auto_plan",  # <- the one line
        accelerator=accelerator,
        devices=devices,
        max_epochs=args.epochs,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[history],
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - t0
    if not trainer.is_global_zero:
        return

    distplan_dir = Path(args.root) / "distplan"
    plan_doc = json.loads((distplan_dir / "plan.json").read_text())
    print("\n=== 1. trained with auto_plan ===")
    print(f"device: {devices} x {accelerator}; chosen plan: {trainer.strategy.plan.describe()}")
    print(f"fit took {fit_s:.1f} s; train_loss first {history.losses[0]:.3f} -> last {history.losses[-1]:.3f}"
          if history.losses else f"fit took {fit_s:.1f} s")
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor)), None)
    summary = monitor.summary if monitor is not None else None
    if summary is not None and summary.mean_observed_s is not None and summary.predicted_s is not None:
        # the full steps after warm-up, not the last (short) one; the median is over the steps history still keeps
        print(f"step time: predicted {summary.predicted_s:.4f} s, observed mean {summary.mean_observed_s:.4f} s "
              f"over {summary.observed_steps} steps after {summary.warmup_steps} warm-up"
              + ("" if summary.median_observed_s is None else f" (median {summary.median_observed_s:.4f} s of the last "
                 f"{sum(not h['warmup'] and not h['partial'] for h in monitor.history)})"))
    print(f"profile + plan written to {distplan_dir}/ (profile.json, plan.json)")
    alternatives = plan_doc.get("alternatives") or []
    for alt in alternatives[:3]:
        print(f"  alternative: {alt.get('strategy')} dp={alt.get('dp')} pp={alt.get('pp')} m={alt.get('micro_batch_size')} "
              f"predicted {alt.get('predicted_step_time_s', float('nan')):.4f} s")

    print("\n=== 2. what should I rent? (Optuna over the fitted model) ===")
    from lightning_distplan.profile import Profile
    from lightning_distplan.tuner import tune
    from lightning_distplan.tuner.plots import attach_to_study, plot_pareto_front, plot_time_breakdown

    profile = Profile.load(distplan_dir / "profile.json")
    db = Path(args.root).resolve() / "distplan.db"
    storage = f"sqlite:///{db}"
    study_name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    global_batch = plan_doc["plan"]["global_batch_size"] if "plan" in plan_doc else trainer.strategy.plan.global_batch_size
    t0 = time.perf_counter()
    result = tune(profile, catalog="alicloud-2023", global_batch_size=global_batch, time_weight=args.time_weight,
                  n_trials=args.trials, storage=storage, study_name=study_name, seed=0, progress=False)
    tune_s = time.perf_counter() - t0
    best = result.best.to_dict()
    print(f"{args.trials} trials in {tune_s:.1f} s; best for C + {args.time_weight:g}·T per step:")
    print("  " + json.dumps({k: best[k] for k in best if k in (
        "instance_type", "count", "strategy", "dp", "pp", "micro_batch_size", "accumulation",
        "predicted_step_time_s", "predicted_cost_per_step", "currency")}))
    print(f"Pareto front (cost vs time per step): {len(result.pareto)} configurations")
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage)
    plot_pareto_front(study, path_html=distplan_dir / "pareto.html", path_png=distplan_dir / "pareto.png")
    plot_time_breakdown(study, path_html=distplan_dir / "breakdown.html", path_png=distplan_dir / "breakdown.png")
    stored = attach_to_study(study)
    print(f"plots: {distplan_dir}/pareto.png, breakdown.png (+ .html)")
    print(open_study_line(storage, stored["artifact_dir"]))


if __name__ == "__main__":
    main()
