"""auto_plan on 2 real gloo ranks: picks dp_ga / a pipeline, matches the chosen strategy run directly,
leaves no trace, resumes under the stored plan without profiling.

All distributed scenarios run in ONE pair of spawned processes (module-scoped fixture): starting
Python + torch + Lightning costs far more than the tiny fits on this shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _auto_plan_models import ChainMLP, LossRecorder, full_state, trainer_kwargs
from _dist_utils import error_of, run_on_ranks

from lightning_distplan import Plan
from lightning_distplan.costmodel import Hardware, predict
from lightning_distplan.planner import enumerate_plans
from lightning_distplan.profiling import profile_module

# Wide enough that compute, not per-call overhead or the all-reduce latency, sets the step time: with
# width 64 the DP and pipeline predictions were within noise of each other and the pick could flip.
DP_MODEL = dict(width=384, depth=4, n_samples=1536, loader_batch=128, dropout=0.1)
PP_MODEL = dict(width=256, depth=4, n_samples=64, loader_batch=4, dropout=0.1)
STEPS = 4


class ValidatedChainMLP(ChainMLP):
    """ChainMLP with a validation loader of 32 samples in batches of 4."""

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        from _auto_plan_models import regression_data

        return torch.utils.data.DataLoader(regression_data(32, seed=9), batch_size=4)


class ValidationSamples(L.Callback):
    """The validation batches this rank ran (outside the sanity check) and the samples in them."""

    def __init__(self) -> None:
        self.batches = self.samples = 0

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self.batches += 1
            self.samples += len(batch[0])


class ScheduledChainMLP(ChainMLP):
    """ChainMLP whose learning rate halves when Lightning steps its scheduler: every 4th of the epoch's batches."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 4}}


class SizedScheduledChainMLP(ScheduledChainMLP):
    """ScheduledChainMLP reading trainer.estimated_stepping_batches in configure_optimizers (as OneCycleLR is sized): the
    train loader is loaded before Lightning restores a resumed fit's loops."""

    def configure_optimizers(self) -> Any:
        assert self.trainer.estimated_stepping_batches > 0
        return super().configure_optimizers()


class StepRates(L.Callback):
    """The learning rate each optimizer step ran with, and the scheduler configs' frequencies after the fit."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.frequencies: list[int] = []
        self._step = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.frequencies = [c.frequency for c in trainer.strategy.lr_scheduler_configs]


BUSY_S = 0.6


class BusyAtStepEnd(L.Callback):
    """A user's callback working (sleeping BUSY_S) in on_train_batch_end, inside the step auto_plan's StepTimeMonitor
    times: the monitor is put after the user's callbacks."""

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(BUSY_S)


class ReloadedOnRank1(ChainMLP):
    """ChainMLP whose train loader, loaded again each epoch (reload_dataloaders_every_n_epochs=1), batches twice as many
    samples from epoch 1 on global rank 1 alone (a loader of each rank's own; :class:`ReloadedOnRank0`: rank 0's)."""

    grows_on = 1

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        from _auto_plan_models import regression_data

        grows = self.trainer.current_epoch >= 1 and torch.distributed.get_rank() == self.grows_on
        return torch.utils.data.DataLoader(regression_data(self.hparams.n_samples), batch_size=self.hparams.loader_batch * (2 if grows else 1))


class ReloadedOnRank0(ReloadedOnRank1):
    grows_on = 0


def _fit(model: L.LightningModule, tmp: str, strategy: Any, world: int, callbacks: tuple[L.Callback, ...] = (),
         **kw: Any) -> tuple[L.Trainer, LossRecorder]:
    rec = LossRecorder()
    trainer = L.Trainer(**trainer_kwargs(tmp, strategy=strategy, devices=world, callbacks=[rec, *callbacks], **kw))
    trainer.fit(model)
    return trainer, rec


