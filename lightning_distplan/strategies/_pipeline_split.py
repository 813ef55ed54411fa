"""Pure helpers of the pipeline strategy: where to cut, what one stage runs, how a batch is split.

Nothing here talks to a process group, so everything tests in milliseconds on one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_distplan._layers import MappingOutput, call_layer, check_crossing, first_layer_args, layer_name
from lightning_distplan.errors import BatchFormatError, BatchNotFactorableError, InfeasiblePlanError, ModelSplitError, described
from lightning_distplan.profiling._batches import find_batch_size as batch_size_of
from lightning_distplan.profiling._batches import slice_samples

__all__ = [
    "StageModule",
    "resolve_boundaries",
    "stage_ranges",
    "split_microbatches",
    "split_structure",
    "auto_n_microbatches",
    "PipelineLayout",
]

_HOOK_EXAMPLE = """
    from lightning_distplan import PipelineSpec

    def pipeline_spec(self):  # in your LightningModule
        return PipelineSpec(
            layers=[self.embed, *self.blocks, self.head],        # run in this order
            inputs=lambda batch: batch[0],                        # what layers[0] receives
            loss=lambda out, batch: F.cross_entropy(out, batch[1]),  # mean over the micro-batch
        )"""


def no_spec_error(reason: str) -> ModelSplitError:
    return ModelSplitError(
        f"The model cannot run as a pipeline: {reason}.",
        hint="Define `pipeline_spec()` on the LightningModule (or `pipeline_loss(output, batch)` next to a "
        "recognised `self.model`), e.g.:" + _HOOK_EXAMPLE,
    )


class StageModule(nn.Module):
    """The contiguous blocks ``layers[start:stop]`` of a :class:`PipelineSpec` run as one stage.

    A block's output is passed to the next block unpacked when it is a tuple, as the spec's contract
    says. The blocks are the LightningModule's own sub-modules (not copies), so the module's
    ``state_dict`` keys never change.

    Between two blocks anything may pass (a dict, a ``ModelOutput``), as in one process; what the stage returns goes
    through torch's runtime, to the next stage or (the last stage) to the loss, and must be a tensor, a tuple of
    tensors or a flat mapping of tensors (:func:`~lightning_distplan._layers.check_crossing`, the rule the check before
    the cut and the profiler apply). A mapping crosses as its values in key order (:attr:`output_form`) and is built
    again: by the next stage for its first block (its :attr:`input_form`), by the strategy for the loss and predict.
    ``start``: the index of the first block in ``PipelineSpec.layers``; ``last``: this is the last stage;
    ``input_form`` / ``output_form``: the mappings the check before the cut saw cross into and out of this stage (a
    later stage learns the keys it gets nowhere else; the last stage's own output form, where the check did not run, is
    found at its first forward).
    """

    def __init__(self, layers: Sequence[nn.Module], *, start: int = 0, last: bool = False,
                 input_form: MappingOutput | None = None, output_form: MappingOutput | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(layers)
        self.start = start
        self.last = last
        self.input_form = input_form
        """The mapping the previous stage's last block returned: its tensors arrive, the first block gets it again."""
        self.forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext
        """What the blocks run in: the precision plugin's forward context (autocast for 'bf16-mixed')."""
        self.copy_inputs = False
        """Whether the blocks get a copy of the received activations (set once a block overwrote them in place)."""
        self.output_form = output_form
        """The mapping this stage's last block returns, whose tensors cross: the check's before the cut (the last
        stage's, where the check did not run: by the first one it returned, at torch's shape inference, which runs it
        first)."""

    def forward(self, *args: Any) -> Any:
        if not self.copy_inputs:
            try:
                return self._run(args)
            except RuntimeError as err:
                if not _is_in_place_on_input(err):
                    raise
                # A first block that works in place on what it receives (nn.ReLU(inplace=True) right after the cut, as
                # the VGG adapter's and many nn.Sequential stages start): the received activation is a leaf of this
                # stage's graph, which autograd does not let an op overwrite. From now on the stage works on a copy.
                # torch's shape inference runs each new stage's first forward (its buffer updates put back by
                # GuardedStage), so the step that meets this first repeats no buffer update.
                self.copy_inputs = True
        return self._run(args)

    def _run(self, args: tuple[Any, ...]) -> Any:
        # p2p send/recv need contiguous buffers: make boundary activations and their gradients contiguous.
        x: Any = tuple(_ContiguousGrad.apply(a) if isinstance(a, Tensor) and a.requires_grad else a for a in args)
        if self.copy_inputs:
            x = tuple(a.clone() if isinstance(a, Tensor) and a.requires_grad else a for a in x)
        if self.input_form is not None:
            x = (self.input_form.rebuild(x),)  # the previous stage's mapping, as one argument of the first block
        with self.forward_context():
            for block in self.blocks:
                x = call_layer(block, x)
        index = self.start + len(self.blocks) - 1
        if self.output_form is not None or isinstance(x, Mapping):
            name = layer_name(index, self.blocks[-1], last=self.last)
            if self.output_form is None:
                if not self.last:
                    raise ModelSplitError(
                        f"{name} returned {described(x)} at a stage boundary where the check before the cut saw none (or could "
                        "not run that far on the run's first batch); the next stage builds a mapping again only by the keys seen there.",
                        hint="Return a mapping there for every batch; where the check cannot run (the run's first batch unreadable, or "
                        "the layers failing on its CPU samples before a GPU run's cut), return a tuple of tensors, which crosses "
                        "without keys.",
                    )
                self.output_form = MappingOutput.of(x, index, self.blocks[-1])
            x = self.output_form.flatten(x, name=name)  # what torch's runtime takes; rebuilt after it
        check_crossing(x, index, self.blocks[-1], last=self.last)
        if isinstance(x, list):
            x = tuple(x)  # what crosses to the next stage: a tuple (torch's runtime takes no list)
        if isinstance(x, tuple):
            return tuple(t.contiguous() if isinstance(t, Tensor) else t for t in x)
        return x.contiguous() if isinstance(x, Tensor) else x


