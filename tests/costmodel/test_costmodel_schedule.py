"""The pipeline schedule's order and dependency-graph time, and 1F1B's warm-up overlap in predict()."""

from __future__ import annotations

import pytest

from lightning_distplan.costmodel import in_flight_microbatches, predict
from lightning_distplan.costmodel._schedule import schedule_time, stage_order
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.plan import Plan
from test_costmodel_time import hw


def eq1(stage_work: list[float], n: int) -> float:
    return n * max(stage_work) + sum(stage_work) - max(stage_work)


@pytest.mark.parametrize("strategy", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("n", "p"), [(1, 2), (2, 2), (5, 2), (3, 3), (8, 4), (2, 4)])
def test_every_stage_runs_each_microbatch_once_forward_before_backward(strategy, n, p):
    for k in range(p):
        order = stage_order(strategy, n, p, k)
        assert sorted(order) == sorted([("F", i) for i in range(n)] + [("B", i) for i in range(n)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(n))


@pytest.mark.parametrize("strategy", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("n", "p"), [(1, 2), (4, 2), (3, 3), (8, 4), (2, 4)])
def test_peak_microbatches_in_flight_match_the_memory_model(strategy, n, p):
    # the activations a stage holds at once, walking its order, are what the memory model charges
    for k in range(p):
        held = peak = 0
        for kind, _ in stage_order(strategy, n, p, k):
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == in_flight_microbatches(strategy, n, p, k)


@pytest.mark.parametrize("strategy", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("n", "p"), [(1, 2), (4, 2), (6, 3), (8, 4)])
def test_equal_stages_take_eq1(strategy, n, p):
    fwd, bwd = [1.0] * p, [2.0] * p
    assert schedule_time(fwd, bwd, n, strategy) == pytest.approx(eq1([3.0] * p, n))


def test_last_stage_slowest_leaves_nothing_to_overlap():
    fwd, bwd = [1.0, 2.0], [1.0, 2.0]
    for n in (1, 2, 4, 8):
        assert schedule_time(fwd, bwd, n, "1f1b") == pytest.approx(eq1([2.0, 4.0], n))
        assert schedule_time(fwd, bwd, n, "gpipe") == pytest.approx(eq1([2.0, 4.0], n))


def test_first_stage_slowest_1f1b_overlaps_the_fill_by_hand():
    # stage 0: F 2, B 2; stage 1: F 1, B 1; n = 2.
    # 1F1B: stage 0 F0 [0,2] F1 [2,4]; stage 1 F0 [2,3] B0 [3,4] (beside stage 0's F1) F1 [4,5] B1 [5,6];
    # stage 0 B0 [4,6] B1 [6,8]. GPipe: stage 1 F0 [2,3] F1 [4,5] B0 [5,6] B1 [6,7]; stage 0 B0 [6,8] B1 [8,10].
    assert schedule_time([2.0, 1.0], [2.0, 1.0], 2, "1f1b") == pytest.approx(8.0)
    assert schedule_time([2.0, 1.0], [2.0, 1.0], 2, "gpipe") == pytest.approx(10.0) == eq1([4.0, 2.0], 2)
    # a hand-over in flight delays the receiver, and starts only once the receiver has posted its recv:
    # stage 1 runs F0 [2.5,3.5] B0 [3.5,4.5], then posts gradient 0 with its recv of activation 1, sent at 4:
    # both cross [4.5,5]; F1 [5,6] B1 [6,7]; stage 0 B0 [5,7], gradient 1 crosses [7,7.5], B1 [7.5,9.5]
    assert schedule_time([2.0, 1.0], [2.0, 1.0], 2, "1f1b", hand_over=[0.5]) == pytest.approx(9.5)
    # over one stream the exchange at 4.5 takes two hand-overs: stage 1 sends gradient 0 first (stage 0's
    # recv is waiting), and its "ready" for activation 1 follows it: activation 1 crosses [5,5.5]
    assert schedule_time([2.0, 1.0], [2.0, 1.0], 2, "1f1b", hand_over=[0.5], shared_stream=True) == pytest.approx(10.0)


def heavy_first_profile():
    big = LayerSpec(fwd_alpha=0.03, bwd_alpha=0.06, param_bytes=1_000_000, activation_bytes_per_sample=1e6, output_bytes_per_sample=1e6)
    small = LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=1e6, output_bytes_per_sample=1e6)
    return synthetic_profile([big, small], step_forward=(0.04, 0.0), step_backward=(0.08, 0.0), optimizer_step_time_s=0.0)


def test_predict_takes_1f1b_warmup_overlap_off_the_bubble_and_leaves_gpipe():
    # m = 2: stage 0 F 0.06 B 0.12, stage 1 F 0.02 B 0.04 (split forced at 1); n = 2
    plans = {
        s: Plan(strategy=s, dp=1, pp=2, micro_batch_size=2, n_microbatches=2, global_batch_size=4, stage_boundaries=(1,))
        for s in ("gpipe", "1f1b")
    }
    free = hw(p2p_latency_s=0.0, p2p_bandwidth_bytes_per_s=1e18)
    one, gp = predict(heavy_first_profile(), plans["1f1b"], free), predict(heavy_first_profile(), plans["gpipe"], free)
    # eq. (1): 2·0.18 + 0.06 = 0.42 for both. The 1F1B order: stage 1 runs F0 [0.06,0.08] and B0
    # [0.08,0.12] beside stage 0's F1 [0.06,0.12], F1 [0.12,0.14] and B1 [0.14,0.18] beside stage 0's
    # B0 [0.12,0.24]; stage 0's B1 [0.24,0.36]: all of stage 1's work is hidden, 0.36 = n·St_0.
    assert schedule_time([0.06, 0.02], [0.12, 0.04], 2, "1f1b") == pytest.approx(0.36)
    assert gp.breakdown["compute"] + gp.breakdown["bubble"] == pytest.approx(0.42)
    assert one.breakdown["compute"] == pytest.approx(0.36)
    assert one.breakdown["bubble"] == pytest.approx(0.0, abs=1e-9)  # what is left: the 2e-12 s hand-overs
    assert gp.step_time_s - one.step_time_s == pytest.approx(0.06)


