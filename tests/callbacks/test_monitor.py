"""StepTimeMonitor in real single-process fits: what it times as a step, and the state it keeps between fits
(the re-plan and the 2-rank runs are in tests/strategies/test_auto_plan_single.py and test_auto_plan.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_distplan.callbacks import StepTimeMonitor


def _trainer(tmp: Path, monitor: StepTimeMonitor, **kw: Any) -> L.Trainer:
    return L.Trainer(**{
        **dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, default_root_dir=str(tmp), callbacks=[monitor]),
        **kw,
    })


# A step of BoringModel is ~1 ms here; 0.45 s leaves a busy host room and still catches a 0.6 s pause counted in a step.
SLOW_S, BOUND_S = 0.6, 0.45


def test_a_skipped_rest_of_epoch_does_not_time_the_epoch_boundary_into_the_next_step(tmp_path: Path) -> None:
    """on_train_batch_start returning -1 ends the epoch without that batch's on_train_batch_end: the timer the monitor
    started for it ran on into the next epoch's first step, counting the epoch's end (0.6 s here) as step time."""

    class SkipsTheRest(BoringModel):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return -1 if batch_idx == 2 else None

        def on_train_epoch_end(self) -> None:
            time.sleep(SLOW_S)

    monitor = StepTimeMonitor(warmup_steps=0)
    trainer = _trainer(tmp_path, monitor, max_epochs=2, limit_val_batches=0)
    trainer.fit(SkipsTheRest())
    assert trainer.global_step == 4 and [h["step"] for h in monitor.history] == [1, 2, 3, 4]
    assert max(h["observed_s"] for h in monitor.history) < BOUND_S, monitor.history


class _SlowToStart(torch.utils.data.DataLoader):
    """A loader whose iterator takes SLOW_S to start, as worker processes or a sharded dataset's first read do."""

    def __iter__(self) -> Any:
        time.sleep(SLOW_S)
        return super().__iter__()


def test_a_validation_inside_a_step_is_left_out_with_its_loader_start(tmp_path: Path) -> None:
    """A validation between the micro-batches of a step (val_check_interval 3 inside accumulation 2) is not step time,
    and neither is the start of its loader's iterator, which Lightning makes (and prefetches from) before the
    on_validation_start hook: the monitor timed from there, so the step held the loader's 0.6 s start."""
    from lightning.pytorch.demos.boring_classes import RandomDataset

    class SlowValidationLoader(BoringModel):
        def val_dataloader(self) -> Any:
            return _SlowToStart(RandomDataset(32, 64))

    monitor = StepTimeMonitor(warmup_steps=0)
    trainer = _trainer(tmp_path, monitor, max_steps=3, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1)
    trainer.fit(SlowValidationLoader())
    assert [h["step"] for h in monitor.history] == [1, 2, 3]
    assert max(h["observed_s"] for h in monitor.history) < BOUND_S, monitor.history


def test_a_checkpoint_saved_after_a_validation_inside_a_step_is_left_out_with_it(tmp_path: Path) -> None:
    """Lightning's default ModelCheckpoint saves in on_validation_end, after the monitor's own on_validation_end (it
    runs checkpoint callbacks last): a validation inside a step was left out, the 0.6 s save after it was step time."""

    class SlowSave(BoringModel):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            time.sleep(SLOW_S)

    monitor = StepTimeMonitor(warmup_steps=0)
    trainer = _trainer(tmp_path, monitor, max_steps=3, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1,
                       enable_checkpointing=True)
    trainer.fit(SlowSave())
    assert list((tmp_path / "checkpoints").iterdir())  # it saved, after the validation at the 3rd micro-batch (step 2)
    assert [h["step"] for h in monitor.history] == [1, 2, 3]
    assert max(h["observed_s"] for h in monitor.history) < BOUND_S, monitor.history


