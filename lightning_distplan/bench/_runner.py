"""Run one plan for real with a fresh Lightning Trainer and measure its step time and peak memory.

Every rank of the live process group calls :func:`measure_plan` for the same plan, in the same
order; the Trainer's strategy (``DPGAStrategy`` / ``PipelineStrategy``) joins the existing group
(Lightning's ``_init_dist_connection`` returns early when one is initialised), so candidates run
back to back in the same processes.

What is measured:

* step time: wall time between consecutive optimizer steps (``on_train_batch_end`` where
  ``trainer.global_step`` advanced; the first interval starts at the first ``on_train_batch_start``),
  after ``torch.cuda.synchronize`` on GPU. Per step the slowest rank counts (a step ends when the
  last rank's collective ends), and the plan's time is the median over the ``steps`` steps after
  ``warmup``. With several passes (``run_bench(passes=...)``) the timed steps of every pass are
  pooled and the median is taken over all of them (:func:`combine_passes`).
* peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before the model is built) less
  what was allocated then, after :func:`settle_cuda_memory` let an earlier plan's leftovers go;
  on CPU the growth of the resident set (``VmHWM`` after the run minus ``VmRSS`` before the model
  was built, after ``malloc_trim`` and a reset of the high-water mark through
  ``/proc/self/clear_refs``). The CPU number therefore also counts allocator slack, Lightning and
  gloo buffers; it is the closest thing to "memory this plan needs" a CPU offers.
  The larger rank's number counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import statistics
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_distplan.plan import Plan

__all__ = ["measure_plan", "memory_metric", "build_strategy", "combine_ranks", "combine_passes"]

log = logging.getLogger(__name__)


def memory_metric(device: torch.device) -> str:
    """Name of what ``measured_peak_memory_bytes`` means on ``device``."""
    return "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_rss_high_water_growth"


def _proc_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_cpu_peak() -> int | None:
    """Return freed memory to the OS, reset the RSS high-water mark, and return the RSS in bytes."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS (proc(5))
    except OSError:
        return None
    rss = _proc_kib("VmRSS")
    return None if rss is None else rss * 1024


def settle_cuda_memory(device: torch.device) -> int:
    """Bytes allocated on ``device`` once an earlier run's leftovers are gone (after a barrier on the
    default process group, when there is one).

    A fit's last gradient all-reduces keep their DDP bucket tensors allocated after ``fit`` returns,
    until the process group runs another collective. Seen on an H100 (NCCL, one device): the whole
    gradient size (1.34 GB for BERT-Large) stayed allocated through 2 s of waiting and was freed
    during the next plan's run (so the bytes allocated when that run began are no baseline to
    subtract), and a barrier freed all of it at once (``benchmarks/cuda_memory/``).
    """
    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def build_strategy(plan: Plan, *, find_unused_parameters: bool = False) -> Any:
    """This package's Lightning strategy for ``plan`` (dp_ga, or gpipe / 1f1b incl. hybrid dp×pp); a dp_ga plan's
    DistributedDataParallel looks for parameters the loss leaves without a gradient when told to (as auto_plan does
    for a model whose profile found some)."""
    if plan.strategy == "dp_ga":
        from lightning_distplan.strategies import DPGAStrategy

        return DPGAStrategy(plan=plan, find_unused_parameters=find_unused_parameters)  # False: DDP's own default
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    return PipelineStrategy(plan=plan, schedule=plan.strategy)


