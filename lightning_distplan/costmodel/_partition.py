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

import numpy as np

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
    times = _checked_times(layer_times, pp)
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


def _checked_times(layer_times: Sequence[float], pp: int) -> list[float]:
    """The layer times as floats, after the checks of ``pp`` and the times both partitions make."""
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
    return times


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
    receive_buffers: int | None = None,
    output_kept: Sequence[float] | None = None,
    received_saved: Sequence[float] | None = None,
    grad_bytes: Sequence[float] | None = None,
    grad_cap: float | None = None,
) -> tuple[int, ...]:
    """Split layers into ``pp`` pipeline stages minimising the slowest stage, hand-overs and memory included.

    What :func:`~lightning_distplan.costmodel.predict` charges a stage (DESIGN §4): stage ``k`` over
    layers ``[a, b)`` takes ``Σ layer_times[a:b]`` plus the hand-over it receives
    (``cut_times[a - 1]``, k > 0) plus the one it sends (``cut_times[b - 1]``, k < pp − 1), and holds
    ``Σ static_memory[a:b] + in_flight[k] · (Σ activation_memory[a:b] + cut_memory[a - 1])`` bytes
    (the received tensor, saved by its first layer, is a second copy on the receiving device), plus
    a full copy of each ``tied`` group it uses whose first user is on an earlier stage. With
    ``receive_buffers`` r, the received tensor counts r times instead of ``in_flight[k]`` times, and a
    stage that sends (k < pp − 1) also holds r buffers of its output's size (the gradients it receives back).
    With ``output_kept`` / ``received_saved`` (and ``receive_buffers``), a stage ending after layer j holds
    ``output_kept[j]`` more per micro-batch in flight (its output, cached until its backward, where no layer of
    its own saved it) and one starting after layer j holds ``received_saved[j]`` less (its first layer's saved
    input, counted in ``activation_memory``, is the receive buffer).
    Hand-overs make cutting after a layer with a large output cost both stages time, and 1F1B's
    stages hold different numbers of micro-batches, which the compute-only
    :func:`partition_layers` does not see.

    Exact dynamic programme over (stages, first layer not yet covered): O(pp · L²) float operations,
    done stage by stage as numpy array operations over every (first layer, end) pair, so O(pp) Python
    steps; among splits with the same slowest stage, the one with the cheapest hand-overs (then the
    first found: the smallest first layer for each stage the programme extends). The
    slowest stage is a proxy: the step time ``predict()`` prices depends on every stage (the
    schedule's fill and bubble), so another split can price lower (up to 1.33× in random settings
    at few micro-batches); ``predict()`` therefore weighs every split where their number allows
    (``_predict._best_priced_split``).

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
        receive_buffers: receive buffers a stage keeps for its input and for its output's gradient, whatever
            its in-flight count (torch's ``PipelineStage`` allocates one of each per micro-batch); None: the
            received input counts once per in-flight micro-batch and no gradient buffer is held.
        output_kept / received_saved: per layer, bytes as above (None: zeros); only with ``receive_buffers``.
        grad_bytes / grad_cap: per layer, the gradient bytes it adds to its stage's data-parallel all-reduce, and the
            most one stage may hold (None: no cap); :func:`~lightning_distplan.costmodel.predict` lowers the cap below
            each split's largest stage, straight down to where a split could price lower (not byte by byte), to find
            splits whose hybrid dp×pp all-reduce is shorter.

    Raises:
        ModelSplitError: ``pp`` below 1 or above the number of layers, or malformed lists.
        InfeasiblePlanError: no split keeps every stage under ``memory_cap``.
    """
    n_layers = len(layer_times)
    pt = [0.0, *accumulate(_checked_times(layer_times, pp))]
    if not math.isfinite(pt[-1]):
        # Times summing past the float range. What ran here before for its checks,
        # partition_layers' search, can then fail by itself; kept so that such input fails as it did.
        partition_layers(layer_times, pp)
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
    if (grad_bytes is None) != (grad_cap is None) or (grad_bytes is not None and (
            len(grad_bytes) != n_layers or any(not math.isfinite(float(v)) or float(v) < 0 for v in grad_bytes))):
        raise ModelSplitError(
            f"`grad_bytes` must hold {n_layers} finite non-negative numbers, one per layer, and come with `grad_cap`.",
            hint="Pass both `grad_bytes` (one per layer) and `grad_cap`, or neither.",
        )
    grads = None if grad_bytes is None else (_block_sums([0.0, *accumulate(float(x) for x in grad_bytes)]), float(grad_cap))  # type: ignore[arg-type]
    with np.errstate(all="ignore"):  # sums past the float range give inf (bytes: nan, never over the cap), unwarned as in Python
        choice = _programme(
            pp, pt, static_memory, activation_memory, cut_times, cut_memory, in_flight, cap, groups, barred, receive_buffers,
            output_kept, received_saved, grads,
        )
    if choice is None:
        if grads is not None:
            raise InfeasiblePlanError(
                f"No split of {n_layers} layers into {pp} stages keeps every stage's gradients under {grads[1]:.4g} bytes"
                + ("" if cap == math.inf else f" and every stage under {cap:.4g} bytes") + ("" if not barred else f" starting no stage at layers {sorted(barred)}") + ".",
                hint="Allow more gradient bytes per stage, use more stages or devices with more memory.",
            )
        if barred:
            under = "" if cap == math.inf else f" and keeps every stage under {cap:.4g} bytes"
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
        j = int(choice[k][j])
        starts.append(j)
    return tuple(reversed(starts))


