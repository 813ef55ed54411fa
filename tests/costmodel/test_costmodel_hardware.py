"""Hardware from a profile, and the money side: C = instances·price_per_s·T, objective C + w·T."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from lightning_distplan.costmodel import DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_LATENCY_S, Hardware, cost_per_step, objective
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.errors import CatalogError, DistPlanError, InfeasiblePlanError
from lightning_distplan.profile import LinkProfile

LINKS = (
    LinkProfile(kind="allreduce", backend="nccl", world_size=2, latency_s=2e-5, bandwidth_bytes_per_s=5e10),
    LinkProfile(kind="allreduce", backend="nccl", world_size=4, latency_s=3e-5, bandwidth_bytes_per_s=4e10),
    LinkProfile(kind="p2p", backend="nccl", world_size=2, latency_s=1e-5, bandwidth_bytes_per_s=6e10),
)


def test_from_profile_uses_measured_links_and_memory():
    prof = synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=LINKS, device_memory_bytes=24 << 30)
    hw = Hardware.from_profile(prof)
    assert hw.device_memory_bytes == 24 << 30
    # the all-reduce measured over the most ranks is the one that scales to a ring
    assert (hw.allreduce_latency_s, hw.allreduce_bandwidth_bytes_per_s) == (3e-5, 4e10)
    assert (hw.p2p_latency_s, hw.p2p_bandwidth_bytes_per_s) == (1e-5, 6e10)
    assert hw.link_source == "measured" and hw.compute_scale == 1.0 and hw.memory_margin == 0.9


def test_one_stream_hand_overs_follow_the_measured_p2p_backend():
    # gloo sends a recv's "ready" notice behind the data going the other way; NCCL's directions are independent
    gloo = tuple(replace(link, backend="gloo") for link in LINKS)
    assert Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=gloo)).p2p_one_stream
    assert not Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=LINKS)).p2p_one_stream
    # no measured link: a CPU profile trains over gloo, a CUDA one over NCCL
    assert not Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)])).p2p_one_stream
    cpu = synthetic_profile([LayerSpec(fwd_alpha=1.0)])
    cpu = replace(cpu, device=replace(cpu.device, type="cpu"))
    assert Hardware.from_profile(cpu).p2p_one_stream


def test_given_numbers_win_and_defaults_are_explicit(caplog):
    prof = synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=LINKS)
    given = Hardware.from_profile(prof, device_memory_bytes=8 << 30, bandwidth_bytes_per_s=1.25e9, latency_s=1e-4)
    assert given.device_memory_bytes == 8 << 30
    assert given.allreduce_bandwidth_bytes_per_s == given.p2p_bandwidth_bytes_per_s == 1.25e9
    assert given.allreduce_latency_s == given.p2p_latency_s == 1e-4
    assert given.link_source == "given"
    with caplog.at_level(logging.WARNING):
        default = Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)]))
    assert default.link_source == "default"
    assert default.allreduce_bandwidth_bytes_per_s == DEFAULT_BANDWIDTH_BYTES_PER_S == 5e8  # 4 Gbit/s, seed 000 Table III
    assert default.p2p_latency_s == DEFAULT_LATENCY_S
    assert "measured no all-reduce or p2p link" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # all-reduce measured, p2p not: the warning names only p2p
        half = Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=LINKS[:1]))
    assert half.allreduce_bandwidth_bytes_per_s == 5e10 and half.p2p_bandwidth_bytes_per_s == DEFAULT_BANDWIDTH_BYTES_PER_S
    assert "measured no p2p link" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a plan on one device crosses no link: nothing to warn about
        quiet = Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)]), warn_default_links=False)
    assert quiet == default and caplog.text == ""
    from lightning_distplan.planner import rank_plans

    with caplog.at_level(logging.WARNING):  # the planner on one device (bench --world-size 1) asks for no links either
        rank_plans(synthetic_profile([LayerSpec(fwd_alpha=1.0)]), world_size=1, global_batch_size=8)
    assert "measured no" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the warning states the numbers used, given or defaulted
        Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)]), latency_s=1e-5)
    assert "assuming 4 Gbit/s (seed 000 Table III, gn6i) and 10 µs (given)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # seed 000 Table III has no latency column: the 50 µs is called an assumption
        Hardware.from_profile(synthetic_profile([LayerSpec(fwd_alpha=1.0)]))
    assert "assuming 4 Gbit/s (seed 000 Table III, gn6i) and 50 µs (assumed; seed 000 lists no latency)" in caplog.text


def test_device_memory_must_be_positive_not_silently_the_profiled_one():
    prof = synthetic_profile([LayerSpec(fwd_alpha=1.0)], links=LINKS)
    with pytest.raises(DistPlanError, match="device memory must be positive, got 0 bytes.*HINT"):
        Hardware.from_profile(prof, device_memory_bytes=0)


@pytest.mark.parametrize("given, match", [
    ({"device_memory_bytes": float("nan")}, r"device memory must be a finite number of bytes, got nan\..*HINT"),
    ({"device_memory_bytes": float("inf")}, r"device memory must be a finite number of bytes, got inf\..*HINT"),
    ({"device_memory_bytes": "16"}, r"device memory must be a finite number of bytes, got '16'\..*HINT"),
    ({"bandwidth_bytes_per_s": float("nan")}, r"`bandwidth_bytes_per_s` must be a positive, finite number, got nan\..*HINT"),
    ({"bandwidth_bytes_per_s": -1.0}, r"`bandwidth_bytes_per_s` must be a positive, finite number, got -1\.0\..*HINT"),
    ({"latency_s": float("nan")}, r"`latency_s` must be a finite number of seconds, zero or more, got nan\..*HINT"),
    ({"latency_s": float("inf")}, r"`latency_s` .* got inf\..*HINT"),
    ({"ranks_per_host": 0}, r"`ranks_per_host` must be a whole number, 1 or more, got 0\..*HINT"),
    ({"ranks_per_host": 1.5}, r"`ranks_per_host` .* got 1\.5\..*HINT"),
])
def test_bad_numbers_given_to_from_profile_are_one_sentence_and_a_hint(caplog, given, match):
    """device_memory_bytes=nan ended in int()'s bare "cannot convert float NaN to integer" (inf: an OverflowError); a NaN
    or negative link was logged as "assuming nan Gbit/s (given)" and then refused under `allreduce_bandwidth_bytes_per_s`,
    a name the caller never passed; ranks_per_host=0 or 1.5 was taken without a word."""
    cpu = synthetic_profile([LayerSpec(fwd_alpha=1.0)], device_memory_bytes=8 << 30)
    cpu = replace(cpu, device=replace(cpu.device, type="cpu"))
    with caplog.at_level(logging.WARNING), pytest.raises(InfeasiblePlanError, match=match) as err:
        Hardware.from_profile(cpu, **given)
    assert isinstance(err.value, ValueError) and str(err.value).count("HINT:") == 1
    assert caplog.text == ""  # refused before the link warning, which would have quoted the bad number


def test_cpu_ranks_share_the_host_memory():
    """A CPU profile's memory is the host's RAM; the ranks on that host share it. 4 dp_ga ranks of 5.3 GiB each on an
    8 GiB host were ranked feasible (21 GiB in all)."""
    from lightning_distplan.planner import rank_plans

    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=500 << 20, activation_bytes_per_sample=50 << 20) for _ in range(2)]
    gpu = synthetic_profile(specs, device_memory_bytes=8 << 30)
    cpu = replace(gpu, device=replace(gpu.device, type="cpu", memory_source="host RAM (sysconf)"))
    assert Hardware.from_profile(cpu, ranks_per_host=4).device_memory_bytes == 2 << 30
    assert Hardware.from_profile(gpu, ranks_per_host=4).device_memory_bytes == 8 << 30  # a GPU per rank
    assert Hardware.from_profile(cpu, ranks_per_host=4, device_memory_bytes=8 << 30).device_memory_bytes == 8 << 30  # given: one rank's
    kw = dict(world_size=4, global_batch_size=16, strategies=("dp_ga",), hardware=None)
    assert not any(c.prediction.feasible for c in rank_plans(cpu, **kw))
    assert rank_plans(gpu, **kw)[0].prediction.feasible
    assert rank_plans(cpu, **{**kw, "world_size": 1})[0].prediction.feasible  # one rank has the host to itself


def test_cpu_ranks_on_several_hosts_share_only_their_own_host():
    """auto_plan and PlanningCallback pass the ranks per node: 4 ranks over 2 CPU hosts of 8 GiB give each 4 GiB, not 2."""
    from lightning_distplan.strategies._auto_planning import choose_plan

    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=300 << 20, activation_bytes_per_sample=50 << 20) for _ in range(2)]
    gpu = synthetic_profile(specs, device_memory_bytes=8 << 30)
    cpu = replace(gpu, device=replace(gpu.device, type="cpu", memory_source="host RAM (sysconf)"))
    with pytest.raises(InfeasiblePlanError):
        choose_plan(cpu, world_size=4, global_batch_size=16, strategies=("dp_ga",))  # 4 ranks on one 8 GiB host
    candidates, hardware = choose_plan(cpu, world_size=4, global_batch_size=16, strategies=("dp_ga",), ranks_per_host=2)
    assert hardware.device_memory_bytes == 4 << 30
    assert candidates[0].prediction.feasible
    from types import SimpleNamespace

    from lightning_distplan.strategies._auto_planning import ranks_per_node

    # what auto_plan and PlanningCallback pass: the trainer's processes per node
    assert [ranks_per_node(SimpleNamespace(world_size=w, num_nodes=n)) for w, n in ((4, 2), (4, 1), (1, 1))] == [2, 4, 1]


def test_ranks_on_several_nodes_share_the_node_link_for_the_stage_all_reduces():
    """auto_plan and PlanningCallback on 2 nodes of 2 GPUs: a dp=2 pp=2 pipeline has both stages on each node, whose
    all-reduces cross the node's one link at once; they were priced each as if alone on it (3 MB where 4 MB cross)."""
    from lightning_distplan.costmodel import DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_LATENCY_S, ring_allreduce_time
    from lightning_distplan.strategies._auto_planning import choose_plan

    profile = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=b) for b in (3_000_000, 1_000_000)])
    kw = dict(world_size=4, global_batch_size=8, pins={"strategy": "1f1b", "stages": 2})
    (two_nodes, *_), hardware = choose_plan(profile, ranks_per_host=2, **kw)
    assert hardware.devices_per_link == 2
    assert two_nodes.prediction.breakdown["exposed_comm"] == pytest.approx(
        ring_allreduce_time(4_000_000, 2, DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH_BYTES_PER_S), rel=1e-12)
    for one_node in (4, None):  # one node: its GPUs' rings do not cross a shared link
        (plan, *_), hardware = choose_plan(profile, ranks_per_host=one_node, **kw)
        assert hardware.devices_per_link == 1
        assert plan.prediction.breakdown["exposed_comm"] == pytest.approx(
            ring_allreduce_time(3_000_000, 2, DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH_BYTES_PER_S), rel=1e-12)


