"""Strategy-portable checkpoints (DESIGN §3.5).

Every strategy of this package writes checkpoints that any other strategy — and plain Lightning —
can load:

* ``checkpoint["state_dict"]``: the FULL LightningModule state dict, same keys as the plain module
  (a pipeline stage gathers the other stages' slices before saving).
* ``checkpoint["optimizer_states"]``: Lightning's usual list of ``torch.optim`` state dicts
  (integer parameter ids), so ``Trainer(strategy="ddp")`` resumes from it unchanged.
* ``checkpoint["distplan_optimizer_states"]``: the same optimizer states keyed by parameter FQN
  (see :func:`optimizer_state_by_name`). Integer ids depend on which parameters an optimizer
  holds and in which order; names do not, so a pipeline stage holding a subset of the parameters
  loads its slice and a full-model optimizer loads everything.
* ``checkpoint["distplan_plan"]``: ``Plan.to_dict()`` of the plan that was running. Resume reuses it
  (DESIGN §3.5: resume does not re-plan unless asked); one this version cannot read (a later schema version)
  is set aside with a warning (:func:`readable_plan`), and the rest of the checkpoint loads as a plain one.
* ``checkpoint["distplan_plan_context"]``: what the plan was made for: the Trainer's ``precision``
  and, for a plan ``auto_plan`` chose, the device memory it had to fit (``memory_limit_bytes``) and the
  trainable parameters its profile found without a gradient (``unused_parameters``, when any: a resumed
  fit that reuses the plan runs DDP with ``find_unused_parameters=True`` again without profiling).
  ``auto_plan`` reuses the stored plan only in the same precision and no less memory.
* ``checkpoint["distplan_pipeline_resume"]`` (auto_plan's pipeline with a stateful train loader, mid-epoch:
  ``_auto_concrete.RESUME_KEY``): where inside a loader batch the last step ended (ints, a bool and the batch
  progress: it loads with ``weights_only``), read by that plan alone; another strategy or plain Lightning ignores it
  and resumes from the loader's state stored, the one before that batch (the samples of it the step trained are
  trained again, none skipped).

The helpers are pure functions over optimizers and plain dicts so they test in milliseconds.
"""

from __future__ import annotations

import copy
import errno
import functools
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_distplan.errors import DistPlanError, described
from lightning_distplan.plan import Plan
from lightning_distplan.strategies._checkpoint_io import raise_on_every_rank

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim import Optimizer

__all__ = [
    "PLAN_KEY",
    "OPTIMIZER_STATES_KEY",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "join_resume_reads",
    "read_checkpoint",
    "optimizer_state_by_name",
    "load_optimizer_state_by_name",
    "merge_stage_states",
    "to_torch_optimizer_state",
    "add_portable_state",
    "check_states_to_save",
    "load_portable_optimizer_states",
    "stored_plan",
    "readable_plan",
    "PLAN_CONTEXT_KEY",
    "plan_context",
    "stored_plan_context",
]

PLAN_KEY = "distplan_plan"
OPTIMIZER_STATES_KEY = "distplan_optimizer_states"
PLAN_CONTEXT_KEY = "distplan_plan_context"

NamedParams = Union[Mapping[str, "Tensor"], Iterable[tuple[str, "Tensor"]]]


class CheckpointFormatError(DistPlanError, ValueError):
    """A checkpoint does not hold the state a strategy needs (missing parameter, mismatched groups), or its file is not a
    checkpoint Lightning can read (cut short, damaged, or another kind of file)."""


class CheckpointNotFoundError(CheckpointFormatError, FileNotFoundError):
    """The checkpoint file to read does not exist (a ``FileNotFoundError`` as well, as Lightning's own was)."""


# What torch.load raises on a file cut short or damaged, or not written by torch.save: an empty file (EOFError), a zip
# archive cut anywhere past its first bytes (a seek before its start: EINVAL), a damaged or foreign archive, a cut
# legacy file, bytes that are no pickle.
_DAMAGED_MARKS = ("PytorchStreamReader", "inline_container", "unexpected EOF", "corrupt", "invalid load key")


def _damaged(err: BaseException) -> bool:
    if isinstance(err, EOFError):
        return True
    if isinstance(err, OSError):
        return err.errno == errno.EINVAL
    return isinstance(err, (RuntimeError, pickle.UnpicklingError)) and any(mark in str(err) for mark in _DAMAGED_MARKS)


