"""``auto_plan``: profile the model at the start of ``fit``, pick the best plan, run it — no relaunch.

Mechanism (Lightning 2.x ``Trainer._run``): ``AutoPlanStrategy`` is a ``DDPStrategy``, so Lightning's
own launcher, cluster environment and process-group setup run unchanged
(``setup_environment`` → ``init_process_group``). The trainer then calls the LightningModule's and
datamodule's ``setup`` hooks, restores the checkpoint's weights (``ckpt_path=``), and calls
``strategy.setup(trainer)``; that is where this strategy works, in every process:

1. resume: a checkpoint written by any strategy of this package holds ``checkpoint["distplan_plan"]``
   (read in :meth:`load_checkpoint`); when it fits this world size and global batch it is run as
   is — nothing is profiled (DESIGN §3.5).
2. otherwise profile the module on this rank's device with real batches from a fresh instance of
   the user's train loader (:func:`~lightning_distplan.profiling.profile_module`, which also measures
   the live process group's links), leaving no trace (weights, optimizer, RNG, loader, counters);
3. rank the plans for the actual world size and the user's global batch (loader batch ×
   ``accumulate_grad_batches`` × world size, unless ``global_batch_size=`` is given) on global rank 0
   only, and broadcast the winner, so every rank runs the same plan;
4. write ``profile.json`` and ``plan.json`` under ``<default_root_dir>/distplan/`` (rank 0) and log the
   plan and the best alternatives once;
5. build the concrete strategy — :class:`~lightning_distplan.strategies.DPGAStrategy` or
   :class:`~lightning_distplan.strategies.pipeline.PipelineStrategy` (incl. hybrid dp × pp) — sharing
   this strategy's accelerator, devices, cluster environment, checkpoint IO, precision plugin,
   launcher and process group, put it in the trainer's place (``trainer.strategy`` reads
   ``trainer._accelerator_connector.strategy``) and call its ``setup(trainer)``. Everything after
   (dataloader processing, steps, checkpoints, teardown) is the concrete strategy's.

A fit that trains no batch (``max_epochs=0``, ``max_steps=0``, ``limit_train_batches=0``, or one resumed from a
checkpoint that already reached ``max_epochs`` / ``max_steps``: Lightning's fit loop skips it) is neither profiled nor
planned; it runs as plain DDP, as a fit with manual optimization does.

A :class:`~lightning_distplan.callbacks.StepTimeMonitor` is added to the trainer's callbacks: it logs
predicted vs observed step time and, with ``replan="auto"``, re-plans at an epoch boundary when
the two depart.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES, Plan
from lightning_distplan.profile import unsplittable
from lightning_distplan.strategies._auto_concrete import (
    RESUME_KEY,
    _AutoPipelineStrategy,
    build_concrete,
    loader_shortfall,
    samples_per_rank,
)
from lightning_distplan.strategies._auto_planning import (
    PlanningOutcome,
    check_boundaries,
    check_count,
    check_memory,
    check_sizes,
    choose_plan,
    ddp_bucket_bytes,
    device_memory,
    distplan_dir,
    jsonable_pins,
    log_outcome,
    made_for_another_run,
    pins_from,
    profile_in_fit,
    ranks_per_node,
    trains_nothing,
    unsuited_plan,
    user_global_batch,
    write_artifacts,
)
from lightning_distplan.strategies._checkpoint import PLAN_KEY, read_checkpoint, readable_plan, stored_plan_context
from lightning_distplan.strategies._checkpoint_io import AtomicSaves
from lightning_distplan.strategies._exit import destroy_process_groups_at_exit
from lightning_distplan.strategies._pipeline_checkpoint import refuse_partial_module
from lightning_distplan.strategies.dp_ga import (
    PROGRESS_KEY,
    accumulation_scheduled,
    check_ddp_kwargs,
    few_names,
    loader_batch_size,
    unused_parameters_named,
)
from lightning_distplan.strategies.pipeline import PIPELINE_PRECISIONS, pipeline_callback_conflicts

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.strategies import Strategy

    from lightning_distplan.planner import Candidate
    from lightning_distplan.profile import Profile

__all__ = ["AutoPlanStrategy"]

Auto = Literal["auto"]


class AutoPlanStrategy(AtomicSaves, DDPStrategy):
    """Profile, plan and run the best data-parallel or pipeline plan, all inside ``trainer.fit``.

    Every argument left at ``"auto"`` is chosen by the planner; any other value pins that part of
    the plan (an impossible pin raises :class:`~lightning_distplan.InfeasiblePlanError` with a HINT).

    Args:
        strategy: ``"dp_ga"``, ``"gpipe"`` or ``"1f1b"``.
        schedule: ``"none"`` (data parallel), ``"gpipe"`` or ``"1f1b"``.
        stages: pipeline stages ``pp`` (1 = data parallel).
        micro_batch_size: samples per forward/backward on one device.
        accumulate_grad_batches: micro-batches accumulated per replica (data parallel plans).
        n_microbatches: micro-batches per pipeline schedule.
        stage_boundaries: index of the first profiled layer of stages 1..pp-1.
        global_batch_size: samples per optimizer step; default: the user's loader batch ×
            ``Trainer(accumulate_grad_batches)`` × world size.
        device_memory_bytes: memory of one device the plan must fit in (default: the device's own;
            on CPU the host RAM).
        replan: ``"off"``, or ``"auto"`` to re-plan at the next epoch boundary when observed step
            times depart from the prediction (see :class:`~lightning_distplan.callbacks.StepTimeMonitor`).
        profile_repeats: timed runs per profiled micro-batch size (the whole step keeps their mean).
        profile_micro_batch_sizes: sizes to profile; default: b/4, b/2 and b for the loader batch b.
        deferred_batchnorm: passed to the pipeline strategy when a pipeline is chosen.
        **ddp_kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and to the
            ``dp_ga`` strategy when chosen), e.g. ``process_group_backend``, ``find_unused_parameters``.

    Example::

        trainer = L.Trainer(strategy="auto_plan", accelerator="cpu", devices=2)
        trainer.fit(model, datamodule)
        trainer.strategy.plan          # the Plan that ran
    """

    strategy_name = "auto_plan"

    def __init__(
        self,
        strategy: Literal["auto", "dp_ga", "gpipe", "1f1b"] = "auto",
        schedule: Literal["auto", "none", "gpipe", "1f1b"] = "auto",
        stages: int | Auto = "auto",
        micro_batch_size: int | Auto = "auto",
        accumulate_grad_batches: int | Auto = "auto",
        n_microbatches: int | Auto = "auto",
        stage_boundaries: Sequence[int] | Auto = "auto",
        global_batch_size: int | Auto = "auto",
        device_memory_bytes: int | None = None,
        replan: Literal["off", "auto"] = "off",
        profile_repeats: int = 1,
        profile_micro_batch_sizes: Sequence[int] | None = None,
        deferred_batchnorm: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        if ddp_kwargs.get("start_method", "popen") != "popen":
            # A spawn launcher hands rank 0's (for a pipeline: one stage's) weights back to the main
            # process through the strategy it was built with; after the swap that would be wrong.
            raise InfeasiblePlanError(
                f"AutoPlanStrategy runs with start_method='popen' (Lightning re-launches the script, as for strategy='ddp'), got {ddp_kwargs['start_method']!r}.",
                hint="Leave start_method at its default, or launch the processes yourself with torchrun / SLURM.",
            )
        check_ddp_kwargs(ddp_kwargs, "AutoPlanStrategy")
        # All of them to DDPStrategy, which keeps those it does not take for DistributedDataParallel: LightningCLI /
        # jsonargparse follow this call to offer them (--trainer.strategy.find_unused_parameters true).
        super().__init__(**ddp_kwargs)
        if strategy != "auto" and strategy not in STRATEGIES:
            raise InfeasiblePlanError(f"Unknown strategy {strategy!r}.", hint=f"Use 'auto' or one of {', '.join(STRATEGIES)}.")
        if schedule not in ("auto", "none", "gpipe", "1f1b"):
            raise InfeasiblePlanError(f"Unknown schedule {schedule!r}.", hint="Use 'auto', 'none', 'gpipe' or '1f1b'.")
        stages = check_count("stages", stages, auto=True)
        micro_batch_size = check_count("micro_batch_size", micro_batch_size, auto=True)
        accumulate_grad_batches = check_count("accumulate_grad_batches", accumulate_grad_batches, auto=True)
        n_microbatches = check_count("n_microbatches", n_microbatches, auto=True)
        global_batch_size = check_count("global_batch_size", global_batch_size, auto=True)
        profile_repeats = check_count("profile_repeats", profile_repeats)
        profile_sizes = check_sizes("profile_micro_batch_sizes", profile_micro_batch_sizes)
        device_memory_bytes = check_memory("device_memory_bytes", device_memory_bytes)
        if strategy != "auto" and schedule != "auto" and schedule != ("none" if strategy == "dp_ga" else strategy):
            raise InfeasiblePlanError(
                f"strategy={strategy!r} contradicts schedule={schedule!r}.",
                hint="Pin one of them: strategy='dp_ga' is schedule='none', strategy='gpipe' / '1f1b' the schedule of that name.",
            )
        boundaries = check_boundaries(stage_boundaries)
        if not isinstance(deferred_batchnorm, bool):
            raise InfeasiblePlanError(f"`deferred_batchnorm` must be True or False, got {deferred_batchnorm!r}.", hint="Pass deferred_batchnorm=True.")
        if replan not in ("off", "auto"):
            raise InfeasiblePlanError(f"`replan` must be 'off' or 'auto', got {replan!r}.", hint="Pass replan='auto' to re-plan when step times drift.")
        self._pins = pins_from(
            strategy=strategy, schedule=schedule, stages=stages, micro_batch_size=micro_batch_size,
            accumulate_grad_batches=accumulate_grad_batches, n_microbatches=n_microbatches,
            stage_boundaries=boundaries,
        )
        self._global_batch_arg = None if global_batch_size == "auto" else global_batch_size
        self._device_memory_bytes = device_memory_bytes
        self._replan = replan
        self._profile_repeats = profile_repeats
        self._profile_sizes = profile_sizes
        self._extra_ddp_kwargs = {k: v for k, v in ddp_kwargs.items() if k not in _DDP_BASE_ARGS}
        self._pipeline_kwargs = {"deferred_batchnorm": deferred_batchnorm}
        self._checkpoint_plan: Plan | None = None
        self._checkpoint_context: dict[str, Any] = {}
        self._resuming: dict[str, Any] | None = None  # what Rechunking.resumed reads of the checkpoint the fit restores
        self._outcome: PlanningOutcome | None = None
        self._profile: Profile | None = None
        self._concrete: Strategy | None = None
        self._monitor: Any = None
        self._fit_start: float | None = None
        self._strategies: tuple[str, ...] = STRATEGIES  # what this fit may run (_strategies_allowed); a re-plan ranks these only

    # -- public --------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan chosen for this run (``None`` before ``fit`` reached ``setup``)."""
        return None if self._outcome is None else self._outcome.plan

    @property
    def outcome(self) -> PlanningOutcome | None:
        """The plan with its ranked candidates, hardware and planning time."""
        return self._outcome

    @property
    def profile(self) -> Profile | None:
        """The profile measured in this run (``None`` when the plan came from a checkpoint)."""
        return self._profile

    @property
    def concrete(self) -> Strategy | None:
        """The strategy this one turned into (also ``trainer.strategy`` after ``setup``)."""
        return self._concrete

    @property
    def pins(self) -> dict[str, Any]:
        return dict(self._pins)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        checkpoint = read_checkpoint(load, checkpoint_path, strategy=self)  # a file cut short or not Lightning's: one sentence
        self._checkpoint_plan = readable_plan(checkpoint, "auto_plan")
        self._checkpoint_context = stored_plan_context(checkpoint)
        # not the weights; the loops too: Rechunking.resumed tells by their progress whether Lightning restored them yet
        self._resuming = {k: checkpoint[k] for k in (PROGRESS_KEY, PLAN_KEY, RESUME_KEY, "loops", "global_step") if k in checkpoint}
        return checkpoint

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # Added here, before Lightning restores callback states from `ckpt_path`, so that a resumed
            # fit gets the monitor's state back (not a warning asking the user to add a callback we own).
            self._monitor_for(trainer)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            # Nothing to plan for evaluation/prediction without a fit: behave like DDP.
            rank_zero_info("auto_plan: not fitting, running as plain DDP (plans are made at the start of fit).")
            super().setup(trainer)
            return
        assert self.accelerator is not None and self.lightning_module is not None
        name = type(self.lightning_module).__name__
        if self._checkpoint_plan is None and (nothing := trains_nothing(trainer, self._resuming)) is not None:
            # Lightning skips the training ("`Trainer.fit` stopped: `max_epochs=0` reached."): no plan to make for it
            rank_zero_info(f"auto_plan: this fit trains no batch ({nothing}), so nothing is profiled or planned: running as plain DDP.")
            super().setup(trainer)
            return
        why = None
        if not self.lightning_module.automatic_optimization:
            # Micro-batches, accumulation and pipelines all need Lightning to run backward and the optimizer.
            why = f"{name} uses manual optimization (automatic_optimization=False)"
        elif accumulation_scheduled(trainer):
            why = "a GradientAccumulationScheduler changes the accumulation (the global batch) during the fit"
        if why is not None:
            if self._pinned_anything():
                raise InfeasiblePlanError(
                    f"{why}, so there is no micro-batch, accumulation or pipeline to plan, but AutoPlanStrategy was given pins {self._pins}.",
                    hint="Drop the pins (auto_plan then runs plain DDP), or drop what stops the planning.",
                )
            rank_zero_warn(f"auto_plan: {why}, so there is nothing to plan: running as plain DDP, your batches as they are.")
            super().setup(trainer)
            return
        self._fit_start = time.perf_counter()
        refuse_partial_module(self.lightning_module)  # what a failed pipeline fit left holds one stage's weights; never profile it
        self.accelerator.setup(trainer)
        self.model_to_device()
        outcome = self._decide(trainer)
        self._outcome = outcome
        concrete = build_concrete(
            self,
            outcome.plan,
            user_accumulate=trainer.accumulate_grad_batches,
            ddp_kwargs=self._ddp_kwargs_for(outcome),
            pipeline_kwargs=self._pipeline_kwargs,
        )
        self._concrete = concrete
        concrete.plan_unused_parameters = outcome.unused_parameters  # type: ignore[union-attr]  # both concrete kinds have it
        later = concrete.later_fits  # type: ignore[union-attr]  # both concrete kinds have it
        later.given_global_batch, later.outcome, later.attach = self._global_batch_arg is not None, outcome, self._attach_again
        # what the plan was made for, stored with it in checkpoints (a reused plan keeps its own)
        concrete.plan_memory_limit_bytes = (  # type: ignore[attr-defined]  # both concrete kinds have it
            outcome.hardware.device_memory_bytes if outcome.hardware is not None else self._checkpoint_context.get("memory_limit_bytes")
        )
        if self._resuming is not None:
            concrete._rechunk.resumed(self._resuming)  # type: ignore[union-attr]  # both concrete kinds re-chunk the loader
            if isinstance(concrete, _AutoPipelineStrategy):  # where inside a loader batch a mid-epoch checkpoint's step ended
                concrete.resumed_record = self._resuming.get(RESUME_KEY)
        self._attach_monitor(trainer, outcome, fit_start=self._fit_start)
        trainer._accelerator_connector.strategy = concrete
        concrete.setup(trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # runs only where auto_plan fell back to plain DDP (the plan's strategy takes the Trainer's place otherwise)
        with unused_parameters_named(self, "AutoPlanStrategy"):
            return super().training_step(*args, **kwargs)

    def _ddp_kwargs_for(self, outcome: PlanningOutcome) -> dict[str, Any]:
        """The DistributedDataParallel arguments of the plan's strategy: the user's, and ``find_unused_parameters=True``
        where the profiled loss left trainable parameters without a gradient (DDP refuses those at the second step
        otherwise), unless the user set it."""
        kwargs = self._extra_ddp_kwargs
        unused = outcome.unused_parameters
        if not unused or outcome.plan.strategy != "dp_ga" or "find_unused_parameters" in kwargs:
            return kwargs
        rank_zero_info(
            f"auto_plan: training_step's loss gives no gradient to {few_names(unused)}; "
            "running DistributedDataParallel with find_unused_parameters=True, which looks for them after every backward."
        )
        return {**kwargs, "find_unused_parameters": True}

    # -- planning ------------------------------------------------------------------------------
    def _made_for_another_run(self) -> str | None:
        """Why the checkpoint's plan was made for another run than this one (precision, less device memory), or None."""
        return made_for_another_run(
            self._checkpoint_context, precision=getattr(self.precision_plugin, "precision", None),
            memory_bytes=device_memory(self._device_memory_bytes, self.root_device),
        )

    def _decide(self, trainer: pl.Trainer) -> PlanningOutcome:
        from lightning_distplan.strategies._auto_planning import check_artifact_dir, fresh_train_loader

        world = self.world_size
        module = self.lightning_module
        assert module is not None
        check_artifact_dir(trainer, "auto_plan")
        stored = self._checkpoint_plan
        strategies = self._strategies = self._strategies_allowed(trainer)
        if stored is not None and (why := unsuited_plan(stored, strategies=strategies, pins=self._pins)):
            rank_zero_info(f"auto_plan: not resuming with the checkpoint's plan {stored.describe()}: {why}; profiling and planning again.")
            stored = None
        # decided on rank 0 for all: a rank that re-profiled while another reused the plan would wait in a collective
        if stored is not None and (why := self.broadcast(self._made_for_another_run())):
            rank_zero_info(f"auto_plan: not resuming with the checkpoint's plan {stored.describe()}: {why}; profiling and planning again.")
            stored = None
        if stored is not None:
            # Resume keeps the stored plan when it still fits: no profiling (DESIGN §3.5).
            loader = fresh_train_loader(trainer)
            global_batch = user_global_batch(
                loader_batch=loader_batch_size(loader), accumulate=trainer.accumulate_grad_batches, world_size=world,
                given=self._global_batch_arg,
            )
            if stored.world_size == world and stored.global_batch_size == global_batch:
                unused = self._checkpoint_context.get("unused_parameters", [])
                unused = tuple(unused) if isinstance(unused, list) and all(isinstance(n, str) for n in unused) else ()
                outcome = PlanningOutcome(plan=stored, source="checkpoint", unused_parameters=unused)
                rank_zero_info(f"auto_plan: resuming with the checkpoint's plan {stored.describe()}; not profiling again.")
                return outcome
            rank_zero_warn(
                f"auto_plan: the checkpoint's plan ({stored.describe()}, global batch {stored.global_batch_size}) does not fit "
                f"this run ({world} devices, global batch {global_batch}); profiling and planning again."
            )
        if self._pins:  # what the world size and the model alone refuse, before minutes of profiling
            from lightning_distplan._layers import find_pipeline_spec
            from lightning_distplan.planner import check_pins_before_profiling

            spec, why = find_pipeline_spec(module) if self._pipeline_pinned() else (None, None)
            check_pins_before_profiling(self._pins, world_size=world, split_reason=why if spec is None else None)
        t0 = time.perf_counter()
        def global_batch_of(loader: Any) -> int:
            global_batch = user_global_batch(
                loader_batch=loader_batch_size(loader), accumulate=trainer.accumulate_grad_batches, world_size=world,
                given=self._global_batch_arg,
            )
            if self._pins:  # the counts the global batch alone refuses, before minutes of profiling
                from lightning_distplan.planner import check_pins_before_profiling

                check_pins_before_profiling(self._pins, world_size=world, global_batch_size=global_batch)
            return global_batch

        profile, loader = profile_in_fit(
            trainer, module, device=self.root_device, micro_batch_sizes=self._profile_sizes, repeats=self._profile_repeats,
            log_prefix="auto_plan", global_batch_of=global_batch_of,
        )
        profiling_s = time.perf_counter() - t0
        self._profile = profile
        if world > 1 and not profile.splittable and not self._pipeline_pinned():  # a pinned one gets the planner's error
            rank_zero_info(f"auto_plan: planning data parallel only: {unsplittable(profile.split_reason)}.")
        global_batch = global_batch_of(loader)
        # Decide once, on global rank 0, and broadcast: timings differ slightly between ranks, the plan must not.
        t1 = time.perf_counter()
        decision: Any = None
        whole_epoch = isinstance(trainer.limit_train_batches, float) and trainer.limit_train_batches == 1.0  # not int 1
        whole_epochs = not self._pipeline_pinned() and whole_epoch
        # each rank's samples per epoch, for the pipelines whose replicas' stages hold other data (ruled out) and a
        # pipeline's skipped samples where each rank reads its own data (rank 0 decides from its loader alone): one
        # all-reduce, on every rank (the same settings and pins on each), wherever planning chooses which ranks form a
        # replica (a pipeline pinned by its strategy or schedule alone too); a pinned layout's loader set-up refuses such stages
        pipelines = world > 1 and strategies != ("dp_ga",) and not self._layout_pinned()
        samples = samples_per_rank(self.root_device, loader) if pipelines else None
        if self.is_global_zero:
            try:
                candidates, hardware = choose_plan(
                    profile, world_size=world, global_batch_size=global_batch, pins=self._pins,
                    device_memory_bytes=self._device_memory_bytes, strategies=strategies, ddp_bucket_bytes=ddp_bucket_bytes(self),
                    ranks_per_host=ranks_per_node(trainer),
                )
                if samples is not None:
                    candidates = replicas_of_other_data_last(candidates, samples)
                if whole_epochs:
                    # Trainer(use_distributed_sampler=False): each rank's loader is its own data (no public accessor)
                    sharding = getattr(trainer._accelerator_connector, "use_distributed_sampler", True)
                    candidates = whole_epochs_first(candidates, loader, distributed_sampler=sharding, samples=samples)
                decision = ("ok", candidates, hardware, profile.unused_parameters)
            except Exception as err:  # every rank must raise, not only rank 0
                decision = ("error", err)
        decision = self.broadcast(decision)
        if decision[0] == "error":
            raise decision[1]
        _, candidates, hardware, unused = decision
        outcome = PlanningOutcome(
            plan=candidates[0].plan, candidates=tuple(candidates), hardware=hardware, source="profiled",
            profiling_s=profiling_s, planning_s=time.perf_counter() - t1, unused_parameters=unused,
        )
        if self.is_global_zero:
            write_artifacts(distplan_dir(trainer), profile=profile, outcome=outcome, extra={"pins": jsonable_pins(self._pins)})
        log_outcome(outcome, prefix="auto_plan")
        return outcome

    def _pinned_anything(self) -> bool:
        return bool(self._pins) or self._global_batch_arg is not None or self._device_memory_bytes is not None

    def _pipeline_pinned(self) -> bool:
        pins = self._pins
        return pins.get("strategy", "dp_ga") != "dp_ga" or pins.get("schedule", "none") != "none" or pins.get("stages", pins.get("pp", 1)) > 1

    def _layout_pinned(self) -> bool:
        """Whether the pins fix the plan's ``pp`` (so ``dp``, and which ranks form a replica): ``stages`` or
        ``stage_boundaries``, or data parallel (``pp`` = 1). ``strategy="gpipe"`` or a pinned schedule alone counts as a
        pinned pipeline (:meth:`_pipeline_pinned`) but leaves ``pp`` to planning, which must then rule out the ``pp``
        whose replicas hold ranks of different data (:func:`replicas_of_other_data_last`): it had chosen such a ``pp``,
        whose fit was refused at set-up, beside one whose replicas were consistent."""
        pins = self._pins
        return (any(key in pins for key in ("stages", "pp", "dp", "stage_boundaries"))
                or pins.get("strategy") == "dp_ga" or pins.get("schedule") == "none")

    def _strategies_allowed(self, trainer: pl.Trainer) -> tuple[str, ...]:
        """The strategies to plan over: data parallel only where this fit rules pipelines out.

        - The precision: PipelineStrategy runs ``"32-true"``, ``"bf16-mixed"`` and ``"bf16-true"`` only.
        - Callbacks a pipeline cannot serve (:func:`~lightning_distplan.strategies.pipeline.pipeline_callback_conflicts`):
          a monitored metric it does not log, weight averaging over the whole model.

        A pinned pipeline that is ruled out is an error before profiling, not after.
        """
        reasons: list[tuple[str, str]] = []  # (why, what to do instead)
        if str(trainer.precision) not in PIPELINE_PRECISIONS:
            reasons.append(
                (f"the fit runs precision={trainer.precision!r} and pipelines run '32-true', 'bf16-mixed' or 'bf16-true' only", "use Trainer(precision='bf16-mixed')")
            )
        reasons.extend(pipeline_callback_conflicts(trainer.callbacks))
        if not reasons:
            return STRATEGIES
        why = "; ".join(r for r, _ in reasons)
        if self._pipeline_pinned():
            fixes = " and ".join(h for _, h in reasons)
            raise InfeasiblePlanError(
                f"A pipeline plan is pinned, but {why}.",
                hint=f"{fixes[0].upper()}{fixes[1:]}, or drop the pipeline pin to let auto_plan plan data parallel only.",
            )
        rank_zero_info(f"auto_plan: planning data parallel only: {why}.")
        return ("dp_ga",)

    def _monitor_for(self, trainer: pl.Trainer) -> Any:
        """The trainer's StepTimeMonitor: the user's own if given, else one added now."""
        from lightning_distplan.callbacks.monitor import StepTimeMonitor

        existing = [cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor)]
        if existing:
            if self._replan == "auto" and existing[0].replan != "auto":
                existing[0].replan = "auto"  # the strategy's explicit ask wins over the monitor's default
                rank_zero_info("auto_plan: your StepTimeMonitor re-plans (replan='auto'), as AutoPlanStrategy(replan='auto') asks.")
            return existing[0]
        monitor = StepTimeMonitor(replan=self._replan)
        # Before the checkpoint callbacks, which Lightning has put last: where ModelCheckpoint saves after the epoch's
        # last validation (val_check_interval < 1), the monitor re-plans in the same on_validation_end, and the checkpoint
        # where the next epoch starts must hold the plan that epoch runs (appended, it held the ending epoch's).
        from lightning.pytorch.callbacks import Checkpoint

        at = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks))
        trainer.callbacks.insert(at, monitor)
        return monitor

    def _attach_monitor(self, trainer: pl.Trainer, outcome: PlanningOutcome, *, fit_start: float | None = None) -> None:
        monitor = self._monitor_for(trainer)
        monitor.attach(
            outcome=outcome, profile=self._profile, pins=self._pins, device_memory_bytes=self._device_memory_bytes,
            fit_start=fit_start, strategies=self._strategies,
        )
        self._monitor = monitor

    def _attach_again(self, trainer: pl.Trainer, outcome: PlanningOutcome) -> None:
        """A later fit of the same Trainer runs ``outcome``'s plan on: no planning overhead to report for it."""
        self._attach_monitor(trainer, outcome, fit_start=None)


