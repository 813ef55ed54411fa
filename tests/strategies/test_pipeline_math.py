"""Real gloo runs of PipelineStrategy against single-process references.

* Same math: gpipe, 1f1b and hybrid dp x pp runs end with the weights of a single-process run.
* Evaluation: validation during fit, ``trainer.validate`` / ``test`` / ``predict`` give the
  single-process loss and outputs.
* Memory: 1F1B keeps fewer micro-batches of activations alive than GPipe, as the cost model says.

To keep the suite fast, the module has ONE launch (a module-scoped fixture): four processes run the
hybrid checks (and auto_plan's dp x pp on replicas of unequal training and evaluation data, then evaluation data a pipeline cannot run), then two of them, on a fresh world of two, run every 2-rank check. Processes are torchrun-like (env vars, gloo),
so Lightning treats them as externally launched; weights come back through the strategy's
full-state-dict checkpoint gather.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import ResumableLoader, error_of, run_on_ranks  # noqa: E402
from _pipeline_models import (  # noqa: E402
    GLOBAL_BATCH,
    MLP_BOUNDARY,
    SavedBytesCounter,
    TinyConvBN,
    TinyGPT2,
    TinyMLP,
    build,
    image_data,
    mlp_data,
    reference_weights,
    tensor_storages,
    token_data,
    trainer_kwargs,
)

import lightning as L  # noqa: E402

N_MICRO = 8  # micro-batches per step in the 2-stage runs
VAL_BATCHES = 2
MATH_RUNS = [("transformer", "gpipe", 2, 8), ("transformer", "1f1b", 2, 8), ("gpt2", "gpipe", 2, 8), ("gpt2", "1f1b", 2, 8)]
HYBRID_RUNS = [("transformer", "1f1b", 2, 4), ("gpt2", "gpipe", 2, 4)]


def _val_data():
    return token_data(n=VAL_BATCHES * GLOBAL_BATCH, seed=1)


def _fit(rank: int, world: int, run: tuple[str, str, int, int], out: str, *, with_eval: bool = False) -> dict[str, Any]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    name, schedule, stages, n = run
    model = build(name)
    dp = world // stages
    loader = DataLoader(token_data(), batch_size=GLOBAL_BATCH // dp)
    strategy = PipelineStrategy(schedule=schedule, stages=stages, n_microbatches=n)
    kwargs = trainer_kwargs(world, strategy, out)
    result: dict[str, Any] = {}
    if with_eval:  # validation runs once, at the end of the only epoch (after the last step)
        kwargs["limit_val_batches"] = VAL_BATCHES
        val = DataLoader(_val_data(), batch_size=GLOBAL_BATCH)
    trainer = L.Trainer(**kwargs)
    trainer.fit(model, loader, val if with_eval else None)
    trainer.save_checkpoint(os.path.join(out, f"{name}-{schedule}-{world}.ckpt"))
    if rank == 0:
        torch.save(trainer.callback_metrics["train_loss"], os.path.join(out, f"{name}-{schedule}-{world}.loss"))
    if with_eval:
        result["fit_val_loss"] = trainer.callback_metrics["val_loss"].item()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["validate"] = trainer.validate(model, val, verbose=False)[0]["val_loss"]
            result["test"] = trainer.test(model, val, verbose=False)[0]["test_loss"]
        result["sync_dist_advice"] = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
        result["predict"] = [p.cpu() for p in trainer.predict(model, val)]
    return result


class _SavedBytesMeter(L.Callback):
    """Peak live saved-for-backward bytes during the training step ``measure`` (this rank's stage)."""

    def __init__(self, measure: int) -> None:
        self.measure = measure
        self.counter: SavedBytesCounter | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.measure:
            self.counter = SavedBytesCounter(exclude=tensor_storages(pl_module))
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.measure and self.counter is not None:
            self.counter.__exit__(None, None, None)


def _memory(world: int, schedule: str, out: str) -> dict[str, int]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    torch.manual_seed(0)
    # Step 0 is skipped: torch.distributed.pipelining runs an extra metadata-inference forward in it.
    meter = _SavedBytesMeter(measure=1)
    strategy = PipelineStrategy(schedule=schedule, stages=2, n_microbatches=N_MICRO, stage_boundaries=[MLP_BOUNDARY])
    kwargs = trainer_kwargs(world, strategy, out, callbacks=[meter])
    kwargs["max_steps"] = 2
    L.Trainer(**kwargs).fit(TinyMLP(), DataLoader(mlp_data(2 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
    assert meter.counter is not None
    return {"peak": meter.counter.peak, "live_after": meter.counter.live}


class _FirstBatchNormStats(L.Callback):
    def __init__(self) -> None:
        self.stats: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        bn = pl_module.model[1]  # on stage 0: the first BatchNorm (a DeferredBatchNorm now)
        self.stats.append({k: v.detach().clone() for k, v in bn.state_dict().items() if k.startswith(("running", "num"))})


def _deferred_batchnorm(world: int, out: str) -> dict[str, Any]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    def strategy() -> PipelineStrategy:
        return PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4, stage_boundaries=[3], deferred_batchnorm=True)

    stats = _FirstBatchNormStats()
    kwargs = trainer_kwargs(world, strategy(), out, callbacks=[stats])
    kwargs.update(max_steps=2, limit_val_batches=1, val_check_interval=1)  # validation inside the fit: an eval schedule is built
    class Validated(TinyConvBN):
        def validation_step(self, batch: Any, batch_idx: int) -> None:  # (the pipeline runs its loss in its place)
            pass

    model = Validated()
    trainer = L.Trainer(**kwargs)
    val = DataLoader(image_data(), batch_size=GLOBAL_BATCH)
    trainer.fit(model, DataLoader(image_data(), batch_size=GLOBAL_BATCH), val)
    path = os.path.join(out, "deferred_bn.ckpt")
    trainer.save_checkpoint(path)
    after = {"classes": [type(m).__name__ for m in model.model], "state": {k: v.clone() for k, v in model.state_dict().items()}}
    trainer.validate(model, val)  # the same strategy again, after the user's BatchNorms came back: eval mode, statistics untouched
    after["after_validate"] = {k: v.clone() for k, v in model.state_dict().items()}
    # the same strategy resumes its own checkpoint
    resumed = L.Trainer(**{**trainer_kwargs(world, strategy(), out), "max_steps": 3})
    resumed.fit(TinyConvBN(), DataLoader(image_data(), batch_size=GLOBAL_BATCH), ckpt_path=path)
    return {"stats": stats.stats, "after": after, "path": path, "resumed_steps": resumed.global_step}


class _FailAt(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("failing on purpose at step 2")


class _LossScaleMLP(TinyMLP):
    """A learned loss scale used only in the loss: no pipeline layer holds it; and a plain tensor (not a
    parameter of the module) handed to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(()))
        self.plain = torch.zeros((), requires_grad=True)

    def pipeline_loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        return super().pipeline_loss(out, batch) * self.log_scale.exp() + 0 * self.plain

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.parameters(), self.plain], lr=0.01)


def _loss_only_parameter(world: int, out: str) -> list[str]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4), out), "max_steps": 1})
        trainer.fit(_LossScaleMLP(), DataLoader(mlp_data(), batch_size=GLOBAL_BATCH))
    return [str(w.message) for w in caught if "belong to no pipeline layer" in str(w.message) or "not parameters of the module" in str(w.message)]


class _ExampleMLP(TinyMLP):
    """TinyMLP with an ``example_input_array``: Lightning's model summary runs a forward pass on it."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _UnfreezeMLP(TinyMLP):
    """Stage 0 (layers 0-3) frozen in epoch 0 and unfrozen at the start of epoch 1 (gradual unfreezing)."""

    def __init__(self) -> None:
        super().__init__()
        self.model[:MLP_BOUNDARY].requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.model[:MLP_BOUNDARY].requires_grad_(True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _unfreeze_reference(steps_per_epoch: int) -> dict[str, torch.Tensor]:
    """The same two epochs in one process, on whole batches."""
    torch.manual_seed(1234)
    model = _UnfreezeMLP()
    opt = model.configure_optimizers()
    x, y = mlp_data(steps_per_epoch * GLOBAL_BATCH).tensors
    for epoch in range(2):
        if epoch == 1:
            model.model[:MLP_BOUNDARY].requires_grad_(True)
        # Lightning's DistributedSampler(shuffle=True, seed=0) over one replica: a permutation seeded 0 + epoch
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            rows = order[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
            opt.zero_grad()
            F.mse_loss(model.model(x[rows]), y[rows]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unfreeze_later(world: int, out: str) -> dict[str, torch.Tensor]:
    """Unfrozen after the first epoch: torch's stage had recorded that its input needs no gradient, so a schedule
    built in epoch 0 sent none back ('Failed to run stage backward ... Output gradient: None')."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    torch.manual_seed(1234)
    model = _UnfreezeMLP()
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO, stage_boundaries=[MLP_BOUNDARY])
    L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": -1, "max_epochs": 2}).fit(
        model, DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _model_summary(world: int, out: str) -> dict[str, Any]:
    """Lightning's ModelSummary (on by default) under a pipeline: what it reports, and the callback afterwards."""
    from lightning.pytorch.callbacks import ModelSummary

    from lightning_distplan.strategies.pipeline import PipelineStrategy

    class Recording(ModelSummary):
        def summarize(self, summary_data: Any, total_parameters: int, trainable_parameters: int, *args: Any, **kwargs: Any) -> None:
            self.seen = (dict(summary_data), total_parameters, trainable_parameters)

    model, callback = _ExampleMLP(), Recording(max_depth=2)
    whole = sum(p.numel() for p in model.parameters())
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY])
    kwargs = {**trainer_kwargs(world, strategy, out, callbacks=[callback]), "max_steps": 1, "enable_model_summary": True}
    L.Trainer(**kwargs).fit(model, DataLoader(mlp_data(), batch_size=GLOBAL_BATCH))
    return {"whole": whole, "seen": getattr(callback, "seen", None), "own_summary": "_summary" not in vars(callback)}


def _failed_fit_then_retry(world: int, out: str) -> dict[str, Any]:
    """A fit that raises on every rank leaves each rank's module with its stage only; training it again is refused."""
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("transformer")
    trainer = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4), out, callbacks=[_FailAt()]))
    with pytest.raises(RuntimeError, match="on purpose"):
        trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    empty = sorted(k for k, v in model.state_dict().items() if v.numel() == 0)
    retry = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=4), out))
    try:
        retry.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
        refused = ""
    except InfeasiblePlanError as err:
        refused = str(err)
    return {"empty": empty, "refused": refused}


def _bf16_mixed(world: int, out: str) -> dict[str, Any]:
    """GPipe under Trainer(precision='bf16-mixed'): whether the stage's blocks ran in autocast, and the weights."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("transformer")
    autocast: list[bool] = []
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):  # those of this rank's stage run
            layer.register_forward_hook(lambda mod, args, output: autocast.append(torch.is_autocast_enabled("cpu")))
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO)
    trainer = L.Trainer(**trainer_kwargs(world, strategy, out, precision="bf16-mixed"))
    trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    state = trainer.strategy.lightning_module_state_dict()  # collective: the full module on every rank
    return {"autocast": autocast, "state": {k: v.detach().clone() for k, v in state.items()}}


def _bf16_true(world: int, out: str) -> dict[str, torch.Tensor]:
    """1F1B under Trainer(precision='bf16-true', gradient_clip_val=CLIP): the whole module after the fit."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("transformer")
    strategy = PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=N_MICRO)
    trainer = L.Trainer(**trainer_kwargs(world, strategy, out, precision="bf16-true", gradient_clip_val=CLIP))
    trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # whole again on every rank after the fit


def _whole_after_fit(world: int, out: str) -> dict[str, Any]:
    """The user's module after a pipeline fit, on every rank; then a second Trainer with a new strategy on it."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("transformer")
    # buffers on the last stage's layer: a persistent one (in the state_dict) and a non-persistent one (not)
    model.model.decoder.register_buffer("scale", torch.full((3,), 2.0))
    model.model.decoder.register_buffer("mask", torch.ones(4), persistent=False)
    first = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), "max_steps": 2})
    first.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    after_first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    second = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=N_MICRO), out), "max_steps": 2})
    second.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    return {"after_first": after_first, "buffers": buffers, "second_steps": second.global_step, "after_second": {k: v.detach().clone() for k, v in model.state_dict().items()}}


CLIP = 0.05  # below the model's gradient norm in every step, so every step is clipped


def _clipped(world: int, out: str, schedule: str) -> dict[str, torch.Tensor]:
    """A pipeline fit with Trainer(gradient_clip_val=CLIP) (by norm, Lightning's default algorithm)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("gpt2")  # tied embeddings: a parameter on both stages counts once in the norm
    strategy = PipelineStrategy(schedule=schedule, stages=2, n_microbatches=N_MICRO)
    trainer = L.Trainer(**trainer_kwargs(world, strategy, out, gradient_clip_val=CLIP))
    trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    return {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


class _NormLoggingGPT2(TinyGPT2):
    """Records, at its first optimizer step, the strategy's whole-model gradient norms and Lightning's own grad_norm
    (which reads the process's stage only)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        if self.global_step == 0:
            strategy = self.trainer.strategy
            self.norms = {"2": strategy.grad_norm(), "1": strategy.grad_norm(1.0), "inf": strategy.grad_norm(float("inf")),
                          "lightning": grad_norm(self, norm_type=2)["grad_2.0_norm_total"]}


def _grad_norms(world: int, out: str) -> dict[str, Any]:
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    torch.manual_seed(1234)
    model = _NormLoggingGPT2()
    strategy = PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=N_MICRO)
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(token_data(GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
    try:
        strategy.grad_norm(-1)
        refused = ""
    except InfeasiblePlanError as err:
        refused = str(err)
    hook_warnings = [str(w.message) for w in caught if "own pipeline stage" in str(w.message)]
    return {**{k: float(v) for k, v in model.norms.items()}, "refused": refused, "hook_warnings": hook_warnings}


def _short_last_batch(world: int, out: str) -> tuple[str, int, bool, int]:
    """70 samples in batches of 16: the epoch's last batch (6) does not split into 4 micro-batches. The refusal leaves
    the module whole with its starting weights (it held one stage, and a retry was refused), so drop_last=True trains it."""
    from lightning_distplan.errors import BatchNotFactorableError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    # limit_train_batches=1 (one batch, as fast_dev_run) never reaches the short batch: it runs
    one = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4), out), "limit_train_batches": 1, "max_epochs": 1})
    one.fit(build("transformer"), DataLoader(token_data(70), batch_size=16))
    assert one.global_step == 1
    trainer = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4), out))
    model = build("transformer")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    message = ""
    try:
        trainer.fit(model, DataLoader(token_data(70), batch_size=16))
    except BatchNotFactorableError as err:
        message = str(err)
    state = model.state_dict()
    unchanged = list(state) == list(start) and all(torch.equal(state[k], v) for k, v in start.items())
    retry = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=4), out), "max_steps": 2})
    retry.fit(model, DataLoader(token_data(70), batch_size=16, drop_last=True))
    return message, trainer.global_step, unchanged, retry.global_step


STEPS_ACC = 3  # optimizer steps of the accumulation run (2 loader batches each)


class _ValidatedGPT2(TinyGPT2):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)


def _frozen_tied_gpt2() -> L.LightningModule:
    """TinyGPT2 (built as build("gpt2") builds it) with its tied embedding (wte = lm_head) frozen, under weight
    decay, which moves any parameter that gets a gradient, zeros included."""
    torch.manual_seed(1234)
    model = _ValidatedGPT2()
    model.model.transformer.wte.requires_grad_(False)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)  # type: ignore[method-assign]
    return model


def _tied_and_frozen(world: int, out: str) -> dict[str, Any]:
    """GPT-2's tied embedding across the two stages under Trainer(accumulate_grad_batches=2), and frozen."""
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("gpt2")
    seen = _PlanSeen()
    kwargs = {**trainer_kwargs(world, PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=N_MICRO), out, callbacks=[seen]),
              "max_steps": STEPS_ACC}
    L.Trainer(**kwargs, accumulate_grad_batches=2).fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    frozen = _frozen_tied_gpt2()
    trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), "max_steps": 2})
    trainer.fit(frozen, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    state = lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()}  # noqa: E731
    # The same Trainer validating another module (trainer.test(best) after fit) runs that module, not the fitted one.
    other = _frozen_tied_gpt2()
    trainer.limit_val_batches = 1.0  # the fit ran without validation
    val = trainer.validate(other, DataLoader(token_data(GLOBAL_BATCH, seed=5), batch_size=GLOBAL_BATCH), verbose=False)[0]["val_loss"]
    # A plan of 2 flushes per step run without Trainer(accumulate_grad_batches=2) would train on half its global batch.
    try:
        L.Trainer(**trainer_kwargs(world, PipelineStrategy(plan=seen.plan), out)).fit(build("gpt2"), DataLoader(token_data(), batch_size=GLOBAL_BATCH))
        refused = "trained"
    except InfeasiblePlanError as err:
        refused = str(err)
    return {"accumulated": state(model), "frozen": state(frozen), "other_val_loss": val, "plan": seen.plan, "refused": refused}


class _PlanSeen(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.plan = trainer.strategy.plan


def _reference_accumulated(model: L.LightningModule, steps: int, accumulate: int) -> dict[str, torch.Tensor]:
    """The LightningModule's own training_step, ``accumulate`` loader batches per optimizer step (Lightning
    divides each loss by ``accumulate``), over the batches DistributedSampler(shuffle, seed 0) gives one replica."""
    opt = model.configure_optimizers()
    data = token_data()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    batches = iter(DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order))
    for _ in range(steps):
        opt.zero_grad()
        for i in range(accumulate):
            (model.training_step(next(batches), i) / accumulate).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_by_rank(rank: int, world: int, out: str) -> str:
    """The user's own DistributedSampler shards by the global rank: each stage of the one replica reads other samples."""
    from torch.utils.data.distributed import DistributedSampler

    from lightning_distplan.errors import BatchFormatError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    data = token_data()
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(data, num_replicas=world, rank=rank, seed=3))
    trainer = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), use_distributed_sampler=False)
    try:
        trainer.fit(build("gpt2"), loader)
    except BatchFormatError as err:
        refused = f"{trainer.global_step}: {err}"
    else:
        refused = f"{trainer.global_step}: trained"
    # Floats only (a random augmentation may differ between ranks and pair correctly): trained, with a warning.
    floats = mlp_data(4 * GLOBAL_BATCH)
    loader = DataLoader(floats, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(floats, num_replicas=world, rank=rank, seed=3))
    trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), "max_steps": 2},
                        use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyMLP(), loader)
    warned = [str(w.message) for w in caught if "read different training batches" in str(w.message)]
    return refused + f" | floats: {trainer.global_step} steps, {len(warned)} warning(s)"


