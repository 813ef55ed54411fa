"""Roofline projection of a profile to another GPU (DESIGN §4), checked against hand-computed ratios."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tuner"))
from tuner_profile_factory import make_profile  # noqa: E402

from lightning_distplan.costmodel.gpus import GPUS, CPU_MEMORY_BANDWIDTH_ASSUMED, GpuSpec, gpu_spec, match_gpu_name, source_spec  # noqa: E402
from lightning_distplan.costmodel.projection import layer_bytes, project_profile, roofline_ratio  # noqa: E402
from lightning_distplan.errors import CatalogError  # noqa: E402
from lightning_distplan.profile import Profile  # noqa: E402


def test_gpu_names_match_catalog_and_torch_spellings():
    assert match_gpu_name("Tesla T4") == "T4"
    assert match_gpu_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert match_gpu_name("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert match_gpu_name("A100") == "A100-40GB"  # SkyPilot's name for the 40 GB part
    assert match_gpu_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert match_gpu_name("NVIDIA H100 PCIe") == "H100-PCIe"
    assert match_gpu_name("NVIDIA A10G") == "A10G"
    assert match_gpu_name("NVIDIA A10") == "A10"
    assert match_gpu_name("NVIDIA L40S") == "L40S"
    assert match_gpu_name("Radeon 7900") is None
    assert match_gpu_name("Tesla V100-SXM2-16GB") == "V100" and match_gpu_name("NVIDIA H200 141GB HBM3e") == "H200"
    # PCIe parts are their own rows (not the SXM ones: less bandwidth, no NVLink), as torch names them
    assert match_gpu_name("NVIDIA A100-PCIE-40GB") == "A100-PCIe-40GB" and match_gpu_name("NVIDIA A100 80GB PCIe") == "A100-PCIe-80GB"
    assert match_gpu_name("NVIDIA H100 NVL") == "H100-NVL" and GPUS["H100-NVL"].memory_bandwidth_bytes_per_s == pytest.approx(3.9e12)
    assert GPUS["A100-PCIe-80GB"].interconnect_bytes_per_s < GPUS["A100-80GB"].interconnect_bytes_per_s
    assert match_gpu_name("NVIDIA H200 NVL") == "H200-NVL" and match_gpu_name("Tesla V100-PCIE-16GB") == "V100-PCIe"
    # Whole words only, and a memory size the row does not have is another part: refused, not taken for a neighbour.
    for other in ("NVIDIA L40", "L40", "GH200", "NVIDIA GH200 480GB", "Tesla V100-PCIE-64GB"):
        assert match_gpu_name(other) is None, other
    # the 32 GB V100 (SkyPilot's "V100-32GB", AWS p3dn) has a row of its own, not the 16 GB one
    assert match_gpu_name("V100-32GB") == match_gpu_name("Tesla V100-SXM2-32GB") == "V100-32GB"
    # and so has the 32 GB PCIe V100, as torch names it: it was unknown, and a profile taken on one could not be projected
    assert match_gpu_name("Tesla V100-PCIE-32GB") == match_gpu_name("V100-PCIe-32GB") == "V100-PCIe-32GB"
    pcie, pcie32 = GPUS["V100-PCIe"], GPUS["V100-PCIe-32GB"]
    assert (pcie32.tensor_flops, pcie32.fp32_flops, pcie32.memory_bandwidth_bytes_per_s, pcie32.interconnect_bytes_per_s) == (
        pcie.tensor_flops, pcie.fp32_flops, pcie.memory_bandwidth_bytes_per_s, pcie.interconnect_bytes_per_s)
    assert pcie32.memory_bytes == 32 * 2**30 and not pcie32.bf16 and pcie32.tf32_flops is None
    with pytest.raises(CatalogError, match=r"Unknown GPU 'MI300X'.*T4, A10, A10G.*HINT:"):
        gpu_spec("MI300X")


def test_every_row_has_a_source_and_the_estimate_is_marked():
    for name, spec in GPUS.items():
        assert spec.source, name
        assert spec.tensor_flops >= spec.fp32_flops > 0
        # TF32 on Ampere and later parts, between the FP32 and the 16-bit tensor rates; none on T4 and V100
        assert (spec.tf32_flops is None) == (name in ("T4", "V100", "V100-32GB", "V100-PCIe", "V100-PCIe-32GB")), name
        assert spec.tf32_flops is None or spec.fp32_flops < spec.tf32_flops < spec.tensor_flops, name
        assert spec.peak_flops("tf32") == (spec.tf32_flops or spec.fp32_flops)
    assert GPUS["A10G"].estimate and not GPUS["A10"].estimate
    assert GPUS["H100-SXM"].tensor_flops == pytest.approx(989e12)
    assert GPUS["H200"].memory_bandwidth_bytes_per_s == pytest.approx(4.8e12)
    text = Path(__file__).resolve().parents[2].joinpath("lightning_distplan/costmodel/gpus.py").read_text()
    previous = text.index("GPUS: dict[str, GpuSpec] = {")
    for name in GPUS:
        # each row is preceded by its own "# source:" comment (between the previous row and this one)
        row = text.index(f'"{name}": _row(')
        assert "# source:" in text[previous:row], name
        previous = row


def test_gddr_parts_give_ecc_its_sixteenth_of_the_memory():
    """CUDA's Best Practices Guide: ECC on GDDR memory takes 6.25% of it (a 16 GB T4 shows 15 GiB); HBM parts keep
    all of theirs. Names still match the datasheet's size, and the 90% headroom is taken of what is left."""
    for name in ("T4", "A10", "A10G", "L4", "L40S"):
        spec = GPUS[name]
        assert spec.ecc_fraction == 1 / 16 and spec.memory_bytes == int(spec.listed_memory_gib * 2**30 * 15 / 16), name
    assert GPUS["T4"].memory_bytes == 15 * 2**30 and GPUS["T4"].listed_memory_gib == 16
    for name in ("V100", "V100-32GB", "V100-PCIe", "V100-PCIe-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200"):
        assert GPUS[name].ecc_fraction == 0 and GPUS[name].memory_bytes == GPUS[name].listed_memory_gib * 2**30, name
    assert match_gpu_name("NVIDIA T4 16GB") == "T4" and match_gpu_name("NVIDIA A10 24GB") == "A10"
    half = GPUS["A10"].share(0.5)
    assert half.memory_bytes == GPUS["A10"].memory_bytes // 2 and half.ecc_fraction == 1 / 16


