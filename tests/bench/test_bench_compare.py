"""Pure parts of the benchmark: errors, percentiles, the summary's pick / regret, plan selection, report."""

from __future__ import annotations

import pytest

from lightning_distplan.bench import BenchError, confirm_candidates, format_table, percentile, plot_result, relative_error, select_candidates, summarize


def _rec(rank, pred, meas, plan=None):
    return {"rank": rank, "plan": plan or f"plan{rank}", "predicted_step_time_s": pred, "measured_step_time_s": meas}


def test_relative_error_and_percentile():
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert relative_error(0.5, 1.0) == pytest.approx(-0.5)
    assert relative_error(1.0, None) is None and relative_error(1.0, 0.0) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)  # linear interpolation like numpy
    assert percentile([], 50) is None


def test_summary_pick_best_within_and_regret():
    # planner ranks 1..4; plan 2 actually ran fastest, the pick (rank 1) is 4% slower than it
    recs = [_rec(1, 1.0, 1.04), _rec(2, 1.1, 1.0), _rec(3, 2.0, 2.5), _rec(4, 3.0, None)]
    s = summarize(recs)
    assert s["n_plans"] == 4 and s["n_measured"] == 3
    errs = sorted(abs(e) for e in (1.0 / 1.04 - 1, 0.1, 2.0 / 2.5 - 1))
    assert s["median_abs_error"] == pytest.approx(errs[1])
    assert s["p90_abs_error"] == pytest.approx(errs[1] + 0.8 * (errs[2] - errs[1]))
    assert s["pick"]["rank"] == 1 and s["measured_best"]["rank"] == 2
    assert s["pick_is_best"] is False and s["pick_within"] is True
    assert s["regret"] == pytest.approx(0.04)
    assert s["spearman"] == pytest.approx(0.5)

    s = summarize([_rec(1, 1.0, 1.2), _rec(2, 1.1, 1.0)])
    assert s["pick_within"] is False and s["regret"] == pytest.approx(0.2)
    assert summarize([])["pick"] is None  # nothing run: no verdict
    # The pick ran out of memory (predicted to fit): a failed pick, whatever the others measured.
    for recs in ([_rec(1, 1.0, None), _rec(2, 1.1, 1.0)], [_rec(1, 1.0, None)]):
        failed = summarize(recs)
        assert failed["pick"]["rank"] == 1 and failed["pick_failed"] is True
        assert failed["pick_is_best"] is False and failed["pick_within"] is False and failed["regret"] is None
    assert summarize([_rec(1, 1.0, None), _rec(2, 1.1, 1.0)])["measured_best"]["rank"] == 2
    assert s["pick_failed"] is False
    assert s["pick_ran"] is True
    # --plans top:K chose by the first profile; the final predictions rank other plans first: the verdict says so
    late = summarize([_rec(4, 1.0, 1.0), _rec(9, 1.1, 1.2)])
    assert late["pick_ran"] is False and late["pick"]["rank"] == 4


def test_confirm_candidates_are_the_picks_and_the_plans_near_the_fastest():
    # measured: rank 4 fastest (1.00), rank 2 at 1.05 and rank 5 at 1.08 within 10%, rank 3 at 1.2 outside;
    # the pick (rank 1) ran 1.3 and the first profile's pick (rank 6 there: first_profile rank 1) 1.5
    recs = [_rec(1, 1.0, 1.3), _rec(2, 1.0, 1.05), _rec(3, 1.0, 1.2), _rec(4, 1.0, 1.0), _rec(5, 1.0, 1.08), _rec(6, 1.0, 1.5), _rec(7, 1.0, None)]
    for i, r in enumerate(recs):
        r["first_profile"] = {"rank": 1 if i == 5 else i + 2}
    picked = confirm_candidates(recs, band=0.10, limit=4)
    assert [recs[i]["rank"] for i in picked] == [4, 2, 1, 6]  # fastest first; the picks always go, outside the band too
    assert [recs[i]["rank"] for i in confirm_candidates(recs, band=0.10, limit=6)] == [4, 2, 5, 1, 6]  # rank 3 is outside the band
    assert [recs[i]["rank"] for i in confirm_candidates([_rec(1, 1.0, 1.0), _rec(2, 1.0, None)])] == [1]  # pick is best; a failed plan never goes
    assert confirm_candidates([_rec(1, 1.0, None)]) == []


