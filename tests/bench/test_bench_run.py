"""``distplan bench`` end to end: real profiling, real Lightning runs of each plan, real measurements.

World size 1 runs in one process; world size 2 goes through torchrun (the command launches
``python -m torch.distributed.run``), gloo on loopback, and covers data-parallel and pipeline plans.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

MODEL = ["lightning_distplan.bench.models:WideMLP", "--init-args", '{"in_features": 16, "hidden": 32, "depth": 2}',
         "--datamodule", "lightning_distplan.bench.models:RandomVectorData", "--datamodule-args", '{"in_features": 16, "batch_size": 4}']
PLAN_KEYS = {
    "rank", "plan", "strategy", "dp", "pp", "micro_batch_size", "predicted_step_time_s", "predicted_breakdown",
    "predicted_peak_memory_bytes", "measured_step_time_s", "measured_step_times_s", "measured_peak_memory_bytes",
    "step_time_error", "abs_step_time_error", "memory_error", "error",
}
SUMMARY_KEYS = {"median_abs_error", "p90_abs_error", "pick", "measured_best", "pick_is_best", "pick_within", "regret"}


def _bench_argv(out: Path, *extra: str) -> list[str]:
    return ["bench", *MODEL, "--steps", "2", "--warmup", "1", "--threads", "1", "--profile-repeats", "1", "--out", str(out), "--quiet", *extra]


def _bench(tmp_path, *extra: str, cwd: Path) -> dict:
    """The console script run from ``cwd`` (another folder: `python -m` would import from that folder itself)."""
    out = tmp_path / "bench.json"
    cmd = [str(Path(sys.executable).parent / "distplan"), *_bench_argv(out, *extra)]
    temporary = tmp_path / "tmp"  # the run's temporary folder, looked at afterwards
    temporary.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temporary)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "step time |error|: median" in res.stdout and "host speed:" in res.stdout  # the readable table was printed
    return result


def _check(result: dict, world_size: int) -> None:
    from lightning_distplan.bench._bench import timed_steps

    assert result["schema"] == "distplan-bench/1" and result["world_size"] == world_size
    assert result["ranks_per_host"] == world_size  # one machine: torchrun --nproc-per-node world_size
    assert result["plans"], "no plan was run"
    for rec in result["plans"]:
        assert PLAN_KEYS <= rec.keys()
        assert rec["error"] is None, rec["error"]
        # each plan's timed steps per pass follow from --steps and --min-time and its first prediction
        count = timed_steps(result["steps"], result["min_time_s"], rec["first_profile"]["predicted_step_time_s"])
        assert rec["timed_steps_per_pass"] == count >= result["steps"]
        # the timed steps of every pass are pooled; the plan's time is their median
        assert len(rec["measured_step_times_s"]) == count * result["passes"] and all(t > 0 for t in rec["measured_step_times_s"])
        assert rec["measured_step_time_s"] == pytest.approx(statistics.median(rec["measured_step_times_s"]))
        assert rec["passes"] == result["passes"] and len(rec["measured_pass_step_times_s"]) == result["passes"]
        assert rec["step_time_error"] == pytest.approx(rec["predicted_step_time_s"] / rec["measured_step_time_s"] - 1)
        assert rec["predicted_step_time_s"] > 0 and rec["predicted_peak_memory_bytes"] > 0
        assert rec["plan_json"]["global_batch_size"] == result["global_batch_size"]
    s = result["summary"]
    assert SUMMARY_KEYS <= s.keys() and s["n_measured"] == len(result["plans"])
    assert s["regret"] >= 0 and (s["regret"] <= 0.05) == s["pick_within"]
    best = min(result["plans"], key=lambda r: r["measured_step_time_s"])
    assert s["measured_best"]["rank"] == best["rank"]
    assert result["memory_metric"] == "cpu_rss_high_water_growth"
    assert result["provenance"]["command"].startswith("distplan bench")
    # the code that ran: versions (transformers' when installed) and, from a git checkout, its commit
    from lightning_distplan._provenance import git_state, versions

    assert result["provenance"]["versions"] == versions() and result["provenance"].get("git") == git_state()
    # after every pass the profiled step is timed again and compared with its profiled time
    checks = result["host_checks"]
    assert [c["after_pass"] for c in checks] == list(range(1, result["passes"] + 1))
    for c in checks:
        assert c["retimed_s"] > 0 and c["ratio"] == pytest.approx(c["retimed_s"] / c["profiled_s"])
    _check_profiles(result)


def _check_profiles(result: dict) -> None:
    """Predictions come from the mean of the stored profiles; the first profile's stay beside them."""
    from lightning_distplan.bench import first_profile_view, summarize
    from lightning_distplan.costmodel import predict
    from lightning_distplan.plan import Plan
    from lightning_distplan.profile import Profile, pool_profiles

    rounds = [Profile.from_dict(p) for p in result["profiles"]]
    pooled = pool_profiles(rounds)
    assert json.loads(json.dumps(pooled.to_dict())) == result["profile"]
    for rec in result["plans"]:
        plan = Plan.from_dict(rec["plan_json"])
        assert rec["predicted_step_time_s"] == pytest.approx(predict(pooled, plan).step_time_s, rel=1e-12)
        first = rec["first_profile"]
        assert first["predicted_step_time_s"] == pytest.approx(predict(rounds[0], plan).step_time_s, rel=1e-12)
        assert first["step_time_error"] == pytest.approx(first["predicted_step_time_s"] / rec["measured_step_time_s"] - 1)
    assert [r["rank"] for r in result["plans"]] == sorted(r["rank"] for r in result["plans"])  # listed best first
    assert result["summary_first_profile"] == summarize(first_profile_view(result["plans"]))


