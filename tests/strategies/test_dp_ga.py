"""dp_ga: same math as one process, no all-reduce on accumulation micro-batches, planned micro-batch size."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import time
import traceback
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from _dist_utils import ResumableLoader, run_on_ranks
from _tiny_lm import TinyLM, cpu_state, token_dataset, trainer_kwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_distplan import BatchFormatError, InfeasiblePlanError, Plan, PlanningCallback
from lightning_distplan.strategies import DPGAStrategy
from lightning_distplan.strategies.dp_ga import _accumulation_steering, _rebatch, resolve_dp_ga_plan


@pytest.fixture
def single_process_group() -> Any:
    """A one-process fit (devices=1 DDP) makes a process group and exports LOCAL_RANK / MASTER_PORT: leave neither behind."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


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
    for not_a_plan in (pipe.to_dict(), "runs/distplan/plan.json"):  # an AttributeError ('dict' object has no attribute 'strategy')
        with pytest.raises(InfeasiblePlanError, match=r"takes a lightning_distplan.Plan, got a (dict|str).*HINT: .*Plan.from_json"):
            DPGAStrategy(plan=not_a_plan)  # type: ignore[arg-type]
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


class _SizedBatches(torch.utils.data.Sampler):
    """A batch sampler yielding index batches of the given sizes in order (``batch_size``: the nominal one)."""

    def __init__(self, sizes: list[int], batch_size: int) -> None:
        self.sizes, self.batch_size = sizes, batch_size

    def __iter__(self) -> Any:
        start = 0
        for n in self.sizes:
            yield list(range(start, start + n))
            start += n

    def __len__(self) -> int:
        return len(self.sizes)


def _dp_ga_warnings(sizes: list[int], batch_size: int, m: int) -> list[str]:
    import warnings

    from lightning_distplan.strategies.dp_ga import _MicroBatchLoader

    data = torch.utils.data.TensorDataset(torch.arange(sum(sizes)))
    loader = torch.utils.data.DataLoader(data, batch_sampler=_SizedBatches(sizes, batch_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        micro = [b[0].tolist() for b in _MicroBatchLoader(loader, m)]
    assert [i for b in micro for i in b] == list(range(sum(sizes)))  # every sample once, in order
    return [str(w.message) for w in caught if str(w.message).startswith("dp_ga:")]


def test_uneven_loader_batches_that_change_the_math_are_warned_about() -> None:
    """The two cases re-chunking cannot train as the user's batches: said once each, the exact ones not at all."""
    joined = _dp_ga_warnings([8, 4], 8, 16)  # 12 samples: the micro-batch of 16 takes the full batch and the short last one
    assert len(joined) == 1 and "joins samples of the epoch's short last batch (4 samples)" in joined[0] and "drop_last=True" in joined[0]
    shifted = _dp_ga_warnings([8, 4, 8, 4, 8], 8, 4)  # a bucketing sampler: short batches mid-epoch
    assert len(shifted) == 1 and "a train loader batch of 4 samples, not 8, came before the epoch's end" in shifted[0]
    # exact: micro-batches dividing every batch, a short last batch cut alone, equal batches joined
    assert _dp_ga_warnings([8, 8, 4], 8, 2) == _dp_ga_warnings([8, 8, 4], 8, 4) == _dp_ga_warnings([6, 6, 6], 6, 4) == []
    assert _dp_ga_warnings([8, 8, 8], 8, 16) == []


class _FirstBatchFirst:
    """A batch sampler whose ``__iter__`` is not a generator: it takes the first batch itself (next()), then the rest."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        rest = iter(self.batches)
        return itertools.chain([next(rest)], rest)  # StopIteration where there is no batch (an empty shard)

    def __len__(self) -> int:
        return len(self.batches)


def test_a_train_loader_whose_iterator_raises_stop_iteration_as_it_is_made_says_so() -> None:
    """iter() of the train loader raising StopIteration (its batch sampler's __iter__ calling next() on no batches) is
    kept for the first pull, which the ranks' agreement carries (_raising); a generator, which Python turned it into
    "RuntimeError: generator raised StopIteration", naming this package's generator. Now one sentence and HINT that
    say the loader's iterator raised it as it was made, with the StopIteration as its cause."""
    from lightning_distplan.errors import DataLoadingError
    from lightning_distplan.strategies.dp_ga import _MicroBatchLoader

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)), batch_sampler=_FirstBatchFirst([]))
    with pytest.raises(DataLoadingError) as caught:
        list(_MicroBatchLoader(loader, 4))
    assert str(caught.value) == (
        "The train loader's iterator raised StopIteration as it was made (iter() of the loader), before its first batch. HINT: Make "
        "the __iter__ of its batch sampler, sampler or IterableDataset a generator (with yield) or have it return an iterator; one "
        "that calls next() itself raises StopIteration where there is nothing left.")
    assert isinstance(caught.value.__cause__, StopIteration)
    # (a batch sampler that has batches runs as it is)
    loader = torch.utils.data.DataLoader(loader.dataset, batch_sampler=_FirstBatchFirst([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert [b[0].tolist() for b in _MicroBatchLoader(loader, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_tensor_that_is_not_per_sample_first_in_a_dict_batch_is_passed_whole(single_process_group: None) -> None:
    """The batch size is what most tensors share, so class weights listed first are not cut as the batch."""
    from lightning_distplan.profiling._batches import BatchSizer, find_batch_size

    assert find_batch_size({"class_weights": torch.ones(3), "x": torch.randn(8, 4), "y": torch.randn(8)}) == 8
    assert find_batch_size({"w": torch.ones(3), "x": torch.randn(8, 4)}) == 3  # a tie: the first tensor's, as before
    # nesting does not matter (a per-sample dict inside, a constant outside); tensors inside lists (records) do not vote
    assert find_batch_size({"inputs": {"x": torch.randn(8, 4), "y": torch.randn(8)}, "temperature": torch.ones(1)}) == 8
    assert find_batch_size(((torch.randn(8, 4), torch.randn(8, 2)), torch.ones(3))) == 8
    assert find_batch_size({"images": torch.randn(2, 3), "boxes": [torch.randn(5, 4), torch.randn(5, 4)]}) == 2
    # over a loader's batches: the tensor holding the loader's batch size gives every later size, the short one too
    constants = {"class_weights": torch.ones(3), "class_counts": torch.ones(3)}
    sizer = BatchSizer(expected=8)
    assert [sizer({"x": torch.randn(n, 4), **constants}) for n in (8, 8, 4)] == [8, 8, 4]
    assert find_batch_size({"x": torch.randn(4, 4), **constants}) == 3  # what a count alone reads
    # a constant as long as the full batch, listed first, does not stand for the batch: in the short batch the tensors
    # whose length changed are the per-sample ones, and only they are read from then on
    sizer = BatchSizer(expected=4)
    weights = torch.ones(4)
    assert [sizer({"class_weights": weights, "x": torch.randn(n, 1), "y": torch.randn(n)}) for n in (4, 4, 2, 4)] == [4, 4, 2, 4]
    assert sizer.paths == [("x",), ("y",)]
    rows: list[tuple[int, int]] = []

    class Weighted(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            rows.append((batch["x"].shape[0], batch["class_weights"].shape[0]))
            return torch.nn.functional.mse_loss(self.lin(batch["x"]).squeeze(-1), batch["y"])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16))
            return torch.utils.data.DataLoader(data, batch_size=8, collate_fn=lambda items: {
                "class_weights": torch.ones(3), "x": torch.stack([a for a, _ in items]), "y": torch.stack([b for _, b in items])})

    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=2), devices=1, max_epochs=1))
    trainer.fit(Weighted())
    assert rows == [(2, 3)] * 8 and trainer.global_step == 2  # it stepped every 4 micro-batches of 2, weights whole


def test_several_train_loaders_are_refused_when_re_chunked(single_process_group: None) -> None:
    class Two(TinyLM):
        def __init__(self, sizes: tuple[int, int]) -> None:
            super().__init__(n_samples=32)
            self.sizes = sizes

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"], batch_idx)

        def train_dataloader(self) -> Any:
            return {k: torch.utils.data.DataLoader(token_dataset(32), batch_size=n) for k, n in zip("ab", self.sizes)}

    with pytest.raises(InfeasiblePlanError, match=r"2 train dataloaders \(batch sizes 4, 8\).*HINT"):
        L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=2), devices=1, max_epochs=1)).fit(Two((4, 8)))
    # one batch size is no better: one re-chunking cannot weigh and count two loaders' batches
    with pytest.raises(InfeasiblePlanError, match=r"2 train dataloaders \(batch sizes 4, 4\).*HINT"):
        L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=2), devices=1, max_epochs=1)).fit(Two((4, 4)))
    model = Two((4, 8))  # each loader as it is: nothing re-chunked
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(), devices=1, max_epochs=1))
    trainer.fit(model)
    assert set(model.micro_batch_sizes) == {4, 8} and trainer.global_step == 8  # 8 loader batches of 4 in the longer loader


class _ValidatedAt(_Validated):
    """Records the global step of every validation (and trains on the user's loader or its micro-batches)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validated_at: list[int] = []

    def on_validation_start(self) -> None:
        self.validated_at.append(self.trainer.global_step)


@pytest.mark.parametrize(
    ("n_samples", "extra"),
    [
        (76, {"val_check_interval": 0.25}),  # 9 batches of 8 and one of 4: validations after batches 2, 4, 6, 8 and 10
        (76, {"val_check_interval": 2}),
        (76, {"val_check_interval": 10}),  # every batch of the epoch: 19 micro-batches, not 20 (Lightning refused 20)
        (20, {"val_check_interval": 3, "check_val_every_n_epoch": None}),  # counted over epochs of 8, 8, 4
    ],
)
def test_validations_follow_the_users_batches_past_a_short_last_batch(n_samples: int, extra: dict[str, Any], single_process_group: None) -> None:
    """The short last batch holds fewer micro-batches than the others: the validation after it was lost (and a count
    over epochs drifted); each micro-batch now validates when the user's run validates after a batch ending in it."""
    runs = []
    for strategy in (None, DPGAStrategy(micro_batch_size=4)):
        model = _ValidatedAt(n_samples=n_samples, loader_batch=8, reference_sampler=strategy is None)
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=3, precision="64-true", **({"strategy": strategy} if strategy else {}), **extra))
        trainer.fit(model)
        runs.append((model.validated_at, trainer.global_step, cpu_state(model)))
        assert trainer.val_check_interval == extra["val_check_interval"]  # the user's setting, restored
    (ref_at, ref_steps, ref_state), (at, steps, state) = runs
    assert at == ref_at and steps == ref_steps and len(at) >= 3, (at, ref_at)
    # float64: 30 SGD steps in float32 part by up to 4e-6 from the sum's order alone (batch of 8 against two of 4),
    # and by how much depends on the thread count (OMP_NUM_THREADS=1 failed a 1e-6 check; float64 parts by < 1e-14)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)


