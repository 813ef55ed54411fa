"""The order in which ``torch.distributed.pipelining`` runs a stage's micro-batches, and its length.

Eq. (1) of seed 000 prices a pipeline as if every stage waited for the slowest one from the first
micro-batch on. The real order has more slack than that in one case the sweeps keep meeting: in
1F1B the last stage runs micro-batch 0's backward while the first stage still runs its warm-up
forwards, so when an earlier stage is the slowest, part of the fill overlaps work that eq. (1)
counts one after the other. :func:`schedule_time` walks the dependency graph of the order
(:func:`stage_order`) to measure that.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["stage_order", "schedule_time"]


def stage_order(strategy: str, n: int, p: int, k: int) -> list[tuple[str, int]]:
    """The ("F" | "B", micro-batch) actions stage ``k`` of ``p`` runs, in order, for ``n`` micro-batches.

    GPipe: all n forwards, then all n backwards (``ScheduleGPipe``). 1F1B (``Schedule1F1B``):
    min(n, p − k) warm-up forwards, then one backward and one forward in turn, then the
    remaining backwards, which is also why stage k holds at most p − k micro-batches' activations
    (:func:`~lightning_distplan.costmodel.in_flight_microbatches`).

    Example:
        >>> stage_order("1f1b", 3, 2, 1)
        [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
        >>> stage_order("1f1b", 3, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if strategy == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    warmup = min(n, p - k)
    order = [("F", i) for i in range(warmup)]
    forwards = warmup
    for i in range(n):
        order.append(("B", i))
        if forwards < n:
            order.append(("F", forwards))
            forwards += 1
    return order


def schedule_time(
    stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, strategy: str, hand_over: Sequence[float] | None = None
) -> float:
    """Time from the first stage's first forward to the last action of any stage, for one step.

    Every stage runs its :func:`stage_order`; a forward of micro-batch i on stage k starts once
    stage k − 1 has finished its forward of i, and a backward once stage k + 1 has finished its
    backward of i (on the last stage, once its own forward has), each plus ``hand_over[boundary]``
    seconds in flight (default none). A stage runs one action at a time.

    Example:
        >>> schedule_time([2.0, 1.0], [2.0, 1.0], 2, "gpipe")  # the first stage the slowest: eq. (1) per pass
        10.0
        >>> schedule_time([2.0, 1.0], [2.0, 1.0], 2, "1f1b")  # the last stage's B0 runs beside the first's F1
        8.0
    """
    p = len(stage_fwd)
    hand_over = list(hand_over) if hand_over is not None else [0.0] * (p - 1)
    orders = [stage_order(strategy, n, p, k) for k in range(p)]
    position = [0] * p
    clock = [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(p):
            while position[k] < len(orders[k]):
                kind, i = orders[k][position[k]]
                if kind == "F":
                    ready = finished.get(("F", k - 1, i)) if k > 0 else 0.0
                    if ready is not None and k > 0:
                        ready += hand_over[k - 1]
                    work = stage_fwd[k]
                else:
                    ready = finished.get(("B", k + 1, i)) if k < p - 1 else finished.get(("F", k, i))
                    if ready is not None and k < p - 1:
                        ready += hand_over[k]
                    work = stage_bwd[k]
                if ready is None:
                    break  # waits for another stage
                clock[k] = max(clock[k], ready) + work
                finished[(kind, k, i)] = clock[k]
                position[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the two orders above; guards a future schedule
            raise RuntimeError(f"the {strategy} order of {n} micro-batches over {p} stages deadlocks")
    return max(clock)
