"""Pareto front / time-breakdown extraction and plots, and what attach_to_study stores."""

from __future__ import annotations

import sys
from pathlib import Path

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _synthetic_study import SMALL, config_attrs, make_study  # noqa: E402

from lightning_distplan.tuner import plots  # noqa: E402
from lightning_distplan.tuner.plots import (  # noqa: E402
    attach_to_study,
    plot_pareto_front,
    plot_time_breakdown,
    summary_markdown,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def study() -> optuna.Study:
    return make_study(None, study_name="plots", **SMALL)


def _trial(attrs: dict, *, state: optuna.trial.TrialState = optuna.trial.TrialState.COMPLETE) -> optuna.trial.FrozenTrial:
    values = [attrs["cost_per_step"], attrs["step_time_s"]] if state == optuna.trial.TrialState.COMPLETE else None
    return optuna.trial.create_trial(user_attrs=attrs, values=values, state=state)


def test_pareto_info_is_the_non_dominated_set(study: optuna.Study) -> None:
    info = plots._get_pareto_info(study)
    feasible = [t for t in study.trials if t.user_attrs["feasible"]]
    assert len(info.points) == len(feasible) and info.n_infeasible == len(study.trials) - len(feasible) > 0
    assert info.currency == "RMB" and info.study_name == "plots"

    def dominates(a, b) -> bool:
        return a.step_time_s <= b.step_time_s and a.cost_per_step <= b.cost_per_step and (a.step_time_s, a.cost_per_step) != (b.step_time_s, b.cost_per_step)

    front_ids = {p.trial_number for p in info.front}
    assert len(info.front) >= 3
    for p in info.points:
        beaten = any(dominates(q, p) for q in info.points)
        assert beaten == (p.trial_number not in front_ids), p.label
    times = [p.step_time_s for p in info.front]
    costs = [p.cost_per_step for p in info.front]
    assert times == sorted(times) and costs == sorted(costs, reverse=True)
    # seed 000 §IV-D weights: w = 0 picks the cheapest, the largest w the fastest point of the front
    assert info.best_by_weight[0.0].cost_per_step == min(costs)
    assert info.best_by_weight[2.0**16].step_time_s == min(times)


def test_duplicates_infeasible_and_running_trials() -> None:
    a = config_attrs("gn7i.2xlarge", 2, 8, 4)
    b = config_attrs("gn7e.4xlarge", 4, 16, 1)
    trials = [
        _trial(a),
        _trial(a),  # a sampler revisiting a configuration: drawn once
        _trial(b),
        _trial({**config_attrs("sgn7i.xlarge", 1, 16, 4)}, state=optuna.trial.TrialState.PRUNED),
        optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL),
    ]
    info = plots._get_pareto_info(trials)
    assert [p.trial_number for p in info.points] == [trials[0].number, trials[2].number]
    assert info.n_infeasible == 2 and info.study_name is None
    assert info.points[0].label == "gn7i.2xlarge×2 · dp_ga dp=2 m=8 s=4"


def test_pipeline_label_uses_n_microbatches() -> None:
    attrs = {**config_attrs("gn7e.4xlarge", 4, 4, 1), "strategy": "1f1b", "schedule": "1f1b", "dp": 2, "pp": 2, "n_microbatches": 8, "accumulate_grad_batches": 1}
    (point,) = plots._get_pareto_info([_trial(attrs)]).points
    assert point.plan == "1f1b dp=2 pp=2 m=4 n=8"