def test_shared_gpu_scales_peaks_and_takes_the_sold_memory():
    a10 = GPUS["A10"]
    sixth = a10.share(1 / 6, memory_bytes=4 << 30)
    assert sixth.fp32_flops == pytest.approx(a10.fp32_flops / 6)
    assert sixth.memory_bandwidth_bytes_per_s == pytest.approx(a10.memory_bandwidth_bytes_per_s / 6)
    assert sixth.memory_bytes == 4 << 30 and sixth.estimate


def test_roofline_ratio_by_hand():
    t4, a100 = GPUS["T4"], GPUS["A100-80GB"]
    # compute-bound on both: ratio of fp32 peaks 8.1 / 19.5
    r, bound = roofline_ratio(1e12, 1e6, t4, a100, source_precision="fp32", precision="fp32")
    assert r == pytest.approx(8.1 / 19.5) and bound == "compute"
    # memory-bound on both: ratio of bandwidths 320 / 2039
    r, bound = roofline_ratio(1e3, 1e9, t4, a100, source_precision="fp32", precision="fp32")
    assert r == pytest.approx(320 / 2039) and bound == "memory"
    # mixed: 1e10 FLOPs, 1e9 bytes. T4: max(1e10/8.1e12, 1e9/320e9) = 3.125e-3 (memory);
    # A100: max(1e10/19.5e12, 1e9/2039e9) = 5.128e-4 (compute)
    r, bound = roofline_ratio(1e10, 1e9, t4, a100, source_precision="fp32", precision="fp32")
    assert r == pytest.approx(max(1e10 / 19.5e12, 1e9 / 2039e9) / max(1e10 / 8.1e12, 1e9 / 320e9))
    assert bound == "compute"


def test_layer_bytes_by_hand():
    layer = make_profile().layers[0]
    fwd, bwd = layer_bytes(layer, 4, input_bytes_per_sample=100.0)
    assert fwd == pytest.approx(28e6 + 4 * 100 + 4 * 2.6e6 + 4 * 262144)
    assert bwd == pytest.approx(2 * 28e6 + 4 * 2.6e6 + 4 * 262144 + 4 * 100)