_DDP_BASE_ARGS = (
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "start_method",
)


def skipped_samples(plan: Plan, loader: object, *, distributed_sampler: bool, spread: tuple[int, int] | None = None) -> int:
    """Samples per replica and epoch a pipeline plan would not train that a DDP run of the user's ``loader`` (not yet
    sharded) trains (:func:`~lightning_distplan.strategies._auto_concrete.loader_shortfall`); 0 for dp_ga, which
    trains the short last batch, or where the loader's length is unknown.

    ``distributed_sampler``: the Trainer's ``use_distributed_sampler``. Where it is False the loader is its rank's own
    data, which DDP trains whole, and the figure is its samples per epoch beyond whole pipeline steps: read as one
    dataset that Lightning shards over the ranks, 20 samples per rank in steps of 8 on 2 replicas of 2 stages were said
    to skip 2 (they skip 4), and 24 per rank 4 (they skip none), which moved a pipeline that trains them all behind
    the other plans; under ``drop_last`` ones that skip samples were said to skip none.

    ``spread``: the fewest and most samples per epoch of the plan's replicas' loaders (of :func:`samples_per_rank`, their
    stages alike; None: rank 0's alone, one process or unknown). ``loader`` is rank 0's: where the replicas read data of their own, every replica
    stops after the steps the fewest fill, so the figure is the most beyond those (16 and 14 samples per rank in steps
    of 8: 8, where rank 0's own 16 said none and the pipeline ran first, skipping 8 and 6 that dp_ga trains)."""
    if plan.strategy == "dp_ga":
        return 0
    return loader_shortfall(loader, plan, sharded=False, distributed_sampler=distributed_sampler, spread=spread) or 0


