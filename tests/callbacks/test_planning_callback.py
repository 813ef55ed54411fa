"""PlanningCallback (single process; the 2-rank DDP run is in tests/strategies/test_auto_plan_real_models.py)
and the StepTimeMonitor's argument checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_distplan import InfeasiblePlanError
from lightning_distplan.callbacks import PlanningCallback, StepTimeMonitor
from lightning_distplan.callbacks.planning import alternative_message, rank_micro_batching
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.profile import LinkProfile
from lightning_distplan.strategies import DPGAStrategy


class Net(L.LightningModule):
    def __init__(self, loader_batch: int = 16) -> None:
        super().__init__()
        self.loader_batch = loader_batch
        torch.manual_seed(7)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.loader_batch, shuffle=True)


class Sizes(L.Callback):
    """Micro-batch sizes the fit loop really runs (profiling calls training_step directly, not through the loop)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.sizes.append(batch[0].shape[0])


def _kwargs(tmp: Path, **kw: Any) -> dict[str, Any]:
    return dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp), **kw,
    )


def test_callback_applies_plan_same_math_and_restores(tmp_path: Path) -> None:
    """Micro-batch 4 x accumulation 4 from a loader of 16 == a plain run with loader 4 and
    accumulate_grad_batches=4, bit for bit: profiling left weights, RNG (dropout, shuffling) alone."""
    model = Net(loader_batch=16)
    callback, sizes = PlanningCallback(micro_batch_size=4), Sizes()
    trainer = L.Trainer(**_kwargs(tmp_path, max_steps=3, callbacks=[callback, sizes]))
    trainer.fit(model)
    plan = callback.plan
    assert (plan.strategy, plan.dp, plan.micro_batch_size, plan.accumulate_grad_batches, plan.global_batch_size) == ("dp_ga", 1, 4, 4, 16)
    assert sizes.sizes == [4] * 12
    assert trainer.accumulate_grad_batches == 1  # restored at teardown
    assert "process_dataloader" not in trainer.strategy.__dict__
    assert callback.overhead_s is not None and 0 < callback.overhead_s < callback.run_s

    reference = Net(loader_batch=4)
    L.Trainer(**_kwargs(tmp_path / "ref", max_steps=3, accumulate_grad_batches=4)).fit(reference)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)

    data = json.loads((tmp_path / "distplan" / "plan.json").read_text())
    assert data["plan"]["micro_batch_size"] == 4 and data["running_strategy"] == "SingleDeviceStrategy"
    assert (tmp_path / "distplan" / "profile.json").is_file()


class _FailsOnce(Net):
    failed = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not _FailsOnce.failed and self.global_step == 1:
            _FailsOnce.failed = True
            raise RuntimeError("a failure in the fit")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_fails_puts_the_trainer_back_and_a_fit_again_plans_for_the_same_global_batch(tmp_path: Path) -> None:
    """Lightning calls on_exception, not teardown, after a failure: the Trainer kept the plan's accumulation (4 where the
    user gave 2) and the strategy's wrapped methods, so fitting it again (a notebook after an error or Ctrl-C) planned for
    a global batch of 8 x 4 = 32 (micro-batches of 4, accumulation 8) where the user's is 8 x 2 = 16."""
    callback = PlanningCallback(micro_batch_size=4)
    trainer = L.Trainer(**_kwargs(tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=[callback]))
    with pytest.raises(RuntimeError, match="a failure in the fit"):
        trainer.fit(_FailsOnce(loader_batch=8))
    assert trainer.accumulate_grad_batches == 2
    assert not {"process_dataloader", "on_train_batch_start", "training_step", "setup"} & set(vars(trainer.strategy))
    trainer.fit(_FailsOnce(loader_batch=8))
    assert (callback.plan.micro_batch_size, callback.plan.accumulate_grad_batches, callback.plan.global_batch_size) == (4, 4, 16)
    assert trainer.global_step == 3 and trainer.accumulate_grad_batches == 2


class _ReadOnlyStep(SingleDeviceStrategy):
    """A user's strategy whose training_step cannot be replaced on the instance (a property without a setter)."""

    @property
    def training_step(self) -> Any:
        return super().training_step