def test_confirmed_regret_is_judged_on_the_confirmation_runs_alone():
    # passes: rank 2 looked 8% faster than the pick; run again, the pick is 2% slower than rank 2
    recs = [{**_rec(1, 1.0, 1.08), "confirm_step_time_s": 1.02}, {**_rec(2, 1.1, 1.0), "confirm_step_time_s": 1.0}, _rec(3, 1.2, 1.3)]
    s = summarize(recs)
    assert s["pick_within"] is False and s["regret"] == pytest.approx(0.08)  # the passes' verdict stays
    c = s["confirmed"]
    assert c["n_plans"] == 2 and c["pick"]["rank"] == 1 and c["measured_best"]["rank"] == 2
    assert c["pick_within"] is True and c["regret"] == pytest.approx(0.02) and c["pick_is_best"] is False
    recs[1]["confirm_step_time_s"] = 0.9  # ... or 13% slower: a miss on the confirmation too
    assert summarize(recs)["confirmed"]["pick_within"] is False
    del recs[0]["confirm_step_time_s"]  # the pick was not run again (e.g. a re-ranked replay): no confirmed verdict
    assert summarize(recs)["confirmed"] is None


class _Pred:
    def __init__(self, feasible):
        self.feasible = feasible


class _Cand:
    def __init__(self, rank, feasible=True):
        self.rank, self.prediction = rank, _Pred(feasible)


def test_select_candidates():
    cands = [_Cand(1), _Cand(2), _Cand(3), _Cand(4, feasible=False)]
    assert [c.rank for c in select_candidates(cands, "all")] == [1, 2, 3]
    assert [c.rank for c in select_candidates(cands, "top:2")] == [1, 2]
    assert [c.rank for c in select_candidates(cands, "3,1,3")] == [3, 1]
    with pytest.raises(BenchError, match=r"rank\(s\) \[9\].*HINT"):
        select_candidates(cands, "1,9")
    with pytest.raises(BenchError, match="top:K"):
        select_candidates(cands, "top:0")
    with pytest.raises(BenchError, match="not 'all'"):
        select_candidates(cands, "best")


def test_table_and_plot(tmp_path):
    plans = [
        {**_rec(1, 0.10, 0.11, "dp_ga dp=2 m=4 accumulate=1"), "strategy": "dp_ga", "step_time_error": -0.09,
         "predicted_peak_memory_bytes": 2**20, "measured_peak_memory_bytes": 2**21, "memory_error": -0.5, "error": None},
        {**_rec(2, 0.12, 0.10, "1f1b dp=1 pp=2 m=2 n_microbatches=4"), "strategy": "1f1b", "step_time_error": 0.2,
         "predicted_peak_memory_bytes": 2**20, "measured_peak_memory_bytes": None, "memory_error": None, "error": None},
    ]
    result = {"model": "m", "world_size": 2, "device": {"type": "cpu", "name": "x"}, "global_batch_size": 8,
              "warmup": 1, "steps": 2, "links": [], "plans": plans, "summary": summarize(plans), "memory_metric": "cpu_rss_high_water_growth"}
    text = format_table(result)
    assert "regret 10.0%" in text and "1*" in text and "2 !" in text and "was not among the plans run" not in text
    late = [{**p, "rank": p["rank"] + 3} for p in plans]  # the final predictions rank two plans that did not run first
    assert "the planner's choice (rank 1 by the final predictions) was not among the plans run" in format_table(
        {**result, "plans": late, "summary": summarize(late)})
    # the pick ran out of memory: said so, never "within 5%"; failing again in the confirmation passes: said too
    oom = [{**plans[0], "measured_step_time_s": None, "step_time_error": None, "error": "OutOfMemoryError: CUDA out of memory"}, plans[1]]
    text = format_table({**result, "plans": oom, "summary": summarize(oom)})
    assert "pick: rank 1 dp_ga dp=2 m=4 accumulate=1 FAILED (predicted to run)" in text
    assert "pick is measured best: False; within 5% of it: False; regret: none (the pick failed)" in text
    again = [{**plans[0], "confirm_step_time_s": None, "confirm_error": "OutOfMemoryError"}, plans[1]]
    text = format_table({**result, "plans": again, "summary": summarize(again), "confirm_passes": 1})
    assert "confirmation (1 more pass(es)): the pick FAILED (OutOfMemoryError); within 5%: False" in text
    png = plot_result(result, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png"]  # written through a temporary file, none left
    # the rank by the first profile (what --plans N,M names) is shown where the final ranking moved a plan
    moved = [{**plans[0], "first_profile": {"rank": 2}}, {**plans[1], "first_profile": {"rank": 1}}]
    text = format_table({**result, "plans": moved})
    assert "rank   1st plan" in text and "1st = rank by the first profile" in text
    assert "1st" not in format_table({**result, "plans": [{**p, "first_profile": {"rank": p["rank"]}} for p in plans]})
    # failed plans are drawn (at the right edge, at their predicted time), a run where every plan failed says so,
    # and a range within one decade gets labels at 1, 2 and 5 (it had one)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_distplan.bench import draw_result

    def drawn(plans: list) -> tuple[list[str], list[str], list[str]]:
        fig, ax = plt.subplots()
        draw_result(ax, [{**result, "plans": plans, "summary": summarize(plans)}])
        fig.canvas.draw()
        out = ([str(c.get_label()) for c in ax.collections], [t.get_text() for t in ax.texts],
               [t.get_text() for t in ax.get_xticklabels() if t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]])
        plt.close(fig)
        return out

    labels, texts, ticks = drawn(oom)
    assert "failed (at the right edge)" in labels and not texts and len(ticks) >= 2, ticks
    labels, _, _ = drawn(plans)
    assert "planner's pick" in labels  # the circle has a legend entry; the legend goes where it hides fewest points
    fig, ax = plt.subplots()
    draw_result(ax, [result])
    assert ax.get_legend()._loc == 0  # matplotlib's code for loc="best"
    plt.close(fig)
    labels, texts, _ = drawn([{**p, "measured_step_time_s": None, "error": "OutOfMemoryError"} for p in plans])
    assert "failed (at the right edge)" in labels and texts == ["no plan produced a measurement"]


