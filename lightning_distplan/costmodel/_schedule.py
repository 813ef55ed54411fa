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
from collections.abc import Callable, Sequence
from typing import Any

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

    return _program(strategy, n, p, k, lambda kind, message: (kind, message), lambda pass_, i: ("run", pass_, i), "post", "wait")


def _program(strategy: str, n: int, p: int, k: int, op: Callable, run: Callable, post_step: Any, wait_step: Any) -> list[tuple]:
    """:func:`stage_program` with its ops made by ``op(kind, message)``, its computations by ``run(pass, i)`` and
    its posts and waits tagged ``post_step`` / ``wait_step`` (:func:`_compiled_programs` makes integers)."""

    def fwd_recv(i: int) -> list:
        return [op("recv", ("F", i, k - 1))] if k > 0 else []

    def fwd_send(i: int) -> list:
        return [op("send", ("F", i, k))] if k < p - 1 else []

    def bwd_recv(i: int) -> list:
        return [op("recv", ("B", i, k))] if k < p - 1 else []

    def bwd_send(i: int) -> list:
        return [op("send", ("B", i, k - 1))] if k > 0 else []

    program: list[tuple] = []

    def post_wait(ops: list) -> None:
        if ops:
            program.extend([(post_step, ops), (wait_step, ops)])

    def post(ops: list) -> None:
        if ops:
            program.append((post_step, ops))

    def wait(ops: list) -> None:
        if ops:
            program.append((wait_step, ops))

    if strategy == "gpipe":
        for pass_, recv, send in (("F", fwd_recv, fwd_send), ("B", bwd_recv, bwd_send)):
            for i in range(n):
                post_wait(recv(i))
                program.append(run(pass_, i))
                post(send(i))
            for i in range(n):  # the pass's sends, waited one by one at its end
                wait(send(i))
        return program
    warmup = min(n, p - k)
    in_flight: list = []
    for i in range(warmup):
        post_wait(fwd_recv(i))
        program.append(run("F", i))
        wait(in_flight)
        in_flight = []
        if i != warmup - 1:
            post(fwd_send(i))
            in_flight = fwd_send(i)
    forwards, pending = warmup, fwd_send(warmup - 1)
    for b in range(n):
        post_wait(pending + bwd_recv(b))
        program.append(run("B", b))
        pending = bwd_send(b)
        if forwards == n:
            break
        post_wait(pending + fwd_recv(forwards))
        program.append(run("F", forwards))
        pending = fwd_send(forwards)
        forwards += 1
    post(pending)
    for b in range(b + 1, n):
        post_wait(bwd_recv(b))
        program.append(run("B", b))
        wait(pending)
        pending = bwd_send(b)
        post(pending)
    wait(pending)
    return program


def _line_start(p: int) -> int:
    """n0: past 6·n0 + 2 micro-batches, :func:`schedule_time` simulates n0, n0 + 1, 2·n0 and 2·n0 + 1 of ``p`` stages
    and extends the line through them."""
    return 16 + 4 * p


def simulated_microbatches(p: int, n: int) -> int:
    """The micro-batches per stage :func:`schedule_time` simulates for ``n`` of ``p`` stages: ``n``, or past 6·n0 + 2 the
    four short runs of :func:`_line_start`'s n0, 6·n0 + 2 together (:func:`simulation_work` counts their work). Not
    counted: the rarer fall-backs to all n, where the short runs' period is not yet the busiest stage's or they do not
    lie on one line (:func:`schedule_time` reports their work in ``work``).

    Example:
        >>> simulated_microbatches(2, 100), simulated_microbatches(2, 10_000)
        (100, 146)
    """
    return min(n, 6 * _line_start(p) + 2)


def simulation_work(p: int, n: int, strategy: str, event_queue: bool = False) -> int:
    """The most work :func:`schedule_time` does for ``n`` micro-batches of ``p`` stages, in the steps ``work`` counts,
    short of its full runs past the line (known only once it has simulated the short runs): each run it simulates, ``n``
    or the four short ones (:func:`simulated_microbatches`), counted by :func:`_run_work`; ``event_queue``: the run
    takes the event queue (1F1B with hand-overs over one stream), its events counted at their most. What a split
    search expects a pricing to cost (``_predict._pricing_cost``).

    Example:
        >>> simulation_work(2, 3, "gpipe"), simulation_work(2, 3, "1f1b"), simulation_work(2, 3, "1f1b", event_queue=True)
        (12, 36, 64)
    """
    if simulated_microbatches(p, n) == n:
        return _run_work(strategy, n, p, event_queue)
    n0 = _line_start(p)
    return sum(_run_work(strategy, m, p, event_queue) for m in (n0, n0 + 1, 2 * n0, 2 * n0 + 1))