def test_plan_json_records_the_devices_behind_one_link(tmp_path):
    """plan.json records the hardware the plan was priced on; over 2 nodes of 2 GPUs the hybrid's all-reduce was priced
    with both stages' bytes on one node link (devices_per_link 2), which the record left out: its exposed_comm read
    as 4 MB over a link the record gave as the only one."""
    import json

    from lightning_distplan.strategies._auto_planning import PlanningOutcome, choose_plan, write_artifacts

    profile = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=b) for b in (3_000_000, 1_000_000)])
    for ranks_per_host, expected in ((2, 2), (4, 1)):
        candidates, hardware = choose_plan(profile, world_size=4, global_batch_size=8, pins={"strategy": "1f1b", "stages": 2},
                                           ranks_per_host=ranks_per_host)
        outcome = PlanningOutcome(plan=candidates[0].plan, candidates=tuple(candidates), hardware=hardware)
        record = json.loads(write_artifacts(tmp_path / str(ranks_per_host), profile=None, outcome=outcome).read_text())
        assert record["hardware"]["devices_per_link"] == expected


def test_format_bytes_picks_the_unit():
    from lightning_distplan.costmodel._hardware import format_bytes

    assert [format_bytes(n) for n in (1000, 2048, 3 << 19, 5 << 30)] == ["1000 B", "2.0 KiB", "1.5 MiB", "5.00 GiB"]


