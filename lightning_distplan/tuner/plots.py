"""Plots of a hardware-search study: the (cost, time) Pareto front and the time breakdown.

Data extraction is separate from drawing, as in :mod:`optuna.visualization`:
:func:`_get_pareto_info` / :func:`_get_breakdown_info` turn a study (or its trials) into plain
NamedTuples; the ``plot_*`` functions draw them with plotly (interactive HTML, and what
optuna-dashboard shows) and matplotlib (static PNG, offline, no browser needed — plotly's PNG
export through kaleido needs a headless Chrome).

Every trial the tuner stores carries these user attributes (``lightning_distplan.tuner.search``):
``instance_type``, ``count``, ``strategy``, ``schedule``, ``dp``, ``pp``, ``micro_batch_size``,
``accumulate_grad_batches`` / ``n_microbatches``, ``feasible``, ``step_time_s``,
``cost_per_step``, ``currency``, ``breakdown`` (``compute``, ``optimizer``, ``exposed_comm``,
``bubble`` seconds), ``peak_memory_bytes``, ``price_per_hour``, ``projection``.

:func:`attach_to_study` stores the results where optuna-dashboard shows them: a Markdown note
(best configuration and Pareto front), the two figures as dashboard plots, and the PNGs as study
artifacts.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from lightning_distplan._files import check_output_path, save_figure_atomic, write_text_atomic
from lightning_distplan.costmodel import BREAKDOWN_KEYS
from lightning_distplan.errors import DistPlanError
from lightning_distplan.plan import as_int
from lightning_distplan.tuner._dashboard import default_artifact_dir, require

if TYPE_CHECKING:
    import optuna
    import plotly.graph_objects as go
    from optuna.trial import FrozenTrial

__all__ = ["PlotAttachError", "plot_pareto_front", "plot_time_breakdown", "attach_to_study", "artifact_dir_problem", "summary_markdown"]

# Order of the stacked bars, bottom to top, and their colours (colour-blind safe, Okabe-Ito).
BREAKDOWN_PARTS = BREAKDOWN_KEYS
"""Every part of the cost model's step time (a part left out showed as an unexplained "other" gap)."""
_PART_LABEL = {
    "compute": "compute",
    "p2p": "pipeline hand-overs",
    "bubble": "pipeline bubble",
    "exposed_comm": "exposed communication",
    "optimizer": "optimizer step",
    "framework": "training loop",
    "sync_wait": "waiting for the slowest rank",
    "other": "other (step time − parts)",
}
_PART_COLOR = {
    "compute": "#0072B2",
    "p2p": "#56B4E9",
    "bubble": "#CC79A7",
    "exposed_comm": "#E69F00",
    "optimizer": "#009E73",
    "framework": "#F0E442",
    "sync_wait": "#8C564B",
    "other": "#999999",
}
_FRONT_COLOR = "#D55E00"
_DOMINATED_COLOR = "#7f9fbf"
# The four weights of seed 000 §IV-D (objective C + w·T); used only to mark their optima.
SEED000_TIME_WEIGHTS = (0.0, 2.0**8, 2.0**12, 2.0**16)

PARETO_GRAPH_ID = "distplan-pareto-front"
BREAKDOWN_GRAPH_ID = "distplan-time-breakdown"


class _ConfigPoint(NamedTuple):
    trial_number: int
    instance_type: str
    count: int
    strategy: str
    schedule: str | None
    dp: int
    pp: int
    micro_batch_size: int
    accumulation: int
    """``accumulate_grad_batches`` for dp_ga, ``n_microbatches`` for pipelines."""
    step_time_s: float
    cost_per_step: float
    currency: str
    breakdown: dict[str, float]
    peak_memory_bytes: float | None
    price_per_hour: float | None
    projection: Any

    @property
    def hardware(self) -> str:
        return f"{self.instance_type}×{self.count}"

    @property
    def plan(self) -> str:
        if self.strategy == "dp_ga":
            return f"dp_ga dp={self.dp} m={self.micro_batch_size} s={self.accumulation}"
        return f"{self.strategy} dp={self.dp} pp={self.pp} m={self.micro_batch_size} n={self.accumulation}"

    @property
    def label(self) -> str:
        return f"{self.hardware} · {self.plan}"

    def objective(self, time_weight: float) -> float:
        # seed 000 §IV-D: min C_iter + w·T_iter
        return self.cost_per_step + time_weight * self.step_time_s