def read_checkpoint(load: Callable[[], Any], path: Any, *, strategy: Any = None) -> dict[str, Any]:
    """``load()`` (the strategy's ``Strategy.load_checkpoint``), refusing in one sentence a file it cannot read, or one
    that is not a checkpoint Lightning wrote, where torch and Lightning name neither (``OSError: [Errno 22] Invalid
    argument`` for a checkpoint cut short, ``KeyError: 'pytorch-lightning_version'`` for a model's bare state_dict).
    ``strategy``: the loading strategy; a fit it resumes refuses a weights-only checkpoint as the one it resumes from
    (Lightning's own refusal comes after the weights loaded, as a ``KeyError``); other files it reads are not refused.

    The Trainer's own read (a fit, validate, ... from ``ckpt_path``) runs on every rank, and every rank raises where
    one failed (:func:`raise_on_every_rank`: a file one node lacks or holds damaged); the failing rank alone raised,
    and the others stopped at their next collective with gloo's "Connection closed by peer". One all-reduce per read.

    Raises:
        CheckpointNotFoundError: (a ``CheckpointFormatError`` and a ``FileNotFoundError``) there is no file at ``path``;
            Lightning's own said only "Checkpoint file not found: <path>".
        CheckpointFormatError: ``path`` is a folder (a bare ``IsADirectoryError`` before), the file is cut short,
            damaged or not a torch file, or holds no Lightning checkpoint, or holds weights only for a fit to resume.
    """
    if not _trainers_read(strategy, path):
        return _read_checkpoint(load, path, strategy)
    failure = None
    try:
        checkpoint = _read_checkpoint(load, path, strategy)
    except Exception as err:  # not a KeyboardInterrupt: no collective then
        failure = err
    raise_on_every_rank(failure, doing=_READING, device=strategy.root_device, skipped=False, mixed=_resumes_on_some_ranks)
    return checkpoint


_READING = "reading the checkpoint"


def join_resume_reads(trainer: Any) -> None:
    """Make a rank whose ``ckpt_path`` came to nothing (``ckpt_path="last"`` on a node whose disk holds no last
    checkpoint, or ``None`` there) join the all-reduce that ends the other ranks' read (:func:`read_checkpoint`):
    Lightning reads no file on it, so it went on to the strategy's setup collectives, which then paired with that
    all-reduce and every rank waited until the process group's timeout. It raises the error a reading rank had; where
    the others read well, every rank raises that the ranks would train from different states. Wraps the trainer's
    ``resume_start`` once (every rank calls it in each run, with or without a path); one all-reduce where no rank reads
    a file. Called by every strategy's ``setup_environment``
    (:class:`~lightning_distplan.strategies._checkpoint_io.AtomicSaves`)."""
    connector = trainer._checkpoint_connector
    resume_start = connector.resume_start
    if getattr(resume_start, "_joins_reads", False):
        return

    @functools.wraps(resume_start)
    def joined(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        if not checkpoint_path:
            raise_on_every_rank(None, doing=_READING, device=trainer.strategy.root_device, skipped=True, mixed=_resumes_on_some_ranks)
        resume_start(checkpoint_path, weights_only=weights_only)

    joined._joins_reads = True  # type: ignore[attr-defined]
    connector.resume_start = joined


def _resumes_on_some_ranks(rank: int) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"Some ranks resume from a checkpoint but global rank {rank} has none (its ckpt_path came to no file, as "
        "ckpt_path='last' does on a node whose disk holds no last checkpoint), so the ranks would train from different states.",
        hint="Put the checkpoints in a folder every node reads (ModelCheckpoint(dirpath=...) on shared storage) and pass that "
        "file as ckpt_path on every rank, or ckpt_path=None on every rank to start afresh.",
    )


def _trainers_read(strategy: Any, path: Any) -> bool:
    """Whether this read is the Trainer's of its ``ckpt_path``, which every rank makes (not a file a callback reads on
    one rank, which no other rank would wait for)."""
    module = None if strategy is None else strategy.lightning_module
    trainer = None if module is None else module._trainer
    return trainer is not None and trainer.ckpt_path is not None and str(trainer.ckpt_path) == str(path)