def test_labels_with_ignored_tokens_are_warned_about_when_re_chunked() -> None:
    """Hugging Face's -100 labels: a token-averaged loss is averaged per micro-batch, not per batch (not the same math)."""
    import warnings

    from lightning_distplan.strategies.dp_ga import _MicroBatchLoader

    ids = torch.randint(0, 10, (16, 6))
    masked = [{"input_ids": ids[i:i + 8], "labels": torch.where(ids[i:i + 8] > 4, ids[i:i + 8], -100)} for i in (0, 8)]
    whole = [{"input_ids": ids[i:i + 8], "labels": ids[i:i + 8]} for i in (0, 8)]
    for batches, expected in ((masked, 1), (whole, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            micro = list(_MicroBatchLoader(batches, 4))
        assert [len(b["labels"]) for b in micro] == [4] * 4
        assert sum("labels hold -100" in str(w.message) for w in caught) == expected


class _Regression(L.LightningModule):
    """A linear regression over 80 samples in loader batches of 8 that records where it trains and validates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.trained: list[tuple[int, int]] = []
        self.validated_at: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.append((self.current_epoch, batch[0].shape[0]))
        return torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1]))

    def on_validation_start(self) -> None:
        self.validated_at.append((self.current_epoch, self.global_step))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(80, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=4)


def test_a_fit_resumed_from_a_checkpoint_saved_at_a_validation_does_not_train_again(tmp_path: Any, single_process_group: None) -> None:
    """ModelCheckpoint saves at the end of the epoch's last validation; on resume Lightning asks, before any batch, whether
    that position was a validation point (with m = 16 over batches of 8 the rounded interval said no, and the fit trained
    one micro-batch and one optimizer step more than the user's). A time-based val_check_interval runs (it crashed)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    settings = dict(val_check_interval=5, check_val_every_n_epoch=None, accumulate_grad_batches=2)
    runs = {}
    for name, make in (("plain", lambda: "ddp"), ("dp_ga", lambda: DPGAStrategy(micro_batch_size=16))):  # ddp: the same sampler
        ckpt = tmp_path / name
        first = L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, enable_checkpointing=True, default_root_dir=str(tmp_path), **settings,
                                            callbacks=[ModelCheckpoint(dirpath=ckpt, filename="e", every_n_epochs=1)], strategy=make()))
        first.fit(_Regression())
        model = _Regression()
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=2, **settings, strategy=make()))
        trainer.fit(model, ckpt_path=str(ckpt / "e.ckpt"))
        runs[name] = (model.trained[0], sum(n for _, n in model.trained), trainer.global_step, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    (p_first, p_samples, p_steps, p_state), (d_first, d_samples, d_steps, d_state) = runs["plain"], runs["dp_ga"]
    assert d_first[0] == p_first[0] == 1 and d_samples == p_samples == 80 and d_steps == p_steps == 10, runs
    torch.testing.assert_close(d_state, p_state, rtol=1e-5, atol=1e-6)
    timed = []
    for strategy in ("ddp", DPGAStrategy(micro_batch_size=4)):
        model = _Regression()
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, val_check_interval={"seconds": 60}, strategy=strategy))
        trainer.fit(model)
        timed.append((trainer.global_step, model.validated_at, cpu_state(model)))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert timed[0][:2] == timed[1][:2] and timed[1][0] == 10, timed
    torch.testing.assert_close(timed[1][2], timed[0][2], rtol=1e-5, atol=1e-6)


class _ShortTail(_Regression):
    """76 samples: nine batches of 8 and one of 4 (with m = 2, four micro-batches each and two for the last)."""

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(76, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_a_checkpoint_at_the_end_of_an_epoch_with_a_short_last_batch_resumes_at_the_next_epoch(tmp_path: Any, single_process_group: None) -> None:
    """The epoch's progress in loader batches came from scaling the 38 micro-batches by 1/4: 9 of 10 batches, so the
    resumed fit (under dp_ga or DDP alike) replayed a batch it had trained; it now counts the loader batches that ended."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    runs = {}
    for first, then in (("ddp", "ddp"), ("dp_ga", "dp_ga"), ("dp_ga", "ddp")):
        make = {"ddp": lambda: "ddp", "dp_ga": lambda: DPGAStrategy(micro_batch_size=2)}
        ckpt = tmp_path / f"{first}_{then}"
        L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, enable_checkpointing=True, strategy=make[first](), default_root_dir=str(tmp_path),
                                   callbacks=[ModelCheckpoint(dirpath=ckpt, filename="e", every_n_train_steps=10)])).fit(_ShortTail())
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        saved = torch.load(ckpt / "e.ckpt", weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
        model = _ShortTail()
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=2, strategy=make[then]()))
        trainer.fit(model, ckpt_path=str(ckpt / "e.ckpt"))
        runs[(first, then)] = (saved["ready"], model.trained[0][0], trainer.global_step, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    reference = runs[("ddp", "ddp")]
    assert reference[:3] == (10, 1, 20)  # all 10 batches done; the resumed fit starts in epoch 1
    for key, run in runs.items():
        assert run[:3] == reference[:3], (key, run[:3])
        torch.testing.assert_close(run[3], reference[3], rtol=1e-5, atol=1e-6)


class _LongerThanItsStream(_Regression):
    """The 76 samples of :class:`_ShortTail` from a stream whose ``__len__`` says 120 (Lightning counts 15 loader batches
    where 10 come)."""

    def train_dataloader(self) -> Any:
        x = torch.randn(76, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(_Stated(_SizedStream(x), 120), batch_size=8)


class _Stated(torch.utils.data.IterableDataset):
    """``stream`` with ``__len__`` ``length``."""

    def __init__(self, stream: Any, length: int) -> None:
        self.stream, self.length = stream, length

    def __iter__(self) -> Any:
        return iter(self.stream)

    def __len__(self) -> int:
        return self.length


class _Even(_Regression):
    """80 samples in ten batches of 8; ``scheduled`` reads trainer.estimated_stepping_batches in configure_optimizers."""

    def __init__(self, scheduled: bool = False) -> None:
        super().__init__()
        self.scheduled = scheduled

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        if not self.scheduled:
            return optimizer
        total = self.trainer.estimated_stepping_batches  # loads the train loader before Lightning restores the loops
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


_RESUMES = {  # name: (module, m, checkpoint settings, both fits' Trainer settings, the resumed fit's, the first fit's)
    # Lightning replays an epoch's remaining count of batches from the loader's start; counted in micro-batches that fell
    # short by what the epoch's short last batch lacks: from loader batch 8 of 10 (m = 2), 12 samples for DDP's 16
    "short last batch": (_ShortTail, 2, dict(every_n_train_steps=8), {}, {}),
    # a time interval crashed the resumed epoch's end (Lightning sets no val_check_interval then)
    "time interval": (_ShortTail, 2, dict(every_n_train_steps=8), dict(val_check_interval={"seconds": 60}), {}),
    # saved after the epoch's last batch: Lightning restores it as not restarting, and dp_ga took the counts as its own
    # (validations over epochs every 3 batches came one step early)
    "after the epoch's last batch": (_ShortTail, 2, dict(save_on_train_epoch_end=True), dict(val_check_interval=3, check_val_every_n_epoch=None), {}),
    # max_steps inside the resumed epoch left Lightning's count of an epoch at the resumed one's
    "max_steps inside it": (_ShortTail, 2, dict(every_n_train_steps=8), {}, dict(max_steps=9)),
    # m = 24 over batches of 8: the user's 7 remaining batches end inside a micro-batch (72 samples trained, not 56) ...
    "ends inside a micro-batch": (_Even, 24, dict(every_n_train_steps=1), dict(accumulate_grad_batches=3), {}, dict(max_steps=1)),
    # ... and the epoch's 10 batches made 3 of its 4 micro-batches: the next epoch trained 24 samples of 80
    "epoch end, m not dividing it": (_Even, 24, dict(every_n_train_steps=4), dict(accumulate_grad_batches=3), {}),
    # saved at the end-of-epoch validation of an epoch ending in a short batch: one extra micro-batch and step
    "at the epoch's validation": (_ShortTail, 4, dict(save_on_train_epoch_end=False), {}, {}),
    # saved at the end of an epoch that max_steps cut short: Lightning trains the next epoch whole, where dp_ga replayed
    # the rest of this one (48 samples in the next epoch for DDP's 76)
    "epoch's end, cut short": (_ShortTail, 2, dict(save_on_train_epoch_end=True), {}, {}, dict(max_steps=4)),
    # ... and of an epoch whose stream ended before Lightning's count (its __len__): 40 samples for DDP's 76
    "epoch's end, stream shorter than its length": (_LongerThanItsStream, 2, dict(save_on_train_epoch_end=True), {}, {}),
    # the train loader loaded before the loops were restored: the checkpoint's batches were read as micro-batches
    "estimated_stepping_batches": (lambda: _Even(scheduled=True), 2, dict(every_n_train_steps=8), {}, {}),
}


@pytest.mark.parametrize("case", list(_RESUMES))
def test_resumed_fits_match_ddp(case: str, tmp_path: Any, single_process_group: None) -> None:
    """Each case, resumed under dp_ga from a DDP or a dp_ga checkpoint (and a dp_ga one under DDP), trains the samples,
    steps, validations and weights DDP resumed from its own does, and leaves Lightning's count of an epoch whole."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, m, saving, settings, resumed_settings, *first_settings = _RESUMES[case]
    make = {"ddp": lambda: "ddp", "dp_ga": lambda: DPGAStrategy(micro_batch_size=m)}
    runs = {}
    for first, then in (("ddp", "ddp"), ("ddp", "dp_ga"), ("dp_ga", "dp_ga"), ("dp_ga", "ddp")):
        ckpt = tmp_path / f"{first}_{then}"
        L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, enable_checkpointing=True, strategy=make[first](), default_root_dir=str(tmp_path),
                                   callbacks=[ModelCheckpoint(dirpath=ckpt, filename="c", **saving)], **{**settings, **(first_settings or [{}])[0]})).fit(module())
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        model = module()
        trainer = L.Trainer(**trainer_kwargs(devices=1, **{"max_epochs": 2, **settings, **resumed_settings}, strategy=make[then]()))
        trainer.fit(model, ckpt_path=str(ckpt / "c.ckpt"))
        in_epoch = [sum(n for e, n in model.trained if e == epoch) for epoch in range(trainer.max_epochs)]
        runs[(first, then)] = (in_epoch, trainer.global_step, model.validated_at, trainer.num_training_batches, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    reference = runs[("ddp", "ddp")]
    whole = -(-len(module().train_dataloader().dataset) // m)  # Lightning's count of an epoch in micro-batches
    for key, run in runs.items():
        assert run[:3] == reference[:3], (case, key, run[:4], reference[:4])
        torch.testing.assert_close(run[4], reference[4], rtol=1e-5, atol=1e-6)
        assert run[3] == (reference[3] if key[1] == "ddp" else whole), (case, key, run[3])


def test_a_resumed_epoch_shorter_than_a_whole_one_leaves_the_later_epochs_whole(tmp_path: Any, single_process_group: None) -> None:
    """Saved at a validation after loader batch 7 of 10 (inside an accumulation of 3), resumed with m = 24: the resumed
    epoch counts 3 micro-batches of 4, and Lightning kept that as the loader's limit, so every later epoch trained 72 of
    its 80 samples. (Steps are not compared: DDP steps after the two batches that end its accumulation, where dp_ga's
    micro-batch of 24 runs across that boundary, a checkpoint inside an accumulation being rare.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    settings = dict(accumulate_grad_batches=3, val_check_interval=7)
    trained = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=24))):
        ckpt = tmp_path / name
        L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, enable_checkpointing=True, strategy="ddp", default_root_dir=str(tmp_path), **settings,
                                   callbacks=[ModelCheckpoint(dirpath=ckpt, filename="c", save_on_train_epoch_end=False)])).fit(_Even())
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        saved = torch.load(ckpt / "c.ckpt", weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"]
        model = _Even()
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=4, strategy=strategy, **settings))
        trainer.fit(model, ckpt_path=str(ckpt / "c.ckpt"))
        trained[name] = ([sum(n for e, n in model.trained if e == epoch) for epoch in range(4)], trainer.num_training_batches, saved)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trained["ddp"] == ([24, 80, 80, 80], 10, 7) and trained["dp_ga"] == ([24, 80, 80, 80], 4, 7), trained


class _WithBatchNorm(_Regression):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(self.norm(batch[0])), batch[1])


class _SkipsNaN(_Regression):
    """Lightning's documented skip: training_step returns None for a batch holding a bad target."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if torch.isnan(batch[1]).any():
            return None
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        x, y = loader.dataset.tensors
        y = y.clone()
        y[3] = float("nan")
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("model, expected", [(_WithBatchNorm, "BatchNorm layers ('norm') normalise over each micro-batch of 2"),
                                             (_SkipsNaN, "training_step returned None, so Lightning skips this micro-batch of 2 samples")])
def test_micro_batches_that_change_what_ddp_would_do_are_warned_about(model: Any, expected: str, single_process_group: None) -> None:
    """BatchNorm's statistics and a skipped batch (training_step returns None) are per forward: under micro-batches of 2
    they are not the user's batches of 8. Both are told, with the pin that keeps DDP's behaviour; a micro-batch equal
    to the loader batch warns about neither."""
    import warnings

    for m, count in ((2, 1), (8, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=m), devices=1, max_epochs=1, limit_val_batches=0)).fit(model())
        said = [str(w.message) for w in caught if expected.split(" ")[0] in str(w.message) and "dp_ga" in str(w.message)]
        assert len(said) == count, [str(w.message) for w in caught]
        if count:
            assert expected in said[0] and "Pass micro_batch_size=8" in said[0], said[0]


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


class _DataclassBatches(_Regression):
    """Batches are a dataclass (Lightning moves and collates them like dicts)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(batch.x), batch.y)

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=lambda items: _Pair(
            torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))


def test_dataclass_batches_are_cut_into_micro_batches_with_ddps_weights(single_process_group: None) -> None:
    """A dataclass batch is cut into micro-batches (and profiled) like a dict: auto_plan and dp_ga give DDP's weights."""
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    weights = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=2)), ("auto_plan", AutoPlanStrategy(micro_batch_size=4))):
        model = _DataclassBatches()
        trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=1, limit_val_batches=0))
        trainer.fit(model)
        assert trainer.global_step == 10, name
        weights[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights["dp_ga"], weights["ddp"], atol=1e-6) and torch.allclose(weights["auto_plan"], weights["ddp"], atol=1e-6)


