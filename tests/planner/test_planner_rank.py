"""rank_plans / explain: feasible first by objective, infeasible marked, ties by memory."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from lightning_distplan.costmodel import Hardware, cost_per_step, predict
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.errors import BatchNotFactorableError
from lightning_distplan.planner import NEAR_TIE, Candidate, explain, near_tie_order, rank_plans

DESIGN_FIELDS = {
    "strategy", "schedule", "dp", "pp", "micro_batch_size", "accumulate_grad_batches", "n_microbatches", "stage_boundaries",
    "predicted_step_time_s", "predicted_peak_memory_bytes", "feasible", "reason", "breakdown", "objective",
}


def prof(**kw):
    layers = [
        LayerSpec(fwd_alpha=0.01, fwd_beta=0.001, bwd_alpha=0.02, bwd_beta=0.002, param_bytes=4_000_000, activation_bytes_per_sample=2e6, output_bytes_per_sample=1e5)
        for _ in range(4)
    ]
    return synthetic_profile(layers, optimizer_step_time_s=0.01, **kw)


def hw(memory=16 << 30, bw=1e9, p2p_latency=1e-4, p2p_bw=None):
    return Hardware(
        device_memory_bytes=memory, allreduce_latency_s=1e-4, allreduce_bandwidth_bytes_per_s=bw,
        p2p_latency_s=p2p_latency, p2p_bandwidth_bytes_per_s=bw if p2p_bw is None else p2p_bw,
    )


def test_ranked_feasible_first_by_time_and_plans_carry_their_split():
    cands = rank_plans(prof(), world_size=4, global_batch_size=32, hardware=hw(memory=120_000_000))
    assert [c.rank for c in cands] == list(range(1, len(cands) + 1))
    feas = [c.prediction.feasible for c in cands]
    assert any(feas) and not all(feas)
    assert feas == sorted(feas, reverse=True)  # all feasible ones first
    times = [c.objective for c in cands if c.prediction.feasible]
    # best first, except that a plan within 2% of the best remaining one may go first (near_tie_order)
    assert all(t <= (1 + NEAR_TIE) * min(times[i:]) for i, t in enumerate(times))
    for c in cands:
        assert c.objective == c.prediction.step_time_s
        assert c.prediction == predict(prof(), c.plan, hw(memory=120_000_000))  # re-predicting the emitted plan gives the same numbers
        if c.plan.pp > 1:
            assert len(c.plan.stage_boundaries) == c.plan.pp - 1
        if not c.prediction.feasible:
            assert "exceeds" in c.prediction.reason or "ran out" in c.prediction.reason


def test_gpipe_and_1f1b_tie_on_time_and_1f1b_wins_on_memory():
    # hand-overs that cost nothing: the schedules then take the same time (over an NCCL link 1F1B is faster)
    free = hw(p2p_latency=0.0, p2p_bw=1e30)
    cands = rank_plans(prof(), world_size=2, global_batch_size=16, strategies=("gpipe", "1f1b"), hardware=free, pins={"micro_batch_size": 2})
    assert [c.plan.strategy for c in cands] == ["1f1b", "gpipe"]
    assert cands[0].prediction.step_time_s == pytest.approx(cands[1].prediction.step_time_s, rel=1e-12)
    assert cands[0].prediction.peak_memory_bytes < cands[1].prediction.peak_memory_bytes
    assert "ties" in explain(cands) and "less peak memory" in explain(cands)


def test_price_gives_cost_plus_weighted_time():
    cands = rank_plans(prof(), world_size=4, global_batch_size=32, hardware=hw(), price_per_hour=3.0, time_weight=256.0)
    for c in cands:
        cost = cost_per_step(c.prediction.step_time_s, instances=4, price_per_hour=3.0)
        assert c.cost_per_step == pytest.approx(cost)
        assert c.objective == pytest.approx(cost + 256.0 * c.prediction.step_time_s)
    d = cands[0].to_dict()
    assert d["predicted_cost_per_step"] == cands[0].cost_per_step


def test_to_dict_has_design_fields():
    cand = rank_plans(prof(), world_size=4, global_batch_size=32, hardware=hw())[0]
    assert isinstance(cand, Candidate)
    d = cand.to_dict()
    assert DESIGN_FIELDS <= set(d)
    assert d["predicted_step_time_s"] == cand.prediction.step_time_s
    assert sum(d["breakdown"].values()) == d["predicted_step_time_s"]


def test_errors_from_rank_plans():
    with pytest.raises(ValueError, match=r"`world_size` must be a positive integer, got 0.*HINT"):
        rank_plans(prof(), world_size=0, global_batch_size=32, hardware=hw())
    with pytest.raises(BatchNotFactorableError, match=r"8 or 12"):
        rank_plans(prof(), world_size=4, global_batch_size=10, hardware=hw(), strategies=("dp_ga",))


def test_explain_table_and_why():
    cands = rank_plans(prof(), world_size=4, global_batch_size=32, hardware=hw(bw=1e7))
    text = explain(cands, top=5)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["rank", "plan", "step"]
    assert len(lines) == 2 + 5 + 1 + 1 + 1  # header, rule, 5 rows, "... more", blank, why
    assert lines[7].startswith(f"... {len(cands) - 5} more")
    # columns line up: every row's "step s" value ends where the header's does
    end = lines[0].index("step s") + len("step s")
    assert all(line[end - 1] != " " for line in lines[2:7])
    assert lines[-1].startswith("Why the winner wins: " + cands[0].plan.describe())
    assert re.search(r" s/step, \d+\.\d\dx faster than the best ", lines[-1]) and "mostly" in lines[-1], lines[-1]


def test_explain_when_nothing_fits():
    cands = rank_plans(prof(), world_size=2, global_batch_size=8, hardware=hw(memory=10_000_000))
    assert not any(c.prediction.feasible for c in cands)
    text = explain(cands)
    assert "NO: peak memory" in text
    assert text.splitlines()[-1].startswith("No plan fits in memory")


def test_near_ties_go_to_the_larger_micro_batch():
    # sorted best first: 1.00 (m=4), 1.015 (m=8, within 2%), 1.03 (m=16, not within 2% of 1.00)
    assert near_tie_order([1.00, 1.015, 1.03], [4, 8, 16], [True, True, True]) == [1, 0, 2]
    assert near_tie_order([1.00, 1.015, 1.03], [4, 8, 16], [True, True, True], tie=0.0) == [0, 1, 2]
    # equal micro-batches keep the given order; a fast infeasible plan never jumps ahead of a feasible one
    assert near_tie_order([1.00, 1.01], [8, 8], [True, True]) == [0, 1]
    assert near_tie_order([1.00, 1.01, 0.99], [4, 4, 16], [True, True, False]) == [0, 1, 2]


def test_near_ties_of_one_layout_go_to_the_preferred_plan():
    # m=8 twice (the second preferred, i.e. 1F1B), m=4 fastest: the larger micro-batch first, the preferred one of it first
    assert near_tie_order([1.00, 1.005, 1.01], [4, 8, 8], [True, True, True], preferred=[False, False, True]) == [2, 1, 0]
    # the micro-batch still comes first: a preferred m=4 does not jump a near-tied m=8
    assert near_tie_order([1.00, 1.01], [4, 8], [True, True], preferred=[True, False]) == [1, 0]
    # beyond the margin the order is by score, preferred or not
    assert near_tie_order([1.00, 1.05], [8, 8], [True, True], preferred=[False, True]) == [0, 1]
    # only a twin of the same layout: a preferred plan of another layout with the same micro-batch keeps its place
    layouts = [("dp", 8), ("pp", 8), ("pp", 8)]
    assert near_tie_order([1.00, 1.005, 1.01], [8, 8, 8], [True] * 3, preferred=[False, False, True], layouts=layouts) == [0, 2, 1]


def test_rank_plans_puts_a_near_tie_between_gpipe_and_1f1b_on_1f1b_and_says_why():
    from lightning_distplan.planner import rank_order

    free = hw(p2p_latency=0.0, p2p_bw=1e30)
    tied = rank_plans(prof(), world_size=2, global_batch_size=16, strategies=("gpipe", "1f1b"), hardware=free, pins={"micro_batch_size": 2})
    one, gpipe = tied  # 1F1B first on memory (the test above)
    # GPipe predicted 1% faster: still a near tie of the same micro-batch, so 1F1B ranks first; plainly (tie 0) GPipe does
    faster = replace(gpipe.prediction, step_time_s=0.99 * one.prediction.step_time_s)
    plans, preds = [gpipe.plan, one.plan], [faster, one.prediction]
    assert rank_order(plans, preds) == [1, 0]
    assert rank_order(plans, preds, tie=0.0) == [0, 1]
    ranked = [replace(one, rank=1), replace(gpipe, prediction=faster, objective=faster.step_time_s, rank=2)]
    why = explain(ranked).splitlines()[-1]
    assert why.startswith(f"Why the winner wins: {one.plan.describe()} is predicted within 1.1% of the fastest plan ({gpipe.plan.describe()}), with the same dp")
    assert "prefers 1F1B, which holds fewer activations" in why


def test_rank_plans_puts_a_near_tie_on_the_larger_micro_batch_and_says_why():
    # a slightly negative intercept makes every extra micro-batch a little *cheaper* in the model:
    # m=1 is predicted fastest, m=8 1.7% slower, so the near-tie rule ranks m=8, 4, 2, 1
    layers = [
        LayerSpec(fwd_alpha=0.01, fwd_beta=-0.0002, bwd_alpha=0.02, bwd_beta=-0.0004, param_bytes=4_000_000, activation_bytes_per_sample=2e6, output_bytes_per_sample=1e5)
        for _ in range(4)
    ]
    profile = synthetic_profile(layers, optimizer_step_time_s=0.01)
    cands = rank_plans(profile, world_size=2, global_batch_size=16, hardware=hw(), strategies=("dp_ga",))
    assert [c.plan.micro_batch_size for c in cands] == [8, 4, 2, 1]
    assert [c.plan.micro_batch_size for c in sorted(cands, key=lambda c: c.objective)] == [1, 2, 4, 8]
    assert cands[0].objective == pytest.approx(1.017 * cands[-1].objective, rel=2e-3)
    why = explain(cands).splitlines()[-1]
    assert why.startswith("Why the winner wins: dp_ga dp=2 m=8 accumulate=1 is predicted within 1.7% of the fastest plan (dp_ga dp=2 m=1")
    assert "larger micro-batches (8 vs 1)" in why


def test_rank_order_reorders_any_list_of_plans_as_rank_plans_does():
    from lightning_distplan.planner import rank_order

    cands = rank_plans(prof(), world_size=4, global_batch_size=32, hardware=hw(memory=120_000_000))
    shuffled = cands[::-1]
    order = rank_order([c.plan for c in shuffled], [c.prediction for c in shuffled])
    assert [shuffled[i].rank for i in order] == [c.rank for c in cands]
    # tie=0: by predicted time alone (feasible first), peak memory breaking exact ties
    plain = [shuffled[i] for i in rank_order([c.plan for c in shuffled], [c.prediction for c in shuffled], tie=0.0)]
    keys = [(not c.prediction.feasible, c.prediction.step_time_s, c.prediction.peak_memory_bytes) for c in plain]
    assert keys == sorted(keys)


def test_an_exact_tie_in_time_and_memory_claims_neither():
    """GPipe and 1F1B at the same time and peak memory (a review's profile: both 1075838976 bytes): the text said the
    winner "needs less peak memory (1.002 vs 1.002 GiB)". Here the second plan is given the first one's peak."""
    free = hw(p2p_latency=0.0, p2p_bw=1e30)
    cands = rank_plans(prof(), world_size=2, global_batch_size=16, strategies=("gpipe", "1f1b"), hardware=free, pins={"micro_batch_size": 4})
    assert cands[0].prediction.step_time_s == pytest.approx(cands[1].prediction.step_time_s, rel=1e-12)
    assert "less peak memory" in explain(cands)  # 1F1B holds 2 of the 4 micro-batches on stage 0, GPipe 4: true
    same = replace(cands[1], prediction=replace(cands[1].prediction, peak_memory_bytes=cands[0].prediction.peak_memory_bytes))
    why = explain([cands[0], same]).splitlines()[-1]
    assert "less peak memory" not in why and "this one came first in the tie" in why


def test_a_time_weight_without_a_price_is_refused():
    """It ranked by time alone, silently (the CLI refuses the same combination)."""
    with pytest.raises(ValueError, match=r"`time_weight` \(4096\) weighs time against cost, and without `price_per_hour` there is no cost.*HINT"):
        rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), time_weight=4096)
    assert rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), time_weight=4096, price_per_hour=1.0)


