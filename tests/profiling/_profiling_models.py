"""Tiny LightningModules shared by the profiling tests (imported by path-less name from this folder)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class MLP(LightningModule):
    """Linear(8,16) -> ReLU -> Linear(16,4), MSE loss: saved-for-backward bytes are known by hand."""

    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.optimizer_name = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # outside a Trainer this would warn; the profiler silences it
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)}


class OOMAbove(LightningModule):
    """A real module whose forward raises the allocator's errors above ``limit`` samples."""

    def __init__(self, limit: int = 4, kind: str = "cuda") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.limit, self.kind = limit, kind

    def forward(self, x):
        if x.shape[0] > self.limit:
            if self.kind == "cuda":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes.")
        return self.out(torch.relu(self.lin(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self(x), y)}

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1)]


class NoParams(LightningModule):
    def training_step(self, batch, batch_idx):
        return batch[0].sum()


def xy_batches(n_batches: int = 4, batch_size: int = 4, d_in: int = 8, d_out: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, d_in, generator=g), torch.randn(batch_size, d_out, generator=g)) for _ in range(n_batches)]
