"""auto_plan in one process (devices=1): pins, errors, LightningCLI, the online re-plan, helpers."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import pytest
import torch
from _auto_plan_models import ChainMLP, regression_data, trainer_kwargs
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_distplan  # noqa: F401
from lightning_distplan import InfeasiblePlanError
from lightning_distplan.callbacks import StepTimeMonitor
from lightning_distplan.callbacks.monitor import departure, refit_compute_scale
from lightning_distplan.costmodel import Prediction
from lightning_distplan.strategies._auto_planning import TrainerCounters, link_sizes, pins_from, profile_in_fit
from lightning_distplan.strategies.auto_plan import AutoPlanStrategy


@pytest.fixture(autouse=True)
def _one_thread_and_clean_group() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    # DDP with devices=1 initialises a 1-rank group in this process: do not leak it into other tests.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _small(**kw: Any) -> ChainMLP:
    return ChainMLP(**{**dict(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0), **kw})


def test_pins_fix_the_plan_and_auto_fills_the_rest(tmp_path: Path) -> None:
    sizes: list[int] = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            sizes.append(batch[0].shape[0])

    strategy = AutoPlanStrategy(micro_batch_size=2, profile_repeats=1)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=2, accumulate_grad_batches=2, callbacks=[Sizes()]))
    model = _small()
    trainer.fit(model)
    plan = trainer.strategy.plan
    assert plan is strategy.plan or plan == strategy.plan
    # global batch = loader 8 x accumulate 2 x world 1; the pin m=2 leaves s = 8 to the planner
    assert (plan.strategy, plan.micro_batch_size, plan.accumulate_grad_batches, plan.global_batch_size) == ("dp_ga", 2, 8, 16)
    assert sizes == [2] * 16  # 2 optimizer steps of 8 planned micro-batches (the loader yields 8)
    assert trainer.accumulate_grad_batches == 2  # the user's setting is back after fit
    assert json.loads((tmp_path / "distplan" / "plan.json").read_text())["pins"] == {"micro_batch_size": 2}


@pytest.mark.parametrize(
    ("global_batch", "m", "s"),
    [(32, 8, 4), (12, 4, 3)],  # 12 is no multiple of the loader's 8: micro-batches are cut from the stream of samples
)
def test_given_global_batch_size(tmp_path: Path, global_batch: int, m: int, s: int) -> None:
    """global_batch_size with a loader of 8 on one device: that many samples per optimizer step."""
    seen: list[int] = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            seen.append(batch[0].shape[0])

    strategy = AutoPlanStrategy(global_batch_size=global_batch, micro_batch_size=m)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=2, callbacks=[Sizes()]))
    trainer.fit(_small(n_samples=128))
    plan = trainer.strategy.plan
    assert (plan.global_batch_size, plan.micro_batch_size, plan.accumulate_grad_batches) == (global_batch, m, s)
    assert seen == [m] * (2 * s) and trainer.global_step == 2
    assert trainer.accumulate_grad_batches == 1


def test_numpy_integers_are_taken_as_counts_and_written_as_json_numbers(tmp_path: Path) -> None:
    """Sizes computed with numpy (np.int64, an array of sizes) plan as Python ints would, and plan.json stays JSON."""
    import numpy as np

    strategy = AutoPlanStrategy(
        global_batch_size=np.int64(32), micro_batch_size=np.int64(8), profile_micro_batch_sizes=np.array([4, 8]),
        device_memory_bytes=np.int64(2**34), profile_repeats=np.int32(1),
    )
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=1))
    trainer.fit(_small(n_samples=128))
    plan = trainer.strategy.plan
    assert (plan.global_batch_size, plan.micro_batch_size, plan.accumulate_grad_batches) == (32, 8, 4)
    assert all(type(getattr(plan, k)) is int for k in ("global_batch_size", "micro_batch_size", "accumulate_grad_batches"))
    written = json.loads((tmp_path / "distplan" / "plan.json").read_text())
    assert written["pins"] == {"micro_batch_size": 8} and written["plan"]["global_batch_size"] == 32


def test_a_later_fit_on_the_same_trainer_keeps_the_plan_or_says_why_it_cannot(tmp_path: Path) -> None:
    """auto_plan plans once per Trainer: a later fit of the same module and global batch runs that plan on; one whose
    loader makes another global batch, or that trains another module, is refused (it ran the first fit's batch)."""
    model = _small(n_samples=64)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=4, replan="auto"), devices=1, max_epochs=1))
    trainer.fit(model)
    plan, steps = trainer.strategy.plan, trainer.global_step
    assert (plan.global_batch_size, steps) == (8, 8)
    trainer.fit_loop.max_epochs = 2
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*re-plans under strategy='auto_plan' only")  # the monitor is auto_plan's again
        trainer.fit(model)  # the same module and loader: one more epoch of the same plan
    assert trainer.strategy.plan == plan and trainer.global_step == 16
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor))
    assert monitor.history and all(r["predicted_s"] is not None for r in monitor.history)  # the plan's prediction, this fit too
    model.hparams.loader_batch = 16
    trainer.fit_loop.max_epochs = 3
    with pytest.raises(InfeasiblePlanError, match=r"for the first fit's global batch of 8, and this fit's loader makes 16 .*HINT: Use a new Trainer"):
        trainer.fit(model)
    with pytest.raises(InfeasiblePlanError, match=r"planned ChainMLP in its first fit .* this fit trains another module.*HINT: Use a new Trainer"):
        trainer.fit(_small(n_samples=64))
    assert trainer.global_step == 16


class _GrowingBatch(ChainMLP):
    """A batch-size warm-up: the train loader's batch doubles every epoch (reload_dataloaders_every_n_epochs=1)."""

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=self.hparams.loader_batch * 2**self.current_epoch)


def test_a_train_loader_reloaded_with_another_batch_size_is_refused_not_run_at_the_old_global_batch(tmp_path: Path) -> None:
    """The plan is made for the fit's first loader: reloaded with batches of 16 in epoch 1, it went on stepping every 8
    samples where DDP steps every 16 (no word said). A reload of the same batch size runs on; DPGAStrategy follows it."""
    from lightning_distplan.strategies import DPGAStrategy

    model = _GrowingBatch(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=4), devices=1, max_epochs=2,
                                         reload_dataloaders_every_n_epochs=1))
    with pytest.raises(InfeasiblePlanError, match=r"loaded again during the fit with batches of 16, where its first batches were 8.*"
                                                  r"global batch of 8.*HINT: Keep the train loader's batch size fixed"):
        trainer.fit(model)
    assert trainer.global_step == 8  # epoch 0 ran as planned (8 steps of 8 samples), nothing of epoch 1
    same = L.Trainer(**trainer_kwargs(str(tmp_path / "same"), strategy=AutoPlanStrategy(micro_batch_size=4), devices=1, max_epochs=2,
                                      reload_dataloaders_every_n_epochs=1))
    same.fit(_small(n_samples=64))
    assert same.global_step == 16
    follows = L.Trainer(**trainer_kwargs(str(tmp_path / "dp_ga"), strategy=DPGAStrategy(micro_batch_size=4), devices=1, max_epochs=2,
                                         reload_dataloaders_every_n_epochs=1))
    follows.fit(_GrowingBatch(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0))
    assert follows.global_step == 8 + 4  # epoch 1 steps on its loader batches of 16


def test_a_pipeline_that_would_skip_the_epochs_last_samples_goes_behind_the_plans_that_train_them() -> None:
    """60 samples on 2 devices: DDP trains each replica's 30 (a short last batch); a dp=1 pipeline's step of 16 samples
    would skip 12 of every epoch's 60. auto_plan runs the best plan that trains them all (the math stays the user's),
    and where none does, the ranking as it was."""
    import dataclasses

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans
    from lightning_distplan.strategies._auto_concrete import pipeline_shortfall
    from lightning_distplan.strategies.auto_plan import skipped_samples, whole_epochs_first

    # large weights over a slow all-reduce: the pipelines rank first
    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=256 << 20, activation_bytes_per_sample=1e3,
                                           output_bytes_per_sample=1e3)] * 4)
    hw = dataclasses.replace(Hardware.from_profile(profile, warn_default_links=False), allreduce_bandwidth_bytes_per_s=1e7, p2p_bandwidth_bytes_per_s=1e9)
    ranked = rank_plans(profile, world_size=2, global_batch_size=16, hardware=hw)
    assert ranked[0].plan.strategy != "dp_ga"
    loader = DataLoader(TensorDataset(torch.zeros(60, 2)), batch_size=8)
    assert skipped_samples(ranked[0].plan, loader, distributed_sampler=True) == 12  # 60 % 16
    assert skipped_samples(ranked[0].plan, DataLoader(TensorDataset(torch.zeros(64, 2)), batch_size=8), distributed_sampler=True) == 0
    # drop_last: DDP's two processes train 24 each in whole batches of 8; the pipeline's 3 steps of 16 the same 48
    assert skipped_samples(ranked[0].plan, DataLoader(TensorDataset(torch.zeros(60, 2)), batch_size=8, drop_last=True), distributed_sampler=True) == 0
    # 4 processes as dp=2 x pp=2 (counted on 4 gloo ranks): DDP trains 4 x 15 (short batches of 7), the pipeline 2 x 16
    assert pipeline_shortfall(60, 8, False, world=4, dp=2, step=16) == 14 and pipeline_shortfall(60, 8, True, world=4, dp=2, step=16) == 0
    first_whole = next(c for c in ranked if c.prediction.feasible and c.plan.strategy == "dp_ga")
    chosen = whole_epochs_first(ranked, loader, distributed_sampler=True)
    assert chosen[0].plan == first_whole.plan and [c.rank for c in chosen] == list(range(1, len(ranked) + 1))
    assert sorted(id(c.plan) for c in chosen) == sorted(id(c.plan) for c in ranked)  # the same plans, reordered
    pipelines_only = [c for c in ranked if c.plan.strategy != "dp_ga"]
    # no plan trains them all: none moved, each marked with what it skips (why_winner's reason where one is moved)
    marked = whole_epochs_first(pipelines_only, loader, distributed_sampler=True)
    assert [c.plan for c in marked] == [c.plan for c in pipelines_only]
    assert [c.skipped_samples for c in marked] == [12 if c.prediction.feasible else 0 for c in pipelines_only]
    assert [c.skipped_samples for c in chosen if c.plan.strategy == "dp_ga"] == [0] * (len(ranked) - len(pipelines_only))


