"""Print the README's "How accurate is it" table from the committed result files.

Every number in that README section comes from a JSON file under ``benchmarks/results/`` written
by the script named in its row; nothing is typed in by hand. Rows whose file is missing say so.

Run:  python benchmarks/readme_table.py            (prints Markdown)
      python benchmarks/readme_table.py --write    (replaces the section in README.md)
      python benchmarks/readme_table.py --check    (exit 1 when README.md's section is not what the results give)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- accuracy-table:begin -->", "<!-- accuracy-table:end -->"
sys.path.insert(0, str(ROOT / "benchmarks"))
from cpu_cluster_sweep import confirmed_picks, summarize_sweep  # noqa: E402


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def sweep_files() -> list[Path]:
    """The committed CPU cluster sweeps in run order: ``cpu_cluster_sweep.json``, then ``_run2``, ``_run3`` ...

    Only those names: a full sweep stopped part-way leaves ``cpu_cluster_sweep.partial.json`` (``.partial.2.json``, ...)
    beside them, which is no sweep's result (its settings, no summary)."""
    def order(path: Path) -> int | None:
        tail = path.stem.removeprefix("cpu_cluster_sweep")
        if not tail:
            return 1
        return int(tail[4:]) if tail.startswith("_run") and tail[4:].isdigit() else None

    return sorted((p for p in RESULTS.glob("cpu_cluster_sweep*.json") if order(p) is not None), key=lambda p: order(p) or 0)


def _picks_by_rate(d: dict) -> str:
    """The planner's pick per model as the link changes (from the sweep's settings)."""
    rates = d.get("provenance", {}).get("rates", [])
    rows = []
    for model in dict.fromkeys(x["model_key"] for x in d["settings"]):
        picks = []
        for rate in rates:
            hit = next((x for x in d["settings"] if x["model_key"] == model and x["rate"] == rate and "summary" in x), None)
            picks.append(hit["summary"]["pick"]["plan"].split()[0] if hit and hit["summary"].get("pick") else "-")
        rows.append(f"{model} {'/'.join(picks)}")
    return f"Run 1's pick at {'/'.join(rates)}: " + ", ".join(rows)


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def _date(d: dict) -> str:
    prov = d.get("provenance", {})
    raw = d.get("date") or prov.get("date") or prov.get("date_start") or d.get("date_utc") or ""
    return str(raw)[:10]


def _first_profile_part(first: dict | None) -> str:
    """A sweep summary's ``first_profile`` block as a bracketed clause ("" for sweeps that profiled once)."""
    if not first:
        return ""
    picks = round(first["pick_within_5pct_rate"] * first["n_settings_done"])
    confirmed = f", {confirmed_picks(first)} confirmed" if confirmed_picks(first) else ""
    return f" (from the first profile alone: {_pct(first['median_abs_error'])}, {_pct(first['p90_abs_error'])}, {picks}/{first['n_settings_done']}{confirmed})"


