"""Readable table and predicted-vs-measured plot of a benchmark result (data in, text / PNG out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from lightning_distplan._files import save_figure_atomic
from lightning_distplan._format import format_ms

__all__ = ["format_table", "plot_result"]


def _pick_line(s: dict[str, Any]) -> str:
    pick, best = s["pick"], s["measured_best"]
    ran = "FAILED (predicted to run)" if s.get("pick_failed") else f"ran {format_ms(pick['measured_step_time_s'], 1)} ms"
    return (f"pick: rank {pick['rank']} {pick['plan']} {ran}; "
            f"measured best: rank {best['rank']} {best['plan']} {format_ms(best['measured_step_time_s'], 1)} ms")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{format_ms(x, 1):>9}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:8.1f}"


def _min_time(result: Mapping[str, Any]) -> str:
    """`` (timed: at least ~T s, 4-40 steps)`` when ``min_time_s`` lengthened some plan's timing, else ""."""
    counts = [r["timed_steps_per_pass"] for r in result["plans"] if r.get("timed_steps_per_pass")]
    if not result.get("min_time_s") or not counts or max(counts) <= result["steps"]:
        return ""
    return f" (timed: at least ~{result['min_time_s']:g} s, {min(counts)}-{max(counts)} steps)"


def _plans_run(result: Mapping[str, Any]) -> list[str]:
    """How many of the candidate plans ran, where not all did (``--plans top:K``, ranks, plans predicted not to fit)."""
    total, ran = result.get("n_candidates"), len(result["plans"])
    if not total or ran >= total:
        return []
    unfit = sum(not c.get("feasible", True) for c in result.get("candidates_not_run", ()))
    line = f"plans run: {ran} of {total} candidates (--plans {result.get('plans_selection', '?')})"
    if unfit:
        line += f"; {unfit} of the others predicted not to fit"
    if total - ran > unfit:  # plans that might have run faster were not measured
        line += "; the verdict below covers the plans run only"
    return [line]