class _ParetoInfo(NamedTuple):
    study_name: str | None
    points: list[_ConfigPoint]
    """Feasible, distinct configurations (first trial of each), in trial order."""
    front: list[_ConfigPoint]
    """Non-dominated points in (cost, time), sorted by step time."""
    best_by_weight: dict[float, _ConfigPoint]
    """Optimum of C + w·T for each of seed 000's weights."""
    n_trials: int
    n_infeasible: int
    currency: str


class _BreakdownInfo(NamedTuple):
    study_name: str | None
    points: list[_ConfigPoint]
    """Top-k feasible configurations by C + w·T, best first."""
    parts: dict[str, list[float]]
    """Seconds per part (BREAKDOWN_PARTS, plus ``other`` when the parts do not sum to the step time)."""
    time_weight: float
    currency: str


def _trials_of(study_or_trials: optuna.Study | Sequence[FrozenTrial]) -> tuple[str | None, list[FrozenTrial], dict[str, Any]]:
    import optuna

    if isinstance(study_or_trials, optuna.Study):
        return study_or_trials.study_name, study_or_trials.get_trials(deepcopy=False), dict(study_or_trials.user_attrs)
    trials = list(study_or_trials)
    if not all(isinstance(t, optuna.trial.FrozenTrial) for t in trials):
        raise TypeError(
            f"Expected an optuna.Study or a sequence of FrozenTrial, got {type(study_or_trials).__name__} holding other objects. "
            "HINT: Pass `optuna.load_study(...)` or `study.trials`."
        )
    return None, trials, {}