def test_planning_counts_the_skipped_samples_of_each_ranks_own_loader_without_a_distributed_sampler(caplog: pytest.LogCaptureFixture) -> None:
    """Trainer(use_distributed_sampler=False), or a loader Lightning never shards (an IterableDataset, a
    DistributedSampler of the user's): each rank's loader is its own data, which DDP trains whole, so a pipeline skips
    its samples per epoch beyond whole steps (as the fit's loader warns, 53412cf). Planning read rank 0's loader as one
    dataset Lightning shards over the ranks: 60 samples in whole batches of 8 (DDP: 56 per rank) were said to skip none
    in a dp=1 pipeline's steps of 16 (it skips 8), and the pipeline ran first; 20 per rank in steps of 8 on dp=2 x pp=2
    skip 4 (said 2), 24 none (said 4, which moved that pipeline behind the others)."""
    import dataclasses

    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans
    from lightning_distplan.planner import why_winner
    from lightning_distplan.strategies.auto_plan import replicas_of_other_data_last, skipped_samples, whole_epochs_first

    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=256 << 20, activation_bytes_per_sample=1e3,
                                           output_bytes_per_sample=1e3)] * 4)
    hw = dataclasses.replace(Hardware.from_profile(profile, warn_default_links=False), allreduce_bandwidth_bytes_per_s=1e7, p2p_bandwidth_bytes_per_s=1e9)
    ranked = rank_plans(profile, world_size=2, global_batch_size=16, hardware=hw)
    first = ranked[0].plan
    assert first.strategy != "dp_ga" and first.dp == 1 and first.micro_batch_size * first.n_microbatches == 16
    dropping = DataLoader(TensorDataset(torch.zeros(60, 2)), batch_size=8, drop_last=True)
    assert skipped_samples(first, dropping, distributed_sampler=True) == 0  # sharded: 24 per rank, 48 in 3 steps
    assert skipped_samples(first, dropping, distributed_sampler=False) == 8  # each rank's 56, 3 steps of 16
    assert whole_epochs_first(ranked, dropping, distributed_sampler=True) == ranked
    chosen = whole_epochs_first(ranked, dropping, distributed_sampler=False)
    assert chosen[0].plan == next(c for c in ranked if c.prediction.feasible and c.plan.strategy == "dp_ga").plan
    assert [c.rank for c in chosen] == list(range(1, len(ranked) + 1))
    # one sample short (49 per rank, 3 steps of 16): the log said "the epoch's last 1 samples"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        whole_epochs_first(ranked, DataLoader(TensorDataset(torch.zeros(49, 2)), batch_size=8), distributed_sampler=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto_plan: not running ")]
    assert len(said) == 1 and "it would skip the epoch's last 1 sample per replica, which your run trains" in said[0], said
    # the ranks' loaders of their own data (samples_per_rank): equal ones skip alike
    caplog.clear()
    with caplog.at_level(logging.INFO):
        moved = whole_epochs_first(ranked, DataLoader(TensorDataset(torch.zeros(49, 2)), batch_size=8), distributed_sampler=False, samples=(49, 49))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto_plan: not running ")]
    skip = "the epoch's last 1 sample per replica"
    assert len(said) == 1 and f"it would skip {skip}, which your run trains" in said[0], said
    assert f"would skip {skip}, " in why_winner(moved), why_winner(moved)
    # ... where they differ on the stages of one replica (the 2 ranks' one pipeline), it is no skip: the stages cannot run
    # together, so the pipelines are ruled out (it said "would skip up to the epoch's last 7 samples per replica")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ruled = replicas_of_other_data_last(ranked, (49, 55))
        moved = whole_epochs_first(ruled, DataLoader(TensorDataset(torch.zeros(49, 2)), batch_size=8), distributed_sampler=False, samples=(49, 55))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto_plan: not running ")]
    assert len(said) == 1 and "the ranks of one of its replicas hold different numbers of samples per epoch (49, 55)" in said[0], said
    assert not any("up to" in m for m in said) and "up to" not in why_winner(moved), (said, why_winner(moved))
    assert moved[0].plan.strategy == "dp_ga" and [c.rank for c in moved] == list(range(1, len(ranked) + 1))
    assert all(not c.prediction.feasible for c in moved if c.plan.strategy != "dp_ga")
    # ... and where no data-parallel plan is feasible (memory, a pin), no pipeline is left to run: refused, not run to hang
    no_dp = [dataclasses.replace(c, prediction=dataclasses.replace(c.prediction, feasible=False, reason="out of memory"))
             if c.plan.strategy == "dp_ga" else c for c in ranked]
    with pytest.raises(InfeasiblePlanError, match=r"^Every feasible plan is a pipeline, .* samples per epoch \(49, 55\), .*HINT: .*or make a data-parallel plan feasible"):
        replicas_of_other_data_last(no_dp, (49, 55))

    class _Stream(IterableDataset):  # Lightning shards no IterableDataset, whatever use_distributed_sampler says
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.zeros(60, 2))

        def __len__(self) -> int:
            return 60

    stream = DataLoader(_Stream(), batch_size=8)
    assert skipped_samples(first, stream, distributed_sampler=True) == skipped_samples(first, stream, distributed_sampler=False) == 12
    # a DistributedSampler of the user's own: Lightning leaves it, each rank trains its shard (31 of 62 samples) whole
    data = TensorDataset(torch.zeros(62, 2))
    own_shard = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    assert skipped_samples(first, own_shard, distributed_sampler=True) == 31 % 16

    world4 = rank_plans(profile, world_size=4, global_batch_size=16, hardware=hw)
    replicas = next(c.plan for c in world4 if c.plan.strategy != "dp_ga" and c.plan.dp == 2 and c.plan.micro_batch_size * c.plan.n_microbatches == 8)
    for per_rank, sharded, own in ((20, 2, 4), (24, 4, 0)):
        loader = DataLoader(TensorDataset(torch.zeros(per_rank, 2)), batch_size=4)
        assert skipped_samples(replicas, loader, distributed_sampler=True) == sharded
        assert skipped_samples(replicas, loader, distributed_sampler=False) == own
    # the replicas' fewest and most samples (of samples_per_rank, on several ranks): every replica stops after the steps
    # the fewest fill, so rank 0's 16 (16 % 8 = 0) are no replica's figure where another replica has 14 (1 step: 8 skipped)
    sixteen = DataLoader(TensorDataset(torch.zeros(16, 2)), batch_size=4)
    assert skipped_samples(replicas, sixteen, distributed_sampler=False) == 0
    assert skipped_samples(replicas, sixteen, distributed_sampler=False, spread=(14, 16)) == 8
    assert skipped_samples(replicas, sixteen, distributed_sampler=False, spread=(16, 16)) == 0
    assert skipped_samples(replicas, sixteen, distributed_sampler=True, spread=(14, 16)) == 0  # sharded: the spread is not its figure
    # read per plan from each rank's samples: 16 on replica 0's ranks, 14 on replica 1's, where 2 replicas of 2 stages
    # skip up to 8 (the replicas differ: "up to"), and one replica of 4 stages cannot run (its stages differ): ruled out
    apart = replicas_of_other_data_last(world4, (16, 16, 14, 14))
    four = [c for c in apart if c.plan.strategy != "dp_ga" and c.plan.pp == 4]
    assert four and all(not c.prediction.feasible and "(16, 16, 14, 14)" in c.prediction.reason for c in four)
    marked = {c.plan: c for c in whole_epochs_first(apart, sixteen, distributed_sampler=False, samples=(16, 16, 14, 14))}
    assert (marked[replicas].skipped_samples, marked[replicas].skipped_samples_differ) == (8, True)
    even = {c.plan: c for c in whole_epochs_first(world4, sixteen, distributed_sampler=False, samples=(16, 16, 16, 16))}
    assert (even[replicas].skipped_samples, even[replicas].skipped_samples_differ) == (0, False)


