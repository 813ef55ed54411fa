"""fairscale's DeferredBatchNorm for pipelines: batch statistics over all micro-batches of a step."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_distplan.errors import DistPlanError, InfeasiblePlanError

__all__ = [
    "DeferredBatchNormUnsupportedError", "convert_deferred_batchnorm", "restore_batchnorm", "skip_metadata_inference_tracking",
]

Swapped = list[tuple[nn.Module, str, nn.Module]]
"""(parent, attribute name, the user's original BatchNorm) of every layer replaced."""


def convert_deferred_batchnorm(layer: nn.Module, *, chunks: int) -> Swapped:
    """Replace, in place, every BatchNorm below ``layer`` (the LightningModule, before the pipeline split) by ``DeferredBatchNorm(chunks=chunks)``.

    Running statistics then accumulate over the ``chunks`` micro-batches and are committed once per
    step, as a single full-batch forward would do. The parameters and running buffers are the
    original layer's, and DeferredBatchNorm's accumulators (``sum``/``sum_squares``) are not
    persistent, so ``state_dict`` has exactly the plain module's keys: its checkpoints load into the
    plain module and resume anywhere. :func:`restore_batchnorm` puts the originals back.
    """
    try:
        from fairscale.nn.pipe.batchnorm import DeferredBatchNorm
    except ImportError as err:  # pragma: no cover - fairscale is a declared dependency
        raise InfeasiblePlanError(
            f"`deferred_batchnorm=True` needs fairscale ({err}).", hint="pip install fairscale"
        ) from None
    swapped: Swapped = []
    for name, child in list(layer.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, DeferredBatchNorm):
            deferred = DeferredBatchNorm.convert_deferred_batch_norm(child, chunks)
            if deferred is not child:  # (a BatchNorm without running statistics stays as it is)
                for accumulator in ("sum", "sum_squares"):
                    deferred.register_buffer(accumulator, deferred._buffers[accumulator], persistent=False)
                setattr(layer, name, deferred)
                swapped.append((layer, name, child))
        else:
            swapped += convert_deferred_batchnorm(child, chunks=chunks)
    return swapped


def restore_batchnorm(swapped: Swapped) -> None:
    """Put the user's BatchNorm layers back, holding the deferred layers' current parameters and buffers.

    Moving the module between devices gave the deferred layers new buffer tensors, so the
    originals take whatever the deferred layers hold now.
    """
    for parent, name, original in swapped:
        deferred = getattr(parent, name)
        for key in original._parameters:
            original._parameters[key] = deferred._parameters[key]
        for key in original._buffers:
            original._buffers[key] = deferred._buffers[key]
        original.train(deferred.training)
        setattr(parent, name, original)


def skip_metadata_inference_tracking(stage: Any) -> None:
    """Keep ``torch.distributed.pipelining``'s metadata-inference forward out of the batch statistics.

    On its first step a ``PipelineStage`` runs one extra forward (the real first micro-batch on
    stage 0, *uninitialised* tensors of the right shape on later stages) to learn the shapes. A
    DeferredBatchNorm would count it as a micro-batch: the step's statistics would include it
    (garbage on later stages) and every later commit would be shifted by one micro-batch. fairscale
    already skips tracking under checkpoint recomputation, so that forward runs with its flag set.
    """
    from fairscale.nn.pipe.checkpoint import enable_recomputing

    original = getattr(stage, "_forward_metadata_inference", None)
    if original is None:
        raise DeferredBatchNormUnsupportedError(
            f"This torch version's PipelineStage ({torch.__version__}) has no `_forward_metadata_inference` to guard, "
            "so DeferredBatchNorm statistics would include its shape-inference forward.",
            hint="Use deferred_batchnorm=False (per-micro-batch statistics) or torch 2.14.",
        )

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with enable_recomputing():
            return original(*args, **kwargs)

    stage._forward_metadata_inference = guarded


class DeferredBatchNormUnsupportedError(DistPlanError, NotImplementedError):
    """DeferredBatchNorm cannot be made exact with this runtime."""