def test_a_price_of_zero_ranks_free_devices_by_step_time_at_cost_zero():
    """Free (on-prem) devices: at price 0 and weight 0 every plan's C + w·T is 0, and ranked by that the pick fell to the
    lowest peak and the largest micro-batch: a GPipe m=8 plan at 0.76 s/step over a dp_ga plan at 0.33 s, which
    why_winner said it "ties" "at 0.7576 s/step". "Costs nothing" ranks by step time, as without a price, at cost 0.
    A weight above 0 ranks by w·T, as by time."""
    from lightning_distplan.planner import why_winner

    free = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), price_per_hour=0.0)
    by_time = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw())
    assert [c.plan for c in free] == [c.plan for c in by_time]
    assert free[0].prediction.step_time_s == min(c.prediction.step_time_s for c in free if c.prediction.feasible)
    assert all(c.cost_per_step == 0 and c.objective == c.prediction.step_time_s for c in free)
    assert why_winner(free) == why_winner(by_time) and " ties " not in why_winner(free)
    header, _, first = explain(free).splitlines()[:3]
    assert "cost/step" in header and first.startswith("1 ") and " 0 " in first  # its cost, 0, is shown
    weighed = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), price_per_hour=0.0, time_weight=256.0)
    assert [c.plan for c in weighed] == [c.plan for c in by_time]
    assert all(c.cost_per_step == 0 and c.objective == pytest.approx(256 * c.prediction.step_time_s) for c in weighed)


