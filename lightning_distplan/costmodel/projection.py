"""Project a Profile measured on one device to another GPU with a per-layer roofline ratio.

Pure Python. For each profiled layer and micro-batch size m (DESIGN §4, "Other hardware"):

    t_target(m) = t_measured(m) · max(F(m)/P_target, Q(m)/BW_target) / max(F(m)/P_source, Q(m)/BW_source)

with F the layer's FLOPs (``flops_*_per_sample · m`` from the profile), Q an estimate of the bytes
it moves (below), P the peak FLOP/s and BW the memory bandwidth of each device
(:mod:`lightning_distplan.costmodel.gpus`). In float32, F/P is the sum over the math each part ran in:
F_tf32/P_tf32 + (F − F_tf32)/P_fp32, where F_tf32 are the FLOPs TF32 was allowed for (convolutions
under ``torch.backends.cudnn.allow_tf32``, on by PyTorch's default; the rest, matmuls, under
``torch.backends.cuda.matmul.allow_tf32``, which ``set_float32_matmul_precision("high")`` turns on),
as the profile recorded for its own run and as the target is told to assume; P_tf32 is P_fp32 on
parts without TF32 (T4, V100, CPUs). The projected times at the profiled sizes are refitted
as t(m) = α·m + β (seed 000 §III-B), so the cost model reads a projected Profile exactly like a
measured one. The ratio keeps the measured device's inefficiencies (a layer that reached 30% of
peak is assumed to reach 30% of the target's bound) — that is what makes it better than
FLOPs / peak alone, and also why it is coarse: kernel launch overheads, cache effects and
different kernel choices on the target are not modelled.

Bytes estimate Q per layer (what must cross DRAM at least once):
  forward:  parameters read + input read + saved activations and output written
  backward: parameters read + gradients written + saved activations read + output-grad read + input-grad written
where the input of layer l is the output of layer l-1 (unknown for the first layer: 0).

Uncertainty is reported, not hidden (:class:`ProjectionInfo`): GPU→GPU a factor of 1.35 either way (0.74× to 1.35× the projected time), CPU→GPU a factor of 3;
see :func:`_uncertainty` for the basis.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from lightning_distplan.costmodel.gpus import GpuSpec, source_spec
from lightning_distplan.errors import CatalogError
from lightning_distplan.profile import DeviceProfile, LayerProfile, LinearFit, OptimizerProfile, Profile, StepProfile, dtype_bytes

__all__ = ["ProjectionInfo", "project_profile", "roofline_ratio", "compute_seconds", "layer_bytes"]

Precision = Literal["fp32", "tf32", "bf16"]

@dataclass(frozen=True, kw_only=True)
class ProjectionInfo:
    """How a projected profile was made and how far to trust it."""

    source: str
    """Device the profile was measured on."""
    source_basis: str
    """Where the source peaks came from (spec row, or the CPU estimate and its assumptions)."""
    target: str
    """Target GPU (spec row name, ``xF`` suffix for a shared fraction)."""
    target_source: str
    """Datasheet / estimate the target row cites."""
    precision: Precision
    """Math the target is assumed to run: ``fp32`` (float32, with TF32 where :attr:`tf32` says), ``tf32`` (float32,
    TF32 for every matmul and convolution) or ``bf16`` (tensor cores)."""
    tf32: tuple[str, ...] = ()
    """Which float32 work runs on TF32 tensor cores on the target (``"matmul"``, ``"conv"``), where it has them."""
    source_tf32: tuple[str, ...] = ()
    """The same for the profiled run, as its profile recorded (none in profiles written before 2026-11-28)."""
    reference_micro_batch_size: int
    """Micro-batch size at which the scales below are reported (the largest profiled one)."""
    compute_scale: float
    """Projected / measured whole-step compute time at the reference size (<1: the target is faster)."""
    layer_scales: tuple[float, ...]
    """Per-layer projected / measured time at the reference size, forward+backward."""
    layer_bounds: tuple[str, ...]
    """Per layer, what bounds it on the target: ``"compute"``, ``"memory"`` or ``"unknown"`` (no FLOPs, no bytes)."""
    optimizer_scale: float
    """Projected / measured optimizer step (memory-bound: ratio of bandwidths)."""
    uncertainty_pct: float
    """Half-width of the stated band in percent (the band is multiplicative: ``band``)."""
    band: tuple[float, float]
    """(low, high) factors: the true time is expected within [low·t, high·t] of a projected time t."""
    uncertainty_basis: str
    """Why the band is that wide."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_scales"] = list(self.layer_scales)
        d["layer_bounds"] = list(self.layer_bounds)
        d["band"] = list(self.band)
        d["tf32"] = list(self.tf32)
        d["source_tf32"] = list(self.source_tf32)
        return d


