"""``PlanningCallback``: keep your strategy; let the profile pick micro-batch size and accumulation.

Like Lightning's ``BatchSizeFinder`` (callback → ``tuner/batch_size_scaling.py``), the callback only
validates and calls the plain functions below, and the Trainer state it changes is put back in
``finally:`` / at teardown.

At ``setup("fit")`` — process group up, datamodule set up, model not yet wrapped by DDP/FSDP — it
profiles the module on this rank's device (every rank; no trace left), ranks the ``dp_ga`` plans
for the user's fixed global batch (loader batch × ``accumulate_grad_batches`` × world size) on rank
0 and broadcasts the winner, then applies it: the train loader is re-chunked into the planned
micro-batches with ``dp_ga``'s own loader wrapper (hooked into ``strategy.process_dataloader``,
after Lightning injected the distributed sampler) and ``trainer.accumulate_grad_batches`` is set.
It also ranks every other strategy and, when one is predicted faster, says so without forcing it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import Plan
from lightning_distplan.strategies._auto_planning import (
    PlanningOutcome,
    check_artifact_dir,
    check_count,
    check_memory,
    choose_plan,
    ddp_bucket_bytes,
    describe_for_user,
    device_memory,
    distplan_dir,
    faster_alternative,
    fresh_train_loader,
    log_outcome,
    made_for_another_run,
    pins_from,
    profile_in_fit,
    ranks_per_node,
    reloaded_loader_error,
    trains_nothing,
    unsuited_plan,
    user_global_batch,
    write_artifacts,
)
from lightning_distplan.strategies._checkpoint import PLAN_KEY, add_portable_state, readable_plan, stored_plan_context
from lightning_distplan.strategies._exit import destroy_process_groups_at_exit
from lightning_distplan.strategies.dp_ga import DPGAStrategy, Rechunking, accumulation_scheduled, few_names, loader_batch_size

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.planner import Candidate
    from lightning_distplan.profile import Profile

__all__ = ["PlanningCallback", "plan_micro_batching", "rank_micro_batching", "alternative_message", "apply_dp_ga_plan", "AppliedPlan"]

Auto = Literal["auto"]


class PlanningCallback(Callback):
    """Profile at the start of ``fit``, then run the best micro-batch size / accumulation for the
    global batch within the trainer's own strategy (ddp, fsdp, single device, ...).

    Args:
        micro_batch_size: pin the micro-batch size (``"auto"``: planned).
        accumulate_grad_batches: pin the accumulation (``"auto"``: planned).
        device_memory_bytes: memory of one device the plan must fit in (default: the device's own).
        profile_repeats: timed runs per profiled micro-batch size.
        apply: ``False`` only reports (and writes the JSON files), changing nothing.

    Example::

        trainer = L.Trainer(strategy="ddp", devices=4, callbacks=[PlanningCallback()])
    """

    def __init__(
        self,
        *,
        micro_batch_size: int | Auto = "auto",
        accumulate_grad_batches: int | Auto = "auto",
        device_memory_bytes: int | None = None,
        profile_repeats: int = 1,
        apply: bool = True,
    ) -> None:
        micro_batch_size = check_count("micro_batch_size", micro_batch_size, auto=True)
        accumulate_grad_batches = check_count("accumulate_grad_batches", accumulate_grad_batches, auto=True)
        profile_repeats = check_count("profile_repeats", profile_repeats)
        device_memory_bytes = check_memory("device_memory_bytes", device_memory_bytes)
        if not isinstance(apply, bool):
            raise InfeasiblePlanError(f"`apply` must be True or False, got {apply!r}.", hint="Pass apply=False to only report the plan.")
        self._pins = pins_from(micro_batch_size=micro_batch_size, accumulate_grad_batches=accumulate_grad_batches)
        self._memory = device_memory_bytes
        self._repeats = profile_repeats
        self._apply = apply
        self.outcome: PlanningOutcome | None = None
        """The dp_ga plan chosen for this run, with the ranked candidates."""
        self.alternative: tuple[Candidate, float] | None = None
        """(best plan of another strategy, its predicted speed-up) when one is predicted faster."""
        self.overhead_s: float | None = None
        self.run_s: float | None = None
        self._applied: AppliedPlan | None = None
        self._fit_start: float | None = None
        self._resuming: dict[str, Any] | None = None
        self._memory_limit: int | None = None  # the device memory the running plan was made for (stored with it)

    @property
    def plan(self) -> Plan | None:
        """The plan this fit runs (``None`` before ``fit`` and after a fit it did not plan). Under ``ddp_spawn`` the
        callback that planned is a copy in the spawned processes, so this one stays ``None``: read
        ``<default_root_dir>/distplan/plan.json``."""
        return None if self.outcome is None else self.outcome.plan

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        destroy_process_groups_at_exit()  # under the user's gloo DDP too (Lightning destroys NCCL groups only)
        self._fit_start = time.perf_counter()
        # a callback used again reports this fit only, also where this fit does not plan (manual optimization, a
        # loader without a batch size, a refusal below); a resumed checkpoint is kept (on_load_checkpoint comes later)
        self.outcome = self.alternative = None
        self.overhead_s = self.run_s = None
        self._memory_limit = None
        from lightning.pytorch.callbacks import BatchSizeFinder

        from lightning_distplan.strategies.auto_plan import AutoPlanStrategy
        from lightning_distplan.strategies.pipeline import PipelineStrategy

        if isinstance(trainer.strategy, (DPGAStrategy, AutoPlanStrategy, PipelineStrategy)):
            # under a pipeline it planned data parallel for a global batch the pipeline does not run; under auto_plan its
            # accumulation was taken for the user's (4 steps of 16 became 1 of 64)
            raise InfeasiblePlanError(
                f"PlanningCallback cannot re-plan under {type(trainer.strategy).__name__}, which sets the micro-batches itself.",
                hint="Drop the callback (strategy='auto_plan' profiles and plans everything), or keep it with strategy='ddp', "
                "'fsdp' or a single device.",
            )
        if accumulation_scheduled(trainer):
            raise InfeasiblePlanError(
                "PlanningCallback sets accumulate_grad_batches, which a GradientAccumulationScheduler callback also changes.",
                hint="Use one of the two.",
            )
        if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
            # it plans when the strategy sets up; the finder changes the loader's batch later, at on_fit_start, and the
            # plan's accumulation would then multiply the batch it found (the global batch silently doubled)
            raise InfeasiblePlanError(
                "PlanningCallback plans for the train loader's batch size at the start of the fit, which a BatchSizeFinder "
                "then changes.",
                hint="Find the batch size in a fit without the callback (Tuner(trainer).scale_batch_size(model)), then set it "
                "and fit with PlanningCallback.",
            )
        nothing = trains_nothing(trainer)
        if nothing is not None:  # Lightning skips the training: no plan to make for it
            rank_zero_info(f"PlanningCallback: this fit trains no batch ({nothing}), so nothing is profiled or planned.")
            return
        if not pl_module.automatic_optimization:
            rank_zero_warn(
                f"PlanningCallback: {type(pl_module).__name__} uses manual optimization (automatic_optimization=False), so there is "
                "nothing to plan (micro-batches and accumulation need it): the callback does nothing in this fit."
            )
            return
        # Lightning calls this hook before the LightningModule's own setup() and configure_model() (where datasets
        # and layers are often built): plan when the strategy sets up, after both, as auto_plan does.
        strategy = trainer.strategy
        original = strategy.setup

        def plan_then_setup(trainer: pl.Trainer) -> None:
            strategy.__dict__.pop("setup", None)
            self._plan(trainer, pl_module)
            original(trainer)

        strategy.setup = plan_then_setup  # type: ignore[method-assign]

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = fresh_train_loader(trainer)
        if loader_batch_size(loader) is None:
            rank_zero_warn(
                "PlanningCallback: the train dataloader's batch size cannot be read (no `batch_size` on it or on its "
                "batch_sampler, e.g. batch_size=None over ready-made batches), so there is no global batch to plan for: "
                "the fit runs your loader as it is. Give the DataLoader a batch_size to have it planned."
            )
            return
        reused = self._checkpoint_plan(trainer, loader) if self._apply else None
        nothing = None if reused is not None else trains_nothing(trainer, self._resuming)
        if nothing is not None:  # resumed where its limits are reached: Lightning restores the progress after this
            rank_zero_info(f"PlanningCallback: this fit trains no batch ({nothing} reached by the checkpoint it resumes), "
                           "so nothing is profiled or planned.")
            self._resuming = None
            return
        if reused is not None:  # DESIGN §3.5: a resumed fit keeps the plan it ran, without profiling again
            self.outcome, self.alternative = PlanningOutcome(plan=reused, source="checkpoint"), None
            limit = stored_plan_context(self._resuming or {}).get("memory_limit_bytes")
            self._memory_limit = limit if isinstance(limit, int) else None
            rank_zero_info(f"PlanningCallback: resuming with the checkpoint's plan {reused.describe()}; not profiling again.")
        else:
            self.outcome, self.alternative = plan_micro_batching(
                trainer, pl_module, pins=self._pins, device_memory_bytes=self._memory, repeats=self._repeats, loader=loader
            )
            hardware = self.outcome.hardware
            self._memory_limit = None if hardware is None else int(hardware.device_memory_bytes)
        if self._apply:
            self._applied = apply_dp_ga_plan(trainer, self.outcome.plan)
            from lightning_distplan.callbacks.monitor import StepTimeMonitor

            for monitor in (cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor)):
                # the steps set beside the plan's prediction (no fit_start: this callback reports its own overhead)
                monitor.attach(outcome=self.outcome, profile=None, pins=self._pins, device_memory_bytes=self._memory, fit_start=None,
                               replannable=False)
            if self._resuming is not None:  # the checkpoint was restored before the plan existed
                self._applied.rechunk.resumed(self._resuming)
        self._resuming = None

    def _checkpoint_plan(self, trainer: pl.Trainer, loader: Any) -> Plan | None:
        """The plan stored in the checkpoint this fit resumes from, when it suits this fit (decided on rank 0), else None."""
        checkpoint = self._resuming
        stored = None if checkpoint is None else readable_plan(checkpoint, "PlanningCallback")
        why = None
        if stored is not None:
            global_batch = user_global_batch(loader_batch=loader_batch_size(loader), accumulate=trainer.accumulate_grad_batches,
                                             world_size=trainer.world_size)
            why = unsuited_plan(stored, strategies=("dp_ga",), pins=self._pins)
            if why is None and (stored.dp != trainer.world_size or stored.global_batch_size != global_batch):
                why = f"it does not fit this run ({trainer.world_size} devices, global batch {global_batch})"
            if why is None:
                why = made_for_another_run(
                    stored_plan_context(checkpoint), precision=getattr(trainer.strategy.precision_plugin, "precision", None),
                    memory_bytes=device_memory(self._memory, trainer.strategy.root_device),
                )
            why = trainer.strategy.broadcast(why)
            if why is not None:
                rank_zero_info(f"PlanningCallback: not resuming with the checkpoint's plan {stored.describe()}: {why}; profiling and planning again.")
        return stored if stored is not None and why is None else None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._applied is not None:
            self._applied.rechunk.train_start()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._applied is not None:  # the epoch's progress in the user's loader batches, not our micro-batches
            self._applied.rechunk.progress_to_user_units(checkpoint)
            if self.outcome is not None and PLAN_KEY not in checkpoint:  # the plan that ran, and what it was made for
                context: dict[str, Any] = {"precision": getattr(trainer.strategy.precision_plugin, "precision", None)}
                if self._memory_limit is not None:
                    context["memory_limit_bytes"] = self._memory_limit
                add_portable_state(checkpoint, plan=self.outcome.plan, optimizer_states_by_name=None, context=context)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._applied is not None:
            self._applied.rechunk.resumed(checkpoint)
        else:
            self._resuming = checkpoint  # restored before the strategy's setup, where the plan is made

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit_start is None or self.outcome is None:
            return
        self.run_s = time.perf_counter() - self._fit_start
        self.overhead_s = self.outcome.overhead_s
        rank_zero_info(
            f"PlanningCallback: planning overhead {self.overhead_s:.2f} s = {100 * self.overhead_s / max(self.run_s, 1e-9):.1f}% "
            f"of this fit ({self.run_s:.1f} s)."
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook of callbacks after an exception: a Trainer fitted again kept the plan's
        # accumulate_grad_batches as the user's and planned for a larger global batch
        self._restore(trainer)

    def _restore(self, trainer: pl.Trainer) -> None:
        trainer.strategy.__dict__.pop("setup", None)  # a fit that failed before the strategy's setup
        self._resuming = None
        if self._applied is not None:
            self._applied.restore(trainer)
            self._applied = None


def plan_micro_batching(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    *,
    pins: dict[str, Any] | None = None,
    device_memory_bytes: int | None = None,
    repeats: int = 1,
    loader: Any = None,
) -> tuple[PlanningOutcome, tuple[Candidate, float] | None]:
    """Profile ``module`` inside this fit, choose the best ``dp_ga`` plan for the user's global batch
    (rank 0 decides, all ranks get it), write ``profile.json`` / ``plan.json``, log, and report a
    faster plan of another strategy if there is one. Every rank must call it. ``loader``: a fresh instance
    of the user's train loader to profile with (default: one made here)."""
    strategy = trainer.strategy
    world = trainer.world_size
    check_artifact_dir(trainer, "PlanningCallback")
    t0 = time.perf_counter()
    profile, loader = profile_in_fit(
        trainer, module, device=strategy.root_device, repeats=repeats, measure_links=world > 1, log_prefix="PlanningCallback", loader=loader
    )
    profiling_s = time.perf_counter() - t0
    global_batch = user_global_batch(loader_batch=loader_batch_size(loader), accumulate=trainer.accumulate_grad_batches, world_size=world,
                                     hint="Give the train DataLoader a batch_size (or a batch_sampler with one).")
    t1 = time.perf_counter()
    decision: Any = None
    if trainer.is_global_zero:
        try:
            decision = ("ok", *rank_micro_batching(profile, world_size=world, global_batch_size=global_batch, pins=pins,
                                                   device_memory_bytes=device_memory_bytes, ddp_bucket_bytes=ddp_bucket_bytes(strategy),
                                                   ranks_per_host=ranks_per_node(trainer)))
        except Exception as err:  # every rank raises the same error
            decision = ("error", err)
    decision = strategy.broadcast(decision)
    if decision[0] == "error":
        raise decision[1]
    _, candidates, hardware, alternative = decision
    outcome = PlanningOutcome(
        plan=candidates[0].plan, candidates=tuple(candidates), hardware=hardware, source="profiled",
        profiling_s=profiling_s, planning_s=time.perf_counter() - t1,
    )
    extra: dict[str, Any] = {"running_strategy": type(strategy).__name__}
    if alternative is not None:
        cand, speedup = alternative
        extra["faster_alternative"] = {"message": alternative_message(alternative), "speedup": speedup, **cand.to_dict()}
    if trainer.is_global_zero:
        write_artifacts(distplan_dir(trainer), profile=profile, outcome=outcome, extra=extra)
    log_outcome(outcome, prefix="PlanningCallback")
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)  # a DDPStrategy's arguments for DistributedDataParallel
    if profile.unused_parameters and isinstance(ddp_kwargs, dict) and not ddp_kwargs.get("find_unused_parameters"):
        rank_zero_warn(
            f"PlanningCallback: training_step's loss gives no gradient to {few_names(profile.unused_parameters)}, which "
            f"{type(strategy).__name__}'s DistributedDataParallel refuses at the second step. HINT: Use "
            "strategy='ddp_find_unused_parameters_true' (or the strategy's find_unused_parameters=True), or set requires_grad=False on them."
        )
    if alternative is not None:
        rank_zero_warn(f"PlanningCallback: {extra['faster_alternative']['message']} (running {outcome.plan.describe()}).")
    return outcome, alternative


