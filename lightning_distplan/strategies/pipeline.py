"""Pipeline-parallel training (GPipe or 1F1B, optionally hybrid dp × pp) as a Lightning strategy.

The runtime is ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
``Schedule1F1B``); this module only adapts it to Lightning's hooks.

How the hooks are used (Lightning automatic optimization, one ``training_step`` per optimizer step):

* ``setup``: broadcasts rank 0's weights (as DDP does), cuts the model into the
  :class:`~lightning_distplan.PipelineSpec`'s layers, keeps only this rank's stage (the other
  stages' parameters and buffers are freed in place), builds the process groups, then runs the
  module's own ``configure_optimizers`` and drops the freed parameters from the optimizer's param
  groups before it has any state. So the optimizer keeps the user's class and hyper-parameters
  and holds state for this stage only.
* ``training_step``: runs one whole pipeline schedule (``schedule.step``: forward *and* backward
  of all micro-batches of the per-replica batch) and returns the global mean loss, also logged as
  ``train_loss`` on every rank. The LightningModule's own ``training_step`` is not called: its
  loss is ``PipelineSpec.loss``.
* ``backward``: Lightning calls ``zero_grad`` between ``training_step`` and ``backward``
  (``Closure.closure``), so ``training_step`` parks the gradients the schedule produced and
  ``backward`` puts them back, then all-reduces them over the data-parallel replicas of the stage
  (and sums tied parameters over the stages that share them). ``on_before_backward`` /
  ``on_after_backward`` still run around it. This keeps Lightning's loop, callbacks, gradient
  accumulation, LR schedulers and ``optimizer_step`` hooks untouched, which a manual-optimization
  rewrite of the user's module would not.
* ``validation_step`` / ``test_step``: a forward-only run of the pipeline (``schedule.eval``) that
  logs ``val_loss`` / ``test_loss`` on every rank: each step its replica's mean, which ``sync_dist``
  averages over the ranks at the epoch's end, weighted by the batch sizes, as under DDP (no collective
  across replicas per step, so replicas with different numbers of batches, a dataset per rank, finish; a
  replica's stages must hold as many, and no replica none beside others with some: checked where the loaders are
  set up, see :meth:`PipelineStrategy._agree_on_evaluation_batches`, and for streams when a run starts and where
  a rank's ends, :meth:`PipelineStrategy._agree_on_streams_having_batches`, :meth:`PipelineStrategy._end_of_streams`); the module's own
  ``validation_step``/``test_step`` is not called, but Lightning still requires the module to define it
  before ``trainer.validate``/``test`` or a validation loader in ``fit`` run.
  ``predict_step`` returns the last stage's merged output on every rank of the replica (from streams, a replica's stages
  also agree at each step that they end together, and stages parting are refused on every rank). Each evaluation run's
  start compares the first batch of a replica's stages, as a fit's first step does (:meth:`PipelineStrategy._check_stages_read_alike`). Checked
  against a single process in ``tests/strategies/test_pipeline_math.py`` (fit with a val loader,
  ``validate``, ``test``, ``predict``).
* ``deferred_batchnorm=True``: BatchNorm layers become fairscale's ``DeferredBatchNorm``: the
  forward still normalises each micro-batch with its own statistics (as GPipe does), but the
  running statistics are committed once per step from all micro-batches (fairscale commits the
  *biased* batch variance, torch's BatchNorm the unbiased one). torch's first-step
  shape-inference forward is kept out of the statistics (``_pipeline_batchnorm``). That forward leaves no trace
  in the module or the loss either (``_pipeline_stage.GuardedStage``).
* ``teardown``: after a fit / validate / test / predict that ended normally, every rank's module
  gets the other stages' tensors back (over gloo, on the CPU, where Lightning's teardown moves the
  module), so the user's model is whole after ``fit`` as after DDP: its ``state_dict``, inference,
  or another Trainer on it. The next run of this strategy frees them again.
* ``start_method``: ``"popen"`` re-runs the script like ``ddp``; ``"spawn"`` (tested) or ``"fork"`` use
  Lightning's multiprocessing launcher, and the full weights (gathered from all stages) are loaded
  back into the caller's module after ``fit``.
* ``lightning_module_state_dict`` / ``optimizer_state``: gather the full state to rank 0 under the
  plain module's keys, so checkpoints load with ``LightningModule.load_from_checkpoint`` and under
  any other strategy; ``load_optimizer_state_dict`` takes this stage's part of a full state.
  ``save_checkpoint`` stores the effective plan as ``checkpoint["distplan_plan"]``.

Rank layout: stage ``k`` of replica ``r`` is global rank ``r·pp + k``; each DataLoader shard goes
to a replica (all stages of a replica read the same batch; only stage 0 uses the inputs and only
the last stage the targets).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_distplan._layers import MappingOutput, PipelineSpec, discover_layers
from lightning_distplan.errors import BatchFormatError, BatchNotFactorableError, CheckpointMismatchError, InfeasiblePlanError, ModelSplitError, described
from lightning_distplan.plan import Plan, require_plan
from lightning_distplan.strategies._auto_planning import check_boundaries, check_count
from lightning_distplan.strategies._checkpoint import (
    add_portable_state,
    check_states_to_save,
    load_portable_optimizer_states,
    plan_context,
    read_checkpoint,
    readable_plan,
)
from lightning_distplan.strategies._checkpoint_io import AtomicSaves
from lightning_distplan.strategies._exit import destroy_process_groups_at_exit
from lightning_distplan.strategies._grad_norm import gradient_norm, norm_order
from lightning_distplan.strategies._pipeline_checkpoint import (
    LooseState,
    OptimizerIndex,
    StateOwnership,
    gather_full_optimizer_state,
    gather_full_state_dict,
    local_optimizer_state,
    mark_partial,
    optimizer_state_names,
    prune_module,
    unprune_module,
    refuse_partial_module,
    restore_full_module,
)
from lightning_distplan.profiling._batches import BatchSizer, loader_batch_size, tensors_in, uncut_part, uncut_part_found
from lightning_distplan.strategies._pipeline_stage import GuardedStage
from lightning_distplan.strategies._pipeline_summary import forget_whole_module_summaries, summarize_whole_module
from lightning_distplan.strategies._pipeline_split import (
    PipelineLayout,
    StageModule,
    auto_n_microbatches,
    no_spec_error,
    resolve_boundaries,
    split_microbatches,
    split_structure,
    stage_ranges,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

__all__ = ["PipelineStrategy"]

ScheduleName = Literal["auto", "gpipe", "1f1b"]
_SCHEDULE_CACHE = 8
"""Schedules (each with its stage's receive buffers) kept per strategy, one per batch shape and mode, least recent dropped."""
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Trainer precisions a pipeline runs: float32, float32 weights with bf16 autocast, or bf16 weights
# (no gradient scaler, so no '16-mixed': the schedule runs backward itself, so a GradScaler would
# never scale the loss).
PIPELINE_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")
#: what a pipeline logs (it runs PipelineSpec.loss in place of the module's steps), and Lightning's own counters
PIPELINE_METRICS = frozenset({"train_loss", "val_loss", "test_loss", "epoch", "step"})


def _weight_averaging_types() -> tuple[type, ...]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:  # Lightning >= 2.5
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:
        return (StochasticWeightAveraging,)
    return (StochasticWeightAveraging, WeightAveraging)


def pipeline_callback_conflicts(callbacks: Iterable[Any]) -> list[tuple[str, str]]:
    """``(why, what to do instead)`` for each kind of callback among ``callbacks`` that a pipeline fit cannot serve.

    - A monitored metric the pipeline does not log: it runs ``PipelineSpec.loss`` in place of the module's
      ``training_step`` / ``validation_step`` and logs only ``train_loss`` / ``val_loss`` / ``test_loss``;
      ``ModelCheckpoint(monitor="val_acc")`` would fail after the first epoch.
    - Weight averaging (``StochasticWeightAveraging``, ``WeightAveraging``): it copies the whole module
      before the strategy's setup and averages every weight, while each pipeline process holds only its
      stage's; it failed mid-fit with a tensor size mismatch.
    - ``ModelPruning``: it prunes, and makes its masks permanent in, the local module, whose other stages'
      tensors are empty; it failed at the first pruning or checkpoint with a tensor size mismatch.
    - Fine-tuning callbacks (``BackboneFinetuning``, ``BaseFinetuning``): they add param groups to the optimizer
      mid-fit (and replace them all on resume), which each stage's share of the optimizer cannot follow.
    """
    callbacks = list(callbacks)
    out: list[tuple[str, str]] = []
    unlogged = sorted(
        {m for cb in callbacks if isinstance(m := getattr(cb, "monitor", None), str) and m not in PIPELINE_METRICS and not m.startswith("distplan/")}
    )
    if unlogged:
        out.append(
            (f"callbacks monitor {', '.join(map(repr, unlogged))}, which a pipeline does not log: it runs PipelineSpec.loss in place "
             "of the module's training_step/validation_step and logs only train_loss/val_loss/test_loss", "monitor 'val_loss' or 'train_loss'")
        )
    averaging = sorted({type(cb).__name__ for cb in callbacks if isinstance(cb, _weight_averaging_types())})
    if averaging:
        out.append(
            (f"{', '.join(averaging)} averages the whole model's weights, and each pipeline process holds only its own stage's",
             f"drop {', '.join(averaging)}")
        )
    from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning

    if any(isinstance(cb, ModelPruning) for cb in callbacks):
        out.append(
            ("ModelPruning prunes the module in each process, which holds only its own pipeline stage's weights",
             "prune after training (torch.nn.utils.prune on the whole model) or drop ModelPruning")
        )
    finetuning = sorted({type(cb).__name__ for cb in callbacks if isinstance(cb, BaseFinetuning)})
    if finetuning:
        out.append(
            (f"{', '.join(finetuning)} adds param groups to the optimizer during the fit, which each pipeline stage's share of it "
             "cannot follow", "give configure_optimizers every parameter and unfreeze with requires_grad_(True) in "
             "on_train_epoch_start instead of a fine-tuning callback")
        )
    return out


class PipelineStrategy(AtomicSaves, DDPStrategy):
    """Run a LightningModule as a GPipe or 1F1B pipeline over ``torch.distributed.pipelining``.

    ``world_size = dp · stages``: with more devices than stages, ``dp`` replicas of the pipeline
    train on disjoint shards and all-reduce each stage's gradients (hybrid dp × pp). The update is
    the one a single process would make on the global batch (``dp ×`` the DataLoader batch):
    every micro-batch loss is a mean, the schedule averages them, the replicas average the result.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"auto"`` (the plan's, else 1F1B, which keeps at most
            ``pp − k`` micro-batches of activations alive on stage ``k`` instead of all ``n``).
        n_microbatches: micro-batches per optimizer step and replica; ``"auto"`` takes the plan's,
            else the largest divisor of the per-replica batch up to ``4 · stages``. A fit resumed
            (``ckpt_path``) from a checkpoint that stores a pipeline plan, with ``n_microbatches``,
            ``stages`` and ``stage_boundaries`` all ``"auto"`` and no ``plan``, runs the stored plan
            where it fits the run (see :func:`unfit_checkpoint_plan`), as ``dp_ga`` and ``auto_plan``
            do, and says in one line whether it did.
        stages: pipeline stages; ``"auto"`` takes the plan's ``pp``, else the world size.
        stage_boundaries: index of the first layer of stages 1..pp-1 in the
            :class:`~lightning_distplan.PipelineSpec` layers; ``"auto"`` takes the plan's, else balances
            the layers by parameter count with the exact contiguous partition solver.
        plan: a :class:`~lightning_distplan.Plan` to run (``gpipe``/``1f1b``); explicit arguments
            must agree with it.
        deferred_batchnorm: replace BatchNorm layers by fairscale's ``DeferredBatchNorm`` so running
            statistics are those of the whole batch rather than of each micro-batch (the forward
            still normalises per micro-batch); needs an integer ``n_microbatches`` or a plan.
        start_method: ``"popen"`` (script re-launch, like ``ddp``) or ``"spawn"``/``"fork"``.

    Example::

        trainer = L.Trainer(strategy=PipelineStrategy(schedule="1f1b", n_microbatches=8), devices=4)
        trainer = L.Trainer(strategy="gpipe", devices=2)   # registered preset
    """

    strategy_name = "pipeline"
    plan_memory_limit_bytes: int | None = None
    """The device memory the running plan was made for, when ``auto_plan`` made it (stored with it in checkpoints)."""
    plan_unused_parameters: tuple[str, ...] = ()
    """Trainable parameters the profiled loss gave no gradient, when ``auto_plan`` found them (stored with the plan in checkpoints)."""

    def __init__(
        self,
        schedule: ScheduleName = "auto",
        n_microbatches: int | Literal["auto"] = "auto",
        stages: int | Literal["auto"] = "auto",
        stage_boundaries: Sequence[int] | Literal["auto"] = "auto",
        plan: Plan | None = None,
        *,
        deferred_batchnorm: bool = False,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        given = check_boundaries(stage_boundaries)
        stage_boundaries = "auto" if given is None else given
        if not isinstance(deferred_batchnorm, bool):  # as AutoPlanStrategy: the string "no" is true
            raise InfeasiblePlanError(f"`deferred_batchnorm` must be True or False, got {deferred_batchnorm!r}.", hint="Pass deferred_batchnorm=True.")
        if schedule not in ("auto", *_SCHEDULES):
            raise InfeasiblePlanError(f"Unknown pipeline schedule {schedule!r}.", hint="Use one of 'auto', 'gpipe', '1f1b'.")
        n_microbatches = check_count("n_microbatches", n_microbatches, auto=True)
        stages = check_count("stages", stages, auto=True, low=2)
        require_plan(plan, "PipelineStrategy")
        self._schedule_auto = schedule == "auto"  # a resumed fit may take the checkpoint plan's schedule
        if plan is not None:
            if plan.strategy not in _SCHEDULES:
                raise InfeasiblePlanError(
                    f"PipelineStrategy runs gpipe/1f1b plans, got a {plan.strategy!r} plan.", hint="Use strategy='dp_ga' for it."
                )
            for name, mine, theirs in (
                ("schedule", schedule, plan.strategy),
                ("n_microbatches", n_microbatches, plan.n_microbatches),
                ("stages", stages, plan.pp),
            ):
                if mine != "auto" and mine != theirs:
                    raise InfeasiblePlanError(f"`{name}`={mine!r} contradicts the plan's {theirs!r}.", hint=f"Leave `{name}`='auto' to run the plan.")
            schedule, n_microbatches, stages = plan.strategy, plan.n_microbatches, plan.pp
            if isinstance(stage_boundaries, str) and plan.stage_boundaries:  # "auto"
                stage_boundaries = plan.stage_boundaries
        self._schedule_name: str = "1f1b" if schedule == "auto" else schedule
        self._n_arg = n_microbatches
        self._stages_arg = stages
        self._boundaries_arg = stage_boundaries
        self._plan_arg = plan
        self._checkpoint_plan: Plan | None = None  # the plan stored in the checkpoint this fit resumes from
        self._deferred_batchnorm = deferred_batchnorm
        self._swapped_batchnorm: list[Any] = []  # (parent, name, the user's BatchNorm) replaced by DeferredBatchNorm
        if self._schedule_name == "1f1b" and isinstance(n_microbatches, int) and isinstance(stages, int):
            _check_1f1b(n_microbatches, stages)
        self._built = False
        self._built_for: Callable[[], Any] = _no_module  # the LightningModule the pipeline was built from (a weak reference)
        self._pruned = False  # this rank's module holds only its own stage's tensors
        # What pruning emptied, kept (on the CPU) until the first optimizer step: a run that stops before it (a refusal
        # at the first batch, the sanity check) gives the user's model back whole without a collective.
        self._unpruned: list[tuple[Tensor, Tensor]] = []
        self._keep_names: set[str] = set()  # names of this rank's tensors (ids change when buffers move devices)
        self._object_group: Any = None
        self._norm_skip: set[int] = set()
        self._n: int | None = n_microbatches if isinstance(n_microbatches, int) else None
        self._per_replica_batch: int | None = None
        self._flushes = 1  # flushes per optimizer step: the Trainer's accumulate_grad_batches at the last training batch
        self._schedules: dict[tuple, Any] = {}
        # one per loop and dataloader, as dp_ga and the profiler read a loader's batches (see _batch_rows)
        self._sizers: dict[tuple[str, int], BatchSizer] = {}
        self._parked: dict[nn.Parameter, Tensor] = {}
        self._warned_bypass = False
        self._checked_batch = False  # whether this fit checked that the stages read the same batch
        # evaluation prefixes ("val", "test", "predict") with a loader whose batches were not counted at its setup (a
        # stream), alike on every rank: their runs check that the ranks have batches alike when they start
        # (_agree_on_streams_having_batches), their steps that the replica's stages end together (_stages_agree)
        self._uncounted_eval: set[str] = set()
        # evaluation prefixes with a loader of no batches on some ranks beside some on others at its setup (predict
        # allows it): a replica may skip the run, so its start meets no other replica (_check_stages_read_alike)
        self._skippable_eval: set[str] = set()
        self._loss_checked = False  # whether PipelineSpec.loss ran once since the build (checked for other stages' tensors)
        self._warned_shapes = False

    # ------------------------------------------------------------------ layout

    @property
    def stages(self) -> int:
        if isinstance(self._stages_arg, int):
            return self._stages_arg
        return self.num_nodes * self.num_processes

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout.of(world_size=self.num_nodes * self.num_processes, stages=self.stages, rank=self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        layout = self.layout
        return {"num_replicas": layout.dp, "rank": layout.replica}

    @property
    def plan(self) -> Plan | None:
        """The plan being run: known once the first training batch fixed the per-replica batch. Under
        ``Trainer(accumulate_grad_batches=k)`` each optimizer step runs k flushes: the plan's
        ``accumulate_grad_batches``, with ``global_batch_size`` the samples of all k."""
        if self._per_replica_batch is None or self._n is None or not self._built:
            return self._plan_arg
        layout = self.layout
        return Plan(
            strategy=self._schedule_name,  # type: ignore[arg-type]
            dp=layout.dp,
            pp=layout.pp,
            micro_batch_size=self._per_replica_batch // self._n,
            n_microbatches=self._n,
            accumulate_grad_batches=self._flushes,
            global_batch_size=layout.dp * self._per_replica_batch * self._flushes,
            stage_boundaries=self._boundaries,
            layer_names=self._layer_names,
        )

    @property
    def checkpoint_plan(self) -> Plan | None:
        """The plan stored in the checkpoint this run resumed from, if any."""
        return self._checkpoint_plan

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        if self.stages < 2:  # stages='auto' on one device: refused before the run, not at its first checkpoint
            raise InfeasiblePlanError(
                f"A {self._schedule_name} pipeline needs at least 2 stages, but stages='auto' gives 1 on this run's single device.",
                hint="Train on 2 or more devices (Trainer(devices=2)), or use strategy='dp_ga' / 'ddp' on one.",
            )
        self.accelerator.setup(trainer)
        # This run's loaders say anew which are streams (process_dataloader, after this hook): an earlier run's entry sent
        # ranks reading a loader with a length into the streams' all-gather at the run's start, which a replica with no
        # batch of those skips with the whole run (gloo aborted on the mismatched collectives).
        self._uncounted_eval = set()
        self._skippable_eval = set()
        plan = self._plan_arg
        if plan is not None and trainer.state.fn == TrainerFn.FITTING and plan.accumulate_grad_batches != trainer.accumulate_grad_batches:
            raise InfeasiblePlanError(
                f"The plan runs {plan.accumulate_grad_batches} pipeline flush(es) per optimizer step, but "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) gives {trainer.accumulate_grad_batches}.",
                hint=f"Pass Trainer(accumulate_grad_batches={plan.accumulate_grad_batches}) with this plan.",
            )
        if str(trainer.precision) not in PIPELINE_PRECISIONS:
            raise InfeasiblePlanError(
                f"PipelineStrategy supports precision '32-true', 'bf16-mixed' and 'bf16-true', got {trainer.precision!r}.",
                hint="Use Trainer(precision='bf16-mixed') (or '32-true' / 'bf16-true'), or strategy='dp_ga'.",
            )
        module = self.lightning_module
        if self._built and module is not self._built_for():
            # Another LightningModule than the pipeline was built from (trainer.test(best) after fit): its own
            # stages, not the first module's (they ran silently before).
            self._built = False
            self._schedules = {}
        if not self._built:
            refuse_partial_module(module)
        conflicts = pipeline_callback_conflicts(trainer.callbacks) if trainer.state.fn == TrainerFn.FITTING else []
        if conflicts:  # refused before the model is cut into stages, not after an epoch
            fixes = " and ".join(fix for _, fix in conflicts)
            raise InfeasiblePlanError(
                f"PipelineStrategy cannot run this fit: {'; '.join(why for why, _ in conflicts)}.",
                hint=f"{fixes[0].upper()}{fixes[1:]}, or train with strategy='dp_ga' (or 'ddp').",
            )
        if module is not None and not module.automatic_optimization and trainer.state.fn == TrainerFn.FITTING:
            raise InfeasiblePlanError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization=False), but PipelineStrategy runs "
                "the pipeline schedule in place of training_step, so your manual backward and optimizer steps would never run.",
                hint="Use automatic optimization (return the loss from training_step), or strategy='dp_ga' / 'ddp'.",
            )
        if trainer.state.fn == TrainerFn.FITTING and module is not None:
            _warn_stage_local_hooks(module, trainer.callbacks)
        assert self.model is not None
        self.precision_plugin.convert_module(self.model)  # 'bf16-true': bf16 weights, as DDP converts them
        if trainer.state.fn == TrainerFn.FITTING and module is not None:
            summarize_whole_module(trainer, module)  # the model summary of the whole module: its callback runs after the cut
        if not self._built:
            if _distributed_is_initialized():
                _sync_module_states(self.model)  # same starting weights on every rank, as DDP does
            fitting = trainer.state.fn == TrainerFn.FITTING
            first = self._first_batch(trainer)  # one fresh loader for both loss checks
            if fitting:
                self._check_guessed_loss(trainer, first)
                self._reuse_checkpoint_plan(trainer)
            # validate / test / predict without a fit before: checked as a fit is (they failed on one rank, or hung)
            self._build_pipeline(first, check_loss=True, loss=trainer.state.fn != TrainerFn.PREDICTING)
        elif not self._pruned:  # a later fit/test of this strategy: the module was made whole after the last one
            self._keep = {id(t) for name, t in _named_tensors(self.model) if name in self._keep_names}
            self._unpruned = []
            prune_module(self.model, self._keep, freed_values=self._unpruned)
            self._pruned = True
            self._loose.reset(self.lightning_module)
            mark_partial(self.lightning_module, self.layout.stage)
        self.model_to_device()
        # 'bf16-mixed': the stage's blocks and the loss run in autocast, as training_step would under Lightning;
        # 'bf16-true': with bf16 as the default dtype.
        self._stage_module.forward_context = self.precision_plugin.forward_context
        # Clipping by norm (Trainer(gradient_clip_val=...) or the module's own clip_gradients) uses the norm of
        # ALL the model's gradients, which no stage holds alone: the precision plugin's norm clipping is ours.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)

    def _reuse_checkpoint_plan(self, trainer: pl.Trainer) -> None:
        """Resume with the checkpoint's plan (its schedule, stages, micro-batches and stage boundaries) where it fits
        this run and no argument chose the layout, as ``dp_ga`` and ``auto_plan`` do (DESIGN §3.5: resume does not
        re-plan); otherwise say, in one line, why it is not reused. Every rank decides alike (same checkpoint, loader
        and model)."""
        stored = self._checkpoint_plan
        if stored is None or self._plan_arg is not None or not (self._n_arg == self._stages_arg == self._boundaries_arg == "auto"):
            return  # no plan stored, or the user's plan or arguments say what to run
        from lightning_distplan.strategies._auto_planning import fresh_train_loader
        from lightning_distplan.strategies.dp_ga import loader_batch_size

        module = self.lightning_module
        assert module is not None
        try:
            loader_batch = loader_batch_size(fresh_train_loader(trainer))
        except InfeasiblePlanError:  # no loader, or several: the fit says so in its own words
            loader_batch = None
        why = unfit_checkpoint_plan(
            stored, schedule=None if self._schedule_auto else self._schedule_name, world_size=self.num_nodes * self.num_processes,
            loader_batch=loader_batch, accumulate=trainer.accumulate_grad_batches, layer_names=discover_layers(module).names,
        )
        if why:
            rank_zero_info(f"PipelineStrategy: not resuming with the checkpoint's plan {stored.describe()}: {why}; deriving "
                           "n_microbatches and stage boundaries for this run.")
            return
        self._schedule_name = stored.strategy
        self._stages_arg = stored.pp
        self._n = stored.n_microbatches
        if stored.stage_boundaries:
            self._boundaries_arg = tuple(stored.stage_boundaries)
        rank_zero_info(f"PipelineStrategy: resuming with the checkpoint's plan {stored.describe()}.")

    def _build_pipeline(self, first: _FirstBatch | None = None, *, check_loss: bool = False, loss: bool = True) -> None:
        """Cut the module into this rank's stage; ``check_loss``: first refuse, on every rank, a chain of layers (and,
        with ``loss``, a loss) the stages could not compute, run on ``first`` (:meth:`_first_batch`)."""
        module = self.lightning_module
        assert module is not None
        layout = self.layout
        if self._schedule_name == "1f1b" and self._n is not None:
            _check_1f1b(self._n, layout.pp)
        self._maybe_defer_batchnorm(module)  # before discovery, so adapters wrap the converted modules
        discovered = discover_layers(module)
        if discovered.spec is None:
            raise no_spec_error(discovered.split_reason)
        spec: PipelineSpec = discovered.spec
        layers = list(spec.layers)
        self._boundaries = resolve_boundaries(self._boundaries_arg, stages=layout.pp, layers=layers)
        self._layer_names = discovered.names
        if self._plan_arg is not None and self._plan_arg.layer_names and tuple(self._plan_arg.layer_names) != discovered.names:
            rank_zero_warn(
                "The plan's layer names differ from this model's pipeline layers; its stage boundaries may cut elsewhere "
                "than profiled. Re-plan from a fresh profile of this model."
            )
        ranges = stage_ranges(self._boundaries, len(layers))

        tensor_stages: dict[int, set[int]] = {}
        param_stages: dict[nn.Parameter, set[int]] = {}
        for k, (a, b) in enumerate(ranges):
            for layer in layers[a:b]:
                for p in layer.parameters():
                    tensor_stages.setdefault(id(p), set()).add(k)
                    param_stages.setdefault(p, set()).add(k)
                for t in layer.buffers():
                    tensor_stages.setdefault(id(t), set()).add(k)
        forms = self._check_loss_before_cut(first, spec, tensor_stages, loss=loss) if check_loss else {}
        self._ownership = StateOwnership.of(module, tensor_stages)
        # every stage's parameters, on every rank: which stages train decides which activations carry a gradient
        self._params_by_stage = [tuple(p for layer in layers[a:b] for p in layer.parameters()) for a, b in ranges]
        k = layout.stage
        in_layers = set(tensor_stages)
        self._in_layers = in_layers
        keep = {i for i, s in tensor_stages.items() if k in s}
        keep |= {id(t) for t in [*module.parameters(), *module.buffers()] if id(t) not in in_layers}
        self._keep = keep
        self._provide = {i for i, s in tensor_stages.items() if min(s) == k} | {
            id(t) for t in module.parameters() if id(t) not in in_layers and k == 0
        }
        self._keep_names = {name for name, t in _named_tensors(module) if id(t) in keep}
        self._unpruned = []
        freed = prune_module(module, keep, freed_values=self._unpruned)
        self._pruned = True
        self._loose = LooseState(module, self._ownership)
        self._loss_checked = False
        self._rng_seed = int(torch.randint(0, 2**62, (1,)).item()) + self.global_rank  # one draw, alike on every rank
        self._rng_state: tuple[Tensor, Tensor | None] | None = None
        mark_partial(module, k)
        a, b = ranges[k]
        # a mapping that crosses a stage boundary: its tensors cross, its keys are the check's before the cut
        self._stage_module = StageModule(layers[a:b], start=a, last=k == layout.pp - 1, input_form=forms.get(a), output_form=forms.get(b))
        self._spec = spec

        # Every rank creates every group, in the same order (a requirement of new_group).
        # Every group waits as long as the user's timeout (default_pg_timeout otherwise), as the default group does:
        # without it a stage stalled in its peer's p2p kept the others waiting torch's 30 minutes.
        timeout = self._timeout
        pipe_groups = [dist.new_group(layout.pipeline_ranks(r), timeout=timeout) for r in range(layout.dp)]
        self._pipe_group = pipe_groups[layout.replica]
        self._dp_group = None
        if layout.dp > 1:
            dp_groups = [dist.new_group(layout.stage_ranks(s), timeout=timeout) for s in range(layout.pp)]
            self._dp_group = dp_groups[k]
        # Parameters used on several stages (tied embeddings): their gradient is the sum over those stages.
        self._shared: list[tuple[list[nn.Parameter], Any]] = []
        by_stages: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for p, s in param_stages.items():
            if len(s) > 1:
                by_stages.setdefault(tuple(sorted(s)), []).append(p)
        for s_tuple in sorted(by_stages):
            ranks = sorted(r * layout.pp + s for r in range(layout.dp) for s in s_tuple)
            group = dist.new_group(ranks, timeout=timeout)
            if k in s_tuple:
                self._shared.append((by_stages[s_tuple], group))
        shared_ids = {id(p) for params, _ in self._shared for p in params}
        # a tied parameter counts once in the global gradient norm: on the first stage that has it
        self._norm_skip = {id(p) for s_tuple, params in by_stages.items() if k in s_tuple and k != min(s_tuple) for p in params}
        self._stage_params = [p for p in self._stage_module.parameters() if id(p) not in shared_ids]
        # The whole module goes back to every rank after a run, and to rank 0 for a checkpoint, as pickled CPU objects:
        # over gloo, never the GPUs (torch's object collectives over NCCL pickle into CUDA tensors, and rank 0's gather
        # held every stage's weights and optimizer state on its GPU at once).
        self._object_group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None
        self._built = True
        self._built_for = weakref.ref(module)
        rank_zero_info(
            f"PipelineStrategy: {self._schedule_name} dp={layout.dp} pp={layout.pp}, {len(layers)} layers, "
            f"stage boundaries {list(self._boundaries)}; rank 0 freed {freed / 2**20:.1f} MiB of other stages' tensors."
        )

    def _check_guessed_loss(self, trainer: pl.Trainer, first: _FirstBatch | None) -> None:
        """Refuse, before the model is cut, a fit whose pipeline loss is a built-in adapter's guess that differs from
        what ``training_step`` computes (label smoothing, a penalty): the pipeline would train another objective,
        silently. Compared on the first 4 samples of a fresh train loader, as the profiler compares them for auto_plan;
        every rank takes the same verdict."""
        from lightning_distplan._layers import chain_output, find_pipeline_spec
        from lightning_distplan.profiling._profiler import _quiet_logging, _reduce, loss_difference
        from lightning_distplan.profiling._snapshot import ModuleSnapshot

        module = self.lightning_module
        if callable(getattr(module, "pipeline_spec", None)) or callable(getattr(module, "pipeline_loss", None)):
            return  # the user's own loss: theirs to keep equal to training_step
        spec = find_pipeline_spec(module)[0]
        differs: str | None = None
        if spec is not None:
            if first is not None:
                batch, device = first.samples(min(first.rows, 4)), first.device
                # training_step may count, log or update metrics: put them back (no optimizer steps: the weights stay)
                snapshot = ModuleSnapshot.take(module, weights=False)
                try:
                    with _quiet_logging(module), self.precision_plugin.train_step_context():
                        differs = loss_difference(module, lambda: module.training_step(batch, 0), lambda: chain_output(spec, batch),
                                                  devices=[device] if device.type == "cuda" else [],
                                                  params=list(module.parameters()),
                                                  precision=str(trainer.precision))
                finally:
                    snapshot.restore()
        if _reduce(float(differs is not None), "max"):  # every rank takes the same verdict
            raise InfeasiblePlanError(
                f"PipelineStrategy would train another loss than {type(module).__name__}.training_step: "
                f"{differs or 'the two losses differ on another rank'}.",
                hint="Define pipeline_loss(self, output, batch) returning what training_step computes from the last "
                "layer's output, or train with strategy='dp_ga' / 'ddp'.",
            )

    def _first_batch(self, trainer: pl.Trainer) -> _FirstBatch | None:
        """The first batch of a fresh loader of the run (:func:`_fresh_loader`: the train loader for a fit, the first
        validation / test / predict loader for the others) as Lightning's loop hands a batch to a step:
        through the precision plugin's ``convert_input`` and the module's (or datamodule's) ``on_before_batch_transfer``,
        ``transfer_batch_to_device`` and ``on_after_batch_transfer``, to the module's device. None when there is no
        batch to check a loss on here (the fit reports its loader's, or its hooks', error at its first batch)."""
        from lightning_distplan.profiling._snapshot import ModuleSnapshot, RNGSnapshot

        module = self.lightning_module
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        try:
            loader = _fresh_loader(trainer)
            batch = self.precision_plugin.convert_input(next(iter(loader)))
            # the hooks run once more than the fit runs them: what they count or draw (a counter on the module, an
            # augmentation's random numbers) goes back, as after the profiler's runs
            snapshot, rng = ModuleSnapshot.take(module, weights=False), RNGSnapshot.take(include_cuda=device.type == "cuda")
            try:
                batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
                batch = self.batch_to_device(batch, device, dataloader_idx=0)
            finally:
                snapshot.restore()
                rng.restore()
        except Exception:  # noqa: BLE001
            return None
        n = BatchSizer(loader_batch_size(loader))(batch)  # as training reads it (_batch_rows)
        if not n:
            return None
        return _FirstBatch(batch, n, device)

    def _check_loss_before_cut(self, first: _FirstBatch | None, spec: PipelineSpec, tensor_stages: dict[int, set[int]],
                               *, loss: bool = True) -> dict[int, MappingOutput]:
        """Run the whole chain on up to 4 samples of a fresh loader of the run before the model is cut, and refuse on every
        rank a ``PipelineSpec.loss`` that the last stage would refuse at the first step (a loss reaching into another
        stage's layer, or one that is not a scalar), first-layer inputs that are no tensors, and a layer output at a stage
        boundary, the last layer's included, that cannot cross (``check_crossing``: torch's runtime failed on that stage
        alone with a PipeliningMetadataError): raised there alone, the other stages only saw their peer gone.
        ``loss=False`` (predict): the chain of layers alone, as predict runs no loss and the batch may hold no targets, and
        a last layer's output predict cannot join (:func:`_check_joinable`).

        Any other error of the chain (the model's own: a shape error in a layer or the loss) is raised as it is, on every
        rank, where it is no artefact of the check: the chain runs again as the first step runs it (the first micro-batch's
        rows, with gradients in a fit, in eval mode for validate / test / predict) and the error is raised only when that run fails
        too. Where the check cannot run as the step does (the module is not yet on the step's device, as before a GPU
        run's cut; fewer rows in the loader's batch than a re-chunked micro-batch holds) it is left to the first step.

        Returns the form of each mapping of tensors the chain passed across a stage boundary, by the index of the layer
        after it (:class:`~lightning_distplan._layers.MappingOutput`): the stage after it gets only its tensors, in key
        order, and builds it again by these keys for its first layer."""
        from lightning_distplan._layers import chain_output
        from lightning_distplan.profiling._profiler import _quiet_logging, _reduce
        from lightning_distplan.profiling._snapshot import ModuleSnapshot

        module = self.lightning_module
        last = self.layout.pp - 1
        elsewhere = {id(t): name for name, t in _named_tensors(module) if id(t) in tensor_stages and last not in tensor_stages[id(t)]}
        refusal: Exception | None = None
        forms: dict[int, MappingOutput] = {}
        if first is not None:
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING

            def checked_loss(output: Any, targets: Any) -> Tensor:
                with _RefuseTensors(elsewhere, stage=last):
                    value = spec.loss(output, targets)
                _check_scalar_loss(value)
                return value

            def run(k: int, *, grad: bool) -> Exception | None:
                batch, rows = first.samples(k), first.rows_in(k)
                checked = dataclasses.replace(spec, loss=checked_loss) if loss else dataclasses.replace(
                    spec, loss=lambda output, _: _check_joinable(output, rows, len(spec.layers) - 1, spec.layers[-1]), targets=None)
                snapshot = ModuleSnapshot.take(module, weights=False)  # buffers, counters and train / eval flags go back
                if not fitting:  # as their loops set it (a BatchNorm of 1 sample predicts in eval mode); a fit keeps the
                    module.eval()  # module's modes (a frozen part left in eval mode stays so)
                try:
                    with torch.set_grad_enabled(grad), _quiet_logging(module), self.precision_plugin.forward_context():
                        chain_output(checked, batch, cuts=(*self._boundaries, len(spec.layers)), forms=forms)
                except Exception as err:  # noqa: BLE001 - a refusal of the check's, or the model's own error
                    return err
                finally:
                    snapshot.restore()
                return None

            few = min(first.rows, 4)
            refusal = run(few, grad=False)  # cheap: a few samples, no activations kept
            if refusal is not None and not isinstance(refusal, (ModelSplitError, BatchFormatError)):
                # The model's own error. At the first step the stage that ran the failing layer (or the loss) raised it
                # alone, and the other stages saw only gloo's "Connection closed by peer" (or waited for the peer while
                # its process lived on); but the check's few samples without gradients may be what failed (a loss's
                # view(8, -1), a gradient penalty): run as the step runs it first.
                rows = self._first_micro_batch_rows(first.rows, fitting=fitting)
                if first.samples(rows) is None or first.device != self.root_device:
                    refusal = None  # not what the step runs: the first step reports its own error
                elif rows != few or fitting:
                    refusal = run(rows, grad=fitting)
                if refusal is not None and not isinstance(refusal, (ModelSplitError, BatchFormatError)):
                    refusal.add_note(
                        f"PipelineStrategy: raised by the pipeline's layers or PipelineSpec.loss, run in one process as the first "
                        f"step runs them (a micro-batch of {rows} sample(s) of the run's first batch, "
                        f"{'with' if fitting else 'without'} gradients) before the model was cut; every rank stops here."
                    )
        if _reduce(float(refusal is not None), "max"):  # every rank raises, the same error where they agree
            if refusal is None:
                raise ModelSplitError(
                    "PipelineStrategy cannot run: the pipeline's layers or PipelineSpec.loss failed on another rank's first "
                    "samples before the model was cut.",
                    hint="Its error is in that rank's output.",
                )
            raise refusal
        return forms

    def _first_micro_batch_rows(self, rows: int, *, fitting: bool) -> int:
        """The samples of the first micro-batch the run's first step cuts from a batch of ``rows`` of the run's loader, as
        :meth:`training_step` (:meth:`_eval_step`, :meth:`predict_step`) chooses the micro-batches (the first ones of an
        uneven split are the longer, as ``split_structure`` cuts)."""
        pp = self.layout.pp
        n = (self._n or auto_n_microbatches(rows, pp)) if fitting else _largest_divisor_at_most(rows, self._n or 4 * pp)
        return -(-rows // n)

    def _maybe_defer_batchnorm(self, module: nn.Module) -> None:
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
        if not has_bn:
            return
        if not self._deferred_batchnorm:
            rank_zero_warn(
                "The model has BatchNorm layers: under micro-batching their running statistics are updated per "
                "micro-batch, not per batch, so they differ from a single-device run. fairscale's "
                "`fairscale.nn.pipe.batchnorm.DeferredBatchNorm` restores batch statistics: pass "
                "PipelineStrategy(deferred_batchnorm=True)."
            )
            return
        if self._n is None:
            raise InfeasiblePlanError(
                "`deferred_batchnorm=True` needs a fixed `n_microbatches`.", hint="Pass n_microbatches=<int> or a plan."
            )
        from lightning_distplan.strategies._pipeline_batchnorm import convert_deferred_batchnorm

        self._swapped_batchnorm = convert_deferred_batchnorm(module, chunks=self._n)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        unlogged = sorted({c.monitor for c in self.lr_scheduler_configs if c.monitor and c.monitor not in PIPELINE_METRICS})
        if unlogged:  # Lightning would fail at the end of the first epoch, after all that training
            raise InfeasiblePlanError(
                f"A learning-rate scheduler monitors {', '.join(map(repr, unlogged))}, which a pipeline does not log: it runs "
                "PipelineSpec.loss in place of the module's training_step/validation_step and logs only train_loss/val_loss/test_loss.",
                hint="Monitor 'val_loss' or 'train_loss' in configure_optimizers, or train with strategy='dp_ga'.",
            )
        # The optimizers were built over the whole module; keep only this stage's parameters (no state exists yet).
        held = {id(p) for opt in self.optimizers for group in opt.param_groups for p in group["params"]}
        outside = [
            name for name, p in self.lightning_module.named_parameters()
            if p.requires_grad and id(p) in held and id(p) not in self._in_layers
        ]
        if outside:
            rank_zero_warn(
                f"PipelineStrategy: the optimizer holds {len(outside)} parameter(s) that belong to no pipeline layer "
                f"({', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''}); the pipeline runs only its layers and "
                "PipelineSpec.loss, whose own parameters get no gradient, so these are never trained. Move them into a "
                "layer of the PipelineSpec, or train this model with strategy='dp_ga'."
            )
        module_params = {id(p) for p in self.lightning_module.parameters()}
        plain = sum(1 for opt in self.optimizers for group in opt.param_groups for p in group["params"] if id(p) not in module_params)
        if plain:  # a tensor the module does not register: no stage holds it, so it leaves the optimizer
            rank_zero_warn(
                f"PipelineStrategy: the optimizer holds {plain} tensor(s) that are not parameters of the module (plain tensors "
                "passed to configure_optimizers); the pipeline steps only its layers' parameters, so these are dropped from the "
                "optimizer and never trained. Register them as nn.Parameter of a pipeline layer, or train this model with "
                "strategy='dp_ga'."
            )
        self._opt_index: dict[int, OptimizerIndex] = {}
        for opt in self.optimizers:
            self._opt_index[id(opt)] = OptimizerIndex.prune(opt, self._keep, self._provide, self.lightning_module)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The ``norm_type``-norm of the whole model's gradients, the same on every rank.

        Each process holds its own stage's gradients only, so Lightning's ``grad_norm(module)`` in a hook
        reads that stage's norm. This one combines the stages (a tied parameter counted once); it is a
        collective: call it on every rank, e.g. in ``on_before_optimizer_step``::

            def on_before_optimizer_step(self, optimizer):
                self.log("grad_norm", self.trainer.strategy.grad_norm())

        Raises:
            InfeasiblePlanError: (a ``ValueError``) ``norm_type`` is not a positive number or ``inf``.
        """
        order = norm_order(norm_type)
        return self._global_grad_norm([p for p in self._stage_module.parameters() if p.grad is not None], order)

    def _global_grad_norm(self, params: list[Tensor], order: float) -> Tensor:
        """The stages' norms combined over the replica's pipeline group (the replicas hold equal gradients after the
        all-reduce); a tied parameter counts on the first stage that has it."""

        def over_stages(partial: Tensor, is_max: bool) -> None:
            if self.layout.pp > 1:
                dist.all_reduce(partial, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=self._pipe_group)

        grads = [p.grad for p in params if id(p) not in self._norm_skip]
        return gradient_norm(grads, order, device=self.root_device, combine=over_stages)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model (:meth:`grad_norm`'s 2-norm)."""
        params = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        coef = torch.clamp(clip_val / (self._global_grad_norm(params, 2.0) + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))

    # ------------------------------------------------------------------ before and after a run

    @override
    def on_train_start(self) -> None:
        self._checked_batch = False
        self._sizers = {}
        self._refuse_dataloader_iter()
        self._check_last_batch()

    @override
    def on_validation_start(self) -> None:
        self._sizers = {key: sizer for key, sizer in self._sizers.items() if key[0] == "train"}  # a fit's validation: its loader may change
        self._start_evaluation_run()

    @override
    def on_test_start(self) -> None:
        self._sizers = {}
        self._start_evaluation_run()

    @override
    def on_predict_start(self) -> None:
        self._sizers = {}
        self._start_evaluation_run()

    def _start_evaluation_run(self) -> None:
        """Refuse a ``dataloader_iter`` step, and have the run's first fetch check its start
        (:meth:`_check_evaluation_start`): these hooks (``on_validation_start`` / ``on_test_start`` /
        ``on_predict_start``, the strategy's after the callbacks' and the module's) run before ``on_*_epoch_start``,
        and a batch fetched here was read before those hooks ran (a hook there that changes the dataset or reseeds, under
        ``num_workers=0``, did not reach batch 0, as it does under DDP). Lightning fetches right after them, each rank
        (one with no batch too) once at least, so the checks' collectives meet there. A fetcher of another kind
        (``dataloader_iter``'s is refused here) checks now."""
        self._refuse_dataloader_iter()
        fetcher = self.lightning_module.trainer._active_loop._data_fetcher
        if type(fetcher) is _PrefetchDataFetcher:
            fetcher.__class__ = _FetcherStartingARun
            fetcher.start_run = self._check_evaluation_start
        else:
            self._check_evaluation_start()

    def _check_evaluation_start(self) -> None:
        """The checks of an evaluation run's start, every rank's first batch fetched: the stages' same batch after the
        streams' having batches (a stage with none is refused there in its own sentence), and both before the loaders
        without a batch on this rank end (:meth:`_end_of_streams`, whose all-gathers the other ranks meet at the ends
        of those loaders, after their own start's)."""
        first = self._agree_on_streams_having_batches()
        self._check_stages_read_alike()
        if first:
            self._end_of_streams(_EVAL_WHAT[self.lightning_module.trainer.state.stage.dataloader_prefix], parted=False, ended=0, going=first)

    def _refuse_dataloader_iter(self) -> None:
        """Refuse, on every rank before the first step, a LightningModule step that takes ``dataloader_iter``: the
        pipeline runs in its place, but Lightning then fetches no batch and hands the pipeline's step the iterator, which
        it refused as a batch of type ``_DataFetcherWrapper`` (a sentence about the batch's tensors, not the signature).
        Nor could a step fetching from the iterator itself tell where a rank's stream ends before its batches run out (a
        rank whose stream yielded none entered the step beside ranks with batches, and the run-start check of streams,
        :meth:`_agree_on_streams_having_batches`, knew nothing of it). The module is the same on every rank, so every
        rank raises here alike, without a collective."""
        from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

        trainer = self.lightning_module.trainer
        if not isinstance(trainer._active_loop._data_fetcher, _DataLoaderIterDataFetcher):
            return
        step = _STEP_OF[trainer.state.stage.dataloader_prefix]
        raise BatchFormatError(
            f"The LightningModule's `{step}` takes `dataloader_iter`, but PipelineStrategy runs the pipeline in place of "
            f"`{step}` and needs Lightning to fetch each batch for it.",
            hint=f"Define `{step}(self, batch, batch_idx)` (its body is not run under PipelineStrategy: the pipeline computes "
            "PipelineSpec.loss, or the last layer's output for predict).",
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        stage = module.trainer.state.stage if module is not None and module._trainer is not None else None
        if stage == RunningStage.TRAINING:
            self._agree_on_train_loader(module.trainer, dataloader)
        elif stage is not None and _distributed_is_initialized() and dist.get_world_size() > 1:
            self._agree_on_evaluation_batches(module.trainer, dataloader, stage.dataloader_prefix)
        return dataloader

    def _agree_on_train_loader(self, trainer: pl.Trainer, dataloader: object) -> None:
        """Refuse, on every rank, train loaders with a length on some ranks beside streams on others (dp_ga's agreement,
        :func:`~lightning_distplan.strategies.dp_ga._agree_on_train_loader`): Lightning's ``has_len_all_ranks``, right
        after this hook, sums their lengths in a collective that the ranks reading a stream skip, and the fit hung
        there (a loader of each rank's own, ``use_distributed_sampler=False``); and, in the same all-reduce, the stages of
        a replica whose loaders hold different numbers of batches or samples (they cannot read the same batches; a
        stage whose loader ended first left the others waiting). One all-reduce per train loader set up, none on one rank. A subclass that agrees on the loader it makes of this one says so by overriding this."""
        from lightning_distplan.strategies.dp_ga import _agree_on_train_loader

        layout = self.layout
        _agree_on_train_loader(trainer, dataloader, stages=(layout.replica, layout.dp, dataloader) if layout.pp > 1 else None)

    def _agree_on_evaluation_batches(self, trainer: pl.Trainer, dataloader: object, prefix: str) -> None:
        """Refuse, on every rank, evaluation loaders whose numbers of batches cannot run together (they hung, or
        timed out in gloo's recv, at the first batch one rank lacked).

        The stages of a replica run each evaluation batch together (stage 0 sends the next its activations, the last
        broadcasts the loss), so they must hold as many batches: a loader of each rank's own
        (``use_distributed_sampler=False``) may differ. Replicas may differ (``val_loss`` is averaged once, at the
        epoch's end), but not one with none beside others with some: a replica of no batches skips the loop, and the
        others wait for it in that average (a replica skipping ``predict`` meets the others again at the teardown,
        as Lightning's ``allow_zero_length_dataloader_with_multiple_devices`` lets it). Lightning refuses an empty
        loader on its own rank only (its ``has_len_all_ranks``), and the other ranks hung. One all-gather of a count
        per rank, where Lightning sets the loader up (every rank, once per loader: no collective per step); a loader
        without a length (a stream) is not counted: its evaluation steps check that the stages end together
        (:meth:`_replica_mean`). Loaders with a length beside streams are refused: Lightning's ``has_len_all_ranks``
        sums the lengths in a collective over every rank that the ranks reading a stream skip (it hung)."""
        length = sized_len(dataloader)
        limit = getattr(trainer, f"limit_{prefix}_batches")
        mine = -1 if length is None else min(length, limit) if isinstance(limit, int) else int(length * limit)
        device = self.root_device
        every = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(every, torch.tensor([mine], dtype=torch.int64, device=device))
        counts = [int(c.item()) for c in every]
        layout = self.layout
        what = _EVAL_WHAT[prefix]
        replicas = [[counts[r] for r in layout.pipeline_ranks(replica)] for replica in range(layout.dp)]
        said = [[str(c) if c >= 0 else "no length" for c in stages] for stages in replicas]
        streams = [rank for rank, c in enumerate(counts) if c < 0]
        if streams and len(streams) < len(counts):
            from lightning_distplan.strategies.dp_ga import lengths_beside_streams

            raise lengths_beside_streams(what, streams)
        if streams:  # alike on every rank (a mix is refused above), as the collectives that follow from it must be
            self._uncounted_eval.add(prefix)
        if 0 in counts and any(c > 0 for c in counts):
            self._skippable_eval.add(prefix)
        for replica, stages in enumerate(replicas):
            if len({c for c in stages if c >= 0}) > 1:
                raise BatchFormatError(
                    f"The stages of pipeline replica {replica} hold different numbers of {what} batches "
                    f"({', '.join(f'stage {k}: {c}' for k, c in enumerate(said[replica]))}), but they "
                    "must run the same batches together (the first stage feeds the inputs, the last computes the loss or the predictions).",
                    hint="Give every rank of a pipeline replica the same loader: let Lightning shard the data "
                    "(use_distributed_sampler=True, no sampler of your own), or shard by trainer.strategy.distributed_sampler_kwargs"
                    "['rank'] / ['num_replicas'] (the data-parallel replica), not by the global rank.",
                )
        module = self.lightning_module
        allowed = module.allow_zero_length_dataloader_with_multiple_devices or (
            trainer.datamodule is not None and trainer.datamodule.allow_zero_length_dataloader_with_multiple_devices)
        empty = [replica for replica, stages in enumerate(replicas) if all(c == 0 for c in stages)]
        if empty and len(empty) < layout.dp and not (prefix == "predict" and allowed):
            sizes = ", ".join(f"replica {replica}: {stages[0]}" for replica, stages in enumerate(said))
            raise BatchFormatError(
                f"Pipeline replica {empty[0]} (ranks {', '.join(map(str, layout.pipeline_ranks(empty[0])))}) has no {what} "
                f"batches while other replicas have some ({sizes}), and the others would wait for it in a collective it never joins.",
                hint="Give every replica at least one batch (with use_distributed_sampler=False each replica reads a loader of "
                "its own: none may be empty), or let Lightning shard one dataset (use_distributed_sampler=True).",
            )

    def _agree_on_streams_having_batches(self) -> int | None:
        """Refuse, on every rank, a run of evaluation streams (loaders without a length) that yield no batch on some
        ranks and some on others (it hung). A stream is not counted at its setup (:meth:`_agree_on_evaluation_batches`),
        and a stage with no batch never reaches a step to say so (:meth:`_replica_mean`): the other stages of its
        replica waited for it in gloo's send or recv, and the other replicas, for a replica with none, in the epoch-end
        average of ``val_loss`` / ``test_loss`` that it never joins. Lightning has fetched each rank's first batch when
        the run starts (to tell a stream's last batch; under a limit of batches, :func:`_prefetch_stream` does), so
        this check, at the run's first fetch, which every rank reaches before the first step, knows the loader it
        comes from (several loaders run one after another: a first batch from loader 1 means loader 0 yielded none):
        one all-gather per run of a stream, none per step. A replica with no predictions beside others runs (its steps meet no other replica), as
        an empty one with a length does. Returns the loader of this rank's first batch (None where no stream runs): the
        loaders before it end at the run's start, where it says so to the others' ends of them
        (:meth:`_check_evaluation_start`)."""
        trainer = self.lightning_module.trainer
        prefix = trainer.state.stage.dataloader_prefix
        if prefix not in self._uncounted_eval or not _distributed_is_initialized() or dist.get_world_size() < 2:
            return None
        loop = trainer._active_loop
        _prefetch_stream(loop._data_fetcher)
        first = _next_loader(loop, 0)  # the number of loaders where there is no batch at all
        device = self.root_device
        every = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(every, torch.tensor([first], dtype=torch.int64, device=device))
        layout = self.layout
        what = _EVAL_WHAT[prefix]
        replicas = [[int(every[r].item()) for r in layout.pipeline_ranks(replica)] for replica in range(layout.dp)]
        parted = [replica for replica, stages in enumerate(replicas) if len(set(stages)) > 1]
        if parted:
            raise _streams_parted(parted, what, "a stage's yielded none where another's yielded some")
        if prefix != "predict":
            _refuse_replica_without_batches([stages[0] for stages in replicas], layout, what, len(loop._combined_loader.flattened))
        return first

    def _check_stages_read_alike(self) -> None:
        """The evaluation runs' :meth:`_check_same_batch`: the stages of a replica must read the same batches, but a
        user's own sampler, or a stream sharded by the global rank, gave them others of as many (their numbers are
        checked, :meth:`_agree_on_evaluation_batches`, not their contents), and the pipeline went on silently: predict
        returned stage 0's predictions on every rank of the replica, beside batches of other samples on the other
        stages, and validate / test paired stage 0's inputs with the last stage's targets. Each rank's first batch as its
        loader yields it (fetched ahead now, :func:`_prefetch_stream`, as a stream's is) is compared, as a fit's first is
        (:meth:`_compare_stages_batches`): one all-gather of 4 numbers per run, none per step. Over every rank, so that
        every rank raises the same error; over the replica's stages where a replica may skip the run (predict beside a
        replica without batches, which never reaches this check), whose ranks alone then raise (or warn, from the
        replica's stage 0: rank 0 does not know): predict's replicas meet no other replica."""
        layout = self.layout
        if layout.pp < 2 or not _distributed_is_initialized() or dist.get_world_size() < 2:
            return
        trainer = self.lightning_module.trainer
        prefix = trainer.state.stage.dataloader_prefix
        fetcher = trainer._active_loop._data_fetcher
        _prefetch_stream(fetcher)
        checked = _checked_tensors(fetcher.batches[0][0]) if getattr(fetcher, "batches", None) else ([], False)
        self._compare_stages_batches(checked, _EVAL_WHAT[prefix], local=prefix in self._skippable_eval)

    def _compare_stages_batches(self, checked: tuple[list[Tensor], bool], what: str, *, local: bool = False) -> None:
        """Refuse the replicas whose stages read other first batches (``checked``, this rank's :func:`_checked_tensors`
        of its batch, none where it has no batch) by their integer tensors, or warn of them where only floats differ:
        one all-gather of 4 numbers (whether the rank has a batch, whether its tensors are integer ones, and their
        :func:`_batch_checksum`) over every rank, so that every rank raises the same error and rank 0 warns naming every
        replica whose stages differ; over this replica's stages alone where ``local`` (its ranks alone then raise, and
        its stage 0 warns: rank 0's ``rank_zero_warn`` would hide another replica's). Used by a fit's first batch
        (:meth:`_check_same_batch`) and an evaluation run's (:meth:`_check_stages_read_alike`)."""
        layout = self.layout
        tensors, ids = checked
        device = self.root_device
        mine = torch.zeros(4, dtype=torch.float64, device=device)
        if tensors:
            mine = torch.cat([torch.tensor([1.0, float(ids)], dtype=torch.float64, device=device), _batch_checksum(tensors, device)])
        every = [torch.zeros_like(mine) for _ in range(layout.pp if local else dist.get_world_size())]
        dist.all_gather(every, mine, group=self._pipe_group if local else None)
        replicas = [layout.replica] if local else range(layout.dp)
        apart: dict[int, bool] = {}  # replica: whether its stages' batches hold integer tensors
        for replica in replicas:
            stages = [every[r if not local else k] for k, r in enumerate(layout.pipeline_ranks(replica))]
            if any(not torch.allclose(other, stages[0], rtol=1e-9, atol=0) for other in stages[1:]):
                apart[replica] = all(stage[1].item() == 1.0 for stage in stages)
        if not apart:
            return
        which = ", ".join(map(str, apart))
        returns = "" if what == "training" else " or the predictions that every rank of the replica returns"
        why = (
            f"The stages of pipeline replica{'s' if len(apart) > 1 else ''} {which} read different {what} batches (each "
            "rank of a pipeline replica must get the same batch: the first stage feeds its inputs, the last computes the loss "
            f"on its targets{returns})"
        )
        if any(apart.values()):
            raise BatchFormatError(f"{why}.", hint=_SAME_BATCH_HINT)
        warning = f"{why}, or a random augmentation differs between the ranks (seed them alike to rule it out). {_SAME_BATCH_HINT}"
        if not local:
            rank_zero_warn(warning)
        elif layout.stage == 0:  # only this replica's ranks compared: rank 0's rank_zero_warn would hide another replica's
            warnings.warn(warning, UserWarning, stacklevel=3)

    def _end_of_streams(self, what: str, *, parted: bool, ended: int, going: int) -> None:
        """Where this rank's run of an evaluation stream's loaders ``ended`` to ``going - 1`` ends (its last step in
        ``ended``, where its next batch is of loader ``going``, the number of loaders at the run's end; or the step
        where its replica's stages parted in ``ended``, :meth:`_stages_agree`), the replicas say whether their stages
        parted, and every rank raises the same error: the replica's own ranks alone raised, and the other replicas
        failed in the epoch-end average of the loss with gloo's error as the replica's processes left. One all-gather of
        the flag and ``going`` per loader over every rank, each rank at the end of its own run of that loader (the
        replicas' steps meet no other replica, so they end at different times), and so before Lightning averages a
        loader's logs over every rank when the next loader begins (a collective that a replica whose stages parted never
        joined: several validation loaders hung there). A loader the rank has no batch of ends where the one before it
        does (or where the run starts), so every rank gathers once per loader, in the loaders' order. Evaluation
        replicas going on to different loaders are refused too (one of them has none of a loader the others have, and
        they would part in Lightning's averages); predictions take no average, and a replica may have none. Only with
        several replicas: one replica's stages all know from the step."""
        layout = self.layout
        parted_replicas = [layout.replica] if parted else []
        if layout.dp > 1:
            device = self.root_device
            for _ in range(ended, ended + 1 if parted else going):
                every = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
                dist.all_gather(every, torch.tensor([int(parted), going], dtype=torch.int64, device=device))
                parted_replicas = sorted({rank // layout.pp for rank, flags in enumerate(every) if flags[0].item()})
                if parted_replicas:
                    break
                if what != _EVAL_WHAT["predict"]:
                    loop = self.lightning_module.trainer._active_loop
                    goes = [int(every[layout.pipeline_ranks(replica)[0]][1].item()) for replica in range(layout.dp)]
                    _refuse_replica_without_batches(goes, layout, what, len(loop._combined_loader.flattened))
        if parted_replicas:
            raise _streams_parted(parted_replicas, what, "one stage's ended where another's went on")

    def _check_last_batch(self) -> None:
        """Refuse, before the first step, an epoch whose short last batch cannot be split into the micro-batches
        (it used to fail when the epoch reached it). Only a map-style DataLoader that reaches its end is checked, whose
        batches torch's ``BatchSampler`` makes (from ``batch_size``, or a ``batch_sampler`` of that class or of a
        subclass that keeps its ``__iter__``): its batch size and samples per epoch read from its batch size or its
        batch sampler's (dp_ga's ``_samples_per_epoch``). A batch sampler that makes its batches itself may fill or pad
        the last one: its batches are left to the step."""
        from lightning_distplan.strategies.dp_ga import _samples_per_epoch

        trainer = self.lightning_module.trainer
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader) or isinstance(loader.dataset, torch.utils.data.IterableDataset):
            return  # auto_plan's loader (it drops a short tail itself), a loader of the user's own kind, or a stream
        batch_sampler = loader.batch_sampler
        if not (isinstance(batch_sampler, torch.utils.data.BatchSampler) and type(batch_sampler).__iter__ is torch.utils.data.BatchSampler.__iter__):
            return  # a batch sampler that makes its batches itself (one that fills or pads the last, or buckets by length)
        batch, samples = loader_batch_size(loader), _samples_per_epoch(loader)
        if batch is None or samples is None:
            return
        batches = math.ceil(samples / batch)
        limit = trainer.limit_train_batches
        if not ((isinstance(limit, float) and limit == 1.0) or (isinstance(limit, int) and limit >= batches)):
            return  # the epoch stops before its last batch
        if trainer.max_steps >= 0 and trainer.max_steps * trainer.accumulate_grad_batches < batches:
            return  # so does the run
        last = samples % batch
        n = self._n or auto_n_microbatches(batch, self.layout.pp)
        if last and last % n:
            raise BatchNotFactorableError(
                f"Each epoch ends with a batch of {last} samples per replica ({samples} samples in batches of {batch}), "
                f"which does not split into `n_microbatches` ({n}) equal micro-batches.",
                hint=f"Pass drop_last=True to the DataLoader, or give each replica a multiple of {n} samples.",
            )

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        interrupted = module is not None and module._trainer is not None and module.trainer.state.status == TrainerStatus.INTERRUPTED
        super().teardown()  # the module goes to the CPU first: the whole module never lands on a GPU
        if module is not None and module._trainer is not None:
            forget_whole_module_summaries(module.trainer.callbacks)  # a fit that stopped before its summary
        if self._pruned and self._unpruned and interrupted:
            # Stopped before the first optimizer step (a refusal at the first batch, a failing sanity check): the
            # weights are those before the run, kept on this rank, so the module is whole again without a collective.
            unprune_module(self._unpruned)
            self._pruned = False
            mark_partial(module, None)
        elif self._pruned and not interrupted and _distributed_is_initialized():
            # The user's module is whole again on every rank (its state_dict, a second Trainer on it, inference),
            # as after a DDP run. Not after an exception: a collective then could wait for a rank that is gone.
            layout = self.layout
            restore_full_module(module, self._ownership, stage=layout.stage, replica=layout.replica, group=self._object_group,
                                moved=self._loose.moved(module))
            self._pruned = False
            mark_partial(module, None)
        elif self._pruned and module is not None:
            rank_zero_warn(
                f"PipelineStrategy: the run stopped early, so the model on each rank still holds only its own pipeline stage's "
                f"weights (the others are empty tensors): do not save its state_dict. The whole model is in the last checkpoint "
                f"({type(module).__name__}.load_from_checkpoint), or call trainer.save_checkpoint(path) on every rank now."
            )
        self._unpruned = []
        if self._swapped_batchnorm:
            from lightning_distplan.strategies._pipeline_batchnorm import restore_batchnorm

            # the user's BatchNorm layers again (a DeferredBatchNorm under another strategy would commit its statistics
            # every n batches); a later fit of this strategy builds the pipeline, and converts them, again
            restore_batchnorm(self._swapped_batchnorm)
            self._swapped_batchnorm = []
            self._built = False
            self._schedules = {}  # they hold the old stage (its DeferredBatchNorm layers): the rebuild makes new ones

    # ------------------------------------------------------------------ steps

    def _loss_fn(self, output: Any, index: Tensor) -> Tensor:
        # The schedule only carries tensors as targets; it gets the micro-batch index and we look the
        # micro-batch's targets (any structure) up here.
        targets = self._targets[int(index.reshape(-1)[0])]
        if self._stage_module.output_form is not None:  # the last layer's mapping, flattened to cross torch's runtime
            output = self._stage_module.output_form.rebuild(output)
        with self.precision_plugin.forward_context():
            if self._loss_checked or not self._pruned:
                loss = self._spec.loss(output, targets)
            else:  # the first call after a build: the loss must not reach into another stage's (freed) tensors
                self._loss_checked = True
                freed = {
                    id(t): name for name, t in _named_tensors(self.lightning_module) if name not in self._keep_names and t.numel() == 0
                }
                with _RefuseTensors(freed, stage=self.layout.stage):
                    loss = self._spec.loss(output, targets)
        _check_scalar_loss(loss)
        return loss

    @contextmanager
    def _stage_random(self) -> Iterator[None]:
        """Run the pipeline on this rank's own random stream, and leave the process's generators as they were.

        Every rank of a replica starts from the same seed (``seed_everything``), so without this the dropout masks of
        stage 1 repeated stage 0's, and each stage consumed the process's generator by its own layers: the ranks'
        generators drifted apart, and so did what they feed a loader (random augmentation in the main process, the
        workers' base seed), which must stay the same on all stages of a replica. The stream is seeded once per
        build from one draw of the process's generator plus the global rank.
        """
        device = self.root_device
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
            if self._rng_state is None:
                torch.default_generator.manual_seed(self._rng_seed)
                if cuda:
                    with torch.cuda.device(device):
                        torch.cuda.manual_seed(self._rng_seed)
            else:
                torch.set_rng_state(self._rng_state[0])
                if cuda:
                    torch.cuda.set_rng_state(self._rng_state[1], device)
            try:
                yield
            finally:
                self._rng_state = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)

    def _schedule_for(self, mode: str, n: int, first_inputs: tuple[Tensor, ...]) -> Any:
        # What crosses the stages follows from what the first layer receives (the stages see nothing else of the
        # batch): keyed by the whole batch's shapes, targets of varying shapes (per-sample label sets, detection boxes)
        # built a new schedule, with torch's shape-inference forward, at every step.
        shapes = tuple((tuple(t.shape), t.dtype) for t in first_inputs)
        # torch's PipelineStage records at its first step whether the activations it receives need a gradient; after
        # a stage is unfrozen (BackboneFinetuning, gradual unfreezing) a schedule built before would send none back.
        training = tuple(any(p.requires_grad for p in params) for params in self._params_by_stage)
        key = (mode, n, shapes, training)
        if key in self._schedules:
            self._schedules[key] = self._schedules.pop(key)  # most recently used last
        else:
            if len(self._schedules) >= _SCHEDULE_CACHE:
                # batches of many shapes (dynamic padding): keep the recent ones, free the oldest stage's buffers
                del self._schedules[next(iter(self._schedules))]
                if not self._warned_shapes:
                    self._warned_shapes = True
                    rank_zero_warn(
                        f"PipelineStrategy: the batches came in more than {_SCHEDULE_CACHE} shapes; each new shape costs the "
                        "pipeline one extra forward to learn the shapes crossing its stages. Pad batches to a few fixed "
                        "lengths (e.g. multiples of 64) to avoid it."
                    )
            layout = self.layout
            stage = GuardedStage(
                self._stage_module, layout.stage, layout.pp, self.root_device, group=self._pipe_group,
                deferred_batchnorm=self._deferred_batchnorm,
            )
            cls = _SCHEDULES[self._schedule_name] if mode == "train" else ScheduleGPipe
            loss_fn = None if mode == "predict" else self._loss_fn
            self._schedules[key] = cls(stage, n, loss_fn=loss_fn, scale_grads=True)
        return self._schedules[key]

    def _batch_rows(self, batch: Any, loop: str, dataloader_idx: int = 0) -> int:
        """Samples in ``batch``, read as dp_ga and the profiler read them: a :class:`BatchSizer` over the loader's batches,
        which knows the batch size the loader yields (:func:`_yielded_batch_size`). So a per-batch constant (class
        weights before the labels) or a list of equally long per-sample sequences is not taken for the batch's rows, and
        every micro-batch's inputs and targets hold the samples a profiled micro-batch held."""
        key = (loop, dataloader_idx)
        sizer = self._sizers.get(key)
        if sizer is None:
            trainer = self.lightning_module.trainer
            sizer = self._sizers[key] = BatchSizer(_yielded_batch_size(_loader_of(trainer, loop, dataloader_idx)))
        size = sizer(batch)
        if size is None:
            raise BatchFormatError(
                f"A batch of type {type(batch).__name__} holds no tensor with a batch dimension, so it cannot be cut into "
                "pipeline micro-batches.",
                hint="Yield tensors (or tuples / lists / dicts / dataclasses of tensors) with the samples along dim 0.",
            )
        return size

    def _prepare(self, batch: Any, n: int, *, mode: str, size: int, targets: bool, what: str) -> tuple[Any, dict[str, Any]]:
        """The schedule for ``mode`` and these micro-batches, and the micro-batches as its ``step`` / ``eval`` take them."""
        layout = self.layout
        # Every rank splits (cheap views) so that a bad batch fails on all ranks alike.
        arg_mbs = split_microbatches(self._spec.inputs(batch), n, size=size, what=what)
        kwargs: dict[str, Any] = {}
        if layout.stage == 0:
            kwargs["arg_mbs"] = arg_mbs
        if targets:
            source = self._spec.targets(batch) if self._spec.targets is not None else batch
            if n > 1:
                self._refuse_uncut_targets(source, size, n)
            if layout.stage == layout.pp - 1:
                self._targets = split_structure(source, n, size=size)
                kwargs["target_mbs"] = [torch.tensor([i], device=self.root_device) for i in range(n)]
        return self._schedule_for(mode, n, arg_mbs[0]), kwargs

    def _refuse_uncut_targets(self, source: Any, size: int, n: int) -> None:
        """Refuse, on every rank, a part of what the loss gets that holds the batch's ``size`` rows in a form micro-batches
        are not cut from (an object of the user's with tensors as attributes): each micro-batch's loss got all its rows
        beside its own samples, as dp_ga and the profiler refuse it (:func:`uncut_part`)."""
        subject = "PipelineSpec.targets(batch)" if self._spec.targets is not None else "The batch"
        found = uncut_part_found(source, size, subject)
        if found is None:
            return
        raise BatchFormatError(
            f"{found}, which cannot be cut into the {n} pipeline "
            f"micro-batches: the loss of each would get all {size} rows of it beside its own {size // n} samples.",
            hint="Make it a tensor (or a dict, tuple or dataclass of tensors), or let PipelineSpec.targets return only the "
            "tensors the loss needs.",
        )

    def _local_mean(self, losses: list[Tensor]) -> Tensor:
        """The mean of this rank's micro-batch losses (none but on the last stage: 0)."""
        local = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros((), device=self.root_device)
        return local.to(self.root_device)

    def _global_mean(self, losses: list[Tensor]) -> Tensor:
        layout = self.layout
        local = self._local_mean(losses)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)  # only last-stage ranks contribute
        return local / layout.dp

    def _replica_mean(self, losses: list[Tensor], *, position: tuple[int, bool, str] | None = None) -> Tensor:
        """The mean loss of this replica's batch on each of its ranks (the last stage's, sent to the others over the
        pipeline's group). An evaluation step meets no other replica: without a DistributedSampler the replicas may
        hold different numbers of evaluation batches (a dataset per rank), and a collective over all ranks at every
        step (:meth:`_global_mean`) hung the one with more. Lightning's ``sync_dist`` averages over the ranks once,
        at the epoch's end, weighted by the batch sizes, as under DDP.

        ``position`` (the batch's dataloader index, that of the next batch's loader, and the loop's name), for a loader
        whose batches were not counted at its setup (a stream, :meth:`_agree_on_evaluation_batches`): the stages say
        where they are in the same collective (:meth:`_stages_agree`: the other stages add 0 to the loss), and a stage
        whose stream ended before another's is refused at the batch where they part (the stage that went on waited
        for good in gloo's send or recv), on every rank (:meth:`_end_of_streams`)."""
        layout = self.layout
        local = self._local_mean(losses)
        if layout.pp < 2 or not _distributed_is_initialized():
            return local
        if position is None:
            dist.broadcast(local, src=layout.pipeline_ranks(layout.replica)[-1], group=self._pipe_group)
            return local
        return self._stages_agree(position, local).to(local.dtype)

    def _stages_agree(self, position: tuple[int, int, str], carried: Tensor) -> Tensor:
        """Refuse the step where the stages of this replica, reading a loader without a length, part (one stage's stream
        ended where another's went on), and return ``carried`` summed over the stages, in the same collective: an
        all-reduce (a sum) of ``carried`` (0 but on the last stage), x and x² with x = (loaders + 1) · dataloader index +
        the loader of the next batch (:func:`_next_loader`), alike on every stage exactly when (Σx)² = pp·Σx². So the
        stages agree at a loader's last batch too, before Lightning averages its logs, not only at the run's last (one
        stage going on to the next loader where another's went on in this one hung in that average). The step where
        they part, and a loader's last step, end this rank's run of it (:meth:`_end_of_streams`), where every replica
        learns of it."""
        index, going, what = position
        at = (len(self.lightning_module.trainer._active_loop._combined_loader.flattened) + 1) * index + going
        mine = torch.tensor([0.0, at, at * at], dtype=torch.float64, device=carried.device)
        mine[0] = carried.double()
        dist.all_reduce(mine, group=self._pipe_group)
        total, squares = mine[1].item(), mine[2].item()
        parted = total * total != self.layout.pp * squares
        if parted or going != index:
            self._end_of_streams(what, parted=parted, ended=index, going=going)
        return mine[0]

    def _warn_bypass(self) -> None:
        if not self._warned_bypass:
            self._warned_bypass = True
            rank_zero_warn(
                "PipelineStrategy runs the pipeline itself: the LightningModule's training_step/validation_step/"
                "test_step/predict_step are not called; the loss is `PipelineSpec.loss`, logged as train_loss/val_loss/test_loss, "
                "and predict returns the last layer's output."
            )

    def _check_same_batch(self, batch: Any) -> None:
        """The stages of one replica must read the same batch (stage 0 its inputs, the last its targets): a user's
        own DistributedSampler or an IterableDataset sharded by ``dist.get_rank()`` gives each stage another one,
        and the pipeline would pair one batch's inputs with another's targets. Checked once per fit, at its first batch,
        by the batch's integer tensors (refused); a batch of floats only is compared too, but only warned about
        (:meth:`_compare_stages_batches`). Over every rank: gathered over the replica's stages alone, only the ranks of
        the replica whose stages differed raised, and the other replicas waited for them in the gradients' all-reduce
        (a hang, or gloo's error as they left); rank 0 warned only of its own replica's floats."""
        if self._checked_batch or self.layout.pp < 2 or not _distributed_is_initialized():
            return
        self._checked_batch = True
        self._compare_stages_batches(_checked_tensors(batch), "training")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = args[0] if args else kwargs["batch"]
        self._warn_bypass()
        self._check_same_batch(batch)
        size = self._batch_rows(batch, "train")
        if self._n is None:
            self._n = auto_n_microbatches(size, self.layout.pp)
            if self._schedule_name == "1f1b":
                _check_1f1b(self._n, self.layout.pp)
        if self._per_replica_batch is None:
            self._per_replica_batch = size
        self._flushes = self.lightning_module.trainer.accumulate_grad_batches  # a GradientAccumulationScheduler changes it
        schedule, mb_kwargs = self._prepare(batch, self._n, mode="train", size=size, targets=True, what="per-replica batch")
        losses: list[Tensor] = []
        # The schedule accumulates into .grad and then divides ALL of .grad by n, so it must start from
        # None; the gradients already there (last step's, or accumulated ones) go back afterwards and
        # Lightning's zero_grad decides their fate. Where that is sure to be "freed" (see
        # _zero_grad_frees), last step's are let go now: kept, every stage held two sets of gradients
        # while its backward ran, where DDP frees the old set before its backward starts.
        params = list(self._stage_module.parameters())
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        previous = [None if _zero_grad_frees(self.lightning_module, batch_idx) else p.grad for p in params]
        for p in params:
            p.grad = None
        with torch.enable_grad(), self._stage_random():
            schedule.step(**mb_kwargs, losses=losses, return_outputs=False)
        # Lightning calls zero_grad between training_step and backward: park the new gradients until backward.
        for p, old in zip(params, previous):
            if p.grad is not None:
                self._parked[p] = _owned(p.grad)
            p.grad = old
        loss = self._global_mean(losses)
        self.lightning_module.log("train_loss", loss, prog_bar=True, batch_size=size, sync_dist=False)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accumulate = module.trainer.accumulate_grad_batches if module._trainer is not None else 1
        # This step's gradients are reduced over the replicas and the stages sharing a parameter before they
        # join what earlier accumulation steps left in .grad: reduced after, a tied parameter's earlier
        # gradients were summed over its stages once more at every step.
        # (in place: the parked gradients are this strategy's alone; a copy held a third set at the end of the step)
        fresh = {p: (grad.div_(accumulate) if accumulate > 1 else grad) for p, grad in self._parked.items()}
        self._parked.clear()
        layout = self.layout
        if self._dp_group is not None:
            _all_reduce_mean(self._stage_params, fresh, self._dp_group, divide_by=layout.dp)
        for params, group in self._shared:
            _all_reduce_mean(params, fresh, group, divide_by=layout.dp)
        for p, grad in fresh.items():
            if p.grad is None:
                p.grad = grad
            else:  # as autograd accumulates into .grad
                p.grad.add_(grad)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        self._check_param_groups(optimizer)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._unpruned = []  # the weights moved on: the pre-run values are stale (a later failure leaves the checkpoints)
        return out

    def _eval_step(self, batch: Any, name: str, dataloader_idx: int) -> Tensor:
        size = self._batch_rows(batch, name, dataloader_idx)
        n = _largest_divisor_at_most(size, self._n or 4 * self.layout.pp)
        schedule, mb_kwargs = self._prepare(batch, n, mode="eval", size=size, targets=True, what="evaluation batch")
        losses: list[Tensor] = []
        with self._stage_random():
            schedule.eval(**mb_kwargs, losses=losses)
        prefix = "val" if name == "val_loss" else "test"
        position = None
        if prefix in self._uncounted_eval:
            position = (dataloader_idx, _next_loader(self.lightning_module.trainer._active_loop, dataloader_idx), _EVAL_WHAT[prefix])
        loss = self._replica_mean(losses, position=position)
        # Every rank holds its replica's mean; sync_dist averages them over the ranks once per epoch (evaluation
        # logs on epoch), weighted by the batch sizes: every sample counts alike, as under DDP, also where the
        # replicas ran different numbers of batches. It also spares the user Lightning's advice to add it to a log
        # call that is ours.
        self.lightning_module.log(name, loss, prog_bar=True, batch_size=size, sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        self._warn_bypass()
        return self._eval_step(args[0] if args else kwargs["batch"], "val_loss", _dataloader_idx(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        self._warn_bypass()
        return self._eval_step(args[0] if args else kwargs["batch"], "test_loss", _dataloader_idx(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs["batch"]
        self._warn_bypass()
        layout = self.layout
        size = self._batch_rows(batch, "predict", _dataloader_idx(args, kwargs))
        n = _largest_divisor_at_most(size, self._n or 4 * layout.pp)
        schedule, mb_kwargs = self._prepare(batch, n, mode="predict", size=size, targets=False, what="prediction batch")
        with self._stage_random():
            out = schedule.eval(**mb_kwargs)
        form = self._stage_module.output_form  # the last layer's mapping: built again from its merged tensors, its own type
        holder = [(_cpu(out) if form is None else form.rebuild(_cpu(out))) if layout.stage == layout.pp - 1 else None]
        if layout.pp > 1 and "predict" in self._uncounted_eval:
            # A stream's stages must end together, as in _eval_step; the broadcast below goes one way, from the last
            # stage, so it cannot carry the other stages' places: one small all-reduce more per step, for streams only
            # (a stage whose stream ended first left the loop, and the one that went on waited in gloo's send or recv).
            index = _dataloader_idx(args, kwargs)
            position = (index, _next_loader(self.lightning_module.trainer._active_loop, index), _EVAL_WHAT["predict"])
            self._stages_agree(position, torch.zeros((), device=self.root_device))
        if layout.pp > 1:
            dist.broadcast_object_list(holder, src=layout.pipeline_ranks(layout.replica)[-1], group=self._pipe_group)
        return holder[0]

    # ------------------------------------------------------------------ checkpoints

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: the LightningModule's full ``state_dict`` on global rank 0 (empty on other ranks)."""
        layout = self.layout
        module = self.lightning_module
        return gather_full_state_dict(module, self._ownership, stage=layout.stage, replica=layout.replica, moved=self._loose.moved(module),
                                      group=self._object_group)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._built:
            return super().lightning_module_state_dict()
        return self.full_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        index = getattr(self, "_opt_index", {}).get(id(optimizer))
        if index is None:
            return optimizer.state_dict()
        self._check_param_groups(optimizer)
        return gather_full_optimizer_state(optimizer, index, replica=self.layout.replica, group=self._object_group)

    def _check_param_groups(self, optimizer: Optimizer) -> None:
        """Refuse an optimizer whose param groups changed in number since the pipeline took its stage's share."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        index = getattr(self, "_opt_index", {}).get(id(optimizer))
        if index is not None and len(optimizer.param_groups) != len(index.full_group_sizes):
            raise InfeasiblePlanError(
                f"The optimizer has {len(optimizer.param_groups)} param groups, but {len(index.full_group_sizes)} when the pipeline "
                "split it by stage: a group added during the fit (optimizer.add_param_group) holds other stages' parameters, "
                "which this process does not have.",
                hint="Give configure_optimizers every parameter from the start (frozen ones get no gradient, so they do not "
                "move) and unfreeze with requires_grad_(True), or train with strategy='dp_ga' / 'ddp'.",
            )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if not self._built:
            return super().load_model_state_dict(checkpoint, strict=strict)
        local = module.state_dict(keep_vars=True)
        mine = {k: v for k, v in checkpoint["state_dict"].items() if k in local and local[k].numel() > 0}
        missing = [k for k in self._ownership.keys if k not in checkpoint["state_dict"]]
        if strict and missing:
            raise CheckpointMismatchError(
                f"The checkpoint misses {len(missing)} entries of the model, e.g. {missing[:3]}.", hint="Load a checkpoint of this model."
            )
        unexpected = [k for k in checkpoint["state_dict"] if k not in local]
        if strict and unexpected:  # as module.load_state_dict refuses them before the pipeline is built
            raise CheckpointMismatchError(
                f"The checkpoint holds {len(unexpected)} entries the model does not have, e.g. {unexpected[:3]}.",
                hint="Load a checkpoint of this model, or set strict_loading = False on the LightningModule to leave them out.",
            )
        module.load_state_dict(mine, strict=False)
        self._loose.reset(module)  # every rank now holds the checkpoint's loose entries: none moved yet
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        raw = [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
        # Prefer the by-name state (written by every lightning_distplan strategy); fall back to torch's ids.
        if load_portable_optimizer_states(raw, self.lightning_module.named_parameters(), checkpoint):
            for optimizer in raw:
                _optimizer_to_device(optimizer, self.root_device)
            return
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"]):
            index = self._opt_index[id(getattr(optimizer, "_optimizer", optimizer))]
            optimizer.load_state_dict(local_optimizer_state(full, index))
            _optimizer_to_device(optimizer, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        checkpoint = read_checkpoint(load, checkpoint_path, strategy=self)  # a file cut short or not Lightning's: one sentence
        self._checkpoint_plan = readable_plan(checkpoint, "PipelineStrategy")
        return checkpoint

    @override
    def _complete_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The portable keys; the by-name optimizer state on global rank 0 only, which alone holds the gathered one
        (:meth:`optimizer_state`). Inside :meth:`save_checkpoint`'s agreement: an error here reached rank 0 alone, and
        the other ranks' save waited in its all-reduce for a rank that had gone on (a hang, or gloo's "Connection
        closed by peer")."""
        by_name = None
        if self._built and self.is_global_zero and "optimizer_states" in checkpoint:
            check_states_to_save(checkpoint["optimizer_states"])  # a user's hook changed them: one sentence, not a KeyError
            by_name = [
                optimizer_state_names(full, self._opt_index[id(getattr(opt, "_optimizer", opt))])
                for opt, full in zip(self.optimizers, checkpoint["optimizer_states"])
            ]
        add_portable_state(checkpoint, plan=self.plan, optimizer_states_by_name=by_name, context=plan_context(self))


class _PipelineMultiProcessingLauncher(_MultiProcessingLauncher):
    """Hands the *full* weights back to the main process (each worker holds one stage only)."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        import os
        import tempfile

        strategy = self._strategy
        assert isinstance(strategy, PipelineStrategy)
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        state_dict = strategy.lightning_module_state_dict()  # collective
        if strategy.global_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(prefix=_WEIGHTS_FOLDER), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning's, then the folder the weights crossed in goes too (Lightning removes only the file)."""
        import os
        import shutil

        try:
            super()._recover_results_in_main_process(worker_output, trainer)
        finally:
            path = worker_output.weights_path
            if path is not None and os.path.basename(os.path.dirname(path)).startswith(_WEIGHTS_FOLDER):
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


_WEIGHTS_FOLDER = "distplan-pipeline-weights-"


def _no_module() -> None:
    """What ``PipelineStrategy._built_for`` returns before a build (a module-level function: the strategy is pickled by spawn)."""
    return None


def unfit_checkpoint_plan(stored: Plan, *, schedule: str | None, world_size: int, loader_batch: int | None, accumulate: int,
                          layer_names: Sequence[str] = ()) -> str | None:
    """Why a checkpoint's plan cannot run this resumed pipeline fit (``None``: it can).

    It fits when it is a pipeline plan of this strategy's ``schedule`` (``None``: any), for this world size, over
    these pipeline layers, and its micro-batches make up the loader's per-replica batch in as many flushes per
    optimizer step (``Trainer(accumulate_grad_batches)``): the same global batch, cut alike.
    """
    if stored.strategy not in _SCHEDULES:
        return f"it is a {stored.strategy} plan, not a pipeline"
    if schedule is not None and stored.strategy != schedule:
        return f"it runs {stored.strategy}, this strategy {schedule}"
    if stored.world_size != world_size:
        return f"it was made for {stored.world_size} processes, this run has {world_size}"
    if stored.layer_names and layer_names and tuple(stored.layer_names) != tuple(layer_names):
        return "its layers are not this model's pipeline layers"
    if layer_names and stored.stage_boundaries and max(stored.stage_boundaries) >= len(layer_names):
        return f"its stage boundaries {list(stored.stage_boundaries)} do not split this model's {len(layer_names)} pipeline layers"
    if loader_batch is None:
        return "the train loader's batch size cannot be read"
    per_replica = stored.micro_batch_size * stored.n_microbatches
    if per_replica != loader_batch or stored.accumulate_grad_batches != accumulate:
        return (f"it was made for global batch {stored.global_batch_size} ({stored.dp} replica(s) x {per_replica} samples x "
                f"{stored.accumulate_grad_batches} flush(es)), this run's is {stored.dp * loader_batch * accumulate} "
                f"({stored.dp} x loader batch {loader_batch} x accumulate_grad_batches {accumulate})")
    return None


_STEP_OF = {"train": "training_step", "val": "validation_step", "test": "test_step", "predict": "predict_step"}  # a loop's prefix
_EVAL_WHAT = {"val": "validation", "test": "test", "predict": "prediction"}  # a loop's dataloader prefix, in a sentence


class _FetcherStartingARun(_PrefetchDataFetcher):
    """Lightning's fetcher of an evaluation run until its first fetch, which first runs ``start_run``
    (:meth:`PipelineStrategy._check_evaluation_start`, set with this class at the run's start, whose checks fetch the
    first batch ahead): after the ``on_*_epoch_start`` hooks, where Lightning fetches it. Then Lightning's own again."""

    start_run: Callable[[], None]

    @override
    def __next__(self) -> Any:
        self.__class__ = _PrefetchDataFetcher  # its later fetches, and this one after the checks: Lightning's own
        self.__dict__.pop("start_run")()
        return next(self)


def _prefetch_stream(fetcher: object) -> None:
    """Fetch the first batch of a run now (for :meth:`PipelineStrategy._check_stages_read_alike`, whatever its loaders;
    and of streams), as Lightning does for a stream without a limit, so that ``done``
    (and each step's ``is_last_batch``) says where this rank's stream ends. A limit of batches as an int
    (``limit_val_batches=2``, or ``num_sanity_val_steps`` while sanity checking) gives the loaders a length, and
    Lightning then prefetches nothing: ``done`` was false on a rank with no batch, and ``is_last_batch`` held only at
    the limit's batch, never on a rank whose stream ended before it, which then skipped the all-gather where the others'
    runs ended (:meth:`PipelineStrategy._end_of_streams`; replicas of 2 batches and 1 under a limit of 2 hung there).
    Without a length the fetcher learns of the end one batch ahead, the loaders' limits still stopping it. The
    length's count still ends the run, the iterator cut to what ``fetched`` leaves of ``length`` (one batch at least,
    as Lightning runs): a fit restarted mid-validation counts the batches run before its checkpoint as fetched
    (Lightning's ``fetched += batch_progress.current.ready``) and runs the rest; with the length cleared alone, it ran
    the whole loader again. A
    ``dataloader_iter`` step's fetcher is left as it is (such a step is refused first,
    :meth:`PipelineStrategy._refuse_dataloader_iter`)."""
    from lightning.pytorch.loops.fetchers import _DataFetcher

    if not isinstance(fetcher, _PrefetchDataFetcher) or fetcher.length is None or fetcher.batches:
        return
    fetcher.iterator = itertools.islice(fetcher.iterator, max(fetcher.length - fetcher.fetched, 1) if fetcher.length else 0)
    fetcher.length = None
    for _ in range(fetcher.prefetch_batches):
        try:
            fetcher.batches.append(_DataFetcher.__next__(fetcher))
        except StopIteration:
            break


def _next_loader(loop: Any, index: int) -> int:
    """The index of the loader that the next batch of the evaluation ``loop``'s streams comes from (the fetcher has
    fetched it ahead, :func:`_prefetch_stream`; several loaders run one after another), ``index`` where none was fetched
    ahead, and the number of loaders where the run ends (so at the run's start: that of the first batch)."""
    fetcher = loop._data_fetcher
    if fetcher.done:
        return len(loop._combined_loader.flattened)
    return fetcher.batches[0][2] if getattr(fetcher, "batches", None) else index


def _refuse_replica_without_batches(goes: list[int], layout: PipelineLayout, what: str, loaders: int) -> None:
    """Refuse, on every rank, evaluation replicas whose streams go on to different loaders (``goes``, each replica's
    next loader, ``loaders`` where it has no batch left): the ones going further have none of the nearest, and the
    others would wait for them in Lightning's average of that loader's logs, a collective they never join."""
    nearest = min(goes)
    empty = [replica for replica, going in enumerate(goes) if going > nearest]
    if not empty:
        return
    of = "" if loaders == 1 else f" of loader {nearest}"
    raise BatchFormatError(
        f"Pipeline replica {empty[0]} (ranks {', '.join(map(str, layout.pipeline_ranks(empty[0])))}) has no {what} batches{of} "
        "(its loader without a length yielded none) while other replicas have some, and the others would wait for it in a "
        "collective it never joins.",
        hint="Give every replica at least one batch (with use_distributed_sampler=False each replica reads a loader of "
        "its own: none may be empty), or let Lightning shard one dataset (use_distributed_sampler=True).",
    )


def _streams_parted(replicas: list[int], what: str, how: str) -> BatchFormatError:
    """The refusal of pipeline replicas whose stages read different numbers of batches from loaders without a length."""
    which = f"replica {replicas[0]}" if len(replicas) == 1 else f"replicas {', '.join(map(str, replicas))}"
    return BatchFormatError(
        f"The stages of pipeline {which} read different numbers of {what} batches from a loader without a length ({how}), "
        "but they must run the same batches together.",
        hint="Give every rank of a pipeline replica the same loader: shard a stream by trainer.strategy.distributed_sampler_kwargs"
        "['rank'] / ['num_replicas'] (the data-parallel replica), not by the global rank.",
    )


def _check_1f1b(n: int, pp: int) -> None:
    if n < pp:
        raise InfeasiblePlanError(
            f"`n_microbatches` ({n}) must be >= the number of pipeline stages ({pp}) for 1F1B.",
            hint="Raise `n_microbatches` or use schedule='gpipe'.",
        )


def _dataloader_idx(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``dataloader_idx`` Lightning passes an evaluation step (only when it has several loaders), else 0."""
    idx = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
    return idx if isinstance(idx, int) else 0


@dataclasses.dataclass(frozen=True)
class _FirstBatch:
    """The run's first batch as its step gets it (through the transfer hooks, on the module's ``device``) and its ``rows``
    as the step reads them (:meth:`PipelineStrategy._batch_rows`), for the checks before the cut."""

    batch: Any
    rows: int
    device: torch.device

    def samples(self, k: int) -> Any | None:
        """The batch's first ``k`` samples; None where it holds fewer. The whole batch where a part of it holds its rows
        uncut (:func:`uncut_part`, an object holding them): ``k`` samples beside that part fail in the loss where the first
        step refuses it in its own sentence."""
        from lightning_distplan.profiling._batches import slice_samples

        if uncut_part(self.batch, self.rows) is not None:
            return self.batch
        return slice_samples(self.batch, 0, k, self.rows) if k <= self.rows else None

    def rows_in(self, k: int) -> int:
        """The samples :meth:`samples` gives for ``k``."""
        return self.rows if uncut_part(self.batch, self.rows) is not None else k


def _fresh_loader(trainer: pl.Trainer) -> Any:
    """A new instance of the loader the run reads first (never its loop's): the train loader for a fit
    (:func:`fresh_train_loader`), else the first of the validation / test / predict loaders.

    Raises:
        InfeasiblePlanError: a fit has no train loader, or several. Any error of the user's loader hook.
    """
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
    from lightning.pytorch.utilities import CombinedLoader

    from lightning_distplan.strategies._auto_planning import fresh_train_loader

    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        return fresh_train_loader(trainer)
    loop = {TrainerFn.VALIDATING: trainer.validate_loop, TrainerFn.TESTING: trainer.test_loop}.get(fn, trainer.predict_loop)
    loader = _request_dataloader(loop._data_source)
    if isinstance(loader, CombinedLoader):
        loader = loader.flattened
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()))
    return loader[0] if isinstance(loader, (list, tuple)) else loader


def _loader_of(trainer: pl.Trainer, loop: str, dataloader_idx: int) -> Any:
    """The loader whose batches ``loop`` (``"train"``, ``"val_loss"``, ``"test_loss"``, ``"predict"``) runs, None when there is
    no one loader (several combined for training, or none)."""
    loaders = {"train": lambda: trainer.train_dataloader, "val_loss": lambda: trainer.val_dataloaders,
               "test_loss": lambda: trainer.test_dataloaders, "predict": lambda: trainer.predict_dataloaders}[loop]()
    if loop != "train" and isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if loop != "train" and isinstance(loaders, (list, tuple)):
        return loaders[dataloader_idx] if 0 <= dataloader_idx < len(loaders) else None
    return loaders


def _yielded_batch_size(loader: Any) -> int | None:
    """Samples per batch ``loader`` yields: auto_plan's re-chunking loader yields its ``micro_batch_size`` (the plan's
    per-replica batch) and answers ``batch_size`` with the user's loader's; else :func:`loader_batch_size`."""
    from lightning_distplan.strategies.dp_ga import _MicroBatchLoader

    return loader.micro_batch_size if isinstance(loader, _MicroBatchLoader) else loader_batch_size(loader)


def _largest_divisor_at_most(size: int, cap: int) -> int:
    return next(d for d in range(min(size, cap), 0, -1) if size % d == 0)


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def _warn_stage_local_hooks(module: Any, callbacks: Iterable[Any]) -> None:
    """Warn (rank 0) when the module or a callback defines a hook that reads gradients: it runs in each process on that
    process's stage only, so a norm it takes there (Lightning's ``grad_norm(self)``) is the stage's. Whether the hook
    already calls ``strategy.grad_norm()`` cannot be told, so it is warned too; Python shows the warning once per process."""
    where = _hooks_defined(module, callbacks, _GRADIENT_HOOKS)
    if where:
        rank_zero_warn(
            f"PipelineStrategy: {', '.join(where)} run(s) in each process on its own pipeline stage, so the gradients and "
            "weights read there are that stage's only (Lightning's grad_norm(self) gives the stage's norm). For the whole "
            "model's gradient norm call self.trainer.strategy.grad_norm() on every rank."
        )


def _owned(grad: Tensor) -> Tensor:
    """A copy of ``grad`` in storage of its own. Autograd may keep a parameter's gradient in the storage of the gradient
    it received (a parameter used as ``x + b.view(1, -1)`` gets the incoming gradient's storage, and ``_is_view()`` does
    not say so); on a pipeline stage that is the runtime's receive buffer, which the next flush receives into,
    overwriting the gradients kept for accumulation (up to 0.40 off in a 2-flush test) or zeroed in place. The copy is
    made one tensor at a time, as the original is let go, so it holds at most one extra tensor."""
    return grad.clone()


def _zero_grad_frees(module: Any, batch_idx: Any) -> bool:
    """Whether Lightning sets every ``.grad`` to None right after this ``training_step``.

    It calls ``zero_grad`` at the first batch of each accumulation cycle
    (``_AutomaticOptimization._make_zero_grad_fn``); the stock ``optimizer_zero_grad`` calls the
    optimizer's stock ``zero_grad()``, which sets them to None. A module that overrides either, or a
    module or callback with an ``on_before_zero_grad`` hook (it may read last step's gradients), keeps
    them until Lightning's own call.
    """
    trainer = module._trainer if module is not None else None
    if trainer is None or not isinstance(batch_idx, int) or batch_idx % trainer.accumulate_grad_batches != 0:
        return False
    if is_overridden("optimizer_zero_grad", module) or _hooks_defined(module, trainer.callbacks, ("on_before_zero_grad",)):
        return False
    return all(type(opt).zero_grad is Optimizer.zero_grad for opt in trainer.optimizers)


def _hooks_defined(module: Any, callbacks: Iterable[Any], hooks: Sequence[str]) -> list[str]:
    """``"Class.hook"`` for each of ``hooks`` that the LightningModule or a callback defines."""
    where = [f"{type(module).__name__}.{hook}" for hook in hooks if is_overridden(hook, module)]
    return where + [f"{type(cb).__name__}.{hook}" for cb in callbacks for hook in hooks if is_overridden(hook, cb, parent=Callback)]


_SAME_BATCH_HINT = (
    "Let Lightning shard the data (no DistributedSampler of your own; an IterableDataset must shard by "
    "trainer.strategy.distributed_sampler_kwargs['rank'] / ['num_replicas'], the data-parallel replica, not the global rank)."
)


def _checked_tensors(batch: Any) -> tuple[list[Tensor], bool]:
    """The tensors of ``batch`` whose checksum tells whether the stages read the same batch, and whether they are its
    integer tensors. Integer tensors (labels, token ids, indices) tell which samples a rank read; float data, uint8 images
    and bool masks may differ between ranks by a random augmentation that keeps inputs and targets paired: compared only
    where there are no integer tensors, and a difference in them only warned about."""
    tensors = [t for t in tensors_in(batch) if not t.is_complex()]
    ids = [t for t in tensors if not t.is_floating_point() and t.dtype not in (torch.uint8, torch.bool)]  # not images, masks
    return ids or tensors, bool(ids)


def _batch_checksum(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """``[sum of every value of tensors, number of tensors]`` (float64) on ``device``, the tensor the stages of a replica
    all-gather to tell whether they read the same batch (:meth:`PipelineStrategy._check_same_batch`). Each sum moves to
    ``device`` before they meet: a step's batch lies on the rank's GPU, and the count's tensor was made on the CPU beside
    it in one ``torch.stack``, which refuses tensors on two devices (every pipeline fit on GPUs failed at its first step);
    a batch whose ``transfer_batch_to_device`` left a tensor on the CPU mixes devices too."""
    sums = torch.stack([t.detach().double().sum().to(device) for t in tensors]).sum()
    return torch.stack([sums, torch.tensor(float(len(tensors)), dtype=torch.float64, device=device)])


def _all_reduce_mean(params: list[nn.Parameter], grads: dict[nn.Parameter, Tensor], group: Any, *, divide_by: int) -> None:
    """Sum ``grads`` of the trainable ``params`` over ``group`` in one flat buffer and divide by ``divide_by``, in place.

    A trainable parameter without a gradient here takes part with zeros (another rank may have one); one that no
    rank of the group has a gradient for gets none, as DistributedDataParallel(find_unused_parameters=True) leaves
    it, so no optimizer's weight decay or momentum moves it (a zero gradient would). A frozen one
    (``requires_grad=False``) takes no part and gets no gradient either.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    # how many ranks have each parameter's gradient travels at the end of the same buffer (one number per parameter)
    have = torch.tensor([float(p in grads) for p in params], dtype=params[0].dtype, device=params[0].device)
    flat = torch.cat([*((grads[p] if p in grads else torch.zeros_like(p)).reshape(-1) for p in params), have])
    dist.all_reduce(flat, group=group)
    used = (flat[-len(params) :] > 0).tolist()
    flat /= divide_by
    offset = 0
    for p, anywhere in zip(params, used):  # back into the gradients given (this strategy's own), so no second set beside the flat buffer
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p in grads:
            grads[p].copy_(chunk)
        elif anywhere:
            grads[p] = chunk.clone()
        offset += n


def _check_scalar_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else described(loss)
        raise BatchFormatError(
            f"PipelineSpec.loss returned {what}; it must return the micro-batch's mean loss as a scalar tensor.",
            hint="Reduce the loss in PipelineSpec.loss, e.g. F.cross_entropy(..., reduction='mean') or loss.mean().",
        )


def _check_joinable(output: Any, rows: int, index: int, layer: Any) -> Any:
    """``output``, what ``layers[index]`` (the last layer) returned for ``rows`` samples, where predict can return it:
    torch's runtime joins the micro-batches' outputs along dim 0 (``torch.cat`` of each tensor, of each value of a
    mapping), which fails on the last stage alone for a 0-d tensor and joins a tensor without the rows there (a [3] class
    bias beside [rows, 3] logits) into a wrong one.

    Raises:
        ModelSplitError: a tensor in ``output`` is 0-d or holds another number of rows than ``rows`` along dim 0.
    """
    if isinstance(output, Mapping):
        items = [(f" under {key!r}", value) for key, value in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(f" at [{i}]", value) for i, value in enumerate(output)]
    else:
        items = [("", output)]
    for where, value in items:
        if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != rows):
            raise ModelSplitError(
                f"PipelineSpec.layers[{index}] ({type(layer).__name__}), the last layer, returned a tensor of shape "
                f"{tuple(value.shape)}{where} for {rows} sample(s); predict joins the micro-batches' outputs along dim 0, so "
                "each tensor it returns must hold one row per sample there.",
                hint="Return per-sample tensors only from the last layer (compute a batch-wide value such as logits.sum() "
                "from predict's output), or predict with strategy='dp_ga' / 'ddp'.",
            )
    return output


def _named_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has (tied ones more than once)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


class _RefuseTensors(TorchFunctionMode):
    """Refuse any torch call on the given tensors (``id`` -> name): the other stages' freed weights, which a loss
    that reaches into another stage's layer (a tied output projection ``h @ self.embed.weight.T``) would otherwise
    meet as empty tensors, failing deep in torch with a size mismatch."""

    def __init__(self, tensors: dict[int, str], *, stage: int) -> None:
        super().__init__()
        self._tensors = tensors
        self._stage = stage

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in tensors_in((args, kwargs)):
            name = self._tensors.get(id(value))
            if name is not None:
                raise ModelSplitError(
                    f"PipelineSpec.loss uses `{name}`, which belongs to a layer of another pipeline stage; the last stage "
                    f"(stage {self._stage}) holds only its own layers' weights.",
                    hint="Compute it in a layer of the last stage instead (e.g. a head module that uses the embedding's "
                    "weight: a parameter shared by layers of several stages is kept on each, with its gradient summed).",
                )
        return func(*args, **kwargs)
