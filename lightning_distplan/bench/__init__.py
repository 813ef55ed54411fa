"""Predicted vs measured: run candidate plans for real and grade the cost model and the planner.

``run_bench`` profiles a LightningModule, ranks the plans, trains each chosen plan for a few
optimizer steps with this package's own strategies (a fresh Lightning Trainer per plan, in the
processes of the live process group), and reports per-plan error, median and p90 |error|,
whether the planner's pick is the measured best (or within 5% of it) and the regret.
``distplan bench`` is its command line.

Example:
    >>> from lightning_distplan.bench import run_bench, format_table  # doctest: +SKIP
    >>> result = run_bench(make_module, loader, world_size=1, global_batch_size=16, steps=3)  # doctest: +SKIP
    >>> print(format_table(result))  # doctest: +SKIP
"""

from __future__ import annotations

from lightning_distplan.bench._bench import BENCH_LINK_SIZES, RESULT_SCHEMA, BenchError, parse_plans_spec, run_bench, select_candidates
from lightning_distplan.bench._compare import CONFIRM_BAND, CONFIRM_LIMIT, WITHIN, confirm_candidates, first_profile_view, percentile, predict_ranked, relative_error, summarize
from lightning_distplan.bench._report import draw_result, format_table, plot_result

__all__ = [
    "run_bench",
    "select_candidates",
    "parse_plans_spec",
    "summarize",
    "predict_ranked",
    "first_profile_view",
    "confirm_candidates",
    "relative_error",
    "percentile",
    "format_table",
    "plot_result",
    "draw_result",
    "BenchError",
    "RESULT_SCHEMA",
    "BENCH_LINK_SIZES",
    "WITHIN",
    "CONFIRM_BAND",
    "CONFIRM_LIMIT",
]
