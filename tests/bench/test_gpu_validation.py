"""The single-GPU validation's own logic, and the committed GPU results belong to today's cost model.

The GPU runs themselves need a CUDA device; here the out-of-memory boundary search and the
predicted-largest-micro-batch helper are checked on known answers, and every prediction in the
committed result file is recomputed from the profile stored beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_distplan.costmodel import Hardware, predict
from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile
from lightning_distplan.plan import Plan
from lightning_distplan.profile import Profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_validation import PoolDataset, _release_process_group, find_boundary, isolated, predicted_largest_micro_batch, unprofiled_sizes  # noqa: E402
from readme_table import _gpu_row  # noqa: E402

GPU_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("gpu_validation_*.json"))


@pytest.mark.parametrize("limit", [1, 2, 37, 38, 300])
@pytest.mark.parametrize("start", [1, 10, 37, 38, 500])
def test_find_boundary_brackets_the_threshold(limit: int, start: int) -> None:
    probes: list[int] = []

    def runs(m: int) -> bool:
        probes.append(m)
        return m <= limit

    ok, bad = find_boundary(runs, start)
    assert ok <= limit < bad
    assert bad - ok <= max(1, int(ok * 0.02))
    assert len(probes) <= 40


def test_find_boundary_when_nothing_runs_or_nothing_fails() -> None:
    assert find_boundary(lambda m: False, 8) == (0, 1)
    ok, bad = find_boundary(lambda m: True, 8, limit=100)
    assert (ok, bad) == (100, None)


def test_unprofiled_sizes_are_between_and_past_the_profiled() -> None:
    assert unprofiled_sizes([4, 8, 16, 32]) == [6, 12, 24, 48]
    assert not set(unprofiled_sizes([16, 32, 64, 128])) & {16, 32, 64, 128}


def test_predicted_largest_micro_batch_matches_a_scan() -> None:
    layers = [LayerSpec(fwd_alpha=0.01, bwd_alpha=0.02, param_bytes=1_000_000, activation_bytes_per_sample=3e6) for _ in range(4)]
    profile = synthetic_profile(layers, fixed_overhead_bytes=5_000_000, device_memory_bytes=1 << 30)
    hw = Hardware.from_profile(profile)

    def peak(m: int) -> int:
        return predict(profile, Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=1, global_batch_size=m), hw).peak_memory_bytes

    for limit in (hw.usable_memory_bytes, hw.device_memory_bytes, peak(1) - 1, peak(7)):
        expected = max((m for m in range(1, 200) if peak(m) <= limit), default=0)
        assert predicted_largest_micro_batch(profile, hw, limit) == expected


def test_there_is_a_committed_gpu_result() -> None:
    assert GPU_RESULTS, "benchmarks/results/gpu_validation_*.json is missing"


@pytest.mark.parametrize("path", GPU_RESULTS, ids=lambda p: p.name)
def test_committed_gpu_result_replays_to_its_recorded_predictions(path: Path) -> None:
    """Each point's prediction comes back from the stored profile with today's cost model (else re-run the GPU study)."""
    doc = json.loads(path.read_text())
    assert doc["device"]["type"] == "cuda" and doc["device"]["name"] and doc["versions"]["torch"] and doc["command"]
    n = 0
    for name, rec in doc["models"].items():
        profile = Profile.from_dict(rec["profile"], source=f"{path.name}:{name}")
        hw = Hardware.from_profile(profile)
        for point in rec["points"]:
            m, s = point["micro_batch_size"], point["accumulate_grad_batches"]
            pred = predict(profile, Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s), hw)
            assert pred.step_time_s == pytest.approx(point["predicted_step_time_s"], rel=1e-9), (name, m, s)
            assert pred.peak_memory_bytes == point["predicted_peak_memory_bytes"], (name, m, s)
            assert pred.feasible == point["predicted_feasible"], (name, m, s)
            n += 1
        if "oom" in rec:
            o = rec["oom"]
            assert predicted_largest_micro_batch(profile, hw, hw.usable_memory_bytes) == o["predicted_largest_micro_batch_planner"]
            # the acceptance: what the planner allows must have run
            assert o["planner_largest_runs"] and o["predicted_largest_micro_batch_planner"] <= o["measured_largest_micro_batch"]
    assert n == doc["summary"]["n_points"]


def test_each_loader_gets_a_pool_of_its_own_length_over_shared_samples():
    pool = PoolDataset([("x", i) for i in range(3)], length=1 << 30)
    small, large = pool.sized(4), pool.sized(10)
    assert (len(small), len(large), len(pool)) == (4, 10, 1 << 30)  # making the second left the first alone
    assert small.samples is pool.samples and large.samples is pool.samples  # not copied
    assert [large[i] for i in range(5)] == [("x", 0), ("x", 1), ("x", 2), ("x", 0), ("x", 1)]  # cycles by index


@pytest.mark.parametrize("path", GPU_RESULTS, ids=lambda p: p.name)
def test_each_committed_gpu_point_started_from_a_clean_device(path: Path) -> None:
    """No point's peak holds an earlier plan's leftovers: next to nothing was allocated when each run began,
    and each plan ran in a process of its own (``--isolate fork``)."""
    doc = json.loads(path.read_text())
    assert doc["isolate"] == "fork"
    before = [p["allocated_before_run_bytes"] for rec in doc["models"].values() for p in rec["points"]]
    probes = [p for rec in doc["models"].values() for p in rec.get("oom", {}).get("probes", [])]
    assert before or probes  # a run of points, or of the boundary search alone (--oom-only)
    assert all(b is not None and b < (1 << 20) for b in before)


def test_gpu_rows_name_the_run_and_say_when_the_oom_search_was_skipped() -> None:
    rows = {p.stem: _gpu_row(json.loads(p.read_text()), p.stem) for p in GPU_RESULTS}
    for stem, (what, result, where, _date, _script) in rows.items():
        doc = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
        searched = any("oom" in rec for rec in doc["models"].values())
        assert ("largest micro-batch (s = 1)" in result) == searched
        assert doc["device"]["name"] in where
        assert "each plan in a process of its own" in result
        if "--oom-only" in doc["command"]:
            assert stem.endswith("_oom") and what.startswith("1 GPU: out-of-memory boundary") and searched
            assert not doc["summary"]["n_points"] and "step time" not in result
            continue
        assert what.startswith("1 GPU, run 2:" if stem.endswith("_run2") else "1 GPU, run 1:")
        assert ("--no-oom-search" in result) == (not searched) == ("--no-oom-search" in doc["command"])


def test_release_process_group_ends_a_group_of_one(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _release_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pid_and(value: int) -> dict:
    import os

    return {"pid": os.getpid(), "value": value * 2}


def _fails(value: int) -> dict:
    raise ValueError(f"no {value}")


def test_isolated_runs_each_task_in_a_process_of_its_own() -> None:
    import os

    here = isolated("none", _pid_and, 3)
    assert here == {"pid": os.getpid(), "value": 6}
    first, second = isolated("fork", _pid_and, 4), isolated("fork", _pid_and, 5)
    assert (first["value"], second["value"]) == (8, 10)
    assert len({os.getpid(), first["pid"], second["pid"]}) == 3
    with pytest.raises(RuntimeError, match="_fails.*ValueError: no 7"):
        isolated("fork", _fails, 7)


def test_committed_input_bytes_replay_reproduces() -> None:
    """The README's replay of the GPU runs with the micro-batch's input counted comes back from the stored profiles."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "cuda_memory"))
    import replay_input_bytes

    doc = json.loads(replay_input_bytes.OUT.read_text())
    assert [r["run"] for r in doc["replays"]] == replay_input_bytes.RUNS
    for stored in doc["replays"]:
        again = replay_input_bytes.replay(stored["run"])
        assert again["points"] == stored["points"] and again["with_input"] == stored["with_input"]
        resnet = [p for p in again["points"] if p["model"] == "resnet101"]
        assert all(p["input_bytes_per_sample"] == 3 * 224 * 224 * 4 + 8 for p in resnet)  # one float32 image and its int64 label
        assert all(p["predicted_with_input"] - p["predicted_before"] == pytest.approx(p["micro_batch_size"] * p["input_bytes_per_sample"], abs=2)
                   for p in again["points"])  # dp holds one micro-batch: the term adds m samples' input, nothing else