def _read_checkpoint(load: Callable[[], Any], path: Any, strategy: Any) -> dict[str, Any]:
    try:
        checkpoint = load()
    except IsADirectoryError as err:  # a folder: torch.load's open() raised a bare "[Errno 21] Is a directory"
        try:
            held = sorted(name for name in os.listdir(path) if name.endswith(".ckpt"))
        except OSError:  # a folder we may not list, a remote path
            held = []
        names = ", ".join(map(repr, held[:3])) + (", ..." if len(held) > 3 else "")
        raise CheckpointFormatError(
            f"The checkpoint {str(path)!r} is a folder, not a checkpoint file" + (f" (it holds {names})." if held else "."),
            hint="Pass the path of a checkpoint file as ckpt_path (such as one ModelCheckpoint saved in that folder), or "
            "ckpt_path='last' to resume from the last checkpoint ModelCheckpoint saved.",
        ) from err
    except FileNotFoundError as err:  # Lightning's checkpoint_io found no file at the path
        where = "" if "://" in str(path) or os.path.isabs(str(path)) else f" (relative to the working folder {os.getcwd()!r})"
        raise CheckpointNotFoundError(
            f"The checkpoint {str(path)!r} does not exist{where}.",
            hint="Check the path, or pass ckpt_path='last' to resume from the last checkpoint ModelCheckpoint saved (a fit "
            "where it saved none starts afresh) or ckpt_path=None to start afresh.",
        ) from err
    except Exception as err:
        if not _damaged(err):
            raise
        found = str(err).split("\n")[0].split(". ")[0] or "no data"
        raise CheckpointFormatError(
            f"The checkpoint {str(path)!r} cannot be read ({type(err).__name__}: {found}): the file is cut short or damaged "
            "(a copy or a save that stopped early), or torch.save did not write it.",
            hint="Resume from another checkpoint (ModelCheckpoint keeps last.ckpt and the best ones), or copy this one again.",
        ) from err
    if isinstance(checkpoint, Mapping):
        missing = [k for k in ("state_dict", "pytorch-lightning_version") if k not in checkpoint]
        if not missing:
            _refuse_weights_only_resume(checkpoint, path, strategy)
            return checkpoint  # type: ignore[return-value]  # Lightning's loader returns a dict
        keys = ", ".join(repr(k) for k in list(checkpoint)[:3]) + (", ..." if len(checkpoint) > 3 else "")
        say = "; a module's state_dict saved with torch.save, say" if "state_dict" in missing else ""
        what = f"a dict without {' or '.join(map(repr, missing))} (keys {keys or 'none'}{say})"
    else:
        what = f"a {type(checkpoint).__name__}"
    raise CheckpointFormatError(
        f"The file {str(path)!r} holds {what}, not a checkpoint Lightning wrote.",
        hint="Load the weights into the module before the run (module.load_state_dict(...)) and leave out ckpt_path, or "
        "pass a file Trainer.save_checkpoint or ModelCheckpoint wrote.",
    )


def _refuse_weights_only_resume(checkpoint: Mapping[str, Any], path: Any, strategy: Any) -> None:
    if not _trainers_read(strategy, path):  # not the resume: a file a callback reads, say
        return
    module = strategy.lightning_module
    if module._trainer.state.fn != TrainerFn.FITTING or not strategy.lightning_restore_optimizer:
        return
    if "optimizer_states" not in checkpoint:
        raise CheckpointFormatError(
            f"The checkpoint {str(path)!r} holds the model's weights only (saved with save_weights_only=True), not the optimizer "
            "state a resumed fit needs.",
            hint=f"Load the weights into the module ({type(module).__name__}.load_from_checkpoint(path)) and fit it without "
            "ckpt_path, or resume from a full checkpoint.",
        )


def _name_by_id(named_params: NamedParams) -> dict[int, str]:
    items = named_params.items() if isinstance(named_params, Mapping) else named_params
    # The first name wins for tied parameters, as in ``Module.named_parameters()``.
    out: dict[int, str] = {}
    for name, param in items:
        out.setdefault(id(param), name)
    return out


def _group_names(optimizer: Optimizer, names: dict[int, str]) -> list[list[str]]:
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        group_names = []
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointFormatError(
                    f"Optimizer param group {i} holds a parameter of shape {tuple(param.shape)} that is not among the "
                    f"{len(names)} named parameters given.",
                    hint="Pass the named_parameters() of the module the optimizer was built from.",
                )
            group_names.append(names[id(param)])
        groups.append(group_names)
    return groups