def test_when_nothing_fits_the_closest_named_is_the_plan_with_the_smallest_peak():
    """Infeasible plans rank by time: with 1 GiB devices the first is a dp_ga plan of 5.01 GiB, yet a 1F1B plan needs
    1.004 GiB; "the closest" named the 5 GiB one."""
    from lightning_distplan.planner import closest_to_fitting, why_winner

    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=256 << 20, activation_bytes_per_sample=1e6,
                                           output_bytes_per_sample=1e4)] * 4)
    cands = rank_plans(profile, world_size=4, global_batch_size=16, hardware=hw(memory=1 << 30, bw=1e11, p2p_latency=1e-5))
    assert not any(c.prediction.feasible for c in cands) and cands[0].plan.strategy == "dp_ga"
    closest = closest_to_fitting(cands)
    assert closest.prediction.peak_memory_bytes == min(c.prediction.peak_memory_bytes for c in cands)
    assert closest.plan.pp == 4 and closest.prediction.peak_memory_bytes < cands[0].prediction.peak_memory_bytes / 4
    assert why_winner(cands) == f"No plan fits in memory; the closest, {closest.plan.describe()}, fails because {closest.prediction.reason}"


def test_a_plan_ranked_behind_for_the_samples_it_would_skip_is_said_to_skip_them():
    """auto_plan ranks the pipelines that would leave each epoch's last samples untrained behind the plans that train
    them all (whole_epochs_first): a 4-rank fit ran dp_ga dp=4 m=4 over a pipeline of m=8 predicted 22.8% faster, and the
    reason given was the near tie's "within 29.7% of the fastest plan ... and runs larger micro-batches (4 vs 8)": no
    near tie, and 4 is smaller. It says the real reason, and a slower winner with a smaller micro-batch never claims a
    larger one."""
    from lightning_distplan.planner import why_winner

    cands = rank_plans(prof(), world_size=4, global_batch_size=16, hardware=hw(), pins={"micro_batch_size": 4})
    dp = next(c for c in cands if c.plan.strategy == "dp_ga" and c.prediction.feasible)
    cands = rank_plans(prof(), world_size=4, global_batch_size=16, hardware=hw(), pins={"micro_batch_size": 8})
    pipe = next(c for c in cands if c.plan.strategy != "dp_ga" and c.prediction.feasible)
    assert (dp.plan.micro_batch_size, pipe.plan.micro_batch_size) == (4, 8)

    def ranked(skipped: int, *slower: Candidate) -> list[Candidate]:
        return [replace(dp, objective=0.478, rank=1), replace(pipe, objective=0.369, rank=2, skipped_samples=skipped), *slower]

    assert why_winner(ranked(4)) == (
        f"Why the winner wins: {dp.plan.describe()} trains every sample of the epoch, while the fastest plan ({pipe.plan.describe()}, "
        "predicted 22.8% faster) would skip the epoch's last 4 samples per replica, which a run of your loader trains.")
    more = replace(pipe, objective=0.4, rank=3, skipped_samples=4)
    assert ", like 1 more plan predicted faster, would skip " in why_winner(ranked(4, more))
    # not moved for skipping (no reason the ranking gives): nothing claimed, least of all a larger micro-batch
    why = why_winner(ranked(0))
    assert why == (f"Why the winner wins: {dp.plan.describe()} was ranked first, though predicted 29.5% slower than the fastest "
                   f"plan ({pipe.plan.describe()})."), why