def layer_bytes(layer: LayerProfile, m: float, *, input_bytes_per_sample: float = 0.0, activation_scale: float = 1.0) -> tuple[float, float]:
    """Estimated DRAM bytes moved by one layer's (forward, backward) at micro-batch ``m``.

    ``activation_scale`` rescales activation-sized terms (0.5 when a float32 profile is projected to
    bf16 math); parameter terms stay as profiled (mixed precision keeps float32 master weights).
    """
    saved = (layer.activation_bytes_per_sample * m + layer.activation_bytes_fixed) * activation_scale
    out = layer.output_bytes_per_sample * m * activation_scale
    inp = input_bytes_per_sample * m * activation_scale
    fwd = layer.param_bytes + inp + saved + out
    bwd = 2 * layer.param_bytes + saved + out + inp
    return fwd, bwd


def compute_seconds(flops: float, spec: GpuSpec, math: Any, *, tf32_flops: float = 0.0) -> float:
    """``flops`` at ``spec``'s peak for ``math``; in ``"fp32"``, ``tf32_flops`` of them at its TF32 peak."""
    if math != "fp32":
        return flops / spec.peak_flops(math)
    return (flops - tf32_flops) / spec.peak_flops("fp32") + tf32_flops / spec.peak_flops("tf32")


def roofline_ratio(
    flops: float, nbytes: float, source: GpuSpec, target: GpuSpec, *, source_precision: Any, precision: Any, target_bytes: float | None = None,
    source_tf32_flops: float = 0.0, target_tf32_flops: float = 0.0, source_peak_math: Any = None, target_peak_math: Any = None,
) -> tuple[float, str]:
    """``max(F/P_t, Q/BW_t) / max(F/P_s, Q/BW_s)`` and the bound on the target (DESIGN §4).

    ``*_tf32_flops``: in ``"fp32"`` math, the part of ``flops`` that runs on TF32 tensor cores on each device
    (see :func:`compute_seconds`). With neither FLOPs nor bytes known, falls back to the ratio of peak FLOP/s
    (``"unknown"``), of ``*_peak_math`` on each device (default: the precisions).
    """
    q_t = nbytes if target_bytes is None else target_bytes
    src = max(compute_seconds(flops, source, source_precision, tf32_flops=source_tf32_flops), nbytes / source.memory_bandwidth_bytes_per_s)
    tgt_compute = compute_seconds(flops, target, precision, tf32_flops=target_tf32_flops)
    tgt_memory = q_t / target.memory_bandwidth_bytes_per_s
    if src <= 0:
        return source.peak_flops(source_peak_math or source_precision) / target.peak_flops(target_peak_math or precision), "unknown"
    return max(tgt_compute, tgt_memory) / src, ("compute" if tgt_compute >= tgt_memory else "memory")


def _tf32_flops(layer: LayerProfile, part: str, m: float, tf32: tuple[str, ...]) -> float:
    """The FLOPs of ``layer``'s forward or backward at ``m`` that TF32 is allowed for (``tf32``: "matmul", "conv")."""
    total = getattr(layer, f"flops_{part}_per_sample") * m
    conv = min(getattr(layer, f"conv_flops_{part}_per_sample") * m, total)
    return ("conv" in tf32) * conv + ("matmul" in tf32) * (total - conv)


def _switches(matmul: bool | None, conv: bool | None) -> tuple[str, ...]:
    return tuple(name for name, on in (("matmul", matmul), ("conv", conv)) if on)