def format_table(result: Mapping[str, Any]) -> str:
    """Per-plan predicted vs measured step time and memory, then the summary lines."""
    lines = [
        f"distplan bench: {result['model']} on {result['world_size']} x {result['device']['type']} "
        f"({result['device']['name']}), global batch {result['global_batch_size']}, "
        f"{result['warmup']}+{result['steps']} steps per plan" + _min_time(result) + (f" x {result['passes']} passes" if result.get('passes', 1) > 1 else ""),
        *_plans_run(result),
    ]
    for link in result.get("links", []):
        lines.append(
            f"  link {link['kind']:9s}: latency {link['latency_s'] * 1e6:7.0f} us, bandwidth {link['bandwidth_bytes_per_s'] * 8 / 1e6:9.1f} Mbit/s"
        )
    # the rank by the first profile (what --plans N,M selects) beside the final one, where they differ
    firsts = [(r.get("first_profile") or {}).get("rank", r["rank"]) for r in result["plans"]]
    show_first = any(f != r["rank"] for f, r in zip(firsts, result["plans"]))
    first_head = f"{'1st':>4} " if show_first else ""
    width = max([52, *(len(r["plan"]) for r in result["plans"])])  # a plan whole (a long split was cut mid-list)
    header = f"{'rank':>4}  {first_head}{'plan':{width}s} {'pred ms':>9} {'meas ms':>9} {'error':>7}   {'pred MiB':>8} {'meas MiB':>8} {'error':>7}"
    lines += ["", header, "-" * len(header)]
    best_rank = (result["summary"].get("measured_best") or {}).get("rank")
    pick_rank = (result["summary"].get("pick") or {}).get("rank")
    for r, first in zip(result["plans"], firsts):
        mark = ("*" if r["rank"] == pick_rank else " ") + ("!" if r["rank"] == best_rank else " ")
        lines.append(
            f"{r['rank']:>4}{mark}" + (f"{first:>4} " if show_first else "")
            + f"{r['plan']:{width}s} {_ms(r['predicted_step_time_s'])} {_ms(r['measured_step_time_s'])} "
            f"{_pct(r['step_time_error']):>7}   {_mib(r['predicted_peak_memory_bytes'])} {_mib(r['measured_peak_memory_bytes'])} "
            f"{_pct(r['memory_error']):>7}" + (f"  FAILED {r['error']}" if r.get("error") else "")
        )
    s = result["summary"]
    if result.get("stopped"):
        during = [r["rank"] for r in result["plans"] if r.get("confirm_error")]
        # the contender that did not finish on every rank (another may have failed on all of them before it)
        stuck = [r["rank"] for r in result["plans"] if str(r.get("confirm_error") or "").startswith("did not finish on every rank")]
        lines += ["", "STOPPED EARLY: " + str(result["stopped"]).split(" HINT:")[0],
                  "the verdict below covers the plans run before the stop" + (
                      f"; it came in the confirmation passes (rank {(stuck or during)[0]} failed there), which give no verdict"
                      if during else "; it came in the confirmation passes, which give no verdict" if s.get("confirmed_withheld") else "")]
    lines += [
        "",
        "* = planner's pick (best-ranked plan that was run), ! = measured best"
        + (", 1st = rank by the first profile (what --plans N,M names)" if show_first else ""),
        f"memory: predicted peak vs {result['memory_metric']}",
    ]
    if s["n_measured"]:
        lines += [
            f"step time |error|: median {s['median_abs_error']:.1%}, p90 {s['p90_abs_error']:.1%}, max {s['max_abs_error']:.1%}, "
            f"mean signed {s['mean_signed_error']:+.1%} over {s['n_measured']} plans"
            + (f"; Spearman rank correlation {s['spearman']:.2f}" if s.get("spearman") is not None else ""),
            _pick_line(s),
            f"pick is measured best: {s['pick_is_best']}; within {s['within']:.0%} of it: {s['pick_within']}; "
            + ("regret: none (the pick failed)" if s.get("pick_failed") else f"regret {s['regret']:.1%}"),
        ]
        if s.get("pick_ran") is False:
            lines.append(
                f"note: the planner's choice (rank 1 by the final predictions) was not among the plans run, so 'pick' is the "
                f"best-ranked plan that ran (rank {s['pick']['rank']}); the verdict covers the plans run only"
            )
        c = s.get("confirmed")
        if c and c.get("pick_failed"):
            lines.append(
                f"confirmation ({result.get('confirm_passes')} more pass(es)): the pick FAILED ({c['error']}); "
                f"within {s['within']:.0%}: False"
            )
        elif c:
            lines.append(
                f"confirmation ({result.get('confirm_passes')} more pass(es) of {c['n_plans']} contenders, judged on those runs alone): "
                f"pick {format_ms(c['pick']['confirm_step_time_s'], 1)} ms, fastest rank {c['measured_best']['rank']} "
                f"{format_ms(c['measured_best']['confirm_step_time_s'], 1)} ms; within {s['within']:.0%}: {c['pick_within']}; regret {c['regret']:.1%}"
            )
        if s.get("median_abs_memory_error") is not None:
            lines.append(f"memory |error|: median {s['median_abs_memory_error']:.1%}, p90 {s['p90_abs_memory_error']:.1%}")
        first = result.get("summary_first_profile")
        if first and first.get("n_measured") and first.get("pick") and len(result.get("profiles", ())) > 1:
            lines.append(
                f"predictions: {result['prediction_profile']}; from the first profile alone (as auto_plan profiles once): "
                f"median {first['median_abs_error']:.1%}, p90 {first['p90_abs_error']:.1%}, "
                f"pick rank {first['pick']['rank']} {first['pick']['plan']} within {first['within']:.0%} of the best: {first['pick_within']}"
            )
    else:
        lines.append("no plan produced a measurement")
    checks = [c for c in result.get("host_checks", []) if c.get("ratio") is not None]
    if checks:
        lines.append(
            f"host speed: the m={checks[0]['micro_batch_size']} step, timed again after each pass, took "
            + " / ".join(f"{c['ratio']:.2f}x" for c in checks)
            + " the profile's time for it (1.00x: as fast as while profiling; one timing, good to about ±10%)"
        )
    return "\n".join(lines)