def _run(times, error=None, peak=100):
    return {"error": error, "rank_pids": [1, 2], "process_groups": ["g", "g"], "measured_step_time_s": None if error else sorted(times)[len(times) // 2],
            "measured_step_times_s": [] if error else list(times), "warmup_step_times_s": [] if error else [9.0],
            "measured_peak_memory_bytes": None if error else peak, "per_rank_peak_memory_bytes": [peak, peak - 1]}


def test_combine_passes_pools_timed_steps():
    from lightning_distplan.bench._runner import combine_passes

    # pass 2 ran in a slow spell: its own median (2.0) would be 100% off, the pooled median is not
    got = combine_passes([_run([1.0, 1.1, 0.9]), _run([2.0, 2.1, 1.9], peak=120), _run([1.05, 0.95, 1.0])])
    assert got["measured_step_times_s"] == [1.0, 1.1, 0.9, 2.0, 2.1, 1.9, 1.05, 0.95, 1.0]
    assert got["measured_step_time_s"] == pytest.approx(1.05)
    assert got["measured_pass_step_times_s"] == [1.0, 2.0, 1.0] and got["passes"] == 3
    assert got["measured_peak_memory_bytes"] == 120 and got["per_rank_peak_memory_bytes"] == [120, 119]
    assert got["warmup_step_times_s"] == [9.0, 9.0, 9.0] and got["error"] is None


def test_combine_passes_failure_is_the_result():
    from lightning_distplan.bench._runner import combine_passes

    got = combine_passes([_run([1.0]), _run([], error="RuntimeError: out of memory")])
    assert got["error"] == "RuntimeError: out of memory" and got["measured_step_time_s"] is None
    assert got["measured_step_times_s"] == [] and got["measured_peak_memory_bytes"] is None


def test_a_profile_without_links_is_warned_of_once_and_only_where_plans_use_a_link(caplog):
    """bench priced each plan with its own default Hardware: one process printed "measured no all-reduce or p2p link"
    once per plan and pass, though no plan of one process uses a link."""
    import logging

    from lightning_distplan.bench import predict_ranked
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.plan import Plan

    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-3, bwd_alpha=2e-3, param_bytes=1000, activation_bytes_per_sample=1e3,
                                           output_bytes_per_sample=1e3)] * 2)
    one = [Plan(strategy="dp_ga", micro_batch_size=m, accumulate_grad_batches=4 // m, global_batch_size=4) for m in (1, 2, 4)]
    two = [Plan(strategy="dp_ga", dp=2, micro_batch_size=m, accumulate_grad_batches=2 // m, global_batch_size=4) for m in (1, 2)]
    with caplog.at_level(logging.WARNING):
        predict_ranked(profile, one)
        assert not [r for r in caplog.records if "measured no" in r.getMessage()]
        predict_ranked(profile, two)
    assert len([r for r in caplog.records if "measured no" in r.getMessage()]) == 1


def test_confirmation_stopped_early_gives_no_confirmed_verdict_in_json_or_table():
    """A rank failing alone stopped the confirmation passes: the table said they give no verdict, while
    summary["confirmed"] (and the table's confirmation line) still judged the pick against the contenders run before
    the stop."""
    stop = "Plan dp_ga dp=2 m=2 accumulate=2 (planner rank 3) did not finish on every rank within 180 s of the others. HINT: x"
    plans = [
        {**_rec(1, 0.10, 0.11, "dp_ga dp=2 m=4 accumulate=1"), "confirm_step_time_s": 0.105},  # ran its confirmation pass
        {**_rec(2, 0.12, 0.10, "1f1b dp=1 pp=2 m=2 n_microbatches=4"), "confirm_step_time_s": 0.104},
        {**_rec(3, 0.13, 0.108, "dp_ga dp=2 m=2 accumulate=2"), "confirm_step_time_s": None,
         "confirm_error": "did not finish on every rank within 180 s (one rank failed alone; each rank's error is in the log)"},
    ]
    for p in plans:
        p.update(strategy=p["plan"].split()[0], step_time_error=0.0, predicted_peak_memory_bytes=None, measured_peak_memory_bytes=None,
                 memory_error=None, error=None)
    assert summarize(plans)["confirmed"]["n_plans"] == 2  # what a complete confirmation of these runs would judge
    s = summarize(plans, confirm_stopped=stop)
    assert s["confirmed"] is None and s["confirmed_withheld"].startswith("the confirmation passes stopped early, so they give no verdict: Plan")
    assert s["pick_within"] is False and s["regret"] == pytest.approx(0.1)  # the passes' verdict stays
    assert summarize(plans)["confirmed_withheld"] is None
    result = {"model": "m", "world_size": 2, "device": {"type": "cpu", "name": "x"}, "global_batch_size": 8, "warmup": 1, "steps": 2,
              "links": [], "plans": plans, "summary": s, "memory_metric": "cpu_rss_high_water_growth", "stopped": stop, "confirm_passes": 1}
    text = format_table(result)
    assert "it came in the confirmation passes (rank 3 failed there), which give no verdict" in text
    assert "confirmation (" not in text  # no verdict printed beside it


def test_predictions_share_a_cpu_hosts_memory_among_the_ranks_as_the_planner_does():
    """bench ranks its plans with rank_plans, which gives each rank of a CPU profile its share of the host's RAM, but graded
    them for the report with the whole host per rank: a plan the planner found too big (and bench did not run) was
    reported feasible, and ranked before the plans that fit."""
    from dataclasses import replace

    from lightning_distplan.bench import predict_ranked
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans

    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=500 << 20, activation_bytes_per_sample=50 << 20) for _ in range(2)]
    gpu = synthetic_profile(specs, device_memory_bytes=8 << 30)
    cpu = replace(gpu, device=replace(gpu.device, type="cpu", memory_source="host RAM (sysconf)"))
    candidates = rank_plans(cpu, world_size=4, global_batch_size=16, strategies=("dp_ga",))
    graded = predict_ranked(cpu, [c.plan for c in candidates])
    assert not any(c.prediction.feasible for c in candidates)  # 4 ranks of 5 GiB and more on one 8 GiB host
    assert [pred.feasible for pred, _ in graded] == [c.prediction.feasible for c in candidates]
    assert [pred.peak_memory_bytes for pred, _ in graded] == [c.prediction.peak_memory_bytes for c in candidates]
    assert [rank for _, rank in graded] == [c.rank for c in candidates]


def test_table_says_how_many_of_the_candidates_ran():
    """With --plans top:K the table read "pick is measured best: True" without a word that most plans never ran."""
    plans = [{**_rec(1, 0.10, 0.11, "dp_ga dp=2 m=4 accumulate=1"), "strategy": "dp_ga", "step_time_error": -0.09,
              "predicted_peak_memory_bytes": 2**20, "measured_peak_memory_bytes": 2**21, "memory_error": -0.5, "error": None},
             {**_rec(2, 0.12, 0.10, "dp_ga dp=2 m=2 accumulate=2"), "strategy": "dp_ga", "step_time_error": 0.2,
              "predicted_peak_memory_bytes": 2**20, "measured_peak_memory_bytes": 2**20, "memory_error": 0.0, "error": None}]
    not_run = [{"rank": 3, "plan": "p3", "feasible": True, "predicted_step_time_s": 0.2, "first_profile_rank": 3},
               {"rank": 4, "plan": "p4", "feasible": False, "predicted_step_time_s": 0.3, "first_profile_rank": 4}]
    result = {"model": "m", "world_size": 2, "device": {"type": "cpu", "name": "x"}, "global_batch_size": 8, "warmup": 1, "steps": 2,
              "links": [], "plans": plans, "summary": summarize(plans), "memory_metric": "cpu_rss_high_water_growth",
              "n_candidates": 4, "plans_selection": "top:2", "candidates_not_run": not_run}
    lines = format_table(result).splitlines()
    assert lines[1] == ("plans run: 2 of 4 candidates (--plans top:2); 1 of the others predicted not to fit; "
                        "the verdict below covers the plans run only")
    # every plan predicted to fit ran (--plans all): no caveat on the verdict
    assert format_table({**result, "plans_selection": "all", "candidates_not_run": not_run[1:], "n_candidates": 3}).splitlines()[1] == (
        "plans run: 2 of 3 candidates (--plans all); 1 of the others predicted not to fit")
    assert "plans run:" not in format_table({**result, "candidates_not_run": [], "n_candidates": 2})
    assert "plans run:" not in format_table({k: v for k, v in result.items() if k != "n_candidates"})  # a result from before the count


def test_a_multi_node_bench_shares_a_cpu_hosts_ram_among_that_hosts_ranks_only(monkeypatch):
    """bench planned (rank_plans) and graded (predict_ranked) a CPU profile with the host's RAM divided by the whole world
    size: under torchrun --nnodes 2 --nproc-per-node 2 each rank was given a quarter of its machine's RAM where two ranks
    share it, and plans that fit were reported infeasible (and not run). It now divides by LOCAL_WORLD_SIZE, the ranks on
    one machine, as auto_plan divides by the ranks per node."""
    from dataclasses import replace

    from lightning_distplan.bench import predict_ranked
    from lightning_distplan.bench._bench import planning_hardware
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans

    specs = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=300 << 20, activation_bytes_per_sample=50 << 20) for _ in range(2)]
    gpu = synthetic_profile(specs, device_memory_bytes=8 << 30)
    cpu = replace(gpu, device=replace(gpu.device, type="cpu", memory_source="host RAM (sysconf)"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 machines of 2 ranks
    hw = planning_hardware(cpu, 4)
    assert hw.device_memory_bytes == 4 << 30
    candidates = rank_plans(cpu, world_size=4, global_batch_size=16, strategies=("dp_ga",), hardware=hw)
    assert candidates[0].prediction.feasible  # fits 4 GiB; on a quarter of the host (2 GiB) nothing did
    assert not any(c.prediction.feasible for c in rank_plans(cpu, world_size=4, global_batch_size=16, strategies=("dp_ga",)))
    graded = predict_ranked(cpu, [c.plan for c in candidates], ranks_per_host=2)
    assert [pred.feasible for pred, _ in graded] == [c.prediction.feasible for c in candidates]
    assert [rank for _, rank in graded] == [c.rank for c in candidates]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: as before
    assert planning_hardware(cpu, 4).device_memory_bytes == 2 << 30
    assert planning_hardware(cpu, 1).device_memory_bytes == 8 << 30  # not distributed: the whole host
    assert planning_hardware(gpu, 4).device_memory_bytes == 8 << 30  # a GPU per rank


def test_a_multi_node_bench_prices_a_hybrids_stages_on_one_machine_sharing_its_link(monkeypatch):
    """Under torchrun --nnodes 2 --nproc-per-node 2 the bench planned and graded 1f1b dp=2 pp=2 over a 3 MB and a 1 MB
    stage with the 3 MB all-reduce alone on the link, where auto_plan (choose_plan, ranks per node 2) prices both stages
    crossing the machine's one link at once (4 MB): the bench graded another model than the one auto_plan plans with."""
    from lightning_distplan.bench import predict_ranked
    from lightning_distplan.bench._bench import planning_hardware
    from lightning_distplan.costmodel import DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_LATENCY_S, ring_allreduce_time
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans
    from lightning_distplan.strategies._auto_planning import choose_plan

    profile = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=b) for b in (3_000_000, 1_000_000)])
    kw = dict(world_size=4, global_batch_size=8, pins={"strategy": "1f1b", "stages": 2})
    shared = ring_allreduce_time(4_000_000, 2, DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH_BYTES_PER_S)
    alone = ring_allreduce_time(3_000_000, 2, DEFAULT_LATENCY_S, DEFAULT_BANDWIDTH_BYTES_PER_S)
    for local, expected in (("2", shared), ("4", alone), ("1", alone)):  # 2 machines of 2; one machine; one rank a machine
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        (best, *_) = rank_plans(profile, hardware=planning_hardware(profile, 4), **kw)
        assert best.prediction.breakdown["exposed_comm"] == pytest.approx(expected, rel=1e-12), local
        ((graded, _),) = predict_ranked(profile, [best.plan], ranks_per_host=int(local))
        assert graded.breakdown["exposed_comm"] == pytest.approx(expected, rel=1e-12), local
        (auto, *_), _ = choose_plan(profile, ranks_per_host=int(local), **kw)  # what auto_plan prices on those machines
        assert auto.prediction.step_time_s == pytest.approx(best.prediction.step_time_s, rel=1e-12) == graded.step_time_s