class _FailAtPlanLine(logging.Filter):
    """Raises at the log line apply_dp_ga_plan writes after its last change, as a Ctrl-C there would."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "PlanningCallback: running micro-batches" in record.getMessage():
            raise RuntimeError("stopped after the plan was applied")
        return True


def test_a_plan_that_fails_part_way_through_applying_leaves_nothing_changed(tmp_path: Path) -> None:
    """apply_dp_ga_plan changes the strategy's methods one by one, then the Trainer's accumulate_grad_batches; failing
    part-way, it returned no AppliedPlan to restore, so the failed fit left the wrapped on_train_batch_start on a
    strategy whose training_step cannot be set, and the plan's accumulation (4 where the user gave 2) and all three
    wrapped methods where it failed after the last change."""
    from lightning_utilities.core import rank_zero

    for strategy, found, fail_at_log in ((_ReadOnlyStep(torch.device("cpu")), "has no setter", False),
                                         (None, "stopped after the plan was applied", True)):
        trainer = L.Trainer(**_kwargs(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[PlanningCallback(micro_batch_size=4)],
                                      **({"strategy": strategy} if strategy is not None else {})))
        fail = _FailAtPlanLine()
        level = rank_zero.log.level
        if fail_at_log:
            rank_zero.log.addFilter(fail)
            rank_zero.log.setLevel(logging.INFO)  # the line reaches the filter whatever level another test left above it
        try:
            with pytest.raises((AttributeError, RuntimeError), match=found):
                trainer.fit(Net(loader_batch=8))
        finally:
            rank_zero.log.removeFilter(fail)
            rank_zero.log.setLevel(level)
        assert trainer.accumulate_grad_batches == 2
        assert not {"process_dataloader", "on_train_batch_start", "training_step", "setup"} & set(vars(trainer.strategy))


class _UnusedHead(Net):
    def __init__(self) -> None:
        super().__init__()
        self.aux_head = nn.Linear(8, 2)  # used by no loss (say, predict_step only)


def test_a_ddp_strategy_that_would_refuse_parameters_the_loss_does_not_use_is_warned_about(tmp_path: Path) -> None:
    """The callback keeps the user's strategy: under DDP without find_unused_parameters the profile's unused
    parameters get a warning with the strategy that trains them before the step that fails; none where DDP is told."""
    import warnings

    with pytest.warns(UserWarning, match=r"PlanningCallback: training_step's loss gives no gradient to 2 trainable parameter\(s\) "
                      r"\(aux_head.weight, aux_head.bias\), which DDPStrategy's .* HINT: Use strategy='ddp_find_unused_parameters_true'"):
        L.Trainer(**_kwargs(tmp_path / "ddp", strategy="ddp", max_steps=1, callbacks=[PlanningCallback(micro_batch_size=4)])).fit(_UnusedHead())
    torch.distributed.destroy_process_group()
    for strategy in ("ddp_find_unused_parameters_true", "auto"):  # DDP told, and no DDP at all
        trainer = L.Trainer(**_kwargs(tmp_path / strategy, strategy=strategy, max_steps=2, callbacks=[PlanningCallback(micro_batch_size=4)]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_UnusedHead())
        assert not [w for w in caught if "no gradient" in str(w.message)] and trainer.global_step == 2
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_reloaded_loaders_draw_the_random_stream_as_the_plain_run_does(tmp_path: Path) -> None:
    """With reload_dataloaders_every_n_epochs=1 Lightning calls iter() on the train loader twice per epoch and drops
    the first; each DataLoader iterator draws a seed from the global random stream when it is made. The micro-batch
    loader makes its loader's iterator when iter() is called, so shuffling and dropout follow the plain run's, bit
    for bit, over three epochs (they parted from the second epoch when it made it at the first batch)."""
    model = Net(loader_batch=16)
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=1, callbacks=[PlanningCallback(micro_batch_size=4)]))
    trainer.fit(model)
    reference = Net(loader_batch=4)
    L.Trainer(**_kwargs(tmp_path / "ref", max_epochs=3, reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=4)).fit(reference)
    assert trainer.global_step == 24
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)


class GrowingNet(Net):
    """A batch-size warm-up: the train loader's batch doubles every epoch (reload_dataloaders_every_n_epochs=1)."""

    def train_dataloader(self) -> DataLoader:
        self.loader_batch = 16 * 2**self.current_epoch
        return super().train_dataloader()


