"""FLOP formulas that torch's ``FlopCounterMode`` lacks or gets wrong, passed as its ``custom_mapping``.

- ``aten.convolution_backward``: torch counts the weight gradient of a grouped convolution ``groups``
  times over (a depthwise ``Conv2d`` came out 33x its forward); each requested gradient (input,
  weight) is one convolution as large as the forward one.
- ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward): the kernel
  ``F.scaled_dot_product_attention`` runs on a CPU without a mask is not counted at all, so the
  attention's 4·T²·d per head was missing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_formulas"]


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _output_padding, _groups,
                   output_mask, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def flop_formulas() -> dict[Any, Any]:
    """``custom_mapping`` for ``FlopCounterMode``: the formulas above, for the ops this torch has."""
    formulas = {
        "convolution_backward": _conv_backward,
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
    }
    return {getattr(torch.ops.aten, name): f for name, f in formulas.items() if hasattr(torch.ops.aten, name)}
