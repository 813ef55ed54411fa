"""Tiny models and rank functions for the auto_plan tests (module-level so spawned ranks import them)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_distplan import PipelineSpec

DIM = 32


def regression_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


class ChainMLP(L.LightningModule):
    """A chain of blocks with the documented ``pipeline_spec`` hook; dropout makes RNG restoration matter."""

    def __init__(
        self, width: int = 64, depth: int = 4, n_samples: int = 128, loader_batch: int = 8, dropout: float = 0.1,
        slow_after: int | None = None, slow_s: float = 0.0, shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        dims = [DIM] + [width] * (depth - 1)
        blocks: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Dropout(dropout)) for a, b in zip(dims, dims[1:])]
        blocks.append(nn.Linear(width, 1))
        self.blocks = nn.ModuleList(blocks)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.blocks), inputs=lambda batch: batch[0], loss=lambda out, batch: F.mse_loss(out, batch[1]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        if self.hparams.slow_after is not None and self.trainer.global_step >= self.hparams.slow_after:
            time.sleep(self.hparams.slow_s)  # the device "slows down" after N steps
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(self.hparams.n_samples), batch_size=self.hparams.loader_batch, shuffle=self.hparams.shuffle)


class LossRecorder(L.Callback):
    """Every training-step loss, in order (micro-batches for dp_ga, pipeline steps for pipelines)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def trainer_kwargs(tmp: str, **overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp,
    )
    kw.update(overrides)
    return kw


def full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The full module state on every rank's return (collective for pipelines: call on all ranks)."""
    sd = trainer.strategy.lightning_module_state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