def project_profile(
    profile: Profile,
    target: GpuSpec,
    *,
    precision: Precision | Literal["auto"] = "auto",
    source: GpuSpec | None = None,
) -> tuple[Profile, ProjectionInfo]:
    """The profile as if it had been measured on ``target``, and how it was projected.

    Args:
        profile: a measured profile (CUDA or CPU).
        target: the GPU to project to (``gpus.GPUS[...]``, possibly ``.share(fraction)``).
        precision: math on the target. ``"auto"`` keeps the profile's dtype (float32 → ``fp32``, with TF32 for
            what the profiled run allowed it: convolutions by PyTorch's default; bf16/fp16 → ``bf16`` tensor
            peak); ``"fp32"`` is float32 without TF32; ``"tf32"`` float32 with TF32 for every matmul and
            convolution (``torch.set_float32_matmul_precision("high")``); ``"bf16"`` on a float32 profile
            also halves the activation bytes (memory sizes stay as profiled: conservative); ``"fp32"`` or
            ``"tf32"`` on a 16-bit profile is refused (its sizes would count half).
        source: peaks of the profiled device; default :func:`gpus.source_spec`.

    Returns:
        ``(projected_profile, info)``. Links are not projected (the tuner takes the network from the
        catalog); memory sizes are device-independent and kept, the device capacity is the target's.

    Raises:
        CatalogError: the profiled CUDA device is not in the spec table, or ``"fp32"`` on a 16-bit profile.

    Example:
        >>> from lightning_distplan.costmodel.gpus import GPUS
        >>> projected, info = project_profile(profile, GPUS["A100-80GB"])  # doctest: +SKIP
        >>> info.compute_scale, info.band  # doctest: +SKIP
    """
    if source is None:
        source, basis = source_spec(profile)
    else:
        basis = f"given: {source.source or source.name}"
    profile_bytes = dtype_bytes(profile.device.dtype) or 4
    if profile_bytes not in (2, 4):
        raise CatalogError(
            f"The profile was measured in {profile.device.dtype}; projecting to catalog GPUs assumes float32 or 16-bit math.",
            hint="Profile the model in float32 or with bf16 (e.g. Trainer(precision='bf16-mixed') or distplan profile --precision bf16-mixed).",
        )
    source_precision: Precision = "bf16" if profile_bytes == 2 else "fp32"
    # A float16 profile's math is fp16, which T4 / V100 tensor cores take and bf16 they do not (GpuSpec.bf16).
    float16 = str(profile.device.dtype).lower().removeprefix("torch.") in ("float16", "fp16", "half", "16", "16-mixed", "16-true")
    auto = precision == "auto"
    if auto:
        precision = source_precision
    if precision not in ("fp32", "tf32", "bf16"):
        raise CatalogError(f"Unknown projection precision {precision!r}.", hint="Use 'auto', 'fp32', 'tf32' or 'bf16'.")
    if precision in ("fp32", "tf32") and profile_bytes == 2:
        # memory sizes are kept as profiled: 16-bit activations (and weights, for '-true') would count half their fp32 size
        raise CatalogError(
            f"The profile was measured in {profile.device.dtype}, so its memory sizes are 16-bit ones; fp32 training needs up to twice "
            "as much, which a projection cannot tell.",
            hint="Profile the model in float32 (distplan profile --precision 32-true) for fp32 predictions, or project with 'bf16' / 'auto'.",
        )
    source_math: Any = "fp16" if float16 else source_precision
    math_on_target: Any = "fp16" if float16 and auto else ("fp32" if precision == "tf32" else precision)
    act_scale = (2 if precision == "bf16" else 4) / profile_bytes
    # What ran on TF32 while profiling (a profile from before the switches were recorded: nothing, as it was read then),
    # and what is assumed to on the target: the same switches, unless told.
    source_tf32 = _switches(profile.device.tf32_matmul, profile.device.tf32_conv) if source_math == "fp32" else ()
    if math_on_target != "fp32":
        target_tf32: tuple[str, ...] = ()
    else:
        target_tf32 = source_tf32 if auto else ("matmul", "conv") if precision == "tf32" else ()
    # where no FLOPs tell the maths apart (a layer with neither FLOPs nor bytes, or no layer time at all): the peaks of
    # the math matmuls ran in, most of a model's work
    source_peak: Any = "tf32" if "matmul" in source_tf32 else source_math
    target_peak: Any = "tf32" if "matmul" in target_tf32 else math_on_target

    sizes = sorted(set(profile.micro_batch_sizes))
    m_ref = sizes[-1]
    new_layers: list[LayerProfile] = []
    scales: list[float] = []
    bounds: list[str] = []
    prev_out = 0.0
    for layer in profile.layers:
        fwd_pts: list[float] = []
        bwd_pts: list[float] = []
        bound = "unknown"
        for m in sizes:
            fb, bb = layer_bytes(layer, m, input_bytes_per_sample=prev_out)
            fb_t, bb_t = layer_bytes(layer, m, input_bytes_per_sample=prev_out, activation_scale=act_scale)
            rf, bound_f = roofline_ratio(layer.flops_forward_per_sample * m, fb, source, target, source_precision=source_math, precision=math_on_target, target_bytes=fb_t,
                                         source_tf32_flops=_tf32_flops(layer, "forward", m, source_tf32), target_tf32_flops=_tf32_flops(layer, "forward", m, target_tf32),
                                         source_peak_math=source_peak, target_peak_math=target_peak)
            rb, _ = roofline_ratio(layer.flops_backward_per_sample * m, bb, source, target, source_precision=source_math, precision=math_on_target, target_bytes=bb_t,
                                   source_tf32_flops=_tf32_flops(layer, "backward", m, source_tf32), target_tf32_flops=_tf32_flops(layer, "backward", m, target_tf32),
                                   source_peak_math=source_peak, target_peak_math=target_peak)
            fwd_pts.append(max(layer.forward(m), 0.0) * rf)
            bwd_pts.append(max(layer.backward(m), 0.0) * rb)
            if m == m_ref:
                bound = bound_f
        new_fwd = _refit(layer.forward, sizes, fwd_pts)
        new_bwd = _refit(layer.backward, sizes, bwd_pts)
        measured = layer.time(m_ref)
        scales.append(new_fwd(m_ref) + new_bwd(m_ref) if measured <= 0 else (new_fwd(m_ref) + new_bwd(m_ref)) / measured)
        bounds.append(bound)
        new_layers.append(replace(layer, forward=new_fwd, backward=new_bwd, samples=()))
        prev_out = layer.output_bytes_per_sample

    # Whole-step fit: scaled by the projected / measured sum of layers at each size (the step
    # includes the loss and glue the layers miss; they are assumed to scale like the layers).
    def layer_sum(layers: tuple[LayerProfile, ...] | list[LayerProfile], m: int, part: str) -> float:
        return sum(max(getattr(lay, part)(m), 0.0) for lay in layers)

    step_pts: dict[str, list[float]] = {"forward": [], "backward": []}
    for m in sizes:
        for part in ("forward", "backward"):
            before = layer_sum(profile.layers, m, part)
            after = layer_sum(new_layers, m, part)
            r = after / before if before > 0 else source.peak_flops(source_peak) / target.peak_flops(target_peak)
            step_pts[part].append(max(getattr(profile.step, part)(m), 0.0) * r)
    new_step = StepProfile(forward=_refit(profile.step.forward, sizes, step_pts["forward"]), backward=_refit(profile.step.backward, sizes, step_pts["backward"]))
    step_before = profile.step.time(m_ref)
    compute_scale = new_step.time(m_ref) / step_before if step_before > 0 else (sum(scales) / len(scales))

    # The optimizer update is elementwise over parameters, gradients and state: memory-bound.
    opt_scale = source.memory_bandwidth_bytes_per_s / target.memory_bandwidth_bytes_per_s
    new_opt = OptimizerProfile(name=profile.optimizer.name, state_bytes=profile.optimizer.state_bytes, step_time_s=profile.optimizer.step_time_s * opt_scale)

    new_memory = replace(profile.memory, device_total_bytes=int(target.memory_bytes), device_total_source=f"spec table: {target.source}")
    # A size that ran out of memory on the profiled device says nothing of a larger one (the memory model decides
    # there); on one no larger it stays out, as on the profiled device (DESIGN §3.4). Rows against rows: what torch
    # measured is always a little under the datasheet (79.2 GiB on an 80 GB H100), so the profiled part's own row
    # would count as larger than the device.
    out_of_memory = profile.infeasible_micro_batch_sizes if int(target.memory_bytes) <= int(source.memory_bytes) else ()
    new_device = DeviceProfile(
        type="cuda",
        name=target.name,
        total_memory_bytes=int(target.memory_bytes),
        memory_source=f"spec table: {target.source}",
        dtype="bfloat16" if precision == "bf16" else "float32",
        count=profile.device.count,
        tf32_matmul="matmul" in target_tf32,
        tf32_conv="conv" in target_tf32,
    )
    versions = dict(profile.versions)
    versions["projection"] = f"{profile.device.name} -> {target.name} ({precision}, roofline ratio)"
    projected = replace(profile, device=new_device, layers=tuple(new_layers), step=new_step, optimizer=new_opt, memory=new_memory, versions=versions,
                        infeasible_micro_batch_sizes=out_of_memory)

    pct, band, why = _uncertainty(source, target, bounds)
    info = ProjectionInfo(
        source=source.name,
        source_basis=basis,
        target=target.name,
        target_source=target.source,
        precision=precision,
        tf32=target_tf32,
        source_tf32=source_tf32,
        reference_micro_batch_size=m_ref,
        compute_scale=compute_scale,
        layer_scales=tuple(scales),
        layer_bounds=tuple(bounds),
        optimizer_scale=opt_scale,
        uncertainty_pct=pct,
        band=band,
        uncertainty_basis=why,
    )
    return projected, info