class _LengthNotImplemented(torch.utils.data.SequentialSampler):
    """A sampler whose ``__len__`` raises NotImplementedError: no length, as Lightning reads it (``sized_len``)."""

    def __len__(self) -> int:
        raise NotImplementedError


def test_a_loader_whose_length_raises_not_implemented_error_counts_as_unsized_where_the_ranks_agree(tmp_path: Path) -> None:
    """Lightning reads a ``__len__`` raising NotImplementedError as no length (its ``sized_len``) and runs the loader
    under DDP; the ranks' agreement on their samples per epoch (planning's samples_per_rank, the pipeline loader's steps)
    read it as an error: NotImplementedError on every rank, the fit stopped. It is an unknown count now, as a loader
    without ``__len__`` (TypeError): samples_per_rank says None, and the pipeline's loader agrees step by step; so does
    planning's figure of the samples a pipeline skips (it raised there, on rank 0 alone). (One process, a one-rank gloo
    group: the same all-reduce as on several.)"""
    import functools

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_distplan import Plan
    from lightning_distplan.strategies._auto_concrete import _FullBatchLoader, loader_shortfall, samples_per_rank
    from lightning_distplan.strategies.dp_ga import _agreed_batch_sizes

    data = TensorDataset(torch.arange(10.0).view(10, 1))
    loader = DataLoader(data, batch_size=4, sampler=_LengthNotImplemented(data))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    assert samples_per_rank(torch.device("cpu"), loader) is None
    full = _FullBatchLoader(loader, 2, agree=functools.partial(_agreed_batch_sizes, torch.device("cpu")))
    assert full._steps is None  # not agreed as it was made: step by step
    assert [batch[0].flatten().tolist() for batch in full] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    # planning's figure of a pipeline's skipped samples (its sampler's length, the loader read as one Lightning shards)
    plan = Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=2, accumulate_grad_batches=1, global_batch_size=4, n_microbatches=2)
    assert loader_shortfall(loader, plan, sharded=False, distributed_sampler=True) is None


class _UnusedHead(ChainMLP):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**{**dict(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0), **kw})
        self.aux_head = torch.nn.Linear(16, 3)  # used by no loss (say, predict_step only)


def test_parameters_the_loss_does_not_use_are_found_while_profiling_and_the_fit_runs(tmp_path: Path) -> None:
    """auto_plan wraps even one device in DDP, which refuses parameters the loss does not use at the second step
    (advising Lightning's strategy='ddp_find_unused_parameters_true', which drops auto_plan). The profile finds
    them, and auto_plan runs DDP with find_unused_parameters=True: the fit trains as that strategy does, and a
    resumed fit that reuses the plan (no profiling) keeps the setting from the checkpoint."""
    torch.manual_seed(0)
    model = _UnusedHead()
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path / "auto"), strategy=AutoPlanStrategy(micro_batch_size=8), devices=1, max_steps=3))
    trainer.fit(model)
    assert trainer.global_step == 3 and trainer.strategy._ddp_kwargs["find_unused_parameters"] is True
    profile = json.loads((tmp_path / "auto" / "distplan" / "profile.json").read_text())
    assert profile["unused_parameters"] == ["aux_head.weight", "aux_head.bias"]
    ckpt = str(tmp_path / "step3.ckpt")
    trainer.save_checkpoint(ckpt)
    torch.distributed.destroy_process_group()
    torch.manual_seed(0)
    reference = _UnusedHead()
    L.Trainer(**trainer_kwargs(str(tmp_path / "ddp"), strategy="ddp_find_unused_parameters_true", devices=1, max_steps=3)).fit(reference)
    torch.distributed.destroy_process_group()
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=1e-7)

    resumed = L.Trainer(**trainer_kwargs(str(tmp_path / "resumed"), strategy=AutoPlanStrategy(micro_batch_size=8), devices=1, max_steps=5))
    resumed.fit(_UnusedHead(), ckpt_path=ckpt)
    assert not (tmp_path / "resumed" / "distplan" / "profile.json").exists()  # the checkpoint's plan, not profiled again
    assert resumed.global_step == 5 and resumed.strategy._ddp_kwargs["find_unused_parameters"] is True
    torch.distributed.destroy_process_group()


def test_parameters_the_loss_does_not_use_get_the_argument_that_keeps_auto_plan(tmp_path: Path) -> None:
    """Where auto_plan does not turn find_unused_parameters on (the user set it False; auto_plan runs as plain DDP,
    with nothing profiled), DDP's refusal at the second step names the argument that keeps auto_plan."""
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=8, find_unused_parameters=False),
                                         devices=1, max_steps=3))
    with pytest.raises(InfeasiblePlanError, match=r"^_UnusedHead has parameters its training_step's loss does not use .* HINT: Pass "
                       r"AutoPlanStrategy\(find_unused_parameters=True\)"):
        trainer.fit(_UnusedHead())
    # where auto_plan runs as plain DDP (a GradientAccumulationScheduler leaves nothing to plan): the same sentence
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(), devices=1, max_steps=3,
                                         callbacks=[GradientAccumulationScheduler({0: 1})]))
    with pytest.raises(InfeasiblePlanError, match=r"does not use .* HINT: Pass AutoPlanStrategy\(find_unused_parameters=True\)"):
        trainer.fit(_UnusedHead())


class _PreBatched(ChainMLP):
    """A loader with batch_size=None over a dataset of ready batches of 8: no batch size to read."""

    def train_dataloader(self) -> Any:
        x, y = regression_data(64).tensors
        return torch.utils.data.DataLoader([(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)], batch_size=None)


def test_a_loader_without_a_batch_size_is_refused_before_profiling_or_profiled_at_the_given_batch(tmp_path: Path) -> None:
    model = _PreBatched(width=16, depth=3, dropout=0.0)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(), devices=1, max_steps=1))
    with pytest.raises(InfeasiblePlanError, match=r"batch size cannot be read.*HINT: Pass global_batch_size="):
        trainer.fit(model)
    assert trainer.strategy._profile is None and not (tmp_path / "distplan" / "profile.json").exists()  # minutes on a real model
    strategy = AutoPlanStrategy(global_batch_size=8)
    L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=1)).fit(model)
    assert strategy.profile is not None and strategy.profile.micro_batch_sizes == (2, 4, 8)  # the given batch's share per device, not guessed from 1


def test_a_pipeline_loader_warns_of_the_samples_it_skips_known_before_the_epoch_or_seen_at_its_end() -> None:
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from lightning_distplan.strategies._auto_concrete import _FullBatchLoader

    data = TensorDataset(torch.arange(60.0).view(60, 1))
    known = _FullBatchLoader(DataLoader(data, batch_size=8), 16)
    known.shortfall = 12
    assert "shortfall" not in vars(known._loader)  # the wrapper's own, not set on the user's loader
    with pytest.warns(UserWarning, match=r"the epoch's last 12 samples per replica do not fill a pipeline step of 16 samples"):
        sizes = [len(b[0]) for b in known]
    assert sizes == [16, 16, 16]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([torch.tensor([float(i)]) for i in range(60)])

    unknown = _FullBatchLoader(DataLoader(Stream(), batch_size=8), 16)
    with pytest.warns(UserWarning, match=r"the epoch's last 12 samples of this replica did not fill a pipeline step of 16 samples and were skipped"):
        assert [len(b) for b in unknown] == [16, 16, 16]


@pytest.mark.parametrize(("length", "yields", "warned"), [
    (36, 36, ["the epoch's last 4 samples per replica do not fill"]),  # its length is what it yields: said before the epoch
    (32, 28, ["the epoch's last 4 samples of this replica did not fill a pipeline step of 8 samples and were skipped (its stream "
              "yielded fewer samples than its length"]),  # 32 fill 4 steps: nothing said before; 4 skipped at the end
    (36, 30, ["the epoch's last 4 samples per replica do not fill",  # the length's 4, then the 6 it skipped
              "the epoch's last 6 samples of this replica did not fill a pipeline step of 8 samples and were skipped (its stream "
              "yielded fewer samples than its length"]),
])
def test_a_pipeline_loader_of_a_stream_shorter_than_its_length_warns_of_what_it_skipped(length: int, yields: int, warned: list[str]) -> None:
    """A pipeline's loader of each rank's own data (no DistributedSampler) over an IterableDataset with a length: the
    shortfall said before the epoch is figured from its length, which need not be what it yields (the loader agrees
    step by step for that reason). 32 said, 28 yielded, in steps of 8: the shortfall 0 had silenced the end-of-epoch
    count, and its last 4 samples were skipped without a word."""
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_distplan.plan import Plan
    from lightning_distplan.strategies._auto_concrete import _FullBatchLoader, loader_shortfall

    class SizedStream(IterableDataset):
        def __len__(self) -> int:
            return length

        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter([torch.tensor([float(i)]) for i in range(yields)])

    loader = DataLoader(SizedStream(), batch_size=4)
    plan = Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=4, accumulate_grad_batches=1, global_batch_size=8, n_microbatches=2)
    wrapped = _FullBatchLoader(loader, 8)
    wrapped.shortfall = loader_shortfall(loader, plan, sharded=True)  # as _AutoPipelineStrategy.process_dataloader sets it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [len(b) for b in wrapped] == [8] * (yields // 8)
    said = [str(w.message) for w in caught if "skipp" in str(w.message)]
    assert len(said) == len(warned) and all(part in text for part, text in zip(warned, said)), said


