"""Exact contiguous partition of the profiled layers into pipeline stages.

fairscale's ``nn.pipe.balance.blockpartition.solve`` (Bárány et al.) is documented in its own
source as "The result might not be optimal", and it ignores memory; this module is an exact,
pure-Python replacement: minimise the slowest stage subject to a per-stage memory cap.

Method: the optimal bottleneck is the sum of some contiguous block, so binary-search the sorted
block sums; for a bound T, a greedy left-to-right sweep that makes every block as long as time
≤ T and memory ≤ cap allow gives the fewest blocks k_min(T). Because times and memories are
non-negative, splitting a block never breaks either bound, so any p in [k_min(T), L] is
reachable, and T is feasible iff k_min(T) ≤ p. O(L² log L) for L layers.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Sequence

from lightning_distplan.errors import InfeasiblePlanError, ModelSplitError

__all__ = ["partition_layers", "stage_sums"]


def partition_layers(
    layer_times: Sequence[float],
    pp: int,
    *,
    layer_memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
) -> tuple[int, ...]:
    """Split layers into ``pp`` contiguous non-empty stages minimising the slowest stage's time.

    Args:
        layer_times: time of each layer (any unit, non-negative), in execution order.
        pp: number of stages.
        layer_memory: bytes each layer adds to its stage (non-negative); needs ``memory_cap``.
        memory_cap: the most bytes one stage may hold.

    Returns:
        ``stage_boundaries`` in the :class:`~lightning_distplan.plan.Plan` convention: the index of
        the first layer of stages 1..pp-1 (empty for ``pp == 1``).

    Raises:
        ModelSplitError: ``pp`` is below 1 or above the number of layers, or the times/memory lists are malformed.
        InfeasiblePlanError: no split keeps every stage under ``memory_cap``.

    Example:
        >>> partition_layers([1, 1, 1, 3], 2)
        (3,)
    """
    n_layers = len(layer_times)
    if not isinstance(pp, int) or pp < 1:
        raise ModelSplitError(f"The number of pipeline stages must be a positive integer, got {pp!r}.", hint="Use pp >= 1.")
    if pp > n_layers:
        raise ModelSplitError(
            f"Cannot split {n_layers} profiled layers into {pp} pipeline stages (pp > number of layers).",
            hint=f"Use at most {n_layers} stages, or expose finer layers through the model's `pipeline_spec()`.",
        )
    times = [float(t) for t in layer_times]
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ModelSplitError(f"Layer times must be finite and non-negative, got {times}.", hint="Pass the profiled per-layer times (seconds >= 0).")
    if (layer_memory is None) != (memory_cap is None):
        raise ModelSplitError(
            f"`layer_memory` and `memory_cap` go together, got layer_memory={'None' if layer_memory is None else 'a list'} and memory_cap={memory_cap!r}.",
            hint="Pass both `layer_memory` and `memory_cap`, or neither.",
        )
    mems = [0.0] * n_layers if layer_memory is None else [float(x) for x in layer_memory]
    if len(mems) != n_layers:
        raise ModelSplitError(f"`layer_memory` has {len(mems)} entries for {n_layers} layers.", hint="Give one memory size per layer, in layer order.")
    cap = math.inf if memory_cap is None else float(memory_cap)
    if pp == 1:
        if sum(mems) > cap:
            raise InfeasiblePlanError(
                f"The whole model needs {sum(mems):.4g} bytes, above the per-stage cap of {cap:.4g}.",
                hint="Use more pipeline stages or a smaller micro-batch.",
            )
        return ()
    if max(mems) > cap:
        worst = max(range(n_layers), key=lambda i: mems[i])
        raise InfeasiblePlanError(
            f"Layer {worst} alone needs {mems[worst]:.4g} bytes, above the per-stage cap of {cap:.4g}, so no split into {pp} stages fits.",
            hint="Use a smaller micro-batch or devices with more memory.",
        )
    # Prefix sums, used identically by the candidate list and the greedy sweep so that a block
    # whose sum *is* the candidate compares equal (no float drift between the two).
    pt = [0.0, *accumulate(times)]
    pm = [0.0, *accumulate(mems)]

    def greedy(bound: float, stages: int) -> list[int] | None:
        """Fewest-block sweep; with ``stages`` it also keeps one layer per stage still to come."""
        starts = [0]
        i = 0
        while True:
            j = i + 1  # a block holds at least one layer
            if pt[j] - pt[i] > bound:
                return None
            left = stages - len(starts)  # stages still to open after this one
            while j < n_layers - left and pt[j + 1] - pt[i] <= bound and pm[j + 1] - pm[i] <= cap:
                j += 1
            if j == n_layers:
                return starts
            if len(starts) == stages:
                return None
            starts.append(j)
            i = j

    candidates = sorted({pt[j] - pt[i] for i in range(n_layers) for j in range(i + 1, n_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    if greedy(candidates[hi], pp) is None:  # only memory can make the widest bound fail
        raise InfeasiblePlanError(
            f"No split of {n_layers} layers into {pp} stages keeps every stage under {cap:.4g} bytes.",
            hint="Use more pipeline stages, a smaller micro-batch or devices with more memory.",
        )
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(candidates[mid], pp) is not None:
            hi = mid
        else:
            lo = mid + 1
    starts = greedy(candidates[lo], pp)
    assert starts is not None and len(starts) == pp  # internal invariant, not user input
    return tuple(starts[1:])


def stage_sums(values: Sequence[float], boundaries: Sequence[int]) -> tuple[float, ...]:
    """Sum ``values`` over each stage that ``boundaries`` (Plan convention) delimit."""
    edges = [0, *boundaries, len(values)]
    return tuple(float(sum(values[a:b])) for a, b in zip(edges, edges[1:]))