def test_a_loader_reloaded_with_another_batch_size_is_refused_not_run_at_the_old_global_batch(tmp_path: Path) -> None:
    """The plan's micro-batches and accumulation were kept for a loader reloaded with batches of 32: the fit stepped every
    16 samples where the run without the callback steps every 32 (no word said). Refused at the reload now; a reload of
    the same batch size runs on (the test above)."""
    model = GrowingNet()
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1, callbacks=[PlanningCallback(micro_batch_size=4)]))
    with pytest.raises(InfeasiblePlanError, match=r"loaded again during the fit with batches of 32, where its first batches were 16.*"
                                                  r"global batch of 16.*HINT: Keep the train loader's batch size fixed"):
        trainer.fit(model)
    assert trainer.global_step == 8  # epoch 0 as planned (8 steps of 16 samples), nothing of epoch 1


class GrowingOneCycleNet(GrowingNet):
    """GrowingNet sizing its schedule with trainer.estimated_stepping_batches: Lightning loads the train loader before it
    restores a resumed fit's loops (the first epoch's batches), and again at the resumed epoch."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total), "interval": "step"}}


def test_a_refused_reloaded_loader_leaves_a_resumed_fits_progress_in_loader_batches(tmp_path: Path) -> None:
    """Resumed at epoch 1, whose loader (batches of 32) is refused after the first one (16): the refusal is raised once the
    loader is wrapped (so every rank makes the same collectives), and that wrap had already counted the trainer's restored
    progress in the refused loader's micro-batches (8 loader batches of 16 as 64 micro-batches of 4 of 32); an
    OnExceptionCheckpoint then saved 64, unmarked, which a fit resumed from it reads as loader batches. It keeps the 8."""
    kw = {**_kwargs(tmp_path), "enable_checkpointing": True, "reload_dataloaders_every_n_epochs": 1}
    L.Trainer(**{**kw, "max_epochs": 1, "callbacks": [PlanningCallback(micro_batch_size=4), ModelCheckpoint(str(tmp_path / "c"), save_last=True)]}).fit(GrowingOneCycleNet())
    trainer = L.Trainer(**{**kw, "max_epochs": 2, "callbacks": [PlanningCallback(micro_batch_size=4), OnExceptionCheckpoint(str(tmp_path))]})
    with pytest.raises(InfeasiblePlanError, match=r"loaded again during the fit with batches of 32, where its first batches were 16"):
        trainer.fit(GrowingOneCycleNet(), ckpt_path=str(tmp_path / "c" / "last.ckpt"))
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert saved == {"ready": 8, "completed": 8, "started": 8, "processed": 8}, saved


class OneCycleNet(Net):
    """Sizes OneCycleLR with trainer.estimated_stepping_batches, as Lightning's docs show."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=total), "interval": "step"}}


def test_callback_plan_holds_when_configure_optimizers_reads_estimated_stepping_batches(tmp_path: Path) -> None:
    """That property makes the fit loop build (and cache) the train loader while the profiler calls
    configure_optimizers, before the plan re-chunks it: the plan must still run, micro-batches and all."""
    model = OneCycleNet(loader_batch=16)
    callback, sizes = PlanningCallback(micro_batch_size=4), Sizes()
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=1, callbacks=[callback, sizes]))
    trainer.fit(model)
    assert callback.plan.accumulate_grad_batches == 4
    assert sizes.sizes == [4] * 32 and trainer.global_step == 8  # 128 samples, 16 per optimizer step

    reference = OneCycleNet(loader_batch=4)
    L.Trainer(**_kwargs(tmp_path / "ref", max_epochs=1, accumulate_grad_batches=4)).fit(reference)
    torch.testing.assert_close(model.state_dict(), reference.state_dict())