def test_no_feasible_trial_is_a_clear_error() -> None:
    trials = [_trial(config_attrs("sgn7i.xlarge", 1, 16, 4), state=optuna.trial.TrialState.PRUNED)]
    with pytest.raises(ValueError, match=r"No feasible configuration among 1 trials.*HINT"):
        plot_pareto_front(trials)
    with pytest.raises(TypeError, match="HINT"):
        plot_pareto_front([1, 2, 3])
    with pytest.raises(ValueError, match=r"`top_k` must be an integer >= 1, got 0"):
        plot_time_breakdown(trials, top_k=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # a string or a fraction raised the comparison's or the slice's TypeError; True showed one configuration
        (dict(top_k="3"), r"^`top_k` must be an integer >= 1, got '3'\. HINT: Pass the number of configurations"),
        (dict(top_k=2.5), r"^`top_k` must be an integer >= 1, got 2\.5\. HINT:"),
        (dict(top_k=True), r"^`top_k` must be an integer >= 1, got True\. HINT:"),
        # a negative w ranked the slowest configurations first and NaN at random, both without a word
        (dict(time_weight=-1.0), r"^`time_weight` must be a finite number >= 0 or None, got -1\.0\. HINT: Use e\.g\. 0, 256"),
        (dict(time_weight=float("nan")), r"^`time_weight` must be a finite number >= 0 or None, got nan\. HINT:"),
        (dict(time_weight="4096"), r"^`time_weight` must be a finite number >= 0 or None, got '4096'\. HINT:"),
    ],
)
def test_bad_top_k_and_time_weight_are_refused(study: optuna.Study, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plot_time_breakdown(study, **kwargs)
    if "time_weight" in kwargs:
        with pytest.raises(ValueError, match=match):
            summary_markdown(study, **kwargs)


def test_numpy_top_k_and_time_weight_are_taken_as_before(study: optuna.Study) -> None:
    """The checks above took only Python int / float: a numpy integer top_k or a numpy time_weight (np.float32,
    np.int64), which the plots drew before the checks, was refused."""
    import numpy as np

    python = plots._get_breakdown_info(study, top_k=3, time_weight=256.0)
    for top_k, time_weight in ((np.int64(3), np.float32(256)), (np.int32(3), np.int64(256))):
        info = plots._get_breakdown_info(study, top_k=top_k, time_weight=time_weight)
        assert info == python and type(info.time_weight) is float
        assert len(plot_time_breakdown(study, top_k=top_k, time_weight=time_weight).data[0].x) == 3
    assert summary_markdown(study, time_weight=np.float32(256)) == summary_markdown(study, time_weight=256.0)
    with pytest.raises(ValueError, match=r"^`top_k` must be an integer >= 1, got np\.True_\. HINT:"):
        plot_time_breakdown(study, top_k=np.True_)


def test_attach_refuses_bad_arguments_before_it_writes_the_note(tmp_path: Path) -> None:
    from optuna_dashboard import get_note

    study = make_study(f"sqlite:///{tmp_path / 't.db'}", study_name="untouched", instances=("gn6i.xlarge",), counts=(1, 2), micro_batch_sizes=(4, 8))
    with pytest.raises(ValueError, match=r"`top_k` must be an integer >= 1, got '8'\. HINT:"):
        attach_to_study(study, top_k="8")
    assert get_note(study) == ""  # no note without its plots
    assert not (tmp_path / "t-artifacts").exists()


def test_plot_paths_that_cannot_be_written_are_one_sentence(study: optuna.Study, tmp_path: Path) -> None:
    """A folder or a path under a file raised the writer's bare IsADirectoryError / FileExistsError."""
    from lightning_distplan.errors import OutputPathError

    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(OutputPathError, match=r"^path_html '.*folder' is a directory\. HINT: Name a file, e\.g\. path_html .*plot\.html\.$"):
        plot_pareto_front(study, path_html=tmp_path / "folder")
    with pytest.raises(OutputPathError, match=r"^path_png '.*afile/b\.png' lies under '.*afile', which is a file\. HINT:"):
        plot_time_breakdown(study, path_png=tmp_path / "afile" / "b.png")
    assert (tmp_path / "afile").read_text() == "mine"
    # written through a temporary file: a PNG that cannot be drawn (too large for Agg) leaves the one there before as it was
    from matplotlib.figure import Figure

    (tmp_path / "p.png").write_bytes(b"earlier")
    with pytest.raises(ValueError, match="Image size"):
        plots._save_png(Figure(figsize=(1e6, 1e6), dpi=100), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes() == b"earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder", "p.png"]


def test_breakdown_ranks_by_objective_and_stacks_to_step_time(study: optuna.Study) -> None:
    cheap = plots._get_breakdown_info(study, top_k=5, time_weight=0.0)
    fast = plots._get_breakdown_info(study, top_k=5, time_weight=2.0**16)
    assert [p.cost_per_step for p in cheap.points] == sorted(p.cost_per_step for p in cheap.points)
    assert fast.points[0].step_time_s == min(p.step_time_s for p in plots._get_pareto_info(study).points)
    assert "other" not in cheap.parts and set(cheap.parts) <= set(plots.BREAKDOWN_PARTS)  # synthetic parts sum to the step time
    for i, p in enumerate(cheap.points):
        assert sum(cheap.parts[k][i] for k in cheap.parts) == pytest.approx(p.step_time_s)
    # default weight: the study's time_weight user attribute (what the tuner stores)
    assert plots._get_breakdown_info(study).time_weight == 0.0


def test_breakdown_shows_unexplained_time_as_other() -> None:
    attrs = config_attrs("gn7i.2xlarge", 1, 8, 8)
    attrs["breakdown"] = {"compute": attrs["step_time_s"] / 2}
    info = plots._get_breakdown_info([_trial(attrs)], top_k=3)
    assert info.parts["other"][0] == pytest.approx(attrs["step_time_s"] / 2)


def test_breakdown_of_a_real_pipeline_trial_shows_every_part_of_the_model() -> None:
    """The model's p2p / framework / sync_wait parts are bars of their own: left out, a pipeline's hand-overs showed as
    an unexplained "other" gap."""
    from lightning_distplan.costmodel import BREAKDOWN_KEYS

    attrs = config_attrs("gn7e.4xlarge", 3, 12, 1)
    t = attrs["step_time_s"]
    attrs["breakdown"] = {"compute": 0.5 * t, "p2p": 0.25 * t, "bubble": 0.1 * t, "exposed_comm": 0.0, "optimizer": 0.05 * t,
                          "framework": 0.06 * t, "sync_wait": 0.04 * t}
    info = plots._get_breakdown_info([_trial(attrs)], top_k=3)
    assert set(plots.BREAKDOWN_PARTS) == set(BREAKDOWN_KEYS)
    assert "other" not in info.parts and "exposed_comm" not in info.parts  # zero everywhere: no legend entry
    assert info.parts["p2p"] == [pytest.approx(0.25 * t)] and info.parts["sync_wait"] == [pytest.approx(0.04 * t)]


def test_plots_write_inline_html_and_png(study: optuna.Study, tmp_path: Path) -> None:
    fig = plot_pareto_front(study, path_html=tmp_path / "p.html", path_png=tmp_path / "p.png")
    info = plots._get_pareto_info(study)
    names = [trace.name for trace in fig.data]
    assert "Pareto front" in names and any(n.startswith("F1 ") for n in names)
    html = (tmp_path / "p.html").read_text()
    assert "Cost vs time per step" in html and "gn7" in html
    assert 'src="https://cdn.plot.ly' not in html and len(html) > 1_000_000  # plotly.js inlined: opens offline
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    front_trace = next(t for t in fig.data if t.name == "Pareto front")
    assert list(front_trace.x) == [p.step_time_s for p in info.front]

    fig = plot_time_breakdown(study, top_k=4, path_html=tmp_path / "b.html", path_png=tmp_path / "b.png")
    bars = [t for t in fig.data if t.type == "bar"]
    shown = plots._get_breakdown_info(study, top_k=4).parts  # the parts not zero in all four
    assert [b.name for b in bars] == [plots._PART_LABEL[part] for part in shown] and bars[0].name == "compute"
    assert all(len(b.y) == 4 for b in bars) and fig.layout.barmode == "stack"
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "b.html").stat().st_size > 1_000_000