def rank_micro_batching(
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    pins: dict[str, Any] | None = None,
    device_memory_bytes: int | None = None,
    ddp_bucket_bytes: int | None = None,
    ranks_per_host: int | None = None,
) -> tuple[list[Candidate], Hardware, tuple[Candidate, float] | None]:
    """The ranked ``dp_ga`` plans, the hardware they were priced on, and — ranking every strategy on
    the same hardware without pins — a faster plan of another strategy with its speed-up, if any (pure)."""
    dp, hardware = choose_plan(
        profile, world_size=world_size, global_batch_size=global_batch_size, pins=pins,
        device_memory_bytes=device_memory_bytes, strategies=("dp_ga",), ddp_bucket_bytes=ddp_bucket_bytes,
        ranks_per_host=ranks_per_host,
    )
    try:
        everything, _ = choose_plan(profile, world_size=world_size, global_batch_size=global_batch_size, hardware=hardware)
    except InfeasiblePlanError:
        everything = dp
    return dp, hardware, faster_alternative(everything, dp[0].plan)


def alternative_message(alternative: tuple[Candidate, float]) -> str:
    """``"1f1b with 2 stages (...) is predicted 1.7x faster: use strategy='auto_plan'"``."""
    cand, speedup = alternative
    return f"{describe_for_user(cand.plan)} is predicted {speedup:.1f}x faster: use strategy='auto_plan'"


