"""Tiny deterministic language models (Lightning's demo Transformer or a Hugging Face GPT-2 built
from a config, dropout 0) and synthetic token data.

Shared by the dp_ga and checkpoint tests; module-level so spawned ranks can import it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, SEQ = 16, 6


def token_dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))  # next-token targets


class TinyLM(L.LightningModule):
    def __init__(
        self, n_samples: int = 320, loader_batch: int = 16, optimizer: str = "sgd", reference_sampler: bool = False, arch: str = "transformer"
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)  # identical initial weights in every process
        if arch == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(
                vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            )
            self.model = GPT2LMHeadModel(cfg)
        else:
            self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        self.micro_batch_sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        self.micro_batch_sizes.append(inputs.shape[0])
        if self.hparams.arch == "gpt2":
            return self.model(input_ids=inputs, labels=inputs).loss  # HF shifts the labels itself
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        ds = token_dataset(self.hparams.n_samples)
        if self.hparams.reference_sampler:
            # A single-process run that visits the samples in the order Lightning's injected
            # DistributedSampler(shuffle=True, seed=0) gives a multi-rank run.
            return DataLoader(ds, batch_size=self.hparams.loader_batch, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=0))
        return DataLoader(ds, batch_size=self.hparams.loader_batch, shuffle=True)


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _scratch_root() -> str:
    """One temporary folder for what fits write (auto_plan's distplan/plan.json), never the cwd; ranks a test starts
    inherit it through the environment, and the process that made it removes it at exit."""
    root = os.environ.get("DISTPLAN_TEST_ROOT")
    if root is None:
        root = os.environ["DISTPLAN_TEST_ROOT"] = tempfile.mkdtemp(prefix="distplan-test-")
        atexit.register(shutil.rmtree, root, True)
    return root


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=_scratch_root(),
    )
    kw.update(overrides)
    return kw
