"""examples/: what the overhead example records for the README's row."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import auto_plan_overhead  # noqa: E402


def test_overhead_run_counts_the_epochs_steps_and_takes_the_median_after_warm_up() -> None:
    """``steps`` is the epoch's optimizer steps (README: "one CPU epoch (256 steps)"); it had become the count after the
    monitor's warm-up (253 for that epoch) when the median moved past the warm-up. The figures are the monitor's
    ``summary`` (tests/callbacks/test_monitor.py measures them in a real fit): the record copies them."""
    from lightning_distplan.callbacks import StepTimeSummary

    summary = StepTimeSummary(
        steps=10, warmup_steps=3, partial_steps=0, observed_steps=7, mean_observed_s=0.4, min_observed_s=0.1, max_observed_s=0.7,
        median_observed_s=0.4, predicted_s=0.25, mean_observed_over_predicted=1.6,
    )
    monitor = SimpleNamespace(summary=summary, overhead_s=1.0, run_s=20.0, predicted_step_time_s=0.25)
    run = auto_plan_overhead.run_record("dp_ga dp=2 m=16 accumulate=1", monitor, 25.0)
    assert run["steps"] == 10 and run["observed_steps"] == 7
    assert run["median_observed_step_s"] == 0.4 and run["overhead_pct"] == 5.0 and run["plan"] == "dp_ga dp=2 m=16 accumulate=1"


def test_overhead_out_path_is_refused_before_the_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "overhead.json"
    monkeypatch.setattr(sys, "argv", ["auto_plan_overhead.py", "--out", str(bad)])
    monkeypatch.setattr(auto_plan_overhead.L, "Trainer", lambda *a, **k: pytest.fail("the fit started"))
    with pytest.raises(SystemExit, match=r"^--out '.*overhead\.json' lies under '.*file', which is a file\. HINT:"):
        auto_plan_overhead.main()


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--trials", "0", "argument --trials: '0' is not a positive integer"),
    ("--batch-size", "0", "argument --batch-size: '0' is not a positive integer"),
    ("--devices", "-2", "argument --devices: '-2' is not a positive integer"),
    ("--trials", "²", "argument --trials: '²' is not a positive integer"),  # a digit to str.isdigit, not to int()
    ("--time-weight", "-1", "argument --time-weight: '-1' is not a number >= 0"),
])
def test_demo_refuses_a_bad_option_before_it_trains(option: str, value: str, said: str, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--trials 0 trained for minutes and then ended in a traceback from tune(); --batch-size 0 in one from the data module."""
    sys.path.insert(0, str(ROOT / "examples"))
    import auto_plan_demo

    monkeypatch.setattr(sys, "argv", ["auto_plan_demo.py", option, value])
    monkeypatch.setattr(auto_plan_demo.L, "Trainer", lambda *a, **k: pytest.fail("the fit started"))
    with pytest.raises(SystemExit) as info:
        auto_plan_demo.main()
    assert info.value.code == 2 and said in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--devices", "0", "argument --devices: '0' is not a positive integer"),
    ("--samples", "0", "argument --samples: '0' is not a positive integer"),
    ("--layers", "0", "argument --layers: '0' is not a positive integer"),
    ("--width", "6", "argument --width: '6' is not a multiple of 4"),
])
def test_overhead_refuses_a_bad_option_before_it_trains(option: str, value: str, said: str, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--devices 0 ended in a ZeroDivisionError traceback, --samples 0 in one from the data module, --width 6 in an
    AssertionError from torch's attention and --layers 0 in a ProfilingError from both ranks after launching them."""
    monkeypatch.setattr(sys, "argv", ["auto_plan_overhead.py", option, value])
    monkeypatch.setattr(auto_plan_overhead.L, "Trainer", lambda *a, **k: pytest.fail("the fit started"))
    with pytest.raises(SystemExit) as info:
        auto_plan_overhead.main()
    assert info.value.code == 2 and said in capsys.readouterr().err.strip().splitlines()[-1]


def test_overhead_record_is_written_as_the_package_writes_its_files(tmp_path: Path) -> None:
    """``_record`` had an atomic write of its own: it replaced a symbolic link ``--out`` with a plain file (the link's
    target kept the old runs), made the file 0600-or-umask instead of keeping its mode, and wrote through a fixed
    ``<name>.tmp`` beside it, replacing a file of that name."""
    import os
    import stat

    target = tmp_path / "kept" / "overhead.json"
    target.parent.mkdir()
    auto_plan_overhead._record(target, {"plan": "a"}, _overhead_args(), (0.0, 0.0, 0.0))
    os.chmod(target, 0o640)
    link = tmp_path / "overhead.json"
    link.symlink_to(target)
    (tmp_path / "overhead.tmp").write_text("mine")
    auto_plan_overhead._record(link, {"plan": "b"}, _overhead_args(), (0.0, 0.0, 0.0))
    assert link.is_symlink() and [r["plan"] for r in json.loads(target.read_text())["runs"]] == ["a", "b"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert (tmp_path / "overhead.tmp").read_text() == "mine"
    assert sorted(p.name for p in target.parent.iterdir()) == ["overhead.json"]


def _overhead_args() -> SimpleNamespace:
    return SimpleNamespace(devices=2, samples=64, batch_size=16, vocab=32, block=8, width=16, layers=1)


def test_demo_names_the_artifact_folder_for_optuna_dashboard(tmp_path: Path) -> None:
    """The demo's closing line offered `optuna-dashboard URL` alone: optuna-dashboard serves no artifact store unless
    told one, so the PNG plots the demo had just attached to the study were not there. It names their folder now."""
    import shlex

    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "tests" / "tuner"))
    import auto_plan_demo
    import optuna
    from _synthetic_study import make_study

    from lightning_distplan.tuner.plots import attach_to_study

    storage = f"sqlite:///{tmp_path / 'my runs' / 'distplan.db'}"
    (tmp_path / "my runs").mkdir()
    study = make_study(storage, study_name="demo", instances=("gn6i.xlarge",), counts=(1, 2), micro_batch_sizes=(4, 8))
    stored = attach_to_study(study)
    line = auto_plan_demo.open_study_line(storage, stored["artifact_dir"])
    alternative = shlex.split(line.split("(or: ", 1)[1].rstrip(")"))
    assert alternative[:2] == ["optuna-dashboard", storage]
    folder = Path(alternative[alternative.index("--artifact-dir") + 1])
    metas = optuna.artifacts.get_all_artifact_meta(study)
    assert len(metas) == 2 and all((folder / meta.artifact_id).is_file() for meta in metas)
    assert shlex.split(line.split("   (or:", 1)[0].split("open the study:", 1)[1]) == ["distplan", "dashboard", storage]