def _point(trial: FrozenTrial) -> _ConfigPoint | None:
    """The configuration a finished, feasible trial evaluated, or None."""
    a = trial.user_attrs
    if trial.state.name != "COMPLETE" or not a.get("feasible", False):
        return None
    try:
        time_s = float(a["step_time_s"])
        cost = float(a["cost_per_step"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(time_s) and math.isfinite(cost)):
        return None
    strategy = str(a.get("strategy", "dp_ga"))
    accumulation = a.get("accumulate_grad_batches") if strategy == "dp_ga" else a.get("n_microbatches")
    breakdown = {str(k): float(v) for k, v in (a.get("breakdown") or {}).items() if isinstance(v, (int, float))}
    return _ConfigPoint(
        trial_number=trial.number,
        instance_type=str(a.get("instance_type", "?")),
        count=int(a.get("count", 1)),
        strategy=strategy,
        schedule=a.get("schedule"),
        dp=int(a.get("dp", 1)),
        pp=int(a.get("pp", 1)),
        micro_batch_size=int(a.get("micro_batch_size", 0)),
        accumulation=int(accumulation or 1),
        step_time_s=time_s,
        cost_per_step=cost,
        currency=str(a.get("currency", "")),
        breakdown=breakdown,
        peak_memory_bytes=a.get("peak_memory_bytes"),
        price_per_hour=a.get("price_per_hour"),
        projection=a.get("projection"),
    )


def _feasible_points(trials: Sequence[FrozenTrial]) -> tuple[list[_ConfigPoint], int]:
    """Distinct feasible configurations (samplers revisit points; plot each once) and the infeasible count."""
    seen: set[tuple[Any, ...]] = set()
    points: list[_ConfigPoint] = []
    n_infeasible = 0
    for trial in trials:
        if trial.state.name in ("RUNNING", "WAITING"):
            continue
        point = _point(trial)
        if point is None:
            n_infeasible += 1
            continue
        key = (point.instance_type, point.count, point.strategy, point.schedule, point.dp, point.pp, point.micro_batch_size, point.accumulation)
        if key in seen:
            continue
        seen.add(key)
        points.append(point)
    return points, n_infeasible


def _pareto_front(points: Sequence[_ConfigPoint]) -> list[_ConfigPoint]:
    """Points no other point beats in both cost and time (ties kept once), sorted by time."""
    front: list[_ConfigPoint] = []
    best_cost = math.inf
    for p in sorted(points, key=lambda p: (p.step_time_s, p.cost_per_step)):
        if p.cost_per_step < best_cost:
            front.append(p)
            best_cost = p.cost_per_step
    return front


def _currency(points: Sequence[_ConfigPoint]) -> str:
    currencies = sorted({p.currency for p in points if p.currency})
    return "/".join(currencies) if currencies else "currency units"


def _get_pareto_info(study_or_trials: optuna.Study | Sequence[FrozenTrial]) -> _ParetoInfo:
    name, trials, _ = _trials_of(study_or_trials)
    points, n_infeasible = _feasible_points(trials)
    best = {w: min(points, key=lambda p, w=w: p.objective(w)) for w in SEED000_TIME_WEIGHTS} if points else {}
    return _ParetoInfo(
        study_name=name,
        points=points,
        front=_pareto_front(points),
        best_by_weight=best,
        n_trials=len(trials),
        n_infeasible=n_infeasible,
        currency=_currency(points),
    )


def _check_top_k(top_k: Any) -> int:
    """``top_k`` as an int: a Python or numpy integer >= 1 (not a bool)."""
    k = as_int(top_k)
    if k is None or k < 1:
        raise ValueError(f"`top_k` must be an integer >= 1, got {top_k!r}. HINT: Pass the number of configurations to show, e.g. top_k=8.")
    return k


def _check_time_weight(time_weight: Any) -> float | None:
    """None (the study's own w) or a finite w >= 0 (a Python or numpy number, not a bool) as a float, as the tuner
    takes: a negative w ranked the slowest first, NaN at random."""
    if time_weight is None:
        return None
    if not isinstance(time_weight, numbers.Real) or isinstance(time_weight, bool) or not math.isfinite(time_weight) or time_weight < 0:
        raise ValueError(
            f"`time_weight` must be a finite number >= 0 or None, got {time_weight!r}. "
            "HINT: Use e.g. 0, 256, 4096 or 65536 (seed 000 §IV-D), or None for the study's own."
        )
    return float(time_weight)


def _get_breakdown_info(study_or_trials: optuna.Study | Sequence[FrozenTrial], *, top_k: int = 8, time_weight: float | None = None) -> _BreakdownInfo:
    top_k = _check_top_k(top_k)
    time_weight = _check_time_weight(time_weight)
    name, trials, study_attrs = _trials_of(study_or_trials)
    if time_weight is None:
        time_weight = float(study_attrs.get("time_weight", 0.0))
    points, _ = _feasible_points(trials)
    ranked = sorted(points, key=lambda p: (p.objective(time_weight), p.step_time_s))[:top_k]
    parts: dict[str, list[float]] = {part: [p.breakdown.get(part, 0.0) for p in ranked] for part in BREAKDOWN_PARTS}
    parts = {part: v for part, v in parts.items() if part == "compute" or any(v)}  # no legend entry for a part that is 0 everywhere
    # The model's parts should add up to the step time; if a cost model reports parts that do
    # not, show the gap instead of hiding it.
    other = [p.step_time_s - sum(p.breakdown.get(part, 0.0) for part in BREAKDOWN_PARTS) for p in ranked]
    if any(abs(o) > 1e-3 * max(p.step_time_s, 1e-12) for o, p in zip(other, ranked)):
        parts["other"] = [max(o, 0.0) for o in other]
    return _BreakdownInfo(study_name=name, points=ranked, parts=parts, time_weight=time_weight, currency=_currency(ranked))


# -- plotting ----------------------------------------------------------------------------------


def _fmt_time(seconds: float) -> str:
    """Four significant digits: a front of sub-millisecond steps (0.2252 and 0.1564 ms) must not read 0.2 ms twice."""
    return f"{seconds * 1e3:.4g} ms" if seconds < 1 else f"{seconds:.4g} s"


def _hover(p: _ConfigPoint) -> str:
    lines = [
        f"trial {p.trial_number}: <b>{p.hardware}</b>",
        p.plan + (f" ({p.schedule})" if p.schedule and p.schedule != p.strategy else ""),
        f"time/step {_fmt_time(p.step_time_s)}",
        f"cost/step {p.cost_per_step:.4g} {p.currency}",
    ]
    if p.peak_memory_bytes:
        lines.append(f"peak memory {float(p.peak_memory_bytes) / 2**30:.2f} GiB")
    if p.price_per_hour is not None:
        lines.append(f"price {p.price_per_hour} {p.currency}/h")
    return "<br>".join(lines)


def _title(kind: str, name: str | None) -> str:
    return f"{kind} — {name}" if name else kind


def _pareto_plotly(info: _ParetoInfo) -> go.Figure:
    go = require("plotly").graph_objects
    front_ids = {p.trial_number for p in info.front}
    dominated = [p for p in info.points if p.trial_number not in front_ids]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[p.step_time_s for p in dominated],
            y=[p.cost_per_step for p in dominated],
            mode="markers",
            name="dominated",
            marker={"color": _DOMINATED_COLOR, "size": 7, "opacity": 0.6},
            hovertext=[_hover(p) for p in dominated],
            hoverinfo="text",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[p.step_time_s for p in info.front],
            y=[p.cost_per_step for p in info.front],
            mode="lines+markers+text",
            name="Pareto front",
            line={"color": _FRONT_COLOR, "shape": "hv"},
            marker={"color": _FRONT_COLOR, "size": 10},
            text=[f"F{i}" for i in range(1, len(info.front) + 1)],
            textposition="top right",
            hovertext=[_hover(p) for p in info.front],
            hoverinfo="text",
        )
    )
    # One legend row per front point spells out hardware and plan (labels on the plot collide).
    for i, p in enumerate(info.front, start=1):
        fig.add_trace(
            go.Scatter(
                x=[p.step_time_s],
                y=[p.cost_per_step],
                mode="markers",
                name=f"F{i} {p.label}",
                marker={"color": _FRONT_COLOR, "size": 10},
                hovertext=[_hover(p)],
                hoverinfo="text",
                legendgroup="front",
            )
        )
    fig.update_layout(
        title=_title("Cost vs time per step", info.study_name)
        + f"<br><sup>{len(info.points)} feasible configurations, {len(info.front)} on the front, {info.n_infeasible} infeasible trials</sup>",
        xaxis_title="time per step (s)",
        yaxis_title=f"cost per step ({info.currency})",
        xaxis_type="log" if _log_axis([p.step_time_s for p in info.points]) else "linear",
        yaxis_type="log" if _log_axis([p.cost_per_step for p in info.points]) else "linear",
        template="plotly_white",
        margin={"t": 80},
    )
    return fig