def _failed_part(settings: list[dict]) -> str:
    """The runs left out of a sweep's figures, as a bracketed clause ("" when none): plans that failed (out of memory,
    an error) have no error to pool, and a setting whose job failed has no pick to judge (its n is not in k/n)."""
    plans = sum(r.get("measured_step_time_s") is None for x in settings if "summary" in x for r in x.get("plans", []))
    jobs = sum("summary" not in x for x in settings)
    parts = ([f"{plans} plan run(s) failed, not in the errors"] if plans else []) + (
        [f"{jobs} setting(s) failed to run, not in the settings counted"] if jobs else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _confirmed_part(summary: dict) -> str:
    """A sweep summary's verdict on the confirmation passes ("" for sweeps without them)."""
    return f" ({confirmed_picks(summary)} judged on the confirmation passes alone)" if confirmed_picks(summary) else ""


def rows() -> list[tuple[str, str, str, str, str]]:
    out: list[tuple[str, str, str, str, str]] = []

    d = _load("single_device_validation_cpu.json")
    if d:
        n = len(d["points"])
        out.append((
            "Step time at unprofiled micro-batch × accumulation, 1 device",
            f"median \\|error\\| {_pct(d['median_abs_error'])} over {n} points (max {_pct(d['max_abs_error'])}); target ≤ 15%",
            f"CPU, {d['device'].get('torch_threads', '?')} thread(s); load {d.get('load_average_at_start', ['?'])[0]:.1f} at start",
            _date(d), "`benchmarks/single_device_validation.py`",
        ))

    for path in sorted(RESULTS.glob("gpu_validation_*.json")):
        out.append(_gpu_row(json.loads(path.read_text()), path.stem))

    d = _load("cli_timings_cpu.json")
    if d:
        plan = d.get("plan_8_devices")  # measured since the console script plans without torch / lightning
        runs = d.get("runs", 1)

        def spread(part: dict[str, Any]) -> str:  # the range of the runs, where several were taken
            return f" ({part['min_s']:.1f}–{part['max_s']:.1f})" if runs > 1 else ""

        out.append((
            "`distplan profile` of the demo Transformer / `distplan tune` 300 trials"
            + (" / `distplan plan` on 8 devices" if plan else "") + " (whole commands"
            + (f"; median of {runs} runs, range in brackets)" if runs > 1 else ")"),
            f"{d['profile']['wall_s']:.1f} s{spread(d['profile'])} (profiling {d['profile']['profiling_time_s_reported']:.1f} s) / "
            f"{d['tune_300_trials']['wall_s']:.1f} s{spread(d['tune_300_trials'])}"
            + (f" / {plan['wall_s']:.1f} s{spread(plan)}" if plan else "") + "; targets ≤ 30 s / < 30 s",
            f"CPU; load {d['load_average_at_start'][0]:.1f} at start", _date(d), "`benchmarks/cli_timings.py`",
        ))

    d = _load("planning_scale_cpu.json")
    if d:
        by_case: dict[tuple, list[dict]] = {}
        for case in d["cases"]:
            by_case.setdefault((case["layers"], case["world_size"], case["global_batch_size"]), []).append(case)
        parts = [
            f"{layers} layers on {world} devices, B={batch}: {cases[0]['plans']} plans in {max(c['wall_s'] for c in cases):.1f} s"
            for (layers, world, batch), cases in by_case.items()
        ]
        out.append((
            "Planning time, deep models on many devices (`planner.rank_plans`, every plan priced; hand-built profiles; slower of gloo- and NCCL-like links)",
            "; ".join(parts),
            f"CPU, one thread; load {d['load_average_at_start'][0]:.1f} at start", _date(d), "`benchmarks/planning_scale.py`",
        ))

    runs = [d for d in (json.loads(path.read_text()) for path in sweep_files()) if d.get("summary")]
    if runs:
        parts = []
        for i, d in enumerate(runs, 1):
            s = d["summary"]
            within = round((s.get("pick_within_5pct_rate") or 0) * s.get("n_settings_done", 0))
            parts.append(
                f"run {i}: median \\|error\\| {_pct(s.get('median_abs_error'))}, p90 {_pct(s.get('p90_abs_error'))} over {s.get('n_points')} runs, "
                f"pick within 5% of the measured best in {within}/{s.get('n_settings_done')} settings"
                + _failed_part(d["settings"]) + _confirmed_part(s) + _first_profile_part(s.get("first_profile"))
            )
        if len(runs) > 1:
            pooled, _ = summarize_sweep([x for d in runs for x in d["settings"]], runs[0].get("provenance", {}).get("rates", []))
            within = round((pooled.get("pick_within_5pct_rate") or 0) * pooled.get("n_settings_done", 0))
            parts.append(
                f"all runs pooled: median \\|error\\| {_pct(pooled.get('median_abs_error'))}, p90 {_pct(pooled.get('p90_abs_error'))} "
                f"over {pooled.get('n_points')} runs, pick within 5% in {within}/{pooled.get('n_settings_done')} settings"
                + _failed_part([x for d in runs for x in d["settings"]]) + _confirmed_part(pooled) + _first_profile_part(pooled.get("first_profile"))
            )
        prov = runs[0].get("provenance", {})
        each = f"{prov.get('passes', 1)} pass(es) × {prov.get('warmup')}+{prov.get('steps')} steps per plan"
        if prov.get("min_time_s"):
            counts = [r["timed_steps_per_pass"] for d in runs for x in d["settings"] for r in x.get("plans", []) if r.get("timed_steps_per_pass")]
            each += f", or more: each plan timed for at least ~{prov['min_time_s']:g} s per pass ({min(counts)}–{max(counts)} timed steps)"
        confirming = [(i, d["provenance"]["confirm_passes"]) for i, d in enumerate(runs, 1) if d.get("provenance", {}).get("confirm_passes")]
        if confirming:
            each += (f"; run{'s' if len(confirming) > 1 else ''} {', '.join(str(i) for i, _ in confirming)} then ran the contenders for the "
                     f"measured best {'/'.join(sorted({str(k) for _, k in confirming}))} more times (confirmation passes)")
        if any(x.get("profiles") and len(x["profiles"]) > 1 for d in runs for x in d["settings"]):
            each += "; predicted from the mean of the profiles taken before the runs and after each pass"
        times = {1: "one run", 2: "the same model and profiler run twice"}.get(len(runs), f"the same model and profiler run {len(runs)} times")
        models = len({x["model_key"] for x in runs[0]["settings"]})
        out.append((
            f"Step time of every candidate plan, 2 ranks over a rate-limited link ({models} models × {len(prov.get('rates', []))} rates; "
            + each + "), " + times,
            "; ".join(parts) + "; targets 10% / 25% / 90%. " + _picks_by_rate(runs[0]),
            "CPU, 2 network namespaces, gloo over veth + tc tbf",
            _date(runs[-1]), "`benchmarks/cpu_cluster_sweep.py`",
        ))

    for name, label in (("tuner_vs_exhaustive.json", "real demo-Transformer profile"),
                        ("tuner_vs_exhaustive_synthetic.json", "hand-built 12-layer profile")):
        d = _load(name)
        if not d:
            continue
        s = d["summary"]
        t = d.get("tune_300_trials", {})
        corners = sum(bool(r.get("optimum_in_initial_design")) for r in d["runs"])
        out.append((
            f"Optuna search vs exhaustive optimum, {label} (≥ 5,000 configurations)",
            f"{s['within_tolerance']}/{s['searches']} searches within 1% (worst gap {s['worst_gap_pct']:.2f}%), "
            f"≤ {s['max_evaluations_pct_of_space']:.1f}% of the space evaluated; the optimum was an initial-design corner "
            f"point for {corners}/{len(d['runs'])} weights; 300 trials in {t.get('elapsed_s_in_process', float('nan')):.1f} s",
            "CPU", _date(d), "`benchmarks/tuner_vs_exhaustive.py`",
        ))

    d = _load("dp_ga_overhead_cpu.json")
    if d:
        out.append((
            "dp_ga vs Lightning ddp + accumulate_grad_batches (same config)",
            f"{d['dp_ga_vs_ddp_pct']:+.1f}% median step time (loader re-chunked to the planned micro-batch: "
            f"{d['dp_ga_rechunk_vs_ddp_pct']:+.1f}%) over {len(d['repeats'])} alternating repeats (per-repeat range {min(r['dp_ga_vs_ddp_pct'] for r in d['repeats']):+.0f}% to {max(r['dp_ga_vs_ddp_pct'] for r in d['repeats']):+.0f}%); re-chunking costs "
            f"{d['rechunk_cost_us_per_micro_batch']:.0f} µs per micro-batch; target within 2%",
            f"{d['device']}; load {d['loadavg_before_after'][0][0]:.1f} at start",
            _date(d), "`benchmarks/dp_ga_overhead.py`",
        ))

    d = _load("auto_plan_overhead_cpu.json")
    if d and d.get("runs"):
        runs = d["runs"]
        pcts = sorted(r["overhead_pct"] for r in runs)
        secs = sorted(r["overhead_s"] for r in runs)
        steps = {r["steps"] for r in runs}
        out.append((
            f"auto_plan profiling + planning overhead, one CPU epoch ({'/'.join(str(x) for x in sorted(steps))} steps), {len(runs)} runs",
            f"median {statistics.median(pcts):.1f}% of the fit ({statistics.median(secs):.1f} s), range {pcts[0]:.1f}–{pcts[-1]:.1f}%; "
            f"plans chosen: {', '.join(sorted({r['plan'] for r in runs}))}; target ≤ {d.get('target_pct', 5):.0f}%",
            f"CPU, {runs[0]['config']['devices']} ranks; load {min(r['load_average_start'][0] for r in runs):.1f}–"
            f"{max(r['load_average_start'][0] for r in runs):.1f} at start",
            _date(runs[-1]), "`examples/auto_plan_overhead.py`",
        ))

    d = _load("seed000_ga.json")
    if d:
        s, paper = d["summary"], d["summary"]["paper"]
        # the summary's mean is over the global batch sizes (the cheapest configuration of the whole catalog at each), and
        # alicloud-2023 is seed 000's IaaS catalog: its IaaS range is the comparison, its FaaS average is another setting
        w0 = [(r["global_batch_size"], next(i for i in r["by_weight"] if i["time_weight"] == 0.0)) for r in d["results"]]
        w0 = [(b, i) for b, i in w0 if "cost_change_pct" in i]
        iaas, faas = paper["DP_IaaS_range"], paper["DP_FaaS_average"]
        out.append((
            "Seed 000 finding: DP with accumulation vs without (alicloud-2023, analytical BERT-Large profile, w=0)",
            f"cheapest configuration with accumulation vs without, on the whole catalog: cost {s['w0_mean_cost_change_pct']:+.1f}%, "
            f"time {s['w0_mean_time_change_pct']:+.1f}%, the mean over B = {', '.join(str(b) for b, _ in w0)} "
            f"(B = {w0[-1][0]}: {w0[-1][1]['cost_change_pct']:+.1f}%, {w0[-1][1]['time_change_pct']:+.1f}%); "
            f"paper, IaaS: cost {min(iaas['cost_change_pct']):+.1f}% to {max(iaas['cost_change_pct']):+.1f}%, time up to "
            f"{iaas['time_change_pct_max']:+.1f}% (FaaS average: {faas['cost_change_pct']:+.1f}% cost, {faas['time_change_pct']:+.1f}% time); "
            "per-instance results in the JSON",
            "model only", _date(d), "`benchmarks/reproduce_seed000_ga.py`",
        ))
    return out


def _gpu_row(d: dict, stem: str = "") -> tuple[str, str, str, str, str]:
    """One single-GPU validation run: step time, peak memory, OOM boundary, profiling cost (``stem``: the
    file's name, whose ``_runN`` ending names a repeat run and ``_oom`` a run of the boundary search alone).
    A run on a CPU or of the ``--tiny`` models is refused: its row would give its numbers as a GPU's, for the
    full-size models."""
    if d["device"]["type"] != "cuda" or d.get("tiny"):
        raise SystemExit(
            f"readme_table: benchmarks/results/{stem}.json is a {'--tiny ' if d.get('tiny') else ''}run on {d['device']['type']} "
            f"({d['device']['name']}), not a GPU result, and the README's GPU rows would show its numbers as one. "
            "HINT: move it out of benchmarks/results/ (gpu_validation.py writes such runs under runs/ unless --out says otherwise)."
        )
    s, models = d["summary"], d["models"]
    oom = "; ".join(
        f"{name} {o['predicted_largest_micro_batch_planner']} / {o['predicted_largest_micro_batch_whole_device']} vs {o['measured_largest_micro_batch']} "
        f"({o['measured_smallest_oom_micro_batch']} ran out)"
        for name, rec in models.items() if (o := rec.get("oom"))
    )
    labels = {"gpt2": "GPT-2 124M, sequence 1024, AdamW", "bert_large": "BERT-Large masked LM, sequence 128, AdamW",
              "resnet101": "ResNet-101, 224×224, SGD"}  # the full configs are in each model's `what` in the JSON
    what = "; ".join(labels.get(name, name) for name in models)
    isolation = "each plan in a process of its own" if d.get("isolate") == "fork" else "one process group per plan"
    where = f"{d['device']['name']}, torch {d['versions']['torch']}"
    largest = "largest micro-batch (s = 1) the planner allows (90% of the device) / predicted for the whole device vs the largest that ran"
    if not s["n_points"]:
        profiling = ", ".join(f"{name} {rec['profiling_time_s']:.1f} s" for name, rec in models.items())
        return (
            f"1 GPU: out-of-memory boundary of dp_ga, s = 1 ({what}; float32, matmul precision {d['float32_matmul_precision']})",
            f"{largest}: {oom}; plans predicted to fit that ran out of memory: {s['predicted_feasible_that_failed']} "
            f"({isolation}; profiling {profiling}); target 0",
            where, _date(d), "`benchmarks/gpu_validation.py --oom-only`",
        )
    run = f"run {stem.rsplit('_run', 1)[1]}" if "_run" in stem else "run 1"
    per_model = ", ".join(
        f"{name} {_pct(statistics.median(abs(p['step_time_error']) for p in rec['points'] if p['step_time_error'] is not None))}"
        for name, rec in models.items()
    )
    cost = ", ".join(f"{name} {rec['profiling_time_s']:.1f} s ≈ {rec['profiling_cost_in_steps']:.0f} steps" for name, rec in models.items()
                     if rec.get("profiling_cost_in_steps"))
    return (
        f"1 GPU, {run}: dp_ga at unprofiled micro-batch × accumulation {'/'.join(sorted({str(p['accumulate_grad_batches']) for r in models.values() for p in r['points']}))} "
        f"({what}; float32, matmul precision {d['float32_matmul_precision']})",
        f"step time median \\|error\\| {_pct(s['median_abs_step_time_error'])}, p90 {_pct(s['p90_abs_step_time_error'])}, max {_pct(s['max_abs_step_time_error'])} "
        f"over {s['n_timed']} points (per model: {per_model}); peak memory vs `torch.cuda.max_memory_allocated` (less what was allocated before the run; {isolation}) median \\|error\\| "
        f"{_pct(s['median_abs_memory_error'])}, max {_pct(s['max_abs_memory_error'])}, {s['n_memory_within_5pct']}/{s['n_timed']} within 5%; "
        f"plans predicted to fit that ran out of memory: {s['predicted_feasible_that_failed']} ({s['failed_as_predicted']} predicted not to fit ran out); "
        + (f"{largest}: {oom}; " if oom else "no out-of-memory boundary search in this run (`--no-oom-search`); ")
        + f"profiling {cost}; targets 10% / 5% / 0",
        where, _date(d), "`benchmarks/gpu_validation.py`",
    )


def table() -> str:
    lines = [
        "| what | result | where | date | script |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows()]
    if not any(RESULTS.glob("gpu_validation_*.json")):
        lines.append("")
        lines.append("No GPU figures yet: no GPU was available to this project so far (the harness runs on CUDA when present).")
    return "\n".join(lines)


def section() -> str:
    """The README's accuracy section, markers included, as the committed results give it today."""
    return f"{BEGIN}\n_Generated by `python benchmarks/readme_table.py --write` from `benchmarks/results/`._\n\n{table()}\n{END}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the section between the markers in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's section differs from what the results give")
    args = parser.parse_args()
    text = section()
    readme = ROOT / "README.md"
    if args.check:
        if text in readme.read_text():
            print("README.md's accuracy section is what benchmarks/results/ gives")
            return 0
        print("README.md's accuracy section differs from what benchmarks/results/ gives. HINT: run python benchmarks/readme_table.py --write", file=sys.stderr)
        return 1
    if not args.write:
        print(text)
        return 0
    content = readme.read_text()
    if BEGIN in content:
        content = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, content, flags=re.S)
    else:
        content = content.replace("ACCURACY_TABLE", text)
    if text not in content:  # no markers (or a begin without its end): nothing was replaced
        print(f"readme_table: {readme} has no {BEGIN} ... {END} section (nor an ACCURACY_TABLE line) to replace; it is left "
              "as it is. HINT: put the two markers, each on a line of its own, where the table goes.", file=sys.stderr)
        return 1
    readme.write_text(content)
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
