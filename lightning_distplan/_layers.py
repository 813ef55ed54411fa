"""Which blocks of a LightningModule count as "layers" for profiling and pipeline splitting.

One list serves both: the profiler times these blocks, the planner's ``stage_boundaries`` index
them, and the pipeline strategies cut the model between them. So the two can never disagree,
both call :func:`discover_layers`.

A model is *splittable* when a :class:`PipelineSpec` exists for it: either the LightningModule
defines the documented hook ``pipeline_spec(self) -> PipelineSpec`` or a built-in adapter
recognises it (registered with :func:`register_adapter`; see ``strategies/_adapters.py``).
Otherwise the layers are found by walking the module tree (good enough to profile and to plan
data parallelism, not to build a pipeline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = [
    "PipelineSpec", "DiscoveredLayers", "call_layer", "first_layer_args", "check_crossing", "layer_name", "MappingOutput", "discover_layers", "find_pipeline_spec", "register_adapter",
]

_TARGET_LAYERS = 24  # enough granularity for a balanced split, few enough for cheap hooks
# Modules whose class name ends like this are blocks: their children do not run as a chain
# (attention + MLP inside a transformer layer, the convs of a residual block), so never cut inside.
_BLOCK_SUFFIXES = ("Layer", "Block", "Bottleneck", "Attention", "Cell", "MLP", "Embeddings")


@dataclass(frozen=True)
class PipelineSpec:
    """How to run a model as a chain of blocks.

    Args:
        layers: blocks run in order; block 0 receives ``inputs(batch)``, every later block receives
            the previous block's output (a tensor, or a tuple or list of tensors unpacked as arguments; a
            ``PackedSequence`` goes whole between two blocks of one stage, and no stage may end with it). A block
            may also return a flat mapping of tensors (``{"hidden": h, "mask": m}``, a Hugging Face ``ModelOutput``):
            the next block, on the next stage too, and after the last block ``loss``, get it built again
            (:class:`MappingOutput`).
        inputs: maps a training batch to what block 0 receives (a tensor, or a tuple or list of tensors
            unpacked as arguments; the first stage cuts them into micro-batches, so no dicts or constants).
        loss: maps (last block's output, batch) to the scalar loss of ``training_step`` — the mean
            over the micro-batch, so the mean of micro-batch losses is the loss of the full batch.
        targets: maps a batch to the tensor(s) ``loss`` needs from it (sliced along dim 0 with the
            micro-batches); defaults to the whole batch.

    A layer that is not itself a sub-module of the LightningModule (a wrapper around some of its
    sub-modules) is named after the sub-modules it holds (``"model.embedding+pos_encoder"``), or by
    its ``distplan_name`` attribute when it sets one.
    """

    layers: Sequence[nn.Module]
    inputs: Callable[[Any], Tensor | tuple[Tensor, ...]]
    loss: Callable[[Any, Any], Tensor]
    targets: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        from torch.nn import Module  # (a spec is only made where torch is loaded; this file imports without it)

        from lightning_distplan.errors import ModelSplitError

        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Module):
                raise ModelSplitError(
                    f"PipelineSpec.layers[{i}] is a {type(layer).__name__}, not an nn.Module; every pipeline layer must be a "
                    "module (its weights are placed, profiled and saved per stage).",
                    hint="Use a module (nn.ReLU(), nn.Flatten(), or a small nn.Module whose forward calls the function), "
                    "or fold the function into the neighbouring layer.",
                )


def layer_name(index: int, layer: Any, *, last: bool = False) -> str:
    """How messages name ``PipelineSpec.layers[index]``: ``PipelineSpec.layers[3] (Block)``, ``, the last layer,`` after it."""
    return f"PipelineSpec.layers[{index}] ({type(layer).__name__}){', the last layer,' if last else ''}"


def call_layer(layer: Any, x: Any) -> Any:
    """``layer`` run on the previous layer's output ``x``, a tuple or list of which is unpacked as its arguments
    (the :class:`PipelineSpec` contract, for the profiler's chain and each pipeline stage alike). A ``PackedSequence``
    is one value, not arguments (a tuple only by being a namedtuple): it goes whole, as ``nn.LSTM`` takes it."""
    from torch.nn.utils.rnn import PackedSequence

    return layer(*x) if isinstance(x, (tuple, list)) and not isinstance(x, PackedSequence) else layer(x)


def first_layer_args(inputs: Any) -> tuple[Any, ...]:
    """``spec.inputs(batch)`` as the first layer's positional arguments, refused where a pipeline cannot feed them.

    The pipeline's first stage cuts them into micro-batches along dim 0 and its runtime takes only tensors, so they must
    be a tensor or a tuple / list of tensors. The profiler's chain (:func:`chain_output`) keeps the same rule, so a profile
    never calls a model splittable whose pipeline refuses its inputs at the first step.

    Raises:
        BatchFormatError: ``inputs`` is a ``PackedSequence`` (a namedtuple whose four tensors were unpacked as arguments),
            or holds something other than a tensor (None, a number, a string, a nested tuple, a dict).
    """
    from torch import Tensor
    from torch.nn.utils.rnn import PackedSequence

    from lightning_distplan.errors import BatchFormatError, described

    if isinstance(inputs, PackedSequence):
        raise BatchFormatError(
            "`PipelineSpec.inputs(batch)` gave the first layer a PackedSequence; the pipeline passes only tensors between "
            "stages and cuts them along dim 0, where a PackedSequence's tensors hold time steps of all its sequences.",
            hint="Return the padded tensor and the lengths, e.g. torch.nn.utils.rnn.pad_packed_sequence(p, batch_first=True), "
            "and pack them again inside layers[0].",
        )
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    # the index, not the value: a None argument (an optional mask left out) is a non-tensor too
    wrong = next((i for i, a in enumerate(args) if not isinstance(a, Tensor)), None)
    if wrong is not None:
        given = described(args[wrong])
        raise BatchFormatError(
            f"`PipelineSpec.inputs(batch)` gave the first layer {given}; the pipeline passes only tensors "
            "between stages, so it must return a tensor or a tuple of tensors (the first layer's positional arguments).",
            hint="Return e.g. (batch['input_ids'], batch['attention_mask']) and let layers[0] take them positionally; "
            "constants, and None for an optional argument, belong in the layer itself (its defaults).",
        )
    return args


def check_crossing(output: Any, index: int, layer: Any, *, last: bool = False) -> MappingOutput | None:
    """Refuse what ``layers[index]`` returned where a pipeline stage ends after it: torch's pipelining runtime sends
    only tensors to the next stage, as the positional arguments of its first layer, and takes only tensors from the
    last stage (``last``: ``layers[index]`` is the last layer; its first-step shape inference refused a dict with
    "PipeliningMetadataError: Stage args must be a tensor, tuple, or list of tensors, got dict") before the loss gets
    them. A flat mapping of tensors passes too, as its values in key order, and the next stage's first layer (or the
    loss) gets it built again: its :class:`MappingOutput` is returned. Between two layers of one stage anything may
    pass: the stage calls them as one process does.

    Raises:
        ModelSplitError: ``output`` is not a tensor, a tuple / list of tensors nor a mapping :class:`MappingOutput`
            takes (None, a number, a nested tuple in it, or a ``PackedSequence``, whose four tensors would arrive as
            four arguments).
    """
    from torch import Tensor
    from torch.nn.utils.rnn import PackedSequence

    from lightning_distplan.errors import ModelSplitError, described

    if isinstance(output, Tensor):
        return None
    if isinstance(output, Mapping):
        return MappingOutput.of(output, index, layer, last=last)
    if isinstance(output, PackedSequence) or not isinstance(output, (tuple, list)):
        given = described(output)
    else:
        wrong = next((a for a in output if not isinstance(a, Tensor)), output)
        if wrong is output:
            return None
        given = f"{described(output)} holding {described(wrong)}"
    if last:
        raise ModelSplitError(
            f"{layer_name(index, layer, last=True)} returned {given}; torch's pipelining "
            "runtime takes only tensors from a stage, the last one included, so it must return a tensor, a tuple (or "
            "list) of tensors, or a dict of tensors, which PipelineSpec.loss then gets.",
            hint="Return the tensor(s) the loss needs (e.g. a wrapper of the head returning out['logits']) and read them "
            "in PipelineSpec.loss (loss=lambda out, batch: F.cross_entropy(out, batch['labels'])).",
        )
    raise ModelSplitError(
        f"{layer_name(index, layer)} returned {given}; only tensors cross between pipeline "
        "stages, so a layer that a stage ends with must return a tensor, a tuple (or list) of tensors, or a dict of tensors.",
        hint="Return only the tensors the next layer takes (leave None and constants to its defaults, turn a PackedSequence "
        "into the padded tensor and the lengths with torch.nn.utils.rnn.pad_packed_sequence), or make the two layers one "
        "block so that no stage ends between them.",
    )


@dataclass(frozen=True)
class MappingOutput:
    """A mapping of tensors a layer returns at a stage boundary (``{"hidden": h, "mask": m}``, ``{"logits": ...}``, a
    Hugging Face ``ModelOutput``) across torch's pipelining runtime, which takes only a tensor or a tuple of tensors from
    a stage, the last one included: the stage returns the values in the mapping's key order (:meth:`flatten`), and the
    same mapping is built again (:meth:`rebuild`: the same type, keys and order) for the next stage's first layer, or,
    after the last layer, before ``PipelineSpec.loss`` gets it and ``predict`` returns it. The one-process chain
    (:func:`chain_output`: the check before the cut, the profiler) passes the rebuilt mapping on too, so every run sees
    what the pipeline's layers and loss see."""

    kind: type
    keys: tuple[Any, ...]

    @classmethod
    def of(cls, output: Mapping, index: int, layer: Any, *, last: bool = True) -> MappingOutput:
        """The form of ``output``, what ``layers[index]`` returned at a stage boundary (``last``: the last layer's).

        Raises:
            ModelSplitError: ``output`` holds no value, a value that is no tensor (None, a tuple of hidden states, a
                nested dict), or is of a mapping type that is not built again from its items (``type(output)(**items)``
                for a dataclass such as ``ModelOutput``, ``type(output)(items)`` otherwise).
        """
        from torch import Tensor

        from lightning_distplan.errors import ModelSplitError, described

        name = layer_name(index, layer, last=last)
        what = f"{name} returned {described(output)}"
        if last:
            why = "torch's pipelining runtime takes only tensors from the last stage, so the pipeline passes"
            gets = "PipelineSpec.loss"
            hint = ("Return only the tensors the loss needs: a tensor, a tuple of tensors or a flat dict of tensors (e.g. "
                    "{'logits': out.logits}, leaving out None and nested values), and read them in PipelineSpec.loss.")
        else:
            why = "only tensors cross between pipeline stages, so the pipeline passes"
            gets = "the next stage's first layer"
            hint = ("Return only the tensors the next layer takes, as a flat dict of tensors (leave None and constants to its "
                    "defaults, put a tuple's tensors under keys of their own), or make the two layers one block so that no "
                    "stage ends between them.")
        wrong = next(((k, v) for k, v in output.items() if not isinstance(v, Tensor)), None)
        if wrong is not None or not output:
            found = "no value" if wrong is None else f"{described(wrong[1])} under {wrong[0]!r}"
            raise ModelSplitError(
                f"{what} holding {found}; {why} a mapping's tensors and builds it again for {gets}, which takes no nested "
                "or non-tensor value.",
                hint=hint,
            )
        form = cls(type(output), tuple(output.keys()))
        try:
            rebuilt = form.rebuild(tuple(output.values()))
        except Exception:  # noqa: BLE001 - a type whose constructor takes no items: said below
            rebuilt = None
        if type(rebuilt) is not form.kind or tuple(rebuilt.keys()) != form.keys:
            raise ModelSplitError(
                f"{what}, which the pipeline cannot build again from its items for {gets} ({why} the mapping's tensors).",
                hint=f"Return a dict of the tensors (dict(out)) and read them in {gets}.",
            )
        return form

    def flatten(self, output: Any, *, name: str = "The pipeline's last layer") -> tuple[Tensor, ...]:
        """``output``'s values in key order; ``name``: the layer that returned it, for the error.

        Raises:
            ModelSplitError: ``output`` is not a mapping of this type with these keys (a micro-batch whose layer
                returned other keys than the first one's).
        """
        from lightning_distplan.errors import ModelSplitError, described, described_type

        if type(output) is not self.kind or tuple(output.keys()) != self.keys:
            given = f"{described(output)} with keys {list(output.keys())}" if isinstance(output, Mapping) else described(output)
            raise ModelSplitError(
                f"{name} returned {given} where it returned {described_type(self.kind)} with keys "
                f"{list(self.keys)} before; the pipeline builds the mapping again from its tensors by the keys it saw first.",
                hint="Return the same keys for every micro-batch (leave optional outputs out, or always return them).",
            )
        return tuple(output.values())

    def rebuild(self, values: Sequence[Any]) -> Mapping:
        """The mapping of ``values`` (what :meth:`flatten` gave, or the micro-batches' merged) under the keys."""
        items = dict(zip(self.keys, values, strict=True))
        return self.kind(**items) if dataclasses.is_dataclass(self.kind) else self.kind(items.items())


def chain_output(spec: PipelineSpec, batch: Any, *, cuts: Collection[int] = (), forms: dict[int, MappingOutput] | None = None) -> Any:
    """What a pipeline computes from ``batch`` in one process: ``spec.inputs`` -> every layer -> ``spec.loss``, with
    ``spec.targets(batch)`` when the spec names its targets (as the last stage calls it). ``cuts``: the indices of the
    layers that start a stage, and ``len(spec.layers)`` for the end of the last one; what the layer before each returns
    is checked to cross (:func:`check_crossing`), and a mapping it returns reaches the next layer (or the loss) rebuilt
    from its tensors, as the pipeline's next stage gets it (:class:`MappingOutput`). ``forms``: filled with the mapping's
    form by the index of the cut it crosses, as the chain passes each cut.

    Raises:
        BatchFormatError: ``spec.inputs(batch)`` is nothing a pipeline's first stage takes (:func:`first_layer_args`).
        ModelSplitError: a layer before a cut returned something that cannot cross to the next stage.
    """
    x = spec.inputs(batch)
    first_layer_args(x)
    for i, layer in enumerate(spec.layers):
        x = call_layer(layer, x)
        if i + 1 in cuts:
            form = check_crossing(x, i, layer, last=i + 1 == len(spec.layers))
            if form is not None:
                x = form.rebuild(form.flatten(x))
                if forms is not None:
                    forms[i + 1] = form
    return spec.loss(x, spec.targets(batch) if spec.targets is not None else batch)


@dataclass(frozen=True)
class DiscoveredLayers:
    names: tuple[str, ...]
    """Qualified names inside the LightningModule."""
    modules: tuple[nn.Module, ...]
    spec: PipelineSpec | None
    """Set when the model can be split into a pipeline."""
    split_reason: str
    """Why the model can or cannot be split (shown to users)."""


_ADAPTERS: list[Callable[[nn.Module], PipelineSpec | None]] = []


def register_adapter(fn: Callable[[nn.Module], PipelineSpec | None]) -> Callable[[nn.Module], PipelineSpec | None]:
    """Register a function that returns a PipelineSpec for models it recognises, else None."""
    _ADAPTERS.append(fn)
    return fn


def find_pipeline_spec(module: nn.Module) -> tuple[PipelineSpec | None, str]:
    """The module's own ``pipeline_spec()`` hook first, then the built-in adapters."""
    hook = getattr(module, "pipeline_spec", None)
    if callable(hook):
        spec = hook()
        if not isinstance(spec, PipelineSpec):
            raise TypeError(
                f"{type(module).__name__}.pipeline_spec() returned {type(spec).__name__}, not a PipelineSpec. "
                "HINT: return lightning_distplan.PipelineSpec(layers=..., inputs=..., loss=...)."
            )
        return spec, f"{type(module).__name__}.pipeline_spec()"
    try:  # the adapters live with the strategies; import lazily so profiling works without them
        from lightning_distplan.strategies._adapters import adapter_miss_reason
    except ImportError:
        adapter_miss_reason = None
    for adapter in _ADAPTERS:
        spec = adapter(module)
        if spec is not None:
            return spec, f"built-in adapter {adapter.__name__}"
    reason = adapter_miss_reason(module) if adapter_miss_reason is not None else None
    if reason is not None:
        return None, reason
    return None, (
        f"{type(module).__name__} defines no `pipeline_spec()` and no built-in adapter recognises it, "
        "so it can run data parallel but not as a pipeline"
    )


def discover_layers(module: nn.Module, *, target: int = _TARGET_LAYERS) -> DiscoveredLayers:
    """The ordered blocks of ``module`` (execution order is fixed later by the profiler's hooks)."""
    spec, reason = find_pipeline_spec(module)
    if spec is not None:
        by_id = {id(m): name for name, m in module.named_modules()}
        names: list[str] = []
        for i, layer in enumerate(spec.layers):
            name = by_id.get(id(layer)) or getattr(layer, "distplan_name", None) or _wrapper_name(layer, by_id)
            name = name or f"pipeline_layer_{i}"
            names.append(name if name not in names else f"{name}#{i}")  # names must stay unique
        return DiscoveredLayers(tuple(names), tuple(spec.layers), spec, reason)

    frontier: list[tuple[str, nn.Module]] = list(module.named_children())
    while len(frontier) < target:
        expandable = [
            (i, sum(p.numel() for p in m.parameters()))
            for i, (_, m) in enumerate(frontier)
            if len(list(m.children())) >= 2 and not type(m).__name__.endswith(_BLOCK_SUFFIXES)
        ]
        if not expandable:
            break
        i, _ = max(expandable, key=lambda x: x[1])
        name, m = frontier[i]
        children = [(f"{name}.{child_name}", child) for child_name, child in m.named_children()]
        if len(frontier) - 1 + len(children) > 4 * target:
            break
        frontier[i : i + 1] = children
    return DiscoveredLayers(tuple(n for n, _ in frontier), tuple(m for _, m in frontier), None, reason)


def _wrapper_name(wrapper: nn.Module, by_id: dict[int, str]) -> str:
    """``"model.embedding+pos_encoder"``: the outermost sub-modules of the LightningModule a wrapper holds.

    A name that shares the previous one's parent is shortened to its last part.
    """
    parts: list[str] = []
    inside: list[str] = []
    for _, sub in wrapper.named_modules():
        name = by_id.get(id(sub))
        if name is None or any(name == n or name.startswith(n + ".") for n in inside):
            continue
        inside.append(name)
        parent, _, leaf = name.rpartition(".")
        prev_parent = inside[-2].rpartition(".")[0] if len(inside) > 1 else None
        parts.append(leaf if parts and parent and parent == prev_parent else name)
    return "+".join(parts)
