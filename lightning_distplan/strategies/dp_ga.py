"""``dp_ga``: data parallel with gradient accumulation at a planned micro-batch size.

One optimizer step = every one of the ``dp`` replicas runs ``s`` micro-batches of ``m`` samples,
so the global batch is ``B = dp·m·s`` (seed 000 §III-A; DESIGN §3.1). Only the last micro-batch's
backward all-reduces: Lightning's automatic optimization already runs the accumulation
micro-batches inside ``strategy.block_backward_sync()`` (``DistributedDataParallel.no_sync``,
see ``lightning.pytorch.loops.optimization.automatic._AutomaticOptimization.run``) and divides each
micro-batch loss by ``trainer.accumulate_grad_batches``. This strategy builds on exactly that and
adds only what is missing: running the PLANNED ``m`` and ``s`` without the user editing their
DataModule.

Mechanism (why this one): the strategy re-chunks the train loader's per-rank batches into
micro-batches of ``m`` samples in :meth:`DPGAStrategy.process_dataloader` — the hook Lightning
calls after it has injected the ``DistributedSampler`` — and sets ``trainer.accumulate_grad_batches
= s``. Re-chunking keeps the user's loader untouched (custom samplers, batch samplers and collate
functions keep working, which re-instantiating a ``DataLoader`` with another ``batch_size``
does not), yields the same samples in the same order on the same rank (so an epoch covers the
same data and the sample-to-step assignment is unchanged), and costs nothing when ``m`` divides
the loader batch (``Tensor.split`` returns views). When ``m`` is larger than the loader batch,
consecutive loader batches are concatenated.

The user's global batch is ``loader batch size × world size × Trainer(accumulate_grad_batches)``;
a plan must factor that same number.

What Lightning counts in batches keeps the user's meaning. Lightning sees micro-batches, so an
integer ``Trainer(limit_train_batches=k)`` becomes the micro-batches of the first ``k`` loader
batches (the wrapper stops there; a fraction is first turned into loader batches as Lightning does),
and a ``val_check_interval`` that counts batches validates after the micro-batch in which the user's
run would validate, decided micro-batch by micro-batch (an epoch's short last batch holds fewer
micro-batches than the others, which a fixed count of micro-batches would not follow); both
settings are restored after ``fit``. A loader batch shorter than the others (the end of an epoch
without ``drop_last``) gets the weight it has in the user's run: Lightning divides every
micro-batch loss by ``s``, and a plain run weighs each loader batch's mean loss by
``1 / accumulate_grad_batches`` whatever its size, so each micro-batch's loss is multiplied by
``s / accumulate · Σ (its samples from loader batch b) / (size of b)``, which is 1 for every
micro-batch cut from full loader batches. The weights are exact where a micro-batch's samples come
from loader batches of one size; a micro-batch that joins the short batch to a full one (``m``
larger than the loader batch, or not dividing it) gets the right total weight spread evenly over
its samples, with one warning per fit (a per-sample weight would need the user's loss). A loader
batch of another size *before* the epoch's end (a batch sampler of varying sizes) shifts every
later micro-batch against the user's batches, so the steps no longer follow them: warned once too
(on several processes where the size the ranks agree on, below, is another). Where the epoch's micro-batches are counted
from that size (several processes, a limit of loader batches, a batch sampler that drops the short last batch), larger
batches that fill the count before the last batch, or overflow it, are refused: Lightning ended the epoch at the count,
before its last samples (larger ones that fit, 12, 4, 8 counted as 3 of 8, train whole). So are batches that overflow a
count of the sampler's samples (a ``collate_fn`` that makes two rows of each sample: 16-row batches of 8 indices).
On several processes the ranks must run the same micro-batches: Lightning broadcasts at every batch
and DDP all-reduces at every step, so ranks whose short last batches differ (a per-rank sampler or
dataset, a stream sharded by rank: 17 and 23 samples cut by ``m = 20`` into 1 and 2 micro-batches)
deadlocked the fit. There (no ``DistributedSampler``) the ranks agree on each loader batch's size: one
all-reduce (MAX) of three integers per loader batch, on the strategy's root device, and every rank cuts
the batch as one of the largest size. The rank(s) holding it cut it as one process does (equal shards:
exactly as one process, no micro-batch shorter than that cut's); a rank with fewer samples spreads them
evenly over as many micro-batches (the weights stay as above), and where it has fewer samples than those
micro-batches (1 sample where another rank's 23 make 3), fills the others with its first sample at loss
weight 0: no gradient, but ``training_step`` sees it (warned on that rank). Any error a rank's loader raises
as a batch is pulled (an ``IndexError`` of its Dataset, a collate error) goes through that agreement too: that rank
raises it with its own traceback, the others a ``RuntimeError`` naming it and the rank (they waited at the next
agreement). As under DDP, each rank's
loader must yield the same number of batches: where the ranks' loaders report one length (a stream with a
global ``__len__``) a rank whose loader ends first raises on every rank; where their lengths differ (per-rank
map-style datasets of different batch counts) Lightning stops each at its own and the ranks fall out of step
(as DDP's do). A refusal that may hold on one rank only (its batch sampler's samples per epoch cannot be
counted, its first batch has a part that cannot be cut) says so in an agreement, and every rank
raises it (the others with a note naming the rank): the first in the one agreement as the loader is set up (also
where nothing is agreed per batch: a ``DistributedSampler`` under a batch sampler that filters on one rank), which also
refuses loaders with a length on some ranks beside streams on others (Lightning's sum of their lengths hung).
In it the ranks also agree that they cut their loaders alike: where one re-chunks and the ranks' loader batch
sizes differ (loaders of their own: 4 and 8 cut by ``m = 4``), every rank refuses (one ran its loader as it is, the other
cut and accumulated its own, and their collectives did not meet); a plan refused on one rank is raised on every rank there.
Where the ranks agree per batch, the micro-batch loader's length, which Lightning counts, is every one of the loader's
batches counted as a full one: the same on every rank without a collective, and an upper bound. Where the
agreed sizes fall short of it (the ranks' last batches all short, or a batch sampler's batches of other sizes
mid-epoch: 40, 30, 20, 40 on one rank and 40, 30, 1, 40 on another), the epoch ends before it, and its last
micro-batch is known as an ``IterableDataset``'s below (looked ahead for, a decision taken only from what
the ranks agreed on: the sizes each batch is cut as, and where its places fall in the micro-batches, so the
ranks meet in the same collectives).
On one process, or where a ``DistributedSampler`` (Lightning's) gives every rank as many samples, nothing
is to agree on, and a short batch is cut into micro-batches of ``m``; on several ranks there, only each epoch's first
batch is agreed on (one all-reduce per epoch), so a refusal of its format on one rank (a part that cannot be cut, no
tensor to cut) is raised on every rank.
An ``IterableDataset`` whose ``__len__`` overstates what a rank's iterator yields (a global length over the rank's shard)
ends the epoch before Lightning's count: the micro-batch that ends it (looked ahead for after the short last batch) steps
exactly when the user's run steps after the loader batch ending in it; one that yields more loader batches than the
loader's length (several workers, each ending in a short batch) stops after that many, as Lightning stops a run of it.
Checkpoints count the epoch's progress in loader batches, and a fit resumed mid-epoch trains the
loader batches a plain run trains there (Lightning replays a loader without state from its start).
The ``batch_idx`` that hooks receive counts micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import math
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_distplan.errors import BatchFormatError, DataLoadingError, DistPlanError, InfeasiblePlanError, first_line
from lightning_distplan.plan import Plan, require_plan
from lightning_distplan.profiling._batches import BatchSizer, concat_samples, find_batch_size, loader_batch_size, slice_samples, uncut_part_found
from lightning_distplan.strategies._auto_planning import check_count
from lightning_distplan.strategies._checkpoint import (
    CheckpointFormatError,
    add_portable_state,
    check_states_to_save,
    load_portable_optimizer_states,
    optimizer_state_by_name,
    plan_context,
    read_checkpoint,
    readable_plan,
)
from lightning_distplan.strategies._checkpoint_io import AtomicSaves, raise_on_every_rank
from lightning_distplan.strategies._exit import destroy_process_groups_at_exit
from lightning_distplan.strategies._grad_norm import gradient_norm, norm_order
from lightning_distplan.strategies._pipeline_checkpoint import refuse_partial_module

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH

__all__ = ["DPGAStrategy", "Rechunking", "check_ddp_kwargs", "resolve_dp_ga_plan", "loader_batch_size"]

log = logging.getLogger(__name__)

Auto = Literal["auto"]

_UNSET = object()  # an attribute the trainer does not have


class DPGAStrategy(AtomicSaves, DDPStrategy):
    """Data parallel + gradient accumulation, running the planned micro-batch size.

    Args:
        plan: a ``dp_ga`` :class:`~lightning_distplan.Plan` to run; its ``dp`` must equal the world
            size and its global batch the user's. ``None``: derive the plan from the loader and
            the two arguments below (and, on resume, reuse the plan stored in the checkpoint).
        micro_batch_size: samples per forward/backward on one device; ``"auto"``: the loader's
            batch size, or ``loader batch · accumulate_grad_batches / s`` when ``s`` is given.
        accumulate_grad_batches: micro-batches per replica per optimizer step; ``"auto"``: keep
            the user's ``loader batch × Trainer(accumulate_grad_batches)`` samples per step.
        **ddp_kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(strategy=DPGAStrategy(micro_batch_size=4), accelerator="cpu", devices=1)
    """

    strategy_name = "dp_ga"
    plan_memory_limit_bytes: int | None = None
    """The device memory the running plan was made for, when ``auto_plan`` made it (stored with it in checkpoints)."""
    plan_unused_parameters: tuple[str, ...] = ()
    """Trainable parameters the profiled loss gave no gradient, when ``auto_plan`` found them (stored with the plan in checkpoints)."""

    def __init__(
        self,
        plan: Plan | None = None,
        micro_batch_size: int | Auto = "auto",
        accumulate_grad_batches: int | Auto = "auto",
        **ddp_kwargs: Any,
    ) -> None:
        check_ddp_kwargs(ddp_kwargs, type(self).__name__)
        super().__init__(**ddp_kwargs)
        micro_batch_size = check_count("micro_batch_size", micro_batch_size, auto=True)
        accumulate_grad_batches = check_count("accumulate_grad_batches", accumulate_grad_batches, auto=True)
        require_plan(plan, "DPGAStrategy")
        if plan is not None and plan.strategy != "dp_ga":
            raise InfeasiblePlanError(
                f"DPGAStrategy runs dp_ga plans, got a {plan.strategy} plan ({plan.describe()}).",
                hint=f"Use Trainer(strategy='{plan.strategy}') with this plan, or strategy='auto_plan'.",
            )
        self._requested_plan = plan
        self._micro_batch_size = micro_batch_size
        self._accumulate_grad_batches = accumulate_grad_batches
        self._plan: Plan | None = plan
        self._checkpoint_plan: Plan | None = None
        self._user_accumulate: int | None = None
        self._rechunk = Rechunking()
        self._warned_unnamed = False

    @property
    def plan(self) -> Plan | None:
        """The plan being run: set once the train dataloader is known (``None`` before ``fit``)."""
        return self._plan

    @property
    def checkpoint_plan(self) -> Plan | None:
        """The plan stored in the checkpoint this run resumed from, if any."""
        return self._checkpoint_plan

    @override
    def setup_environment(self) -> None:
        if self._requested_plan is not None:
            _check_plan(self._requested_plan, self.world_size)  # fail before the process group exists
        super().setup_environment()
        destroy_process_groups_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        refuse_partial_module(self.lightning_module)  # what a failed pipeline fit left holds one stage's weights
        # Remember the user's accumulation: it defines their global batch, and teardown restores it.
        self._user_accumulate = trainer.accumulate_grad_batches
        self._rechunk.remember(trainer)
        super().setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader  # evaluation runs at the loader's own batch size
        nothing_asked = self._requested_plan is None and self._micro_batch_size == self._accumulate_grad_batches == "auto"
        if nothing_asked and self._checkpoint_plan is None and loader_batch_size(dataloader) is None:
            # An iterable without a readable batch size and nothing to re-plan: plain DDP + accumulation.
            rank_zero_info("dp_ga: the train loader's batch size is unknown; running it as is (no plan).")
            _agree_on_train_loader(trainer, dataloader)  # its layout unknown, cut by none (as Rechunking.wrap's on other ranks)
            return dataloader
        try:  # the loader batch may be this rank's own (use_distributed_sampler=False), so may a refusal of it
            self._check_train_loader(dataloader)
            plan = resolve_dp_ga_plan(
                world_size=self.world_size,
                loader_batch=loader_batch_size(dataloader),
                user_accumulate=self._user_accumulate if self._user_accumulate is not None else trainer.accumulate_grad_batches,
                plan=self._requested_plan,
                micro_batch_size=self._micro_batch_size,
                accumulate_grad_batches=self._accumulate_grad_batches,
                checkpoint_plan=self._checkpoint_plan,
            )
            rechunks = plan.accumulate_grad_batches > 1 or plan.micro_batch_size != loader_batch_size(dataloader)
            if rechunks and accumulation_scheduled(trainer):
                raise InfeasiblePlanError(
                    f"dp_ga runs {plan.describe()}, setting accumulate_grad_batches itself, which a GradientAccumulationScheduler "
                    "callback also changes during the fit.",
                    hint="Use one of the two: drop the callback, or strategy='ddp' with it.",
                )
            if plan.accumulate_grad_batches > 1 and not self.lightning_module.automatic_optimization:
                raise InfeasiblePlanError(
                    f"The plan accumulates {plan.accumulate_grad_batches} micro-batches but the LightningModule uses manual optimization.",
                    hint="Use automatic optimization, or micro_batch_size equal to the loader batch and accumulate_grad_batches=1.",
                )
        except InfeasiblePlanError as refusal:
            # the others wait in that agreement (Rechunking.wrap)
            _agree_on_train_loader(trainer, dataloader, refusal, layout=(loader_batch_size(dataloader), None))
            raise
        if plan != self._plan:
            rank_zero_info(f"dp_ga: running {plan.describe()} (global batch {plan.global_batch_size}).")
        self._plan = plan
        trainer.accumulate_grad_batches = plan.accumulate_grad_batches
        user_accumulate = self._user_accumulate if self._user_accumulate is not None else 1
        weight = plan.accumulate_grad_batches / user_accumulate
        return self._rechunk.wrap(trainer, dataloader, plan.micro_batch_size, weight=weight)

    def _check_train_loader(self, dataloader: object) -> None:
        """Raise an :class:`InfeasiblePlanError` for a train loader this strategy cannot run (``auto_plan``'s: one loaded
        again with another batch size than the plan's). Called in :meth:`process_dataloader` where its refusals are
        agreed on, so a refusal of one rank's loader is raised on every rank. Nothing here."""

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        combined = trainer.fit_loop._combined_loader
        loaders = [] if combined is None else combined.flattened
        changed = any(isinstance(dl, _MicroBatchLoader) for dl in loaders) or trainer.accumulate_grad_batches != self._user_accumulate
        if len(loaders) > 1 and changed:
            # One Rechunking weighs and counts the micro-batches of one loader: a second one's weights, ends and epoch
            # length (max_size_cycle restarts the shorter loader) do not follow its batches.
            sizes = ", ".join(str(loader_batch_size(dl)) for dl in loaders)  # a wrapped loader answers with the user's loader's
            raise InfeasiblePlanError(
                f"dp_ga runs {self._plan.describe() if self._plan else 'a plan'} by cutting the train loader's batches into "
                f"micro-batches, but the fit has {len(loaders)} train dataloaders (batch sizes {sizes}), whose combined batches it "
                "cannot cut alike.",
                hint="Pass one train DataLoader, or use micro_batch_size='auto' and accumulate_grad_batches='auto' (each loader "
                "as it is), or strategy='ddp'.",
            )
        self._rechunk.train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._rechunk.start_batch()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with unused_parameters_named(self, self.user_facing_name):
            loss = super().training_step(*args, **kwargs)
        return self._rechunk.weigh(loss)

    @property
    def user_facing_name(self) -> str:
        """The strategy class a user constructs (``auto_plan``'s concrete strategy says AutoPlanStrategy)."""
        return type(self).__name__

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type``-norm of the model's gradients (each parameter once), as under a pipeline's
        :meth:`PipelineStrategy.grad_norm`, so a hook that logs it runs under any plan ``auto_plan`` picks. In
        ``on_before_optimizer_step`` DDP has all-reduced them: every rank gets the same value.

        Raises:
            InfeasiblePlanError: (a ``ValueError``) ``norm_type`` is not a positive number or ``inf``.
        """
        order = norm_order(norm_type)
        module = self.lightning_module
        grads = [p.grad for p in module.parameters() if p.grad is not None] if module is not None else []
        return gradient_norm(grads, order, device=self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        by_name = None
        if "optimizer_states" in checkpoint and self.lightning_module is not None:
            check_states_to_save(checkpoint["optimizer_states"])  # a user's hook changed them: one sentence, not a KeyError
            named = dict(self.lightning_module.named_parameters())
            try:
                by_name = [
                    optimizer_state_by_name(opt, named, state_dict=sd) for opt, sd in zip(self.optimizers, checkpoint["optimizer_states"])
                ]
            except CheckpointFormatError:
                # The optimizer holds a tensor that is not one of the module's parameters: no name to store its state
                # under. Lightning's own (ordered) optimizer state is still saved, as DDP saves it.
                if not self._warned_unnamed:
                    rank_zero_warn(
                        "dp_ga: the optimizer holds a tensor that is not a parameter of the LightningModule, so checkpoints keep "
                        "its state in torch's order only (as DDP does): they resume under dp_ga or DDP, not under a pipeline."
                    )
                    self._warned_unnamed = True
        add_portable_state(checkpoint, plan=self._plan, optimizer_states_by_name=by_name, context=plan_context(self))
        self._rechunk.progress_to_user_units(checkpoint)  # a mid-epoch checkpoint resumes any plan or strategy at its place
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        load = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        checkpoint = read_checkpoint(load, checkpoint_path, strategy=self)  # a file cut short or not Lightning's: one sentence
        self._checkpoint_plan = readable_plan(checkpoint, "dp_ga")
        self._rechunk.resumed(checkpoint)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Prefer the by-name state (any lightning_distplan strategy wrote it); plain Lightning checkpoints lack it.
        if not load_portable_optimizer_states(self.optimizers, self.lightning_module.named_parameters(), checkpoint):
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer in self.optimizers:
            _optimizer_to_device(optimizer, self.root_device)  # as Strategy.load_optimizer_state_dict does

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and module._trainer is not None and self._user_accumulate is not None:
            self._rechunk.restore(module.trainer)  # first: it puts back the plan's accumulate_grad_batches where it steered a step
            module.trainer.accumulate_grad_batches = self._user_accumulate
        super().teardown()


def resolve_dp_ga_plan(
    *,
    world_size: int,
    loader_batch: int | None,
    user_accumulate: int,
    plan: Plan | None = None,
    micro_batch_size: int | Auto = "auto",
    accumulate_grad_batches: int | Auto = "auto",
    checkpoint_plan: Plan | None = None,
) -> Plan:
    """The ``dp_ga`` plan to run, from the user's loader and the strategy's arguments (pure).

    The user's global batch is ``world_size · loader_batch · user_accumulate``; every plan returned
    factors it (DESIGN §3.1). Resolution order: an explicit ``plan``; explicit ``micro_batch_size``
    and/or ``accumulate_grad_batches``; the ``checkpoint_plan`` when it fits this world size and
    global batch (resume does not re-plan); else the loader's own layout.

    Raises:
        InfeasiblePlanError: the numbers do not factor the global batch, or the plan does not fit
            this world size.
    """
    if loader_batch is None:
        if plan is not None:
            return _check_plan(plan, world_size)
        if isinstance(micro_batch_size, int) and isinstance(accumulate_grad_batches, int):
            return Plan(
                strategy="dp_ga",
                dp=world_size,
                micro_batch_size=micro_batch_size,
                accumulate_grad_batches=accumulate_grad_batches,
                global_batch_size=world_size * micro_batch_size * accumulate_grad_batches,
            )
        raise InfeasiblePlanError(
            "The train dataloader's per-rank batch size cannot be read (no `batch_size` on it or on its batch_sampler).",
            hint="Pass both micro_batch_size and accumulate_grad_batches to DPGAStrategy, or a Plan.",
        )
    per_replica = loader_batch * user_accumulate  # samples one replica contributes to one optimizer step
    global_batch = world_size * per_replica
    user = f"loader batch ({loader_batch}) x world size ({world_size}) x accumulate_grad_batches ({user_accumulate})"
    if plan is not None:
        _check_plan(plan, world_size)
        if plan.global_batch_size != global_batch:
            raise InfeasiblePlanError(
                f"The plan's global batch ({plan.global_batch_size}) differs from the user's {user} = {global_batch}.",
                hint="A plan never changes the global batch: re-plan for this global batch, or change the loader batch size / Trainer(accumulate_grad_batches).",
            )
        for name, value in (("micro_batch_size", micro_batch_size), ("accumulate_grad_batches", accumulate_grad_batches)):
            if value != "auto" and value != getattr(plan, name):
                raise InfeasiblePlanError(
                    f"`{name}`={value} contradicts the plan's {name}={getattr(plan, name)}.",
                    hint=f"Pass either a plan or {name}, not both.",
                )
        return plan
    m, s = micro_batch_size, accumulate_grad_batches
    if m == "auto" and s == "auto":
        if (
            checkpoint_plan is not None
            and checkpoint_plan.strategy == "dp_ga"
            and checkpoint_plan.dp == world_size
            and checkpoint_plan.global_batch_size == global_batch
        ):
            return checkpoint_plan
        if checkpoint_plan is not None:
            rank_zero_info(
                f"dp_ga: the checkpoint's plan ({checkpoint_plan.describe()}, global batch {checkpoint_plan.global_batch_size}) "
                f"does not fit {world_size} processes and global batch {global_batch}; running the loader's layout."
            )
        m, s = loader_batch, user_accumulate
    elif m == "auto":
        if per_replica % s:
            raise InfeasiblePlanError(
                f"accumulate_grad_batches={s} does not divide the {per_replica} samples per replica per step (loader batch {loader_batch} x accumulate_grad_batches {user_accumulate}).",
                hint=f"Pick accumulate_grad_batches among {_divisors(per_replica)}.",
            )
        m = per_replica // s
    elif s == "auto":
        if per_replica % m:
            raise InfeasiblePlanError(
                f"micro_batch_size={m} does not divide the {per_replica} samples per replica per step (loader batch {loader_batch} x accumulate_grad_batches {user_accumulate}).",
                hint=f"Pick micro_batch_size among {_divisors(per_replica)}.",
            )
        s = per_replica // m
    elif m * s != per_replica:
        raise InfeasiblePlanError(
            f"micro_batch_size ({m}) x accumulate_grad_batches ({s}) = {m * s} differs from the {per_replica} samples per replica per step (loader batch {loader_batch} x accumulate_grad_batches {user_accumulate}).",
            hint="Pass only one of them and let the other be 'auto'.",
        )
    return Plan(strategy="dp_ga", dp=world_size, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=global_batch)


def _check_plan(plan: Plan, world_size: int) -> Plan:
    if plan.strategy != "dp_ga":
        raise InfeasiblePlanError(
            f"DPGAStrategy runs dp_ga plans, got a {plan.strategy} plan ({plan.describe()}).",
            hint=f"Use Trainer(strategy='{plan.strategy}') with this plan, or strategy='auto_plan'.",
        )
    if plan.dp != world_size:
        raise InfeasiblePlanError(
            f"The plan has dp={plan.dp} replicas but the trainer runs on {world_size} processes.",
            hint=f"Use Trainer(devices=..., num_nodes=...) with {plan.dp} processes in all, or re-plan for {world_size}.",
        )
    return plan


def step_frequencies(configs: Any) -> list[tuple[Any, int]]:
    """``(config, frequency)`` of the learning-rate schedulers with ``interval="step"`` and a whole ``frequency`` above 1:
    the ones whose frequency Lightning counts in its batches, which a plan re-chunks (see :func:`restore_frequencies`)."""
    return [(c, c.frequency) for c in configs if c.interval == "step" and _is_count(c.frequency) and c.frequency > 1]


def restore_frequencies(frequencies: list[tuple[Any, int]]) -> None:
    """Give each config of :func:`step_frequencies` the user's frequency back."""
    for config, frequency in frequencies:
        config.frequency = frequency


class Rechunking:
    """Runs a plan's micro-batches in place of the user's loader batches, keeping what the user's
    Trainer settings mean (the module docstring says how); shared by :class:`DPGAStrategy` and
    :class:`~lightning_distplan.PlanningCallback`.

    Call :meth:`remember` in ``setup``, :meth:`wrap` on the train loader, :meth:`train_start` at
    ``on_train_start``, :meth:`start_batch` at each ``on_train_batch_start``, :meth:`weigh` on ``training_step``'s output and :meth:`restore`
    at teardown; :meth:`progress_to_user_units` on every checkpoint saved and :meth:`resumed` when
    a fit resumes from one.

    Checkpoints count the epoch's progress in the user's loader batches, as a plain DDP run does:
    Lightning counts the batches it ran, here micro-batches, and a mid-epoch checkpoint in those
    units would resume any other plan or strategy at the wrong place in the epoch.
    """

    def __init__(self) -> None:
        self._user: tuple[Any, Any] | None = None  # (limit_train_batches, val_check_interval) as the user set them
        self._loader: _MicroBatchLoader | None = None
        self._weight = 1.0
        self._per_user_batch: Fraction | None = None  # user's loader batches per batch Lightning runs (None: not known)
        self._resumed = False
        self._loader_batch: int | None = None
        self._warned_skip = False  # training_step returned None for a micro-batch: warned once per strategy
        self._saved_progress: dict[str, Any] | None = None  # the resumed checkpoint's batch progress, as Lightning restores it
        self._saved_at_epoch_end = False  # ... was saved at the epoch's end (on_train_epoch_end): the next epoch starts whole
        self._resumed_from_micro: int | None = None  # an older checkpoint counted micro-batches of this many samples
        self._trainer: pl.Trainer | None = None
        self._val_every: int | None = None  # the user validates after every this many of their loader batches
        self._steer: bool | None = None  # whether this loader's validations are steered (decided at its first batch)
        self._done_total: int | None = None  # the user's loader batches trained in this fit (all epochs)
        self._done_epoch = 0  # ... and in this epoch
        self._epoch_seen: int | None = None
        self._resumed_counts: tuple[Fraction, Fraction] | None = None  # the resumed checkpoint's (epoch, fit) loader batches
        self._whole_epoch: int | None = None  # Lightning's count of an epoch's batches, set back at a resumed epoch's end
        self._val_check_next: int | None = None  # ... and its val_check_batch, set back after that
        self._frequencies: list[tuple[Any, int]] | None = None  # (config, user's frequency) of the step schedulers steered
        self._user_accumulate = 1  # the user's accumulate_grad_batches
        self._user_epoch: int | None = None  # the loader batches Lightning counts in an epoch of the user's loader (None: unsized)
        self._accumulate: int | None = None  # the plan's accumulate_grad_batches, while a batch's step is steered (see _steer_step)
        self._val_check_batch: int | None = None  # ... and Lightning's val_check_batch

    def remember(self, trainer: pl.Trainer) -> None:
        # Lightning has no val_check_interval attribute when it is a time ("00:00:05:00", a dict): nothing to convert then
        self._user = (trainer.limit_train_batches, getattr(trainer, "val_check_interval", _UNSET))
        self._user_accumulate = trainer.accumulate_grad_batches
        self._done_total = self._epoch_seen = None

    def wrap(
        self, trainer: pl.Trainer, dataloader: object, m: int, *, weight: float = 1.0, cls: type[_MicroBatchLoader] | None = None,
        replica_share: int = 1, refusal: Exception | None = None, stages: tuple[int, int] | None = None,
    ) -> object:
        """``dataloader`` re-chunked into batches of ``m`` samples by ``cls`` (itself when its batches already are).

        ``weight``: a micro-batch cut from full loader batches gets loss weight ``weight`` · its
        share of a loader batch, i.e. ``s / the user's accumulate_grad_batches`` for dp_ga.
        ``replica_share``: processes per data-parallel replica (a pipeline's stages). The data is
        sharded over replicas, not processes, so one of the user's loader batches per process (what
        an integer ``limit_train_batches`` / ``val_check_interval`` counts under DDP) is this many
        loader batches of a replica.
        ``refusal``: the caller's of this rank's loader (one loaded again with another batch size than the fit's first,
        maybe on this rank alone), raised on every rank at the set-up agreement this ends in
        (:func:`_agree_on_train_loader`): raised before it, the other ranks waited there until this rank's process ended.
        So is an error reading the loader's length here (its ``__len__`` raising on this rank alone), and the BatchNorm
        warning made an error by a warnings filter (``-W error``; warned on rank 0 alone, as Lightning's warnings are).
        The loader is wrapped as on the other ranks first, so this rank makes the same collectives on the way (a
        pipeline's :class:`_FullBatchLoader` agrees on the epoch's steps as it is made, told of the error, which it
        carries there in place of this rank's count: it does not read the length again).
        ``stages``: a pipeline's (this rank's replica, the number of replicas), whose stages' loaders must hold as many
        batches and samples (:func:`_agree_on_train_loader`, in the same agreement).
        """
        self.restore(trainer)  # a reloaded loader is converted from the user's settings, not from ours
        stages_of = None if stages is None else (*stages, dataloader)
        kept = dict(vars(self))  # put back where the loader is refused (_agree_or_keep)
        self._loader = None
        self._whole_epoch = self._val_check_next = None
        loader_batch = loader_batch_size(dataloader)
        self._per_user_batch = None if loader_batch is None else Fraction(m, loader_batch * replica_share)
        # not a loader loaded before Lightning restores the loops (trainer.estimated_stepping_batches in configure_optimizers);
        # converted once the ranks agreed the loader runs (_convert_resumed_progress)
        resuming = self._resumed and self._loops_restored(trainer)
        self._loader_batch = loader_batch
        # known also for a loader used as it is: one loaded before the loops were restored is set up again (reload_resumed)
        # where the checkpoint's progress is to be converted (a pipeline step is 1/pp of the user's loader batch)
        self._trainer = trainer
        if loader_batch == m:
            self._agree_or_keep(kept, trainer, dataloader, refusal, layout=(loader_batch, m), stages=stages_of)
            if resuming:
                self._convert_resumed_progress(trainer, loader_batch)
            return dataloader
        agree = first = None
        # several replicas whose data may differ (no DistributedSampler): their loaders agree (a pipeline's, see
        # _FullBatchLoader, on the epoch's steps; the stages of one replica read the same batches)
        if trainer.world_size > replica_share and not isinstance(loader_sampler(dataloader)[0], DistributedSampler):
            agree = functools.partial(_agreed_batch_sizes, trainer.strategy.root_device)
        elif trainer.world_size > replica_share and cls is None:  # as many batches on every rank: only the first is agreed on
            first = functools.partial(_agreed_batch_sizes, trainer.strategy.root_device)
        micro_batches = functools.partial(cls or _MicroBatchLoader, dataloader, m, weight=weight, agree=agree,
                                          **({} if first is None else {"agree_first": first}))
        try:  # maybe on this rank alone, before any agreement: raised here, the other ranks waited in it until this one ended
            if cls is None and loader_batch is not None:
                _warn_batchnorm(trainer, m, loader_batch)  # rank 0's alone: an error there under a warnings filter (-W error)
            limit, interval = _in_loader_batches(trainer, dataloader, replica_share)
            n = sized_len(dataloader)  # a __len__ raising other than TypeError / NotImplementedError (this rank's data)
        except Exception as failure:  # (a KeyboardInterrupt is not carried: this rank stops at once)
            # wrapped as on the other ranks (the same collectives on the way), then raised on every rank at the set-up
            # agreement: here as it was raised, there as _told_elsewhere says
            # (made told of it: a pipeline's loader, which agrees as it is made, carries it there; left to count its samples,
            # it read the length again, and the user saw the ValueError twice, the second raised handling the first)
            def made_and_agreed(failure: Exception) -> None:  # (the except's name is unbound after it: passed, not closed over)
                self._loader = self._made_or_keep(kept, functools.partial(micro_batches, failed=failure))
                self._agree_or_keep(kept, trainer, self._loader, failure, layout=(loader_batch, m), stages=stages_of)

            _tell_every_rank(functools.partial(made_and_agreed, failure), failure)
            raise
        self._user_epoch = n if n is None or limit is None else min(n, limit)
        self._loader = self._made_or_keep(kept, functools.partial(micro_batches, limit_batches=limit))
        self._loader.ended = self._end_steered_step
        # maybe on this rank only (a batch sampler's own filter or shard, also over a DistributedSampler)
        if refusal is None and loader_batch is not None and getattr(dataloader, "batch_sampler", None) is not None \
                and sized_len(dataloader) is not None and _samples_per_epoch(dataloader) is None:
            refusal = _uncounted(dataloader, loader_batch, m)
        self._agree_or_keep(kept, trainer, self._loader, refusal, layout=(loader_batch, m), stages=stages_of)
        if resuming:
            self._convert_resumed_progress(trainer, loader_batch)
        self._trainer, self._steer = trainer, None
        self._val_every = interval if loader_batch is not None else None
        if loader_batch is not None:
            _count_in_micro_batches(trainer, loader_batch, m, limit=limit, interval=interval, micro_batches=sized_len(self._loader))
            if resuming and cls is None:  # start_batch follows the micro-batches of this loader (not a pipeline's)
                self._resume_in_place(trainer, dataloader, loader_batch, m, limit)
        return self._loader

    def _agree_or_keep(self, kept: dict[str, Any], trainer: pl.Trainer, loader: object, refusal: Exception | None, *,
                       layout: tuple[int | None, int | None], stages: tuple[int, int, object] | None = None) -> None:
        """:func:`_agree_on_train_loader`; where it raises (this rank's refusal of the loader, or another rank's), this
        wrapper's attributes are put back as ``kept`` (the loader before, whose units the trainer's progress still
        counts): a checkpoint saved after the failure (OnExceptionCheckpoint) converted that progress with the refused
        loader's batch size (a pipeline whose rank 0 refused a reloaded loader of 8 where the first had 4 saved 2
        loader batches for the 4 trained)."""
        try:
            _agree_on_train_loader(trainer, loader, refusal, layout=layout, stages=stages)
        except BaseException:
            vars(self).clear()
            vars(self).update(kept)
            raise

    def _made_or_keep(self, kept: dict[str, Any], make: Callable[[], _MicroBatchLoader]) -> _MicroBatchLoader:
        """``make()``, the re-chunking loader; where it raises, this wrapper's attributes are put back as ``kept``, as
        :meth:`_agree_or_keep` does. A pipeline's loader agrees as it is made (:class:`_FullBatchLoader`), where one
        rank's error reading its loader raises on every rank before the set-up agreement: a reloaded loader of 2 where
        the first had 4, whose length one rank could not read, left the checkpoint an OnExceptionCheckpoint saved
        counting the progress trained in loader batches of 2 (twice the batches of 4 trained)."""
        try:
            return make()
        except BaseException:
            vars(self).clear()
            vars(self).update(kept)
            raise

    def _convert_resumed_progress(self, trainer: pl.Trainer, loader_batch: int | None) -> None:
        """The restored checkpoint's epoch progress, counted in this loader's batches from now on (its loader batches
        remembered in :attr:`_resumed_counts`). Only for a loader the ranks agreed runs (:func:`_agree_on_train_loader`):
        a refused one (loaded again with another batch size on some rank) raised with the trainer's progress already
        counted in its micro-batches, and a checkpoint saved after the failure (OnExceptionCheckpoint) held those,
        unmarked, where a resumed fit read them as loader batches (8 times as many for micro-batches of 4 of 32)."""
        self._resumed = False
        # the checkpoint's units: loader batches, or (written before the marker) micro-batches of a dp_ga plan
        saved = 1 if self._resumed_from_micro is None or loader_batch is None else Fraction(self._resumed_from_micro, loader_batch)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        # the user's loader batches the checkpoint's epoch and fit trained (exact, where scaling to micro-batches rounds)
        self._resumed_counts = (progress.current.ready * saved, progress.total.ready * saved)
        if self._per_user_batch is not None and saved != self._per_user_batch:
            _scale_progress(progress.state_dict(), saved / self._per_user_batch, into=progress)

    def _resume_in_place(self, trainer: pl.Trainer, dataloader: object, loader_batch: int, m: int, limit: int | None) -> None:
        """Resumed from a checkpoint whose epoch had trained ``done`` of the user's loader batches (:attr:`_resumed_counts`):
        train what a run of their loader trains next.

        At the epoch's end, Lightning goes on to the next epoch only if it counts all of this one's micro-batches
        (``done`` scaled to micro-batches rounds down where ``m`` does not divide the epoch, or exceeds the epoch's
        count where it ends in a short batch). So it does from a checkpoint saved at the epoch's end with fewer batches
        than its count (a stream shorter than its ``__len__``, max_steps inside the epoch): Lightning trains the next
        epoch whole after it (this replayed the epoch's remaining count). Mid-epoch, Lightning replays the epoch's
        remaining count of batches from the loader's start (a loader cannot resume in place), so the user's run trains
        its first ``n - done`` loader batches, all full. Counted in micro-batches, the epoch's remaining count is not
        theirs: short by what the short last batch lacks, or past them where they end inside a micro-batch. So this one
        epoch stops after those loader batches, and Lightning counts it as the micro-batches trained before plus theirs;
        :meth:`start_batch` sets Lightning's count back at its last batch.
        """
        assert self._loader is not None and self._resumed_counts is not None
        done = self._resumed_counts[0]
        n, whole = sized_len(dataloader), sized_len(self._loader)
        if n is None or whole is None or not done:
            return
        n = n if limit is None else min(n, limit)
        whole = _lightning_batches(whole, trainer.limit_train_batches)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if done >= n or self._saved_at_epoch_end:
            progress.load_state_dict(_recount_progress(progress.state_dict(), lambda part, count: whole if part == "current" else count))
            return
        if done.denominator != 1:
            return  # not at a loader batch's end (an older checkpoint's micro-batch): replayed as Lightning counts it
        left = n - int(done)
        length = progress.current.ready + math.ceil(left * loader_batch / m)
        self._loader.resume_epoch(left, length)
        if length != whole:
            self._whole_epoch = whole

    def start_batch(self) -> None:
        """Called at each ``on_train_batch_start``: the micro-batch's loss weight, and whether to validate after it."""
        if self._loader is None:
            self._weight = 1.0
            return
        self._end_steered_step()
        self._weight, ends, last = self._loader.next_batch()
        if ends is None or self._per_user_batch is None or self._trainer is None:
            return
        trainer = self._trainer
        loop = trainer.fit_loop.epoch_loop
        if self._val_check_next is not None:  # the first batch after a resumed epoch
            trainer.val_check_batch, self._val_check_next = self._val_check_next, None
        if self._whole_epoch is not None and (loop.batch_progress.is_last_batch or last):
            self._count_whole_epochs(trainer)
        resumed, self._resumed_counts = self._resumed_counts, None
        if self._done_total is None:  # the fit's first batch (a resumed fit continues Lightning's counts, in micro-batches)
            self._done_total = int(resumed[1] if resumed else loop.total_batch_idx * self._per_user_batch)
        if self._epoch_seen != trainer.current_epoch:
            self._epoch_seen = trainer.current_epoch
            # mid-epoch: the checkpoint's count (exact, where scaling rounds); a checkpoint at an epoch's end starts a new one
            self._done_epoch = int(resumed[0] if resumed and loop.batch_idx else loop.batch_idx * self._per_user_batch)
        if self._val_every is not None:
            self._steer_validation(ends)
        self._steer_schedulers(ends)
        if last:
            self._steer_step(ends)
        self._done_epoch += ends  # the user's loader batches this micro-batch completes (what a checkpoint counts)
        self._done_total += ends

    def _loops_restored(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning has restored the resumed checkpoint's loops (their progress is the checkpoint's)."""
        saved = self._saved_progress
        return saved is None or trainer.fit_loop.epoch_loop.batch_progress.state_dict() == saved

    def _count_whole_epochs(self, trainer: pl.Trainer) -> None:
        """At a resumed epoch's last batch (see :meth:`_resume_in_place`): Lightning counts the next epochs' batches
        from the whole epoch, and from the next batch on, the validation point of a fractional ``val_check_interval``
        (1.0: the epoch's end; this epoch's is at its last batch still)."""
        assert self._whole_epoch is not None
        _count_epochs_as(trainer, self._whole_epoch)
        if isinstance(getattr(trainer, "val_check_interval", None), float) and type(trainer.val_check_batch) is int:
            self._val_check_next = max(1, int(self._whole_epoch * trainer.val_check_interval))
        self._whole_epoch = None

    def train_start(self) -> None:
        """At ``on_train_start`` of a resumed fit: a loader set up before Lightning restored the loops
        (trainer.estimated_stepping_batches read in configure_optimizers) could not count the checkpoint's progress,
        so it is set up again at the epoch's start (Lightning does when it has none), where it can; otherwise the
        restart's validation check is answered (:meth:`_steer_restart`)."""
        if not self.reload_resumed():
            self._steer_restart()

    def reload_resumed(self) -> bool:
        """Whether the train loader is to be set up again at the epoch's start, as :meth:`train_start` says why (also
        called alone at a pipeline's ``on_train_start``)."""
        trainer = self._trainer
        if self._resumed and trainer is not None and self._loops_restored(trainer):
            trainer.fit_loop._combined_loader = None
            return True
        return False

    def _steer_restart(self) -> None:
        """A fit resuming mid-epoch asks, before any batch starts, whether its checkpoint was saved at a validation
        (then it does not validate again); answer as the user's run would at that place."""
        trainer = self._trainer
        if trainer is None or self._loader is None or self._val_every is None or self._per_user_batch is None:
            return
        loop = trainer.fit_loop.epoch_loop
        if not loop.restarting:
            return
        if self._steer is None:
            self._steer = type(trainer.val_check_batch) is int
        if not self._steer:
            return
        index = loop.batch_idx if trainer.check_val_every_n_epoch is not None else loop.total_batch_idx
        done = int((index + 1) * self._per_user_batch)  # the user's loader batches trained when the checkpoint was saved
        trainer.val_check_batch = index + 1 if done and done % self._val_every == 0 else index + 2

    def _steer_validation(self, ends: int) -> None:
        """Validate after this micro-batch exactly when the user's run validates after one of the ``ends`` loader
        batches that end in it.

        Lightning validates after a batch when ``(its index + 1) % trainer.val_check_batch == 0`` (the index in the
        epoch, or over the fit with ``check_val_every_n_epoch=None``). A fixed count of micro-batches cannot follow the
        user's loader batches where one holds fewer micro-batches than the others (the epoch's short last batch: its
        validation was lost, and over epochs the count drifted), so ``val_check_batch`` is set before each micro-batch
        to the index + 1 (validate) or + 2 (not). Only where Lightning counts batches for it (an int
        ``val_check_batch``; not an unsized loader's or a time interval).
        """
        trainer = self._trainer
        assert trainer is not None and self._val_every is not None and self._per_user_batch is not None
        if self._steer is None:
            self._steer = type(trainer.val_check_batch) is int
        if not self._steer:
            return
        loop = trainer.fit_loop.epoch_loop
        by_epoch = trainer.check_val_every_n_epoch is not None
        done = self._done_epoch if by_epoch else self._done_total
        assert done is not None
        validate = any((done + k) % self._val_every == 0 for k in range(1, ends + 1))
        index = loop.batch_idx if by_epoch else loop.total_batch_idx
        trainer.val_check_batch = index + 1 if validate else index + 2

    def _steer_schedulers(self, ends: int) -> None:
        """Step a learning-rate scheduler with ``interval="step"`` and a ``frequency`` above 1 after this micro-batch
        exactly when the user's run steps it after the loader batch that ends in it.

        Lightning consults such a scheduler at each optimizer step and steps it when ``(batch_idx + 1) % frequency == 0``,
        ``batch_idx`` counting the epoch's batches: the user's loader batches in their run, micro-batches here, so a
        plan with another count of batches per step stepped it at other steps (``frequency=2`` with 2 micro-batches per
        step: every step instead of every second). The user's run checks it at the optimizer step that ends with their
        loader batch ``done + ends`` of the epoch, so ``frequency`` is set before each micro-batch to the index + 1
        (step it) or + 2 (not); :meth:`restore` puts the user's back.
        """
        trainer = self._trainer
        assert trainer is not None
        if self._frequencies is None:
            self._frequencies = step_frequencies(getattr(trainer.strategy, "lr_scheduler_configs", None) or [])
        if not self._frequencies:
            return
        index = trainer.fit_loop.epoch_loop.batch_idx
        done = self._done_epoch + ends  # the user's loader batches of this epoch trained once this micro-batch is
        for config, frequency in self._frequencies:
            config.frequency = index + 1 if done % frequency == 0 else index + 2

    def _steer_step(self, ends: int) -> None:
        """This micro-batch is the loader's last of the epoch although Lightning counts more (an IterableDataset whose
        ``__len__`` is all ranks' samples where each rank iterates its shard): end the epoch's training as the user's run
        does after the loader batch that ends in it.

        Lightning steps where ``ready % accumulate_grad_batches == 0`` or at the epoch's last batch by its count. A run of
        the user's loader does so after their loader batch ``j`` where ``j % (their accumulate_grad_batches) == 0`` or
        ``j`` is their loader's count; the plan's micro-batches follow that while the loader batches are full, but the
        epoch's short last batch holds fewer micro-batches than a full one, so the step it ends was lost (2 of 4 steps
        in 2 epochs). Where ``j`` is their loader's count, their Lightning knows the epoch ends there (it also steps
        epoch-interval schedulers and validates at the epoch's end): this one is told so (and validates there where
        ``val_check_interval`` is the whole epoch). Before it (their Lightning does not know either),
        ``accumulate_grad_batches`` is set for this micro-batch alone (Lightning zeroes the gradients before it, or not,
        as it would; its loss is weighed for the other divisor) and set back when the loader ends.
        """
        trainer = self._trainer
        assert trainer is not None
        progress = trainer.fit_loop.epoch_loop.batch_progress
        ready, s = progress.current.ready, trainer.accumulate_grad_batches
        if progress.is_last_batch or ready == trainer.num_training_batches:
            return  # Lightning knows the epoch ends here
        done = range(self._done_epoch + 1, self._done_epoch + ends + 1)  # the user's loader batches ending in it
        if self._user_epoch in done:
            progress.is_last_batch = True
            if self._val_every is None and type(trainer.val_check_batch) is int and trainer.val_check_batch == trainer.num_training_batches:
                self._val_check_batch, trainer.val_check_batch = trainer.val_check_batch, ready
            return
        step = any(j % self._user_accumulate == 0 for j in done)
        if step == (ready % s == 0):
            return
        index = ready - 1  # Lightning's batch_idx
        accumulate = _accumulation_steering(index, first=index % s == 0, step=step)
        self._accumulate, trainer.accumulate_grad_batches = s, accumulate
        self._weight *= accumulate / s  # Lightning divides this loss by `accumulate`, not s

    def _end_steered_step(self) -> None:
        """Lightning's ``accumulate_grad_batches`` and ``val_check_batch`` back after an epoch's end :meth:`_steer_step`
        steered."""
        if self._trainer is not None:
            if self._accumulate is not None:
                self._trainer.accumulate_grad_batches = self._accumulate
            if self._val_check_batch is not None:
                self._trainer.val_check_batch = self._val_check_batch
        self._accumulate = self._val_check_batch = None

    def _restore_frequencies(self) -> None:
        restore_frequencies(self._frequencies or [])
        self._frequencies = None

    def weigh(self, output: Any) -> Any:
        """``training_step``'s output, its loss weighted as the user's run weighs those samples."""
        if output is None and self._loader is not None and not self._warned_skip:
            # Lightning skips the batch training_step returns None for: here a micro-batch, not the user's batch
            self._warned_skip = True
            m, b = self._loader.micro_batch_size, self._loader_batch
            if b is None:  # a loader whose batch size cannot be read (batch_size=None)
                what, pin = "your whole loader batch", "a micro_batch_size equal to your loader batch"
            else:
                what = f"your loader batch of {b}: " + ("the rest of that batch still trains" if m < b else "samples of other batches are skipped with it")
                pin = f"micro_batch_size={b}"
            rank_zero_warn(
                f"dp_ga: training_step returned None, so Lightning skips this micro-batch of {m} samples, where under DDP it "
                f"skips {what}. Pass {pin} to skip as DDP does, or filter such samples in the dataset."
            )
        return _scale_loss(output, self._weight) if self._weight != 1.0 else output

    def restore(self, trainer: pl.Trainer) -> None:
        self._restore_frequencies()
        self._end_steered_step()
        if self._whole_epoch is not None:  # the fit stopped inside a resumed epoch (max_steps)
            _count_epochs_as(trainer, self._whole_epoch)
            self._whole_epoch = None
        if self._user is not None:
            trainer.limit_train_batches = self._user[0]
            if self._user[1] is not _UNSET:
                trainer.val_check_interval = self._user[1]

    def resumed(self, checkpoint: Mapping[str, Any]) -> None:
        """The fit restores ``checkpoint``: convert its progress to this plan's batches when the loader is wrapped.

        It counts loader batches when it says so (:data:`PROGRESS_KEY`) or holds no plan of ours (plain
        Lightning); one a dp_ga plan wrote before the key existed counts that plan's micro-batches.
        """
        self._resumed = True
        self._resumed_from_micro = None
        saved = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        self._saved_progress = saved if isinstance(saved, dict) else None
        epoch = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("total")
        # Lightning restarts on the epoch's end (it trains the next epoch whole) where the epoch was processed, not completed
        self._saved_at_epoch_end = isinstance(epoch, dict) and epoch.get("started") == epoch.get("processed") == epoch.get("completed", -2) + 1
        plan = None if checkpoint.get(PROGRESS_KEY) == "loader_batches" else readable_plan(checkpoint)
        if plan is not None and plan.strategy == "dp_ga":
            self._resumed_from_micro = plan.micro_batch_size

    def progress_to_user_units(self, checkpoint: dict[str, Any]) -> None:
        """Count ``checkpoint``'s epoch progress in the user's loader batches instead of the batches Lightning ran."""
        if self._per_user_batch is None:
            return  # the loader's batch size is unknown: the progress stays in the batches run (no mark says otherwise)
        checkpoint[PROGRESS_KEY] = "loader_batches"
        if self._per_user_batch == 1:
            return
        loops = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = loops.get("epoch_loop.batch_progress")
        if not isinstance(progress, dict):
            return
        if self._done_total is not None and self._epoch_seen == self._trainer_epoch():
            # the loader batches that ended in this fit's micro-batches: a linear scale rounds an epoch that ends in a
            # short batch (fewer micro-batches than the others) down to one batch short of its end
            loops["epoch_loop.batch_progress"] = _progress_at(progress, current=self._done_epoch, total=self._done_total)
        else:
            loops["epoch_loop.batch_progress"] = _scale_progress(progress, self._per_user_batch)

    def _trainer_epoch(self) -> int | None:
        return None if self._trainer is None else self._trainer.current_epoch


PROGRESS_KEY = "distplan_progress_units"
"""Checkpoint key: ``"loader_batches"`` when the epoch's progress counts the user's loader batches."""


def _scale_progress(progress: dict[str, Any], factor: Fraction, into: Any = None) -> dict[str, Any]:
    """Lightning's batch-progress counters times ``factor`` (rounded down: a partly accumulated step runs again).
    With ``into`` (a live ``_BatchProgress``) the result is loaded into it as well."""
    scaled = _recount_progress(progress, lambda _, count: int(count * factor))
    if into is not None:
        into.load_state_dict(scaled)
    return scaled


def _progress_at(progress: dict[str, Any], *, current: int, total: int) -> dict[str, Any]:
    """Lightning's batch-progress counters set to ``current`` batches in the epoch and ``total`` in all."""
    return _recount_progress(progress, lambda key, _: current if key == "current" else total)


def _recount_progress(progress: dict[str, Any], count: Callable[[str, int], int]) -> dict[str, Any]:
    """``progress`` with each counter of its ``"total"`` and ``"current"`` parts replaced by ``count(part, counter)``.

    A checkpoint saved at a batch's end (ModelCheckpoint) has ``completed = processed − 1``, which
    tells Lightning to count that batch as done on resume; the new counters keep that relation.
    """

    def recount(part: str, counts: dict[str, int]) -> dict[str, int]:
        out = {k: count(part, v) for k, v in counts.items()}
        if "completed" in counts and "processed" in counts and counts["processed"] - counts["completed"] == 1:
            out["completed"] = out["processed"] - 1
        return out

    return {key: recount(key, value) if key in ("total", "current") and isinstance(value, dict) else value for key, value in progress.items()}


def check_ddp_kwargs(kwargs: Mapping[str, Any], owner: str) -> None:
    """Refuse keyword arguments that neither Lightning's ``DDPStrategy`` nor ``DistributedDataParallel`` takes.

    Lightning hands unknown ones to ``DistributedDataParallel`` when it wraps the model, which fails
    deep inside ``fit`` (after profiling, for ``auto_plan``); this says so when the strategy is built.
    """
    from torch.nn.parallel import DistributedDataParallel

    known = set(inspect.signature(DDPStrategy.__init__).parameters) | set(inspect.signature(DistributedDataParallel.__init__).parameters)
    unknown = sorted(set(kwargs) - (known - {"self", "kwargs", "module"}))
    if unknown:
        raise InfeasiblePlanError(
            f"{owner} got keyword argument(s) {', '.join(map(repr, unknown))} that neither it nor DDPStrategy / DistributedDataParallel takes.",
            hint=f"Check the spelling; {owner} passes other keywords on to DDPStrategy, e.g. find_unused_parameters=True or bucket_cap_mb=50.",
        )


def accumulation_scheduled(trainer: pl.Trainer) -> bool:
    """Whether a ``GradientAccumulationScheduler`` changes ``accumulate_grad_batches`` during the fit (no plan can then own it)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    return any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks)


def _is_count(value: Any) -> bool:
    """Lightning reads an int limit or interval as a number of batches, a float as a fraction."""
    return isinstance(value, int) and not isinstance(value, bool)


def _count_epochs_as(trainer: pl.Trainer, batches: int) -> None:
    """Lightning counts an epoch of the (one) train loader as ``batches``: its count, and the limit it set up the loader
    with (a resumed epoch's shorter length would otherwise cut every later epoch short)."""
    trainer.fit_loop.max_batches = batches
    combined = trainer.fit_loop._combined_loader
    if combined is not None and combined.limits is not None and len(combined.limits) == 1:
        combined.limits = [batches]


def _accumulation_steering(index: int, *, first: bool, step: bool) -> int:
    """An ``accumulate_grad_batches`` under which Lightning, at the epoch's batch ``index``, zeroes the gradients before
    it when ``first`` and steps the optimizer after it when ``step`` (it zeroes where ``index % a == 0`` and steps where
    ``(index + 1) % a == 0``). No ``a`` zeroes at index 1 without stepping: there the gradients are neither zeroed nor
    stepped (the epoch ends with this batch; the next one zeroes them before its first)."""
    if step:
        return 1 if first else index + 1
    if first and index != 1:
        return 2 if index == 0 else index
    return index + 2


def _lightning_batches(length: int, limit: int | float) -> int:
    """The batches Lightning trains per epoch from a loader of ``length`` batches under ``limit_train_batches``."""
    return min(length, limit) if isinstance(limit, int) else int(length * limit)


def _in_loader_batches(trainer: pl.Trainer, dataloader: object, replica_share: int) -> tuple[int | None, int | None]:
    """The user's ``limit_train_batches`` and ``val_check_interval`` as counts of this replica's loader batches.

    An integer counts one process's loader batches under DDP (``replica_share`` of them per replica);
    a fraction below 1 is of the epoch, as Lightning reads it under DDP: ``int(batches · f)`` of one
    process's batches, and validation every ``int(limited batches · f)`` of them, each ``replica_share``
    batches of the replica (a pipeline replica's loader is ``replica_share`` processes' shards long;
    rounding the replica's count instead validated at other steps than DDP). None: nothing to convert
    (no limit, a fraction of an unsized loader, or one Lightning would turn into zero batches and
    refuse itself).
    """
    n = sized_len(dataloader)  # (a __len__ raising NotImplementedError is none either, as Lightning reads it)
    per_process = None if n is None else -(-n // replica_share)  # one process's loader batches under DDP
    value = trainer.limit_train_batches
    limit = None
    if _is_count(value):
        limit = value * replica_share
    elif isinstance(value, float) and 0 < value < 1 and per_process and int(per_process * value) > 0:
        limit = int(per_process * value) * replica_share
    interval = getattr(trainer, "val_check_interval", None)  # absent for a time interval
    if _is_count(interval):
        return limit, interval * replica_share
    if isinstance(interval, float) and 0 < interval < 1 and per_process:
        limited = per_process if limit is None else min(per_process, limit // replica_share)
        return limit, max(1, int(limited * interval)) * replica_share
    return limit, None


def _count_in_micro_batches(trainer: pl.Trainer, loader_batch: int, m: int, *, limit: int | None, interval: int | None,
                            micro_batches: int | None = None) -> None:
    """Set ``limit_train_batches`` / ``val_check_interval`` to the micro-batches of ``limit`` / ``interval`` loader batches
    (the interval at most the epoch's ``micro_batches``, where known, as Lightning requires). When the validations
    happen is then steered batch by batch (:meth:`Rechunking._steer_validation`)."""
    if limit is not None:
        trainer.limit_train_batches = math.ceil(limit * loader_batch / m)
        micro_batches = min(micro_batches or trainer.limit_train_batches, trainer.limit_train_batches)
    if interval is not None:
        micro = max(1, round(interval * loader_batch / m))
        if micro * m != interval * loader_batch:
            rank_zero_info(
                f"dp_ga: every {interval}th loader batch of {loader_batch} does not end where a micro-batch of {m} does; "
                "validating after the micro-batch it ends in."
            )
        trainer.val_check_interval = micro if not micro_batches else min(micro, micro_batches)


def _uncounted(dataloader: object, loader_batch: int, m: int) -> InfeasiblePlanError:
    """The refusal of a sized train loader whose samples per epoch cannot be known (a batch sampler without a ``sampler``
    of its own whose length is not the number of batches the whole dataset makes, or one whose ``sampler`` holds more
    samples than its batches can: :func:`_samples_per_epoch`), which would have its micro-batches miscounted: Lightning,
    given a length, ends the epoch (and steps) at that count, so an optimizer step ran across the epoch's end and
    ``estimated_stepping_batches`` was not DDP's. Raised before the first batch, on several ranks on every rank, as the
    loader is set up (:func:`_agree_on_train_loader`)."""
    name = type(getattr(dataloader, "batch_sampler", None)).__name__
    return InfeasiblePlanError(
        f"The train loader has {len(dataloader)} batches of up to {loader_batch} samples, but how many samples its {name} "  # type: ignore[arg-type]
        f"yields per epoch cannot be told from its sampler, so its micro-batches of {m} cannot be counted (counted wrong, an "
        "optimizer step would run across the epoch's end).",
        hint=f"Use micro_batch_size={loader_batch} (your batches as they are), a batch sampler whose `sampler` attribute holds "
        "exactly the indices it batches, or strategy='ddp'.",
    )


def _agree_on_train_loader(
    trainer: pl.Trainer, loader: object, refusal: Exception | None = None, *, layout: tuple[int | None, int | None] = (None, None),
    stages: tuple[int, int, object] | None = None,
) -> None:
    """Where Lightning sets the train loader up (every rank, once per loader), the ranks agree that ``loader``, the one
    Lightning gets, can run: ``refusal`` (this rank's, maybe of its own data alone) is raised on every rank, and
    loaders with a length beside streams are refused on every rank. Lightning's ``has_len_all_ranks``, right after
    this hook, sums the loaders' lengths in a collective that only the ranks with a length join, so a loader of each
    rank's own (``use_distributed_sampler=False``) that is a stream (an IterableDataset without ``__len__``) on some
    ranks hung the fit there until the process group's timeout; so did a rank refusing alone (the others waited there
    until its process ended under them).

    In the same collective the ranks agree that they cut their loaders alike: ``layout`` is this rank's loader batch
    size (None: unknown) and the micro-batch size it is cut into (None: run as it is). Loaders of each rank's own may
    batch other sizes, and a rank whose batch size is ``m`` ran its loader as it is (no agreement per batch,
    :class:`_MicroBatchLoader`) while another cut its own (one per batch) and accumulated other numbers of micro-batches
    per step: their collectives did not meet (the fit hung, or gloo failed on all-reduces of other sizes). Refused on
    every rank where one re-chunks and the ranks' sizes differ (run as they are, they train as under DDP). One
    all-reduce of eight integers per loader set up (:func:`raise_on_every_rank`), none on one rank.

    ``stages`` (a pipeline's: this rank's replica, the number of replicas, and the user's loader as this rank reads
    it): the stages of a replica read the same batches together, so their loaders must hold as many batches and samples.
    Loaders of each rank's own (``use_distributed_sampler=False``, a sampler sharding by the global rank) may not: a
    stage whose loader ended first left the others waiting for it in the pipeline's send / recv (a hang until the
    process group's timeout: 16 and 12 samples in batches of 4 trained 3 steps, then hung); only the first batch was
    compared (``PipelineStrategy._check_same_batch``), and a batch of floats only was just warned about. Refused on
    every rank, in the same all-reduce (4 more integers per replica: the MIN and MAX of its stages' counts).

    ``loader``'s ``__len__`` raising (other than the TypeError / NotImplementedError of no length: an unreadable index
    file of this rank's) is carried as a refusal: raised here as it was raised, on the other ranks as
    :func:`_told_elsewhere` says (read before the collective, it stopped this rank alone and the others waited in it)."""
    if trainer.world_size < 2:  # the trainer's ranks agree, not a wider default group's (no collective for one)
        if refusal is not None:
            raise refusal
        return
    counts = (-1, -1)  # this rank's (batches, samples) of the user's loader where it is a pipeline's stage (-1: unknown)
    try:  # (none read where this rank refuses: the refusal is raised whatever the others' lengths)
        skipped = None if refusal is not None else sized_len(loader) is None
        if refusal is None and stages is not None:
            batches, samples = sized_len(stages[2]), _samples_per_epoch(stages[2])
            counts = (-1 if batches is None else batches, -1 if samples is None else samples)
    except Exception as failure:  # a __len__ raising on this rank alone (its own data): the others waited in the agreement
        _tell_every_rank(functools.partial(_agree_on_train_loader, trainer, loader, failure, layout=layout, stages=stages), failure)
        raise
    loader_batch, m = layout
    batch, micro = -1 if loader_batch is None else loader_batch, -1 if m is None else m
    rechunks = m is not None and loader_batch != m
    # each replica's MIN and MAX of its stages' batches and samples: the other replicas' ranks put a value above any count
    replica, replicas = (0, 0) if stages is None else stages[:2]
    apart = 2**62
    per_replica = [v for r in range(replicas) for c in counts for v in ((c, -c) if r == replica else (apart, apart))]
    # MIN of each, and of its negation (the MAX)
    agreed = raise_on_every_rank(refusal, doing="reading its train loader", device=trainer.strategy.root_device,
                                 skipped=skipped, mixed=lambda rank: lengths_beside_streams("train", [rank]),
                                 also=(batch, -batch, micro, -micro, -rechunks, *per_replica), sent=_told_elsewhere)
    smallest, largest, fewest, most, rechunked = agreed[0], -agreed[1], agreed[2], -agreed[3], agreed[4] < 0
    for r in range(replicas):
        least_batches, most_batches, least_samples, most_samples = (
            agreed[5 + 4 * r], -agreed[6 + 4 * r], agreed[7 + 4 * r], -agreed[8 + 4 * r])
        # (a count unknown on a stage, -1, is no difference: streams beside lengths are refused above)
        if least_batches >= 0 and least_batches != most_batches or least_samples >= 0 and least_samples != most_samples:
            raise stages_hold_other_data(r, replicas, (least_batches, most_batches), (least_samples, most_samples))
    if rechunked and (largest != smallest or most != fewest):
        sizes = f"{smallest}" if smallest == largest else f"from {smallest} to {largest}" if smallest >= 0 else \
            f"up to {largest} (unknown on some)"
        cut = f"{fewest}" if fewest == most else f"{max(fewest, 0)} to {most}"
        raise InfeasiblePlanError(
            f"The ranks' train loaders have batch sizes {sizes}, re-chunked into micro-batches of {cut}, so ranks whose batches "
            "make other numbers of micro-batches (or run as they are) would take other steps and meet in other collectives.",
            hint="Give every rank's train loader the same batch size, or run each rank's batches as they are "
            "(DPGAStrategy's micro_batch_size and accumulate_grad_batches 'auto', or strategy='ddp').",
        )


def stages_hold_other_data(replica: int, replicas: int, batches: tuple[int, int], samples: tuple[int, int]) -> BatchFormatError:
    """The refusal of pipeline replica ``replica`` (of ``replicas``) whose stages' train loaders hold from ``batches[0]``
    to ``batches[1]`` batches and ``samples[0]`` to ``samples[1]`` samples per epoch (-1: unknown on some stage)
    (:func:`_agree_on_train_loader`): they are not the same data, which every stage of a replica must read."""
    held = [f"from {lo} to {hi} {what}" for (lo, hi), what in ((batches, "batches"), (samples, "samples")) if lo >= 0 and lo != hi]
    which = "the pipeline's stages" if replicas == 1 else f"the stages of pipeline replica {replica}"
    return BatchFormatError(
        f"The train loaders of {which} hold different numbers of batches or samples ({' and '.join(held)} per epoch), "
        "but a replica's stages must read the same batches together (the first stage feeds the inputs, the last computes "
        "the loss), so a stage whose loader ends first would leave the others waiting.",
        hint="Give every rank of a pipeline replica the same loader: let Lightning shard the data (use_distributed_sampler=True, "
        "no sampler of your own), or shard by trainer.strategy.distributed_sampler_kwargs['rank'] / ['num_replicas'] (the "
        "data-parallel replica), not by the global rank.",
    )


def lengths_beside_streams(what: str, ranks: Sequence[int]) -> BatchFormatError:
    """The refusal of ``what`` ("train", "validation", ...) loaders without a length (streams) on ``ranks`` beside loaders
    with one on the others: Lightning's ``has_len_all_ranks`` sums their lengths in a collective that the ranks reading a
    stream skip, and the run hung there (train loaders: :func:`_agree_on_train_loader`; a pipeline's evaluation loaders:
    ``PipelineStrategy._agree_on_evaluation_batches``)."""
    many = len(ranks) > 1
    return BatchFormatError(
        f"The {what} loader{'s' if many else ''} of rank{'s' if many else ''} {', '.join(map(str, ranks))} "
        f"{'have' if many else 'has'} no length (a stream) while those of other ranks have one, and Lightning sums their "
        "lengths in a collective that only the ranks with a length join.",
        hint="Give every rank a loader of the same kind: a dataset with a length on every rank (map-style, or an "
        "IterableDataset with __len__), or a stream without one on every rank.",
    )


def _warn_batchnorm(trainer: pl.Trainer, m: int, loader_batch: int) -> None:
    """BatchNorm normalises over what one forward sees: micro-batches of ``m`` are not the user's batches (DESIGN §3,
    invariant 2: detected and reported)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    module = trainer.lightning_module
    names = [name for name, sub in module.named_modules() if isinstance(sub, _BatchNorm) and sub.training] if module is not None else []
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        rank_zero_warn(
            f"dp_ga: the model's BatchNorm layers ({shown}) normalise over each micro-batch of {m} samples, not your loader batch "
            f"of {loader_batch}, so the weights and running statistics differ from DDP's. Pass micro_batch_size={loader_batch} to "
            "keep DDP's statistics (if it fits in memory), or accept per-micro-batch statistics."
        )


def _scale_loss(output: Any, weight: float) -> Any:
    """``training_step``'s output with its loss multiplied by ``weight`` (a tensor, or a mapping with ``"loss"``)."""
    if isinstance(output, torch.Tensor):
        return output * weight
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"] * weight}
    return output  # None (a skipped batch) or anything Lightning will reject itself


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def loader_sampler(dataloader: object) -> tuple[Any, bool | None]:
    """The sampler behind a DataLoader's batches (None: unknown) and whether its batches drop the short last one (None:
    unknown). A batch sampler without a ``sampler`` of its own (one that shards or filters the data itself) does not
    draw from the DataLoader's ``sampler``, which torch makes over the whole dataset."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    sampler = getattr(dataloader, "sampler", None) if batch_sampler is None else getattr(batch_sampler, "sampler", None)
    return sampler, getattr(batch_sampler, "drop_last", getattr(dataloader, "drop_last", None))


def _samples_per_epoch(dataloader: object) -> int | None:
    """Samples one pass of ``dataloader`` yields, None where they cannot be known from its lengths (also where a
    sampler holds more samples than the loader's batches, each at most the batch size, can: they are not drawn from it).

    A batch sampler without a ``sampler`` of its own (a user's shuffling or bucketing one, which draws its indices
    itself) is counted from the DataLoader's ``sampler`` (the whole dataset) only where its length is the number of
    batches of ``batch`` that dataset makes: one that shards or filters the data itself makes fewer, and is left
    uncounted. A ``__len__`` raising NotImplementedError is no length, as Lightning reads it (``sized_len``): raised
    here, it stopped a pipeline's fit on several ranks (and auto_plan's planning there) that Lightning runs as unsized."""
    batch = loader_batch_size(dataloader)
    sampler, drop_last = loader_sampler(dataloader)
    if batch is None or drop_last is None:
        return None
    try:
        batches = len(dataloader)  # type: ignore[arg-type]
        if drop_last:
            return batches * batch
        dataset = getattr(dataloader, "dataset", None)
        # an iterable-style dataset's length is its samples (the DataLoader's own length is taken from it); its sampler
        # (torch's _InfiniteConstantSampler) has none
        if isinstance(dataset, torch.utils.data.IterableDataset):
            samples = len(dataset)  # type: ignore[arg-type]
        elif sampler is None and getattr(dataloader, "batch_sampler", None) is not None:
            samples = len(getattr(dataloader, "sampler", None))  # type: ignore[arg-type]
            return samples if -(-samples // batch) == batches else None
        else:
            samples = len(sampler)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None
    return samples if samples <= batches * batch else None


class _MicroBatchLoader:
    """The train loader, yielding micro-batches of ``micro_batch_size`` samples.

    Everything else (``sampler`` for ``set_epoch``, ``dataset``, ``worker_init_fn``...) is the
    wrapped loader's, so Lightning's loops treat it like the original. ``limit_batches`` stops after
    that many loader batches. For each micro-batch it yields, the loss weight that keeps the user's
    weighting (``weight`` · its share of loader batches, see the module docstring) is queued, and
    :meth:`next_batch` hands them out in the same order as the loop consumes the micro-batches. ``ended`` (if set) is
    called when an epoch's batches run out. ``agree`` (set on several ranks without a ``DistributedSampler``, see
    :func:`_agreed_batch_sizes`) has the ranks agree on each loader batch's size, the largest of theirs, and every rank
    cuts it as a batch of that size (:func:`_rebatch_pieces`), so every rank runs the same micro-batches. ``__len__`` then
    counts every one of the loader's batches as a full one (the same on every rank without a collective): where the
    agreed sizes fall short of that (short last batches, or other sizes mid-epoch), the epoch ends before that count,
    its last micro-batch looked ahead for (as an IterableDataset's). A refusal of a batch that may hold on some ranks
    only is raised on every rank at the agreement (one known before the first batch, as the loader is set up:
    :func:`_agree_on_train_loader`).
    """

    ended: Callable[[], None] | None = None

    def __init__(
        self, loader: Iterable, micro_batch_size: int, weight: float = 1.0, limit_batches: int | None = None, *,
        agree: Callable[[int, Exception | None], tuple[int, int]] | None = None,
        agree_first: Callable[[int, Exception | None], tuple[int, int]] | None = None, failed: Exception | None = None,
    ) -> None:
        # ``failed``: an error this rank's set-up raised reading ``loader`` (Rechunking.wrap), which still makes the loader
        # as the other ranks do; a loader that agrees as it is made (_FullBatchLoader) carries it there (this one makes none)
        self._loader = loader
        self.micro_batch_size = micro_batch_size
        self.agree = agree  # several ranks: (largest, smallest) of the ranks' batch sizes; raises a rank's refusal (see _agreed_batch_sizes)
        self.agree_first = agree_first  # several ranks under a DistributedSampler: the same, at a pass's first batch only (see _agree)
        self._weight = weight
        self._limit_batches = limit_batches
        # (loss weight, loader batches ending in it, whether the loader is known to end after it) per micro-batch yielded
        self._weights: deque[tuple[float, int, bool]] = deque()
        self._warned: set[str] = set()  # a warning about uneven loader batches, once per fit
        self._resume: tuple[int, int] | None = None  # a resumed epoch's (loader batches, length as Lightning counts it)
        self._resume_began = False
        self._states: dict[int, Any] | None = None  # a stateful loader's state after each loader batch pulled (see _recorded)
        self._held: Any = None  # the state a checkpoint stores for it now (None: the loader's own)
        self._exhausted = False

    def resume_epoch(self, loader_batches: int, length: int) -> None:
        """The next epoch resumes one: it stops after ``loader_batches`` of the loader's batches, and has ``length``
        batches for Lightning (those it trained before the checkpoint, then these)."""
        self._resume, self._resume_began = (loader_batches, length), False

    def __iter__(self) -> Iterator[Any]:
        if self._resume is not None and self._resume_began:
            self._resume = None  # the epoch after the resumed one
        limit = self._limit_batches
        if self._resume is not None:
            self._resume_began = True
            limit = self._resume[0]
        self._weights.clear()  # a new epoch (a previous one may have stopped early, e.g. at max_steps)
        # The loader's own iterator now, as iter(loader) makes it: a DataLoader draws its workers' base seed from the
        # global random stream then, and Lightning calls iter() on it once more than it uses (the first is dropped).
        try:
            batches = iter(self._batches(limit))
        except StopIteration as stop:  # raised by _raising's generator, Python's "generator raised StopIteration" (PEP 479)
            batches = _raising(_stopped_as_made(stop))
        except Exception as failure:  # (a KeyboardInterrupt is not carried: this rank stops at once)
            # maybe this rank's alone (its batch sampler's __iter__, a worker that did not start): raised here, it left
            # the other ranks waiting at the epoch's first agreement; raised at the first pull, that agreement carries it
            batches = _raising(failure)
        return self._iterate(batches, limit)

    def _iterate(self, batches: Iterator[Any], limit: int | None) -> Iterator[Any]:
        expected = loader_batch_size(self._loader)
        odd: tuple[int, int] | None = None  # (index, size) of the first loader batch of another size than the others
        # An IterableDataset's length (its __len__) may overstate what this rank's iterator yields: once a loader batch of
        # another size came (the stream's short last one), look one micro-batch ahead after each that ends a loader batch,
        # so the epoch's last is known where Lightning, counting more, does not know it (Rechunking._steer_step)
        # (so does a loader cut as the ranks agree: __len__ counts its batches as full, and one of another size may come
        # mid-epoch). Every decision that pulls a loader batch (the look-ahead) is made from what the ranks agreed on (the
        # sizes each batch was cut as, and the pieces' places, alike on every rank: see Piece), so they meet in its
        # collective at the same place.
        peek = (self._stream or self.agree is not None) and sized_len(self) is not None
        micro_batches = _rebatch_pieces(self._watch_labels(batches), self.micro_batch_size, expected, agree=self._agree,
                                        room=self._counted_room(limit, expected))
        item = next(micro_batches, None)
        while item is not None:
            batch, pieces = item
            # (index, size): the size the ranks agreed on (where they do), which is how the batch was cut
            sources = [(i, cut) for i, _, _, _, cut in pieces]
            if expected is None:
                expected = sources[0][1]
            odd = odd or next(((i, n) for i, n in sources if n != expected), None)
            if odd is not None and sources[-1][0] > odd[0]:
                self._warn_once("uneven", f"dp_ga: a train loader batch of {odd[1]} samples, not {expected}, came before the epoch's "
                                f"end, so the micro-batches of {self.micro_batch_size} after it no longer start where your batches do "
                                "and the optimizer steps stop following your batches (a batch sampler of varying sizes?). Use "
                                "micro_batch_size='auto' to train your batches as they are.")
            elif len({n for _, n in sources}) > 1:
                self._warn_once("joined", f"dp_ga: a micro-batch of {self.micro_batch_size} joins samples of the epoch's short last batch "
                                f"({min(n for _, n in sources)} samples) to those of a full batch, and weighs them alike, where a run of "
                                "your loader weighs each batch's mean loss alike (the short batch's samples more). drop_last=True, "
                                "or a micro-batch size that divides the loader's batch, gives the same weights.")
            _, n, _, end, cut = pieces[-1]
            if all(first == end for _, _, first, end, _ in pieces):
                self._warn_once("filler", f"dp_ga: a train loader batch of {n} samples holds fewer samples than the micro-batches "
                                f"another rank's batch of {cut} there is cut into, which every rank runs alike (its ranks "
                                "meet at each); the missing ones repeat a sample with loss weight 0 (no gradient, but training_step "
                                "sees it). Use drop_last=True, or micro_batch_size='auto', to run no such micro-batch.", any_rank=True)
            looked = peek and odd is not None and end == n  # its last place ends a loader batch: alike on every rank
            following = next(micro_batches, None) if looked else None
            self._weights.append((self._weight * _share(pieces), _ends(pieces), looked and following is None))
            self._hold_state_of(sources[0][0])
            yield batch
            item = following if looked else next(micro_batches, None)
        if self.ended is not None:
            self.ended()

    def _counted_room(self, limit: int | None, expected: int | None) -> Room | None:
        """The places Lightning's count of this pass's micro-batches (:meth:`__len__`) holds, and what it was counted from
        (:data:`Room`): every loader batch as a full one (on several ranks that agree, under a limit of loader batches or a
        resumed epoch's, or where the batches drop the short last one), else the samples the loader's sampler (or
        dataset) holds. Batches holding more samples in all (a batch sampler's own sizes; a ``collate_fn`` that makes
        several rows of a sample, which no count before the epoch sees) ended the epoch at that count before their last
        samples, without a word (:func:`_rebatch_pieces` refuses them); larger ones that fit (12, 4, 8 where 3 of 8 were
        counted) train whole. None: not counted (no length)."""
        batches = sized_len(self._loader)
        micro_batches = sized_len(self)
        if expected is None or batches is None or micro_batches is None:
            return None
        limited = limit is not None and limit < batches
        batches = batches if limit is None else min(batches, limit)
        m = self.micro_batch_size
        if not (self.agree is not None or limited or loader_sampler(self._loader)[1]):
            return micro_batches * m, batches, None, self._samples()  # __len__: the samples, in micro-batches of m
        return math.ceil(batches * expected / m) * m, batches, expected, batches * expected

    @property
    def _stream(self) -> bool:
        """Whether the loader reads an IterableDataset (whose ``__len__``, if any, need not be what it yields)."""
        return isinstance(getattr(self._loader, "dataset", None), torch.utils.data.IterableDataset)

    def _watch_labels(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, warning once when the first few carry Hugging Face's -100 labels (tokens a loss ignores)."""
        for i, batch in enumerate(batches):
            labels = batch.get("labels") if i < 8 and isinstance(batch, Mapping) else None
            if isinstance(labels, torch.Tensor) and labels.dim() > 1 and bool((labels == -100).any()):
                self._warn_once("ignored", "dp_ga: the batch's labels hold -100 (tokens the loss ignores), so a loss averaged over "
                                f"the counted tokens (Hugging Face's) is averaged per micro-batch of {self.micro_batch_size}, not over your "
                                "batch, and the weights differ from a run of your batches (as under Lightning's own accumulate_grad_batches; "
                                "a micro-batch without counted tokens even gives a NaN loss). Divide the summed token loss by a count fixed "
                                "per batch, or use micro_batch_size='auto'.")
            yield batch

    def _batches(self, limit: int | None) -> Iterable[Any]:
        """The loader's batches, the first ``limit`` of them when limited.

        Over an IterableDataset with ``__len__``, at most the loader's length of them: Lightning stops a run of the
        user's loader there, where the stream may yield more (several workers each batch their share, each ending in a
        short batch: 8, 8, 2, 2 where the loader's length is 3).
        """
        length = sized_len(self._loader) if self._stream else None
        if length is not None:
            limit = length if limit is None else min(limit, length)
        source = self._loader if limit is None else itertools.islice(self._loader, limit)
        self._states, self._held, self._exhausted = None, None, False
        if isinstance(self._loader, _Stateful) and type(self)._iterate is _MicroBatchLoader._iterate and sized_len(self) is None:
            return self._recorded(iter(source))  # iter() now: see __iter__
        return source

    def _recorded(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, keeping a stateful loader's state after each one.

        Lightning saves a stateful loader's ``state_dict`` in a mid-epoch checkpoint, and fetches one batch ahead of the
        one it trains where the loader has no length: a run of the user's loader saves the state past one loader batch
        more than it trained. Fetched ahead here is a micro-batch, which may take several loader batches; the state
        stored is the loader's after the first of them, so the resumed fit starts where the user's run resumes (it had
        skipped the micro-batch's further loader batches too)."""
        self._states = {}
        for i, batch in enumerate(batches):
            self._states[i] = self._loader.state_dict()
            yield batch
        self._held, self._exhausted = None, True  # all pulled, as the user's run has at the epoch's end

    def _hold_state_of(self, first: int) -> None:
        """The micro-batch just yielded starts with loader batch ``first``: a checkpoint stores the state after it."""
        if self._states is None or self._exhausted:
            return
        self._held = self._states.get(first)
        for index in [i for i in self._states if i < first]:
            del self._states[index]

    def _held_state_dict(self) -> Any:
        return self._held

    def _warn_once(self, kind: str, message: str, *, any_rank: bool = False) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            if any_rank:  # what happens on this rank alone
                warnings.warn(message, UserWarning, stacklevel=2)
            else:
                rank_zero_warn(message)

    def _agree(self, index: int, n: int, failure: Exception | None = None) -> int:
        """The size to cut loader batch ``index`` of ``n`` samples as (``n`` is the end of the epoch's batches): ``n``
        on one rank; on several, the largest of the ranks' sizes (:func:`_agreed_batch_sizes`). ``failure`` (this rank's
        refusal of the batch, else :attr:`refusal`) is raised, on several ranks on every rank.

        Under a DistributedSampler on several ranks (as many batches on each, nothing agreed per batch: :attr:`agree_first`)
        ``n`` it is, and only the pass's first batch is agreed on, where a refusal of the batch's format (its size
        unreadable, a part that cannot be cut: maybe in one rank's shard alone) is found: the other ranks went on into a
        step and died with gloo's error once the refusing rank's process ended. One all-reduce per pass there."""
        if self.agree is None:
            if self.agree_first is not None and index == 0:
                self.agree_first(n, failure)
            if failure is not None:
                raise failure
            return n
        largest, smallest = self.agree(n, failure)
        if smallest == 0 < largest:
            raise DataLoadingError(
                f"dp_ga: the ranks' train loaders yielded different numbers of batches this epoch (this rank's "
                f"{'ended after' if n == 0 else 'yielded more than'} {index}), where the ranks cut each loader batch alike and meet "
                "at each, so they must yield as many (as under DDP).",
                hint="Give each rank's loader as many batches (a DistributedSampler, or drop_last=True with shards of equal "
                "sizes).",
            )
        return largest

    def _samples(self) -> int:
        """Samples per epoch through :meth:`_batches`; TypeError (Lightning: not sized) when unknown."""
        n = _samples_per_epoch(self._loader)
        if n is None:
            raise TypeError("the number of samples per epoch is unknown")  # Lightning's sized_len -> iterable
        if self._limit_batches is not None:
            n = min(n, self._limit_batches * loader_batch_size(self._loader))  # type: ignore[operator]
        return n

    def next_batch(self) -> tuple[float, int | None, bool]:
        """For the next micro-batch the loop trains on: its loss weight (1 for one cut from full loader batches), how
        many loader batches end in it (None: not known) and whether the loader is known to end after it."""
        weight, ends, last = self._weights.popleft() if self._weights else (1.0, None, False)
        return (1.0 if math.isclose(weight, 1.0, rel_tol=1e-12) else weight), ends, last

    def __len__(self) -> int:
        if self._resume is not None:
            return self._resume[1]
        batch = loader_batch_size(self._loader)
        # several ranks: each of the loader's batches counted as a full one (another rank's may be, also mid-epoch: each
        # rank's count alike where their loaders yield as many batches, with no collective; also on a rank whose samples
        # per epoch are unknown, which is refused on every rank as the loader is set up: _agree_on_train_loader)
        if self.agree is not None and batch:
            batches = len(self._loader)  # type: ignore[arg-type]  # TypeError where it has no length: not sized
            samples = (batches if self._limit_batches is None else min(batches, self._limit_batches)) * batch
        else:
            samples = self._samples()
        return math.ceil(samples / self.micro_batch_size)

    _OWN = frozenset({"_loader", "micro_batch_size", "agree", "agree_first", "_weight", "_limit_batches", "_weights", "_warned", "_resume", "_resume_began",
                      "_states", "_held", "_exhausted", "ended"})

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._OWN:  # during unpickling, before __init__ ran
            raise AttributeError(name)
        if name == "state_dict":  # only where the loader has one (Lightning tells stateful loaders by the attribute)
            own = getattr(self._loader, name)
            return self._held_state_dict if self._held is not None else own
        return getattr(self._loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. Lightning's worker_init_fn injection belongs to the real loader
            setattr(self._loader, name, value)


def few_names(names: Sequence[str]) -> str:
    """``"2 trainable parameter(s) (head.weight, head.bias)"``: the count and the first three names."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} trainable parameter(s) ({', '.join(names[:3])}{more})"


@contextlib.contextmanager
def unused_parameters_named(strategy: DDPStrategy, name: str) -> Iterator[None]:
    """Turn DDP's error about parameters the last step's loss did not use into one sentence naming the argument that
    keeps ``name`` (DDP wraps even one device under these strategies; its own advice, Lightning's
    ``strategy='ddp_find_unused_parameters_true'``, would drop it)."""
    try:
        yield
    except RuntimeError as err:
        if "find_unused_parameters" not in str(err) or strategy._ddp_kwargs.get("find_unused_parameters"):
            raise
        module = strategy.lightning_module
        raise InfeasiblePlanError(
            f"{type(module).__name__} has parameters its training_step's loss does not use (a head used only in "
            "predict_step?), which DistributedDataParallel, wrapping the model under this strategy, refuses.",
            hint=f"Pass {name}(find_unused_parameters=True), or set requires_grad=False on them.",
        ) from err


def _batch_n(batch: Any, sizer: BatchSizer | None = None) -> int:
    """Samples in a training batch (:func:`find_batch_size`, or what ``sizer`` reads over a loader's batches)."""
    n = sizer(batch) if sizer is not None else find_batch_size(batch)
    if n is None:
        raise InfeasiblePlanError(
            f"A training batch of type {type(batch).__name__} holds no tensor with a batch dimension to split into micro-batches.",
            hint="Return tensors (or dicts/lists/tuples of tensors) from the train dataloader, or use micro_batch_size='auto'.",
        )
    return n


def _rebatch(batches: Iterable[Any], m: int) -> Iterator[Any]:
    """Yield the samples of ``batches`` in order, ``m`` at a time (the last one may be shorter)."""
    for batch, _ in _rebatch_pieces(batches, m):
        yield batch


Room = tuple[int, int, "int | None", int]
"""The places an epoch's count of micro-batches holds (:meth:`_MicroBatchLoader._counted_room`), the loader batches counted,
the batch size each was counted as (None: the count is of the samples the sampler holds) and the samples counted."""


Piece = tuple[int, int, int, int, int]
"""Where some of a micro-batch's samples come from: (index of the loader batch in this pass, its size, first, end, the size
it was cut as). On several ranks the last is the size they agreed on, and a micro-batch has a piece for each loader batch
whose places it holds, also one of no samples there (``first == end``), so its pieces' indices, cut sizes and ends
(``end == size``: the batch's last place) are alike on every rank."""


_ENDED = object()  # what next() gives past a loader's last batch


def _raising(failure: Exception) -> Iterator[Any]:
    """An iterator whose first ``next`` raises ``failure`` (what making the loader's iterator raised), where the pull of
    a batch is carried to the other ranks (:func:`_rebatch_pieces`, :class:`_FullBatchLoader`'s steps)."""
    raise failure
    yield  # a generator: raised at the first next(), not when made


def _stopped_as_made(stop: StopIteration) -> DataLoadingError:
    """The error for a train loader whose ``iter()`` raised ``stop`` (its cause): carried in :func:`_raising`'s
    generator, Python turned it into "RuntimeError: generator raised StopIteration", naming this package's generator
    rather than the loader whose iterator could not be made."""
    err = DataLoadingError(
        "The train loader's iterator raised StopIteration as it was made (iter() of the loader), before its first batch.",
        hint="Make the __iter__ of its batch sampler, sampler or IterableDataset a generator (with yield) or have it "
        "return an iterator; one that calls next() itself raises StopIteration where there is nothing left.",
    )
    err.__cause__ = stop
    return err


def _rebatch_pieces(
    batches: Iterable[Any], m: int, expected: int | None = None, *, agree: Callable[..., int] | None = None,
    room: Room | None = None, counted_by: tuple[str, str] = ("dp_ga", "micro-batches"),
) -> Iterator[tuple[Any, tuple[Piece, ...]]]:
    """:func:`_rebatch`, with each micro-batch's pieces of loader batches. ``expected``: the loader's batch size, which
    tells the batch dimension from per-batch constants (:class:`BatchSizer`). ``room``: the places the epoch's count of
    micro-batches holds, and the loader batches and batch size it was counted from
    (:meth:`_MicroBatchLoader._counted_room`); batches that fill them before the last counted one, or overflow them,
    are refused (Lightning ends the epoch there; a count of the sampler's samples filled only where a batch follows:
    :func:`_follows`), as the ranks cut them, so alike on every rank. ``counted_by``: who counted them, in what
    (:func:`_cut_short`).

    ``agree`` (several ranks): called with each loader batch's index and size (and once with the index past the last and
    0), it answers the size to cut the batch as, the largest of the ranks' (:meth:`_MicroBatchLoader._agree`); called
    with a batch's refusal (its size unknown, a part that cannot be cut) or any error pulling it raised (this rank's
    Dataset or collate_fn), it raises it on every rank. A batch
    of that size is cut as it is; a smaller one has its samples spread evenly over that many places, so it gives the
    same micro-batches (ranks whose short batches differ run the same ones: Lightning and DDP meet in a collective at
    each), with the same pieces (:data:`Piece`: places that hold none of the batch's samples give a piece of none). A
    micro-batch whose places hold none of its samples (a batch of fewer samples than micro-batches) is a filler: the
    batch's first sample, its piece of no samples (loss weight 0). A batch's last place holds its last sample."""
    sizer = BatchSizer(expected)
    pending: list[tuple[Any, Piece]] = []  # (samples, where they come from)
    have = 0  # places of the micro-batch filled (samples, or a spread batch's places)
    placed = 0  # places of the epoch's batches so far
    i = -1
    batches = iter(batches)
    while True:
        try:  # pulling the batch too: any error of this rank's loader (an IndexError of its Dataset) may be its alone
            batch = next(batches, _ENDED)
            if batch is _ENDED:
                break
            n = _batch_n(batch, sizer)
            if i == -1 and n != m:
                _refuse_uncut_parts(batch, n, m)
        except Exception as failure:  # (a KeyboardInterrupt is not carried: this rank stops at once)
            if agree is None:
                raise
            # raises it on every rank (another rank's batch may be fine: it waits at the agreement); here as it was raised
            _tell_every_rank(functools.partial(agree, i + 1, 0, failure), failure)
            raise
        i += 1
        places = n if agree is None else agree(i, n)  # n places hold n samples: one each
        placed += places
        if room is not None and (placed > room[0] or placed == room[0] and i + 1 < room[1] and _follows(batches, room)):
            raise _cut_short(i, placed, room, m, expected, counted_by=counted_by)
        offset = 0
        while offset < places:
            take = min(m - have, places - offset)
            first, end = offset * n // places, (offset + take) * n // places  # the samples at these places
            samples = None if end == first else batch if end - first == n else slice_samples(batch, first, end, n)  # a view
            pending.append((samples, (i, n, first, end, places)))
            have += take
            offset += take
            if have == m:
                yield _joined_or_filler(pending, batch, n)
                pending, have = [], 0
    if agree is not None:
        agree(i + 1, 0)  # the ranks' loaders end together (a rank that has another batch raises)
    if have:
        yield _joined_or_filler(pending, batch, n)


def _agreed_batch_sizes(device: torch.device, n: int, failure: Exception | None = None) -> tuple[int, int]:
    """The largest and the smallest of the ranks' ``n`` (dp_ga: this rank's loader batch size, 0 where its loader ended;
    a pipeline's ``_FullBatchLoader``: its samples per epoch, -1 where unknown, or whether it has a full step), by one
    all-reduce of three integers on ``device`` (the strategy's root device, so NCCL can). A rank with a ``failure`` (its
    refusal of the batch, maybe on it alone, or any error its loader raised) says so in the third; where one did, every
    rank raises the lowest such rank's error (:func:`raise_on_every_rank`, collectives only then, the others as
    :func:`_told_elsewhere` says) rather than one waiting at the next agreement."""
    sizes = torch.tensor([n, -n, failure is not None], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(sizes, op=torch.distributed.ReduceOp.MAX)
    largest, negative_smallest, failed = sizes.tolist()
    if failed:
        raise_on_every_rank(failure, doing="reading its train loader", device=device, sent=_told_elsewhere)
    return largest, -negative_smallest


def _follows(batches: Iterator[Any], room: Room) -> bool:
    """Whether a loader batch follows where the epoch's batches filled the ``room`` counted before the loader's last
    batch. Counted from the sampler's samples (``room``'s batch size None), all of them came: a batch sampler whose
    length overstates its batches (larger ones: 12, 8 of 20 samples where it says 3) trains whole, and only a further
    batch (a ``collate_fn`` making rows of no sample of the sampler's) is cut short; so the next batch is looked for
    (a refusal follows where there is one; none: the loop ends). Counted in loader batches, the count is the one
    to go by (and the ranks that agree per batch meet at each: no look-ahead of one rank's own)."""
    return room[2] is not None or next(batches, _ENDED) is not _ENDED


def _told_elsewhere(failure: Exception, rank: int) -> Exception:
    """What the other ranks raise for the ``failure`` global rank ``rank`` had reading its train loader: a refusal of
    this package's (a sentence and HINT that hold there too) as it is; any other (an IndexError of that rank's Dataset, a
    collate error) as a RuntimeError that names it and sends them to that rank's traceback. Raised as it is, the error
    would look like one of their own data, with a traceback through this package's code, not where it was raised."""
    if isinstance(failure, DistPlanError):
        return failure
    if isinstance(failure, Warning):  # rank 0's warning (rank_zero_warn) that a warnings filter made an error there alone
        return RuntimeError(
            f"Global rank {rank} raised the warning {type(failure).__name__} ({first_line(failure)}) as an error (a warnings "
            "filter such as -W error), so every rank stops. HINT: Act on that warning, or exempt its message from the filter "
            "(warnings.filterwarnings('default', message=...)) to run on."
        )
    return RuntimeError(
        f"Global rank {rank} raised {type(failure).__name__} ({first_line(failure)}) reading its train loader, "
        f"so every rank stops. HINT: See global rank {rank}'s traceback for where it was raised (its Dataset, sampler, collate_fn or __len__)."
    )


def _tell_every_rank(agree: Callable[[], object], failure: Exception) -> None:
    """Call ``agree``, an agreement that raises this rank's ``failure`` on every rank, from the except block that caught
    ``failure``, which re-raises it with a bare ``raise``. Raised by :func:`raise_on_every_rank`, ``failure``'s traceback
    had the agreement's frames put in front of where its loader raised it (the error looked raised there); it is set back
    to the traceback it was caught with. Another error of the agreement's (another rank's, told here) passes."""
    caught = failure.__traceback__
    try:
        agree()
    except Exception as err:
        if err is not failure:
            raise
        failure.__traceback__ = caught


def _joined_or_filler(pending: list[tuple[Any, Piece]], batch: Any, n: int) -> tuple[Any, tuple[Piece, ...]]:
    """The micro-batch of ``pending``, or where it holds no samples, a filler: the first sample of ``batch`` (the loader
    batch of ``n`` samples whose places it holds), counted as none of its samples."""
    held = [(samples, piece) for samples, piece in pending if samples is not None]
    return (_joined(held) if held else slice_samples(batch, 0, 1, n)), tuple(piece for _, piece in pending)


def _cut_short(index: int, placed: int, room: Room, m: int, loader_batch: int | None, *,
               counted_by: tuple[str, str] = ("dp_ga", "micro-batches")) -> InfeasiblePlanError:
    """The refusal of loader batch ``index`` whose ``placed`` samples (the epoch's so far, as the ranks cut them) fill or
    overflow the ``room`` the epoch's micro-batches of ``m`` were counted with (:meth:`_MicroBatchLoader._counted_room`):
    Lightning would end the epoch at that count, before the epoch's last samples, which a run of the user's loader
    trains (it counts loader batches, whatever their sizes). ``loader_batch``: the loader's batch size (the hint's; None:
    not a remedy, as for auto_plan's pipeline, whose steps of ``m`` are its plan's). ``counted_by``: who counted, and
    its units of ``m`` (auto_plan's pipeline counts its steps from the sampler's samples too)."""
    places, batches, batch, samples = room
    rest = batches - index - 1
    left = "before its last samples" if placed > places else f"before its {rest} {'batch' if rest == 1 else 'batches'} left"
    first = "first batch of the epoch holds" if index == 0 else f"first {index + 1} batches of the epoch hold"
    counted = f"{batches} batches as at most {batch} samples each" if batch is not None else \
        f"{batches} batches as the {samples} samples its sampler holds"
    within = "a batch sampler whose batches hold at most its `batch_size` samples" if batch is not None else \
        "a collate_fn (and batch sampler) making one row of each of the sampler's samples"
    who, units = counted_by
    own = "" if loader_batch is None else f"micro_batch_size={loader_batch} (your batches as they are), "
    return InfeasiblePlanError(
        f"The train loader's {first} {placed} samples, where {who} counts the epoch's "
        f"{counted} ({places // m} {units} of {m}), so the epoch would end {left} (DDP trains them).",
        hint=f"Use {own}{within}, or strategy='ddp'.",
    )


def _refuse_uncut_parts(batch: Any, n: int, m: int) -> None:
    """Refuse, at the first loader batch, a part of it that micro-batches cannot be cut from although it holds the batch's
    ``n`` rows: every micro-batch of ``m`` got all of it (a shape error in ``training_step``, or a loss broadcast over the
    wrong rows)."""
    found = uncut_part_found(batch, n)
    if found is None:
        return
    raise InfeasiblePlanError(
        f"{found}, which cannot be cut into micro-batches of {m}: every micro-batch would get all {n} rows of it.",
        hint=f"Make it a tensor (or a dict, tuple or dataclass of tensors), or use micro_batch_size={n} (your batches as they are).",
    )


def _joined(pending: list[tuple[Any, Piece]]) -> Any:
    return concat_samples([samples for samples, _ in pending], [end - first for _, (_, _, first, end, _) in pending])


def _share(pieces: Iterable[Piece]) -> float:
    """A micro-batch's share of loader batches: Σ (its samples from batch b) / (size of b)."""
    return sum((end - first) / n for _, n, first, end, _ in pieces)


def _ends(pieces: Iterable[Piece]) -> int:
    """How many loader batches end in a micro-batch (their last sample is in it)."""
    return sum(end == n for _, n, _, end, _ in pieces)