def test_hardware_validation_is_a_one_sentence_error():
    good = Hardware(device_memory_bytes=1, allreduce_latency_s=0, allreduce_bandwidth_bytes_per_s=1, p2p_latency_s=0, p2p_bandwidth_bytes_per_s=1)
    with pytest.raises(CatalogError, match=r"allreduce_bandwidth_bytes_per_s.*got 0.*HINT"):
        replace(good, allreduce_bandwidth_bytes_per_s=0)
    with pytest.raises(CatalogError, match="memory_margin"):
        replace(good, memory_margin=1.5)
    with pytest.raises(DistPlanError, match="device_memory_bytes"):
        replace(good, device_memory_bytes=0)


def test_cost_seed000_section_4d():
    # C = instances · price/3600 · T = 8 · (3.6/3600) · 2.5 = 0.02
    assert cost_per_step(2.5, instances=8, price_per_hour=3.6) == pytest.approx(0.02, rel=1e-12)
    assert objective(0.02, 2.5, 0.0) == pytest.approx(0.02)
    assert objective(0.02, 2.5, 4096) == pytest.approx(0.02 + 4096 * 2.5)
    with pytest.raises(CatalogError, match="instances"):
        cost_per_step(1.0, instances=0, price_per_hour=1.0)
    with pytest.raises(CatalogError, match="time_weight"):
        objective(1.0, 1.0, -1)