def plot_result(result: Mapping[str, Any] | list[Mapping[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """Scatter of predicted vs measured step time (log-log) with y = x and ±10% / ±25% bands.

    ``result`` may be one result or a list of them (e.g. a sweep); points are coloured by strategy
    and the planner's pick of each result is circled. Results carrying a ``rate`` (a sweep's link
    rate) get one marker shape per rate.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [result] if isinstance(result, Mapping) else list(result)
    fig, ax = plt.subplots(figsize=(6, 6))
    draw_result(ax, results, title=title)
    fig.tight_layout()
    try:
        return save_figure_atomic(fig, path, dpi=110)
    finally:
        plt.close(fig)


def draw_result(ax: Any, results: list[Mapping[str, Any]], *, title: str | None = None) -> None:
    """Draw :func:`plot_result`'s scatter into the matplotlib ``ax``: measured plans by strategy (the pick
    circled), failed plans as red crosses at the right edge at their predicted time, y = x and the bands."""
    colours = {"dp_ga": "tab:blue", "gpipe": "tab:orange", "1f1b": "tab:green"}
    xs_all: list[float] = []
    seen: set[str] = set()
    shapes = ("o", "s", "^", "D", "v", "P")
    rates = list(dict.fromkeys(str(res["rate"]) for res in results if "rate" in res))
    failed: list[float] = []  # predicted step times of plans without a measurement (out of memory, ...)
    pick_drawn = False
    for res in results:
        marker = shapes[rates.index(str(res["rate"])) % len(shapes)] if "rate" in res else "o"
        pick = (res["summary"].get("pick") or {}).get("rank")
        for r in res["plans"]:
            if r["measured_step_time_s"] is None:
                if r.get("predicted_step_time_s"):
                    failed.append(r["predicted_step_time_s"])
                    xs_all.append(r["predicted_step_time_s"])
                continue
            x, y = r["measured_step_time_s"], r["predicted_step_time_s"]
            xs_all += [x, y]
            label = r["strategy"] if r["strategy"] not in seen else None
            seen.add(r["strategy"])
            ax.scatter([x], [y], s=22, marker=marker, color=colours.get(r["strategy"], "gray"), label=label, alpha=0.8)
            if r["rank"] == pick:
                ax.scatter([x], [y], s=110, facecolors="none", edgecolors="black", linewidths=1.2)
                pick_drawn = True
    if xs_all:
        lo, hi = min(xs_all) / 1.3, max(xs_all) * 1.3
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
        for band, style in ((0.10, ":"), (0.25, "--")):
            ax.plot([lo, hi], [lo * (1 + band), hi * (1 + band)], "k" + style, lw=0.6)
            ax.plot([lo, hi], [lo * (1 - band), hi * (1 - band)], "k" + style, lw=0.6, label=f"±{band:.0%}")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        if failed:  # no measured time to place them by: at the right edge, at their predicted time
            ax.scatter([hi / 1.08] * len(failed), failed, s=40, marker="x", color="tab:red", label="failed (at the right edge)")
    if not any(r["measured_step_time_s"] is not None for res in results for r in res["plans"]):
        ax.text(0.5, 0.5, "no plan produced a measurement", transform=ax.transAxes, ha="center", va="center", fontsize=10)
    for i, rate in enumerate(rates):  # legend entries for the marker shapes
        ax.scatter([], [], marker=shapes[i % len(shapes)], color="gray", label=f"link {rate}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # plain numbers at 1, 2 and 5 per decade, or more within a narrow range (which had one label, or none); never
    # closer than a factor 1.4 (every digit crowded 0.007, 0.008, 0.009 into one another)
    narrow = bool(xs_all) and max(xs_all) / min(xs_all) < 5
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if narrow else (1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured step time [s]")
    ax.set_ylabel("predicted step time [s]")
    ax.set_title(title or (f"{results[0]['model']}: predicted vs measured" if len(results) == 1 else "predicted vs measured"), fontsize=9)
    if pick_drawn:
        ax.scatter([], [], s=110, facecolors="none", edgecolors="black", linewidths=1.2, label="planner's pick")
    ax.legend(fontsize=8, loc="best")  # where it hides fewest points (a fixed corner hid an over-predicted plan)
    ax.grid(True, which="both", alpha=0.2)