def _is_in_place_on_input(err: RuntimeError) -> bool:
    """Whether autograd refused an in-place op on a stage's received activation (a view :class:`_ContiguousGrad` made)."""
    text = str(err)
    return "modified inplace" in text and "custom Function" in text


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward returns a contiguous gradient (autograd may produce strided ones)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def stage_ranges(boundaries: Sequence[int], n_layers: int) -> list[tuple[int, int]]:
    """``[start, stop)`` layer range of every stage from the Plan's ``stage_boundaries``."""
    edges = [0, *boundaries, n_layers]
    return list(zip(edges[:-1], edges[1:]))


def resolve_boundaries(
    stage_boundaries: Sequence[int] | str,
    *,
    stages: int,
    layers: Sequence[nn.Module],
) -> tuple[int, ...]:
    """Validate explicit boundaries, or balance the layers over ``stages`` when ``"auto"``.

    ``"auto"`` minimises the largest stage by parameter count (a proxy for time when no profile is
    given) with the exact contiguous partition solver of ``costmodel`` when it is available.
    """
    n_layers = len(layers)
    if stages > n_layers:
        raise ModelSplitError(
            f"Cannot split {n_layers} layer{'s' if n_layers != 1 else ''} into {stages} pipeline stages (more stages than layers).",
            hint=f"Use at most {n_layers} stage{'s' if n_layers != 1 else ''}, or expose finer blocks through `pipeline_spec()`.",
        )
    if not isinstance(stage_boundaries, str):  # given, checked by PipelineStrategy
        b = tuple(int(x) for x in stage_boundaries)  # type: ignore[union-attr]
        if len(b) != stages - 1 or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])) or (b and b[-1] >= n_layers):
            raise InfeasiblePlanError(
                f"`stage_boundaries` {list(b)} must be {stages - 1} strictly increasing layer indices in [1, {n_layers - 1}] "
                f"for {stages} stages over {n_layers} layers.",
                hint="Give the index of the first layer of every stage after the first, or use 'auto'.",
            )
        return b
    # +1 so parameter-free blocks (pooling, activations) still count as work and get spread out
    weights = [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]
    try:
        from lightning_distplan.costmodel._partition import partition_layers
    except ImportError:  # pragma: no cover - costmodel is part of the package; keep a fallback anyway
        return _greedy_partition(weights, stages)
    return tuple(partition_layers(weights, stages))


