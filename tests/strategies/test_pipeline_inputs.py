"""Bad input raises one clear sentence with a HINT; built-in adapters reproduce the models' own loss."""

from __future__ import annotations


import os
import warnings
from typing import Any
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _pipeline_models import build, token_data  # noqa: E402

from lightning_distplan._layers import discover_layers  # noqa: E402
from lightning_distplan.errors import BatchNotFactorableError, InfeasiblePlanError, ModelSplitError  # noqa: E402
from lightning_distplan.strategies._pipeline_split import (  # noqa: E402
    PipelineLayout,
    StageModule,
    no_spec_error,
    resolve_boundaries,
    split_microbatches,
)
from lightning_distplan.strategies.auto_plan import AutoPlanStrategy  # noqa: E402
from lightning_distplan.strategies.pipeline import PipelineStrategy  # noqa: E402


def test_pipeline_1f1b_needs_enough_microbatches() -> None:
    with pytest.raises(InfeasiblePlanError, match=r"`n_microbatches` \(2\) must be >= the number of pipeline stages \(4\) for 1F1B.*HINT"):
        PipelineStrategy(schedule="1f1b", n_microbatches=2, stages=4)
    PipelineStrategy(schedule="gpipe", n_microbatches=2, stages=4)  # GPipe has no such rule


@pytest.mark.parametrize("boundaries", [[2.5], [True], [3, 1], "x", [0]])
def test_pipeline_stage_boundaries_that_are_no_layer_indices_are_refused_at_construction(boundaries: Any) -> None:
    with pytest.raises(InfeasiblePlanError, match=r"^`stage_boundaries` must be increasing positive layer indices or 'auto'.*HINT"):
        PipelineStrategy(stages=2, stage_boundaries=boundaries)


@pytest.mark.parametrize("flag", ["no", 0, None])
def test_pipeline_deferred_batchnorm_must_be_a_bool(flag: Any) -> None:
    """As AutoPlanStrategy's: the string "no" is true and swapped the user's BatchNorm layers for DeferredBatchNorm."""
    with pytest.raises(InfeasiblePlanError, match=rf"^`deferred_batchnorm` must be True or False, got {flag!r}\. HINT: Pass deferred_batchnorm=True\.$"):
        PipelineStrategy(stages=2, deferred_batchnorm=flag)
    assert PipelineStrategy(stages=2, deferred_batchnorm=False)._deferred_batchnorm is False


def test_a_plan_that_is_no_plan_object_is_refused_with_a_hint() -> None:
    """What plan.json holds (a dict) or its path: an AttributeError ('dict' object has no attribute 'strategy'), as
    DPGAStrategy raised before 4fa0303."""
    from lightning_distplan import Plan

    pipe = Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=4, n_microbatches=8, global_batch_size=32)
    for not_a_plan in (pipe.to_dict(), "runs/distplan/plan.json"):
        with pytest.raises(InfeasiblePlanError, match=r"PipelineStrategy\(plan=\.\.\.\) takes a lightning_distplan.Plan, got a (dict|str).*HINT: .*Plan.from_json"):
            PipelineStrategy(plan=not_a_plan)  # type: ignore[arg-type]
    PipelineStrategy(plan=pipe)  # a Plan still runs


def test_numpy_stage_boundaries_are_layer_indices() -> None:
    np = pytest.importorskip("numpy")
    assert PipelineStrategy(stages=3, stage_boundaries=np.array([1, 2]))._boundaries_arg == (1, 2)
    assert AutoPlanStrategy(stage_boundaries=np.array([1, 2])).pins["stage_boundaries"] == (1, 2)


