"""Models someone else wrote train under ``strategy="auto_plan"`` on 2 gloo ranks with no code change:
Lightning's BoringModel, Lightning's demo Transformer (small vocab, synthetic tokens) and a
torchvision resnet18 on small images. The same spawned ranks also run ``PlanningCallback`` under
plain ``strategy="ddp"`` (one spawn: starting the interpreters dominates on this machine).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _auto_plan_models import ChainMLP, trainer_kwargs
from _dist_utils import run_on_ranks

STEPS = 2




def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    import lightning_distplan  # noqa: F401
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.demos.transformer import LightningTransformer

    from lightning_distplan.callbacks import PlanningCallback
    from lightning_distplan.demos import RandomImageData, RandomTokenData, TorchvisionClassifier

    class LightningTransformerOffline(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText2; this machine has no internet
            pass

    out: dict[str, Any] = {}
    cases = {
        "boring": (lambda: BoringModel(), None),
        "transformer": (lambda: LightningTransformerOffline(vocab_size=64), RandomTokenData(vocab_size=64, block_size=16, batch_size=4, num_samples=64)),
        "resnet18": (lambda: TorchvisionClassifier("resnet18", num_classes=10), RandomImageData(num_classes=10, image_size=32, batch_size=4, num_samples=64)),
    }
    for name, (build, data) in cases.items():
        torch.manual_seed(0)
        model = build()
        before = _state(model)
        t0 = time.perf_counter()
        trainer = L.Trainer(**trainer_kwargs(os.path.join(root, name), strategy="auto_plan", devices=world, max_steps=STEPS))
        trainer.fit(model, datamodule=data)
        after = {k: v.detach().cpu() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        out[name] = {
            "plan": trainer.strategy.plan,
            "strategy": type(trainer.strategy).__name__,
            "global_step": trainer.global_step,
            # a pipeline plan gathers the full state dict on global rank 0 only (empty elsewhere)
            "moved": max((after[k].float() - before[k].float()).abs().max().item() for k in after if k in before and after[k].numel()) if after else None,
            "seconds": time.perf_counter() - t0,
        }

    # PlanningCallback keeps strategy="ddp" and picks micro-batch size / accumulation for the fixed global batch.
    sizes: list[int] = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            sizes.append(batch[0].shape[0])

    callback = PlanningCallback(micro_batch_size=4)
    model = ChainMLP(width=16, depth=3, n_samples=128, loader_batch=16, dropout=0.0)
    trainer = L.Trainer(**trainer_kwargs(os.path.join(root, "callback"), strategy="ddp", devices=world, max_steps=STEPS, callbacks=[Sizes(), callback]))
    trainer.fit(model)
    out["callback"] = {
        "plan": callback.plan,
        "sizes": sizes,
        "strategy": type(trainer.strategy).__name__,
        "accumulate_after": trainer.accumulate_grad_batches,
        "state": _state(model),
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("auto_plan_models"))
    t0 = time.perf_counter()
    ranks = run_on_ranks(_run, 2, root, timeout=500)
    print(f"real models under auto_plan on 2 ranks: {time.perf_counter() - t0:.1f}s; fits: "
          + ", ".join(f"{k} {ranks[0][k]['seconds']:.1f}s" for k in ("boring", "transformer", "resnet18")))
    return {"ranks": ranks, "root": Path(root)}


@pytest.mark.parametrize("name", ["boring", "transformer", "resnet18"])
def test_real_model_trains_under_auto_plan(results: dict[str, Any], name: str) -> None:
    r0, r1 = (r[name] for r in results["ranks"])
    assert r0["plan"] is not None and r0["plan"] == r1["plan"]
    assert r0["plan"].world_size == 2
    assert r0["global_step"] == STEPS and r0["moved"] > 0
    plan_json = json.loads((results["root"] / name / "distplan" / "plan.json").read_text())
    assert plan_json["plan"]["strategy"] == r0["plan"].strategy
    assert (results["root"] / name / "distplan" / "profile.json").is_file()


def test_planning_callback_under_ddp(results: dict[str, Any]) -> None:
    r0, r1 = (r["callback"] for r in results["ranks"])
    plan = r0["plan"]
    assert r0["strategy"] == "DDPStrategy"  # the user's strategy is kept
    assert plan == r1["plan"] and plan.strategy == "dp_ga"
    # global batch = loader 16 x 2 ranks; micro-batch pinned to 4 -> accumulation 4
    assert (plan.global_batch_size, plan.micro_batch_size, plan.accumulate_grad_batches) == (32, 4, 4)
    assert r0["sizes"] == [4] * (STEPS * 4)
    assert r0["accumulate_after"] == 1  # restored
    torch.testing.assert_close(r0["state"], r1["state"], rtol=0, atol=0)
    assert json.loads((results["root"] / "callback" / "distplan" / "plan.json").read_text())["running_strategy"] == "DDPStrategy"
