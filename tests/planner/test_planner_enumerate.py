"""enumerate_plans: every plan factors the user's global batch exactly (DESIGN §3.1); pins."""

from __future__ import annotations

import pytest

from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.errors import BatchNotFactorableError, InfeasiblePlanError
from lightning_distplan.planner import enumerate_plans, nearest_valid_batch_sizes, satisfies_pins

LAYER = LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1000, activation_bytes_per_sample=100)


def prof(n_layers: int = 4, splittable: bool = True):
    return synthetic_profile([LAYER] * n_layers, splittable=splittable)


def _expected(W, B, n_layers, splittable=True):
    """Brute force over all (strategy, dp, pp, m, steps) tuples."""
    out = set()
    for dp in range(1, W + 1):
        for pp in range(1, W + 1):
            if dp * pp != W:
                continue
            for m in range(1, B + 1):
                for steps in range(1, B + 1):
                    if dp * m * steps != B:
                        continue
                    if pp == 1:
                        out.add(("dp_ga", dp, 1, m, steps))
                    elif splittable and pp <= n_layers:
                        out.add(("gpipe", dp, pp, m, steps))
                        if steps >= pp:
                            out.add(("1f1b", dp, pp, m, steps))
    return out


@pytest.mark.parametrize("W,B,n_layers", [(1, 12, 4), (4, 32, 4), (6, 24, 3), (8, 16, 8), (4, 10, 4), (3, 9, 2)])
def test_enumeration_is_exactly_the_factorisations(W, B, n_layers):
    plans = enumerate_plans(prof(n_layers), world_size=W, global_batch_size=B)
    got = {(p.strategy, p.dp, p.pp, p.micro_batch_size, p.steps_per_replica) for p in plans}
    assert got == _expected(W, B, n_layers)
    assert len(got) == len(plans)  # no duplicates
    for p in plans:
        assert p.dp * p.pp == W
        assert p.dp * p.micro_batch_size * p.steps_per_replica == B == p.global_batch_size
        assert p.pp <= n_layers
        assert len(p.layer_names) == n_layers


def test_no_pipelines_for_an_unsplittable_model_and_max_pp():
    plans = enumerate_plans(prof(splittable=False), world_size=4, global_batch_size=32)
    assert plans and {p.strategy for p in plans} == {"dp_ga"}
    plans = enumerate_plans(prof(8), world_size=8, global_batch_size=64, max_pp=2)
    assert max(p.pp for p in plans) == 2
    assert {p.strategy for p in enumerate_plans(prof(), world_size=4, global_batch_size=32, strategies=("gpipe",))} == {"gpipe"}


def test_batch_not_factorable_lists_nearest_sizes():
    with pytest.raises(BatchNotFactorableError, match=r"Global batch size 10 cannot be factored over 4 devices.*HINT:.*8 or 12"):
        enumerate_plans(prof(splittable=False), world_size=4, global_batch_size=10)
    assert nearest_valid_batch_sizes(prof(splittable=False), world_size=4, global_batch_size=10) == (8, 12)
    # with pipelines B = 10 works on 4 devices (dp=2 × pp=2), so it is not an error
    assert enumerate_plans(prof(), world_size=4, global_batch_size=10)
    with pytest.raises(BatchNotFactorableError, match=r"HINT: Use the nearest valid global batch size, 8\b"):
        enumerate_plans(prof(splittable=False), world_size=8, global_batch_size=3)
    assert nearest_valid_batch_sizes(prof(splittable=False), world_size=8, global_batch_size=3) == (None, 8)


