"""``profile_module``: measure a LightningModule on the real device and return a :class:`Profile`."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from lightning_distplan._format import format_ms
from lightning_distplan._layers import chain_output, discover_layers
from lightning_distplan.errors import BatchFormatError, DistPlanError, InfeasiblePlanError, ModelSplitError, first_line
from lightning_distplan.profile import (
    FrameworkProfile,
    LayerProfile,
    LinearFit,
    MemoryProfile,
    OptimizerProfile,
    Profile,
    SharedParameters,
    StepProfile,
    TimingSample,
)
from lightning_distplan.profiling._batches import SampleBank, device_bytes, move_to
from lightning_distplan.profiling._device import device_info, resolve_device, tf32_switches
from lightning_distplan.profiling._errors import ProfilingError
from lightning_distplan.profiling._links import _device_for
from lightning_distplan.profiling._recorder import LayerRecorder, RunRecord, _storage_key
from lightning_distplan.profiling._snapshot import ModuleSnapshot, OptimizerSnapshot, RNGSnapshot

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

__all__ = ["profile_module", "default_micro_batch_sizes"]

log = logging.getLogger(__name__)

# Default sizes stop growing once one forward+backward would take longer than this, so profiling a
# big model on a CPU stays in seconds; the fit still gets >= 3 sizes (smaller ones are added instead).
_MAX_STEP_S = 1.5
_MIN_SIZES = 3
_MIN_R2 = 0.9  # below this the linear model t(m) = α·m + β is a poor description: warn


_MAX_REPEATS = 100
"""At most this many timed whole-step runs per size when ``min_timed_s`` asks for more than ``repeats``.

Only steps under ``min_timed_s / 100`` (2.5 ms by default) reach it; the timing itself stays within
``min_timed_s``. It was 15: a 4 ms step was then timed over 60 ms only, and on the shared 2-vCPU
host such a window is off by ±10–15% (blocks of 20 runs of one step, timed back to back)."""


def default_micro_batch_sizes(loader_batch_size: int) -> list[int]:
    """Powers of two around the loader's batch size b: b/2, b, 2b, 4b (at least 1; >= 3 distinct sizes).

    Spanning a factor of 8 keeps the linear fit t(m) = α·m + β (seed 000 §III-B) well conditioned
    for both α and β, so unprofiled sizes inside and just outside the range are predicted well.
    """
    b = max(1, int(loader_batch_size))
    sizes = sorted({max(1, b // 2), b, 2 * b, 4 * b})
    while len(sizes) < 4:
        sizes.append(2 * sizes[-1])
    return sizes


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if isinstance(err, RuntimeError):
        text = str(err)
        return "out of memory" in text.lower() or "can't allocate memory" in text or "DefaultCPUAllocator" in text
    return isinstance(err, MemoryError)


def _is_size_error(err: BaseException) -> bool:
    """The model rejects this micro-batch size itself (BatchNorm in training needs > 1 sample per channel)."""
    return isinstance(err, ValueError) and "Expected more than 1 value per channel" in str(err)


def _dist_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _reduce(value: float, op: str) -> float:
    """All ranks agree on ``value`` (max or min); identity when not distributed."""
    if _dist_group_size() <= 1:
        return value
    return _reduce_all([value], op)[0]


def _reduce_all(values: Sequence[float], op: str) -> list[float]:
    """Element-wise max or min of ``values`` over all ranks, in one all-reduce (every rank calls it with as many)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=_device_for(None))  # the default group's, as measure_links
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    except RuntimeError as err:  # gloo's 'Connection closed by peer', a timeout, NCCL's abort: not this rank's training_step
        raise ProfilingError(
            f"Another process of this run failed or left while the processes were profiling together ({type(err).__name__}: "
            f"{first_line(err)[:200].rstrip('.')}).",
            hint="Its own error is in its output (under torchrun, look for the first rank that failed); fix that one and re-run.",
        ) from err
    return [float(x) for x in t.tolist()]


def _agree_on_memory(record: RunRecord) -> None:
    """Every rank takes, per layer, the most bytes any rank counted in this size's counting run (in place; identity when
    not distributed). The ranks count their own samples, whose shapes may differ (a text batch padded to its own
    longest sequence), and the profile global rank 0 plans with held its own counts only, so a plan that fits rank 0's
    shorter samples could run out of memory on another rank."""
    if _dist_group_size() <= 1:
        return
    fields = ("saved_bytes", "output_bytes", "output_saved_bytes", "output_saved_later_bytes")
    values = [float(x) for name in fields for x in getattr(record, name)] + [float(record.total_saved_bytes)]
    agreed = [int(x) for x in _reduce_all(values, "max")]
    n = len(record.saved_bytes)
    for i, name in enumerate(fields):
        setattr(record, name, agreed[i * n : (i + 1) * n])
    record.total_saved_bytes = agreed[-1]


class SkippedBatchError(ProfilingError):
    """``training_step`` returned None: Lightning's "skip this batch", so there is no step to time on these samples."""


def _skipped_everywhere(name: str) -> SkippedBatchError:
    return SkippedBatchError(
        f"{name}.training_step returned None (Lightning's 'skip this batch') on every micro-batch the profiler tried, "
        "so there is no step to time.",
        hint="Let the first batches be ones it trains on (shuffle=True, or drop such samples in the dataset), or train with strategy='ddp'.",
    )


def _loss_in(out: Any) -> Any:
    """The loss in what a training step returned: ``out["loss"]`` of any mapping, as Lightning's ClosureResult reads it."""
    return out.get("loss") if isinstance(out, Mapping) else out


def _extract_loss(out: Any, name: str) -> Tensor:
    loss = _loss_in(out)
    if out is None:  # the callers move on to other samples (or sizes) and re-raise it once nothing is left
        raise _skipped_everywhere(name)
    if not isinstance(loss, Tensor):
        raise ProfilingError(
            f"{name}.training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'.",
            hint="Return the scalar loss (or {'loss': loss}) from training_step.",
        )
    if loss.numel() != 1:
        # Lightning's backward (loss.backward()) and the pipeline's (_check_scalar_loss) refuse it: averaging it here
        # profiled a model that a fit then stopped at its first step ("grad can be implicitly created only for scalar outputs")
        raise ProfilingError(
            f"{name}.training_step returned a loss of shape {tuple(loss.shape)}, and Lightning's backward needs a scalar loss.",
            hint="Reduce the loss in training_step, e.g. F.cross_entropy(..., reduction='mean') or loss.mean().",
        )
    if not loss.requires_grad:
        raise ProfilingError(
            f"The loss returned by {name}.training_step does not require grad, so there is no backward to profile.",
            hint="Make sure training_step computes the loss from the module's trainable parameters.",
        )
    return loss


_LOSS_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}
"""How far the pipeline's loss may be from training_step's (relative) before it counts as another loss: a few hundred
times float32's rounding of the same arithmetic in another order (label smoothing 0.1 on a fresh ResNet-18 moves the
loss by 7e-4); 1e-2 when the weights or the precision are 16-bit, which catches only larger differences."""


def _pipeline_loss_difference(prof: _Profiler, m: int) -> tuple[str | None, bool]:
    """:func:`loss_difference` on the profiler's micro-batch of ``m`` samples, and whether the pipeline's chain itself
    raised (it cannot run on these batches: a dict fed to an ``nn.Sequential``) or gave a loss that is not a scalar,
    which the pipeline's last stage refuses (``_check_scalar_loss``); the per-layer pass then runs ``training_step``.
    Where the pipeline's own rules refused the batch (:func:`~lightning_distplan._layers.first_layer_args`: a
    PackedSequence or a None as the first layer's inputs) or a layer's output (:func:`~lightning_distplan._layers.check_crossing`:
    a None in a tuple that would cross to the next stage), the reason is the pipeline's sentence, as a fit would say it."""
    chain_failed: list[Exception] = []

    def chain() -> Any:
        try:
            out = prof.chain_output(m)
            loss = _loss_in(out)
            if isinstance(loss, Tensor) and loss.numel() != 1:
                raise ValueError(f"the pipeline's loss is a tensor of shape {tuple(loss.shape)}, not a scalar")
            return out
        except Exception as err:
            chain_failed.append(err)
            raise

    differs = loss_difference(
        prof.module, lambda: prof.step_output(m), chain, devices=[prof.device] if prof.cuda else [],
        params=prof.params, precision=str(getattr(prof.precision_plugin, "precision", "32-true")),
    )
    if chain_failed and isinstance(chain_failed[0], (BatchFormatError, ModelSplitError)):
        differs = str(chain_failed[0]).rstrip(".")  # not "comparing the losses failed ... define pipeline_loss"
    return differs, bool(chain_failed)


