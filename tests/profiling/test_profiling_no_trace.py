"""Profiling leaves no trace (DESIGN §3.3): weights, buffers, grads, optimizer state, flags, caches, RNG."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _profiling_models import OOMAbove  # noqa: E402

from lightning_distplan.profiling import profile_module  # noqa: E402

torch.set_num_threads(1)


class Stateful(LightningModule):
    """Dropout (uses the RNG), BatchNorm (buffers change in train mode), a frozen layer, a lazy cache."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.3)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(12, 3)
        self.cache = None  # built lazily in forward, like the demo Transformer's positional encoding

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.ones(12)
        return self.head(self.frozen(self.drop(torch.relu(self.bn(self.inp(x))))) * self.cache)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "training": {k: m.training for k, m in model.named_modules()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
        "opt": copy.deepcopy(opt.state_dict()),  # state_dict() holds live tensors
        "attrs": {k: dict(vars(m)).keys() for k, m in model.named_modules()},
    }


def _opt_state_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


@pytest.mark.parametrize("with_history", [False, True])
def test_profiling_leaves_no_trace(with_history: bool) -> None:
    torch.manual_seed(1)
    model = Stateful()
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if with_history:  # mid-training: optimizer state exists, some grads are set, one submodule in eval
        loss = model.training_step(data[0], 0)
        loss.backward()
        opt.step()
        model.head.weight.grad = torch.randn_like(model.head.weight)
        model.inp.weight.grad = None
        model.drop.eval()
    model.cache = None
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    before = _state(model, opt)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    ids = {k: id(v) for k, v in model.named_parameters()}

    profile = profile_module(model, data, micro_batch_sizes=[1, 2, 4, 8], repeats=1, optimizer=opt)
    assert profile.optimizer.name == "AdamW"
    assert profile.micro_batch_sizes == (2, 4, 8)  # BatchNorm rejects one sample: skipped, not "out of memory"
    assert profile.infeasible_micro_batch_sizes == ()

    after = _state(model, opt)
    for group in ("params", "buffers"):
        assert before[group].keys() == after[group].keys()
        for k in before[group]:
            assert torch.equal(before[group][k], after[group][k]), (group, k)
    for k, g in before["grads"].items():
        assert (g is None) == (after["grads"][k] is None), k
        if g is not None:
            assert torch.equal(g, after["grads"][k]), k
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]
    assert before["attrs"] == after["attrs"] and model.cache is None
    _opt_state_equal(before["opt"], after["opt"])
    if not with_history:
        assert len(opt.state) == 0
    assert {k: id(v) for k, v in model.named_parameters()} == ids  # same Parameter objects
    assert "log" not in vars(model) and "log_dict" not in vars(model)
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    np_after = np.random.get_state()
    assert np_after[0] == rng[2][0] and np.array_equal(np_after[1], rng[2][1]) and np_after[2:] == rng[2][2:]


