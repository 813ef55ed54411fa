"""Portable checkpoints: by-name optimizer state, stage slices, and resume across plans and strategies."""

from __future__ import annotations

import copy
import os
import subprocess
import time
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from _dist_utils import error_of, run_on_ranks
from _tiny_lm import TinyLM, cpu_state, trainer_kwargs
from torch import nn

from lightning_distplan import Plan
from lightning_distplan.strategies import (
    CheckpointFormatError,
    DPGAStrategy,
    load_optimizer_state_by_name,
    merge_stage_states,
    optimizer_state_by_name,
    stored_plan,
)
from lightning_distplan.strategies._checkpoint import OPTIMIZER_STATES_KEY, PLAN_KEY, to_torch_optimizer_state
from lightning_distplan.strategies.dp_ga import PROGRESS_KEY


def _trained_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters(), "lr": 1e-2}])
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_optimizer_state_by_name_loads_into_stage_slices_and_merges_back() -> None:
    model, opt = _trained_adam()
    full = optimizer_state_by_name(opt, model.named_parameters())
    assert set(full["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert [g["params"] for g in full["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]

    # Two "pipeline stages", each with its own optimizer over its own parameters (same group layout,
    # an empty group where the stage has none of the parameters).
    stages = []
    for keep in (0, 2):
        named = {n: p for n, p in model.named_parameters() if n.startswith(f"{keep}.")}
        groups = [{"params": list(named.values()) if i == keep else []} for i in (0, 2)]
        stage_opt = torch.optim.Adam(groups, lr=0.5)  # wrong lr on purpose: the checkpoint's wins
        load_optimizer_state_by_name(stage_opt, named, copy.deepcopy(full))  # torch aliases loaded tensors
        for name, p in named.items():
            torch.testing.assert_close(stage_opt.state[p]["exp_avg"], opt.state[p]["exp_avg"], rtol=0, atol=0)
        assert stage_opt.param_groups[0 if keep == 0 else 1]["lr"] == 1e-2
        stages.append(optimizer_state_by_name(stage_opt, named))

    merged = merge_stage_states(stages)
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in full["param_groups"]]
    torch.testing.assert_close(merged["state"], full["state"], rtol=0, atol=0)

    # The merged state in torch's own format continues training exactly like the original optimizer.
    clone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    clone.load_state_dict(model.state_dict())
    clone_opt = torch.optim.Adam([{"params": clone[0].parameters()}, {"params": clone[2].parameters()}])
    clone_opt.load_state_dict(copy.deepcopy(to_torch_optimizer_state(merged)))
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (clone, clone_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    torch.testing.assert_close(clone.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_portable_state_errors_have_hints() -> None:
    model, opt = _trained_adam()
    full = optimizer_state_by_name(opt, model.named_parameters())
    extra = nn.Linear(2, 2)
    bad = torch.optim.Adam(list(model.parameters()) + list(extra.parameters()))
    named = {**dict(model.named_parameters()), **{f"head.{n}": p for n, p in extra.named_parameters()}}
    with pytest.raises(CheckpointFormatError, match=r"Parameter 'head.weight' .* is not in the checkpoint.*HINT"):
        load_optimizer_state_by_name(bad, named, full)
    with pytest.raises(CheckpointFormatError, match=r"mixes parameters of checkpoint groups \[0, 1\].*HINT"):
        load_optimizer_state_by_name(torch.optim.Adam(model.parameters()), model.named_parameters(), full)
    # A malformed state passed to the public function is refused as the checkpoint loader refuses one (it was a bare
    # KeyError: 'param_groups'), and the optimizer is left as it was.
    before = copy.deepcopy(opt.state_dict())
    for malformed, found in (({"state": {}}, "is a dict without 'param_groups'"), ([], "is a list without 'state' or 'param_groups'"),
                             ({**full, "state": []}, "has a list as 'state', not a dict by parameter name")):
        with pytest.raises(CheckpointFormatError, match=rf"^The optimizer state {found}, so the optimizer state cannot be loaded by "
                           r"parameter name\. HINT: Pass a state optimizer_state_by_name returned"):
            load_optimizer_state_by_name(opt, model.named_parameters(), malformed)
    torch.testing.assert_close(opt.state_dict(), before, rtol=0, atol=0)
    other = {**full, "param_groups": [{**g, "lr": 0.5} for g in full["param_groups"]]}
    with pytest.raises(CheckpointFormatError, match=r"hyper-parameters.*HINT"):
        merge_stage_states([full, other])


def _phases(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """All dp_ga runs of the resume test in one pair of processes (imports cost more than the training).

    SGD with momentum (stateful, linear): Adam would turn the fp rounding noise on parameters whose
    true gradient is zero (attention key biases) into full-size steps, so plans that sum the same
    samples in a different order would differ by far more than the checkpoint logic under test.
    The by-name Adam state is covered by the unit tests above.
    """
    out: dict[str, Any] = {}
    kw = trainer_kwargs(devices=world_size)

    model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")  # 160 samples = 5 steps of 32 per epoch
    L.Trainer(**kw, strategy=DPGAStrategy(micro_batch_size=4), max_epochs=2).fit(model)
    out["uninterrupted"] = cpu_state(model)

    model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")
    strategy = DPGAStrategy(micro_batch_size=4)
    trainer = L.Trainer(**kw, strategy=strategy, max_epochs=1)
    trainer.fit(model)
    trainer.save_checkpoint(path)
    first, first_path = trainer, path
    out["first_plan"], out["first_state"], out["first_steps"] = strategy.plan, cpu_state(model), trainer.global_step

    # resume with a different plan (m=8, s=2)
    model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")
    strategy = DPGAStrategy(micro_batch_size=8)
    trainer = L.Trainer(**kw, strategy=strategy, max_epochs=2)
    trainer.fit(model, ckpt_path=path)
    out["other_plan"], out["other_state"], out["other_steps"] = strategy.plan, cpu_state(model), trainer.global_step
    out["other_checkpoint_plan"], out["other_micro"] = strategy.checkpoint_plan, model.micro_batch_sizes

    # resume with "auto": the stored plan is reused, not re-derived from the loader
    model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")
    strategy = DPGAStrategy()
    L.Trainer(**kw, strategy=strategy, max_epochs=2).fit(model, ckpt_path=path)
    out["auto_plan"], out["auto_state"], out["auto_micro"] = strategy.plan, cpu_state(model), model.micro_batch_sizes

    # a mid-epoch checkpoint (ModelCheckpoint at step 2 of 5) resumed under the same plan, another plan and plain DDP
    from lightning.pytorch.callbacks import ModelCheckpoint

    mid_dir = os.path.join(os.path.dirname(path), "mid")
    every = ModelCheckpoint(dirpath=mid_dir, every_n_train_steps=2, save_top_k=-1, filename="mid")
    model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")
    L.Trainer(**{**kw, "enable_checkpointing": True}, strategy=DPGAStrategy(micro_batch_size=4), max_steps=2, callbacks=[every]).fit(model)
    # a checkpoint as dp_ga wrote them before the progress was kept in loader batches: micro-batches, no mark
    old = torch.load(os.path.join(mid_dir, "mid.ckpt"), weights_only=False)
    del old[PROGRESS_KEY]
    progress = old["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for part in ("total", "current"):
        counts = {k: v * 4 for k, v in progress[part].items()}
        counts["completed"] = counts["processed"] - 1  # saved at the batch's end, as ModelCheckpoint does
        progress[part] = counts
    old_path = os.path.join(mid_dir, f"old-{rank}.ckpt")
    torch.save(old, old_path)
    for name, resumed_under, path in (
        ("same", DPGAStrategy(micro_batch_size=4), "mid.ckpt"), ("other", DPGAStrategy(micro_batch_size=8), "mid.ckpt"),
        ("ddp", "ddp", "mid.ckpt"), ("old", DPGAStrategy(micro_batch_size=4), os.path.basename(old_path)),
    ):
        model = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")
        epochs = _EpochSteps()
        trainer = L.Trainer(**kw, strategy=resumed_under, max_epochs=2, callbacks=[epochs])
        trainer.fit(model, ckpt_path=os.path.join(mid_dir, path))
        out[f"mid_{name}"] = {"state": cpu_state(model), "epoch_end_steps": epochs.steps}

    # Saves global rank 0 cannot make (the path is a folder, or lies under a file: the checkpoint) stop every rank with
    # rank 0's error; rank 1 saw only gloo's "Connection closed by peer" (last, as the ranks' collectives then paired
    # wrongly). The checkpoint stays as it was (the parent loads it).
    for name, bad in (("folder", mid_dir), ("under a file", os.path.join(first_path, "x.ckpt"))):
        out[f"save to {name}"] = error_of(lambda: first.save_checkpoint(bad))
    # A resume one rank cannot read (a node without the file) stops every rank with that rank's error, before a step;
    # rank 0 went on and stopped at its next collective with gloo's "Connection closed by peer"
    model, trainer = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd"), L.Trainer(**kw, strategy=DPGAStrategy(), max_epochs=2)
    out["resume a rank lacks"] = error_of(lambda: trainer.fit(model, ckpt_path=first_path if rank == 0 else first_path + ".missing"))
    # A resume that comes to no file on one rank only (ckpt_path="last" on a node whose disk holds none: None there) stops
    # every rank with one sentence; rank 1 went on into the setup collectives, which paired with rank 0's read all-reduce,
    # and both waited for the process group's timeout
    model, trainer = TinyLM(n_samples=160, loader_batch=16, optimizer="sgd"), L.Trainer(**kw, strategy=DPGAStrategy(), max_epochs=2)
    out["resume on one rank only"] = error_of(lambda: trainer.fit(model, ckpt_path=first_path if rank == 0 else None))
    # An old checkpoint global rank 0 cannot remove (ModelCheckpoint's top-k) is a warning there, and every rank trains
    # on; rank 0 alone raised a bare PermissionError, and rank 1 trained on into gloo's "Connection reset by peer"
    top_dir = os.path.join(os.path.dirname(first_path), "top")
    blocked = _UndeletableOnRankZero(top_dir)
    top = ModelCheckpoint(dirpath=top_dir, every_n_train_steps=1, save_top_k=1)
    trainer = L.Trainer(**{**kw, "enable_checkpointing": True}, strategy=DPGAStrategy(micro_batch_size=4), max_steps=3,
                        callbacks=[blocked, top])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            raised = error_of(lambda: trainer.fit(TinyLM(n_samples=160, loader_batch=16, optimizer="sgd")))
        removals = [str(w.message) for w in caught if "checkpoint" in str(w.message) and "remov" in str(w.message).lower()]
        out["top-k removal"] = (raised, trainer.global_step, sorted(blocked.paths), removals)
    finally:
        for blocked_path in blocked.paths:
            subprocess.run(["chattr", "-i", blocked_path], check=True)
    return out


class _UndeletableOnRankZero(L.Callback):
    """After the first step, global rank 0's disk cannot remove the checkpoints saved so far (an immutable file: these
    tests run as root, which removes read-only files), once (a step ends several loader batches); ``paths``: those made
    so (none where chattr +i is refused)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.paths = folder, set()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 2 and not self.paths:
            for name in os.listdir(self.folder):
                name = os.path.join(self.folder, name)
                if name not in self.paths and subprocess.run(["chattr", "+i", name], capture_output=True).returncode == 0:
                    self.paths.add(name)


class _EpochSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


def _resume_plain_ddp(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = TinyLM(n_samples=160, loader_batch=32 // world_size, optimizer="sgd")
    trainer = L.Trainer(**trainer_kwargs(devices=world_size), strategy="ddp", max_epochs=2)
    trainer.fit(model, ckpt_path=path)
    return {"state": cpu_state(model), "steps": trainer.global_step}


def test_checkpoint_resumes_under_other_plans_and_plain_ddp(tmp_path: Any) -> None:
    t0 = time.perf_counter()
    path = str(tmp_path / "dp_ga.ckpt")
    r0, r1 = run_on_ranks(_phases, 2, path)
    (ddp1,) = run_on_ranks(_resume_plain_ddp, 1, path)

    first = Plan(strategy="dp_ga", dp=2, micro_batch_size=4, accumulate_grad_batches=4, global_batch_size=32)
    assert r0["first_plan"] == first and r0["first_steps"] == 5
    # The file: full module keys, FQN-keyed optimizer state, the plan.
    ckpt = torch.load(path, weights_only=False)
    assert list(ckpt["state_dict"]) == list(TinyLM().state_dict())
    assert stored_plan(ckpt) == first and ckpt[PLAN_KEY]["schedule"] == "none"
    assert set(ckpt[OPTIMIZER_STATES_KEY][0]["state"]) == {n for n, _ in TinyLM().named_parameters()}
    # Plain Lightning loads it.
    plain = TinyLM.load_from_checkpoint(path)
    torch.testing.assert_close(cpu_state(plain), r0["first_state"], rtol=0, atol=0)

    expected = r0["uninterrupted"]
    assert r0["other_plan"] == Plan(strategy="dp_ga", dp=2, micro_batch_size=8, accumulate_grad_batches=2, global_batch_size=32)
    assert r0["other_checkpoint_plan"] == first and r0["other_steps"] == 10
    assert r0["other_micro"] == [8] * 10
    torch.testing.assert_close(r0["other_state"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r1["other_state"], expected, rtol=1e-5, atol=1e-6)
    assert r0["auto_plan"] == first and r0["auto_micro"] == [4] * 20  # stored plan reused
    torch.testing.assert_close(r0["auto_state"], expected, rtol=1e-5, atol=1e-6)
    assert ddp1["steps"] == 10
    torch.testing.assert_close(ddp1["state"], expected, rtol=1e-5, atol=1e-6)
    # Mid-epoch: the checkpoint counts the epoch's progress in the user's loader batches (2 steps = 2 of them per
    # rank, not dp_ga's 8 micro-batches), so every plan and plain DDP resume at the same place in the epoch: epoch 0
    # ends at step 5, and the weights match the same-plan resume (another plan or DDP ran 8 or 4 steps per epoch).
    mid = torch.load(os.path.join(str(tmp_path), "mid", "mid.ckpt"), weights_only=False)
    assert mid["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"] == {"ready": 2, "started": 2, "processed": 2, "completed": 1}
    for name in ("same", "other", "ddp", "old"):  # "old": an unmarked checkpoint dp_ga wrote in micro-batches before
        assert r0[f"mid_{name}"]["epoch_end_steps"] == [5, 10], name
        torch.testing.assert_close(r0[f"mid_{name}"]["state"], r0["mid_same"]["state"], rtol=1e-5, atol=1e-6)
    for name, bad, found in (("folder", tmp_path / "mid", "is a directory"), ("under a file", tmp_path / "dp_ga.ckpt" / "x.ckpt",
                                                                               f"lies under {path!r}, which is a file")):
        sentence = f"The checkpoint {str(bad)!r} {found}. HINT: Save checkpoints to a file path in a writable folder"
        for r, notes in ((r0, []), (r1, ["Raised on global rank 0 saving the checkpoint; global rank 1 stops with it."])):
            kind, message, raised_notes = r[f"save to {name}"]
            assert (kind, raised_notes) == ("OutputPathError", notes) and message.startswith(sentence), (name, r[f"save to {name}"])
    # Lightning's own said "FileNotFoundError: Checkpoint file not found: <path>", with no hint
    missing = ("CheckpointNotFoundError", f"The checkpoint {path + '.missing'!r} does not exist. HINT: Check the path, or pass "
               "ckpt_path='last' to resume from the last checkpoint ModelCheckpoint saved (a fit where it saved none starts afresh) "
               "or ckpt_path=None to start afresh.")
    assert r1["resume a rank lacks"] == (*missing, [])
    assert r0["resume a rank lacks"] == (*missing, ["Raised on global rank 1 reading the checkpoint; global rank 0 stops with it."])
    for r in (r0, r1):
        kind, message, notes = r["resume on one rank only"]
        assert (kind, notes) == ("CheckpointFormatError", []), r["resume on one rank only"]
        assert message.startswith("Some ranks resume from a checkpoint but global rank 1 has none") and "HINT: " in message, message
    old = os.path.join(str(tmp_path), "top", "epoch=0-step=1.ckpt")
    if r0["top-k removal"][2] != [old]:
        pytest.skip(f"chattr +i could not make {old} undeletable (not root, or a file system without it): top-k removal untested")
    warned = (f"Removing the old checkpoint {old!r} failed (Operation not permitted), so it is left in place and training goes "
              "on. HINT: Let this process delete files in that folder (its permissions; a read-only or immutable file), or keep "
              "every checkpoint (ModelCheckpoint(save_top_k=-1)).")
    assert r0["top-k removal"][:2] == r1["top-k removal"][:2] == (None, 3), (r0["top-k removal"], r1["top-k removal"])
    assert (r0["top-k removal"][3], r1["top-k removal"][3]) == ([warned], []), (r0["top-k removal"], r1["top-k removal"])
    assert sorted(os.listdir(tmp_path / "top")) == ["epoch=0-step=1.ckpt", "epoch=0-step=3.ckpt"]  # the old one stays
    print(f"checkpoint resume test {time.perf_counter() - t0:.1f}s")


class _ExtraTensorLM(TinyLM):
    """An optimizer over the module's parameters plus a tensor that is not one of them (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__(n_samples=64, loader_batch=16, optimizer="sgd")
        self.temperature = torch.ones((), requires_grad=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.temperature

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.1, momentum=0.9)


def test_dp_ga_checkpoints_an_optimizer_holding_a_tensor_outside_the_module(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    kw = {**trainer_kwargs(devices=1), "enable_checkpointing": True}
    model = _ExtraTensorLM()
    with pytest.warns(UserWarning, match="not a parameter of the LightningModule.*resume under dp_ga or DDP"):
        L.Trainer(**kw, strategy=DPGAStrategy(micro_batch_size=4), max_steps=2, callbacks=[every]).fit(model)
    torch.distributed.destroy_process_group()
    ckpt = torch.load(str(tmp_path / "step=2.ckpt"), weights_only=False)
    assert OPTIMIZER_STATES_KEY not in ckpt and len(ckpt["optimizer_states"][0]["state"]) == len(list(model.parameters())) + 1
    resumed = _ExtraTensorLM()
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(micro_batch_size=4), max_steps=3)
    trainer.fit(resumed, ckpt_path=str(tmp_path / "step=2.ckpt"))
    torch.distributed.destroy_process_group()
    assert trainer.global_step == 3


def test_a_checkpoint_pipeline_plan_is_reused_only_where_it_fits_the_resumed_run() -> None:
    """strategy='gpipe' / '1f1b' with 'auto' arguments re-derived n_microbatches and the split on resume, silently."""
    from lightning_distplan.plan import Plan
    from lightning_distplan.strategies.pipeline import unfit_checkpoint_plan

    stored = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=8, n_microbatches=4, global_batch_size=32, stage_boundaries=(2,),
                  layer_names=("a", "b", "c"))
    fits = dict(schedule="1f1b", world_size=2, loader_batch=32, accumulate=1, layer_names=("a", "b", "c"))
    assert unfit_checkpoint_plan(stored, **fits) is None
    assert unfit_checkpoint_plan(stored, **{**fits, "schedule": None}) is None  # schedule='auto' takes the plan's
    assert unfit_checkpoint_plan(stored, **{**fits, "schedule": "gpipe"}) == "it runs 1f1b, this strategy gpipe"
    assert unfit_checkpoint_plan(stored, **{**fits, "world_size": 4}) == "it was made for 2 processes, this run has 4"
    assert unfit_checkpoint_plan(stored, **{**fits, "layer_names": ("a", "x", "c")}) == "its layers are not this model's pipeline layers"
    unnamed = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=8, n_microbatches=4, global_batch_size=32, stage_boundaries=(3,))
    assert unfit_checkpoint_plan(unnamed, **fits) == "its stage boundaries [3] do not split this model's 3 pipeline layers"
    assert unfit_checkpoint_plan(stored, **{**fits, "loader_batch": 16}) == (
        "it was made for global batch 32 (1 replica(s) x 32 samples x 1 flush(es)), this run's is 16 (1 x loader batch 16 x "
        "accumulate_grad_batches 1)")
    assert unfit_checkpoint_plan(stored, **{**fits, "accumulate": 2}).startswith("it was made for global batch 32")
    assert unfit_checkpoint_plan(stored, **{**fits, "loader_batch": None}) == "the train loader's batch size cannot be read"
    dp_ga = Plan(strategy="dp_ga", dp=2, micro_batch_size=4, accumulate_grad_batches=4, global_batch_size=32)
    assert unfit_checkpoint_plan(dp_ga, **fits) == "it is a dp_ga plan, not a pipeline"


class _Validated(TinyLM):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def _fit_from(strategy: Any, ckpt: str, steps: int) -> tuple[dict[str, torch.Tensor], int]:
    model = TinyLM(n_samples=64, loader_batch=16, optimizer="adam")
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=strategy, max_steps=steps)
    trainer.fit(model, ckpt_path=ckpt)
    torch.distributed.destroy_process_group()
    return cpu_state(model), trainer.global_step


def test_a_checkpoint_whose_plan_cannot_be_read_resumes_without_it(tmp_path: Any) -> None:
    """The stored plan only says what to run: one of a later schema version (a checkpoint written by a newer
    lightning_distplan) or with values this version refuses stopped dp_ga, the pipelines and auto_plan from resuming,
    or even validating, a checkpoint whose weights and optimizer state are fine (ProfileFormatError, 'HINT: Re-plan')."""
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    model = TinyLM(n_samples=64, loader_batch=16, optimizer="adam")
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(micro_batch_size=4), max_steps=2)
    trainer.fit(model)
    good = str(tmp_path / "good.ckpt")
    trainer.save_checkpoint(good)
    torch.distributed.destroy_process_group()
    reference, steps = _fit_from(DPGAStrategy(micro_batch_size=4), good, 4)
    assert steps == 4
    for name, edit in (("newer", {"schema_version": 2}), ("inconsistent", {"accumulate_grad_batches": 3})):
        ckpt = torch.load(good, weights_only=False)
        ckpt[PLAN_KEY].update(edit)
        path = str(tmp_path / f"{name}.ckpt")
        torch.save(ckpt, path)
        with pytest.warns(UserWarning, match=r"^dp_ga: the plan stored in the checkpoint cannot be read \(.+\), so it is not reused; the weights"):
            state, steps = _fit_from(DPGAStrategy(micro_batch_size=4), path, 4)
        assert steps == 4
        torch.testing.assert_close(state, reference, rtol=0, atol=0)  # the weights and Adam's moments resumed
        if name == "newer":  # auto_plan profiles and plans again
            with pytest.warns(UserWarning, match="^auto_plan: the plan stored in the checkpoint cannot be read"):
                _, steps = _fit_from(AutoPlanStrategy(profile_repeats=1), path, 3)
            assert steps == 3
        evaluated = _Validated(n_samples=64, loader_batch=16)
        with pytest.warns(UserWarning, match="^dp_ga: the plan stored"):
            L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy()).validate(evaluated, ckpt_path=path, verbose=False)
        torch.distributed.destroy_process_group()
        torch.testing.assert_close(cpu_state(evaluated), cpu_state(TinyLM.load_from_checkpoint(good)), rtol=0, atol=0)


