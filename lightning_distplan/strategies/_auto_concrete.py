"""The concrete strategies ``auto_plan`` turns into, and how it builds them in the running processes.

``_AutoDPGAStrategy`` / ``_AutoPipelineStrategy`` are the public ``DPGAStrategy`` /
``PipelineStrategy`` plus the two things only a plan chosen *inside* ``fit`` needs:

* the per-replica batch of the plan may differ from what the user's loader yields per step
  (a pipeline runs ``m·n`` samples per schedule; a given ``global_batch_size`` may differ from
  ``loader batch × accumulate × world``), so the train loader is re-chunked with ``dp_ga``'s own
  re-batching (:func:`~lightning_distplan.strategies.dp_ga._rebatch`) and the Trainer's
  ``accumulate_grad_batches`` set for the plan — and restored at teardown;
* a re-plan at an epoch boundary (``replan="auto"``) can hand a new dp_ga plan to the running strategy.
"""

from __future__ import annotations

import copy
import functools
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset
from typing_extensions import override

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import Plan
from lightning_distplan.profiling._batches import find_batch_size, slice_samples
from lightning_distplan.strategies._auto_planning import reloaded_loader_error
from lightning_distplan.strategies._checkpoint_io import raise_on_every_rank
from lightning_distplan.strategies.dp_ga import (
    DPGAStrategy,
    Rechunking,
    Room,
    _batch_n,
    _is_count,
    Piece,
    _MicroBatchLoader,
    _rebatch_pieces,
    _samples_per_epoch,
    _tell_every_rank,
    _told_elsewhere,
    loader_batch_size,
    loader_sampler,
    restore_frequencies,
    step_frequencies,
)
from lightning_distplan.strategies.pipeline import PipelineStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

__all__ = ["build_concrete", "_AutoDPGAStrategy", "_AutoPipelineStrategy", "_FullBatchLoader"]


