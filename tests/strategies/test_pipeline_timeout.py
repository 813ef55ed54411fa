"""A stage stalled in the middle of a step: the others give up after the strategy's ``timeout``, as under DDP."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import run_on_ranks  # noqa: E402
from _pipeline_models import GLOBAL_BATCH, MLP_BOUNDARY, TinyMLP, mlp_data, trainer_kwargs  # noqa: E402

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

TIMEOUT_S = 4


class _StallsOnRank1(TinyMLP):
    """Rank 1 stops before its second step until rank 0 has given up (a file says so), for 60 s at most."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1 and self.global_step == 1:
            end = time.monotonic() + 60
            while not os.path.exists(self.flag) and time.monotonic() < end:
                time.sleep(0.2)
            raise RuntimeError("rank 1 stalled")


def _stalled(rank: int, world: int, out: str) -> tuple[str, float]:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    flag = os.path.join(out, "rank0-gave-up")
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY],
                                timeout=timedelta(seconds=TIMEOUT_S))
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": 3})
    start = time.monotonic()
    try:
        trainer.fit(_StallsOnRank1(flag), DataLoader(mlp_data(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH))
        verdict = "trained"
    except Exception as err:  # noqa: BLE001 — what each rank saw is the result
        verdict = f"{type(err).__name__}: {err}"
    waited = time.monotonic() - start
    if rank == 0:
        open(flag, "w").close()
    return verdict, waited


def test_a_stalled_stage_makes_the_others_fail_after_the_strategys_timeout(tmp_path) -> None:
    """The pipeline's own process groups took torch's 30-minute default: rank 0 waited in its p2p receive for as long
    as rank 1 stalled (98 s in the review's run, with timeout=15 s)."""
    (verdict, waited), _ = run_on_ranks(_stalled, 2, str(tmp_path), timeout=200)
    assert verdict != "trained" and "Timed out" in verdict, verdict
    assert waited < TIMEOUT_S + 25, waited  # the fit's start, one step and the timeout; not the 60 s rank 1 would stall
