"""dp_ga: same math as one process, no all-reduce on accumulation micro-batches, planned micro-batch size."""

from __future__ import annotations

import os
import time
from typing import Any

import lightning as L
import pytest
import torch
from _dist_utils import run_on_ranks
from _tiny_lm import TinyLM, cpu_state, token_dataset, trainer_kwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_distplan import InfeasiblePlanError, Plan
from lightning_distplan.strategies import DPGAStrategy
from lightning_distplan.strategies.dp_ga import _rebatch, resolve_dp_ga_plan


def _counting_allreduce(state, bucket):  # noqa: ANN001, ANN202 — DDP checks real (non-string) annotations
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


class _CountAllReduce(L.Callback):
    """Counts DDP gradient all-reduces (Lightning registers comm hooks only on CUDA, so do it here)."""

    def __init__(self) -> None:
        self.state = {"calls": 0}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, _counting_allreduce)


def _train_dp_ga(rank: int, world_size: int, steps: int, archs: tuple[str, ...]) -> dict[str, Any]:
    # Several models in one pair of processes: starting a rank costs more than training a tiny model.
    return {arch: _train_one(world_size, steps, arch) for arch in archs}


def _train_one(world_size: int, steps: int, arch: str) -> dict[str, Any]:
    model = TinyLM(n_samples=320, loader_batch=16, arch=arch)
    counter = _CountAllReduce()
    comm_state = counter.state
    # bucket_cap_mb: the whole tiny model in one gradient bucket, so one all-reduce = one hook call
    strategy = DPGAStrategy(micro_batch_size=4, bucket_cap_mb=100)
    trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=world_size, max_steps=steps, callbacks=[counter]))
    trainer.fit(model)
    return {
        "state": cpu_state(model),
        "plan": strategy.plan,
        "micro_batch_sizes": model.micro_batch_sizes,
        "allreduce_calls": comm_state["calls"],
        "global_step": trainer.global_step,
        "accumulate_after_fit": trainer.accumulate_grad_batches,
    }


ARCHS = ("transformer", "gpt2")  # Lightning's demo Transformer; Hugging Face GPT-2 from a tiny config


def test_dp_ga_same_math_as_single_process() -> None:
    """2 ranks x m=4 x s=4 (loader batch 16 re-chunked) for 10 steps == 1 process, batch 32, 10 steps."""
    t0 = time.perf_counter()
    results = run_on_ranks(_train_dp_ga, 2, 10, ARCHS)
    torch.set_num_threads(1)
    for arch in ARCHS:
        _check_same_math([r[arch] for r in results], arch)
    print(f"same-math test ({', '.join(ARCHS)}) {time.perf_counter() - t0:.1f}s")


def _check_same_math(ranks: list[dict[str, Any]], arch: str) -> None:
    reference = TinyLM(n_samples=320, loader_batch=32, reference_sampler=True, arch=arch)
    L.Trainer(**trainer_kwargs(devices=1, max_steps=10)).fit(reference)

    for r in ranks:
        assert r["plan"] == Plan(strategy="dp_ga", dp=2, micro_batch_size=4, accumulate_grad_batches=4, global_batch_size=32)
        assert r["global_step"] == 10
        assert r["micro_batch_sizes"] == [4] * 40  # the planned micro-batch, not the loader's 16
        assert r["allreduce_calls"] == 10  # one all-reduce per optimizer step: no_sync on 3 of 4 micro-batches
        assert r["accumulate_after_fit"] == 1  # the user's Trainer setting is restored
    assert reference.micro_batch_sizes == [32] * 10
    torch.testing.assert_close(ranks[0]["state"], ranks[1]["state"], rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["state"], cpu_state(reference), rtol=1e-5, atol=1e-6)
    initial = TinyLM(arch=arch).state_dict()
    changed = max((ranks[0]["state"][k] - initial[k]).abs().max().item() for k in ranks[0]["state"])
    assert changed > 1e-3  # the weights really moved