def test_table_shows_a_long_plan_whole_and_aligned():
    """The plan column cut every plan at 52 characters: a 4-stage hybrid at a GPU-sized batch read
    '1f1b dp=2 pp=4 m=16 n_microbatches=128 split=[12, 24' (its split cut off mid-list, no word said)."""
    long = "1f1b dp=2 pp=4 m=16 n_microbatches=128 split=[12, 24, 36]"
    plans = [{**_rec(1, 0.10, 0.11, long), "strategy": "1f1b", "step_time_error": -0.09, "predicted_peak_memory_bytes": 2**20,
              "measured_peak_memory_bytes": 2**21, "memory_error": -0.5, "error": None},
             {**_rec(2, 0.12, 0.10, "dp_ga dp=8 m=64 accumulate=8"), "strategy": "dp_ga", "step_time_error": 0.2,
              "predicted_peak_memory_bytes": 2**20, "measured_peak_memory_bytes": 2**20, "memory_error": 0.0, "error": None}]
    result = {"model": "m", "world_size": 8, "device": {"type": "cuda", "name": "x"}, "global_batch_size": 4096, "warmup": 1,
              "steps": 2, "links": [], "plans": plans, "summary": summarize(plans), "memory_metric": "cuda_max_memory_allocated"}
    lines = format_table(result).splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    rows = lines[header + 2: header + 4]
    assert rows[0][6:].startswith(long + " ") and rows[1][6:].startswith("dp_ga dp=8 m=64 accumulate=8 ")
    # every column still lines up under its heading
    assert len({len(line) for line in (lines[header], lines[header + 1], *rows)}) == 1, [lines[header], *rows]
    assert lines[header].index("pred ms") + len("pred ms") == rows[0].index(" 100.0") + len(" 100.0")


