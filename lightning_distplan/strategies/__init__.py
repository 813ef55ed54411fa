"""Lightning strategies that run a :class:`~lightning_distplan.Plan`.

``import lightning_distplan`` calls :func:`register_strategies`, after which
``Trainer(strategy="dp_ga" | "gpipe" | "1f1b" | "auto_plan")`` works.
"""

from __future__ import annotations

import importlib
import logging

from lightning_distplan.strategies._checkpoint import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    load_optimizer_state_by_name,
    merge_stage_states,
    optimizer_state_by_name,
    stored_plan,
)
from lightning_distplan.strategies.dp_ga import DPGAStrategy

__all__ = [
    "DPGAStrategy",
    "register_strategies",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "optimizer_state_by_name",
    "load_optimizer_state_by_name",
    "merge_stage_states",
    "stored_plan",
]

log = logging.getLogger(__name__)

# name -> (module, class, description, preset init args). Modules that are not there yet (other
# strategies land separately) are skipped, so importing the package never fails because of them.
_STRATEGIES: tuple[tuple[str, str, str, str, dict], ...] = (
    ("dp_ga", "lightning_distplan.strategies.dp_ga", "DPGAStrategy",
     "Data parallel + gradient accumulation at a given plan's micro-batch size (lightning_distplan).", {}),
    ("gpipe", "lightning_distplan.strategies.pipeline", "PipelineStrategy",
     "Pipeline parallel, GPipe schedule, optional dp x pp (lightning_distplan).", {"schedule": "gpipe"}),
    ("1f1b", "lightning_distplan.strategies.pipeline", "PipelineStrategy",
     "Pipeline parallel, 1F1B schedule, optional dp x pp (lightning_distplan).", {"schedule": "1f1b"}),
    # auto_plan (profile -> plan -> run) is owned by another module; registered once it exists.
    # Its owner: keep module/class names here in sync with the implementation.
    ("auto_plan", "lightning_distplan.strategies.auto_plan", "AutoPlanStrategy",
     "Profile the model, pick the best dp_ga / gpipe / 1f1b plan and run it (lightning_distplan).", {}),
)


def register_strategies() -> list[str]:
    """Register this package's strategies in Lightning's ``StrategyRegistry``.

    Names already present (registered by the user or an earlier call) are left alone, and
    strategies whose module is not importable are skipped.

    Returns:
        The names registered by this call.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    registered = []
    for name, module_name, class_name, description, presets in _STRATEGIES:
        if name in StrategyRegistry:
            continue
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:  # the module exists but one of ITS imports is missing: a real bug
                raise
            log.debug("lightning_distplan: %s not available yet (%s), %r not registered", module_name, err, name)
            continue
        except AttributeError:
            log.debug("lightning_distplan: %s has no %s yet, %r not registered", module_name, class_name, name)
            continue
        StrategyRegistry.register(name, cls, description=description, **presets)
        registered.append(name)
    return registered
