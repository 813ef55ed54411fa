"""The committed CPU sweep results belong to this code: replaying them reproduces every prediction.

Each sweep setting stores the profile its predictions came from. Predicting each measured plan
again from that profile with today's cost model must give the recorded number. If it does not, the
cost model changed after the sweep, so the README's accuracy figures no longer describe the code.
Then re-run ``benchmarks/cpu_cluster_sweep.py``, or use ``benchmarks/replay_sweep.py`` to see what
the change does to those measurements.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from readme_table import sweep_files  # noqa: E402

SWEEPS = sweep_files()


def test_there_are_committed_sweeps() -> None:
    assert [p.name for p in SWEEPS][:2] == ["cpu_cluster_sweep.json", "cpu_cluster_sweep_run2.json"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_committed_sweep_replays_to_its_recorded_predictions(path: Path) -> None:
    from replay_sweep import replay_setting

    doc = json.loads(path.read_text())
    settings = [s for s in doc["settings"] if "profile" in s and "summary" in s]
    assert len(settings) == 9  # 3 models x 3 rates
    for setting in settings:
        replayed = replay_setting(setting)
        recorded = {r["plan"]: r["predicted_step_time_s"] for r in setting["plans"] if r.get("measured_step_time_s") is not None}
        again = {r["plan"]: r["predicted_step_time_s"] for r in replayed["plans"]}
        assert again.keys() == recorded.keys()
        for plan, seconds in recorded.items():
            assert again[plan] == pytest.approx(seconds, rel=1e-9), f"{setting['model_key']}@{setting['rate']} {plan}"
        # the planner's pick is the plan it ranked first
        assert replayed["summary"]["pick"]["plan"] == setting["summary"]["pick"]["plan"]
        confirmed = setting["summary"].get("confirmed")
        if confirmed:  # the same pick, judged again on the same confirmation runs
            again_confirmed = replayed["summary"]["confirmed"]
            assert again_confirmed["measured_best"]["plan"] == confirmed["measured_best"]["plan"]
            assert again_confirmed["regret"] == pytest.approx(confirmed["regret"], rel=1e-12)
            assert again_confirmed["pick_within"] == confirmed["pick_within"]


def test_replay_variants_change_predictions_only_inside_their_block() -> None:
    from replay_sweep import replay_setting
    from replay_variants import variant

    import lightning_distplan.planner._rank as ranking

    setting = next(s for s in json.loads(SWEEPS[0].read_text())["settings"] if "profile" in s and "summary" in s)
    recorded = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    with variant("slot", 1e-3):
        slot = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    with variant("slot", 1e-3, 5e-3):
        per_schedule = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    with variant("samples"):
        samples = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    with variant("side-by-side"):
        side_by_side = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    with variant("no-1f1b-preference"):  # the ranking only: near ties of one micro-batch stay in predicted order
        unpreferred = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
        assert ranking.near_tie_order([1.0, 1.005], [8, 8], [True, True], preferred=[False, True]) == [0, 1]
    assert unpreferred == recorded
    assert ranking.near_tie_order([1.0, 1.005], [8, 8], [True, True], preferred=[False, True]) == [1, 0]
    after = {r["plan"]: r["predicted_step_time_s"] for r in replay_setting(setting)["plans"]}
    assert after == recorded
    for plan, seconds in recorded.items():
        if plan.startswith("dp_ga"):
            assert slot[plan] == seconds  # the slot variant charges pipeline stages only
        else:
            assert slot[plan] > seconds + 1e-3  # at least one micro-batch slot's worth more
            gpipe = plan.startswith("gpipe")
            assert (per_schedule[plan] > seconds + 5e-3) if gpipe else (per_schedule[plan] == pytest.approx(slot[plan], rel=1e-12))
    assert any(samples[p] != pytest.approx(s, rel=1e-6) for p, s in recorded.items())
    # with an exchange's two directions side by side no plan is slower, dp_ga plans are the same, and 1F1B's faster
    assert all(side_by_side[p] == s for p, s in recorded.items() if p.startswith("dp_ga"))
    assert all(side_by_side[p] <= s * (1 + 1e-12) for p, s in recorded.items())
    assert any(side_by_side[p] < s * (1 - 1e-6) for p, s in recorded.items() if p.startswith("1f1b"))


def test_settings_with_several_profiles_replay_from_their_mean_and_keep_the_first() -> None:
    from cpu_cluster_sweep import summarize_sweep
    from replay_sweep import replay_setting

    from lightning_distplan.costmodel import predict
    from lightning_distplan.plan import Plan
    from lightning_distplan.profile import Profile, pool_profiles

    setting = next(s for s in json.loads(SWEEPS[0].read_text())["settings"] if "profile" in s and "summary" in s)
    first = Profile.from_dict(setting["profile"])
    slow = json.loads(json.dumps(setting["profile"]))
    for fit in (slow["step"]["forward"], slow["step"]["backward"]):
        fit["alpha"] *= 1.5
        fit["beta"] *= 1.5
    for layer in slow["layers"]:
        for fit in (layer["forward"], layer["backward"]):
            fit["alpha"] *= 1.5
            fit["beta"] *= 1.5
    replayed = replay_setting({**setting, "profiles": [setting["profile"], slow]})
    pooled = pool_profiles([first, Profile.from_dict(slow)])
    for rec in replayed["plans"]:
        plan = Plan.from_dict(rec["plan_json"])
        assert rec["predicted_step_time_s"] == pytest.approx(predict(pooled, plan).step_time_s, rel=1e-12)
        assert rec["first_profile"]["predicted_step_time_s"] == pytest.approx(predict(first, plan).step_time_s, rel=1e-12)
        assert rec["predicted_step_time_s"] > rec["first_profile"]["predicted_step_time_s"]  # the slower profile weighs in
    summary, lines = summarize_sweep([{**replayed, "rate": "unlimited"}], ["unlimited"])
    assert summary["first_profile"]["median_abs_error"] == pytest.approx(replayed["summary_first_profile"]["median_abs_error"])
    assert summary["median_abs_error"] == pytest.approx(replayed["summary"]["median_abs_error"])
    assert any("from its first profile alone" in line for line in lines)


def test_links_replay_refits_only_the_links_and_every_line_reaches_its_largest_message() -> None:
    from replay_sweep import stored_profiles
    from replay_variants import refit_links

    # T was measured with the link fit before fe17271, so fitting its links again changes some
    doc = json.loads((ROOT / "benchmarks" / "results" / "earlier" / "cpu_cluster_sweep_T.json").read_text())
    again = refit_links(doc)
    links = lambda d: [l for s in d["settings"] for p in stored_profiles(s) for l in p.get("links", [])]  # noqa: E731
    assert len(links(again)) == len(links(doc)) > 0
    changed = 0
    for old, new in zip(links(doc), links(again)):
        assert {k: v for k, v in old.items() if k not in ("latency_s", "bandwidth_bytes_per_s")} == {
            k: v for k, v in new.items() if k not in ("latency_s", "bandwidth_bytes_per_s")
        }
        changed += old != new
        g, t = new["samples"][-1]
        hops = 2 * (new["world_size"] - 1) if new["kind"] == "allreduce" else 1
        per_byte = hops / (new["world_size"] * new["bandwidth_bytes_per_s"]) if new["kind"] == "allreduce" else 1 / new["bandwidth_bytes_per_s"]
        assert new["latency_s"] * hops + per_byte * g >= t * (1 - 1e-9)  # the line reaches the largest message
        assert new["latency_s"] > 0 and new["bandwidth_bytes_per_s"] > 0
    assert changed > 0
    for s_old, s_new in zip(doc["settings"], again["settings"]):
        assert s_old["plans"] == s_new["plans"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_committed_sweep_timed_each_plan_for_min_time(path: Path) -> None:
    """Each plan ran the timed steps --steps and --min-time ask for, in every pass and confirmation pass."""
    from lightning_distplan.bench import format_table
    from lightning_distplan.bench._bench import timed_steps

    doc = json.loads(path.read_text())
    assert doc["provenance"]["min_time_s"] == 1.0  # the sweep's default since 155c235
    for setting in doc["settings"]:
        for rec in setting["plans"]:
            count = timed_steps(setting["steps"], setting["min_time_s"], rec["first_profile"]["predicted_step_time_s"])
            assert rec["timed_steps_per_pass"] == count
            assert len(rec["measured_step_times_s"]) == count * setting["passes"]
            if rec.get("confirm_step_times_s"):
                assert len(rec["confirm_step_times_s"]) == count * setting["confirm_passes"]
            # about a second of steps per pass, as predicted: fast plans ran more than --steps
            assert count == setting["steps"] or count * rec["first_profile"]["predicted_step_time_s"] >= 1.0
        # the readable table says how long each plan was timed, where --min-time lengthened any plan's timing
        counts = [r["timed_steps_per_pass"] for r in setting["plans"]]
        header = format_table(setting).splitlines()[0]
        if max(counts) > setting["steps"]:
            assert f"(timed: at least ~1 s, {min(counts)}-{max(counts)} steps)" in header
        else:  # every plan slow enough that --steps already took a second (tiny GPT-2 at 100 Mbit/s)
            assert "(timed:" not in header


def test_readme_noise_and_slot_figures_are_those_of_the_committed_sweeps() -> None:
    from sweep_stats import sweep_stats

    s = sweep_stats([json.loads(p.read_text()) for p in SWEEPS])
    readme = " ".join((ROOT / "README.md").read_text().split())  # line breaks as spaces
    lo, mid, hi, n = s["slot_s"]
    assert f"({lo * 1e3:.2f}–{hi * 1e3:.2f} ms, median {mid * 1e3:.2f} ms, over the {n} profiles of the three sweeps" in readme
    assert f"took {s['host_checks'][0]:.2f}× to {s['host_checks'][1]:.2f}× its" in readme
    assert f"up to {s['spread_max'][0]:.2f}× apart" in readme
    assert f"{s['spread_median']:.2f}× the smallest at the median and {s['spread_p90']:.2f}× at the p90" in readme


def _figures(line: str) -> tuple[str, str, str]:
    """(median, p90, picks) from a line of ``replay_variants._pooled``."""
    median, p90, picks = re.search(r"median \|error\| ([0-9.]+%), p90 ([0-9.]+%), pick within 5% in (\d+/\d+)", line).groups()
    return median, p90, picks


def test_readme_figures_of_the_earlier_runs_are_what_they_replay_to_today() -> None:
    """The README's prose about the earlier runs K–V (benchmarks/results/earlier/) replays them with today's model: a
    model change that moves these figures fails here (two of them had gone stale unnoticed)."""
    from replay_variants import _pooled, refit_links

    earlier = ROOT / "benchmarks" / "results" / "earlier"
    k_to_s = [json.loads((earlier / f"cpu_cluster_sweep_{run}.json").read_text()) for run in "KLMNOPQRS"]
    t_to_v = [json.loads((earlier / f"cpu_cluster_sweep_{run}.json").read_text()) for run in "TUV"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    ks, ks_links = _figures(_pooled(k_to_s)), _figures(_pooled([refit_links(d) for d in k_to_s]))
    tv, tv_links = _figures(_pooled(t_to_v)), _figures(_pooled([refit_links(d) for d in t_to_v]))
    assert f"The nine runs K–S, which profiled once, pool to median {ks[0]}, p90 {ks[1]} and {ks[2]} picks" in readme

    def change(a: str, b: str) -> str:
        return f"{a} both" if a == b else f"{a} → {b}"

    expected = (f"{change(tv[0], tv_links[0])}, p90 {change(tv[1], tv_links[1])}, picks {change(tv[2], tv_links[2])} on T, U, V, and "
                f"{change(ks[0], ks_links[0])}, p90 {change(ks[1], ks_links[1])}, picks {change(ks[2], ks_links[2])} on K–S")
    assert expected in readme, expected


def test_readme_accuracy_section_is_what_the_committed_results_give() -> None:
    """The README's table is generated (benchmarks/readme_table.py --write): a result file changed without
    regenerating it, or a hand edit, fails here."""
    from readme_table import section

    assert section() in (ROOT / "README.md").read_text(), "run python benchmarks/readme_table.py --write"


def test_readme_pipeline_slot_figures_are_those_of_their_result_file() -> None:
    """README quoted the hand-overs the model charged as 0.20 ms where the file has 0.209 ms."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "pipeline_slot_overhead_cpu.json").read_text())
    one, gpipe, handover = doc["per_microbatch_ms"]["1f1b"], doc["per_microbatch_ms"]["gpipe"], doc["modelled_per_microbatch_ms"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"({one:.2f} ms per micro-batch, less {handover:.2f} ms of hand-overs)" in readme
    assert f"measured {one:.2f} against GPipe's {gpipe:.2f} ms per micro-batch" in readme
    assert f"({gpipe:.2f} against {one:.2f} ms per micro-batch)" in readme


def test_a_setting_whose_pick_failed_is_summarised_as_a_miss() -> None:
    """A pick that failed on every rank (out of memory, say) left its setting with no pick time: the sweep's summary
    raised a TypeError on it, so the whole sweep was written without a summary and readme_table.py could not pool it."""
    import copy

    from cpu_cluster_sweep import summarize_sweep

    from lightning_distplan.bench import summarize

    doc = json.loads(SWEEPS[0].read_text())
    settings = copy.deepcopy([s for s in doc["settings"] if "summary" in s][:2])
    failed = settings[0]
    for rec in failed["plans"]:
        if rec["rank"] == 1:
            rec.update(measured_step_time_s=None, step_time_error=None, abs_step_time_error=None, error="OutOfMemoryError: out of memory")
            rec.pop("confirm_step_time_s", None)
    failed["summary"] = summarize(failed["plans"])
    nothing = copy.deepcopy(settings[1])  # every plan failed (a replay can give such a setting)
    for rec in nothing["plans"]:
        rec.update(measured_step_time_s=None, step_time_error=None, abs_step_time_error=None, error="RuntimeError: x")
    nothing["summary"] = summarize(nothing["plans"])
    summary, lines = summarize_sweep([failed, nothing], doc["provenance"]["rates"])
    assert summary["n_picks_failed"] == 2 and summary["pick_within_5pct_rate"] == 0.0
    assert "the pick FAILED in 2 setting(s)" in "\n".join(lines)
    # the setting without a measurement: dashes where its errors go
    row = next(line for line in lines if line.startswith(nothing["model_key"]) and line.split()[1] == nothing["rate"])
    assert row.split()[2:7] == ["0", "-", "-", "-", "nan"]
    # the pick table: the failed picks as such, beside the measured best where there is one
    table = lines[lines.index(next(line for line in lines if line.startswith("chosen plan (pick)"))):]
    pick_rows = [line for line in table if line.startswith((failed["model_key"], nothing["model_key"]))]
    assert len(pick_rows) == 2 and all(line.split(" FAILED")[0].strip() for line in pick_rows)
    assert [line.count(" FAILED") for line in pick_rows] == [1, 1]


def test_readme_row_says_which_runs_of_a_sweep_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting whose job failed left its sweep's "k/n settings" with n one smaller and a plan that failed left the
    "over N runs" one smaller, and the row said neither (nor that fewer than 3 x 3 settings ran)."""
    import copy
    import shutil

    import readme_table
    from cpu_cluster_sweep import summarize_sweep

    for path in SWEEPS:
        shutil.copy(path, tmp_path / path.name)
    doc = json.loads(SWEEPS[1].read_text())
    settings = copy.deepcopy(doc["settings"])
    settings[0] = {"model_key": settings[0]["model_key"], "rate": settings[0]["rate"], "error": "exit codes [1, 0]"}
    settings[1]["plans"][-1].update(measured_step_time_s=None, step_time_error=None, abs_step_time_error=None, error="OutOfMemoryError: x")
    summary, _ = summarize_sweep(settings, doc["provenance"]["rates"])
    (tmp_path / SWEEPS[1].name).write_text(json.dumps({**doc, "settings": settings, "summary": summary}))
    monkeypatch.setattr(readme_table, "RESULTS", tmp_path)
    row = next(r for r in readme_table.rows() if r[4] == "`benchmarks/cpu_cluster_sweep.py`")
    assert row[0].startswith("Step time of every candidate plan, 2 ranks over a rate-limited link (3 models × 3 rates;")
    run1, run2 = row[1].split("; run 2: ")[0], row[1].split("; run 2: ")[1].split("; run 3: ")[0]
    assert "failed" not in run1
    assert f"over {summary['n_points']} runs" in run2 and f"/{summary['n_settings_done']} settings" in run2
    assert summary["n_settings_done"] == 8
    assert "(1 plan run(s) failed, not in the errors; 1 setting(s) failed to run, not in the settings counted)" in run2
    pooled = row[1].split("all runs pooled: ")[1]
    assert "(1 plan run(s) failed, not in the errors; 1 setting(s) failed to run, not in the settings counted)" in pooled


@pytest.mark.parametrize("text", ["# no section here\n", "<!-- accuracy-table:begin -->\nold table, its end marker lost\n"])
def test_readme_table_write_without_a_section_says_so(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--write on a README without the markers printed "updated README.md" and changed nothing."""
    import readme_table

    (tmp_path / "README.md").write_text(text)
    monkeypatch.setattr(readme_table, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["readme_table.py", "--write"])
    assert readme_table.main() == 1
    captured = capsys.readouterr()
    assert "updated" not in captured.out and "has no <!-- accuracy-table:begin --> ... <!-- accuracy-table:end --> section" in captured.err
    assert "HINT:" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert (tmp_path / "README.md").read_text() == text
    (tmp_path / "README.md").write_text("intro\nACCURACY_TABLE\n")  # the placeholder a new README starts with is replaced
    assert readme_table.main() == 0 and readme_table.section() in (tmp_path / "README.md").read_text()


def test_a_stopped_sweeps_partial_file_is_no_committed_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sweep stopped part-way writes benchmarks/results/cpu_cluster_sweep.partial.json (by default beside the
    committed runs); sweep_files took it for run 1 (its name sorted there), and this file's tests then replayed, counted
    and checked the README's figures against it (7 failed with one such file present)."""
    import readme_table

    names = ["cpu_cluster_sweep.json", "cpu_cluster_sweep_run2.json", "cpu_cluster_sweep_run10.json", "cpu_cluster_sweep.partial.json",
             "cpu_cluster_sweep.partial.2.json", "cpu_cluster_sweep_run2.partial.json", "cpu_cluster_sweep_quick.json"]
    for name in names:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(readme_table, "RESULTS", tmp_path)
    assert [p.name for p in readme_table.sweep_files()] == names[:3]


def test_a_replay_prices_the_plans_with_the_ranks_per_machine_the_bench_recorded() -> None:
    """A bench result did not say how many of its ranks ran on one machine, so replay_sweep priced every setting as one
    machine of all the ranks: a 2-machine x 2-rank run's 1f1b dp=2 pp=2 had its two stages' all-reduces alone on the
    link, where the bench (and auto_plan) priced them sharing the machine's one link. The bench now records
    ranks_per_host and the replay prices with it; a setting from before it was recorded replays as before."""
    from replay_sweep import replay_setting

    from lightning_distplan.bench import predict_ranked
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
    from lightning_distplan.planner import rank_plans

    profile = synthetic_profile([LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=b) for b in (3_000_000, 1_000_000)])
    (best, *_) = rank_plans(profile, world_size=4, global_batch_size=8, pins={"strategy": "1f1b", "stages": 2})
    plan = best.plan
    record = {"rank": 1, "plan": plan.describe(), "plan_json": plan.to_dict(), "strategy": plan.strategy, "error": None,
              "measured_step_time_s": 0.5, "predicted_step_time_s": None}
    old = {"model_key": "m", "rate": "unlimited", "profile": profile.to_dict(), "plans": [record]}
    ((shared, _),) = predict_ranked(profile, [plan], ranks_per_host=2)  # 2 machines of 2 ranks, as the bench priced them
    ((alone, _),) = predict_ranked(profile, [plan], ranks_per_host=4)  # one machine of 4
    assert shared.step_time_s > alone.step_time_s
    (again,) = replay_setting({**old, "ranks_per_host": 2})["plans"]
    assert again["predicted_step_time_s"] == pytest.approx(shared.step_time_s, rel=1e-12)
    (before,) = replay_setting(old)["plans"]  # no ranks_per_host recorded: one machine, as replays always priced it
    assert before["predicted_step_time_s"] == pytest.approx(alone.step_time_s, rel=1e-12)
