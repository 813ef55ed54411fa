"""Cloud hardware search: catalogs of instances and prices, and an Optuna search over the cost model.

Pure Python plus Optuna (no lightning, no torch.distributed): a saved Profile is enough.

Example:
    >>> from lightning_distplan.tuner import tune
    >>> result = tune(profile, catalog="alicloud-2023", global_batch_size=256, time_weight=4096,
    ...               n_trials=300, storage="sqlite:///distplan.db", study_name="resnet101")  # doctest: +SKIP
    >>> result.best.to_dict()["instance_type"], [c.cost_per_step for c in result.pareto]  # doctest: +SKIP
"""

from __future__ import annotations

from lightning_distplan.tuner._space import ConfigSpace, TunedConfig
from lightning_distplan.tuner.catalog import BUILTIN_CATALOGS, PRICINGS, Catalog, Instance, load_catalog, parse_catalog_csv, spot_priced
from lightning_distplan.tuner.search import (
    TIME_WEIGHTS,
    ExhaustiveResult,
    StudyConflictError,
    StudyStorageError,
    TuneResult,
    exhaustive,
    pareto_front,
    tune,
)

__all__ = [
    "Catalog",
    "Instance",
    "BUILTIN_CATALOGS",
    "load_catalog",
    "parse_catalog_csv",
    "spot_priced",
    "PRICINGS",
    "ConfigSpace",
    "TunedConfig",
    "TuneResult",
    "ExhaustiveResult",
    "StudyStorageError",
    "StudyConflictError",
    "TIME_WEIGHTS",
    "tune",
    "exhaustive",
    "pareto_front",
]
