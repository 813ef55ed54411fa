"""Snapshot everything profiling could touch and put it back exactly (DESIGN §3.3).

Weights, buffers, gradients (including which ones are ``None``), optimizer state, every
submodule's ``training`` flag, tensors a module caches as plain attributes during ``forward``
(Lightning's demo Transformer builds ``pe`` and ``src_mask`` lazily), the module's device and all
RNG streams (torch CPU and CUDA, Python ``random``, NumPy). Copies are kept on the CPU so they do
not inflate the device memory that profiling measures.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ModuleSnapshot", "RNGSnapshot", "OptimizerSnapshot"]


def _cpu_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


@dataclass
class RNGSnapshot:
    torch_cpu: Tensor
    torch_cuda: list[Tensor] | None
    python: Any
    numpy: Any

    @classmethod
    def take(cls, *, include_cuda: bool) -> RNGSnapshot:
        cuda_state = None
        # Reading the CUDA state initialises CUDA, so only touch it when profiling uses it or it is already live.
        if torch.cuda.is_available() and (include_cuda or torch.cuda.is_initialized()):
            cuda_state = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            np_state = np.random.get_state()
        except ImportError:  # numpy is optional for torch
            np_state = None
        return cls(torch.get_rng_state(), cuda_state, random.getstate(), np_state)

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)


@dataclass
class ModuleSnapshot:
    module: nn.Module
    device: torch.device | None
    params: dict[str, Tensor] = field(default_factory=dict)
    grads: dict[str, Tensor | None] = field(default_factory=dict)
    buffers: dict[str, Tensor | None] = field(default_factory=dict)
    training: dict[str, bool] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per submodule: plain (unregistered) attributes holding tensors or None, by identity."""

    @classmethod
    def take(cls, module: nn.Module) -> ModuleSnapshot:
        devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
        snap = cls(module=module, device=next(iter(devices)) if len(devices) == 1 else None)
        for name, p in module.named_parameters(remove_duplicate=True):
            snap.params[name] = _cpu_copy(p)
            snap.grads[name] = None if p.grad is None else _cpu_copy(p.grad)
        for name, b in module.named_buffers(remove_duplicate=True):
            snap.buffers[name] = None if b is None else _cpu_copy(b)
        for name, sub in module.named_modules(remove_duplicate=True):
            snap.training[name] = sub.training
            snap.attrs[name] = {k: v for k, v in vars(sub).items() if _is_cached_tensor(k, v) or (v is None and not k.startswith("__"))}
        return snap

    def restore(self, *, grads: bool = True) -> None:
        """Put weights back (and, unless ``grads=False``, gradients, flags, cached attributes, device)."""
        module = self.module
        if grads and self.device is not None:
            module.to(self.device)
        with torch.no_grad():
            params = dict(module.named_parameters(remove_duplicate=True))
            for name, saved in self.params.items():
                params[name].copy_(saved)
            if not grads:
                return
            for name, saved in self.grads.items():
                p = params[name]
                p.grad = None if saved is None else saved.to(p.device)
            buffers = dict(module.named_buffers(remove_duplicate=True))
            for name, saved in self.buffers.items():
                if saved is not None and name in buffers:
                    buffers[name].copy_(saved)
        for name, sub in module.named_modules(remove_duplicate=True):
            if name in self.training:
                sub.training = self.training[name]
            if name in self.attrs:
                before = self.attrs[name]
                for key, value in list(vars(sub).items()):
                    if _is_cached_tensor(key, value) and (key not in before or before[key] is not value):
                        # a cache built during profiling (possibly on the profiling device) is dropped
                        if key in before:
                            object.__setattr__(sub, key, before[key])
                        else:
                            delattr(sub, key)


def _is_cached_tensor(key: str, value: Any) -> bool:
    return isinstance(value, Tensor) and not isinstance(value, nn.Parameter) and not key.startswith("__")


@dataclass
class OptimizerSnapshot:
    optimizer: torch.optim.Optimizer
    state: dict[str, Any]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer) -> OptimizerSnapshot:
        return cls(optimizer, _copy_tree(optimizer.state_dict()))

    def restore(self) -> None:
        # load_state_dict casts the CPU copies back to each parameter's device and dtype, and
        # replaces the state wholesale, so a fresh optimizer goes back to having no state.
        self.optimizer.load_state_dict(_copy_tree(self.state))
        if not self.state.get("state"):
            self.optimizer.state.clear()


def _copy_tree(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return _cpu_copy(obj) if obj.device.type != "cpu" else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_tree(v) for v in obj)
    return obj