def _stages_of_other_lengths(rank: int, world: int, out: str) -> dict[str, Any]:
    """Each rank's own data (use_distributed_sampler=False), 16 samples on rank 0 and 12 on rank 1, in batches of 4:
    the one replica's stages hold different numbers of batches. PipelineStrategy compared the first batch alone (floats
    only: warned) and trained 3 steps, then stage 0 waited for good at the 4th, which stage 1 has no batch for (gloo's
    timeout); auto_plan's pinned pipeline the same after 1 step; unpinned, planning said the pipeline "would skip up to
    the epoch's last 8 samples per replica" (no skip: its stages cannot run together) before running dp_ga. What each
    raised and its steps, and for the unpinned plan (``_WideMLP``, 2 steps), the plan and what planning said of the
    pipelines (rank 0's log). Run with a 20 s timeout, so that a hang fails here quickly."""
    import datetime
    import logging

    from lightning_utilities.core import rank_zero

    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    timeout = datetime.timedelta(seconds=20)
    results: dict[str, Any] = {}
    for kind, strategy in (
        ("pipeline", PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY], timeout=timeout)),
        ("pinned", AutoPlanStrategy(strategy="gpipe", stages=2, micro_batch_size=4, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                    timeout=timeout)),
    ):
        trainer = L.Trainer(**{**trainer_kwargs(world, strategy, os.path.join(out, f"lengths-{kind}"), use_distributed_sampler=False),
                               "max_steps": -1, "max_epochs": 1})
        raised = error_of(lambda: trainer.fit(TinyMLP(), DataLoader(mlp_data(16 if rank == 0 else 12, seed=rank), batch_size=4)))
        results[kind] = (raised and f"{raised[0]}: {raised[1]}", trainer.global_step)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(rank_zero.log.name).addHandler(handler)
    auto = AutoPlanStrategy(timeout=timeout)
    trainer = L.Trainer(**{**trainer_kwargs(world, auto, os.path.join(out, "lengths-unpinned"), use_distributed_sampler=False), "max_steps": 2})
    raised = error_of(lambda: trainer.fit(_WideMLP(), DataLoader(mlp_data(16 if rank == 0 else 12, seed=rank), batch_size=4)))
    logging.getLogger(rank_zero.log.name).removeHandler(handler)
    ranked = [] if auto.outcome is None else [(c.plan.strategy, c.prediction.feasible, c.prediction.reason, c.skipped_samples_differ)
                                              for c in auto.outcome.candidates]
    results["unpinned"] = {"raised": raised, "plan": None if raised else trainer.strategy.plan.describe(), "ranked": ranked,
                           "said": [m for m in said if m.startswith("auto_plan: not running ")]}
    return results


def _guessed_loss_differs(world: int, out: str) -> dict[str, Any]:
    """GPT-2 whose training_step adds a weight penalty the built-in adapter's loss (the model's own LM loss) does not
    have: the pipeline trained the plain loss, silently. Refused before the model is cut, the module whole; with a
    pipeline_loss that matches, it trains."""
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    class Penalised(TinyGPT2):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []  # what training_step was called on: the comparison leaves no trace in it

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(batch_idx)
            return super().training_step(batch, batch_idx) + 100.0 * self.model.lm_head.weight.pow(2).mean()

    class Declared(Penalised):
        def pipeline_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:  # GPT-2's own shifted LM loss, plus the penalty
            shift, labels = logits[..., :-1, :], batch[1][..., 1:]
            return F.cross_entropy(shift.reshape(-1, shift.size(-1)), labels.reshape(-1)) + 100.0 * self.model.lm_head.weight.pow(2).mean()

    torch.manual_seed(1234)
    model = Penalised()
    whole = sum(p.numel() for p in model.parameters())
    trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), "max_steps": 1})
    refused = ""
    try:
        trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    except InfeasiblePlanError as err:
        refused = str(err)
    result = {"refused": refused, "steps": trainer.global_step, "whole": sum(p.numel() for p in model.parameters()) == whole,
              "seen": list(model.seen)}
    torch.manual_seed(1234)
    declared = Declared()
    ok = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out), "max_steps": 1})
    try:
        ok.fit(declared, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    except InfeasiblePlanError as err:
        result["declared_refused"] = str(err)
    result["declared_steps"] = ok.global_step
    return result


def _plateau_on_unlogged(world: int, out: str) -> str:
    """ReduceLROnPlateau on a metric the module logs but a pipeline does not: refused before the first step."""
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = build("gpt2")

    def configure_optimizers() -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "val_acc"}}

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    trainer = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out))
    whole = sum(p.numel() for p in model.parameters())
    try:
        trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    except InfeasiblePlanError as err:
        return f"{trainer.global_step} {sum(p.numel() for p in model.parameters()) == whole}: {err}"
    return f"{trainer.global_step}: trained"


class _BackboneMLP(TinyMLP):
    @property
    def backbone(self) -> nn.Module:  # what BackboneFinetuning freezes (the first stage's layers)
        return self.model[:MLP_BOUNDARY]


def _callbacks_a_pipeline_cannot_serve(world: int, out: str) -> list[str]:
    """A ModelCheckpoint on a metric the pipeline does not log, and StochasticWeightAveraging: each refused before
    the model is cut into stages (they failed after an epoch, or mid-fit with a tensor size mismatch, leaving each
    rank's module holding one stage), and the module stays whole."""
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint, ModelPruning, StochasticWeightAveraging

    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    got = []
    for callback in (ModelCheckpoint(monitor="val_mae", dirpath=out), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1),
                     ModelPruning("l1_unstructured", amount=0.5), BackboneFinetuning(unfreeze_backbone_at_epoch=1)):
        model = _BackboneMLP()
        whole = sum(p.numel() for p in model.parameters())
        trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out),
                               "callbacks": [callback], "max_epochs": 3, "enable_checkpointing": True})
        try:
            trainer.fit(model, DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
            verdict = "trained"
        except InfeasiblePlanError as err:
            verdict = str(err)
        got.append(f"{trainer.global_step} {sum(p.numel() for p in model.parameters()) == whole}: {verdict}")
    return got


class _LateGroupMLP(TinyMLP):
    """Trains stage 1's layers, then adds stage 0's as a second param group at the start of epoch 1."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model[MLP_BOUNDARY:].parameters(), lr=0.1)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.trainer.optimizers[0].add_param_group({"params": list(self.model[:MLP_BOUNDARY].parameters()), "lr": 0.01})


def _param_group_added_during_the_fit(world: int, out: str) -> str:
    """optimizer.add_param_group mid-fit hands each process parameters of the other stage (emptied tensors there)."""
    from lightning_distplan.errors import InfeasiblePlanError
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    trainer = L.Trainer(**{**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out),
                           "max_steps": -1, "max_epochs": 2})
    try:
        trainer.fit(_LateGroupMLP(), DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
        verdict = "trained"
    except InfeasiblePlanError as err:
        verdict = str(err)
    return f"{trainer.global_step}: {verdict}"


class _PenaltyLossMLP(TinyMLP):
    def pipeline_loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:  # a penalty on stage 0's first weight
        return F.mse_loss(out, batch[1]) + 1e-4 * self.model[0].weight.pow(2).sum()


class _VectorLossMLP(TinyMLP):
    def pipeline_loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(out, batch[1], reduction="none")


def _losses_the_last_stage_cannot_compute(world: int, out: str) -> list[str]:
    """Refused at the first step on the last stage alone, they left the other stages with gloo's 'Connection closed
    by peer' (and, had the last stage's process lived on, waiting the timeout out)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    got = []
    for model in (_PenaltyLossMLP(), _VectorLossMLP()):
        whole = sum(p.numel() for p in model.parameters())
        trainer = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO), out))
        try:
            trainer.fit(model, DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
            verdict = "trained"
        except (ValueError, TypeError) as err:  # ModelSplitError, BatchFormatError
            verdict = f"{type(err).__name__}: {err}"
        got.append(f"{trainer.global_step} {sum(p.numel() for p in model.parameters()) == whole}: {verdict}")
    return got


class _Center(nn.Module):
    """A linear layer that keeps a running mean of its output by *re-assigning* a buffer (not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mu", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.training:
            self.mu = 0.9 * self.mu + 0.1 * x.detach().mean(0)
        return x - self.mu


class _RunningLoss(nn.Module):
    """A loss that keeps a running mean of itself in a buffer (as DINO's loss keeps its center): state no pipeline
    layer holds, which only the last stage moves."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(()))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, target)
        self.mean.mul_(0.9).add_(0.1 * loss.detach())
        return loss


class _IdsThenCenter(L.LightningModule):
    """Token ids cross the stage boundary (layer 0 returns a *list* [hidden, ids]); layer 1 embeds them again and
    runs a :class:`_Center`; the loss counts its calls and keeps a running mean (:class:`_RunningLoss`). torch's
    first-step shape inference must leave no trace: ids in range, the buffer as a single process has it, the loss
    called once per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Embedding(10, 8)
        self.second = nn.Embedding(10, 8)
        self.center = _Center()
        self.head = nn.Linear(8, 2)
        self.criterion = _RunningLoss()
        self.loss_calls = 0

    def _first(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return [self.first(ids).mean(1), ids]

    def _second(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.center(h + self.second(ids).mean(1))

    def _loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        self.loss_calls += 1
        return self.criterion(out, batch[1])

    def pipeline_spec(self) -> Any:
        from lightning_distplan import PipelineSpec

        return PipelineSpec(
            layers=[_Call(self, "_first", self.first), _Call(self, "_second", self.second, self.center), self.head],
            inputs=lambda batch: batch[0], loss=self._loss,
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(self.head(self._second(*self._first(batch[0]))), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Call(nn.Module):
    """A pipeline layer that runs one of the module's methods (holding the sub-modules that method uses)."""

    def __init__(self, owner: L.LightningModule, method: str, *modules: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self._run = lambda *args: getattr(owner, method)(*args)
        self.distplan_name = method

    def forward(self, *args: torch.Tensor) -> Any:
        return self._run(*args)


def _ids_data(n: int = 2 * GLOBAL_BATCH) -> Any:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, 10, (n, 5), generator=g), torch.randint(0, 2, (n,), generator=g))


def _shape_inference(world: int, out: str) -> dict[str, Any]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = _IdsThenCenter()
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO, stage_boundaries=[1])
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": 2})
    trainer.fit(model, DataLoader(_ids_data(), batch_size=GLOBAL_BATCH))
    path = os.path.join(out, "ids_then_center.ckpt")
    trainer.save_checkpoint(path)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "loss_calls": model.loss_calls,
            "saved": torch.load(path, weights_only=False)["state_dict"] if world > 1 else None}


def _many_shapes(world: int, out: str) -> dict[str, Any]:
    """Batches of 10 different sizes: the schedules kept stay bounded, with one warning."""
    from lightning_distplan.strategies.pipeline import _SCHEDULE_CACHE, PipelineStrategy

    sizes = [2 * (i + 1) for i in range(_SCHEDULE_CACHE + 2)]
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    loader = DataLoader(mlp_data(edges[-1]), batch_sampler=[list(range(a, b)) for a, b in zip(edges, edges[1:])])
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY])
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": len(sizes)}, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyMLP(), loader)
    warned = [str(w.message) for w in caught if "came in more than" in str(w.message)]
    return {"steps": trainer.global_step, "kept": len(strategy._schedules), "warned": warned}


class _DropoutChain(TinyMLP):
    """Stage 0: Linear, Dropout, Dropout (a second draw only stage 0 makes) | stage 1: Linear, Dropout, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 4))


def _dropout_streams(world: int, out: str) -> dict[str, Any]:
    """After seed_everything (the same seed on every rank): each stage's own dropout masks, and the process's
    generator left alike on both ranks (what a loader's random augmentation and worker seeds draw from)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    L.seed_everything(7, verbose=False)
    model = _DropoutChain()
    masks: list[torch.Tensor] = []
    for d in (model.model[1], model.model[4]):  # the first Dropout of each stage, both on (micro-batch, 32)
        d.register_forward_hook(lambda mod, args, out: masks.append((out == 0).clone()) if torch.is_grad_enabled() else None)
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[3])
    L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": 2}).fit(model, DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
    return {"masks": masks, "after": torch.rand(4)}


