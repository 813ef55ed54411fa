"""A small hardware-search study written with optuna directly, for the plot and dashboard tests.

It carries the same per-trial user attributes the tuner (``lightning_distplan.tuner.search``)
stores, so the plots can be tested without running a search. The numbers come from a toy version
of seed 000 §III-A (T = s·T_calc(m) + S_all(W) − S_over) over four of Table III's instances; they
are plausible, not a prediction of anything.
"""

from __future__ import annotations

import warnings

import optuna

# name: (relative speed, bandwidth Gbps, price RMB/h, GPU memory GB); source: seed 000 Table III.
INSTANCES = {
    "gn6i.xlarge": (1.0, 4.0, 11.67, 16),
    "gn7i.2xlarge": (2.0, 16.0, 12.75, 24),
    "sgn7i.4xlarge": (0.6, 20.0, 5.621, 8),
    "sgn7i.xlarge": (0.15, 5.0, 1.875, 2),
    "gn7e.4xlarge": (5.0, 25.0, 34.742, 80),
}
GRAD_BYTES = 170e6  # ResNet101-sized gradients (seed 000 Table II: 170 MB)
ACT_BYTES_PER_SAMPLE = 198e6  # seed 000 Table II (ResNet101)


def config_attrs(instance: str, count: int, m: int, s: int, global_batch_size: int = 64) -> dict:
    speed, gbps, price, mem_gb = INSTANCES[instance]
    t_calc = (0.05 * m + 0.02) / speed
    bw = gbps * 1e9 / 8
    s_all = 0.0 if count == 1 else 2 * (count - 1) * (1e-4 + GRAD_BYTES / (count * bw))
    s_over = min(s_all, 0.3 * 2 / 3 * t_calc)  # only the last micro-batch's backward overlaps
    optimizer = 0.05 / speed
    time_s = s * t_calc + s_all - s_over + optimizer
    peak = 4 * GRAD_BYTES + m * ACT_BYTES_PER_SAMPLE
    feasible = peak <= mem_gb * 1e9
    cost = count * price / 3600 * time_s
    return {
        "instance_type": instance,
        "count": count,
        "strategy": "dp_ga",
        "schedule": None,
        "dp": count,
        "pp": 1,
        "micro_batch_size": m,
        "accumulate_grad_batches": s,
        "n_microbatches": 1,
        "feasible": feasible,
        "step_time_s": time_s if feasible else None,
        "cost_per_step": cost if feasible else None,
        "currency": "RMB",
        "breakdown": {"compute": s * t_calc, "optimizer": optimizer, "exposed_comm": s_all - s_over, "bubble": 0.0},
        "peak_memory_bytes": peak,
        "price_per_hour": price,
        "projection": {"source_device": "synthetic", "ratio": 1.0 / speed},
        "global_batch_size": global_batch_size,
    }


SMALL = {"instances": ("gn6i.xlarge", "gn7i.2xlarge", "sgn7i.xlarge", "gn7e.4xlarge"), "counts": (1, 2, 4), "micro_batch_sizes": (2, 4, 8, 16)}
"""48 trials (7 infeasible): enough for a front, cheap to write (SQLite costs ~0.1 s per trial on a busy machine)."""


def make_study(
    storage: str | None,
    study_name: str = "distplan-test",
    global_batch_size: int = 64,
    *,
    instances: tuple[str, ...] = tuple(INSTANCES),
    counts: tuple[int, ...] = (1, 2, 4, 8),
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> optuna.Study:
    """Every (instance, count, m, s) with count·m·s = global_batch_size, as finished trials."""
    study = optuna.create_study(storage=storage, study_name=study_name, directions=["minimize", "minimize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["cost_per_step", "step_time_s"])
    study.set_user_attr("time_weight", 0.0)
    for instance in instances:
        for count in counts:
            for m in micro_batch_sizes:
                if global_batch_size % (count * m):
                    continue
                s = global_batch_size // (count * m)
                attrs = config_attrs(instance, count, m, s, global_batch_size)
                params = {"instance_type": instance, "count": count, "micro_batch_size": m}
                dists = {
                    "instance_type": optuna.distributions.CategoricalDistribution(list(INSTANCES)),
                    "count": optuna.distributions.CategoricalDistribution([1, 2, 4, 8]),
                    "micro_batch_size": optuna.distributions.CategoricalDistribution([1, 2, 4, 8, 16]),
                }
                if attrs["feasible"]:
                    trial = optuna.trial.create_trial(params=params, distributions=dists, user_attrs=attrs, values=[attrs["cost_per_step"], attrs["step_time_s"]])
                else:
                    trial = optuna.trial.create_trial(params=params, distributions=dists, user_attrs=attrs, state=optuna.trial.TrialState.PRUNED)
                study.add_trial(trial)
    return study
