"""Profile → plan → record, inside a running ``Trainer.fit`` (shared by ``auto_plan`` and ``PlanningCallback``).

Plain module-level functions over a Trainer and plain data, so the Lightning adapters
(:class:`~lightning_distplan.strategies.auto_plan.AutoPlanStrategy`,
:class:`~lightning_distplan.callbacks.PlanningCallback`) stay thin.

"Profiling leaves no trace" (DESIGN §3.3) is kept here at the Trainer level: the profiler itself
restores weights, optimizer state and RNG streams; :func:`profile_in_fit` additionally draws its
batches from a *fresh* instance of the user's train loader (the loader the fit loop iterates is
created later, so its position is untouched), snapshots all RNG streams around that, and
snapshots and restores every progress counter of the fit loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from lightning.pytorch.utilities import rank_zero_info

from lightning_distplan._files import write_text_atomic
from lightning_distplan.costmodel import Hardware
from lightning_distplan._format import format_ms
from lightning_distplan.costmodel._hardware import format_bytes
from lightning_distplan.errors import InfeasiblePlanError, OutputPathError
from lightning_distplan.plan import STRATEGIES, Plan, as_indices, as_int
from lightning_distplan.planner import Candidate, closest_to_fitting, explain, rank_plans, satisfies_pins
from lightning_distplan.profile import unsplittable

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

    from lightning_distplan.profile import Profile

__all__ = [
    "PlanningOutcome",
    "check_artifact_dir",
    "TrainerCounters",
    "fresh_train_loader",
    "user_global_batch",
    "profile_in_fit",
    "choose_plan",
    "write_artifacts",
    "pins_from",
    "distplan_dir",
    "in_fit_micro_batch_sizes",
    "link_sizes",
    "faster_alternative",
    "describe_for_user",
    "plan_record",
    "log_outcome",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlanningOutcome:
    """What planning decided, with what it was based on."""

    plan: Plan
    """The plan to run."""
    candidates: tuple[Candidate, ...] = ()
    """All ranked candidates (best first); empty when the plan came from a checkpoint."""
    hardware: Hardware | None = None
    """The hardware the candidates were priced on."""
    source: str = "profiled"
    """``"profiled"`` (measured now), ``"checkpoint"`` (stored plan reused) or ``"pinned"``."""
    profiling_s: float = 0.0
    """Seconds spent profiling (0 when reused)."""
    planning_s: float = 0.0
    """Seconds spent ranking plans."""
    unused_parameters: tuple[str, ...] = ()
    """Trainable parameters the profiled steps' loss gave no gradient (or the checkpoint's plan recorded)."""

    @property
    def prediction(self) -> Any:
        """The cost model's prediction for :attr:`plan` (None when the plan was not priced)."""
        for c in self.candidates:
            if c.plan == self.plan:
                return c.prediction
        return None

    @property
    def overhead_s(self) -> float:
        return self.profiling_s + self.planning_s


def distplan_dir(trainer: pl.Trainer) -> Path:
    """``<trainer.default_root_dir>/distplan`` (DESIGN §5)."""
    return Path(trainer.default_root_dir) / "distplan"


def check_artifact_dir(trainer: pl.Trainer, who: str) -> None:
    """Collective: refuse on every rank, before minutes of profiling, a fit whose ``plan.json`` global rank 0 could not
    write (:func:`distplan_dir` under a file, or not writable). Found at the write, it failed rank 0 alone with a
    bare ``FileExistsError`` after the profiling, and the other ranks with their peer gone."""
    from lightning_distplan._files import check_output_path

    problem: OutputPathError | None = None
    if trainer.is_global_zero:
        try:
            check_output_path(
                distplan_dir(trainer) / "plan.json",
                f"{who}'s plan file",
                hint=f"Set Trainer(default_root_dir=...) to a writable folder: {who} writes profile.json and plan.json in its distplan/.",
            )
        except OutputPathError as err:
            problem = err
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise problem