class _Busy(Callback):
    """A callback that works (sleeps) in its batch hooks, as a progress bar, a logging or weight-averaging callback does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, *args: Any) -> None:
        time.sleep(self.seconds)

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def test_the_other_callbacks_work_is_left_out_of_the_step_wherever_they_stand(tmp_path: Path) -> None:
    """The prediction is for a bare loop; other callbacks' hooks are not the step. The monitor timed from its own
    on_train_batch_start to its own on_train_batch_end, so what a callback before it did in on_train_batch_end, one after
    it in on_train_batch_start, and one after it between micro-batches all counted (0.9 s in a ~2 ms step here; under
    auto_plan, which puts its monitor after the user's callbacks, every user callback's on_train_batch_end counted).
    The profiler the user gave still times every hook, and gets its own methods back after the fit."""
    from lightning.pytorch.profilers import SimpleProfiler

    monitor, profiler = StepTimeMonitor(warmup_steps=0), SimpleProfiler()
    trainer = _trainer(tmp_path, monitor, max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, profiler=profiler,
                       callbacks=[_Busy(0.15), monitor, _Busy(0.15)])
    trainer.fit(BoringModel())
    assert [h["step"] for h in monitor.history] == [1, 2]
    assert max(h["observed_s"] for h in monitor.history) < BOUND_S, monitor.history
    assert len(profiler.recorded_durations["[Callback]_Busy.on_train_batch_end"]) == 8  # 2 callbacks x 4 micro-batches
    assert "start" not in vars(profiler) and "stop" not in vars(profiler)


class _CopiesTheProfiler(Callback):
    """Pickles and deep-copies trainer.profiler in the middle of a fit, and times an action of its own on each copy."""

    def __init__(self) -> None:
        self.copies: list[Any] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        import copy
        import pickle

        for made in (pickle.loads(pickle.dumps(trainer.profiler)), copy.deepcopy(trainer.profiler)):
            made.start("a copy's own action")
            made.stop("a copy's own action")
            self.copies.append(made)


def test_two_monitors_fitting_twice_with_one_profiler_each_leave_the_others_work_out_and_the_profiler_as_it_was(tmp_path: Path) -> None:
    """Two monitors (a subclass has a state_key of its own) on one profiler, the Trainer fitted twice. Each wrapped the
    profiler's methods on top of the other's and put back what it had found, so the first one to be put back removed
    the second's wrapper and the second put the first's back: it stayed on the profiler after the fit, and in the next
    fit the busy callback's 0.2 s was taken off that monitor's steps twice (steps of -0.2 s). A copy of the profiler
    made mid-fit could not be pickled (a local function on it), and a deep copy timed into the original profiler."""
    from lightning.pytorch.profilers import SimpleProfiler

    class OtherMonitor(StepTimeMonitor):
        pass

    first, second, profiler, copies = StepTimeMonitor(warmup_steps=0), OtherMonitor(warmup_steps=0), SimpleProfiler(), _CopiesTheProfiler()
    busy = _Busy(0.2)
    busy.on_train_batch_start = lambda *args: None  # type: ignore[method-assign]  # busy at each step's end only
    trainer = _trainer(tmp_path, first, max_steps=2, limit_val_batches=0, profiler=profiler, callbacks=[busy, first, second, copies])
    for steps in (2, 4):
        trainer.fit_loop.epoch_loop.max_steps = steps
        trainer.fit(BoringModel())
        for monitor in (first, second):
            assert len(monitor.history) == 2 and all(0 < h["observed_s"] < BOUND_S for h in monitor.history), monitor.history
        assert "start" not in vars(profiler) and "stop" not in vars(profiler)
    assert len(profiler.recorded_durations["[Callback]_Busy.on_train_batch_end"]) == 4
    assert len(copies.copies) == 8 and "a copy's own action" not in profiler.recorded_durations
    assert all(len(made.recorded_durations["a copy's own action"]) == 1 for made in copies.copies)


def test_off_cuda_the_monitor_reads_the_plain_clock_and_on_cuda_it_would_synchronize_around_the_hooks_callbacks_implement(
    tmp_path: Path,
) -> None:
    """On CUDA the monitor's time stamps synchronize the device (device_clock, StepTimer's and so the bench's), and so
    do the callback clock's around the hooks the other callbacks implement: a progress bar reading the logged loss in
    on_train_batch_end waits there for the step's queued work, which was taken off the step as the progress bar's. No
    GPU here: this checks that off CUDA the clock is time.perf_counter itself (no sync, the CPU path as it was) and which
    hooks would be synchronized around in a real Trainer (the progress bar's and ModelCheckpoint's on_train_batch_end,
    no callback's do-nothing on_before_backward, none of the monitor's own)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from lightning_distplan.callbacks.monitor import _implemented_hooks
    from lightning_distplan.profiling._overhead import device_clock

    assert device_clock(torch.device("cpu")) is time.perf_counter
    monitor = StepTimeMonitor()
    trainer = _trainer(tmp_path, monitor, enable_progress_bar=True, enable_checkpointing=True, callbacks=[monitor])
    actions = _implemented_hooks(trainer.callbacks, besides=monitor)
    bar, checkpoint = trainer.progress_bar_callback, trainer.checkpoint_callback
    assert isinstance(bar, ProgressBar) and isinstance(checkpoint, ModelCheckpoint)
    assert {f"[Callback]{bar.state_key}.on_train_batch_end", f"[Callback]{checkpoint.state_key}.on_train_batch_end"} <= actions
    assert not {a for a in actions if a.endswith(".on_before_backward") or a.startswith("[Callback]StepTimeMonitor.")}