def test_a_checkpoint_file_cut_short_or_not_lightnings_is_refused_in_one_sentence(tmp_path: Any) -> None:
    """torch and Lightning named neither: a checkpoint cut short (a copy or a save that stopped) raised 'OSError: [Errno
    22] Invalid argument' (an empty one a bare EOFError), a module's bare state_dict "KeyError: 'pytorch-lightning_version'"."""
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    model = TinyLM(n_samples=32, loader_batch=16)
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(model)
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    torch.distributed.destroy_process_group()
    raw = good.read_bytes()
    (tmp_path / "half.ckpt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.ckpt").write_bytes(raw)
    cut = r"cannot be read \({}\): the file is cut short or damaged .* HINT: Resume from another checkpoint"
    bare = r"holds a dict without 'state_dict' or 'pytorch-lightning_version' \(keys 'model.embedding.weight', .*\), not a checkpoint "
    expected = {"half.ckpt": cut.format(r"OSError: \[Errno 22\] Invalid argument"), "empty.ckpt": cut.format("EOFError: no data"),
                "weights.pt": bare + "Lightning wrote. HINT: Load the weights into the module before the run",
                # Lightning's own: "FileNotFoundError: Checkpoint file not found: <path>", no hint
                "missing.ckpt": r"The checkpoint '.*missing.ckpt' does not exist\. HINT: Check the path, or pass ckpt_path='last'",
                # torch.load's own: a bare "IsADirectoryError: [Errno 21] Is a directory"
                "run": r"The checkpoint '.*run' is a folder, not a checkpoint file \(it holds 'last.ckpt'\)\. HINT: Pass the path of a "
                "checkpoint file as ckpt_path"}
    for name, message in expected.items():
        for run in ("fit", "validate"):
            trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=2, limit_val_batches=1)
            with pytest.raises(CheckpointFormatError, match=message) as raised:
                getattr(trainer, run)(_Validated(n_samples=32, loader_batch=16), ckpt_path=str(tmp_path / name))
            assert isinstance(raised.value, FileNotFoundError) == (name == "missing.ckpt")  # still what Lightning raised
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        for strategy in (PipelineStrategy(schedule="gpipe"), AutoPlanStrategy()):
            with pytest.raises(CheckpointFormatError, match=message):
                strategy.load_checkpoint(str(tmp_path / name))
    assert stored_plan(PipelineStrategy(schedule="1f1b").load_checkpoint(str(good))) is not None  # an intact one loads