class _NormLogging(_Regression):
    """Records the gradient's 2-norm at each optimizer step: torch's, and the strategy's grad_norm() where it has one."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[tuple[float, float | None]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        strategy = self.trainer.strategy
        ours = float(strategy.grad_norm()) if hasattr(strategy, "grad_norm") else None
        self.norms.append((float(torch.nn.utils.get_total_norm(grads, 2.0)), ours))


def test_the_strategy_gradient_norm_in_a_hook_is_ddps(single_process_group: None) -> None:
    """trainer.strategy.grad_norm() (also a pipeline's) under dp_ga, 4 micro-batches accumulated per loader batch: the
    norm of the accumulated gradient, which is DDP's on whole loader batches."""
    got = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=2))):
        model = _NormLogging()
        L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=1, limit_val_batches=0)).fit(model)
        got[name] = model.norms
    assert len(got["dp_ga"]) == len(got["ddp"]) == 10
    for (ddp_torch, _), (torch_norm, ours) in zip(got["ddp"], got["dp_ga"]):
        assert ours == pytest.approx(torch_norm, rel=1e-6) and ours == pytest.approx(ddp_torch, rel=1e-5)
    with pytest.raises(InfeasiblePlanError, match=r"`norm_type` must be a positive number or inf, got 0\. HINT:"):
        DPGAStrategy().grad_norm(0)


class _StepScheduled(_ShortTail):
    """A step-interval scheduler stepped every ``frequency`` batches; records the learning rate of each optimizer step."""

    def __init__(self, frequency: int) -> None:
        super().__init__()
        self.frequency = frequency
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": self.frequency}}


@pytest.mark.parametrize(("frequency", "accumulate", "m"), [(2, 1, 4), (3, 1, 2), (2, 2, 4), (2, 2, 16), (3, 2, 16)])
def test_a_step_scheduler_with_a_frequency_steps_where_ddp_steps_it(frequency: int, accumulate: int, m: int, tmp_path: Any,
                                                                     single_process_group: None) -> None:
    """Lightning steps a scheduler with interval='step' when (batch_idx + 1) % frequency == 0 at an optimizer step, and
    batch_idx counts dp_ga's micro-batches: with frequency=2 and two micro-batches per step it stepped at every step
    (DDP: every second), with m=16 over batches of 8 at every second where DDP stepped at every one. The learning rate
    of every step, also after a resume from a mid-epoch checkpoint of either, is DDP's, and the user's frequency is
    back on the scheduler's config after the fit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    make = {"ddp": lambda: "ddp", "dp_ga": lambda: DPGAStrategy(micro_batch_size=m)}
    runs = {}
    for name in make:
        model = _StepScheduled(frequency)
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=2, accumulate_grad_batches=accumulate, strategy=make[name]()))
        trainer.fit(model)
        runs[name] = model.lrs
        assert trainer.lr_scheduler_configs[0].frequency == frequency
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(runs["ddp"]) == 2 * -(-10 // accumulate)
    assert runs["dp_ga"] == runs["ddp"]
    resumed = {}
    for first, then in (("ddp", "dp_ga"), ("dp_ga", "dp_ga"), ("dp_ga", "ddp")):
        ckpt = tmp_path / f"{first}_{then}"
        L.Trainer(**trainer_kwargs(devices=1, max_steps=3, accumulate_grad_batches=accumulate, enable_checkpointing=True, strategy=make[first](),
                                   callbacks=[ModelCheckpoint(dirpath=ckpt, filename="c", every_n_train_steps=3)])).fit(_StepScheduled(frequency))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        model = _StepScheduled(frequency)
        L.Trainer(**trainer_kwargs(devices=1, max_epochs=2, accumulate_grad_batches=accumulate, strategy=make[then]())).fit(
            model, ckpt_path=str(ckpt / "c.ckpt"))
        resumed[(first, then)] = model.lrs
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for key, lrs in resumed.items():
        assert lrs == runs["ddp"][3:], key


class _WarmedUp(_Regression):
    """A batch-size warm-up: 48 samples in loader batches of 4 in epoch 0 and of 8 from epoch 1 on (a loader of each
    epoch's own, reload_dataloaders_every_n_epochs=1); trainer.estimated_stepping_batches read in configure_optimizers,
    so a resumed fit loads its first loader before Lightning restores the loops (current_epoch 0 then: batches of 4)."""

    def configure_optimizers(self) -> Any:
        self.total = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()

    def train_dataloader(self) -> Any:
        x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
        batch_size = 4 if self.current_epoch == 0 else 8
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def test_a_resumed_fit_with_a_batch_size_warm_up_runs_as_ddp(tmp_path: Any, single_process_group: None) -> None:
    """A fit whose loader's batch size grows after epoch 0 (:class:`_WarmedUp`), resumed from a checkpoint in the middle
    of epoch 0 (step 6 of 12 + 6 + 6) and of epoch 1 (step 15): its first loader is loaded before the loops are restored,
    with epoch 0's batches of 4, and set up again at the resumed epoch (in epoch 0 by Rechunking.reload_resumed, in epoch
    1 by Lightning's reload, with batches of 8), where the checkpoint's progress is converted. dp_ga, cutting it into
    micro-batches of 2 or running it as it is, is not refused and trains what DDP trains after the resume (the rest of
    the resumed epoch, as Lightning replays a mid-epoch resume, then whole epochs): 24 steps, the same weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    settings = dict(devices=1, reload_dataloaders_every_n_epochs=1, limit_val_batches=0)
    for at, trained in ((6, {0: 24, 1: 48, 2: 48}), (15, {1: 24, 2: 48})):
        runs = {}
        for name, make in (("ddp", lambda: "ddp"), ("cut", lambda: DPGAStrategy(micro_batch_size=2)), ("as_is", DPGAStrategy)):
            saves = ModelCheckpoint(dirpath=tmp_path / f"{name}{at}", filename="s", every_n_train_steps=at)
            L.Trainer(**trainer_kwargs(strategy=make(), max_steps=at, enable_checkpointing=True, callbacks=[saves], **settings)).fit(_WarmedUp())
            model = _WarmedUp()
            trainer = L.Trainer(**trainer_kwargs(strategy=make(), max_epochs=3, **settings))
            trainer.fit(model, ckpt_path=str(tmp_path / f"{name}{at}" / "s.ckpt"))
            per_epoch = {epoch: sum(n for e, n in model.trained if e == epoch) for epoch, _ in model.trained}
            runs[name] = (model.total, trainer.global_step, per_epoch, {n for _, n in model.trained[-1:]}, cpu_state(model))
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        # (estimated_stepping_batches 36: 3 epochs of epoch 0's 12 batches of 4, the loader loaded before the loops were restored)
        assert runs["ddp"][:4] == (36, 24, trained, {8}), (at, runs["ddp"][:4])
        assert runs["cut"][:4] == (36, 24, trained, {2}) and runs["as_is"][:4] == runs["ddp"][:4], (at, runs["cut"][:4], runs["as_is"][:4])
        for name in ("cut", "as_is"):
            torch.testing.assert_close(runs[name][4], runs["ddp"][4], rtol=1e-5, atol=1e-6)


def test_a_loader_of_one_step_per_batch_loaded_before_the_loops_were_restored_is_set_up_again(tmp_path: Any) -> None:
    """A pipeline plan whose replica takes one of the user's loader batches per step (global_batch_size = dp x loader batch)
    is handed that loader as it is, yet a step is 1/pp of the user's batch (the data is sharded over replicas, not ranks),
    so a resumed fit converts the checkpoint's progress. Loaded early (trainer.estimated_stepping_batches in
    configure_optimizers, before Lightning restores the loops), the loader was never set up again: the early return kept
    Rechunking from knowing its trainer, and the progress stayed in the user's batches (half the steps trained, pp = 2)."""
    from lightning.pytorch.loops.progress import _BatchProgress

    from lightning_distplan.strategies._auto_concrete import _FullBatchLoader
    from lightning_distplan.strategies.dp_ga import PROGRESS_KEY, Rechunking

    trainer = L.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    done = _BatchProgress()
    for _ in range(2):  # the checkpoint: 2 of the user's loader batches trained in this epoch
        done.increment_ready(), done.increment_started(), done.increment_processed(), done.increment_completed()
    saved = done.state_dict()
    rechunk = Rechunking()
    rechunk.remember(trainer)
    rechunk.resumed({PROGRESS_KEY: "loader_batches", "loops": {"fit_loop": {"epoch_loop.batch_progress": saved}}})
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=8)
    assert rechunk.wrap(trainer, loader, 8, cls=_FullBatchLoader, replica_share=2) is loader  # early: the loops not restored yet
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.load_state_dict(saved)  # Lightning restores the loops
    assert rechunk.reload_resumed()  # so the loader is set up again at the epoch's start ...
    rechunk.wrap(trainer, loader, 8, cls=_FullBatchLoader, replica_share=2)
    assert progress.current.ready == 4  # ... where the 2 loader batches count as 4 of the plan's steps