def test_compute_bound_profile_projects_by_the_peak_ratio():
    # 1.8 GFLOP fwd per sample on a T4: at m=1 F/P = 2.2e-4 s vs bytes/BW <= 1e-4 s, so every layer is
    # compute-bound on both GPUs at every profiled size -> α and β scale by exactly 8.1/19.5.
    profile = make_profile()
    projected, info = project_profile(profile, GPUS["A100-80GB"])
    ratio = 8.1 / 19.5
    for before, after in zip(profile.layers, projected.layers):
        assert after.forward.alpha == pytest.approx(before.forward.alpha * ratio)
        assert after.forward.beta == pytest.approx(before.forward.beta * ratio)
        assert after.backward.alpha == pytest.approx(before.backward.alpha * ratio)
    assert info.layer_bounds == ("compute",) * 12
    assert info.compute_scale == pytest.approx(ratio)
    assert projected.step.time(8) == pytest.approx(profile.step.time(8) * ratio)
    # optimizer step is memory-bound: bandwidth ratio
    assert projected.optimizer.step_time_s == pytest.approx(profile.optimizer.step_time_s * 320 / 2039)
    assert projected.device.name == "A100-80GB" and projected.memory.device_total_bytes == GPUS["A100-80GB"].memory_bytes
    assert projected.memory.param_bytes == profile.memory.param_bytes  # memory sizes are device-independent
    assert info.band == (pytest.approx(1 / 1.35, rel=1e-3), pytest.approx(1.35)) and "Habitat" in info.uncertainty_basis
    # JSON round trip of the projected profile stays valid
    Profile.from_dict(projected.to_dict())


def test_memory_bound_layer_projects_by_bandwidth_and_bound_changes_with_m():
    profile = make_profile(flops_fwd=1e3)  # essentially no FLOPs: pure bandwidth
    projected, info = project_profile(profile, GPUS["H100-SXM"])
    assert info.layer_bounds[0] == "memory"
    assert projected.layers[3].forward(4) == pytest.approx(profile.layers[3].forward(4) * 320 / 3350, rel=1e-6)


def test_bf16_projection_uses_tensor_peak():
    # small parameters keep every layer compute-bound on the H100 even at m=1 in bf16
    # (m=1: 1.8e9/989e12 = 1.8e-6 s of math vs (1e6 + 0.5·2.86e6)/3.35e12 = 7.3e-7 s of traffic)
    profile = make_profile(param_bytes_per_layer=1_000_000)
    _, fp32 = project_profile(profile, GPUS["H100-SXM"], precision="fp32")
    _, bf16 = project_profile(profile, GPUS["H100-SXM"], precision="bf16")
    assert fp32.compute_scale == pytest.approx(8.1 / 67)
    assert bf16.compute_scale == pytest.approx(8.1 / 989)


def test_bf16_on_parts_without_bf16_tensor_cores_runs_at_the_fp32_rate():
    """T4 and V100 tensor cores take FP16, not BF16: a bf16 model gets their FP32 peak there, an fp16 one the tensor peak."""
    from dataclasses import replace as change

    h100 = make_profile(param_bytes_per_layer=1_000_000, device_name="NVIDIA H100 80GB HBM3")
    for dtype, t4_peak in (("bf16-mixed", 8.1), ("bfloat16", 8.1), ("16-mixed", 65), ("float16", 65)):
        profile = change(h100, device=change(h100.device, dtype=dtype))
        _, info = project_profile(profile, GPUS["T4"])
        assert info.compute_scale == pytest.approx(989 / t4_peak, rel=1e-6), dtype
    _, explicit = project_profile(change(h100, device=change(h100.device, dtype="16-mixed")), GPUS["V100"], precision="bf16")
    assert explicit.compute_scale == pytest.approx(989 / 15.7, rel=1e-6)  # --precision bf16 is bf16, whatever was profiled
    _, a100 = project_profile(change(h100, device=change(h100.device, dtype="bf16-mixed")), GPUS["A100-80GB"])
    assert a100.compute_scale == pytest.approx(989 / 312, rel=1e-6)


