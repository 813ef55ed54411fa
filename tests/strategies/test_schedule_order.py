"""The cost model's pipeline orders are the ones torch.distributed.pipelining runs (3 real gloo ranks)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import run_on_ranks  # noqa: E402

from lightning_distplan.costmodel._schedule import stage_order  # noqa: E402

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


def _orders(rank: int, world: int) -> dict[str, list[tuple[str, int]]]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    out = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = Recorder()
        schedule = cls(PipelineStage(module, rank, world, torch.device("cpu")), N_MICROBATCHES, loss_fn=lambda y, t: y.square().mean())
        x = torch.ones(N_MICROBATCHES, 8)
        for _ in range(2):  # the first step also exchanges shapes; record the second
            module.log.clear()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=x)
            else:
                schedule.step()
        out[name] = list(module.log)
    return out


def test_stage_orders_match_torch_pipelining():
    world = 3
    results = run_on_ranks(_orders, world)
    for k, orders in enumerate(results):
        for strategy, seen in orders.items():
            assert seen == stage_order(strategy, N_MICROBATCHES, world, k), (strategy, k)