def loss_difference(
    module: nn.Module, step_output: Callable[[], Any], chain_output: Callable[[], Any], *,
    devices: Sequence[torch.device], params: Sequence[Tensor], precision: str,
) -> str | None:
    """Why a pipeline would train another loss than ``training_step``, or None when both agree on one micro-batch.

    A pipeline never calls ``training_step``: it computes ``spec.loss`` on the last block's output, and a built-in
    adapter guesses that loss (cross-entropy for a torchvision classifier). A user whose ``training_step`` adds label
    smoothing or a penalty would silently train another objective under a pipeline plan. Both losses
    (``step_output()``, ``chain_output()``) are computed in eval mode (no dropout, BatchNorm's running statistics
    read, not updated) from the same random state, so the same objective gives the same number; gradients stay on
    for a step that differentiates (a gradient penalty). A comparison that fails (a step that needs train mode)
    counts as a difference, with the reason."""
    modes = [(sub, sub.training) for sub in module.modules()]
    values: list[float] = []
    try:
        module.eval()
        for compute in (step_output, chain_output):
            with torch.random.fork_rng(devices=list(devices)):
                torch.manual_seed(0)
                out = compute()
            loss = _loss_in(out)
            if not isinstance(loss, Tensor):
                return None  # training_step's own answer is judged (and refused) by the profiling that follows
            values.append(float(loss.detach().float().mean()))
            del out, loss
    except Exception as err:
        return (f"comparing the pipeline's loss with training_step's in eval mode failed ({type(err).__name__}: "
                f"{first_line(err)[:120]}), so it is not known that a pipeline trains the same objective; define "
                "pipeline_loss(output, batch) as training_step computes it, and a step that runs in eval mode")
    finally:
        for sub, training in modes:
            sub.training = training
    step, chain = values
    half = any(p.dtype in (torch.float16, torch.bfloat16) for p in params) or "16" in precision
    rtol = 1e-2 if half else _LOSS_RTOL.get(next((p.dtype for p in params), torch.float32), _LOSS_RTOL[torch.float32])
    if abs(step - chain) <= rtol * max(abs(step), abs(chain)) + 1e-6:
        return None
    source = "the module's pipeline_spec()" if callable(getattr(module, "pipeline_spec", None)) else (
        "its pipeline_loss()" if callable(getattr(module, "pipeline_loss", None)) else "the built-in adapter's guess")
    return (f"the pipeline's loss ({source}) is {chain:.6g} where training_step's is {step:.6g} on the same micro-batch, "
            "so a pipeline would train another objective; define pipeline_loss(output, batch) as training_step computes it")