def measure_plan(
    plan: Plan,
    *,
    make_module: Callable[[], pl.LightningModule],
    make_loader: Callable[[int], DataLoader],
    steps: int,
    warmup: int,
    accelerator: str,
    devices: int,
    num_nodes: int,
    precision: str = "32-true",
    find_unused_parameters: bool = False,
) -> dict[str, Any]:
    """Train ``plan`` for ``warmup + steps`` optimizer steps with a fresh module and Trainer on this rank.

    Args:
        plan: the plan to run.
        make_module: builds a fresh LightningModule (same seed on every rank and call).
        make_loader: per-replica batch size -> the training DataLoader (Lightning shards it).
        steps: timed optimizer steps.
        warmup: untimed optimizer steps first.
        accelerator: ``"cpu"`` or ``"cuda"``.
        devices: processes per node.
        num_nodes: nodes.
        precision: ``Trainer(precision=...)``.
        find_unused_parameters: see :func:`build_strategy`.

    Returns:
        This rank's raw numbers: ``step_times_s`` (all steps, warm-up included), ``peak_memory_bytes``,
        ``baseline_memory_bytes`` (CUDA: bytes allocated when the run began, not in the peak; CPU:
        the resident set then) and ``error`` (``None`` when the run worked).
    """
    import lightning.pytorch as pl_

    from lightning_distplan.profiling._overhead import QUIET_FIT, StepTimer

    device = torch.device("cuda", torch.cuda.current_device()) if accelerator == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        base = settle_cuda_memory(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        base = _reset_cpu_peak()
    timer = StepTimer()
    error = None
    flushes = 1 if plan.strategy == "dp_ga" else plan.accumulate_grad_batches  # a pipeline's per step; 1 in planned plans
    try:
        module = make_module()
        trainer = pl_.Trainer(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            strategy=build_strategy(plan, find_unused_parameters=find_unused_parameters),
            max_steps=warmup + steps,
            max_epochs=-1,
            callbacks=[timer],
            accumulate_grad_batches=flushes,
            **QUIET_FIT,
        )
        try:
            trainer.fit(module, train_dataloaders=make_loader(plan.global_batch_size // (plan.dp * flushes)))
        except SystemExit:
            if not trainer.interrupted:
                raise
            # Lightning turns a Ctrl-C into sys.exit(1) with SIGINT ignored: it stops the whole bench, as one
            # during profiling does ("interrupted; no result file was written", status 130), not a bare exit 1.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt from None
        if trainer.global_step != warmup + steps:
            error = f"ran {trainer.global_step} optimizer steps, expected {warmup + steps} (the dataset is too small?)"
    except Exception as err:  # a failed plan is data for the report, not the end of the benchmark
        if isinstance(err, torch.distributed.DistError):
            raise  # a broken process group (a rank gone, a link down) ends the job: no later plan could run or be compared
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        log.warning("plan %s failed%s: %s", plan.describe(), _on_rank(), error)
    if device.type == "cuda":
        peak = max(0, int(torch.cuda.max_memory_allocated(device)) - base)
    else:
        hwm = _proc_kib("VmHWM")
        peak = None if base is None or hwm is None else max(0, hwm * 1024 - base)
    module = trainer = None  # noqa: F841 — free this plan's model before the next one
    gc.collect()
    return {"step_times_s": timer.step_times, "peak_memory_bytes": peak, "baseline_memory_bytes": base, "error": error,
            "pid": os.getpid(), "group": _group_id()}


def _on_rank() -> str:
    """`` on rank N`` in a distributed job (which rank failed matters when one fails alone), else ``""``."""
    import torch.distributed as dist

    return f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""


def _group_id() -> str | None:
    """Identity of the default process group, to show every plan ran in the same group (none: not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return f"{id(dist.distributed_c10d._get_default_group()):x}"


def combine_ranks(per_rank: list[dict[str, Any]], *, warmup: int) -> dict[str, Any]:
    """One plan's numbers from every rank's: per step the slowest rank, median over timed steps."""
    errors = [r["error"] for r in per_rank if r["error"]]
    lengths = {len(r["step_times_s"]) for r in per_rank}
    out: dict[str, Any] = {"error": errors[0] if errors else None, "rank_pids": [r.get("pid") for r in per_rank],
                           "process_groups": [r.get("group") for r in per_rank]}
    if errors or not lengths or min(lengths) <= warmup:
        out.update(measured_step_time_s=None, measured_step_times_s=[], measured_peak_memory_bytes=None)
        if not errors:
            out["error"] = "no timed optimizer steps were recorded"
        return out
    n = min(lengths)
    slowest = [max(r["step_times_s"][i] for r in per_rank) for i in range(n)]
    timed = slowest[warmup:]
    peaks = [r["peak_memory_bytes"] for r in per_rank if r["peak_memory_bytes"] is not None]
    out.update(
        measured_step_time_s=statistics.median(timed),
        measured_step_times_s=timed,
        warmup_step_times_s=slowest[:warmup],
        measured_peak_memory_bytes=max(peaks) if peaks else None,
        per_rank_peak_memory_bytes=[r["peak_memory_bytes"] for r in per_rank],
    )
    return out


def combine_passes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One plan's numbers from its runs in several passes (each from :func:`combine_ranks`).

    The timed steps of all passes are pooled and their median is the plan's step time: passes run
    minutes apart, so a slow spell of a shared host weighs on one pass of a plan, not on all of it.
    ``measured_pass_step_times_s`` keeps each pass's own median. The first failed pass decides the error.
    """
    out = dict(runs[0])
    failed = [r for r in runs if r["error"]]  # combine_ranks gives every run without a measurement an error
    if failed:
        out.update(failed[0])
        out.update(measured_step_time_s=None, measured_step_times_s=[], measured_peak_memory_bytes=None,
                   passes=len(runs), measured_pass_step_times_s=[r["measured_step_time_s"] for r in runs])
        return out
    timed = [t for r in runs for t in r["measured_step_times_s"]]
    peaks = [r["measured_peak_memory_bytes"] for r in runs if r["measured_peak_memory_bytes"] is not None]
    per_rank = [r["per_rank_peak_memory_bytes"] for r in runs]
    out.update(
        measured_step_time_s=statistics.median(timed),
        measured_step_times_s=timed,
        warmup_step_times_s=[t for r in runs for t in r["warmup_step_times_s"]],
        measured_peak_memory_bytes=max(peaks) if peaks else None,
        per_rank_peak_memory_bytes=[max((p[i] for p in per_rank if p[i] is not None), default=None) for i in range(len(per_rank[0]))],
        passes=len(runs),
        measured_pass_step_times_s=[r["measured_step_time_s"] for r in runs],
    )
    return out