def test_a_checkpoint_saved_by_time_between_micro_batches_is_left_out(tmp_path: Path) -> None:
    """ModelCheckpoint(train_time_interval=...) saves in on_train_batch_end once the interval is over, also between the
    micro-batches of a step (the global step not saved yet): with steps of 0.2 s and an interval of 0.3 s, the interval
    runs out inside every other step, and the 0.6 s save was step time."""
    import datetime

    from lightning.pytorch.callbacks import ModelCheckpoint

    class SlowSave(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(0.05)
            return super().training_step(batch, batch_idx)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            time.sleep(SLOW_S)

    monitor = StepTimeMonitor(warmup_steps=0)
    by_time = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), train_time_interval=datetime.timedelta(seconds=0.3), save_top_k=-1)
    trainer = _trainer(tmp_path, monitor, max_steps=4, accumulate_grad_batches=4, limit_val_batches=0, enable_checkpointing=True,
                       callbacks=[monitor, by_time])
    trainer.fit(SlowSave())
    assert list((tmp_path / "ckpt").iterdir())
    assert [h["step"] for h in monitor.history] == [1, 2, 3, 4]
    assert max(h["observed_s"] for h in monitor.history) < 0.2 + BOUND_S, monitor.history


def test_a_monitor_used_again_reports_only_its_own_fit(tmp_path: Path) -> None:
    """The monitor auto_plan used, then in a plain fit: that fit has no planning overhead to report; `overhead_s` and
    `run_s` still held the auto_plan fit's figures."""
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    monitor = StepTimeMonitor(warmup_steps=0)
    first = _trainer(tmp_path / "auto", monitor, max_steps=1, strategy=AutoPlanStrategy(profile_repeats=1))
    first.fit(BoringModel())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    assert monitor.overhead_s is not None and monitor.run_s is not None and monitor.predicted_step_time_s is not None
    _trainer(tmp_path / "plain", monitor, max_steps=2, limit_val_batches=0).fit(BoringModel())
    assert [h["predicted_s"] for h in monitor.history] == [None, None]
    assert monitor.overhead_s is None and monitor.run_s is None


def test_history_keeps_the_last_steps_and_the_summary_the_whole_fit(tmp_path: Path) -> None:
    """`history` is bounded (a record a step grew without end over a long fit); `summary` still counts every step,
    warm-up apart, and each record says whether it was warm-up (slicing off `warmup_steps` no longer finds them)."""
    import statistics

    bounded, whole = StepTimeMonitor(warmup_steps=2, history_size=3), StepTimeMonitor(warmup_steps=2, history_size=None)
    for monitor in (bounded, whole):  # one stateful monitor per Trainer, as Lightning requires
        _trainer(tmp_path, monitor, max_steps=7, limit_val_batches=0).fit(BoringModel())
    assert [h["step"] for h in bounded.history] == [5, 6, 7] and not any(h["warmup"] for h in bounded.history)
    assert [h["step"] for h in whole.history] == list(range(1, 8))
    assert [h["warmup"] for h in whole.history] == [True, True] + [False] * 5
    for monitor in (bounded, whole):
        summary = monitor.summary
        assert (summary.steps, summary.warmup_steps, summary.observed_steps) == (7, 2, 5)
        assert summary.predicted_s is None and summary.mean_observed_over_predicted is None  # no plan in this fit
        kept = [h["observed_s"] for h in monitor.history if not h["warmup"]]
        assert summary.median_observed_s == statistics.median(kept)
        assert summary.min_observed_s <= min(kept) and summary.max_observed_s >= max(kept)
    after = [h["observed_s"] for h in whole.history[2:]]
    assert whole.summary.mean_observed_s == pytest.approx(statistics.fmean(after))
    assert (whole.summary.min_observed_s, whole.summary.max_observed_s) == (min(after), max(after))
    assert len(bounded._observed) <= bounded.window


def test_an_epochs_short_last_step_is_not_set_beside_a_full_steps_prediction(tmp_path: Path) -> None:
    """limit_train_batches=5 with accumulate_grad_batches=2: each epoch's last step runs 1 micro-batch, not 2. It is
    logged and kept, with its micro-batch count, but left out of the figures compared with the prediction (made for
    a full step) and of the re-plan window, where such a step, about half as long, could break every streak of slow steps
    in epochs of no more than `window` full steps."""
    monitor = StepTimeMonitor(warmup_steps=1, window=2)
    trainer = _trainer(tmp_path, monitor, max_epochs=2, limit_train_batches=5, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(BoringModel())
    assert [(h["step"], h["micro_batches"]) for h in monitor.history] == [(1, 2), (2, 2), (3, 1), (4, 2), (5, 2), (6, 1)]
    summary = monitor.summary
    assert (summary.steps, summary.warmup_steps, summary.partial_steps, summary.observed_steps) == (6, 1, 2, 3)
    full = [h["observed_s"] for h in monitor.history if h["micro_batches"] == 2 and not h["warmup"]]
    assert summary.median_observed_s == sorted(full)[1] and summary.mean_observed_s == pytest.approx(sum(full) / 3)
    assert monitor._observed == full[-2:]  # the re-plan window: full steps only