@functools.lru_cache(maxsize=256)
def _program_work(strategy: str, n: int, p: int) -> tuple[int, int]:
    """(steps, most events) of simulating every stage's :func:`stage_program`: one step per computation and per op a
    post or a wait handles (the in-order walk's work, op by op); for the event queue at most one event per stage
    started, per op posted, per recv's notice (its data's event) and per wait (a blocked stage woken)."""
    steps = events = 0
    for program in _compiled_programs(strategy, n, p):
        events += 1
        for step, arg in program:
            steps += len(arg) if step else 1
            if step == 1:
                events += len(arg) + sum(op & 1 for op in arg)
            elif step == 2:
                events += 1
    return steps, events


def _run_work(strategy: str, n: int, p: int, event_queue: bool) -> int:
    """The most work :func:`_length` does for one run, in :func:`schedule_time`'s ``work`` steps (it reports the exact
    count). GPipe's sweeps: one step per stage, micro-batch and pass, 2·p·n. 1F1B: its programs' steps
    (:func:`_program_work`), and over the event queue also its events. Measured per step (time.process_time, 2-core
    host, p = 2-32, n = 8-256): 0.11-0.17 µs in the sweeps, 0.17-0.25 µs in the in-order walk, 0.24-0.41 µs in the event
    queue (steps and events together); per stage-slot, what the split search's budget counted before, 1F1B's walk
    took 5-7 times a GPipe sweep's time and the event queue 11-22 times."""
    if strategy == "gpipe":
        return 2 * p * n
    steps, events = _program_work(strategy, n, p)
    return steps + events if event_queue else steps


