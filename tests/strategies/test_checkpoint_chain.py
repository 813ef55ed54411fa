"""DESIGN §3.5 end to end: train with gpipe, resume with dp_ga, resume with 1f1b — same weights as
one uninterrupted single-process run. Every hop changes strategy AND plan; each checkpoint is
written by the previous strategy and read by the next."""

from __future__ import annotations

import os
import time
from typing import Any

import lightning as L
import pytest
import torch
from _dist_utils import error_of, run_on_ranks
from torch.utils.data import DataLoader, DistributedSampler

EPOCH = 160  # samples: 5 optimizer steps of 32 per epoch, so every hop resumes at an epoch boundary


def _kw(world: int, epochs: int) -> dict[str, Any]:
    return dict(accelerator="cpu", devices=world, max_epochs=epochs, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


def _chain(rank: int, world: int, out: str) -> dict[str, Any]:
    from _pipeline_models import build, token_data

    from lightning_distplan.strategies import DPGAStrategy
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    data = token_data(EPOCH)
    a, b, c = (os.path.join(out, f"{x}.ckpt") for x in ("gpipe", "dp_ga", "1f1b"))
    plans = {}

    model = build("transformer")  # epoch 0: gpipe, 2 stages, 8 micro-batches of 4
    strategy = PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=8)
    trainer = L.Trainer(**_kw(world, 1), strategy=strategy)
    trainer.fit(model, DataLoader(data, batch_size=32))
    trainer.save_checkpoint(a)
    plans["gpipe"] = strategy.plan

    model = build("transformer")  # epoch 1: dp_ga, 2 replicas x m=4 x s=4
    strategy = DPGAStrategy(micro_batch_size=4)
    trainer = L.Trainer(**_kw(world, 2), strategy=strategy)
    trainer.fit(model, DataLoader(data, batch_size=16), ckpt_path=a)
    trainer.save_checkpoint(b)
    plans["dp_ga"], plans["dp_ga_from"] = strategy.plan, strategy.checkpoint_plan

    model = build("transformer")  # epoch 2: 1f1b, 2 stages, 4 micro-batches of 8
    strategy = PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=4)
    trainer = L.Trainer(**_kw(world, 3), strategy=strategy)
    trainer.fit(model, DataLoader(data, batch_size=32), ckpt_path=b)
    trainer.save_checkpoint(c)
    plans["1f1b"], plans["steps"] = strategy.plan, trainer.global_step
    plans["strict"] = _strict_loading_into_the_built_pipeline(rank, trainer, model, c)
    pipelined = trainer

    # strategy="1f1b" with every argument 'auto', resumed from that checkpoint (at its end: nothing more trains), runs
    # the stored plan (4 micro-batches; re-derived, it was 8) and says so; from the gpipe one it says why it does not
    import lightning_distplan.strategies.pipeline as pipeline

    said: list[str] = []
    pipeline.rank_zero_info = lambda message, *args, **kwargs: said.append(message)
    for ckpt in (c, a):
        trainer = L.Trainer(**_kw(world, 3 if ckpt == c else 1), strategy="1f1b")
        trainer.fit(build("transformer"), DataLoader(data, batch_size=32), ckpt_path=ckpt)
        plans[f"resumed from {os.path.basename(ckpt)}"] = (trainer.strategy._n, trainer.strategy.checkpoint_plan)
    plans["said"] = [line for line in said if "checkpoint's plan" in line]

    # A save global rank 0 cannot make (the path lies under a file: the checkpoint, which stays) stops every stage with
    # rank 0's error; stage 1 saw only gloo's "Connection closed by peer" (last: the ranks' collectives then paired wrongly)
    plans["save under a file"] = error_of(lambda: pipelined.save_checkpoint(os.path.join(c, "x.ckpt")))
    # An error in what rank 0 alone adds before the write (the by-name optimizer state, here of a state a user's hook left
    # without its param groups) stops every stage too; the other stage waited in the save's all-reduce while rank 0 went
    # on, and the next collectives hung
    pipelined.callbacks.append(_DropsParamGroups())
    plans["save after a hook"] = error_of(lambda: pipelined.save_checkpoint(os.path.join(out, "hooked.ckpt")))
    pipelined.callbacks.pop()
    # A resume one rank cannot read (its node holds a copy cut short) stops every stage with that rank's error
    cut = os.path.join(out, f"cut-{rank}.ckpt")
    with open(c, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(1000))
    trainer = L.Trainer(**_kw(world, 4), strategy=PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=4))
    plans["resume a rank cannot read"] = error_of(
        lambda: trainer.fit(build("transformer"), DataLoader(data, batch_size=32), ckpt_path=c if rank == 0 else cut)
    )
    # A resume from a file one rank lacks stops every stage with one sentence and a hint (Lightning's own said only
    # "Checkpoint file not found: <path>")
    trainer = L.Trainer(**_kw(world, 4), strategy=PipelineStrategy(schedule="1f1b", stages=2, n_microbatches=4))
    plans["resume a rank lacks"] = error_of(
        lambda: trainer.fit(build("transformer"), DataLoader(data, batch_size=32), ckpt_path=c if rank == 0 else cut + ".missing")
    )
    return plans


