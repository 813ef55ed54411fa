"""The whole model's gradient norm for user hooks (``trainer.strategy.grad_norm()``), under every strategy of this package."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import Tensor

from lightning_distplan.errors import InfeasiblePlanError

__all__ = ["gradient_norm", "norm_order"]


def norm_order(norm_type: object) -> float:
    """``norm_type`` as a float, checked before any gradient (or device) is looked at.

    Raises:
        InfeasiblePlanError: (a ``ValueError``) ``norm_type`` is not a positive number or ``inf``.
    """
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise InfeasiblePlanError(f"`norm_type` must be a positive number or inf, got {norm_type!r}.", hint="Use 2.0 (the default), 1.0 or float('inf').")
    return float(norm_type)


def gradient_norm(
    grads: Iterable[Tensor], p: float, *, device: torch.device, combine: Callable[[Tensor, bool], None] | None = None
) -> Tensor:
    """The ``p``-norm (:func:`norm_order`) of ``grads`` taken as one vector (float32), as ``torch.nn.utils.clip_grad_norm_``
    takes it, on ``device``.

    ``combine(partial, is_max)``: reduces in place the partial norm of several processes' disjoint shares (the sum of
    ``|g|^p``, or the max for ``inf``), e.g. an all-reduce over a pipeline's stages.
    """
    norms = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device) for g in grads]
    is_max = math.isinf(p)
    partial = torch.zeros((), dtype=torch.float32, device=device)
    if norms:
        partial = torch.stack(norms).max() if is_max else torch.stack([n**p for n in norms]).sum()
    if combine is not None:
        combine(partial, is_max)
    return partial if is_max else partial ** (1.0 / p)