def test_a_smoke_run_never_lands_among_the_gpu_results(tmp_path: Path) -> None:
    """``gpu_validation.py --tiny --device cpu`` (the docstring's smoke run) wrote benchmarks/results/gpu_validation_x86_64.json,
    which the README's table then showed as "1 GPU, run 1" with the full-size models' labels."""
    from gpu_validation import default_out

    results, runs = ROOT / "benchmarks" / "results", ROOT / "runs"
    assert default_out("cuda", "NVIDIA H100 80GB HBM3", tiny=False, oom_only=False) == results / "gpu_validation_nvidia_h100_80gb_hbm3.json"
    assert default_out("cuda", "NVIDIA H100 80GB HBM3", tiny=False, oom_only=True) == results / "gpu_validation_nvidia_h100_80gb_hbm3_oom.json"
    assert default_out("cuda", "NVIDIA H100 80GB HBM3", tiny=True, oom_only=False) == runs / "gpu_validation_nvidia_h100_80gb_hbm3_tiny.json"
    assert default_out("cpu", "x86_64", tiny=True, oom_only=False) == runs / "gpu_validation_x86_64_tiny.json"
    assert default_out("cpu", "x86_64", tiny=False, oom_only=False) == runs / "gpu_validation_x86_64.json"
    doc = json.loads(GPU_RESULTS[0].read_text())
    for device, tiny in (("cpu", False), ("cuda", True)):
        smoke = {**doc, "device": {**doc["device"], "type": device, "name": "x86_64" if device == "cpu" else doc["device"]["name"]}, "tiny": tiny}
        with pytest.raises(SystemExit, match=r"^readme_table: benchmarks/results/gpu_validation_x\.json is a .*not a GPU result.* HINT: move it out"):
            _gpu_row(smoke, "gpu_validation_x")