def test_bench_world_size_1(tmp_path, monkeypatch, capfd, no_group_left):
    # The command run by its main in this process (one process: no torchrun); a subprocess imported torch and Lightning
    # again first, seconds of the test. The real command line: test_bench_world_size_2_torchrun_loopback.
    out = tmp_path / "bench.json"
    argv = _bench_argv(out, "--world-size", "1", "--global-batch-size", "4", "--plans", "top:2", "--confirm", "1", "--plot", str(tmp_path / "p.png"))
    returncode = _bench_command_here(monkeypatch, tmp_path, argv)
    printed = capfd.readouterr()
    assert returncode == 0, printed.err[-3000:]
    assert "step time |error|: median" in printed.out and "host speed:" in printed.out  # the readable table was printed
    result = json.loads(out.read_text())
    _check(result, 1)
    # one confirmation pass of the contenders (the pick, the measured best, plans within 10% of it); the pick judged on it alone
    from lightning_distplan.bench import confirm_candidates

    again = [result["plans"][i] for i in confirm_candidates(result["plans"])]
    assert result["confirm_passes"] == 1 and again[0]["rank"] == result["summary"]["measured_best"]["rank"]
    assert [r["rank"] for r in result["plans"] if "confirm_step_time_s" in r] == sorted(r["rank"] for r in again)
    for rec in again:
        assert len(rec["confirm_step_times_s"]) == 2 and rec["confirm_step_time_s"] == pytest.approx(statistics.median(rec["confirm_step_times_s"]))
    c = result["summary"]["confirmed"]
    fastest = min(again, key=lambda r: r["confirm_step_time_s"])
    assert c["n_plans"] == len(again) and c["measured_best"]["rank"] == fastest["rank"] and c["pick"]["rank"] == 1
    assert c["regret"] == pytest.approx(result["plans"][0]["confirm_step_time_s"] / fastest["confirm_step_time_s"] - 1)
    assert result["passes"] == 2  # the default
    assert len(result["profiles"]) == 3  # before the runs and again after each pass
    assert result["prediction_profile"].startswith("mean of 3 profiles")
    assert [r["rank"] for r in result["plans"]] == [1, 2]
    assert {r["strategy"] for r in result["plans"]} == {"dp_ga"}  # one process: no pipeline
    assert {(r["micro_batch_size"], r["accumulate_grad_batches"]) for r in result["plans"]} <= {(4, 1), (2, 2), (1, 4)}
    assert (tmp_path / "p.png").stat().st_size > 1000
    from lightning_distplan._files import FIGURE_MARK, check_replaceable_figure

    assert FIGURE_MARK.encode() in (tmp_path / "p.png").read_bytes()
    check_replaceable_figure(tmp_path / "p.png", "--plot")  # a later run may replace the plot it made
    assert result["links"] == []  # nothing to measure on one process


