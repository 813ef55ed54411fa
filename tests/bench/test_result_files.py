"""Benchmark scripts and their result files: a script refuses a bad output path before it measures, says so
before it replaces a committed result, writes atomically, and ``--help`` only prints the usage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "cuda_memory"))
from _results import result_path, write_result  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def test_a_bad_output_path_is_one_line_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes.txt").write_text("my notes")
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "file" / "r.json", "which is a file"),
                     (tmp_path / "notes.txt", "exists and is not a JSON result file")):
        with pytest.raises(SystemExit) as info:
            result_path(bad, tmp_path / "default.json", script="bench")
        message = str(info.value.code)
        assert message.startswith(f"bench: --out '{bad}'") and why in message and "HINT:" in message and "\n" not in message
    assert (tmp_path / "notes.txt").read_text() == "my notes"


def test_the_default_result_is_named_before_it_is_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    default = tmp_path / "result.json"
    assert result_path(None, default, script="bench") == default  # nothing to replace: nothing said
    assert capsys.readouterr().err == ""
    write_result(default, {"benchmark": "bench"})
    written = json.loads(default.read_text())  # with the code that wrote it (tests/test_provenance.py)
    assert written.pop("code")["versions"] and written == {"benchmark": "bench"} and [p.name for p in tmp_path.iterdir()] == ["result.json"]
    result_path(None, default, script="bench")
    assert f"bench: this run replaces the result file {default} when it ends; pass --out FILE to keep it." in capsys.readouterr().err
    result_path(tmp_path / "mine.json", default, script="bench")  # a file of the user's choosing: nothing to say
    result_path(default, default, script="bench")
    assert capsys.readouterr().err == ""
    committed = RESULTS / "planning_scale_cpu.json"
    result_path(None, committed, script="bench")
    assert ("this run replaces the committed result benchmarks/results/planning_scale_cpu.json when it ends; pass --out FILE "
            "to keep it (git checkout -- benchmarks/results/planning_scale_cpu.json restores it).") in capsys.readouterr().err
    # a run that writes as it goes (gpu_validation, after each model) and names its default only then: too late for --out
    result_path(None, committed, script="gpu_validation", now=True)
    assert ("gpu_validation: this run is replacing the committed result benchmarks/results/planning_scale_cpu.json (it writes after "
            "each part); git checkout -- benchmarks/results/planning_scale_cpu.json restores it.") in capsys.readouterr().err


def test_only_a_result_file_is_replaced(tmp_path: Path) -> None:
    """Any JSON object counted as a result: ``--out package.json`` or ``--out runs/distplan/profile.json`` was replaced
    without a word. A result is known by a "benchmark" name, one of our result schemas, or a provenance command."""
    from _results import is_result

    committed = [p for p in sorted(RESULTS.rglob("*.json")) if not p.name.endswith(("_profile.json", "_profile_synthetic.json"))]
    assert len(committed) > 40 and [p.name for p in committed if not is_result(json.loads(p.read_text()))] == []
    profile = RESULTS / "tuner_vs_exhaustive_profile.json"  # a distplan profile: the benchmark's input, no result
    others = {"package.json": '{"name": "app", "version": "1.0.0"}\n', "profile.json": profile.read_text(), "list.json": "[1, 2]\n",
              "provenance.json": '{"provenance": "mine"}\n'}
    for name, text in others.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as info:
            result_path(tmp_path / name, tmp_path / "default.json", script="bench")
        message = str(info.value.code)
        assert message.startswith(f"bench: --out '{tmp_path / name}' exists and is not a JSON result file; it is left as it is. HINT:"), message
        assert "\n" not in message and (tmp_path / name).read_text() == text
    for source in (RESULTS / "seed000_ga.json", RESULTS / "planning_scale_cpu.json", RESULTS / "cpu_cluster_sweep.json",
                   RESULTS / "auto_plan_overhead_cpu.json"):  # provenance, benchmark, schema (two)
        (tmp_path / source.name).write_text(source.read_text())
        assert result_path(tmp_path / source.name, tmp_path / "default.json", script="bench") == tmp_path / source.name


@pytest.mark.parametrize("module", ["planning_scale", "replay_input_bytes"])
def test_help_prints_the_usage_and_writes_nothing(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    """These two took no arguments: ``--help`` ran the benchmark and replaced the committed result."""
    script = __import__(module)
    before = {p: p.stat().st_mtime_ns for p in RESULTS.glob("*.json")}
    with pytest.raises(SystemExit) as info:
        script.main(["--help"])
    assert info.value.code == 0 and "--out" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in RESULTS.glob("*.json")} == before


def test_replay_input_bytes_writes_where_it_is_told(tmp_path: Path) -> None:
    import replay_input_bytes

    replay_input_bytes.main(["--out", str(tmp_path / "replay.json")])
    doc = json.loads((tmp_path / "replay.json").read_text())
    committed = json.loads(replay_input_bytes.OUT.read_text())
    assert doc["replays"] == committed["replays"] and doc["command"].endswith(f"replay_input_bytes.py --out {tmp_path / 'replay.json'}")


SCRIPTS = {  # script: arguments besides --out that let it reach its output check
    "cli_timings": [], "cpu_cluster_sweep": ["--quick"], "dp_ga_overhead": [], "gloo_rendezvous": [], "gpu_validation": ["--device", "cpu"],
    "pipeline_slot_overhead": [], "planning_scale": [], "reproduce_seed000_ga": [], "single_device_validation": ["--device", "cpu"],
    "tuner_vs_exhaustive": [],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_script_refuses_a_bad_output_before_it_measures(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wrote its result only at the end, with a traceback there for a folder or a path under a file, after minutes of
    measuring (and replaced, say, README.md given as --out)."""
    script = __import__(name)
    (tmp_path / "notes.md").write_text("mine")
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "notes.md", "is not a JSON result file")):
        argv = [*SCRIPTS[name], "--out", str(bad)]
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        with pytest.raises(SystemExit) as info:
            script.main(argv) if "argv" in script.main.__code__.co_varnames else script.main()
        message = str(info.value.code)
        assert message.startswith(f"{name}: --out '{bad}'") and why in message and "HINT:" in message, message
    assert (tmp_path / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


@pytest.mark.parametrize("name", ["replay_sweep", "replay_variants", "sweep_stats"])
def test_replay_scripts_refuse_a_file_that_is_no_sweep_in_one_line(name: str, tmp_path: Path) -> None:
    """They ended in FileNotFoundError / JSONDecodeError / KeyError tracebacks."""
    script = __import__(name)
    (tmp_path / "notes.md").write_text("# notes")
    lead = ["links"] if name == "replay_variants" else []
    for path, why in ((tmp_path / "missing.json", "does not exist"), (tmp_path / "notes.md", "cannot be read as JSON"),
                      (RESULTS / "seed000_ga.json", "is not a CPU cluster sweep result")):
        with pytest.raises(SystemExit) as info:
            script.main([*lead, str(path)])
        message = str(info.value.code)
        assert message.startswith(f"{name}: {path} {why}") and "HINT: pass sweep results" in message and "\n" not in message


def test_bad_arguments_of_the_validation_scripts_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import tuner_vs_exhaustive

    with pytest.raises(SystemExit) as info:
        tuner_vs_exhaustive.main(["--profile", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t.json")])
    assert str(info.value.code).startswith(f"tuner_vs_exhaustive: Profile file '{tmp_path / 'missing.json'}' does not exist. HINT:")
    with pytest.raises(SystemExit) as info:
        tuner_vs_exhaustive.main(["--global-batch-size", "0", "--weights", "0", "--seeds", "0", "--out", str(tmp_path / "t.json")])
    assert str(info.value.code).startswith("tuner_vs_exhaustive: `global_batch_size` must be an integer >= 1, got 0. HINT:")
    for name, argv, said in (("single_device_validation", ["--models", "nope"], "unknown model(s) ['nope']"),
                             ("single_device_validation", ["--accumulations", "1,x"], "'1,x' is not a comma-separated list of positive integers"),
                             ("gpu_validation", ["--accumulations", "0"], "'0' is not a comma-separated list of positive integers")):
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv, "--out", str(tmp_path / "r.json")])
        with pytest.raises(SystemExit) as info:
            __import__(name).main()
        assert info.value.code == 2 and said in capsys.readouterr().err.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["replay_sweep", "replay_variants", "sweep_stats"])