def test_impossible_pin_is_explained(tmp_path: Path) -> None:
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(stages=2, profile_repeats=1), devices=1, max_steps=1))
    with pytest.raises(InfeasiblePlanError, match=r"pin stages=2 is impossible: stages must divide world_size 1.*HINT"):
        trainer.fit(_small())
    # refused before profiling: what the world size alone rules out needs no profile (minutes on a large model)
    assert trainer.strategy._profile is None and not (tmp_path / "distplan" / "profile.json").exists()
    # and what the global batch alone rules out (8 = loader 8 x 1 device)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=3), devices=1, max_steps=1))
    with pytest.raises(InfeasiblePlanError, match=r"pin micro_batch_size=3 is impossible: it must be a positive divisor of the global batch size 8.*HINT"):
        trainer.fit(_small())
    assert trainer.strategy._profile is None and not (tmp_path / "distplan" / "profile.json").exists()


def test_memory_cap_no_plan_fits_is_explained(tmp_path: Path) -> None:
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(device_memory_bytes=1000, profile_repeats=1), devices=1, max_steps=1))
    with pytest.raises(InfeasiblePlanError, match=r"No plan .* fits in 1000 B per device.*the closest, .*, needs [0-9.]+ (KiB|MiB).*HINT"):
        trainer.fit(_small())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 0}, "`stages` must be a positive integer"), ({"strategy": "zero3"}, "Unknown strategy 'zero3'"),
        ({"replan": "yes"}, "`replan`"), ({"start_method": "spawn"}, "start_method='popen'.*HINT"),
        ({"strategy": "1f1b", "schedule": "gpipe"}, "strategy='1f1b' contradicts schedule='gpipe'.*HINT"),
        ({"stage_boundaries": "x"}, "`stage_boundaries` must be increasing positive layer indices.*HINT"),
        ({"stage_boundaries": [4, 2]}, "`stage_boundaries`.*got \\[4, 2\\].*HINT"),
        ({"deferred_batchnorm": "yes"}, "`deferred_batchnorm` must be True or False.*HINT"),
        ({"bucket_capmb": 25}, "keyword argument\\(s\\) 'bucket_capmb' that neither.*HINT"),
        ({"profile_micro_batch_sizes": 4}, "`profile_micro_batch_sizes` must be a list of positive micro-batch sizes, got 4.*HINT"),
        ({"profile_micro_batch_sizes": [0, 2]}, "`profile_micro_batch_sizes` must be a list.*got \\[0, 2\\].*HINT"),
        ({"profile_repeats": "auto"}, "`profile_repeats` must be a positive integer, got 'auto'.*HINT"),
        ({"device_memory_bytes": 1.5}, "`device_memory_bytes` must be a positive number of bytes.*HINT"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InfeasiblePlanError, match=match):
        AutoPlanStrategy(**kwargs)


def test_lightning_cli_trainer_strategy_auto_plan(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        BoringModel,
        args=[
            "fit", "--trainer.strategy=auto_plan", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_kwargs={"overwrite": True},
    )
    assert cli.trainer.global_step == 2
    assert cli.trainer.strategy.plan is not None and cli.trainer.strategy.plan.strategy == "dp_ga"
    assert (tmp_path / "distplan" / "plan.json").is_file()


def test_lightning_cli_passes_ddp_arguments_and_pins_to_auto_plan(tmp_path: Path) -> None:
    """DDP's own arguments reach AutoPlanStrategy from the command line (they were hidden from jsonargparse)."""
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        BoringModel,
        run=False,
        args=[
            "--trainer.strategy=lightning_distplan.strategies.auto_plan.AutoPlanStrategy", "--trainer.strategy.find_unused_parameters=true",
            "--trainer.strategy.micro_batch_size=2", "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AutoPlanStrategy) and strategy._extra_ddp_kwargs["find_unused_parameters"] is True
    assert strategy._pins == {"micro_batch_size": 2}


def test_replan_after_a_sustained_slowdown(tmp_path: Path) -> None:
    """The module sleeps 40 ms per step from step 4 on: the monitor sees the departure, refits the
    compute speed at the epoch boundary and re-plans; afterwards the prediction matches again."""
    monitor = StepTimeMonitor(warmup_steps=1, window=3)  # its replan default 'off': the strategy's 'auto' wins
    model = _small(n_samples=80, loader_batch=8, slow_after=3, slow_s=0.04)  # 10 steps per epoch
    trainer = L.Trainer(
        **trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(replan="auto", profile_repeats=1), devices=1, max_epochs=2, callbacks=[monitor])
    )
    trainer.fit(model)
    assert [cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor)] == [monitor]  # reused, not duplicated
    assert len(monitor.history) == 20 and len(monitor._observed) <= monitor.window
    assert len(monitor.replans) == 1
    replan = monitor.replans[0]
    assert replan["epoch"] == 0 and replan["ratio"] > 1.5 and replan["compute_scale"] > 1.5
    second_epoch = monitor.history[10:]
    ratios = sorted(h["observed_s"] / h["predicted_s"] for h in second_epoch)
    assert 0.5 < ratios[len(ratios) // 2] < 2.0  # refitted: the prediction tracks the slowed device
    assert json.loads((tmp_path / "distplan" / "plan.json").read_text())["replans"][0]["compute_scale"] == pytest.approx(replan["compute_scale"])
    assert monitor.overhead_s is not None and monitor.run_s is not None and monitor.overhead_s < monitor.run_s


class _MonitorsMyMetric(L.Callback):
    monitor = "my_metric"  # a metric a pipeline does not log: this fit runs data parallel only


class _Validated(ChainMLP):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(regression_data(16, seed=1), batch_size=8)


@pytest.mark.parametrize("validation", [False, True], ids=["no-validation", "validation-twice-an-epoch"])
def test_a_replan_is_recorded_where_it_runs_and_only_among_the_strategies_the_fit_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, validation: bool
) -> None:
    """A forced switch (the re-plan pins micro_batch_size=2) at the end of epoch 0: the checkpoint saved at that
    epoch's end, where epoch 1 starts, records the plan epoch 1 runs, also where ModelCheckpoint saves after the
    epoch's last validation (val_check_interval=0.5), before on_train_epoch_end; plan.json keeps the pins; the
    re-plan ranks data parallel only, as the first decision did. The same monitor in a one-epoch fit then starts with
    no re-plans counted and does not re-plan at the fit's last epoch end."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_distplan.strategies._auto_planning as planning

    asked: list[Any] = []
    real = planning.choose_plan

    def choose(profile: Any, **kwargs: Any) -> Any:
        if kwargs.get("compute_scale") is not None:  # the re-plan
            asked.append(kwargs.get("strategies"))
            kwargs["pins"] = {**kwargs.get("pins", {}), "micro_batch_size": 2}
        return real(profile, **kwargs)

    monkeypatch.setattr(planning, "choose_plan", choose)
    monitor = StepTimeMonitor(warmup_steps=1, window=3, max_replans=1)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}-{step}", save_top_k=-1)
    extra = dict(limit_val_batches=2, val_check_interval=0.5) if validation else {}
    trainer = L.Trainer(**trainer_kwargs(  # m=8 pinned first, so that the forced m=2 is a switch however noisy the profile
        str(tmp_path), strategy=AutoPlanStrategy(replan="auto", profile_repeats=1, micro_batch_size=8), devices=1, max_epochs=2,
        callbacks=[monitor, checkpoints, _MonitorsMyMetric()], enable_checkpointing=True, **extra,
    ))
    model_kwargs = dict(width=16, depth=3, n_samples=80, loader_batch=8, dropout=0.0, slow_after=3, slow_s=0.04)
    trainer.fit(_Validated(**model_kwargs) if validation else ChainMLP(**model_kwargs))
    assert asked == [("dp_ga",)]
    assert [(r["applied"], r["ran"]) for r in monitor.replans] == [(True, True)] and trainer.strategy.plan.micro_batch_size == 2
    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0-step=10.ckpt", weights_only=False)  # the last of epoch 0
    assert ckpt["distplan_plan"]["micro_batch_size"] == 2  # was the m=8 plan epoch 0 ran
    monitor_state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("StepTimeMonitor"))
    assert monitor_state["plan"] == ckpt["distplan_plan"]
    record = json.loads((tmp_path / "distplan" / "plan.json").read_text())
    assert record["source"] == "replanned" and record["pins"] == {"micro_batch_size": 8} and record["plan"]["micro_batch_size"] == 2
    torch.distributed.destroy_process_group()

    one_epoch = L.Trainer(**trainer_kwargs(
        str(tmp_path / "again"), strategy=AutoPlanStrategy(replan="auto", profile_repeats=1), devices=1, max_epochs=1, callbacks=[monitor],
    ))
    one_epoch.fit(_small(n_samples=80, loader_batch=8, slow_after=3, slow_s=0.04))
    assert monitor.replans == [] and len(asked) == 1  # a fresh count, and no plan decided that would never run
    assert json.loads((tmp_path / "again" / "distplan" / "plan.json").read_text())["source"] == "profiled"


def test_a_replan_at_an_epoch_end_where_early_stopping_then_stops_the_fit_is_recorded_as_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monitor does not re-plan at the fit's last epoch end as far as it can tell then, but EarlyStopping decides in
    on_train_epoch_end after every other callback: the forced switch (m=8 to m=2) was made at epoch 0's end, the fit
    stopped there, and plan.json and the log said the fit switched from the next epoch, which never ran. The record and
    plan.json now say the plan did not run (ran: false)."""
    from lightning.pytorch.callbacks import EarlyStopping

    import lightning_distplan.strategies._auto_planning as planning

    real = planning.choose_plan

    def choose(profile: Any, **kwargs: Any) -> Any:
        if kwargs.get("compute_scale") is not None:  # the re-plan
            kwargs["pins"] = {**kwargs.get("pins", {}), "micro_batch_size": 2}
        return real(profile, **kwargs)

    monkeypatch.setattr(planning, "choose_plan", choose)
    monitor = StepTimeMonitor(warmup_steps=1, window=3, max_replans=1)
    stop = EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True, stopping_threshold=1e9)  # at the first check
    trainer = L.Trainer(**trainer_kwargs(
        str(tmp_path), strategy=AutoPlanStrategy(replan="auto", profile_repeats=1, micro_batch_size=8), devices=1, max_epochs=3,
        callbacks=[monitor, stop],
    ))
    trainer.fit(ChainMLP(width=16, depth=3, n_samples=80, loader_batch=8, dropout=0.0, slow_after=3, slow_s=0.04))
    assert trainer.current_epoch == 1 and trainer.global_step == 10  # one epoch of 10 steps of m=8, then stopped
    assert [(r["applied"], r["ran"], r["new_best"]) for r in monitor.replans] == [(True, False, "dp_ga dp=1 m=2 accumulate=4")]
    record = json.loads((tmp_path / "distplan" / "plan.json").read_text())
    assert [r["ran"] for r in record["replans"]] == [False]