def test_bench_world_size_2_torchrun_loopback(tmp_path):
    # run from a folder whose torch.py and json.py would replace the real ones if the workers imported from it first
    # (PYTHONSAFEPATH keeps it off their path from Python 3.11; before, `python -m` always puts it first)
    (tmp_path / "here").mkdir()
    for name in ("torch.py", "json.py") if sys.version_info >= (3, 11) else ():
        (tmp_path / "here" / name).write_text("raise SystemExit('the current folder shadowed a module')\n")
    result = _bench(tmp_path, "--world-size", "2", "--global-batch-size", "2", "--plans", "all", "--passes", "1", "--profile-once", "--min-time", "0.05",
                    cwd=tmp_path / "here")
    _check(result, 2)
    # --min-time reached the torchrun workers: the tiny model's plans (a few ms a step) ran more than --steps 2
    assert result["min_time_s"] == 0.05 and max(r["timed_steps_per_pass"] for r in result["plans"]) > 2
    assert "--min-time 0.05" in result["provenance"]["command"]
    assert len(result["profiles"]) == 1 and result["prediction_profile"] == "one profile, before the runs"
    for rec in result["plans"]:  # one profile: its predictions and ranks are the first profile's
        assert rec["rank"] == rec["first_profile"]["rank"]
        assert rec["predicted_step_time_s"] == rec["first_profile"]["predicted_step_time_s"]
    strategies = {r["strategy"] for r in result["plans"]}
    assert "dp_ga" in strategies and strategies & {"gpipe", "1f1b"}, strategies  # both kinds ran, one after the other
    assert {link["kind"] for link in result["links"]} == {"allreduce", "p2p"}  # measured over the live group
    slot = result["profile"]["framework"]["pipeline_slot_s"]  # and the pipelining runtime's own cost per slot
    assert slot is not None and 0.0 <= slot < 0.05, slot
    for rec in result["plans"]:
        assert rec["dp"] * rec["pp"] == 2
    # every plan ran in the same two processes and the same (reused) default process group
    assert len({tuple(rec["rank_pids"]) for rec in result["plans"]}) == 1 and len(result["plans"][0]["rank_pids"]) == 2
    assert len({tuple(rec["process_groups"]) for rec in result["plans"]}) == 1 and None not in result["plans"][0]["process_groups"]
    # torchrun's log folder (torchelastic_*, one per run, kept by torchrun) went with the run (torch's own
    # compile cache, torchinductor_<user>, is meant to stay)
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--plans", "top:0"], "top:K"), (["--plans", "fastest"], "not 'all'"), (["--steps", "0"], "--steps"), (["--passes", "0"], "--passes"), (["--confirm", "-1"], "--confirm"),
     (["--min-time", "-1"], "--min-time"), (["--min-time", "nan"], "--min-time"), (["--min-time", "inf"], "finite number of seconds"),
     (["--rank-timeout", "0"], "--rank-timeout"), (["--rank-timeout", "inf"], "--rank-timeout"),
     (["--world-size", "0"], "--world-size"), (["--plot", "bench.json", "--out", "bench.json"], "name the same file"),
     (["--plot", "bench.txt"], "no image suffix"), (["--plot", "."], "is a directory. HINT: Name a file, e.g. --plot bench.png."),
     # refused before torchrun starts the ranks (they each refused it, into one line of the pipe)
     (["--world-size", "2", "--profile-repeats", "0"], "--profile-repeats must be >= 1, got 0."),
     (["--world-size", "2", "--init-args", '{"nosuch": 1}'], "failed: TypeError: got an unexpected keyword argument 'nosuch'."),
     (["--world-size", "2", "--init-args", "{}", "--datamodule-args", '{"nosuch": 1}'], "Building datamodule"),
     pytest.param(["--world-size", "2", "--device", "cuda"], "torch sees no CUDA GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU")),
     ],
)
def test_bench_bad_input_one_line_error(capsys, args, message):
    from lightning_distplan.cli import main

    base = {"--world-size": "1", "--global-batch-size": "4"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["bench", *MODEL, *(x for kv in base.items() for x in kv)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("classes", "message"),
    [(["lightning_distplan.bench.models:RandomVectorData"], "models:RandomVectorData is not a LightningModule. HINT"),
     ([MODEL[0], "--datamodule", MODEL[0]], "models:WideMLP is not a LightningDataModule. HINT")],
)
def test_a_class_of_the_wrong_kind_is_refused_before_torchrun_starts(capsys, monkeypatch, classes, message):
    """The ranks refused it once started (and --print-launch printed a command that could only fail)."""
    from lightning_distplan.cli import main

    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["bench", *classes, "--world-size", "2", "--global-batch-size", "4", "--print-launch"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_plot_does_not_replace_a_file_it_did_not_make(tmp_path, capsys):
    from lightning_distplan.cli import main

    mine = tmp_path / "figure.pdf"
    mine.write_bytes(b"%PDF-1.4 the user's own figure")
    assert main(["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--plot", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"--plot '{mine}' exists and is not a figure distplan saved; it is left as it is. HINT:" in err and len(err.strip().splitlines()) == 1
    assert mine.read_bytes() == b"%PDF-1.4 the user's own figure"


def test_two_ranks_error_lines_run_together_in_the_pipe_are_shown_once(capfd):
    from lightning_distplan._cli.bench import _run_torchrun

    line = "distplan bench: error: Bad. HINT: Fix it."
    code = _run_torchrun([sys.executable, "-c", f"import sys; sys.stderr.write({line!r} * 2 + '\\n'); sys.exit(1)"])
    assert code == 2 and capfd.readouterr().err == line + "\n"


def _bench_command_here(monkeypatch, cwd: Path, argv: list[str], **env: str) -> int:
    """``distplan bench`` run by its ``main`` in this process (what the console script exits with), from ``cwd``, with
    ``env`` added; only torchrun and its workers start (the command's own process would import torch and Lightning
    again first). test_bench_world_size_2_torchrun_loopback and the SIGTERM test run the real command line."""
    from lightning_distplan.cli import main

    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):  # this process is no torchrun worker
        monkeypatch.delenv(var, raising=False)
    for name, value in {"OMP_NUM_THREADS": "1", **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # the command would put the current folder on sys.path: it goes again after the test
    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:  # --threads sets torch's threads for a run in this process (--world-size 1): back for the later tests
        torch.set_num_threads(threads)


def test_an_error_found_inside_the_torchrun_job_is_one_line_with_exit_2(tmp_path, monkeypatch, capfd):
    """--plans 99 is known wrong only once the plans are ranked, inside every worker: one line, not torchrun's traceback."""
    argv = ["bench", *MODEL, "--world-size", "2", "--global-batch-size", "4", "--plans", "99", "--profile-repeats", "1", "--threads", "1", "--quiet"]
    returncode = _bench_command_here(monkeypatch, tmp_path, argv)
    stderr = capfd.readouterr().err
    errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert returncode == 2 and len(errors) == 1, stderr[-2000:]
    assert errors[0].startswith("distplan bench: error: --plans names rank(s) [99]") and "HINT" in errors[0]


ONE_RANK_FAILS = """
import torch
from lightning_distplan.bench.models import WideMLP

FITS = []  # the plan fits this process ran


class FailsOnRank1(WideMLP):
    def on_fit_start(self):
        FITS.append(self.trainer.global_rank)

    def on_train_batch_start(self, batch, batch_idx):  # called by data-parallel and pipeline plans alike
        if self.trainer.global_rank == 1 and len(FITS) == 2 and self.trainer.global_step == 1:  # rank 1's second plan only
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, rank 1 only)")
"""


def test_a_plan_failing_on_one_rank_stops_the_bench_within_the_rank_timeout(tmp_path, monkeypatch, capfd):
    """One rank out of memory alone leaves the other in the DDP all-reduce: the bench stops after --rank-timeout with one
    error line (it waited for gloo's 30-minute timeout), each rank's own error logged, and --out holds the plan measured
    before it and the failed one, marked as stopped. (--rank-timeout 5: the failed rank waits that long, idle; ranks
    that both finished a plan meet in the gather well within it.)"""
    (tmp_path / "fails_on_rank1.py").write_text(ONE_RANK_FAILS)
    out = tmp_path / "bench.json"
    argv = ["bench", "fails_on_rank1:FailsOnRank1", *MODEL[1:], "--world-size", "2",
            "--global-batch-size", "4", "--plans", "1,2", "--passes", "1", "--profile-once", "--steps", "2", "--warmup", "1",
            "--profile-repeats", "1", "--threads", "1", "--rank-timeout", "5", "--out", str(out)]
    returncode = _bench_command_here(monkeypatch, tmp_path, argv,
                                     PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    res = capfd.readouterr()
    errors = [line for line in res.err.splitlines() if line.startswith("distplan bench: error:") or "Traceback" in line]
    assert returncode == 2 and len(errors) == 1, res.err[-3000:]
    assert "did not finish on every rank within 5 s" in errors[0] and "HINT" in errors[0] and "--rank-timeout" in errors[0]
    assert "(e.g. --plans 1)" in errors[0]  # the other plans run, not the one that failed (it suggested 1,2,4)
    assert "failed on rank 1: OutOfMemoryError: CUDA out of memory (simulated, rank 1 only)" in res.err
    assert "STOPPED EARLY: Plan" in res.out  # rank 0 reported (rank 1 ended with status 0 so torchrun did not end it first)
    result = json.loads(out.read_text())
    assert result["stopped"] == errors[0].removeprefix("distplan bench: error: ")
    first, second = result["plans"]
    assert first["error"] is None and first["measured_step_time_s"] > 0
    assert second["measured_step_time_s"] is None and second["error"].startswith("did not finish on every rank within 5 s (one rank failed alone")
    assert result["summary"]["n_measured"] == 1 and not list(tmp_path.glob(".bench.json.*.tmp"))


def test_print_launch_names_torchrun(capsys, monkeypatch):
    from lightning_distplan.cli import main

    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["bench", *MODEL, "--world-size", "4", "--global-batch-size", "8", "--precision", "bf16-mixed", "--print-launch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PYTHONSAFEPATH=1 ")  # the command the bench runs, the workers' environment included
    assert "-m torch.distributed.run --standalone --nproc-per-node 4 -m lightning_distplan.cli bench" in out
    assert "--precision bf16-mixed" in out  # every worker runs in it
    # One process has no torchrun command: said, instead of running the bench in this process.
    assert main(["bench", *MODEL, "--world-size", "1", "--global-batch-size", "8", "--print-launch"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--world-size 1 runs in this process without one. HINT" in captured.err


def test_workers_import_the_package_this_process_imported_from_the_current_folder(tmp_path, monkeypatch):
    """`python -m lightning_distplan.cli bench` in a source checkout imports the package from the current folder,
    which PYTHONSAFEPATH leaves off the workers' path: that folder goes on their PYTHONPATH (else they failed with
    "No module named 'lightning_distplan'", or ran another copy installed); from any other folder nothing is added."""
    import lightning_distplan
    from lightning_distplan._cli.bench import worker_env

    checkout = Path(lightning_distplan.__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.chdir(checkout)
    assert worker_env() == {"PYTHONSAFEPATH": "1", "PYTHONPATH": f"{checkout}{os.pathsep}/elsewhere"}
    monkeypatch.delenv("PYTHONPATH")
    assert worker_env() == {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(checkout)}
    monkeypatch.chdir(tmp_path)  # a torch.py here must stay off the workers' path
    assert worker_env() == {"PYTHONSAFEPATH": "1"}


def test_timed_steps_lasts_min_time_within_bounds():
    from lightning_distplan.bench._bench import MAX_TIMED_STEPS, timed_steps

    assert timed_steps(4, 0.0, 0.01) == 4  # no --min-time: exactly --steps
    assert timed_steps(4, 1.0, 0.025) == 40  # a 25 ms plan: 40 steps make the second
    assert timed_steps(4, 1.0, 0.3) == 4  # a slow plan: --steps already last longer
    assert timed_steps(4, 1.0, 1e-6) == MAX_TIMED_STEPS  # a prediction far too fast cannot make a run take minutes
    assert timed_steps(500, 1.0, 1e-6) == 500  # --steps above the cap still holds
    assert timed_steps(4, 1.0, 0.0) == 4 and timed_steps(4, 1.0, float("nan")) == 4  # no usable prediction


def test_dataset_size_is_checked_against_the_global_batch_and_a_whole_pass():
    """6 samples for a global batch of 8 on 2 replicas was let through (6 >= 8/2) and every plan then ran 0 steps."""
    import warnings

    from lightning_distplan.bench._bench import BenchError, check_dataset_size

    with pytest.raises(BenchError, match=r"The dataset has 6 samples, fewer than one global batch \(8\).*HINT"):
        check_dataset_size(6, global_batch_size=8, warmup=1, timed=2)
    with pytest.warns(UserWarning, match=r"The dataset has 12 samples, fewer than the 1\+2 steps of a pass read \(24\): epochs end"):
        assert check_dataset_size(12, global_batch_size=8, warmup=1, timed=2) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_dataset_size(512, global_batch_size=8, warmup=1, timed=2) == 24


def test_a_dataset_smaller_than_one_global_batch_is_refused_before_the_profiling():
    """It was refused only once the model had been profiled (and the links measured) and the plans ranked."""
    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench._bench import BenchError
    from lightning_distplan.bench.models import RandomVectorData, WideMLP

    dm = RandomVectorData(in_features=16, batch_size=4, num_samples=6)
    built: list[WideMLP] = []

    def make_module() -> WideMLP:
        built.append(WideMLP(in_features=16, hidden=32, depth=2))
        return built[-1]

    with pytest.raises(BenchError, match=r"The dataset has 6 samples, fewer than one global batch \(8\)\..*HINT"):
        run_bench(make_module, dm.train_dataloader(), world_size=1, global_batch_size=8, steps=1, warmup=0, passes=1,
                  profile_repeats=1, micro_batch_sizes=[1, 2, 4], device="cpu")
    assert built == []  # nothing was built, let alone profiled


@pytest.fixture
def no_group_left():
    """run_bench in this process: each plan's Trainer starts a process group of one, which must not outlive the test."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bench_profiles_and_trains_in_the_given_precision(precision, no_group_left):
    """``--precision``: the profile and every plan's Trainer run in it (autocast, or converted weights)."""
    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP

    seen: list[tuple[bool, torch.dtype]] = []  # (autocast on, weight dtype) in every training_step

    class Recording(WideMLP):
        def training_step(self, batch, batch_idx):
            seen.append((torch.is_autocast_enabled("cpu"), next(self.parameters()).dtype))
            return super().training_step(batch, batch_idx)

    dm = RandomVectorData(in_features=16, batch_size=4)
    dm.setup("fit")
    result = run_bench(lambda: Recording(in_features=16, hidden=32, depth=2), dm.train_dataloader(), world_size=1,
                       global_batch_size=4, plans="top:1", steps=1, warmup=1, passes=1, profile_repeats=1,
                       micro_batch_sizes=[1, 2, 4], precision=precision, device="cpu")
    expected = (True, torch.float32) if precision == "bf16-mixed" else (False, torch.bfloat16)
    assert seen and set(seen) == {expected}, set(seen)  # profiling, host check and the plan's fit alike
    assert result["profile"]["device"]["dtype"] == ("bf16-mixed" if precision == "bf16-mixed" else "bfloat16")
    assert result["provenance"]["precision"] == precision and result["plans"][0]["error"] is None


def test_bench_pipelines_only_in_their_precisions(monkeypatch, no_group_left):
    """A precision pipelines do not train in ranks dp_ga plans only (a pipeline would fail at setup)."""
    import lightning_distplan.planner as planner
    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP

    asked: list[tuple[str, ...]] = []
    real = planner.rank_plans

    def spy(*args, **kwargs):
        asked.append(tuple(kwargs["strategies"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "rank_plans", spy)
    dm = RandomVectorData(in_features=16, batch_size=4)
    dm.setup("fit")
    for precision in ("16-true", "16-mixed"):  # on a CPU Lightning runs '16-mixed' as 'bf16-mixed', which pipelines do run
        run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), dm.train_dataloader(), world_size=1,
                  global_batch_size=4, plans="top:1", steps=1, warmup=1, passes=1, profile_repeats=1,
                  micro_batch_sizes=[2, 4], precision=precision, device="cpu")
    assert asked == [("dp_ga",), ("dp_ga", "gpipe", "1f1b")]
    with pytest.raises(ValueError, match="Unknown precision 'fp8'.*HINT"):
        run_bench(lambda: WideMLP(in_features=16), dm.train_dataloader(), world_size=1, global_batch_size=4, precision="fp8")


def test_a_pick_that_runs_out_of_memory_is_a_failed_pick_and_no_measurement_exits_1(monkeypatch, capsys, no_group_left):
    """Out of memory in the plans' own fits (not while profiling): the table says the pick FAILED and never that it
    was within 5% of the best; when no plan measured anything, `distplan bench` exits 1."""
    import time

    from lightning_distplan.bench.models import WideMLP
    from lightning_distplan.cli import main

    original = WideMLP.training_step
    failing = {"m": 4}
    # Every Linear call takes 10 ms more, so a step's time is mostly per micro-batch: m=4 (1 micro-batch) is predicted
    # about 4x faster than m=1 and ranked first in every profile and in the bench's regrading after its pass. This tiny
    # MLP's own steps differ by fractions of a millisecond, and under load a profile ranked m=1 first (the pick then ran).
    linear = torch.nn.Linear.forward

    def slow_linear(self, x):
        time.sleep(0.01)
        return linear(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", slow_linear)

    def training_step(self, batch, batch_idx):
        in_plan_fit = self._trainer is not None and type(self.trainer.strategy).__name__ == "DPGAStrategy"
        if in_plan_fit and batch[0].shape[0] in failing.values():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(WideMLP, "training_step", training_step)
    args = ["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--plans", "all", "--steps", "1", "--warmup", "1",
            "--passes", "1", "--profile-repeats", "1", "--micro-batch-sizes", "1,2,4", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "m=4" in out.split("pick: rank 1 ")[1].split("\n")[0] and "FAILED (predicted to run)" in out
    assert "within 5% of it: False; regret: none (the pick failed)" in out
    failing.update(others=1, more=2)
    assert main(args) == 1
    assert "distplan bench: no plan produced a measurement" in capsys.readouterr().err


def test_a_ctrl_c_while_a_plan_trains_stops_the_bench_with_status_130(monkeypatch, capsys, no_group_left):
    """Lightning turns a Ctrl-C inside fit into sys.exit(1) with SIGINT ignored; the bench says it was interrupted,
    exits 130 as during profiling, and Ctrl-C works again afterwards."""
    import signal

    from lightning_distplan.bench.models import WideMLP
    from lightning_distplan.cli import main

    original = WideMLP.training_step

    def training_step(self, batch, batch_idx):
        if self._trainer is not None and type(self.trainer.strategy).__name__ == "DPGAStrategy":
            raise KeyboardInterrupt
        return original(self, batch, batch_idx)

    monkeypatch.setattr(WideMLP, "training_step", training_step)
    args = ["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--plans", "top:1", "--steps", "1", "--warmup", "1",
            "--passes", "1", "--profile-repeats", "1", "--quiet"]
    try:
        assert main(args) == 130
        assert capsys.readouterr().err.strip().splitlines()[-1] == "distplan bench: interrupted; no result file was written"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_sigterm_to_a_two_process_bench_stops_its_workers_and_writes_nothing(tmp_path):
    """`kill <pid>` of `distplan bench --world-size 2`: torchrun and its workers stop with it, and no --out appears
    later (they ran on and wrote a complete-looking result after distplan itself had died)."""
    import signal
    import time

    out = tmp_path / "term.json"
    cmd = [sys.executable, "-m", "lightning_distplan.cli", "bench", *MODEL, "--world-size", "2", "--global-batch-size", "2",
           "--steps", "200", "--warmup", "1", "--threads", "1", "--profile-repeats", "1", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None and "launching 2 processes with torchrun" in proc.stdout.readline()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until both workers are up (they carry --out in their command line)
            workers = subprocess.run(["pgrep", "-f", f"lightning_distplan.cli bench .*{out}"], capture_output=True, text=True).stdout.split()
            if len([w for w in workers if int(w) != proc.pid]) >= 2:
                break
            time.sleep(0.5)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "distplan bench: terminated; no result file was written"
    # until no process of the run is left (only they could still write --out), for up to the 3 s it once slept
    deadline = time.monotonic() + 3
    while (left := subprocess.run(["pgrep", "-f", f"bench .*{out}"], capture_output=True, text=True).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [] and not out.exists()


def test_a_ctrl_c_after_the_result_was_written_says_so(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the last line prints (the result already saved) must not claim that no result file was written."""
    import io

    from lightning_distplan.cli import main

    class CtrlCOnLastLine(io.StringIO):
        def write(self, text: str) -> int:
            if "result written to" in text:
                raise KeyboardInterrupt
            return super().write(text)

    import torch.distributed as dist

    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "stdout", CtrlCOnLastLine())
    # The command sets OMP_NUM_THREADS and torch's threads for its run (its process ends); in the test's process they
    # would reach every later test (an equivalence check read 4e-6 apart at one thread): both go back at the end.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--plans", "1", "--steps", "2", "--warmup", "1",
                   "--passes", "1", "--threads", "1", "--device", "cpu", "--out", str(out)])
    finally:  # the one-process fit's group would be left to the next test (a command ends its process)
        torch.set_num_threads(threads)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    err = capsys.readouterr().err
    assert rc == 130 and err.strip().splitlines()[-1] == f"distplan bench: interrupted; the result was written to {out}"
    assert json.loads(out.read_text())["summary"]["n_measured"] == 1


_UNUSED_HEAD = """
import torch
from lightning_distplan.bench.models import WideMLP


class UnusedHead(WideMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.aux_head = torch.nn.Linear(kw.get("in_features", 16), 3)  # used by no loss (say, predict_step only)
"""


def test_bench_runs_a_model_whose_loss_leaves_parameters_unused(tmp_path, monkeypatch, capfd, no_group_left):
    """The profile lists the parameters the loss gives no gradient, and the dp_ga runs tell DDP to look for them
    (each plan failed at its second step with DDP's refusal before)."""
    (tmp_path / "unusedhead.py").write_text(_UNUSED_HEAD)
    out = tmp_path / "bench.json"
    argv = ["bench", "unusedhead:UnusedHead", *MODEL[1:], "--world-size", "1",
            "--global-batch-size", "4", "--plans", "top:2", "--steps", "2", "--warmup", "1", "--threads", "1", "--passes", "1",
            "--profile-once", "--profile-repeats", "1", "--out", str(out), "--quiet"]
    returncode = _bench_command_here(monkeypatch, tmp_path, argv)
    assert returncode == 0, capfd.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    assert result["profile"]["unused_parameters"] == ["aux_head.weight", "aux_head.bias"]
    assert [rec["error"] for rec in result["plans"]] == [None, None] and {rec["strategy"] for rec in result["plans"]} == {"dp_ga"}


def test_format_json_prints_json_alone_on_stdout(capsys, no_group_left):
    """`distplan bench --format json | jq`: the progress lines go to stderr (they came first on stdout, which then
    was no JSON)."""
    from lightning_distplan.cli import main

    args = ["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--plans", "1", "--steps", "1", "--warmup", "0",
            "--passes", "1", "--profile-once", "--profile-repeats", "1", "--micro-batch-sizes", "1,2,4", "--format", "json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["schema"] == "distplan-bench/1" and result["summary"]["n_measured"] == 1 and "profiles" not in result
    assert "profiling before the runs" in captured.err and "[1/1] rank 1" in captured.err


def test_every_plan_failing_under_torchrun_is_one_line_with_exit_1(capfd):
    """Every plan failed (each one's error is in the table): rank 0 exits 1 with one line, and torchrun's report of
    that exit (its ChildFailedError traceback) is not shown after it."""
    from lightning_distplan._cli.bench import _run_torchrun

    line = "distplan bench: no plan produced a measurement (each plan's error is in the report)."
    torchrun_report = "Traceback (most recent call last):\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    code = _run_torchrun([sys.executable, "-c", f"import sys; sys.stderr.write({line!r} + '\\n' + {torchrun_report!r}); sys.exit(1)"])
    assert code == 1 and capfd.readouterr().err == line + "\n"


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_processes_than_gpus_is_refused_before_torchrun_starts(capsys, monkeypatch, device):
    """Each process takes the GPU of its local rank: with one GPU, rank 1 failed alone at torch.cuda.set_device(1)
    ("invalid device ordinal") while rank 0 waited at the rendezvous. No GPU here: torch is told it has one."""
    from lightning_distplan.cli import main

    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    argv = ["bench", *MODEL, "--world-size", "2", "--global-batch-size", "4", "--print-launch"]
    assert main([*argv, "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert (f"--device {device} runs each of the 2 processes on this machine on a GPU of its own, but torch sees 1 CUDA GPU(s) here. "
            "HINT: Use --device cpu, or --world-size 1 or less") in captured.err
    assert main([*argv, "--device", "cpu"]) == 0 and "torch.distributed.run" in capsys.readouterr().out  # the CPU runs any count
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main([*argv, "--device", device]) == 0  # one GPU for each


def test_a_rank_of_a_torchrun_job_with_more_processes_than_gpus_refuses_before_set_device(capsys, monkeypatch):
    """Inside a torchrun job started by hand, every rank refuses the node (not rank 1 alone at set_device)."""
    from lightning_distplan.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i}) was called"))
    for var, value in (("TORCHELASTIC_RUN_ID", "x"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"), ("WORLD_SIZE", "2"), ("RANK", "0")):
        monkeypatch.setenv(var, value)
    assert main(["bench", *MODEL, "--world-size", "2", "--global-batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "but torch sees 1 CUDA GPU(s) here. HINT: Use --device cpu" in err and len(err.strip().splitlines()) == 1
    assert not torch.distributed.is_initialized()


def test_a_profile_that_cannot_be_pooled_is_kept_aside_and_named_in_the_prediction_label(monkeypatch, no_group_left):
    """A later profile that cannot be pooled with the first was dropped from the result (run_bench says it keeps each
    one taken), and the label still said the predictions rest on profiles "before the runs and after each pass"."""
    import lightning_distplan.profile as profile_module
    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP
    from lightning_distplan.profile import Profile

    asked: list[int] = []

    def unpoolable_reason(a, b):  # the profile after pass 2 measured something else (say, a size ran out of memory)
        asked.append(1)
        return "they timed different micro-batch sizes ([1, 2] vs [1, 2, 4])" if len(asked) == 2 else None

    monkeypatch.setattr(profile_module, "unpoolable_reason", unpoolable_reason)
    import lightning_distplan.profiling as profiling

    taken: list[Profile] = []
    real = profiling.profile_module

    def profile_once(*args, **kwargs):  # the later profiles as the first (their timings do not matter here): seconds less
        if not taken:
            taken.append(real(*args, **kwargs))
        return taken[0]

    monkeypatch.setattr(profiling, "profile_module", profile_once)
    dm = RandomVectorData(in_features=16, batch_size=4)
    dm.setup("fit")
    result = run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), dm.train_dataloader(), world_size=1, global_batch_size=4,
                       plans="top:1", steps=1, warmup=0, passes=2, profile_repeats=1, micro_batch_sizes=[1, 2, 4], device="cpu")
    assert len(result["profiles"]) == 2  # before the runs and after pass 1: the ones the predictions rest on
    [aside] = result["profiles_left_out"]
    assert aside["reason"] == "it is not averaged with the first profile: they timed different micro-batch sizes ([1, 2] vs [1, 2, 4])"
    assert Profile.from_dict(aside["profile"]).model == result["model"]
    assert result["prediction_profile"] == ("mean of 2 profiles (before the runs and after pass 1); the profile after pass 2 left out: "
                                            "measured otherwise than the first (profiles_left_out says how)")


def test_a_profile_left_out_for_its_tf32_switch_says_so(no_group_left):
    """pool_profiles refuses profiles whose TF32 switches differ, and a module that turns TF32 on in a hook the plans' fits
    call (on_fit_start) and the profiler does not has its first profile taken with it off and the later ones with it on.
    The bench then said the later profile 'timed other sizes or layers than the first' and recorded 'other micro-batch
    sizes, layers or links', neither of which was so."""
    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP

    class TurnsTf32On(WideMLP):
        def on_fit_start(self) -> None:
            torch.backends.cuda.matmul.allow_tf32 = True

    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        dm = RandomVectorData(in_features=16, batch_size=4)
        dm.setup("fit")
        result = run_bench(lambda: TurnsTf32On(in_features=16, hidden=32, depth=2), dm.train_dataloader(), world_size=1, global_batch_size=4,
                           plans="top:1", steps=1, warmup=0, passes=1, profile_repeats=1, micro_batch_sizes=[1, 2, 4], device="cpu")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    [aside] = result["profiles_left_out"]
    why = "they were measured with different TF32 settings (matmul True, conv True vs matmul False, conv True)"
    assert aside["reason"] == f"it is not averaged with the first profile: {why}"


def test_prediction_label_names_the_profiles_pooled():
    """After an early stop (no profile after the stopped pass and those after it) the label said 'after each pass'."""
    from lightning_distplan.bench._bench import prediction_label

    assert prediction_label([1, 2], passes=2) == "mean of 3 profiles (before the runs and after each pass)"
    assert prediction_label([1], passes=3) == "mean of 2 profiles (before the runs and after pass 1)"  # stopped in pass 2
    assert prediction_label([1, 2], passes=3) == "mean of 3 profiles (before the runs and after passes 1 and 2)"
    assert prediction_label([], passes=3) == "one profile, before the runs"
    assert prediction_label([], [1, 2, 3], passes=3) == (
        "one profile, before the runs; the profiles after passes 1, 2 and 3 left out: measured otherwise than the first (profiles_left_out says how)")


def test_plot_without_matplotlib_is_refused_before_the_runs(tmp_path, monkeypatch, capsys):
    """matplotlib is optional (the dashboard extra): --plot without it profiled and ran every plan, then failed at the
    plot with "No module named 'matplotlib'" and no install command."""
    from lightning_distplan.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an uninstalled package looks like to import
    out = tmp_path / "bench.json"
    argv = ["bench", *MODEL, "--world-size", "1", "--global-batch-size", "4", "--steps", "1", "--warmup", "0", "--passes", "1",
            "--profile-repeats", "1", "--out", str(out), "--plot", str(tmp_path / "bench.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "The optional package 'matplotlib'" in captured.err and 'HINT: Run `pip install "lightning_distplan[dashboard]"`' in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "profiling" not in captured.out  # before the profiling
    assert not out.exists()


@pytest.mark.parametrize("local", ["abc", "0", "-1", "3", " "])
def test_a_bad_local_world_size_is_one_sentence_before_the_process_group_or_profiling(capsys, monkeypatch, local):
    """LOCAL_WORLD_SIZE (the ranks on one machine, read from the launcher's environment) was read with int() after the
    profiling: 'abc' ended the bench in a bare "ValueError: invalid literal for int()", 0 and -1 in the cost model's
    `ranks_per_host` sentence, which names no variable the user set, each after minutes of profiling. Every rank now
    refuses it in one sentence naming the variable, before the process group starts."""
    from lightning_distplan.cli import main

    for var, value in (("TORCHELASTIC_RUN_ID", "x"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", local), ("WORLD_SIZE", "2"), ("RANK", "0")):
        monkeypatch.setenv(var, value)
    assert main(["bench", *MODEL, "--world-size", "2", "--global-batch-size", "4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"LOCAL_WORLD_SIZE ({local!r})" in err and "divides the world size (2)" in err and "HINT:" in err
    assert "ValueError" not in err and not torch.distributed.is_initialized()


def test_ranks_per_machine_reads_a_good_local_world_size(monkeypatch):
    from lightning_distplan.bench._bench import ranks_per_machine

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_machine(4) == 2 and ranks_per_machine(1) == 1  # not distributed: one
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_machine(4) == 1  # ranks started by hand without it: one a machine, as before


_GROUP_PEER = """
import torch.distributed as dist

dist.init_process_group("gloo")  # rank 1 of 2, from the environment; it leaves the group at once
dist.destroy_process_group()
"""


def test_a_global_batch_no_plan_factors_is_refused_before_the_profiling(monkeypatch, capfd):
    """--global-batch-size 3 on 2 processes in 64-true (data parallel only: pipelines do not train in float64) was
    refused by rank_plans after the profile and the link measurement (45 s for this MLP, minutes for a real model).
    Every rank now refuses it before the profiling, in one line: nothing was profiled.

    Rank 0 is the command run in this process as a torchrun worker; rank 1 a bare process that joins the gloo group and
    leaves (it imports torch only): a rank that profiled would next measure the links with it and fail there."""
    from _ports import free_port

    from lightning_distplan.cli import main

    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}
    peer = subprocess.Popen([sys.executable, "-c", _GROUP_PEER], env={**os.environ, **env, "RANK": "1"})
    # The command quiets Lightning's loggers while it runs; here in pytest's process, whose levels and warning filters
    # it must give back (it once left lightning.pytorch at WARNING for every later test)
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_distplan.strategies")]
    levels, filters = [lg.level for lg in loggers], list(warnings.filters)
    try:
        for var, value in {**env, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(var, value)
        returncode = main(["bench", *MODEL, "--world-size", "2", "--global-batch-size", "3", "--precision", "64-true",
                           "--profile-repeats", "1", "--device", "cpu"])
        assert peer.wait(timeout=120) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    res = capfd.readouterr()
    errors = [line for line in res.err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert returncode == 2 and len(errors) == 1, res.err[-2000:]
    assert errors[0].startswith("distplan bench: error: Global batch size 3 cannot be factored over 2 devices (data parallel only")
    assert "HINT: Use the nearest valid global batch size, 2 or 4" in errors[0]
    assert "profiling" not in res.out and "allreduce:" not in res.out, res.out  # no profile, no link measurement
    assert [lg.level for lg in loggers] == levels and warnings.filters == filters
    assert not torch.distributed.is_initialized()  # the command's group is gone with it


def test_with_min_time_the_plans_read_no_more_distinct_samples_than_warmup_plus_steps_batches(no_group_left):
    """run_bench materialised every sample a pass reads, (warm-up + timed steps) x the global batch: with --min-time a
    fast plan times up to 200 steps, so 202 x 64 images of 3x224x224 (576 MiB per 1000 measured) held ~7.3 GB on every
    rank before the first run, and took ~50 s to build. The plans now read (warm-up + --steps) global batches of it over
    and over: a pass is as long as before (the loader's length is the same), its distinct samples are bounded."""
    from torch.utils.data import DataLoader, Dataset

    from lightning_distplan.bench import run_bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP

    dm = RandomVectorData(in_features=16, batch_size=4, num_samples=2048)
    dm.setup("fit")

    class Counting(Dataset):  # the datamodule's dataset, its reads counted
        reads = 0

        def __len__(self):
            return len(dm.dataset)

        def __getitem__(self, i):
            Counting.reads += 1
            return dm.dataset[i]

    loader = DataLoader(Counting(), batch_size=4)
    result = run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), loader, world_size=1, global_batch_size=4,
                       plans="top:1", steps=1, warmup=1, passes=1, min_time_s=2.0, reprofile=False, profile_repeats=1,
                       micro_batch_sizes=[1, 2, 4], device="cpu")
    (plan,) = result["plans"]
    count = plan["timed_steps_per_pass"]  # about 2 s of steps (30 or so on a busy 2-core host), up to 200
    assert plan["error"] is None and count >= 10 and len(plan["measured_step_times_s"]) == count
    long_run, Counting.reads = Counting.reads, 0
    # the same bench timing exactly --steps: the profiler and the host check read the same (a re-timed size or two more
    # at most, a few samples); before, the long run read (count - 1) x 4 samples more for its cache
    run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), loader, world_size=1, global_batch_size=4,
              plans="top:1", steps=1, warmup=1, passes=1, min_time_s=0.0, reprofile=False, profile_repeats=1,
              micro_batch_sizes=[1, 2, 4], device="cpu")
    assert long_run - Counting.reads < 2 * (count - 1), (count, long_run, Counting.reads)
