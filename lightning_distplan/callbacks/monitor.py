"""Online check of the plan: predicted vs observed step time, and an opt-in re-plan when they drift.

``auto_plan`` adds a :class:`StepTimeMonitor` to the trainer. It logs, per optimizer step,
``distplan/predicted_step_time_s`` and ``distplan/observed_step_time_s``: the wall time from the
first micro-batch's ``on_train_batch_start`` to the end of the optimizer step. Like the prediction
(a bare training loop: the model, its optimizer, Lightning's own hooks and logging), it leaves out
the work of the other callbacks, whatever their place in ``trainer.callbacks``: their hooks inside
the step (a progress bar's refresh, a ``ModelCheckpoint`` saving between micro-batches, your own
callbacks), read off ``trainer.profiler``, which Lightning runs every callback hook through. It also
leaves out the loading of the step's first batch (Lightning fetches it before that hook; the
fetches of later micro-batches fall inside) and any validation run inside the step, from the end
of the micro-batch before it to the start of the one after it (its loader's start, and checkpoints
saved after it, left out with it; so is the loading of that next micro-batch). On CUDA its time
stamps wait for the device (``torch.cuda.synchronize``, as ``distplan bench`` does), at each
micro-batch's end and around the hooks the other callbacks implement, so that a step is the device's
work, not the host's queueing of it, and a hook that waits for the device (a progress bar reading
the logged loss) does not take the step's queued work off with it. Its state
(re-plans, compute scale, the running plan and its prediction) goes into checkpoints, so a fit
resumed with the checkpoint's plan still sets its steps beside that plan's prediction; it cannot
re-plan (no profile is taken when the plan is reused).

``history`` keeps a record for each of the last ``history_size`` steps only (1000 by default): a
record is ~360 bytes (tracemalloc), so one per step of a million-step fit would be ~360 MB.
``summary`` keeps the whole fit's figures in constant memory: steps, warm-up, mean / min / max
observed step after warm-up and its mean ratio to the prediction each step ran beside (the median
is over the steps still in ``history``). An epoch's short last step (fewer micro-batches than
``accumulate_grad_batches``) is logged and kept but, as warm-up, left out of ``summary`` and of the
re-plan check: the prediction is for a full step.

With ``replan="auto"``: after ``warmup_steps`` steps, when the last ``window`` full steps are
all more than ``threshold`` × off the prediction (slower or faster), the compute part of the cost
model is refitted from them — the one number it can learn from steps of a single micro-batch size
is the speed of the device, ``Hardware.compute_scale`` (every profiled compute time is multiplied
by it) — and the plans are ranked again at the next epoch boundary, on global rank 0, broadcast
to all ranks. A new data-parallel plan (other micro-batch size / accumulation) is applied from the
next epoch on (the train loader is re-processed, as with ``reload_dataloaders_every_n_epochs``); a
switch between data parallel and a pipeline is logged and recorded in ``plan.json`` but not
applied mid-run (it needs the model re-sharded: resume the last checkpoint with the pins it names).
It does not re-plan at the fit's last epoch end as far as it can tell then; a stop asked for after
it re-planned (``EarlyStopping`` decides last) is recorded at the fit's end (``ran: false``).
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Sequence

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES, as_int
from lightning_distplan.profiling._overhead import device_clock
from lightning_distplan.strategies._auto_planning import check_count

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_distplan.profile import Profile
    from lightning_distplan.strategies._auto_planning import PlanningOutcome

__all__ = ["StepTimeMonitor", "StepTimeSummary", "departure"]


class StepTimeSummary(NamedTuple):
    """The optimizer steps of one fit, as :attr:`StepTimeMonitor.summary` gives them."""

    steps: int
    """Optimizer steps timed in this fit, warm-up included."""
    warmup_steps: int
    """Of those, the first ones left out of the figures below (at most the monitor's ``warmup_steps``)."""
    partial_steps: int
    """Steps after warm-up with fewer micro-batches than ``accumulate_grad_batches`` (an epoch's short last step), left
    out of the figures below: the prediction is for a full step."""
    observed_steps: int
    """Full steps after warm-up: the ones the figures below are over."""
    mean_observed_s: float | None
    min_observed_s: float | None
    max_observed_s: float | None
    median_observed_s: float | None
    """Median of the full steps after warm-up still in ``history`` (its last ``history_size``): the whole fit's when
    it had no more steps than that. Like the mean, it spans a re-plan's plans; compare each with its own prediction
    through ``mean_observed_over_predicted`` or the records' ``predicted_s``."""
    predicted_s: float | None
    """The prediction the monitor sets the steps beside now (after a re-plan, the new plan's); None without a plan."""
    mean_observed_over_predicted: float | None
    """Mean of observed / predicted over the full steps after warm-up that had a prediction, each step against the
    prediction it ran beside (so a re-plan does not mix two plans' figures)."""


def departure(predicted_s: float, observed: list[float], *, threshold: float, window: int) -> float | None:
    """The median observed/predicted ratio of the last ``window`` steps when ALL of them are beyond
    ``threshold`` (or below 1/threshold), else None. A sustained departure, not one slow step."""
    if predicted_s <= 0 or len(observed) < window:
        return None
    ratios = [o / predicted_s for o in observed[-window:]]
    if all(r > threshold for r in ratios) or all(r < 1.0 / threshold for r in ratios):
        return statistics.median(ratios)
    return None


def refit_compute_scale(prediction: Any, observed_s: float, current_scale: float) -> float:
    """The ``compute_scale`` that makes the prediction match ``observed_s``, keeping communication fixed.

    Compute, bubble and optimizer time scale with the device speed; p2p sends, exposed all-reduce
    time (seed 000 §III: T = compute + communication terms) and the training loop's own cost
    (``framework``: host-side, measured apart from the device) do not.

    A step observed at or below those fixed parts cannot be matched by any scale (on a CPU the loop runs
    on the cores that compute, so a faster host speeds it up too): compute then scales by the whole step's
    ratio, ``observed_s / predicted``, rather than being priced as free (the 1e-12 a plain fit gave, which
    ``plan.json`` recorded).
    """
    predicted = prediction.step_time_s
    fixed = sum(prediction.breakdown.get(k, 0.0) for k in ("p2p", "exposed_comm", "framework"))
    if observed_s > fixed and predicted > fixed:
        return current_scale * (observed_s - fixed) / (predicted - fixed)
    return current_scale * observed_s / predicted if predicted > 0 else current_scale


def _last_epoch(trainer: pl.Trainer) -> bool:
    """Whether the fit stops after the epoch now ending (``current_epoch`` is still its number): ``max_steps`` or
    ``max_epochs`` reached, or a stop asked for that ``min_epochs`` / ``min_steps`` no longer hold back (as
    ``_FitLoop._can_stop_early`` decides)."""
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1:
        return True
    if trainer.should_stop:
        loop = trainer.fit_loop
        return trainer.current_epoch + 1 >= (loop.min_epochs or 0) and trainer.global_step >= (loop.min_steps or 0)
    return False


def _epoch_end_validation(trainer: pl.Trainer) -> bool:
    """Whether the validation now ending is the one at the end of a training epoch (after its last batch)."""
    return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


class _Totals:
    """Running figures over a fit's steps, in constant memory."""

    def __init__(self) -> None:
        self.steps = self.partial = self.observed = self.ratios = 0
        self.sum = self.ratio_sum = 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, observed_s: float, predicted_s: float | None, *, warmup: bool, partial: bool) -> None:
        self.steps += 1
        if warmup:
            return
        if partial:
            self.partial += 1
            return
        self.observed += 1
        self.sum += observed_s
        self.min, self.max = min(self.min, observed_s), max(self.max, observed_s)
        if predicted_s is not None and predicted_s > 0:
            self.ratios += 1
            self.ratio_sum += observed_s / predicted_s


