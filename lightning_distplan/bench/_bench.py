"""``run_bench``: profile, plan, run every chosen candidate for real, and set measurements beside predictions."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import socket
import time
import warnings
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_distplan.bench._compare import WITHIN, confirm_candidates, first_profile_view, predict_ranked, relative_error, summarize
from lightning_distplan.bench._runner import combine_passes, combine_ranks, measure_plan, memory_metric
from lightning_distplan._provenance import code_provenance
from lightning_distplan._format import format_ms
from lightning_distplan.errors import DistPlanError, InfeasiblePlanError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.planner import Candidate
    from lightning_distplan.profile import Profile

__all__ = ["run_bench", "select_candidates", "parse_plans_spec", "check_counts", "check_dataset_size", "check_own_devices", "cuda_devices_used",
           "ranks_sharing_a_device", "timed_steps", "BenchError", "RESULT_SCHEMA",
           "BENCH_LINK_SIZES", "MAX_TIMED_STEPS", "RANK_TIMEOUT_S"]

log = logging.getLogger(__name__)

RESULT_SCHEMA = "distplan-bench/1"

# 4 KiB .. 4 MiB: latency- to bandwidth-bound, yet a whole link measurement stays ~5 s even at
# 100 Mbit/s (the profiler's default goes to 16 MiB).
BENCH_LINK_SIZES: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22)

# The most timed steps ``min_time_s`` may ask of one plan in one pass: a prediction far too fast
# (a mis-profiled size) must not turn one run into minutes.
MAX_TIMED_STEPS = 200

# How long a rank that finished a plan's run (or failed it) waits for the others before the benchmark
# stops. A rank that fails alone (the usual GPU out-of-memory: one device runs out first) leaves the
# others blocked in a collective that never completes; without this they would wait for the process
# group's timeout (30 minutes on gloo). Ranks that run a plan normally reach its end seconds apart.
RANK_TIMEOUT_S = 180.0


class BenchError(DistPlanError, ValueError):
    """The benchmark cannot run as asked (bad plan selection, wrong world size, unusable data)."""


def parse_plans_spec(spec: str) -> tuple[str, int | list[int] | None]:
    """``("all", None)``, ``("top", K)`` or ``("ranks", [N, M, ...])`` for a ``--plans`` value.

    Raises:
        BenchError: the value is none of those forms.
    """
    spec = spec.strip()
    if spec == "all":
        return "all", None
    if spec.startswith("top:"):
        try:
            k = int(spec[4:])
        except ValueError:
            k = 0
        if k < 1:
            raise BenchError(f"--plans {spec!r} needs a positive K in top:K.", hint="Use e.g. --plans top:5.")
        return "top", k
    try:
        ranks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise BenchError(f"--plans {spec!r} is not 'all', 'top:K' or comma-separated planner ranks (>= 1).", hint="Use e.g. --plans all, --plans top:5 or --plans 1,2,7.")
    return "ranks", ranks


def check_counts(*, steps: int, warmup: int, passes: int, confirm: int = 0, min_time_s: float = 0.0, rank_timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Raise :class:`BenchError` unless ``steps`` and ``passes`` are >= 1, ``warmup``, ``confirm`` and ``min_time_s`` >= 0
    and ``rank_timeout_s`` > 0."""
    if not 0 <= min_time_s < math.inf:  # also NaN
        raise BenchError(f"--min-time ({min_time_s}) must be a finite number of seconds >= 0.", hint="Use e.g. --min-time 1, or 0 for exactly --steps timed steps.")
    if not 0 < rank_timeout_s < math.inf:
        raise BenchError(f"--rank-timeout ({rank_timeout_s}) must be a finite number of seconds > 0.", hint=f"Use e.g. --rank-timeout {RANK_TIMEOUT_S:g} (the default).")
    if confirm < 0:
        raise BenchError(f"--confirm ({confirm}) must be >= 0.", hint="Use e.g. --confirm 2, or 0 for no confirmation passes.")
    if steps < 1 or warmup < 0 or passes < 1:
        raise BenchError(
            f"--steps ({steps}) and --passes ({passes}) must be >= 1 and --warmup ({warmup}) >= 0.",
            hint="Use e.g. --steps 5 --warmup 2 --passes 2.",
        )


def check_dataset_size(n_samples: int, *, global_batch_size: int, warmup: int, timed: int) -> int:
    """The samples a pass reads (at most the dataset's): refused below one global batch (every plan's optimizer step
    reads one, over all replicas), warned about below a whole pass (epochs would end inside the timed steps)."""
    _check_one_global_batch(n_samples, global_batch_size)
    wanted = (warmup + timed) * global_batch_size
    if n_samples < wanted:
        warnings.warn(
            f"The dataset has {n_samples} samples, fewer than the {warmup}+{timed} steps of a pass read ({wanted}): epochs end "
            "inside the timed steps, and each epoch's end and restart is timed with a step (slower measurements). Use a "
            "bigger dataset (e.g. num_samples in the datamodule's arguments), or fewer --steps or a smaller --min-time.",
            stacklevel=3,
        )
    return min(n_samples, wanted)


