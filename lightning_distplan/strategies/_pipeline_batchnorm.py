"""fairscale's DeferredBatchNorm for pipelines: batch statistics over all micro-batches of a step."""

from __future__ import annotations

from torch import nn

from lightning_distplan.errors import InfeasiblePlanError

__all__ = ["convert_deferred_batchnorm"]


def convert_deferred_batchnorm(layer: nn.Module, *, chunks: int) -> None:
    """Replace, in place, every BatchNorm below ``layer`` (the LightningModule, before the pipeline split) by ``DeferredBatchNorm(chunks=chunks)``.

    Running statistics then accumulate over the ``chunks`` micro-batches and are committed once per
    step, as a single full-batch forward would do. The running buffers are shared with the original
    layer, so ``state_dict`` keys keep their meaning (DeferredBatchNorm adds ``sum``/``sum_squares``).
    """
    try:
        from fairscale.nn.pipe.batchnorm import DeferredBatchNorm
    except ImportError as err:  # pragma: no cover - fairscale is a declared dependency
        raise InfeasiblePlanError(
            f"`deferred_batchnorm=True` needs fairscale ({err}).", hint="pip install fairscale"
        ) from None
    for name, child in list(layer.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(layer, name, DeferredBatchNorm.convert_deferred_batch_norm(child, chunks))
        else:
            convert_deferred_batchnorm(child, chunks=chunks)