class _SizedStream(torch.utils.data.IterableDataset):
    """An iterable-style dataset with a length (its samples), as a streaming dataset that knows its size declares."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __iter__(self) -> Any:
        for row in self.x:
            yield row, row.sum(0, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)


class _ScheduledOver(_Regression):
    """A learning rate decayed over trainer.estimated_stepping_batches (read in configure_optimizers), recorded per step;
    ``loader`` makes the train loader from the 20 samples."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader, self.lrs, self.total = loader, [], None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=self.total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def train_dataloader(self) -> Any:
        return self.loader(torch.randn(20, 4, generator=torch.Generator().manual_seed(0)))


def _assert_scheduled_as_ddp(loader: Any, *, steps: int, total: int | None = None, **trainer_extra: Any) -> None:
    """DDP and dp_ga (micro-batches of 2) over ``loader`` for 2 epochs: ``steps`` optimizer steps and
    estimated_stepping_batches ``total`` (``steps`` unless given), the same learning rates and the same weights."""
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=2))):
        model = _ScheduledOver(loader)
        trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=2, limit_val_batches=0, **trainer_extra))
        trainer.fit(model)
        runs[name] = (model.total, trainer.global_step, model.lrs, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert runs["ddp"][:2] == (steps if total is None else total, steps) and runs["dp_ga"][:3] == runs["ddp"][:3], (
        runs["ddp"][:3], runs["dp_ga"][:3])
    torch.testing.assert_close(runs["dp_ga"][3], runs["ddp"][3], rtol=1e-5, atol=1e-6)


def test_an_iterable_dataset_with_a_length_keeps_ddps_count_of_steps(single_process_group: None) -> None:
    """An IterableDataset with __len__ (20 samples in batches of 8: 8, 8, 4) re-chunked into micro-batches of 2: the
    micro-batch loader had no length (its sampler has none), so Lightning counted the epoch as endless and
    estimated_stepping_batches was max_steps (-1) where DDP's is 6: a schedule over it kept the learning rate flat."""
    _assert_scheduled_as_ddp(lambda x: torch.utils.data.DataLoader(_SizedStream(x), batch_size=8), steps=6)


class _LengthNotImplemented(torch.utils.data.SequentialSampler):
    """A sampler whose ``__len__`` raises NotImplementedError: no length, as Lightning reads it (``sized_len``)."""

    def __len__(self) -> int:
        raise NotImplementedError


def test_a_loader_whose_length_raises_not_implemented_error_runs_as_ddp_runs_it(single_process_group: None) -> None:
    """A sampler whose ``__len__`` raises NotImplementedError: Lightning reads the loader as one without a length and
    runs it under DDP; dp_ga's count of the loader's batches under limit_train_batches (and the samples per epoch the
    ranks agree on) took only TypeError for no length, so the fit stopped with a bare NotImplementedError as the loader
    was set up. Now it runs as DDP does: 3 batches of 20 samples per epoch, 6 steps in 2 epochs (no count ahead: Lightning's
    estimated_stepping_batches is -1 under either), the same weights."""
    _assert_scheduled_as_ddp(lambda x: torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, sampler=_LengthNotImplemented(x)),
        steps=6, total=-1, use_distributed_sampler=False)


class _EveryOther(torch.utils.data.Sampler):
    """A user's batch sampler over part of the data (every other sample, as one that shards by rank itself), in batches of
    ``batch_size`` (10 samples: 4, 4, 2); it has no ``sampler`` attribute."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.indices, self.batch_size = list(range(0, n, 2)), batch_size

    def __iter__(self) -> Any:
        for k in range(0, len(self.indices), self.batch_size):
            yield self.indices[k : k + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)


def test_a_batch_sampler_whose_samples_per_epoch_cannot_be_counted_is_refused_before_training(single_process_group: None) -> None:
    """The micro-batches of an epoch were counted from the DataLoader's own sampler (all 20 samples: 10 micro-batches of 2)
    where the batch sampler yields 10 samples: Lightning ended no epoch where it ends, so an optimizer step ran across
    the epoch's end (4 steps in 2 epochs where DDP takes 6) and estimated_stepping_batches was 10, not 6. Refused
    before any step now; with the loader's own batch size nothing is counted and the run is DDP's."""
    loader = lambda x: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_sampler=_EveryOther(20, 4))  # noqa: E731
    model = _ScheduledOver(loader)
    before = cpu_state(model)
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=2), devices=1, max_epochs=2, limit_val_batches=0,
                                         use_distributed_sampler=False))
    with pytest.raises(InfeasiblePlanError, match=r"3 batches of up to 4 samples, but how many samples its _EveryOther yields per epoch "
                                                  r"cannot be told.*micro-batches of 2.*HINT: Use micro_batch_size=4"):
        trainer.fit(model)
    assert trainer.global_step == 0
    torch.testing.assert_close(cpu_state(model), before, rtol=0, atol=0)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=4))):
        model = _ScheduledOver(loader)
        trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=2, limit_val_batches=0, use_distributed_sampler=False))
        trainer.fit(model)
        runs[name] = (model.total, trainer.global_step, model.lrs, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert runs["ddp"][:2] == (6, 6) and runs["dp_ga"][:3] == runs["ddp"][:3]
    torch.testing.assert_close(runs["dp_ga"][3], runs["ddp"][3], rtol=0, atol=0)


class _DropLastBatches(_SizedBatches):
    """:class:`_SizedBatches` that says it drops the short last batch, so its samples per epoch count as its batches times
    its ``batch_size``, whose batches may hold more than that size (a bucketing sampler's)."""

    drop_last = True


def _sized_batches_loader(sizes: tuple[int, ...], sampler_class: type, *, counted: bool = False) -> Any:
    """Batches of ``sizes`` (batch size 8) of fresh samples by ``sampler_class``; ``counted``: its ``sampler`` holds them all."""

    def loader(_: torch.Tensor) -> Any:
        x = torch.randn(sum(sizes), 4, generator=torch.Generator().manual_seed(0))
        batches = sampler_class(list(sizes), 8)
        if counted:
            batches.sampler = range(sum(sizes))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_sampler=batches)

    return loader


def test_a_batch_sampler_whose_batches_exceed_its_batch_size_is_refused_not_cut_short(single_process_group: None) -> None:
    """Micro-batches of 4 from a batch sampler of batches 8, 12, 8 that drops the short last one (batch size 8): dp_ga
    counted the epoch's samples as 3 batches of 8 (6 micro-batches), Lightning ended the epoch there, and the last 4 of
    the 28 samples (DDP trains them all) were never trained, without a word; so under limit_train_batches=2 over batches
    of 12, 8, 4 (16 samples counted, 20 come), and over 12, 12, 8 (the first two fill the count: the third never came).
    Refused where the batches overflow (or fill) the count now. Batches 12, 4, 8 (24 samples, as counted) train whole,
    as under DDP (a larger batch alone was refused too), and so do 12, 8, 4 where the count is the sampler's own total
    (no drop_last, no limit)."""
    refused = (((8, 12, 8), _DropLastBatches, {}, r"first 3 batches of the epoch hold 28 samples, where dp_ga counts the epoch's 3 "
                r"batches as at most 8 samples each \(6 micro-batches of 4\), so the epoch would end before its last samples", 20),
               ((12, 8, 4), _SizedBatches, {"limit_train_batches": 2}, r"first 2 batches of the epoch hold 20 samples, where dp_ga "
                r"counts the epoch's 2 batches as at most 8 samples each \(4 micro-batches of 4\)", 12),
               ((12, 12, 8), _DropLastBatches, {}, r"first 2 batches of the epoch hold 24 samples.*would end before its 1 batch "
                r"left", 12))
    for sizes, sampler_class, extra, matching, trained in refused:
        model = _ScheduledOver(_sized_batches_loader(sizes, sampler_class, counted=sampler_class is _SizedBatches))
        trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=4), devices=1, max_epochs=1, limit_val_batches=0,
                                             use_distributed_sampler=False, **extra))
        with pytest.raises(InfeasiblePlanError, match=matching + r".*HINT: Use micro_batch_size=8"):
            trainer.fit(model)
        assert sum(n for _, n in model.trained) == trained  # the batches before the one that overflows the count
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for sizes, sampler_class in (((12, 8, 4), _SizedBatches), ((12, 4, 8), _DropLastBatches)):
        trained = []
        for strategy in ("ddp", DPGAStrategy(micro_batch_size=4)):
            model = _ScheduledOver(_sized_batches_loader(sizes, sampler_class, counted=sampler_class is _SizedBatches))
            L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=1, limit_val_batches=0, use_distributed_sampler=False)).fit(model)
            trained.append(sum(n for _, n in model.trained))
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        assert trained == [24, 24], sizes


