"""One epoch of Lightning's demo Transformer on synthetic tokens under ``strategy="auto_plan"`` (CPU).

The run itself reports what planning cost: ``auto_plan`` logs the profiling progress and, at the
end of ``fit``, "planning overhead X s = Y% of this fit". This script also prints one JSON line
with those numbers (rank 0), so the overhead claim can be checked::

    python examples/auto_plan_overhead.py --devices 2 --samples 8192

Lightning's own launcher starts the second process (``strategy="auto_plan"`` is a DDP strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer

import lightning_distplan  # noqa: F401  (registers "auto_plan")
from lightning_distplan.callbacks import StepTimeMonitor
from lightning_distplan.demos import RandomTokenData


class OfflineTransformer(LightningTransformer):
    """Lightning's demo model unchanged, except that it does not download WikiText2 (no internet here)."""

    def __init__(self, vocab_size: int, ninp: int, nlayers: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = Transformer(vocab_size=vocab_size, ninp=ninp, nhead=4, nhid=2 * ninp, nlayers=nlayers)

    def prepare_data(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192, help="samples in the one epoch (8192 = 256 steps of 16 per rank on 2 ranks)")
    parser.add_argument("--batch-size", type=int, default=16, help="loader batch size per rank")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--root", default="runs/auto_plan_overhead")
    args = parser.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    torch.manual_seed(0)
    model = OfflineTransformer(args.vocab, args.width, args.layers)
    data = RandomTokenData(vocab_size=args.vocab, block_size=args.block, batch_size=args.batch_size, num_samples=args.samples)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="auto_plan", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=args.root,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - t0
    if trainer.is_global_zero:
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor))
        steps = [h["observed_s"] for h in monitor.history]
        print(json.dumps({
            "plan": trainer.strategy.plan.describe(),
            "overhead_s": round(monitor.overhead_s, 3),
            "fit_s": round(monitor.run_s, 3),
            "overhead_pct": round(100 * monitor.overhead_s / monitor.run_s, 2),
            "fit_wall_s": round(wall, 3),
            "steps": len(steps),
            "predicted_step_s": monitor.predicted_step_time_s,
            "median_observed_step_s": sorted(steps)[len(steps) // 2] if steps else None,
        }))


if __name__ == "__main__":
    main()