def _tf32_profile(*, matmul: bool | None, conv: bool | None, conv_share: float = 0.0, device_name: str = "NVIDIA H100 80GB HBM3") -> Profile:
    """A compute-bound float32 profile (small parameters) whose layers spend ``conv_share`` of their FLOPs in convolutions."""
    base = make_profile(param_bytes_per_layer=1_000_000, device_name=device_name)
    layers = tuple(replace(layer, conv_flops_forward_per_sample=conv_share * layer.flops_forward_per_sample,
                           conv_flops_backward_per_sample=conv_share * layer.flops_backward_per_sample) for layer in base.layers)
    return replace(base, layers=layers, device=replace(base.device, tf32_matmul=matmul, tf32_conv=conv))


def test_float32_work_that_ran_on_tf32_is_projected_from_the_tf32_peak():
    """A float32 H100 profile whose matmuls ran on TF32 (set_float32_matmul_precision("high")) took the H100's TF32
    rate (494.5 dense), not its plain FP32 one (67): a T4, which has no TF32, is 494.5 / 8.1 = 61x slower, not 8.3x."""
    _, ran_tf32 = project_profile(_tf32_profile(matmul=True, conv=True), GPUS["T4"])
    assert ran_tf32.compute_scale == pytest.approx(494.5 / 8.1, rel=1e-6)
    assert ran_tf32.source_tf32 == ("matmul", "conv") and ran_tf32.tf32 == ("matmul", "conv")
    # the same run with TF32 off, and a profile written before the switches were recorded (read as nothing on TF32)
    for matmul in (False, None):
        _, plain = project_profile(_tf32_profile(matmul=matmul, conv=matmul), GPUS["T4"])
        assert plain.compute_scale == pytest.approx(67 / 8.1, rel=1e-6) and plain.source_tf32 == ()
    # on an A100 the target runs what the profiled run allowed on TF32 too ("auto"), or what it is told to
    _, a100 = project_profile(_tf32_profile(matmul=True, conv=True), GPUS["A100-80GB"])
    assert a100.compute_scale == pytest.approx(494.5 / 156, rel=1e-6)
    _, strict = project_profile(_tf32_profile(matmul=True, conv=True), GPUS["A100-80GB"], precision="fp32")
    assert strict.compute_scale == pytest.approx(494.5 / 19.5, rel=1e-6) and strict.tf32 == ()
    _, told = project_profile(_tf32_profile(matmul=False, conv=False), GPUS["A100-80GB"], precision="tf32")
    assert told.compute_scale == pytest.approx(67 / 156, rel=1e-6) and told.tf32 == ("matmul", "conv") and told.precision == "tf32"
    # bf16 on the target: the source side still ran TF32
    _, bf16 = project_profile(_tf32_profile(matmul=True, conv=True), GPUS["A100-80GB"], precision="bf16")
    assert bf16.compute_scale == pytest.approx(494.5 / 312, rel=1e-6) and bf16.tf32 == ()


def test_a_layer_with_neither_flops_nor_bytes_takes_the_peaks_of_the_math_matmuls_ran_in():
    """No FLOPs, no bytes: the ratio of peaks, of TF32 where matmuls ran (or are to run) on it, as the rest of the model."""
    base = _tf32_profile(matmul=False, conv=False)
    empty = replace(base.layers[0], param_bytes=0, param_count=0, activation_bytes_per_sample=0.0, output_bytes_per_sample=0.0,
                    flops_forward_per_sample=0.0, flops_backward_per_sample=0.0)
    profile = replace(base, layers=(empty,))
    for matmul, precision, ratio in ((False, "auto", 67 / 19.5), (True, "auto", 494.5 / 156), (False, "tf32", 67 / 156), (True, "fp32", 494.5 / 19.5)):
        _, info = project_profile(replace(profile, device=replace(profile.device, tf32_matmul=matmul)), GPUS["A100-80GB"], precision=precision)
        assert info.layer_bounds == ("unknown",) and info.layer_scales[0] == pytest.approx(ratio, rel=1e-6), (matmul, precision)


