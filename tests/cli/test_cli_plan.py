"""`distplan plan` end to end on a Profile JSON written by hand (DESIGN §5)."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest

from lightning_distplan.cli import main
from lightning_distplan.plan import Plan
from lightning_distplan.profile import Profile


def _fit(alpha, beta):
    return {"alpha": alpha, "beta": beta, "r2": 1.0}


def _layer(i, param_bytes=4_000_000):
    return {
        "name": f"model.layers.{i}",
        "forward": _fit(0.01, 0.001),
        "backward": _fit(0.02, 0.002),
        "param_count": param_bytes // 4,
        "param_bytes": param_bytes,
        "activation_bytes_per_sample": 2e6,
        "output_bytes_per_sample": 1e5,
    }


def profile_json(**over):
    """A schema-version-1 profile as the profiler would save it, written out field by field."""
    data = {
        "schema_version": 1,
        "model": "tests.HandWritten",
        "device": {"type": "cuda", "name": "Tesla T4", "total_memory_bytes": 16 << 30, "memory_source": "nvml"},
        "micro_batch_sizes": [1, 2, 4, 8],
        "step": {"forward": _fit(0.04, 0.004), "backward": _fit(0.08, 0.008)},
        "layers": [_layer(i) for i in range(4)],
        "optimizer": {"name": "AdamW", "state_bytes": 32_000_000, "step_time_s": 0.01},
        "memory": {
            "param_bytes": 16_000_000,
            "grad_bytes": 16_000_000,
            "optimizer_state_bytes": 32_000_000,
            "activation": _fit(8e6, 0.0),
            "fixed_overhead_bytes": 50_000_000,
            "measured_peak_bytes": {"1": 120_000_000},
            "device_total_bytes": 16 << 30,
            "device_total_source": "nvml",
        },
        "links": [{"kind": "allreduce", "backend": "nccl", "world_size": 2, "latency_s": 2e-5, "bandwidth_bytes_per_s": 2e10}],
        "infeasible_micro_batch_sizes": [],
        "splittable": True,
        "split_reason": "hand-written",
    }
    data.update(over)
    return data


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json()))
    return path


def test_json_output_is_the_ranked_list(profile_path, capsys):
    assert main(["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list) and len(out) > 4
    assert {"dp_ga", "gpipe", "1f1b"} == {c["strategy"] for c in out}
    for i, c in enumerate(out, 1):
        assert c["rank"] == i
        for key in ("strategy", "schedule", "dp", "pp", "micro_batch_size", "accumulate_grad_batches", "n_microbatches",
                    "predicted_step_time_s", "predicted_peak_memory_bytes", "feasible", "breakdown", "objective"):
            assert key in c
        steps = c["accumulate_grad_batches"] if c["strategy"] == "dp_ga" else c["n_microbatches"]
        assert c["dp"] * c["micro_batch_size"] * steps == 32 and c["dp"] * c["pp"] == 4
    # the same ranking the library gives
    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.planner import rank_plans

    profile = Profile.load(profile_path)
    lib = rank_plans(profile, world_size=4, global_batch_size=32, hardware=Hardware.from_profile(profile))
    assert [c["predicted_step_time_s"] for c in out] == [c.prediction.step_time_s for c in lib]


def test_pins_keep_only_the_plans_that_have_them(profile_path, capsys):
    """--pin fixes part of the plan as AutoPlanStrategy(pins=...) does: the ranking holds only matching plans."""
    base = ["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--format", "json"]
    assert main(base) == 0
    every = json.loads(capsys.readouterr().out)
    assert {c["micro_batch_size"] for c in every} != {8} and {c["strategy"] for c in every} != {"1f1b"}
    assert main([*base, "--pin", "micro_batch_size=8"]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned and {c["micro_batch_size"] for c in pinned} == {8}
    def unranked(candidates):
        return [{k: v for k, v in c.items() if k != "rank"} for c in candidates]

    assert unranked(c for c in every if c["micro_batch_size"] == 8) == unranked(pinned)  # the same candidates, in the same order
    assert main([*base, "--pin", "strategy=1f1b", "--pin", "stages=2"]) == 0
    pipelines = json.loads(capsys.readouterr().out)
    assert pipelines and {(c["strategy"], c["pp"]) for c in pipelines} == {("1f1b", 2)}


def test_table_output_and_options(profile_path, capsys):
    args = ["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--top", "3",
            "--bandwidth-gbps", "10", "--latency-us", "30", "--device-memory-gb", "24", "--price-per-hour", "0.8", "--time-weight", "4096"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("rank") and "objective" in lines[0] and "cost/step" in lines[0]
    assert lines[2].startswith("1 ") and lines[5].startswith("... ")
    assert "Why the winner wins" in lines[-1] or "only plan" in lines[-1]
    assert main(args[:-8] + ["--format", "json", "--strategy", "dp_ga"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 3 and {c["strategy"] for c in out} == {"dp_ga"}


def test_a_price_of_zero_ranks_by_step_time(profile_path, capsys):
    """--price-per-hour 0 (free, on-prem devices) ranks as with no price, by step time, at cost 0: every objective C + w·T
    was 0, and the ranking went by peak memory and micro-batch alone."""
    base = ["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--format", "json"]
    assert main(base) == 0
    by_time = json.loads(capsys.readouterr().out)
    assert main([*base, "--price-per-hour", "0"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert [c["plan"] for c in free] == [c["plan"] for c in by_time]
    assert all(c["predicted_cost_per_step"] == 0 and c["objective"] == c["predicted_step_time_s"] for c in free)
    assert main(base[:-2] + ["--price-per-hour", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "cost/step" in lines[0] and "Why the winner wins" in lines[-1] and " ties " not in lines[-1]


@pytest.mark.parametrize(
    "mutate,args,message",
    [
        (None, ["--world-size", "0", "--global-batch-size", "32"], "`world_size` must be a positive integer, got 0"),
        (None, ["--world-size", "4", "--global-batch-size", "10", "--strategy", "dp_ga"], "nearest valid global batch size, 8 or 12"),
        ({"schema_version": 99}, ["--world-size", "2", "--global-batch-size", "8"], "profile schema version 99"),
        ({"layers": []}, ["--world-size", "2", "--global-batch-size", "8"], "has no layers"),
        ("corrupt", ["--world-size", "2", "--global-batch-size", "8"], "is not valid JSON"),
        ("missing", ["--world-size", "2", "--global-batch-size", "8"], "does not exist"),
        ("dir", ["--world-size", "2", "--global-batch-size", "8"], "is a directory, not a file"),
        ("devnull", ["--world-size", "2", "--global-batch-size", "8"], "'/dev/null' is not a regular file"),
        ("empty", ["--world-size", "2", "--global-batch-size", "8"], "The profile path is empty"),
        ("plan", ["--world-size", "2", "--global-batch-size", "8"], "is a plan (auto_plan's plan.json), not a profile"),
        # DESIGN §5: a model that cannot be split / more stages than layers, named as such
        ({"splittable": False, "split_reason": "no PipelineSpec"}, ["--world-size", "4", "--global-batch-size", "32", "--strategy", "gpipe"],
         "No gpipe plan exists on 4 devices: the model cannot be split into pipeline stages (no PipelineSpec)"),
        ({"layers": [_layer(0)]}, ["--world-size", "4", "--global-batch-size", "32", "--strategy", "1f1b"],
         "needs 2 or more stages, but the profile has only 1 layer"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--max-pp", "0"], "`max_pp` must be a positive integer"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--pin", "micro_batch_size"], "--pin 'micro_batch_size' is not KEY=VALUE"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--pin", "micro_batch_size=big"], "--pin micro_batch_size='big' is not a whole number"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--pin", "colour=red"], "Unknown pins ['colour']"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--pin", "dp=3"], "dp=3"),
        # numbers are checked before the link-default warning, so the error stays the only line
        (None, ["--world-size", "4", "--global-batch-size", "32", "--memory-margin", "0"], "--memory-margin must be in (0, 1]"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--time-weight", "4096"], "without --price-per-hour"),
        # semantically corrupt profiles are refused on load, not planned with
        ({"micro_batch_sizes": [0, 2]}, ["--world-size", "2", "--global-batch-size", "8"], "each must be a positive integer"),
        ({"layers": [_layer(0, param_bytes=-4)]}, ["--world-size", "2", "--global-batch-size", "8"], "has a negative layers[0].param_bytes (-4)"),
        # with trainable_param_bytes present (every profile since the field), the negative one is still the one named
        ({"layers": [{**_layer(0, param_bytes=-4), "trainable_param_bytes": 4_000_000}]}, ["--world-size", "2", "--global-batch-size", "8"],
         "has a negative layers[0].param_bytes (-4)"),
        # every number is finite (JSON NaN parses), and times, sizes and FLOPs are never negative
        ({"optimizer": {"name": "AdamW", "state_bytes": 0, "step_time_s": float("nan")}}, ["--world-size", "2", "--global-batch-size", "8"],
         "holds a non-finite number at optimizer.step_time_s"),
        ({"optimizer": {"name": "AdamW", "state_bytes": 0, "step_time_s": -5.0}}, ["--world-size", "2", "--global-batch-size", "8"],
         "has a negative optimizer.step_time_s (-5.0)"),
        ({"layers": [{**_layer(0), "flops_forward_per_sample": float("nan")}]}, ["--world-size", "2", "--global-batch-size", "8"],
         "non-finite number at layers[0].flops_forward_per_sample"),
        ({"layers": [{**_layer(0), "activation_bytes_fixed": float("inf")}]}, ["--world-size", "2", "--global-batch-size", "8"],
         "non-finite number at layers[0].activation_bytes_fixed"),
        ({"micro_batch_sizes": [1, 1.7]}, ["--world-size", "2", "--global-batch-size", "8"], "1.7 is not a whole number"),
        ({"infeasible_micro_batch_sizes": [-3]}, ["--world-size", "2", "--global-batch-size", "8"], "out-of-memory sizes [-3]"),
        ({"device": {"type": "cuda", "name": "T4", "total_memory_bytes": 16 << 30, "memory_source": "nvml", "dtype": "int8"}},
         ["--world-size", "2", "--global-batch-size", "8"], "has dtype 'int8'; expected one of"),
        ({"links": [{"kind": "allreduce", "backend": "gloo", "world_size": 2, "latency_s": 1e-5, "bandwidth_bytes_per_s": 0}]},
         ["--world-size", "2", "--global-batch-size", "8"], "bandwidth must be positive"),
        ({"links": [{"kind": "bogus", "backend": "gloo", "world_size": 2, "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}]},
         ["--world-size", "2", "--global-batch-size", "8"], "link of kind 'bogus'"),
        # each of these was planned with (a review): a string for a list or a number, a negative device size, a layer fit
        # negative by more than the step at its profiled sizes
        ({"micro_batch_sizes": "248"}, ["--world-size", "2", "--global-batch-size", "8"], "'248' is not a list"),
        ({"optimizer": {"name": "AdamW", "state_bytes": 0, "step_time_s": "0.1"}}, ["--world-size", "2", "--global-batch-size", "8"],
         "'0.1' is not a number"),
        ({"memory": {**profile_json()["memory"], "device_total_bytes": -5}}, ["--world-size", "2", "--global-batch-size", "8"],
         "has a negative memory.device_total_bytes (-5)"),
        ({"layers": [{**_layer(0), "forward": _fit(-1.0, -1.0)}]}, ["--world-size", "2", "--global-batch-size", "8"],
         "predicts -2 s for layers[0] at its profiled micro-batch 1"),
        # shared parameters count under their first user, so they cannot hold more than it does
        ({"shared_parameters": [{"layers": [1, 3], "param_bytes": 4_000_001}]}, ["--world-size", "2", "--global-batch-size", "8"],
         "4000001 bytes of shared parameters first used by layers[1], which holds 4000000 bytes"),
        # the sign check comes first: a negative param_bytes is named as such, not as fewer bytes than the gradients'
        ({"memory": {**profile_json()["memory"], "param_bytes": -5}}, ["--world-size", "2", "--global-batch-size", "8"],
         "has a negative memory.param_bytes (-5); sizes, FLOPs and times are never negative"),
        # the activation line and the device's size are bytes beyond belief as the others: a 1e300 slope overflowed in
        # the pipeline split (a ModelSplitError about its arguments, after a warning line), a -1e300 intercept or a
        # 1e300-byte device planned silently with every plan feasible
        ({"memory": {**profile_json()["memory"], "activation": _fit(1e300, 0.0)}}, ["--world-size", "4", "--global-batch-size", "32"],
         "has memory.activation.alpha = 1e+300, beyond any device"),
        ({"memory": {**profile_json()["memory"], "activation": _fit(8e6, -1e300)}}, ["--world-size", "4", "--global-batch-size", "32"],
         "has memory.activation.beta = -1e+300, beyond any device"),
        ({"memory": {**profile_json()["memory"], "device_total_bytes": 0},
          "device": {"type": "cuda", "name": "T4", "total_memory_bytes": 10**300, "memory_source": "nvml"}},
         ["--world-size", "4", "--global-batch-size", "32"], "has device.total_memory_bytes = 1e+300, beyond any device"),
        # a layer name that is not a string is the profile's fault (it named the plan before)
        ({"layers": [{**_layer(0), "name": 5}, _layer(1)]}, ["--world-size", "2", "--global-batch-size", "8"],
         "has layers[0].name = 5; a layer's name is a string. HINT: Re-create it with `distplan profile`"),
        ({"layers": [_layer(0), {**_layer(1), "name": ["a"]}]}, ["--world-size", "2", "--global-batch-size", "8"], "has layers[1].name = ['a']"),
        # numbers so large or small that the arithmetic overflows: refused naming the option, never inf printed or a crash
        (None, ["--world-size", "4", "--global-batch-size", "32", "--device-memory-gb", "1e300"], "--device-memory-gb 1e+300 is more than any device holds"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--bandwidth-gbps", "1e-320"], "--bandwidth-gbps 9.99989e-321 is so small"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--format", "json", "--compute-scale", "1e308", "--price-per-hour", "1e308"],
         "The predicted step time overflows what a float holds with --compute-scale 1e+308, --price-per-hour 1e+308"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--latency-us", "1e308"], "step time overflows what a float holds with --latency-us 1e+308"),
        (None, ["--world-size", "4", "--global-batch-size", "32", "--price-per-hour", "1e308", "--time-weight", "1e308"],
         "step cost overflows what a float holds with --price-per-hour 1e+308, --time-weight 1e+308"),
    ],
)
def test_bad_input_is_one_line_with_hint_exit_2(tmp_path, capsys, mutate, args, message):
    path = tmp_path / "p.json"
    if mutate == "corrupt":
        path.write_text('{"schema_version": 1, "model": ')
    elif mutate == "dir":
        path.mkdir()
    elif mutate == "devnull":
        path = Path("/dev/null")
    elif mutate == "empty":
        path = ""
    elif mutate == "plan":
        path.write_text(json.dumps({"plan": {"strategy": "dp_ga"}, "prediction": {}, "alternatives": []}))
    elif mutate != "missing":
        path.write_text(json.dumps(profile_json(**(mutate or {}))))
    assert main(["plan", "--profile", str(path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert message in err[0] and "HINT:" in err[0]


def test_real_entry_point_no_traceback(tmp_path):
    # one real process (the in-process tests above cover the successful paths)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json()))
    bad = subprocess.run(
        [sys.executable, "-m", "lightning_distplan.cli", "plan", "--profile", str(path), "--world-size", "3", "--global-batch-size", "8", "--strategy", "dp_ga"],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "HINT: Use the nearest valid global batch size, 6 or 9" in bad.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(profile_path):
    """`distplan plan ... | head -c 100`: the pipe's reader is gone before the output is written (here it never reads).
    Through the console script's entry point, as `distplan` runs it: `plan` imports neither torch nor Lightning there
    (`python -m lightning_distplan.cli` imports both first, seconds of a test that is about the pipe; the same `main`
    handles the broken pipe either way)."""
    child = "import sys, _distplan_cli\nsys.argv[0] = 'distplan'\nsys.exit(_distplan_cli.main())\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", child, "plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32",
         "--format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdout.close()  # the only reader: every write of the command now fails with EPIPE
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and "error" not in stderr and "Traceback" not in stderr, stderr


def test_no_feasible_plan_prints_the_ranking_and_exits_1(profile_path, capsys):
    # DESIGN §3.4: an infeasible plan is never presented as the pick; the list still shows how far off each is.
    args = ["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--format", "json",
            "--device-memory-gb", "0.01", "--bandwidth-gbps", "10", "--latency-us", "30"]
    assert main(args) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out and not any(c["feasible"] for c in out)
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    # the closest is the plan with the smallest peak (the JSON list ranks infeasible plans by time)
    closest = min(out, key=lambda c: c["predicted_peak_memory_bytes"])
    assert closest["pp"] == 4 and closest is not out[0]
    named = Plan.from_dict(closest["plan"]).describe()
    assert err[0].startswith(f"distplan plan: error: no plan is feasible; the closest, {named}, ") and "exceeds" in err[0] and "HINT:" in err[0]
    # the same request on the profiled 16 GiB device has feasible plans and exits 0
    assert main([a for a in args if a not in ("--device-memory-gb", "0.01")]) == 0


def test_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    """A Ctrl-C during the seconds of importing torch and lightning prints one line, not Python's traceback."""
    import lightning_distplan.cli as cli

    real = cli.importlib.import_module

    def ctrl_c_on_bench(name, *args):  # as if the key landed while the bench subcommand's imports ran
        if name.endswith("bench"):
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", ctrl_c_on_bench)
    assert main(["plan", "--help"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["distplan: interrupted while starting; nothing was run"]


def test_a_ctrl_c_a_library_swallows_while_starting_still_stops_the_command(monkeypatch, capsys):
    """A real SIGINT that lands in a library's broad ``except`` while torch and lightning are imported: the import
    went on and the command ran to its end (exit 0, a profile written) as if no key had been pressed."""
    import os
    import signal

    import lightning_distplan

    def swallowed(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - what such a library does
            pass

    monkeypatch.setattr(lightning_distplan, "_register_strategies", swallowed)
    assert main(["profile", "lightning_distplan.bench.models:WideMLP", "--out", "never.json"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["distplan: interrupted while starting; nothing was run"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_the_real_command_imports_is_one_line():
    """The console script's entry point: a real SIGINT while it imports the package (seconds of torch and
    lightning on a cold start, before any code in the package could catch it) prints one line and exits 130.
    The child sends the signal to itself as the import of lightning_distplan.cli begins, so the test does not
    depend on how fast the imports are on this machine."""
    child = (
        "import builtins, os, signal, sys\n"
        "import _distplan_cli\n"
        "real = builtins.__import__\n"
        "def hooked(name, *args, **kwargs):\n"
        "    if name == 'lightning_distplan.cli':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = hooked\n"
        "sys.argv = ['distplan', '--help']\n"
        "sys.exit(_distplan_cli.main())\n"
    )
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and res.stderr.strip().splitlines() == ["distplan: interrupted while starting; nothing was run"], res.stderr[-1500:]


@pytest.mark.parametrize("command", ["profile", "bench"])
def test_a_real_ctrl_c_while_profile_or_bench_starts_is_one_line(command, tmp_path):
    """`distplan profile` and `distplan bench` import torch and lightning after the console script's own start
    (registering the strategies: seconds on any machine). A real SIGINT one second in lands there, or, on a fast
    machine, in the command before it has done any work: wherever it lands, one line, exit 130, no traceback and
    nothing written. The command is a valid one that works for many seconds (without a datamodule it failed at once, and
    on an idle machine it had printed that error before the SIGINT came: exit 2)."""
    import signal
    import time

    out = tmp_path / "out.json"
    argv = ["lightning_distplan.bench.models:WideMLP", "--datamodule", "lightning_distplan.bench.models:RandomVectorData", "--out", str(out)]
    argv += ["--world-size", "1", "--global-batch-size", "8"] if command == "bench" else []
    child = "import sys, _distplan_cli\nsys.argv[0] = 'distplan'\nsys.exit(_distplan_cli.main())\n"
    proc = subprocess.Popen([sys.executable, "-c", child, command, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and "Traceback" not in err, err[-1500:]
    assert lines and lines[-1].startswith("distplan") and "interrupted" in lines[-1], err[-1500:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_console_script_plans_without_torch_or_lightning(tmp_path):
    """`plan` (like `tune` and `dashboard`) reads a profile and runs the pure core: through the console script it
    imports neither torch nor lightning (seconds on a cold start), and prints what `main` prints in-process.
    `profile` and `bench` still find the strategies registered (bench runs plans by name)."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json()))
    child = (
        "import sys\n"
        "import _distplan_cli\n"
        f"sys.argv = ['distplan', 'plan', '--profile', {str(path)!r}, '--world-size', '4', '--global-batch-size', '32', '--format', 'json']\n"
        "rc = _distplan_cli.main()\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'lightning.pytorch') if m in sys.modules)\n"
        "print('HEAVY', heavy, rc, file=sys.stderr)\n"
        "from lightning_distplan.cli import main\n"
        f"rc = main(['profile', 'no_such_module:Model', '--out', {str(tmp_path / 'p.json')!r}])\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('REGISTERED', rc, all(n in StrategyRegistry for n in ('auto_plan', 'dp_ga', 'gpipe', '1f1b')), file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert "HEAVY [] 0" in res.stderr and "REGISTERED 2 True" in res.stderr, res.stderr[-1500:]
    assert json.loads(res.stdout) == _plan_json(path)


def test_the_entry_point_file_run_as_a_script_plans_without_torch_or_lightning(tmp_path):
    """`python _distplan_cli.py plan ...` (the file run as __main__, as from a source checkout) set its `starting`
    flag on __main__, where the package does not look: it imported torch and lightning (11 s on a busy host,
    against 0.3 s), which the console script does not."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json()))
    script = Path(__file__).resolve().parents[2] / "_distplan_cli.py"
    child = (
        "import runpy, sys\n"
        f"sys.argv = [{str(script)!r}, 'plan', '--profile', {str(path)!r}, '--world-size', '4', '--global-batch-size', '32', '--format', 'json']\n"
        "try:\n"
        f"    runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    rc = stop.code\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'lightning.pytorch') if m in sys.modules)\n"
        "print('HEAVY', heavy, rc, file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert "HEAVY [] 0" in res.stderr, res.stderr[-1500:]
    assert json.loads(res.stdout) == _plan_json(path)


def _plan_json(path):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--profile", str(path), "--world-size", "4", "--global-batch-size", "32", "--format", "json"]) == 0
    return json.loads(out.getvalue())


def test_our_warnings_print_as_one_line_naming_the_command(monkeypatch):
    """A warning from this package prints as `distplan <command>: warning: ...`, not with our source path and
    line (Lightning's format claims every path with "lightning" in it); others keep their usual format."""
    import warnings

    import lightning_distplan
    from lightning_distplan import cli

    ours = str(Path(lightning_distplan.__file__).parent / "profiling" / "_profiler.py")
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    for command in ("plan", "profile"):  # installed again by a second main() in one process: no chain of wrappers
        cli._short_warnings(command)
        assert warnings.formatwarning("slow step", UserWarning, ours, 766) == f"distplan {command}: warning: slow step\n"
    assert warnings.formatwarning("x", UserWarning, "/elsewhere/mod.py", 3) == "/elsewhere/mod.py:3: UserWarning: x\n"


def test_json_output_is_standard_json_with_extreme_but_finite_options(profile_path, capsys):
    """Options far from any real device that still give finite predictions are planned, and the JSON is standard
    (no Infinity or NaN, which json.loads with a strict parse_constant refuses)."""
    assert main(["plan", "--profile", str(profile_path), "--world-size", "4", "--global-batch-size", "32", "--format", "json",
                 "--compute-scale", "1e200", "--price-per-hour", "1e100"]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    ranked = json.loads(out, parse_constant=refuse)
    assert ranked and all(c["predicted_step_time_s"] > 1e195 for c in ranked)


def test_the_plan_commands_finiteness_check_finds_nested_values():
    from lightning_distplan._cli.plan import _non_finite

    assert _non_finite({"a": 1.0, "b": [0.5, {"c": 2.0}]}) is None
    assert _non_finite({"a": 1.0, "breakdown": {"compute": float("inf")}}) == ("breakdown.compute", float("inf"))
    assert _non_finite({"stage_times_s": [1.0, float("-inf")]}) == ("stage_times_s[1]", float("-inf"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "is not a profile (its JSON is nested too deeply to read)"),
        ('{"schema_version": 1, "model": "m", "micro_batch_sizes": [' + "7" * 5000 + "]}",
         "holds a number too long to be a profile's (Exceeds the limit (4300 digits) for integer string conversion)"),
    ],
)
def test_a_profile_file_json_cannot_hold_is_named_with_the_profile_hint(tmp_path, capsys, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    assert main(["plan", "--profile", str(path), "--world-size", "2", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Profile file {str(path)!r} {message}" in err[0], err
    assert err[0].endswith("HINT: The file is corrupt; re-create it with `distplan profile`.")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--profile", "p.json", "--world-size", "x", "--global-batch-size", "8"],
         "distplan plan: error: argument --world-size: invalid int value: 'x'. HINT: See `distplan plan --help` for the options."),
        (["plan", "--profile", "p.json"],
         "distplan plan: error: the following arguments are required: --world-size, --global-batch-size. HINT: See `distplan plan --help`"),
        (["tune", "--profile", "p.json", "--global-batch-size", "8", "--format", "xml"], "distplan tune: error: argument --format: invalid choice: 'xml'"),
        (["nope"], "distplan: error: argument COMMAND: invalid choice: 'nope'"),
        # a mistyped flag of a subcommand: argparse reported it from the top parser, whose --help lists no plan options
        (["plan", "--profile", "p.json", "--world-size", "2", "--global-batch-size", "8", "--bandwith-gbps", "3"],
         "distplan plan: error: unrecognized arguments: --bandwith-gbps 3. HINT: See `distplan plan --help` for the options."),
        (["tune", "--profile", "p.json", "--global-batch-size", "8", "extra"],
         "distplan tune: error: unrecognized arguments: extra. HINT: See `distplan tune --help` for the options."),
        ([], "distplan: error: the following arguments are required: COMMAND. HINT: See `distplan --help` for the options."),
    ],
)
def test_usage_errors_are_one_line_with_a_hint(argv, message, capsys):
    """argparse printed the whole usage (a dozen lines for plan) before the sentence, and no HINT."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith(message) and "HINT:" in err[0], err


def test_a_cpu_hosts_ram_is_shared_by_the_ranks_on_it_not_by_every_node_s(tmp_path, capsys):
    """`distplan plan` divided a CPU profile's host RAM by --world-size, all nodes' ranks together: 4 ranks on 4 machines
    of 8 GiB each were given 2 GiB apiece, and a plan that fits each machine was refused. --num-nodes (as
    Trainer(num_nodes=...), which auto_plan reads) now gives each machine's RAM to its own ranks."""
    mem = profile_json()["memory"]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(profile_json(
        device={"type": "cpu", "name": "x86_64", "total_memory_bytes": 8 << 30, "memory_source": "host RAM (sysconf)"},
        layers=[_layer(i, param_bytes=400_000_000) for i in range(4)],
        memory={**mem, "param_bytes": 1_600_000_000, "grad_bytes": 1_600_000_000, "optimizer_state_bytes": 0,
                "device_total_bytes": 8 << 30, "device_total_source": "host RAM (sysconf)"},
    )))
    base = ["plan", "--profile", str(path), "--world-size", "4", "--global-batch-size", "16", "--strategy", "dp_ga"]
    for nodes, rc, share in ((None, 1, "2 GiB"), ("1", 1, "2 GiB"), ("2", 1, "4 GiB"), ("4", 0, None)):
        assert main(base + ([] if nodes is None else ["--num-nodes", nodes])) == rc
        out, err = capsys.readouterr()
        if share:  # ~4.6 GiB a rank: more than 90% of what each rank has
            assert f"exceeds 90% of the {share} device" in err
        else:
            assert "exceeds" not in out + err and "yes" in out  # one rank per 8 GiB machine: it fits
    for nodes in ("3", "0"):
        assert main(base + ["--num-nodes", nodes]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--num-nodes {nodes} does not divide --world-size 4" in err[0] and "HINT:" in err[0]


def test_over_several_nodes_a_hybrids_stages_on_one_node_share_its_link(tmp_path, capsys):
    """`distplan plan --num-nodes 2 --world-size 4` priced 1f1b dp=2 pp=2 over a 3 MB and a 1 MB stage with the 3 MB
    all-reduce alone on the link, where both stages on a node cross its one link at once (4 MB) and auto_plan (its
    choose_plan) prices them so: the CLI ranked the plans auto_plan would run on those nodes otherwise."""
    from lightning_distplan.costmodel import ring_allreduce_time

    mem = profile_json()["memory"]
    path = tmp_path / "two_stages.json"
    path.write_text(json.dumps(profile_json(layers=[_layer(0, param_bytes=3_000_000), _layer(1, param_bytes=1_000_000)],
                                            memory={**mem, "param_bytes": 4_000_000, "grad_bytes": 4_000_000})))
    base = ["plan", "--profile", str(path), "--world-size", "4", "--global-batch-size", "8", "--pin", "strategy=1f1b",
            "--pin", "stages=2", "--bandwidth-gbps", "80", "--latency-us", "20", "--format", "json"]
    exposed = {}
    for nodes in ("1", "2", "4"):
        assert main(base + ["--num-nodes", nodes]) == 0
        (best, *_) = json.loads(capsys.readouterr().out)
        assert (best["dp"], best["pp"]) == (2, 2)
        exposed[nodes] = best["breakdown"]["exposed_comm"]
    assert exposed["2"] == pytest.approx(ring_allreduce_time(4_000_000, 2, 20e-6, 1e10), rel=1e-12)  # both stages on one link
    for alone in ("1", "4"):  # one node (its rings share no link), or one rank a node
        assert exposed[alone] == pytest.approx(ring_allreduce_time(3_000_000, 2, 20e-6, 1e10), rel=1e-12)