def test_fractional_batch_limits_count_the_users_loader_batches(tmp_path: Path) -> None:
    """limit_train_batches=0.5 is half of the user's loader batches (4 of 8 = 4 steps), not half of the
    micro-batches Lightning sees (16 of 32 = 4 steps only by luck of m; with 0.3: 2 vs 2.4 loader batches)."""
    from types import SimpleNamespace

    from lightning_distplan.strategies.dp_ga import _in_loader_batches

    model = Net(loader_batch=16)
    callback, sizes = PlanningCallback(micro_batch_size=4), Sizes()
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=1, limit_train_batches=0.3, callbacks=[callback, sizes]))
    trainer.fit(model)
    assert sizes.sizes == [4] * 8 and trainer.global_step == 2  # int(8 * 0.3) = 2 loader batches of 16
    assert trainer.limit_train_batches == 0.3  # restored
    reference = Net(loader_batch=4)
    L.Trainer(**_kwargs(tmp_path / "ref", max_epochs=1, limit_train_batches=8, accumulate_grad_batches=4)).fit(reference)
    torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=0, atol=0)

    # validation every half epoch of 3 loader batches: every int(3 * 0.5) = 1 loader batch, as under DDP
    def fake(limit, interval):
        return SimpleNamespace(limit_train_batches=limit, val_check_interval=interval)

    assert _in_loader_batches(fake(1.0, 0.5), range(3), 1) == (None, 1)
    assert _in_loader_batches(fake(0.5, 0.5), range(8), 1) == (4, 2)
    assert _in_loader_batches(fake(2, 1), range(8), 2) == (4, 2)  # counts per process, two processes per replica
    assert _in_loader_batches(fake(0.1, 1.0), range(8), 1) == (None, None)  # zero batches: Lightning refuses it itself
    assert _in_loader_batches(fake(0.5, 0.5), iter(()), 1) == (None, None)  # no length: nothing to convert
    # A pipeline replica of 2 stages reads 2 processes' shards: 6 batches where a DDP process has 3. Fractions are
    # rounded in one process's batches, as under DDP (every int(3 * 0.5) = 1 of them = 2 of the replica's; rounding
    # the replica's 6 gave every 3, so validations fell at other steps than DDP's).
    assert _in_loader_batches(fake(1.0, 0.5), range(6), 2) == (None, 2)
    assert _in_loader_batches(fake(0.5, 0.5), range(6), 2) == (2, 2)  # int(3 * 0.5) = 1 process batch, validate every 1
    assert _in_loader_batches(fake(0.6, 1.0), range(7), 2) == (4, None)  # 7 replica batches: 4 per process (ceil), int(2.4) = 2 of them


class TailNet(Net):
    """120 samples in batches of 16 (the last holds 8), no dropout."""

    def __init__(self, loader_batch: int = 16) -> None:
        super().__init__(loader_batch)
        self.net[2] = nn.Identity()

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(TensorDataset(*loader.dataset[:120]), batch_size=self.loader_batch, shuffle=True)


def test_callback_keeps_the_short_last_batch_and_batch_limits(tmp_path: Path) -> None:
    """Micro-batches of 4 from a loader of 16 whose last batch holds 8 give the plain run's weights;
    limit_train_batches=3 still means three loader batches."""
    for extra in ({"max_epochs": 2}, {"max_epochs": 1, "limit_train_batches": 3}):
        model, sizes = TailNet(), Sizes()
        trainer = L.Trainer(**_kwargs(tmp_path, callbacks=[PlanningCallback(micro_batch_size=4), sizes], **extra))
        trainer.fit(model)
        reference = TailNet()
        ref_trainer = L.Trainer(**_kwargs(tmp_path / "ref", **extra))
        ref_trainer.fit(reference)
        assert trainer.global_step == ref_trainer.global_step == (16 if "limit_train_batches" not in extra else 3)
        assert sum(sizes.sizes) == 120 * 2 if "limit_train_batches" not in extra else 3 * 16
        torch.testing.assert_close(model.state_dict(), reference.state_dict(), rtol=1e-5, atol=1e-6)
        assert trainer.limit_train_batches == extra.get("limit_train_batches", 1.0)  # restored at teardown
        assert not {"process_dataloader", "training_step", "on_train_batch_start"} & set(trainer.strategy.__dict__)