@pytest.mark.parametrize(
    "profile_kw,W,strategies,max_pp,reason",
    [
        (dict(splittable=False), 4, ("gpipe",), None, r"the model cannot be split into pipeline stages"),
        (dict(n_layers=1), 4, ("gpipe", "1f1b"), None, r"needs 2 or more stages, but the profile has only 1 layer\b"),
        (dict(n_layers=2), 9, ("gpipe", "1f1b"), None, r"every pipeline on 9 devices needs 3 or more stages, but the profile has only 2 layers"),
        (dict(), 4, ("gpipe",), 1, r"needs 2 or more stages, but max_pp is 1"),
        (dict(), 1, ("gpipe", "1f1b"), None, r"a pipeline needs at least 2 devices and the world size is 1"),
    ],
)
def test_pipeline_only_that_cannot_exist_says_why(profile_kw, W, strategies, max_pp, reason):
    # DESIGN §5: "model that cannot be split" / "more stages than layers" name the real cause, not a batch size.
    profile = prof(**profile_kw)
    with pytest.raises(BatchNotFactorableError, match=rf"No {'/'.join(strategies)} plan exists on {W} devices: .*{reason}.*HINT: Allow strategy 'dp_ga'"):
        enumerate_plans(profile, world_size=W, global_batch_size=36, strategies=strategies, max_pp=max_pp)
    # with dp_ga allowed the same request has plans: the error is about pipelines only
    assert {p.strategy for p in enumerate_plans(profile, world_size=W, global_batch_size=36, strategies=("dp_ga",) + strategies, max_pp=max_pp)} == {"dp_ga"}


@pytest.mark.parametrize("max_pp", [0, -2, 1.5, True])
def test_bad_max_pp_is_named(max_pp):
    with pytest.raises(InfeasiblePlanError, match=r"`max_pp` must be a positive integer or None, got .*HINT"):
        enumerate_plans(prof(), world_size=4, global_batch_size=32, max_pp=max_pp)


@pytest.mark.parametrize("W,B", [(0, 8), (-1, 8), (4, 0)])
def test_bad_sizes(W, B):
    with pytest.raises(ValueError, match=r"must be a positive integer.*HINT"):
        enumerate_plans(prof(), world_size=W, global_batch_size=B)


def test_absurd_sizes_are_refused_not_enumerated():
    with pytest.raises(InfeasiblePlanError, match=r"`global_batch_size` 100000000000000000000 is above the 16777216 this planner handles.*HINT"):
        enumerate_plans(prof(), world_size=4, global_batch_size=10**20)
    assert len(enumerate_plans(prof(), world_size=2, global_batch_size=1 << 24, strategies=("dp_ga",))) == 24  # m = 2^0 .. 2^23


def test_pins_select():
    plans = enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"strategy": "1f1b", "micro_batch_size": 2})
    assert plans and all(p.strategy == "1f1b" and p.micro_batch_size == 2 for p in plans)
    assert {(p.dp, p.pp) for p in plans} == {(2, 2), (1, 4)}
    plans = enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"schedule": "none", "accumulate_grad_batches": 4})
    assert [(p.strategy, p.micro_batch_size) for p in plans] == [("dp_ga", 2)]
    plans = enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"stage_boundaries": [1], "strategy": "gpipe"})
    assert plans and all(p.stage_boundaries == (1,) and p.pp == 2 and p.dp == 2 for p in plans)


@pytest.mark.parametrize(
    "pins,message",
    [
        ({"dp": 3}, r"pin dp=3 is impossible: dp must divide world_size 4"),
        ({"pp": 8}, r"pin pp=8 is impossible: pp must divide world_size 4"),
        ({"stages": 8}, r"pin stages=8 is impossible: stages must divide world_size 4"),
        ({"stages": 2, "pp": 2}, r"pins stages/pp name the same thing twice"),
        ({"micro_batch_size": 5}, r"pin micro_batch_size=5 is impossible: it must be a positive divisor of the global batch size 32"),
        ({"strategy": "gpipe"}, r"pin strategy='gpipe' is impossible: the model cannot be split"),
        ({"bogus": 1}, r"Unknown pins \['bogus'\]"),
        ({"schedule": "zb"}, r"schedule 'zb' is unknown"),
        ({"stage_boundaries": [2, 1]}, r"pin stage_boundaries=\[2, 1\] is impossible: boundaries must be strictly increasing"),
        # neither truncated ([1.7] was split at 1), split into characters ("12" was [1, 2]) nor a raw TypeError
        ({"stage_boundaries": [1.7]}, r"pin stage_boundaries=\[1.7\] is not a list of whole layer indices"),
        ({"stage_boundaries": "12"}, r"pin stage_boundaries='12' is not a list of whole layer indices"),
        ({"stage_boundaries": 3}, r"pin stage_boundaries=3 is not a list of whole layer indices"),
        ({"stages": True}, r"pin stages=True is not a count"),
    ],
)
def test_impossible_pins_are_named(pins, message):
    profile = prof(splittable="strategy" not in pins)
    with pytest.raises(InfeasiblePlanError, match=message + ".*HINT"):
        enumerate_plans(profile, world_size=4, global_batch_size=32, pins=pins)