def optimizer_state_by_name(
    optimizer: Optimizer, named_params: NamedParams, *, state_dict: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with parameter FQNs in place of integer ids.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_params: ``module.named_parameters()`` (or a dict) covering every parameter the optimizer holds.
        state_dict: ``optimizer.state_dict()`` when the caller already has it (Lightning's checkpoint dict).

    Returns:
        ``{"state": {fqn: per-param state}, "param_groups": [{hyper-parameters..., "params": [fqn, ...]}]}``.
    """
    names = _name_by_id(named_params)
    group_names = _group_names(optimizer, names)
    sd = optimizer.state_dict() if state_dict is None else state_dict
    # torch numbers parameters consecutively over param_groups in order (Optimizer.state_dict).
    id_to_name: dict[int, str] = {}
    for torch_group, fqns in zip(sd["param_groups"], group_names):
        id_to_name.update(zip(torch_group["params"], fqns))
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(fqns)} for g, fqns in zip(sd["param_groups"], group_names)]
    state = {id_to_name[i]: s for i, s in sd["state"].items()}
    return {"state": state, "param_groups": groups}


def to_torch_optimizer_state(state_by_name: Mapping[str, Any], param_order: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """Convert a by-name state back to ``torch.optim`` format (integer ids).

    Args:
        state_by_name: output of :func:`optimizer_state_by_name` or :func:`merge_stage_states`.
        param_order: parameter names per group in the target optimizer's order; defaults to the
            order stored in ``state_by_name`` (for a merged pipeline state: stage by stage, which is
            module order when stages are contiguous blocks).

    Returns:
        A dict that ``optimizer.load_state_dict`` accepts for an optimizer with that grouping.
    """
    groups = state_by_name["param_groups"]
    order = [list(g["params"]) for g in groups] if param_order is None else [list(p) for p in param_order]
    if len(order) != len(groups):
        raise CheckpointFormatError(
            f"The target optimizer has {len(order)} param groups but the checkpoint has {len(groups)}.",
            hint="Build the optimizer with the same param groups as the run that saved the checkpoint.",
        )
    out_groups, out_state, index = [], {}, 0
    for group, fqns in zip(groups, order):
        ids = []
        for fqn in fqns:
            if fqn in state_by_name["state"]:
                out_state[index] = state_by_name["state"][fqn]
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def load_optimizer_state_by_name(optimizer: Optimizer, named_params: NamedParams, state_by_name: Mapping[str, Any]) -> None:
    """Load a by-name optimizer state into ``optimizer``, which may hold any subset of its parameters.

    Hyper-parameters (lr, betas, ...) come from the checkpoint group that holds the optimizer
    group's parameters; per-parameter state (momentum, Adam moments, step) is matched by name.

    Raises:
        CheckpointFormatError: ``state_by_name`` is not what :func:`optimizer_state_by_name` returns (no ``state``
            dict or ``param_groups`` list of parameter names), a parameter of ``optimizer`` is not in it, or one of
            its groups mixes parameters from different checkpoint groups.
    """
    _load_state_by_name(
        optimizer,
        named_params,
        state_by_name,
        what="The optimizer state",
        hint="Pass a state optimizer_state_by_name returned (a dict of 'state' by parameter name and 'param_groups' "
        "listing parameter names).",
    )


def _load_state_by_name(optimizer: Optimizer, named_params: NamedParams, state_by_name: Any, *, what: str, hint: str) -> None:
    """:func:`load_optimizer_state_by_name`; a malformed ``state_by_name`` is refused as ``what`` with ``hint``."""
    _check_state_by_name(state_by_name, what, hint)
    names = _name_by_id(named_params)
    own_groups = _group_names(optimizer, names)
    group_of: dict[str, int] = {}
    for i, group in enumerate(state_by_name["param_groups"]):
        for fqn in group["params"]:
            group_of.setdefault(fqn, i)
    order = []
    hyper = []
    for i, fqns in enumerate(own_groups):
        missing = [f for f in fqns if f not in group_of]
        if missing:
            raise CheckpointFormatError(
                f"Parameter {missing[0]!r} (and {len(missing) - 1} more) of optimizer group {i} is not in the checkpoint's optimizer state.",
                hint="Resume from a checkpoint of the same model, or pass weights_only checkpoints to load_from_checkpoint.",
            )
        src = {group_of[f] for f in fqns}
        if len(src) > 1:
            raise CheckpointFormatError(
                f"Optimizer group {i} mixes parameters of checkpoint groups {sorted(src)}.",
                hint="Build the optimizer with the same param groups as the run that saved the checkpoint.",
            )
        order.append(fqns)
        hyper.append(state_by_name["param_groups"][src.pop()] if fqns else {"params": []})
    sd = to_torch_optimizer_state({"state": state_by_name["state"], "param_groups": hyper}, order)
    # Empty groups keep the optimizer's own hyper-parameters.
    for g, own in zip(sd["param_groups"], optimizer.param_groups):
        for key, value in own.items():
            if key != "params":
                g.setdefault(key, value)
    optimizer.load_state_dict(sd)


def merge_stage_states(partials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the by-name optimizer states of pipeline stages (or any disjoint shards) into one.

    Groups are merged by position (group i of every stage becomes group i of the whole, its
    parameters in stage order); hyper-parameters must agree.
    """
    if not partials:
        raise CheckpointFormatError("merge_stage_states got no stage states.", hint="Pass one state per pipeline stage.")
    n_groups = {len(p["param_groups"]) for p in partials}
    if len(n_groups) != 1:
        raise CheckpointFormatError(
            f"Stage optimizers have different numbers of param groups {sorted(n_groups)}.",
            hint="Let configure_optimizers build the same groups on every stage (empty groups are fine).",
        )
    merged_groups: list[dict[str, Any]] = []
    for i in range(n_groups.pop()):
        hyper: dict[str, Any] | None = None
        params: list[str] = []
        for stage, partial in enumerate(partials):
            group = partial["param_groups"][i]
            if not group["params"]:
                continue  # a stage without parameters in this group: its hyper-parameters are irrelevant
            h = {k: v for k, v in group.items() if k != "params"}
            if hyper is None:
                hyper = h
            elif h != hyper:
                raise CheckpointFormatError(
                    f"Param group {i} of stage {stage} has hyper-parameters {h} but an earlier stage has {hyper}.",
                    hint="Use the same optimizer settings on every stage.",
                )
            params.extend(p for p in group["params"] if p not in params)
        if hyper is None:  # no stage has parameters in this group
            hyper = {k: v for k, v in partials[0]["param_groups"][i].items() if k != "params"}
        merged_groups.append({**hyper, "params": params})
    state: dict[str, Any] = {}
    for partial in partials:
        for fqn, s in partial["state"].items():
            state.setdefault(fqn, s)  # tied parameters: every stage holds the same value
    return {"state": state, "param_groups": merged_groups}


def add_portable_state(
    checkpoint: dict[str, Any],
    *,
    plan: Plan | None,
    optimizer_states_by_name: Sequence[Mapping[str, Any]] | None,
    context: Mapping[str, Any] | None = None,
) -> None:
    """Add the portable keys to a checkpoint dict in place (called by every strategy's ``save_checkpoint``)."""
    if plan is not None:
        checkpoint[PLAN_KEY] = plan.to_dict()
        if context:
            checkpoint[PLAN_CONTEXT_KEY] = dict(context)
    if optimizer_states_by_name is not None:
        checkpoint[OPTIMIZER_STATES_KEY] = [copy.copy(dict(s)) for s in optimizer_states_by_name]


def load_portable_optimizer_states(
    optimizers: Sequence[Optimizer], named_params: NamedParams, checkpoint: Mapping[str, Any]
) -> bool:
    """Load the by-name optimizer states of ``checkpoint`` into ``optimizers``.

    Returns:
        False (and loads nothing) when the checkpoint has no portable optimizer state, e.g. one
        written by plain Lightning; the caller then falls back to ``checkpoint["optimizer_states"]``.
    """
    states = checkpoint.get(OPTIMIZER_STATES_KEY)
    if states is None:
        return False
    _check_states_by_name(states)
    if len(states) != len(optimizers):
        raise CheckpointFormatError(
            f"The checkpoint holds {len(states)} optimizer states but configure_optimizers returned {len(optimizers)} optimizers.",
            hint="Resume with the same configure_optimizers as the run that saved the checkpoint.",
        )
    named = dict(named_params.items() if isinstance(named_params, Mapping) else named_params)
    for i, (optimizer, state) in enumerate(zip(optimizers, states)):
        _load_state_by_name(optimizer, named, state, what=f"The checkpoint's {OPTIMIZER_STATES_KEY!r} entry {i}", hint=_CHECKPOINT_HINT)
    return True


_CHECKPOINT_HINT = (
    f"Resume from a checkpoint a lightning_distplan strategy wrote, or delete its {OPTIMIZER_STATES_KEY!r} entry to "
    "load Lightning's 'optimizer_states' instead."
)


def _check_states_by_name(states: Any) -> None:
    """Refuse an ``OPTIMIZER_STATES_KEY`` entry that is not a list (each of its states is checked as it loads,
    :func:`_check_state_by_name`)."""
    if not isinstance(states, (list, tuple)):
        raise CheckpointFormatError(
            f"The checkpoint's {OPTIMIZER_STATES_KEY!r} is {described(states)}, not a list of one state per optimizer, so the "
            "optimizer state cannot be loaded by parameter name.",
            hint=_CHECKPOINT_HINT,
        )


def check_states_to_save(states: Sequence[Any]) -> None:
    """Refuse a checkpoint's torch-format optimizer states (``checkpoint["optimizer_states"]``) that a user's
    ``on_save_checkpoint`` hook left without what the by-name copy reads, before a bare ``KeyError: 'param_groups'``
    in the save."""
    for i, state in enumerate(states):
        _check_state_by_name(
            state,
            f"The optimizer state to save (checkpoint['optimizer_states'][{i}])",
            hint="An on_save_checkpoint hook (a Callback's or the LightningModule's) changed it: leave "
            "checkpoint['optimizer_states'] as Lightning made it (change a copy), or save the weights only "
            "(Trainer.save_checkpoint(path, weights_only=True)).",
            so="so it cannot be stored by parameter name",
        )


def _check_state_by_name(
    state: Any, what: str, hint: str, so: str = "so the optimizer state cannot be loaded by parameter name"
) -> None:
    """Refuse a by-name optimizer state that is not what :func:`optimizer_state_by_name` returns (a checkpoint's entry
    edited by hand or by another tool), before a bare ``KeyError`` deep in the load, or a ``state`` read as empty (no
    Adam moments). A torch-format state has the same outline (``params`` lists ids), which a save checks
    (:func:`check_states_to_save`); ``so``: what follows from the problem."""
    problem = None
    missing = [k for k in ("state", "param_groups") if not isinstance(state, Mapping) or k not in state]
    if not isinstance(state, Mapping) or missing:
        problem = f"is {described(state)} without {' or '.join(map(repr, missing))}"
    elif not isinstance(state["state"], Mapping):
        problem = f"has {described(state['state'])} as 'state', not a dict by parameter name"
    elif not isinstance(state["param_groups"], (list, tuple)):
        problem = f"has {described(state['param_groups'])} as 'param_groups', not a list"
    else:
        bad = [j for j, g in enumerate(state["param_groups"]) if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple))]
        if bad:
            problem = f"has param group {bad[0]} without a list of parameter names as 'params'"
    if problem is not None:
        raise CheckpointFormatError(f"{what} {problem}, {so}.", hint=hint)