# -- trainer state ----------------------------------------------------------------------------------
@dataclass
class TrainerCounters:
    """Every progress counter of the fit loop plus the trainer fields planning could touch."""

    progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict, repr=False)
    accumulate_grad_batches: int = 1
    batches_that_stepped: int = 0
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    loader_state: dict[str, Any] = field(default_factory=dict, repr=False)

    # The fit loop's train-loader state: ``configure_optimizers`` reading ``trainer.estimated_stepping_batches``
    # (Lightning's way to size OneCycleLR) makes the fit loop build and cache the loader while we profile,
    # before the plan re-chunks it; restored, the loop builds it again afterwards, through the plan.
    _LOADER_FIELDS = ("_combined_loader", "_data_fetcher", "max_batches", "_last_train_dl_reload_epoch", "_combined_loader_states_to_load")

    @classmethod
    def take(cls, trainer: pl.Trainer) -> TrainerCounters:
        import copy

        objects = dict(_progress_objects(trainer.fit_loop, "fit_loop"))
        return cls(
            progress={name: copy.deepcopy(obj.state_dict()) for name, obj in objects.items()},
            objects=objects,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            batches_that_stepped=trainer.fit_loop.epoch_loop._batches_that_stepped,
            callback_metrics=dict(trainer.callback_metrics),
            loader_state={k: getattr(trainer.fit_loop, k) for k in cls._LOADER_FIELDS if hasattr(trainer.fit_loop, k)},
        )

    def restore(self, trainer: pl.Trainer) -> None:
        for name, obj in self.objects.items():
            obj.load_state_dict(self.progress[name])
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and fetcher is not self.loader_state.get("_data_fetcher"):
            fetcher.teardown()  # one built while we profiled: let its loader's workers go now
        for key, value in self.loader_state.items():
            setattr(trainer.fit_loop, key, value)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        trainer.fit_loop.epoch_loop._batches_that_stepped = self.batches_that_stepped

    def comparable(self) -> dict[str, Any]:
        return {
            "progress": self.progress,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "batches_that_stepped": self.batches_that_stepped,
            "callback_metrics": sorted(self.callback_metrics),
        }


def _progress_objects(loop: Any, prefix: str, seen: set[int] | None = None) -> list[tuple[str, Any]]:
    """(dotted name, progress tracker) of ``loop`` and its child loops, found by walking attributes."""
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress

    seen = set() if seen is None else seen
    if id(loop) in seen:
        return []
    seen.add(id(loop))
    out: list[tuple[str, Any]] = []
    for name, value in sorted(vars(loop).items()):
        if isinstance(value, _BaseProgress):
            out.append((f"{prefix}.{name}", value))
        elif isinstance(value, _Loop) or type(value).__name__ in ("_AutomaticOptimization", "_ManualOptimization"):
            out += _progress_objects(value, f"{prefix}.{name}", seen)
    return out


def trains_nothing(trainer: pl.Trainer, checkpoint: Mapping[str, Any] | None = None) -> str | None:
    """Why this fit will train no batch, as Lightning's fit loop decides before its first (``_FitLoop.skip``:
    ``max_steps`` or ``max_epochs`` reached, 0 in a new fit, or ``limit_train_batches=0``), e.g. ``"max_epochs=0"``;
    None when it trains. Profiling such a fit spends seconds to minutes on a plan that never runs.

    ``checkpoint``: the one this fit resumes from (``ckpt_path=``), whose progress Lightning restores only after the
    strategy's setup, where the plan is made: a fit resumed from the end of its last epoch trains nothing either."""
    loop = trainer.fit_loop
    steps, epochs = trainer.global_step, loop.epoch_progress.current.processed
    if checkpoint is not None:
        steps = checkpoint.get("global_step", steps)
        with contextlib.suppress(KeyError, TypeError):
            epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
    for name, done, limit in (("max_steps", steps, loop.max_steps), ("max_epochs", epochs, loop.max_epochs)):
        if isinstance(limit, int) and limit != -1 and done >= limit:  # Lightning's _is_max_limit_reached
            return f"{name}={limit}"
    if trainer.limit_train_batches == 0:
        return f"limit_train_batches={trainer.limit_train_batches!r}"
    return None


# -- data ----------------------------------------------------------------------------------------------
def fresh_train_loader(trainer: pl.Trainer) -> Any:
    """A new instance of the user's train loader (datamodule or module hook), never the fit loop's.

    Raises:
        InfeasiblePlanError: there is no train dataloader to profile with, or several (a dict, list or
            ``CombinedLoader``: ``training_step`` gets their combined batch).
    """
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    from lightning_distplan.profiling._batches import refuse_several_loaders

    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise InfeasiblePlanError(
            "There is no train dataloader to profile the model with.",
            hint="Pass train_dataloaders= or a datamodule to trainer.fit, or define train_dataloader().",
        )
    loader = _request_dataloader(source)
    refuse_several_loaders(loader, hint="Pass one train DataLoader, or use strategy='ddp' (without PlanningCallback), which runs your loaders as they are.")
    return loader