def test_no_trace_after_oom_and_after_error() -> None:
    model = OOMAbove(limit=2)
    data = [(torch.randn(4, 4), torch.randn(4, 1))]
    bad = [(torch.randn(4, 4), "not a target")]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile_module(model, data, micro_batch_sizes=[1, 2, 4], repeats=1)
    with pytest.raises(ValueError, match="failed in its training step with AttributeError.*HINT"):
        profile_module(model, bad, micro_batch_sizes=[1], repeats=1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_what_training_step_collects_in_plain_attributes_is_put_back() -> None:
    """training_step runs hundreds of times while profiling: what it appends to a list (Lightning's
    ``self.training_step_outputs`` pattern), a dict of lists, a counter, a tensor updated in place, a torchmetrics
    metric or a new attribute must not survive into the user's first epoch."""
    import torchmetrics

    class Collecting(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.training_step_outputs = [torch.tensor(7.0)]
            self.per_key = {"train": [1], "seen": set()}
            self.steps = 0
            self.running = torch.zeros(3)
            self.mse = torchmetrics.MeanSquaredError()

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.layer(x)
            loss = F.mse_loss(out, y)
            self.training_step_outputs.append(loss.detach())
            self.per_key["train"].append(len(x))
            self.per_key["seen"].add(len(x))
            self.steps += 1
            self.running += 1
            self.mse.update(out.detach(), y)
            self.first_loss = getattr(self, "first_loss", loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = Collecting()
    outputs, per_key, running = model.training_step_outputs, model.per_key, model.running
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    profile_module(model, data, micro_batch_sizes=[2, 4, 8], repeats=1)
    assert model.training_step_outputs is outputs and len(outputs) == 1 and outputs[0].item() == 7.0
    assert model.per_key is per_key and per_key == {"train": [1], "seen": set()}
    assert model.steps == 0 and model.running is running and torch.equal(running, torch.zeros(3))
    assert int(model.mse.total) == 0 and model.mse._update_count == 0
    assert not hasattr(model, "first_loss")


def test_restoring_attributes_keeps_odd_containers_and_modules_built_during_profiling() -> None:
    """A Counter is put back with its counts (Counter.update would count pairs), a dict subclass that refuses update
    (Hugging Face's ModelOutput) does not break the restore, and a placeholder that became a sub-module while
    profiling (self.head = None, built on the first batch) stays that module, not None beside its parameters."""
    from collections import Counter

    class Refuses(dict):
        def update(self, *args, **kwargs):
            raise RuntimeError("you cannot use update on this instance")

    class Odd(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = None
            self.labels = Counter({"cat": 10, "dog": 5})
            self.last = Refuses(a=1)

        def training_step(self, batch, batch_idx):
            if self.head is None:
                self.head = nn.Linear(4, 1)
            self.labels["cat"] += 1
            return F.mse_loss(self.head(self.body(batch[0])), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Odd()
    data = [(torch.randn(8, 4), torch.randn(8, 1))]
    rng = torch.get_rng_state()
    profile_module(model, data, micro_batch_sizes=[2, 4, 8], repeats=1)
    assert model.labels == Counter({"cat": 10, "dog": 5}) and model.last == {"a": 1}
    assert isinstance(model.head, nn.Linear) and "head" not in vars(model) and "head.weight" in model.state_dict()
    assert torch.equal(torch.get_rng_state(), rng)



def test_registered_buffers_that_training_step_reassigns_are_put_back() -> None:
    """A registered buffer re-assigned in training_step with another shape (the last batch's logits), one registered
    as None and filled lazily (a mask cache) and one registered during profiling go back to what they were. The
    restore copied saved values into the buffers in place: the first raised a shape mismatch from profile_module's
    cleanup, after which the module stayed in train mode and the RNG streams were not restored."""

    class Reassigns(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.register_buffer("last_logits", torch.zeros(0, 2))
            self.register_buffer("mask", None, persistent=False)
            self.norm = nn.Identity()

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.layer(x)
            self.last_logits = out.detach()
            if self.mask is None:
                self.mask = torch.ones(2)
            if "seen" not in self._buffers:
                self.register_buffer("seen", torch.zeros(1))
            if isinstance(self.norm, nn.Identity):  # a sub-module swapped for another: its own buffers stay its own
                self.norm = nn.BatchNorm1d(2)
            return F.cross_entropy(self.norm(out * self.mask), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = Reassigns().eval()
    last = model.last_logits
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    rng = torch.get_rng_state()
    profile_module(model, data, micro_batch_sizes=[2, 4, 8], repeats=1, min_timed_s=0, loop_overhead=False)
    assert model.last_logits.shape == (0, 2) and model.last_logits.device == last.device
    assert model.mask is None and "mask" in model._buffers and "seen" not in model._buffers
    assert isinstance(model.norm, nn.BatchNorm1d) and model.norm.running_mean.shape == (2,)
    # its plain attributes too (restored by name they were deleted: "'BatchNorm1d' object has no attribute 'momentum'")
    assert model.norm.momentum == 0.1 and model.norm.eps == 1e-5 and model.norm.num_features == 2
    model.train()
    model.training_step(data[0], 0)
    model.eval()
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_optimizer_whose_step_needs_a_closure_is_profiled_and_leaves_no_trace() -> None:
    """LBFGS's step() takes the closure Lightning hands it (training_step and backward, run again inside the step).
    The profiler called step() without one: a TypeError, reported as a failure of training_step."""

    class LBFGSModel(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)

    torch.manual_seed(0)
    model = LBFGSModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [(torch.randn(8, 2), torch.randn(8, 1))]
    rng = torch.get_rng_state()
    profile = profile_module(model, data, micro_batch_sizes=[2, 4, 8], repeats=1, min_timed_s=0, loop_overhead=False)
    assert profile.optimizer.name == "LBFGS" and profile.optimizer.step_time_s > 0 and profile.optimizer.state_bytes > 0
    # its history (old_dirs, old_stps: lists of flat-parameter copies, history_size=100 pairs in a fit) is state: the
    # profile counted only the tensors directly in the state dict, 524 bytes for 132 bytes of weights
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.optimizer.state_bytes >= 2 * 100 * param_bytes, (profile.optimizer.state_bytes, param_bytes)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.steps == 0 and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_random_generators_the_module_owns_are_put_back() -> None:
    """A torch.Generator, a NumPy Generator and RandomState, and a random.Random held by the module (a diffusion model's
    timestep sampler, an augmentation in training_step) drew hundreds of times while profiling and kept that state:
    the fit's first draws were not an unprofiled fit's."""

    class OwnStreams(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)
            self.gen = torch.Generator().manual_seed(7)
            self.np_rng = np.random.default_rng(7)
            self.streams = {"legacy": np.random.RandomState(7), "python": random.Random(7)}
            # a random.Random without state: its getstate() raises NotImplementedError, which the snapshot raised
            # out of profile_module; it is kept by identity
            self.entropy = random.SystemRandom()

        def training_step(self, batch, batch_idx):
            x, y = batch
            t = torch.randint(0, 10, (len(x),), generator=self.gen)
            scale = float(self.np_rng.uniform()) + self.streams["legacy"].rand() + self.streams["python"].random()
            return F.cross_entropy(self.layer(x * scale) + 0 * t[:, None], y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model, fresh = OwnStreams(), OwnStreams()
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    profile_module(model, data, micro_batch_sizes=[2, 4, 8], repeats=1, min_timed_s=0, loop_overhead=False)
    assert torch.equal(model.gen.get_state(), fresh.gen.get_state())
    assert model.np_rng.bit_generator.state == fresh.np_rng.bit_generator.state
    assert model.streams["legacy"].rand() == fresh.streams["legacy"].rand()
    assert model.streams["python"].getstate() == fresh.streams["python"].getstate()
    assert isinstance(model.entropy, random.SystemRandom)

def test_token_ids_beyond_the_vocabulary_are_named_in_the_hint() -> None:
    """The package's TinyGPT2LM (vocab 4096) on RandomTokenData (vocab 33278) failed with torch's bare
    'index out of range in self'."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Embeds(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Embedding(8, 2))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.layer(batch).sum()

    with pytest.raises(ValueError, match=r"with IndexError: index out of range in self\. HINT: If an embedding met an id beyond its table, "
                                         r"make the model's vocabulary"):
        profile_module(Embeds(), [torch.tensor([9, 10])], micro_batch_sizes=[1], repeats=1)