def _two_rows_per_sample(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn making two rows of each sample (an augmentation's two views): batches of 8 indices hold 16 rows."""
    x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    return torch.cat([x, x]), torch.cat([y, y])


def test_a_collate_fn_making_more_rows_than_samples_is_refused_not_cut_short(single_process_group: None) -> None:
    """Micro-batches of 4 from 24 samples in loader batches of 8 whose collate_fn makes two rows of each sample: dp_ga
    counted the epoch from the sampler's 24 samples (6 micro-batches), the batches held 48 rows, and Lightning ended the
    epoch after 24 of them (DDP trains all 48), without a word; so over a batch sampler of 12, 8, 4 counted from its
    sampler (24 rows in its first batch: the count filled before its other 2 batches). Refused where the rows overflow
    (or fill) the count now, with the batches before trained. A batch sampler whose length overstates its batches (12, 12
    of the 24 samples where it says 3), one row per sample, fills the count with no batch left: it trains whole, as under
    DDP (it was refused for the 1 batch its length promised)."""
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def sized(_: torch.Tensor) -> Any:
        batches = _SizedBatches([12, 8, 4], 8)
        batches.sampler = range(24)
        return torch.utils.data.DataLoader(data, batch_sampler=batches, collate_fn=_two_rows_per_sample)

    cases = ((lambda _: torch.utils.data.DataLoader(data, batch_size=8, collate_fn=_two_rows_per_sample),
              r"first 2 batches of the epoch hold 32 samples, where dp_ga counts the epoch's 3 batches as the 24 samples its "
              r"sampler holds \(6 micro-batches of 4\), so the epoch would end before its last samples", 16),
             (sized, r"first batch of the epoch holds 24 samples.*would end before its 2 batches left", 0))
    for loader, matching, trained in cases:
        ddp = _ScheduledOver(loader)
        L.Trainer(**trainer_kwargs(strategy="ddp", devices=1, max_epochs=1, limit_val_batches=0, use_distributed_sampler=False)).fit(ddp)
        torch.distributed.destroy_process_group()
        assert sum(n for _, n in ddp.trained) == 48
        model = _ScheduledOver(loader)
        trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=4), devices=1, max_epochs=1, limit_val_batches=0,
                                             use_distributed_sampler=False))
        with pytest.raises(InfeasiblePlanError, match=matching + r".*HINT: Use micro_batch_size=8 .*a collate_fn"):
            trainer.fit(model)
        assert sum(n for _, n in model.trained) == trained  # the batches before the one that overflows the count
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    class _Overstated(_SizedBatches):
        def __len__(self) -> int:
            return len(self.sizes) + 1

    batches = _Overstated([12, 12], 8)
    batches.sampler = range(24)
    model = _ScheduledOver(lambda _: torch.utils.data.DataLoader(data, batch_sampler=batches))
    L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=4), devices=1, max_epochs=1, limit_val_batches=0,
                               use_distributed_sampler=False)).fit(model)
    assert [n for _, n in model.trained] == [4] * 6


class _Targets:
    """A user's target container that Lightning moves with its ``to`` method (no dataclass: nothing to look into)."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    def to(self, *args: Any, **kwargs: Any) -> _Targets:
        return _Targets(self.y.to(*args, **kwargs))


class _OpaqueTargets(_Regression):
    """Batches (x, part) where ``part`` holds the batch's targets in a form slicing does not look into."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, part = batch
        y = part.y if self.part == "object" else torch.as_tensor(part)
        self.trained.append((self.current_epoch, x.shape[0]))
        return ((self.lin(x).squeeze(1) - y.reshape(-1)) ** 2).mean()

    def train_dataloader(self) -> Any:
        import numpy as np

        def collate(items: list[Any]) -> Any:
            x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
            return x, (_Targets(y) if self.part == "object" else np.asarray(y.numpy()))

        return torch.utils.data.DataLoader(super().train_dataloader().dataset, batch_size=8, collate_fn=collate)


def test_a_numpy_part_of_the_batch_rows_is_cut_as_a_tensor_and_trains_as_ddp(single_process_group: None) -> None:
    """Numpy arrays of the batch's rows (targets here; sample ids kept for logging alike) are cut into the micro-batches
    as tensors are: micro-batches of 2 train the same samples and weights as DDP over loader batches of 8."""
    states, trained = [], []
    for strategy in ("ddp", DPGAStrategy(micro_batch_size=2)):
        model = _OpaqueTargets("numpy")
        L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=1, limit_val_batches=0)).fit(model)
        states.append(cpu_state(model))
        trained.append(model.trained)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert {size for _, size in trained[1]} == {2} and sum(size for _, size in trained[1]) == sum(size for _, size in trained[0])
    torch.testing.assert_close(states[1], states[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("part", "name"), [("object", "_Targets")])
def test_a_batch_part_that_holds_the_batch_rows_but_cannot_be_cut_is_refused(part: str, name: str, single_process_group: None) -> None:
    """An object of the user's with tensors as attributes was passed whole into every micro-batch: each
    micro-batch of 2 got the 8 targets of its loader batch (a shape error deep in training_step, or a loss silently
    broadcast over the wrong rows). Refused at the first batch, before any step; micro_batch_size=8 trains as DDP."""
    model = _OpaqueTargets(part)
    before = cpu_state(model)
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=2), devices=1, max_epochs=1, limit_val_batches=0))
    with pytest.raises(InfeasiblePlanError, match=rf"The training batch\[1\] is a {name} holding the batch's 8 rows, which cannot be cut "
                                                  r"into micro-batches of 2.*HINT: Make it a tensor.*micro_batch_size=8"):
        trainer.fit(model)
    assert model.trained == [] and trainer.global_step == 0
    torch.testing.assert_close(cpu_state(model), before, rtol=0, atol=0)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    states = []
    for strategy in ("ddp", DPGAStrategy(micro_batch_size=8)):
        model = _OpaqueTargets(part)
        L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=1, limit_val_batches=0)).fit(model)
        states.append(cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.testing.assert_close(states[1], states[0], rtol=0, atol=0)


class _Stream(torch.utils.data.IterableDataset):
    """44 samples (x, target, index) in order; no length."""

    def __iter__(self) -> Any:
        x = torch.randn(44, 4, generator=torch.Generator().manual_seed(0))
        for i in range(44):
            yield x[i], x[i].sum(0, keepdim=True), i


class _ResumableStream(_Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.extend(batch[2].tolist())
        return torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])

    def train_dataloader(self) -> Any:
        return ResumableLoader(_Stream(), batch_size=4)


def test_a_stateful_loader_without_a_length_resumes_a_mid_epoch_checkpoint_where_ddp_does(tmp_path: Any, single_process_group: None) -> None:
    """Lightning fetches one batch ahead of the one it trains where the loader has no length, and saves a stateful loader's
    state: under DDP one loader batch past those trained. Under dp_ga the batch fetched ahead is a micro-batch of 8, two
    loader batches of 4, so the checkpoint held the state two batches past, and the resumed fit skipped samples 20-23,
    which DDP trains. The checkpoint now holds the state after the first of them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    make = {"ddp": lambda: "ddp", "dp_ga": lambda: DPGAStrategy(micro_batch_size=8)}
    runs = {}
    for first, then in (("ddp", "ddp"), ("dp_ga", "dp_ga"), ("dp_ga", "ddp")):
        ckpt = tmp_path / f"{first}_{then}"
        L.Trainer(**trainer_kwargs(devices=1, max_steps=2, accumulate_grad_batches=2, enable_checkpointing=True, strategy=make[first](),
                                   limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=ckpt, filename="c", every_n_train_steps=2)])
                  ).fit(_ResumableStream())
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        model = _ResumableStream()
        trainer = L.Trainer(**trainer_kwargs(devices=1, max_epochs=1, accumulate_grad_batches=2, strategy=make[then](), limit_val_batches=0))
        trainer.fit(model, ckpt_path=str(ckpt / "c.ckpt"))
        runs[(first, then)] = (model.trained, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    reference = runs[("ddp", "ddp")]
    assert reference[0] == list(range(20, 44))  # DDP itself skips the batch it had fetched ahead (16-19)
    for key, (trained, state) in runs.items():
        assert trained == reference[0], key
        torch.testing.assert_close(state, reference[1], rtol=1e-5, atol=1e-6)


class _ShuffledBatches(torch.utils.data.Sampler):
    """A user's batch sampler that draws its own permutation of every sample (no ``sampler`` attribute, as a shuffling or
    bucketing batch sampler written by hand): 18 samples in batches of 4 (4, 4, 4, 4, 2)."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size, self.drop_last = n, batch_size, False

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(1)).tolist()
        for k in range(0, self.n, self.batch_size):
            yield order[k : k + self.batch_size]

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


def test_a_batch_sampler_without_a_sampler_that_batches_the_whole_dataset_is_counted_not_refused(single_process_group: None) -> None:
    """A batch sampler with no ``sampler`` attribute whose length is the batches the whole dataset makes is counted from
    the dataset, as before 83ba25b (which refused it: the run was DDP's); one that yields fewer batches (the test above)
    is still refused."""
    loader = lambda x: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:18], x[:18].sum(1, keepdim=True)),  # noqa: E731
                                                   batch_sampler=_ShuffledBatches(18, 4))
    _assert_scheduled_as_ddp(loader, steps=10, use_distributed_sampler=False)


class _ShardOfStream(torch.utils.data.IterableDataset):
    """An iterable-style dataset whose ``__len__`` is all ranks' samples where its iterator yields this rank's shard (every
    world-size-th sample), as a stream sharded by rank that reports its global size. Out of a process group: every other
    sample (a shard of 2 ranks)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __iter__(self) -> Any:
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if torch.distributed.is_initialized() else (0, 2)
        if world == 1:
            rank, world = 0, 2  # devices=1 DDP: emulate one of two ranks
        for row in self.x[rank::world]:
            yield row, row.sum(0, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)


def _fit_ddp_and_dp_ga(loader: Any, devices: int, accumulate: int, m: int, model_class: Any = None) -> dict[str, tuple[Any, ...]]:
    """DDP and dp_ga (micro-batches of ``m``) over ``loader`` for 2 epochs: (estimated_stepping_batches, optimizer steps,
    learning rate at each step, weights, accumulate_grad_batches after the fit, dp_ga's BatchNorm warnings on this rank)
    of each. ``model_class``: :class:`_ScheduledOver` (default) or a subclass."""
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=m))):
        model = (model_class or _ScheduledOver)(loader)
        trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, max_epochs=2, limit_val_batches=0,
                                             accumulate_grad_batches=accumulate))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
        said = sum("dp_ga: the model's BatchNorm layers" in str(w.message) for w in caught)
        runs[name] = (model.total, trainer.global_step, model.lrs, cpu_state(model), trainer.accumulate_grad_batches, said)
        if devices == 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return runs


def _assert_as_ddp(runs: dict[str, tuple[Any, ...]], steps: int) -> None:
    assert runs["ddp"][1] == steps and runs["dp_ga"][:3] == runs["ddp"][:3], (runs["ddp"][:3], runs["dp_ga"][:3])
    torch.testing.assert_close(runs["dp_ga"][3], runs["ddp"][3], rtol=1e-5, atol=1e-6)
    assert runs["dp_ga"][4] == runs["ddp"][4]  # the user's accumulate_grad_batches is back after the fit


@pytest.mark.parametrize(("accumulate", "steps"), [(1, 4), (2, 2)])
def test_an_iterable_dataset_that_yields_fewer_samples_than_its_length_steps_as_ddp(accumulate: int, steps: int,
                                                                                    single_process_group: None) -> None:
    """A stream whose __len__ (20) is all ranks' samples while it yields this rank's 10 (loader batches 8, 2): Lightning
    counts 10 micro-batches of 2 where 5 come, so it did not know the fifth ends the epoch and did not step after it
    where DDP steps after the short batch (2 steps in 2 epochs where DDP takes 4, weights 0.36 apart; fcbd86c only
    warned). The micro-batch that ends the stream is now known (one micro-batch looked ahead after a short loader
    batch) and steps exactly when DDP steps after the batch ending in it."""
    _assert_as_ddp(_fit_ddp_and_dp_ga(lambda x: torch.utils.data.DataLoader(_ShardOfStream(x), batch_size=8), 1, accumulate, 2), steps)


class _Stream36(torch.utils.data.IterableDataset):
    """36 samples (loader batches 8, 8, 8, 8, 4) from a stream whose ``__len__`` says 40: Lightning counts its 5 loader
    batches right, and 20 micro-batches of 2 where 18 come."""

    def __len__(self) -> int:
        return 40

    def __iter__(self) -> Any:
        x = torch.randn(36, 4, generator=torch.Generator().manual_seed(0))
        for row in x:
            yield row, row.sum(0, keepdim=True)


class _EpochScheduled(_Regression):
    """An epoch-interval learning-rate schedule, recorded per step, over :class:`_Stream36`."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "epoch"}}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(_Stream36(), batch_size=8)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_stream_that_ends_where_ddp_counts_its_last_batch_ends_the_epoch_as_ddp(accumulate: int, single_process_group: None) -> None:
    """Under DDP Lightning knows the stream's fifth loader batch is the epoch's last (its count), so it steps there,
    steps the epoch-interval schedule and validates at the epoch's end; dp_ga counted 20 micro-batches where 18 come, and
    did none of the three (no validation in 3 epochs, the learning rate never decayed). Now the same validations,
    learning rates and weights."""
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("dp_ga", DPGAStrategy(micro_batch_size=2))):
        model = _EpochScheduled()
        trainer = L.Trainer(**trainer_kwargs(strategy=strategy, devices=1, max_epochs=3, accumulate_grad_batches=accumulate))
        trainer.fit(model)
        runs[name] = (trainer.global_step, model.validated_at, model.lrs, cpu_state(model))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(runs["ddp"][1]) == 3 and runs["dp_ga"][:3] == runs["ddp"][:3], (runs["ddp"][:3], runs["dp_ga"][:3])
    torch.testing.assert_close(runs["dp_ga"][3], runs["ddp"][3], rtol=1e-5, atol=1e-6)