def _same(value: Any) -> Any:
    return value


class _ProfilerHook:
    """A profiler's ``start`` or ``stop`` as it was, still called, and then told to the clocks installed on this profiler
    (one per monitor fitting with it, whatever order they are put back in). Set on the profiler instance for a fit; a
    copy of the profiler (pickle, ``copy.deepcopy``) gets the method it had, without this fit's timing."""

    def __init__(self, profiler: Any, name: str) -> None:
        self.profiler, self.name = profiler, name
        self.inner = getattr(profiler, name)
        self.had_attr = name in vars(profiler)  # a method the user set on the instance: put back, not removed
        self.clocks: list[_CallbackClock] = []

    def __call__(self, action_name: str) -> None:
        if self.name == "start":
            for clock in self.clocks:
                clock.started(action_name)
            self.inner(action_name)
        else:
            self.inner(action_name)
            for clock in self.clocks:
                clock.stopped(action_name)

    def __reduce__(self) -> tuple[Any, ...]:
        return _same, (self.inner,)


class _CallbackClock:
    """Seconds a Trainer spends in the hooks of callbacks other than one: Lightning runs every callback hook inside
    ``trainer.profiler.profile("[Callback]<state_key>.<hook>")``, so the profiler's ``start`` / ``stop`` bracket them
    whatever the callbacks' order (a checkpoint saved inside ``ModelCheckpoint.on_train_batch_end`` with its hook).
    The profiler's own ``start`` / ``stop`` are wrapped on the instance (:class:`_ProfilerHook`), still called as they
    were, and put back by :meth:`remove` once no clock is left on them. On CUDA (:meth:`read_synced`) the hooks a
    callback implements are timed from a synchronized device: a hook that waits for the device (a progress bar reading
    the logged loss) would otherwise take the step's queued work off the step as the callback's."""

    def __init__(self) -> None:
        self.total = 0.0
        """Seconds in the other callbacks' hooks since :meth:`install`."""
        self._hooks: list[_ProfilerHook] = []
        self._own = ""
        self._running: str | None = None  # the outermost other callback's hook now running
        self._since = 0.0
        self._now: Callable[[], float] = time.perf_counter
        self._synced: frozenset[str] = frozenset()  # the actions timed with _now rather than time.perf_counter

    def install(self, profiler: Any, *, own_key: str) -> None:
        self.remove()
        self.total, self._running, self._own = 0.0, None, f"[Callback]{own_key}."
        self._now, self._synced = time.perf_counter, frozenset()
        for name in ("start", "stop"):
            hook = vars(profiler).get(name)
            if not isinstance(hook, _ProfilerHook):  # the first clock on this profiler (a second monitor shares it)
                hook = _ProfilerHook(profiler, name)
                setattr(profiler, name, hook)
            hook.clocks.append(self)
            self._hooks.append(hook)

    def remove(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.clocks.remove(self)
            if not hook.clocks and vars(hook.profiler).get(hook.name) is hook:  # else wrapped since by another: left inert
                if hook.had_attr:
                    setattr(hook.profiler, hook.name, hook.inner)
                else:
                    delattr(hook.profiler, hook.name)

    def read_synced(self, now: Callable[[], float], actions: frozenset[str]) -> None:
        """Time ``actions`` (profiler action names) with ``now``, a clock that synchronizes the device."""
        self._now, self._synced = now, actions

    def started(self, action_name: str) -> None:
        if self._running is None and action_name.startswith("[Callback]") and not action_name.startswith(self._own):
            self._running, self._since = action_name, (self._now if action_name in self._synced else time.perf_counter)()

    def stopped(self, action_name: str) -> None:
        if action_name == self._running:
            self.total += (self._now if action_name in self._synced else time.perf_counter)() - self._since
            self._running = None


_HOOKS = tuple(name for name in dir(Callback) if name.startswith("on_"))


def _implemented_hooks(callbacks: Sequence[Callback], *, besides: Callback) -> frozenset[str]:
    """The profiler actions of the hooks the callbacks other than ``besides`` implement (Lightning runs every hook of
    every callback; the base class's do nothing)."""
    return frozenset(
        f"[Callback]{cb.state_key}.{hook}" for cb in callbacks if cb is not besides for hook in _HOOKS
        if is_overridden(hook, cb, parent=Callback)
    )


class StepTimeMonitor(Callback):
    """Log predicted and observed step time; optionally re-plan when they depart (see module docstring).

    Every rank times its own steps (:attr:`history`, :attr:`summary`); a logger records global rank 0's. A rank leaves
    out its own callbacks' work, not its wait for another rank's: where a callback works on rank 0 only between the
    micro-batches of a step, the other ranks wait for it at Lightning's next per-batch broadcast, inside their step. Under
    ``strategy="ddp_spawn"`` the steps are timed by copies of the monitor in the spawned processes, so the one in your
    script stays empty: read the logger's ``distplan/observed_step_time_s``.

    Args:
        replan: ``"off"`` or ``"auto"``.
        warmup_steps: first optimizer steps of each fit left out of the re-plan check and :attr:`summary` (allocations,
            caches, JIT); they are still logged and kept in :attr:`history`, marked ``warmup``.
        window: consecutive steps that must all depart before a re-plan.
        threshold: observed/predicted ratio beyond which (or below whose inverse) a step departs.
        max_replans: re-plans per run.
        history_size: the last steps kept in :attr:`history` (``None``: every step of the fit); :attr:`summary`
            covers the whole fit either way.
    """

    def __init__(
        self,
        *,
        replan: Literal["off", "auto"] = "off",
        warmup_steps: int = 3,
        window: int = 5,
        threshold: float = 1.5,
        max_replans: int = 2,
        history_size: int | None = 1000,
    ) -> None:
        if replan not in ("off", "auto"):
            raise InfeasiblePlanError(f"`replan` must be 'off' or 'auto', got {replan!r}.", hint="Pass replan='auto' or 'off'.")
        if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or not 1.0 < threshold < math.inf:
            raise InfeasiblePlanError(f"`threshold` must be a number above 1, got {threshold!r}.", hint="Use e.g. threshold=1.5 (50% off).")
        threshold = float(threshold)  # a numpy number too
        warmup_steps = check_count("warmup_steps", warmup_steps, low=0)
        window = check_count("window", window)
        max_replans = check_count("max_replans", max_replans, low=0)
        if history_size is not None and ((size := as_int(history_size)) is None or size < 1):
            # None, not 0 or -1 (Lightning's max_steps=-1), keeps every step: the message must say so
            raise InfeasiblePlanError(
                f"`history_size` must be a positive integer or None, got {history_size!r}.",
                hint="Pass e.g. history_size=1000 to keep the last 1000 steps, or history_size=None to keep every step.",
            )
        history_size = None if history_size is None else as_int(history_size)
        self.replan = replan
        self.warmup_steps = warmup_steps
        self.window = window
        self.threshold = threshold
        self.max_replans = max_replans
        self.history_size = history_size
        self.history: list[dict[str, Any]] = []
        """One record per optimizer step of this fit, the last ``history_size`` only: ``step``, ``predicted_s`` (may be
        None), ``observed_s``, ``micro_batches`` (training batches Lightning ran in the step), ``warmup`` (True for the
        warm-up steps) and ``partial`` (True for a step of fewer micro-batches than ``accumulate_grad_batches``); the
        re-plan check and :attr:`summary` leave out both kinds."""
        self.replans: list[dict[str, Any]] = []
        """One record per re-plan: step, epoch, observed/predicted ratio, new scale, old and new plan, applied; at the fit's
        end an applied one gets ``ran``: False where the fit stopped at that epoch's end (EarlyStopping) before it ran."""
        self.overhead_s: float | None = None
        self.run_s: float | None = None
        self._outcome: PlanningOutcome | None = None
        self._profile: Profile | None = None
        self._pins: dict[str, Any] = {}
        self._memory: int | None = None
        self._fit_start: float | None = None
        self._predicted: float | None = None
        self._scale = 1.0
        self._t: float | None = None
        self._clock = _CallbackClock()
        self._now: Callable[[], float] = time.perf_counter  # synchronizes the device on CUDA (set at the train start)
        self._in_callbacks = 0.0  # _clock.total when the step started (moved on past a validation): later time in them is not the step's
        self._last_step = -1
        self._observed: list[float] = []
        self._totals = _Totals()
        self._pending: float | None = None
        self._replan_s = 0.0
        self._replans_before = 0  # re-plans restored from a checkpoint, before this fit's
        self._micro_end: float | None = None  # when this step's last finished micro-batch ended (a validation may follow it)
        self._micro_end_in_callbacks = 0.0  # _clock.total then
        self._micro = 0  # micro-batches (training batches) started in this step
        self._validated = False  # a validation ran since then: the gap up to the next micro-batch is not the step's
        self._restored: tuple[dict[str, Any], float] | None = None  # (plan, its prediction) from a checkpoint
        self._strategies: tuple[str, ...] = STRATEGIES
        self._replannable = True

    def attach(
        self,
        *,
        outcome: PlanningOutcome,
        profile: Profile | None,
        pins: dict[str, Any],
        device_memory_bytes: int | None,
        fit_start: float | None,
        strategies: Sequence[str] = STRATEGIES,
        replannable: bool = True,
    ) -> None:
        """Called by ``auto_plan`` once it has decided (and by ``PlanningCallback``, whose plan the monitor can set
        beside the steps but not change: ``replannable=False``); ``strategies``: those this fit may run (a re-plan
        ranks only these)."""
        self._outcome = outcome
        self._replannable = replannable
        self._strategies = tuple(strategies)
        self._profile = profile
        self._pins = dict(pins)
        self._memory = device_memory_bytes
        self._fit_start = fit_start
        pred = outcome.prediction
        self._predicted = None if pred is None else pred.step_time_s
        if pred is None and self._restored is not None and self._restored[0] == outcome.plan.to_dict():
            self._predicted = self._restored[1]  # a plan reused from a checkpoint: the prediction it ran with
        if outcome.hardware is not None:
            self._scale = outcome.hardware.compute_scale

    @property
    def predicted_step_time_s(self) -> float | None:
        """The step time predicted for the plan running now (``None`` without a plan: no ``auto_plan`` or
        ``PlanningCallback`` in this fit, or a resumed plan the checkpoint holds no prediction for)."""
        return self._predicted

    @property
    def summary(self) -> StepTimeSummary:
        """This fit's steps in a few figures (all of them, also those no longer in :attr:`history`)."""
        t = self._totals
        after = [h["observed_s"] for h in self.history if not h["warmup"] and not h["partial"]]
        return StepTimeSummary(
            steps=t.steps, warmup_steps=t.steps - t.partial - t.observed, partial_steps=t.partial, observed_steps=t.observed,
            mean_observed_s=t.sum / t.observed if t.observed else None,
            min_observed_s=t.min if t.observed else None, max_observed_s=t.max if t.observed else None,
            median_observed_s=statistics.median(after) if after else None, predicted_s=self._predicted,
            mean_observed_over_predicted=t.ratio_sum / t.ratios if t.ratios else None,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # the same monitor in another Trainer (or a second fit) starts afresh; a checkpoint's state
            # (re-plans, compute scale, plan) is loaded after this hook
            self.replans = []
            self.overhead_s = self.run_s = None
            self._fit_start = None
            self._scale = 1.0
            self._restored = None
            self._outcome = None
            self._profile = None
            self._predicted = None
            self._replannable = True
            self.history = []
            self._totals = _Totals()
            self._t = None
            self._now = time.perf_counter
            self._micro_end = None
            self._validated = False
            self._last_step = -1
            self._observed = []
            self._pending = None
            self._replan_s = 0.0
            self._clock.install(trainer.profiler, own_key=self.state_key)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._clock.remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._clock.remove()  # Lightning calls no teardown hook of callbacks after an exception

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # On CUDA a time stamp waits for the queued work, as StepTimer's (the bench's) do; off it, no cost
        self._now = device_clock(trainer.strategy.root_device)
        self._replans_before = len(self.replans)  # a checkpoint's are loaded by now
        if self._now is not time.perf_counter:
            self._clock.read_synced(self._now, _implemented_hooks(trainer.callbacks, besides=self))
        if self.replan == "auto" and (self._outcome is None or not self._replannable):
            rank_zero_warn(
                f"distplan: StepTimeMonitor(replan='auto') re-plans under strategy='auto_plan' only; this fit runs "
                f"{type(trainer.strategy).__name__}, so the monitor logs step times and does not re-plan."
            )
        elif self.replan == "auto" and self._profile is None:
            rank_zero_warn(
                "distplan: replan='auto' has no profile to re-plan from in this fit (the plan was reused from a "
                "checkpoint, without profiling), so it will not re-plan. Start a fresh fit to plan and re-plan."
            )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation inside an accumulation is not the step's: it is left out from the end of the micro-batch before
        # it (Lightning sets up the val loader, its iterator, workers and first prefetched batch, before
        # on_validation_start) to the start of the one after it (ModelCheckpoint and EarlyStopping act in their
        # on_validation_end, after this one: checkpoint callbacks run last).
        self._validated = self._t is not None and self._micro_end is not None
        if _epoch_end_validation(trainer):
            # ModelCheckpoint saves here when it saves after validation (val_check_interval < 1, ...), before
            # on_train_epoch_end: re-plan first, so that the checkpoint where the next epoch starts holds its plan
            self._replan_at_epoch_end(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning steps at an epoch's last batch, so no step spans two epochs; but a batch whose on_train_batch_start
        # returned -1 (skip the rest of the epoch) never reaches on_train_batch_end, and its timer would run on into the
        # next epoch's first step with the epoch's end (hooks, checkpoints, the new loader iterator) in it.
        self._t = self._micro_end = None
        self._validated = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._t is None:
            self._t = self._now()
            self._in_callbacks = self._clock.total
            self._micro_end = None
            self._micro = 0
        elif self._validated and self._micro_end is not None:
            self._t += self._now() - self._micro_end
            self._in_callbacks += self._clock.total - self._micro_end_in_callbacks  # inside that gap: not taken off twice
        self._validated = False
        self._micro += 1
        if self._last_step < 0:
            self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step <= self._last_step or self._t is None:
            self._micro_end, self._micro_end_in_callbacks = self._now(), self._clock.total
            return  # an accumulation micro-batch: the step is not done yet
        observed = self._now() - self._t - (self._clock.total - self._in_callbacks)
        self._t = self._micro_end = None
        self._last_step = trainer.global_step
        warmup = self._totals.steps < self.warmup_steps
        # an epoch's last step may run fewer micro-batches (limit_train_batches, a short last loader batch re-chunked):
        # the prediction is for a full step, so it is not compared with one
        partial = self._micro < trainer.accumulate_grad_batches
        self._totals.add(observed, self._predicted, warmup=warmup, partial=partial)
        self.history.append({
            "step": trainer.global_step, "predicted_s": self._predicted, "observed_s": observed, "micro_batches": self._micro,
            "warmup": warmup, "partial": partial,
        })
        if self.history_size is not None and len(self.history) > self.history_size:
            del self.history[0]  # one at a time: at most history_size pointers moved, a list still for slicing
        pl_module.log("distplan/observed_step_time_s", observed, on_step=True, on_epoch=False, batch_size=1)
        if self._predicted is not None:
            pl_module.log("distplan/predicted_step_time_s", self._predicted, on_step=True, on_epoch=False, batch_size=1)
        if not warmup and not partial:
            self._observed.append(observed)
            del self._observed[: -self.window]  # only the last window decides: a long fit must not grow it by a float a step
        can_replan = self._predicted is not None and self._profile is not None and self._replannable
        if self.replan == "auto" and can_replan and self._pending is None and len(self.replans) < self.max_replans:
            ratio = departure(self._predicted, self._observed, threshold=self.threshold, window=self.window)
            if ratio is not None:
                self._pending = ratio
                rank_zero_info(
                    f"distplan: observed step time is {ratio:.2f}x the prediction for {self.window} steps; "
                    "re-planning at the end of this epoch."
                )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._replan_at_epoch_end(trainer)  # a no-op where the epoch's last validation re-planned already

    def _replan_at_epoch_end(self, trainer: pl.Trainer) -> None:
        if self.replan != "auto" or self._outcome is None:
            return
        # Ranks observe slightly different times: rank 0's view decides, every rank follows.
        pending = trainer.strategy.broadcast(self._pending)
        self._pending = None
        if pending is None:
            return
        if _last_epoch(trainer):  # a plan decided now would never run, yet plan.json would name it
            rank_zero_info("distplan: the fit ends with this epoch, so it does not re-plan.")
            return
        t0 = time.perf_counter()
        try:
            self._do_replan(trainer, pending)
        finally:
            self._replan_s += time.perf_counter() - t0
        self._observed = []

    def _do_replan(self, trainer: pl.Trainer, ratio: float) -> None:
        from lightning_distplan.strategies._auto_concrete import _AutoDPGAStrategy
        from lightning_distplan.strategies._auto_planning import PlanningOutcome, choose_plan

        outcome = self._outcome
        assert outcome is not None
        running = getattr(trainer.strategy, "plan", None) or outcome.plan
        if self._profile is None or outcome.hardware is None:
            rank_zero_warn("distplan: cannot re-plan a plan reused from a checkpoint (no profile in this run).")
            return
        decision: Any = None
        if trainer.is_global_zero:
            current = next((c for c in outcome.candidates if c.plan == running), None)
            observed = statistics.median(self._observed[-self.window:])
            scale = refit_compute_scale(current.prediction, observed, self._scale) if current is not None else self._scale * ratio
            candidates, hardware = choose_plan(
                self._profile, world_size=running.world_size, global_batch_size=running.global_batch_size, pins=self._pins,
                hardware=outcome.hardware, compute_scale=scale, strategies=self._strategies,
            )
            decision = (scale, candidates, hardware)
        scale, candidates, hardware = trainer.strategy.broadcast(decision)
        best = candidates[0].plan
        applied = False
        if best != running and best.strategy == "dp_ga" and isinstance(trainer.strategy, _AutoDPGAStrategy):
            trainer.strategy.replace_plan(best)
            trainer.fit_loop._combined_loader = None  # re-process the train loader at the next epoch start
            applied = True
        nxt = best if (applied or best == running) else running
        self._scale = scale
        self._outcome = PlanningOutcome(
            plan=nxt, candidates=tuple(candidates), hardware=hardware, source="replanned",
            profiling_s=outcome.profiling_s, planning_s=outcome.planning_s,
        )
        later = getattr(trainer.strategy, "later_fits", None)
        if later is not None:  # a later fit of this Trainer runs (and monitors) the plan as re-planned
            later.outcome = self._outcome
        self._predicted = self._outcome.prediction.step_time_s if self._outcome.prediction is not None else None
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "ratio": ratio,
            "compute_scale": scale,
            "old_plan": running.describe(),
            "new_best": best.describe(),
            "applied": applied,
            "predicted_step_time_s": self._predicted,
        }
        self.replans.append(record)
        if best == running:
            what = f"the plan stays {running.describe()}"
        elif applied:
            what = f"switching from {running.describe()} to {best.describe()} from the next epoch"
        else:
            what = (
                f"{best.describe()} is now predicted best, but switching from {running.describe()} needs the model re-sharded; "
                f"resume from the last checkpoint with AutoPlanStrategy(strategy='{best.strategy}', stages={best.pp}) to run it"
            )
        rank_zero_info(f"distplan: re-planned with compute scale {scale:.3g} (observed/predicted {ratio:.2f}x): {what}.")
        self._write_plan_json(trainer)

    def _write_plan_json(self, trainer: pl.Trainer) -> None:
        from lightning_distplan.strategies._auto_planning import distplan_dir, jsonable_pins, write_artifacts

        if trainer.is_global_zero:
            extra = {"pins": jsonable_pins(self._pins), "replans": self.replans}
            write_artifacts(distplan_dir(trainer), profile=None, outcome=self._outcome, extra=extra)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A switch made at an epoch's end runs from the next epoch, if there is one: _last_epoch cannot foresee a stop
        # asked for after the re-plan (EarlyStopping checks in on_train_epoch_end after every other callback, and in
        # on_validation_end after the monitor where it comes after it), so the record says whether the plan ran
        unrun = None
        for record in self.replans[self._replans_before:]:
            if record["applied"]:
                record["ran"] = record["step"] < trainer.global_step
                unrun = None if record["ran"] else record
        if unrun is not None:
            rank_zero_info(
                f"distplan: the fit stopped at the end of epoch {unrun['epoch']}, so {unrun['new_best']}, re-planned there, did not "
                "run in it (a checkpoint saved at that epoch's end holds it, and a later fit of this Trainer would run it)."
            )
            self._write_plan_json(trainer)
        if self._fit_start is None or self._outcome is None:
            return
        self.run_s = time.perf_counter() - self._fit_start
        self.overhead_s = self._outcome.overhead_s + self._replan_s
        pct = 100.0 * self.overhead_s / self.run_s if self.run_s > 0 else 0.0
        rank_zero_info(
            f"distplan: planning overhead {self.overhead_s:.2f} s = {pct:.1f}% of this fit ({self.run_s:.1f} s; "
            f"plan {unrun['old_plan'] if unrun else f'{self._outcome.plan.describe()}, {self._outcome.source}'})."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"replans": list(self.replans), "compute_scale": self._scale}
        if self._outcome is not None and self._predicted is not None:  # a resumed fit that reuses the plan compares with it
            state.update(plan=self._outcome.plan.to_dict(), predicted_step_time_s=self._predicted)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.replans = list(state_dict.get("replans", []))
        self._scale = float(state_dict.get("compute_scale", 1.0))
        plan, predicted = state_dict.get("plan"), state_dict.get("predicted_step_time_s")
        self._restored = (dict(plan), float(predicted)) if isinstance(plan, dict) and isinstance(predicted, (int, float)) else None
