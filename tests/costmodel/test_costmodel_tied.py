"""Tied parameters (GPT-2's embedding = output head) across pipeline stages: comm and memory."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_distplan.costmodel import Hardware, predict, ring_allreduce_time
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.plan import Plan
from lightning_distplan.profile import Profile, SharedParameters

HW = Hardware(device_memory_bytes=16 << 30, allreduce_latency_s=1e-3, allreduce_bandwidth_bytes_per_s=1e7, p2p_latency_s=0.0, p2p_bandwidth_bytes_per_s=1e9)
TIED = 1_000_000


def _profile(tied: bool) -> Profile:
    layer = LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=2_000_000)
    p = synthetic_profile([layer] * 4, optimizer_step_time_s=0.0)
    return dataclasses.replace(p, shared_parameters=(SharedParameters(layers=(0, 3), param_bytes=TIED),) if tied else ())


def _plan(dp: int, split: tuple[int, ...]) -> Plan:
    return Plan(strategy="1f1b", dp=dp, pp=len(split) + 1, micro_batch_size=1, n_microbatches=4, global_batch_size=4 * dp, stage_boundaries=split)


@pytest.mark.parametrize("dp", [1, 2])
def test_tied_gradient_is_all_reduced_over_the_stages_that_hold_it(dp: int) -> None:
    plain, tied = predict(_profile(False), _plan(dp, (2,)), HW), predict(_profile(True), _plan(dp, (2,)), HW)
    # layers 0 and 3 sit on stages 0 and 1: one all-reduce of 1 MB over 2·dp ranks, after the stage's own dp all-reduce
    extra = ring_allreduce_time(TIED, 2 * dp, 1e-3, 1e7)
    assert tied.breakdown["exposed_comm"] - plain.breakdown["exposed_comm"] == pytest.approx(extra, rel=1e-12)
    # stage 1 holds its own copy of the tied parameter, its gradient and its Adam state (2x)
    assert tied.stage_memory_bytes[1] - plain.stage_memory_bytes[1] == pytest.approx(4 * TIED, abs=4)
    assert tied.stage_memory_bytes[0] == plain.stage_memory_bytes[0]


def test_tied_layers_on_one_stage_cost_nothing_extra() -> None:
    three = Plan(strategy="gpipe", dp=1, pp=2, micro_batch_size=1, n_microbatches=2, global_batch_size=2, stage_boundaries=(1,))
    # stage 0 = layer 0; stage 1 = layers 1..3: still split. A group inside one stage:
    profile = dataclasses.replace(_profile(False), shared_parameters=(SharedParameters(layers=(1, 3), param_bytes=TIED),))
    assert predict(profile, three, HW).breakdown == predict(_profile(False), three, HW).breakdown