def test_resume_restores_the_monitor_it_added_without_a_callback_warning(tmp_path: Path) -> None:
    """auto_plan adds its StepTimeMonitor before Lightning restores callback states, so a resumed fit
    gets the monitor's state back instead of Lightning asking the user to add a callback they never made."""

    class MarkReplan(L.Callback):  # stands in for a re-plan done in the first run
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor))
            monitor.replans.append({"step": 1, "compute_scale": 2.5})
            monitor._scale = 2.5

    first = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(profile_repeats=1), devices=1, max_steps=2, callbacks=[MarkReplan()]))
    first.fit(_small())
    first_monitor = next(cb for cb in first.callbacks if isinstance(cb, StepTimeMonitor))
    ckpt = str(tmp_path / "step2.ckpt")
    first.save_checkpoint(ckpt)
    torch.distributed.destroy_process_group()

    resumed = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(profile_repeats=1, replan="auto"), devices=1, max_steps=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(_small(), ckpt_path=ckpt)
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    # the checkpoint's plan comes without a profile: re-planning cannot work, and says so
    assert [w for w in caught if "replan='auto' has no profile to re-plan from in this fit" in str(w.message)]
    monitors = [cb for cb in resumed.callbacks if isinstance(cb, StepTimeMonitor)]
    assert len(monitors) == 1 and monitors[0].replans == [{"step": 1, "compute_scale": 2.5}]
    assert monitors[0].state_dict()["compute_scale"] == 2.5 and len(monitors[0].history) == 2
    # ... but the prediction the plan ran with comes back: the resumed steps are still set beside it
    predicted = first_monitor.predicted_step_time_s
    assert predicted is not None and [h["predicted_s"] for h in monitors[0].history] == [predicted, predicted]
    assert resumed.logged_metrics["distplan/predicted_step_time_s"] == pytest.approx(predicted)
    assert resumed.strategy.plan is not None and resumed.global_step == 4


def test_monitor_times_each_fit_afresh_and_leaves_validation_out(tmp_path: Path) -> None:
    """The same StepTimeMonitor in two Trainers: each fit's steps, none lost or merged; a validation run that falls
    between the micro-batches of a step (val_check_interval inside an accumulation) is not timed with the step."""
    import time

    class Slow(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(0.01)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(0.6)
            return super().validation_step(batch, batch_idx)

    monitor = StepTimeMonitor(warmup_steps=0)
    for steps in (3, 4):
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1,
            num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[monitor], default_root_dir=str(tmp_path),
        )
        trainer.fit(Slow())
        assert [h["step"] for h in monitor.history] == list(range(1, steps + 1))
        # a step is ~0.03 s here; 0.45 s leaves a busy host room and still catches a 0.6 s validation counted in a step
        assert max(h["observed_s"] for h in monitor.history) < 0.45, monitor.history


def test_a_monitor_asked_to_replan_without_auto_plan_says_it_will_not(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[StepTimeMonitor(replan="auto")], default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    assert [str(w.message) for w in caught if "StepTimeMonitor(replan='auto')" in str(w.message)] == [
        "distplan: StepTimeMonitor(replan='auto') re-plans under strategy='auto_plan' only; this fit runs SingleDeviceStrategy, "
        "so the monitor logs step times and does not re-plan."]


def test_profile_in_fit_leaves_counters_rng_and_weights(tmp_path: Path) -> None:
    """Called from a callback in the middle of a fit: counters, RNG, weights, optimizer state unchanged."""
    seen: dict[str, Any] = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != 2 or seen:
                return
            before = TrainerCounters.take(trainer).comparable()
            rng = torch.get_rng_state()
            weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
            opt = {k: {n: t.clone() for n, t in s.items()} for k, s in trainer.optimizers[0].state.items()}
            profile, _ = profile_in_fit(trainer, pl_module, device=torch.device("cpu"), repeats=1, measure_links=False)
            seen["profile"] = profile
            seen["counters"] = (before, TrainerCounters.take(trainer).comparable())
            seen["rng"] = torch.equal(rng, torch.get_rng_state())
            seen["weights"] = all(torch.equal(weights[k], v) for k, v in pl_module.state_dict().items())
            after = trainer.optimizers[0].state
            seen["opt"] = all(torch.equal(opt[k][n], after[k][n]) for k in opt for n in opt[k])

    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, max_steps=4, callbacks=[Probe()]))
    trainer.fit(_small(dropout=0.2))
    assert seen["profile"].layers
    assert seen["counters"][0] == seen["counters"][1]
    assert seen["rng"] and seen["weights"] and seen["opt"]


def test_helpers() -> None:
    assert pins_from(strategy="auto", stages=2, micro_batch_size="auto", stage_boundaries=[1]) == {"stages": 2, "stage_boundaries": (1,)}
    assert link_sizes(10) == (4096, 32768, 131072) and link_sizes(1 << 30)[-1] == 1 << 24
    assert departure(1.0, [2.0, 2.1, 1.9], threshold=1.5, window=3) == pytest.approx(2.0)
    assert departure(1.0, [2.0, 1.2, 1.9], threshold=1.5, window=3) is None  # one normal step: not sustained
    assert departure(1.0, [0.5, 0.4, 0.6], threshold=1.5, window=3) == pytest.approx(0.5)
    pred = Prediction(
        step_time_s=1.0, breakdown={"compute": 0.7, "p2p": 0.0, "bubble": 0.0, "exposed_comm": 0.2, "optimizer": 0.1},
        peak_memory_bytes=1, memory_breakdown={}, stage_times_s=(1.0,), stage_memory_bytes=(1,), stage_boundaries=(),
        feasible=True, reason="",
    )
    # compute + optimizer (0.8 s) scale, the exposed all-reduce (0.2 s) does not: 0.2 + 0.8 k = 2.6 -> k = 3
    assert refit_compute_scale(pred, 2.6, 1.0) == pytest.approx(3.0)
    # faster: 0.2 + 0.8 k = 0.6 -> k = 0.5 (from 2.0: 1.0), the all-reduce still held fixed
    assert refit_compute_scale(pred, 0.6, 2.0) == pytest.approx(1.0)
    # a step at or below the fixed part (a CPU host that got faster, its loop included) cannot be matched: compute scales
    # by the step's ratio instead of being priced as free (it was 1e-12)
    assert refit_compute_scale(pred, 0.15, 1.0) == pytest.approx(0.15)
    assert refit_compute_scale(pred, 0.2, 2.0) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("precision", "autocast", "dtype", "label"),
    [("bf16-mixed", True, torch.float32, "bf16-mixed"), ("bf16-true", False, torch.bfloat16, "bfloat16"), ("32-true", False, torch.float32, "float32")],
)
def test_profiling_runs_in_the_fits_precision(tmp_path: Path, precision: str, autocast: bool, dtype: torch.dtype, label: str) -> None:
    """The profiled steps run as the fit's steps do (autocast, converted weights and inputs), and the profile says which."""
    seen: list[tuple[bool, torch.dtype, torch.dtype]] = []  # (autocast on, input dtype, weight dtype) per training_step call

    class Recording(ChainMLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), batch[0].dtype, self.blocks[0][0].weight.dtype))
            return super().training_step(batch, batch_idx)

    strategy = AutoPlanStrategy(profile_repeats=1, micro_batch_size=8, accumulate_grad_batches=1)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=2, precision=precision))
    trainer.fit(Recording(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0))
    profiling, training = seen[:-2], seen[-2:]  # the pinned plan runs one micro-batch per step
    assert len(profiling) > 4 and set(profiling) == set(training) == {(autocast, dtype if precision.endswith("-true") else torch.float32, dtype)}
    assert json.loads((tmp_path / "distplan" / "profile.json").read_text())["device"]["dtype"] == label
    for other, expected in ((precision, ("dp_ga", "gpipe", "1f1b")), ("16-true", ("dp_ga",)), ("64-true", ("dp_ga",))):  # what pipelines run
        assert AutoPlanStrategy()._strategies_allowed(L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, precision=other))) == expected