def test_a_percentage_never_states_less_than_the_difference_nor_zero():
    """A 1F1B plan predicted 0.001% slower than its GPipe twin was said to be "within 0.0% of the fastest plan", and one
    0.74% slower "within 0.7%": a bound stated less than the difference. It now rounds up to 0.1%. A point estimate
    under 0.05% read "predicted 0.0% slower" (or faster), as if there were no difference; it reads "under 0.1%"."""
    from lightning_distplan.planner import why_winner

    free = hw(p2p_latency=0.0, p2p_bw=1e30)
    one, gpipe = rank_plans(prof(), world_size=2, global_batch_size=16, strategies=("gpipe", "1f1b"), hardware=free, pins={"micro_batch_size": 2})

    def twin_faster_by(factor: float) -> str:
        t = one.prediction.step_time_s / factor
        return why_winner([one, replace(gpipe, prediction=replace(gpipe.prediction, step_time_s=t), objective=t, rank=2)])

    assert " is predicted within 0.1% of the fastest plan " in twin_faster_by(1 + 1e-5)
    assert " is predicted within 0.8% of the fastest plan " in twin_faster_by(1.0074)
    assert " is predicted within 1.0% of the fastest plan " in twin_faster_by(1.01)
    # slower for no reason the ranking gives (a pipeline that skips nothing), or faster but skipping samples
    dp = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), strategies=("dp_ga",), pins={"micro_batch_size": 1})[0]
    assert "though predicted under 0.1% slower than the fastest plan" in why_winner(
        [replace(dp, objective=1.0002), replace(one, objective=1.0, rank=2)])
    assert ", predicted under 0.1% faster) would skip" in why_winner([replace(dp, objective=1.0002), replace(one, objective=1.0, rank=2, skipped_samples=3)])