def test_a_whole_ranks_per_host_written_as_a_float_is_taken():
    """88059cb refused ranks_per_host=2.0 ("must be a whole number, 1 or more, got 2.0"), which from_profile took before
    and which world_size / num_nodes gives; a whole float is that many ranks, 1.5 is still refused."""
    import numpy as np

    cpu = synthetic_profile([LayerSpec(fwd_alpha=1.0)], device_memory_bytes=8 << 30)
    cpu = replace(cpu, device=replace(cpu.device, type="cpu"))
    for whole in (2.0, np.float64(2.0), np.int64(2), 4 / 2):
        hardware = Hardware.from_profile(cpu, ranks_per_host=whole, warn_default_links=False)
        assert hardware.device_memory_bytes == 4 << 30 and type(hardware.device_memory_bytes) is int
    for bad in (1.5, 0.0, float("nan"), True):
        with pytest.raises(InfeasiblePlanError, match=r"`ranks_per_host` must be a whole number, 1 or more.*HINT"):
            Hardware.from_profile(cpu, ranks_per_host=bad, warn_default_links=False)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: cost_per_step(float("nan"), instances=2, price_per_hour=1.0), "step_time_s"),
        (lambda: cost_per_step(-1.0, instances=2, price_per_hour=1.0), "step_time_s"),
        (lambda: cost_per_step(float("inf"), instances=2, price_per_hour=0.0), "step_time_s"),
        (lambda: cost_per_step(1.0, instances=True, price_per_hour=1.0), "instances"),
        (lambda: cost_per_step(1.0, instances=2, price_per_hour="3.6"), "price_per_hour"),
        (lambda: objective(float("nan"), 1.0, 0.0), "cost"),
        (lambda: objective(1.0, float("nan"), 0.0), "time_s"),
        (lambda: objective(1.0, float("inf"), 0.0), "time_s"),
        (lambda: objective(1.0, 1.0, float("nan")), "time_weight"),
        (lambda: objective(1.0, 1.0, "256"), "time_weight"),
    ],
)
def test_cost_and_objective_refuse_nan_and_other_non_numbers(call, name):
    """cost_per_step(nan, ...) and objective(nan, ...) returned nan (objective(1, nan, 0) too: 0 * nan), which ranks
    nowhere and prints as a price; a string price raised Python's bare "must be real number"."""
    with pytest.raises(CatalogError, match=rf"`{name}` must be .*got .*HINT"):
        call()