def _log_axis(values: Sequence[float]) -> bool:
    """Log scale when the values span more than 20x (cheap slow and fast costly configs together)."""
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) / min(positive) > 20


def _pareto_png(info: _ParetoInfo, path: Path) -> None:
    require("matplotlib")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(12, 6.5), dpi=110, layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=(5, 3))
    ax = fig.add_subplot(grid[0])
    side = fig.add_subplot(grid[1])
    front_ids = {p.trial_number for p in info.front}
    dominated = [p for p in info.points if p.trial_number not in front_ids]
    ax.scatter([p.step_time_s for p in dominated], [p.cost_per_step for p in dominated], s=18, color=_DOMINATED_COLOR, alpha=0.6, label="dominated")
    ax.step([p.step_time_s for p in info.front], [p.cost_per_step for p in info.front], where="post", color=_FRONT_COLOR, alpha=0.7)
    ax.scatter([p.step_time_s for p in info.front], [p.cost_per_step for p in info.front], s=40, color=_FRONT_COLOR, zorder=3, label="Pareto front")
    # Front points are numbered on the plot and spelled out beside it: full labels collide.
    for i, p in enumerate(info.front, start=1):
        ax.annotate(f"F{i}", (p.step_time_s, p.cost_per_step), textcoords="offset points", xytext=(4, 4), fontsize=8, color=_FRONT_COLOR, fontweight="bold")
    if _log_axis([p.step_time_s for p in info.points]):
        ax.set_xscale("log")
    if _log_axis([p.cost_per_step for p in info.points]):
        ax.set_yscale("log")
    ax.set_xlabel("time per step (s)")
    ax.set_ylabel(f"cost per step ({info.currency})")
    ax.set_title(_title("Cost vs time per step", info.study_name) + f"\n{len(info.points)} feasible, {len(info.front)} on the front, {info.n_infeasible} infeasible trials", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize=8)
    side.axis("off")
    rows = [f"F{i}  {p.label}\n     {_fmt_time(p.step_time_s)}/step, {p.cost_per_step:.4g} {p.currency}/step" for i, p in enumerate(info.front, start=1)]
    side.text(0.0, 1.0, "Pareto front (fastest first)\n\n" + "\n".join(rows), va="top", ha="left", fontsize=8, family="monospace", transform=side.transAxes)
    _save_png(fig, path)