def replica_samples(plan: Plan, samples: Sequence[int]) -> list[list[int]]:
    """Each replica's stages' samples per epoch under ``plan``, of the ranks' ``samples`` (:func:`samples_per_rank`, in
    global rank order): a replica's stages are consecutive ranks (``PipelineLayout.pipeline_ranks``); dp_ga's replicas
    are one rank each."""
    pp = 1 if plan.strategy == "dp_ga" else plan.pp
    return [list(samples[r * pp:(r + 1) * pp]) for r in range(len(samples) // pp)]


def replicas_of_other_data_last(candidates: Sequence[Candidate], samples: Sequence[int]) -> list[Candidate]:
    """``candidates`` with the pipelines whose replicas' stages hold different numbers of samples per epoch (``samples``:
    each rank's, :func:`samples_per_rank`) made infeasible and moved behind the feasible plans, said once where the
    first feasible one was; ranks renumbered. A replica's stages read the same batches together, so ranks of data of
    their own (``use_distributed_sampler=False``) that differ cannot be one replica: that pipeline's fit would be
    refused at its loader's set-up (``_agree_on_train_loader``), where a user who left the layout to planning (pinning
    nothing, or a pipeline's strategy or schedule alone) expects the plan that runs their data, dp_ga's (each rank its
    own data, as under DDP), or a pipeline whose replicas' stages hold alike.
    Planning had said such a pipeline "would skip up to the epoch's last 8 samples per replica" (one replica of 16 and
    12 samples in steps of 8), which no replica does; where no plan trained every sample it would have run it, and a
    pipeline so run hung where one stage's loader ended. No feasible plan left (every other one ruled out by the pins
    or memory): refused."""
    apart = {id(c): stages for c in candidates if c.prediction.feasible and c.plan.strategy != "dp_ga"
             for stages in [next((s for s in replica_samples(c.plan, samples) if len(set(s)) > 1), None)] if stages is not None}
    if not apart:
        return list(candidates)

    def ruled_out(c: Candidate) -> Candidate:
        stages = apart[id(c)]
        reason = (f"the ranks of one of its replicas hold different numbers of samples per epoch ({', '.join(map(str, stages))}), "
                  "and a replica's stages must read the same batches")
        return dataclasses.replace(c, prediction=dataclasses.replace(c.prediction, feasible=False, reason=reason))

    marked = [ruled_out(c) if id(c) in apart else c for c in candidates]
    feasible = [c for c in marked if c.prediction.feasible]
    first = next(c for c in candidates if c.prediction.feasible)
    if not feasible:
        raise InfeasiblePlanError(
            f"Every feasible plan is a pipeline, and the ranks' train loaders hold different numbers of samples per epoch "
            f"({', '.join(map(str, samples))}), so the stages of their replicas would read different data.",
            hint="Give every rank of a pipeline replica the same loader (use_distributed_sampler=True, or shard by "
            "trainer.strategy.distributed_sampler_kwargs), or make a data-parallel plan feasible (the planning table "
            "gives each one's reason: a pin, or memory).",
        )
    if id(first) in apart:
        rank_zero_info(
            f"auto_plan: not running {first.plan.describe()} (predicted {first.prediction.step_time_s:.4g} s/step): "
            f"{ruled_out(first).prediction.reason}; running {feasible[0].plan.describe()} "
            f"(predicted {feasible[0].prediction.step_time_s:.4g} s/step)."
        )
    order = feasible + [c for c in marked if not c.prediction.feasible]
    return [dataclasses.replace(c, rank=i + 1) for i, c in enumerate(order)]


def whole_epochs_first(candidates: Sequence[Candidate], loader: object, *, distributed_sampler: bool,
                       samples: Sequence[int] | None = None) -> list[Candidate]:
    """``candidates`` with the feasible pipelines that would skip an epoch's last samples moved behind the other feasible
    plans (the plan's math would differ from the user's run: DESIGN §3.1), said once; ranks renumbered. Each feasible
    plan carries the samples it would skip (``Candidate.skipped_samples``, moved or not: why_winner says why a slower
    plan won). ``distributed_sampler``: as :func:`skipped_samples`. ``samples``: each rank's samples per epoch
    (:func:`samples_per_rank`; None: rank 0's loader alone), read per plan as its replicas' (:func:`replica_samples`,
    their stages alike: :func:`replicas_of_other_data_last` ruled the others out), whose fewest and most are its
    ``spread``. Where its replicas hold different numbers, they skip different numbers, the figure their most: said as
    "up to" it (``skipped_samples_differ``; it said each replica skipped the most, 8 of 16 and 14 samples per rank in
    steps of 8, where one skips 6). Only there: the ranks' fewest and most, read for every plan, said "up to" of one
    replica whose stages differ (it has one figure, or none: its stages cannot run together)."""
    def spread(plan: Plan) -> tuple[int, int] | None:
        if samples is None or plan.strategy == "dp_ga":  # (dp_ga trains every sample: nothing skipped, the same or not)
            return None
        held = [stages[0] for stages in replica_samples(plan, samples)]
        return min(held), max(held)

    def marked_one(c: Candidate) -> Candidate:
        s = spread(c.plan)
        return dataclasses.replace(c, skipped_samples=skipped_samples(c.plan, loader, distributed_sampler=distributed_sampler, spread=s),
                                   skipped_samples_differ=s is not None and s[0] != s[1])

    marked = [marked_one(c) if c.prediction.feasible else c for c in candidates]
    feasible = [c for c in marked if c.prediction.feasible]
    keep = [c for c in feasible if not c.skipped_samples]
    if not feasible or not keep or keep[0] is feasible[0]:
        return marked
    first = feasible[0]
    n = first.skipped_samples
    rank_zero_info(
        f"auto_plan: not running {first.plan.describe()} (predicted {first.prediction.step_time_s:.4g} s/step): it would skip "
        f"{'up to ' if first.skipped_samples_differ else ''}the epoch's last {n} sample{'s' if n > 1 else ''} per replica, which your run trains; running "
        f"{keep[0].plan.describe()} (predicted {keep[0].prediction.step_time_s:.4g} s/step). Pin the pipeline to run it anyway."
    )
    kept = {id(c) for c in keep}
    order = keep + [c for c in feasible if id(c) not in kept] + [c for c in marked if not c.prediction.feasible]
    return [dataclasses.replace(c, rank=i + 1) for i, c in enumerate(order)]