def test_rebatch_splits_merges_and_keeps_order() -> None:
    x = torch.arange(40).reshape(20, 2)
    batches = [{"x": x[i : i + 4], "y": (x[i : i + 4, 0], "tag")} for i in range(0, 20, 4)]  # 5 loader batches of 4
    for m in (1, 2, 3, 4, 6, 8, 20):
        out = list(_rebatch(batches, m))
        sizes = [b["x"].shape[0] for b in out]
        assert sizes == [m] * (20 // m) + ([20 % m] if 20 % m else [])
        torch.testing.assert_close(torch.cat([b["x"] for b in out]), x)
        torch.testing.assert_close(torch.cat([b["y"][0] for b in out]), x[:, 0])
        assert all(b["y"][1] == "tag" for b in out)  # non-batch leaves are carried along
    split = list(_rebatch([x[:8]], 4))
    assert split[0].data_ptr() == x.data_ptr()  # splitting returns views, no copy


def test_resolve_plan_from_loader_and_arguments() -> None:
    kw = dict(world_size=2, loader_batch=16, user_accumulate=1)
    assert resolve_dp_ga_plan(**kw).describe() == "dp_ga dp=2 m=16 accumulate=1"
    assert resolve_dp_ga_plan(**kw, micro_batch_size=4).accumulate_grad_batches == 4
    assert resolve_dp_ga_plan(**kw, accumulate_grad_batches=8).micro_batch_size == 2
    # user accumulation is part of the global batch: 2 x 4 x 8 = 64, run as m=16, s=2
    p = resolve_dp_ga_plan(world_size=2, loader_batch=4, user_accumulate=8, micro_batch_size=16)
    assert (p.global_batch_size, p.micro_batch_size, p.accumulate_grad_batches) == (64, 16, 2)
    stored = Plan(strategy="dp_ga", dp=2, micro_batch_size=8, accumulate_grad_batches=2, global_batch_size=32)
    assert resolve_dp_ga_plan(**kw, checkpoint_plan=stored) == stored  # resume does not re-plan
    other_world = Plan(strategy="dp_ga", dp=4, micro_batch_size=8, accumulate_grad_batches=1, global_batch_size=32)
    assert resolve_dp_ga_plan(**kw, checkpoint_plan=other_world).dp == 2


def test_bad_inputs_raise_with_hint() -> None:
    kw = dict(world_size=2, loader_batch=16, user_accumulate=1)
    with pytest.raises(InfeasiblePlanError, match=r"micro_batch_size=3 does not divide the 16 samples.*HINT: Pick micro_batch_size among \[1, 2, 4, 8, 16\]"):
        resolve_dp_ga_plan(**kw, micro_batch_size=3)
    with pytest.raises(InfeasiblePlanError, match=r"\(4\) x accumulate_grad_batches \(2\) = 8 differs.*HINT"):
        resolve_dp_ga_plan(**kw, micro_batch_size=4, accumulate_grad_batches=2)
    plan4 = Plan(strategy="dp_ga", dp=4, micro_batch_size=4, accumulate_grad_batches=2, global_batch_size=32)
    with pytest.raises(InfeasiblePlanError, match=r"dp=4 replicas but the trainer runs on 2 processes.*HINT"):
        resolve_dp_ga_plan(**kw, plan=plan4)
    plan64 = Plan(strategy="dp_ga", dp=2, micro_batch_size=4, accumulate_grad_batches=8, global_batch_size=64)
    with pytest.raises(InfeasiblePlanError, match=r"global batch \(64\) differs from the user's.*= 32.*HINT"):
        resolve_dp_ga_plan(**kw, plan=plan64)
    pipe = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=4, n_microbatches=8, global_batch_size=32)
    with pytest.raises(InfeasiblePlanError, match=r"runs dp_ga plans, got a 1f1b plan.*HINT: Use Trainer\(strategy='1f1b'\)"):
        DPGAStrategy(plan=pipe)
    with pytest.raises(InfeasiblePlanError, match=r"`micro_batch_size` must be a positive integer or 'auto', got 0.*HINT"):
        DPGAStrategy(micro_batch_size=0)
    with pytest.raises(InfeasiblePlanError, match="cannot be read.*HINT"):
        resolve_dp_ga_plan(world_size=2, loader_batch=None, user_accumulate=1, micro_batch_size=4)


