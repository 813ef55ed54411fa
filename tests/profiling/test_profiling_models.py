"""Real models someone else wrote: Lightning's demo Transformer and torchvision's ResNet-18."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F

from lightning_distplan import PipelineSpec
from lightning_distplan.demos import RandomImageData, RandomTokenData, TorchvisionClassifier
from lightning_distplan.profiling import profile_module

torch.set_num_threads(1)


def test_demo_transformer_pipeline_layers_and_no_trace() -> None:
    from lightning.pytorch.demos.transformer import LightningTransformer

    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=64)
    dm = RandomTokenData(vocab_size=64, block_size=8, batch_size=2, num_samples=16)
    dm.setup("fit")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_module(model, dm.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
    assert profile.splittable and "adapter" in profile.split_reason
    # embeddings, 2 encoder layers, encoder norm, 2 decoder layers, head
    assert len(profile.layers) == 7
    # FlopCounterMode counts matmuls/convs/attention: every attention block and the head, not the norm
    assert all(profile.layers[i].flops_forward_per_sample > 0 for i in (1, 2, 4, 5, 6))
    assert all(profile.layers[i].flops_backward_per_sample > profile.layers[i].flops_forward_per_sample for i in (1, 2, 4, 5, 6))
    assert all(l.activation_bytes_per_sample > 0 for l in profile.layers)
    # the boundary after the embeddings carries (src, tgt): 2 x 8 tokens x 200 features x 4 bytes
    assert profile.layers[0].output_bytes_per_sample == pytest.approx(2 * 8 * 200 * 4)
    assert sum(l.param_bytes for l in profile.layers) == profile.memory.param_bytes
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert model.model.pos_encoder.pe is None and model.model.src_mask is None  # lazy caches dropped


def test_resnet18_profiles_with_inplace_relu() -> None:
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = TorchvisionClassifier("resnet18", num_classes=10)
    data = RandomImageData(num_classes=10, image_size=32, batch_size=2, num_samples=8)
    profile = profile_module(model, data.train_dataloader(), micro_batch_sizes=[2, 4, 8], repeats=1)
    assert profile.splittable and len(profile.layers) == 10  # stem, 8 basic blocks, pool+fc
    assert profile.optimizer.name == "SGD" and profile.memory.optimizer_state_bytes == profile.memory.param_bytes  # momentum
    conv_flops = sum(l.flops_forward_per_sample for l in profile.layers)
    assert 30e6 < conv_flops < 120e6  # ResNet-18 at 32x32 is ~1/49 of its 1.8 GMAC at 224x224 -> ~75 MFLOP
    assert all(l.backward.alpha == l.backward.alpha for l in profile.layers)


def test_a_training_step_loss_the_pipeline_would_not_train_leaves_pipelines_out() -> None:
    """A pipeline computes the adapter's loss (plain cross-entropy for a torchvision classifier), never training_step:
    a module whose training_step adds label smoothing would train another objective under a pipeline plan. The
    profiler compares both losses on one micro-batch and marks such a profile not splittable, with the reason."""
    pytest.importorskip("torchvision")
    import torch.nn.functional as F

    class Smoothed(TorchvisionClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y, label_smoothing=0.1)

    from lightning.pytorch.plugins.precision import Precision

    data = RandomImageData(num_classes=10, image_size=32, batch_size=4, num_samples=8)
    torch.manual_seed(0)
    # as in a fit: Lightning's plain fp32 Precision plugin (the fresh model's near-uniform logits move the loss by ~7e-4)
    profile = profile_module(Smoothed("resnet18", num_classes=10), data.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1,
                             precision_plugin=Precision())
    assert not profile.splittable
    assert "the pipeline's loss (the built-in adapter's guess) is" in profile.split_reason
    assert "define pipeline_loss(output, batch)" in profile.split_reason and "cannot be split" in profile.pipeline_refusal

    class Declared(Smoothed):  # the user's own pipeline loss, the same objective: splittable again
        def pipeline_loss(self, output, batch):
            return F.cross_entropy(output, batch[1], label_smoothing=0.1)

    torch.manual_seed(0)
    profile = profile_module(Declared("resnet18", num_classes=10), data.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
    assert profile.splittable, profile.split_reason


def test_a_training_step_that_differentiates_is_compared_with_gradients_on() -> None:
    """A gradient penalty (torch.autograd.grad inside training_step) must not fail profiling: the loss comparison keeps
    gradients on, and the penalty is a term the pipeline's loss lacks, so pipelines are left out."""
    pytest.importorskip("torchvision")
    import torch.nn.functional as F

    class Penalised(TorchvisionClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            x = x.clone().requires_grad_(True)
            loss = F.cross_entropy(self.model(x), y)
            (grad,) = torch.autograd.grad(loss, x, create_graph=True)
            return loss + grad.pow(2).sum()

    data = RandomImageData(num_classes=10, image_size=32, batch_size=4, num_samples=8)
    torch.manual_seed(0)
    profile = profile_module(Penalised("resnet18", num_classes=10), data.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=1)
    assert not profile.splittable and "training_step" in profile.split_reason


def test_a_pipeline_that_cannot_run_on_the_batches_is_profiled_as_not_splittable() -> None:
    """An nn.Sequential `net` with a correct pipeline_loss but dict batches: the pipeline's chain would feed the dict to
    the first layer, which the pipeline refuses, so pipelines are left out with the pipeline's own sentence; the
    per-layer pass then runs training_step (which works), as for a module without pipeline_loss."""
    import lightning.pytorch as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    class DictPL(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch["x"]), batch["y"])

        def pipeline_loss(self, output, batch):
            return F.cross_entropy(output, batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    loader = DataLoader([{"x": torch.randn(16), "y": torch.tensor(1)} for _ in range(32)], batch_size=4)
    profile = profile_module(DictPL(), loader, micro_batch_sizes=[1, 2, 4], repeats=1)
    assert not profile.splittable
    assert profile.split_reason.startswith("`PipelineSpec.inputs(batch)` gave the first layer a dict; ")
    assert [layer.name for layer in profile.layers] == ["net.0", "net.1", "net.2"]
    assert profile.layers[0].flops_forward_per_sample > 0  # the layers were run (by training_step) and measured


class _Recurrent(L.LightningModule):
    """An LSTM classifier over sequences; ``first_inputs="packed"`` packs them by their lengths, ``"none"`` runs the
    LSTM on the padded tensor with ``hx=None`` passed by the pipeline's inputs."""

    def __init__(self, first_inputs: str) -> None:
        super().__init__()
        self.first_inputs = first_inputs
        self.lstm = torch.nn.LSTM(3, 8, batch_first=True)
        self.last = _LastHidden()
        self.head = torch.nn.Linear(8, 2)

    def packed(self, batch: Any) -> Any:
        from torch.nn.utils.rnn import pack_padded_sequence

        return pack_padded_sequence(batch[0], batch[1], batch_first=True, enforce_sorted=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.packed(batch) if self.first_inputs == "packed" else batch[0]
        return F.cross_entropy(self.head(self.last(*self.lstm(x))), batch[2])

    def pipeline_spec(self) -> PipelineSpec:
        inputs = self.packed if self.first_inputs == "packed" else (lambda batch: (batch[0], None))
        return PipelineSpec(layers=[self.lstm, self.last, self.head], inputs=inputs, loss=lambda out, batch: F.cross_entropy(out, batch[2]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _LastHidden(torch.nn.Module):
    def forward(self, output: Any, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return state[0][-1]


@pytest.mark.parametrize(("first_inputs", "given"), [("packed", "a PackedSequence"), ("none", "None")])
def test_first_layer_inputs_the_pipeline_refuses_are_profiled_as_not_splittable_in_its_words(first_inputs: str, given: str) -> None:
    """The profiler's chain unpacked a PackedSequence from PipelineSpec.inputs into four positional arguments of
    nn.LSTM, so the profile was not splittable for "comparing the pipeline's loss with training_step's in eval mode
    failed (TypeError: LSTM.forward() takes from 2 to 3 positional arguments but 5 were given) ... define
    pipeline_loss(output, batch)", a fix that does not help; (x, None) into a layer that takes an optional argument
    profiled as splittable, while the pipeline refused it at the first step. Now the chain keeps the pipeline's rule for
    the first layer's inputs and the reason is the pipeline's sentence."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    data = [(torch.randn(5, 3), torch.tensor(1 + i % 5), torch.tensor(i % 2)) for i in range(16)]
    profile = profile_module(_Recurrent(first_inputs), DataLoader(data, batch_size=4), micro_batch_sizes=[2, 4], repeats=1)
    assert not profile.splittable
    assert profile.split_reason.startswith(f"`PipelineSpec.inputs(batch)` gave the first layer {given}; ")
    assert "HINT: " in profile.split_reason
    assert [layer.name for layer in profile.layers][:1] == ["lstm"]  # training_step ran the per-layer pass
    assert profile.layers[0].forward.alpha > 0 or profile.layers[0].forward.beta > 0


class _PassesItsMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.linear(x), mask


class _Masked(torch.nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return h.relu() if mask is None else h.relu() * mask


class _OptionalMask(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_PassesItsMask(), _Masked(), torch.nn.Linear(16, 3)])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.layers), inputs=lambda b: b[0], loss=lambda out, b: F.cross_entropy(out, b[1]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, masked, head = self.layers
        return F.cross_entropy(head(masked(*first(batch[0]))), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_layer_output_that_cannot_cross_a_stage_is_profiled_as_not_splittable() -> None:
    """A layer returning (h, None), its optional mask passed along: the chain ran in one process and the profile was
    splittable, while a pipeline cut after that layer failed in torch's runtime ("Stage arg[1] is None") on one stage
    and with "Connection closed by peer" on the other. A plan may cut after any layer, so the profile is now not
    splittable, with the sentence the pipeline refuses such a cut with."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    data = [(torch.randn(4), torch.tensor(i % 3)) for i in range(16)]
    profile = profile_module(_OptionalMask(), DataLoader(data, batch_size=4), micro_batch_sizes=[2, 4], repeats=1)
    assert not profile.splittable
    assert profile.split_reason.startswith(
        "PipelineSpec.layers[0] (_PassesItsMask) returned a tuple holding None; only tensors cross between pipeline stages"
    ), profile.split_reason
    assert "HINT: " in profile.split_reason


class _DictEmbed(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"hidden": super().forward(x), "scale": (x[:, :1] > 0).float() + 1}


class _DictBlock(torch.nn.Module):
    def forward(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        return out["hidden"].relu() * out["scale"]


class _DictBetween(_OptionalMask):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_DictEmbed(4, 16), _DictBlock(), torch.nn.Linear(16, 3)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, block, head = self.layers
        return F.cross_entropy(head(block(first(batch[0]))), batch[1])


def test_a_dict_of_tensors_a_layer_passes_on_is_profiled_as_splittable_with_its_tensors_bytes() -> None:
    """A layer returning {"hidden": h, "scale": s}: the profile was not splittable ("returned a dict; only tensors cross
    between pipeline stages"), as the pipeline refused a cut after it. Its tensors cross a stage boundary now, so the
    profile is splittable, and what a cut after the layer sends is its output bytes: both tensors' (16 + 1 floats)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    data = [(torch.randn(4), torch.tensor(i % 3)) for i in range(16)]
    profile = profile_module(_DictBetween(), DataLoader(data, batch_size=4), micro_batch_sizes=[2, 4], repeats=1)
    assert profile.splittable, profile.split_reason
    assert profile.layers[0].output_bytes_per_sample == pytest.approx((16 + 1) * 4)


class _Frozen(Mapping):
    """A read-only mapping that is no dict (built from its items, as the pipeline builds a mapping again)."""

    def __init__(self, items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _FrozenEmbed(_DictEmbed):
    def forward(self, x: torch.Tensor) -> _Frozen:  # type: ignore[override]
        return _Frozen(super().forward(x).items())


def test_a_mapping_that_is_no_dict_is_profiled_with_its_tensors_bytes() -> None:
    """The same layer returning its tensors in a Mapping that is no dict subclass: the pipeline sends its tensors across
    a cut after it as a dict's, but the recorder looked only inside dicts, so the layer's output counted 0 bytes (a cut
    after it predicted free) and its tensors got no backward hook. Now it counts both tensors, as the dict's."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    data = [(torch.randn(4), torch.tensor(i % 3)) for i in range(16)]
    model = _DictBetween()
    model.layers[0] = _FrozenEmbed(4, 16)
    profile = profile_module(model, DataLoader(data, batch_size=4), micro_batch_sizes=[2, 4], repeats=1)
    assert profile.splittable, profile.split_reason
    assert profile.layers[0].output_bytes_per_sample == pytest.approx((16 + 1) * 4)
