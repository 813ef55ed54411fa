"""torch's ``PipelineStage`` whose first-step shape inference leaves no trace in the user's model or loss.

On the first step of a schedule, a ``PipelineStage`` learns the shapes that cross the stage
boundaries by running every stage once more (torch's *dynamic metadata inference*): stage 0 on
the real first micro-batch, each later stage on a tensor of the received shape, and the last stage
through the loss. torch forks the RNG and puts back every buffer updated *in place*, but:

* the later stages' inputs are uninitialised memory (values like 1e35, or token ids far out of an
  embedding's range, which crash an ``nn.Embedding`` on a later stage);
* a buffer the layer *re-assigns* (``self.mu = 0.9 * self.mu + 0.1 * x.mean(0)``) keeps the tensor
  computed from that memory: the trained module and its checkpoints held 1e35;
* ``PipelineSpec.loss`` is called once more, on that output (a metric update or a finite-value
  check in the loss sees it).

:class:`GuardedStage` infers on zeros, puts every buffer slot back as it was, and gives the
inference a stand-in loss (the sum of the output tensors, whose gradients have the same shapes and
dtypes as the real loss's) so the user's loss only ever sees real micro-batches. With
``deferred_batchnorm`` the inference forward is also kept out of the batch statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from lightning_distplan.profiling._batches import tensors_in

__all__ = ["GuardedStage", "GUARDED_HOOKS"]

GUARDED_HOOKS = ("_to_tensor", "_pre_metadata_inference_backup", "_post_metadata_inference_cleanup", "_backward_metadata_inference")
"""The ``PipelineStage`` methods overridden here; a test checks the installed torch still calls them by these names."""


class GuardedStage(PipelineStage):
    """A ``PipelineStage`` for one :class:`~lightning_distplan.strategies._pipeline_split.StageModule`; see the module docstring."""

    def __init__(self, *args: Any, deferred_batchnorm: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer_slots: list[tuple[nn.Module, str, Tensor | None]] | None = None
        if deferred_batchnorm:
            from lightning_distplan.strategies._pipeline_batchnorm import skip_metadata_inference_tracking

            skip_metadata_inference_tracking(self)

    def _to_tensor(self, arg: Any) -> Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, Tensor):  # a received shape: zeros, not uninitialised memory
            with torch.no_grad():
                tensor.zero_()
        return tensor

    def _pre_metadata_inference_backup(self) -> None:
        # every buffer *slot*, so that a re-assigned buffer gets its own tensor back (torch restores values in place)
        self._buffer_slots = [(m, name, t) for m in self.submod.modules() for name, t in m._buffers.items()]
        super()._pre_metadata_inference_backup()

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()  # in-place updates undone first (the original tensors' values)
        for module, name, tensor in self._buffer_slots or ():
            if module._buffers.get(name) is not tensor:
                module._buffers[name] = tensor
        self._buffer_slots = None

    def _backward_metadata_inference(self, loss_fn: Any = None, target: Any = None, **kwargs: Any) -> Any:
        return super()._backward_metadata_inference(loss_fn=_stand_in_loss if loss_fn is not None else None, target=target, **kwargs)


def _stand_in_loss(output: Any, target: Any, **_: Any) -> Tensor:
    """The sum of the output's differentiable tensors: the same gradient shapes at the stage's inputs as any loss of
    them, without calling the user's loss on the inference output."""
    sums = [t.float().sum() for t in tensors_in(output) if t.requires_grad]
    return torch.stack(sums).sum() if sums else torch.zeros((), requires_grad=True)
