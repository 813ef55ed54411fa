"""The training loop's own cost and CPU comm overlap in the cost model (framework breakdown term)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_distplan.costmodel import PIPELINE_SLOT_S, Hardware, loop_sync_time, predict, ring_allreduce_time
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.errors import ProfileFormatError
from lightning_distplan.plan import Plan
from lightning_distplan.profile import FrameworkProfile, LinkProfile, Profile, pool_profiles


def _profile(device: str = "cpu", per_batch: float = 0.01, per_step: float = 0.02) -> Profile:
    layer = LayerSpec(fwd_alpha=0.03, fwd_beta=0.01, bwd_alpha=0.1, bwd_beta=0.05, param_bytes=4_000_000, output_bytes_per_sample=1e3)
    links = [
        LinkProfile(kind="allreduce", backend="gloo", world_size=2, latency_s=1e-3, bandwidth_bytes_per_s=1e8),
        LinkProfile(kind="p2p", backend="gloo", world_size=2, latency_s=1e-3, bandwidth_bytes_per_s=1e8),
    ]
    p = synthetic_profile([layer, layer], step_forward=(0.1, 0.05), step_backward=(0.2, 0.1), optimizer_step_time_s=0.02, grad_bytes=8_000_000, links=links)
    return dataclasses.replace(
        p,
        device=dataclasses.replace(p.device, type=device),
        framework=FrameworkProfile(per_batch_s=per_batch, per_step_s=per_step, source="test"),
    )


def test_loop_sync_is_one_broadcast_per_batch_when_distributed():
    assert loop_sync_time(1, 1e-3) == 0.0
    assert loop_sync_time(2, 1e-3) == pytest.approx(1e-3)
    assert loop_sync_time(5, 1e-3) == pytest.approx(3e-3)  # ⌈log2 5⌉ tree levels


def test_cpu_dp_ga_adds_loop_cost_per_batch_and_hides_no_allreduce():
    profile = _profile("cpu")
    hw = Hardware.from_profile(profile)
    assert not hw.comm_overlap and not hw.host_overlap
    plan = Plan(strategy="dp_ga", dp=2, micro_batch_size=2, accumulate_grad_batches=3, global_batch_size=12)
    pred = predict(profile, plan, hw)
    # 3 batches · (10 ms loop + 1 ms broadcast) + 20 ms per optimizer step
    assert pred.breakdown["framework"] == pytest.approx(3 * 0.011 + 0.02, rel=1e-12)
    # on a CPU nothing of the all-reduce hides behind backward (gloo shares the cores)
    assert pred.breakdown["exposed_comm"] == pytest.approx(ring_allreduce_time(8e6, 2, 1e-3, 1e8), rel=1e-12)
    assert sum(pred.breakdown.values()) == pred.step_time_s


def test_cuda_hides_host_loop_behind_device_work_but_not_the_sync():
    profile = _profile("cuda")
    hw = Hardware.from_profile(profile)
    assert hw.comm_overlap and hw.host_overlap
    plan = Plan(strategy="dp_ga", dp=2, micro_batch_size=2, accumulate_grad_batches=3, global_batch_size=12)
    pred = predict(profile, plan, hw)
    # the device works 3·0.75 + 0.02 s, far longer than the 50 ms of host loop: only the broadcasts show
    assert pred.breakdown["framework"] == pytest.approx(3 * 1e-3, rel=1e-12)
    # a host-bound case: a loop slower than the device shows by the difference
    slow = dataclasses.replace(profile, framework=FrameworkProfile(per_batch_s=1.0, per_step_s=0.0))
    pred = predict(slow, plan, hw)
    assert pred.breakdown["framework"] == pytest.approx(3 * 1.0 - (3 * 0.75 + 0.02) + 3e-3, rel=1e-12)


def test_pipeline_sees_one_lightning_batch_per_step_plus_the_loss_allreduce():
    profile = _profile("cpu")
    hw = Hardware.from_profile(profile)
    plan = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=1, n_microbatches=8, global_batch_size=8)
    pred = predict(profile, plan, hw)
    loss = ring_allreduce_time(4, 2, 1e-3, 1e8)
    # on a CPU the pipelining runtime's own work adds to each of the n + p - 1 = 9 slots of the schedule
    assert pred.breakdown["framework"] == pytest.approx(0.01 + 0.02 + 1e-3 + loss + 9 * PIPELINE_SLOT_S, rel=1e-12)
    # a slot measured over the process group (FrameworkProfile.pipeline_slot_s) replaces the default
    measured = dataclasses.replace(profile, framework=dataclasses.replace(profile.framework, pipeline_slot_s=2e-3))
    assert predict(measured, plan, hw).breakdown["framework"] == pytest.approx(0.01 + 0.02 + 1e-3 + loss + 9 * 2e-3, rel=1e-12)
    # on CUDA the host queues work ahead of the device: neither the loop's nor the runtime's host work shows
    on_gpu = predict(_profile("cuda"), plan, Hardware.from_profile(_profile("cuda")))
    assert on_gpu.breakdown["framework"] == pytest.approx(1e-3 + loss, rel=1e-12)


def test_profile_without_framework_loads_as_zero_and_bad_values_are_rejected():
    data = _profile().to_dict()
    assert Profile.from_dict(data).framework.per_batch_s == 0.01
    old = {k: v for k, v in data.items() if k != "framework"}  # a profile written before the field existed
    assert Profile.from_dict(old).framework == FrameworkProfile()
    data["framework"]["per_batch_s"] = -1.0
    with pytest.raises(ProfileFormatError, match="training-loop overhead.*HINT"):
        Profile.from_dict(data)


def test_pipeline_slot_round_trips_pools_over_the_profiles_that_measured_it_and_is_checked():
    base = _profile()
    assert base.framework.pipeline_slot_s is None  # profiled without a process group
    slow, fast = (dataclasses.replace(base, framework=dataclasses.replace(base.framework, pipeline_slot_s=x)) for x in (3e-3, 1e-3))
    assert Profile.from_dict(slow.to_dict()).framework.pipeline_slot_s == 3e-3
    assert pool_profiles([slow, base, fast]).framework.pipeline_slot_s == pytest.approx(2e-3)
    assert pool_profiles([base, base]).framework.pipeline_slot_s is None
    data = slow.to_dict()
    data["framework"]["pipeline_slot_s"] = float("nan")
    with pytest.raises(ProfileFormatError, match="non-finite number at framework.pipeline_slot_s.*HINT"):
        Profile.from_dict(data)


def test_sync_wait_is_the_expected_lag_of_the_slowest_rank_per_meeting():
    from lightning_distplan.costmodel import expected_max_excess

    base = _profile("cpu", per_batch=0.0, per_step=0.0)
    noisy = dataclasses.replace(base, step=dataclasses.replace(base.step, spread=0.1))
    hw = Hardware.from_profile(noisy)
    dp = Plan(strategy="dp_ga", dp=2, micro_batch_size=2, accumulate_grad_batches=3, global_batch_size=12)
    # T_calc(2) = 0.3·2 + 0.15 = 0.75 s; 3 batches each end where the 2 replicas meet
    assert predict(noisy, dp, hw).breakdown["sync_wait"] == pytest.approx(3 * expected_max_excess(2) * 0.1 * 0.75, rel=1e-12)
    assert predict(base, dp, hw).breakdown["sync_wait"] == 0.0  # no spread measured: nothing to wait for
    single = Plan(strategy="dp_ga", dp=1, micro_batch_size=2, accumulate_grad_batches=6, global_batch_size=12)
    assert predict(noisy, single, hw).breakdown["sync_wait"] == 0.0  # one replica waits for nobody
    pipe = Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=1, n_microbatches=4, global_batch_size=4)
    pred = predict(noisy, pipe, hw)
    # two equal layers, one per stage: each stage computes half of T_calc(1) = 0.45 s; n + p − 1 = 5 slots
    assert pred.breakdown["sync_wait"] == pytest.approx(5 * expected_max_excess(2) * 0.1 * 0.225, rel=1e-9)
    assert sum(pred.breakdown.values()) == pred.step_time_s