def test_callback_mid_epoch_checkpoint_resumes_at_the_same_place_with_or_without_it(tmp_path: Path) -> None:
    """A checkpoint at step 3 of 8 counts 3 loader batches (not 12 micro-batches): both resumes end epoch 0 at step 8."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, filename="mid")
    L.Trainer(**{**_kwargs(tmp_path, max_steps=3, callbacks=[PlanningCallback(micro_batch_size=4), every]), "enable_checkpointing": True}).fit(Net())
    mid = str(tmp_path / "ck" / "mid.ckpt")
    saved = torch.load(mid, weights_only=False)
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 3
    # the plan that ran is in the checkpoint (DESIGN §3.5), with what it was made for
    assert (saved["distplan_plan"]["micro_batch_size"], saved["distplan_plan"]["accumulate_grad_batches"]) == (4, 4)
    assert saved["distplan_plan_context"]["precision"] == "32-true" and saved["distplan_plan_context"]["memory_limit_bytes"] > 0
    states = []
    for callbacks in ([PlanningCallback(micro_batch_size=4)], [PlanningCallback()], []):
        model = Net()
        trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=1, callbacks=callbacks))
        trainer.fit(model, ckpt_path=mid)
        assert trainer.global_step == 8, callbacks
        if callbacks:  # resumed with the checkpoint's plan, not profiled and planned again
            assert callbacks[0].outcome.source == "checkpoint" and callbacks[0].plan.micro_batch_size == 4
        states.append(model.state_dict())
    torch.testing.assert_close(states[0], states[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states[1], states[2], rtol=1e-5, atol=1e-6)
    # a pin the checkpoint's plan breaks: planned again
    other = PlanningCallback(micro_batch_size=2)
    L.Trainer(**_kwargs(tmp_path, max_epochs=1, callbacks=[other])).fit(Net(), ckpt_path=mid)
    assert other.outcome.source == "profiled" and other.plan.micro_batch_size == 2


def test_a_step_time_monitor_beside_the_callback_sets_the_steps_beside_its_prediction(tmp_path: Path) -> None:
    """The callback's plan comes with a prediction: a StepTimeMonitor logs it beside the observed steps (it logged the
    observed time only), and says that it re-plans under auto_plan only."""
    import warnings

    callback, monitor = PlanningCallback(micro_batch_size=4), StepTimeMonitor(replan="auto", warmup_steps=0)
    trainer = L.Trainer(**_kwargs(tmp_path, max_steps=3, callbacks=[callback, monitor]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net())
    predicted = callback.outcome.prediction.step_time_s
    assert [h["predicted_s"] for h in monitor.history] == [predicted] * 3 and monitor.replans == []
    ratios = [h["observed_s"] / predicted for h in monitor.history]
    assert monitor.summary.predicted_s == predicted and monitor.summary.mean_observed_over_predicted == pytest.approx(sum(ratios) / 3)
    assert trainer.logged_metrics["distplan/predicted_step_time_s"] == pytest.approx(predicted)
    assert [w for w in caught if "re-plans under strategy='auto_plan' only" in str(w.message)]


def test_callback_apply_false_only_reports(tmp_path: Path) -> None:
    model = Net(loader_batch=16)
    callback, sizes = PlanningCallback(micro_batch_size=2, apply=False), Sizes()
    L.Trainer(**_kwargs(tmp_path, max_steps=2, callbacks=[callback, sizes])).fit(model)
    assert callback.plan.micro_batch_size == 2 and sizes.sizes == [16, 16]


def test_callback_refuses_conflicting_setups(tmp_path: Path) -> None:
    with pytest.raises(InfeasiblePlanError, match="GradientAccumulationScheduler.*HINT"):
        L.Trainer(**_kwargs(tmp_path, max_steps=1, callbacks=[PlanningCallback(), GradientAccumulationScheduler({0: 2})])).fit(Net())
    with pytest.raises(InfeasiblePlanError, match="micro_batch_size"):
        PlanningCallback(micro_batch_size=0)
    # BatchSizeFinder changes the loader's batch after the plan was made: the global batch silently doubled (8 -> 16 x 2)
    class Sized(Net):  # the finder's field
        def __init__(self) -> None:
            super().__init__(loader_batch=8)
            self.batch_size = 8

        def train_dataloader(self) -> DataLoader:
            self.loader_batch = self.batch_size
            return super().train_dataloader()

    with pytest.raises(InfeasiblePlanError, match="then changes.*HINT: Find the batch size in a fit without the callback"):
        L.Trainer(**_kwargs(tmp_path, max_steps=1, callbacks=[PlanningCallback(), BatchSizeFinder(max_trials=1)])).fit(Sized())
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    # Under a pipeline it planned data parallel for another global batch; under auto_plan its accumulation was read as
    # the user's (4 steps of 16 became 1 of 64). Each refused before anything trains.
    for strategy in (DPGAStrategy(), AutoPlanStrategy(), PipelineStrategy(stages=2)):
        model = Net()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = L.Trainer(**_kwargs(tmp_path, max_steps=1, strategy=strategy, callbacks=[PlanningCallback()]))
        try:
            with pytest.raises(InfeasiblePlanError, match=f"re-plan under {type(strategy).__name__}, which sets the micro-batches.*HINT: Drop"):
                trainer.fit(model)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        assert trainer.global_step == 0 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_report_names_a_faster_pipeline_without_forcing_it() -> None:
    """Large gradients over a slow link: all-reduce dominates DP; a 2-stage pipeline sends only small activations."""
    layers = [LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=200 << 20, activation_bytes_per_sample=1e3, output_bytes_per_sample=1e3)] * 4
    slow = 100e6  # 100 MB/s
    links = (
        LinkProfile(kind="allreduce", backend="gloo", world_size=2, latency_s=1e-4, bandwidth_bytes_per_s=slow),
        LinkProfile(kind="p2p", backend="gloo", world_size=2, latency_s=1e-4, bandwidth_bytes_per_s=slow),
    )
    profile = synthetic_profile(layers, links=links, device_memory_bytes=64 << 30)
    dp, hardware, alternative = rank_micro_batching(profile, world_size=2, global_batch_size=32)
    assert all(c.plan.strategy == "dp_ga" for c in dp)
    assert alternative is not None
    cand, speedup = alternative
    assert cand.plan.pp == 2 and speedup > 1.05
    assert speedup == pytest.approx(dp[0].prediction.step_time_s / cand.prediction.step_time_s)
    message = alternative_message(alternative)
    assert message.startswith(f"{cand.plan.strategy} with 2 stages") and message.endswith("faster: use strategy='auto_plan'")
    # no faster alternative when the link is fast and the model small
    fast = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=1 << 10, activation_bytes_per_sample=1e6, output_bytes_per_sample=1e6)] * 4)
    assert rank_micro_batching(fast, world_size=2, global_batch_size=32)[2] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replan": "on"}, "`replan`"), ({"threshold": 1.0}, "`threshold` must be a number above 1, got 1.0"),
        ({"window": 0}, "`window` must be a positive integer, got 0"), ({"threshold": "2"}, "`threshold` must be a number above 1, got '2'"),
        ({"threshold": None}, "`threshold` must be a number above 1, got None"),
        ({"threshold": float("nan")}, "`threshold` must be a number above 1, got nan"), ({"warmup_steps": True}, "`warmup_steps` must be an integer >= 0, got True"),
        ({"history_size": 0}, "`history_size` must be a positive integer or None, got 0"),
        ({"history_size": -1}, "`history_size` must be a positive integer or None, got -1"),
        ({"history_size": 2.5}, "`history_size` must be a positive integer or None, got 2.5"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InfeasiblePlanError, match=f"^{match}.*HINT: "):
        StepTimeMonitor(**kwargs)


def test_monitor_history_size_error_names_none_for_every_step() -> None:
    """0 and -1 mean "no limit" elsewhere (Lightning's max_steps=-1); here None does, and the error must say so (it read
    "must be a positive integer ... HINT: Pass e.g. history_size=2")."""
    with pytest.raises(ValueError, match=r"got -1\. HINT: .*history_size=None to keep every step"):
        StepTimeMonitor(history_size=-1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_memory_bytes": "8GB"}, "`device_memory_bytes` must be a positive number of bytes, got '8GB'"),
        ({"device_memory_bytes": -5}, "`device_memory_bytes` must be a positive number of bytes, got -5"),
        ({"profile_repeats": "auto"}, "`profile_repeats` must be a positive integer, got 'auto'"),
        ({"apply": "no"}, "`apply` must be True or False, got 'no'"),
        ({"micro_batch_size": 0}, "`micro_batch_size` must be a positive integer or 'auto', got 0"),
    ],
)
def test_callback_rejects_bad_arguments_before_the_fit(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InfeasiblePlanError, match=f"^{match}.*HINT: "):
        PlanningCallback(**kwargs)


class LateNet(L.LightningModule):
    """Builds its layers in configure_model() and its data in setup(), as Lightning allows (both run after the
    callbacks' setup hook)."""

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            torch.manual_seed(7)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        self.train_set = TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)


