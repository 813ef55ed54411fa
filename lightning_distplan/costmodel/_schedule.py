"""The order in which ``torch.distributed.pipelining`` runs a stage's micro-batches, and its length.

Eq. (1) of seed 000 prices a pipeline as if every stage waited for the slowest one from the first
micro-batch on, and its hand-overs as if each crossed the link on its own. The real runtime differs
in two ways the CPU sweeps measure, and :func:`schedule_time` replays both by simulating each
stage's program (:func:`stage_program`: the computations of :func:`stage_order` with the
``batch_isend_irecv`` posts and waits of ``ScheduleGPipe`` / ``Schedule1F1B`` between them):

* Order. In 1F1B the last stage runs micro-batch 0's backward while the first stage still runs
  its warm-up forwards, so when an earlier stage is the slowest, part of the fill overlaps work
  that eq. (1) counts one after the other.
* Hand-overs are rendezvous. No byte of a message crosses before its receiver has posted the recv
  (``benchmarks/gloo_rendezvous.py``: a recv posted 0.3 s late still took the whole link time).
  Over gloo the receiver's "ready" notice travels on the same TCP stream as the data going the
  other way, behind it; 1F1B posts each send together with the recv from the same peer, sends
  first, so when the peer is already waiting, the send's data goes out first and the notice for
  the recv follows it: the two directions cross one after the other, not side by side (measured
  in the same script: the second of two ranks posting [send, recv] waits two message times).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence

__all__ = ["stage_order", "stage_program", "schedule_time"]

# A message: (pass "F" | "B", micro-batch, boundary b); boundary b joins stage b and stage b + 1.
# "F" crosses from b to b + 1 (an activation), "B" from b + 1 to b (its gradient).
Message = tuple[str, int, int]
Op = tuple[str, Message]  # ("send" | "recv", message)


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
    return [(step[1], step[2]) for step in stage_program(strategy, n, p, k) if step[0] == "run"]


def stage_program(strategy: str, n: int, p: int, k: int) -> list[tuple]:
    """Stage ``k``'s step as torch runs it: ``("run", "F" | "B", i)``, ``("post", ops)`` and ``("wait", ops)``.

    ``ops`` are ``("send" | "recv", message)`` pairs posted together (one ``batch_isend_irecv``)
    or waited for together; a post does not block, a wait returns once every op in it is done.
    The posts and waits follow ``ScheduleGPipe._step_microbatches`` (each recv posted and waited
    just before its computation, sends waited at the end of the pass) and
    ``Schedule1F1B._step_microbatches`` (the warm-up's and the cool-down's sends waited one
    computation later, the last at the end; in the steady state each send posted and waited
    together with the next recv from the same peer, the send first).

    Example:
        >>> stage_program("gpipe", 1, 2, 1)
        [('post', [('recv', ('F', 0, 0))]), ('wait', [('recv', ('F', 0, 0))]), ('run', 'F', 0), ('run', 'B', 0), ('post', [('send', ('B', 0, 0))]), ('wait', [('send', ('B', 0, 0))])]
    """

    def fwd_recv(i: int) -> list[Op]:
        return [("recv", ("F", i, k - 1))] if k > 0 else []

    def fwd_send(i: int) -> list[Op]:
        return [("send", ("F", i, k))] if k < p - 1 else []

    def bwd_recv(i: int) -> list[Op]:
        return [("recv", ("B", i, k))] if k < p - 1 else []

    def bwd_send(i: int) -> list[Op]:
        return [("send", ("B", i, k - 1))] if k > 0 else []

    program: list[tuple] = []

    def post_wait(ops: list[Op]) -> None:
        if ops:
            program.extend([("post", ops), ("wait", ops)])

    def post(ops: list[Op]) -> None:
        if ops:
            program.append(("post", ops))

    def wait(ops: list[Op]) -> None:
        if ops:
            program.append(("wait", ops))

    if strategy == "gpipe":
        for run, recv, send in (("F", fwd_recv, fwd_send), ("B", bwd_recv, bwd_send)):
            for i in range(n):
                post_wait(recv(i))
                program.append(("run", run, i))
                post(send(i))
            for i in range(n):  # the pass's sends, waited one by one at its end
                wait(send(i))
        return program
    warmup = min(n, p - k)
    in_flight: list[Op] = []
    for i in range(warmup):
        post_wait(fwd_recv(i))
        program.append(("run", "F", i))
        wait(in_flight)
        in_flight = []
        if i != warmup - 1:
            post(fwd_send(i))
            in_flight = fwd_send(i)
    forwards, pending = warmup, fwd_send(warmup - 1)
    for b in range(n):
        post_wait(pending + bwd_recv(b))
        program.append(("run", "B", b))
        pending = bwd_send(b)
        if forwards == n:
            break
        post_wait(pending + fwd_recv(forwards))
        program.append(("run", "F", forwards))
        pending = fwd_send(forwards)
        forwards += 1
    post(pending)
    for b in range(b + 1, n):
        post_wait(bwd_recv(b))
        program.append(("run", "B", b))
        wait(pending)
        pending = bwd_send(b)
        post(pending)
    wait(pending)
    return program


def schedule_time(
    stage_fwd: Sequence[float],
    stage_bwd: Sequence[float],
    n: int,
    strategy: str,
    hand_over: Sequence[float] | None = None,
    *,
    shared_stream: bool = False,
) -> float:
    """Time from the first stage's first forward to the last action of any stage, for one step.

    Every stage runs its :func:`stage_program`, one computation at a time. A message across
    boundary b takes ``hand_over[b]`` seconds on the link (default none) and starts once its
    send is posted, its receiver's recv is posted and the link in its direction is free (one
    message at a time per direction). A recv is done when its message has crossed; a send when
    its message starts to cross (the kernel buffers the rest). ``shared_stream``: the recv's
    "ready" notice reaches the sender only after the data already queued the other way on the
    same connection, as over gloo's one TCP stream per pair; without it (NCCL, assumed) the two
    directions are independent.

    Example:
        >>> schedule_time([2.0, 1.0], [2.0, 1.0], 2, "gpipe")  # the first stage the slowest: eq. (1) per pass
        10.0
        >>> schedule_time([2.0, 1.0], [2.0, 1.0], 2, "1f1b")  # the last stage's B0 runs beside the first's F1
        8.0
        >>> schedule_time([1.0, 1.0], [1.0, 1.0], 4, "1f1b", [3.0])  # the two directions of an exchange side by side
        25.0
        >>> schedule_time([1.0, 1.0], [1.0, 1.0], 4, "1f1b", [3.0], shared_stream=True)  # one after the other
        34.0
        >>> schedule_time([1.0, 1.0], [1.0, 1.0], 4, "gpipe", [3.0], shared_stream=True)  # GPipe's passes each cross one way
        34.0
    """
    p = len(stage_fwd)
    n0 = 16 + 4 * p
    if n > 6 * n0 + 2:  # below, the four short runs cost more than the long one
        # Past the fill every further micro-batch adds the same period, so t(n) is affine in n.
        # Simulate n0, n0 + 1, 2·n0 and 2·n0 + 1 micro-batches and extend the line when all four lie
        # on it (so in every random case of tests/costmodel/test_costmodel_schedule.py); else
        # simulate all n. Planning a large global batch then costs what a small one does.
        key = (tuple(stage_fwd), tuple(stage_bwd), strategy, None if hand_over is None else tuple(hand_over), shared_stream)
        a, b, c, d = (_simulate_cached(k, *key) for k in (n0, n0 + 1, 2 * n0, 2 * n0 + 1))
        step = b - a
        if math.isclose(d - c, step, rel_tol=1e-9, abs_tol=1e-12) and math.isclose(c - a, n0 * step, rel_tol=1e-9, abs_tol=1e-12):
            return d + (n - 2 * n0 - 1) * step
    return _simulate(stage_fwd, stage_bwd, n, strategy, hand_over, shared_stream)


@functools.lru_cache(maxsize=4096)
def _simulate_cached(
    n: int, stage_fwd: tuple[float, ...], stage_bwd: tuple[float, ...], strategy: str, hand_over: tuple[float, ...] | None, shared_stream: bool
) -> float:
    # The four lengths the line goes through do not depend on n: plans that differ only in n
    # (the same stages and micro-batch, another dp) share them.
    return _simulate(stage_fwd, stage_bwd, n, strategy, hand_over, shared_stream)


def _simulate(
    stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, strategy: str, hand_over: Sequence[float] | None, shared_stream: bool
) -> float:
    """:func:`schedule_time` by running every stage's program event by event."""
    p = len(stage_fwd)
    links = list(hand_over) if hand_over is not None else [0.0] * (p - 1)
    programs = [stage_program(strategy, n, p, k) for k in range(p)]
    pc, clock = [0] * p, [0.0] * p
    blocked: dict[int, list[Op]] = {}
    posted: dict[Op, float] = {}
    ready_notice: dict[Message, float] = {}  # when the recv's "ready" reached the sender
    done: dict[Op, float] = {}
    free: dict[tuple[int, int], float] = {}  # (from, to) stage: when that direction's link is free
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, what: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, what))
        seq += 1

    def ends(message: Message) -> tuple[int, int]:
        kind, _, b = message
        return (b, b + 1) if kind == "F" else (b + 1, b)

    def wake(k: int) -> None:
        ops = blocked.get(k)
        if ops is not None and all(op in done for op in ops):
            del blocked[k]
            push(max([clock[k], *(done[op] for op in ops)]), "stage", k)

    for k in range(p):
        push(0.0, "stage", k)
    while events:
        t, _, kind, what = heapq.heappop(events)
        if kind == "stage":  # run the stage on until a wait whose ops are not yet settled
            k = what
            clock[k] = max(clock[k], t)
            while pc[k] < len(programs[k]):
                step = programs[k][pc[k]]
                if step[0] == "run":
                    clock[k] += (stage_fwd if step[1] == "F" else stage_bwd)[k]
                elif step[0] == "post":
                    for op in step[1]:
                        posted[op] = clock[k]
                        push(clock[k], "notice" if op[0] == "recv" else "data", op[1])
                elif all(op in done for op in step[1]):
                    clock[k] = max([clock[k], *(done[op] for op in step[1])])
                else:
                    blocked[k] = step[1]
                    break
                pc[k] += 1
        elif kind == "notice":
            src, dst = ends(what)
            ready_notice[what] = max(t, free.get((dst, src), 0.0)) if shared_stream else t
            push(ready_notice[what], "data", what)
        else:  # data: crosses once both sides have posted
            send, recv = ("send", what), ("recv", what)
            if send in done or posted.get(send, float("inf")) > t or ready_notice.get(what, float("inf")) > t:
                continue
            src, dst = ends(what)
            start = max(t, free.get((src, dst), 0.0))
            free[(src, dst)] = done[recv] = start + links[what[2]]
            done[send] = start
            for k in (src, dst):
                wake(k)
    stuck = [k for k in range(p) if pc[k] < len(programs[k])]
    if stuck:  # cannot happen for the two programs above; guards a future schedule
        raise RuntimeError(f"the {strategy} program of {n} micro-batches over {p} stages deadlocks at stages {stuck}")
    return max(clock)