def test_table_never_prints_a_nonzero_step_time_as_zero():
    """The report printed ms with 1 decimal: a plan of a tiny model measured at 9.6 µs read "0.0 ms", as if it took no
    time. Under 1 ms it prints 3 significant figures (format_ms); from 1 ms up, 1 decimal as before."""
    plans = [{**_rec(1, 4.2e-6, 9.6e-6), "strategy": "dp_ga", "step_time_error": -0.56, "predicted_peak_memory_bytes": 2**20,
              "measured_peak_memory_bytes": 2**20, "memory_error": 0.0, "error": None},
             {**_rec(2, 0.0123456, 0.25), "strategy": "dp_ga", "step_time_error": -0.95, "predicted_peak_memory_bytes": 2**20,
              "measured_peak_memory_bytes": 2**20, "memory_error": 0.0, "error": None}]
    result = {"model": "m", "world_size": 1, "device": {"type": "cpu", "name": "x"}, "global_batch_size": 4, "warmup": 1,
              "steps": 2, "links": [], "plans": plans, "summary": summarize(plans), "memory_metric": "rss"}
    lines = format_table(result).splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    tiny, ordinary = (lines[header + i].split(f"plan{i - 1} ")[1].split()[:2] for i in (2, 3))  # pred ms, meas ms
    assert tiny == ["0.00420", "0.00960"] and ordinary == ["12.3", "250.0"], lines
    assert len({len(line) for line in lines[header: header + 4]}) == 1, lines  # still aligned under the headings
    assert "pick: rank 1 plan1 ran 0.00960 ms; measured best: rank 1 plan1 0.00960 ms" in lines, lines
