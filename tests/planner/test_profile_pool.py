"""``pool_profiles``: profiles taken at different times become one that predicts their mean speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_distplan.costmodel import predict
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.plan import Plan
from lightning_distplan.profile import LinearFit, LinkProfile, StepProfile, pool_profiles, poolable


def _profile(k: float, *, latency_s: float = 1e-4, bandwidth: float = 1e8, n_layers: int = 4):
    """A 4-layer model whose every time is ``k`` times the base (a host running 1/k as fast)."""
    layer = LayerSpec(fwd_alpha=0.002 * k, fwd_beta=0.001 * k, bwd_alpha=0.004 * k, bwd_beta=0.002 * k,
                      param_bytes=4_000_000, activation_bytes_per_sample=1e5, output_bytes_per_sample=4e4)
    links = [LinkProfile(kind=kind, backend="gloo", world_size=2, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth) for kind in ("allreduce", "p2p")]
    return synthetic_profile([layer] * n_layers, optimizer_step_time_s=0.01 * k, links=links)


PLANS = [
    Plan(strategy="dp_ga", dp=2, pp=1, micro_batch_size=4, accumulate_grad_batches=2, global_batch_size=16),
    Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=4, accumulate_grad_batches=1, global_batch_size=16, n_microbatches=4),
    Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=2, accumulate_grad_batches=1, global_batch_size=16, n_microbatches=8),
]


def test_mean_of_lines_is_the_least_squares_line_through_all_points() -> None:
    xs = [1, 2, 4, 8]
    a, b = LinearFit.fit(xs, [1.0, 2.1, 3.9, 8.2]), LinearFit.fit(xs, [1.5, 3.0, 6.2, 11.9])
    first = replace(_profile(1.0), step=StepProfile(forward=a, backward=a))
    second = replace(_profile(1.0), step=StepProfile(forward=b, backward=b))
    pooled = pool_profiles([first, second]).step.forward
    both = LinearFit.fit(xs + xs, [1.0, 2.1, 3.9, 8.2, 1.5, 3.0, 6.2, 11.9])
    assert pooled.alpha == pytest.approx(both.alpha) and pooled.beta == pytest.approx(both.beta)


def test_pooled_profile_predicts_between_its_profiles_and_at_their_mean_compute() -> None:
    fast, slow = _profile(1.0, latency_s=1e-4, bandwidth=2e8), _profile(1.6, latency_s=3e-4, bandwidth=1e8)
    pooled = pool_profiles([fast, slow, fast])
    for plan in PLANS:
        lo, hi, mid = (predict(p, plan).step_time_s for p in (fast, slow, pooled))
        assert lo < mid < hi, plan.describe()
        assert predict(pooled, plan).peak_memory_bytes == predict(fast, plan).peak_memory_bytes  # memory: the first profile's
    # every timing is the mean: compute at 1.2x, links at the mean time per message
    assert pooled.step.forward.alpha == pytest.approx(0.002 * 4 * 1.2)
    assert pooled.optimizer.step_time_s == pytest.approx(0.012)
    link = pooled.link("allreduce")
    for nbytes in (0, 1 << 20, 16 << 20):
        assert link.time(nbytes) == pytest.approx((2 * fast.link("allreduce").time(nbytes) + slow.link("allreduce").time(nbytes)) / 3)


def test_pooling_one_or_equal_profiles_changes_nothing() -> None:
    one = _profile(1.0)
    assert pool_profiles([one]) is one
    twice = pool_profiles([one, _profile(1.0)])
    for plan in PLANS:
        assert predict(twice, plan).step_time_s == pytest.approx(predict(one, plan).step_time_s, rel=1e-12)


def test_pooling_different_models_or_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"at least one profile\. HINT: "):
        pool_profiles([])
    with pytest.raises(ValueError, match=r"cannot average profile 1 with profile 0: .*HINT: pool only profiles of the same model"):
        pool_profiles([_profile(1.0), _profile(1.0, n_layers=3)])
    with pytest.raises(ValueError, match=r"equally many x and y values, at least one \(got 2 and 1\)\. HINT: Pass one y per x\."):
        LinearFit.fit([1, 2], [0.5])
    assert poolable(_profile(1.0), _profile(1.6)) and not poolable(_profile(1.0), _profile(1.0, n_layers=3))


def test_profiles_of_other_devices_or_precisions_are_not_pooled() -> None:
    """pool_profiles averaged a CUDA profile's timings with a CPU one's, or bf16's with fp32's, into a profile that
    predicts neither: the device, the dtype and the TF32 switches must match too."""
    base = _profile(1.0)
    cuda = replace(base, device=replace(base.device, type="cuda", name="NVIDIA H100 80GB HBM3"))
    cpu = replace(base, device=replace(base.device, type="cpu", name="cpu"))
    bf16 = replace(cuda, device=replace(cuda.device, dtype="bf16-mixed"))
    tf32 = replace(cuda, device=replace(cuda.device, tf32_matmul=True))
    other_gpu = replace(cuda, device=replace(cuda.device, name="NVIDIA A100-SXM4-80GB"))
    for a, b, why in (
        (cuda, cpu, r"on different devices \(cpu 'cpu' vs cuda 'NVIDIA H100 80GB HBM3'\)"),
        (cuda, other_gpu, r"on different devices \(cuda 'NVIDIA A100-SXM4-80GB' vs cuda 'NVIDIA H100 80GB HBM3'\)"),
        (cuda, bf16, r"in different precisions \(bf16-mixed vs float32\)"),
        (cuda, tf32, r"with different TF32 settings \(matmul True, conv None vs matmul None, conv None\)"),
    ):
        assert not poolable(a, b) and not poolable(b, a)
        with pytest.raises(ValueError, match=rf"^pool_profiles cannot average profile 1 with profile 0: they were measured {why}\. HINT: [^\n]+$"):
            pool_profiles([a, b])
    # the same device and math, however the dtype was spelled, still pools
    spelled = replace(cuda, device=replace(cuda.device, dtype="torch.float32"))
    assert poolable(cuda, spelled) and pool_profiles([cuda, spelled]).device == cuda.device


def test_step_time_lines_stay_positive_where_they_were_measured() -> None:
    """A slow small size on a noisy host tilted the least-squares backward line below zero at the largest size, and the
    profile was then refused as corrupt when read back (bench's own, auto_plan's profile.json); the line through the
    origin replaces it."""
    from lightning_distplan.profile import TimingSample

    xs, bwd = [1, 2, 4, 8], [0.010, 0.001, 0.001, 0.001]
    assert LinearFit.fit(xs, bwd)(8) < 0  # what least squares gives
    line = LinearFit.fit_times(xs, bwd)
    assert line.beta == 0.0 and line.alpha == pytest.approx(sum(x * y for x, y in zip(xs, bwd)) / sum(x * x for x in xs))
    assert all(line(x) > 0 for x in xs) and line.r2 < 0.5  # positive, and its poor fit shows
    good = [0.002 * x + 0.001 for x in xs]
    assert LinearFit.fit_times(xs, good) == LinearFit.fit(xs, good)  # a sound line is kept as it is
    base = _profile(1.0)
    samples = tuple(TimingSample(micro_batch_size=x, forward_s=0.003 * x, backward_s=b) for x, b in zip(xs, bwd))
    step = StepProfile(forward=LinearFit.fit_times(xs, [s.forward_s for s in samples]), backward=line, samples=samples)
    replace(base, step=step, micro_batch_sizes=tuple(xs)).validate()  # accepted (the least-squares line is refused)
    with pytest.raises(ValueError, match="predicts a step forward .* and backward of -"):
        replace(base, step=replace(step, backward=LinearFit.fit(xs, bwd)), micro_batch_sizes=tuple(xs)).validate()