def test_callback_plans_after_the_modules_setup_and_configure_model(tmp_path: Path) -> None:
    callback, sizes = PlanningCallback(micro_batch_size=4), Sizes()
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=1, callbacks=[callback, sizes]))
    trainer.fit(LateNet())
    assert callback.plan.micro_batch_size == 4 and sizes.sizes == [4] * 16 and trainer.global_step == 4
    assert "setup" not in trainer.strategy.__dict__  # the strategy's own setup again


def test_callback_leaves_a_loader_without_a_batch_size_as_it_is_and_refuses_several_loaders(tmp_path: Path) -> None:
    """Ready-made batches (batch_size=None): no global batch to plan for, so the fit runs as is, with a warning
    (the HINT used to name a global_batch_size= the callback does not take). Several train loaders: refused, since
    training_step gets their combined batch and profiling one loader would call it with another structure."""
    g = torch.Generator().manual_seed(0)
    batches = [(x, x.sum(1, keepdim=True)) for x in torch.randn(4, 8, 8, generator=g)]
    callback, sizes = PlanningCallback(), Sizes()
    trainer = L.Trainer(**_kwargs(tmp_path, max_epochs=1, callbacks=[callback, sizes]))
    with pytest.warns(UserWarning, match="batch size cannot be read.*runs your loader as it is"):
        trainer.fit(Net(), DataLoader(batches, batch_size=None))
    assert callback.plan is None and sizes.sizes == [8] * 4 and trainer.global_step == 4
    assert callback.overhead_s is None
    loader = Net(loader_batch=8).train_dataloader()
    with pytest.raises(InfeasiblePlanError, match="dict of train dataloaders.*HINT"):
        L.Trainer(**_kwargs(tmp_path, max_steps=1, callbacks=[PlanningCallback()])).fit(Net(), {"a": loader, "b": loader})