def test_a_winner_faster_by_a_hair_is_said_faster_in_numbers_that_show_it():
    """A dp_ga plan predicted 0.03% faster than the runner-up read "takes 0.9099 s/step, 1.00x less than the runner-up",
    and a 1F1B plan faster by less than 4 digits "takes 0.4559 s/step, 1.00x less than ... (...: 0.4559 s)": the numbers
    said no time was saved. The saving is said in percent under 1.005x (above it as the speedup, "1.50x faster than",
    not "1.50x less than"), and times print with the digits that tell them apart."""
    from lightning_distplan.planner import why_winner

    win, runner = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), strategies=("dp_ga",))[:2]
    t = win.prediction.step_time_s

    def slower_by(factor: float) -> str:
        pred = replace(runner.prediction, step_time_s=t * factor, breakdown={k: v * factor * t / runner.prediction.step_time_s
                                                                             for k, v in runner.prediction.breakdown.items()})
        return why_winner([win, replace(runner, prediction=pred, objective=t * factor)])

    assert f"takes {t:.4g} s/step, 1.50x faster than the runner-up" in slower_by(1.5)
    why = slower_by(1.00001)
    m = re.search(r"takes ([0-9.]+) s/step, under 0.1% less than the runner-up \(.*: ([0-9.]+) s\), mostly \w+ \(([0-9.]+) s vs ([0-9.]+) s\)", why)
    assert m, why
    assert float(m[1]) == pytest.approx(t, rel=1e-6) and float(m[1]) < float(m[2]) and float(m[3]) < float(m[4]), why
    assert ", 0.4% less than the runner-up" in slower_by(1.004)


