"""Snapshot everything profiling could touch and put it back exactly (DESIGN §3.3).

Weights, buffers, gradients (including which ones are ``None``), optimizer state, every
submodule's ``training`` flag, the module's device, all RNG streams (torch CPU and CUDA, Python
``random``, NumPy) and every submodule's plain attributes: tensors a module caches during
``forward`` (Lightning's demo Transformer builds ``pe`` and ``src_mask`` lazily), tensors updated in
place (a torchmetrics state), lists, dicts and sets ``training_step`` appends to (Lightning's
``self.training_step_outputs`` pattern), counters; attributes profiling created are removed.
Copies are kept on the CPU so they do not inflate the device memory that profiling measures.
"""

from __future__ import annotations

import copy
import random
from collections import deque
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
    buffers: dict[str, dict[str, Tensor | None]] = field(default_factory=dict)
    """Per submodule: its registered buffers as they were (None where one was registered as None)."""
    modules: dict[str, nn.Module] = field(default_factory=dict)
    """Per name: the submodule it was (its buffer table and plain attributes are put back into that module object, not
    into one that replaced it under the same name)."""
    training: dict[str, bool] = field(default_factory=dict)
    attrs: dict[str, dict[str, _Kept]] = field(default_factory=dict)
    """Per submodule: its plain (unregistered) attributes, each object with what it held (:class:`_Kept`)."""

    @classmethod
    def take(cls, module: nn.Module, *, weights: bool = True) -> ModuleSnapshot:
        """``weights=False``: parameters and their gradients are left out (a forward that steps no optimizer leaves
        them as they are), so a large model is not copied."""
        devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
        snap = cls(module=module, device=next(iter(devices)) if len(devices) == 1 else None)
        for name, p in module.named_parameters(remove_duplicate=True) if weights else ():
            snap.params[name] = _cpu_copy(p)
            snap.grads[name] = None if p.grad is None else _cpu_copy(p.grad)
        budget = [_MAX_TENSOR_COPIES, _MAX_ELEMENTS]
        for name, sub in module.named_modules(remove_duplicate=True):
            # each module's own buffer table, a buffer registered as None (a cache filled in forward) included,
            # which named_buffers() leaves out
            snap.buffers[name] = {k: None if b is None else _cpu_copy(b) for k, b in sub._buffers.items()}
            snap.modules[name] = sub
            snap.training[name] = sub.training
            snap.attrs[name] = {k: _Kept.of(v, budget) for k, v in vars(sub).items() if _is_user_attr(k, v)}
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
            # into the module objects the snapshot saw, not by name: a sub-module that training_step swapped in under
            # a snapshotted name (an nn.Identity placeholder replaced by an nn.BatchNorm1d) keeps its own buffers
            for name, saved_buffers in self.buffers.items():
                _restore_buffers(self.modules[name], saved_buffers, self.device)
        for name, sub in module.named_modules(remove_duplicate=True):
            if name in self.training:
                sub.training = self.training[name]
        for name, sub in self.modules.items():
            # plain attributes likewise by object: by name, a swapped-in BatchNorm1d lost eps, momentum, num_features
            # (not in the placeholder's table, so deleted as "made during profiling") and failed at its next forward
            if name in self.attrs:
                before = self.attrs[name]
                state = vars(sub)
                for key, value in list(state.items()):
                    if key not in before and _is_user_attr(key, value):
                        del state[key]  # made during profiling (a cache, possibly on the profiling device)
                registered = set(sub._modules) | set(sub._parameters) | set(sub._buffers)
                for key, kept in before.items():
                    if key in registered:  # a placeholder (self.head = None) that became a sub-module: keep the module
                        continue
                    try:
                        state[key] = kept.restore()
                    except Exception:  # a container whose methods refuse (a frozen or foreign type): put the object back as is
                        state[key] = kept.obj


def _restore_buffers(sub: nn.Module, saved: dict[str, Tensor | None], device: torch.device | None) -> None:
    """Put ``sub``'s buffer table back as it was: values copied into the same tensor where it is still there with its
    shape and dtype; otherwise (``training_step`` re-assigned it: another shape, a tensor where None was) the saved
    tensor goes back on the buffer's device, a buffer registered as None is None again, and one registered during
    profiling is removed."""
    table = sub._buffers
    for key in [k for k in table if k not in saved]:
        del table[key]
    for key, value in saved.items():
        now = table.get(key)
        if value is None:
            table[key] = None
        elif isinstance(now, Tensor) and now.shape == value.shape and now.dtype == value.dtype:
            now.copy_(value)
        else:
            where = now.device if isinstance(now, Tensor) else device
            table[key] = value.to(where) if where is not None else value