class _WorkerShardedStream(_SizedStream):
    """A sized stream that each DataLoader worker iterates a share of (every num_workers-th sample), as streaming datasets do."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        rows = self.x if info is None else self.x[info.id :: info.num_workers]
        for row in rows:
            yield row, row.sum(0, keepdim=True)


def test_a_sized_stream_read_by_two_workers_trains_the_batches_ddp_trains(single_process_group: None) -> None:
    """Two workers each batch their 10 of the 20 samples: 8, 8, 2, 2 where the loader's length is 3. Lightning stops a run
    of the loader after its 3 batches; dp_ga counted 10 micro-batches of 2 and so trained the fourth batch's samples too
    (weights 0.12 from DDP's). It now stops after the loader's length in batches, and the run is DDP's."""
    loader = lambda x: torch.utils.data.DataLoader(_WorkerShardedStream(x), batch_size=8, num_workers=2)  # noqa: E731
    _assert_as_ddp(_fit_ddp_and_dp_ga(loader, 1, 1, 2), 6)


class _UnequalWorkerShards(_SizedStream):
    """A sized stream of 20 samples whose two DataLoader workers iterate shards of 5 and 15 (a stream's files of unequal
    sizes): in batches of 4, 4, 4, 1, 4, 4, 3 in the DataLoader's order (it takes the workers' batches in turn), where
    the loader's length is 5."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        rows = self.x if info is None else (self.x[:5], self.x[5:])[info.id]
        for row in rows:
            yield row, row.sum(0, keepdim=True)


def test_a_sized_stream_whose_workers_shards_differ_steps_as_a_run_of_its_loader(single_process_group: None) -> None:
    """Worker shards of 5 and 15 samples (loader batches 4, 4, 1, 4, 4 within the loader's length of 5, the short one
    mid-epoch), micro-batches of 2 and accumulate_grad_batches=2: a run of the loader steps after its batches 2, 4 and
    5, 6 times in 2 epochs. 08b0d44 stepped 4 times (no epoch's last micro-batch, the ninth of 10 counted, was known: it
    looked ahead only after a micro-batch that ends with the short batch's last sample, and no micro-batch does here: that
    sample is joined to the next batch's first); e8d0171 looks ahead after every micro-batch that ends a loader batch
    once the short one came. Same estimated_stepping_batches, steps and learning
    rates as the run of the loader (the weights differ: the micro-batches after the short batch no longer start where
    the loader's batches do, as warned)."""
    loader = lambda x: torch.utils.data.DataLoader(_UnequalWorkerShards(x), batch_size=4, num_workers=2)  # noqa: E731
    runs = _fit_ddp_and_dp_ga(loader, 1, 2, 2)
    assert runs["ddp"][:2] == (6, 6) and runs["dp_ga"][:3] == runs["ddp"][:3], (runs["ddp"][:3], runs["dp_ga"][:3])


class _FailsAt(_ScheduledOver):
    """Raises in ``training_step`` of the epoch's batch ``at``."""

    def __init__(self, loader: Any, at: int | None) -> None:
        super().__init__(loader)
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.at:
            raise RuntimeError("the user's training_step failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("planner", ["strategy", "callback"])
@pytest.mark.parametrize("stop", ["max_steps", "exception"])
def test_a_fit_that_stops_at_a_steered_step_leaves_the_users_accumulate_grad_batches(planner: str, stop: str,
                                                                                      single_process_group: None) -> None:
    """The stream's short last batch (20 per __len__, 10 yielded: loader batches 8, 2; m=2, 4 micro-batches per step) has
    its step steered with accumulate_grad_batches=1. A fit that stops there (max_steps=2, or the user's training_step
    raising) was torn down with the user's value put back first and the plan's (4) over it after: the Trainer kept 4,
    which a second fit took for the user's accumulate_grad_batches (a global batch 4 times the user's)."""
    model = _FailsAt(lambda x: torch.utils.data.DataLoader(_ShardOfStream(x), batch_size=8), at=4 if stop == "exception" else None)
    extra: dict[str, Any] = {"max_steps": 2} if stop == "max_steps" else {"max_epochs": 1}
    if planner == "strategy":
        extra["strategy"] = DPGAStrategy(micro_batch_size=2, accumulate_grad_batches=4)
    else:
        extra.update(strategy="ddp", callbacks=[PlanningCallback(micro_batch_size=2, accumulate_grad_batches=4)])
    trainer = L.Trainer(**trainer_kwargs(devices=1, limit_val_batches=0, **extra))
    if stop == "exception":
        with pytest.raises(RuntimeError, match="the user's training_step failed"):
            trainer.fit(model)
    else:
        trainer.fit(model)
        assert trainer.global_step == 2  # the second step is the steered one
    assert trainer.accumulate_grad_batches == 1


def test_accumulation_steering_zeroes_and_steps_as_asked() -> None:
    """Lightning zeroes before batch i where i % a == 0 and steps after it where (i + 1) % a == 0: the steered a does what
    is asked at every index, but zeroing without a step at index 1 (impossible: neither is done there)."""
    for index in range(12):
        for first in (False, True) if index else (True,):
            for step in (False, True):
                a = _accumulation_steering(index, first=first, step=step)
                if first and not step and index == 1:
                    assert index % a and (index + 1) % a
                else:
                    assert (index % a == 0, (index + 1) % a == 0) == (first, step), (index, first, step, a)


def _fit_sharded_stream(rank: int, world_size: int,
                        cases: list[tuple[Any, ...]]) -> tuple[list[dict[str, tuple[Any, ...]]], str, tuple[Any, ...], list[Any]]:
    """The runs of each case, then the error dp_ga raises where the ranks' loaders yield 1 and 2 batches (last: the fit
    stops there), then :func:`_fit_varying_batches`'s run, then :func:`_refused_on_one_rank`'s errors."""
    torch.manual_seed(0)
    runs = [_fit_ddp_and_dp_ga(loader, world_size, *rest) for loader, *rest in cases]
    varying = _fit_varying_batches(world_size)
    model = _ScheduledOver(functools.partial(_uneven_loader, sizes=(30, 63)))
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=20), devices=world_size, max_epochs=1, limit_val_batches=0))
    with pytest.raises(ValueError, match="different numbers of batches") as error:
        trainer.fit(model)
    return runs, str(error.value), varying, _refused_on_one_rank(world_size)


def _uncounted_loader(_: torch.Tensor) -> Any:
    """:func:`_varying_loader` with a batch sampler of no ``sampler``: rank 0's 130 samples are counted from its dataset (4
    batches of 40, as its sampler's length says), rank 1's 111 are not (3 such batches, where it has 4)."""
    mine = VARYING[torch.distributed.get_rank()]
    x = torch.randn(sum(mine), 4)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_sampler=_SizedBatches(list(mine), 40))


def _uncut_on_rank_1(x: torch.Tensor, distributed: bool = False) -> Any:
    """Batches of 8 (x, y), whose targets are a :class:`_Targets` (which micro-batches cannot be cut from) on rank 1 only;
    ``distributed``: of a DistributedSampler of the user's (10 of the 20 samples per rank; no agreement per batch)."""
    def collate(items: list[Any]) -> Any:
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        return x, (_Targets(y) if torch.distributed.get_rank() == 1 else y)

    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False) if distributed else None
    return torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler, collate_fn=collate)


class _FilteredBatches(torch.utils.data.Sampler):
    """Batches of ``batch_size`` from ``sampler`` (a DistributedSampler: 10 of the 20 samples per rank) that, on rank 1
    only, leave out its last 2 samples (a filter of the user's): 2 batches of 4 where its ``sampler`` holds 10, so that
    rank's samples per epoch cannot be counted from it (rank 0's 4, 4, 2 can)."""

    def __init__(self, sampler: Any, batch_size: int) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, False

    def _kept(self) -> list[int]:
        indices = list(self.sampler)
        return indices[:-2] if torch.distributed.get_rank() == 1 else indices

    def __iter__(self) -> Any:
        kept = self._kept()
        for k in range(0, len(kept), self.batch_size):
            yield kept[k : k + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self._kept()) // self.batch_size)


def _filtered_on_rank_1(x: torch.Tensor) -> Any:
    """Loader batches of :class:`_FilteredBatches` over a DistributedSampler of the user's (so no agreement per batch)."""
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_sampler=_FilteredBatches(torch.utils.data.DistributedSampler(data, shuffle=False), 4))


class _MissingOnRank1(torch.utils.data.Dataset):
    """(x, target) samples of ``x`` whose samples from 8 on raise IndexError where rank 1 reads them (its broken data)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if i >= 8 and torch.distributed.get_rank() == 1:
            raise IndexError(f"no sample {i} on this rank")
        return self.x[i], self.x[i].sum(0, keepdim=True)


def _missing_on_rank_1(x: torch.Tensor) -> Any:
    """Loader batches of 8 of :class:`_MissingOnRank1`: rank 1's second batch raises IndexError."""
    return torch.utils.data.DataLoader(_MissingOnRank1(x), batch_size=8)


class _UnopenedOnRank1(torch.utils.data.BatchSampler):
    """A BatchSampler whose ``__iter__`` (a plain method, not a generator) raises at once where rank 1 calls it: the
    loader's iterator cannot be made there (its shard file missing)."""

    def __iter__(self) -> Any:
        if torch.distributed.get_rank() == 1:
            raise ValueError("no shard file for rank 1")
        return super().__iter__()