def test_pipeline_more_stages_than_layers() -> None:
    layers = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ModelSplitError, match=r"Cannot split 3 layers into 4 pipeline stages.*HINT"):
        resolve_boundaries("auto", stages=4, layers=layers)
    with pytest.raises(InfeasiblePlanError, match=r"strictly increasing.*HINT"):
        resolve_boundaries([2, 1], stages=3, layers=layers)
    assert resolve_boundaries("auto", stages=3, layers=layers) == (1, 2)
    with pytest.raises(ModelSplitError, match=r"Cannot split 1 layer into 2 .*HINT: Use at most 1 stage, or"):
        resolve_boundaries("auto", stages=2, layers=layers[:1])


def test_pipeline_batch_not_divisible() -> None:
    with pytest.raises(BatchNotFactorableError, match=r"per-replica batch \(10\) is not divisible by `n_microbatches` \(4\).*HINT"):
        split_microbatches(torch.zeros(10, 3), 4)
    assert [t[0].shape[0] for t in split_microbatches(torch.zeros(12, 3), 4)] == [3, 3, 3, 3]


def test_pipeline_world_not_divisible_by_stages() -> None:
    with pytest.raises(InfeasiblePlanError, match=r"world size \(3\) is not divisible by the number of pipeline stages \(2\).*HINT"):
        PipelineLayout.of(world_size=3, stages=2, rank=0)
    layout = PipelineLayout.of(world_size=4, stages=2, rank=3)
    assert (layout.replica, layout.stage, layout.pipeline_ranks(1), layout.stage_ranks(1)) == (1, 1, [2, 3], [1, 3])


def test_pipeline_unsplittable_model_says_what_to_add() -> None:
    import lightning as L

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    found = discover_layers(Plain())
    assert found.spec is None
    err = no_spec_error(found.split_reason)
    assert isinstance(err, ValueError) and "HINT" in str(err) and "def pipeline_spec(self)" in str(err)