def test_the_commands_a_replay_scripts_docstring_gives_name_sweeps_only(name: str) -> None:
    """replay_variants' docstring ran over benchmarks/results/earlier/*.json, where the earlier GPU results lie too:
    each of its commands ended in KeyError: 'settings'."""
    import glob
    import shlex

    from _results import read_sweep

    script = __import__(name)
    commands = [line.split("python ", 1)[1] for line in script.__doc__.splitlines() if f"python benchmarks/{name}.py" in line]
    assert commands
    for command in commands:
        files = [a for a in shlex.split(command)[1:] if a.endswith(".json")]
        paths = [p for a in files for p in sorted(glob.glob(str(ROOT / a)))]
        assert files and paths, command
        for path in paths:
            read_sweep(path, script=name)  # a SystemExit names the file that is no sweep


def test_tuner_benchmark_leaves_no_studies_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run left a distplan-bench-* folder of SQLite studies (1-2 MB) in the temporary folder."""
    import tempfile

    import tuner_vs_exhaustive

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit):  # a failing run: after the folder was made
        tuner_vs_exhaustive.main(["--global-batch-size", "0", "--weights", "0", "--seeds", "0", "--out", str(tmp_path / "t.json")])
    assert not list(tmp_path.glob("distplan-bench-*")) and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(("name", "argv"), [
    ("reproduce_seed000_ga", ["--figure", "{picture}"]),
    ("cpu_cluster_sweep", ["--quick", "--plot", "{picture}"]),
    ("cpu_cluster_sweep", ["--quick"]),  # the plot beside --out's JSON: picture.png for picture.json
])
def test_a_figure_option_never_replaces_a_file_that_is_no_figure(name: str, argv: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--figure / --plot were checked for a folder only: ``reproduce_seed000_ga.py --figure photo.png`` replaced the
    user's picture with the seed-000 chart, no word said."""
    from _results import figure_path

    picture = tmp_path / "picture.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\nmy picture")
    argv = [a.format(picture=picture) for a in argv] + ["--out", str(tmp_path / "picture.json")]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as info:
        __import__(name).main(argv)
    message = str(info.value.code)
    assert message.startswith(f"{name}: --plot '{picture}'" if name == "cpu_cluster_sweep" else f"{name}: --figure '{picture}'"), message
    assert "is not a figure distplan saved" in message and "HINT:" in message and "\n" not in message
    assert picture.read_bytes() == b"\x89PNG\r\n\x1a\nmy picture" and sorted(p.name for p in tmp_path.iterdir()) == ["picture.png"]
    # what may be replaced: a new path, a committed figure (git restores it), one distplan saved
    assert figure_path(tmp_path / "new.png", script="x", option="--figure") == tmp_path / "new.png"
    assert figure_path(RESULTS / "seed000_ga.png", script="x", option="--figure") == RESULTS / "seed000_ga.png"
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from lightning_distplan._files import save_figure_atomic

    save_figure_atomic(Figure(), tmp_path / "ours.png")
    assert figure_path(tmp_path / "ours.png", script="x", option="--figure") == tmp_path / "ours.png"


