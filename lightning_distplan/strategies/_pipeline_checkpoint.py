"""Full (strategy-portable) model and optimizer state for the pipeline strategy.

Each pipeline rank keeps only its stage's tensors. A checkpoint must still hold the state a plain,
single-process run would hold (DESIGN §3.5), so saving gathers every stage's tensors to global
rank 0 under the LightningModule's own ``state_dict`` keys, and the optimizer state under the
indices the un-pruned optimizer (built by ``configure_optimizers`` over the whole module) uses.
Loading does the reverse: each rank picks its own entries out of the full state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_distplan.errors import CheckpointMismatchError, InfeasiblePlanError

__all__ = [
    "StateOwnership",
    "LooseState",
    "OptimizerIndex",
    "gather_full_state_dict",
    "gather_full_optimizer_state",
    "local_optimizer_state",
    "optimizer_state_names",
    "prune_module",
    "unprune_module",
]


@dataclass(frozen=True)
class StateOwnership:
    """Which stage provides each ``state_dict`` entry (the first stage that uses the tensor)."""

    keys: tuple[str, ...]
    """Every key of the full ``state_dict``, in its order."""
    provider: dict[str, int]
    """Stage whose rank of replica 0 sends the entry; entries no layer uses are sent by stage 0."""
    loose: frozenset[str] = frozenset()
    """Entries no layer uses (a buffer of the loss module, say): every rank keeps its own copy, and only the stage
    running the code that updates one (``spec.inputs`` on the first stage, ``spec.loss`` on the last) moves it."""

    @classmethod
    def of(cls, module: nn.Module, tensor_stages: dict[int, set[int]]) -> StateOwnership:
        full = module.state_dict(keep_vars=True)
        provider = {k: min(tensor_stages.get(id(t), {0})) for k, t in full.items()}
        loose = frozenset(k for k, t in full.items() if isinstance(t, Tensor) and id(t) not in tensor_stages)
        return cls(tuple(full), provider, loose)


class LooseState:
    """The values the :attr:`StateOwnership.loose` entries had when the stages were cut, to tell which stage moved one
    since: that stage's copy is the one a checkpoint, or the whole module after the fit, must hold (a running
    statistic the last stage's loss keeps was saved from stage 0's copy, which never moved)."""

    def __init__(self, module: nn.Module, ownership: StateOwnership) -> None:
        self._ownership = ownership
        self.reset(module)

    def reset(self, module: nn.Module) -> None:
        """Take the current values as the reference (after the fit's start, or after loading a checkpoint)."""
        local = module.state_dict()
        self._start = {k: _to_cpu(local[k]) for k in self._ownership.loose if k in local}

    def moved(self, module: nn.Module) -> frozenset[str]:
        """Loose entries this rank's copy changed since :meth:`reset`."""
        local = module.state_dict()
        return frozenset(
            k for k, start in self._start.items()
            if k in local and (local[k].shape != start.shape or not torch.equal(local[k].detach().cpu(), start))
        )


def _replica_zero_entries(local: dict[str, Any], ownership: StateOwnership, stage: int, moved: frozenset[str]) -> dict[str, Any]:
    """What this rank of replica 0 sends: the entries its stage provides, and the loose ones it moved. Merged in rank
    order (stage order within replica 0), a later stage's moved copy replaces stage 0's unmoved one."""
    return {k: _to_cpu(local[k]) for k in ownership.keys if k in local and (ownership.provider[k] == stage or k in moved)}


def _to_cpu(obj: Any) -> Any:
    """A CPU copy of ``obj``'s tensors, through dicts, lists and tuples: an optimizer's state may keep tensors in lists
    (LBFGS's history, ``old_dirs`` and the like), which were passed on as the optimizer's live lists, their CUDA tensors
    pickled to rank 0 as CUDA tensors."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        items = [_to_cpu(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a namedtuple takes its fields apart
    return obj


def _gather_to_zero(local: Any, group: Any = None) -> list[Any] | None:
    """``local`` of every rank, on global rank 0 (None elsewhere), as pickled objects over ``group`` (None: the default
    group). Over an NCCL group torch pickles each rank's object into a CUDA tensor and rank 0 holds them all there at
    once: pass a gloo group so that a whole model's state never lands on rank 0's GPU."""
    world = dist.get_world_size(group)
    out: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(local, out, dst=0, group=group)
    return out


def gather_full_state_dict(
    module: nn.Module, ownership: StateOwnership, *, stage: int, replica: int, moved: frozenset[str] = frozenset(), group: Any = None
) -> dict[str, Any]:
    """Collective: the LightningModule's full ``state_dict`` on global rank 0 (empty elsewhere).

    ``moved``: the loose entries this rank changed (:meth:`LooseState.moved`); they replace stage 0's copy.
    ``group``: the group of all ranks the pickled entries travel over (a gloo group on GPUs; None: the default group).
    """
    mine = {}
    if replica == 0:  # replicas hold identical weights; one copy is enough (replica 0's loose entries, as DDP broadcasts rank 0's buffers)
        mine = _replica_zero_entries(module.state_dict(), ownership, stage, moved)
    parts = _gather_to_zero(mine, group)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return OrderedDict((k, merged[k]) for k in ownership.keys if k in merged)


def restore_full_module(
    module: nn.Module, ownership: StateOwnership, *, stage: int, replica: int, group: Any = None, moved: frozenset[str] = frozenset()
) -> None:
    """Collective: give every tensor :func:`prune_module` emptied its full value again, on every rank.

    Each entry comes from its provider (the first stage using it, replica 0), as when saving, and each
    loose entry from the last stage of replica 0 that ``moved`` it; the values travel as pickled CPU
    objects over ``group`` (a gloo group, so that nothing lands on the GPUs).
    """
    local = module.state_dict(keep_vars=True)
    mine = _replica_zero_entries(local, ownership, stage, moved) if replica == 0 else {}
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    for part in parts:
        for key, value in part.items():
            tensor = local.get(key)
            if tensor is not None and ((tensor.numel() == 0 and value.numel() > 0) or key in ownership.loose):
                tensor.data = value.to(device=tensor.device, dtype=tensor.dtype)


@dataclass(frozen=True)
class OptimizerIndex:
    """How a stage's pruned optimizer maps onto the optimizer ``configure_optimizers`` built over the whole module."""

    full_group_sizes: tuple[int, ...]
    """Number of parameters in each original param group."""
    local_to_full: tuple[int, ...]
    """Original (torch ``state_dict``) index of each parameter the pruned optimizer still holds, in its order."""
    provided: frozenset[int]
    """Original indices whose state this stage sends when saving (the first stage using the parameter)."""
    names: tuple[str, ...]
    """Parameter name (first one of ``named_parameters``) of every original index."""

    @classmethod
    def prune(cls, optimizer: Optimizer, keep: set[int], provide: set[int], module: nn.Module) -> OptimizerIndex:
        """Drop parameters whose ``id`` is not in ``keep`` from ``optimizer``'s groups (its state must be empty)."""
        name_of: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            name_of.setdefault(id(p), name)
        sizes, local_to_full, provided, names = [], [], set(), []
        index = 0
        for group in optimizer.param_groups:
            sizes.append(len(group["params"]))
            kept = []
            for p in group["params"]:
                names.append(name_of.get(id(p), f"<unnamed parameter {index}>"))
                if id(p) in keep:
                    kept.append(p)
                    local_to_full.append(index)
                    if id(p) in provide:
                        provided.add(index)
                index += 1
            group["params"] = kept
        return cls(tuple(sizes), tuple(local_to_full), frozenset(provided), tuple(names))


def _full_param_groups(local_groups: Iterable[dict[str, Any]], sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    groups, start = [], 0
    for group, size in zip(local_groups, sizes):
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = list(range(start, start + size))
        groups.append(g)
        start += size
    return groups


def gather_full_optimizer_state(optimizer: Optimizer, index: OptimizerIndex, *, replica: int, group: Any = None) -> dict[str, Any]:
    """Collective: the state dict of the un-pruned optimizer, on global rank 0 (empty elsewhere); ``group`` as for
    :func:`gather_full_state_dict`."""
    local = optimizer.state_dict()
    mine: dict[int, Any] = {}
    if replica == 0:
        for local_idx, state in local["state"].items():
            full_idx = index.local_to_full[local_idx]
            if full_idx in index.provided:
                mine[full_idx] = _to_cpu(state)
    parts = _gather_to_zero(mine, group)
    if parts is None:
        return {}
    state: dict[int, Any] = {}
    for part in parts:
        state.update(part)
    return {"state": dict(sorted(state.items())), "param_groups": _full_param_groups(local["param_groups"], index.full_group_sizes)}


def optimizer_state_names(full: dict[str, Any], index: OptimizerIndex) -> dict[str, Any]:
    """A full torch-format optimizer state keyed by parameter name (the ``_checkpoint`` portable format)."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index.names[i] for i in g["params"]]} for g in full["param_groups"]]
    return {"state": {index.names[i]: s for i, s in full["state"].items()}, "param_groups": groups}


def local_optimizer_state(full: dict[str, Any], index: OptimizerIndex) -> dict[str, Any]:
    """This stage's part of a full optimizer state dict, indexed like the pruned optimizer."""
    state = {local_idx: full["state"][full_idx] for local_idx, full_idx in enumerate(index.local_to_full) if full_idx in full["state"]}
    full_groups = full["param_groups"]
    if tuple(len(g["params"]) for g in full_groups) != index.full_group_sizes:
        raise CheckpointMismatchError(
            f"The checkpoint's optimizer has param groups of sizes {[len(g['params']) for g in full_groups]}, "
            f"this model's has {list(index.full_group_sizes)}.",
            hint="Resume with the same `configure_optimizers`.",
        )
    groups, local_idx, start = [], 0, 0
    for g, size in zip(full_groups, index.full_group_sizes):
        n_local = sum(1 for f in index.local_to_full if start <= f < start + size)
        new = {k: v for k, v in g.items() if k != "params"}
        new["params"] = list(range(local_idx, local_idx + n_local))
        groups.append(new)
        local_idx += n_local
        start += size
    return {"state": state, "param_groups": groups}


def prune_module(module: nn.Module, keep: set[int], *, freed_values: list[tuple[Tensor, Tensor]] | None = None) -> int:
    """Free the storage of every parameter and persistent buffer whose ``id`` is not in ``keep``; returns bytes freed.

    The tensor objects stay (with an empty storage) so that optimizer param groups and user references
    do not break; ``state_dict`` keys stay, and the full values are gathered at save time. With
    ``freed_values``, each emptied tensor and its former value (on the CPU) are appended to it, so that
    :func:`unprune_module` can put them back without a collective.
    """
    freed = 0
    for sub in module.modules():
        # Non-persistent buffers (attention masks, rotary tables) stay: no state_dict carries them back
        # after the run, and they are small.
        buffers = [(n, b) for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set]
        for name, t in list(sub._parameters.items()) + buffers:
            if t is None or id(t) in keep or t.numel() == 0:
                continue
            freed += t.numel() * t.element_size()
            if freed_values is not None:
                freed_values.append((t, t.data.cpu()))  # on the CPU already before the module moves to its device: no copy
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed


def unprune_module(freed_values: list[tuple[Tensor, Tensor]]) -> None:
    """Give the tensors :func:`prune_module` emptied their recorded values again (local: no collective)."""
    for t, value in freed_values:
        if t.numel() == 0:
            t.data = value.to(device=t.device, dtype=t.dtype)


_PARTIAL = "_distplan_pipeline_stage"  # on a module that holds one pipeline stage's tensors only


def mark_partial(module: nn.Module | None, stage: int | None) -> None:
    """Record on ``module`` that it holds only ``stage``'s tensors (``None``: it is whole again)."""
    if module is None:
        return
    if stage is None:
        module.__dict__.pop(_PARTIAL, None)
    else:
        module.__dict__[_PARTIAL] = stage


def refuse_partial_module(module: nn.Module | None) -> None:
    """Refuse to train a module a failed pipeline run left holding one stage's tensors (the rest are empty).

    Raises:
        InfeasiblePlanError: the module is partial (on every rank alike, so no rank waits on a collective).
    """
    stage = None if module is None else module.__dict__.get(_PARTIAL)
    if stage is not None:
        raise InfeasiblePlanError(
            f"{type(module).__name__} holds only pipeline stage {stage}'s weights on this rank: an earlier pipeline fit stopped "
            "before it could hand the other stages' tensors back, so they are empty here.",
            hint=f"Load the whole model from the last checkpoint ({type(module).__name__}.load_from_checkpoint(path)) and fit that.",
        )