def test_pinned_pipeline_with_a_precision_pipelines_do_not_run_is_refused_before_profiling(tmp_path: Path) -> None:
    clipped = L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, gradient_clip_val=1.0))  # pipelines clip by the global norm
    assert AutoPlanStrategy()._strategies_allowed(clipped) == ("dp_ga", "gpipe", "1f1b")
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(strategy="gpipe"), devices=1, max_steps=1, precision="16-true"))
    with pytest.raises(
        InfeasiblePlanError,
        match=r"pinned, but the fit runs precision='16-true' and pipelines run '32-true', 'bf16-mixed' or 'bf16-true' only\..*"
        r"HINT: Use Trainer\(precision='bf16-mixed'\), or drop the pipeline pin",
    ):
        trainer.fit(_small())
    assert not (tmp_path / "distplan" / "profile.json").exists()


def test_monitored_metrics_a_pipeline_does_not_log(tmp_path: Path) -> None:
    """A callback monitoring the module's own metric keeps auto_plan to data parallel, and a pinned pipeline is refused before profiling."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    own = L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(monitor="val_acc"), EarlyStopping(monitor="val_loss")]))
    assert AutoPlanStrategy()._strategies_allowed(own) == ("dp_ga",)
    loss_only = L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, callbacks=[EarlyStopping(monitor="val_loss")]))
    assert AutoPlanStrategy()._strategies_allowed(loss_only) == ("dp_ga", "gpipe", "1f1b")
    # weight averaging needs the whole model in every process: data parallel only too
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    averaged = L.Trainer(**trainer_kwargs(str(tmp_path), devices=1, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)]))
    assert AutoPlanStrategy()._strategies_allowed(averaged) == ("dp_ga",)

    trainer = L.Trainer(
        **trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(strategy="1f1b"), devices=1, max_steps=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(monitor="val_acc")])
    )
    with pytest.raises(InfeasiblePlanError, match=r"callbacks monitor 'val_acc', which a pipeline does not log.*HINT: Monitor 'val_loss'"):
        trainer.fit(_small())
    assert not (tmp_path / "distplan" / "profile.json").exists()  # refused before profiling


def test_resume_plans_again_when_the_checkpoints_plan_breaks_a_pin(tmp_path: Path) -> None:
    """The stored plan is reused only when it satisfies this fit's pins (and strategies); otherwise auto_plan plans again."""
    first = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(profile_repeats=1, micro_batch_size=8), devices=1, max_steps=2))
    first.fit(_small())
    ckpt = str(tmp_path / "step2.ckpt")
    first.save_checkpoint(ckpt)
    torch.distributed.destroy_process_group()
    for pinned, source in ((8, "checkpoint"), (4, "planned")):
        auto = AutoPlanStrategy(profile_repeats=1, micro_batch_size=pinned)
        resumed = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=auto, devices=1, max_steps=3))
        resumed.fit(_small(), ckpt_path=ckpt)
        assert auto.plan is not None and auto.plan.micro_batch_size == pinned
        assert (auto._outcome.source == "checkpoint") == (source == "checkpoint"), auto._outcome.source
        assert resumed.global_step == 3
        torch.distributed.destroy_process_group()


class _Scheduled(ChainMLP):
    """Reads trainer.estimated_stepping_batches in configure_optimizers (as OneCycleLR is sized) and counts the samples
    each epoch trains."""

    def __init__(self) -> None:
        super().__init__(width=16, depth=3, n_samples=80, loader_batch=8, dropout=0.0, shuffle=False)
        self.trained: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.append((self.current_epoch, batch[0].shape[0]))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        total = self.trainer.estimated_stepping_batches  # loads the train loader before Lightning restores the loops
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_mid_epoch_resume_trains_the_rest_of_the_epoch_when_configure_optimizers_loads_the_loader(tmp_path: Path) -> None:
    """Saved after 8 of an epoch's 10 batches and resumed under auto_plan with m = 2: the resumed epoch trains the 2
    batches DDP trains. auto_plan kept the checkpoint's progress, but not the loops' own, so its dp_ga took the loader
    that estimated_stepping_batches loaded (before Lightning restored the loops) for the resumed one: the epoch trained
    64 samples, not 16, in 6 optimizer steps too many."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="c", every_n_train_steps=8)
    L.Trainer(**trainer_kwargs(str(tmp_path), strategy="ddp", devices=1, max_epochs=1, enable_checkpointing=True, callbacks=[every])).fit(_Scheduled())
    torch.distributed.destroy_process_group()
    runs = {}
    for name, strategy in (("ddp", "ddp"), ("auto_plan", AutoPlanStrategy(profile_repeats=1, micro_batch_size=2))):
        model = _Scheduled()
        trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_epochs=2))
        trainer.fit(model, ckpt_path=str(tmp_path / "ckpt" / "c.ckpt"))
        runs[name] = ([sum(n for e, n in model.trained if e == epoch) for epoch in range(2)], trainer.global_step)
        torch.distributed.destroy_process_group()
    assert runs["ddp"] == ([16, 80], 20) and runs["auto_plan"] == runs["ddp"], runs


def test_resume_plans_again_in_another_precision_or_with_less_device_memory(tmp_path: Path) -> None:
    """The checkpoint stores what its plan was made for: a plan chosen for bf16-true (half the bytes) or for more device
    memory could run out of memory in this fit, so auto_plan plans again (it reused the plan, review)."""
    memory = 1 << 30
    first = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(profile_repeats=1, device_memory_bytes=memory), devices=1,
                                       max_steps=2, precision="bf16-true"))
    first.fit(_small())
    ckpt = str(tmp_path / "step2.ckpt")
    first.save_checkpoint(ckpt)
    torch.distributed.destroy_process_group()
    assert torch.load(ckpt, weights_only=False)["distplan_plan_context"] == {"precision": "bf16-true", "memory_limit_bytes": memory}
    # 1% less is the same card as another library reports it (NVML and torch differ by 0.6% on an H100): reused
    for precision, given, source in (("bf16-true", memory, "checkpoint"), ("32-true", memory, "profiled"), ("bf16-true", memory // 2, "profiled"),
                                     ("bf16-true", 2 * memory, "checkpoint"), ("bf16-true", int(0.99 * memory), "checkpoint")):
        auto = AutoPlanStrategy(profile_repeats=1, device_memory_bytes=given)
        resumed = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=auto, devices=1, max_steps=3, precision=precision))
        resumed.fit(_small(), ckpt_path=ckpt)
        assert auto._outcome is not None and auto._outcome.source == source, (precision, given, auto._outcome.source)
        assert resumed.global_step == 3
        torch.distributed.destroy_process_group()


class _ManualBoring(BoringModel):
    """Manual optimization: training_step runs backward and the optimizer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.step(batch))
        opt.step()


def test_manual_optimization_runs_as_plain_ddp_with_a_warning_and_pins_are_refused(tmp_path: Path) -> None:
    """Nothing to plan without automatic optimization: auto_plan and PlanningCallback say so and let the fit run
    (the profiler refused the module before, with advice about profiling)."""
    from lightning_distplan import PlanningCallback

    for strategy, callbacks, what in ((AutoPlanStrategy(), [], "auto_plan: _ManualBoring"), ("auto", [PlanningCallback()], "PlanningCallback: _ManualBoring")):
        model = _ManualBoring()
        trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=strategy, devices=1, max_steps=3, callbacks=callbacks))
        with pytest.warns(UserWarning, match=rf"{what} uses manual optimization .* nothing to plan"):
            trainer.fit(model)
        assert trainer.global_step == 3
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=2), devices=1, max_steps=1))
    with pytest.raises(InfeasiblePlanError, match=r"manual optimization .* pins \{'micro_batch_size': 2\}.*HINT"):
        trainer.fit(_ManualBoring())