class _DropsParamGroups(L.Callback):
    """A user's hook that leaves the optimizer's param groups out of the checkpoint it is handed."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        for state in checkpoint.get("optimizer_states", []):
            state.pop("param_groups", None)


def test_an_optimizer_state_a_hook_broke_is_refused_on_save_in_one_sentence(tmp_path: Any) -> None:
    """An on_save_checkpoint hook that drops the optimizer state's 'param_groups' stopped dp_ga's save with a bare
    "KeyError: 'param_groups'" (the pipeline's: test_checkpoint_chain); no file is made, and the next save works."""
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(TinyLM(n_samples=32, loader_batch=16, optimizer="adam"))
    trainer.callbacks.append(_DropsParamGroups())
    with pytest.raises(CheckpointFormatError, match=r"^The optimizer state to save \(checkpoint\['optimizer_states'\]\[0\]\) is a dict "
                       r"without 'param_groups', so it cannot be stored by parameter name\. HINT: An on_save_checkpoint hook"):
        trainer.save_checkpoint(tmp_path / "hooked.ckpt")
    trainer.callbacks.pop()
    assert os.listdir(tmp_path) == []
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    torch.distributed.destroy_process_group()
    assert "param_groups" in torch.load(tmp_path / "good.ckpt", weights_only=False)["optimizer_states"][0]


def test_a_malformed_by_name_optimizer_state_is_refused_in_one_sentence(tmp_path: Any) -> None:
    """A checkpoint whose 'distplan_optimizer_states' entry is not what the strategies write (edited by hand or by
    another tool) stopped the resume with a bare "KeyError: 'param_groups'" (or 'state', 'params'), and one whose
    'state' was a list resumed with no Adam moments at all, silently."""
    model = TinyLM(n_samples=32, loader_batch=16, optimizer="adam")
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(model)
    good = str(tmp_path / "good.ckpt")
    trainer.save_checkpoint(good)
    torch.distributed.destroy_process_group()

    def no_params(states: list[dict[str, Any]]) -> None:
        del states[0]["param_groups"][0]["params"]

    edits = {
        "no param_groups": (lambda states: states[0].pop("param_groups"), r"entry 0 is a dict without 'param_groups'"),
        "no state": (lambda states: states[0].pop("state"), r"entry 0 is a dict without 'state'"),
        "state a list": (lambda states: states[0].__setitem__("state", list(states[0]["state"].values())), r"entry 0 has a list as 'state'"),
        "group without params": (no_params, r"entry 0 has param group 0 without a list of parameter names as 'params'"),
        "one dict": (None, r"is a dict, not a list of one state per optimizer"),
    }
    for name, (edit, found) in edits.items():
        ckpt = torch.load(good, weights_only=False)
        if edit is None:
            ckpt[OPTIMIZER_STATES_KEY] = ckpt[OPTIMIZER_STATES_KEY][0]
        else:
            edit(ckpt[OPTIMIZER_STATES_KEY])
        path = str(tmp_path / f"{name}.ckpt")
        torch.save(ckpt, path)
        resumed = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=2)
        with pytest.raises(CheckpointFormatError, match=rf"^The checkpoint's 'distplan_optimizer_states' {found}.*\. HINT: Resume from a "
                           r"checkpoint a lightning_distplan strategy wrote, or delete its 'distplan_optimizer_states'"):
            resumed.fit(TinyLM(n_samples=32, loader_batch=16, optimizer="adam"), ckpt_path=path)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_fit_resumed_from_a_weights_only_checkpoint_is_refused_in_one_sentence(tmp_path: Any) -> None:
    """ckpt_path= a weights-only checkpoint (ModelCheckpoint(save_weights_only=True), save_checkpoint(weights_only=True))
    stopped the fit after loading the weights with Lightning's "KeyError: 'Trying to restore optimizer state but
    checkpoint contains only the model. ...'" (its repr, in quotes); validating from it works, and still does."""
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    model = TinyLM(n_samples=32, loader_batch=16)
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(model)
    path = str(tmp_path / "weights.ckpt")
    trainer.save_checkpoint(path, weights_only=True)
    torch.distributed.destroy_process_group()
    for strategy in (DPGAStrategy(), AutoPlanStrategy(profile_repeats=1)):
        trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=strategy, max_steps=2)
        with pytest.raises(CheckpointFormatError, match=r"^The checkpoint '.*weights\.ckpt' holds the model's weights only \(saved with "
                           r"save_weights_only=True\), not the optimizer state a resumed fit needs\. HINT: Load the weights into the module "
                           r"\(TinyLM\.load_from_checkpoint\(path\)\) and fit it without ckpt_path, or resume from a full checkpoint\.$"):
            trainer.fit(TinyLM(n_samples=32, loader_batch=16), ckpt_path=path)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    evaluated = _Validated(n_samples=32, loader_batch=16)
    L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), limit_val_batches=1).validate(evaluated, ckpt_path=path, verbose=False)
    torch.distributed.destroy_process_group()
    torch.testing.assert_close(cpu_state(evaluated), cpu_state(model), rtol=0, atol=0)