def test_convolutions_and_matmuls_follow_their_own_tf32_switch():
    """PyTorch's defaults: convolutions on TF32 (cuDNN), matmuls not. A layer with 3/4 of its FLOPs in convolutions
    takes F·(3/4)/P_tf32 + F·(1/4)/P_fp32 on each device (the sum of the two maths' times)."""
    _, info = project_profile(_tf32_profile(matmul=False, conv=True, conv_share=0.75), GPUS["A10"])
    h100 = 0.75 / 494.5 + 0.25 / 67
    a10 = 0.75 / 62.5 + 0.25 / 31.2
    assert info.compute_scale == pytest.approx(a10 / h100, rel=1e-6) and info.source_tf32 == ("conv",) and info.tf32 == ("conv",)
    projected, _ = project_profile(_tf32_profile(matmul=False, conv=True, conv_share=0.75), GPUS["A10"])
    assert (projected.device.tf32_matmul, projected.device.tf32_conv) == (False, True)
    Profile.from_dict(projected.to_dict())  # the projected profile stays a valid one


def test_a_size_that_ran_out_of_memory_stays_out_only_on_a_device_no_larger():
    """m = 16 ran out of memory on a T4: on an 80 GiB A100 the memory model decides (it kept every m >= 16 out, so a
    28%-dearer plan was picked); on a T4 (its row against its row: torch reports 14.76 GiB of its 15) or a slice of
    another part it stays out."""
    from lightning_distplan.costmodel import Hardware, predict
    from lightning_distplan.plan import Plan

    profile = make_profile(infeasible=(16,))  # a Tesla T4
    t4_measured = replace(profile, memory=replace(profile.memory, device_total_bytes=15_843_721_216))  # 14.76 GiB, what torch reports
    big, _ = project_profile(t4_measured, GPUS["A100-80GB"])
    assert big.infeasible_micro_batch_sizes == ()
    for measured in (profile, t4_measured):  # on the profiled part's own row (15 GiB), however much torch saw of it
        same, _ = project_profile(measured, GPUS["T4"])
        assert same.infeasible_micro_batch_sizes == (16,)
    sixth, _ = project_profile(make_profile(infeasible=(16,), device_name="NVIDIA A10"), GPUS["A10"].share(1 / 6))
    assert sixth.infeasible_micro_batch_sizes == (16,)
    plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=16, accumulate_grad_batches=1, global_batch_size=16)
    on_a100 = predict(big, plan, Hardware.from_profile(big))
    assert on_a100.feasible, on_a100.reason


def test_a_16_bit_profile_is_not_projected_to_tf32_either():
    profile = make_profile(device_name="NVIDIA H100 80GB HBM3")
    with pytest.raises(CatalogError, match=r"16-bit ones.*HINT:"):
        project_profile(replace(profile, device=replace(profile.device, dtype="bf16-mixed")), GPUS["A100-80GB"], precision="tf32")


def test_cpu_profile_estimates_host_peak_from_the_profile_and_says_it_is_coarse():
    profile = make_profile(device_type="cpu", device_name="x86_64")
    spec, basis = source_spec(profile)
    # best per-layer rate at m=8: 3 * 1.8e9 * 8 FLOPs over (4.5e-4*8+1e-4) + (9e-4*8+2e-4) s
    expected = 3 * 1.8e9 * 8 / (4.5e-4 * 8 + 1e-4 + 9e-4 * 8 + 2e-4)
    assert spec.fp32_flops == pytest.approx(expected)
    assert spec.memory_bandwidth_bytes_per_s == CPU_MEMORY_BANDWIDTH_ASSUMED
    assert "estimated" in basis and spec.kind == "cpu"
    projected, info = project_profile(profile, GPUS["A10"])
    assert info.band[1] >= 3.0 and "coarse" in info.uncertainty_basis
    # With one profiled size the projection is exact at that size: the best layer (all layers are equal
    # here, compute-bound on both sides at m=8) runs at the target's peak, F / P_target.
    single = make_profile(device_type="cpu", device_name="x86_64", micro_batch_sizes=(8,))
    projected, _ = project_profile(single, GPUS["A10"])
    m = 8
    assert projected.layers[0].time(m) == pytest.approx(3 * 1.8e9 * m / 31.2e12, rel=1e-6)


def test_unknown_profiled_gpu_is_a_catalog_error():
    profile = replace(make_profile(), device=replace(make_profile().device, name="Mystery GPU 9000"))
    # it names the profiled device as such, and a way out that needs no source edit
    with pytest.raises(CatalogError, match=r"The profile was measured on 'Mystery GPU 9000', a GPU the spec table does not know.*HINT: Profile on one of those GPUs or on the CPU"):
        project_profile(profile, GPUS["A10"])


