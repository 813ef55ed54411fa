"""Measure a LightningModule on the real device: per-layer time, memory, FLOPs, links, device facts.

The result is a :class:`lightning_distplan.profile.Profile`, the input of the cost model and the
planner. Profiling leaves no trace on the module, its optimizer or the RNG streams.

Example:
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> from lightning_distplan.profiling import profile_module
    >>> model = BoringModel()
    >>> profile = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
    >>> profile.step.forward.alpha > 0
    True
"""

from __future__ import annotations

from lightning_distplan.profiling._device import device_info
from lightning_distplan.profiling._errors import DataLoadingError, ProfilingError
from lightning_distplan.profiling._links import measure_links, measure_pipeline_slot
from lightning_distplan.profiling._overhead import StepTimer
from lightning_distplan.profiling._profiler import default_micro_batch_sizes, profile_module

__all__ = [
    "profile_module",
    "measure_links",
    "measure_pipeline_slot",
    "device_info",
    "default_micro_batch_sizes",
    "StepTimer",
    "ProfilingError",
    "DataLoadingError",
]