def user_global_batch(*, loader_batch: int | None, accumulate: int, world_size: int, given: int | None = None,
                      hint: str = "Pass global_batch_size= to AutoPlanStrategy.") -> int:
    """The user's global batch: ``loader batch × accumulate_grad_batches × world size`` (DESIGN §3.1), or ``given``.

    Raises:
        InfeasiblePlanError: neither a readable loader batch size nor ``given``.
    """
    if given is not None:
        return given
    if loader_batch is None:
        raise InfeasiblePlanError(
            "The train dataloader's batch size cannot be read (no `batch_size` on it or on its batch_sampler).",
            hint=hint,
        )
    return loader_batch * accumulate * world_size


def profile_in_fit(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    *,
    device: torch.device,
    micro_batch_sizes: Sequence[int] | None = None,
    repeats: int = 1,
    measure_links: bool = True,
    log_prefix: str = "distplan",
    loader: Any = None,
    global_batch_of: Callable[[Any], int] | None = None,
) -> tuple[Profile, Any]:
    """Profile ``module`` on ``device`` with real batches of the user's train loader, leaving no trace.

    Every rank must call it when distributed (the profiler's collectives and link measurements).

    Cheaper than a stand-alone :func:`~lightning_distplan.profiling.profile_module` run, so that
    planning stays a few percent of a short fit: sizes b/4, b/2, b (:func:`in_fit_micro_batch_sizes`),
    ``repeats=1``, FLOPs counted at one size (``flop_sizes=1``: FLOPs per sample are F(b/4)/(b/4),
    which assumes no batch-independent FLOPs; they only feed the tuner's projection to other
    devices, not this run's plan), and links measured at three sizes up to the gradient size
    (:func:`link_sizes`). Times, bytes and fits are all measured, none is copied from elsewhere.
    The steps run in the fit's precision (``trainer.precision_plugin``: autocast for the mixed
    precisions, the weights and inputs converted for ``"bf16-true"`` and the like), as the fit will.

    ``loader``: a fresh instance of the user's train loader (:func:`fresh_train_loader`) when the
    caller already made one. ``global_batch_of(loader)``: the fit's global batch, read before anything is profiled
    (it raises where it cannot be read); without a loader batch size the sizes profiled follow its share per device.

    Returns:
        (the profile, the fresh loader it drew from — its ``batch_size`` is the user's loader batch)
    """
    import dataclasses

    import torch.distributed as dist

    from lightning_distplan.profiling import measure_links as _measure_links
    from lightning_distplan.profiling import profile_module
    from lightning_distplan.profiling._snapshot import RNGSnapshot

    def progress(line: str) -> None:
        rank_zero_info(f"{log_prefix}: profiling {line}")

    counters = TrainerCounters.take(trainer)
    # The loader's sampler may draw its seed from the global RNG when iterated: snapshot first.
    rng = RNGSnapshot.take(include_cuda=device.type == "cuda")
    was_training = module.training
    attached = False
    try:
        if loader is None:
            loader = fresh_train_loader(trainer)
        global_batch = None if global_batch_of is None else global_batch_of(loader)
        # The weights in the dtype the fit trains them in ('bf16-true', '64-true', ...): the strategy's
        # setup converts them the same way anyway (a no-op for 32-true and the mixed precisions).
        trainer.precision_plugin.convert_module(module)
        if micro_batch_sizes is None:
            from lightning_distplan.strategies.dp_ga import loader_batch_size

            share = None if global_batch is None else max(1, global_batch // trainer.world_size)
            micro_batch_sizes = in_fit_micro_batch_sizes(loader_batch_size(loader) or share or 1)
        attached = not trainer.strategy.optimizers  # before the fit's own exist (mid-fit, training_step has those)
        optimizer = _attach_optimizers(trainer, module) if attached else None
        profile = profile_module(
            module,
            loader,
            micro_batch_sizes=micro_batch_sizes,
            device=device,
            repeats=repeats,
            measure_links=False,
            progress=progress,
            flop_sizes=1,  # FLOPs per sample from one size (an estimate: see profile_module); saves a slow counting run
            min_timed_s=IN_FIT_MIN_TIMED_S,
            precision_plugin=trainer.precision_plugin,  # the fit's precision: autocast, converted inputs
            optimizer=optimizer,
        )
        if measure_links and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t0 = time.perf_counter()
            sizes = link_sizes(profile.memory.grad_bytes)
            # The pipelining runtime's own cost per slot is not measured here (0.16 s over two CPU ranks,
            # an eighth of the in-fit planning budget); the cost model takes costmodel.PIPELINE_SLOT_S.
            links = _measure_links(sizes_bytes=sizes, repeats=3)
            elapsed = time.perf_counter() - t0
            progress(f"links: all-reduce and p2p at {[f'{s / 2**10:.0f} KiB' for s in sizes]} in {elapsed:.2f} s")
            profile = dataclasses.replace(profile, links=links, profiling_time_s=profile.profiling_time_s + elapsed)
    finally:
        rng.restore()
        counters.restore(trainer)
        module.train(was_training)
        if attached:
            trainer.strategy.optimizers, trainer.strategy.lr_scheduler_configs = [], []  # the fit's own come with its setup
    return profile, loader


def _attach_optimizers(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    """The module's optimizer as Lightning builds it, attached to the strategy while we profile, so a training_step
    that calls ``self.optimizers()`` or ``self.lr_schedulers()`` (to log the learning rate) runs as in the fit.
    None when there is not exactly one (Lightning's stand-in when configure_optimizers returns none is one)."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    trainer.strategy.optimizers, trainer.strategy.lr_scheduler_configs = optimizers, schedulers
    return optimizers[0] if len(optimizers) == 1 else None


IN_FIT_MIN_TIMED_S = 0.1
"""In-fit profiling repeats a short step until its timed runs add up to this, not the standalone
profiler's 0.25 s. Measured with ``examples/auto_plan_overhead.py --samples 8192`` on an idle 2-core
CPU: 0.25 s gave 2.11 s of planning = 5.7% of the epoch; 0.1 s gave 2.00 s = 5.2% and 1.57 s = 4.7%."""


def in_fit_micro_batch_sizes(loader_batch: int) -> list[int]:
    """Sizes profiled inside ``fit``: b/4, b/2 and b for the loader batch b (at least 3 distinct sizes).

    Cheaper than the stand-alone profiler's b/2..4b (the sizes sum to 1.75 loader batches instead
    of 7.5), which is what keeps planning to a few percent of a short CPU run. A factor of 4 still
    conditions the fit t(m) = α·m + β (seed 000 §III-B); plans at larger m (pipelines, little
    accumulation) extrapolate it.
    """
    b = max(1, int(loader_batch))
    sizes = sorted({max(1, b // 4), max(1, b // 2), b})
    while len(sizes) < 3:
        sizes.append(2 * sizes[-1])
    return sizes


def link_sizes(grad_bytes: int) -> tuple[int, ...]:
    """Message sizes for the link fit: latency-bound small messages up to the model's gradient size.

    The all-reduce of the gradients (G bytes) is the biggest message a plan sends; measuring up to
    it (capped at 16 MiB, beyond which the fit t = L + bytes/BW extrapolates linearly) instead of
    the profiler's fixed 4 KiB..16 MiB keeps the measurement short for small models.
    """
    top = 1 << 17
    while top < min(int(grad_bytes), 1 << 24):
        top <<= 1
    return (1 << 12, 1 << 15, top)


def pins_from(**values: Any) -> dict[str, Any]:
    """Planner pins from keyword arguments: ``"auto"`` / ``None`` mean "let the planner choose".

    ``stages`` stays the user's word for the ``pp`` pin (the planner reads it, and names it so in
    its messages); ``schedule="none"`` means data parallel.
    """
    pins: dict[str, Any] = {}
    for key, value in values.items():
        if value is None or (isinstance(value, str) and value == "auto"):
            continue
        if key == "stage_boundaries":
            value = tuple(value)
        pins[key] = value
    return pins


def check_count(name: str, value: Any, *, auto: bool = False, low: int = 1) -> Any:
    """``value`` as an int ``>= low`` (a numpy integer taken; or ``"auto"`` where ``auto``), or refused in one sentence
    with a HINT."""
    if auto and isinstance(value, str) and value == "auto":
        return value
    count = as_int(value)
    if count is None or count < low:
        what = ("a positive integer" if low == 1 else f"an integer >= {low}") + (" or 'auto'" if auto else "")
        example = f"{name}={max(low, 2)}" + (" or leave it 'auto'" if auto else "")
        raise InfeasiblePlanError(f"`{name}` must be {what}, got {value!r}.", hint=f"Pass e.g. {example}.")
    return count


def check_sizes(name: str, value: Any) -> list[int] | None:
    """``value`` (None, or a list of positive micro-batch sizes) as a list of ints, or refused in one sentence with a HINT."""
    if value is None:
        return None
    sizes = as_indices(value)
    if not sizes or any(v < 1 for v in sizes):
        raise InfeasiblePlanError(f"`{name}` must be a list of positive micro-batch sizes, got {value!r}.", hint=f"Pass e.g. {name}=[2, 4, 8].")
    return list(sizes)


def check_boundaries(value: Any) -> tuple[int, ...] | None:
    """``stage_boundaries`` as a tuple of increasing positive layer indices (numpy integers taken), None for
    ``"auto"``, or refused in one sentence with a HINT."""
    if isinstance(value, str) and value == "auto":
        return None
    given = as_indices(value)
    if given is None or any(b < 1 for b in given) or list(given) != sorted(set(given)):
        raise InfeasiblePlanError(
            f"`stage_boundaries` must be increasing positive layer indices or 'auto', got {value!r}.",
            hint="Pass e.g. stage_boundaries=[6] for two stages split before layer 6.",
        )
    return given


def check_memory(name: str, value: Any) -> int | None:
    """``value`` as a positive number of bytes (an int, numpy integers taken) or None, or refused in one sentence with a HINT."""
    if value is None:
        return None
    count = as_int(value)
    if count is None or count <= 0:
        raise InfeasiblePlanError(f"`{name}` must be a positive number of bytes, got {value!r}.", hint=f"Pass e.g. {name}=8 * 2**30 for 8 GiB.")
    return count


def unsuited_plan(stored: Plan, *, strategies: Sequence[str], pins: Mapping[str, Any]) -> str | None:
    """Why a checkpoint's plan cannot run in a fit that allows ``strategies`` under ``pins``, or None (the parts that
    do not depend on the run's size: see :func:`made_for_another_run` and the world size / global batch)."""
    if stored.strategy != "dp_ga" and stored.accumulate_grad_batches > 1:  # a registered pipeline under accumulation wrote it
        return f"it runs {stored.accumulate_grad_batches} pipeline flushes per optimizer step, and a plan made here runs one"
    if stored.strategy not in strategies:
        return f"this fit allows {', '.join(strategies)} only"
    if not satisfies_pins(stored, dict(pins)):
        return f"it does not match the pins {dict(pins)}"
    return None


