"""A hand-built Profile for the tuner tests: every number stated, nothing measured.

A 12-block transformer-like model "profiled" on a Tesla T4 in float32 (device name as
``torch.cuda.get_device_name`` spells it), with per-layer FLOPs so the roofline projection has
something to scale. Imported by tests/tuner and tests/cli (by path).
"""

from __future__ import annotations

from lightning_distplan.profile import (
    DeviceProfile,
    LayerProfile,
    LinearFit,
    MemoryProfile,
    OptimizerProfile,
    Profile,
    StepProfile,
)

GIB = 1024**3


def make_profile(*, n_layers: int = 12, device_type: str = "cuda", device_name: str = "Tesla T4", splittable: bool = True,
                 param_bytes_per_layer: int = 28_000_000, activation_per_sample: float = 2.6e6, flops_fwd: float = 1.8e9,
                 micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8), infeasible: tuple[int, ...] = ()) -> Profile:
    layers = []
    for i in range(n_layers):
        layers.append(
            LayerProfile(
                name=f"model.blocks.{i}",
                forward=LinearFit(alpha=4.5e-4, beta=1e-4, r2=0.99),
                backward=LinearFit(alpha=9e-4, beta=2e-4, r2=0.99),
                param_count=param_bytes_per_layer // 4,
                param_bytes=param_bytes_per_layer,
                activation_bytes_per_sample=activation_per_sample,
                output_bytes_per_sample=262_144.0,
                flops_forward_per_sample=flops_fwd,
                flops_backward_per_sample=2 * flops_fwd,
            )
        )
    params = param_bytes_per_layer * n_layers
    return Profile(
        model="tests.synthetic:TransformerLike",
        device=DeviceProfile(type=device_type, name=device_name, total_memory_bytes=16 * GIB, memory_source="given"),
        micro_batch_sizes=micro_batch_sizes,
        step=StepProfile(forward=LinearFit(alpha=4.5e-4 * n_layers * 1.05, beta=1e-4 * n_layers), backward=LinearFit(alpha=9e-4 * n_layers * 1.05, beta=2e-4 * n_layers)),
        layers=tuple(layers),
        optimizer=OptimizerProfile(name="AdamW", state_bytes=2 * params, step_time_s=0.004),
        memory=MemoryProfile(
            param_bytes=params,
            grad_bytes=params,
            optimizer_state_bytes=2 * params,
            activation=LinearFit(alpha=activation_per_sample * n_layers, beta=0.0),
            fixed_overhead_bytes=300 * 1024**2,
            device_total_bytes=16 * GIB,
            device_total_source="given",
        ),
        infeasible_micro_batch_sizes=infeasible,
        splittable=splittable,
        split_reason="hand-built",
    )