class _LaterFits:
    """What a later ``fit`` on the same Trainer must keep for the plan ``auto_plan`` made in the first: the module it
    planned and, unless the user gave ``global_batch_size``, the global batch (the plan would silently run the first
    fit's). ``auto_plan`` plans once per Trainer: the concrete strategy is the Trainer's strategy from then on."""

    def __init__(self, plan: Plan, user_accumulate: int) -> None:
        self.plan = plan
        self.user_accumulate = user_accumulate
        self.given_global_batch = False  # set by auto_plan: the plan's global batch is the user's argument
        self.fits = 0
        self.module: Any = None
        self.outcome: Any = None  # the plan's PlanningOutcome, as the last re-plan left it (StepTimeMonitor sets it)
        self.attach: Callable[[pl.Trainer, Any], None] | None = None  # auto_plan's: attach its StepTimeMonitor again
        self.fit_loader_batch: int | None = None  # the batch size of this fit's first train loader

    def setup(self, trainer: pl.Trainer) -> None:
        """Count a fit; refuse a later one that trains another module than the one planned."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.fits += 1
        self.fit_loader_batch = None
        if self.fits == 1:
            self.module = trainer.lightning_module
        elif trainer.lightning_module is not self.module:
            raise InfeasiblePlanError(
                f"This Trainer's auto_plan planned {type(self.module).__name__} in its first fit ({self.plan.describe()}), "
                f"and this fit trains another module.",
                hint=_NEW_TRAINER,
            )
        elif self.attach is not None and self.outcome is not None:
            self.attach(trainer, self.outcome)  # the monitor started afresh in its setup: it logs (and re-plans) this fit too

    def check_loader(self, dataloader: object, world_size: int) -> None:
        """Refuse a later fit whose loader makes another global batch than the plan's, and a train loader loaded again
        during a fit (``reload_dataloaders_every_n_epochs``) with another batch size than the fit's first: the plan would
        silently keep running the old global batch where DDP steps on the new one."""
        b = loader_batch_size(dataloader)
        if self.given_global_batch or b is None:
            return
        first, self.fit_loader_batch = self.fit_loader_batch, self.fit_loader_batch or b
        if first is not None and b != first:
            # compared with the fit's first loader, not the plan: Lightning's re-instantiation can read another batch size
            # than the loader the plan was made from (a torch BatchSampler becomes batch_size=1), which the plan absorbs
            raise reloaded_loader_error(b, first, self.plan, planner="auto_plan", hint="use DPGAStrategy(micro_batch_size=...) "
                                        "or strategy='ddp', which follow a changing batch size.")
        if self.fits < 2:
            return
        now = b * self.user_accumulate * world_size
        if now != self.plan.global_batch_size:
            raise InfeasiblePlanError(
                f"This Trainer's auto_plan made its plan ({self.plan.describe()}) for the first fit's global batch of "
                f"{self.plan.global_batch_size}, and this fit's loader makes {now} ({b} x accumulate {self.user_accumulate} x {world_size} "
                f"device{'s' if world_size != 1 else ''}).",
                hint=_NEW_TRAINER,
            )


_NEW_TRAINER = "Use a new Trainer(strategy='auto_plan') for a fit of another model or batch size: it plans again."


class _AutoDPGAStrategy(DPGAStrategy):
    """:class:`DPGAStrategy` running a plan chosen by ``auto_plan`` (may change at an epoch boundary)."""

    def __init__(self, *, plan: Plan, user_accumulate: int, **kwargs: Any) -> None:
        super().__init__(plan=plan, **kwargs)
        self.later_fits = _LaterFits(plan, user_accumulate)  # also the user's accumulation, put back at teardown

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.later_fits.setup(trainer)
        super().setup(trainer)

    @property
    def user_facing_name(self) -> str:
        return "AutoPlanStrategy"

    def replace_plan(self, plan: Plan) -> None:
        """Run ``plan`` from the next time the train loader is processed (the next epoch boundary)."""
        self._requested_plan = plan
        self.later_fits.plan = plan

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # A re-plan at this epoch's end (StepTimeMonitor) waits for the next epoch's loader: a checkpoint saved in
        # between (the epoch-end ModelCheckpoint) is where that epoch starts, so it records the plan it will run.
        pending, running = self._requested_plan, self._plan
        if pending is None or running is None or pending == running:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        self._plan = pending
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        finally:
            self._plan = running

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        plan = self._requested_plan
        if trainer.state.stage == RunningStage.TRAINING:
            b = loader_batch_size(dataloader)
            if plan is not None and b is not None:
                per_replica = plan.global_batch_size // plan.dp
                # DPGAStrategy reads the user's global batch as loader batch x world x accumulation; a
                # plan for an explicitly given global batch is presented through the accumulation,
                # a fraction where the loader batch does not divide the per-replica batch (the
                # micro-batches are cut from the stream of samples, whatever the loader's batches).
                self._user_accumulate = per_replica // b if per_replica % b == 0 else Fraction(per_replica, b)
        return super().process_dataloader(dataloader)

    @override
    def _check_train_loader(self, dataloader: object) -> None:
        # (maybe one rank's loader alone: raised here, DPGAStrategy agrees on it with the other ranks, which waited)
        self.later_fits.check_loader(dataloader, self.world_size)

    @override
    def teardown(self) -> None:
        super().teardown()
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            module.trainer.accumulate_grad_batches = self.later_fits.user_accumulate


def pipeline_shortfall(n: int, b: int, drop_last: bool, *, world: int, dp: int, step: int) -> int:
    """Samples per replica and epoch a pipeline of ``dp`` replicas, each training ``step`` samples per step, trains
    fewer than DDP's ``world`` processes do over a dataset of ``n`` in loader batches of ``b``.

    ``DistributedSampler`` pads each shard to ``ceil(n / shards)``; under ``drop_last`` each process of DDP (each
    replica of the pipeline, whose stages read its shard together) trains whole loader batches only, and a pipeline
    step takes whole steps of what its replica's loader yields.

    Example:
        >>> pipeline_shortfall(60, 8, False, world=2, dp=1, step=16)  # DDP: 30 + 30 (short last batches); 3 steps of 16
        12
        >>> pipeline_shortfall(60, 8, True, world=2, dp=1, step=16)  # DDP: 24 + 24 in whole batches; 3 steps of 16
        0
    """

    def trained(shards: int) -> int:
        shard = -(-n // shards)
        return shard - shard % b if drop_last else shard

    replica = trained(dp)
    return max(0, world * trained(world) - dp * (replica - replica % step)) // dp


class _FullBatchLoader(_MicroBatchLoader):
    """Yields exactly ``micro_batch_size`` samples per batch; a trailing short batch is dropped (a
    pipeline schedule needs ``n`` equal micro-batches). ``shortfall`` (set by the strategy: samples per replica and
    epoch that DDP would train and this does not, None where the loader's length is unknown) is warned about when an
    epoch starts; an unknown one when the epoch ends short, as is a stream's that ends shorter than its length said.

    ``agree`` (set by :meth:`Rechunking.wrap` on several replicas without a ``DistributedSampler``, as for dp_ga): the
    replicas' loaders may hold different numbers of samples (a dataset per rank), and their gradient all-reduce meets at
    every step, so a replica stepping more often than another hung the fit (16 and 14 samples per rank in steps of 8:
    2 steps and 1). The ranks agree, when the loader is made (on every rank as Lightning processes its train loader), on
    the epoch's steps: the fewest any rank's samples fill (one :func:`~lightning_distplan.strategies.dp_ga._agreed_batch_sizes` of the samples per epoch); each
    stops there, and ``__len__`` is that count (also an IterableDataset's with a length of each rank's own: Lightning
    stops where ``__len__`` says, so each rank's count of its own let one rank step more). Where the loaders hold
    different numbers, that spread is warned about in place of ``shortfall``. They also agree at every step, before it,
    whether every rank has a full one (where a rank's length is unknown or may overstate what it yields, an
    IterableDataset) and whether a rank could not read its batch (its size unreadable, or any error its loader raised,
    an IndexError of its Dataset: maybe in this rank's data alone): one rank raising alone left the others waiting in the
    agreement or the gradient all-reduce until the process group's timeout; every rank raises its error
    (:func:`~lightning_distplan.strategies.dp_ga._agreed_batch_sizes`, as dp_ga's loader does; the other ranks a RuntimeError naming it and its rank where it
    is not this package's refusal). One all-reduce of three integers per step. With a DistributedSampler (every replica as many samples) nothing is agreed.

    Lightning stops at ``__len__``, the steps the samples counted before the epoch fill: batches holding more rows than
    the sampler's samples (a ``collate_fn`` making two rows of each) ended the epoch there, their last rows skipped
    unsaid (the shortfall said counted samples). The epoch's rows are held to that count as dp_ga's are
    (:meth:`_counted_room`, refused where they overflow it: :func:`~lightning_distplan.strategies.dp_ga._cut_short`),
    and before the last counted step is handed over, the loader's batches after it are read, where Lightning would not
    pull them: the remainder short of a step, or the first batch past the count where the rows overflow it. Only where
    this rank's own samples end its epoch there: on a replica with more samples than the fewest (whose steps the ranks
    agreed on), the rest of its epoch is skipped whatever its rows (said as the spread, in samples), and reading it
    before the last step read and discarded the rest of its epoch (16 samples per rank beside 100,000: 99,984 of them,
    each epoch, also moving a stateful loader's ``state_dict`` in a checkpoint of that step to the epoch's end).

    ``steps_done`` (set by the strategy): the epoch's steps Lightning counts as trained when a pass starts, nonzero in a
    fit resumed mid-epoch, where Lightning pulls only the rest of ``__len__``. A pass counts its steps from there, so
    the last counted step is the epoch's: counted from 0, the pass never reached it, so no read-ahead ran, and a
    stateful loader resumed in place (its rows two of each sample) trained one step of the rest and ended the fit
    without a word, where the fit run through refused them. (A loader that replays from its start reads the rest of
    the epoch once at that step.)

    ``record_states`` (set by the strategy for a stateful loader of a known batch size where a step is no whole number
    of its batches, or the loader has no length: it costs a ``state_dict()`` per loader batch): a step that is no whole
    number of the loader's batches ends inside one, so the state a mid-epoch checkpoint stores is the one before that
    batch, and the strategy stores how many of its samples the steps trained (:meth:`resume_record`); ``skip`` (set where
    a fit resumes from such a checkpoint): those samples, left out of the resumed pass's first batch (:meth:`_states_kept`).
    """

    shortfall: int | None = None
    steps_done: Callable[[], int] | None = None
    _steps: int | None = None  # the epoch's steps the ranks agreed on (None: none agreed, or agreed step by step alone)
    _spread: tuple[int, int] | None = None  # the fewest and most samples per epoch of the ranks' loaders, where they differ
    record_states = False  # set by the strategy: a stateful loader's state is held per step (see _states_kept)
    skip = 0  # set by the strategy: samples of the next pass's first loader batch that a resumed checkpoint's step trained
    _inside: int | None = None  # samples of the loader batch after the held state that the last step yielded trained
    _loaded: Any = None  # the state Lightning restored into the loader (the one before a resumed pass's first batch)
    _lag = False  # Lightning pulls a step ahead of the one it trains (no length, no integer limit): held a step later
    _ahead: tuple[int, int] | None = None  # where the step pulled ahead ends (whole loader batches, samples inside the next)
    _OWN = _MicroBatchLoader._OWN | {"shortfall", "steps_done", "_steps", "_spread", "record_states", "skip", "_inside", "_loaded",
                                     "_lag", "_ahead"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.agree is None:
            return
        failed = kwargs.get("failed")
        if failed is not None:  # this rank's set-up raised reading the loader (Rechunking.wrap): raised on every rank here,
            self.agree(-1, failed)  # its samples not read (their length raised again, chained to the first, seen twice)
        try:
            samples = self._samples()
        except TypeError:
            samples = -1  # unknown on this rank: the ranks agree step by step
        except Exception as failure:  # (a __len__ raising on this rank alone: the others waited in the agreement)
            # raises it on every rank: here as it was raised, there as _told_elsewhere says
            _tell_every_rank(functools.partial(self.agree, -1, failure), failure)
            raise
        largest, smallest = self.agree(samples)
        if smallest >= 0:
            self._steps = smallest // self.micro_batch_size
            self._spread = (smallest, largest) if largest != smallest else None

    def _iterate(self, batches: Iterator[Any], limit: int | None) -> Iterator[Any]:
        m = self.micro_batch_size
        agreed = self._steps
        if self._spread is not None and agreed is not None:
            # (not the shortfall: each rank's is of its own samples, and rank 0 alone would say its own for every replica)
            smallest, largest = self._spread
            self._warn_once(
                "replicas", f"auto_plan: the ranks' train loaders hold from {smallest} to {largest} samples per epoch, and the "
                f"replicas' gradient all-reduce meets at every step, so every replica stops after the {agreed} pipeline "
                f"steps of {m} samples the fewest fill, skipping up to {largest - agreed * m} samples per epoch (give every "
                "replica as many samples, e.g. Lightning's DistributedSampler, to train them all)."
            )
        elif self.shortfall and limit is None:
            self._warn_once(
                "shortfall", f"auto_plan: the epoch's last {self.shortfall} samples per replica do not fill a pipeline step of "
                f"{m} samples and are skipped (a run of your loader under DDP trains them)."
            )
        # several replicas of their own data agree before every step: whether every rank has a full one (no count agreed,
        # or a stream's, whose length may overstate what it yields), and whether one could not read its batch
        each_step = self.agree
        dropped = 0
        # the epoch's steps so far: a resumed epoch's pass starts where its checkpoint was saved (Lightning pulls the rest)
        steps = 0 if self.steps_done is None else self.steps_done()
        room = self._counted_room(limit, None)
        counted = agreed if agreed is not None or room is None else room[0] // m  # the steps Lightning pulls (__len__)
        # read ahead only where this rank's own samples end the epoch at the counted steps: on a rank with more (the
        # fewest set the agreed steps) the rest is skipped anyway, said as the spread, and reading it cost its epoch
        ahead = counted if room is not None and counted is not None and room[0] // m == counted else None
        if ahead is None and agreed is not None and room is not None:  # a replica with more samples than the fewest
            batches = self._drawn_rows(batches, agreed)
        skip, self.skip = self.skip, 0
        if skip or self.record_states:
            batches = self._states_kept(batches, skip)
        # Lightning pulls one step ahead of the one it trains where the loader has no length and no integer
        # limit_train_batches counts its steps (its fetcher prefetches to tell the epoch's last batch): a checkpoint after
        # a step then holds the state the step before the last yielded set
        self._lag = sized_len(self) is None and self._limit_batches is None
        cut = _rebatch_pieces(batches, m, room=room, counted_by=("auto_plan's pipeline", "pipeline steps"))
        pieces: tuple[Any, ...] = ()
        while agreed is None or steps < agreed:  # the steps the ranks agreed on (warned above, where a rank has more): none pulled past them
            try:
                batch, pieces = next(cut, (None, ()))
                n = 0 if batch is None else _batch_n(batch)
                if n == m and steps + 1 == ahead:
                    # Lightning pulls no batch after this step's: the rest of the epoch's (their rows held to the count)
                    for _ in cut:
                        pass
            except Exception as failure:  # maybe on this rank alone (its own data): the others wait at the agreement
                if each_step is None:  # (a KeyboardInterrupt is not carried: this rank stops at once)
                    raise
                # raises it on every rank: here as it was raised, there as _told_elsewhere says
                _tell_every_rank(functools.partial(each_step, 0, failure), failure)
                raise
            if n != m:
                dropped += n  # the short last one, or none
                break
            if each_step is not None and each_step(1)[1] == 0:
                self._warn_once("ended", "auto_plan: another replica's train loader ended before this one's; this replica "
                                "stops with it (their gradient all-reduce meets at every step), skipping the rest of its epoch.",
                                any_rank=True)
                return
            steps += 1
            self._hold_state_before(pieces[-1], skip)
            yield batch
        if each_step is not None:
            each_step(0)  # this rank has no further step: the others stop at their next
        # unknown before the epoch, or a stream's said from its length, which need not be what it yields (shorter, a
        # shortfall of 0 had said nothing, and its skipped samples went unsaid)
        if dropped and limit is None and (self.shortfall is None or self._stream and dropped != self.shortfall):
            why = "the loader's length is unknown" if self.shortfall is None else "its stream yielded fewer samples than its length"
            self._warn_once(
                "dropped", f"auto_plan: the epoch's last {dropped} samples of this replica did not fill a pipeline step of "
                f"{m} samples and were skipped ({why}, so this could not be said before)."
            )

    def _states_kept(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        """``batches`` without the first ``skip`` samples of the first (a resumed checkpoint's step trained them), keeping
        a stateful loader's state after each one (and the state Lightning restored, the one before the first).

        A pipeline step of ``m`` samples that is no whole number of the loader's batches ends inside one, whose rest goes
        to the next step, so the loader's own state after the step (what Lightning saves in a mid-epoch checkpoint) is
        past samples no step trained yet: resumed from it, the fit skipped them. A checkpoint stores the state before
        that batch instead (:meth:`_hold_state_before`), and how many of its samples the step trained
        (:meth:`resume_record`), which the resumed pass skips here."""
        self._states = {} if self._loaded is None else {-1: self._loaded}
        self._loaded, self._inside, self._ahead = None, None, None
        for i, batch in enumerate(batches):
            if i == 0 and skip:
                n = _batch_n(batch)
                if skip >= n:
                    raise InfeasiblePlanError(
                        f"The resumed checkpoint's step trained {skip} samples of the loader batch after its saved state, and "
                        f"the loader's first batch now holds {n}, so the resumed epoch cannot start where the checkpoint's did.",
                        hint="Resume with the loader (and its batch size) the checkpoint was saved with.",
                    )
                batch = slice_samples(batch, skip, n, n)
            self._states[i] = self._loader.state_dict()
            yield batch
        self._held, self._exhausted = None, True  # all pulled: a checkpoint stores the loader's own state (the epoch's end)

    def _hold_state_before(self, last: Piece, skip: int) -> None:
        """The step just yielded ends with ``last``'s samples: a checkpoint stores the loader's state after the last loader
        batch the steps so far trained whole, and (:meth:`resume_record`) how many samples of the next one they trained.
        Where that is the pass's first batch of a fresh epoch, no state before it is held (a loader's state before its
        first batch may still be the previous epoch's end): the record says so, and that resume is refused."""
        if self._states is None or self._exhausted:
            return
        i, n, _, end, _ = last
        whole, inside = (i, 0) if end == n else (i - 1, end + (skip if i == 0 else 0))
        if self._lag:  # (see _iterate) the previous step's, held once Lightning pulled this one
            (whole, inside), self._ahead = self._ahead or (None, None), (whole, inside)
            if whole is None:
                return
        self._inside = inside
        self._held = self._states.get(whole)
        for index in [k for k in self._states if k < whole]:
            del self._states[index]

    def resume_record(self) -> tuple[int, bool] | None:
        """For a checkpoint saved now: the samples of the loader batch after the state it stores that the last step
        trained, and whether that state is the one before that batch (False: the epoch's first batch of a fresh pass,
        whose state before it is not known); None where no state is held (not recorded, or the epoch's batches all pulled)."""
        if self._states is None or self._exhausted or self._inside is None:
            return None
        return self._inside, self._held is not None

    def _drawn_rows(self, batches: Iterator[Any], agreed: int) -> Iterator[Any]:
        """``batches`` of a replica with more samples than the fewest, which stops after the ``agreed`` steps and reads
        no further (no read-ahead): their rows are held to the samples its batch sampler draws, where it is torch's
        ``BatchSampler`` (at most ``batch_size`` each). What it skips is counted in the sampler's samples (the spread),
        so where a ``collate_fn`` made two rows of each, the rows it skipped went unsaid (16 samples, 32 rows, beside
        14 in steps of 8: said 8 skipped, 24 rows skipped), where a replica of the fewest samples, reading ahead, is
        refused (:func:`~lightning_distplan.strategies.dp_ga._cut_short`). A batch sampler of its own sizes is not
        checked (its batch size need not bound its batches)."""
        sampler = getattr(self._loader, "batch_sampler", None)
        if type(sampler) is not BatchSampler:
            yield from batches
            return
        draws, m = sampler.batch_size, self.micro_batch_size
        for batch in batches:
            try:
                n = find_batch_size(batch)
            except Exception:  # (an unreadable batch: refused as it is cut, with its own error)
                n = None
            if n is not None and n > draws:
                raise InfeasiblePlanError(
                    f"A batch of this replica's train loader holds {n} samples where its batch sampler draws at most {draws}, "
                    f"and auto_plan's pipeline counts in the sampler's samples what this replica skips beyond the {agreed} "
                    f"pipeline steps of {m} the replicas' fewest samples fill, so it would skip more than it says (DDP trains them).",
                    hint="Use a collate_fn (and batch sampler) making one row of each of the sampler's samples, or strategy='ddp'.",
                )
            yield batch

    def _counted_room(self, limit: int | None, expected: int | None) -> Room | None:
        """The samples :meth:`__len__` counted this pass's steps from, as dp_ga's room
        (:data:`~lightning_distplan.strategies.dp_ga.Room`): the loader's batches as full ones under a limit of them or
        where they drop the short last one (:func:`_samples_per_epoch`), else the samples its sampler (or dataset)
        holds. A short last step is skipped (said as the shortfall), so the room is the samples, not the steps'
        places. None: not counted."""
        batches = sized_len(self._loader)
        try:
            samples = self._samples()
        except TypeError:
            return None
        if batches is None:
            return None
        limited = limit is not None and limit < batches
        batch = loader_batch_size(self._loader) if limited or loader_sampler(self._loader)[1] else None
        return samples, batches if limit is None else min(batches, limit), batch, samples

    def __len__(self) -> int:
        return self._steps if self._steps is not None else self._samples() // self.micro_batch_size

    def __getattr__(self, name: str) -> Any:
        if name == "load_state_dict" and self.record_states:  # (only where the loader has one: Lightning tells by the attribute)
            own = getattr(self._loader, name)

            def load_state_dict(state: Any) -> Any:
                self._loaded = state  # the state before the resumed pass's first batch (_states_kept)
                return own(state)

            return load_state_dict
        return super().__getattr__(name)


_EVAL_PREFIXES = ("val", "test", "predict")

RESUME_KEY = "distplan_pipeline_resume"
"""Checkpoint key of auto_plan's pipeline with a stateful train loader, mid-epoch: where the epoch's last step ended, for
a fit resumed from it to train what the fit run through trains (:meth:`_AutoPipelineStrategy._resumed_inside_a_batch`):
``per_replica`` and ``loader_batch`` (the step's samples and the loader's batch size it was saved with),
``samples_inside`` (samples the steps trained of the loader batch after the loader's state stored), ``state_before``
(whether that state is the one before that batch) and ``progress`` (the epoch's batch progress in steps, exact, where
the one stored in the user's loader batches rounds)."""


class _AutoPipelineStrategy(PipelineStrategy):
    """:class:`PipelineStrategy` fed ``m·n`` samples per replica and step from the user's loader."""

    def __init__(self, *, plan: Plan, user_accumulate: int, **kwargs: Any) -> None:
        super().__init__(plan=plan, **kwargs)
        self._auto_plan = plan
        self._rechunk = Rechunking()
        self._user_eval_limits: dict[str, Any] = {}
        self.later_fits = _LaterFits(plan, user_accumulate)
        self._frequencies: list[tuple[Any, int]] = []  # (scheduler config, the user's frequency) changed for this fit
        self.resumed_record: Any = None  # set by auto_plan: the resumed checkpoint's RESUME_KEY (_resumed_inside_a_batch)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.later_fits.setup(trainer)
        # One schedule (n micro-batches) is one optimizer step; the accumulation is in the schedule.
        trainer.accumulate_grad_batches = 1
        self._rechunk.remember(trainer)
        self._user_eval_limits = {p: getattr(trainer, f"limit_{p}_batches") for p in _EVAL_PREFIXES}
        super().setup(trainer)
        self._frequencies = step_frequencies(self.lr_scheduler_configs)
        self._count_scheduler_frequencies_in_steps(self.later_fits.user_accumulate)

    @override
    def _first_micro_batch_rows(self, rows: int, *, fitting: bool) -> int:
        # a fit's batches are the user's re-chunked into the plan's m·n samples per replica (process_dataloader)
        return self._auto_plan.micro_batch_size if fitting else super()._first_micro_batch_rows(rows, fitting=fitting)

    def _count_scheduler_frequencies_in_steps(self, per_step: Any) -> None:
        """A scheduler with ``interval="step"`` and ``frequency`` f steps where the user's run steps it.

        Lightning steps it when ``(batch_idx + 1) % f == 0``, ``batch_idx`` counting the epoch's batches: the user's
        loader batches under DDP (and under a dp_ga plan, which steers it so), where optimizer step j ends with batch
        ``j·k`` (``k``: the loader batches of one process one step holds, their ``accumulate_grad_batches`` unless
        ``global_batch_size`` was given), but optimizer steps here (one batch is one step). ``j·k`` is a multiple of f
        exactly when j is a multiple of ``f / gcd(k, f)``. Set from the user's frequencies, so a loader processed
        again sets the same; :meth:`teardown` puts the user's back. A fractional ``k`` (a given global batch that
        is no whole number of loader batches per process) keeps what the setup set.
        """
        if not _is_count(per_step) or per_step < 1:
            return
        for config, frequency in self._frequencies:
            config.frequency = frequency // math.gcd(per_step, frequency)

    def _count_eval_limit_per_replica(self, trainer: pl.Trainer, prefix: str) -> None:
        """An integer ``limit_val_batches`` (test, predict) counts one process's loader batches under DDP, where every
        process reads a shard of its own; a pipeline's stages read their replica's shard together, so the same
        samples are ``pp`` times as many of the replica's batches (set before Lightning reads the limit)."""
        user = self._user_eval_limits.get(prefix)
        if _is_count(user) and user > 0:
            setattr(trainer, f"limit_{prefix}_batches", user * self._auto_plan.pp)

    def _resumed_inside_a_batch(
        self, trainer: pl.Trainer, dataloader: object, per_replica: int
    ) -> tuple[InfeasiblePlanError | None, dict[str, Any] | None]:
        """Where a fit resumes mid-epoch with a stateful loader (Lightning restores its ``state_dict``): the checkpoint's
        :data:`RESUME_KEY` record to resume it exactly by, or the refusal where a step of ``per_replica`` samples is no
        whole number of the loader's batches and no record fits; (None, None) elsewhere.

        Such a step ends inside a loader batch whose rest the next step trains, and the checkpoint counts the epoch's
        progress in the user's loader batches, rounded: resumed from the loader's own state after that batch (loader
        batches of 3 in steps of 8, dp=1 pp=2, after step 1), the fit trained samples 9-16 and ended the epoch at the
        short rest, sample 8 and 17-23 never trained (the fit run through trains 8-15 and 16-23), without a word. So a
        checkpoint saved here stores the loader's state before that batch, how many of its samples the steps trained and
        the epoch's progress in steps (:meth:`_resume_record`); resumed with the same steps and loader batch, that
        progress is restored and those samples skipped (:meth:`_FullBatchLoader._states_kept`). Refused (on every rank at
        the loader's set-up agreement, :meth:`Rechunking.wrap`'s ``refusal``, before any step): a checkpoint without
        that record (saved by another strategy or plan), of other steps or loader batches, or whose step ended inside
        the epoch's first loader batch, whose state before it the loader does not give."""
        rechunk = self._rechunk
        b = loader_batch_size(dataloader)
        if not b or not isinstance(dataloader, _Stateful):
            return None, None
        if not rechunk._resumed or rechunk._saved_at_epoch_end or not rechunk._loops_restored(trainer):
            return None, None
        record = self.resumed_record
        if isinstance(record, dict) and record.get("per_replica") == per_replica and record.get("loader_batch") == b:
            if record.get("state_before"):
                return None, record
            why = (f"its checkpoint's step ended inside the epoch's first loader batch ({record.get('samples_inside')} samples "
                   "into it), whose state before it the loader does not give")
        elif per_replica % b == 0:
            return None, None
        else:
            # the checkpoint's count (rounded down: a step of 6 samples in loader batches of 8 counts 0 of them, its
            # ``completed`` one below its ``processed`` where it was saved at a batch's end) as Lightning restored it
            progress = trainer.fit_loop.epoch_loop.batch_progress
            done, n = progress.current.ready, sized_len(dataloader)
            if not (done or progress.current.processed > progress.current.completed):  # at the epoch's start
                return None, None
            if progress.is_last_batch or n is not None and done >= n:  # at its end: the next epoch starts whole
                return None, None
            why = ("its checkpoint does not record where inside a loader batch its last step ended (saved by another strategy "
                   "or plan, or by an earlier version of this package)" if not isinstance(record, dict) else
                   f"its checkpoint was saved with steps of {record.get('per_replica')} samples in loader batches of "
                   f"{record.get('loader_batch')}")
        return InfeasiblePlanError(
            f"This fit resumes mid-epoch with a stateful train loader whose batches of {b} do not hold auto_plan's pipeline "
            f"steps of {per_replica} samples per replica whole, and {why}, so the resumed epoch would skip samples a run of "
            "your loader trains.",
            hint=f"Resume from a checkpoint saved at an epoch's end, or mid-epoch by this plan after the epoch's first loader "
                 f"batch, or use a global_batch_size whose steps hold whole loader batches (a multiple of {b} samples per replica).",
        ), None

    def _resume_record(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """What a checkpoint saved now stores under :data:`RESUME_KEY` (read in :meth:`_resumed_inside_a_batch`), None
        where the train loader holds no state per step (not stateful, not re-chunked, or its epoch's batches all pulled)."""
        loader = self._rechunk._loader
        held = loader.resume_record() if isinstance(loader, _FullBatchLoader) else None
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if held is None or not isinstance(progress, dict):
            return None
        plan = self._auto_plan
        return {"per_replica": plan.micro_batch_size * plan.n_microbatches, "loader_batch": self._rechunk._loader_batch,
                "samples_inside": held[0], "state_before": held[1], "progress": copy.deepcopy(progress)}

    @override
    def _agree_on_train_loader(self, trainer: pl.Trainer, dataloader: object) -> None:
        """Nothing here: :meth:`Rechunking.wrap` (:meth:`process_dataloader`) ends the set-up in that agreement, once,
        on the loader Lightning gets (the re-chunked one, or the user's where it runs as it is)."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            if trainer.state.stage is not None and trainer.state.stage.dataloader_prefix in _EVAL_PREFIXES:
                # before the pipeline's agreement on the evaluation batches (PipelineStrategy.process_dataloader), which counts under it
                self._count_eval_limit_per_replica(trainer, trainer.state.stage.dataloader_prefix)
            return super().process_dataloader(dataloader)
        dataloader = super().process_dataloader(dataloader)
        refusal = None
        try:
            self.later_fits.check_loader(dataloader, self.world_size)
        except InfeasiblePlanError as refused:  # maybe of one rank's loader alone: raised on every rank where the set-up agrees
            refusal = refused
        trainer.accumulate_grad_batches = 1
        plan = self._auto_plan
        per_replica = plan.micro_batch_size * plan.n_microbatches
        inside, record = self._resumed_inside_a_batch(trainer, dataloader, per_replica)
        wrapped = self._rechunk.wrap(trainer, dataloader, per_replica, cls=_FullBatchLoader, replica_share=plan.pp, refusal=refusal or inside,
                                     stages=(self.layout.replica, self.layout.dp) if plan.pp > 1 else None)
        # one step holds this many of one process's loader batches: the user's accumulation, or what a given
        # global_batch_size makes of it (a dp_ga plan counts the scheduler's frequency in those loader batches too)
        per_step = self._rechunk._per_user_batch
        if per_step is not None and per_step.denominator == 1:
            self._count_scheduler_frequencies_in_steps(int(per_step))
        if isinstance(wrapped, _FullBatchLoader):
            wrapped.shortfall = loader_shortfall(dataloader, plan, sharded=True)
            # read as each pass starts (a fit resumed mid-epoch has trained some of its steps)
            wrapped.steps_done = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.ready
            # a stateful loader's state after each loader batch, kept where a step can end inside one, or Lightning pulls a
            # step ahead (no length, no integer limit_train_batches: _FullBatchLoader._lag): elsewhere the loader's own
            # state after the step is where it ended (as before)
            b = loader_batch_size(dataloader)
            ahead = sized_len(wrapped) is None and wrapped._limit_batches is None
            wrapped.record_states = bool(isinstance(dataloader, _Stateful) and b and (per_replica % b or ahead))
            if record is not None:  # resumed exactly where the checkpoint's step ended (_resumed_inside_a_batch)
                self.resumed_record = None
                progress = copy.deepcopy(record["progress"])
                trainer.fit_loop.epoch_loop.batch_progress.load_state_dict(progress)
                steps = sized_len(wrapped)
                if steps is None or progress["current"]["processed"] < steps:  # (at the epoch's last step the next starts whole)
                    wrapped.skip = int(record["samples_inside"])
        return wrapped

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # a loader set up before Lightning restored a resumed fit's loops (estimated_stepping_batches) is set up again,
        # so that the checkpoint's progress is counted in this plan's steps
        self._rechunk.reload_resumed()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        record = self._resume_record(checkpoint)  # (before the progress is counted in the user's loader batches)
        self._rechunk.progress_to_user_units(checkpoint)  # a mid-epoch checkpoint resumes any plan or strategy at its place
        if record is not None:
            checkpoint[RESUME_KEY] = record
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        super().teardown()
        if module is not None and module._trainer is not None:
            module.trainer.accumulate_grad_batches = self.later_fits.user_accumulate
            self._rechunk.restore(module.trainer)
            restore_frequencies(self._frequencies)
            self._frequencies = []
            for prefix, value in self._user_eval_limits.items():
                setattr(module.trainer, f"limit_{prefix}_batches", value)


def loader_shortfall(dataloader: object, plan: Plan, *, sharded: bool, distributed_sampler: bool = True,
                     spread: tuple[int, int] | None = None) -> int | None:
    """:func:`pipeline_shortfall` of a pipeline ``plan`` for the user's train loader, or None where its length is unknown;
    ``sharded``: as Lightning set it up for the fit (its sampler a shard of the dataset), else the user's own, which
    Lightning shards (a ``DistributedSampler`` of its own) where ``distributed_sampler`` (the Trainer's
    ``use_distributed_sampler``) and the loader has no ``DistributedSampler`` already and is not an IterableDataset (its
    ``_requires_distributed_sampler``); else it will be its rank's own data as it is.

    Set up for the fit without a ``DistributedSampler`` (``use_distributed_sampler=False``, an IterableDataset), the
    loader is its rank's own data, not a shard of a dataset every rank holds: DDP trains each process's loader whole, and
    a replica whose stages read it trains its whole steps, so the shortfall is its samples per epoch beyond those. (Read
    as a dataset to shard, it was a wrong figure, 2 for 20 samples per rank in steps of 8 on 2 replicas of 2 stages,
    or none where the sampler does not name its dataset, the samples skipped unsaid. Replicas whose loaders hold
    different numbers: :class:`_FullBatchLoader` says their spread.)

    ``spread`` (planning: the fewest and most samples per epoch of the plan's replicas' loaders, :func:`samples_per_rank`): read as
    each rank's own data, every replica stops after the steps the fewest fill (:class:`_FullBatchLoader`), so the
    figure is the most beyond those, not rank 0's own remainder (16 and 14 samples per rank in steps of 8: 8, not 0)."""
    b = loader_batch_size(dataloader)
    sampler, drop_last = loader_sampler(dataloader)
    if sharded:
        own = not isinstance(sampler, DistributedSampler)
    else:  # planning, before the fit's loader is set up (rank 0's: the replicas' may differ, see _FullBatchLoader)
        own = (not distributed_sampler or isinstance(sampler, DistributedSampler)
               or isinstance(getattr(dataloader, "dataset", None), IterableDataset))
    step = plan.micro_batch_size * plan.n_microbatches
    if own and spread is not None:
        smallest, largest = spread
        return largest - smallest // step * step
    if own:
        samples = _samples_per_epoch(dataloader)
        return None if samples is None else samples % step
    try:
        n = len(getattr(sampler, "dataset", None) if sharded else sampler)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):  # no length, as Lightning reads it (sized_len)
        return None
    if b is None or drop_last is None:
        return None
    return pipeline_shortfall(n, b, bool(drop_last), world=plan.world_size, dp=plan.dp, step=step)


def samples_per_rank(device: Any, dataloader: object) -> tuple[int, ...] | None:
    """Each rank's samples per epoch of its train loader (``dataloader``), in global rank order, None where a rank's are
    unknown: one all-reduce of a slot per rank (and a failure flag) on ``device``, which every rank calls. Planning
    reads rank 0's loader only, and where each rank reads its own data a pipeline's replicas stop after the steps the
    fewest fill (:func:`loader_shortfall`), while the stages of one replica must read the same data: the ranks a plan
    puts in one replica holding different numbers rule that plan out (:func:`~lightning_distplan.strategies.auto_plan.replicas_of_other_data_last`). The
    fewest and most alone (an all-reduce of three integers, as it was) could not tell which ranks differ: 16 and 12
    samples on the one replica of 2 ranks were said to make its pipeline "skip up to the epoch's last 8 samples per
    replica", where its stages cannot run together at all. An error reading a rank's lengths (a ``__len__`` raising other than TypeError,
    maybe on that rank alone) rides the same all-reduce: every rank raises it (that rank its own, the others a
    RuntimeError naming it), none waits."""
    try:
        samples = _samples_per_epoch(dataloader)
    except Exception as failure:  # (a __len__ raising on this rank alone: the others waited in the all-reduce)
        # raises it on every rank: here as it was raised, there as _told_elsewhere says
        _tell_every_rank(functools.partial(_ranks_counts, device, -1, failure), failure)
        raise
    counts = _ranks_counts(device, -1 if samples is None else samples)
    return None if min(counts) < 0 else counts


def _ranks_counts(device: Any, n: int, failure: Exception | None = None) -> tuple[int, ...]:
    """Every rank's ``n`` (at least -1), by one MAX all-reduce of a slot per rank (the others' -2) and whether a rank
    failed; where one did, every rank raises the lowest such rank's error, as :func:`~lightning_distplan.strategies.dp_ga._agreed_batch_sizes` does."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    slots = torch.full((world + 1,), -2, dtype=torch.int64, device=device)
    slots[rank], slots[world] = n, int(failure is not None)
    torch.distributed.all_reduce(slots, op=torch.distributed.ReduceOp.MAX)
    *counts, failed = slots.tolist()
    if failed:
        raise_on_every_rank(failure, doing="reading its train loader", device=device, sent=_told_elsewhere)
    return tuple(counts)


def build_concrete(
    auto: DDPStrategy,
    plan: Plan,
    *,
    user_accumulate: int,
    ddp_kwargs: dict[str, Any],
    pipeline_kwargs: dict[str, Any],
) -> Strategy:
    """The strategy that runs ``plan``, sharing ``auto``'s accelerator, devices, cluster environment,
    checkpoint IO, precision plugin, launcher and (already initialised) process group."""
    common: dict[str, Any] = dict(
        accelerator=auto.accelerator,
        parallel_devices=auto.parallel_devices,
        cluster_environment=auto.cluster_environment,
        checkpoint_io=auto.checkpoint_io,
        precision_plugin=auto.precision_plugin,
        process_group_backend=auto._process_group_backend,
        timeout=auto._timeout,
        start_method=auto._start_method,
    )
    concrete: DDPStrategy
    if plan.strategy == "dp_ga":
        concrete = _AutoDPGAStrategy(plan=plan, user_accumulate=user_accumulate, **common, **ddp_kwargs)
    else:
        concrete = _AutoPipelineStrategy(plan=plan, user_accumulate=user_accumulate, **common, **pipeline_kwargs)
    concrete.num_nodes = auto.num_nodes
    concrete._layer_sync = auto._layer_sync
    concrete._launcher = auto._launcher  # the processes are already launched: keep the launcher that did it
    concrete.set_world_ranks()
    assert auto.lightning_module is not None
    concrete.connect(auto.lightning_module)
    return concrete