def test_a_gradient_accumulation_scheduler_runs_auto_plan_as_ddp_and_is_refused_by_a_rechunking_dp_ga(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_distplan.strategies.dp_ga import DPGAStrategy

    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(), devices=1, max_steps=2,
                                         callbacks=[GradientAccumulationScheduler({0: 2})]))
    with pytest.warns(UserWarning, match=r"auto_plan: a GradientAccumulationScheduler changes the accumulation .* plain DDP"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 2
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=DPGAStrategy(micro_batch_size=4), devices=1, max_steps=2,
                                         callbacks=[GradientAccumulationScheduler({0: 2})]))
    with pytest.raises(InfeasiblePlanError, match=r"dp_ga runs .* GradientAccumulationScheduler.*HINT: Use one of the two"):
        trainer.fit(_small())  # loader batches of 8 cut into micro-batches of 4


def test_a_training_step_that_reads_its_optimizer_and_scheduler_is_profiled(tmp_path: Path) -> None:
    """Logging the learning rate from training_step (self.optimizers(), self.lr_schedulers()) works under ddp; the
    in-fit profiler called training_step with no optimizer attached and refused the module."""

    class LogsLR(ChainMLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("lr", self.optimizers().param_groups[0]["lr"])
            self.log("sched_lr", self.lr_schedulers().get_last_lr()[0])
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}}

    model = LogsLR(width=16, depth=3, n_samples=64, loader_batch=8, dropout=0.0)
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=AutoPlanStrategy(micro_batch_size=4), devices=1, max_steps=3))
    trainer.fit(model)
    assert trainer.global_step == 3 and trainer.callback_metrics["sched_lr"].item() == pytest.approx(0.1 * 0.5**2)
    assert trainer.strategy.plan.micro_batch_size == 4


def test_no_plan_fits_says_why_pipelines_were_left_out_instead_of_suggesting_one():
    """Out of memory with pipelines left out (the profile is not splittable): the HINT names the reason, it does not
    send the user to pipelines the planner would not build."""
    from dataclasses import replace

    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.strategies._auto_planning import choose_plan

    layer = LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=10 << 20, activation_bytes_per_sample=100)
    profile = synthetic_profile([layer] * 4, splittable=True)
    reason = "the pipeline's loss (the built-in adapter's guess) is 1.4 where training_step's is 1.5 on the same micro-batch"
    with pytest.raises(InfeasiblePlanError, match=r"HINT: Drop pins, .*use more devices \(pipeline stages split the model\)"):
        choose_plan(profile, world_size=2, global_batch_size=8, device_memory_bytes=30 << 20)
    with pytest.raises(InfeasiblePlanError, match=r"HINT: Pipelines, which split the model over devices, were left out because .*adapter's guess\) is 1.4"):
        choose_plan(replace(profile, splittable=False, split_reason=reason), world_size=2, global_batch_size=8, device_memory_bytes=30 << 20)


def test_the_plan_is_priced_with_the_strategys_ddp_bucket_size():
    """DDPStrategy(bucket_cap_mb=...) (the callback's), or the same argument to auto_plan / dp_ga: the cost model's
    buckets are that size (the default 1 MiB / 25 MiB were assumed whatever the run used)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy
    from lightning_distplan.strategies.dp_ga import DPGAStrategy
    from lightning_distplan.strategies._auto_planning import choose_plan, ddp_bucket_bytes

    assert ddp_bucket_bytes(DDPStrategy()) is None and ddp_bucket_bytes(object()) is None
    assert ddp_bucket_bytes(DDPStrategy(bucket_cap_mb=50)) == 50 << 20
    assert ddp_bucket_bytes(DDPStrategy(bucket_cap_mb=0.5)) == 1 << 19
    assert ddp_bucket_bytes(AutoPlanStrategy(bucket_cap_mb=4)) == ddp_bucket_bytes(DPGAStrategy(bucket_cap_mb=4)) == 4 << 20
    profile = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=10 << 20)] * 4)
    _, hardware = choose_plan(profile, world_size=2, global_batch_size=8, ddp_bucket_bytes=4 << 20)
    assert hardware.ddp_bucket_bytes == 4 << 20
    assert choose_plan(profile, world_size=2, global_batch_size=8)[1].ddp_bucket_bytes is None


@pytest.mark.parametrize(
    ("state", "last"),
    [
        (dict(current_epoch=0, max_epochs=2), False), (dict(current_epoch=1, max_epochs=2), True),
        (dict(global_step=10, max_steps=10), True), (dict(global_step=9, max_steps=10), False),
        (dict(should_stop=True), True),
        (dict(should_stop=True, min_epochs=3), False),  # min_epochs keeps the fit going: Lightning's _can_stop_early
        (dict(should_stop=True, min_epochs=3, current_epoch=2), True),
        (dict(should_stop=True, min_steps=20, global_step=10), False),
    ],
)
def test_the_monitor_knows_the_fits_last_epoch(state: dict[str, Any], last: bool) -> None:
    from types import SimpleNamespace

    from lightning_distplan.callbacks.monitor import _last_epoch

    base = dict(current_epoch=0, max_epochs=5, global_step=3, max_steps=-1, should_stop=False, min_epochs=None, min_steps=None)
    base.update(state)
    trainer = SimpleNamespace(**base, fit_loop=SimpleNamespace(min_epochs=base["min_epochs"], min_steps=base["min_steps"]))
    assert _last_epoch(trainer) is last


def test_the_monitor_auto_plan_adds_replans_before_modelcheckpoint_saves_after_the_epochs_last_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AutoPlanStrategy(replan='auto') with no StepTimeMonitor of the user's: the one it adds re-plans before
    ModelCheckpoint saves at the epoch's last validation (val_check_interval=0.5), so the checkpoint where epoch 1
    starts holds the plan epoch 1 runs. Appended after the checkpoint callbacks (which Lightning puts last), it re-planned
    after that save, and the checkpoint held epoch 0's plan (m=8 where epoch 1 ran m=2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_distplan.strategies._auto_planning as planning

    real = planning.choose_plan

    def choose(profile: Any, **kwargs: Any) -> Any:
        if kwargs.get("compute_scale") is not None:  # the re-plan: forced to a switch
            kwargs["pins"] = {**kwargs.get("pins", {}), "micro_batch_size": 2}
        return real(profile, **kwargs)

    monkeypatch.setattr(planning, "choose_plan", choose)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}-{step}", save_top_k=-1)
    trainer = L.Trainer(**trainer_kwargs(
        str(tmp_path), strategy=AutoPlanStrategy(replan="auto", profile_repeats=1, micro_batch_size=8), devices=1, max_epochs=2,
        callbacks=[checkpoints], enable_checkpointing=True, limit_val_batches=2, val_check_interval=0.5,
    ))
    # the auto-added monitor's defaults (warmup 3, window 5) see the slowdown within epoch 0's 10 steps
    trainer.fit(_Validated(width=16, depth=3, n_samples=80, loader_batch=8, dropout=0.0, slow_after=3, slow_s=0.04))
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor))
    assert trainer.callbacks.index(monitor) < trainer.callbacks.index(checkpoints)
    assert [r["applied"] for r in monitor.replans] == [True] and trainer.strategy.plan.micro_batch_size == 2
    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0-step=10.ckpt", weights_only=False)  # saved after epoch 0's last validation
    assert ckpt["distplan_plan"]["micro_batch_size"] == 2


def test_no_plan_fits_names_why_the_closest_fails_where_its_peak_fits() -> None:
    """A plan whose micro-batch ran out of memory while profiling is infeasible though its predicted peak fits: with that
    micro-batch pinned, the error said no plan fits in 16 GiB and 'the closest ... needs 1.28 GiB'."""
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.strategies._auto_planning import choose_plan

    layer = LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=64 << 20, activation_bytes_per_sample=1e6, output_bytes_per_sample=1e4)
    profile = synthetic_profile([layer] * 4, micro_batch_sizes=(1, 2, 4), infeasible_micro_batch_sizes=(8,), device_memory_bytes=16 << 30)
    with pytest.raises(InfeasiblePlanError, match=r"^No plan for global batch 32 on 1 devices with the pins \{'micro_batch_size': 8\} fits in "
                       r"16.00 GiB per device \(usable 90%\); the closest, dp_ga dp=1 m=8 accumulate=4, fails because micro_batch_size 8 >= 8, "
                       r"which ran out of memory while profiling\. HINT: "):
        choose_plan(profile, world_size=1, global_batch_size=32, pins={"micro_batch_size": 8})


@pytest.mark.parametrize(
    ("limits", "reason"),
    [(dict(max_epochs=0), "max_epochs=0"), (dict(max_steps=0), "max_steps=0"), (dict(max_epochs=1, limit_train_batches=0), "limit_train_batches=0")],
)
def test_a_fit_that_trains_no_batch_is_neither_profiled_nor_planned(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      limits: dict[str, Any], reason: str) -> None:
    """Lightning's fit loop skips training when max_epochs=0, max_steps=0 or limit_train_batches=0 ("`Trainer.fit`
    stopped: `max_epochs=0` reached."); auto_plan and PlanningCallback profiled the model first all the same (1-3 s on
    this 3-layer MLP, minutes on a real model) and wrote profile.json and plan.json for a plan that never ran."""
    import logging

    from lightning_utilities.core import rank_zero

    from lightning_distplan import PlanningCallback

    caplog.set_level(logging.INFO, logger=rank_zero.log.name)  # where rank_zero_info writes
    for strategy, callbacks, who in ((AutoPlanStrategy(), [], "auto_plan"), ("auto", [PlanningCallback()], "PlanningCallback")):
        root = tmp_path / who
        trainer = L.Trainer(**trainer_kwargs(str(root), strategy=strategy, devices=1, callbacks=callbacks, **limits))
        trainer.fit(_small())
        assert trainer.global_step == 0
        assert not (root / "distplan").exists(), who  # nothing profiled, nothing written
        assert [m for m in caplog.messages if m.startswith(f"{who}: this fit trains no batch ({reason})")], caplog.messages
        if callbacks:
            assert callbacks[0].outcome is None
        else:
            assert trainer.strategy.plan is None and trainer.strategy.profile is None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_fit_resumed_where_its_limits_are_reached_is_neither_profiled_nor_planned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning restores a checkpoint's progress after the strategy's setup, where the plan is made: a fit resumed
    from the end of its last epoch (a plain checkpoint, no plan in it) skips training ("`max_epochs=1` reached"), and
    auto_plan and PlanningCallback profiled and planned it all the same (2-5 s here, a ranked table and plan.json)."""
    import logging

    from lightning_utilities.core import rank_zero

    from lightning_distplan import PlanningCallback

    caplog.set_level(logging.INFO, logger=rank_zero.log.name)
    first = L.Trainer(**trainer_kwargs(str(tmp_path / "plain"), devices=1, max_epochs=1))
    first.fit(_small())
    ckpt = str(tmp_path / "end-of-epoch-1.ckpt")
    first.save_checkpoint(ckpt)
    for strategy, callbacks, who in ((AutoPlanStrategy(), [], "auto_plan"), ("auto", [PlanningCallback()], "PlanningCallback")):
        root = tmp_path / who
        trainer = L.Trainer(**trainer_kwargs(str(root), strategy=strategy, devices=1, callbacks=callbacks, max_epochs=1))
        trainer.fit(_small(), ckpt_path=ckpt)
        assert trainer.global_step == first.global_step  # restored, and nothing trained
        assert not (root / "distplan").exists(), who
        assert [m for m in caplog.messages if m.startswith(f"{who}: this fit trains no batch (max_epochs=1")], caplog.messages
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # one more epoch to go: planned as any resumed fit
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path / "more"), strategy=AutoPlanStrategy(), devices=1, max_epochs=2))
    trainer.fit(_small(), ckpt_path=ckpt)
    assert trainer.global_step == 2 * first.global_step and trainer.strategy.plan is not None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _two_rows_per_sample(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor]:
    """A collate_fn making two rows of each sample (an augmentation's two views): batches of 4 indices hold 8 rows."""
    x = torch.stack([s[0] for s in samples])
    return (torch.cat([x, x]),)