def made_for_another_run(context: Mapping[str, Any], *, precision: Any, memory_bytes: int | None) -> str | None:
    """Why a checkpoint's plan, made in ``context`` (its precision and the device memory it had to fit), does not
    suit a fit in ``precision`` with ``memory_bytes`` of device memory (None: unknown), or None."""
    was = context.get("precision")
    if was is not None and precision is not None and str(was) != str(precision):
        return f"it was made for precision={was!r} and this fit runs {precision!r}"
    limit = context.get("memory_limit_bytes")
    # 5%: NVML and torch report one card's memory 0.6% apart (an H100: 85.5 GB against 85.0 GB)
    if isinstance(limit, int) and memory_bytes is not None and memory_bytes < 0.95 * limit:
        return f"it was made for {format_bytes(limit)} of device memory and this fit has {format_bytes(memory_bytes)}"
    return None


def device_memory(given: int | None, device: torch.device) -> int | None:
    """``given``, else a CUDA device's total memory, else None (a CPU fit's limit is what the plan was made for)."""
    if given is None and device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    return given


def jsonable_pins(pins: Mapping[str, Any]) -> dict[str, Any]:
    """``pins`` as ``plan.json`` records them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in pins.items()}


def ddp_bucket_bytes(strategy: Any) -> int | None:
    """The gradient bucket size a DDP strategy was given (``bucket_cap_mb``, MiB, as torch reads it) in bytes, or
    ``None`` for DDP's defaults (or a strategy that is not DDP)."""
    mb = getattr(strategy, "_ddp_kwargs", {}).get("bucket_cap_mb")
    return None if mb is None else int(mb * 1024 * 1024)