class _GradientLives(L.Callback):
    """At the first backward of each step on this stage: how many of the stage's gradients of the previous batch are alive."""

    def __init__(self, read_at_zero_grad: bool = False) -> None:
        self.refs: list[weakref.ref] = []
        self.alive: list[tuple[int, int, int]] = []
        self.batch = -1
        self.read_at_zero_grad: list[int] | None = [] if read_at_zero_grad else None
        if read_at_zero_grad:  # a hook Lightning calls before zero_grad: it must still find last step's gradients
            self.on_before_zero_grad = self._count_gradients  # type: ignore[method-assign]

    def _count_gradients(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        assert self.read_at_zero_grad is not None
        self.read_at_zero_grad.append(sum(p.grad is not None for p in pl_module.parameters()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch = batch_idx
        if batch_idx == 0:
            first = next(m for m in trainer.strategy._stage_module.modules() if isinstance(m, nn.Linear))
            first.register_full_backward_hook(self._at_backward)

    def _at_backward(self, *_: Any) -> None:
        if not self.alive or self.alive[-1][0] != self.batch:
            self.alive.append((self.batch, sum(r() is not None for r in self.refs), len(self.refs)))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.refs = [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]


def _old_gradients(world: int, out: str) -> dict[str, Any]:
    """Accumulating 2 batches per step over 4 batches, with Lightning's stock zero_grad, then with an on_before_zero_grad hook."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    res: dict[str, Any] = {}
    for name, probe in (("stock", _GradientLives()), ("hooked", _GradientLives(read_at_zero_grad=True))):
        torch.manual_seed(0)
        model = TinyMLP()
        strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=N_MICRO, stage_boundaries=[MLP_BOUNDARY])
        kwargs = {**trainer_kwargs(world, strategy, out, callbacks=[probe], accumulate_grad_batches=2), "max_steps": 2}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L.Trainer(**kwargs).fit(model, DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
        res[name] = {"hook_warnings": [str(w.message) for w in caught if "own pipeline stage" in str(w.message)], "alive": probe.alive, "read_at_zero_grad": probe.read_at_zero_grad, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return res


class _ViewBias(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b.view(1, -1)  # b's gradient shares the storage of the gradient the stage receives


class _ViewBiasMLP(TinyMLP):
    """Stage 0 ends in ``x + b.view(1, -1)``: autograd keeps ``b.grad`` in the pipeline's receive buffer, which the
    next flush receives into. ``keep_zeros``: zero_grad(set_to_none=False), which zeroes that storage in place."""

    def __init__(self, keep_zeros: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.keep_zeros = keep_zeros
        self.model = nn.Sequential(nn.Linear(16, 8), _ViewBias(8), nn.Linear(8, 4))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not self.keep_zeros)


def _view_bias_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g) * 3)


def _view_bias_reference(keep_zeros: bool, accumulate: int) -> dict[str, torch.Tensor]:
    model = _ViewBiasMLP(keep_zeros)
    opt = model.configure_optimizers()
    for i, batch in enumerate(DataLoader(_view_bias_data(), batch_size=2)):
        if i % accumulate == 0:
            opt.zero_grad(set_to_none=not keep_zeros)
        (model.training_step(batch, i) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gradients_in_receive_buffers(world: int, out: str) -> dict[tuple[bool, int], dict[str, torch.Tensor]]:
    """Micro-batches of one sample, the loader in order, 2 flushes per step (or 1 with zeroed, kept gradients)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    res = {}
    for keep_zeros, accumulate in ((False, 2), (True, 1), (True, 2)):
        model = _ViewBiasMLP(keep_zeros)
        strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[2])
        kwargs = {**trainer_kwargs(world, strategy, out, accumulate_grad_batches=accumulate, use_distributed_sampler=False),
                  "max_steps": -1, "max_epochs": 1}
        L.Trainer(**kwargs).fit(model, DataLoader(_view_bias_data(), batch_size=2))
        res[(keep_zeros, accumulate)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


class _PlanEachEpoch(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plan = trainer.strategy.plan
        self.seen.append((trainer.accumulate_grad_batches, plan.accumulate_grad_batches, plan.global_batch_size))


def _flushes_that_change_and_a_resume_under_auto_plan(world: int, out: str) -> dict[str, Any]:
    """A GradientAccumulationScheduler takes a registered pipeline from 1 to 2 flushes per step in epoch 1; the fit
    resumed from its checkpoint under auto_plan (same global batch) plans again, since auto_plan runs one flush a step."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_distplan.strategies.pipeline import PipelineStrategy

    seen = _PlanEachEpoch()
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY])
    kwargs = {**trainer_kwargs(world, strategy, out, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2}), seen]), "max_steps": -1,
              "max_epochs": 2}
    trainer = L.Trainer(**kwargs)
    trainer.fit(TinyMLP(), DataLoader(mlp_data(32), batch_size=8))
    ckpt = os.path.join(out, "flushes.ckpt")
    trainer.save_checkpoint(ckpt)
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    auto = AutoPlanStrategy(profile_repeats=1)
    resumed = L.Trainer(**{**trainer_kwargs(world, auto, out, accumulate_grad_batches=2), "max_steps": -1, "max_epochs": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(TinyMLP(), DataLoader(mlp_data(32), batch_size=4), ckpt_path=ckpt)
    return {"seen": seen.seen, "stored": torch.load(ckpt, weights_only=False)["distplan_plan"], "resumed": resumed.strategy.plan,
            "resumed_source": auto.outcome.source, "resumed_steps": resumed.global_step}


class _ShiftedData(torch.utils.data.Dataset):
    """mlp_data's samples, their inputs shifted by ``offset`` (an epoch-start hook sets it, as one changing the data)."""

    def __init__(self, n: int) -> None:
        self.data, self.offset = mlp_data(n, seed=5), 0.0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        return x + self.offset, y


class _EvaluationSeen(L.Callback):
    """Each evaluation batch run (where: its global step for validation), its index, ``is_last_batch`` and whether its
    inputs were shifted by the ``on_*_epoch_start`` hook; ``save_at``: a checkpoint at the first validation's batch of
    that index, as an exception in its step left the loop (OnExceptionCheckpoint's: the step started, not processed)."""

    def __init__(self, save_at: str | None = None) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.save_at = save_at

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.val_dataloaders.dataset.offset = 100.0

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.test_dataloaders.dataset.offset = 100.0

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.predict_dataloaders.dataset.offset = 100.0

    def _seen(self, trainer: L.Trainer, where: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((where, batch_idx, trainer._active_loop.batch_progress.is_last_batch, float(batch[0][0, 0]) > 50))

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._seen(trainer, trainer.global_step, batch, batch_idx)

    def on_test_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._seen(trainer, "test", batch, batch_idx)

    def on_predict_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._seen(trainer, "predict", batch, batch_idx)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.save_at is not None and trainer.global_step == 2 and batch_idx == 1:
            progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
            progress.total.processed -= 1
            progress.current.processed -= 1
            trainer.save_checkpoint(self.save_at)
            progress.total.processed += 1
            progress.current.processed += 1


def _evaluation_restarted_and_epoch_start_hooks(world: int, out: str) -> dict[str, Any]:
    """The evaluation batches a pipeline runs (each rank's first fetched ahead, for the run-start checks), as DDP runs
    them. A fit resumed from a checkpoint of its first validation's batch 1 (validation every 2 of 4 steps, 5 batches)
    ran the whole validation again: its first batch fetched ahead, the fetcher's length was cleared, and Lightning's
    count of the batches run before (``fetched += ready``) ended nothing; it now runs the 4 left (batch 4 of those the
    last), and under limit_val_batches=3 the 2 left. An ``on_validation_epoch_start`` / ``on_test_epoch_start`` /
    ``on_predict_epoch_start`` hook shifting the data (num_workers=0) did not reach batch 0, fetched in
    ``on_*_start`` before it: it does now."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    def trainer(callback: _EvaluationSeen, limit: float | int) -> L.Trainer:
        strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY])
        return L.Trainer(**{**trainer_kwargs(world, strategy, out, callbacks=[callback], use_distributed_sampler=False),
                            "limit_val_batches": limit, "max_steps": 4, "val_check_interval": 2})

    results: dict[str, Any] = {}
    for limit in (1.0, 3):
        path = os.path.join(out, f"mid-validation-{limit}.ckpt")
        first = _EvaluationSeen(save_at=path)
        torch.manual_seed(0)
        trainer(first, limit).fit(_PredictedMLP(), DataLoader(mlp_data(16, seed=1), batch_size=4), DataLoader(_ShiftedData(20), batch_size=4))
        resumed = _EvaluationSeen()
        trainer(resumed, limit).fit(_PredictedMLP(), DataLoader(mlp_data(16, seed=1), batch_size=4),
                                    DataLoader(_ShiftedData(20), batch_size=4), ckpt_path=path)
        results[limit] = first.seen, resumed.seen
    evaluated = _EvaluationSeen()
    again = L.Trainer(**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY]),
                                       out, callbacks=[evaluated], use_distributed_sampler=False))
    again.test(_PredictedMLP(), DataLoader(_ShiftedData(8), batch_size=4))
    again.predict(_PredictedMLP(), DataLoader(_ShiftedData(8), batch_size=4))
    results["test, predict"] = evaluated.seen
    return results


def _two_rank_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    results["shape_inference"] = _shape_inference(world, out)
    results["many_shapes"] = _many_shapes(world, out)
    results["plateau"] = _plateau_on_unlogged(world, out)
    results["guessed_loss"] = _guessed_loss_differs(world, out)
    results["callbacks"] = _callbacks_a_pipeline_cannot_serve(world, out)
    results["sharded"] = _sharded_by_rank(rank, world, out)
    results["other lengths"] = _stages_of_other_lengths(rank, world, out)
    results["tied_frozen"] = _tied_and_frozen(world, out)
    results["short_last"] = _short_last_batch(world, out)
    results["clipped"] = _clipped(world, out, "1f1b")
    results["whole"] = _whole_after_fit(world, out)
    results["bf16_mixed"] = _bf16_mixed(world, out)
    results["bf16_true"] = _bf16_true(world, out)
    for run in MATH_RUNS:
        results[run[:2]] = _fit(rank, world, run, out, with_eval=run[:2] == ("transformer", "gpipe"))
    for schedule in ("gpipe", "1f1b"):
        results[("memory", schedule)] = _memory(world, schedule, out)
    results["deferred_bn"] = _deferred_batchnorm(world, out)
    results["failed"] = _failed_fit_then_retry(world, out)
    results["loss_only"] = _loss_only_parameter(world, out)
    results["summary"] = _model_summary(world, out)
    results["unfreeze"] = _unfreeze_later(world, out)
    results["late_group"] = _param_group_added_during_the_fit(world, out)
    results["grad_norms"] = _grad_norms(world, out)
    results["bad_losses"] = _losses_the_last_stage_cannot_compute(world, out)
    results["old_grads"] = _old_gradients(world, out)
    results["receive_buffers"] = _gradients_in_receive_buffers(world, out)
    results["flushes"] = _flushes_that_change_and_a_resume_under_auto_plan(world, out)
    results["eval_restart"] = _evaluation_restarted_and_epoch_start_hooks(world, out)
    results["reduce_unused"] = _reduce_unused_worker(rank, world)  # the gradient reduce alone, over the same group
    results["dropout"] = _dropout_streams(world, out)  # last: it seeds the process's generator
    return results


def _hybrid_worker(rank: int, world: int, out: str) -> None:
    for run in HYBRID_RUNS:
        _fit(rank, world, run, out)


class _StepsAtEpochEnd(L.Callback):
    """The global step at each epoch's end, and the weights of this rank's stage at the fit's start."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = {k: v.detach().clone() for k, v in trainer.strategy._stage_module.state_dict().items()}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append(trainer.global_step)


class _Stream(torch.utils.data.IterableDataset):
    """The samples of a dataset as a stream: no length."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)


class _SizedStream(_Stream):
    """A stream whose length is its rank's own number of samples."""

    def __len__(self) -> int:
        return len(self.data)


class _ReadSamples(torch.utils.data.Dataset):
    """A dataset that records the indices of the samples read from it (``read``)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data, self.read = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        self.read.append(i)
        return self.data[i]


class _MissingSamples(torch.utils.data.Dataset):
    """A dataset whose samples from ``first_missing`` on raise IndexError where they are read (a rank's broken data)."""

    def __init__(self, data: TensorDataset, first_missing: int) -> None:
        self.data, self.first_missing = data, first_missing

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        if i >= self.first_missing:
            raise IndexError(f"no sample {i} on this rank")
        return self.data[i]


class _UnsizedOnThisRank(DataLoader):
    """A DataLoader whose length cannot be read (a rank whose shard index is missing): its ``__len__`` raises ValueError."""

    def __len__(self) -> int:
        raise ValueError("no shard index on this rank")


class _ReloadedUnsizedOnRank3(TinyMLP):
    """Its train loader is loaded again each epoch (reload_dataloaders_every_n_epochs=1): ``data`` in batches of 4, then
    of 2, whose length rank 3 cannot read (_UnsizedOnThisRank)."""

    def __init__(self, rank: int, data: TensorDataset) -> None:
        super().__init__()
        self.rank, self.data = rank, data

    def train_dataloader(self) -> DataLoader:
        first = self.trainer.current_epoch == 0
        return (DataLoader if first or self.rank != 3 else _UnsizedOnThisRank)(self.data, batch_size=4 if first else 2)


class _UnsizedSampler(torch.utils.data.Sampler):
    """The first ``n`` indices, in order, whose length cannot be read (its ``__len__`` raises ValueError)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        raise ValueError("no shard index on this rank")


class _CountedBatches(torch.utils.data.BatchSampler):
    """A batch sampler of ``n`` samples that counts its batches itself (not from its sampler's length)."""

    def __init__(self, sampler: Any, n: int, batch_size: int) -> None:
        super().__init__(sampler, batch_size, drop_last=False)
        self.n = n

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


class _WideMLP(TinyMLP):
    """TinyMLP's chain 2048 wide (8.4M parameters, little compute per sample): on 4 gloo ranks a pipeline, all-reducing
    half the gradients or none, is predicted faster than dp_ga, which all-reduces them all."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                   nn.Linear(2048, 4))


class _EvaluatedMLP(TinyMLP):
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:  # (the pipeline runs its loss in its place)
        pass

    def test_step(self, batch: Any, batch_idx: int) -> None:
        pass


def _unequal_val_data(rank: int) -> TensorDataset:
    """Each replica's own evaluation data: 8 samples on replica 0 (ranks 0, 1), 4 on replica 1 (ranks 2, 3)."""
    return mlp_data(8, seed=10) if rank < 2 else mlp_data(4, seed=11)


def _two_rows_per_sample(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn making two rows of each sample (an augmentation's two views): batches of 4 indices hold 8 rows."""
    x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    return torch.cat([x, x]), torch.cat([y, y])


class _RowsSeen(TinyMLP):
    """TinyMLP recording each step's batch as this rank reads it: the first feature of each row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[float]] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.rows.append(batch[0][:, 0].tolist())


def _replicas_of_unequal_data_under_auto_plan(rank: int, world: int, out: str) -> dict[str, Any]:
    """auto_plan's pipeline, dp=2 x pp=2, where each rank reads data of its own (use_distributed_sampler=False):
    replica 0's ranks 14 samples, replica 1's 16, in loader batches of 4 (4 batches each, as DDP needs), from a dataset
    from a stream (its length unknown) and from a stream with each rank's own length (Lightning stopped each rank where
    its length said: replica 1 after 2 steps, replica 0 after 1, which hung likewise). A pipeline step takes 8 samples per replica: 16 fill 2, 14 fill 1, and the
    replica stepping twice waited in the replicas' gradient all-reduce for good. Replica 0 has the fewer, so that rank 0,
    which warns for every replica, has samples of its own beyond its whole steps (6): its own figure is no replica's skip. Run on a group of its own with a 120 s
    timeout (set up by Lightning, the port in the environment), so that a hang fails here rather than holding the launch.
    The sized dataset records the samples read from it (``read``).

    The dataset's fit also validates (sanity check and each epoch) on evaluation data of each replica's own, 8 and 4
    samples in batches of 4, and then a plain PipelineStrategy validates and tests a fresh model on it: every
    evaluation step all-reduced its loss over all ranks, so the replica with 2 batches waited for good (gloo's recv
    timeout) at its second. ``evaluated``: (val_loss, test_loss, the whole model's loss on all 12 samples).

    ``equal``: every rank 20 samples of its own, 2 steps of 8 and 4 left over per replica: the shortfall was read as of
    a dataset to shard over the ranks, none where the sampler does not name its dataset (the samples skipped unsaid; 2
    where it does). ``refused``: rank 3's loader yields batches of strings after its first step's (its size unreadable,
    on that rank alone): it raised alone, and the other ranks waited in the gradient all-reduce (or p2p) until gloo
    gave up; what each rank raised. ``failed``: rank 3's Dataset raises IndexError at its second step's samples (any
    error of that rank's loader, not a refusal of this package's): the same, and where rank 3's traceback ends.
    ``unsized sampler`` and ``unsized``: rank 3's sampler's ``__len__`` (read as the pipeline's loader counts the epoch's
    samples), and its DataLoader's (read as an unpinned auto_plan plans: samples_per_rank), raise ValueError: the same.
    ``unsized loader``: rank 3's DataLoader's ``__len__`` under the pinned plan, first read as the loader is set up
    (Rechunking.wrap, before the pipeline's loader agrees on the epoch's steps): the same. ``reloaded unsized``: the same
    where the loader is loaded again for epoch 1 in batches of 2 (epoch 0's were 4), an OnExceptionCheckpoint saving at
    the error: what each rank raised, and rank 0's the epoch's progress the checkpoint holds.

    ``doubled``: every rank 16 samples of its own, rank 3's collate_fn making two rows of each (32 rows): its
    replica's steps were counted from its 16 samples, and Lightning ended its epoch after 16 of the 32 rows, unsaid;
    what each rank raised. ``doubled larger``: replica 0's ranks 14 samples, replica 1's 16, rank 3's collate_fn making
    two rows of each (its replica stops after the 1 step the fewest fill, reading no further): what each rank raised.

    ``resumed``: every rank 20 samples of its own in an in-place stateful loader (ResumableLoader), fit for 1 step with a
    checkpoint there, then resumed from it for the rest of the epoch (``rows``: the batch each rank then trained), and
    ``resumed doubled``: the same checkpoint resumed with rank 3's collate_fn making two rows of each sample: what each
    rank raised, and the steps trained.

    ``planned``: an unpinned auto_plan (profiled and planned) of _WideMLP on each rank's own samples, 16 on replica 0's
    ranks and 14 on replica 1's, in batches of 4: the plan chosen, and what planning said of skipped samples (rank 0's
    log). ``planned apart``: the same with 16 on ranks 0-2 and 14 on rank 3 (2 steps), where every pipeline has a
    replica whose stages differ. ``gpipe planned``: ``planned``'s data under ``AutoPlanStrategy(strategy="gpipe")``, its
    pp left to planning (1 step): the plan, and the ranking's strategy, pp, feasibility and reason. ``stages differ``: the
    pinned pipeline on 16 samples per rank but 12 on rank 3."""
    import datetime
    import logging

    import torch.distributed as dist
    from lightning_utilities.core import rank_zero

    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    results: dict[str, Any] = {}
    data = mlp_data(14 if rank < 2 else 16, seed=rank // 2)
    for kind, dataset in (("sized", _ReadSamples(data)), ("stream", _Stream(data)), ("sized-stream", _SizedStream(data))):
        steps = _StepsAtEpochEnd()
        strategy = AutoPlanStrategy(strategy="gpipe", stages=2, micro_batch_size=4, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                    timeout=datetime.timedelta(seconds=120))
        validated = kind == "sized"
        trainer = L.Trainer(**{**trainer_kwargs(world, strategy, os.path.join(out, kind), callbacks=[steps], use_distributed_sampler=False),
                               "max_steps": -1, "max_epochs": 2,
                               **({"limit_val_batches": 1.0, "num_sanity_val_steps": 2} if validated else {})})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_EvaluatedMLP() if validated else TinyMLP(), DataLoader(dataset, batch_size=4),
                        DataLoader(_unequal_val_data(rank), batch_size=4) if validated else None)
        results[kind] = {"plan": trainer.strategy.plan, "steps": steps.seen, "start": steps.start,
                         "stage": {k: v.detach().clone() for k, v in trainer.strategy._stage_module.state_dict().items()},
                         "warned": [str(w.message) for w in caught if "skipp" in str(w.message)],
                         "val_loss": trainer.callback_metrics["val_loss"].item() if validated else None,
                         "read": getattr(dataset, "read", None)}

    def fit_own_data(kind: str, loader: DataLoader) -> None:
        steps = _StepsAtEpochEnd()
        strategy = AutoPlanStrategy(strategy="gpipe", stages=2, micro_batch_size=4, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                    timeout=datetime.timedelta(seconds=120))
        trainer = L.Trainer(**{**trainer_kwargs(world, strategy, os.path.join(out, kind), callbacks=[steps], use_distributed_sampler=False),
                               "max_steps": -1, "max_epochs": 1})
        raised_at: list[str] = []
        shown: list[str] = []

        def fit() -> None:
            try:
                trainer.fit(TinyMLP(), loader)
            except Exception as err:
                raised_at.extend(frame.name for frame in traceback.extract_tb(err.__traceback__))  # where its traceback runs
                shown.append("".join(traceback.format_exception(err)))  # as the user sees it (with the errors it was raised handling)
                raise

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            raised = error_of(fit)
        results[kind] = {"raised": raised, "raised at": raised_at, "shown": "".join(shown), "steps": steps.seen,
                         "warned": [str(w.message) for w in caught if "skipp" in str(w.message)]}

    fit_own_data("equal", DataLoader(mlp_data(20, seed=rank // 2), batch_size=4))
    # replica 1's stages of their own data: 16 samples on rank 2, 12 on rank 3 (it trained 1 step on other data per stage)
    fit_own_data("stages differ", DataLoader(mlp_data(12 if rank == 3 else 16, seed=rank // 2), batch_size=4))
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(rank_zero.log.name).addHandler(handler)
    auto = AutoPlanStrategy(timeout=datetime.timedelta(seconds=120))
    trainer = L.Trainer(**{**trainer_kwargs(world, auto, os.path.join(out, "planned"), use_distributed_sampler=False),
                           "max_steps": -1, "max_epochs": 1})
    raised = error_of(lambda: trainer.fit(_WideMLP(), DataLoader(mlp_data(16 if rank < 2 else 14, seed=rank // 2), batch_size=4)))
    logging.getLogger(rank_zero.log.name).removeHandler(handler)
    ranked = [] if auto.outcome is None else [(c.plan.strategy, c.plan.describe(), c.objective, c.prediction.feasible, c.skipped_samples)
                                              for c in auto.outcome.candidates]
    results["planned"] = {"raised": raised, "plan": None if raised else trainer.strategy.plan.describe(), "ranked": ranked,
                          "said": [m for m in said if m.startswith("auto_plan: not running ")],
                          "why": [line for m in said for line in m.splitlines() if line.startswith("Why the winner wins: ")]}
    # ... and replica 1's stages (of dp=2 x pp=2) holding 16 and 14: each pipeline has a replica whose stages differ
    said.clear()
    logging.getLogger(rank_zero.log.name).addHandler(handler)
    auto = AutoPlanStrategy(timeout=datetime.timedelta(seconds=120))
    trainer = L.Trainer(**{**trainer_kwargs(world, auto, os.path.join(out, "planned apart"), use_distributed_sampler=False), "max_steps": 2})
    raised = error_of(lambda: trainer.fit(_WideMLP(), DataLoader(mlp_data(14 if rank == 3 else 16, seed=rank // 2), batch_size=4)))
    logging.getLogger(rank_zero.log.name).removeHandler(handler)
    results["planned apart"] = {"raised": raised, "plan": None if raised else trainer.strategy.plan.describe(),
                                "ranked": [] if auto.outcome is None else [(c.plan.strategy, c.prediction.feasible, c.prediction.reason,
                                                                            c.skipped_samples_differ) for c in auto.outcome.candidates],
                                "said": [m for m in said if m.startswith("auto_plan: not running ")]}
    # a pipeline pinned by its strategy alone (pp planned) on replica 0's ranks' 16 samples and replica 1's 14
    auto = AutoPlanStrategy(strategy="gpipe", timeout=datetime.timedelta(seconds=120))
    trainer = L.Trainer(**{**trainer_kwargs(world, auto, os.path.join(out, "gpipe planned"), use_distributed_sampler=False), "max_steps": 1})
    raised = error_of(lambda: trainer.fit(_WideMLP(), DataLoader(mlp_data(16 if rank < 2 else 14, seed=rank // 2), batch_size=4)))
    results["gpipe planned"] = {"raised": raised, "plan": None if raised else trainer.strategy.plan.describe(),
                                "ranked": [] if auto.outcome is None else [(c.plan.strategy, c.plan.pp, c.prediction.feasible, c.prediction.reason)
                                                                           for c in auto.outcome.candidates]}
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    torch.manual_seed(0)
    model = _EvaluatedMLP()
    both = [_unequal_val_data(0), _unequal_val_data(2)]
    with torch.no_grad():
        whole = F.mse_loss(model.model(torch.cat([d.tensors[0] for d in both])), torch.cat([d.tensors[1] for d in both])).item()
    kwargs = {**trainer_kwargs(world, PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY]),
                               os.path.join(out, "evaluated"), use_distributed_sampler=False), "limit_val_batches": 1.0}
    trainer = L.Trainer(**kwargs)
    val = DataLoader(_unequal_val_data(rank), batch_size=4)
    results["evaluated"] = (trainer.validate(model, val, verbose=False)[0]["val_loss"], trainer.test(model, val, verbose=False)[0]["test_loss"], whole)
    # last in this world: where rank 3 raised alone, the others' fit failed (gloo's timeout, or rank 3's connections
    # closing as it left), not the checks after it
    full = mlp_data(16, seed=rank // 2)
    fit_own_data("doubled", DataLoader(full, batch_size=4, **({"collate_fn": _two_rows_per_sample} if rank == 3 else {})))
    fit_own_data("doubled larger", DataLoader(mlp_data(14 if rank < 2 else 16, seed=rank // 2), batch_size=4,
                                              **({"collate_fn": _two_rows_per_sample} if rank == 3 else {})))
    from lightning.pytorch.callbacks import ModelCheckpoint

    def pipeline(**given: Any) -> AutoPlanStrategy:
        return AutoPlanStrategy(strategy="gpipe", stages=2, micro_batch_size=4, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                timeout=datetime.timedelta(seconds=120), **given)

    twenty, saved = mlp_data(20, seed=rank // 2), os.path.join(out, "resume")
    at_step = ModelCheckpoint(dirpath=saved, filename="step", every_n_train_steps=1)
    trainer = L.Trainer(**{**trainer_kwargs(world, pipeline(), saved, callbacks=[at_step], use_distributed_sampler=False),
                           "max_steps": 1, "enable_checkpointing": True})
    first = ResumableLoader(twenty, batch_size=4)
    trainer.fit(TinyMLP(), first)
    results["resume states given"] = first.states_given
    for kind, collate in (("resumed", {}), ("resumed doubled", {"collate_fn": _two_rows_per_sample} if rank == 3 else {})):
        model = _RowsSeen()
        trainer = L.Trainer(**{**trainer_kwargs(world, pipeline(), os.path.join(out, kind), use_distributed_sampler=False),
                               "max_steps": -1, "max_epochs": 1})
        raised = error_of(lambda: trainer.fit(model, ResumableLoader(twenty, batch_size=4, **collate), ckpt_path=os.path.join(saved, "step.ckpt")))
        results[kind] = {"raised": raised, "rows": model.rows, "steps": trainer.global_step,
                         "expected": twenty.tensors[0][8:16, 0].tolist()}
    # the same checkpoint (steps of 8 holding 2 whole loader batches of 4: no record where inside a batch a step ended)
    # resumed in loader batches of 3
    model = _RowsSeen()
    trainer = L.Trainer(**{**trainer_kwargs(world, pipeline(global_batch_size=16), os.path.join(out, "resumed in threes"),
                                            use_distributed_sampler=False), "max_steps": -1, "max_epochs": 1})
    raised = error_of(lambda: trainer.fit(model, ResumableLoader(twenty, batch_size=3), ckpt_path=os.path.join(saved, "step.ckpt")))
    results["resumed in threes"] = {"raised": raised, "rows": model.rows}
    # loader batches of 3 in steps of 8 per replica (a global batch of 16): step 1 ends 2 samples into the batch of
    # samples 6-8, whose sample 8 is step 2's; run through, resumed from step 1's checkpoint, and (batches of 10) from a
    # checkpoint whose step ended inside the epoch's first batch; and from a stream (no length: Lightning pulls a step
    # ahead of the one it trains, so the checkpoint after step 1 is saved once step 2 was pulled)
    # (with an integer limit_train_batches counting its steps, Lightning pulls none ahead)
    for kind, b, source, limit in (("inside a batch", 3, twenty, {}), ("inside the first batch", 10, twenty, {}),
                                   ("inside a stream's batch", 3, _Stream(twenty), {}),
                                   ("inside a limited stream's batch", 3, _Stream(twenty), {"limit_train_batches": 6})):
        inside = os.path.join(out, f"resume {kind}")
        weights = []
        for fit in ("through", "to step 1", "resumed") if b == 3 else ("to step 1", "resumed"):
            torch.manual_seed(0)
            model = _RowsSeen()
            saving = [ModelCheckpoint(dirpath=inside, filename="step", every_n_train_steps=1)] if fit == "to step 1" else []
            trainer = L.Trainer(**{**trainer_kwargs(world, pipeline(global_batch_size=16), os.path.join(inside, fit), use_distributed_sampler=False,
                                                    callbacks=saving),
                                   "max_steps": 1 if saving else -1, "max_epochs": 1, "enable_checkpointing": bool(saving), **limit})
            raised = error_of(lambda: trainer.fit(model, ResumableLoader(source, batch_size=b),
                                                  ckpt_path=os.path.join(inside, "step.ckpt") if fit == "resumed" else None))
            results[f"{kind} {fit}"] = {"raised": raised, "rows": model.rows}
            weights.append([p.detach().clone() for p in model.parameters()])
        if b == 3:
            results[f"{kind} same weights"] = all(torch.equal(a, c) for a, c in zip(weights[0], weights[2]))
    fit_own_data("refused", DataLoader([full[i] for i in range(8)] + (["text"] * 8 if rank == 3 else [full[i] for i in range(8, 16)]),
                                       batch_size=4))
    fit_own_data("failed", DataLoader(_MissingSamples(full, 8 if rank == 3 else 16), batch_size=4))
    # rank 3's sampler's __len__ raises where the pipeline's loader counts the epoch's samples (_FullBatchLoader.__init__)
    sampler = _UnsizedSampler(16) if rank == 3 else torch.utils.data.SequentialSampler(full)
    fit_own_data("unsized sampler", DataLoader(full, batch_sampler=_CountedBatches(sampler, 16, 4)))
    # rank 3's loader's __len__ raises where planning reads the ranks' samples per epoch (samples_per_rank)
    unpinned = AutoPlanStrategy(timeout=datetime.timedelta(seconds=120))
    trainer = L.Trainer(**{**trainer_kwargs(world, unpinned, os.path.join(out, "unsized"), use_distributed_sampler=False),
                           "max_steps": -1, "max_epochs": 1})
    loader = (_UnsizedOnThisRank if rank == 3 else DataLoader)(full, batch_size=4)
    results["unsized"] = {"raised": error_of(lambda: trainer.fit(TinyMLP(), loader))}
    # ... and where the pinned plan's set-up reads it (Rechunking.wrap), before the pipeline's loader is made there
    fit_own_data("unsized loader", (_UnsizedOnThisRank if rank == 3 else DataLoader)(full, batch_size=4))
    # ... where the loader is loaded again for epoch 1 (batches of 2 where epoch 0's were 4), an OnExceptionCheckpoint saving
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    saved = os.path.join(out, "reloaded unsized")
    strategy = AutoPlanStrategy(strategy="gpipe", stages=2, micro_batch_size=4, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                timeout=datetime.timedelta(seconds=120))
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, saved, use_distributed_sampler=False, callbacks=[OnExceptionCheckpoint(saved)]),
                           "max_steps": -1, "max_epochs": 2, "reload_dataloaders_every_n_epochs": 1, "enable_checkpointing": True})
    results["reloaded unsized"] = {"raised": error_of(lambda: trainer.fit(_ReloadedUnsizedOnRank3(rank, full)))}
    if rank == 0:  # (written by rank 0)
        checkpoint = torch.load(os.path.join(saved, "on_exception.ckpt"), weights_only=False)
        results["reloaded unsized"]["progress"] = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"]
    dist.destroy_process_group()
    return results


class _PredictedMLP(_EvaluatedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (Lightning's predict requires it; the pipeline runs in its place)
        return self.model(x)


class _IterStepMLP(_PredictedMLP):
    """Steps that fetch their own batches (Lightning then hands the step ``dataloader_iter``, not a batch)."""

    def training_step(self, dataloader_iter: Any) -> None:
        pass

    def validation_step(self, dataloader_iter: Any) -> None:
        pass


def _evaluation_data_a_pipeline_cannot_run(rank: int, world: int, out: str) -> dict[str, Any]:
    """Evaluation loaders of each rank's own (use_distributed_sampler=False) whose numbers of batches cannot run
    together, on 4 ranks (dp=2 x pp=2, replica 0 is ranks 0 and 1): replica 1 with none beside replica 0's 2 (validate:
    Lightning refused the empty loader on ranks 2 and 3 only, and ranks 0 and 1 waited for them in the epoch-end
    average of val_loss), stage 1 of replica 0 with 1 batch beside stage 0's 2 (validate) and with none (test): both
    stages waited, in gloo's recv or in different collectives, until the timeout; so did the stages of each replica
    reading streams of 3 and 2 batches (validate; not counted at the loader's setup, checked at each step). Each is now
    one BatchFormatError on every rank (the streams': each replica's rank its own replica's, at the second batch).
    Streams of equal stages, 2 batches per replica and 1, still test, to the test_loss of the same data with a length
    (the loss broadcast, not summed with the stages' places). Stage 1 of each replica reading a stream beside
    stage 0's loader with a length (validate) waited in Lightning's has_len_all_ranks, a collective only stage 0 joined;
    it is refused on every rank at the loader's setup too, and so is the same of a fit's train loaders (fit; it hung
    there too, as dp_ga's did: one refusal naming rank 1, before any step). A fit whose replica 1 has 2 train batches on
    stage 0 and 1 on stage 1 trained its first step and hung at the second (replica 0 and stage 0 waiting for stage 1);
    refused on every rank at the loader's setup (in the agreement that refuses lengths beside streams). Predict on an empty replica under allow_zero_length_dataloader_with_multiple_devices still runs: its
    steps meet no other replica. Streams again (the last cases, as a hang without the fix broke the world for those
    after it): stage 1 of replica 1 yielding none beside 2 batches everywhere else (validate; its stage 0 waited in
    gloo's send until the timeout) and replica 1 yielding none beside replica 0's 2 (test; replica 0 waited in the
    epoch-end average of test_loss) are refused on every rank where the run starts; replica 0's stages at 3 and 2
    batches beside replica 1's 2 and 2 (validate) raised on replica 0 alone, and replica 1 failed in the epoch-end
    average with gloo's error: every rank now raises replica 0's refusal (so do both replicas' ranks where both part:
    one sentence naming both). A replica of no predictions from a stream beside one of 2 batches predicts ([] on its
    ranks). Predicting from streams with replica 0's stage 0 at 2 batches and its stage 1 at 3 timed out on every
    rank (stage 1 waiting in gloo's recv for a third batch, the others in later collectives); it is refused on every rank too.
    The empty replica's predict again, with a length, on a Trainer that predicted from streams just before: the
    ranks with batches waited for the empty replica (which skips the run) in the streams' check of the run's start. Streams
    of 2 batches and 1 per replica under limit_test_batches=2, and at a fit's sanity check (num_sanity_val_steps=2), test
    and fit: a limit gave the loaders a length, Lightning fetched no batch ahead, and the replica of 1 never saw its last
    batch, so skipped the all-gather where the other's run ended (both timed out); under limit_val_batches=2 a replica
    of no stream batches beside 2 is refused at the run's start, as without a limit (it hung). Two validation streams run
    one after the other ("several streams": a val_loss of each, alike on every rank; predict from two with replica 1
    having none of the first), but replica 0's stage 1 reading 3 batches of the first beside its stage 0's 2 hung: stage
    0 went on to Lightning's average of the first loader's logs (a collective of every rank) while stage 1 waited for
    its third batch, and replica 1 having none of the second loader beside replica 0's 2 failed in that average with
    gloo's error; each is now one BatchFormatError on every rank, where the first loader ends. A validation_step (or
    training_step) taking ``dataloader_iter`` made Lightning hand the pipeline's step the iterator, refused as a batch of
    type _DataFetcherWrapper (validate, from streams with an empty stage; fit); it is refused by its signature, on every
    rank before the first step. Rank 3 reading other samples than rank 2 (validate, predict; as many batches, the
    samples' integer indices differ) ran silently: predict returned rank 2's predictions on rank 3 too; it is refused on
    every rank at the run's start (each rank's first batch compared, as a fit's first is); where only floats differ (rank 3's
    shifted), beside a first predict loader replica 1 lacks (its stages compare among themselves), replica 1's stage 0 warns
    (rank 0's rank_zero_warn, alone, never knew of it: no warning at all). A fit whose replica 1's stages read other
    samples (rank 3's indices differ) was refused on ranks 2 and 3 alone (their stages compared among themselves), and
    replica 0 waited for them in the gradients' all-reduce until gloo's timeout; every rank now raises the same error at
    the first batch. Where only rank 3's floats differ, the fit trains, and rank 0 warns naming replica 1 (it warned of
    its own replica only: no warning at all). Last, as a hang without the fix breaks the world. Run on a group of its
    own with a 20 s timeout (set up by Lightning, the port in the environment), so that a hang fails here quickly
    rather than holding the launch."""
    import datetime

    import torch.distributed as dist

    from lightning_distplan.strategies.pipeline import PipelineStrategy

    def batches(counts: list[int], stream: bool) -> DataLoader:
        n = counts[rank]
        data = mlp_data(4 * n, seed=12) if n else TensorDataset(torch.zeros(0, 16), torch.zeros(0, 4))
        return DataLoader(_Stream(data) if stream else data, batch_size=4)

    def shapes(predicted: list[Any]) -> list[Any]:  # each loader's list of them where there are several
        return [shapes(p) if isinstance(p, list) else None if p is None else tuple(p.shape) for p in predicted]

    results: dict[str, Any] = {}
    for case, fn, counts in (("empty replica", "validate", [2, 2, 0, 0]), ("stages differ", "validate", [2, 1, 2, 2]),
                             ("empty stage", "test", [2, 2, 2, 0]), ("empty replica predicts", "predict", [2, 2, 0, 0]),
                             ("streams of stages differ", "validate", [3, 2, 3, 2]), ("streams", "test", [2, 2, 1, 1]),
                             ("the streams' data", "test", [2, 2, 1, 1]), ("lengths beside streams", "validate", [2, 2, 2, 2]),
                             ("train lengths beside streams", "fit", [2, 2, 2, 2]),
                             ("train: one replica's stages differ", "fit", [2, 2, 2, 1]),
                             ("streams: an empty stage", "validate", [2, 2, 2, 0]), ("streams: an empty replica", "test", [2, 2, 0, 0]),
                             ("streams: one replica's stages differ", "validate", [3, 2, 2, 2]),
                             ("streams: an empty replica predicts", "predict", [2, 2, 0, 0]),
                             ("streams: predicting stages differ", "predict", [2, 3, 2, 2]),
                             ("after streams: an empty replica predicts", "predict", [2, 2, 0, 0]),
                             ("streams under a limit", "test", [2, 2, 1, 1]),
                             ("streams under a limit: an empty replica", "validate", [2, 2, 0, 0]),
                             ("streams at the sanity check", "fit", [2, 2, 1, 1]),
                             ("dataloader_iter: streams with an empty stage", "validate", [2, 2, 2, 0]),
                             ("a stage reads other samples", "validate", [2, 2, 2, 2]),
                             ("a stage predicts from other samples", "predict", [2, 2, 2, 2]),
                             ("floats differ on a replica without the first loader", "predict", [1, 1, 0, 0]),
                             ("dataloader_iter: train", "fit", [2, 2, 2, 2]),
                             ("several streams", "validate", [2, 2, 1, 1]), ("several streams predict", "predict", [2, 2, 0, 0]),
                             ("several streams: a replica without the second", "validate", [2, 2, 2, 2]),
                             ("several streams part at a loader boundary", "validate", [2, 3, 2, 2]),
                             ("replica 1's stages train on other floats", "fit", [2, 2, 2, 2]),
                             ("replica 1's stages train on other samples", "fit", [2, 2, 2, 2])):
        strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                    timeout=datetime.timedelta(seconds=20))
        limits = {"streams under a limit": {"limit_test_batches": 2},
                  "streams under a limit: an empty replica": {"limit_val_batches": 2},
                  "streams at the sanity check": {"num_sanity_val_steps": 2, "max_steps": 2},
                  "replica 1's stages train on other floats": {"max_steps": 1}}.get(case, {})
        trainer = L.Trainer(**{**trainer_kwargs(world, strategy, os.path.join(out, case), use_distributed_sampler=False),
                               "limit_val_batches": 1.0, **limits})
        torch.manual_seed(3)  # the same weights in "streams" and "the streams' data"
        model = _IterStepMLP() if case.startswith("dataloader_iter") else _PredictedMLP()
        model.allow_zero_length_dataloader_with_multiple_devices = fn == "predict"
        try:
            stream = case.startswith(("streams", "several", "dataloader_iter: streams")) or ("lengths beside streams" in case and rank % 2 == 1)
            if case.startswith("after streams"):  # the same Trainer and strategy predicted from streams just before
                trainer.predict(model, batches([2, 2, 2, 2], stream=True))
            if case == "streams at the sanity check":  # the validation streams, each replica's own, beside one train loader
                trainer.fit(model, batches([2, 2, 2, 2], stream=False), batches(counts, stream=True))
                got = float(trainer.callback_metrics["val_loss"])
            elif case.startswith("a stage"):  # as many batches everywhere, rank 3's of other samples (their indices tell)
                data = mlp_data(8, seed=12)
                index = torch.arange(8) + (100 if rank == 3 else 0)
                got = getattr(trainer, fn)(model, DataLoader(TensorDataset(*data.tensors, index), batch_size=4))
            elif case.startswith("floats differ"):  # rank 3's floats shifted (warned), after a loader replica 1 lacks
                data = mlp_data(8, seed=12)
                inputs = data.tensors[0] + (1.0 if rank == 3 else 0.0)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = trainer.predict(model, [batches(counts, stream=False), DataLoader(TensorDataset(inputs, data.tensors[1]), batch_size=4)])
                results[f"{case}: warned"] = any("read different prediction batches" in str(w.message) for w in caught)
            elif case.startswith("replica 1's stages train"):  # rank 3's floats shifted (warned), or its samples' indices (refused)
                data = mlp_data(8, seed=12)
                if case.endswith("floats"):
                    data = TensorDataset(data.tensors[0] + (1.0 if rank == 3 else 0.0), data.tensors[1])
                else:
                    data = TensorDataset(*data.tensors, torch.arange(8) + (100 if rank == 3 else 0))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = trainer.fit(model, DataLoader(data, batch_size=4))
                results[f"{case}: warned"] = [str(w.message) for w in caught if "read different training batches" in str(w.message)]
            elif case.startswith("several streams"):  # a second loader after the first, of these batches per rank
                second = {"several streams predict": [1, 1, 2, 2], "several streams: a replica without the second": [2, 2, 0, 0]}
                got = getattr(trainer, fn)(model, [batches(counts, stream=True), batches(second.get(case, [2, 2, 2, 2]), stream=True)])
            else:
                got = getattr(trainer, fn)(model, batches(counts, stream=stream))
            results[case] = shapes(got) if fn == "predict" and got is not None else got
        except Exception as err:  # (BatchFormatError; a gloo timeout without the fix)
            results[case] = f"{type(err).__name__}: {err}"
        if fn == "fit":
            results[f"{case}: steps"] = trainer.global_step
    dist.destroy_process_group()
    return results


def _hybrid_then_two_ranks(rank: int, world: int, hybrid_out: str, out: str, ports: tuple[int, int, int]) -> dict[str, Any]:
    """The hybrid runs on all 4 ranks, then auto_plan's on replicas of unequal data on a fresh world of four; then ranks
    2 and 3 are done and ranks 0 and 1 run every 2-rank check on a fresh world of two (each world its own port), as a
    2-process launch of its own did: starting Python, torch and Lightning in two more processes costs more than many of
    the fits."""
    import torch.distributed as dist

    _hybrid_worker(rank, world, hybrid_out)
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(ports[0]))
    unequal = _replicas_of_unequal_data_under_auto_plan(rank, world, os.path.join(hybrid_out, "unequal"))
    os.environ.update(MASTER_PORT=str(ports[2]))
    unequal["cannot run"] = _evaluation_data_a_pipeline_cannot_run(rank, world, os.path.join(hybrid_out, "cannot"))
    if rank >= 2:
        return {"unequal": unequal}
    os.environ.update(MASTER_PORT=str(ports[1]), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    return {**_two_rank_worker(rank, 2, out), "unequal": unequal}


@pytest.fixture(scope="module")
def _launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, list[dict[str, Any]]]:
    """The module's one launch: 4 ranks for the hybrid runs, then ranks 0 and 1 for the 2-rank checks."""
    from _ports import free_ports

    hybrid_out = str(tmp_path_factory.mktemp("pipeline_hybrid"))
    out = str(tmp_path_factory.mktemp("pipeline_2ranks"))
    ports = tuple(free_ports(3))
    results = run_on_ranks(_hybrid_then_two_ranks, 4, hybrid_out, out, ports, timeout=560)  # under pytest's 600 s, so a stall gets run_on_ranks's message
    return hybrid_out, out, results


@pytest.fixture(scope="module")
def two_rank_run(_launch: tuple[str, str, list[dict[str, Any]]]) -> tuple[str, list[dict[str, Any]]]:
    _, out, results = _launch
    return out, results[:2]


def _check(out: str, name: str, schedule: str, world: int, dp: int) -> None:
    ckpt = torch.load(os.path.join(out, f"{name}-{schedule}-{world}.ckpt"), weights_only=False)
    ref = reference_weights(name)
    assert list(ckpt["state_dict"]) == list(ref), "checkpoint keys must be the plain module's"
    torch.testing.assert_close(ckpt["state_dict"], ref, rtol=1e-5, atol=2e-6)
    plan = ckpt["distplan_plan"]
    assert (plan["strategy"], plan["dp"], plan["pp"], plan["n_microbatches"], plan["global_batch_size"]) == (
        schedule, dp, 2, 8 // dp if dp > 1 else 8, GLOBAL_BATCH)
    # The plain LightningModule loads it, and its optimizer state is the full one.
    model = build(name)
    model.load_state_dict(ckpt["state_dict"])
    n_params = len(list(model.configure_optimizers().param_groups[0]["params"]))
    assert sorted(ckpt["optimizer_states"][0]["param_groups"][0]["params"]) == list(range(n_params))
    assert torch.isfinite(torch.load(os.path.join(out, f"{name}-{schedule}-{world}.loss"))).all()


@pytest.mark.parametrize("kind", ["sized", "stream", "sized-stream"])
def test_auto_plans_replicas_of_unequal_data_step_alike_and_end_with_equal_weights(_launch, kind: str) -> None:
    """Each rank's own data, 14 samples on replica 0 and 16 on replica 1 (see _replicas_of_unequal_data_under_auto_plan):
    the ranks agree on the epoch's steps (a dataset: when the loader is made; a stream: at every step, and when the
    loader is made where it has a length, so that Lightning counts as many steps on every rank), the fewest either
    replica fills (1 of 8 samples), so every rank steps once per epoch and the replicas of a stage end with the same
    weights; the samples skipped are warned about: the spread (known before the epoch), not rank 0's own samples beyond
    its steps as every replica's shortfall. Replica 1 reads its step's 8 samples per epoch, not its whole 16: reading
    ahead for rows beyond its count (_FullBatchLoader) read and discarded the rest of its epoch, which its replica
    skips whatever its rows (on a rank of 100,000 samples beside 16, nearly all of them)."""
    unequal = [r["unequal"][kind] for r in _launch[2]]
    assert all(u["plan"].describe() == "gpipe dp=2 pp=2 m=4 n_microbatches=2 split=[4]" for u in unequal), [u["plan"] for u in unequal]
    assert [u["steps"] for u in unequal] == [[1, 2]] * 4
    for stage in (0, 1):  # ranks `stage` and 2 + `stage` run the same stage in replicas 0 and 1
        ours, theirs = unequal[stage]["stage"], unequal[2 + stage]["stage"]
        assert list(ours) == list(theirs) and ours
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert max((v - unequal[stage]["start"][k]).abs().max().item() for k, v in ours.items()) > 1e-4  # trained
    if kind == "sized":  # replica 0's remainder is read (its rows held to its count); replica 1's rest, skipped, is not
        # (the last sample read, read once per epoch; the first batch is also read as the loader is set up)
        reads = [u["read"] for u in unequal]
        assert [(max(r), r.count(max(r))) for r in reads] == [(13, 2), (13, 2), (7, 2), (7, 2)], reads
    if kind in ("sized", "sized-stream"):  # known before the epoch: rank 0 says it for every replica
        assert [u["warned"] for u in unequal] == [[
            "auto_plan: the ranks' train loaders hold from 14 to 16 samples per epoch, and the replicas' gradient all-reduce meets "
            "at every step, so every replica stops after the 1 pipeline steps of 8 samples the fewest fill, skipping up to 8 "
            "samples per epoch (give every replica as many samples, e.g. Lightning's DistributedSampler, to train them all)."
        ], [], [], []]
    else:  # known when another replica's stream ends: the ranks of the replica with more say it; rank 0 what it skipped
        ended = ["auto_plan: another replica's train loader ended before this one's; this replica stops with it (their gradient "
                 "all-reduce meets at every step), skipping the rest of its epoch."]
        dropped = ["auto_plan: the epoch's last 6 samples of this replica did not fill a pipeline step of 8 samples and were skipped "
                   "(the loader's length is unknown, so this could not be said before)."]
        assert [u["warned"] for u in unequal] == [dropped, [], ended, ended]


def test_auto_plan_warns_of_the_samples_each_replica_of_its_own_data_skips(_launch) -> None:
    """Every rank 20 samples of its own (use_distributed_sampler=False, see _replicas_of_unequal_data_under_auto_plan):
    each replica trains 2 steps of 8 and skips its last 4, which a DDP run of each rank's loader trains. The shortfall was
    figured as of one dataset sharded over the 4 ranks: none here (the sampler names no dataset), so the 4 samples were
    skipped unsaid (2, where the sampler names its dataset)."""
    equal = [r["unequal"]["equal"] for r in _launch[2]]
    assert [(u["raised"], u["steps"]) for u in equal] == [(None, [2])] * 4
    assert [u["warned"] for u in equal] == [[
        "auto_plan: the epoch's last 4 samples per replica do not fill a pipeline step of 8 samples and are skipped (a run of "
        "your loader under DDP trains them)."
    ], [], [], []]


def test_auto_plans_planning_counts_the_samples_each_rank_of_its_own_data_skips(_launch) -> None:
    """Each rank's own samples, 16 on replica 0's ranks (rank 0's, the loader planning reads) and 14 on replica 1's, in
    batches of 4 (use_distributed_sampler=False, see _replicas_of_unequal_data_under_auto_plan), planned on 4 ranks
    with nothing pinned: every replica stops after the steps the fewest fill (_FullBatchLoader), 1 of 8 samples on dp=2
    (replica 0 skips 8, replica 1 6), which DDP trains, so dp_ga, the one plan that trains them all, runs; a pipeline of
    one replica (dp=1) puts ranks of 16 and 14 samples in one replica, whose stages cannot read the same batches: ruled
    out (it was said to skip them all, 16). Planning read rank 0's loader alone: 16 % 8 = 0 and 16 % 16 = 0, no pipeline skipped
    any, and a pipeline predicted faster ran; each rank's samples now come with one all-reduce
    (samples_per_rank). Read as one dataset that Lightning shards over the 4 ranks (AutoPlanStrategy._plan must pass
    use_distributed_sampler), no pipeline skipped any either. Which plan is predicted fastest depends on the host's
    measured compute and links (_WideMLP makes it a pipeline on the hosts seen, 0.369 vs 0.478 s/step), so only what
    follows from the recorded ranking is asserted: every feasible pipeline (dp=2: the dp=1 ones are ruled out) marked as
    skipping 8 on any host, and where one was moved behind dp_ga, that it was said, and why dp_ga won."""
    planned = [r["unequal"]["planned"] for r in _launch[2]]
    assert [p["raised"] for p in planned] == [None] * 4, planned
    ranked, said, why = planned[0]["ranked"], planned[0]["said"], planned[0]["why"]
    pipelines = [r for r in ranked if r[0] != "dp_ga" and r[3]]
    skips = {r[1]: 8 for r in pipelines}
    assert pipelines and all(" dp=2 " in r[1] for r in pipelines), ranked  # one replica of all 4 ranks: ruled out
    assert [r[4] for r in pipelines] == list(skips.values()), ranked  # (rank 0's own, or read as sharded: 0)
    said = [m for m in said if "would skip" in m]  # (not the dp=1 pipelines' ruling out, if one of them ranked first)
    assert len({p["plan"] for p in planned}) == 1 and planned[0]["plan"].startswith("dp_ga dp=4 "), planned
    assert ranked[0][0] == "dp_ga" and ranked[0][4] == 0 and len(why) == 1, (ranked, why)
    if said:  # a pipeline ranked first, moved behind dp_ga
        moved = [p for p in skips if said[0].startswith(f"auto_plan: not running {p} (predicted ")]
        # (replica 0 skips 8, replica 1 6: the most, "up to")
        assert len(said) == 1 and len(moved) == 1 and (f"it would skip up to the epoch's last {skips[moved[0]]} samples per replica, "
                                                       "which your run trains; running dp_ga dp=4 " in said[0]), said
        assert why[0].startswith(f"Why the winner wins: {ranked[0][1]} trains every sample of the epoch, while the fastest plan ("), why
        assert why[0].endswith(f"would skip up to the epoch's last {skips[moved[0]]} samples per replica, which a run of your loader "
                               "trains."), why
    else:  # dp_ga ranked first on its own: no pipeline beyond the near tie (2%) it may win
        assert ranked[0][2] <= 1.02 * min(r[2] for r in ranked if r[3]) * (1 + 1e-9), ranked
        assert "would skip" not in why[0], why


def _stopped_by_rank_3(others: tuple[str, str], rank_3: tuple[str, str]) -> list[tuple[str, str, list[str]]]:
    """What the 4 ranks raised where rank 3's train loader failed (error_of's (type, message, notes)): ranks 0-2
    ``others`` with the note naming rank 3, rank 3 its own ``rank_3`` without one."""
    return [(*others, [f"Raised on global rank 3 reading its train loader; global rank {r} stops with it."]) for r in range(3)] + [
        (*rank_3, [])]


def test_auto_plan_refuses_or_rules_out_pipelines_whose_replicas_stages_hold_other_lengths(_launch) -> None:
    """Replica 1's stages of data of their own hold 16 samples (rank 2) and 12 or 14 (rank 3), replica 0's 16 each (see
    _replicas_of_unequal_data_under_auto_plan). The pinned pipeline (dp=2 x pp=2) trained 1 step, each stage of replica
    1 on other data, and warned of the replicas' spread "skipping up to 8 samples per epoch" (stage 1 computed the loss
    on other targets than stage 0's inputs): now one refusal on every rank at the loader's set-up, before any step.
    Unpinned, planning said a pipeline "would skip up to the epoch's last 8 samples per replica" (each pipeline has a
    replica whose stages differ): every pipeline is ruled out now, said as such, and dp_ga runs. A pipeline pinned by
    its strategy alone (16 samples on replica 0's ranks, 14 on replica 1's) counted as a pinned layout: planning read no
    rank's samples, ranked a pp=4 first (one replica of 16, 16, 14 and 14; so on the hosts seen) and the fit was refused
    at the loader's set-up; pp=4 is ruled out now and a pp=2, whose replicas hold alike, runs."""
    differ = [r["unequal"]["stages differ"] for r in _launch[2]]
    sentence = ("BatchFormatError: The train loaders of the stages of pipeline replica 1 hold different numbers of batches or "
                "samples (from 3 to 4 batches and from 12 to 16 samples per epoch)")
    assert all(d["raised"] is not None for d in differ), differ
    got = {f"{d['raised'][0]}: {d['raised'][1]}" for d in differ}
    assert len(got) == 1 and next(iter(got)).startswith(sentence) and "HINT: " in next(iter(got)), got
    assert [d["steps"] for d in differ] == [[]] * 4 and not any(d["warned"] for d in differ), differ  # no epoch trained
    apart = [r["unequal"]["planned apart"] for r in _launch[2]]
    assert [a["raised"] for a in apart] == [None] * 4 and all(a["plan"].startswith("dp_ga dp=4 ") for a in apart), apart
    ranked, said = apart[0]["ranked"], apart[0]["said"]
    pipelines = [r for r in ranked if r[0] != "dp_ga"]
    assert pipelines and all(not r[1] for r in pipelines), ranked
    assert any("hold different numbers of samples per epoch (16, 16, 16, 14)" in r[2] for r in pipelines), ranked
    assert not any(r[3] for r in ranked) and not any("would skip" in m for m in said), (ranked, said)
    # strategy="gpipe" alone leaves pp to planning: pp=4 (one replica of 16, 16, 14, 14) is ruled out, pp=2 (replicas of
    # 16, 16 and 14, 14) runs; it had been taken as a pinned layout, planning counted no rank's samples, and a pp=4 it
    # ranked first was refused at the loader's set-up
    gpipe = [r["unequal"]["gpipe planned"] for r in _launch[2]]
    assert [g["raised"] for g in gpipe] == [None] * 4 and all(g["plan"].startswith("gpipe dp=2 pp=2 ") for g in gpipe), gpipe
    ranked = gpipe[0]["ranked"]
    assert ranked[0][:3] == ("gpipe", 2, True) and any(r[1] == 4 for r in ranked), ranked
    assert all(not r[2] and "hold different numbers of samples per epoch (16, 16, 14, 14)" in r[3] for r in ranked if r[1] == 4), ranked


def test_rows_beyond_the_samples_counted_under_auto_plans_pipeline_are_refused_on_every_rank(_launch) -> None:
    """Rank 3's collate_fn alone makes two rows of each of its 16 samples (see _replicas_of_unequal_data_under_auto_plan):
    the replicas' 2 steps of 8 were counted from the samples, and Lightning ended rank 3's epoch after 16 of its 32
    rows, without a word. Its second step fills the count before its last 2 batches: refused there, on every rank
    (the per-step agreement carries it), after the first step."""
    doubled = [r["unequal"]["doubled"] for r in _launch[2]]
    sentence = ("The train loader's first 2 batches of the epoch hold 16 samples, where auto_plan's pipeline counts the epoch's 4 "
                "batches as the 16 samples its sampler holds (2 pipeline steps of 8), so the epoch would end before its 2 batches "
                "left (DDP trains them). HINT: Use a collate_fn (and batch sampler) making one row of each of the sampler's samples, "
                "or strategy='ddp'.")
    assert [d["raised"] for d in doubled] == _stopped_by_rank_3(("InfeasiblePlanError", sentence), ("InfeasiblePlanError", sentence)), doubled
    assert [d["steps"] for d in doubled] == [[]] * 4


def test_a_fit_resumed_mid_epoch_from_a_stateful_loader_trains_the_epochs_rest_and_refuses_rows_beyond_its_samples(_launch) -> None:
    """A fit resumed mid-epoch (its checkpoint after the first of 2 steps) with an in-place stateful loader of 20
    samples per rank (see _replicas_of_unequal_data_under_auto_plan): every rank trains its samples 8-15, the epoch's
    second step, as the fit run through does. With rank 3's collate_fn making two rows of each sample, the resumed pass
    counted its steps from 0, never reached the epoch's last counted one, so read nothing ahead: every rank trained one
    step of 8 rows and the fit ended without a word (rank 3 skipped 24 rows of its 12 samples left, which the fit run
    through refuses). It is refused now, on every rank, at that step."""
    resumed = [r["unequal"]["resumed"] for r in _launch[2]]
    assert [(r["raised"], r["steps"]) for r in resumed] == [(None, 2)] * 4, resumed
    # steps of 8 hold 2 whole loader batches: the loader's state is read for the checkpoint alone, not after every batch
    assert [r["unequal"]["resume states given"] for r in _launch[2]] == [1] * 4
    assert all(r["rows"] == [r["expected"]] for r in resumed), resumed
    doubled = [r["unequal"]["resumed doubled"] for r in _launch[2]]
    # (its batches from where the checkpoint's state resumes it: the 3 after the 2 trained)
    sentence = ("The train loader's first 3 batches of the epoch hold 24 samples, where auto_plan's pipeline counts the epoch's 5 "
                "batches as the 20 samples its sampler holds (2 pipeline steps of 8), so the epoch would end before its last samples "
                "(DDP trains them). HINT: Use a collate_fn (and batch sampler) making one row of each of the sampler's samples, "
                "or strategy='ddp'.")
    assert [d["raised"] for d in doubled] == _stopped_by_rank_3(("InfeasiblePlanError", sentence), ("InfeasiblePlanError", sentence)), doubled
    assert [(d["steps"], d["rows"]) for d in doubled] == [(1, [])] * 4, doubled


def test_a_fit_resumed_inside_a_stateful_loaders_batch_trains_what_the_fit_run_through_trains(_launch) -> None:
    """Loader batches of 3 in pipeline steps of 8 per replica (global_batch_size=16, dp=2 x pp=2), resumed from the
    checkpoint of step 1 (see _replicas_of_unequal_data_under_auto_plan), which ended 2 samples into the batch of samples
    6-8. The in-place loader's own state there is the one after that batch, and the checkpoint counts the epoch's progress
    in loader batches, rounded: on 2 ranks (dp=1, 24 samples) the resumed fit trained samples 9-16 and ended its epoch at
    the short rest, sample 8 and 17-23 never trained (the fit run through trains 8-15, 16-23), without a word. The
    checkpoint now holds the state before that batch, the 2 samples of it trained and the progress in steps: the resumed
    fit trains step 2 of the fit run through (samples 8-15 of each replica), and ends with its weights, on every rank.
    The same from a stream (no length): Lightning pulls step 2 before it trains step 1, and the checkpoint held where
    step 2 ended, so the resumed fit went on with step 3's samples (step 2's never trained), without a word. And from a
    stream with limit_train_batches=6, where Lightning pulls no step ahead (held a step late, the checkpoint had no
    record, and the resume was refused)."""
    for r in _launch[2]:
        d = r["unequal"]
        for kind in ("inside a batch", "inside a stream's batch", "inside a limited stream's batch"):
            through, first, resumed = (d[f"{kind} {fit}"] for fit in ("through", "to step 1", "resumed"))
            assert (through["raised"], first["raised"], resumed["raised"]) == (None, None, None), (kind, d)
            assert len(through["rows"]) == 2 and first["rows"] == through["rows"][:1] and resumed["rows"] == through["rows"][1:], (kind, d)
            assert d[f"{kind} same weights"] is True, (kind, d)


def test_a_fit_resumed_inside_a_stateful_loaders_first_batch_is_refused_on_every_rank(_launch) -> None:
    """Loader batches of 10 in steps of 8: step 1's checkpoint ended 8 samples into the epoch's first batch, and a loader's
    state before its first batch is not known (the in-place loader's says the previous epoch's end), so the resumed
    epoch cannot start there: refused, on every rank, before any step. So is a checkpoint that does not record where
    inside a loader batch its step ended (the 'resume' one, steps of whole batches of 4) resumed in batches of 3."""
    inside = [r["unequal"]["inside the first batch resumed"] for r in _launch[2]]
    sentence = ("This fit resumes mid-epoch with a stateful train loader whose batches of 10 do not hold auto_plan's pipeline "
                "steps of 8 samples per replica whole, and its checkpoint's step ended inside the epoch's first loader batch (8 "
                "samples into it), whose state before it the loader does not give, so the resumed epoch would skip samples a run "
                "of your loader trains. HINT: Resume from a checkpoint saved at an epoch's end, or mid-epoch by this plan after "
                "the epoch's first loader batch, or use a global_batch_size whose steps hold whole loader batches (a multiple of "
                "10 samples per replica).")
    assert [((d["raised"] or ())[:2], d["rows"]) for d in inside] == [(("InfeasiblePlanError", sentence), [])] * 4, inside
    # a checkpoint with no record of where inside a loader batch its step ended (saved with steps of whole batches of 4)
    threes = [r["unequal"]["resumed in threes"] for r in _launch[2]]
    sentence = ("This fit resumes mid-epoch with a stateful train loader whose batches of 3 do not hold auto_plan's pipeline "
                "steps of 8 samples per replica whole, and its checkpoint does not record where inside a loader batch its last "
                "step ended (saved by another strategy or plan, or by an earlier version of this package), so the resumed epoch "
                "would skip samples a run of your loader trains. HINT: Resume from a checkpoint saved at an epoch's end, or "
                "mid-epoch by this plan after the epoch's first loader batch, or use a global_batch_size whose steps hold whole "
                "loader batches (a multiple of 3 samples per replica).")
    assert [((d["raised"] or ())[:2], d["rows"]) for d in threes] == [(("InfeasiblePlanError", sentence), [])] * 4, threes


def test_rows_beyond_the_samples_of_a_replica_with_more_than_the_fewest_are_refused_on_every_rank(_launch) -> None:
    """Replica 0's ranks 14 samples, replica 1's 16, rank 3's collate_fn making two rows of each (see
    _replicas_of_unequal_data_under_auto_plan): its replica stops after the 1 step of 8 the fewest fill, and reads no
    further (dad6d98), so the rows of its first batch, 8 of 4 samples, went unchecked: it trained 8 of its 32 rows and
    the spread said 8 samples skipped (it skipped 24 rows, 12 of its samples), where a replica of the fewest samples or
    replicas of equal samples with that collate_fn are refused. Refused now on every rank, at its first batch, before
    any step."""
    raised = [r["unequal"]["doubled larger"] for r in _launch[2]]
    sentence = ("A batch of this replica's train loader holds 8 samples where its batch sampler draws at most 4, and auto_plan's pipeline "
                "counts in the sampler's samples what this replica skips beyond the 1 pipeline steps of 8 the replicas' fewest samples "
                "fill, so it would skip more than it says (DDP trains them). HINT: Use a collate_fn (and batch sampler) making one row "
                "of each of the sampler's samples, or strategy='ddp'.")
    assert [d["raised"] for d in raised] == _stopped_by_rank_3(("InfeasiblePlanError", sentence), ("InfeasiblePlanError", sentence)), raised
    assert [d["steps"] for d in raised] == [[]] * 4


def test_a_batch_one_rank_cannot_read_under_auto_plans_pipeline_raises_on_every_rank(_launch) -> None:
    """Rank 3's loader alone yields batches of strings at its second step (see _replicas_of_unequal_data_under_auto_plan):
    it raised alone, and ranks 0-2 waited in the replicas' gradient all-reduce (or p2p) for gloo's timeout or a closed
    connection, a raw gloo error. The ranks' per-step agreement carries the refusal (as dp_ga's per-batch one does):
    every rank raises rank 3's one sentence and HINT, the others with a note naming it."""
    raised = [r["unequal"]["refused"]["raised"] for r in _launch[2]]
    sentence = ("A training batch of type list holds no tensor with a batch dimension to split into micro-batches. HINT: Return "
                "tensors (or dicts/lists/tuples of tensors) from the train dataloader, or use micro_batch_size='auto'.")
    assert raised == _stopped_by_rank_3(("InfeasiblePlanError", sentence), ("InfeasiblePlanError", sentence)), raised


def test_an_error_of_one_ranks_train_loader_under_auto_plans_pipeline_stops_every_rank(_launch) -> None:
    """Rank 3's Dataset alone raises IndexError at its second step's samples (see
    _replicas_of_unequal_data_under_auto_plan): only this package's refusals rode the ranks' per-step agreement, so rank
    3 raised alone and ranks 0-2 waited in the replicas' gradient all-reduce (or p2p) for gloo's timeout or a closed
    connection, a raw gloo error. Now rank 3 raises its own IndexError, its traceback still ending in the Dataset, and the
    others one RuntimeError naming it and rank 3, with a HINT to read rank 3's traceback."""
    failed = [r["unequal"]["failed"] for r in _launch[2]]
    told = ("Global rank 3 raised IndexError (no sample 8 on this rank) reading its train loader, so every rank stops. "
            "HINT: See global rank 3's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    assert [f["raised"] for f in failed] == _stopped_by_rank_3(("RuntimeError", told), ("IndexError", "no sample 8 on this rank")), [
        f["raised"] for f in failed]
    # (as it was raised: the agreement that carried it to the other ranks raised it again, its frames put in the middle)
    frames = failed[3]["raised at"]
    assert frames[-1] == "__getitem__" and not {"raise_on_every_rank", "_agreed_batch_sizes"} & set(frames), frames


@pytest.mark.parametrize("kind", ["unsized sampler", "unsized", "unsized loader"])
def test_a_length_one_rank_cannot_read_under_auto_plan_stops_every_rank(_launch, kind: str) -> None:
    """Rank 3's train loader alone raises ValueError where its length is read (see
    _replicas_of_unequal_data_under_auto_plan): its sampler's, as the pipeline's loader counts the epoch's samples the
    ranks agree on (_FullBatchLoader), and its own, as planning reads the ranks' samples per epoch (samples_per_rank, one
    all-reduce). Only a TypeError (not sized) was caught there, so rank 3 raised alone before the all-reduce the others
    waited in. Now it rides that all-reduce: rank 3 raises its own ValueError, its traceback ending in the __len__, and
    the others one RuntimeError naming it and rank 3. So does its own under a pinned plan, first read as the loader is
    set up (Rechunking.wrap): rank 3 makes the pipeline's loader there as the others do, whose agreement carries it,
    told of the error (left to count its samples, it read the length again: the ValueError shown twice, chained)."""
    unsized = [r["unequal"][kind] for r in _launch[2]]
    told = ("Global rank 3 raised ValueError (no shard index on this rank) reading its train loader, so every rank stops. "
            "HINT: See global rank 3's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    assert [u["raised"] for u in unsized] == _stopped_by_rank_3(("RuntimeError", told), ("ValueError", "no shard index on this rank")), [
        u["raised"] for u in unsized]
    if kind != "unsized":
        frames = unsized[3]["raised at"]
        assert frames[-1] == "__len__" and not {"raise_on_every_rank", "_agreed_batch_sizes"} & set(frames), frames
        assert [u["steps"] for u in unsized] == [[]] * 4
        # raised once: the pipeline's loader, made on rank 3 as on the others, read the length again and raised it a
        # second time, shown chained to the first ("During handling of the above exception, another exception occurred")
        shown = unsized[3]["shown"]
        assert shown.count(", in __len__\n") == 1 and "During handling" not in shown, shown


def test_a_reloaded_loader_one_rank_cannot_read_leaves_the_checkpoint_saved_at_the_error_in_the_first_loaders_batches(_launch) -> None:
    """Rank 3's train loader, loaded again for epoch 1 in batches of 2 where epoch 0's were 4, raises ValueError reading
    its length (see _replicas_of_unequal_data_under_auto_plan): the pipeline's loader, made on every rank, raised there
    (its agreement on the epoch's steps), before the set-up agreement that puts the wrapper's state back where it
    raises, so the checkpoint an OnExceptionCheckpoint saved counted epoch 0's 2 steps in the reloaded loader's batches
    of 2 (4 of them, twice what each process trained in batches of 4). It counts them in epoch 0's batches: 2."""
    reloaded = [r["unequal"]["reloaded unsized"] for r in _launch[2]]
    told = ("Global rank 3 raised ValueError (no shard index on this rank) reading its train loader, so every rank stops. "
            "HINT: See global rank 3's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    assert [r["raised"] for r in reloaded] == [("RuntimeError", told, [f"Raised on global rank 3 reading its train loader; global rank {r} "
                                                                       "stops with it."]) for r in range(3)] + [
        ("ValueError", "no shard index on this rank", [])], [r["raised"] for r in reloaded]
    assert reloaded[0]["progress"] == 2, reloaded[0]


def test_replicas_of_unequal_evaluation_data_validate_and_test_as_ddp_does(_launch) -> None:
    """Each replica's own evaluation data, 8 samples and 4 (see _replicas_of_unequal_data_under_auto_plan): auto_plan's
    fit (sanity check, and validation each epoch) and a plain PipelineStrategy's validate and test finish (they hung in
    the per-step all-reduce of the loss), and give every rank the mean over all 12 samples, as DDP does."""
    ranks = _launch[2]
    fit_val = [r["unequal"]["sized"]["val_loss"] for r in ranks]
    assert len(set(fit_val)) == 1 and fit_val[0] == fit_val[0], fit_val  # one finite value on every rank
    for val_loss, test_loss, whole in (r["unequal"]["evaluated"] for r in ranks):
        assert val_loss == pytest.approx(whole, rel=1e-5) and test_loss == pytest.approx(whole, rel=1e-5), (val_loss, test_loss, whole)


def test_evaluation_data_a_pipeline_cannot_run_is_refused_on_every_rank(_launch) -> None:
    """See _evaluation_data_a_pipeline_cannot_run: one BatchFormatError, the same on every rank, where the ranks hung
    (or timed out in gloo's recv); an empty replica's predict finishes (no prediction on its ranks)."""
    ranks = [r["unequal"]["cannot run"] for r in _launch[2]]
    expected = {
        "empty replica": "BatchFormatError: Pipeline replica 1 (ranks 2, 3) has no validation batches while other replicas have "
                         "some (replica 0: 2, replica 1: 0)",
        "stages differ": "BatchFormatError: The stages of pipeline replica 0 hold different numbers of validation batches "
                         "(stage 0: 2, stage 1: 1)",
        "empty stage": "BatchFormatError: The stages of pipeline replica 1 hold different numbers of test batches (stage 0: 2, stage 1: 0)",
        "streams of stages differ": "BatchFormatError: The stages of pipeline replicas 0, 1 read different numbers of validation "
                                    "batches from a loader without a length (one stage's ended where another's went on)",
        "lengths beside streams": "BatchFormatError: The validation loaders of ranks 1, 3 have no length (a stream) while those of "
                                  "other ranks have one",
        "train lengths beside streams": "BatchFormatError: The train loader of rank 1 has no length (a stream) while those of "
                                        "other ranks have one",
        "streams: an empty stage": "BatchFormatError: The stages of pipeline replica 1 read different numbers of validation batches "
                                   "from a loader without a length (a stage's yielded none where another's yielded some)",
        "streams: an empty replica": "BatchFormatError: Pipeline replica 1 (ranks 2, 3) has no test batches (its loader without a "
                                     "length yielded none) while other replicas have some",
        "streams: one replica's stages differ": "BatchFormatError: The stages of pipeline replica 0 read different numbers of "
                                                "validation batches from a loader without a length (one stage's ended where another's went on)",
        "streams: predicting stages differ": "BatchFormatError: The stages of pipeline replica 0 read different numbers of "
                                             "prediction batches from a loader without a length (one stage's ended where another's went on)",
        "streams under a limit: an empty replica": "BatchFormatError: Pipeline replica 1 (ranks 2, 3) has no validation batches "
                                                   "(its loader without a length yielded none) while other replicas have some",
        "dataloader_iter: streams with an empty stage": "BatchFormatError: The LightningModule's `validation_step` takes "
                                                        "`dataloader_iter`, but PipelineStrategy runs the pipeline in place of `validation_step`",
        "dataloader_iter: train": "BatchFormatError: The LightningModule's `training_step` takes `dataloader_iter`",
        "train: one replica's stages differ": "BatchFormatError: The train loaders of the stages of pipeline replica 1 hold "
                                              "different numbers of batches or samples (from 1 to 2 batches and from 4 to 8 samples per epoch)",
        "a stage reads other samples": "BatchFormatError: The stages of pipeline replica 1 read different validation batches",
        "a stage predicts from other samples": "BatchFormatError: The stages of pipeline replica 1 read different prediction batches",
        "several streams: a replica without the second": "BatchFormatError: Pipeline replica 1 (ranks 2, 3) has no validation "
                                                         "batches of loader 1 (its loader without a length yielded none)",
        "replica 1's stages train on other samples": "BatchFormatError: The stages of pipeline replica 1 read different training batches",
        "several streams part at a loader boundary": "BatchFormatError: The stages of pipeline replica 0 read different numbers of "
                                                     "validation batches from a loader without a length (one stage's ended where another's went on)",
    }
    for case, start in expected.items():
        got = [r[case] for r in ranks]
        assert len(set(got)) == 1 and got[0].startswith(start), got
        assert "HINT: " in got[0] and ". " not in got[0].split(" HINT: ")[0], got
    tested = [r["streams"][0]["test_loss"] for r in ranks]
    assert len(set(tested)) == 1 and math.isfinite(tested[0]), tested
    assert tested[0] == pytest.approx(ranks[0]["the streams' data"][0]["test_loss"], rel=1e-6), (tested, ranks[0]["the streams' data"])
    assert [r["empty replica predicts"] for r in ranks] == [[(4, 4), (4, 4)], [(4, 4), (4, 4)], None, None]
    assert [r["streams: an empty replica predicts"] for r in ranks] == [[(4, 4), (4, 4)], [(4, 4), (4, 4)], [], []]
    assert [r["after streams: an empty replica predicts"] for r in ranks] == [[(4, 4), (4, 4)], [(4, 4), (4, 4)], None, None]
    assert [r["train lengths beside streams: steps"] for r in ranks] == [0, 0, 0, 0]
    assert [r["train: one replica's stages differ: steps"] for r in ranks] == [0, 0, 0, 0]
    assert [r["dataloader_iter: train: steps"] for r in ranks] == [0, 0, 0, 0]
    limited = [r["streams under a limit"][0]["test_loss"] for r in ranks]
    assert len(set(limited)) == 1 and limited[0] == pytest.approx(tested[0], rel=1e-6), (limited, tested)
    sanity = [r["streams at the sanity check"] for r in ranks]
    assert len(set(sanity)) == 1 and math.isfinite(sanity[0]), sanity
    # Replica 1 lacks the first loader, so only its own stages compare their first batches (replica 0 meets it in no
    # collective): its stage 0 warns of the floats that differ, which rank 0's rank_zero_warn alone never knew of.
    floats = "floats differ on a replica without the first loader"
    assert [r[floats] for r in ranks] == [[[(4, 4)], [(4, 4)] * 2]] * 2 + [[[], [(4, 4)] * 2]] * 2
    assert [r[f"{floats}: warned"] for r in ranks] == [False, False, True, False]
    several = [r["several streams"] for r in ranks]
    assert all(s == several[0] for s in several) and [list(s) for s in several[0]] == [["val_loss/dataloader_idx_0"], ["val_loss/dataloader_idx_1"]], several
    assert all(math.isfinite(v) for s in several[0] for v in s.values()), several
    assert [r["several streams predict"] for r in ranks] == [[[(4, 4)] * 2, [(4, 4)]]] * 2 + [[[], [(4, 4)] * 2]] * 2
    # A fit's first batch is compared over every rank too: replica 1's stages reading other samples is refused on
    # replica 0's ranks as well (they waited in the gradients' all-reduce), and other floats warned of from rank 0.
    samples = "replica 1's stages train on other samples"
    assert [r[f"{samples}: steps"] for r in ranks] == [0, 0, 0, 0]
    floats = "replica 1's stages train on other floats"
    assert [r[f"{floats}: steps"] for r in ranks] == [1, 1, 1, 1], [r[floats] for r in ranks]
    warned = [r[f"{floats}: warned"] for r in ranks]
    assert [len(w) for w in warned] == [1, 0, 0, 0], warned
    assert warned[0][0].startswith("The stages of pipeline replica 1 read different training batches"), warned


def test_pipeline_gpipe_and_1f1b_match_single_process(two_rank_run) -> None:
    out, _ = two_rank_run
    for name, schedule, _, _ in MATH_RUNS:
        _check(out, name, schedule, 2, 1)


def test_pipeline_hybrid_dp2_pp2_matches_single_process(_launch) -> None:
    hybrid_out, _, _ = _launch
    for name, schedule, _, _ in HYBRID_RUNS:
        _check(hybrid_out, name, schedule, 4, 2)


def test_pipeline_bf16_mixed_runs_in_autocast_and_matches_a_single_process_bf16_run(two_rank_run) -> None:
    _, results = two_rank_run
    fp32 = reference_weights("transformer")
    bf16 = reference_weights("transformer", autocast_bf16=True)
    for rank, res in enumerate(results):
        autocast = res["bf16_mixed"]["autocast"]
        assert autocast and all(autocast), rank  # every Linear of this rank's stage ran in autocast
    state = results[0]["bf16_mixed"]["state"]  # rank 0 returns the whole module
    assert list(state) == list(fp32) and all(v.dtype == fp32[k].dtype for k, v in state.items())  # float32 weights, as 'bf16-mixed' keeps them
    # bf16 rounds each micro-batch's weight gradients (the single-process run rounds the batch's once): after
    # 10 steps the weights sat 0.006 from the bf16 run and 0.012 from the float32 one (those two are 0.014 apart).
    near = max((state[k] - bf16[k]).abs().max().item() for k in bf16)
    far = max((state[k] - fp32[k]).abs().max().item() for k in fp32)
    assert near < 0.01 and near < 0.75 * far, (near, far)  # the autocast changed the math the way a bf16 run does


def test_pipeline_bf16_true_matches_a_single_process_bf16_true_run(two_rank_run) -> None:
    _, results = two_rank_run
    fp32 = reference_weights("transformer", clip_norm=CLIP)
    bf16 = reference_weights("transformer", clip_norm=CLIP, bf16_true=True)
    for res in results:
        state = res["bf16_true"]
        assert list(state) == list(fp32) and {v.dtype for v in state.values()} == {torch.bfloat16}  # bf16 weights, as 'bf16-true' makes them
        # each micro-batch's gradients are bf16 sums (the single-process run has the batch's at once): the weights
        # sat about 1e-3 (a bf16 step at their size) from the bf16 run's and 8e-3 from the float32 run's
        near = max((state[k].float() - bf16[k].float()).abs().max().item() for k in bf16)
        far = max((state[k].float() - fp32[k]).abs().max().item() for k in fp32)
        assert near < 0.003 and near < 0.5 * far, (near, far)


def test_pipeline_clips_by_the_norm_of_all_the_models_gradients(two_rank_run) -> None:
    _, results = two_rank_run
    expected = reference_weights("gpt2", clip_norm=CLIP)
    torch.testing.assert_close(results[0]["clipped"], expected, rtol=1e-5, atol=2e-6)
    unclipped = reference_weights("gpt2")
    assert max((expected[k] - unclipped[k]).abs().max().item() for k in expected) > 1e-3  # the clipping mattered


def test_tied_parameters_under_accumulation_and_frozen_parameters_match_single_process(two_rank_run) -> None:
    """A later trainer.validate(other_module) on the same Trainer runs that module's weights (it ran the fitted one's).
    A parameter on both stages (GPT-2's tied wte / lm_head) gets each accumulation step's gradient summed over
    the stages once (summed again at every step, its weights ended 0.05 off); a frozen one gets no gradient at
    all, so weight decay leaves it where a single process leaves it (a zero gradient let it decay)."""
    _, results = two_rank_run
    got = results[0]["tied_frozen"]
    torch.testing.assert_close(got["accumulated"], _reference_accumulated(build("gpt2"), STEPS_ACC, 2), rtol=1e-5, atol=2e-6)
    frozen_init = _frozen_tied_gpt2().state_dict()["model.transformer.wte.weight"]
    expected = _reference_accumulated(_frozen_tied_gpt2(), 2, 1)
    torch.testing.assert_close(got["frozen"], expected, rtol=1e-5, atol=2e-6)
    assert torch.equal(got["frozen"]["model.transformer.wte.weight"], frozen_init)
    other = _frozen_tied_gpt2().eval()
    with torch.no_grad():
        expected_val = other.training_step(next(iter(DataLoader(token_data(GLOBAL_BATCH, seed=5), batch_size=GLOBAL_BATCH))), 0).item()
    assert got["other_val_loss"] == pytest.approx(expected_val, rel=1e-5)
    for res in results:  # two flushes of the loader batch per optimizer step: the plan says so, and its global batch is both's
        plan = res["tied_frozen"]["plan"]
        assert (plan.n_microbatches, plan.accumulate_grad_batches, plan.global_batch_size, plan.steps_per_replica) == (N_MICRO, 2, 2 * GLOBAL_BATCH, 2 * N_MICRO)
        assert res["tied_frozen"]["refused"].startswith(
            "The plan runs 2 pipeline flush(es) per optimizer step, but Trainer(accumulate_grad_batches=1) gives 1. "
            "HINT: Pass Trainer(accumulate_grad_batches=2) with this plan."), res["tied_frozen"]["refused"]


def test_a_scheduler_monitoring_what_a_pipeline_does_not_log_is_refused_before_training(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:  # and the module is whole again on every rank (it held one stage's weights)
        assert res["plateau"].startswith("0 True: A learning-rate scheduler monitors 'val_acc', which a pipeline does not log")
    assert "HINT: Monitor 'val_loss'" in results[0]["plateau"]


def test_a_training_step_loss_the_adapters_guess_misses_is_refused_before_the_model_is_cut(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:
        got = res["guessed_loss"]
        assert got["refused"].startswith("PipelineStrategy would train another loss than Penalised.training_step: the pipeline's loss "
                                         "(the built-in adapter's guess) is"), got
        assert "HINT: Define pipeline_loss(self, output, batch)" in got["refused"]
        assert got["steps"] == 0 and got["whole"] and got["seen"] == []
        assert "declared_refused" not in got and got["declared_steps"] == 1  # the same objective declared: it trains


def test_callbacks_a_pipeline_cannot_serve_are_refused_before_the_model_is_cut(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:
        monitored, averaged, pruned, finetuned = res["callbacks"]
        assert monitored.startswith("0 True: PipelineStrategy cannot run this fit: callbacks monitor 'val_mae', which a pipeline does not log"), monitored
        assert "HINT: Monitor 'val_loss' or 'train_loss', or train with strategy='dp_ga'" in monitored
        assert averaged.startswith("0 True: PipelineStrategy cannot run this fit: StochasticWeightAveraging averages the whole model's weights"), averaged
        assert "HINT: Drop StochasticWeightAveraging" in averaged
        # ModelPruning failed at its first pruning or checkpoint (a tensor size mismatch); BackboneFinetuning's param
        # group added at epoch 1 failed the next checkpoint (an IndexError)
        assert pruned.startswith("0 True: PipelineStrategy cannot run this fit: ModelPruning prunes the module in each process"), pruned
        assert finetuned.startswith("0 True: PipelineStrategy cannot run this fit: BackboneFinetuning adds param groups"), finetuned
        assert "HINT: Give configure_optimizers every parameter and unfreeze with requires_grad_(True)" in finetuned


def test_stages_reading_different_batches_are_refused_at_the_first_step(two_rank_run) -> None:
    """Sharded by the global rank, stage 0 fed one batch's inputs and stage 1 took another's targets, silently.
    Token ids tell the samples apart: refused. A batch of floats only trains, with a warning (on rank 0)."""
    _, results = two_rank_run
    assert results[0]["sharded"].endswith("| floats: 2 steps, 1 warning(s)"), results[0]["sharded"]
    for r in (0, 1):
        got = results[r]["sharded"]
        assert got.startswith("0: The stages of pipeline replica 0 read different training batches"), got
        assert "HINT" in got


def test_stages_of_one_replica_holding_loaders_of_other_lengths_are_refused_before_any_step(two_rank_run) -> None:
    """16 samples on rank 0, 12 on rank 1, each its own (see _stages_of_other_lengths): PipelineStrategy and auto_plan's
    pinned pipeline trained 3 steps and 1, then hung (gloo's timeout); now one refusal on every rank where the train
    loader is set up, before any step. Unpinned, the pipelines are ruled out (their stages would read other data), said
    as such, and dp_ga runs: never "would skip up to ... per replica" of the one replica."""
    _, results = two_rank_run
    sentence = ("BatchFormatError: The train loaders of the pipeline's stages hold different numbers of batches or samples "
                "(from 3 to 4 batches and from 12 to 16 samples per epoch), but a replica's stages must read the same batches together")
    for kind in ("pipeline", "pinned"):
        got = [r["other lengths"][kind] for r in results]
        assert got[0] == got[1] and got[0][0].startswith(sentence) and got[0][1] == 0, got
        assert "HINT: " in got[0][0] and ". " not in got[0][0].split(" HINT: ")[0], got
    unpinned = [r["other lengths"]["unpinned"] for r in results]
    assert [u["raised"] for u in unpinned] == [None, None] and all(u["plan"].startswith("dp_ga dp=2 ") for u in unpinned), unpinned
    ranked, said = unpinned[0]["ranked"], unpinned[0]["said"]
    pipelines = [r for r in ranked if r[0] != "dp_ga"]
    assert pipelines and all(not r[1] for r in pipelines), ranked  # every pipeline ruled out (one replica of both ranks)
    assert any("hold different numbers of samples per epoch (16, 12)" in r[2] for r in pipelines), ranked
    assert not any(r[3] for r in ranked) and not any("up to" in m for m in said), (ranked, said)
    assert all("the ranks of one of its replicas hold different numbers of samples per epoch (16, 12)" in m for m in said), said


def test_a_last_batch_that_does_not_split_is_refused_before_the_first_step(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:
        message, steps, unchanged, retried = res["short_last"]
        assert "ends with a batch of 6 samples per replica (70 samples in batches of 16)" in message and "HINT: Pass drop_last=True" in message
        assert steps == 0
        assert unchanged  # whole, with the starting weights: nothing the user owns is lost to a refusal
        assert retried == 2  # the HINT's fix trains the same module (it was refused as holding one stage)


def test_module_is_whole_on_every_rank_after_fit_and_fits_again(two_rank_run) -> None:
    """After fit every rank's module holds all the weights again (as after DDP), and a second Trainer on it works."""
    _, results = two_rank_run
    expected = reference_weights("transformer", steps=2)
    for rank, res in enumerate(results):
        whole = res["whole"]
        torch.testing.assert_close({k: whole["after_first"][k] for k in expected}, expected, rtol=1e-5, atol=2e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(whole["buffers"], {"model.decoder.scale": torch.full((3,), 2.0), "model.decoder.mask": torch.ones(4)})
        assert whole["second_steps"] == 2
    torch.testing.assert_close(results[0]["whole"]["after_second"], results[1]["whole"]["after_second"], rtol=0, atol=0)
    assert set(results[0]["whole"]["after_first"]) == {*expected, "model.decoder.scale"}
    moved = max((results[0]["whole"]["after_second"][k] - expected[k]).abs().max().item() for k in expected)
    assert moved > 1e-4  # the second fit trained the whole module further


def test_pipeline_validate_test_predict_match_single_process(two_rank_run) -> None:
    _, results = two_rank_run
    model = build("transformer")
    model.load_state_dict(reference_weights("transformer"))
    model.eval()
    batches = list(DataLoader(_val_data(), batch_size=GLOBAL_BATCH))
    with torch.no_grad():
        ref_loss = torch.stack([model.training_step(b, i) for i, b in enumerate(batches)]).mean().item()
        ref_pred = [model.predict_step(b, i) for i, b in enumerate(batches)]
    for rank, res in enumerate(results):
        got = res[("transformer", "gpipe")]
        for key in ("fit_val_loss", "validate", "test"):
            assert got[key] == pytest.approx(ref_loss, rel=1e-5), (rank, key)
        assert got["sync_dist_advice"] == []  # the strategy's own loss logs draw no advice to the user
        assert len(got["predict"]) == VAL_BATCHES  # every rank of the pipeline returns the last stage's output
        torch.testing.assert_close(got["predict"], ref_pred, rtol=1e-5, atol=1e-6)


def _per_microbatch_saved_bytes() -> tuple[int, int]:
    """Saved bytes of ONE micro-batch per stage, measured single-process on the unsplit chain."""
    from lightning_distplan._layers import discover_layers

    torch.manual_seed(0)
    module = TinyMLP()
    spec = discover_layers(module).spec
    assert spec is not None
    x, y = mlp_data()[: GLOBAL_BATCH // N_MICRO]
    exclude = tensor_storages(module)
    with SavedBytesCounter(exclude=exclude) as stage0:
        h = x
        for layer in spec.layers[:MLP_BOUNDARY]:
            h = layer(h)
    h = h.detach().requires_grad_()  # stage 1 receives a fresh tensor, as over p2p
    with SavedBytesCounter(exclude=exclude) as stage1:
        for layer in spec.layers[MLP_BOUNDARY:]:
            h = layer(h)
        loss = spec.loss(h, (x, y))
    del loss
    return stage0.peak, stage1.peak


def test_pipeline_1f1b_keeps_fewer_activations_than_gpipe(two_rank_run) -> None:
    _, results = two_rank_run
    peak = {s: [r[("memory", s)]["peak"] for r in results] for s in ("gpipe", "1f1b")}
    per_mb = _per_microbatch_saved_bytes()
    p, n = 2, N_MICRO
    assert peak["1f1b"][0] < peak["gpipe"][0]
    for k in range(p):
        # Each micro-batch saves exactly its own tensors, so the counts are exact multiples (5% slack for
        # anything the runtime might add).
        assert peak["gpipe"][k] == pytest.approx(n * per_mb[k], rel=0.05), (k, peak, per_mb)
        assert peak["1f1b"][k] == pytest.approx(min(n, p - k) * per_mb[k], rel=0.05), (k, peak, per_mb)
        assert all(r[("memory", s)]["live_after"] == 0 for r in results for s in peak), "backward frees everything"

    # The cost model, fed a single-process profile of the same model, predicts the same bytes.
    predicted, boundary = _cost_model_activations(p, n)
    for s in ("gpipe", "1f1b"):
        # 20%: the profile splits the whole-step fit over layers by their own counts (seed 000 §III-B fits).
        assert peak[s][0] == pytest.approx(predicted[s][0], rel=0.20), (s, peak[s][0], predicted[s][0])
        # Stage 1 also saves the tensor it RECEIVES (its first Linear saves its input): a new storage
        # that the single-process profile counted once, on stage 0's ReLU. The cost model adds it.
        expected = predicted[s][1]
        assert peak[s][1] == pytest.approx(expected, rel=0.20), (s, peak[s][1], predicted[s][1], boundary)


def _cost_model_activations(p: int, n: int) -> tuple[dict[str, list[float]], float]:
    """Activation bytes per stage that ``costmodel.predict`` expects, and the stage-0 -> 1 boundary tensor's bytes."""
    from lightning_distplan.costmodel import in_flight_microbatches, predict
    from lightning_distplan.plan import Plan
    from lightning_distplan.profiling import profile_module

    torch.manual_seed(0)
    m = GLOBAL_BATCH // n
    loader = DataLoader(mlp_data(), batch_size=m)
    profile = profile_module(TinyMLP(), loader, micro_batch_sizes=(2, 4, 8), device="cpu", warmup=0, repeats=1, measure_links=False)
    stage_mem = {}
    for s in ("gpipe", "1f1b"):
        plan = Plan(strategy=s, dp=1, pp=p, micro_batch_size=m, n_microbatches=n, global_batch_size=GLOBAL_BATCH,
                    stage_boundaries=(MLP_BOUNDARY,), layer_names=tuple(l.name for l in profile.layers))
        stage_mem[s] = predict(profile, plan).stage_memory_bytes
    predicted: dict[str, list[float]] = {"gpipe": [], "1f1b": []}
    boundary = m * profile.layers[MLP_BOUNDARY - 1].output_bytes_per_sample
    for k in range(p):
        # Params, grads, optimizer, overhead and the n receive buffers are the same under both schedules; the
        # difference is (n − in_flight_1f1b) micro-batches of this stage's activations. What the meter counts,
        # saved tensors, holds those and, on stage 1, the receive buffer of each micro-batch in flight (its
        # first Linear saves its input).
        per_mb = (stage_mem["gpipe"][k] - stage_mem["1f1b"][k]) / (n - in_flight_microbatches("1f1b", n, p, k))
        for s in predicted:
            predicted[s].append(in_flight_microbatches(s, n, p, k) * (per_mb + (boundary if k else 0.0)))
    return predicted, boundary


def test_pipeline_costmodel_counts_received_boundary_activation(two_rank_run) -> None:
    _, results = two_rank_run
    predicted, _ = _cost_model_activations(2, N_MICRO)
    for s in ("gpipe", "1f1b"):
        assert results[1][("memory", s)]["peak"] == pytest.approx(predicted[s][1], rel=0.20)


def test_pipeline_deferred_batchnorm_keeps_full_batch_statistics(two_rank_run) -> None:
    _, results = two_rank_run
    stats = results[0]["deferred_bn"]["stats"]  # rank 0 = stage 0, which holds the first BatchNorm
    # One commit per optimizer step, not one per micro-batch (plain BatchNorm would count 4 per step).
    assert [int(s["num_batches_tracked"]) for s in stats] == [1, 2]
    # The first BatchNorm sees the same inputs as a single-process step on the whole batch, so after
    # step 1 its running statistics are exactly the full-batch ones (torch's extra shape-inference
    # forward must not be counted). Later BatchNorms normalise per micro-batch in the forward, as in
    # GPipe, so only their running statistics are full-batch, of slightly different inputs.
    model = TinyConvBN()
    data = image_data()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:GLOBAL_BATCH]
    with torch.no_grad():
        x = model.model[0](data.tensors[0][order])  # what the first BatchNorm sees
    momentum = model.model[1].momentum
    torch.testing.assert_close(stats[0]["running_mean"], momentum * x.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    # fairscale's DeferredBatchNorm commits the biased variance (torch's BatchNorm the unbiased one, a
    # 1/(N-1) = 5e-4 relative difference here); E[x²] - E[x]² in float32 needs rtol 1e-4.
    expected_var = (1 - momentum) + momentum * x.var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(stats[0]["running_var"], expected_var, rtol=1e-4, atol=1e-6)


def test_deferred_batchnorm_leaves_the_users_module_and_checkpoints_plain(two_rank_run) -> None:
    """No DeferredBatchNorm key or layer outlives the fit: the checkpoint loads into the plain module (and resumes)."""
    _, results = two_rank_run
    plain = TinyConvBN()
    for res in results:
        after = res["deferred_bn"]["after"]
        assert after["classes"] == [type(m).__name__ for m in plain.model]  # BatchNorm2d again, not DeferredBatchNorm
        assert list(after["state"]) == list(plain.state_dict())
        assert int(after["state"]["model.1.num_batches_tracked"]) == 2  # the committed statistics stayed with the layer
        torch.testing.assert_close(after["after_validate"], after["state"], rtol=0, atol=0)
        assert res["deferred_bn"]["resumed_steps"] == 3
    ckpt = torch.load(results[0]["deferred_bn"]["path"], weights_only=True)
    assert list(ckpt["state_dict"]) == list(plain.state_dict())
    plain.load_state_dict(ckpt["state_dict"])  # strict
    torch.testing.assert_close(plain.state_dict(), results[0]["deferred_bn"]["after"]["state"], rtol=0, atol=0)


def test_a_parameter_only_the_loss_uses_is_named_as_untrained(two_rank_run) -> None:
    _, results = two_rank_run
    named, plain = results[0]["loss_only"]
    assert "holds 1 parameter(s) that belong to no pipeline layer (log_scale)" in named
    assert "holds 1 tensor(s) that are not parameters of the module" in plain and "dropped from the optimizer" in plain


def test_a_stage_unfrozen_during_the_fit_trains_as_in_one_process(two_rank_run) -> None:
    _, results = two_rank_run
    ref = _unfreeze_reference(steps_per_epoch=4)
    torch.manual_seed(1234)
    start = _UnfreezeMLP().state_dict()
    moved = {k: ref[k] - start[k] for k in ref}
    assert min(moved[k].abs().max() for k in ("model.0.weight", "model.2.weight")) > 1e-3  # stage 0 trained in epoch 1
    for res in results:  # to 1e-6, a thousandth of what stage 0 moved
        torch.testing.assert_close(res["unfreeze"], ref, rtol=1e-5, atol=1e-6)


def test_the_strategy_gives_hooks_the_whole_models_gradient_norm(two_rank_run) -> None:
    """Lightning's grad_norm(module) in a hook reads the process's own stage; strategy.grad_norm() is the whole model's
    (GPT-2's tied embedding counted once), the same on both ranks, for the 2-, 1- and inf-norm."""
    _, results = two_rank_run
    model = build("gpt2")
    model.training_step(next(iter(DataLoader(token_data(GLOBAL_BATCH), batch_size=GLOBAL_BATCH))), 0).backward()
    grads = [p.grad.flatten() for p in model.parameters()]  # parameters() yields a tied one once
    want = {"2": torch.cat(grads).norm(2), "1": torch.cat(grads).norm(1), "inf": torch.cat(grads).abs().max()}
    got = [res["grad_norms"] for res in results]
    for res in got:
        for key, value in want.items():
            assert res[key] == pytest.approx(float(value), rel=1e-4), (key, res[key], float(value))
        assert res["refused"].startswith("`norm_type` must be a positive number or inf, got -1.") and "HINT:" in res["refused"]
    # the hook reading gradients is named once, on rank 0; a fit whose hooks read none (the probe of the next test) is not warned
    assert results[0]["grad_norms"]["hook_warnings"] == [
        "PipelineStrategy: _NormLoggingGPT2.on_before_optimizer_step run(s) in each process on its own pipeline stage, so the "
        "gradients and weights read there are that stage's only (Lightning's grad_norm(self) gives the stage's norm). For the "
        "whole model's gradient norm call self.trainer.strategy.grad_norm() on every rank."]
    assert results[1]["grad_norms"]["hook_warnings"] == [] == results[0]["old_grads"]["stock"]["hook_warnings"]
    assert min(res["lightning"] for res in got) < 0.9 * float(want["2"])  # a stage's own norm: what the README warns of


def test_a_loss_the_last_stage_cannot_compute_is_refused_on_every_rank_before_the_cut(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:  # the same error on both ranks, global_step 0, the module whole
        penalty, vector = res["bad_losses"]
        assert penalty.startswith("0 True: ModelSplitError: PipelineSpec.loss uses `model.0.weight`, which belongs to a layer of another "
                                  "pipeline stage; the last stage (stage 1)"), penalty
        assert vector.startswith("0 True: BatchFormatError: PipelineSpec.loss returned a tensor of shape (4, 4); it must return"), vector


def test_a_param_group_added_during_the_fit_is_refused_at_the_next_step(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:  # epoch 0's four steps ran; epoch 1's first step is refused before it moves a weight
        assert res["late_group"].startswith("4: The optimizer has 2 param groups, but 1 when the pipeline split it by stage"), res["late_group"]
        assert "HINT: Give configure_optimizers every parameter from the start" in res["late_group"]


def test_the_model_summary_counts_the_whole_module_and_runs_its_example_input(two_rank_run) -> None:
    """Lightning's ModelSummary runs after the model is cut: it counted rank 0's stage alone, and a module with an
    example_input_array failed in its forward pass (on the emptied tensors of the other stage)."""
    _, results = two_rank_run
    res = results[0]["summary"]
    data, total, trainable = res["seen"]
    assert total == trainable == res["whole"] == 9668
    assert data["In sizes"][0] == "[2, 16]" and data["Out sizes"][0] == "[2, 4]"  # the whole model's forward pass
    assert data["Name"][:2] == ["model", "model.0"]
    assert results[1]["summary"]["seen"] is None  # rank 1 prints nothing
    assert all(r["summary"]["own_summary"] for r in results)  # the callback summarises on its own again after the fit


def test_a_failed_pipeline_fit_leaves_a_partial_module_that_is_not_trained_again(two_rank_run) -> None:
    _, results = two_rank_run
    for rank, res in enumerate(results):
        assert res["failed"]["empty"], rank  # the other stage's tensors are empty on this rank
        assert f"holds only pipeline stage {rank}'s weights on this rank" in res["failed"]["refused"]
        assert "HINT: Load the whole model from the last checkpoint" in res["failed"]["refused"]


def test_pipeline_spawn_start_method_returns_full_weights(tmp_path, monkeypatch) -> None:
    """``start_method="spawn"`` from this (plain, non-distributed) process: Lightning's own spawn launcher.

    Each worker holds one stage; the launcher gathers the full weights and loads them into the
    caller's model, which then equals the single-process result. The folder the weights crossed in
    goes with them (it stayed, empty, in the temporary folder after each fit).
    """
    import tempfile

    from lightning_distplan.strategies.pipeline import PipelineStrategy

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # the spawned workers' temporary folder
    monkeypatch.setattr(tempfile, "tempdir", None)
    # a port an earlier test's one-process fit exported (Lightning sets MASTER_PORT) may still be held by its store:
    # let the launcher find a free one (CI once failed here with EADDRINUSE)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    model = build("transformer")
    strategy = PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=8, start_method="spawn")
    trainer = L.Trainer(**trainer_kwargs(2, strategy, str(tmp_path)))
    trainer.fit(model, DataLoader(token_data(), batch_size=GLOBAL_BATCH))
    torch.testing.assert_close(model.state_dict(), reference_weights("transformer"), rtol=1e-5, atol=2e-6)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_shape_inference_leaves_no_trace_in_buffers_ids_or_the_loss(two_rank_run) -> None:
    """torch's step-0 shape inference runs later stages on tensors of the received shapes: they are zeros (ids stay
    in an embedding's range), a re-assigned buffer gets its tensor back, and the user's loss never sees that run."""
    _, results = two_rank_run
    reference = _IdsThenCenter()  # the same micro-batches in one process: the mean of micro-batch losses per step
    opt = reference.configure_optimizers()
    order = torch.randperm(2 * GLOBAL_BATCH, generator=torch.Generator().manual_seed(0)).tolist()
    for batch in DataLoader(_ids_data(), batch_size=GLOBAL_BATCH, sampler=order):
        opt.zero_grad()
        for micro in zip(*(t.chunk(N_MICRO) for t in batch)):
            (reference.training_step(list(micro), 0) / N_MICRO).backward()
        opt.step()
    for res in results:  # the whole module on every rank after the fit, and in the checkpoint
        torch.testing.assert_close(res["shape_inference"]["state"], reference.state_dict(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["shape_inference"]["saved"], reference.state_dict(), rtol=1e-5, atol=1e-6)
    assert reference.criterion.mean > 0.1  # the loss's running mean moved: the last stage's copy (stage 0's stayed 0)
    assert results[0]["shape_inference"]["state"]["center.mu"].abs().max() < 10  # (was ~1e35: the inference's uninitialised input)
    assert results[1]["shape_inference"]["loss_calls"] == 2 * N_MICRO  # last stage: 2 steps of N_MICRO, no extra call
    assert results[0]["shape_inference"]["loss_calls"] == 0


def test_batches_of_many_shapes_keep_a_bounded_number_of_schedules(two_rank_run) -> None:
    from lightning_distplan.strategies.pipeline import _SCHEDULE_CACHE

    _, results = two_rank_run
    for res in results:
        assert res["many_shapes"]["steps"] == _SCHEDULE_CACHE + 2
        assert res["many_shapes"]["kept"] == _SCHEDULE_CACHE
    assert len(results[0]["many_shapes"]["warned"]) == 1 and "Pad batches to a few fixed lengths" in results[0]["many_shapes"]["warned"][0]


def test_each_stage_draws_its_own_dropout_masks_and_leaves_the_ranks_generators_alike(two_rank_run) -> None:
    _, results = two_rank_run
    stage0, stage1 = results[0]["dropout"]["masks"], results[1]["dropout"]["masks"]
    assert len(stage0) == len(stage1) == 1 + 2 * 2  # torch's shape inference (its RNG forked), then 2 steps x 2 micro-batches
    assert all(a.shape == b.shape for a, b in zip(stage0, stage1))
    assert not any(torch.equal(a, b) for a, b in zip(stage0[1:], stage1[1:]))  # were equal: the same seed on both ranks
    assert all(0.3 < m.float().mean().item() < 0.7 for m in stage0 + stage1)  # still p = 0.5 dropout
    torch.testing.assert_close(results[0]["dropout"]["after"], results[1]["dropout"]["after"], rtol=0, atol=0)


def test_last_steps_gradients_are_let_go_before_the_next_steps_backward(two_rank_run) -> None:
    """Lightning frees the gradients (zero_grad, set to None) right after training_step at the first batch of an
    accumulation cycle; the pipeline runs the whole backward inside training_step, so it lets them go first (DDP's
    backward never meets them either). Accumulated ones stay, and so do any a hook before zero_grad may read."""
    _, results = two_rank_run
    for res in results:
        stock, hooked = res["old_grads"]["stock"], res["old_grads"]["hooked"]
        (b1, alive1, n1), (b2, alive2, n2), (b3, alive3, n3) = stock["alive"][1:]
        assert (b1, b2, b3) == (1, 2, 3) and min(n1, n2, n3) > 0
        assert alive1 == n1 and alive3 == n3, stock["alive"]  # batch 0's / 2's gradients, still being accumulated
        assert alive2 == 0, stock["alive"]  # step 1's gradients: gone before step 2's backward
        assert [alive for _, alive, n in hooked["alive"][1:]] == [n for _, _, n in hooked["alive"][1:]]  # all kept
        assert hooked["read_at_zero_grad"][1] > 0  # the hook at step 2 read step 1's gradients
        torch.testing.assert_close(stock["weights"], hooked["weights"], rtol=0, atol=0)


def test_gradients_kept_in_the_pipelines_receive_buffers_are_not_overwritten_by_the_next_flush(two_rank_run) -> None:
    """A parameter used as x + b.view(1, -1) gets its gradient in the receive buffer of the gradient the stage got;
    kept for accumulation (or zeroed in place by zero_grad(set_to_none=False)) it was overwritten by the next flush's
    receive: 0.40 off after 2 steps. The weights now match one process's plain loop."""
    _, results = two_rank_run
    got = results[0]["receive_buffers"]
    for (keep_zeros, accumulate), state in got.items():
        torch.testing.assert_close(state, _view_bias_reference(keep_zeros, accumulate), rtol=1e-5, atol=2e-6, msg=f"{keep_zeros} {accumulate}")


def test_the_plan_follows_a_changing_accumulation_and_auto_plan_does_not_resume_a_plan_of_several_flushes(two_rank_run) -> None:
    _, results = two_rank_run
    for res in results:
        got = res["flushes"]
        # (trainer's accumulation, the plan's flushes, its global batch) at each epoch's end: the plan followed the scheduler
        assert got["seen"] == [(1, 1, 8), (2, 2, 16)], got["seen"]
        assert (got["stored"]["accumulate_grad_batches"], got["stored"]["global_batch_size"]) == (2, 16)
        # auto_plan's global batch is 4 x 2 x 2 = 16 too, but it runs one flush a step: planned again, and trained on
        assert got["resumed_source"] == "profiled" and got["resumed"].global_batch_size == 16 and got["resumed_steps"] > 6


def _reduce_unused_worker(rank: int, world: int) -> dict[str, Any]:
    """Run in the 2-rank launch, over the world group its fits left alive (a group of its own if there is none)."""
    import torch.distributed as dist

    from lightning_distplan.strategies.pipeline import _all_reduce_mean

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    assert dist.get_world_size() == world
    used, one_rank, nowhere = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    grads = {used: torch.full((3,), float(rank + 1))}
    if rank == 0:
        grads[one_rank] = torch.full((3,), 4.0)
    _all_reduce_mean([used, one_rank, nowhere], grads, None, divide_by=world)
    return {"used": grads[used].tolist(), "one_rank": grads[one_rank].tolist(), "nowhere": nowhere in grads}


def test_a_parameter_no_replica_has_a_gradient_for_gets_none_as_under_ddp(two_rank_run) -> None:
    """The hybrid dp x pp gradient reduce: a stage parameter that no replica's loss used (an unused head inside a
    layer) stays without a gradient, as DistributedDataParallel(find_unused_parameters=True) leaves it; with a zero
    gradient, weight decay and momentum moved it, unlike a dp_ga fit (dp=2 pp=2: 0.007 after three SGD steps of
    weight_decay=0.1). One that some replica used gets the mean, zeros counted for the others."""
    _, results = two_rank_run
    for res in (r["reduce_unused"] for r in results):
        assert res == {"used": [1.5] * 3, "one_rank": [2.0] * 3, "nowhere": False}


def test_evaluation_epoch_start_hooks_reach_the_first_batch(two_rank_run) -> None:
    """See _evaluation_restarted_and_epoch_start_hooks: the on_*_epoch_start hooks' shifted data reaches every batch,
    the first (fetched ahead for the run-start checks) too, as under DDP."""
    _, results = two_rank_run
    for res in results:
        seen = res["eval_restart"]
        runs = [*seen[1.0], *seen[3], seen["test, predict"]]
        assert [[batch[:2] for batch in run if not batch[3]] for run in runs] == [[] for _ in runs]


def test_a_fit_restarted_mid_validation_runs_the_batches_left(two_rank_run) -> None:
    """See _evaluation_restarted_and_epoch_start_hooks: the batches DDP runs (index, is_last_batch), each rank's first
    fetched ahead for the run-start checks, in a fit resumed from a checkpoint saved mid-validation and in fresh runs."""
    _, results = two_rank_run

    def run(step: Any, n: int) -> list[tuple[Any, ...]]:
        return [(step, i, i == n - 1) for i in range(n)]

    for res in results:
        seen = {key: [[batch[:3] for batch in run] for run in runs] if key != "test, predict" else [b[:3] for b in runs]
                for key, runs in res["eval_restart"].items()}
        assert seen[1.0] == [run(2, 5) + run(4, 5), run(2, 4) + run(4, 5)]  # resumed: the 4 batches left of 5
        assert seen[3] == [run(2, 3) + run(4, 3), run(2, 2) + run(4, 3)]  # under limit_val_batches=3: the 2 left
        assert seen["test, predict"] == run("test", 2) + run("predict", 2)
