"""``distplan tune``: search cloud instances and plans with Optuna over the cost model (DESIGN §5)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="search cloud instance type, count and plan for the lowest cost + w*time per step",
        description=(
            "Project the profile to every GPU of a catalog, search instance type, count, strategy, stages and "
            "micro-batch size with Optuna (objective C + w*T per step, seed 000 §IV-D), print the best configuration "
            "and the (cost, time) Pareto front, and leave the study (per-trial breakdowns as user attributes) in the storage."
        ),
    )
    parser.add_argument("--profile", required=True, help="profile JSON written by `distplan profile`")
    parser.add_argument("--catalog", default="alicloud-2023", help="built-in catalog (alicloud-2023, the default, or aws-2026) or a SkyPilot-style CSV path")
    parser.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step (kept exactly)")
    parser.add_argument(
        "--time-weight", type=float, default=0.0,
        help="w in C + w*T, in the catalog's currency per second of step time (C: currency per step, T: seconds per "
        "step). Default 0: the cheapest. A w near the instances' price per second (12.75 RMB/h is 0.0035 RMB/s) trades "
        "the two; far above it, the fastest (seed 000's 256, 4096 and 65536 all pick the fastest for the demo profile "
        "on both built-in catalogs)",
    )
    parser.add_argument("--trials", type=int, default=300, help="Optuna trials to run (default 300); at least as many as the configurations left to price prices each of them once instead")
    parser.add_argument("--storage", default="sqlite:///distplan.db", help="Optuna RDB URL (default sqlite:///distplan.db)")
    parser.add_argument(
        "--study-name", default=None,
        help="study name (default distplan-<catalog>-B<batch>-w<weight>, with -mo after it for --multi-objective; <catalog> is "
        "<name>-spot with --pricing spot); an existing one with the same settings is extended",
    )
    parser.add_argument("--format", choices=("json", "table"), default="json", help="json (default) or a readable table")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (default 0); a run with another seed extends the same study. Workers started on one study on this "
                        "machine (same temporary folder, not Windows) while others run draw with seeds derived from it (so they spread out); "
                        "elsewhere give each its own")
    parser.add_argument("--max-instances", type=int, default=8, help="most instances of one type (default 8)")
    parser.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), help="strategies to consider")
    parser.add_argument("--max-pp", type=int, default=None, help="most pipeline stages to consider (default: as many as the profile has layers and the world size allows)")
    parser.add_argument(
        "--bandwidth-gbps", "--bandwidth", dest="bandwidth", type=float, default=None,
        help="network Gbit/s for every instance (required for a CSV without NetworkGbps); the same flag as plan's. aws-2026 "
        "prices its 'Up to N Gbps' instances (g5.xlarge, g6.xlarge, g6e.xlarge, p3.2xlarge) at the burst peak N; the result's "
        "notes say so",
    )
    parser.add_argument(
        "--pricing", choices=("on-demand", "spot"), default="on-demand",
        help="which price to minimise: on-demand (the catalog's Price, default) or spot (its SpotPrice; instances without one "
        "are left out; the built-in catalogs have none). Spot instances can be taken back at any time: the search prices a "
        "step, not the restarts",
    )
    parser.add_argument(
        "--precision", choices=("auto", "fp32", "tf32", "bf16"), default="auto",
        help="math assumed on the target GPUs (auto: the profile's dtype, and for float32 TF32 where the profiled run allowed it; "
        "fp32: no TF32; tf32: TF32 for every float32 matmul and convolution, as set_float32_matmul_precision('high'); bf16: "
        "bf16 tensor cores, a float32 profile's activations at half their size; fp32 and tf32 refuse a 16-bit profile)",
    )
    parser.add_argument("--multi-objective", action="store_true", help="optimise (cost, time) with NSGA-II instead of C + w*T with TPE")
    parser.add_argument(
        "--plots", action="store_true",
        help="attach the Pareto-front and time-breakdown plots and a summary note to the study for optuna-dashboard "
        "(PNG artifacts in <db stem>-artifacts next to a SQLite file; needs the [dashboard] extra)",
    )
    parser.add_argument("--quiet", "--no-progress", dest="no_progress", action="store_true", help="hide the progress bar (as profile's and bench's --quiet)")
    parser.set_defaults(run=run)


def _table(result: dict[str, Any]) -> str:
    cur = result["currency"]

    def row(c: dict[str, Any]) -> str:
        plan = f"{c['strategy']} dp={c['dp']} pp={c['pp']} m={c['micro_batch_size']} acc={c['accumulation']}"
        lo, hi = c["predicted_step_time_band_s"]
        band = f"[{lo:.3g}-{hi:.3g}]"
        cost = f"{c['predicted_cost_per_step']:.5g} {cur}"
        return (
            f"{c['count']:>3} x {c['instance_type']:<20} {plan:<38} {c['predicted_step_time_s']:>9.4g}s {band:<19} "
            f"{cost:>16} {c['predicted_peak_memory_bytes'] / 2**30:>8.2f} GiB"
        )

    header = f"{'n':>3}   {'instance':<20} {'plan':<38} {'time/step':>10} {'band':<19} {'cost/step':>16} {'peak memory':>12}"
    lines = [
        f"study {result['study_name']!r} in {result['storage']}: {result['n_trials']} trials, {result['n_evaluations']} configurations priced "
        f"of {result['space_size']} (the study has {result['n_feasible']} feasible ones); "
        f"{'objectives (C, T), best by ' if result.get('multi_objective') else 'objective '}C + w*T, w={result['time_weight']:g}; "
        f"{result.get('pricing', 'on-demand')} prices of catalog {result['catalog']}",
        *([f"no sampler ran: {result['sampler'].removeprefix('none: ')}"] if result.get("sampler", "").startswith("none:") else []),
        "",
        "best:",
        header,
        row(result["best"]),
        "",
        "Pareto front (cost, time), cheapest first:",
        header,
        *[row(c) for c in result["pareto"]],
        *(["", "notes:", *[f"- {note}" for note in result["notes"]]] if result.get("notes") else []),
        *(_plots_lines(result) if result.get("plots") else []),
    ]
    return "\n".join(lines)


def _plots_lines(result: dict[str, Any]) -> list[str]:
    """What --plots attached, where its PNGs are, and the command that shows them (the JSON has the same under "plots")."""
    plots = result["plots"]
    graphs = len(plots["graph_ids"])
    lines = ["", "plots:", f"- {'a summary note' if plots['note'] else 'no note'} and {graphs} graph{'s' if graphs != 1 else ''} attached to study {result['study_name']!r}"]
    if plots.get("artifact_dir") and plots.get("png"):
        lines.append(f"- PNGs: {plots['artifact_dir']}/ ({', '.join(sorted(plots['png']))})")
    lines.append(f"- view them: distplan dashboard {result['storage']}")
    return lines


def run(args: argparse.Namespace) -> int:
    """The command, with a SIGTERM (``kill``, a scheduler's time limit) handled as a Ctrl-C is: the trials finished
    before it are written to the study, one line says so, and the exit status is 143 (128 + SIGTERM)."""
    import signal
    import sys
    import threading

    terminated: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    previous = signal.signal(signal.SIGTERM, on_sigterm) if ours else None
    try:
        return _run(args)
    except KeyboardInterrupt as err:
        if not terminated:
            raise
        kept = err.args[0] if err.args and isinstance(err.args[0], str) else "the study was left as it was"
        print(f"distplan tune: terminated; {kept}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if ours:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from lightning_distplan.profile import Profile
    from lightning_distplan.tuner import load_catalog, tune
    from lightning_distplan.tuner.search import SEED_MAX

    for flag, value, low, example in (
        ("--global-batch-size", args.global_batch_size, 1, 256), ("--trials", args.trials, 1, 300),
        ("--max-instances", args.max_instances, 1, 8), ("--seed", args.seed, 0, 0),
        ("--max-pp", 1 if args.max_pp is None else args.max_pp, 1, 4),
    ):
        if value < low:
            raise InfeasiblePlanError(f"{flag} must be an integer >= {low}, got {value}.", hint=f"Use e.g. {flag} {example}.")
    if args.seed > SEED_MAX:  # Optuna's samplers' range (checked before the storage is opened)
        raise InfeasiblePlanError(f"--seed must be at most 2**32 - 1, got {args.seed}.", hint="Use e.g. --seed 0.")
    if args.study_name is not None and not args.study_name.strip():  # `--study-name "$NAME"` with NAME unset
        raise InfeasiblePlanError(f"--study-name must not be empty, got {args.study_name!r}.", hint="Pass a name, e.g. --study-name resnet101, or leave the flag out for the default name.")
    if not (math.isfinite(args.time_weight) and args.time_weight >= 0):
        raise InfeasiblePlanError(f"--time-weight must be a finite number >= 0, got {args.time_weight}.", hint="Use e.g. 0, 256, 4096 or 65536 (seed 000 §IV-D).")
    profile = Profile.load(args.profile)
    catalog = load_catalog(args.catalog, bandwidth_gbps=args.bandwidth, pricing=args.pricing)
    if args.plots:
        from lightning_distplan.tuner._dashboard import require

        for module in ("optuna_dashboard", "plotly", "matplotlib"):
            require(module)  # before the search, not after
        from lightning_distplan.tuner._storage import StudyStorageError
        from lightning_distplan.tuner.plots import artifact_dir_problem

        problem = artifact_dir_problem(args.storage)
        if problem is not None:
            raise StudyStorageError(problem[0], hint=problem[1])
    result = tune(
        profile,
        catalog=catalog,
        global_batch_size=args.global_batch_size,
        time_weight=args.time_weight,
        n_trials=args.trials,
        storage=args.storage,
        study_name=args.study_name,
        seed=args.seed,
        max_instances=args.max_instances,
        strategies=tuple(args.strategy),
        max_pp=args.max_pp,
        multi_objective=args.multi_objective,
        precision=args.precision,
        progress=not args.no_progress,
    )
    data = result.to_dict()
    if args.plots:
        import optuna

        from lightning_distplan.errors import first_line
        from lightning_distplan.tuner.plots import PlotAttachError, attach_to_study

        study = optuna.load_study(study_name=result.study_name, storage=args.storage)
        try:
            data["plots"] = attach_to_study(study, time_weight=args.time_weight)
        except KeyboardInterrupt:  # the search's trials are already in the study: say so, not "left as it was"
            raise KeyboardInterrupt(
                f"the {result.n_trials} trials were written to study {result.study_name!r}; its plots were not all attached "
                "(run the same command again: it extends the study and attaches them)"
            ) from None
        except Exception as err:  # noqa: BLE001 - same: the trials are kept, and the user must hear it
            raise PlotAttachError(
                f"The {result.n_trials} trials were written to study {result.study_name!r}, but attaching its plots failed "
                f"({type(err).__name__}: {first_line(err)[:200]}).",
                hint="Fix the cause and run the same command again: it extends the study and attaches the plots.",
            ) from None
    if args.format == "json":
        print(json.dumps(data, indent=1))
    else:
        print(_table(data))
    return 0