class _LoadsWeightsAtStart(L.Callback):
    """Reads a weights-only checkpoint through the strategy during the fit (a teacher's or an EMA's weights, say)."""

    def __init__(self, path: str) -> None:
        self.path, self.loaded = path, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loaded = trainer.strategy.load_checkpoint(self.path)["state_dict"]


def test_a_weights_only_checkpoint_read_during_a_fit_is_not_taken_for_its_resume(tmp_path: Any) -> None:
    """The refusal of a fit resumed from a weights-only checkpoint refused every weights-only checkpoint the strategy
    read while fitting, also one a callback reads during a fit resumed from a full checkpoint or not resumed at all."""
    model = TinyLM(n_samples=32, loader_batch=16)
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(model)
    full, weights = str(tmp_path / "full.ckpt"), str(tmp_path / "weights.ckpt")
    trainer.save_checkpoint(full)
    trainer.save_checkpoint(weights, weights_only=True)
    torch.distributed.destroy_process_group()
    for ckpt_path in (None, full):
        reader = _LoadsWeightsAtStart(weights)
        trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=2, callbacks=[reader])
        trainer.fit(TinyLM(n_samples=32, loader_batch=16), ckpt_path=ckpt_path)
        torch.distributed.destroy_process_group()
        assert reader.loaded is not None
        torch.testing.assert_close(reader.loaded, cpu_state(model), rtol=0, atol=0)
