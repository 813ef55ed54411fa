"""The cost model's pipeline orders, posts and waits are the ones torch.distributed.pipelining runs (3 real gloo ranks)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import run_on_ranks  # noqa: E402

from lightning_distplan.costmodel._schedule import stage_order, stage_program  # noqa: E402

N_MICROBATCHES = 4


class _Tag(torch.autograd.Function):
    """Identity whose backward notes which micro-batch's gradient went through."""

    @staticmethod
    def forward(ctx, x, log, i):  # noqa: ANN001
        ctx.log, ctx.i = log, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        ctx.log.append(("B", ctx.i))
        return grad, None, None


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.log: list[tuple[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = sum(1 for kind, _ in self.log if kind == "F")
        self.log.append(("F", i))
        return _Tag.apply(self.lin(x), self.log, i)


def _orders(rank: int, world: int) -> dict[str, dict[str, list]]:
    """Per schedule: the computations this rank ran ("order") and, in one log with them, its p2p posts and waits ("program")."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining import schedules

    dist.init_process_group("gloo")
    log: list = []
    posted: dict[int, list] = {}
    batch, wait_batch = schedules._batch_p2p, schedules._wait_batch_p2p

    def ops_of(ops: list) -> list:
        return [("send" if "send" in op.op.__name__ else "recv", op.peer) for op in ops]

    def logged_batch(ops: list, desc: str | None = None) -> list:
        works = batch(ops, desc=desc)
        if works:
            log.append(("post", ops_of(ops)))
        for i, work in enumerate(works):  # one work per op, or one for the whole batch
            posted[id(work)] = ops_of(ops)[i : i + 1] if len(works) == len(ops) else ops_of(ops)
        return works

    def logged_wait(works: list) -> None:
        if works:
            log.append(("wait", [op for work in works for op in posted[id(work)]]))
        wait_batch(works)

    schedules._batch_p2p, schedules._wait_batch_p2p = logged_batch, logged_wait
    out = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = Recorder()
        module.log = log
        schedule = cls(PipelineStage(module, rank, world, torch.device("cpu")), N_MICROBATCHES, loss_fn=lambda y, t: y.square().mean())
        x = torch.ones(N_MICROBATCHES, 8)
        for _ in range(2):  # the first step also exchanges shapes; record the second
            log.clear()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=x)
            else:
                schedule.step()
        out[name] = {"order": [e for e in log if e[0] in ("F", "B")], "program": list(log)}
    return out


def _as_logged(step: tuple) -> tuple:
    """A stage_program step as the test logs it: computations as ("F" | "B", i), ops as (kind, peer rank)."""
    if step[0] == "run":
        return step[1], step[2]
    peer = {("send", "F"): 1, ("recv", "F"): 0, ("send", "B"): 0, ("recv", "B"): 1}  # boundary b joins ranks b and b + 1
    return step[0], [(kind, b + peer[(kind, pas)]) for kind, (pas, _, b) in step[1]]


def test_stage_orders_and_programs_match_torch_pipelining():
    world = 3
    results = run_on_ranks(_orders, world)
    for k, runs in enumerate(results):
        for strategy, seen in runs.items():
            assert seen["order"] == stage_order(strategy, N_MICROBATCHES, world, k), (strategy, k)
            # the posts and waits schedule_time simulates are torch's, in torch's order (a middle stage included)
            assert seen["program"] == [_as_logged(step) for step in stage_program(strategy, N_MICROBATCHES, world, k)], (strategy, k)
