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


def _every_split(n_layers: int, pp: int) -> list[tuple[int, ...]]:
    from itertools import combinations

    return [tuple(c) for c in combinations(range(1, n_layers), pp - 1)]


def test_split_counts_the_tied_copy_against_memory() -> None:
    # GPT-2's shape: the tie joins the first and the last layer (layer 0 holds the 1 MB tied parameter,
    # layers 1 and 2 2 MB, layer 3 3 MB of its own), so the last stage always holds a copy. With Adam a
    # parameter byte costs 4 (itself, its gradient, two moments). Per stage, (1,) holds 4 / 32 MB, the
    # balanced (2,) 12 / 24 MB and (3,) 20 / 16 MB: under 22 MB only (3,) fits. The split used to add
    # the copy only after choosing (2,), and reported the plan as not fitting.
    layers = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=mb * 1_000_000) for mb in (1, 2, 2, 3)]
    profile = dataclasses.replace(
        synthetic_profile(layers, optimizer_step_time_s=0.0),
        shared_parameters=(SharedParameters(layers=(0, 3), param_bytes=1_000_000),),
    )
    tight = dataclasses.replace(HW, device_memory_bytes=22_000_000, memory_margin=1.0)
    plan = dataclasses.replace(_plan(1, (2,)), stage_boundaries=())
    fits = [b for b in _every_split(4, 2) if predict(profile, dataclasses.replace(plan, stage_boundaries=b), tight).feasible]
    assert fits == [(3,)]
    pred = predict(profile, plan, tight)
    assert pred.stage_boundaries == (3,) and pred.feasible, pred.reason
    assert pred.stage_memory_bytes == (20_000_000, 16_000_000)


def test_split_keeps_a_tied_pair_together_when_its_all_reduce_costs_more() -> None:
    # Six equal layers, layers 1 and 2 share a 100 MB parameter, and the all-reduce link is slow
    # (10 MB/s): the most balanced split, (3,) or (2, 4), puts them on different stages and pays a
    # ~10 s all-reduce for well under a second of pipeline; a split with no cut at 2 pays none.
    layer = LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=2_000_000)
    first_user = dataclasses.replace(layer, param_bytes=102_000_000)  # the tied parameter counts under its first user
    profile = dataclasses.replace(
        synthetic_profile([layer, first_user, *[layer] * 4], optimizer_step_time_s=0.0),
        shared_parameters=(SharedParameters(layers=(1, 2), param_bytes=100_000_000),),
    )
    for pp, balanced in ((2, (2,)), (3, (2, 4))):
        plan = Plan(strategy="1f1b", dp=1, pp=pp, micro_batch_size=1, n_microbatches=4, global_batch_size=4)
        pred = predict(profile, plan, HW)
        priced = {b: predict(profile, dataclasses.replace(plan, stage_boundaries=b), HW).step_time_s for b in _every_split(6, pp)}
        assert 2 not in pred.stage_boundaries  # layers 1 and 2 on one stage
        assert pred.breakdown["exposed_comm"] == 0.0
        assert priced[balanced] > 10 * pred.step_time_s
        # within the slowest-stage proxy's reach of the best split (partition_pipeline's docstring:
        # at pp = 3 a split with the slowest stage first prices 14% lower under 1F1B)
        assert pred.step_time_s <= 1.2 * min(priced.values())


def test_boundaries_made_for_another_model_are_refused() -> None:
    from lightning_distplan.errors import ModelSplitError

    profile = _profile(False)
    names = tuple(layer.name for layer in profile.layers)
    ours = dataclasses.replace(_plan(1, (2,)), layer_names=names)
    assert predict(profile, ours, HW).stage_boundaries == (2,)
    for other in (names[:2] + ("lm_head", names[3]), names + ("extra",)):
        with pytest.raises(ModelSplitError, match="split another model.*HINT"):
            predict(profile, dataclasses.replace(ours, layer_names=other), HW)
    # without boundaries the plan is split for this profile, whatever model it was made for
    unsplit = dataclasses.replace(ours, stage_boundaries=(), layer_names=names + ("extra",))
    assert predict(profile, unsplit, HW).stage_boundaries