def _greedy_partition(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    total = sum(weights)
    bounds: list[int] = []
    acc = 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        remaining_layers = len(weights) - (i + 1)
        remaining_cuts = stages - 1 - len(bounds)
        if remaining_cuts and (acc >= total * (len(bounds) + 1) / stages or remaining_layers == remaining_cuts):
            bounds.append(i + 1)
    return tuple(bounds)


def auto_n_microbatches(per_replica_batch: int, stages: int) -> int:
    """The largest divisor of the per-replica batch up to ``4 * stages`` (bubble (p-1)/(n+p-1) below ~20 %)."""
    for n in range(min(per_replica_batch, 4 * stages), 0, -1):
        if per_replica_batch % n == 0:
            return n
    return 1  # pragma: no cover - 1 always divides


def split_structure(obj: Any, n: int, *, size: int | None = None) -> list[Any]:
    """``obj`` (a batch or part of one) cut into ``n`` consecutive chunks of its ``size`` samples.

    Tensors and numpy arrays with the batch's rows and per-sample lists (file names, detection targets) are cut; the
    rest (a 0-d temperature, a constant tag) goes whole to every chunk. Mappings keep their type
    (transformers' ``BatchEncoding``). The rules are the profiler's and dp_ga's
    (:func:`~lightning_distplan.profiling._batches.slice_samples`). ``size``: the samples in the whole batch, as the
    strategy's :class:`~lightning_distplan.profiling._batches.BatchSizer` read them (so a part holding a constant
    first, ``(class_weights, labels)``, is cut at its labels); None: :func:`find_batch_size` of ``obj``.
    """
    if size is None:
        size = batch_size_of(obj)
    if size is None:
        return [obj] * n
    # as torch.tensor_split cuts: the first size % n chunks one sample longer
    starts = [i * (size // n) + min(i, size % n) for i in range(n + 1)]
    return [slice_samples(obj, starts[i], starts[i + 1], size) for i in range(n)]


def split_microbatches(inputs: Any, n: int, *, size: int | None = None, what: str = "per-replica batch") -> list[tuple[Any, ...]]:
    """Split what layer 0 receives into ``n`` micro-batches of positional-argument tuples.

    ``size``: the samples in the whole batch (:func:`split_structure`); None: :func:`find_batch_size` of ``inputs``.

    Raises:
        BatchFormatError: ``inputs`` is not a tensor or a tuple / list of tensors (a ``PackedSequence`` is not), or
            none of its tensors has the batch's ``size`` rows.
        BatchNotFactorableError: the batch does not split into ``n`` equal micro-batches (unequal
            micro-batches would weight samples unequally in the mean of micro-batch losses).
    """
    args = first_layer_args(inputs)
    found = batch_size_of(args) if size is None else size
    rows = [int(a.shape[0]) for a in args if a.dim() > 0]
    if found is None or found not in rows:
        holds = f"tensors of {', '.join(map(str, rows))} rows" if rows else "no tensor with a batch dimension"
        but = f", but the {what} holds {size} samples" if size is not None else ""
        raise BatchFormatError(
            f"`PipelineSpec.inputs(batch)` holds {holds}{but}; the pipeline cuts the first layer's inputs into "
            "micro-batches along dim 0.",
            hint="Make `PipelineSpec.inputs(batch)` return a tensor or a tuple of tensors with the batch's samples on dim 0.",
        )
    if found % n:
        raise BatchNotFactorableError(
            f"The {what} ({found}) is not divisible by `n_microbatches` ({n}).",
            hint=f"Use a batch size that is a multiple of {n} (and `drop_last=True` on the DataLoader), or change `n_microbatches`.",
        )
    return [tuple(chunk) for chunk in split_structure(args, n, size=found)]


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Where this rank sits in the hybrid dp × pp grid: stage ``k`` of replica ``r`` is rank ``r·pp + k``."""

    dp: int
    pp: int
    rank: int

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [replica * self.pp + k for k in range(self.pp)]

    def stage_ranks(self, stage: int) -> list[int]:
        return [r * self.pp + stage for r in range(self.dp)]

    @classmethod
    def of(cls, *, world_size: int, stages: int, rank: int) -> PipelineLayout:
        if world_size % stages:
            raise InfeasiblePlanError(
                f"The world size ({world_size}) is not divisible by the number of pipeline stages ({stages}).",
                hint=f"Use a number of devices that is a multiple of {stages}, or change `stages`.",
            )
        return cls(dp=world_size // stages, pp=stages, rank=rank)