def test_a_callback_used_again_reports_only_the_fit_it_planned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same callback in a second fit that it does not plan (a loader without a batch size): no plan, no overhead,
    no 'planning overhead' line. It kept the first fit's plan as `callback.plan` and logged that fit's profiling time
    as a share of the second ("1.66 s = 3735.1% of this fit (0.0 s)")."""
    import logging

    from lightning_utilities.core import rank_zero

    callback = PlanningCallback(micro_batch_size=4)
    caplog.set_level(logging.INFO, logger=rank_zero.log.name)  # where rank_zero_info writes
    L.Trainer(**_kwargs(tmp_path / "first", max_steps=1, callbacks=[callback])).fit(Net())
    assert callback.plan is not None and callback.overhead_s is not None
    assert [r for r in caplog.messages if "planning overhead" in r and "of this fit" in r]
    caplog.clear()
    g = torch.Generator().manual_seed(0)
    batches = [(x, x.sum(1, keepdim=True)) for x in torch.randn(2, 8, 8, generator=g)]
    with pytest.warns(UserWarning, match="batch size cannot be read"):
        L.Trainer(**_kwargs(tmp_path / "second", max_steps=2, callbacks=[callback])).fit(Net(), DataLoader(batches, batch_size=None))
    assert callback.plan is None and callback.outcome is None and callback.alternative is None
    assert callback.overhead_s is None and callback.run_s is None
    assert not [r for r in caplog.messages if "planning overhead" in r], caplog.messages
