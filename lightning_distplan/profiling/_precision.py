"""Lightning's precision plugin for a ``Trainer(precision=...)`` name, for profiling outside a fit."""

from __future__ import annotations

from typing import Any

import torch

from lightning_distplan.profile import PRECISIONS

__all__ = ["PRECISIONS", "precision_plugin", "trainer_precision"]


def trainer_precision(name: str, device: torch.device) -> str:
    """The precision ``Trainer(precision=name)`` runs on ``device``: Lightning runs ``"16-mixed"`` as ``"bf16-mixed"`` on a CPU."""
    return "bf16-mixed" if name == "16-mixed" and device.type == "cpu" else name


def precision_plugin(name: str, device: torch.device) -> Any:
    """The precision plugin ``Trainer(precision=name)`` would use on ``device``.

    Profiling runs each step in its ``train_step_context()`` on ``convert_input``-ed batches, with
    the module converted by ``convert_module`` first, as a fit in that precision runs them.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    name = trainer_precision(name, device)
    if name.endswith("-mixed"):
        return MixedPrecision(name, device=device.type)  # type: ignore[arg-type]
    if name in ("bf16-true", "16-true"):
        return HalfPrecision(name)  # type: ignore[arg-type]
    return DoublePrecision() if name == "64-true" else Precision()
