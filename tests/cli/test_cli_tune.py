"""`distplan tune` end to end: JSON contract, stored study, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tuner"))
from tuner_profile_factory import make_profile  # noqa: E402

from lightning_distplan.cli import main  # noqa: E402


@pytest.fixture()
def profile_path(tmp_path):
    return str(make_profile().save(tmp_path / "profile.json"))


def test_tune_json_contract_and_study(tmp_path, profile_path, capsys):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    rc = main(["tune", "--profile", profile_path, "--catalog", "aws-2026", "--global-batch-size", "128", "--time-weight", "4096",
               "--trials", "30", "--storage", url, "--study-name", "cli", "--format", "json", "--max-instances", "4", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for entry in [out["best"], *out["pareto"]]:
        for key in ("instance_type", "count", "strategy", "schedule", "micro_batch_size", "accumulation", "dp", "pp",
                    "predicted_step_time_s", "predicted_cost_per_step", "currency"):
            assert key in entry, key
        assert entry["currency"] == "USD"
        assert entry["dp"] * entry["micro_batch_size"] * entry["accumulation"] == 128
    study = optuna.load_study(study_name="cli", storage=url)
    assert len(study.trials) == 30 and all("feasible" in t.user_attrs for t in study.trials)
    assert out["projections"]["p5.48xlarge"]["target"] == "H100-SXM"


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_study_name_is_refused_not_replaced_by_the_default(tmp_path, profile_path, capsys, name):
    """`--study-name ''` (an unset shell variable: --study-name "$NAME") searched and stored under the default name."""
    rc = main(["tune", "--profile", profile_path, "--catalog", "aws-2026", "--global-batch-size", "32", "--trials", "5",
               "--storage", f"sqlite:///{tmp_path / 'e.db'}", "--study-name", name, "--max-instances", "2", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"distplan tune: error: --study-name must not be empty, got {name!r}. HINT:"), err
    assert not (tmp_path / "e.db").exists()  # refused before the storage was opened


def test_tune_table_format(tmp_path, profile_path, capsys):
    rc = main(["tune", "--profile", profile_path, "--catalog", "alicloud-2023", "--global-batch-size", "32", "--trials", "10",
               "--storage", f"sqlite:///{tmp_path / 't.db'}", "--format", "table", "--max-instances", "2", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and "best:" in text and "Pareto front" in text and "RMB" in text
    # every column has a title, and the titles sit over their columns (the peak memory's right edge)
    lines = text.splitlines()
    header = lines[lines.index("best:") + 1]
    assert header.split()[-2:] == ["peak", "memory"] and lines[lines.index("best:") + 2].endswith(" GiB")
    assert len(header) == len(lines[lines.index("best:") + 2])


def test_the_table_says_when_the_trials_priced_every_configuration_instead_of_sampling(tmp_path, profile_path, capsys):
    rc = main(["tune", "--profile", profile_path, "--catalog", "alicloud-2023", "--global-batch-size", "32", "--trials", "100",
               "--storage", f"sqlite:///{tmp_path / 't.db'}", "--format", "table", "--max-instances", "1", "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[0].startswith("study 'distplan-alicloud-2023-B32-w0' in sqlite:///") and ": 72 trials, 72 configurations priced of 72" in lines[0]
    assert lines[1] == "no sampler ran: 100 trials asked >= the 72 configurations left to price, so each was priced once"
    assert lines[2:4] == ["", "best:"]


def test_tune_says_which_network_figures_are_burst_peaks(tmp_path, profile_path, capsys):
    """aws-2026 prices its "Up to N Gbps" instances at N; the result (JSON and table) says so, and how to replace it."""
    common = ["--profile", profile_path, "--catalog", "aws-2026", "--global-batch-size", "32", "--trials", "5", "--max-instances", "2", "--quiet"]
    assert main(["tune", *common, "--storage", f"sqlite:///{tmp_path / 'j.db'}", "--format", "json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes[0] == "A10G peaks are an estimate (no NVIDIA datasheet)."
    assert "g5.xlarge 10, g6.xlarge 10, g6e.xlarge 20, p3.2xlarge 10 Gbit/s is the provider's 'up to' burst peak" in notes[1]
    assert main(["tune", *common, "--storage", f"sqlite:///{tmp_path / 't.db'}", "--format", "table"]) == 0
    text = capsys.readouterr().out
    assert "\nnotes:\n- A10G peaks are an estimate" in text and "- The network bandwidth of g5.xlarge 10" in text and "--bandwidth-gbps N" in text
    assert main(["tune", *common, "--storage", f"sqlite:///{tmp_path / 'b.db'}", "--format", "json", "--bandwidth-gbps", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == ["A10G peaks are an estimate (no NVIDIA datasheet)."]


def test_tune_table_shows_step_times_to_four_significant_digits(tmp_path, capsys):
    """The table printed step times with 4 decimals: a sub-millisecond Pareto front (a small model on an 8-GPU
    instance) showed 0.0002s for both its points, so the faster one looked no faster than the cheaper one, where
    the JSON has 0.000225 and 0.000156 s."""
    from lightning_distplan._cli.tune import _table

    profile = make_profile()
    url = f"sqlite:///{tmp_path / 's.db'}"
    from lightning_distplan.tuner import tune

    data = tune(profile, catalog="aws-2026", global_batch_size=32, n_trials=8, storage=url, study_name="s", max_instances=2,
                progress=False).to_dict()
    fast, slow = (dict(data["best"], predicted_step_time_s=t, predicted_step_time_band_s=[t / 3, t * 3]) for t in (0.000156391, 0.000225203))
    text = _table(dict(data, best=fast, pareto=[slow, fast]))
    rows = [line for line in text.splitlines() if " x " in line]
    assert [row.split()[8] for row in rows] == ["0.0001564s", "0.0002252s", "0.0001564s"]
    header = text.splitlines()[text.splitlines().index("best:") + 1]
    assert all(len(row) == len(header) for row in rows)


def test_the_default_study_names_are_the_ones_help_describes(tmp_path, profile_path, capsys):
    """--help gave distplan-<catalog>-B<batch>-w<weight> alone; --multi-objective adds -mo and --pricing spot names
    the catalog <name>-spot, so a user looking for the study under the name --help gave found none."""
    import re

    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "distplan-<catalog>-B<batch>-w<weight>, with -mo after it for --multi-objective; <catalog> is <name>-spot with --pricing spot" in text
    csv = tmp_path / "cat.csv"
    csv.write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,NetworkGbps\na,A10,1,1.0,0.4,10\n")
    names = []
    for flags in (["--multi-objective"], ["--pricing", "spot", "--catalog", str(csv)]):
        rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "4", "--max-instances", "2", "--quiet",
                   "--storage", f"sqlite:///{tmp_path / 'n.db'}", "--time-weight", "256", *flags])
        assert rc == 0
        names.append(json.loads(capsys.readouterr().out)["study_name"])
    assert names == ["distplan-alicloud-2023-B32-w256-mo", "distplan-cat-spot-B32-w256"]
    assert all(re.fullmatch(r"distplan-[\w.-]+-B32-w256(-mo)?", n) for n in names)


def test_flag_names_match_plan_and_profile_and_old_names_still_work(tmp_path, profile_path, capsys):
    """--bandwidth-gbps (as in plan) and --quiet (as in profile, bench); --bandwidth and --no-progress remain."""
    outs = []
    for flags in (["--bandwidth-gbps", "3", "--quiet"], ["--bandwidth", "3", "--no-progress"]):
        rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "6", "--max-instances", "2",
                   "--storage", f"sqlite:///{tmp_path / 'f.db'}", "--study-name", f"flags{len(outs)}", *flags])
        captured = capsys.readouterr()
        assert rc == 0 and "Trial" not in captured.err and "%" not in captured.err  # no progress bar
        outs.append(json.loads(captured.out))
    assert outs[0]["best"] == outs[1]["best"]
    for name in ("flags0", "flags1"):
        trials = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'f.db'}").trials
        links = {t.user_attrs["hardware"]["allreduce_bandwidth_bytes_per_s"] for t in trials if "hardware" in t.user_attrs}
        assert links == {3e9 / 8}  # every evaluated trial priced with the given network


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--catalog", "nope"], "Unknown catalog 'nope'.*alicloud-2023, aws-2026"),
        (["--storage", "not-a-url"], "not a database URL.*HINT"),
        (["--storage", "sqlite:///{tmp}"], "names the folder .*, not an SQLite file.*HINT: Name the database file in it, e.g. sqlite:///.*distplan.db"),
        # the planner's device limit in this command's terms (it named --world-size, a flag tune does not have)
        (["--catalog", "aws-2026", "--max-instances", "16384"],
         r"--max-instances 16384 of \S+ \(8 devices each\) makes 131072 devices, above the 65536 .*HINT: Lower --max-instances \(at most 8192"),
        # the same for a catalog row past the limit alone (the HINT said "at most 0" instances) and for the global batch
        (["--catalog", "{tmp}/wide.csv"],
         r"Instance 'wide' of catalog 'wide' has 100000 GPUs, above the 65536 devices .*HINT: Fix that row's AcceleratorCount"),
        (["--global-batch-size", "1000000000"], r"`global_batch_size` 1000000000 is above the 16777216 samples .*HINT: Check the number: --global-batch-size"),
        # Optuna's seed range (it failed through the generic fallback, after the SQLite file was made); --max-pp below 1
        (["--seed", "99999999999999"], r"--seed must be at most 2\*\*32 - 1, got 99999999999999\. HINT: Use e\.g\. --seed 0"),
        (["--max-pp", "-1", "--strategy", "gpipe"], r"--max-pp must be an integer >= 1, got -1\. HINT"),
        # a password in the URL is never printed
        (["--storage", "postgresql://user:s3cret@127.0.0.1:1/db"], r"Cannot open the study storage 'postgresql://user:\*\*\*@127\.0\.0\.1:1/db'.*HINT"),
        # nor any part of one with an unescaped @ (SQLAlchemy took "s3cret@127.0.0.1" for the host), nor of a URL
        # SQLAlchemy cannot read (a port that is no number: it was shown as typed)
        (["--storage", "postgresql://user:pw@s3cret@127.0.0.1:1/db"], r"Cannot open the study storage 'postgresql://user:\*\*\*@127\.0\.0\.1:1/db'.*HINT"),
        (["--storage", "postgresql://user:s3cret@127.0.0.1:port/db"], r"Cannot open the study storage 'postgresql://user:\*\*\*@127\.0\.0\.1:port/db'.*HINT"),
        # the built-in catalogs have on-demand prices only
        (["--catalog", "aws-2026", "--pricing", "spot"],
         r"Catalog 'aws-2026' has no spot prices \(the built-in catalogs list on-demand prices only\).*HINT: Pass a SkyPilot-style CSV with a SpotPrice"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, profile_path, capsys, extra, match):
    (tmp_path / "wide.csv").write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\nwide,A100,100000,1,10\n")
    args = ["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "5", "--no-progress",
            "--storage", f"sqlite:///{tmp_path / 'e.db'}", *[e.format(tmp=tmp_path) for e in extra]]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    import re

    assert re.search(match, err), err
    assert "s3cret" not in err
    if "--seed" in extra or "--max-pp" in extra:
        assert not (tmp_path / "e.db").exists()  # refused before the storage was opened


def test_plots_flag_attaches_plots_for_the_dashboard(tmp_path, profile_path, capsys):
    url = f"sqlite:///{tmp_path / 'plots.db'}"
    rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "12", "--max-instances", "2",
               "--storage", url, "--study-name", "pl", "--quiet", "--plots"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["plots"]["note"] and len(out["plots"]["graph_ids"]) == 2
    pngs = sorted(p.name for p in (tmp_path / "plots-artifacts").rglob("*") if p.is_file())
    assert len(pngs) == len(out["plots"]["artifact_ids"]) == 2  # the PNGs the dashboard serves without a flag
    assert sorted(out["plots"]["png"]) == ["pl-pareto_front.png", "pl-time_breakdown.png"]
    for stored in out["plots"]["png"].values():  # the files the JSON names exist and are the PNGs
        assert Path(stored).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(optuna.load_study(study_name="pl", storage=url).user_attrs) > 0


def test_the_table_says_where_the_plots_went_and_the_dashboard_command_that_shows_them(tmp_path, profile_path, capsys):
    """`--format table --plots` attached the note, graphs and PNGs and printed not a word of them (the JSON has them)."""
    from lightning_distplan.tuner._dashboard import open_storage

    url = f"sqlite:///{tmp_path / 'plots.db'}"
    rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "12", "--max-instances", "2",
               "--storage", url, "--study-name", "pl", "--quiet", "--plots", "--format", "table"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    plots = lines[lines.index("plots:") + 1:]
    assert plots[0] == "- a summary note and 2 graphs attached to study 'pl'", plots
    assert plots[1] == f"- PNGs: {tmp_path / 'plots-artifacts'}/ (pl-pareto_front.png, pl-time_breakdown.png)", plots
    assert plots[2] == f"- view them: distplan dashboard {url}", plots
    assert open_storage(plots[2].split()[-1]).get_all_studies()[0].study_name == "pl"  # the command's URL serves the study


def test_plots_that_cannot_be_stored_are_refused_before_the_search(tmp_path, profile_path, capsys):
    """A file where the plots' folder goes: one line before any trial (it failed after the search with FileExistsError)."""
    (tmp_path / "blocked-artifacts").write_text("mine")
    url = f"sqlite:///{tmp_path / 'blocked.db'}"
    rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "12", "--max-instances", "2",
               "--storage", url, "--study-name", "pl", "--quiet", "--plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "a file of that name is there" in err[0] and "HINT:" in err[0], err
    assert not (tmp_path / "blocked.db").exists() and (tmp_path / "blocked-artifacts").read_text() == "mine"