def test_plan_world_size_mismatch_fails_before_training() -> None:
    plan = Plan(strategy="dp_ga", dp=2, micro_batch_size=8, accumulate_grad_batches=2, global_batch_size=32)
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(plan=plan), devices=1, max_steps=1))
    environ = dict(os.environ)
    try:
        with pytest.raises(InfeasiblePlanError, match=r"dp=2 replicas but the trainer runs on 1 processes.*HINT"):
            trainer.fit(TinyLM(n_samples=64, loader_batch=16))
        assert not torch.distributed.is_initialized()  # raised before any process group was created
    finally:  # Lightning's launcher exported LOCAL_RANK/MASTER_PORT; other tests must not inherit them
        os.environ.clear()
        os.environ.update(environ)


def test_unsized_iterable_loader_runs_as_is_when_nothing_is_asked() -> None:
    """A loader with no readable batch size is left alone by ``DPGAStrategy()`` (single process: no group)."""

    class Gen(TinyLM):
        def train_dataloader(self) -> Any:
            loader = super().train_dataloader()
            return _Iterable(loader)

    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(), devices=1, max_steps=2, use_distributed_sampler=False))
    model = Gen(n_samples=64, loader_batch=8)
    environ = dict(os.environ)
    try:
        trainer.fit(model)
    finally:
        # Leave no process group and no LOCAL_RANK/MASTER_PORT (which Lightning exports) behind for other tests.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert trainer.strategy.plan is None and model.micro_batch_sizes == [8, 8]


class _Iterable:
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)


class _Validated(TinyLM):
    """TinyLM with a validation loop that counts its runs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validations = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_validation_start(self) -> None:
        self.validations += 1

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(token_dataset(8), batch_size=8)


def _fit_single(strategy: Any, epochs: int, **kwargs: Any) -> tuple[L.Trainer, _Validated]:
    model_kwargs = {k: kwargs.pop(k) for k in ("n_samples", "loader_batch", "reference_sampler") if k in kwargs}
    model = _Validated(**model_kwargs)
    extra = {"strategy": strategy} if strategy is not None else {}
    trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=epochs, **extra, **kwargs))
    trainer.fit(model)
    return trainer, model


def test_short_last_batch_and_batch_counts_keep_the_users_meaning() -> None:
    """One process: dp_ga's micro-batches give the weights of the plain run with the user's loader,
    where the epoch ends in a short batch, and integer limit_train_batches / val_check_interval
    still count the user's loader batches."""
    environ = dict(os.environ)
    try:
        cases = [
            # (loader batch, Trainer accumulate, micro-batch, extra Trainer arguments)
            (8, 1, 2, {}),  # 20 samples: 8, 8, 4 -> micro-batches 2 x 10; the last loader batch counts as much as a full one
            (4, 2, 8, {}),  # 4, 4 | 4, 4 | 4: the last step holds one loader batch, weighed 1/2 as Lightning does
            (8, 1, 2, {"limit_train_batches": 2, "val_check_interval": 1}),
        ]
        for loader_batch, accumulate, m, extra in cases:
            common = dict(n_samples=20, loader_batch=loader_batch, accumulate_grad_batches=accumulate, **extra)
            ref_trainer, reference = _fit_single(None, 2, reference_sampler=True, **common)
            trainer, model = _fit_single(DPGAStrategy(micro_batch_size=m), 2, **common)
            assert trainer.global_step == ref_trainer.global_step, (loader_batch, m, extra)
            assert model.validations == reference.validations, (loader_batch, m, extra)
            assert sum(model.micro_batch_sizes) == sum(reference.micro_batch_sizes)  # the same samples were trained on
            assert max(model.micro_batch_sizes) == m  # the planned micro-batch (the epoch's last may be shorter)
            torch.testing.assert_close(cpu_state(model), cpu_state(reference), rtol=1e-5, atol=1e-6)
            assert (trainer.limit_train_batches, trainer.val_check_interval) == (extra.get("limit_train_batches", 1.0), extra.get("val_check_interval", 1.0))
        assert ref_trainer.global_step == 4 and reference.validations == 2 * 2  # the limit case: 2 steps and 2 validations per epoch
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