def test_long_schedules_extend_the_simulated_line_exactly() -> None:
    """Beyond 6·(16 + 4p) + 2 micro-batches schedule_time extends a line through four simulated lengths;
    in random cases (stage times, links, both schedules, one or two TCP streams) it equals the
    event-by-event simulation of all n."""
    import random

    from lightning_distplan.costmodel._schedule import _simulate, simulated_microbatches

    rng = random.Random(0)
    for _ in range(12):
        p = rng.choice([2, 3, 4, 8])
        fwd = [rng.uniform(0.1, 2) for _ in range(p)]
        bwd = [rng.uniform(0.1, 4) for _ in range(p)]
        hand = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(p - 1)]
        strategy, shared = rng.choice(["gpipe", "1f1b"]), rng.choice([False, True])
        for n in (simulated_microbatches(p, 10**9) + 1, 400):  # the first past the line, and one further
            full = _simulate(fwd, bwd, n, strategy, hand, shared)
            assert schedule_time(fwd, bwd, n, strategy, hand, shared_stream=shared) == pytest.approx(full, rel=1e-9)


def test_the_line_waits_for_the_busiest_stage_to_become_the_bottleneck() -> None:
    """1F1B, stages of 0.995, 0, 0.36 and 0.98 s a micro-batch: the last one, behind by the fill, set the period
    (0.98 s) from 32 to 65 micro-batches, and the first (0.995 s) only from about 70 on. The line through the four
    short runs priced 400 micro-batches at 393.355 s, below the 398 s the first stage alone computes; a period below
    the busiest stage's work is not the line's, so schedule_time simulates all n there."""
    from lightning_distplan.costmodel._schedule import _simulate

    fwd, bwd = [0.35, 0.0, 0.27, 0.15], [0.645, 0.0, 0.09, 0.83]
    for n in (291, 400):
        t = schedule_time(fwd, bwd, n, "1f1b")
        assert t >= n * 0.995
        assert t == pytest.approx(_simulate(fwd, bwd, n, "1f1b", [0.0] * 3, False), rel=1e-9)


@pytest.mark.parametrize("p", [2, 3, 8])
def test_simulated_microbatches_is_where_schedule_time_takes_its_line(p: int) -> None:
    """_predict._pricing_cost expects a pricing to cost what schedule_time simulates (simulated_microbatches, through
    _schedule.simulation_work); it repeated
    schedule_time's cutoff by hand. Up to the cutoff schedule_time simulates n itself (no short runs), one past it the
    four short runs it extends the line through, 6·n0 + 2 micro-batches together."""
    from lightning_distplan.costmodel._schedule import _line_start, _simulate_cached, simulated_microbatches

    cutoff = simulated_microbatches(p, 10**9)
    assert simulated_microbatches(p, cutoff) == cutoff and simulated_microbatches(p, 5) == 5
    fwd, bwd = [1.0 + 0.123 * p + 0.001 * k for k in range(p)], [2.0] * p  # stages no other test simulates
    before = _simulate_cached.cache_info().misses
    schedule_time(fwd, bwd, cutoff, "gpipe")
    assert _simulate_cached.cache_info().misses == before
    schedule_time(fwd, bwd, cutoff + 1, "gpipe")
    assert _simulate_cached.cache_info().misses == before + 4
    n0 = _line_start(p)
    assert n0 + (n0 + 1) + 2 * n0 + (2 * n0 + 1) == cutoff


def test_fast_routes_give_the_event_by_event_length() -> None:
    """GPipe's two sweeps and 1F1B's walk over dependencies (what schedule_time uses unless a notice
    can queue behind data) equal the event-by-event simulation exactly, in random cases with
    positive stage times and in tie-heavy ones (zero and whole-number stage times and hand-overs)."""
    import random

    from lightning_distplan.costmodel._schedule import _gpipe_length, _simulate, _simulate_in_order

    rng = random.Random(1)
    for case in range(900):
        ties = case % 3 == 0
        pick = (lambda: rng.choice([0.0, 0.5, 1.0, 2.0])) if ties else (lambda: rng.uniform(0.01, 3))
        p, n = rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 2, 3, 5, 9, 17])
        fwd, bwd = [pick() for _ in range(p)], [pick() for _ in range(p)]
        hand = [rng.choice([0.0, pick()]) for _ in range(p - 1)]
        for shared in (False, True):
            assert _gpipe_length(fwd, bwd, n, hand) == _simulate(fwd, bwd, n, "gpipe", hand, shared), (fwd, bwd, n, hand, shared)
        for strategy in ("gpipe", "1f1b"):
            assert _simulate_in_order(fwd, bwd, n, strategy, hand) == _simulate(fwd, bwd, n, strategy, hand, False), (fwd, bwd, n, hand, strategy)
        # without hand-overs the one stream changes nothing, which schedule_time's routing relies on
        assert _simulate(fwd, bwd, n, "1f1b", [0.0] * (p - 1), True) == _simulate(fwd, bwd, n, "1f1b", [0.0] * (p - 1), False)