def test_a_pipeline_loader_refuses_batches_holding_more_rows_than_the_samples_it_counted() -> None:
    """A pipeline's loader counts its steps (``__len__``, where Lightning stops) from the sampler's samples: 20 in
    batches of 4 whose collate_fn makes two rows of each (40 rows), steps of 8, were counted as 2 steps, and Lightning
    ended the epoch after 16 of the 40 rows (DDP trains them all; the shortfall said 4), without a word. Refused now,
    by dp_ga's rule, where the rows overflow the count, also where they would first overflow past the counted steps
    (the loader's rest is read before the last one); a batch sampler exceeding its batch size under a limit of loader
    batches likewise. Legitimate loaders (a short last batch, drop_last, batches of varying sizes that fill the count,
    a batch sampler whose length overstates its batches, a sampler of fewer samples than the dataset) run as before."""
    import itertools

    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from lightning_distplan.strategies._auto_concrete import _FullBatchLoader

    data = TensorDataset(torch.arange(20.0).view(20, 1))

    class Batches:
        """A batch sampler of its own sizes over the 20 samples, saying ``length`` batches."""

        def __init__(self, sizes: list[int], length: int | None = None) -> None:
            self.sizes, self.length, self.batch_size, self.drop_last, self.sampler = sizes, length, 8, False, range(20)

        def __iter__(self) -> Iterator[list[int]]:
            ends = list(itertools.accumulate(self.sizes))
            return iter([list(range(end - k, end)) for k, end in zip(self.sizes, ends)])

        def __len__(self) -> int:
            return self.length or len(self.sizes)

    def pulled(loader: DataLoader, step: int, limit: int | None = None) -> list[int]:
        wrapped = _FullBatchLoader(loader, step, limit_batches=limit)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the shortfall)
            return [len(b[0]) for b in itertools.islice(wrapped, len(wrapped))]  # as Lightning pulls them: __len__ of them

    for step, refused in ((8, r"first 3 batches of the epoch hold 24 samples.* counts the epoch's 5 batches as the 20 samples its "
                              r"sampler holds \(2 pipeline steps of 8\), so the epoch would end before its last samples"),
                          (16, r"first 3 batches .* hold 24 samples.*\(1 pipeline steps of 16\)")):
        with pytest.raises(InfeasiblePlanError, match=r"auto_plan's pipeline counts .*" if step == 16 else refused):
            pulled(DataLoader(data, batch_size=4, collate_fn=_two_rows_per_sample), step)
    with pytest.raises(InfeasiblePlanError, match=r"counts the epoch's 2 batches as at most 8 samples each .*HINT: Use a batch sampler "
                       r"whose batches hold at most its `batch_size` samples, or strategy='ddp'"):
        pulled(DataLoader(data, batch_sampler=Batches([12, 8], length=3)), 8, limit=2)
    with pytest.raises(InfeasiblePlanError, match=r"HINT: Use a collate_fn \(and batch sampler\) making one row of each of the "
                       r"sampler's samples, or strategy='ddp'\."):
        pulled(DataLoader(data, batch_size=8, collate_fn=_two_rows_per_sample), 8)
    legitimate = {"short last batch": DataLoader(data, batch_size=8), "drop_last": DataLoader(data, batch_size=8, drop_last=True),
                  "12, 4, 4": DataLoader(data, batch_sampler=Batches([12, 4, 4])),
                  "4, 4, 12": DataLoader(data, batch_sampler=Batches([4, 4, 12])),
                  "12, 8 said as 3": DataLoader(data, batch_sampler=Batches([12, 8], length=3)),
                  "12 of 20 drawn": DataLoader(data, batch_size=4, sampler=RandomSampler(data, num_samples=12))}
    for name, loader in legitimate.items():
        assert pulled(loader, 4) == [4] * (len(loader.sampler) // 4 if name == "12 of 20 drawn" else 4 if name == "drop_last" else 5), name
        assert pulled(loader, 8) == [8] * (1 if name == "12 of 20 drawn" else 2), name


def test_the_logged_plan_never_prints_a_nonzero_step_time_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    """log_outcome printed the predicted step time as ms with 2 decimals: a step under 5 µs (a tiny model) read
    "predicted 0.00 ms/step". Below 1 ms it prints 3 significant figures; from 1 ms up, 2 decimals as before."""
    import dataclasses

    from lightning_utilities.core import rank_zero

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans
    from lightning_distplan.strategies._auto_planning import PlanningOutcome, log_outcome

    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=1 << 20)] * 2)
    ranked = rank_plans(profile, world_size=1, global_batch_size=4, hardware=Hardware.from_profile(profile, warn_default_links=False),
                        strategies=("dp_ga",))
    caplog.set_level(logging.INFO, logger=rank_zero.log.name)  # where rank_zero_info writes
    for step_s, printed in ((4.2e-6, "0.00420"), (1.23456e-4, "0.123"), (9.99e-4, "0.999"), (0.0123456, "12.35"), (1.5, "1500.00")):
        win = dataclasses.replace(ranked[0], prediction=dataclasses.replace(ranked[0].prediction, step_time_s=step_s))
        caplog.clear()
        log_outcome(PlanningOutcome(plan=win.plan, candidates=(win, *ranked[1:])), prefix="auto_plan")
        first = caplog.messages[0].splitlines()[0]
        assert f", predicted {printed} ms/step, peak " in first, first
