"""Build small :class:`~lightning_distplan.profile.Profile` objects by hand.

For tests, examples and what-if studies: every number is stated, nothing is measured, so the
cost model can be pinned against values computed on paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_distplan.profile import (
    DeviceProfile,
    LayerProfile,
    LinearFit,
    LinkProfile,
    MemoryProfile,
    OptimizerProfile,
    Profile,
    StepProfile,
)

__all__ = ["LayerSpec", "synthetic_profile"]


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer of a synthetic profile: forward/backward t(m) = α·m + β and its sizes."""

    fwd_alpha: float = 0.0
    fwd_beta: float = 0.0
    bwd_alpha: float = 0.0
    bwd_beta: float = 0.0
    param_bytes: int = 0
    activation_bytes_per_sample: float = 0.0
    output_bytes_per_sample: float = 0.0


def synthetic_profile(
    layers: Sequence[LayerSpec],
    *,
    step_forward: tuple[float, float] | None = None,
    step_backward: tuple[float, float] | None = None,
    optimizer_step_time_s: float = 0.0,
    optimizer_state_bytes: int | None = None,
    grad_bytes: int | None = None,
    activation: tuple[float, float] | None = None,
    fixed_overhead_bytes: int = 0,
    device_memory_bytes: int = 16 << 30,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    infeasible_micro_batch_sizes: Sequence[int] = (),
    links: Sequence[LinkProfile] = (),
    splittable: bool = True,
) -> Profile:
    """A Profile whose whole-step fits default to the sum of the layer fits.

    Args:
        layers: the layers in execution order.
        step_forward / step_backward: (α, β) of the whole step; default Σ over layers.
        optimizer_step_time_s: one ``optimizer.step()``.
        optimizer_state_bytes: default 2 × parameter bytes (Adam's two moments).
        grad_bytes: default = parameter bytes.
        activation: (bytes per sample, fixed bytes) of the whole step; default Σ over layers.
    """
    param_bytes = sum(layer.param_bytes for layer in layers)
    fa = step_forward or (sum(x.fwd_alpha for x in layers), sum(x.fwd_beta for x in layers))
    ba = step_backward or (sum(x.bwd_alpha for x in layers), sum(x.bwd_beta for x in layers))
    act = activation or (sum(x.activation_bytes_per_sample for x in layers), 0.0)
    opt_bytes = 2 * param_bytes if optimizer_state_bytes is None else optimizer_state_bytes
    return Profile(
        model="synthetic",
        device=DeviceProfile(type="cuda", name="synthetic", total_memory_bytes=device_memory_bytes, memory_source="given"),
        micro_batch_sizes=tuple(micro_batch_sizes),
        step=StepProfile(forward=LinearFit(alpha=fa[0], beta=fa[1]), backward=LinearFit(alpha=ba[0], beta=ba[1])),
        layers=tuple(
            LayerProfile(
                name=f"layers.{i}",
                forward=LinearFit(alpha=x.fwd_alpha, beta=x.fwd_beta),
                backward=LinearFit(alpha=x.bwd_alpha, beta=x.bwd_beta),
                param_count=x.param_bytes // 4,
                param_bytes=x.param_bytes,
                activation_bytes_per_sample=x.activation_bytes_per_sample,
                output_bytes_per_sample=x.output_bytes_per_sample,
            )
            for i, x in enumerate(layers)
        ),
        optimizer=OptimizerProfile(name="Adam", state_bytes=opt_bytes, step_time_s=optimizer_step_time_s),
        memory=MemoryProfile(
            param_bytes=param_bytes,
            grad_bytes=param_bytes if grad_bytes is None else grad_bytes,
            optimizer_state_bytes=opt_bytes,
            activation=LinearFit(alpha=act[0], beta=act[1]),
            fixed_overhead_bytes=fixed_overhead_bytes,
            device_total_bytes=device_memory_bytes,
            device_total_source="given",
        ),
        links=tuple(links),
        infeasible_micro_batch_sizes=tuple(infeasible_micro_batch_sizes),
        splittable=splittable,
        split_reason="synthetic profile" if splittable else "synthetic profile marked not splittable",
    )