def test_plots_failing_after_the_search_say_the_trials_were_written(tmp_path, profile_path, capsys, monkeypatch):
    from lightning_distplan.tuner import plots

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "attach_to_study", broken)
    url = f"sqlite:///{tmp_path / 'plots.db'}"
    rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "12", "--max-instances", "2",
               "--storage", url, "--study-name", "pl", "--quiet", "--plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "The 12 trials were written to study 'pl', but attaching its plots failed (OSError: [Errno 28] No space left on device)" in err[0]
    assert "HINT:" in err[0] and len(optuna.load_study(study_name="pl", storage=url).trials) == 12


def test_ctrl_c_while_plots_attach_says_the_trials_were_written(tmp_path, profile_path, capsys, monkeypatch):
    import optuna

    from lightning_distplan.tuner import plots

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "attach_to_study", interrupted)
    url = f"sqlite:///{tmp_path / 'plots.db'}"
    rc = main(["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "12", "--max-instances", "2",
               "--storage", url, "--study-name", "pl", "--quiet", "--plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and len(err) == 1 and "the 12 trials were written to study 'pl'; its plots were not all attached" in err[0], err
    assert len(optuna.load_study(study_name="pl", storage=url).trials) == 12


def test_ctrl_c_is_one_line_and_keeps_the_finished_trials(tmp_path, profile_path, capfd, monkeypatch):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    args = ["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "8", "--max-instances", "2",
            "--storage", url, "--study-name", "i", "--quiet"]
    assert main(args) == 0
    capfd.readouterr()
    sample = optuna.samplers.TPESampler.sample_relative
    calls = []

    def ctrl_c_on_the_third(self, *a, **k):  # as if the user pressed Ctrl-C in the sampler (where a real one lands)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return sample(self, *a, **k)

    monkeypatch.setattr(optuna.samplers.TPESampler, "sample_relative", ctrl_c_on_the_third)
    assert main(args) == 130
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["distplan tune: interrupted; the 2 trial(s) finished before it were written to study 'i'; re-run the same command to search on"]
    trials = optuna.load_study(study_name="i", storage=url).trials
    assert len(trials) == 10 and all(t.state.is_finished() and t.state != optuna.trial.TrialState.FAIL for t in trials)
    # a new study interrupted after two trials exists with them (3000 finished trials were thrown away before)
    calls.clear()
    assert main([*args[:-3], "--study-name", "fresh", "--quiet"]) == 130
    kept = len(optuna.load_study(study_name="fresh", storage=url).trials)  # the initial design's, and two sampled
    assert kept >= 2 and f"the {kept} trial(s) finished before it were written to study 'fresh'" in capfd.readouterr().err
    calls.append(1)  # no more Ctrl-C
    assert main([*args[:-3], "--study-name", "fresh", "--quiet"]) == 0  # and the same command searches on
    assert len(optuna.load_study(study_name="fresh", storage=url).trials) == kept + 8


def test_a_ctrl_c_while_the_trials_are_written_waits_for_the_write(tmp_path, profile_path, capfd, monkeypatch):
    """A Ctrl-C in the write of a new study deleted the study again: every trial of the run was lost. It is held
    until the trials are written now; a second one stops the write at once, as one did before."""
    import os
    import signal

    from lightning_distplan.tuner import search

    write = search.write_trials
    presses = []

    def interrupted_write(study, trials):  # real SIGINTs to this process while the trials are written
        for _ in presses:
            os.kill(os.getpid(), signal.SIGINT)
        return write(study, trials)

    monkeypatch.setattr(search, "write_trials", interrupted_write)
    url = f"sqlite:///{tmp_path / 'w.db'}"
    args = ["tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "8", "--max-instances", "2", "--storage", url, "--quiet"]
    presses.append(1)
    assert main([*args, "--study-name", "once"]) == 130
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["distplan tune: writing this run's trials first; interrupt again to stop now without them",
                   "distplan tune: interrupted; the 8 trial(s) finished before it were written to study 'once'; re-run the same command to search on"]
    assert len(optuna.load_study(study_name="once", storage=url).trials) == 8
    presses.append(1)
    assert main([*args, "--study-name", "twice"]) == 130
    assert "twice" not in optuna.get_all_study_names(url) and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert capfd.readouterr().err.strip().splitlines()[-1] == "distplan tune: interrupted; the study was left as it was"


def test_sigterm_keeps_the_finished_trials_as_ctrl_c_does(tmp_path, profile_path):
    """`kill <pid>` (a batch scheduler's time limit) ended the search with Python's default action: every trial lost.
    In a process of its own: without the handler the SIGTERM ends that process, not the test session. Started through
    the console script's entry point, as `distplan tune` runs: `tune` imports neither torch nor Lightning there (the
    same `main` runs the search)."""
    url = f"sqlite:///{tmp_path / 't.db'}"
    script = (
        "import os, signal, sys\n"
        "import optuna\n"
        "import _distplan_cli\n"
        "sample, calls = optuna.samplers.TPESampler.sample_relative, []\n"
        "def sigterm_on_the_third(self, *a, **k):  # a real SIGTERM to this process, in the search\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return sample(self, *a, **k)\n"
        "optuna.samplers.TPESampler.sample_relative = sigterm_on_the_third\n"
        "sys.argv[0] = 'distplan'\n"
        "rc = _distplan_cli.main()\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, "tune", "--profile", profile_path, "--global-batch-size", "32", "--trials", "40",
                           "--max-instances", "2", "--storage", url, "--study-name", "t", "--quiet"], capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
    kept = len(optuna.load_study(study_name="t", storage=url).trials)
    assert err == [f"distplan tune: terminated; the {kept} trial(s) finished before it were written to study 't'; "
                   "re-run the same command to search on"], err
    assert 2 <= kept < 40


def test_real_command_line(tmp_path, profile_path):
    # the installed console script, as a user runs it
    exe = Path(sys.executable).with_name("distplan")
    proc = subprocess.run([str(exe), "tune", "--profile", profile_path, "--catalog", "alicloud-2023", "--global-batch-size", "64",
                           "--trials", "20", "--storage", f"sqlite:///{tmp_path / 'r.db'}", "--study-name", "r", "--max-instances", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["n_trials"] == 20 and out["best"]["currency"] == "RMB"


def test_pipeline_only_on_unsplittable_profile_names_the_split(tmp_path, capsys):
    flat = str(make_profile(splittable=False).save(tmp_path / "flat.json"))
    rc = main(["tune", "--profile", flat, "--strategy", "gpipe", "--global-batch-size", "32", "--trials", "5", "--no-progress",
               "--storage", f"sqlite:///{tmp_path / 'f.db'}"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "cannot be split into pipeline stages (hand-built)" in err and "HINT: Allow dp_ga" in err
    assert "factors the global batch size" not in err