def test_summary_markdown_names_best_and_front(study: optuna.Study) -> None:
    text = summary_markdown(study, time_weight=0.0)
    info = plots._get_pareto_info(study)
    best = info.best_by_weight[0.0]
    assert f"**{best.hardware}**, `{best.plan}`" in text
    for p in info.front:
        assert f"| {p.trial_number} | {p.hardware} | `{p.plan}` |" in text


def test_summary_markdown_tells_sub_millisecond_front_points_apart() -> None:
    """The note printed times with one decimal of a millisecond: a small model's two-point front (0.2252 and
    0.1564 ms) read 0.2 ms twice, so the faster point looked no faster than the cheaper one."""
    slow = {**config_attrs("gn7i.2xlarge", 1, 8, 1), "step_time_s": 0.000225203, "cost_per_step": 6.29e-08}
    fast = {**config_attrs("gn7e.4xlarge", 1, 8, 1), "step_time_s": 0.000156391, "cost_per_step": 8.08e-08}
    text = summary_markdown([_trial(slow), _trial(fast)], time_weight=2.0**16)
    assert "0.1564 ms/step" in text and "| 0.2252 ms |" in text and "| 0.1564 ms |" in text
    assert plots._fmt_time(3.95195) == "3.952 s" and plots._fmt_time(0.0599797) == "59.98 ms"


def test_attach_to_study_stores_note_plots_and_png_artifacts(tmp_path: Path) -> None:
    from optuna_dashboard import get_note

    db = tmp_path / "tune.db"
    study = make_study(f"sqlite:///{db}", study_name="attach", instances=("gn6i.xlarge", "gn7i.2xlarge"), counts=(1, 2), micro_batch_sizes=(4, 8))
    stored = attach_to_study(study)
    assert get_note(study) == summary_markdown(study)
    system = study._storage.get_study_system_attrs(study._study_id)  # optuna 5 dropped Study.system_attrs
    for graph_id in (plots.PARETO_GRAPH_ID, plots.BREAKDOWN_GRAPH_ID):
        assert any(k.startswith(f"dashboard:plot_data:{graph_id}:") for k in system)
    metas = optuna.artifacts.get_all_artifact_meta(study)
    assert sorted(m.filename for m in metas) == ["attach-pareto_front.png", "attach-time_breakdown.png"]
    assert all(m.mimetype == "image/png" for m in metas)
    art_dir = tmp_path / "tune-artifacts"
    assert stored["artifact_dir"] == str(art_dir)
    for meta in metas:
        assert (art_dir / meta.artifact_id).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in art_dir.iterdir() if p.name.startswith("_staging")]

    # A name with a slash is one study, not a folder: its PNGs get a file-safe name (this raised OSError after the search).
    other = make_study(f"sqlite:///{db}", study_name="resnet/run 1", instances=("gn6i.xlarge",), counts=(1, 2), micro_batch_sizes=(4, 8))
    attach_to_study(other)
    names = sorted(m.filename for m in optuna.artifacts.get_all_artifact_meta(other))
    assert names == ["resnet_run_1-pareto_front.png", "resnet_run_1-time_breakdown.png"]
    assert not [p for p in art_dir.iterdir() if p.name.startswith("_staging")]