def _unopened_on_rank_1(x: torch.Tensor) -> Any:
    """Loader batches of 8 of ``x`` from :class:`_UnopenedOnRank1`: rank 1's iter(loader) raises."""
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_sampler=_UnopenedOnRank1(torch.utils.data.SequentialSampler(data), 8, False))


OVERSIZED = ((40, 40, 40), (40, 50, 30))  # rank 1's second batch holds more than the batch size (40) its loader says


def _stream_on_rank_1(x: torch.Tensor) -> Any:
    """Loader batches of 8: a stream without a length (:class:`_Stream`) on rank 1, a map-style dataset of ``x`` (a
    length) on rank 0."""
    if torch.distributed.get_rank() == 1:
        return torch.utils.data.DataLoader(_Stream(), batch_size=8)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class _LengthFailsOnRank1(torch.utils.data.SequentialSampler):
    """A sampler whose ``__len__`` raises OSError where rank 1 calls it (its index file unreadable there alone)."""

    def __len__(self) -> int:
        if torch.distributed.get_rank() == 1:
            raise OSError("no index file for rank 1")
        return super().__len__()


def _unsized_on_rank_1(x: torch.Tensor) -> Any:
    """Loader batches of 8 of ``x`` from :class:`_LengthFailsOnRank1`: rank 1's len(loader) raises OSError."""
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=8, sampler=_LengthFailsOnRank1(data))


def _refused_on_one_rank(world_size: int) -> list[Any]:
    """(error type, message, notes, optimizer steps, weights unchanged, where its traceback ends) of dp_ga's fits over
    :func:`_uncounted_loader` (m=20), :func:`_uncut_on_rank_1` (m=4), :func:`_varying_loader` of :data:`OVERSIZED` (m=20)
    and :func:`_missing_on_rank_1` (m=4), no
    DistributedSampler, and :func:`_filtered_on_rank_1` (m=2), a DistributedSampler, each refused on rank 1 only (the
    last last: without an agreement rank 1 went on alone); then :func:`_stream_on_rank_1` as it is (m=8) and cut (m=4),
    and :func:`_batch_size_by_rank` of 4 and 8 (m=4) and of 8 and 12 (m=8), which hung, and :func:`_uncut_on_rank_1` over
    a DistributedSampler (m=4), whose rank 0 went on alone (last: a hang cannot disturb the other cases); then
    :func:`_unopened_on_rank_1` (m=4), whose iter(loader) raises on rank 1, and :func:`_unsized_on_rank_1`, whose
    len(loader) raises on rank 1, cut (m=4) and as it is (m=8); last, :class:`_ScheduledOverBatchNorm` over batches of 8
    (m=4) where a warnings filter makes dp_ga's warning on its BatchNorm (rank 0's alone) an error (appended: the others
    keep their places)."""
    errors = []
    oversized = functools.partial(_varying_loader, sizes=OVERSIZED)
    batch_norm = functools.partial(_ScheduledOverBatchNorm, functools.partial(_batch_size_by_rank, sizes=(8, 8)))
    for loader, m in ((_uncounted_loader, 20), (_uncut_on_rank_1, 4), (oversized, 20), (_missing_on_rank_1, 4), (_filtered_on_rank_1, 2),
                      (_stream_on_rank_1, 8), (_stream_on_rank_1, 4), (functools.partial(_batch_size_by_rank, sizes=(4, 8)), 4),
                      (functools.partial(_batch_size_by_rank, sizes=(8, 12)), 8), (functools.partial(_uncut_on_rank_1, distributed=True), 4),
                      (_unopened_on_rank_1, 4), (_unsized_on_rank_1, 4), (_unsized_on_rank_1, 8), (batch_norm, 4)):
        model = loader() if loader is batch_norm else _ScheduledOver(loader)
        before = cpu_state(model)
        trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=m), devices=world_size, max_epochs=1, limit_val_batches=0,
                                             use_distributed_sampler=False))
        with pytest.raises(Exception) as error, warnings.catch_warnings():  # noqa: PT011  # the test compares what each rank raised
            warnings.filterwarnings("error", message="dp_ga: the model's BatchNorm layers")
            trainer.fit(model)
        unchanged = all(torch.equal(a, b) for a, b in zip(cpu_state(model).values(), before.values()))
        errors.append((type(error.value), str(error.value), getattr(error.value, "__notes__", None), trainer.global_step, unchanged,
                       [frame.name for frame in traceback.extract_tb(error.value.__traceback__)]))
    return errors


def _batch_size_by_rank(x: torch.Tensor, sizes: tuple[int, ...]) -> Any:
    """The 20 samples in loader batches of ``sizes[rank]`` (a loader of each rank's own: use_distributed_sampler=False)."""
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=sizes[torch.distributed.get_rank()])


VARYING = ((40, 30, 20, 40), (40, 30, 1, 40))  # each rank's loader batches (batch_size 40), of different sizes mid-epoch


def _varying_loader(_: torch.Tensor, sizes: tuple[tuple[int, ...], ...] = VARYING) -> Any:
    """Loader batches of ``sizes[rank]`` (of this rank's own samples, not the model's 20) from a batch sampler of this
    rank's own (no DistributedSampler), whose ``sampler`` counts the rank's samples."""
    mine = sizes[torch.distributed.get_rank()]
    x = torch.randn(sum(mine), 4, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    batches = _SizedBatches(list(mine), 40)
    batches.sampler = range(sum(mine))  # type: ignore[attr-defined]  # the samples per epoch, which Lightning's count needs
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_sampler=batches)


def _fit_varying_batches(world_size: int) -> tuple[Any, ...]:
    """dp_ga (m=20) over :func:`_varying_loader` for 2 epochs: (estimated_stepping_batches, optimizer steps, learning rate
    at each step, micro-batch sizes trained, weights)."""
    model = _ScheduledOver(_varying_loader)
    trainer = L.Trainer(**trainer_kwargs(strategy=DPGAStrategy(micro_batch_size=20), devices=world_size, max_epochs=2, limit_val_batches=0,
                                         use_distributed_sampler=False))
    trainer.fit(model)
    return model.total, trainer.global_step, model.lrs, [n for _, n in model.trained], cpu_state(model)


class _ScheduledOverBatchNorm(_ScheduledOver):
    """:class:`_ScheduledOver` plus a training BatchNorm1d (no running statistics) over a feature that is constant over the
    samples, so its output (its bias) and gradients do not depend on how a batch is cut, but, as every BatchNorm in
    training, it refuses a batch of 1 sample ("Expected more than 1 value per channel when training")."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        self.norm = torch.nn.BatchNorm1d(1, track_running_stats=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        return torch.nn.functional.mse_loss(self.lin(x) + self.norm(x.new_ones(len(x), 1)), batch[1])


def _sharded_loader(x: torch.Tensor, n: int) -> Any:
    """A rank-sharded stream of ``n`` samples (``__len__`` = n) in loader batches of 8."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(_ShardOfStream(torch.randn(n, 4, generator=g)), batch_size=8)


class _UnevenShards(torch.utils.data.IterableDataset):
    """A stream sharded by rank into shards of unequal sizes (``sizes[rank]`` samples), whose ``__len__`` is all ranks'."""

    def __init__(self, x: torch.Tensor, sizes: tuple[int, ...]) -> None:
        self.x, self.sizes = x, sizes

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        start = sum(self.sizes[:rank])
        for row in self.x[start : start + self.sizes[rank]]:
            yield row, row.sum(0, keepdim=True)

    def __len__(self) -> int:
        return sum(self.sizes)


def _uneven_loader(x: torch.Tensor, sizes: tuple[int, ...]) -> Any:
    """Loader batches of 40 from :class:`_UnevenShards`: the same number of them on each rank, the last ones of unequal sizes."""
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(_UnevenShards(torch.randn(sum(sizes), 4, generator=g), sizes), batch_size=40)


