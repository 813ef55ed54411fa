"""The training loop's own cost, measured with a real tiny Trainer.fit (FrameworkProfile)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_distplan.profile import FrameworkProfile
from lightning_distplan.profiling._overhead import measure_framework_overhead


def test_measures_a_positive_loop_cost_and_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    # as inside a torchrun rank: the nested fit must still run as one plain process and give the variables back
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    got = measure_framework_overhead()
    assert torch.equal(torch.rand(3), expected)  # the RNG stream is where it was
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] == "1"
    assert got.source.startswith("tiny Trainer.fit")
    # Lightning's loop costs something per batch, and far less than a second on any host that runs this suite
    assert 0 < got.per_batch_s < 0.5
    assert 0 <= got.per_step_s < 0.5


def test_profile_module_records_it_and_can_skip_it() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distplan.profiling import profile_module

    model = BoringModel()
    on = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
    assert on.framework.per_batch_s > 0 and on.framework.source
    off = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert off.framework == FrameworkProfile()


def test_tied_weights_are_recorded_once_with_every_layer_that_uses_them() -> None:
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule
    from torch import nn

    from lightning_distplan.profile import SharedParameters
    from lightning_distplan.profiling import profile_module

    class Tied(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8))
            self.net[3].weight = self.net[0].weight  # first and last layer share a weight, as GPT-2's embedding/head do

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]
    profile = profile_module(Tied(), batches, micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    names = [layer.name for layer in profile.layers]
    first, last = names.index("net.0"), names.index("net.3")
    assert profile.shared_parameters == (SharedParameters(layers=(first, last), param_bytes=8 * 8 * 4),)
    assert sum(layer.param_bytes for layer in profile.layers) == profile.memory.param_bytes  # counted once


def test_profile_records_the_repeat_to_repeat_spread() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distplan.profile import Profile
    from lightning_distplan.profiling import profile_module

    model = BoringModel()
    profile = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=3, loop_overhead=False)
    # three timed repeats per size never take exactly the same time on a real clock
    assert 0 < profile.step.spread < 5
    assert Profile.from_dict(profile.to_dict()).step.spread == profile.step.spread
    single = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False, min_timed_s=0)
    assert single.step.spread == 0.0  # exactly one repeat: no spread to measure
    short = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1, loop_overhead=False)
    assert short.step.spread > 0  # a BoringModel step is far below 0.25 s: repeat-until-0.25 s gave it several runs