def test_p90_is_within_the_errors_and_taken_as_the_cpu_sweeps_take_it() -> None:
    """statistics.quantiles (the summary's p90 until 2026-11-25) put the p90 of three points above the largest."""
    from gpu_validation import summarize

    from lightning_distplan.bench import percentile

    def point(error: float) -> dict:
        return {"measured_step_time_s": 1.0, "step_time_error": error, "memory_error": None, "predicted_feasible": True}

    errors = [0.1, -0.2, 3.5]
    s = summarize({"m": {"points": [point(e) for e in errors]}})
    assert s["p90_abs_step_time_error"] == pytest.approx(0.2 + 0.8 * (3.5 - 0.2)) == percentile([abs(e) for e in errors], 90)
    assert s["p90_abs_step_time_error"] <= s["max_abs_step_time_error"] == 3.5
    assert summarize({"m": {"points": [point(0.3)]}})["p90_abs_step_time_error"] == 0.3


def test_cuda_diagnostics_say_in_one_line_that_they_need_a_gpu(tmp_path: Path) -> None:
    """Without a GPU these ended in a traceback from deep inside torch ("Found no NVIDIA driver on your system").
    The six run at once: each is a process whose time is torch's import."""
    import os
    import subprocess

    runs = {}
    for script in ("bucket_view", "collectives_smoke", "first_fit_swing", "release", "small_batch_gap", "trace_peaks"):
        out = tmp_path / script
        out.mkdir()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "OUT": str(out)}
        args = ["--out", str(out / "x.json")] if script == "first_fit_swing" else []
        runs[script] = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "cuda_memory" / f"{script}.py"), *args], cwd=ROOT,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for script, run in runs.items():
        _, stderr = run.communicate(timeout=300)
        lines = stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1, (script, stderr[-2000:])
        assert lines[0].startswith(f"{script}.py needs a CUDA GPU") and "HINT:" in lines[0]
        assert not list((tmp_path / script).iterdir()), script