def _chain_loss(module: nn.Module, batch) -> torch.Tensor:
    spec = discover_layers(module).spec
    assert spec is not None
    inputs = spec.inputs(batch)
    out = StageModule(spec.layers)(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    return spec.loss(out, spec.targets(batch) if spec.targets else batch)


def test_pipeline_adapters_reproduce_model_loss() -> None:
    import lightning as L
    import torch.nn.functional as F
    import torchvision
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    batch = next(iter(torch.utils.data.DataLoader(token_data(), batch_size=4)))
    for name in ("transformer", "gpt2"):
        model = build(name)
        torch.testing.assert_close(_chain_loss(model, batch), model.training_step(batch, 0))

    class Vision(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    for net in (torchvision.models.resnet18(num_classes=5), torchvision.models.mobilenet_v2(num_classes=5)):
        net.eval()  # batch statistics aside, the chain must compute the same function
        torch.testing.assert_close(_chain_loss(Vision(net), (x, y)), F.cross_entropy(net(x), y))

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16)
    ids = torch.randint(0, 64, (2, 8))
    mlm = BertForMaskedLM(cfg)
    labels = torch.where(torch.rand(2, 8) < 0.5, ids, torch.full_like(ids, -100))
    torch.testing.assert_close(_chain_loss(mlm, {"input_ids": ids, "labels": labels}), mlm(input_ids=ids, labels=labels).loss)
    cls = BertForSequenceClassification(BertConfig(**{**cfg.to_dict(), "num_labels": 3}))
    lab = torch.tensor([0, 2])
    torch.testing.assert_close(_chain_loss(cls, {"input_ids": ids, "labels": lab}), cls(input_ids=ids, labels=lab).loss)

    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    class Reg(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = seq

        def pipeline_loss(self, out, batch):
            return F.mse_loss(out, batch[1])

    xb, yb = torch.randn(4, 4), torch.randn(4, 1)
    torch.testing.assert_close(_chain_loss(Reg(), (xb, yb)), F.mse_loss(seq(xb), yb))


def test_hugging_face_regression_splits_with_pipeline_loss_and_near_misses_are_named() -> None:
    """A regression / multi-label BERT classifier has no loss the adapter can guess: with `pipeline_loss` it splits (it was
    skipped even then), without it the reason says so; a known network under another attribute name is named as such; a
    padded batch is warned about once (the adapter passes input_ids only)."""
    import lightning as L
    import torch.nn.functional as F
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from lightning_distplan._layers import find_pipeline_spec
    from lightning_distplan.strategies import _adapters

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16, num_labels=1)

    class Reg(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = BertForSequenceClassification(cfg)

    class RegWithLoss(Reg):
        def pipeline_loss(self, out, batch):
            return F.mse_loss(out.squeeze(-1), batch["labels"])

    ids, target = torch.randint(0, 64, (2, 8)), torch.randn(2)
    reg = RegWithLoss()
    torch.testing.assert_close(_chain_loss(reg, {"input_ids": ids, "labels": target}), reg.model(input_ids=ids, labels=target).loss)
    spec, reason = find_pipeline_spec(Reg())
    assert spec is None and "BertForSequenceClassification for regression (num_labels=1)" in reason and "`pipeline_loss(output, batch)`" in reason

    class Renamed(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2))

    spec, reason = find_pipeline_spec(Renamed())
    assert spec is None and "holds a GPT2LMHeadModel as `gpt2`" in reason and "model, net, network, backbone, module" in reason

    _adapters._padding_check.looked = 0
    with pytest.warns(UserWarning, match="attention_mask holds padding, which the pipeline does not see"):
        _adapters._hf_inputs({"input_ids": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, and only the first few batches are looked at
        _adapters._hf_inputs({"input_ids": ids, "attention_mask": torch.zeros(2, 8)})


def test_pipeline_wrapped_layers_have_readable_names() -> None:
    import lightning as L
    import torchvision

    names = discover_layers(build("transformer")).names
    assert names == (
        "model.embedding+pos_encoder",
        "model.transformer.encoder.layers.0",
        "model.transformer.encoder.layers.1",
        "model.transformer.encoder.norm",
        "model.transformer.decoder.layers.0",
        "model.transformer.decoder.layers.1",
        "model.transformer.decoder.norm+model.decoder",
    )
    assert discover_layers(build("gpt2")).names == (
        "model.transformer.wte+wpe+drop", "model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f+model.lm_head")

    class Vision(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

    resnet = discover_layers(Vision(torchvision.models.resnet18(num_classes=5))).names
    assert (resnet[0], resnet[1], resnet[-1]) == ("net.conv1+bn1+relu+maxpool", "net.layer1.0", "net.avgpool+fc")

    # A user's own wrapper: its `distplan_name` wins; duplicates are made unique.
    class Named(nn.Module):
        distplan_name = "my.block"

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class User(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def pipeline_spec(self):
            from lightning_distplan import PipelineSpec

            return PipelineSpec(layers=[Named(self.a), Named(self.b), self.a], inputs=lambda b: b, loss=lambda o, b: o.sum())

    assert discover_layers(User()).names == ("my.block", "my.block#1", "a")


def test_hf_batch_without_labels_is_a_batch_format_error() -> None:
    from lightning_distplan.errors import BatchFormatError
    from lightning_distplan.strategies._adapters import _hf_labels

    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(BatchFormatError, match=r"^The batch has no 'labels' \(keys: \['input_ids'\]\)\. HINT: Add 'labels'"):
        _hf_labels({"input_ids": ids}, default_to_inputs=False)
    with pytest.raises(BatchFormatError, match=r"^The batch is a Tensor, which carries no labels\. HINT: Use \(input_ids, labels\)"):
        _hf_labels(ids, default_to_inputs=False)
    with pytest.raises(KeyError):  # the built-ins they were before still catch them
        _hf_labels({"input_ids": ids}, default_to_inputs=False)
    with pytest.raises(TypeError):
        _hf_labels(ids, default_to_inputs=False)
    assert _hf_labels({"input_ids": ids}, default_to_inputs=True) is ids


def test_pipeline_refuses_manual_optimization(tmp_path) -> None:
    """The schedule replaces training_step, so manual backward/step would never run (and max_steps never reached)."""
    import lightning as L
    from _auto_plan_models import ChainMLP, trainer_kwargs

    class Manual(ChainMLP):
        def __init__(self) -> None:
            super().__init__(width=8, depth=3, n_samples=16, loader_batch=4)
            self.automatic_optimization = False

    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy=PipelineStrategy(stages=2, n_microbatches=2), devices=1, max_steps=2))
    try:
        with pytest.raises(InfeasiblePlanError, match=r"Manual uses manual optimization .* would never run.*HINT: Use automatic optimization"):
            trainer.fit(Manual())
    finally:  # the 1-process group the fit started (and its port) must not outlive this test
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_one_device_pipeline_is_refused_before_training(tmp_path) -> None:
    """strategy='gpipe' with stages='auto' on one device is a one-stage "pipeline": it trained a whole epoch and then every
    checkpoint save failed (a pipeline plan needs 2 stages); it is refused before the first step."""
    import lightning as L
    from _auto_plan_models import ChainMLP, trainer_kwargs

    model = ChainMLP(width=8, depth=3, n_samples=16, loader_batch=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(**trainer_kwargs(str(tmp_path), strategy="gpipe", devices=1, max_steps=2))
    try:
        with pytest.raises(InfeasiblePlanError, match=r"gpipe pipeline needs at least 2 stages, but stages='auto' gives 1 .*HINT: Train on 2 or more"):
            trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 0
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_the_last_stage_passes_a_dicts_tensors_and_the_loss_gets_the_dict_again() -> None:
    """torch's runtime takes only a tensor or a tuple of tensors from the last stage (its shape inference refused a dict):
    the last stage returns a mapping's values in key order, and the strategy's loss (and predict) gets the mapping built
    again, of its own type (a Hugging Face ModelOutput too). Other keys at a later micro-batch, a nested value or a None
    are refused in one sentence."""
    SequenceClassifierOutput = pytest.importorskip("transformers.modeling_outputs").SequenceClassifierOutput

    from lightning_distplan._layers import MappingOutput, PipelineSpec

    class Head(nn.Linear):
        def __init__(self, kind: type = dict) -> None:
            super().__init__(2, 3)
            self.kind = kind

        def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
            return self.kind(logits=super().forward(h), hidden_states=h)

    torch.manual_seed(0)
    for kind in (dict, SequenceClassifierOutput):
        stage = StageModule([nn.Linear(2, 2), Head(kind)], start=3, last=True)
        x = torch.randn(4, 2)
        out = stage(x)
        assert isinstance(out, tuple) and stage.output_form == MappingOutput(kind, ("logits", "hidden_states"))
        strategy = PipelineStrategy(stages=2)
        strategy._stage_module = stage
        strategy._spec = PipelineSpec(layers=list(stage.blocks), inputs=lambda b: b[0],
                                      loss=lambda out, batch: F.cross_entropy(out["logits"], batch[1]) if type(out) is kind else None)
        y = torch.tensor([0, 1, 2, 0])
        strategy._targets = [(x, y)]
        expected = F.cross_entropy(stage.blocks[1](stage.blocks[0](x))["logits"], y)
        torch.testing.assert_close(strategy._loss_fn(out, torch.tensor([0])), expected)
    with pytest.raises(ModelSplitError, match=r"last layer returned a dict with keys \['logits'\] where it returned a dict with keys \['logits', 'hidden_states'\] before.*HINT"):
        MappingOutput(dict, ("logits", "hidden_states")).flatten({"logits": x})
    nested = SequenceClassifierOutput(logits=x, hidden_states=(x, x))
    with pytest.raises(ModelSplitError, match=r"layers\[5\] \(Head\), the last layer, returned an object of type SequenceClassifierOutput holding a tuple under 'hidden_states'; .*HINT: Return only the tensors the loss needs"):
        MappingOutput.of(nested, 5, Head())
    with pytest.raises(ModelSplitError, match=r"returned a dict holding None under 'mask'; .*HINT"):
        StageModule([nn.Identity(), _MaskOut()], last=True)(x)


class _MaskOut(nn.Module):
    def forward(self, h: torch.Tensor) -> dict[str, Any]:
        return {"logits": h, "mask": None}


class _Embed(nn.Linear):
    """Returns the hidden state and a per-sample scale (an integer tensor, no gradient) as ``kind(hidden=, scale=)``;
    ``scale="none"``: None for it, ``"tuple"``: in a tuple, ``"gone"``: the key left out."""

    def __init__(self, kind: type = dict, scale: str = "tensor") -> None:
        super().__init__(4, 4)
        self.kind, self.scale = kind, scale

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        h = super().forward(x)
        scale = (x[:, :1] > 0).long() + 1
        if self.scale == "gone":
            return self.kind(hidden=h)
        return self.kind(hidden=h, scale={"none": None, "tuple": (scale,)}.get(self.scale, scale))


class _Scaled(nn.Linear):
    def forward(self, out: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(out["hidden"] * out["scale"])


def test_a_dict_crossing_a_stage_boundary_reaches_the_next_stages_first_layer_again() -> None:
    """A layer returning {"hidden": h, "scale": s} where a stage ends (Hugging Face style blocks; a ModelOutput too) was
    refused: only tensors cross torch's runtime. The check before the cut (chain_output) now records its form, the
    sending stage returns its tensors in key order, and the receiving stage builds the same mapping, its type too, for
    its first layer: the stages compute what one process does. A None or a tuple among the values, or other keys at a
    later micro-batch, are refused in one sentence naming the layer."""
    from dataclasses import dataclass

    from lightning_distplan._layers import MappingOutput, PipelineSpec, chain_output

    ModelOutput = pytest.importorskip("transformers.utils").ModelOutput

    @dataclass
    class BlockOutput(ModelOutput):
        hidden: torch.Tensor | None = None
        scale: torch.Tensor | None = None

    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    for kind in (dict, BlockOutput):
        embed, head = _Embed(kind), _Scaled(4, 3)
        spec = PipelineSpec(layers=[embed, head], inputs=lambda b: b[0], loss=lambda out, b: F.cross_entropy(out, b[1]))
        forms: dict[int, MappingOutput] = {}
        expected = F.cross_entropy(head(embed(x)), y)
        torch.testing.assert_close(chain_output(spec, (x, y), cuts=(1, 2), forms=forms), expected)
        assert forms == {1: MappingOutput(kind, ("hidden", "scale"))}
        sent = StageModule([embed], output_form=forms[1])(x)
        assert isinstance(sent, tuple) and [t.dtype for t in sent] == [torch.float32, torch.long]
        got = StageModule([head], start=1, last=True, input_form=forms[1])(*sent)
        torch.testing.assert_close(got, head(embed(x)))
        with pytest.raises(ModelSplitError, match=r"layers\[0\] \(_Embed\) returned .* with keys \['hidden'\] where it returned .* with keys \['hidden', 'scale'\] before.*HINT: Return the same keys"):
            StageModule([_Embed(kind, "gone")], output_form=forms[1])(x)
    for scale, found in (("none", "None"), ("tuple", "a tuple")):
        spec = PipelineSpec(layers=[_Embed(dict, scale), _Scaled(4, 3)], inputs=lambda b: b[0], loss=lambda out, b: out.mean())
        with pytest.raises(ModelSplitError, match=rf"^PipelineSpec.layers\[0\] \(_Embed\) returned a dict holding {found} under 'scale'; only tensors "
                           r"cross between pipeline stages, so the pipeline passes a mapping's tensors and builds it again for the next "
                           r"stage's first layer.*HINT: Return only the tensors the next layer takes, as a flat dict"):
            chain_output(spec, (x, y), cuts=(1, 2))


def test_pipeline_spec_contract_breaks_are_named() -> None:
    """A layer returning a dict, or a loss that is not a scalar: one sentence naming the spec, not torch's internals."""
    from lightning_distplan._layers import PipelineSpec
    from lightning_distplan.errors import BatchFormatError

    class DictOut(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"hidden": x}

    class FromDict(nn.Module):
        def forward(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
            return out["hidden"] * 2

    # a dict crosses a stage boundary by the keys the check before the cut saw (input_form / output_form); without them
    with pytest.raises(ModelSplitError, match=r"layers\[4\] \(DictOut\) returned a dict at a stage boundary where the check before the cut saw none.*HINT: .*"
                       r"where the check cannot run .* return a tuple of tensors, which crosses without keys"):
        StageModule([nn.Linear(2, 2), DictOut()], start=3)(torch.zeros(3, 2))
    class NoneOut(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    with pytest.raises(ModelSplitError, match=r"layers\[1\] \(NoneOut\), the last layer, returned None; .*or a dict of tensors.*HINT: Return the tensor\(s\) the loss"):
        StageModule([nn.Linear(2, 2), NoneOut()], last=True)(torch.zeros(3, 2))
    # between two blocks of one stage a dict passes, as in one process: torch's runtime never sees it
    assert torch.equal(StageModule([DictOut(), FromDict()], last=True)(torch.ones(3, 2)), torch.full((3, 2), 2.0))

    strategy = PipelineStrategy(stages=2)
    strategy._stage_module = StageModule([nn.Identity()], last=True)
    strategy._spec = PipelineSpec(layers=[nn.Identity()], inputs=lambda b: b[0], loss=lambda out, batch: (out - batch[1]) ** 2)
    strategy._targets = [(torch.zeros(3, 2), torch.ones(3, 2))]
    with pytest.raises(BatchFormatError, match=r"PipelineSpec.loss returned a tensor of shape \(3, 2\); it must return .* scalar.*HINT"):
        strategy._loss_fn(torch.zeros(3, 2), torch.tensor([0]))
    strategy._spec = PipelineSpec(layers=[nn.Identity()], inputs=lambda b: b[0], loss=lambda out, batch: ((out - batch[1]) ** 2).mean())
    assert strategy._loss_fn(torch.zeros(3, 2), torch.tensor([0])).item() == 1.0


def test_spec_and_inputs_that_cannot_cross_stages_are_named() -> None:
    """A function as a layer, a dict from `inputs`: one sentence and a HINT before any process group exists; a layer's
    list output and a list of inputs are passed on unpacked, as tuples are."""
    from lightning_distplan._layers import PipelineSpec
    from lightning_distplan.errors import BatchFormatError

    with pytest.raises(ModelSplitError, match=r"PipelineSpec.layers\[1\] is a function, not an nn.Module.*HINT: Use a module"):
        PipelineSpec(layers=[nn.Linear(2, 2), lambda x: x.relu()], inputs=lambda b: b[0], loss=lambda o, b: o.mean())
    with pytest.raises(BatchFormatError, match=r"gave the first layer a dict; .* tensor or a tuple of tensors.*HINT"):
        split_microbatches({"x": torch.zeros(4, 2)}, 2)
    assert [tuple(t.shape for t in mb) for mb in split_microbatches([torch.zeros(4, 2), torch.zeros(4)], 2)] == [((2, 2), (2,))] * 2

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x, 2 * x]

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    assert torch.equal(StageModule([Pair(), Add()])(torch.ones(3)), torch.full((3,), 3.0))
    assert isinstance(StageModule([Pair()])(torch.ones(3)), tuple)  # what crosses to the next stage


def test_a_stage_that_starts_in_place_on_what_it_receives_trains_on_a_copy() -> None:
    """A stage whose first block overwrites the received activation (nn.ReLU(inplace=True) right after the cut, where
    the automatic split puts the cut of Sequential(Linear(8, 16), ReLU(inplace=True), Linear(16, 4)) and of the VGG
    adapter's layers): the received tensor is a leaf that needs a gradient, as torch's PipelineStage hands it over.
    It failed at the first step with autograd's 'Output 0 of _ContiguousGrad is a view and is being modified inplace'
    (and 'Connection closed by peer' on the other stage); now the blocks get a copy, and the output and the gradient
    sent back are a single process's."""
    torch.manual_seed(0)
    relu, linear = nn.ReLU(inplace=True), nn.Linear(4, 3)
    stage = StageModule([relu, linear])
    received = torch.randn(5, 4).requires_grad_()  # the runtime's receive buffer
    before = received.detach().clone()
    out = stage(received)
    out.sum().backward()
    expected_input = before.clone().requires_grad_()
    expected = linear(torch.relu(expected_input))
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(received.grad, expected_input.grad)
    assert torch.equal(received.detach(), before)  # the receive buffer is not overwritten
    assert stage.copy_inputs
    # a stage that does not overwrite its input works on the received tensor itself (no copy, no second activation)
    plain = StageModule([nn.Linear(4, 3)])
    plain(torch.randn(5, 4).requires_grad_()).sum().backward()
    assert not plain.copy_inputs
    # other errors of a block are not taken for it
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        StageModule([nn.Linear(7, 3)])(torch.randn(5, 4).requires_grad_())


def test_a_loss_that_uses_another_stages_weight_is_named() -> None:
    """A tied output projection computed in the loss (``h @ embed.weight.T``) on the last stage, whose copy of the
    embedding was freed: the loss's first call names the tensor instead of failing on a size mismatch."""
    from lightning_distplan.strategies._pipeline_checkpoint import prune_module
    from lightning_distplan.strategies.pipeline import _RefuseTensors

    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4))
    prune_module(model, {id(t) for t in model[1].parameters()})
    freed = {id(t): name for name, t in model.named_parameters() if t.numel() == 0}
    h = torch.randn(2, 4)
    with pytest.raises(ModelSplitError, match=r"PipelineSpec.loss uses `0.weight`, which belongs to a layer of another pipeline stage.*stage 1.*HINT"):
        with _RefuseTensors(freed, stage=1):
            h @ model[0].weight.T
    with _RefuseTensors(freed, stage=1):
        assert model[1](h).shape == (2, 4)  # the stage's own weights pass


def test_the_shape_inference_hooks_guarded_exist_in_this_torch() -> None:
    """GuardedStage overrides torch's private shape-inference methods by name: a torch that renamed them would
    silently run unguarded (the 2-rank test of the behaviour would catch it too, more slowly)."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_distplan.strategies._pipeline_stage import GUARDED_HOOKS

    for name in GUARDED_HOOKS:
        assert callable(getattr(PipelineStage, name, None)), name


def test_the_same_batch_check_sums_a_batch_on_another_device_than_the_cpu() -> None:
    """The stages' same-batch check (``PipelineStrategy._check_same_batch``) builds its all-gathered tensor on the rank's
    root device from a step's batch, which lies there: a GPU under NCCL. Its count was made on the CPU beside the batch's
    sum in one ``torch.stack``, which refuses two devices, so every pipeline fit on GPUs failed at its first step. Without
    a GPU here, ``meta`` stands in for it (``torch.stack`` refuses meta beside CPU alike); a batch with a tensor left on
    the CPU meets on the root device too."""
    from lightning_distplan.strategies.pipeline import _batch_checksum

    ids, labels = torch.arange(6).reshape(2, 3), torch.tensor([1, 0])
    on_cpu = _batch_checksum([ids, labels], torch.device("cpu"))
    assert on_cpu.dtype == torch.float64 and on_cpu.tolist() == [16.0, 2.0]
    meta = torch.device("meta")
    for batch in ([ids.to(meta), labels.to(meta)], [ids.to(meta), labels]):
        got = _batch_checksum(batch, meta)
        assert got.device == meta and got.shape == (2,) and got.dtype == torch.float64