_MODULE_ATTRS = frozenset(vars(nn.Module()))
"""What ``nn.Module.__init__`` puts in every module's ``__dict__`` (parameter, buffer, sub-module and hook tables,
``training``): torch's own bookkeeping, never snapshotted as user state."""

_MAX_ELEMENTS = 100_000
"""Container items kept one by one (each tensor's values, nested containers); past that a container's items are
kept as a shallow copy, so a million-entry vocabulary costs one C-speed copy, not a million records."""

_MAX_TENSOR_COPIES = 256 << 20
"""Bytes of plain tensor attributes whose values are copied; past that (a replay buffer, a cached dataset) a tensor
is put back by identity only."""


def _is_user_attr(key: str, value: Any) -> bool:
    return key not in _MODULE_ATTRS and not key.startswith("__") and not isinstance(value, (nn.Parameter, nn.Module))


@dataclass
class _Kept:
    """One attribute's object and what it held: a tensor's values, a container's items (each kept the same way,
    a few levels deep), so what profiling appended or updated in place is put back into the same object."""

    obj: Any
    items: Any = None
    shallow: bool = False
    """``items`` are the container's items as they were, not records of them (past :data:`_MAX_ELEMENTS`, and sets)."""
    generator: bool = False
    """``obj`` is a random generator (``torch.Generator``, NumPy's ``Generator`` / ``RandomState``, ``random.Random``)
    and ``items`` its state: a module's own stream (a diffusion model's timestep sampler, an augmentation's RNG) advances
    with every profiled training_step, as the global streams do."""

    @classmethod
    def of(cls, obj: Any, budget: list[int], depth: int = 3) -> _Kept:
        """``budget``: [bytes of tensor values still to be copied, container items still to be kept one by one]
        (shared by one snapshot, decremented here)."""
        state = _generator_state(obj)
        if state is not None:
            return cls(obj, state, generator=True)
        if isinstance(obj, Tensor):
            size = obj.numel() * obj.element_size()
            if type(obj) is not Tensor or obj.device.type == "meta" or obj.layout != torch.strided or size > budget[0]:
                return cls(obj)
            budget[0] -= size
            return cls(obj, _cpu_copy(obj))
        if depth == 0 or not isinstance(obj, (list, deque, dict, set)):
            return cls(obj)
        if len(obj) > budget[1] or isinstance(obj, set):  # items as they are (not their contents)
            return cls(obj, list(obj.items()) if isinstance(obj, dict) else list(obj), shallow=True)
        budget[1] -= len(obj)
        if isinstance(obj, dict):
            return cls(obj, [(k, cls.of(v, budget, depth - 1)) for k, v in obj.items()])
        return cls(obj, [cls.of(v, budget, depth - 1) for v in obj])

    def restore(self) -> Any:
        obj, items = self.obj, self.items
        if items is None:
            return obj
        if self.generator:
            _set_generator_state(obj, items)
        elif isinstance(obj, Tensor):
            if obj.shape == items.shape:
                try:
                    with torch.no_grad():
                        obj.copy_(items)
                except RuntimeError:  # an inference tensor, a view of a leaf that needs grad: identity only
                    pass
        else:  # the base type's own methods: a subclass's (Counter.update counts, ModelOutput.update refuses) would not restore
            base = next(t for t in (dict, list, deque, set) if isinstance(obj, t))
            if self.shallow:
                values = items
            else:
                values = [(k, kept.restore()) for k, kept in items] if base is dict else [kept.restore() for kept in items]
            base.clear(obj)
            if base is dict:
                dict.update(obj, values)
            elif base is set:
                set.update(obj, values)
            else:
                base.extend(obj, values)
        return obj


def _generator_state(obj: Any) -> Any:
    """A copy of the state of a random generator (torch, NumPy, Python), None for anything else, and for a generator
    without a state to copy (``random.SystemRandom``, a ``random.Random`` subclass whose ``getstate`` raises
    NotImplementedError): such an object is kept by identity, as before, and the snapshot does not fail on it."""
    try:
        return _generator_state_or_raise(obj)
    except Exception:  # noqa: BLE001 - any generator that cannot give its state: nothing to put back
        return None


def _generator_state_or_raise(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return None
    if isinstance(obj, np.random.Generator):
        return copy.deepcopy(obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        return obj.get_state()
    return None


def _set_generator_state(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "bit_generator"):  # numpy.random.Generator
        obj.bit_generator.state = copy.deepcopy(state)
    else:  # numpy.random.RandomState
        obj.set_state(state)


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