def _check_one_global_batch(n_samples: int, global_batch_size: int) -> None:
    if n_samples < global_batch_size:
        raise BenchError(
            f"The dataset has {n_samples} samples, fewer than one global batch ({global_batch_size}).",
            hint="Use a bigger dataset (e.g. num_samples in the datamodule's arguments) or a smaller --global-batch-size.",
        )


def timed_steps(steps: int, min_time_s: float, predicted_step_time_s: float) -> int:
    """Timed steps for one plan and pass: ``steps``, or more so that they last about ``min_time_s``.

    Sized from the plan's predicted step time, which every rank shares, so all ranks run the same
    count; at most :data:`MAX_TIMED_STEPS` (or ``steps``, when that is more).
    """
    if min_time_s <= 0 or not predicted_step_time_s > 0:
        return steps
    return max(steps, min(MAX_TIMED_STEPS, math.ceil(min_time_s / predicted_step_time_s)))


def select_candidates(candidates: Sequence[Candidate], spec: str) -> list[Candidate]:
    """The candidates ``spec`` names: ``all`` (every feasible one), ``top:K``, or planner ranks ``N,M,...``."""
    kind, value = parse_plans_spec(spec)
    feasible = [c for c in candidates if c.prediction.feasible]
    if kind == "all":
        return feasible
    if kind == "top":
        return feasible[: int(value)]  # type: ignore[arg-type]
    ranks = list(value)  # type: ignore[arg-type]
    by_rank = {c.rank: c for c in candidates}
    missing = [r for r in ranks if r not in by_rank]
    if missing:
        raise BenchError(
            f"--plans names rank(s) {missing}, but the planner ranked {len(candidates)} plans (1..{len(candidates)}).",
            hint="The ranks are those of the benchmark's first profile (a bench table's '1st' column, or its rank column where "
            "there is none); use --plans all to see them all.",
        )
    return [by_rank[r] for r in dict.fromkeys(ranks)]


