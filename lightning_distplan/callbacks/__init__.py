"""Lightning callbacks: :class:`PlanningCallback` (profile → plan → apply within your strategy) and
:class:`StepTimeMonitor` (predicted vs observed step time, opt-in re-plan; added by ``auto_plan``)."""

from __future__ import annotations

from lightning_distplan.callbacks.monitor import StepTimeMonitor, StepTimeSummary
from lightning_distplan.callbacks.planning import PlanningCallback

__all__ = ["PlanningCallback", "StepTimeMonitor", "StepTimeSummary"]