def test_pp_pin_beyond_layers_and_conflicting_pins():
    with pytest.raises(InfeasiblePlanError, match=r"pin pp=4 is impossible: the profile has only 2 layers"):
        enumerate_plans(prof(2), world_size=4, global_batch_size=32, pins={"pp": 4})
    with pytest.raises(InfeasiblePlanError, match=r"pin strategy='1f1b' is impossible: the model has only 1 pipeline layer, so no pipeline"):
        enumerate_plans(prof(1), world_size=2, global_batch_size=32, pins={"strategy": "1f1b"})
    with pytest.raises(InfeasiblePlanError, match=r"each possible but no plan .* satisfies all of them together.*HINT"):
        enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"strategy": "dp_ga", "pp": 2})
    with pytest.raises(InfeasiblePlanError, match=r"pins strategy='dp_ga', stages=2 are each possible"):
        enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"strategy": "dp_ga", "stages": 2})
    # `stages` is `pp` under another name: the same plans, and a finished plan satisfies either.
    plans = enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"stages": 2})
    assert plans == enumerate_plans(prof(), world_size=4, global_batch_size=32, pins={"pp": 2})
    assert plans and all(p.pp == 2 for p in plans) and satisfies_pins(plans[0], {"stages": 2}) and not satisfies_pins(plans[0], {"stages": 4})


def test_micro_batches_the_model_rejected_are_never_planned():
    # e.g. BatchNorm on a 1x1 feature map refuses one sample per channel: the profiler records the
    # size as rejected and no plan, DP or pipeline, may use it (a 2-rank resnet18 run crashed on m=1).
    import dataclasses

    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import enumerate_plans

    layers = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1000, activation_bytes_per_sample=100) for _ in range(4)]
    prof = dataclasses.replace(synthetic_profile(layers), rejected_micro_batch_sizes=(1,))
    assert prof.min_micro_batch_size == 2
    plans = enumerate_plans(prof, world_size=2, global_batch_size=8)
    assert plans and min(p.micro_batch_size for p in plans) == 2
    assert {p.strategy for p in plans} >= {"dp_ga", "gpipe", "1f1b"}
    assert min(p.micro_batch_size for p in enumerate_plans(synthetic_profile(layers), world_size=2, global_batch_size=8)) == 1
    # a batch the refused size alone rules out names that cause, not the world size
    from lightning_distplan.errors import BatchNotFactorableError

    single = dataclasses.replace(prof, splittable=False)
    with pytest.raises(BatchNotFactorableError, match=r"with at least 2 samples per device\); the model refused micro-batches of 1 sample .*HINT: Use the nearest valid global batch size, 4,"):
        enumerate_plans(single, world_size=2, global_batch_size=2)
    # a refused size far above any batch near the asked one: the nearest data-parallel batch, not a give-up
    huge = dataclasses.replace(single, rejected_micro_batch_sizes=(999,))
    with pytest.raises(BatchNotFactorableError, match=r"refused micro-batches of 999 samples or fewer .*nearest valid global batch size, 2000,"):
        enumerate_plans(huge, world_size=2, global_batch_size=8)


