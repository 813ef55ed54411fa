"""Tiny models, data and a torchrun-like process launcher shared by the pipeline tests."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import traceback
import weakref
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from _dist_utils import exit_now
from _ports import free_port
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

    # The single-process meaning of evaluation; PipelineStrategy runs PipelineSpec.loss instead (same loss).
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(*batch)


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


@functools.lru_cache(maxsize=None)
def reference_weights(
    name: str, steps: int = N_STEPS, autocast_bf16: bool = False, clip_norm: float = 0.0, bf16_true: bool = False
) -> dict[str, torch.Tensor]:
    """Plain single-process loop: the LightningModule's own training_step on the global batch
    (in CPU bf16 autocast, as Lightning's 'bf16-mixed' runs it, with ``autocast_bf16``; with bf16
    weights and bf16 as the default dtype, as 'bf16-true' runs it, with ``bf16_true``; gradients
    clipped to the norm ``clip_norm`` when it is > 0, as Trainer(gradient_clip_val=...))."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    model = build(name)
    if bf16_true:
        model = model.to(torch.bfloat16)
    context = HalfPrecision("bf16-true").forward_context if bf16_true else contextlib.nullcontext
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), context():
            loss = model.training_step(batch, i)
        loss.backward()
        if clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}




def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:  # a gloo group left to interpreter shutdown can abort the process (see test_process_group_exit.py)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    exit_now()  # succeeded: no interpreter shutdown, where gloo's teardown can still abort it


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


# ---------------------------------------------------------------------------- memory measurement


class TinyMLP(L.LightningModule):
    """A chain of Linear/ReLU layers (built-in Sequential adapter): its saved tensors are easy to reason about."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )

    def pipeline_loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(out, batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.model(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


MLP_BOUNDARY = 4  # stage 0: Linear, ReLU, Linear, ReLU; stage 1: Linear, ReLU, Linear (+ loss)


def mlp_data(n: int = GLOBAL_BATCH, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


class SavedBytesCounter:
    """Live bytes saved for backward (``saved_tensors_hooks``) and their peak, each storage counted once.

    ``pack`` returns a handle; autograd drops the handle when it frees the saved tensor (after the
    backward that used it, or with the graph), and a ``weakref.finalize`` on the handle releases
    the bytes. A storage counts the bytes between the lowest and highest byte its live saved
    views touch, so two ops saving the same tensor count once and a micro-batch sliced from the
    batch counts its own rows, not the whole batch (the profiler counts the same way). Storages in
    ``exclude`` (parameters, buffers) are not activations.
    """

    def __init__(self, exclude: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.exclude = exclude
        self.live = 0
        self.peak = 0
        self._spans: dict[int, dict[int, tuple[int, int]]] = {}  # storage address -> {handle id: (lo, hi)}
        self._bytes: dict[int, int] = {}
        self._ids = itertools.count()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _update(self, key: int) -> None:
        spans = self._spans.get(key)
        now = max(hi for _, hi in spans.values()) - min(lo for lo, _ in spans.values()) if spans else 0
        self.live += now - self._bytes.get(key, 0)
        self._bytes[key] = now
        if not spans:
            self._spans.pop(key, None)
            self._bytes.pop(key, None)
        self.peak = max(self.peak, self.live)

    def _release(self, key: int, hid: int) -> None:
        self._spans[key].pop(hid)
        self._update(key)

    def _pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.exclude or t.nelement() == 0:
            return t
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + size * (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())))
        hid = next(self._ids)
        self._spans.setdefault(key, {})[hid] = (lo, hi)
        self._update(key)
        handle = _Handle(t)
        weakref.finalize(handle, self._release, key, hid)
        return handle

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.t if isinstance(packed, _Handle) else packed

    def __enter__(self) -> SavedBytesCounter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


class _Handle:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def tensor_storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


class TinyConvBN(L.LightningModule):
    """Conv + BatchNorm chain (built-in Sequential adapter) for the deferred-BatchNorm check."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3),
        )

    def pipeline_loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(out, batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.model(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def image_data(n: int = 2 * GLOBAL_BATCH, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g))