def _refit(original: LinearFit, sizes: list[int], ys: list[float]) -> LinearFit:
    # One profiled size cannot separate α from β: scale both by the single ratio.
    if len(sizes) < 2:
        m = sizes[0]
        before = original(m)
        r = ys[0] / before if before > 0 else 0.0
        return LinearFit(alpha=original.alpha * r, beta=original.beta * r, r2=original.r2)
    fit = LinearFit.fit([float(m) for m in sizes], ys)
    if fit.alpha < 0 <= original.alpha:
        # The projected points can fall with m where the measured ones rise: the roofline ratio changes
        # across the profiled sizes (a CPU profile at m = 1, 2, 4 projected to an A10 went 0.63, 0.60,
        # 0.54 ms), and the line through them reaches zero time at m ≈ 23. A time per sample is never
        # negative: scale the measured line by the ratio at the largest profiled size instead, the regime
        # larger micro-batches extend.
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        before = original(sizes[i])
        r = ys[i] / before if before > 0 else 0.0
        return LinearFit(alpha=original.alpha * r, beta=original.beta * r, r2=original.r2)
    # r2 stays the measurement's: the projection itself is exact on the fitted points' line up to
    # the roofline's change of bound, so the fit quality worth reporting is the measured one.
    return LinearFit(alpha=fit.alpha, beta=fit.beta, r2=original.r2)