def test_pins_the_world_size_or_the_model_rule_out_are_refused_before_profiling():
    from lightning_distplan.planner import check_pins_before_profiling

    for pins, world, reason, match in (
        ({"stages": 3}, 2, None, r"pin stages=3 is impossible: stages must divide world_size 2"),
        ({"dp": 3}, 4, None, r"pin dp=3 is impossible: dp must divide world_size 4"),
        ({"stage_boundaries": [2, 4]}, 4, None, r"pin stage_boundaries=\[2, 4\] is impossible: 3 stages do not divide world_size 4"),
        ({"strategy": "1f1b"}, 1, None, r"pin strategy='1f1b' is impossible: a pipeline needs at least 2 devices"),
        ({"schedule": "gpipe", "micro_batch_size": 2}, 2, "no PipelineSpec", r"pin schedule='gpipe' is impossible: the model cannot be split .*no PipelineSpec"),
    ):
        with pytest.raises(InfeasiblePlanError, match=match + ".*HINT: Drop or change that pin"):
            check_pins_before_profiling(pins, world_size=world, split_reason=reason)
    # what needs the profile (batch factors, layer counts) waits for it; data-parallel pins ignore a split reason
    for pins, world in (({"micro_batch_size": 5}, 1), ({"stages": 2, "strategy": "1f1b"}, 2), ({"strategy": "dp_ga", "stages": 1}, 1)):
        check_pins_before_profiling(pins, world_size=world, split_reason="no PipelineSpec" if pins.get("strategy") == "dp_ga" else None)


def test_a_profile_in_a_precision_pipelines_do_not_run_gets_data_parallel_plans_only():
    """A float16 ('16-true') profile: PipelineStrategy refuses that precision at fit, so `distplan plan` / `tune` must not
    offer gpipe/1f1b plans for it (they were ranked 'feasible: yes'; auto_plan and bench already restricted them)."""
    from dataclasses import replace

    from lightning_distplan.errors import ModelSplitError
    from lightning_distplan.tuner._space import ConfigSpace

    for dtype, pipelines in (("float16", False), ("float64", False), ("bfloat16", True), ("bf16-mixed", True), ("float32", True)):
        profile = prof()
        profile = replace(profile, device=replace(profile.device, dtype=dtype))
        plans = enumerate_plans(profile, world_size=4, global_batch_size=32)
        assert any(p.strategy != "dp_ga" for p in plans) == pipelines, dtype
        if not pipelines:
            assert profile.pipeline_refusal == f"it was profiled in {dtype} and pipelines train in 32-true, bf16-mixed or bf16-true only"
            with pytest.raises(InfeasiblePlanError, match=rf"pin strategy='gpipe' is impossible: it was profiled in {dtype}.*HINT"):
                enumerate_plans(profile, world_size=4, global_batch_size=32, pins={"strategy": "gpipe"})
            with pytest.raises(BatchNotFactorableError, match=rf"No 1f1b plan exists on 4 devices: it was profiled in {dtype}"):
                enumerate_plans(profile, world_size=4, global_batch_size=32, strategies=("1f1b",))
    half = replace(prof(), device=replace(prof().device, dtype="float16"))
    with pytest.raises(ModelSplitError, match=r"No pipeline can train .*: it was profiled in float16.*HINT: .*--precision bf16"):
        ConfigSpace(half, None, global_batch_size=32, time_weight=0.0, max_instances=4, strategies=("gpipe",))  # type: ignore[arg-type]
    space = ConfigSpace(half, None, global_batch_size=32, time_weight=0.0, max_instances=4, strategies=("gpipe",), precision="bf16")  # type: ignore[arg-type]
    assert space.strategies == ("gpipe",) and {p.strategy for p in space.plans(4)} == {"gpipe"}  # planned as bf16 ones