def reloaded_loader_error(batch: int, first: int, plan: Plan, *, planner: str, hint: str) -> InfeasiblePlanError:
    """The error for a train loader loaded again during a fit (``reload_dataloaders_every_n_epochs``) with another batch
    size than the fit's first: ``planner``'s plan would silently keep the global batch it was made for, where a run of
    the user's loader as it is steps on the new one."""
    return InfeasiblePlanError(
        f"The train loader was loaded again during the fit with batches of {batch}, where its first batches were {first}, and "
        f"{planner}'s plan ({plan.describe()}) keeps the global batch of {plan.global_batch_size} it was made for "
        "(a run of your loader as it is would step on the new batch size).",
        hint="Keep the train loader's batch size fixed across reload_dataloaders_every_n_epochs, or " + hint,
    )


def ranks_per_node(trainer: Any) -> int:
    """Processes on one node: on a CPU profile they share the host's RAM, over several nodes its network link
    (``choose_plan``'s ``ranks_per_host``)."""
    return max(1, trainer.world_size // max(1, trainer.num_nodes))


def choose_plan(
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    pins: dict[str, Any] | None = None,
    device_memory_bytes: int | None = None,
    strategies: Sequence[str] = STRATEGIES,
    compute_scale: float = 1.0,
    hardware: Hardware | None = None,
    ddp_bucket_bytes: int | None = None,
    ranks_per_host: int | None = None,
) -> tuple[list[Candidate], Hardware]:
    """Rank every plan for the user's global batch on ``world_size`` devices; the first is feasible.

    ``ddp_bucket_bytes``: the run's DDP gradient bucket size (:func:`ddp_bucket_bytes`), where it sets one.
    ``ranks_per_host``: processes on one node (default: all ``world_size``): on a CPU profile they share the host's RAM,
    and over several nodes they share its network link (``Hardware.devices_per_link``), which the stages of a hybrid
    dp×pp on one node cross at once with their gradient all-reduces.

    Raises:
        InfeasiblePlanError: an impossible pin (from the planner, with its HINT), or no plan fits in memory.
        BatchNotFactorableError: the global batch cannot be factored over the devices.
    """
    if hardware is None:
        hardware = Hardware.from_profile(profile, device_memory_bytes=device_memory_bytes, warn_default_links=world_size > 1,
                                         ranks_per_host=world_size if ranks_per_host is None else ranks_per_host, world_size=world_size)
    if compute_scale != hardware.compute_scale:
        hardware = replace(hardware, compute_scale=compute_scale)
    if ddp_bucket_bytes is not None:
        hardware = replace(hardware, ddp_bucket_bytes=ddp_bucket_bytes)
    candidates = rank_plans(
        profile, world_size=world_size, global_batch_size=global_batch_size, hardware=hardware, pins=pins, strategies=strategies
    )
    if not candidates or not candidates[0].prediction.feasible:
        best = closest_to_fitting(candidates) if candidates else None
        cap = f"{format_bytes(hardware.device_memory_bytes)} per device"
        closest = ""
        if best is not None and best.prediction.peak_memory_bytes > hardware.usable_memory_bytes:
            closest = f" the closest, {best.plan.describe()}, needs {format_bytes(best.prediction.peak_memory_bytes)}"
        elif best is not None:  # its peak fits: it fails for another reason (its micro-batch ran out of memory while profiling)
            why = best.prediction.reason.rstrip(".")
            closest = f" the closest, {best.plan.describe()}, fails because {why[:1].lower() + why[1:]}"
        pinned = f" with the pins {pins}" if pins else ""
        hint = "Drop pins, raise device_memory_bytes, use more devices (pipeline stages split the model), or a smaller micro-batch."
        if not profile.splittable and world_size > 1 and any(s != "dp_ga" for s in strategies):
            # "use a pipeline" would not help: say why none was planned
            hint = (f"Pipelines, which split the model over devices, were left out because {unsplittable(profile.split_reason)}; mend that, "
                    + ("drop pins, " if pins else "") + "raise device_memory_bytes, or use a smaller micro-batch.")
        raise InfeasiblePlanError(
            f"No plan for global batch {global_batch_size} on {world_size} devices{pinned} fits in {cap} "
            f"(usable {hardware.memory_margin:.0%});{closest}.",
            hint=hint,
        )
    return candidates, hardware


def faster_alternative(candidates: Sequence[Candidate], running: Plan, *, min_speedup: float = 1.05) -> tuple[Candidate, float] | None:
    """The best feasible candidate of another strategy or layout than ``running``, if predicted faster."""
    current = next((c for c in candidates if c.plan == running), None)
    if current is None:
        return None
    for c in candidates:
        if not c.prediction.feasible:
            break
        if (c.plan.strategy, c.plan.pp) != (running.strategy, running.pp):
            speedup = current.prediction.step_time_s / max(c.prediction.step_time_s, 1e-12)
            return (c, speedup) if speedup >= min_speedup else None
    return None


def describe_for_user(plan: Plan) -> str:
    """``"1f1b with 2 stages (8 micro-batches of 4)"``, ``"dp_ga with micro-batch 8 x 4 accumulation on 2 replicas"``."""
    if plan.strategy == "dp_ga":
        return f"dp_ga with micro-batch {plan.micro_batch_size} x {plan.accumulate_grad_batches} accumulation on {plan.dp} replicas"
    dp = f", {plan.dp} replicas" if plan.dp > 1 else ""
    return f"{plan.strategy} with {plan.pp} stages{dp} ({plan.n_microbatches} micro-batches of {plan.micro_batch_size})"


def plan_record(outcome: PlanningOutcome, *, top: int = 5, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``plan.json``: chosen plan, its prediction, the best alternatives."""
    chosen = next((c for c in outcome.candidates if c.plan == outcome.plan), None)
    alternatives = [c.to_dict() for c in outcome.candidates if c.plan != outcome.plan][:top]
    return {
        "plan": outcome.plan.to_dict(),
        "source": outcome.source,
        "prediction": chosen.to_dict() if chosen is not None else None,
        "alternatives": alternatives,
        "hardware": None if outcome.hardware is None else {
            "name": outcome.hardware.name,
            "device_memory_bytes": outcome.hardware.device_memory_bytes,
            "allreduce_latency_s": outcome.hardware.allreduce_latency_s,
            "allreduce_bandwidth_bytes_per_s": outcome.hardware.allreduce_bandwidth_bytes_per_s,
            "p2p_latency_s": outcome.hardware.p2p_latency_s,
            "p2p_bandwidth_bytes_per_s": outcome.hardware.p2p_bandwidth_bytes_per_s,
            "compute_scale": outcome.hardware.compute_scale,
            "devices_per_link": outcome.hardware.devices_per_link,
            "link_source": outcome.hardware.link_source,
        },
        "profiling_s": outcome.profiling_s,
        "planning_s": outcome.planning_s,
        **(dict(extra) if extra else {}),
    }


def write_artifacts(
    directory: Path, *, profile: Profile | None, outcome: PlanningOutcome, extra: Mapping[str, Any] | None = None
) -> Path:
    """Write ``profile.json`` (when profiled) and ``plan.json`` under ``directory``; returns the plan path.

    Call on global rank 0 only.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        profile.save(directory / "profile.json")
    return write_text_atomic(directory / "plan.json", json.dumps(plan_record(outcome, extra=extra), indent=2, default=str))


def log_outcome(outcome: PlanningOutcome, *, prefix: str = "distplan", top: int = 5) -> None:
    """Log the plan and the best alternatives once (rank zero)."""
    lines = [f"{prefix}: chose {outcome.plan.describe()} (global batch {outcome.plan.global_batch_size}, {outcome.source})"]
    pred = outcome.prediction
    if pred is not None:
        lines[0] += f", predicted {format_ms(pred.step_time_s)} ms/step, peak {format_bytes(pred.peak_memory_bytes)}/device"
    if outcome.candidates:
        lines.append(explain(outcome.candidates, top=top))
    if outcome.source == "profiled":
        lines.append(f"{prefix}: planning overhead {outcome.profiling_s:.2f} s profiling + {outcome.planning_s:.3f} s ranking")
    rank_zero_info("\n".join(lines))