def schedule_time(
    stage_fwd: Sequence[float],
    stage_bwd: Sequence[float],
    n: int,
    strategy: str,
    hand_over: Sequence[float] | None = None,
    *,
    shared_stream: bool = False,
    work: list[int] | None = None,
) -> float:
    """Time from the first stage's first forward to the last action of any stage, for one step.

    Every stage runs its :func:`stage_program`, one computation at a time. A message across
    boundary b takes ``hand_over[b]`` seconds on the link (default none) and starts once its
    send is posted, its receiver's recv is posted and the link in its direction is free (one
    message at a time per direction). A recv is done when its message has crossed; a send when
    its message starts to cross (the kernel buffers the rest). ``shared_stream``: the recv's
    "ready" notice reaches the sender only after the data already queued the other way on the
    same connection, as over gloo's one TCP stream per pair; without it (NCCL, assumed) the two
    directions are independent. ``work``: where given, the work of every run simulated here is appended to it
    (:func:`_run_work`'s steps, the event queue's events as they happened; a short run the cache already held, what it
    did when simulated, so a price never depends on what was priced before), the full runs past the line too (the
    short runs gave no line: off one, or slower than the busiest stage), so a caller that budgets its simulations can
    charge what they did.

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
    n0 = _line_start(p)
    if simulated_microbatches(p, n) < n:  # below, the four short runs cost more than the long one
        # Past the fill every further micro-batch adds the same period, so t(n) is affine in n.
        # Simulate n0, n0 + 1, 2·n0 and 2·n0 + 1 micro-batches and extend the line when all four lie
        # on it (so in every random case of tests/costmodel/test_costmodel_schedule.py); else
        # simulate all n. Planning a large global batch then costs what a small one does.
        key = (tuple(stage_fwd), tuple(stage_bwd), strategy, None if hand_over is None else tuple(hand_over), shared_stream)
        runs = []
        for k in (n0, n0 + 1, 2 * n0, 2 * n0 + 1):
            # A short run the cache held is charged the work it did when simulated: a search's budget, and so the split
            # it finds, must not depend on what was priced before (another plan of the same stages, the same plan).
            length, done = _simulate_cached(k, *key)
            if work is not None:
                work.append(done)
            runs.append(length)
        a, b, c, d = runs
        step = b - a
        # Every further micro-batch adds at least the busiest stage's work (GPipe: the busiest forward and backward,
        # its passes being pipelines of their own). A period below it is a bottleneck not yet reached: a stage the fill
        # left behind sets the pace until the busiest one, falling behind a little each micro-batch, takes over (1F1B,
        # first stage 0.995 s a micro-batch, last 0.983 s: a slope of 0.983 from 32 to 65 micro-batches, 0.995 from
        # about 70 on; the line priced 291 micro-batches 2.5 s under the 289.8 s simulated, below 291 × 0.995). Then
        # simulate all n.
        busiest = (max(stage_fwd) + max(stage_bwd) if strategy == "gpipe"
                   else max(x + y for x, y in zip(stage_fwd, stage_bwd)))
        if (step >= busiest * (1 - 1e-9) and math.isclose(d - c, step, rel_tol=1e-9, abs_tol=1e-12)
                and math.isclose(c - a, n0 * step, rel_tol=1e-9, abs_tol=1e-12)):
            return d + (n - 2 * n0 - 1) * step
    return _length(stage_fwd, stage_bwd, n, strategy, hand_over, shared_stream, work)


@functools.lru_cache(maxsize=4096)
def _simulate_cached(
    n: int, stage_fwd: tuple[float, ...], stage_bwd: tuple[float, ...], strategy: str, hand_over: tuple[float, ...] | None, shared_stream: bool
) -> tuple[float, int]:
    # The four lengths the line goes through do not depend on n: plans that differ only in n
    # (the same stages and micro-batch, another dp) share them. (length, the run's work)
    work: list[int] = []
    length = _length(stage_fwd, stage_bwd, n, strategy, hand_over, shared_stream, work)
    return length, work[0]


def _length(
    stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, strategy: str, hand_over: Sequence[float] | None, shared_stream: bool,
    work: list[int] | None = None,
) -> float:
    """One step's simulated length, by the cheapest exact route.

    GPipe's passes are two sweeps over the stages (:func:`_gpipe_length`); 1F1B follows its
    dependencies alone (:func:`_simulate_in_order`) unless a notice can queue behind data, which
    takes the event queue (:func:`_simulate`). tests/costmodel/test_costmodel_schedule.py holds
    the first two to the third in random cases. One step of 64 stages and 512 micro-batches took
    1.4 to 1.9 s to simulate event by event; now 0.02 s (GPipe), 0.2 s (1F1B) or 0.5 s (1F1B over
    one stream), on this project's 2-core machine (benchmarks/planning_scale.py times whole plannings). ``work``: its
    steps (:func:`_run_work`; the event queue's events as many as it handled) are appended to it.
    """
    p = len(stage_fwd)
    links = [0.0] * (p - 1) if hand_over is None else [float(x) for x in hand_over]
    if strategy == "gpipe":
        if work is not None:
            work.append(_run_work(strategy, n, p, False))
        return _gpipe_length(stage_fwd, stage_bwd, n, links)
    if shared_stream and any(links):
        events: list[int] = []
        length = _simulate(stage_fwd, stage_bwd, n, strategy, links, shared_stream, events)
        if work is not None:
            work.append(_program_work(strategy, n, p)[0] + events[0])
        return length
    if work is not None:
        work.append(_run_work(strategy, n, p, False))
    return _simulate_in_order(stage_fwd, stage_bwd, n, strategy, links)


@functools.lru_cache(maxsize=16)
def _compiled_programs(strategy: str, n: int, p: int) -> tuple[tuple[tuple[int, object], ...], ...]:
    """Every stage's :func:`stage_program` in integers, for :func:`_simulate`.

    A step is ``(0, pass)`` (run; pass 0 forward, 1 backward), ``(1, ops)`` (post) or ``(2, ops)``
    (wait). A message ``(kind, i, b)`` is ``2·(i·(p − 1) + b) + (kind == "B")``; an op is
    ``2·message + (op is a recv)``. Plans that differ only in their micro-batch's size share them.
    """
    def code(kind: str, message: Message) -> int:
        pass_, i, b = message
        return 2 * (2 * (i * (p - 1) + b) + (pass_ == "B")) + (kind == "recv")

    forward, backward = (0, 0), (0, 1)
    return tuple(
        tuple((step[0], tuple(step[1])) if step[0] else step
              for step in _program(strategy, n, p, k, code, lambda pass_, i: backward if pass_ == "B" else forward, 1, 2))
        for k in range(p)
    )


def _gpipe_length(stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, links: Sequence[float]) -> float:
    """:func:`_simulate` of GPipe's programs as two sweeps over the stages, one per pass.

    Stage k receives F_i once both sides have posted, its sender when it ends F_i and the receiver
    just before it runs F_i; the backward pass runs the same way back. What the programs also wait
    for never binds: a message never waits for its link (each recv is waited before the next from
    the same peer is posted) nor, over one stream, behind data going the other way (a stage sends
    its first gradient after its last activation has arrived), so ``shared_stream`` changes
    nothing; and the waits for sends at a pass's end return before the gradient the stage waits
    for next, or, at the end, before its receiver has finished.
    """
    p = len(stage_fwd)
    ends: list[float] = []
    forward_end = [0.0] * p  # when each stage begins its backward pass
    for k in range(p):
        clock, mine = 0.0, []
        for i in range(n):
            if k:  # the receiver posted at `clock`, the sender when it ended F_i
                clock = max(ends[i], clock) + links[k - 1]
            clock += stage_fwd[k]
            mine.append(clock)
        forward_end[k], ends = clock, mine
    for k in range(p - 1, -1, -1):
        clock, mine = forward_end[k], []
        for i in range(n):
            if k < p - 1:
                clock = max(ends[i], clock) + links[k]
            clock += stage_bwd[k]
            mine.append(clock)
        ends = mine
    return ends[-1]  # stage 0 ends last: it runs each gradient after the stage behind it


def _finished(programs: Sequence[Sequence[tuple]], pc: list[int], clock: list[float], strategy: str, n: int) -> float:
    """The step's length once every stage has run its program to the end."""
    stuck = [k for k in range(len(programs)) if pc[k] < len(programs[k])]
    if stuck:  # cannot happen for the two programs above; guards a future schedule
        raise RuntimeError(f"the {strategy} program of {n} micro-batches over {len(programs)} stages deadlocks at stages {stuck}")
    return max(clock)


def _settled(ops: tuple[int, ...], done: list[float | None], now: float) -> float | None:
    """When a wait on ``ops`` begun at ``now`` returns; None while one of them is not done."""
    for op in ops:
        end = done[op]
        if end is None:
            return None
        if end > now:
            now = end
    return now


def _simulate_in_order(stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, strategy: str, links: Sequence[float]) -> float:
    """:func:`_simulate` where no recv's notice queues behind data (no shared stream), by dependencies alone.

    Then every length is a maximum of sums: a message starts once both sides have posted (its link
    is always free by then: every recv is waited before the next from the same peer is posted, so
    the message before it the same way has arrived) and each stage's clock follows its program.
    Stages run on in any order until a wait finds an op unsettled, and a message is settled the
    moment its second side posts: no event queue. tests/costmodel/test_costmodel_schedule.py holds
    it to :func:`_simulate` in random cases, zero-length stages and hand-overs among them.
    """
    p = len(stage_fwd)
    programs = _compiled_programs(strategy, n, p)
    durations = [(float(f), float(b)) for f, b in zip(stage_fwd, stage_bwd)]
    n_ops = 4 * n * max(p - 1, 0)
    pc, clock = [0] * p, [0.0] * p
    blocked: list[tuple[int, ...] | None] = [None] * p
    posted: list[float | None] = [None] * n_ops
    done: list[float | None] = [None] * n_ops
    runnable = list(range(p - 1, -1, -1))
    while runnable:
        k = runnable.pop()
        program, (fwd, bwd), now, i = programs[k], durations[k], clock[k], pc[k]
        while i < len(program):
            step, arg = program[i]
            if step == 0:
                now += bwd if arg else fwd
            elif step == 1:
                for op in arg:
                    posted[op] = now
                    other = posted[op ^ 1]
                    if other is None:
                        continue
                    message = op >> 1
                    b = (message >> 1) % (p - 1)
                    start = max(now, other)
                    done[2 * message], done[2 * message + 1] = start, start + links[b]
                    peer = (b if message & 1 else b + 1) if op & 1 == 0 else (b + 1 if message & 1 else b)
                    ops = blocked[peer]
                    if ops is not None:
                        then = _settled(ops, done, clock[peer])
                        if then is not None:
                            blocked[peer], clock[peer] = None, then
                            pc[peer] += 1
                            runnable.append(peer)
            else:
                then = _settled(arg, done, now)
                if then is None:
                    blocked[k] = arg
                    break
                now = then
            i += 1
        clock[k], pc[k] = now, i
    return _finished(programs, pc, clock, strategy, n)


def _simulate(
    stage_fwd: Sequence[float], stage_bwd: Sequence[float], n: int, strategy: str, hand_over: Sequence[float] | None, shared_stream: bool,
    events_handled: list[int] | None = None,
) -> float:
    """:func:`schedule_time` by running every stage's program event by event (``events_handled``: the count is appended).

    Events are (time, order of posting, kind, what): a stage running on from a time, a recv's
    "ready" notice leaving its receiver, or a message's data able to cross. Message m crosses
    boundary ``b = (m // 2) % (p − 1)``, forward (stage b to b + 1) for even m, backward for odd;
    ``free[2·b + (m odd)]`` is when that direction of the link is next free.
    """
    p = len(stage_fwd)
    links = list(hand_over) if hand_over is not None else [0.0] * (p - 1)
    programs = _compiled_programs(strategy, n, p)
    durations = [(float(f), float(b)) for f, b in zip(stage_fwd, stage_bwd)]
    inf = math.inf
    n_ops = 4 * n * max(p - 1, 0)
    pc, clock = [0] * p, [0.0] * p
    blocked: list[tuple[int, ...] | None] = [None] * p
    posted = [inf] * n_ops
    done: list[float | None] = [None] * n_ops
    ready_notice = [inf] * (n_ops // 2)  # when the recv's "ready" reached the sender
    free = [0.0] * (2 * max(p - 1, 0))
    events: list[tuple[float, int, int, int]] = []  # kinds: 0 stage, 1 notice, 2 data
    push, pop = heapq.heappush, heapq.heappop
    seq = 0

    def wake(k: int) -> None:
        nonlocal seq
        ops = blocked[k]
        then = None if ops is None else _settled(ops, done, clock[k])
        if then is not None:
            blocked[k] = None
            push(events, (then, seq, 0, k))
            seq += 1

    for k in range(p):
        push(events, (0.0, seq, 0, k))
        seq += 1
    while events:
        t, _, kind, what = pop(events)
        if kind == 0:  # run the stage on until a wait whose ops are not yet settled
            k = what
            program, (fwd, bwd), now, i = programs[k], durations[k], max(clock[k], t), pc[k]
            while i < len(program):
                step, arg = program[i]
                if step == 0:
                    now += bwd if arg else fwd
                elif step == 1:
                    for op in arg:
                        posted[op] = now
                        push(events, (now, seq, 1 if op & 1 else 2, op >> 1))
                        seq += 1
                else:
                    then = _settled(arg, done, now)
                    if then is None:
                        blocked[k] = arg
                        break
                    now = then
                i += 1
            clock[k], pc[k] = now, i
        elif kind == 1:
            if shared_stream:  # the notice queues behind the data crossing the other way
                t = max(t, free[2 * ((what >> 1) % (p - 1)) + 1 - (what & 1)])
            ready_notice[what] = t
            push(events, (t, seq, 2, what))
            seq += 1
        else:  # data: crosses once both sides have posted
            send = 2 * what
            if done[send] is not None or posted[send] > t or ready_notice[what] > t:
                continue
            b = (what >> 1) % (p - 1)
            direction = 2 * b + (what & 1)
            start = max(t, free[direction])
            free[direction] = done[send + 1] = start + links[b]
            done[send] = start
            src, dst = (b + 1, b) if what & 1 else (b, b + 1)
            wake(src)
            wake(dst)
    if events_handled is not None:
        events_handled.append(seq)  # each event pushed once and handled once
    return _finished(programs, pc, clock, strategy, n)
