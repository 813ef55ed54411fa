"""The cost model: time, memory and money of a :class:`~lightning_distplan.plan.Plan`.

Pure Python over a saved :class:`~lightning_distplan.profile.Profile` — no torch, no lightning —
so a profile taken on a GPU can be re-planned anywhere. Equations: DESIGN §4, seeds 000 and 001.

Example:
    >>> from lightning_distplan.costmodel import predict
    >>> prediction = predict(profile, plan)  # doctest: +SKIP
    >>> prediction.step_time_s, prediction.peak_memory_bytes, prediction.feasible  # doctest: +SKIP
"""

from __future__ import annotations

from lightning_distplan.costmodel._cost import cost_per_step, objective
from lightning_distplan.costmodel._hardware import DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_LATENCY_S, Hardware
from lightning_distplan.costmodel._partition import partition_layers, partition_pipeline
from lightning_distplan.costmodel._predict import (
    BREAKDOWN_KEYS,
    MEMORY_KEYS,
    PIPELINE_SLOT_S,
    Prediction,
    in_flight_microbatches,
    exposed_allreduce_time,
    predict,
    expected_max_excess,
    loop_sync_time,
    ring_allreduce_time,
)

__all__ = [
    "Hardware",
    "Prediction",
    "predict",
    "partition_layers",
    "partition_pipeline",
    "cost_per_step",
    "objective",
    "ring_allreduce_time",
    "loop_sync_time",
    "expected_max_excess",
    "exposed_allreduce_time",
    "in_flight_microbatches",
    "BREAKDOWN_KEYS",
    "MEMORY_KEYS",
    "PIPELINE_SLOT_S",
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "DEFAULT_LATENCY_S",
]