def test_bad_gpu_spec_is_a_catalog_error_with_a_hint():
    with pytest.raises(CatalogError, match=r"GpuSpec 'X'.*`fp32_flops` must be > 0, got 0.*HINT:"):
        GpuSpec(name="X", tensor_flops=1e12, fp32_flops=0, memory_bandwidth_bytes_per_s=1e11, memory_bytes=1)
    with pytest.raises(CatalogError, match=r"`fraction` must be in \(0, 1\], got 1.5.*HINT:"):
        replace(gpu_spec("T4"), fraction=1.5)


def test_a_16_bit_profile_is_not_projected_to_fp32():
    """Its memory sizes are 16-bit ones: an fp32 projection predicted half the peak of a float32 profile (review)."""
    profile = make_profile()
    bf16 = replace(profile, device=replace(profile.device, dtype="bfloat16"))
    with pytest.raises(CatalogError, match=r"measured in bfloat16, so its memory sizes are 16-bit ones.*HINT: Profile the model in float32"):
        project_profile(bf16, GPUS["H100-SXM"], precision="fp32")
    assert project_profile(bf16, GPUS["H100-SXM"], precision="bf16")[1].compute_scale > 0  # 16-bit to 16-bit stays
    assert project_profile(profile, GPUS["H100-SXM"], precision="fp32")[1].compute_scale > 0


def test_a_projected_step_never_gets_cheaper_with_more_samples() -> None:
    """A committed CPU profile (m = 1, 2, 4) projected to an A10: the roofline ratio falls across the three sizes,
    and the line refitted through the projected points fell with m (0 ms near m = 23, so `tune` saw m = 256 on an A10
    as cheap as m = 1 and ranked it 3x faster than an A100). The projected line keeps the measured line's rising slope."""
    source = Profile.load(Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tuner_vs_exhaustive_profile.json")
    assert source.device.type == "cpu" and source.step.forward.alpha > 0 and source.step.backward.alpha > 0
    step_ms = {}
    for name in ("A10", "A100-80GB", "T4"):
        projected, _ = project_profile(source, gpu_spec(name))
        for part in ("forward", "backward"):
            line = getattr(projected.step, part)
            assert line.alpha >= 0 and line(256) > line(4) > 0, (name, part, line)
        step_ms[name] = projected.step.time(256) * 1e3
    # the A100 (3.4x the A10's memory bandwidth, 0.6x its fp32 peak) is not slower at a large micro-batch
    assert step_ms["A100-80GB"] < step_ms["A10"] < step_ms["T4"]


def test_a_mig_slice_matches_no_row_and_its_profile_is_not_scaled_as_the_whole_gpu():
    # torch names a MIG instance after its GPU with the slice appended; the whole GPU's row would overstate its peaks.
    for name in ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"):
        assert match_gpu_name(name) is None, name
    profile = make_profile(device_name="NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    with pytest.raises(CatalogError, match=r"a MIG slice.*HINT: Profile on a whole GPU"):
        source_spec(profile)


def test_v100_variants_without_a_sourced_row_match_none_and_are_refused():
    """"Tesla V100-FHHL-16GB" (the lower-clocked half-length PCIe card) and "Tesla V100-DGXS-16GB" (the DGX Station's)
    matched the SXM2 V100 row, so a profile taken on one was scaled as if measured at the SXM2's 125 TFLOP/s, silently."""
    for name in ("Tesla V100-FHHL-16GB", "Tesla V100-DGXS-16GB", "Tesla V100-DGXS-32GB", "V100 FHHL"):
        assert match_gpu_name(name) is None, name
    for name, row in (("Tesla V100-SXM2-16GB", "V100"), ("Tesla V100-PCIE-16GB", "V100-PCIe"), ("Tesla V100-SXM2-32GB", "V100-32GB")):
        assert match_gpu_name(name) == row  # the parts the table holds still match
    profile = make_profile(device_name="Tesla V100-FHHL-16GB")
    with pytest.raises(CatalogError, match=r"'Tesla V100-FHHL-16GB': the spec table has no row for its FHHL variant.*HINT: Profile on one of the table's GPUs"):
        source_spec(profile)
    with pytest.raises(CatalogError, match=r"Unknown GPU 'Tesla V100-DGXS-16GB'.*HINT"):
        gpu_spec("Tesla V100-DGXS-16GB")