def test_a_tie_on_time_claims_no_tie_on_memory_the_winner_does_not_have():
    """dp_ga plans whose time does not depend on the micro-batch (no per-micro-batch cost) tie exactly, and the tie goes
    to the larger micro-batch, which needs more memory; the text said the winner "ties the runner-up ... at 1.253 s/step
    and 0.616 GiB peak memory", the winner's peak, as if both had it. A peak less by a few bytes read "needs less peak
    memory (1.002 vs 1.002 GiB)"."""
    from lightning_distplan.planner import why_winner

    flat = synthetic_profile([LayerSpec(fwd_alpha=1e-2, bwd_alpha=2e-2, param_bytes=4_000_000, activation_bytes_per_sample=2e6)] * 4)
    cands = rank_plans(flat, world_size=1, global_batch_size=16, hardware=hw(), strategies=("dp_ga",))
    win, runner = cands[:2]
    assert win.prediction.step_time_s == pytest.approx(runner.prediction.step_time_s, rel=1e-12)
    assert win.plan.micro_batch_size > runner.plan.micro_batch_size
    assert win.prediction.peak_memory_bytes > runner.prediction.peak_memory_bytes
    why = why_winner(cands)
    assert "either runs as predicted" not in why
    assert (f"and runs larger micro-batches ({win.plan.micro_batch_size} vs {runner.plan.micro_batch_size}), which in a tie the "
            f"ranking prefers, though it needs more peak memory ({win.prediction.peak_memory_bytes / 2**30:.3f} vs "
            f"{runner.prediction.peak_memory_bytes / 2**30:.3f} GiB).") in why
    less = replace(runner, prediction=replace(runner.prediction, peak_memory_bytes=win.prediction.peak_memory_bytes + 1000))
    m = re.search(r"needs less peak memory \(([0-9.]+) vs ([0-9.]+) GiB\)\.$", why_winner([win, less]))
    assert m and float(m[1]) < float(m[2]) and float(m[1]) == pytest.approx(win.prediction.peak_memory_bytes / 2**30, rel=1e-5), m


def test_the_only_candidate_is_not_said_to_be_the_only_one_that_fits():
    """Pins that leave one plan: it was "the only plan that fits in memory", as if others had been ruled out by memory."""
    from lightning_distplan.planner import why_winner

    only = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), strategies=("dp_ga",), pins={"micro_batch_size": 8})
    assert len(only) == 1
    assert why_winner(only) == f"Why the winner wins: {only[0].plan.describe()} is the only candidate plan."
    tight = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(memory=100_000_000), strategies=("dp_ga",))
    assert sum(c.prediction.feasible for c in tight) == 1 < len(tight)
    assert why_winner(tight).endswith(" is the only plan that fits in memory.")