def _scenarios(rank: int, world: int, root: str, pp_cap: int) -> dict[str, Any]:
    import lightning_distplan  # noqa: F401  (registers auto_plan)
    from lightning_distplan.strategies import DPGAStrategy
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    out: dict[str, Any] = {}
    # -- 1. dp_ga is best: auto_plan vs DPGAStrategy(plan=...) run directly ------------------------------
    tmp = os.path.join(root, "dp")
    t0 = time.perf_counter()
    auto, rec = _fit(ChainMLP(**DP_MODEL), tmp, "auto_plan", world, callbacks=(BusyAtStepEnd(),), max_steps=STEPS)
    out["dp_auto_s"] = time.perf_counter() - t0
    plan = auto.strategy.plan
    out["dp_plan"] = plan
    out["dp_strategy"] = type(auto.strategy).__name__
    out["dp_is_dpga"] = isinstance(auto.strategy, DPGAStrategy)
    out["dp_losses"] = rec.losses
    out["dp_state"] = full_state(auto)
    out["dp_monitor"] = [cb for cb in auto.callbacks if type(cb).__name__ == "StepTimeMonitor"][0].history
    ckpt = os.path.join(root, "dp_step4.ckpt")
    auto.save_checkpoint(ckpt)  # "killed" after 4 of 6 steps of the epoch
    direct, rec_d = _fit(ChainMLP(**DP_MODEL), os.path.join(root, "dp_direct"), DPGAStrategy(plan=plan), world, max_steps=STEPS)
    out["dp_direct_losses"] = rec_d.losses
    out["dp_direct_state"] = full_state(direct)

    # -- 2. resume: same plan, no profiling ---------------------------------------------------------------
    profile_json = Path(tmp) / "distplan" / "profile.json"
    mtime = profile_json.stat().st_mtime if rank == 0 else None
    rec_r = LossRecorder()
    strategy = lightning_distplan.strategies.auto_plan.AutoPlanStrategy()
    resumed = L.Trainer(**trainer_kwargs(tmp, strategy=strategy, devices=world, callbacks=[rec_r], max_steps=STEPS + 2))
    resumed.fit(ChainMLP(**DP_MODEL), ckpt_path=ckpt)
    out["resume_plan"] = resumed.strategy.plan
    out["resume_source"] = strategy.outcome.source
    out["resume_profile"] = strategy.profile
    out["resume_global_step"] = resumed.global_step
    out["resume_steps_run"] = len(rec_r.losses)
    out["resume_profile_untouched"] = rank != 0 or profile_json.stat().st_mtime == mtime

    # -- 3. a pipeline is best (DP does not fit the per-device memory cap) --------------------------------
    tmp = os.path.join(root, "pp")
    auto, rec = _fit(ChainMLP(**PP_MODEL), tmp, lightning_distplan.strategies.auto_plan.AutoPlanStrategy(device_memory_bytes=pp_cap), world, max_steps=STEPS)
    plan = auto.strategy.plan
    out["pp_plan"] = plan
    out["pp_is_pipeline"] = isinstance(auto.strategy, PipelineStrategy)
    out["pp_losses"] = rec.losses
    out["pp_state"] = full_state(auto)
    # Direct: the plan's per-replica batch straight from the loader.
    direct_model = ChainMLP(**{**PP_MODEL, "loader_batch": plan.global_batch_size // plan.dp})
    direct, rec_d = _fit(direct_model, os.path.join(root, "pp_direct"), PipelineStrategy(plan=plan), world, max_steps=STEPS)
    out["pp_direct_losses"] = rec_d.losses
    out["pp_direct_state"] = full_state(direct)
    # An integer limit_train_batches counts loader batches per process, as under DDP: 3 of them are
    # 3 optimizer steps here too, though the pipeline's replica (both processes) reads the whole data.
    pins = dict(strategy=plan.strategy, stages=plan.pp, profile_repeats=1)
    limited, _ = _fit(ChainMLP(**PP_MODEL), os.path.join(root, "pp_limit"), lightning_distplan.strategies.auto_plan.AutoPlanStrategy(**pins),
                      world, max_epochs=1, limit_train_batches=3)
    out["pp_limit"] = (limited.global_step, limited.limit_train_batches, isinstance(limited.strategy, PipelineStrategy))
    # An integer limit_val_batches likewise counts one process's batches: under DDP the 2 processes read 2 batches of
    # 4 each from shards of their own (16 samples); the pipeline's stages read their replica's batches together, so
    # 4 of them (it read 2: half DDP's validation set, and a different val_loss).
    seen = ValidationSamples()
    validated = L.Trainer(**trainer_kwargs(os.path.join(root, "pp_val"), strategy=lightning_distplan.strategies.auto_plan.AutoPlanStrategy(**pins),
                                           devices=world, callbacks=[seen], max_epochs=1, limit_train_batches=2, limit_val_batches=2))
    validated.fit(ValidatedChainMLP(**PP_MODEL))
    out["pp_val_limit"] = (seen.batches, seen.samples, validated.limit_val_batches, isinstance(validated.strategy, PipelineStrategy))
    # A short tail (70 = 8 pipeline steps of 8 + 6): auto_plan's loader drops it (with a warning); nothing refuses the epoch.
    tail, _ = _fit(ChainMLP(**{**PP_MODEL, "n_samples": 70}), os.path.join(root, "pp_tail"),
                   lightning_distplan.strategies.auto_plan.AutoPlanStrategy(**pins), world, max_epochs=1)
    out["pp_tail_steps"] = tail.global_step
    # A step scheduler with frequency 4 and the user's accumulate 2: under DDP step j ends with loader batch 2j, so the
    # scheduler steps after every second optimizer step; a pipeline step is one of Lightning's batches (it stepped every 4th).
    from lightning.pytorch.callbacks import ModelCheckpoint

    rates = {}
    mid_epoch = os.path.join(root, "sched_pp_ckpt")
    for name, strategy in (("ddp", "ddp"), ("pp", lightning_distplan.strategies.auto_plan.AutoPlanStrategy(**pins))):
        seen_rates = StepRates()
        saving = [ModelCheckpoint(dirpath=mid_epoch, filename="{step}", every_n_train_steps=2, save_top_k=-1)] if name == "pp" else []
        L.Trainer(**trainer_kwargs(os.path.join(root, f"sched_{name}"), strategy=strategy, devices=world, callbacks=[seen_rates, *saving],
                                   enable_checkpointing=bool(saving), max_epochs=1, accumulate_grad_batches=2)).fit(ScheduledChainMLP(**PP_MODEL))
        rates[name] = (seen_rates.rates, seen_rates.frequencies)
    out["pp_scheduler"] = rates
    # ... resumed from that fit's checkpoint after 2 of the epoch's 4 steps (the checkpoint's plan: nothing profiled), by a
    # module whose configure_optimizers reads trainer.estimated_stepping_batches: the resumed epoch has DDP's 2 steps left
    resumed = L.Trainer(**trainer_kwargs(os.path.join(root, "sched_pp_resumed"), strategy="auto_plan", devices=world, max_epochs=2,
                                         accumulate_grad_batches=2))
    resumed.fit(SizedScheduledChainMLP(**PP_MODEL), ckpt_path=os.path.join(mid_epoch, "step=2.ckpt"))
    out["pp_resumed"] = (resumed.global_step, isinstance(resumed.strategy, PipelineStrategy))

    # -- 4. a step scheduler under a given global batch, dp_ga and a pipeline (asserted in its own test) -------
    out["scheduler_given_batch"] = _scheduler_under_a_given_global_batch(rank, world, os.path.join(root, "scheduler_given_batch"))

    # -- 5. <default_root_dir>/distplan is a file: plan.json cannot be written ---------------------------
    blocked = os.path.join(root, "blocked")
    os.makedirs(blocked, exist_ok=True)
    if rank == 0:
        Path(blocked, "distplan").write_text("a file of the user's")
    t0 = time.perf_counter()
    trainer = L.Trainer(**trainer_kwargs(blocked, strategy="auto_plan", devices=world, max_steps=STEPS))
    try:
        trainer.fit(ChainMLP(**DP_MODEL))
        out["blocked"] = "trained"
    except ValueError as err:
        out["blocked"] = f"{type(err).__name__}: {err}"
    out["blocked_s"] = time.perf_counter() - t0
    out["blocked_file"] = Path(blocked, "distplan").read_text()

    # -- 6. rank 1's train loader loaded again with another batch size (PlanningCallback, auto_plan's dp_ga and pipeline) --
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_distplan import PlanningCallback
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    out["reloaded"] = {}
    waited = timedelta(seconds=30)  # a rank left waiting fails in 30 s, not the default 30 min
    for name, kw in (("callback", dict(strategy=DDPStrategy(timeout=waited), callbacks=[PlanningCallback(micro_batch_size=2)])),
                     ("dp_ga", dict(strategy=AutoPlanStrategy(strategy="dp_ga", micro_batch_size=2, profile_repeats=1, timeout=waited))),
                     ("pipeline", dict(strategy=AutoPlanStrategy(strategy="gpipe", stages=2, profile_repeats=1, timeout=waited)))):
        trainer = L.Trainer(**trainer_kwargs(os.path.join(root, f"reloaded_{name}"), devices=world, max_epochs=2,
                                             reload_dataloaders_every_n_epochs=1, **kw))
        t0 = time.perf_counter()
        out["reloaded"][name] = (*error_of(lambda: trainer.fit(ReloadedOnRank1(width=16, depth=4, n_samples=32, loader_batch=4, dropout=0.0))),
                                 time.perf_counter() - t0)
    # rank 0's (it writes the checkpoints) refused under a pipeline plan, an OnExceptionCheckpoint saving at the refusal
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    saved = os.path.join(root, "reloaded_saved")
    trainer = L.Trainer(**trainer_kwargs(saved, devices=world, max_epochs=2, reload_dataloaders_every_n_epochs=1, enable_checkpointing=True,
                                         strategy=AutoPlanStrategy(strategy="gpipe", stages=2, profile_repeats=1, timeout=waited),
                                         callbacks=[OnExceptionCheckpoint(saved)]))
    out["reloaded_saved"] = (error_of(lambda: trainer.fit(ReloadedOnRank0(width=16, depth=4, n_samples=32, loader_batch=4, dropout=0.0)))
                             or ("no error",))[0]
    if rank == 0:  # (written by rank 0)
        checkpoint = torch.load(os.path.join(saved, "on_exception.ckpt"), weights_only=False)
        out["reloaded_progress"] = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"]
    return out


def _pp_cap() -> int:
    """A per-device memory cap between the smallest DP peak and the smallest pipeline peak (counted, not timed)."""
    torch.set_num_threads(1)
    model = ChainMLP(**PP_MODEL)
    profile = profile_module(model, model.train_dataloader(), micro_batch_sizes=[2, 4, 8], repeats=1)
    big = Hardware.from_profile(profile, device_memory_bytes=1 << 40)
    peaks: dict[bool, list[int]] = {True: [], False: []}
    for plan in enumerate_plans(profile, world_size=2, global_batch_size=2 * PP_MODEL["loader_batch"]):
        peaks[plan.strategy == "dp_ga"].append(predict(profile, plan, big).peak_memory_bytes)
    dp_min, pp_min = min(peaks[True]), min(peaks[False])
    assert pp_min < dp_min, (pp_min, dp_min)
    return int((dp_min + pp_min) / 2 / big.memory_margin)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("auto_plan"))
    t0 = time.perf_counter()
    ranks = run_on_ranks(_scenarios, 2, root, _pp_cap(), timeout=500)
    print(f"auto_plan scenarios on 2 ranks: {time.perf_counter() - t0:.1f}s (dp auto fit {ranks[0]['dp_auto_s']:.1f}s)")
    return {"ranks": ranks, "root": Path(root)}


def test_auto_plan_picks_dp_ga_and_matches_direct_run(results: dict[str, Any]) -> None:
    r0, r1 = results["ranks"]
    plan: Plan = r0["dp_plan"]
    assert plan.strategy == "dp_ga" and plan.dp == 2 and plan.global_batch_size == 2 * DP_MODEL["loader_batch"]
    assert r1["dp_plan"] == plan  # decided once, broadcast
    assert r0["dp_is_dpga"] and r1["dp_is_dpga"]  # trainer.strategy is the concrete strategy after the swap
    assert len(r0["dp_losses"]) == STEPS * plan.accumulate_grad_batches
    # Same losses and weights as DPGAStrategy(plan=plan) run directly: profiling left no trace
    # (weights, optimizer, RNG — dropout masks —, loader position and counters).
    for r in (r0, r1):
        assert r["dp_losses"] == pytest.approx(r["dp_direct_losses"], rel=1e-6, abs=1e-7)
        torch.testing.assert_close(r["dp_state"], r["dp_direct_state"], rtol=1e-6, atol=1e-7)
    changed = max((r0["dp_state"][k] - ChainMLP(**DP_MODEL).state_dict()[k]).abs().max().item() for k in r0["dp_state"])
    assert changed > 1e-3
    # monitor: predicted and observed step time per optimizer step, on each rank without the user's busy callback (its
    # BUSY_S at every step's end was step time: the monitor timed up to its own on_train_batch_end, after the user's)
    for rank in results["ranks"]:
        history = rank["dp_monitor"]
        assert len(history) == STEPS and all(0 < h["observed_s"] < BUSY_S and h["predicted_s"] > 0 for h in history), history


def test_auto_plan_writes_profile_and_plan_json(results: dict[str, Any]) -> None:
    d = results["root"] / "dp" / "distplan"
    data = json.loads((d / "plan.json").read_text())
    assert Plan.from_dict(data["plan"]) == results["ranks"][0]["dp_plan"]
    assert Plan.from_json(d / "plan.json") == results["ranks"][0]["dp_plan"]  # the file as written, prediction and all
    assert data["prediction"]["predicted_step_time_s"] > 0 and data["alternatives"]
    assert data["source"] == "profiled" and data["profiling_s"] > 0
    assert json.loads((d / "profile.json").read_text())["layers"]


def test_auto_plan_resume_keeps_plan_without_profiling(results: dict[str, Any]) -> None:
    for r in results["ranks"]:
        assert r["resume_plan"] == r["dp_plan"]
        assert r["resume_source"] == "checkpoint" and r["resume_profile"] is None
        assert r["resume_global_step"] == STEPS + 2 and r["resume_steps_run"] == 2 * r["dp_plan"].accumulate_grad_batches
        assert r["resume_profile_untouched"]


def test_auto_plan_picks_pipeline_under_memory_cap_and_matches_direct_run(results: dict[str, Any]) -> None:
    r0, r1 = results["ranks"]
    plan: Plan = r0["pp_plan"]
    assert plan.strategy in ("gpipe", "1f1b") and plan.pp == 2 and plan.dp == 1
    assert plan.global_batch_size == 2 * PP_MODEL["loader_batch"]
    assert r1["pp_plan"] == plan and r0["pp_is_pipeline"] and r1["pp_is_pipeline"]
    assert len(r0["pp_losses"]) == STEPS
    assert r0["pp_losses"] == pytest.approx(r0["pp_direct_losses"], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(r0["pp_state"], r0["pp_direct_state"], rtol=1e-6, atol=1e-7)
    assert r0["pp_limit"] == r1["pp_limit"] == (3, 3, True)  # 3 steps, as ddp; the user's setting restored after fit
    assert r0["pp_val_limit"] == r1["pp_val_limit"] == (4, 16, 2, True)  # DDP's 16 validation samples; the user's 2 restored
    assert r0["pp_tail_steps"] == r1["pp_tail_steps"] == 8
    # a step scheduler with a frequency steps where DDP steps it, the user's accumulation counted; frequency given back
    for r in (r0, r1):
        ddp, pp = r["pp_scheduler"]["ddp"], r["pp_scheduler"]["pp"]
        assert ddp[0] == [0.05, 0.05, 0.025, 0.025] and pp == ddp == (ddp[0], [4]), r["pp_scheduler"]
    # resumed mid-epoch: 2 steps left in epoch 0 and 4 in epoch 1, as under DDP (the checkpoint's progress, in the user's
    # loader batches, was left unconverted to pipeline steps when configure_optimizers loaded the loader: 10 steps)
    assert r0["pp_resumed"] == r1["pp_resumed"] == (8, True)


def test_a_root_dir_where_plan_json_cannot_go_is_refused_on_every_rank_before_profiling(results: dict[str, Any]) -> None:
    """It failed on rank 0 alone, after the profiling, with a bare FileExistsError (the other rank: its peer gone)."""
    for out in results["ranks"]:
        assert out["blocked"].startswith("OutputPathError: auto_plan's plan file ") and "which is a file" in out["blocked"], out["blocked"]
        assert "HINT: Set Trainer(default_root_dir=...) to a writable folder" in out["blocked"]
        assert out["blocked_file"] == "a file of the user's"


class _Rates(L.Callback):
    """The learning rate of every optimizer step (on each rank: a pipeline stage's optimizer has the same rate)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


def _scheduler_under_a_given_global_batch(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    import lightning_distplan  # noqa: F401  (registers auto_plan)

    out: dict[str, Any] = {}
    with warnings.catch_warnings():  # (run inside _scenarios: the filter ends with this scenario)
        warnings.filterwarnings("ignore")
        for name, pins in (("dp_ga", dict(strategy="dp_ga")), ("pp", dict(strategy="gpipe", stages=2))):
            seen = _Rates()
            trainer = L.Trainer(**trainer_kwargs(
                os.path.join(root, name), devices=world, callbacks=[seen], max_epochs=1,
                strategy=lightning_distplan.strategies.auto_plan.AutoPlanStrategy(global_batch_size=16, profile_repeats=1, **pins),
            ))
            trainer.fit(ScheduledChainMLP(width=32, depth=4, n_samples=64, loader_batch=4, dropout=0.0))
            out[name] = (trainer.strategy.plan.strategy, seen.rates, [c.frequency for c in trainer.strategy.lr_scheduler_configs])
    return out


def test_a_step_schedulers_frequency_under_a_given_global_batch_is_the_same_for_a_pipeline_as_for_dp_ga(results: dict[str, Any]) -> None:
    """AutoPlanStrategy(global_batch_size=16) over loader batches of 4 on 2 processes, accumulate_grad_batches=1: one
    optimizer step holds 2 loader batches of each process. A dp_ga plan counts a step scheduler's frequency (4) in
    loader batches (Lightning's, or Rechunking's steering), so it steps the scheduler every second step; the pipeline
    divided the frequency by the Trainer's accumulate_grad_batches (1) and stepped it every fourth: the plan auto_plan
    picked changed the learning-rate schedule (rates 0.05, 0.05, 0.025, 0.025 against 0.05 x 4)."""
    ranks = [out["scheduler_given_batch"] for out in results["ranks"]]  # run in the module's one launch
    for r in ranks:
        assert r["dp_ga"][0] == "dp_ga" and r["pp"][0] == "gpipe", r
        assert r["dp_ga"][1] == [0.05, 0.05, 0.025, 0.025], r
        assert r["pp"][1] == r["dp_ga"][1], r
        assert r["pp"][2] == r["dp_ga"][2] == [4], r  # the user's frequency back after the fit


def test_a_train_loader_reloaded_with_another_batch_size_on_one_rank_is_refused_on_every_rank(results: dict[str, Any]) -> None:
    """Rank 1's loader loaded again in epoch 1 with batches of 8 where the fit's first were 4 (reload_dataloaders_every_n_epochs=1):
    PlanningCallback and auto_plan (its dp_ga and pipeline plans) refused it on rank 1 alone, before the set-up
    agreement, and rank 0 waited there until rank 1's process ended (gloo's "Connection closed by peer", or the
    group's timeout). The refusal is now carried through that agreement: both ranks raise the one InfeasiblePlanError
    with its HINT, rank 0 with a note naming rank 1, at once."""
    r0, r1 = (out["reloaded"] for out in results["ranks"])
    planners = {"callback": "PlanningCallback's plan (dp_ga", "dp_ga": "auto_plan's plan (dp_ga", "pipeline": "auto_plan's plan (gpipe"}
    for name, planner in planners.items():
        (kind, message, notes, took), (kind1, message1, notes1, _) = r0[name], r1[name]
        assert (kind, kind1) == ("InfeasiblePlanError",) * 2 and message == message1, (r0[name], r1[name])
        assert message.startswith("The train loader was loaded again during the fit with batches of 8, where its first batches were 4, "
                                  f"and {planner}") and " HINT: Keep the train loader's batch size fixed" in message, message
        assert (notes, notes1) == (["Raised on global rank 1 reading its train loader; global rank 0 stops with it."], []), (notes, notes1)
        assert took < 25, took  # not the 30 s group timeout
    # rank 0's own refused under the pipeline plan: the checkpoint an OnExceptionCheckpoint saved there counted epoch 0's
    # progress with the refused loader's batches of 8 (2 loader batches where each process trained 4 of 4, 16 samples)
    assert [out["reloaded_saved"] for out in results["ranks"]] == ["InfeasiblePlanError"] * 2, results["ranks"]
    assert results["ranks"][0]["reloaded_progress"] == 4, results["ranks"][0]["reloaded_progress"]
