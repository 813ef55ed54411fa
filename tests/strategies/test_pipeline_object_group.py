"""A pipeline checkpoint gathers the whole model to rank 0 over the strategy's gloo object group, never the default group.

On GPUs the default group is NCCL, and torch's object collectives over NCCL pickle each rank's object into a CUDA
tensor: rank 0's gather held every stage's weights (and Adam's two moments of each) on its GPU at once, the memory
a pipeline exists to spread. Here (gloo, CPU) the strategy is given a gloo group of its own in place of the one it
makes on GPUs, and every object collective of a fit, a checkpoint and the hand-back after the fit is recorded.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import run_on_ranks  # noqa: E402
from _pipeline_models import MLP_BOUNDARY, TinyMLP, mlp_data, trainer_kwargs  # noqa: E402

import lightning as L  # noqa: E402


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_distplan.strategies import _pipeline_checkpoint
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    class OwnObjectGroup(PipelineStrategy):
        def _build_pipeline(self, *args: Any, **kwargs: Any) -> None:
            super()._build_pipeline(*args, **kwargs)
            self._object_group = dist.new_group(backend="gloo")  # what a GPU run makes (its default group is NCCL)

    calls: list[tuple[str, bool]] = []
    strategy_box: list[Any] = []

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            calls.append((name, group is not None and group is strategy_box[0]._object_group))
            return fn(*args, group=group, **kwargs)
        return wrapped

    for name in ("gather_object", "all_gather_object"):
        setattr(_pipeline_checkpoint.dist, name, spy(name, getattr(dist, name)))
    strategy = OwnObjectGroup(schedule="1f1b", stages=2, n_microbatches=2, stage_boundaries=[MLP_BOUNDARY])
    strategy_box.append(strategy)
    model = TinyMLP()
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=0.01)  # type: ignore[method-assign]
    trainer = L.Trainer(**{**trainer_kwargs(world, strategy, out), "max_steps": 2})
    trainer.fit(model, DataLoader(mlp_data(32), batch_size=8))
    path = os.path.join(out, "object_group.ckpt")
    trainer.save_checkpoint(path)
    return {"calls": calls, "path": path}


def test_pipeline_checkpoints_gather_over_the_object_group(tmp_path: Any) -> None:
    results = run_on_ranks(_worker, 2, str(tmp_path), timeout=300)
    for res in results:
        names = [name for name, _ in res["calls"]]
        assert names.count("gather_object") >= 2, names  # the state dict and the optimizer state, at the checkpoint
        assert "all_gather_object" in names, names  # the module made whole after the fit
        assert all(on_object_group for _, on_object_group in res["calls"]), res["calls"]
    ckpt = torch.load(results[0]["path"], weights_only=False)
    model = TinyMLP()
    model.load_state_dict(ckpt["state_dict"])  # the whole model, as before
    assert len(ckpt["optimizer_states"][0]["state"]) == len(list(model.parameters()))  # Adam state of both stages