class _CachedDataset(Dataset):
    """``n`` samples read from the first ``distinct`` of the user's dataset, in turn (sample ``i`` is its ``i % distinct``),
    materialised once so data loading costs ~nothing, and bounded: a pass of 200 timed steps (``--min-time``) must not
    hold 200 global batches on every rank (7 GB for 64 images of 3x224x224 a step)."""

    def __init__(self, dataset: Any, n: int, *, distinct: int | None = None) -> None:
        self.n = n
        self.samples = [dataset[i] for i in range(min(n, distinct or n))]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.samples[i % len(self.samples)]


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, over ``group`` (default: the default group); ``[obj]`` when not distributed."""
    import torch.distributed as dist

    if _dist()[1] == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def ranks_per_machine(world: int) -> int:
    """Processes of this ``world``-process job on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (1 when not distributed,
    or when the launcher did not set it).

    Raises:
        BenchError: ``LOCAL_WORLD_SIZE`` is no whole number from 1 to ``world`` that divides it (every machine runs as
            many ranks: the runs' Trainers get ``devices`` = this, ``num_nodes`` = ``world`` / this).
    """
    if world <= 1:
        return 1
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local = int(text)
    except ValueError:
        local = 0
    if not 1 <= local <= world or world % local:
        raise BenchError(
            f"LOCAL_WORLD_SIZE ({text!r}), the processes of this job on one machine, must be a whole number that divides the "
            f"world size ({world}).",
            hint="Start the ranks with torchrun, which sets it, or set it to the processes per machine (e.g. "
            f"LOCAL_WORLD_SIZE={world} for one machine).",
        )
    return local


def planning_hardware(profile: Profile, world: int) -> Hardware:
    """The hardware the bench plans and grades on, as auto_plan plans on it: the profile's, a CPU profile's host RAM
    shared by the :func:`ranks_per_machine` ranks on one machine (not by all ``world`` ranks, which span machines under
    ``--nnodes``), and over several machines their link shared by the stages of a hybrid dp×pp on one machine
    (``Hardware.devices_per_link``, as ``choose_plan`` sets it)."""
    from lightning_distplan.costmodel import Hardware

    return Hardware.from_profile(profile, warn_default_links=world > 1, ranks_per_host=ranks_per_machine(world), world_size=world)


def _control_group(timeout_s: float) -> Any:
    """A gloo group of every rank whose operations give up after ``timeout_s`` (None when not distributed)."""
    import torch.distributed as dist
    from datetime import timedelta

    if _dist()[1] == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _gather_run(obj: dict[str, Any], group: Any, *, timeout_s: float, plan: str, others: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Every rank's numbers for one plan's run, gathered over ``group`` (:func:`_control_group`).

    Raises:
        BenchError: a rank did not finish the run within ``timeout_s`` of this one, which is what a
            rank failing alone looks like (the others wait in a collective for it).
    """
    if group is None:
        return [obj]
    try:
        return _gather(obj, group)
    except RuntimeError:  # gloo: "Timed out waiting ...", or "Connection closed by peer" once a rank gave up
        # The same sentence on every rank (the launcher shows it once); each rank's own error was logged by measure_plan.
        raise BenchError(
            f"Plan {plan} did not finish on every rank within {timeout_s:g} s of the others, so the benchmark stops: a rank that "
            "fails alone (e.g. one GPU out of memory first) leaves the others waiting in a collective; each rank's error is above.",
            hint=f"Leave this plan out by listing the planner ranks to run with --plans (e.g. --plans {','.join(map(str, others[:3])) or '1,2,4'}), "
            "or raise --rank-timeout if a rank is only slow (e.g. building a large model).",
        ) from None


def _leave_group() -> None:
    """End every process group of this process once the runs stopped (a rank still blocked in one of its collectives
    is freed only when this process ends: the strategies' objects keep the connections open until then)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _device_key(dev: torch.device) -> str:
    """What names CUDA device ``dev`` alike in every process of one machine: its UUID (one GPU whatever a process's
    ``CUDA_VISIBLE_DEVICES`` numbers it), else that numbering and its index."""
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}:{dev.index}"


def cuda_devices_used(dev: torch.device) -> list[tuple[str, str, str]]:
    """The CUDA devices this rank's bench would use, each as (host, :func:`_device_key`, shown): ``dev`` (the profiling's
    and retiming's) and, under an NCCL group, the current device its collectives run on (``profiling._links._device_for``:
    the link measurement, the broadcasts). Empty on CPU."""
    import torch.distributed as dist

    from lightning_distplan.profiling._links import _device_for

    devices = [dev] if dev.type == "cuda" else []
    if dist.is_available() and dist.is_initialized():
        collectives = _device_for(None)
        if collectives.type == "cuda" and collectives not in devices:
            devices.append(collectives)
    host = socket.gethostname()
    return [(host, _device_key(d), str(d)) for d in devices]


def ranks_sharing_a_device(used: Sequence[Sequence[tuple[str, str, str]]]) -> tuple[list[int], str, str] | None:
    """(ranks, shown device, host) for the first device two or more ranks of one host use, given each rank's
    :func:`cuda_devices_used` in rank order; None when every rank has devices of its own."""
    ranks: dict[tuple[str, str], list[int]] = {}
    shown: dict[tuple[str, str], str] = {}
    for rank, devices in enumerate(used):
        for host, key, name in devices:
            at = ranks.setdefault((host, key), [])
            if rank not in at:
                at.append(rank)
            shown.setdefault((host, key), name)
    for place, at in ranks.items():
        if len(at) > 1:
            return at, shown[place], place[0]
    return None


def check_own_devices(used: Sequence[tuple[str, str, str]], world: int) -> None:
    """Refuse, on every rank alike, a job whose ranks share a CUDA device (``used``: this rank's :func:`cuda_devices_used`).

    Why: ``run_bench`` called from the user's own job does not own its process group, so the devices are the user's
    ``torch.cuda.set_device`` calls; a job that forgot them has every rank on ``cuda:0``, where the profiles time one GPU
    shared by all ranks and NCCL refuses the collectives ("Duplicate GPU detected") or hangs in them. The ranks' devices
    cross over the job's own group where it carries CPU tensors (gloo, "cpu:gloo,cuda:nccl": one small all-gather, no
    group made for it, so a CPU run pays nothing more); only under an NCCL-only group, where the exchange would itself run
    on the shared device, over a gloo group made for it and ended after (every rank makes it: every rank runs run_bench).

    Raises:
        BenchError: two ranks of one host use one CUDA device."""
    import torch.distributed as dist

    from lightning_distplan.profiling._links import _device_for

    if world <= 1:
        return
    group = None if _device_for(None).type == "cpu" else dist.new_group(backend="gloo")
    try:
        every = _gather(list(used), group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    shared = ranks_sharing_a_device(every)
    if shared is None:
        return
    ranks, device, host = shared
    named = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    raise BenchError(
        f"Ranks {named} of this job {'both' if len(ranks) == 2 else 'all'} run on {device} of host {host!r}, so their profiles would time one shared GPU and NCCL "
        "would refuse or hang in their collectives; nothing was run.",
        hint="Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) in every process before init_process_group and run_bench "
        "(`distplan bench` does this itself), or give each process its own GPU with CUDA_VISIBLE_DEVICES.",
    )


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    if _dist()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _retime_step(make_module: Callable[[], pl.LightningModule], loader: DataLoader, m: int, device: torch.device,
                 precision: Any = None) -> float:
    """Mean forward + backward seconds of one training step at micro-batch ``m``, timed as the profiler times it."""
    from lightning_distplan.profiling._profiler import _Profiler

    module = make_module()
    if precision is not None:
        module = precision.convert_module(module)
    module = module.to(device).train()
    # three untimed runs first: a fresh module's first steps allocate (and fault in) its gradient buffers
    prof = _Profiler(module, loader, micro_batch_sizes=[m], device=device, optimizer=None, warmup=3, repeats=3,
                     progress=None, t0=time.perf_counter(), loop_overhead=False, precision_plugin=precision)
    fwd, bwd, _, _ = prof.time_step(m, warmup=3)
    prof.clear_grads()
    return fwd + bwd


def _unpoolable(reason: str) -> str:
    """A left-out profile's ``reason``, from :func:`~lightning_distplan.profile.unpoolable_reason`'s clause: other sizes,
    layers or links (a size that fitted before ran out of memory, say), or another device, dtype or TF32 switch (a
    module that turns TF32 on in a hook the runs call and the profiler does not)."""
    return f"it is not averaged with the first profile: {reason}"


def _passes(numbers: Sequence[int]) -> str:
    """``pass 2`` / ``passes 1 and 2`` / ``passes 1, 2 and 3``."""
    if len(numbers) == 1:
        return f"pass {numbers[0]}"
    return "passes " + ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"


def prediction_label(pooled_after: Sequence[int], left_out_after: Sequence[int] = (), *, passes: int) -> str:
    """Which profiles the predictions rest on, in words: the one before the runs and those taken after the passes in
    ``pooled_after``; those after the passes in ``left_out_after`` could not be pooled (a stop after some passes
    takes none after the later ones)."""
    n = 1 + len(pooled_after)
    if not pooled_after:
        label = "one profile, before the runs"
    elif list(pooled_after) == list(range(1, passes + 1)):
        label = f"mean of {n} profiles (before the runs and after each pass)"
    else:
        label = f"mean of {n} profiles (before the runs and after {_passes(pooled_after)})"
    if left_out_after:
        taken = "the profile" if len(left_out_after) == 1 else "the profiles"
        label += f"; {taken} after {_passes(left_out_after)} left out: measured otherwise than the first (profiles_left_out says how)"
    return label


def default_bench_micro_batch_sizes(global_batch_size: int) -> list[int]:
    """Powers of two from 1 to the global batch (at least 3): every planned micro-batch lies inside the fit."""
    sizes = [1]
    while sizes[-1] * 2 <= global_batch_size:
        sizes.append(sizes[-1] * 2)
    while len(sizes) < 3:
        sizes.append(sizes[-1] * 2)
    return sizes


def run_bench(
    make_module: Callable[[], pl.LightningModule],
    train_loader: DataLoader,
    *,
    world_size: int,
    global_batch_size: int,
    plans: str = "all",
    steps: int = 5,
    warmup: int = 2,
    passes: int = 2,
    confirm: int = 0,
    min_time_s: float = 0.0,
    reprofile: bool = True,
    device: str | torch.device | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    profile_repeats: int = 3,
    precision: str = "32-true",
    link_sizes: Sequence[int] = BENCH_LINK_SIZES,
    rank_timeout_s: float = RANK_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Profile, plan, run the chosen plans for real and compare them with the predictions.

    Every rank of the live process group (or a single process) must call this with the same
    arguments. Candidates run one after the other in the same processes, each with a fresh module
    from ``make_module`` and a fresh Lightning Trainer whose strategy is built from the plan.

    Args:
        make_module: builds the LightningModule; called once for profiling and once per plan.
            Seed inside it (or rely on the seed set here before each call) for identical replicas.
        train_loader: the user's training DataLoader: profiled as is; its ``dataset`` and
            ``collate_fn`` feed every plan at the batch size the plan needs.
        world_size: processes in the job (must equal the process group's size).
        global_batch_size: samples per optimizer step, the same for every plan.
        plans: ``"all"`` (every feasible plan), ``"top:K"`` or planner ranks ``"1,3,5"``.
        steps: timed optimizer steps per plan and pass (at least; see ``min_time_s``).
        warmup: untimed optimizer steps per plan and pass first.
        passes: times the whole list of plans is run, in alternating order (first to last, then
            last to first, ...); each plan's step time is the median of its timed steps from all
            passes, so a slow spell of a shared host weighs on one pass of a plan, not all of it.
        confirm: confirmation passes after the predictions are final: the contenders for the
            measured best (:func:`~lightning_distplan.bench.confirm_candidates`: the pick, the first
            profile's pick, the fastest plan and those measured within 10% of it) run this many more
            times, alternating, and ``summary["confirmed"]`` judges the pick on those runs alone, free of
            the winner's curse of taking the fastest of many noisy measurements. Their step times
            stay out of the per-plan errors. When the runs stop during these passes (a rank failing
            alone), ``summary["confirmed"]`` is None and ``summary["confirmed_withheld"]`` says why. 0: none.
        min_time_s: time each plan for at least about this long per pass: a plan predicted to take
            t seconds a step runs ``max(steps, ceil(min_time_s / t))`` timed steps (at most
            :data:`MAX_TIMED_STEPS`; the first profile's prediction, fixed before the first pass, so
            every pass and confirmation pass of a plan times the same count). A fast plan's few
            steps otherwise sample a fraction of a second of a noisy host. 0: exactly ``steps``. The plans read the
            first ``(warmup + steps)`` global batches of the dataset in turn, however many steps they time.
        reprofile: profile again (model and links) after each pass and predict from the mean of
            all the profiles (:func:`~lightning_distplan.profile.pool_profiles`), so predictions
            and measurements sample the same stretch of time; a host whose speed drifts then
            shows the model's error rather than the drift. The first profile's predictions and
            ranks (what auto_plan, profiling once, would have had) stay in every record under
            ``first_profile`` and are summarised in ``summary_first_profile``. False: the first
            profile alone.
        device: ``"cpu"``/``"cuda"``; default CUDA when present.
        micro_batch_sizes: sizes to profile; default powers of two from 1 up to the global batch, at least three
            (:func:`default_bench_micro_batch_sizes`).
        profile_repeats: timed runs per profiled size.
        precision: ``Trainer(precision=...)`` of every run, and of the profiling (autocast for the
            mixed precisions, converted weights and inputs for ``"bf16-true"`` and the like).
            Pipelines train only in :data:`~lightning_distplan.strategies.pipeline.PIPELINE_PRECISIONS`;
            in another precision only ``dp_ga`` plans are ranked.
        link_sizes: message sizes for the link measurement (when distributed).
        rank_timeout_s: how long a rank that has finished (or failed) a plan's run waits for the
            others before the runs stop (:data:`RANK_TIMEOUT_S`; the result's ``stopped`` says why).
            A rank that fails alone leaves the others blocked in a collective; this bounds the wait.
        progress: called with one line per phase.
        meta: extra provenance (e.g. the command line), stored under ``provenance``.

    Returns:
        The result dict (schema :data:`RESULT_SCHEMA`): ``plans`` (per-plan predicted and measured
        numbers, errors, breakdown, ordered by rank), ``summary`` (see
        :func:`~lightning_distplan.bench.summarize`), ``summary_first_profile`` (the same from the
        first profile alone), ``profile`` (the one predictions rest on), ``profiles`` (the ones pooled into it:
        the one before the runs, then those after each pass, up to a stop), ``profiles_left_out`` (each one taken
        after a pass that could not be pooled with the first: ``after_pass``, ``reason``, ``profile``),
        ``prediction_profile`` (which profiles the predictions rest on, in words),
        ``ranks_per_host`` (:func:`ranks_per_machine`: the ranks on one machine, which share a CPU host's RAM and,
        over several machines, a machine's link; ``world_size`` / it machines), ``links``, ``host_checks`` (after each pass, the whole step at the largest profiled
        micro-batch timed again, slowest rank: its ratio to the profile's fit there shows roughly,
        to about ±10% on a noisy CPU, how far the host's speed drifted while the plans ran),
        ``provenance`` (date, host, the command, ``versions`` of Python, torch, lightning, this package and, when
        installed, transformers and torchvision, and ``git``: the commit the package ran from, with ``dirty`` and the
        ``changed`` paths, absent when it runs from no git checkout); ``stopped``: None, or why the runs stopped early (a plan's run that not every
        rank finished within ``rank_timeout_s`` of the others: that plan is recorded as failed, the
        plans after it are not run, and the process group is gone). Identical on every rank unless stopped.

    Raises:
        BenchError: bad ``plans``, ``steps``/``warmup``, world size or data; ranks that share a CUDA device
            (:func:`check_own_devices`: a job of the user's own whose processes did not call ``torch.cuda.set_device``).
    """
    from lightning_distplan._layers import discover_layers
    from lightning_distplan.plan import STRATEGIES
    from lightning_distplan.planner import check_batch_before_profiling, rank_plans
    from lightning_distplan.profile import Profile, pool_profiles, unpoolable_reason
    from lightning_distplan.profiling import measure_links, profile_module
    from lightning_distplan.profiling._device import resolve_device
    from lightning_distplan.profiling._links import pipeline_slot_for
    from lightning_distplan.profiling._precision import PRECISIONS, precision_plugin, trainer_precision
    from lightning_distplan.strategies.pipeline import PIPELINE_PRECISIONS

    started = time.perf_counter()
    say = progress or (lambda line: None)
    check_counts(steps=steps, warmup=warmup, passes=passes, confirm=confirm, min_time_s=min_time_s, rank_timeout_s=rank_timeout_s)
    rank, world = _dist()
    if world != world_size:
        raise BenchError(
            f"The benchmark was asked for world size {world_size} but runs in {world} process(es).",
            hint=f"Launch it with `python -m torch.distributed.run --nproc-per-node {world_size} -m lightning_distplan.cli bench ...` "
            "(the `distplan bench` command does this itself when it is not inside a torchrun job).",
        )
    ranks_per_machine(world)  # a launcher's bad LOCAL_WORLD_SIZE, refused before the profiling
    dataset = getattr(train_loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise BenchError(
            f"The train DataLoader's dataset ({type(dataset).__name__}) is not a map-style dataset with __len__/__getitem__.",
            hint="Give the benchmark a DataLoader over a map-style Dataset (e.g. --datamodule lightning_distplan.demos:RandomTokenData).",
        )
    _check_one_global_batch(len(dataset), global_batch_size)  # before the profiling, which takes minutes on a large model
    if precision not in PRECISIONS:
        raise BenchError(f"Unknown precision {precision!r}.", hint=f"Use one of {', '.join(PRECISIONS)}.")
    dev = resolve_device(device)
    if dev.type == "cuda":  # before the first collective, which would land on a shared GPU; a CPU bench (the same
        # --device on every rank) has none to share, and pays no exchange before its own refusals
        check_own_devices(cuda_devices_used(dev), world)
    accelerator = "cuda" if dev.type == "cuda" else "cpu"
    if trainer_precision(precision, dev) != precision:
        say(f"precision {precision} runs as {trainer_precision(precision, dev)} on {dev.type}, as Lightning runs it")
        precision = trainer_precision(precision, dev)
    plugin = precision_plugin(precision, dev)
    # pipelines train only in some precisions (PipelineStrategy refuses the others at setup)
    strategies = STRATEGIES if precision in PIPELINE_PRECISIONS else ("dp_ga",)

    # -- profile (every rank; rank 0's profile is the one planned on) -----------------------------
    sizes = list(micro_batch_sizes) if micro_batch_sizes else default_bench_micro_batch_sizes(global_batch_size)
    def take_profile(when: str, *, first: bool = False) -> Profile:
        torch.manual_seed(0)
        module = plugin.convert_module(make_module())  # the weights' dtype for the '*-true' precisions, as the Trainer converts them
        if first:  # a global batch no plan can factor on this world size, refused before minutes of profiling
            layers = discover_layers(module)
            check_batch_before_profiling(world_size=world_size, global_batch_size=global_batch_size, n_layers=len(layers.names),
                                         split_reason=None if layers.spec is not None else layers.split_reason, strategies=strategies)
        say(f"profiling {when} on {dev} at micro-batch sizes {sizes} (world size {world})")
        taken = profile_module(module, train_loader, micro_batch_sizes=sizes, device=dev, repeats=profile_repeats, measure_links=False,
                               precision_plugin=plugin)
        del module
        if world > 1:
            say(f"measuring the links at {[s >> 10 for s in link_sizes]} KiB")
            links = measure_links(sizes_bytes=link_sizes, repeats=5)
            # the pipelining runtime's own cost per slot, over the same group (CPU; None on CUDA)
            slot = pipeline_slot_for(links, dev.type)
            taken = dataclasses.replace(taken, links=links, framework=dataclasses.replace(taken.framework, pipeline_slot_s=slot))
        taken = Profile.from_dict(_broadcast(taken.to_dict()), source="rank 0's profile")
        for link in taken.links:
            say(f"  {link.kind}: latency {link.latency_s * 1e6:.0f} us, bandwidth {link.bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s (R² {link.r2:.3f})")
        if taken.framework.pipeline_slot_s is not None:
            say(f"  pipelining runtime: {format_ms(taken.framework.pipeline_slot_s)} ms per micro-batch slot beyond the hand-over")
        return taken

    profile = take_profile("before the runs", first=True)
    profiles = [profile]
    pooled_after: list[int] = []  # the passes after which a profile was taken and pooled
    left_out: list[dict[str, Any]] = []  # those taken after a pass that could not be pooled with the first

    # -- plan --------------------------------------------------------------------------------------
    # the ranks on one machine (torchrun's LOCAL_WORLD_SIZE; the Trainer's devices): on a CPU profile they share its RAM,
    # as auto_plan shares it among a node's ranks, not the whole job's over several machines
    local = ranks_per_machine(world)
    candidates = rank_plans(profile, world_size=world_size, global_batch_size=global_batch_size, strategies=strategies,
                            hardware=planning_hardware(profile, world))
    chosen = select_candidates(candidates, plans)
    if not chosen:
        raise InfeasiblePlanError(
            f"None of the {len(candidates)} plans for world size {world_size} and global batch {global_batch_size} is predicted to fit in memory.",
            hint="Lower --global-batch-size or use a bigger device.",
        )
    counts = [timed_steps(steps, min_time_s, c.prediction.step_time_s) for c in chosen]
    timed = f"{steps}" if max(counts) == steps else f"{min(counts)}-{max(counts)} (at least {steps}, about {min_time_s:g} s)"
    say(f"{len(candidates)} candidate plans, running {len(chosen)} for {warmup}+{timed} optimizer steps each" + (f", in {passes} passes" if passes > 1 else ""))

    # -- run --------------------------------------------------------------------------------------
    needed = check_dataset_size(len(dataset), global_batch_size=global_batch_size, warmup=warmup, timed=max(counts))
    # the loader's length is a pass's (or the dataset's); its distinct samples are the (warm-up + --steps) global batches a
    # pass read before --min-time could ask for up to 200 steps
    cached = _CachedDataset(dataset, needed, distinct=(warmup + steps) * global_batch_size)
    collate = getattr(train_loader, "collate_fn", None)

    def make_loader(batch_size: int) -> DataLoader:
        return DataLoader(cached, batch_size=batch_size, shuffle=False, drop_last=True, collate_fn=collate)

    def seeded_module() -> pl.LightningModule:
        torch.manual_seed(0)
        return make_module()

    # the step the predictions rest on: the whole-step fit at the largest profiled micro-batch
    check_m = max(x.micro_batch_size for x in profile.step.samples)
    profiled_check = profile.step.forward(check_m) + profile.step.backward(check_m)
    host_checks: list[dict[str, Any]] = []

    def check_host(after_pass: int) -> None:
        # The same whole-step timing as the profile, again: roughly how much faster or slower the host runs
        # now than while it was profiled (a shared machine drifts; every prediction inherits the profile's
        # speed). One timing of ~0.25 s: on a noisy CPU host it is itself good to about ±10%.
        seconds = max(_gather(_retime_step(seeded_module, train_loader, check_m, dev, plugin)))
        host_checks.append({"after_pass": after_pass, "micro_batch_size": check_m, "profiled_s": profiled_check,
                            "retimed_s": seconds, "ratio": seconds / profiled_check if profiled_check > 0 else None})
        say(f"host check after pass {after_pass}: the m={check_m} step took {format_ms(seconds, 1)} ms, "
            f"{seconds / profiled_check:.2f}x its profiled {format_ms(profiled_check, 1)} ms")

    control = _control_group(rank_timeout_s)  # the runs' results cross here: a rank left waiting gives up
    stopped: list[str] = []  # why the runs stopped early: a plan not every rank finished (see _gather_run)
    nodes = max(1, world // local)
    walls = [0.0] * len(chosen)

    def run_once(i: int, step_time_s: float, where: str) -> dict[str, Any]:
        """Train ``chosen[i]`` for warmup + its timed steps on every rank; its slowest-rank numbers."""
        plan = chosen[i].plan
        t0 = time.perf_counter()
        mine = measure_plan(
            plan, make_module=seeded_module, make_loader=make_loader, steps=counts[i], warmup=warmup,
            accelerator=accelerator, devices=local, num_nodes=nodes, precision=precision,
            find_unused_parameters=bool(profile.unused_parameters),
        )
        try:
            others = [c.rank for c in chosen if c.rank != chosen[i].rank]  # what the hint suggests running instead
            got = combine_ranks(_gather_run(mine, control, timeout_s=rank_timeout_s, plan=f"{plan.describe()} (planner rank {chosen[i].rank})",
                                            others=others), warmup=warmup)
        except BenchError as err:
            # A rank failed alone and the others wait in a collective: no further plan can run in this group. The
            # group goes (no collective runs after this), and the plans measured so far are the result.
            stopped.append(str(err))
            # the same text on every rank (whichever writes the result): each rank's own error is in its log
            got = combine_ranks([{**mine, "error": f"did not finish on every rank within {rank_timeout_s:g} s (one rank failed alone; "
                                  "each rank's error is in the log)"}], warmup=warmup)
            _leave_group()
        walls[i] += time.perf_counter() - t0
        shown = "failed: " + str(got["error"]) if got["error"] else (
            f"measured {format_ms(got['measured_step_time_s'], 1)} ms, predicted {format_ms(step_time_s, 1)} ms "
            f"({relative_error(step_time_s, got['measured_step_time_s']):+.1%})"
        )
        say(f"[{where}] rank {chosen[i].rank} {plan.describe()}: {shown}")
        return got

    runs: list[list[dict[str, Any]]] = [[] for _ in chosen]
    for p in range(passes):
        order = range(len(chosen)) if p % 2 == 0 else range(len(chosen) - 1, -1, -1)
        for k, i in enumerate(order):
            if runs[i] and runs[i][-1]["error"]:
                continue  # a plan that failed once is not run again
            where = f"pass {p + 1}/{passes} " if passes > 1 else ""
            runs[i].append(run_once(i, chosen[i].prediction.step_time_s, f"{where}{k + 1}/{len(chosen)}"))
            if stopped:
                break
        if stopped:
            say(f"stopped: {stopped[0]}")
            break
        check_host(p + 1)
        if reprofile:
            again = take_profile(f"again after pass {p + 1}")
            why = unpoolable_reason(profile, again)
            if why is None:
                profiles.append(again)
                pooled_after.append(p + 1)
            else:  # e.g. a size that fitted before ran out of memory now: average only what was measured alike
                say(f"the profile after pass {p + 1} cannot be averaged with the first ({why}); predicting without it")
                left_out.append({"after_pass": p + 1, "reason": _unpoolable(why), "profile": again.to_dict()})
    # predictions from the mean of the profiles, which span the runs' stretch of time (with one: the first)
    pooled = pool_profiles(profiles)
    graded = predict_ranked(pooled, [cand.plan for cand in candidates], ranks_per_host=local)  # ranks among all candidates, as the first profile's
    index = {id(cand): i for i, cand in enumerate(candidates)}
    regraded = [graded[index[id(cand)]] for cand in chosen]
    records = []
    for i, cand in enumerate(chosen):
        if not runs[i]:
            continue  # the runs stopped before this plan's turn
        plan, pred = cand.plan, regraded[i][0]
        got = combine_passes(runs[i])
        err = relative_error(pred.step_time_s, got["measured_step_time_s"])
        mem_err = relative_error(pred.peak_memory_bytes, got["measured_peak_memory_bytes"])
        first_err = relative_error(cand.prediction.step_time_s, got["measured_step_time_s"])
        records.append({
            "rank": regraded[i][1],
            "plan": plan.describe(),
            **plan.layout(),
            "predicted_step_time_s": pred.step_time_s,
            "predicted_breakdown": dict(pred.breakdown),
            "predicted_stage_times_s": list(pred.stage_times_s),
            "predicted_peak_memory_bytes": pred.peak_memory_bytes,
            "predicted_memory_breakdown": dict(pred.memory_breakdown),
            **got,
            "step_time_error": err,
            "abs_step_time_error": None if err is None else abs(err),
            "memory_error": mem_err,
            "wall_s": walls[i],
            "timed_steps_per_pass": counts[i],
            "plan_json": plan.to_dict(),
            "first_profile": {
                "rank": cand.rank,
                "predicted_step_time_s": cand.prediction.step_time_s,
                "predicted_peak_memory_bytes": cand.prediction.peak_memory_bytes,
                "step_time_error": first_err,
                "abs_step_time_error": None if first_err is None else abs(first_err),
            },
        })
    confirm_stopped = None  # why the confirmation passes stopped early: they then give no verdict
    if confirm and not stopped:
        # The predictions (and so the picks) are final; the contenders run again and only these
        # runs judge the pick's regret (summary["confirmed"]).
        contenders = confirm_candidates(records)
        say(f"confirmation: {len(contenders)} contenders for the measured best run {confirm} more pass(es): "
            + ", ".join(f"rank {records[i]['rank']}" for i in contenders))
        again: dict[int, list[dict[str, Any]]] = {i: [] for i in contenders}
        for p in range(confirm):
            order = contenders if p % 2 == 0 else contenders[::-1]
            for k, i in enumerate(order):
                if not (again[i] and again[i][-1]["error"]) and not stopped:
                    again[i].append(run_once(i, records[i]["predicted_step_time_s"], f"confirm {p + 1}/{confirm} {k + 1}/{len(order)}"))
        if stopped:
            say(f"stopped: {stopped[0]}")
            confirm_stopped = stopped[0]
        for i, got in ((i, combine_passes(again[i])) for i in contenders if again[i]):
            records[i].update(confirm_step_time_s=got["measured_step_time_s"], confirm_step_times_s=got["measured_step_times_s"],
                              confirm_pass_step_times_s=got["measured_pass_step_times_s"], confirm_error=got["error"], wall_s=walls[i])
    if control is not None and not stopped:
        import torch.distributed as dist

        dist.destroy_process_group(control)
    records.sort(key=lambda r: r["rank"])
    summary = summarize(records, within=WITHIN, confirm_stopped=confirm_stopped)
    result = {
        "schema": RESULT_SCHEMA,
        "model": profile.model,
        "world_size": world_size,
        "ranks_per_host": local,  # the ranks on one machine the plans were priced with (a replay prices them alike)
        "global_batch_size": global_batch_size,
        "steps": steps,
        "min_time_s": min_time_s,
        "warmup": warmup,
        "passes": passes,
        "confirm_passes": confirm,
        "plans_selection": plans,
        "device": {"type": profile.device.type, "name": profile.device.name},
        "accelerator": accelerator,
        "memory_metric": memory_metric(dev),
        "step_time_metric": "median over timed steps (of all passes) of the slowest rank's wall time between optimizer steps"
        + (" (cuda-synchronised)" if dev.type == "cuda" else ""),
        "links": [dataclasses.asdict(link) for link in pooled.links],
        "n_candidates": len(candidates),
        "candidates_not_run": [  # ranked as the run plans are (from the profile the predictions rest on)
            {"rank": graded[i][1], "plan": c.plan.describe(), "feasible": graded[i][0].feasible, "predicted_step_time_s": graded[i][0].step_time_s,
             "first_profile_rank": c.rank}
            for i, c in enumerate(candidates)
            if c not in chosen or not runs[chosen.index(c)]
        ],
        "stopped": stopped[0] if stopped else None,
        "plans": records,
        "summary": summary,
        "summary_first_profile": summarize(first_profile_view(records), within=WITHIN, confirm_stopped=confirm_stopped),
        "host_checks": host_checks,
        "profile": pooled.to_dict(),
        "profiles": [p.to_dict() for p in profiles],
        "profiles_left_out": left_out,
        "prediction_profile": prediction_label(pooled_after, [x["after_pass"] for x in left_out], passes=passes),
        "provenance": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "precision": precision,
            # versions (transformers' when installed) and, from a git checkout, the commit and its uncommitted changes
            **code_provenance(),
            "wall_s": time.perf_counter() - started,
            **(meta or {}),
        },
    }
    return result