def _breakdown_plotly(info: _BreakdownInfo) -> go.Figure:
    go = require("plotly").graph_objects
    labels = [f"#{i + 1} {p.label}" for i, p in enumerate(info.points)]
    fig = go.Figure()
    for part, seconds in info.parts.items():
        fig.add_trace(go.Bar(x=labels, y=seconds, name=_PART_LABEL[part], marker_color=_PART_COLOR[part]))
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[p.step_time_s for p in info.points],
            mode="markers",
            name="predicted step time",
            marker={"symbol": "line-ew-open", "size": 24, "color": "black"},
            hovertext=[f"{_fmt_time(p.step_time_s)}, {p.cost_per_step:.4g} {p.currency}/step" for p in info.points],
            hoverinfo="text",
        )
    )
    fig.update_layout(
        barmode="stack",
        title=_title(f"Time breakdown of the top {len(info.points)} configurations (C + {info.time_weight:g}·T)", info.study_name),
        yaxis_title="seconds per step",
        template="plotly_white",
        xaxis_tickangle=-30,
        legend={"orientation": "h", "y": 1.08},
        margin={"b": 160},
    )
    return fig


def _breakdown_png(info: _BreakdownInfo, path: Path) -> None:
    require("matplotlib")
    from matplotlib.figure import Figure

    n = len(info.points)
    fig = Figure(figsize=(max(7.0, 1.1 * n + 3), 6), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(n))
    bottom = [0.0] * n
    for part, seconds in info.parts.items():
        ax.bar(xs, seconds, bottom=bottom, color=_PART_COLOR[part], label=_PART_LABEL[part], width=0.7)
        bottom = [b + s for b, s in zip(bottom, seconds)]
    ax.scatter(xs, [p.step_time_s for p in info.points], marker="_", s=600, color="black", zorder=3, label="predicted step time")
    ax.set_xticks(xs, [f"#{i + 1} {p.hardware}\n{p.plan}" for i, p in enumerate(info.points)], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(_title(f"Time breakdown, top {n} by C + {info.time_weight:g}·T", info.study_name), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save_png(fig, path)


def _save_png(fig: Any, path: Path) -> None:
    save_figure_atomic(fig, path, fmt="png")  # a failure leaves the file there before as it was


def _write_html(fig: go.Figure, path: Path) -> None:
    # plotly.js inline (~4.8 MB): the file must open where there is no internet, as on our CI.
    write_text_atomic(path, fig.to_html(include_plotlyjs=True, full_html=True))


def _render(
    info: Any, *, empty: str, plotly: Callable[[Any], go.Figure], png: Callable[[Any, Path], None],
    path_html: str | Path | None, path_png: str | Path | None,
) -> go.Figure:
    """The plotly figure of ``info``, also written where asked; ``empty`` is the sentence raised when there are no points."""
    if not info.points:
        raise ValueError(f"{empty} HINT: widen the catalog or the global batch size, or run more trials.")
    # before drawing: a folder, a path under a file or a read-only one raised a bare OSError from the writer
    if path_html is not None:
        path_html = check_output_path(path_html, "path_html", example="plot.html")
    if path_png is not None:
        path_png = check_output_path(path_png, "path_png", example="plot.png")
    fig = plotly(info)
    if path_html is not None:
        _write_html(fig, Path(path_html))
    if path_png is not None:
        png(info, Path(path_png))
    return fig


def plot_pareto_front(
    study_or_trials: optuna.Study | Sequence[FrozenTrial],
    *,
    path_html: str | Path | None = None,
    path_png: str | Path | None = None,
) -> go.Figure:
    """Cost per step against time per step for every feasible configuration, front highlighted.

    Each point is one distinct (instance type × count, plan) the tuner evaluated; the Pareto
    front (no other point is both cheaper and faster; seed 000 §IV-D) is drawn as a staircase
    and labelled with hardware and plan.

    Args:
        study_or_trials: the tuner's study, or its trials.
        path_html: where to write a self-contained interactive HTML file (plotly.js inlined).
        path_png: where to write a static PNG (matplotlib).

    Returns:
        The plotly figure.

    Raises:
        ValueError: no trial is feasible, so there is nothing to plot.
    """
    info = _get_pareto_info(study_or_trials)
    return _render(
        info, empty=f"No feasible configuration among {info.n_trials} trials of study {info.study_name!r}, so there is no Pareto front.",
        plotly=_pareto_plotly, png=_pareto_png, path_html=path_html, path_png=path_png,
    )


def plot_time_breakdown(
    study_or_trials: optuna.Study | Sequence[FrozenTrial],
    *,
    top_k: int = 8,
    time_weight: float | None = None,
    path_html: str | Path | None = None,
    path_png: str | Path | None = None,
) -> go.Figure:
    """Stacked bars of predicted compute / exposed communication / bubble / optimizer time.

    Args:
        study_or_trials: the tuner's study, or its trials.
        top_k: how many configurations to show, best first.
        time_weight: w of the ranking objective C + w·T (seed 000 §IV-D); default: the study's
            ``time_weight`` user attribute, else 0 (cheapest first).
        path_html: where to write a self-contained interactive HTML file (plotly.js inlined).
        path_png: where to write a static PNG (matplotlib).

    Returns:
        The plotly figure.
    """
    info = _get_breakdown_info(study_or_trials, top_k=top_k, time_weight=time_weight)
    return _render(
        info, empty=f"No feasible configuration in study {info.study_name!r}, so there is no breakdown to plot.",
        plotly=_breakdown_plotly, png=_breakdown_png, path_html=path_html, path_png=path_png,
    )


def summary_markdown(study_or_trials: optuna.Study | Sequence[FrozenTrial], *, time_weight: float | None = None) -> str:
    """A Markdown note: the best configuration for the study's objective and the Pareto front."""
    time_weight = _check_time_weight(time_weight)
    info = _get_pareto_info(study_or_trials)
    if time_weight is None:
        _, _, attrs = _trials_of(study_or_trials)
        time_weight = float(attrs.get("time_weight", 0.0))
    cur = info.currency
    lines = [f"# lightning_distplan: {info.study_name or 'hardware search'}", ""]
    lines.append(f"{info.n_trials} trials, {len(info.points)} distinct feasible configurations, {info.n_infeasible} infeasible.")
    lines.append("Times and costs are model predictions (seed 000 §III-A, eq. (2)/(3)); see each trial's `projection` attribute for how far they were projected.")
    lines.append("")
    if not info.points:
        lines.append("No feasible configuration.")
        return "\n".join(lines)
    best = min(info.points, key=lambda p: (p.objective(time_weight), p.step_time_s))
    lines += [
        f"## Best for C + w·T, w = {time_weight:g}",
        "",
        f"**{best.hardware}**, `{best.plan}` — {_fmt_time(best.step_time_s)}/step, {best.cost_per_step:.4g} {cur}/step (trial {best.trial_number}).",
        "",
        "## Pareto front (cost vs time per step)",
        "",
        f"| trial | hardware | plan | time/step | cost/step ({cur}) |",
        "|---|---|---|---|---|",
    ]
    for p in info.front:
        lines.append(f"| {p.trial_number} | {p.hardware} | `{p.plan}` | {_fmt_time(p.step_time_s)} | {p.cost_per_step:.4g} |")
    lines += ["", "## Optimum per time weight (seed 000 §IV-D)", "", "| w | hardware | plan | time/step | cost/step |", "|---|---|---|---|---|"]
    for w, p in info.best_by_weight.items():
        lines.append(f"| {w:g} | {p.hardware} | `{p.plan}` | {_fmt_time(p.step_time_s)} | {p.cost_per_step:.4g} |")
    return "\n".join(lines)


class PlotAttachError(DistPlanError, RuntimeError):
    """The plots of a study could not be attached (its trials were written)."""


def artifact_dir_problem(storage_url: str) -> tuple[str, str] | None:
    """(message, hint) when the plots of a study at ``storage_url`` cannot be stored in their default folder
    (``<db stem>-artifacts`` next to a SQLite file): a file of that name is there, or the folder cannot be
    made. Checked before a search, so ``tune --plots`` does not fail after it."""
    folder = default_artifact_dir(storage_url)
    if folder is None:
        return None
    if folder.exists() and not folder.is_dir():
        return (f"The plots of this study go to the folder {str(folder)!r}, but a file of that name is there.",
                "Move that file away, or leave out --plots (and attach the plots later with attach_to_study(study, artifact_dir=...)).")
    nearest = folder if folder.exists() else next((p for p in folder.parents if p.exists()), None)
    if nearest is not None and not os.access(nearest, os.W_OK | os.X_OK):
        return (f"The plots of this study go to {str(folder)!r}, and {str(nearest)!r} is not writable for this user.",
                "Pass a --storage in a writable folder, or leave out --plots.")
    return None


def attach_to_study(
    study: optuna.Study,
    *,
    artifact_dir: str | Path | None = None,
    top_k: int = 8,
    time_weight: float | None = None,
) -> dict[str, Any]:
    """Store the summary note, both figures and their PNGs in the study for optuna-dashboard.

    * the Markdown note (:func:`summary_markdown`) via :func:`optuna_dashboard.save_note`
      (the study's "Note" page);
    * both plotly figures via :func:`optuna_dashboard.save_plotly_graph_object` (drawn on the
      study's main page, next to the dashboard's own Pareto-front plot);
    * both PNGs as study artifacts in a :class:`optuna.artifacts.FileSystemArtifactStore` at
      ``artifact_dir`` (default: ``<db stem>-artifacts`` next to a SQLite file; ``distplan
      dashboard`` serves that directory without a flag).

    Returns:
        What was stored: ``{"note": True, "graph_ids": [...], "artifact_ids": [...], "artifact_dir": str|None,
        "png": {name: file}}``; the artifact store keeps each PNG under its artifact id (no extension), and the
        dashboard shows it by ``name``. Each call adds new artifacts: those of an earlier call stay.
    """
    optuna_dashboard = require("optuna_dashboard")
    import optuna

    top_k = _check_top_k(top_k)  # before the note is saved: not a study with a note and no plots
    time_weight = _check_time_weight(time_weight)
    stored: dict[str, Any] = {"note": False, "graph_ids": [], "artifact_ids": [], "artifact_dir": None, "png": {}}
    optuna_dashboard.save_note(study, summary_markdown(study, time_weight=time_weight))
    stored["note"] = True
    if not _get_pareto_info(study).points:
        return stored
    pareto = plot_pareto_front(study)
    breakdown = plot_time_breakdown(study, top_k=top_k, time_weight=time_weight)
    stored["graph_ids"].append(optuna_dashboard.save_plotly_graph_object(study, pareto, graph_object_id=PARETO_GRAPH_ID))
    stored["graph_ids"].append(optuna_dashboard.save_plotly_graph_object(study, breakdown, graph_object_id=BREAKDOWN_GRAPH_ID))

    if artifact_dir is None:
        url = _storage_url(study)
        artifact_dir = default_artifact_dir(url) if url else None
    if artifact_dir is None:
        return stored
    artifact_dir = Path(artifact_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    store = optuna.artifacts.FileSystemArtifactStore(str(artifact_dir))
    # upload_artifact names the artifact after the file, so write to readable names first: the study's name made
    # safe for a file name ("resnet/run1" is one name, not a folder), in a folder of this run's own.
    import re
    import shutil
    import tempfile

    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", study.study_name).strip("._") or "study"
    staging = Path(tempfile.mkdtemp(prefix="_staging-", dir=artifact_dir))
    pngs = [staging / f"{stem}-pareto_front.png", staging / f"{stem}-time_breakdown.png"]
    try:
        plot_pareto_front(study, path_png=pngs[0])
        plot_time_breakdown(study, top_k=top_k, time_weight=time_weight, path_png=pngs[1])
        for png in pngs:
            stored["artifact_ids"].append(optuna.artifacts.upload_artifact(artifact_store=store, file_path=str(png), study_or_trial=study, mimetype="image/png"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    stored["artifact_dir"] = str(artifact_dir)
    stored["png"] = {p.name: str(artifact_dir / aid) for p, aid in zip(pngs, stored["artifact_ids"])}
    return stored


def _storage_url(study: optuna.Study) -> str | None:
    """The RDB URL a study was opened with, when there is one (private optuna attributes, read defensively)."""
    storage: Any = study._storage
    for _ in range(3):  # _CachedStorage wraps RDBStorage
        url = getattr(storage, "url", None)
        if isinstance(url, str):
            return url
        storage = getattr(storage, "_backend", None)
        if storage is None:
            return None
    return None