def _programme(
    pp: int,
    pt: list[float],
    static_memory: Sequence[float],
    activation_memory: Sequence[float],
    cut_times: Sequence[float],
    cut_memory: Sequence[float],
    in_flight: Sequence[int],
    cap: float,
    groups: list[tuple[int, list[int], float]],
    barred: set[int],
    receive_buffers: int | None = None,
    output_kept: Sequence[float] | None = None,
    received_saved: Sequence[float] | None = None,
    grads: tuple[np.ndarray, float] | None = None,
) -> list[np.ndarray] | None:
    """partition_pipeline's programme: ``choice[k][j]``, the first layer of stage ``k`` in the best split
    of layers ``[0, j)`` into stages ``0..k``, or None where no split of all layers into ``pp`` stages fits.

    Stage by stage, every (first layer i, end j) pair at once as numpy arrays: O(pp · L²) operations.
    """
    n_layers = len(pt) - 1
    inf = math.inf
    # Edges 0..L index the arrays: stage [i, j) is row i, column j of the square ones. Each entry is
    # the float64 operation a scalar loop over (i, j) would do, in its order, so splits and ties are
    # decided on the same numbers.
    edge = np.arange(n_layers + 1)
    span = _block_sums(pt)
    static = _block_sums([0.0, *accumulate(float(x) for x in static_memory)])
    activations = _block_sums([0.0, *accumulate(float(x) for x in activation_memory)])
    handover = np.array([0.0, *(float(x) for x in cut_times)])  # [i]: seconds of the hand-over into layer i
    received = np.array([0.0, *(float(x) for x in cut_memory)])  # [i]: bytes of layer i - 1's output
    kept_at = np.array([0.0, *(float(x) for x in ([0.0] * n_layers if output_kept is None else output_kept))])  # [j]: kept by a stage ending at j
    resaved_at = np.array([0.0, *(float(x) for x in ([0.0] * n_layers if received_saved is None else received_saved))])  # [i]: saved input that is the buffer
    later = edge[:, None] < edge[None, :]  # [i, j]: i < j, a stage holds at least one layer
    # a middle stage's seconds (it receives and sends) and bytes per micro-batch (with the received copy)
    middle = span + handover[:, None] + handover[None, :]
    held = activations + received[:, None]
    copies = np.zeros_like(span)  # [i, j]: the tied groups' copies a stage [i, j) holds past their first user's
    for first, users, nbytes in groups:
        ahead = np.array(users)
        copies = copies + np.where((first < edge)[:, None] & (ahead[None, :] > ahead[:, None]), nbytes, 0.0)
    may_start = np.array([i not in barred for i in range(n_layers + 1)])
    # best[j], handed[j]: (slowest stage, hand-over seconds) of the best split of layers [0, j) into the
    # stages so far, inf where there is none; choice[k][j]: the first layer of stage k in it
    best = np.full(n_layers + 1, inf)
    handed = np.full(n_layers + 1, inf)
    best[0] = handed[0] = 0.0
    choice: list[np.ndarray] = []
    for k in range(pp):
        last = k == pp - 1
        stop = n_layers - (pp - 1 - k)  # stage k ends at most here: one layer left for each later stage
        cols = slice(n_layers, n_layers + 1) if last else slice(k + 1, stop + 1)
        ready = best[:stop] < inf
        if k > 0:
            ready &= may_start[:stop]
        starts = np.flatnonzero(ready)
        if not starts.size:  # no split reaches stage k
            return None
        rows = slice(int(starts[0]), int(starts[-1]) + 1)
        ok = ready[rows, None] & later[rows, cols]
        factor = in_flight[k] * 1.0  # as the scalar product in_flight[k] * (...) converts it
        if cap < inf:  # memory > inf (or nan) never holds
            if receive_buffers is None:
                memory = static[rows, cols] + factor * (held[rows, cols] if k > 0 else activations[rows, cols] + 0.0)
            else:  # the input's buffers (k > 0) and the output gradient's (k < pp - 1), whatever is in flight
                memory = static[rows, cols] + factor * (activations[rows, cols] + kept_at[cols] - (resaved_at[rows, None] if k > 0 else 0.0))
                if k > 0:
                    memory = memory + receive_buffers * received[rows, None]
                if not last:
                    memory = memory + receive_buffers * received[cols]
            if groups:
                memory = memory + copies[rows, cols]
            ok &= ~(memory > cap)
        if grads is not None:  # the stage's gradient bytes, summed as the memory is: a block of the prefix sums
            ok &= ~(grads[0][rows, cols] > grads[1])
        send = 0.0 if last else handover[cols]
        if 0 < k < pp - 1:
            stage = middle[rows, cols]
        else:
            stage = span[rows, cols] + (handover[rows, None] if k > 0 else 0.0) + send
        # A ready row's best and stage are never nan (the first is finite, the second sums a finite
        # prefix difference and hand-overs), so maximum is max(before, stage) here.
        slowest = np.where(ok, np.maximum(best[rows, None], stage), inf)
        bottleneck = slowest.min(axis=0)
        at = ok & (slowest == bottleneck)
        seconds = np.where(at, handed[rows, None] + send, inf)
        cheapest = seconds.min(axis=0)
        first_i = rows.start + (at & (seconds == cheapest)).argmax(axis=0)  # the smallest i of a tie
        reached = bottleneck < inf  # a split whose slowest stage is inf is none: no later stage extends it
        best = np.full(n_layers + 1, inf)
        handed = np.full(n_layers + 1, inf)
        arg = np.full(n_layers + 1, -1)
        best[cols] = np.where(reached, bottleneck, inf)
        handed[cols] = np.where(reached, cheapest, inf)
        arg[cols] = np.where(reached, first_i, -1)
        choice.append(arg)
    if best[n_layers] == inf:
        return None
    return choice


def _block_sums(prefix: list[float]) -> np.ndarray:
    """``[i, j] = prefix[j] - prefix[i]``: the sum over layers ``[i, j)`` for ``i < j``."""
    edges = np.array(prefix)
    return edges[None, :] - edges[:, None]


def stage_sums(values: Sequence[float], boundaries: Sequence[int]) -> tuple[float, ...]:
    """Sum ``values`` over each stage that ``boundaries`` (Plan convention) delimit."""
    edges = [0, *boundaries, len(values)]
    return tuple(float(sum(values[a:b])) for a, b in zip(edges, edges[1:]))
