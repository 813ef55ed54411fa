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

__all__ = ["partition_layers", "partition_pipeline", "stage_sums"]


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


def partition_pipeline(
    layer_times: Sequence[float],
    pp: int,
    *,
    cut_times: Sequence[float],
    static_memory: Sequence[float],
    activation_memory: Sequence[float],
    cut_memory: Sequence[float],
    in_flight: Sequence[int],
    memory_cap: float | None,
    tied: Sequence[tuple[Sequence[int], float]] = (),
    no_cut: Sequence[int] = (),
) -> tuple[int, ...]:
    """Split layers into ``pp`` pipeline stages minimising the slowest stage, hand-overs and memory included.

    What :func:`~lightning_distplan.costmodel.predict` charges a stage (DESIGN §4): stage ``k`` over
    layers ``[a, b)`` takes ``Σ layer_times[a:b]`` plus the hand-over it receives
    (``cut_times[a - 1]``, k > 0) plus the one it sends (``cut_times[b - 1]``, k < pp − 1), and holds
    ``Σ static_memory[a:b] + in_flight[k] · (Σ activation_memory[a:b] + cut_memory[a - 1])`` bytes
    (the received tensor, saved by its first layer, is a second copy on the receiving device), plus
    a full copy of each ``tied`` group it uses whose first user is on an earlier stage.
    Hand-overs make cutting after a layer with a large output cost both stages time, and 1F1B's
    stages hold different numbers of micro-batches, which the compute-only
    :func:`partition_layers` does not see.

    Exact dynamic programme over (stages, first layer not yet covered), O(pp · L²); among splits
    with the same slowest stage, the one with the cheapest hand-overs (then the first found). The
    slowest stage is a proxy: the step time ``predict()`` prices depends on every stage (the
    schedule's fill and bubble), so another split can occasionally price a few percent lower.

    Args:
        layer_times: seconds of each layer (forward + backward at the plan's micro-batch).
        pp: number of stages.
        cut_times: seconds of the hand-over after each layer (the last entry is never used).
        static_memory: bytes of parameters, gradients and optimizer state each layer brings.
        activation_memory: bytes of activations each layer saves per in-flight micro-batch.
        cut_memory: bytes of each layer's output (the received copy on the next stage).
        in_flight: micro-batches stage k holds at its peak (length ``pp``).
        memory_cap: the most bytes one stage may hold (None: no cap).
        tied: parameters several layers use, as (those layers, bytes of one more copy with its
            gradient and optimizer state); ``static_memory`` counts each once, at its first user.
        no_cut: layers no stage may start at (besides layer 0), e.g. to keep a tied group on one stage.

    Raises:
        ModelSplitError: ``pp`` below 1 or above the number of layers, or malformed lists.
        InfeasiblePlanError: no split keeps every stage under ``memory_cap``.
    """
    n_layers = len(layer_times)
    partition_layers(layer_times, pp)  # the same checks of pp and the times
    lists = {"cut_times": cut_times, "static_memory": static_memory, "activation_memory": activation_memory, "cut_memory": cut_memory}
    for what, values in lists.items():
        if len(values) != n_layers or any(not math.isfinite(float(v)) or float(v) < 0 for v in values):
            raise ModelSplitError(f"`{what}` must hold {n_layers} finite non-negative numbers, one per layer.", hint="Pass one value per layer, in layer order.")
    if len(in_flight) != pp:
        raise ModelSplitError(f"`in_flight` has {len(in_flight)} entries for {pp} stages.", hint="Give one micro-batch count per stage.")
    groups = []
    for layers, nbytes in tied:
        where = sorted({int(i) for i in layers})
        if not where or where[0] < 0 or where[-1] >= n_layers or not math.isfinite(float(nbytes)) or float(nbytes) < 0:
            raise ModelSplitError(
                f"A tied group of layers {list(layers)} and {nbytes!r} bytes does not fit {n_layers} layers.",
                hint=f"Give at least one layer index in [0, {n_layers}) and bytes >= 0.",
            )
        # users[j]: how many of the group's layers lie before layer j
        users = [0, *accumulate(1 if i in where else 0 for i in range(n_layers))]
        groups.append((where[0], users, float(nbytes)))
    barred = {int(j) for j in no_cut}
    cap = math.inf if memory_cap is None else float(memory_cap)
    pt = [0.0, *accumulate(float(t) for t in layer_times)]
    ps = [0.0, *accumulate(float(x) for x in static_memory)]
    pa = [0.0, *accumulate(float(x) for x in activation_memory)]
    cuts = [float(x) for x in cut_times]
    held = [float(x) for x in cut_memory]
    inf = math.inf
    # best[j]: (slowest stage, hand-over seconds) of the best split of layers [0, j) into the stages so far
    best: list[tuple[float, float]] = [(inf, inf)] * (n_layers + 1)
    best[0] = (0.0, 0.0)
    choice: list[list[int]] = []
    for k in range(pp):
        last = k == pp - 1
        nxt: list[tuple[float, float]] = [(inf, inf)] * (n_layers + 1)
        arg = [-1] * (n_layers + 1)
        # stage k covers [i, j): at least one layer, and one layer left for each later stage
        for j in range(k + 1, n_layers - (pp - 1 - k) + 1):
            if last and j != n_layers:
                continue
            send = 0.0 if last else cuts[j - 1]
            for i in range(k, j):
                before = best[i]
                if before[0] == inf:
                    continue
                receive = cuts[i - 1] if k > 0 else 0.0
                if k > 0 and i in barred:
                    continue
                memory = ps[j] - ps[i] + in_flight[k] * (pa[j] - pa[i] + (held[i - 1] if k > 0 else 0.0))
                if groups:  # a copy of each tied group this stage uses but an earlier one holds
                    memory += sum(nbytes for first, users, nbytes in groups if first < i and users[j] > users[i])
                if memory > cap:
                    continue
                stage = pt[j] - pt[i] + receive + send
                cand = (max(before[0], stage), before[1] + send)
                if cand < nxt[j]:
                    nxt[j], arg[j] = cand, i
        best = nxt
        choice.append(arg)
    if best[n_layers][0] == inf:
        if barred:
            under = "" if cap == inf else f" and keeps every stage under {cap:.4g} bytes"
            raise InfeasiblePlanError(
                f"No split of {n_layers} layers into {pp} stages starts no stage at layers {sorted(barred)}{under}.",
                hint="Allow more cut points, use fewer stages or devices with more memory.",
            )
        raise InfeasiblePlanError(
            f"No split of {n_layers} layers into {pp} stages keeps every stage under {cap:.4g} bytes.",
            hint="Use more pipeline stages, a smaller micro-batch or devices with more memory.",
        )
    starts, j = [], n_layers
    for k in range(pp - 1, 0, -1):
        j = choice[k][j]
        starts.append(j)
    return tuple(reversed(starts))


def stage_sums(values: Sequence[float], boundaries: Sequence[int]) -> tuple[float, ...]:
    """Sum ``values`` over each stage that ``boundaries`` (Plan convention) delimit."""
    edges = [0, *boundaries, len(values)]
    return tuple(float(sum(values[a:b])) for a, b in zip(edges, edges[1:]))