def test_nearest_valid_batch_sizes_equal_a_scan_and_stay_fast_on_huge_worlds():
    """The nearest sizes are solved per (strategy, dp, pp); a scan of every size with the enumerator agrees on
    random small cases. The scan took 15 to 30 s at 60,000+ devices when small micro-batches were refused."""
    import dataclasses
    import random

    from lightning_distplan.planner._enumerate import _raw_plans

    rng = random.Random(3)
    for _ in range(150):
        W, B = rng.randint(1, 24), rng.randint(1, 60)
        strategies = rng.choice([("dp_ga",), ("gpipe",), ("1f1b",), ("gpipe", "1f1b"), ("dp_ga", "gpipe", "1f1b")])
        max_pp = rng.choice([None, 2, 3])
        profile = dataclasses.replace(prof(n_layers=rng.randint(1, 6)), rejected_micro_batch_sizes=tuple(range(1, rng.randint(1, 4))))
        if not any(_raw_plans(profile, W, b, strategies, max_pp) for b in range(1, 64 * W * 4)):
            with pytest.raises(BatchNotFactorableError, match="HINT"):
                nearest_valid_batch_sizes(profile, world_size=W, global_batch_size=B, strategies=strategies, max_pp=max_pp)
            continue
        below = next((b for b in range(B - 1, 0, -1) if _raw_plans(profile, W, b, strategies, max_pp)), None)
        above = next(b for b in range(B + 1, 64 * W * (B + 4)) if _raw_plans(profile, W, b, strategies, max_pp))
        got = nearest_valid_batch_sizes(profile, world_size=W, global_batch_size=B, strategies=strategies, max_pp=max_pp)
        assert got == (below, above), (W, B, strategies, max_pp, profile.min_micro_batch_size, len(profile.layers))
    huge = dataclasses.replace(prof(n_layers=8), rejected_micro_batch_sizes=(1, 2, 3))
    assert nearest_valid_batch_sizes(huge, world_size=65521, global_batch_size=1000) == (None, 4 * 65521)
    assert nearest_valid_batch_sizes(huge, world_size=60000, global_batch_size=70001, strategies=("dp_ga",)) == (None, 240000)


def test_numpy_sizes_and_pins_plan_as_python_ints():
    np = pytest.importorskip("numpy")
    plans = enumerate_plans(prof(), world_size=np.int64(4), global_batch_size=np.int64(32), max_pp=np.int32(2), pins={"micro_batch_size": np.int64(4)})
    assert plans == enumerate_plans(prof(), world_size=4, global_batch_size=32, max_pp=2, pins={"micro_batch_size": 4})
    assert plans and all(p.micro_batch_size == 4 and type(p.global_batch_size) is int for p in plans)


def test_a_global_batch_no_plan_factors_is_refused_before_profiling_as_after():
    """distplan bench met a global batch no plan factors (3 on 2 devices, data parallel only) in rank_plans, after the
    profile (45 s for a 2-layer MLP under --precision 64-true). check_batch_before_profiling refuses it from the world
    size, the batch and the layers found alone, in the words enumerate_plans uses once the profile is there."""
    from lightning_distplan.planner import check_batch_before_profiling

    two = [LayerSpec(), LayerSpec()]
    cases = [  # (world, batch, layers, splittable, strategies)
        (2, 3, 2, True, ("dp_ga",)),  # not a multiple of the world size, data parallel only
        (4, 2, 2, True, ("dp_ga",)),  # smaller than the world size
        (2, 3, 2, False, ("dp_ga", "gpipe", "1f1b")),  # pipelines allowed, but the model cannot be split
        (4, 3, 2, True, ("dp_ga", "gpipe", "1f1b")),  # a pipeline on 4 devices would need 4 stages of 2 layers
    ]
    for world, batch, layers, splittable, strategies in cases:
        profile = synthetic_profile([LayerSpec()] * layers, splittable=splittable)
        with pytest.raises(BatchNotFactorableError) as after:
            enumerate_plans(profile, world_size=world, global_batch_size=batch, strategies=strategies)
        with pytest.raises(BatchNotFactorableError) as before:
            check_batch_before_profiling(world_size=world, global_batch_size=batch, n_layers=layers,
                                         split_reason=None if splittable else profile.split_reason, strategies=strategies)
        assert str(before.value) == str(after.value) and "HINT: Use the nearest valid global batch size" in str(before.value)
    # what a profile factors passes: 3 on 2 devices as a 2-stage pipeline, 1 on 2 devices as GPipe of one micro-batch
    for world, batch in ((2, 3), (2, 1), (1, 7), (4, 8)):
        assert enumerate_plans(synthetic_profile(two), world_size=world, global_batch_size=batch)
        check_batch_before_profiling(world_size=world, global_batch_size=batch, n_layers=2)