class _DropsParamGroups(L.Callback):
    """A user's hook that leaves the optimizer's param groups out of the checkpoint (its other ranks hold no state)."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        for state in checkpoint.get("optimizer_states", []):
            state.pop("param_groups", None)


def _strict_loading_into_the_built_pipeline(rank: int, trainer: L.Trainer, model: L.LightningModule, good: str) -> list[str]:
    """The Trainer of a pipeline fit loads a checkpoint into the pipeline it built (trainer.validate(ckpt_path=...)), as
    strictly as Lightning loads one before the build: it took one with an entry the model does not have, silently."""
    from _pipeline_models import token_data

    from lightning_distplan.errors import CheckpointMismatchError

    extra = good.replace(".ckpt", "-extra.ckpt")
    if rank == 0:
        ckpt = torch.load(good, weights_only=False)
        ckpt["state_dict"]["head.weight"] = torch.zeros(3)
        torch.save(ckpt, extra)
    torch.distributed.barrier()
    said = []
    for path in (good, extra):
        try:
            trainer.validate(model, DataLoader(token_data(32), batch_size=32), ckpt_path=path, verbose=False)
            said.append("loaded")
        except CheckpointMismatchError as err:
            said.append(str(err))
    return said


def test_gpipe_to_dp_ga_to_1f1b_equals_uninterrupted_run(tmp_path: Any) -> None:
    from _pipeline_models import build, token_data

    t0 = time.perf_counter()
    ranks = run_on_ranks(_chain, 2, str(tmp_path))
    plans = ranks[0]
    assert plans["steps"] == 15
    assert plans["strict"] == [
        "loaded", "The checkpoint holds 1 entries the model does not have, e.g. ['head.weight']. HINT: Load a checkpoint of this "
        "model, or set strict_loading = False on the LightningModule to leave them out.",
    ]
    gpipe = plans["gpipe"]
    assert (gpipe.strategy, gpipe.dp, gpipe.pp, gpipe.micro_batch_size, gpipe.n_microbatches) == ("gpipe", 1, 2, 4, 8)
    assert plans["dp_ga_from"] == plans["gpipe"]  # the stored plan is exposed on resume
    assert (plans["dp_ga"].micro_batch_size, plans["dp_ga"].accumulate_grad_batches) == (4, 4)
    assert (plans["1f1b"].strategy, plans["1f1b"].n_microbatches) == ("1f1b", 4)
    assert plans["resumed from 1f1b.ckpt"] == (4, plans["1f1b"])  # the stored plan, not 'auto''s 8 micro-batches
    assert plans["resumed from gpipe.ckpt"] == (None, plans["gpipe"])  # 'auto': derived at the first batch (none here)
    assert plans["said"] == [
        f"PipelineStrategy: resuming with the checkpoint's plan {plans['1f1b'].describe()}.",
        f"PipelineStrategy: not resuming with the checkpoint's plan {plans['gpipe'].describe()}: it runs gpipe, this strategy "
        "1f1b; deriving n_microbatches and stage boundaries for this run.",
    ]

    # Reference: one process, batch 32, the sample order Lightning's DistributedSampler(seed=0) gives.
    torch.set_num_threads(1)
    data = token_data(EPOCH)
    reference = build("transformer")
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    L.Trainer(**_kw(1, 3)).fit(reference, loader)

    for name in ("gpipe", "dp_ga", "1f1b"):
        ckpt = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
        assert list(ckpt["state_dict"]) == list(reference.state_dict())
        assert ckpt["distplan_plan"]["strategy"] == name
    final = torch.load(tmp_path / "1f1b.ckpt", weights_only=False)["state_dict"]
    torch.testing.assert_close(final, {k: v.detach() for k, v in reference.state_dict().items()}, rtol=1e-5, atol=2e-6)
    bad = os.path.join(tmp_path, "1f1b.ckpt")
    sentence = f"The checkpoint {os.path.join(bad, 'x.ckpt')!r} lies under {bad!r}, which is a file. HINT: Save checkpoints to"
    for r, notes in ((ranks[0], []), (ranks[1], ["Raised on global rank 0 saving the checkpoint; global rank 1 stops with it."])):
        kind, message, raised_notes = r["save under a file"]
        assert (kind, raised_notes) == ("OutputPathError", notes) and message.startswith(sentence), r["save under a file"]
    for r, notes in ((ranks[0], []), (ranks[1], ["Raised on global rank 0 saving the checkpoint; global rank 1 stops with it."])):
        kind, message, raised_notes = r["save after a hook"]  # a bare "KeyError: 'param_groups'" before
        assert (kind, raised_notes) == ("CheckpointFormatError", notes) and message.startswith(
            "The optimizer state to save (checkpoint['optimizer_states'][0]) is a dict without 'param_groups', so it cannot be "
            "stored by parameter name. HINT: An on_save_checkpoint hook"), r["save after a hook"]
    assert not os.path.exists(os.path.join(tmp_path, "hooked.ckpt"))
    cut = os.path.join(tmp_path, "cut-1.ckpt")
    sentence = f"The checkpoint {cut!r} cannot be read (RuntimeError: PytorchStreamReader failed reading zip archive"
    for r, notes in ((ranks[1], []), (ranks[0], ["Raised on global rank 1 reading the checkpoint; global rank 0 stops with it."])):
        kind, message, raised_notes = r["resume a rank cannot read"]
        assert (kind, raised_notes) == ("CheckpointFormatError", notes) and message.startswith(sentence), r["resume a rank cannot read"]
    missing = f"The checkpoint {cut + '.missing'!r} does not exist. HINT: Check the path, or pass ckpt_path='last'"
    for r, notes in ((ranks[1], []), (ranks[0], ["Raised on global rank 1 reading the checkpoint; global rank 0 stops with it."])):
        kind, message, raised_notes = r["resume a rank lacks"]
        assert (kind, raised_notes) == ("CheckpointNotFoundError", notes) and message.startswith(missing), r["resume a rank lacks"]
    print(f"gpipe -> dp_ga -> 1f1b chain {time.perf_counter() - t0:.1f}s")


def test_optimizer_state_of_other_param_groups_is_a_checkpoint_mismatch() -> None:
    from lightning_distplan.errors import CheckpointMismatchError
    from lightning_distplan.strategies._pipeline_checkpoint import OptimizerIndex, local_optimizer_state

    index = OptimizerIndex(full_group_sizes=(2,), local_to_full=(0,), provided=frozenset({0}), names=("a", "b"))
    full = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    with pytest.raises(CheckpointMismatchError, match=r"param groups of sizes \[3\], this model's has \[2\]\. HINT: Resume with the same"):
        local_optimizer_state(full, index)
    with pytest.raises(ValueError):  # still the built-in it was before
        local_optimizer_state(full, index)


def test_the_optimizer_state_a_checkpoint_gathers_copies_tensors_in_lists() -> None:
    """LBFGS keeps its history as lists of tensors in its state (``old_dirs``, ``old_stps``, ``ro``, ``al``). The
    state a pipeline checkpoint gathers (``_to_cpu``) copied tensors and dicts only, so such a list travelled as the
    optimizer's own live list: its CUDA tensors were pickled to rank 0 as CUDA tensors, and the saved history grew with
    the next step's."""
    from lightning_distplan.strategies._pipeline_checkpoint import _to_cpu

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.LBFGS([w], lr=0.5, max_iter=2, history_size=10)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((w - 1.0) ** 4).sum()
        loss.backward()
        return loss

    for _ in range(2):  # its first step keeps no history yet
        opt.step(closure)
    live = opt.state_dict()["state"][0]
    saved = _to_cpu(live)
    history = [[t.clone() for t in live[k]] for k in ("old_dirs", "old_stps", "ro")]
    assert all(len(h) > 0 for h in history), "LBFGS kept no history to check"
    opt.step(closure)  # appends to its lists in place and changes nothing already there
    for key, before in zip(("old_dirs", "old_stps", "ro"), history):
        assert type(saved[key]) is list and saved[key] is not live[key] and len(saved[key]) == len(before), key
        assert all(t.device.type == "cpu" and torch.equal(t, b) and t.data_ptr() != l.data_ptr()
                   for t, b, l in zip(saved[key], before, live[key])), key
    one = torch.ones(1)
    copied = _to_cpu((2, [one]))  # a tuple stays a tuple, a list a list, and their tensors are copies
    assert type(copied) is tuple and copied[0] == 2 and type(copied[1]) is list and copied[1][0] is not one