def test_a_rank_sharded_iterable_dataset_with_a_global_length_steps_as_ddp_on_2_ranks() -> None:
    """2 gloo ranks, each iterating its shard of a stream whose __len__ is the whole stream's: 40 samples (20 per rank:
    loader batches 8, 8, 4) with m=2, where dp_ga took 4 steps in 2 epochs and DDP 6; and 56 samples (28 per rank: 8, 8, 8,
    4) with accumulate_grad_batches=2 and m=4, where DDP steps after the short fourth batch. Same steps, learning rates
    and weights as DDP on both ranks.

    Shards of unequal sizes (the same number of loader batches of 40 per rank, the last ones of 17 and 23 samples) with
    m=20: rank 0 cut its last batch into 1 micro-batch and rank 1 into 2, and the fit hung (Lightning broadcasts at every
    batch, DDP all-reduces at every step: one rank waited in a collective the other never reached). The ranks now agree
    on each loader batch's size (the largest of theirs, 23) and cut it as that: rank 0 spreads its 17 samples over the 2
    micro-batches; also where a rank's last batch (1 sample) holds fewer samples than those (m=10, 3 micro-batches for
    the batch of 23: 2 of them repeat the sample with loss weight 0).

    Equal shards of 43 samples (last batches of 3) with m=10 and a BatchNorm1d in training: f09f7a5 cut every short
    batch as a full one of 40 (4 micro-batches: 3 of 1 sample and a filler), and BatchNorm refused the batch of 1 sample
    where DDP runs; the agreed size (3) cuts it into one micro-batch of 3, as one process does.

    Shards whose loaders yield 1 and 2 batches (DDP itself aborts there): both ranks raise, rather than one waiting in
    the agreement the other never makes.

    Batch samplers of the ranks' own whose batches differ in size mid-epoch (40, 30, 20, 40 and 40, 30, 1, 40; m=20) hung
    (df00c1c's known gap): the epoch-end look-ahead was decided from the micro-batch's last piece of samples, and the
    rank whose batch of 1 sample puts none in a micro-batch's places had another last piece there, so it looked ahead
    (the next batch's agreement) where the other rank all-reduced its gradients; and __len__ counted the rank's samples
    as full batches but the last (8 and 6 micro-batches), so the second rank stopped before the first's last agreement.
    Both now run the same 7 micro-batches per epoch (the second rank's batch of 1 spread over 2 of them) and step after
    the epoch's last, in step: the same learning rates and weights on both ranks (the steps shift against the user's
    batches there, as warned, so not DDP's).

    A refusal on one rank only (its batch sampler has no ``sampler`` and its samples, unlike rank 0's, cannot be counted
    from its dataset; its first batch holds a part that cannot be cut): that rank raised and the other waited in the
    agreement (or died with gloo's "Connection closed by peer" once the first rank's process ended). Both now raise the
    refusal before any step, rank 0 with a note naming rank 1. So where the ranks read through a DistributedSampler (no
    agreement per batch) and rank 1's batch sampler filters its samples (uncounted there alone): rank 1 raised while the
    loader was set up and rank 0 waited in Lightning's sum of the loaders' lengths (gloo's "Connection closed by peer"
    here, once rank 1's process ended); the refusal is now agreed on there, once per loader set up.

    A rank's batch sampler whose second batch holds 50 samples where its batch size says 40 (:data:`OVERSIZED`, m=20):
    the ranks count each loader batch as a full one of 40 (6 micro-batches), cut that batch as 50 (3 micro-batches), and
    Lightning ended the epoch after the sixth of the 7, rank 1's last samples never trained, without a word. Refused
    now, on both ranks, at the batch that overflows the count (the third, after two steps).

    Rank 1's loader a stream without a length beside rank 0's map-style one (use_distributed_sampler=False), run as it
    is (m=8) and cut (m=4): both ranks hung (a 15 s group timeout in a run of its own) in Lightning's has_len_all_ranks,
    which sums the loaders' lengths in a collective the rank reading the stream skips. Both now raise one
    BatchFormatError with a HINT as the loader is set up, before any step.

    Loaders of each rank's own whose batch sizes differ: 4 on rank 0 and 8 on rank 1 with m=4 (rank 0 ran its loader as
    it is with no agreement per batch, rank 1 cut its batches into 2 micro-batches, agreeing on each, and accumulated 2
    per step), and 8 and 12 with m=8 (rank 1 alone refused: 8 does not divide 12): the ranks' collectives did not meet
    (gloo failed on all-reduces of other sizes, or a rank waited for the refusing one's). Both ranks now raise one
    InfeasiblePlanError with a HINT as the loader is set up, before any step (rank 1's refusal with a note on rank 0).

    Rank 1's first batch holding a part that cannot be cut, where the ranks read through a DistributedSampler (nothing
    agreed per batch): rank 1 raised alone, and rank 0 went on into the step's gradient all-reduce and died with gloo's
    error once rank 1's process ended. The ranks now agree at each epoch's first batch (one all-reduce per epoch), and
    both raise rank 1's refusal before any step, rank 0 with a note naming rank 1."""
    cases = [
        (functools.partial(_sharded_loader, n=40), 1, 2),
        (functools.partial(_sharded_loader, n=56), 2, 4),
        (functools.partial(_uneven_loader, sizes=(57, 63)), 1, 20),
        (functools.partial(_uneven_loader, sizes=(41, 63)), 2, 10),
        (functools.partial(_uneven_loader, sizes=(43, 43)), 1, 10, _ScheduledOverBatchNorm),
    ]
    results = run_on_ranks(_fit_sharded_stream, 2, cases)
    torch.set_num_threads(1)
    for steps, ranks in zip((6, 4, 4, 2, 4), zip(*(runs for runs, *_ in results))):
        for runs in ranks:
            _assert_as_ddp(runs, steps)
    # dp_ga's BatchNorm warning (micro-batches of 10 of loader batches of 40), with no warnings filter making it an error:
    # said once, on rank 0 alone, as the loader is set up (its move into the set-up agreement's try changed nothing here)
    assert [results[rank][0][4]["dp_ga"][5] for rank in (0, 1)] == [1, 0], [results[rank][0][4]["dp_ga"][5] for rank in (0, 1)]
    assert not any(runs["ddp"][5] or runs["dp_ga"][5] for result in results for runs in result[0][:4])
    assert ["this rank's ended after 1)" in results[0][1], "this rank's yielded more than 1)" in results[1][1]] == [True, True], results
    assert all(" HINT: " in error for _, error, *_ in results)
    (total, steps, lrs, trained, state), other = results[0][2], results[1][2]
    assert (total, steps) == (8, 8) and other[:3] == (total, steps, lrs), (results[0][2][:3], other[:3])
    assert (trained, other[3]) == ([20, 20, 20, 20, 20, 20, 10] * 2, [20, 20, 20, 10, 11, 20, 10] * 2)
    torch.testing.assert_close(other[4], state, rtol=0, atol=0)
    note = ["Raised on global rank 1 reading its train loader; global rank 0 stops with it."]
    assert len(results[0][3]) == len(results[1][3]) == 14
    # dp_ga's BatchNorm warning (rank 0's alone, as the loader is set up) made an error by a warnings filter: rank 0
    # raised it alone there, and rank 1 waited in the set-up agreement (gloo's "Connection closed by peer" once rank 0's
    # process ended); now the agreement carries it: rank 0 raises its UserWarning, rank 1 a RuntimeError naming it and rank 0
    warned = (results[0][3].pop(), results[1][3].pop())
    told = ("Global rank 0 raised the warning UserWarning (dp_ga: the model's BatchNorm layers ('norm') normalise over each "
            "micro-batch of 4 samples, not your loader batch of 8, so the weights and running statistics differ from DDP's. "
            "Pass micro_batch_size=8 to keep DDP's statistics (if it fits in memory), or accept per-micro-batch statistics.) "
            "as an error (a warnings filter such as -W error), so every rank stops. HINT: ")
    assert [r[0] for r in warned] == [UserWarning, RuntimeError] and warned[1][1].startswith(told), warned
    assert [r[2:5] for r in warned] == [(None, 0, True), (["Raised on global rank 0 reading its train loader; global rank 1 stops with it."], 0, True)], warned
    assert "_warn_batchnorm" in warned[0][5] and not {"raise_on_every_rank", "_tell_every_rank"} & set(warned[0][5]), warned
    # rank 1's len(loader) raising OSError (not the TypeError / NotImplementedError of no length) as the loader is set up,
    # cut (m=4) and as it is (m=8, read only for the set-up agreement): rank 1 raised it alone there and rank 0 waited in
    # that agreement (gloo's "Connection closed by peer" once rank 1's process ended); now the agreement carries it: rank
    # 1 raises its own, its traceback still ending in the sampler's __len__, and rank 0 a RuntimeError naming it and
    # rank 1, before any step
    told = ("Global rank 1 raised OSError (no index file for rank 1) reading its train loader, so every rank stops. "
            "HINT: See global rank 1's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    for _ in range(2):
        unsized = (results[0][3].pop(), results[1][3].pop())
        assert [r[:5] for r in unsized] == [(RuntimeError, told, note, 0, True), (OSError, "no index file for rank 1", None, 0, True)], unsized
        assert unsized[1][5][-1] == "__len__" and not {"raise_on_every_rank", "_tell_every_rank"} & set(unsized[1][5]), unsized
    # rank 1's batch sampler raising as the loader's iterator is made (iter(loader), outside the carried pull of a batch):
    # rank 1 raised it alone and rank 0 waited at the epoch's first agreement (gloo's "Connection closed by peer" once
    # rank 1's process ended); now the first pull raises it, which that agreement carries: rank 1 raises its own, its
    # traceback still ending in the sampler's __iter__, and rank 0 a RuntimeError naming it and rank 1, before any step
    unopened = (results[0][3].pop(), results[1][3].pop())
    told = ("Global rank 1 raised ValueError (no shard file for rank 1) reading its train loader, so every rank stops. "
            "HINT: See global rank 1's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    assert [r[:5] for r in unopened] == [(RuntimeError, told, note, 0, True), (ValueError, "no shard file for rank 1", None, 0, True)], unopened
    assert unopened[1][5][-1] == "__iter__" and not {"raise_on_every_rank", "_agreed_batch_sizes", "_agree"} & set(unopened[1][5]), unopened
    # rank 1's Dataset raising IndexError at its second batch: rank 1 raised it alone and rank 0 waited in the next
    # agreement (gloo's "Connection closed by peer" once rank 1's process ended); now rank 1 raises its own, its traceback
    # still ending in the Dataset, and rank 0 a RuntimeError naming it and rank 1
    missing = (results[0][3].pop(3), results[1][3].pop(3))
    told = ("Global rank 1 raised IndexError (no sample 8 on this rank) reading its train loader, so every rank stops. "
            "HINT: See global rank 1's traceback for where it was raised (its Dataset, sampler, collate_fn or __len__).")
    assert [r[:3] for r in missing] == [(RuntimeError, told, note), (IndexError, "no sample 8 on this rank", None)], missing
    assert missing[0][3] == missing[1][3] and missing[1][5][-1] == "__getitem__", missing
    # (as it was raised: the agreement that carried it to rank 0 raised it again, its frames put in the middle)
    assert not {"raise_on_every_rank", "_agreed_batch_sizes", "_agree"} & set(missing[1][5]), missing
    # loader batch sizes of each rank's own, 4 and 8 cut by m=4, and 8 and 12 by m=8 (refused on rank 1 alone): both
    # ranks raise as the loader is set up (their collectives did not meet)
    for refused, (matching, noted) in zip(zip(results[0][3][6:8], results[1][3][6:8]), (
            (r"^The ranks' train loaders have batch sizes from 4 to 8, re-chunked into micro-batches of 4, .*HINT: Give every "
             r"rank's train loader the same batch size", None),
            (r"^micro_batch_size=8 does not divide the 12 samples per replica per step", note))):
        assert [r[0] for r in refused] == [InfeasiblePlanError] * 2 and refused[0][1] == refused[1][1], refused
        assert re.search(matching, refused[0][1]) and " HINT: " in refused[0][1], refused
        assert [r[2:5] for r in refused] == [(noted, 0, True), (None, 0, True)], refused
    # a stream on rank 1 beside a loader with a length on rank 0, as it is and cut: both ranks raise it as the loader is
    # set up (each hung in Lightning's sum of the loaders' lengths, which rank 1 skips)
    for refused in zip(results[0][3][4:6], results[1][3][4:6]):
        assert [r[0] for r in refused] == [BatchFormatError] * 2 and refused[0][1] == refused[1][1], refused
        assert refused[0][1].startswith("The train loader of rank 1 has no length (a stream) while those of other ranks "
                                        "have one") and " HINT: " in refused[0][1], refused
        assert [r[2:5] for r in refused] == [(None, 0, True)] * 2, refused
    # (what the message says, the optimizer steps before it: the oversized batch comes after the first batch's step)
    # (the oversized batches: every rank refuses the batches as they cut them, alike, so none names another)
    # (the last: rank 1's uncut part under a DistributedSampler, agreed on at the epoch's first batch)
    expected = ((r"4 batches of up to 40 samples, but how many samples its _SizedBatches", 0, note),
                (r"The training batch\[1\] is a _Targets holding the batch's 8 rows", 0, note),
                (r"first 3 batches of the epoch hold 130 samples, where dp_ga counts the epoch's 3 batches as at most 40 samples "
                 r"each \(6 micro-batches of 20\).*HINT: Use micro_batch_size=40", 2, None),
                (r"2 batches of up to 4 samples, but how many samples its _FilteredBatches", 0, note),
                (r"The training batch\[1\] is a _Targets holding the batch's 8 rows", 0, note))
    for refused, (matching, steps, noted) in zip(zip(results[0][3][:4] + results[0][3][8:], results[1][3][:4] + results[1][3][8:]), expected):
        assert [r[0] for r in refused] == [InfeasiblePlanError] * 2 and refused[0][1] == refused[1][1], refused
        assert re.search(matching, refused[0][1]) and " HINT: " in refused[0][1], refused
        assert [r[2:5] for r in refused] == [(noted, steps, steps == 0), (None, steps, steps == 0)], refused