def plan_context(strategy: Any) -> dict[str, Any]:
    """What ``strategy``'s plan was made for (see the module docstring): its precision, and the memory limit
    ``auto_plan`` planned it for when it did (``strategy.plan_memory_limit_bytes``)."""
    context: dict[str, Any] = {"precision": getattr(strategy.precision_plugin, "precision", None)}
    limit = strategy.plan_memory_limit_bytes
    if limit is not None:
        context["memory_limit_bytes"] = int(limit)
    if strategy.plan_unused_parameters:  # a resumed fit that reuses the plan does not profile, so cannot find them again
        context["unused_parameters"] = list(strategy.plan_unused_parameters)
    return context


def stored_plan_context(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The context stored with a checkpoint's plan (empty for checkpoints written before it was stored)."""
    context = checkpoint.get(PLAN_CONTEXT_KEY)
    return dict(context) if isinstance(context, Mapping) else {}


def stored_plan(checkpoint: Mapping[str, Any]) -> Plan | None:
    """The plan saved in a checkpoint, or None for checkpoints not written by this package."""
    data = checkpoint.get(PLAN_KEY)
    return None if data is None else Plan.from_dict(data)


def readable_plan(checkpoint: Mapping[str, Any], who: str | None = None) -> Plan | None:
    """:func:`stored_plan`, or None when the stored plan cannot be read (a later schema version, values this version
    refuses). The plan only says what to run: the weights, optimizer state and progress load without it, as from a
    checkpoint plain Lightning wrote, and the strategy plans as it does for one. ``who``: warn, naming it, that the
    plan is not reused (None: say nothing, for a second reader of the same checkpoint)."""
    try:
        return stored_plan(checkpoint)
    except (ValueError, TypeError) as err:
        if who is not None:
            reason = str(err).split(" HINT: ")[0]
            rank_zero_warn(
                f"{who}: the plan stored in the checkpoint cannot be read ({reason}), so it is not reused; the weights, "
                "optimizer state and progress load without it, as from a plain Lightning checkpoint."
            )
        return None