def _optimizers_from(conf: Any) -> list[torch.optim.Optimizer]:
    """The optimizer(s) of any form ``configure_optimizers`` may return (Lightning's documented forms)."""
    if conf is None:
        return []
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, dict):
        return _optimizers_from(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)):
        # ([optimizers], [schedulers]) or [opt, ...] or [{"optimizer": ...}, ...]
        if len(conf) == 2 and isinstance(conf[0], (list, tuple)) and isinstance(conf[1], (list, tuple)):
            return _optimizers_from(conf[0])
        out: list[torch.optim.Optimizer] = []
        for item in conf:
            out += _optimizers_from(item)
        return out
    # lightning's LightningOptimizer wraps the real one
    inner = getattr(conf, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``closure`` argument without a default (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or an odd wrapper: call it as the others
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _unique_bytes(tensors: Iterable[Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        ptr, nbytes = _storage_key(t)
        if ptr not in seen:
            seen.add(ptr)
            total += nbytes
    return total


def _state_tensors(optimizers: Sequence[torch.optim.Optimizer]) -> list[Tensor]:
    """Every tensor in the optimizers' state, also inside lists, tuples and dicts: LBFGS keeps its history there
    (``old_dirs``, ``old_stps``, ``ro``, ``al``), up to ``2 * history_size`` copies of the flat parameters."""
    out: list[Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)

    for opt in optimizers:
        for state in opt.state.values():
            walk(state)
    return out


def _lbfgs_history_to_come(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes an LBFGS history adds beyond what the profiled steps left in it: it grows by one direction and one step
    (each the size of the flat parameters) and one ``ro`` per iteration until ``history_size`` pairs are kept, which
    a fit reaches after a few steps; the profile's few steps may stop short of that."""
    extra = 0
    for opt in optimizers:
        if not isinstance(opt, torch.optim.LBFGS):
            continue
        size = int(opt.param_groups[0].get("history_size", 0))
        for state in opt.state.values():
            dirs, stps, ro = state.get("old_dirs") or [], state.get("old_stps") or [], state.get("ro") or []
            if dirs and stps and ro and len(dirs) < size:
                one = sum(t.numel() * t.element_size() for t in (dirs[0], stps[0], ro[0]))
                extra += (size - len(dirs)) * one
    return extra


class _Profiler:
    def __init__(
        self,
        module: nn.Module,
        batches: Iterable[Any],
        *,
        micro_batch_sizes: Sequence[int] | None,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
        warmup: int,
        repeats: int,
        progress: Callable[[str], None] | None,
        t0: float,
        flop_sizes: int = 2,
        loop_overhead: bool = True,
        min_timed_s: float = 0.25,
        precision_plugin: Any = None,
        datamodule: Any = None,
    ) -> None:
        self.module = module
        self.datamodule = datamodule
        self.bank = SampleBank(batches)
        self.precision_plugin = precision_plugin
        self.explicit_sizes = list(micro_batch_sizes) if micro_batch_sizes is not None else None
        self.device = device
        self.user_optimizer = optimizer
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.t0 = t0
        self.name = type(module).__name__
        self.cuda = device.type == "cuda"
        sig = inspect.signature(module.training_step)
        positional = [
            p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
        self.pass_batch_idx = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional)
        self.params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.unused: dict[str, None] = {}  # trainable parameters a step's loss gave no gradient, in module order
        self._batch_cache: dict[int, Any] = {}
        self._hooks_skipped = False
        self.spec: Any = None
        self.flop_sizes = flop_sizes
        self.loop_overhead = loop_overhead
        self.min_timed_s = max(0.0, float(min_timed_s))
        self.spreads: list[float] = []
        self.agreed = False  # whether this rank took part in the current size's agreement on its timed runs

    # -- helpers ---------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        text = f"[{time.perf_counter() - self.t0:6.1f}s] {message}"
        log.info(text)
        if self.progress is not None:
            self.progress(text)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def batch(self, m: int) -> Any:
        if m not in self._batch_cache:
            self._batch_cache = {m: self.transfer(self.bank.micro_batch(m))}  # keep one on the device
        return self._batch_cache[m]

    def transfer(self, batch: Any) -> Any:
        """What Lightning's training loop makes of a loader batch before ``training_step`` (``training_epoch_loop``):
        the precision plugin's ``convert_input`` (floats to bf16 for 'bf16-true'), then the module's (or, in a fit, the
        datamodule's) ``on_before_batch_transfer``, ``transfer_batch_to_device`` and ``on_after_batch_transfer``. A
        plain ``nn.Module``'s batch is only moved. Moved only, a module whose hook augments, normalises or resizes on
        the device was timed on inputs its training never sees (uint8 images its hook turns into floats failed). Hooks
        that need a Trainer (``self.trainer.training``) outside a fit are skipped with one warning: the batch is moved only."""
        if self.precision_plugin is not None:
            batch = self.precision_plugin.convert_input(batch)
        before = getattr(self.module, "_on_before_batch_transfer", None)
        handler = getattr(self.module, "_apply_batch_transfer_handler", None)
        if not (callable(before) and callable(handler)):
            return move_to(batch, self.device)
        try:
            if self.datamodule is not None and getattr(self.module, "_trainer", None) is None:
                # outside a fit, the hooks a fit would take from the datamodule (where it overrides them), as Lightning's
                # _DataHookSelector picks them; the module's own hooks only ran, so a datamodule's uint8-to-float failed
                from lightning.pytorch.trainer.connectors.data_connector import _DataHookSelector

                selector = _DataHookSelector(self.module, self.datamodule)

                def hook(name: str) -> Callable[..., Any]:
                    return getattr(selector.get_instance(name), name)

                batch = hook("on_before_batch_transfer")(batch, 0)
                batch = hook("transfer_batch_to_device")(batch, self.device, 0)
                return hook("on_after_batch_transfer")(batch, 0)
            return handler(before(batch, dataloader_idx=0), device=self.device, dataloader_idx=0)
        except Exception as err:
            if _is_oom(err):
                raise
            # a LightningModule's self.trainer raises outside a fit; a LightningDataModule's is None, so its hook fails
            # with "'NoneType' object has no attribute 'training'"
            needs_trainer = (isinstance(err, RuntimeError) and "is not attached to a `Trainer`" in str(err)) or (
                self.datamodule is not None and getattr(self.datamodule, "trainer", None) is None
                and isinstance(err, AttributeError) and "'NoneType' object has no attribute" in str(err)
            )
            if needs_trainer:
                # a hook that reads self.trainer (Lightning's `if self.trainer.training:` augmentation pattern) outside a
                # fit: time the batches moved only, as before the hooks ran here, and say so once
                if not self._hooks_skipped:
                    self._hooks_skipped = True
                    log.warning(
                        "%s's batch transfer hooks need a Trainer (%s), so the profiled micro-batches were moved to the device "
                        "without them; what they do in training is not timed. Profile inside the fit (strategy='auto_plan' or "
                        "PlanningCallback()) to time them.", self.name, first_line(err).rstrip("."),
                    )
                return move_to(batch, self.device)
            raise ProfilingError(
                f"{self.name}'s batch transfer hooks (on_before_batch_transfer, transfer_batch_to_device, on_after_batch_transfer), "
                f"which the training loop runs on every batch, failed on a micro-batch of the loader with {type(err).__name__}: "
                f"{first_line(err).rstrip('.')}.",
                hint="Make them run outside a Trainer (guard uses of self.trainer with `self._trainer is not None`, in a datamodule "
                "`self.trainer is not None`), or let the "
                "fit profile: strategy='auto_plan' or PlanningCallback().",
            ) from err

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """What Lightning runs ``training_step`` in: the precision plugin's (autocast for '*-mixed')."""
        return contextlib.nullcontext() if self.precision_plugin is None else self.precision_plugin.train_step_context()

    def step_output(self, m: int) -> Any:
        """What ``training_step`` returns on the micro-batch of ``m`` samples (in the precision plugin's context)."""
        batch = self.batch(m)
        with self.step_context():
            return self.module.training_step(batch, 0) if self.pass_batch_idx else self.module.training_step(batch)

    def chain_output(self, m: int) -> Any:
        """What a pipeline's loss returns on that micro-batch: ``spec.inputs`` -> blocks -> ``spec.loss``, every block's
        output checked to cross to a next stage (a plan may cut after any of them), the last one's to reach the loss."""
        batch = self.batch(m)
        with self.step_context():
            return chain_output(self.spec, batch, cuts=range(1, len(self.spec.layers) + 1))

    def loss(self, m: int) -> Tensor:
        return _extract_loss(self.step_output(m), self.name)

    def chain_loss(self, m: int) -> Tensor:
        """The loss computed the way a pipeline computes it: ``spec.inputs`` -> blocks -> ``spec.loss``.

        Used for the per-layer pass of splittable models, whose blocks may be wrappers that
        ``training_step`` never calls; the whole-step timing always uses ``training_step``.
        """
        return _extract_loss(self.chain_output(m), f"{self.name} (pipeline_spec)")

    def layer_loss(self, m: int) -> Tensor:
        return self.chain_loss(m) if self.spec is not None else self.loss(m)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def note_unused(self) -> None:
        """After ``training_step``'s backward (from cleared gradients): note the trainable parameters it gave no
        gradient, which DistributedDataParallel refuses unless told (``find_unused_parameters=True``)."""
        for name, p in self.named_params:
            if p.grad is None:
                self.unused.setdefault(name)

    def after_oom(self) -> None:
        self.clear_grads()
        self._batch_cache = {}
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- phases ----------------------------------------------------------------------------------
    def time_step(self, m: int, *, warmup: int) -> tuple[float, float, int, int]:
        """Whole-step forward/backward means without layer hooks (after ``warmup`` untimed runs); on CUDA
        the peak allocated bytes and the bytes allocated before the step other than the micro-batch
        itself (weights, optimizer state, no gradients), so ``peak - resident`` is what one
        micro-batch adds at its peak, its input on the device included (0, 0 on CPU). The profiler
        keeps the batch on the device between runs, but in a fit each micro-batch is copied there
        anew (ResNet-101: 0.6 MB per 224x224 image, 14 MB at m = 24).

        The mean, not the median: a training loop pays the average run, and on a shared host the
        run times are skewed to the slow side (occasional slow runs), so the median sits below what
        a loop of many steps takes. Measured on the 2-vCPU CPU cluster host (2 ranks at once, six
        windows of 50 runs of tiny GPT-2 or an MLP): the loop's wall time per run came out 0–23%
        (typically 6–10%) above the median run."""
        fwd: list[float] = []
        bwd: list[float] = []
        resident = 0
        if self.cuda:
            self.clear_grads()
            batch = self.batch(m)
            self.sync()
            resident = int(torch.cuda.memory_allocated(self.device)) - device_bytes(batch, self.device)
            del batch
            torch.cuda.reset_peak_memory_stats(self.device)
        i, runs, started = 0, warmup + self.repeats, None
        while i < runs:
            self.clear_grads()
            self.sync()
            a = time.perf_counter()
            loss = self.loss(m)
            self.sync()
            b = time.perf_counter()
            loss.backward()
            self.sync()
            c = time.perf_counter()
            del loss
            self.note_unused()
            if i >= warmup:
                fwd.append(b - a)
                bwd.append(c - b)
                if started is None:
                    # A short step is cheap to repeat and noisy to time: repeat it until the timed runs
                    # add up to min_timed_s (at most _MAX_REPEATS runs), so its mean is as steady as a long step's.
                    started = self.agree_first_run(c - a)
                    runs = warmup + max(self.repeats, min(_MAX_REPEATS, math.ceil(self.min_timed_s / max(started, 1e-6))))
            i += 1
        totals = [x + y for x, y in zip(fwd, bwd)]
        if len(totals) >= 2:
            self.spreads.append(statistics.pstdev(totals) / statistics.fmean(totals))
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0
        return statistics.fmean(fwd), statistics.fmean(bwd), peak, resident

    def agree_first_run(self, seconds: float | None) -> float:
        """The first timed run's seconds at this size, the slowest rank's when distributed, so every rank times as many
        runs of ``training_step``: one that runs a collective itself (SyncBatchNorm, an ``all_gather`` of embeddings for
        a contrastive loss, a metric synced on step) stays paired across ranks. Each rank sized its loop from its own
        first run before, and one run more on one rank met the profiler's next all-reduce: gloo aborted the process
        ("Received data size doesn't match expected size").

        ``None``: this rank raised before its first timed run at this size (out of memory, a skipped batch); it takes
        part all the same (:meth:`catch_up`), so the profiler's own collectives stay paired too."""
        self.agreed = True
        if _dist_group_size() <= 1:
            return math.inf if seconds is None else seconds
        return _reduce(math.inf if seconds is None else seconds, "max")

    def catch_up(self) -> None:
        """Take part in this size's :meth:`agree_first_run` if this rank did not reach it (it raised before); once per size
        (the main loop clears :attr:`agreed` before each)."""
        if not self.agreed:
            self.agree_first_run(None)

    def count_layers(self, recorder: LayerRecorder, m: int, *, flops: bool) -> RunRecord:
        """One untimed hooked run at ``m``: bytes saved for backward and output bytes per layer, and
        (``flops=True``) FLOPs per layer. It is also the first warm-up at this size (same kernels,
        same shapes), so the whole-step timing that follows needs one warm-up run less."""
        self.clear_grads()
        if not flops:
            return recorder.run(lambda: self.layer_loss(m), count_saved=True, synchronize=self.sync)
        from torch.utils.flop_counter import FlopCounterMode

        from lightning_distplan.profiling._flops import flop_formulas

        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
            return recorder.run(lambda: self.layer_loss(m), count_saved=True, flop_counter=counter, synchronize=self.sync)

    def time_layers(self, recorder: LayerRecorder, m: int) -> list[RunRecord]:
        """``repeats`` timed hooked runs (after :meth:`count_layers` and :meth:`time_step` warmed this size up)."""
        timed = []
        for _ in range(self.repeats):
            self.clear_grads()
            timed.append(recorder.run(lambda: self.layer_loss(m), synchronize=self.sync))
        return timed

    def optimizer_phase(self, optimizers: list[torch.optim.Optimizer], m: int) -> tuple[float, int, int]:
        """Mean ``step()`` + one ``zero_grad()`` with the gradients of the prime step; state bytes; CUDA peak.

        An optimizer whose ``step`` takes a closure it must have (LBFGS, which re-evaluates the model inside its step)
        gets one, as Lightning gives it: ``training_step`` and backward on the prime micro-batch of ``m`` samples. Its
        step time then holds those evaluations, as a fit's does. Called without one it raised a TypeError, reported as
        a failure of ``training_step``, for a model Lightning trains."""
        if not optimizers:
            return 0.0, 0, 0
        times = []
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

        def closure() -> Tensor:
            self.clear_grads()
            loss = self.loss(m)
            loss.backward()
            return loss.detach()

        closures = [closure if _needs_closure(opt) else None for opt in optimizers]
        # gradients stay in place across repeats, so every step does the same work
        for i in range(self.warmup + self.repeats):
            self.sync()
            a = time.perf_counter()
            for opt, given in zip(optimizers, closures):
                opt.step() if given is None else opt.step(given)
            self.sync()
            if i >= max(1, self.warmup):  # the first step allocates the state: never timed
                times.append(time.perf_counter() - a)
        if not times:
            times = [time.perf_counter() - a]
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0
        self.sync()
        a = time.perf_counter()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        self.sync()
        zero = time.perf_counter() - a
        state = _unique_bytes(_state_tensors(optimizers)) + _lbfgs_history_to_come(optimizers)
        return statistics.fmean(times) + zero, state, peak


@contextlib.contextmanager
def _quiet_logging(module: nn.Module):
    """``self.log`` outside a Trainer warns (and inside one would pollute its metrics): make it a no-op."""
    own = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    noop = lambda *args, **kwargs: None  # noqa: E731
    object.__setattr__(module, "log", noop)
    object.__setattr__(module, "log_dict", noop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log.*")
            warnings.filterwarnings("ignore", message=r".*module hierarchy tracking.*")
            warnings.filterwarnings("ignore", message=r".*[Nn]ot attached to a .*Trainer.*")
            yield
    finally:
        for k in ("log", "log_dict"):
            if k in own:
                object.__setattr__(module, k, own[k])
            else:
                module.__dict__.pop(k, None)


def profile_module(
    module: LightningModule,
    batches: Iterable[Any],
    *,
    micro_batch_sizes: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int = 1,
    repeats: int = 3,
    measure_links: bool = True,
    progress: Callable[[str], None] | None = None,
    flop_sizes: int = 2,
    loop_overhead: bool = True,
    min_timed_s: float = 0.25,
    precision_plugin: Any = None,
    datamodule: Any = None,
) -> Profile:
    """Measure ``module`` on the real device and return its :class:`~lightning_distplan.profile.Profile`.

    For each micro-batch size m (built from the loader's real batches, concatenated and sliced to
    exactly m samples) it first runs one untimed hooked step that counts the bytes saved for
    backward and the bytes output per layer (and, at the first ``flop_sizes`` sizes only, FLOPs
    per layer); that run is also the first warm-up at m. Then it times ``training_step``
    (forward) and ``loss.backward()`` without hooks (mean of ``repeats`` after ``warmup - 1``
    further warm-ups), then ``repeats`` times per layer with hooks, and fits every time as
    t(m) = α·m + β (seed 000 §III-B). It also measures parameter/gradient/optimizer-state bytes,
    the optimizer step time and (on CUDA) the peak memory per m. A size that runs out of memory is
    recorded in ``infeasible_micro_batch_sizes``, not raised (all ranks agree when distributed).
    When ``torch.distributed`` is initialised with more than one rank, every rank must call this,
    and the links are measured too; the whole-step times are then the slowest rank's, and the bytes
    saved for backward (and on CUDA the peaks) the largest any rank counted on its own samples.

    Profiling leaves no trace: weights, buffers, gradients, optimizer state, training flags, the
    module's device and all RNG streams are restored afterwards, even on error.

    Args:
        module: the LightningModule (any ``nn.Module`` with ``training_step``).
        batches: a DataLoader or any iterable of batches (tensors, or nested tuples/lists/dicts/dataclasses of
            them; numpy arrays of the batch's rows are cut as tensors, an object holding them as attributes is refused).
        micro_batch_sizes: sizes to time; default: b/2, b, 2b, 4b for the loader's batch size b,
            growing only while a step stays short (see :func:`default_micro_batch_sizes`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; default CUDA when present, else CPU.
        optimizer: measured instead of the one(s) from ``module.configure_optimizers()``.
        warmup: untimed runs at each size before the timed ones (the per-layer counting run is
            the first of them, so at least one always happens).
        repeats: timed runs per size (the whole step keeps their mean, the per-layer times their median).
        min_timed_s: the whole-step timing repeats a short step more often than ``repeats``, until
            its timed runs add up to this many seconds (at most 100 runs): a 5 ms step is timed ~50×
            cheaper than a 250 ms one and is far noisier. 0 = exactly ``repeats`` runs.
        measure_links: measure all-reduce / p2p when distributed (see :func:`measure_links`).
        progress: called with one line per phase (what is measured, elapsed seconds).
        flop_sizes: at how many sizes FLOPs are counted (counting costs a Python call per op, so a
            counting run is several times slower than a step on a CPU). 2: FLOPs per sample are the
            slope between the first two sizes, exact for any F(m) = a·m + c. 1: they are F(m)/m at
            the first size, an estimate that assumes c = 0, i.e. every counted op (matmul,
            convolution, attention) works per sample; a batch-independent FLOP term would be
            spread over m samples.
        loop_overhead: also measure what the training loop itself costs per batch and per optimizer
            step (a tiny real ``Trainer.fit``, ~0.3 s; see
            :func:`~lightning_distplan.profiling._overhead.measure_framework_overhead`).
        precision_plugin: a Lightning precision plugin (``trainer.precision_plugin``): every step runs
            in its ``train_step_context()`` (autocast for ``"bf16-mixed"`` / ``"16-mixed"``) on batches
            passed through its ``convert_input``, as the Trainer runs them. The module is not converted
            here (for ``"bf16-true"`` etc. pass it converted, as ``trainer.strategy`` leaves it). The
            profile's ``device.dtype`` then names the mixed precision instead of the weights' dtype.
        datamodule: the LightningDataModule ``batches`` come from, outside a fit: its batch transfer hooks
            (``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer``) run
            where it overrides them, the module's elsewhere, as ``Trainer.fit(module, datamodule)`` picks
            them. In a fit (the module attached to a Trainer) the Trainer picks them. Outside a fit, hooks that need
            a Trainer (``if self.trainer.training:``) are skipped with one warning: the micro-batches are moved only.

    Returns:
        The Profile (save it with ``profile.save(path)``).

    Raises:
        ProfilingError: the module has no trainable parameters, returns no loss (or one that is not a scalar), its
            batch transfer hooks fail, or the loader yields nothing (or a batch part micro-batches cannot be cut from).
        InfeasiblePlanError: not even a micro-batch of one sample fits in memory.
        DeviceUnavailableError: ``device`` names a device that is not present.

    Example:
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> model = BoringModel()
        >>> profile = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
        >>> len(profile.micro_batch_sizes)
        3
    """
    t0 = time.perf_counter()
    name = type(module).__name__
    if not callable(getattr(module, "training_step", None)):
        raise ProfilingError(f"{name} has no training_step to profile.", hint="Pass a LightningModule.")
    # parameters, and buffers: nn.LazyBatchNorm1d(affine=False) has no parameters, only uninitialized running stats
    lazy = [n for n, p in module.named_parameters() if nn.parameter.is_lazy(p)]
    lazy_buffers = [n for n, b in module.named_buffers() if nn.parameter.is_lazy(b)]
    if lazy or lazy_buffers:  # copying them for the snapshot raised torch's ValueError; materialising them here would leave a trace
        what = "parameters" if not lazy_buffers else "buffers" if not lazy else "parameters and buffers"
        lazy += lazy_buffers
        raise ProfilingError(
            f"{name} has {what} that are not initialized yet ({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}: a lazy "
            "module such as nn.LazyLinear), so their sizes, and the model's memory, are not known before a first forward.",
            hint="Initialize them before the fit: run the module once on a dummy batch in __init__, setup() or configure_model() "
            "(as torch advises for lazy modules).",
        )
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ProfilingError(
            f"{name} has no trainable parameters ({sum(1 for _ in module.parameters())} parameters, none with requires_grad), so there is nothing to train or plan.",
            hint="Profile a model with nn.Parameters (create layers in __init__, or call configure_model()/setup() first).",
        )
    if getattr(module, "automatic_optimization", True) is False:
        raise ProfilingError(
            f"{name} uses manual optimization (automatic_optimization=False); its training_step runs backward itself, so forward and backward cannot be timed apart.",
            hint="Profile a variant with automatic optimization, or pass a wrapper module whose training_step only returns the loss.",
        )
    if flop_sizes not in (1, 2):
        raise ProfilingError(f"flop_sizes ({flop_sizes}) must be 1 or 2.", hint="Use flop_sizes=2 (exact) or 1 (cheaper).")
    if repeats < 1 or warmup < 0:
        raise ProfilingError(f"repeats ({repeats}) must be >= 1 and warmup ({warmup}) >= 0.", hint="Use e.g. warmup=1, repeats=3.")
    if micro_batch_sizes is not None:
        sizes = list(micro_batch_sizes)
        if not sizes or any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in sizes):
            raise ProfilingError(
                f"micro_batch_sizes {sizes!r} must be a non-empty list of positive integers.", hint="Pass e.g. [2, 4, 8]."
            )
        micro_batch_sizes = sorted(set(sizes))
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ProfilingError(
            f"{name} has parameters on several devices ({sorted(map(str, devices))}); the profiler measures one device.",
            hint="Move the module to one device first (module.to('cpu')).",
        )
    dev = resolve_device(device)

    rng = RNGSnapshot.take(include_cuda=dev.type == "cuda")
    snapshot = ModuleSnapshot.take(module)
    user_opt_snapshot = OptimizerSnapshot.take(optimizer) if optimizer is not None else None
    prof = _Profiler(
        module, batches, micro_batch_sizes=micro_batch_sizes, device=dev, optimizer=optimizer,
        warmup=warmup, repeats=repeats, progress=progress, t0=t0,
        flop_sizes=flop_sizes, loop_overhead=loop_overhead, min_timed_s=min_timed_s, precision_plugin=precision_plugin,
        datamodule=datamodule,
    )
    try:
        with _quiet_logging(module):
            return _run(prof, snapshot, measure_links=measure_links)
    except (DistPlanError, KeyboardInterrupt):
        raise
    except Exception as err:  # the user's training_step / loss failed: say where, keep the chain
        out_of_range = isinstance(err, IndexError) and "index out of range" in str(err)
        raise ProfilingError(
            f"Profiling {name} failed in its training step with {type(err).__name__}: {first_line(err).rstrip('.')}.",
            hint=("If an embedding met an id beyond its table, make the model's vocabulary (vocab_size, num_embeddings) "
                  "cover the data's token ids. " if out_of_range else "")
            + "Check that training_step runs on a batch of the loader outside a Trainer (e.g. it must not need self.trainer); "
            "the original traceback is chained to this error.",
        ) from err
    finally:
        prof.bank.close()
        prof._batch_cache = {}
        snapshot.restore()
        if user_opt_snapshot is not None:
            user_opt_snapshot.restore()
        rng.restore()
        if dev.type == "cuda":
            # return profiling's cached blocks to the device; a full gc.collect() first frees tensors
            # held in reference cycles. On the CPU there is no cache to empty, and a full collection
            # (hundreds of ms with torch + lightning loaded) would only run earlier than Python's own.
            gc.collect()
            torch.cuda.empty_cache()


def _run(prof: _Profiler, snapshot: ModuleSnapshot, *, measure_links: bool) -> Profile:
    module, dev = prof.module, prof.device
    world = _dist_group_size()
    module.to(dev)
    module.train()
    discovered = discover_layers(module)
    layer_names = list(discovered.names)
    layer_modules = list(discovered.modules)
    prof.spec = discovered.spec
    if not layer_modules:  # a module that holds its parameters directly: one layer, the whole model
        layer_names, layer_modules = [type(module).__name__], [module]
    b = prof.bank.first_batch_size()
    prof.say(f"profiling {prof.name} on {dev} ({len(layer_modules)} layers, loader batch size {b})")

    # -- optimizer -----------------------------------------------------------------------------
    if prof.user_optimizer is not None:
        optimizers = [prof.user_optimizer]
        if prof.user_optimizer.state:  # state on the old device: load_state_dict casts it to the parameters' device
            prof.user_optimizer.load_state_dict(prof.user_optimizer.state_dict())
    else:
        try:
            optimizers = _optimizers_from(module.configure_optimizers())
        except Exception as err:  # configure_optimizers may need a Trainer (e.g. estimated_stepping_batches)
            raise ProfilingError(
                f"{prof.name}.configure_optimizers() failed outside a Trainer ({type(err).__name__}: {err}).",
                hint="Pass the optimizer to profile explicitly: profile_module(..., optimizer=torch.optim.AdamW(model.parameters())).",
            ) from err
    created_snapshots = [OptimizerSnapshot.take(o) for o in optimizers if o is not prof.user_optimizer]

    # -- sizes -----------------------------------------------------------------------------------
    queue = list(prof.explicit_sizes) if prof.explicit_sizes is not None else default_micro_batch_sizes(b)
    explicit = prof.explicit_sizes is not None
    prof.bank.prefetch(max(queue))  # every sample the timed steps use, read before any is timed
    infeasible: list[int] = []
    skipped: list[int] = []  # sizes the model itself rejects (BatchNorm with one sample): not memory
    unprofiled: list[int] = []  # sizes whose samples training_step skipped (returned None): they train, but were not timed

    # Prime: one forward/backward at the smallest size (warms caches, builds lazy state), then the
    # optimizer steps on those gradients so its state exists for the memory peaks that follow.
    m0 = queue[0]
    while True:
        oom = False
        refused: str | None = None
        try:
            prof.clear_grads()
            loss = prof.loss(m0)
            loss.backward()
            del loss
            prof.note_unused()
        except SkippedBatchError:
            # training_step skipped these samples (returned None): cut the micro-batches from the next ones
            if prof.bank.start + m0 >= prof.bank.collected:
                raise
            prof.bank.start += m0
            prof._batch_cache = {}
            prof.say(f"micro-batch {m0}: training_step skipped it; trying samples {prof.bank.start}..")
            continue
        except Exception as err:
            if _is_size_error(err):
                refused = first_line(err)
            elif not _is_oom(err):
                raise
            else:
                oom = True
                prof.after_oom()
        # a size refused on any rank (its own samples' shapes) is left out on every rank: decided here alone, the
        # ranks went on with different sizes and their all-reduces paired up across them
        if _reduce(float(refused is not None), "max"):
            prof.clear_grads()
            prof.say(f"micro-batch {m0}: skipped ({refused or 'refused on another rank'})")
            skipped.append(m0)
            queue = [m for m in queue if m != m0] or [2 * m0]
            m0 = queue[0]
            continue
        if not _reduce(float(oom), "max"):
            break
        infeasible.append(m0)
        prof.say(f"micro-batch {m0}: out of memory")
        if m0 == 1:
            raise InfeasiblePlanError(
                f"{prof.name} runs out of memory on {dev} even with a micro-batch of 1 sample.",
                hint="Profile on a device with more memory, reduce the model, or use a pipeline across several devices.",
            )
        queue = [m for m in queue if m < m0] or [max(1, m0 // 2)]
        m0 = queue[0]
    opt_oom = False
    try:
        opt_time, opt_state, opt_peak = prof.optimizer_phase(optimizers, m0)
    except Exception as err:
        if not _is_oom(err):
            raise
        prof.after_oom()
        opt_oom = True
    # every rank raises, not the one that ran out alone: the others went on into the main loop's collectives and
    # failed there with "Another process of this run failed or left", not knowing what the run lacks
    if _reduce(float(opt_oom), "max"):
        raise InfeasiblePlanError(
            f"The optimizer step of {prof.name} runs out of memory on {dev}{'' if opt_oom else ' of another rank'}.",
            hint="Use an optimizer with less state (SGD instead of Adam), or shard the optimizer state over devices.",
        )
    opt_peak = int(_reduce(opt_peak, "max"))
    prof.clear_grads()
    snapshot.restore(grads=False)  # undo the optimizer's weight updates; its state stays allocated
    opt_name = "+".join(type(o).__name__ for o in optimizers) or "none"
    prof.say(f"optimizer {opt_name}: step {format_ms(opt_time)} ms, state {opt_state / 2**20:.1f} MiB")

    split_reason = discovered.split_reason
    if prof.spec is not None:
        differs, chain_failed = _pipeline_loss_difference(prof, m0)
        if _reduce(float(differs is not None), "max"):  # every rank plans with the same answer
            split_reason = differs or "the pipeline's loss differs from training_step's on another rank's batch"
            prof.say(f"not splittable: {split_reason}")
            log.warning("Pipelines are left out of the plans: %s.", split_reason)
        if _reduce(float(chain_failed), "max"):
            # The chain cannot run on these batches (a dict fed to an nn.Sequential): the per-layer pass runs
            # training_step instead, as for a module that cannot be split. A chain that runs but computes another
            # loss stays the pass's path (training_step may call autograd.grad, which the layer hooks do not take).
            prof.spec = None

    # -- main loop: whole step, then per layer ---------------------------------------------------
    param_storages = {_storage_key(t)[0] for t in list(module.parameters()) + list(module.buffers())}
    step_samples: list[TimingSample] = []
    peaks: dict[int, int] = {}
    working: dict[int, int] = {}  # CUDA: step peak minus what was resident before it (the micro-batch's input not counted as resident)
    counted: dict[int, RunRecord] = {}
    timed: dict[int, list[RunRecord]] = {}
    flop_records: dict[int, RunRecord] = {}
    done: list[int] = []
    with LayerRecorder(layer_modules, dev, exclude_storages=param_storages) as recorder:
        while queue:
            m = queue.pop(0)
            if m in done or m in infeasible or m in skipped or m in unprofiled:
                continue
            oom = none_here = False
            refused = None
            prof.agreed = False
            try:
                # FLOPs are counted in the counting run of the first flop_sizes sizes only: counting
                # is slow per op, and FLOPs are linear in m (see flop_sizes in the docstring).
                count_flops = len(flop_records) < prof.flop_sizes
                c = prof.count_layers(recorder, m, flops=count_flops)
                f, bw, peak, resident = prof.time_step(m, warmup=max(0, prof.warmup - 1))  # the counting run was the first warm-up
                t = prof.time_layers(recorder, m)
            except SkippedBatchError:
                none_here = True
            except Exception as err:
                if _is_size_error(err):
                    refused = first_line(err)
                elif not _is_oom(err):
                    raise
                else:
                    oom = True
                    prof.after_oom()
            prof.catch_up()
            if _reduce(float(refused is not None), "max"):
                # refused on any rank: every rank leaves the size out. A `continue` on the refusing rank alone skipped
                # the reductions below that the others made, and the ranks' all-reduces paired up across sizes.
                prof.clear_grads()
                prof.say(f"micro-batch {m}: skipped ({refused or 'refused on another rank'})")
                skipped.append(m)
                if not explicit and not queue and len(done) < _MIN_SIZES:
                    queue = [2 * max(done + [m])]
                continue
            if _reduce(float(none_here), "max"):  # on any rank: every rank leaves the size out (the collectives stay paired)
                # these samples hold one training_step skips: the size is left unprofiled (not rejected: it trains)
                prof.say(f"micro-batch {m}: training_step skipped it (returned None); not profiled")
                unprofiled.append(m)
                if not done and not [x for x in queue if x not in infeasible + skipped + unprofiled]:
                    raise _skipped_everywhere(prof.name)
                continue
            if _reduce(float(oom), "max"):
                infeasible.append(m)
                prof.say(f"micro-batch {m}: out of memory -> infeasible; larger sizes skipped")
                larger = [x for x in queue if x > m]
                queue = [x for x in queue if x < m]
                if larger:
                    log.info("Skipped micro-batch sizes %s (larger than the infeasible %d).", larger, m)
                if not explicit and done and len(done) < _MIN_SIZES and min(done) > 1 and min(done) // 2 not in skipped:
                    queue = [max(1, min(done) // 2)]  # below the smallest: cheap and surely fits
                continue
            f, bw = _reduce(f, "max"), _reduce(bw, "max")  # the slowest rank sets the pace
            # and the rank that needs the most memory sets what fits (its samples may be longer): rank 0 plans for all
            _agree_on_memory(c)
            done.append(m)
            step_samples.append(TimingSample(micro_batch_size=m, forward_s=f, backward_s=bw))
            counted[m], timed[m] = c, t
            if count_flops:
                flop_records[m] = c
            if prof.cuda:
                peaks[m] = int(_reduce(max(peak, opt_peak), "max"))
                working[m] = int(_reduce(peak - resident, "max"))
            prof.say(f"micro-batch {m}: forward {format_ms(f, 1)} ms, backward {format_ms(bw, 1)} ms" + (f", peak {peaks[m] / 2**20:.0f} MiB" if prof.cuda else ""))
            if not explicit:
                queue = _next_sizes(queue, done, infeasible, skipped + unprofiled, step_s=_reduce(f + bw, "max"), m=m, say=prof.say)
        feasible = sorted(done)
        if not feasible:
            raise InfeasiblePlanError(
                f"No micro-batch size of {prof.name} fits in memory on {dev} (tried {sorted(infeasible)}).",
                hint="Profile smaller micro-batch sizes, e.g. micro_batch_sizes=[1, 2, 4].",
            )
        prof.clear_grads()
    prof.say(f"per-layer pass done; FLOPs counted at micro-batch {sorted(flop_records)}")
    step_samples = _retime_outliers(prof, step_samples)
    prof.clear_grads()

    # -- the training loop's own cost ------------------------------------------------------------
    framework = FrameworkProfile()
    if prof.loop_overhead:
        from lightning_distplan.profiling._overhead import measure_framework_overhead

        framework = measure_framework_overhead()
        prof.say(f"training loop: {format_ms(framework.per_batch_s)} ms per batch, {format_ms(framework.per_step_s)} ms per optimizer step")

    # -- links -------------------------------------------------------------------------------------
    links = ()
    if measure_links and world > 1:
        from lightning_distplan.profiling._links import measure_links as _measure_links

        prof.say("measuring all-reduce and p2p links")
        links = _measure_links()
        from lightning_distplan.profiling._links import pipeline_slot_for

        framework = dataclasses.replace(framework, pipeline_slot_s=pipeline_slot_for(links, "cuda" if prof.cuda else "cpu"))
        if framework.pipeline_slot_s is not None:
            prof.say(f"pipelining runtime: {format_ms(framework.pipeline_slot_s)} ms per micro-batch slot beyond the hand-over")

    # -- assemble ----------------------------------------------------------------------------------
    order = _execution_order(counted, len(layer_modules))
    layers = []
    seen_params: set[int] = set()
    users: dict[int, list[int]] = {}  # trainable parameter -> positions (in `layers`) of the layers using it
    sizes: dict[int, int] = {}
    for i in order:
        for p in layer_modules[i].parameters():
            if p.requires_grad:
                users.setdefault(id(p), []).append(len(layers))
                sizes[id(p)] = p.numel() * p.element_size()
        params = [p for p in layer_modules[i].parameters() if id(p) not in seen_params]
        seen_params.update(id(p) for p in params)
        fwd = [statistics.median(r.forward_s[i] for r in timed[m]) for m in feasible]
        bwd = [statistics.median(r.backward_s[i] for r in timed[m]) for m in feasible]
        saved = [counted[m].saved_bytes[i] for m in feasible]
        outs = [counted[m].output_bytes[i] for m in feasible]
        act = LinearFit.fit(feasible, saved)
        out_fit = LinearFit.fit(feasible, outs)
        out_per_sample = max(0.0, out_fit.alpha)
        out_saved = min(out_per_sample, max(0.0, LinearFit.fit(feasible, [counted[m].output_saved_bytes[i] for m in feasible]).alpha))
        out_later = min(out_per_sample - out_saved, max(0.0, LinearFit.fit(feasible, [counted[m].output_saved_later_bytes[i] for m in feasible]).alpha))
        flops_f, flops_b = _per_sample(flop_records, i)
        conv_f, conv_b = _per_sample(flop_records, i, conv=True)
        layers.append(
            LayerProfile(
                name=layer_names[i],
                # a host stall at one size tilts a small layer's line below zero at another (one at 4 of 1, 2, 4:
                # -1.6 ms at 1), which the planner would sum into a stage's time and a saved profile may be refused for
                forward=LinearFit.fit_times(feasible, fwd),
                backward=LinearFit.fit_times(feasible, bwd),
                param_count=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                trainable_param_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                activation_bytes_per_sample=max(0.0, act.alpha),
                activation_bytes_fixed=max(0.0, act.beta),
                output_bytes_per_sample=out_per_sample,
                output_saved_bytes_per_sample=out_saved,
                output_saved_later_bytes_per_sample=out_later,
                flops_forward_per_sample=flops_f,
                flops_backward_per_sample=flops_b,
                # the same line's slope for the convolutions alone cannot pass the whole's by more than rounding
                conv_flops_forward_per_sample=min(conv_f, flops_f),
                conv_flops_backward_per_sample=min(conv_b, flops_b),
                samples=tuple(TimingSample(micro_batch_size=m, forward_s=a, backward_s=c) for m, a, c in zip(feasible, fwd, bwd)),
            )
        )
    tied: dict[tuple[int, ...], int] = {}
    for pid, where in users.items():
        if len(where) > 1:
            tied[tuple(where)] = tied.get(tuple(where), 0) + sizes[pid]
    shared = tuple(SharedParameters(layers=k, param_bytes=v) for k, v in sorted(tied.items()))
    if shared:
        prof.say("shared parameters: " + ", ".join(f"{g.param_bytes / 2**20:.2f} MiB over layers {list(g.layers)}" for g in shared))
    step_samples.sort(key=lambda s: s.micro_batch_size)
    # the repeat-to-repeat spread of one micro-batch (root mean square over the sizes; the largest rank's)
    spread = math.sqrt(statistics.fmean(x * x for x in prof.spreads)) if prof.spreads else 0.0
    spread = _reduce(spread, "max")
    step = StepProfile(
        forward=LinearFit.fit_times([s.micro_batch_size for s in step_samples], [s.forward_s for s in step_samples]),
        backward=LinearFit.fit_times([s.micro_batch_size for s in step_samples], [s.backward_s for s in step_samples]),
        samples=tuple(step_samples),
        spread=spread,
    )
    total = LinearFit.fit([s.micro_batch_size for s in step_samples], [s.forward_s + s.backward_s for s in step_samples])
    worst = max(abs(total(s.micro_batch_size) - (s.forward_s + s.backward_s)) / (s.forward_s + s.backward_s) for s in step_samples)
    if len(step_samples) < 3:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"The step time of {prof.name} was measured at {len(step_samples)} micro-batch size(s) only ({list(feasible)}): "
            + ("one point fixes no line, so it is drawn through zero, " if len(step_samples) == 1 else "two points fit any line, ")
            + "and its R² of 1 shows nothing. Profile three or more sizes (e.g. --micro-batch-sizes 2,4,8) for predictions at other sizes."
        )
    # flat, overhead-bound steps have a low R² but predict fine: warn only when the line misses a point by > 15%
    if len(step_samples) >= 3 and total.r2 < _MIN_R2 and worst > 0.15:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"The step time of {prof.name} is not linear in the micro-batch size (R² = {total.r2:.2f} over {list(feasible)}, a measured point off the line by {worst:.0%}), "
            "so predictions at other sizes are uncertain. A busy host or a device far from saturation does this; "
            "re-profile on an idle machine or with more repeats."
        )
    all_params = list(dict.fromkeys(module.parameters()))
    param_bytes = sum(p.numel() * p.element_size() for p in all_params)
    grad_bytes = sum(p.numel() * p.element_size() for p in all_params if p.requires_grad)
    activation = LinearFit.fit(feasible, [counted[m].total_saved_bytes for m in feasible])
    activation_source = "saved for backward (counted by hooks)"
    overhead = 0
    if working:
        # seed 000 §III: memory = weights + grads + optimizer state + activations(m) + a fixed part.
        # On CUDA the per-micro-batch part is measured, not counted: the step's peak over what was
        # resident before it. The bytes saved for backward miss the step's transients (GPT-2's logits
        # and their gradient: 1.64 GiB per sample measured on an H100 against 1.18 GiB saved), and a
        # constant fitted to the largest size would then overstate small sizes and understate large ones.
        sizes = sorted(working)
        activation = LinearFit.fit(sizes, [working[m] for m in sizes])
        activation_source = "CUDA step peak minus resident bytes, the micro-batch's input included (measured)"
        # what the line misses at a profiled size, and the optimizer step's own peak (state + temporaries)
        overhead = max(0, max(int(working[m] - activation(m)) for m in sizes),
                       int(opt_peak - (param_bytes + grad_bytes + opt_state) - activation(sizes[0])))
    else:
        prof.say("no peak memory on CPU: fixed overhead recorded as 0 (the model's parts are counted, not measured)")
    info = device_info(dev)
    tf32_matmul, tf32_conv = tf32_switches()
    dtypes = [p.dtype for p in all_params]
    dtype = str(max(set(dtypes), key=dtypes.count)).replace("torch.", "") if dtypes else "float32"
    mixed = getattr(prof.precision_plugin, "precision", None)
    if mixed in ("bf16-mixed", "16-mixed"):
        dtype = mixed  # float32 weights, 16-bit math: what the tuner's projection needs to know
    memory = MemoryProfile(
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_state,
        activation=activation,
        fixed_overhead_bytes=overhead,
        activation_source=activation_source,
        measured_peak_bytes=dict(sorted(peaks.items())),
        device_total_bytes=info.total_memory_bytes,
        device_total_source=info.memory_source,
    )
    if prof.bank.repeated:
        log.warning("The loader yielded fewer samples than the largest micro-batch; samples were repeated to fill it.")
    for snap in created_snapshots:
        snap.restore()
    elapsed = time.perf_counter() - prof.t0
    profile = Profile(
        model=f"{type(module).__module__}:{type(module).__qualname__}",
        # the process's TF32 switches, which decide what a float32 matmul or convolution runs on (the projection's peaks)
        device=dataclasses.replace(info, dtype=dtype, count=world, tf32_matmul=tf32_matmul, tf32_conv=tf32_conv),
        micro_batch_sizes=tuple(feasible),
        step=step,
        layers=tuple(layers),
        optimizer=OptimizerProfile(name=opt_name, state_bytes=opt_state, step_time_s=opt_time),
        memory=memory,
        links=tuple(links),
        framework=framework,
        shared_parameters=shared,
        infeasible_micro_batch_sizes=tuple(sorted(set(infeasible))),
        rejected_micro_batch_sizes=tuple(sorted(set(skipped))),
        splittable=discovered.spec is not None and split_reason == discovered.split_reason,
        split_reason=split_reason,
        unused_parameters=tuple(prof.unused),
        profiling_time_s=elapsed,
        versions=_versions(),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    prof.say(
        f"done: step fit forward R²={step.forward.r2:.3f}, backward R²={step.backward.r2:.3f}; "
        f"sizes {list(feasible)}" + (f", infeasible {sorted(set(infeasible))}" if infeasible else "")
    )
    return profile


_OUTLIER = 0.5
"""A whole-step timing this far (relative) from the line through the other sizes is timed again."""
_MAX_RETIMES = 2


def _retime_outliers(prof: _Profiler, samples: list[TimingSample]) -> list[TimingSample]:
    """Time again (once) a size whose step time lies more than :data:`_OUTLIER` off the line through
    the other sizes, and keep the smaller of its two timings; at most :data:`_MAX_RETIMES` sizes,
    the worst first.

    Why: a stall of the host during one size's window (measured once in the CPU cluster sweep: the
    m = 16 step of tiny GPT-2 timed 238 ms against 73–123 ms in its 26 other profiles) bends the
    fit, and the planner then picked a plan that ran 3× slower than the best. A stall only ever adds
    time, so of two timings of the same work the smaller is the less disturbed. A size that is
    really off the line (a step dominated by fixed overhead at m = 1) times the same again, and
    keeps its value. The timings are already the slowest rank's, so every rank decides alike.

    Only a size above the line through the others is timed again, one above a line that predicts no
    time at all at its size counts as off it, and the size furthest above its line (in seconds) goes
    first: with two stalled sizes of four (m = 8 and 64, beside busy loops on 2 cores), each one's
    line through the others, bent by the other stall, went below 0 at its size, so neither counted
    as off it, and both re-timings went to sizes lying below the bent lines, which no stall of their
    own had put there.

    Of the sizes above their lines, the one whose leaving out straightens the others most goes
    first: its distance above the line through the others times sqrt(1 - h), h its leverage in the
    fit through all sizes (leaving a point out lowers the fit's squared error by distance² · (1 - h)).
    By distance alone, one stall at the smallest of sizes 8..64 tilts the line through the others
    so far that the largest lies further above it than the stall itself (m = 64 1.3 times the stall
    above it), and the first re-timing went to that unstalled size.
    """
    def total(s: TimingSample) -> float:
        return s.forward_s + s.backward_s

    by_size = {s.micro_batch_size: s for s in samples}
    retimed: set[int] = set()
    for _ in range(_MAX_RETIMES):
        xs = sorted(by_size)
        if len(xs) < 3:
            break
        worst, where, line, gain = 0.0, 0, 0.0, 0.0
        mean = sum(xs) / len(xs)
        spread = sum((x - mean) ** 2 for x in xs)
        for m in xs:
            others = [x for x in xs if x != m]
            expected = LinearFit.fit(others, [total(by_size[x]) for x in others])(m)
            if m in retimed or total(by_size[m]) <= expected:  # below the line: another size's stall bent it there
                continue
            off = total(by_size[m]) / expected - 1 if expected > 0 else math.inf
            # the worst is the one whose leaving out straightens the others most, in seconds: a stall adds time, and
            # bends the fit by what it added (by relative distance, a 3 ms step above a line that the stall of m = 64
            # bent below 0 came first; by distance alone, an end size the other end's stall tilted the line away from)
            straightens = (total(by_size[m]) - expected) * math.sqrt(1 - (1 / len(xs) + (m - mean) ** 2 / spread))  # 1 - leverage
            if off > _OUTLIER and straightens > gain:
                worst, where, line, gain = off, m, expected, straightens
        if not where:
            break
        first = by_size[where]
        f, bw, _, _ = prof.time_step(where, warmup=1)
        again = TimingSample(micro_batch_size=where, forward_s=_reduce(f, "max"), backward_s=_reduce(bw, "max"))
        retimed.add(where)
        by_size[where] = keep = min(first, again, key=total)
        how_far = f"{worst:.0%} off" if math.isfinite(worst) else "above"
        prof.say(
            f"micro-batch {where}: {format_ms(total(first), 1)} ms was {how_far} the line through the "
            f"other sizes ({format_ms(line, 1)} ms); timed again: {format_ms(total(again), 1)} ms; kept {format_ms(total(keep), 1)} ms"
        )
    return [by_size[s.micro_batch_size] for s in samples]


def _next_sizes(queue: list[int], done: list[int], infeasible: list[int], skipped: list[int], *, step_s: float, m: int, say: Callable[[str], None]) -> list[int]:
    """Default sizes: go on while the next step stays under _MAX_STEP_S; always reach _MIN_SIZES sizes,
    preferring smaller sizes (cheap) over larger ones when time runs short."""
    if queue and step_s * queue[0] / m <= _MAX_STEP_S:
        return queue
    if len(done) >= _MIN_SIZES:
        if queue:
            say(f"stopping after micro-batch {m}: a step of {queue[0]} would take ~{step_s * queue[0] / m:.1f} s")
        return []
    smallest = min(done)
    if smallest > 1 and smallest // 2 not in skipped:
        return [smallest // 2]
    larger = [x for x in queue if x not in done] or [2 * max(done)]
    return [x for x in larger if x not in infeasible and x not in skipped][:1]


def _execution_order(counted: dict[int, RunRecord], n: int) -> list[int]:
    order: list[int] = []
    for rec in counted.values():
        for i in rec.first_call:
            if i not in order:
                order.append(i)
    return order + [i for i in range(n) if i not in order]  # never-called layers last (zero time)


def _per_sample(records: dict[int, RunRecord], i: int, *, conv: bool = False) -> tuple[float, float]:
    """Layer ``i``'s (forward, backward) FLOPs per sample (``conv``: those of its convolutions)."""
    if not records:
        return 0.0, 0.0

    def counts(m: int) -> tuple[int, int]:
        r = records[m]
        return (r.conv_flops_forward[i], r.conv_flops_backward[i]) if conv else (r.flops_forward[i], r.flops_backward[i])

    sizes = sorted(records)
    if len(sizes) == 1:
        (f, g), m = counts(sizes[0]), sizes[0]
        return f / m, g / m
    a, b = sizes[0], sizes[1]
    (fa, ga), (fb, gb) = counts(a), counts(b)
    return max(0.0, float((fb - fa) / (b - a))), max(0.0, float((gb - ga) / (b - a)))


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:
        pass
    try:
        import lightning_distplan

        out["lightning_distplan"] = lightning_distplan.__version__
    except (ImportError, AttributeError):
        pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out