def test_seed000_figure_goes_beside_out_and_leaves_the_default_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """With --out and no --figure, reproduce_seed000_ga.py wrote its figure to the committed seed000_ga.png, no word
    said, while it told the user that --out kept the committed result. The script's folder is moved to tmp_path here, so
    the defaults lie there and a failing run replaces no committed file."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    import reproduce_seed000_ga
    from lightning_distplan._files import FIGURE_MARK, save_figure_atomic

    monkeypatch.setattr(reproduce_seed000_ga, "ROOT", tmp_path)
    default_png = save_figure_atomic(Figure(), tmp_path / "results" / "seed000_ga.png")
    before = default_png.read_bytes()
    quick = ["--global-batch-sizes", "64", "--weights", "0"]
    assert reproduce_seed000_ga.main([*quick, "--out", str(tmp_path / "elsewhere.json")]) == 0
    assert default_png.read_bytes() == before
    assert FIGURE_MARK.encode() in (tmp_path / "elsewhere.png").read_bytes() and json.loads((tmp_path / "elsewhere.json").read_text())["results"]
    assert f"wrote {tmp_path / 'elsewhere.json'} and {tmp_path / 'elsewhere.png'}" in capsys.readouterr().out
    # without --out both defaults are written, the figure beside the JSON as before
    assert reproduce_seed000_ga.main(quick) == 0
    assert default_png.read_bytes() != before and (tmp_path / "results" / "seed000_ga.json").is_file()
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["seed000_ga.json", "seed000_ga.png"]


@pytest.mark.parametrize("name", ["replay_sweep", "replay_variants", "sweep_stats"])
def test_replay_scripts_leave_out_a_stopped_sweeps_partial_file(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Their documented commands glob benchmarks/results/cpu_cluster_sweep*.json, which also matches the
    cpu_cluster_sweep.partial.json a stopped full sweep leaves beside the committed runs: its settings (here one measured
    before the stop) were pooled with the committed runs' and counted again. They are now left out, and named."""
    script = __import__(name)
    committed = RESULTS / "cpu_cluster_sweep_run2.json"
    doc = json.loads(committed.read_text())
    partial = tmp_path / "cpu_cluster_sweep.partial.json"  # what cpu_cluster_sweep.py writes when stopped after one setting
    partial.write_text(json.dumps({"schema": doc["schema"], "stopped": "interrupted", "settings": doc["settings"][:1],
                                   "provenance": doc["provenance"]}))
    lead = ["no-1f1b-preference"] if name == "replay_variants" else []
    assert script.main([*lead, str(committed)]) == 0
    alone = capsys.readouterr().out
    assert script.main([*lead, str(committed), str(partial)]) == 0
    both = capsys.readouterr()
    assert both.out == alone  # the committed run's figures only
    assert both.err.strip() == f"{name}: left out {partial}, a stopped sweep's partial file (interrupted)."
    with pytest.raises(SystemExit) as info:  # nothing else given: one line
        script.main([*lead, str(partial)])
    assert str(info.value.code).startswith(f"{name}: every file given is a stopped sweep's partial file") and "HINT:" in str(info.value.code)
