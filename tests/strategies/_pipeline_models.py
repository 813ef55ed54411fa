"""Tiny models, data and a torchrun-like process launcher shared by the pipeline tests."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 32
N_STEPS = int(os.environ.get("PP_TEST_STEPS", "10"))


class TinyTransformer(LightningTransformer):
    """Lightning's demo Transformer, small and without dropout (same training_step / loss)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def prepare_data(self) -> None:  # synthetic data: no WikiText2 download
        pass


class TinyGPT2(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_data(n: int = N_STEPS * GLOBAL_BATCH, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


def build(name: str) -> L.LightningModule:
    torch.manual_seed(1234)
    return {"transformer": TinyTransformer, "gpt2": TinyGPT2}[name]()


def reference_weights(name: str, steps: int = N_STEPS) -> dict[str, torch.Tensor]:
    """Plain single-process loop: the LightningModule's own training_step on the global batch."""
    model = build(name)
    opt = model.configure_optimizers()
    data = token_data()
    # Lightning shards training data with DistributedSampler(shuffle=True, seed=0) over the dp replicas;
    # at every step the replicas' batches together are the next GLOBAL_BATCH entries of this permutation.
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order)
    for i, batch in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad()
        model.training_step(batch, i).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_processes(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Start ``world`` real processes (like torchrun: env vars, gloo) running ``fn(rank, world, *args)``."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"worker exit codes {bad}")


def trainer_kwargs(world: int, strategy: Any, tmp: str, **extra: Any) -> dict[str, Any]:
    return dict(accelerator="cpu", devices=world, strategy=strategy, max_steps=N_STEPS, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp, **extra)