@dataclass
class AppliedPlan:
    """What :func:`apply_dp_ga_plan` changed, so that :meth:`restore` can put it back."""

    strategy: Any
    own_methods: dict[str, Callable[..., Any] | None]  # the instance's own attributes that were replaced (None: there was none)
    accumulate_grad_batches: int
    rechunk: Rechunking

    def restore(self, trainer: pl.Trainer) -> None:
        try:
            for name, own in self.own_methods.items():
                if own is not None:
                    setattr(self.strategy, name, own)
                else:
                    self.strategy.__dict__.pop(name, None)
        finally:
            self.rechunk.restore(trainer)  # first: it puts back the plan's accumulate_grad_batches where it steered a step
            trainer.accumulate_grad_batches = self.accumulate_grad_batches


def apply_dp_ga_plan(trainer: pl.Trainer, plan: Plan) -> AppliedPlan:
    """Run ``plan``'s micro-batch size and accumulation under the trainer's current strategy.

    The strategy's ``process_dataloader`` (called by Lightning after it injected the distributed
    sampler) is wrapped on this instance so train loaders are re-chunked into ``plan.micro_batch_size``
    samples by ``dp_ga``'s loader wrapper; ``trainer.accumulate_grad_batches`` becomes the plan's.
    ``on_train_batch_start`` and ``training_step`` are wrapped too, to weigh a short last loader
    batch as the user's run does (:class:`~lightning_distplan.strategies.dp_ga.Rechunking`).
    When applying fails part-way, what was changed is put back before the error propagates.
    """
    strategy = trainer.strategy
    names = ("process_dataloader", "on_train_batch_start", "training_step")
    rechunk = Rechunking()
    rechunk.remember(trainer)
    applied = AppliedPlan(
        strategy=strategy,
        own_methods={name: strategy.__dict__.get(name) for name in names},
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        rechunk=rechunk,
    )
    original = strategy.process_dataloader
    original_batch_start = strategy.on_train_batch_start
    original_step = strategy.training_step
    weight = plan.accumulate_grad_batches / applied.accumulate_grad_batches

    first: list[int] = []  # the batch size of the fit's first train loader

    def process_dataloader(dataloader: object) -> object:
        dataloader = original(dataloader)
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        b = loader_batch_size(dataloader)
        refusal = None
        if b is not None and first and b != first[0]:
            # the plan's micro-batches and accumulation would silently keep the first loader's global batch; maybe on
            # this rank alone (a loader of each rank's own), so raised on every rank where the wrap's set-up agrees
            refusal = reloaded_loader_error(b, first[0], plan, planner="PlanningCallback", hint="drop PlanningCallback.")
        if b is not None and not first:
            first.append(b)
        return rechunk.wrap(trainer, dataloader, plan.micro_batch_size, weight=weight, refusal=refusal)

    def on_train_batch_start(batch: Any, batch_idx: int) -> None:
        original_batch_start(batch, batch_idx)
        rechunk.start_batch()

    def training_step(*args: Any, **kwargs: Any) -> Any:
        return rechunk.weigh(original_step(*args, **kwargs))

    try:
        strategy.on_train_batch_start = on_train_batch_start
        strategy.training_step = training_step
        strategy.process_dataloader = process_dataloader
        trainer.accumulate_grad_batches = plan.accumulate_grad_batches
        rank_zero_info(
            f"PlanningCallback: running micro-batches of {plan.micro_batch_size} with accumulate_grad_batches="
            f"{plan.accumulate_grad_batches} (global batch {plan.global_batch_size})."
        )
    except BaseException:  # no AppliedPlan reaches the caller to restore: undo what was changed (a Ctrl-C included)
        applied.restore(trainer)
        raise
    return applied
