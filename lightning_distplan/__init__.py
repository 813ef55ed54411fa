"""lightning_distplan: profile a LightningModule, plan data/pipeline parallelism, run the plan,
and search cloud hardware — with one line: ``Trainer(strategy="auto_plan")``.

Importing the package registers the strategy names ``auto_plan``, ``dp_ga``, ``gpipe`` and
``1f1b`` in Lightning's ``StrategyRegistry`` (names already present are left alone).
"""

from __future__ import annotations

import sys

from lightning_distplan._layers import PipelineSpec
from lightning_distplan.errors import (
    BatchFormatError,
    BatchNotFactorableError,
    CatalogError,
    CheckpointMismatchError,
    DemoArgumentError,
    DeviceUnavailableError,
    DistPlanError,
    InfeasiblePlanError,
    ModelSplitError,
    OutputPathError,
    ProfileFormatError,
)
from lightning_distplan.plan import Plan
from lightning_distplan.profile import Profile

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "Profile",
    "PipelineSpec",
    "DistPlanError",
    "ProfileFormatError",
    "InfeasiblePlanError",
    "BatchNotFactorableError",
    "ModelSplitError",
    "CatalogError",
    "DeviceUnavailableError",
    "BatchFormatError",
    "CheckpointMismatchError",
    "DemoArgumentError",
    "OutputPathError",
    "PlanningCallback",
    "StepTimeMonitor",
]


def _register_strategies() -> None:
    if getattr(sys.modules.get("_distplan_cli"), "starting", False):
        # The ``distplan`` console script is importing us: ``plan``, ``tune`` and ``dashboard`` need
        # neither torch nor lightning (seconds to import), and it registers them for the others.
        return
    try:
        from lightning_distplan.strategies import register_strategies
    except ImportError as err:  # strategies need lightning; the pure core does not
        if "lightning" in str(err) or "lightning_distplan.strategies" in str(err):
            return
        raise
    register_strategies()


_register_strategies()


def __getattr__(name: str):  # lazy: keep `import lightning_distplan` light
    if name in ("PlanningCallback", "StepTimeMonitor"):
        from lightning_distplan import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'lightning_distplan' has no attribute {name!r}")