def test_the_samples_plans_would_skip_are_said_of_each_plan_that_skips_them():
    """"like 2 more plans predicted faster, would skip the epoch's last 4 samples" was said of plans that skip 4 and 10
    (a plan of another dp splits the loader otherwise), and one sample read "the epoch's last 1 samples". The other
    plans' counts carry their unit: "and 1 more plan predicted faster would skip 1, which ..." left it to be guessed."""
    from lightning_distplan.planner import why_winner

    cands = rank_plans(prof(), world_size=4, global_batch_size=16, hardware=hw())
    dp = next(c for c in cands if c.plan.strategy == "dp_ga" and c.prediction.feasible)
    pipes = [c for c in cands if c.plan.strategy != "dp_ga" and c.prediction.feasible][:3]

    def ranked(*skips: int) -> str:
        return why_winner([replace(dp, objective=1.0, rank=1)] + [
            replace(p, objective=0.5 + 0.1 * i, rank=i + 2, skipped_samples=s) for i, (p, s) in enumerate(zip(pipes, skips))])

    assert " would skip the epoch's last 1 sample per replica, which a run of your loader trains." in ranked(1)
    assert "predicted 50.0% faster), like 2 more plans predicted faster, would skip the epoch's last 4 samples per replica, which" in ranked(4, 4, 4)
    why = ranked(4, 10, 2)
    assert "like" not in why and ("predicted 50.0% faster) would skip the epoch's last 4 samples per replica, and 2 more plans "
                                  "predicted faster would skip 2 to 10 samples, which a run of your loader trains.") in why, why
    assert "last 4 samples per replica, and 1 more plan predicted faster would skip 10 samples, which" in ranked(4, 10)
    assert "last 4 samples per replica, and 1 more plan predicted faster would skip 1 sample, which" in ranked(4, 1)
    # replicas of their own data, of different sizes, skip different numbers: the figure is the most one skips
    differ = why_winner([replace(dp, objective=1.0, rank=1), replace(pipes[0], objective=0.5, rank=2, skipped_samples=8, skipped_samples_differ=True)])
    assert differ.endswith("faster) would skip up to the epoch's last 8 samples per replica, which a run of your loader trains."), differ


def test_a_near_tie_gone_to_1f1b_claims_fewer_activations_only_where_it_holds_fewer():
    """With as many micro-batches as stages, 1F1B holds as many in flight as GPipe; a GPipe predicted 1% faster read
    "prefers 1F1B, which holds fewer activations (0.045 vs 0.045 GiB peak)"."""
    from lightning_distplan.planner import why_winner

    cands = rank_plans(prof(), world_size=2, global_batch_size=4, hardware=hw(), strategies=("gpipe", "1f1b"), pins={"micro_batch_size": 2})
    one, gpipe = sorted(cands, key=lambda c: c.plan.strategy)
    assert (one.plan.strategy, gpipe.plan.strategy, one.plan.n_microbatches, one.plan.pp) == ("1f1b", "gpipe", 2, 2)
    assert one.prediction.peak_memory_bytes == gpipe.prediction.peak_memory_bytes
    t = one.objective / 1.01
    why = why_winner([one, replace(gpipe, prediction=replace(gpipe.prediction, step_time_s=t), objective=t, rank=2)])
    assert "fewer activations" not in why
    assert why.endswith(f"prefers 1F1B, whose runtime measured cheaper per micro-batch than GPipe's; both peak at "
                        f"{one.prediction.peak_memory_bytes / 2**30:.3f} GiB."), why


def test_the_near_tie_sentences_are_said_only_of_a_near_tie_the_ranking_decided():
    """why_winner explains any list it is given (explain() of a caller's own order): a winner 5% slower with a larger
    micro-batch read "within 5.0% of the fastest plan ... in a near tie the ranking prefers them" (the margin is 2%), and
    a GPipe winner behind its faster 1F1B twin "in a near tie the ranking prefers 1F1B"."""
    from lightning_distplan.planner import why_winner

    dp = rank_plans(prof(), world_size=2, global_batch_size=16, hardware=hw(), strategies=("dp_ga",))
    big, small = next(c for c in dp if c.plan.micro_batch_size == 8), next(c for c in dp if c.plan.micro_batch_size == 1)
    assert "larger micro-batches (8 vs 1)" in why_winner([replace(big, objective=1.015), replace(small, objective=1.0, rank=2)])
    why = why_winner([replace(big, objective=1.05), replace(small, objective=1.0, rank=2)])
    assert why.endswith(f"{big.plan.describe()} was ranked first, though predicted 5.0% slower than the fastest plan ({small.plan.describe()})."), why
    free = hw(p2p_latency=0.0, p2p_bw=1e30)
    one, gpipe = rank_plans(prof(), world_size=2, global_batch_size=16, strategies=("gpipe", "1f1b"), hardware=free, pins={"micro_batch_size": 2})
    why = why_winner([replace(gpipe, objective=1.01), replace(one, objective=1.0, rank=2)])
    assert "prefers 1F1B" not in why and "was ranked first, though predicted 1.0% slower" in why, why