def _uncertainty(source: GpuSpec, target: GpuSpec, bounds: list[str]) -> tuple[float, tuple[float, float], str]:
    """The stated uncertainty band of a projection, and its basis (not measured here)."""
    if source.kind == "cpu":
        # A CPU and a GPU differ in per-kernel efficiency, launch overheads (µs per kernel on a GPU,
        # dominant for tiny layers) and which kernels run at all; a layer-level ratio cannot see that.
        factor = 3.0
        why = (
            "CPU-to-GPU projection with a layer-level roofline ratio from an estimated CPU peak: coarse, "
            "stated as a factor of 3 either way (not validated); profile on a GPU for a usable projection. "
            "For comparison Habitat (ATC'21), which scales GPU kernels individually, reports 11.8% average error GPU-to-GPU."
        )
    else:
        factor = 1.35
        why = (
            "GPU-to-GPU layer-level roofline ratio: stated as a factor of 1.35 either way, 0.74x to 1.35x (not validated here). Habitat (ATC'21) reports "
            "11.8% average error with a far richer kernel-level method; a per-layer ratio ignores kernel launch "
            "overheads and kernel choice, so the band is set about three times wider."
        )
    if target.estimate or source.estimate and source.kind != "cpu":
        factor *= 1.15
        why += " Widened by 15%: a peak in the table is an estimate (or a shared GPU slice assumed to scale linearly)."
    if bounds and all(b == "unknown" for b in bounds):
        factor = max(factor, 3.0)
        why += " The profile has neither FLOPs nor byte counts: every layer was scaled by the ratio of peaks."
    pct = (factor - 1.0) * 100.0
    return round(pct, 1), (round(1.0 / factor, 4), round(factor, 4)), why
