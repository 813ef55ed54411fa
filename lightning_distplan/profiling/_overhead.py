"""The training loop's own cost: what Lightning spends per batch and per optimizer step beyond the model.

The profiler times ``training_step`` + ``backward`` and ``optimizer.step()`` directly. A real
``Trainer.fit`` adds, per training batch, the loop's hooks, the optimizer closure, result
collection for ``self.log`` and the data loader's fetch, and per optimizer step the optimizer's
hooks and bookkeeping. On a CPU that is about a millisecond per batch: small next to a large
model's step, but a third of the step of a small model with many micro-batches.

:func:`measure_framework_overhead` measures it the direct way: it runs a real, tiny
``Trainer.fit`` (a 4→1 linear layer that logs its loss, as most training steps do) twice, with
accumulation 1 and 4, on a single CPU device, and solves the two step times for the per-batch and
per-step parts after subtracting the tiny model's own forward/backward/step time. It takes about
0.3 s and leaves no trace: the RNG streams are restored, nothing is written, and a Trainer that is
already fitting (``auto_plan`` profiles from inside ``fit``) is not touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import Callback

from lightning_distplan.profile import FrameworkProfile
from lightning_distplan.profiling._snapshot import RNGSnapshot

__all__ = ["measure_framework_overhead", "QUIET_FIT", "StepTimer", "device_clock"]

log = logging.getLogger(__name__)

QUIET_FIT: dict[str, Any] = {
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""Trainer arguments for a measuring fit: training steps only, nothing logged, saved or printed."""


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock for timing work on ``device``: ``time.perf_counter`` itself off CUDA; on CUDA, the same read after
    ``torch.cuda.synchronize(device)``, so that a time stamp comes after the work queued before it has run (not when
    the host had merely queued it)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced


class StepTimer(Callback):
    """Timestamps of optimizer-step boundaries (synchronised on CUDA): the first training batch's
    start, then every batch end where ``trainer.global_step`` advanced. Used by this tiny fit and by
    ``distplan bench`` for every plan."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._last_step = -1

    def _now(self, trainer: Any) -> float:
        return device_clock(trainer.strategy.root_device)()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.stamps:
            self.stamps.append(self._now(trainer))
            self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._last_step:
            self.stamps.append(self._now(trainer))
            self._last_step = trainer.global_step

    @property
    def step_times(self) -> list[float]:
        """Seconds of each optimizer step, in order."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


_STEPS = 24
"""Optimizer steps per run; the first :data:`_SKIP` are warm-up."""
_SKIP = 4
_ACCUMULATE = 4

# The tiny fit runs in a process that torchrun (or Lightning's launcher) may have started as one
# rank of many: hide the job's cluster variables so the nested Trainer sees one plain process.
_CLUSTER_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_JOB_NAME", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "LSB_JOBID",
)


@contextlib.contextmanager
def _single_process_env() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in _CLUSTER_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _tiny_module() -> Any:
    from lightning.pytorch import LightningModule

    class _Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch).square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return _Tiny()


def _fit_step_time(accumulate: int) -> float:
    """Median seconds per optimizer step of the tiny model under a real ``Trainer.fit``."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import SingleDeviceStrategy

    stamps = StepTimer()
    trainer = Trainer(
        accelerator="cpu",
        strategy=SingleDeviceStrategy(device=torch.device("cpu")),
        max_steps=_STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[stamps],
        default_root_dir=os.devnull,
        **QUIET_FIT,
    )
    data = torch.utils.data.DataLoader(torch.zeros(_STEPS * accumulate, 4), batch_size=1)
    trainer.fit(_tiny_module(), train_dataloaders=data)
    return statistics.median(stamps.step_times[_SKIP:])


def _raw_times() -> tuple[float, float]:
    """The tiny model's own forward+backward and optimizer step (+zero_grad), outside any loop."""
    layer = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    x = torch.zeros(1, 4)
    fb, st = [], []
    for _ in range(40):
        a = time.perf_counter()
        layer(x).square().mean().backward()
        b = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        c = time.perf_counter()
        fb.append(b - a)
        st.append(c - b)
    return statistics.median(fb[5:]), statistics.median(st[5:])


def measure_framework_overhead() -> FrameworkProfile:
    """Lightning's per-batch and per-optimizer-step cost on this host (see the module docstring).

    Returns an empty :class:`FrameworkProfile` (``source`` saying why) when the tiny fit cannot
    run here; the cost model then adds nothing, as before this measurement existed.
    """
    rng = RNGSnapshot.take(include_cuda=False)
    try:
        with _single_process_env(), _quiet():
            one = _fit_step_time(1)
            many = _fit_step_time(_ACCUMULATE)
            raw_fb, raw_step = _raw_times()
    except Exception as err:  # never fail a profile over its loop-overhead estimate
        log.warning("Could not measure the training loop's overhead (%s: %s); the cost model will leave it out.", type(err).__name__, err)
        return FrameworkProfile(source=f"not measured ({type(err).__name__})")
    finally:
        rng.restore()
    # one = b + s + fb + st ; many = k·(b + fb) + s + st   (b per batch, s per optimizer step)
    k = _ACCUMULATE
    per_batch = max(0.0, (many - one) / (k - 1) - raw_fb)
    per_step = max(0.0, one - per_batch - raw_fb - raw_step)
    return FrameworkProfile(
        per_batch_s=per_batch,
        per_step_s=per_step,
        source=f"tiny Trainer.fit on cpu, accumulate 1 and {k} ({one * 1e3:.2f} / {many * 1e3:.2f} ms per step)",
    )
