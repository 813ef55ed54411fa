"""Measure the live process group's links: all-reduce and point-to-point, as latency + bytes / bandwidth.

Both kinds are reported as the parameters of ONE link (``latency_s``, ``bandwidth_bytes_per_s``),
so the cost model can use them directly:

* ``p2p``: rank 0 and rank 1 ping-pong a message; half the round trip t(G) = L + G / BW is fitted.
  A p2p latency above the all-reduce's per-step latency is not believed at once: the small
  messages are timed again and the faster median per size kept (see :func:`measure_links`).
* ``allreduce``: the all-reduce time of G bytes over W ranks is fitted as t(G) = a + b·G and
  inverted through the ring model S_all = 2(W−1)·(L + G/(W·BW)) (DESIGN §4; seed 001 eq. 5.1):
  L = a / (2(W−1)), BW = 2(W−1) / (W·b). ``samples`` keep the raw (bytes, seconds) of the whole
  all-reduce, so ``LinkProfile.time(G)`` is one link's time and the ring formula gives the collective.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from lightning_distplan.costmodel._schedule import schedule_time
from lightning_distplan.profile import LinearFit, LinkProfile
from lightning_distplan.profiling._errors import ProfilingError

__all__ = ["measure_links", "measure_pipeline_slot", "pipeline_slot_for", "time_trivial_pipeline", "trivial_pipeline_links", "link_parameters", "DEFAULT_LINK_SIZES"]

log = logging.getLogger(__name__)

# 4 KiB .. 16 MiB: latency-bound to bandwidth-bound for gloo and NCCL alike.
DEFAULT_LINK_SIZES: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
# Messages this small are timed several times per round: the latency estimate rests on them.
SMALL_MESSAGE_BYTES = 1 << 16
SMALL_MESSAGE_RUNS = 4


def _device_for(group: Any) -> torch.device:
    """The device a collective's tensor goes on over ``group`` (None: the default group): the current CUDA device for
    an NCCL-only backend (NCCL takes CUDA tensors only), else CPU (gloo; a "cpu:gloo,cuda:nccl" group runs CPU tensors
    on gloo). The one rule for every collective of the profiler (``_profiler._reduce_all`` too)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_links(
    *,
    group: Any = None,
    sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES,
    repeats: int = 5,
) -> tuple[LinkProfile, ...]:
    """All-reduce and p2p latency/bandwidth over the live process group (every rank must call it).

    The sizes are timed in ``repeats`` interleaved rounds (each round visits every size, in
    alternating order) rather than size after size, so a disturbance of a few hundred
    milliseconds on a shared host spoils one round of every size instead of every run of one;
    messages of at most :data:`SMALL_MESSAGE_BYTES` are timed :data:`SMALL_MESSAGE_RUNS` times per
    round, since the latency rests on them and they cost next to nothing. The medians give
    t(G) = a + b·G with the bandwidth from the larger half of the sizes and the latency from the
    smallest (see :func:`_fit`).

    Args:
        group: the process group (default: the world).
        sizes_bytes: message sizes to time (float32 tensors of that many bytes).
        repeats: timed rounds over all sizes after one warm-up per size; the median per size is
            kept, and for the all-reduce the slowest rank's median (the collective finishes with it).

    Returns:
        ``(allreduce, p2p)`` link profiles, identical on every rank; empty when not distributed
        or the group has one rank.
    """
    import torch.distributed as dist

    sizes = sorted({int(s) for s in sizes_bytes})
    # The messages are float32 tensors of n // 4 values: a size that is no multiple of 4 was sent short and fitted
    # as sent whole (6 and 7 bytes both one 4-byte value), which tilts the line the latency comes from.
    if len(sizes) < 2 or sizes[0] < 4 or any(s % 4 for s in sizes) or repeats < 1:
        raise ProfilingError(
            f"measure_links needs >= 2 distinct sizes that are positive multiples of 4 bytes (float32 messages) and repeats >= 1 "
            f"(got sizes {list(sizes_bytes)}, repeats {repeats}).",
            hint="Use the defaults or e.g. sizes_bytes=(4096, 1 << 20, 1 << 22).",
        )
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    world = dist.get_world_size(group)
    if world < 2:
        return ()
    dev = _device_for(group)
    backend = str(dist.get_backend(group))
    # zeros: a sum all-reduce keeps them zero however often it runs (ones would grow by W each time)
    buffers = {n: torch.zeros(n // 4, dtype=torch.float32, device=dev) for n in sizes}

    # -- all-reduce -----------------------------------------------------------------------------
    def all_reduce(t: torch.Tensor) -> float:
        dist.barrier(group=group)
        _sync(dev)
        a = time.perf_counter()
        dist.all_reduce(t, group=group)
        _sync(dev)
        return time.perf_counter() - a

    for n in sizes:
        dist.all_reduce(buffers[n], group=group)  # warm-up (connection set-up, buffers)
    runs = _rounds(sizes, repeats, lambda n: all_reduce(buffers[n]))
    med = torch.tensor([statistics.median(runs[n]) for n in sizes], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    ar_times = [float(x) for x in med.tolist()]
    raw, (a, b) = _fit(sizes, ar_times)
    ar_latency, ar_bandwidth = link_parameters("allreduce", world, a, b)
    allreduce = LinkProfile(
        kind="allreduce",
        backend=backend,
        world_size=world,
        latency_s=ar_latency,
        bandwidth_bytes_per_s=ar_bandwidth,
        r2=raw.r2,
        samples=tuple(zip(sizes, ar_times)),
    )

    # -- p2p: rank 0 <-> rank 1 ping-pong --------------------------------------------------------
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    peer0, peer1 = ranks[0], ranks[1]
    me = dist.get_rank()

    # over ``group`` (its peers' global ranks), whose backend chose ``dev``: without it the messages went through the
    # default group, e.g. a gloo group's CPU tensors into an NCCL world's group, which refuses them
    def ping_pong(t: torch.Tensor) -> float:
        if me == peer0:
            _sync(dev)
            a0 = time.perf_counter()
            dist.send(t, dst=peer1, group=group)
            dist.recv(t, src=peer1, group=group)
            _sync(dev)
            return (time.perf_counter() - a0) / 2
        if me == peer1:
            dist.recv(t, src=peer0, group=group)
            dist.send(t, dst=peer0, group=group)
        return 0.0

    def p2p_medians(timed_sizes: Sequence[int]) -> list[float]:
        runs = _rounds(timed_sizes, repeats, lambda n: ping_pong(buffers[n]))
        # rank 0 of the pair measured; everyone returns its numbers
        box: list[Any] = [[statistics.median(runs[n]) for n in timed_sizes]]
        dist.broadcast_object_list(box, src=peer0, group=group, device=dev if dev.type == "cuda" else None)
        return [float(x) for x in box[0]]

    dist.barrier(group=group)
    for n in sizes:
        ping_pong(buffers[n])  # warm-up
    p2p_times = p2p_medians(sizes)
    raw_p2p, (lat, inv_bw) = _fit(sizes, p2p_times)
    if lat > allreduce.latency_s:
        # Over gloo one message should not take longer than a step of the all-reduce that just
        # crossed the same link. On the CPU cluster host the first reading after the link came up
        # sometimes put every 4 KiB message at ~1.95 ms (p2p L 1.6 ms against ~0.1 ms in its other
        # profiles), which priced each pipeline hand-over 16x too high. Time the small messages
        # again and keep the faster median per size; where the check misfires (NCCL's per-step
        # latency of a ring model can be below a real send's), it costs one more timing of them.
        # Both numbers are the same on every rank, so every rank takes this branch or none does.
        small = [n for n in sizes if n <= SMALL_MESSAGE_BYTES] or sizes[:1]
        p2p_times = _keep_faster(sizes, p2p_times, dict(zip(small, p2p_medians(small))))
        first = lat
        raw_p2p, (lat, inv_bw) = _fit(sizes, p2p_times)
        if dist.get_rank() == 0:  # every rank measured the same and took this branch: say it once
            log.warning(
                "p2p latency %.1f us exceeded the all-reduce's %.1f us per step; timed the messages up to %d bytes again: %.1f us",
                first * 1e6, allreduce.latency_s * 1e6, small[-1], lat * 1e6,
            )
    p2p_latency, p2p_bandwidth = link_parameters("p2p", world, lat, inv_bw)
    p2p = LinkProfile(
        kind="p2p",
        backend=backend,
        world_size=world,
        latency_s=p2p_latency,
        bandwidth_bytes_per_s=p2p_bandwidth,
        r2=raw_p2p.r2,
        samples=tuple(zip(sizes, p2p_times)),
    )
    dist.barrier(group=group)
    log.info(
        "links over %s (world %d): all-reduce L=%.1f us BW=%.2f GB/s (R²=%.3f); p2p L=%.1f us BW=%.2f GB/s (R²=%.3f)",
        backend, world, allreduce.latency_s * 1e6, allreduce.bandwidth_bytes_per_s / 1e9, allreduce.r2,
        p2p.latency_s * 1e6, p2p.bandwidth_bytes_per_s / 1e9, p2p.r2,
    )
    return allreduce, p2p


# Micro-batch counts of the trivial schedule measure_pipeline_slot times; the slot is the slope between them.
SLOT_MICRO_BATCHES = (2, 16)
SLOT_ROUNDS = 7


def measure_pipeline_slot(p2p: LinkProfile, *, group: Any = None, rounds: int = SLOT_ROUNDS) -> float | None:
    """What ``torch.distributed.pipelining`` itself costs per micro-batch slot over the live group (every rank must call it).

    Ranks 0 and 1 of the group run a two-stage 1F1B schedule whose stages are one ``nn.Linear(8, 8)``
    each, so the compute is next to nothing, at 2 and at 16 micro-batches, alternating, ``rounds``
    times after one warm-up each. The slope of the median step time is what one more micro-batch
    costs: the runtime's own work (forward/backward bookkeeping, ``batch_isend_irecv`` and its waits)
    plus the hand-overs that the cost model already charges for it (:func:`trivial_pipeline_links`:
    two ``p2p.time`` of one 8-float sample). The rest, never below zero, is returned, identical on
    every rank. None where it cannot be measured: not distributed, one rank, or a group whose backend
    is not gloo (the cost model hides host work behind a CUDA device anyway).

    Example of the numbers (the 2-vCPU sweep host, loopback): 2.08 ms at n = 2, 14.72 ms at n = 16,
    so 0.90 ms per micro-batch, of which the hand-overs are 0.20 ms.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    if "gloo" not in str(dist.get_backend(group)):
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    # every rank of the group joins new_group, even those that do not run the pipeline
    pair = group if len(ranks) == 2 else dist.new_group(ranks[:2], backend="gloo")
    me = dist.get_rank()
    slot: list[Any] = [None]
    if me in ranks[:2]:
        steps = time_trivial_pipeline(Schedule1F1B, ranks.index(me), SLOT_MICRO_BATCHES, rounds, group=pair)
        lo, hi = SLOT_MICRO_BATCHES
        per_micro_batch = (statistics.median(steps[hi]) - statistics.median(steps[lo])) / (hi - lo)
        slot = [max(0.0, per_micro_batch - trivial_pipeline_links(p2p.time(8 * 4)))]
        if me == ranks[0]:
            log.info("pipelining runtime: %.2f ms per micro-batch over %s, %.2f ms of it beyond the hand-overs", per_micro_batch * 1e3,
                     dist.get_backend(group), slot[0] * 1e3)
    dist.broadcast_object_list(slot, src=ranks[0], group=group)
    if pair is not group:
        dist.destroy_process_group(pair)
    return None if slot[0] is None else float(slot[0])


def trivial_pipeline_links(hand_over_s: float) -> float:
    """What the cost model charges the hand-overs per micro-batch of :func:`measure_pipeline_slot`'s schedule.

    The slope between :data:`SLOT_MICRO_BATCHES` of a two-stage gloo 1F1B whose stages cost
    nothing and whose messages take ``hand_over_s`` each
    (:func:`~lightning_distplan.costmodel._schedule.schedule_time`): two hand-overs, since over
    gloo the activation and the gradient exchanged between the stages cross one after the other.
    Taking exactly this off the measured slope leaves the runtime's own work, so the model
    predicts the trivial schedule as measured.

    Example:
        >>> round(trivial_pipeline_links(1e-4) * 1e6, 1)
        200.0
    """
    lo, hi = SLOT_MICRO_BATCHES

    def length(n: int) -> float:
        return schedule_time([0.0, 0.0], [0.0, 0.0], n, "1f1b", [hand_over_s], shared_stream=True)

    return (length(hi) - length(lo)) / (hi - lo)


def time_trivial_pipeline(schedule_cls: Any, stage_index: int, micro_batches: Sequence[int], rounds: int, *, group: Any = None) -> dict[int, list[float]]:
    """Step times of a two-stage ``schedule_cls`` whose stages are one ``nn.Linear(8, 8)`` each (both ranks of ``group`` call it).

    One schedule per micro-batch count in ``micro_batches``; after one warm-up step each (the
    stages' shape exchange and first buffers) they run ``rounds`` times in alternating order, each
    step started together (a barrier), so a slow spell of the host hits every count alike.
    Returns the timed seconds per count. Used by :func:`measure_pipeline_slot` and
    ``benchmarks/pipeline_slot_overhead.py``.
    """
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    schedules = {
        n: schedule_cls(PipelineStage(nn.Linear(8, 8), stage_index, 2, torch.device("cpu"), group=group), n,
                        loss_fn=lambda out, target: out.square().mean())
        for n in micro_batches
    }
    x = {n: torch.zeros(n, 8) for n in micro_batches}

    def step(n: int) -> float:
        dist.barrier(group=group)
        a = time.perf_counter()
        if stage_index == 0:
            schedules[n].step(x[n])
        else:
            schedules[n].step(target=x[n])
        return time.perf_counter() - a

    for n in micro_batches:
        step(n)
    steps: dict[int, list[float]] = {n: [] for n in micro_batches}
    for i in range(max(1, rounds)):
        for n in micro_batches if i % 2 == 0 else list(micro_batches)[::-1]:
            steps[n].append(step(n))
    return steps


def pipeline_slot_for(links: Sequence[LinkProfile], device_type: str) -> float | None:
    """:func:`measure_pipeline_slot` over the group whose ``links`` were just measured, for a CPU profile (every rank must call it).

    None on CUDA, where the cost model hides the runtime's host work behind the device, and where
    no p2p link was measured.
    """
    p2p = next((link for link in links if link.kind == "p2p"), None)
    return measure_pipeline_slot(p2p) if p2p is not None and device_type == "cpu" else None


def link_parameters(kind: str, world: int, a: float, b: float) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of ONE link from a fitted time a + b·G of the whole operation.

    ``p2p``: a message's time is the link's, L = a and BW = 1/b. ``allreduce``: inverted through the
    ring model S_all = 2(W−1)·(L + G/(W·BW)) (DESIGN §4; seed 001 eq. 5.1), L = a / (2(W−1)) and
    BW = 2(W−1) / (W·b).

    Example:
        >>> link_parameters("allreduce", 2, 4e-4, 2**-30)
        (0.0002, 1073741824.0)
    """
    if kind == "p2p":
        return a, 1.0 / b
    hops = 2 * (world - 1)
    return a / hops, hops / (world * b)


def _rounds(sizes: Sequence[int], rounds: int, timed: Callable[[int], float]) -> dict[int, list[float]]:
    """``timed(size)`` in ``rounds`` passes over all sizes, alternating ascending and descending order.

    Every rank calls this with the same sizes and rounds, so collective and paired calls line up.
    """
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes if r % 2 == 0 else reversed(sizes):
            for _ in range(SMALL_MESSAGE_RUNS if n <= SMALL_MESSAGE_BYTES else 1):
                runs[n].append(timed(n))
    return runs


def _keep_faster(sizes: Sequence[int], times: Sequence[float], again: dict[int, float]) -> list[float]:
    """Per size, the smaller of the first median and the one timed ``again`` (sizes not timed again keep theirs).

    Example:
        >>> _keep_faster([4096, 65536, 1 << 20], [2e-3, 4e-3, 8e-2], {4096: 2e-4, 65536: 5e-3})
        [0.0002, 0.004, 0.08]
    """
    return [min(t, again.get(n, t)) for n, t in zip(sizes, times)]


def _fit(sizes: Sequence[int], times: Sequence[float]) -> tuple[LinearFit, tuple[float, float]]:
    """t(G) = a + b·G in two regimes: b from the larger half of the sizes, a from the smallest.

    A single least-squares line over 4 KiB..16 MiB lets the largest message's absolute noise set
    the intercept (the latency, which every pipeline message and per-batch broadcast pays), while
    a shaped link (a token bucket passing small bursts at full speed) bends the curve so no line
    fits both ends. So the bandwidth is the slope over the larger half of the sizes (at least two,
    where the transfer dominates), but never flatter than the slope from the smallest to the
    largest message, so the line reaches the largest message's time; the latency is what the
    smallest message takes beyond its transfer at that bandwidth. ``r2`` is that line's fit to all
    the medians.

    Example (a stalled 1 MiB median does not flatten the line below the 4 MiB message's time):
        >>> line, _ = _fit([4096, 1 << 16, 1 << 20, 1 << 22], [2e-4, 3e-4, 3.6e-3, 4.0e-3])
        >>> round(line.beta + line.alpha * (1 << 22), 6)
        0.004
    """
    n = len(sizes)
    top = max(2, n // 2)
    big = LinearFit.fit([float(s) for s in sizes[n - top:]], list(times[n - top:]))
    # The line may not fall short of the largest message, the best-measured point on the bandwidth:
    # one slow median among the larger sizes (a stall of a round on a busy host) flattens the slope
    # between two points, and a line from the smallest message along it then put a 4 MiB gloo
    # all-reduce that took 4.0 ms at 0.74 ms. The slope from the smallest to the largest message is
    # the floor. A shaped link (burst at full speed, then the rate) has the steeper top-half slope,
    # which stays.
    ends = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
    slope = max(big.alpha, ends)
    if slope <= 0:  # no measurable size dependence: bandwidth from the largest message alone
        slope = max(times[-1], 1e-12) / sizes[-1]
    intercept = times[0] - slope * sizes[0]
    line = LinearFit(alpha=slope, beta=intercept, r2=_r2(sizes, times, slope, intercept))
    # the slope is > 0 by now; a latency at or below zero (hidden in noise, or a token bucket's
    # burst passing the smallest message faster than the rate) is bounded by half that message's time
    latency = intercept if intercept > 0 else max(times[0] * 0.5, 1e-9)
    return line, (latency, slope)


def _r2(sizes: Sequence[int], times: Sequence[float], slope: float, intercept: float) -> float:
    mean = statistics.fmean(times)
    ss_tot = sum((t - mean) ** 2 for t in times)
    ss_res = sum((t - (intercept + slope * g)) ** 2 for g, t in zip(sizes, times))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
