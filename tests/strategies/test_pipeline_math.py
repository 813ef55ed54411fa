"""Same math: gpipe, 1f1b and hybrid dp x pp runs end with the weights of a single-process run.

Real gloo processes (torchrun-like env vars, Lightning's own launcher path for externally created
processes); the weights come back through the strategy's full-state-dict checkpoint gather.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from _pipeline_models import GLOBAL_BATCH, build, reference_weights, run_processes, token_data, trainer_kwargs  # noqa: E402

import lightning as L  # noqa: E402


def _fit_all(rank: int, world: int, runs: list[tuple[str, str, int, int]], out: str) -> None:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    for name, schedule, stages, n in runs:
        model = build(name)
        dp = world // stages
        loader = DataLoader(token_data(), batch_size=GLOBAL_BATCH // dp)
        strategy = PipelineStrategy(schedule=schedule, stages=stages, n_microbatches=n)
        trainer = L.Trainer(**trainer_kwargs(world, strategy, out))
        trainer.fit(model, loader)
        trainer.save_checkpoint(os.path.join(out, f"{name}-{schedule}-{world}.ckpt"))
        if rank == 0:
            torch.save(trainer.callback_metrics["train_loss"], os.path.join(out, f"{name}-{schedule}-{world}.loss"))


def _check(out: str, name: str, schedule: str, world: int, dp: int) -> None:
    ckpt = torch.load(os.path.join(out, f"{name}-{schedule}-{world}.ckpt"), weights_only=False)
    ref = reference_weights(name)
    assert list(ckpt["state_dict"]) == list(ref), "checkpoint keys must be the plain module's"
    torch.testing.assert_close(ckpt["state_dict"], ref, rtol=1e-5, atol=2e-6)
    plan = ckpt["distplan_plan"]
    assert (plan["strategy"], plan["dp"], plan["pp"], plan["n_microbatches"], plan["global_batch_size"]) == (
        schedule, dp, 2, 8 // dp if dp > 1 else 8, GLOBAL_BATCH)
    # The plain LightningModule loads it, and its optimizer state is the full one.
    model = build(name)
    model.load_state_dict(ckpt["state_dict"])
    n_params = len(list(model.configure_optimizers().param_groups[0]["params"]))
    assert sorted(ckpt["optimizer_states"][0]["param_groups"][0]["params"]) == list(range(n_params))
    assert torch.isfinite(torch.load(os.path.join(out, f"{name}-{schedule}-{world}.loss"))).all()


def test_pipeline_gpipe_and_1f1b_match_single_process(tmp_path) -> None:
    runs = [("transformer", "gpipe", 2, 8), ("transformer", "1f1b", 2, 8), ("gpt2", "gpipe", 2, 8), ("gpt2", "1f1b", 2, 8)]
    run_processes(_fit_all, 2, runs, str(tmp_path))
    for name, schedule, _, _ in runs:
        _check(str(tmp_path), name, schedule, 2, 1)


def test_pipeline_hybrid_dp2_pp2_matches_single_process(tmp_path) -> None:
    runs = [("transformer", "1f1b", 2, 4), ("gpt2", "gpipe", 2, 4)]
    run_processes(_fit_all, 4, runs, str(tmp_path))
    for name, schedule, _, _ in runs:
        _check(str(tmp_path), name, schedule, 4, 2)
