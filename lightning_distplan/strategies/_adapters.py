"""Built-in :class:`~lightning_distplan.PipelineSpec` adapters for models other people wrote.

An adapter recognises a network either as the module itself or as an attribute of the
LightningModule named one of ``model``, ``net``, ``network``, ``backbone``, ``module``. The loss is
the LightningModule's ``pipeline_loss(output, batch)`` when it defines one, else the network's
natural training loss:

============================================  =============================================  ==========================
network                                       layers                                         default loss
============================================  =============================================  ==========================
``nn.Sequential``                             its children                                   none: define ``pipeline_loss``
torchvision ResNet / VGG / MobileNetV2        stem, every block, pool+flatten+classifier      ``F.cross_entropy(out, y)`` on ``(x, y)`` batches
Hugging Face ``GPT2LMHeadModel``              embeddings, every block, ``ln_f``+``lm_head``   causal-LM loss (shifted labels)
Hugging Face ``BertForMaskedLM``              embeddings, every layer, MLM head               cross-entropy, ignore -100
Hugging Face ``BertForSequenceClassification``  embeddings, every layer, pooler+classifier   cross-entropy on ``labels``
                                                                                             (regression / multi-label:
                                                                                             define ``pipeline_loss``)
Lightning demo ``Transformer``                embeddings, encoder layers, encoder norm,       ``nll_loss`` as its ``training_step``
                                              decoder layers, norm+linear+log_softmax
============================================  =============================================  ==========================

Batches: vision and ``Sequential`` take ``(x, y)``; Hugging Face models take a dict with
``input_ids`` (and ``labels``; GPT-2 defaults ``labels`` to ``input_ids``; an ``attention_mask`` with
padding or ``token_type_ids`` with segments are not passed on, and warned about) or ``(input_ids, labels)``;
the demo Transformer takes ``(inputs, target)`` like its ``training_step``.

Losses are means over a micro-batch, so the mean of micro-batch losses equals the full-batch loss
when every micro-batch holds the same number of counted items (always for classification and
unpadded causal LM; for masked LM only when every micro-batch masks as many tokens).
The wrappers below hold references to the original sub-modules, so ``state_dict`` keys never change.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_distplan._layers import PipelineSpec, register_adapter
from lightning_distplan.errors import BatchFormatError

__all__: list[str] = []

_NET_ATTRS = ("model", "net", "network", "backbone", "module")


def _candidates(module: nn.Module) -> list[nn.Module]:
    found = [module]
    for name in _NET_ATTRS:
        sub = getattr(module, name, None)
        if isinstance(sub, nn.Module) and sub is not module:
            found.append(sub)
    return found


def _user_loss(module: nn.Module) -> Callable[[Any, Any], Tensor] | None:
    fn = getattr(module, "pipeline_loss", None)
    return fn if callable(fn) else None


def _xy_inputs(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _xy_ce(output: Tensor, batch: Any) -> Tensor:
    return F.cross_entropy(output, batch[1])


class _Chain(nn.Module):
    """Run referenced modules (or plain callables) in order; not registered in the LightningModule."""

    def __init__(self, *steps: nn.Module | Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.mods = nn.ModuleList([s for s in steps if isinstance(s, nn.Module)])
        self._steps = steps

    def forward(self, x: Tensor) -> Tensor:
        for step in self._steps:
            x = step(x)
        return x


def _flatten(x: Tensor) -> Tensor:
    return torch.flatten(x, 1)


# ---------------------------------------------------------------------------- Sequential


@register_adapter
def sequential_adapter(module: nn.Module) -> PipelineSpec | None:
    loss = _user_loss(module)
    if loss is None:
        return None  # a Sequential says nothing about its loss
    for net in _candidates(module):
        if _splittable_sequential(net):
            return PipelineSpec(layers=list(net), inputs=_xy_inputs, loss=loss)
    return None


def _splittable_sequential(net: nn.Module) -> bool:
    return type(net) is nn.Sequential and len(net) >= 2


def adapter_miss_reason(module: nn.Module) -> str | None:
    """Why no built-in adapter split ``module`` when one nearly could (a sentence ending in what still runs); else None.

    A Sequential without a loss to put on its last stage; a Hugging Face classifier for regression or
    multi-label, whose loss the adapter does not guess; a network the adapters know held under another
    attribute name than the ones they look at.
    """
    tail = "so it can run data parallel but not as a pipeline"
    if _user_loss(module) is None:
        named = [("the module itself", module)] + [(f"`{name}`", getattr(module, name, None)) for name in _NET_ATTRS]
        where = next((label for label, net in named if isinstance(net, nn.Module) and _splittable_sequential(net)), None)
        if where is not None:
            return (
                f"{type(module).__name__} holds an nn.Sequential ({where}) but defines no `pipeline_loss(output, batch)`, which a "
                f"pipeline needs to compute the loss on its last stage (a Sequential says nothing about its loss), nor a `pipeline_spec()`, {tail}"
            )
        guessed = next((net for net in _candidates(module) if _hf_loss_not_guessed(net)), None)
        if guessed is not None:
            return (
                f"{type(module).__name__} holds a {type(guessed).__name__} for {guessed.config.problem_type or 'regression'} (num_labels="
                f"{guessed.num_labels}), whose loss the built-in adapter does not guess, and defines no `pipeline_loss(output, batch)` "
                f"(output: the logits) nor a `pipeline_spec()`, {tail}"
            )
    # a whole network the adapters know, held under another name (the module's only child with parameters: a
    # Sequential encoder beside a head, say, is part of a network, and renaming it would split the wrong thing)
    known = _known_network_types()
    holding = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
    if len(holding) == 1 and holding[0][0] not in _NET_ATTRS and isinstance(holding[0][1], known):
        name, child = holding[0]
        return (
            f"{type(module).__name__} holds a {type(child).__name__} as `{name}`, but the built-in adapters look for the network "
            f"in the module itself or in an attribute named {', '.join(_NET_ATTRS)}, {tail} (rename the attribute, or define "
            "`pipeline_spec()`)"
        )
    return None


def _hf_loss_not_guessed(net: nn.Module) -> bool:
    """A Hugging Face sequence classifier for regression or multi-label (its default loss is not cross-entropy)."""
    if not any(name in sys.modules for name in _HF_MODEL_MODULES):
        return False
    from transformers import BertForSequenceClassification

    return isinstance(net, BertForSequenceClassification) and (
        net.config.problem_type not in (None, "single_label_classification") or net.num_labels < 2
    )


def _known_network_types() -> tuple[type, ...]:
    """The network classes the adapters split, among those already imported (importing them costs seconds)."""
    known: list[type] = []
    if "torchvision.models" in sys.modules:
        from torchvision.models import VGG, MobileNetV2, ResNet

        known += [ResNet, VGG, MobileNetV2]
    if any(name in sys.modules for name in _HF_MODEL_MODULES):
        from transformers import BertForMaskedLM, BertForSequenceClassification, GPT2LMHeadModel

        known += [GPT2LMHeadModel, BertForMaskedLM, BertForSequenceClassification]
    if "lightning.pytorch.demos.transformer" in sys.modules:
        from lightning.pytorch.demos.transformer import Transformer

        known.append(Transformer)
    return tuple(known)


# ---------------------------------------------------------------------------- torchvision


@register_adapter
def torchvision_adapter(module: nn.Module) -> PipelineSpec | None:
    try:
        from torchvision.models import VGG, MobileNetV2, ResNet
    except ImportError:  # pragma: no cover - torchvision is optional
        return None
    for net in _candidates(module):
        if isinstance(net, ResNet):
            layers: list[nn.Module] = [_Chain(net.conv1, net.bn1, net.relu, net.maxpool)]
            for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
                layers.extend(stage)
            layers.append(_Chain(net.avgpool, _flatten, net.fc))
        elif isinstance(net, VGG):
            layers = [*net.features, _Chain(net.avgpool, _flatten), *net.classifier]
        elif isinstance(net, MobileNetV2):
            layers = [*net.features, _Chain(nn.AdaptiveAvgPool2d((1, 1)), _flatten, net.classifier)]
        else:
            continue
        return PipelineSpec(layers=layers, inputs=_xy_inputs, loss=_user_loss(module) or _xy_ce)
    return None


# ---------------------------------------------------------------------------- Hugging Face


def _hf_inputs(batch: Any) -> Tensor:
    if isinstance(batch, Mapping):
        _padding_check.look(batch)
        return batch["input_ids"]
    return _xy_inputs(batch)


class _PaddingCheck:
    """Warns once per process when a dict batch carries what the Hugging Face adapters drop: padding in its
    ``attention_mask``, or segments in its ``token_type_ids``. Only the first few batches are looked at (each
    look waits for the device)."""

    LOOKS = 8

    def __init__(self) -> None:
        self.looked = 0

    def look(self, batch: Mapping) -> None:
        if self.looked >= self.LOOKS:
            return
        self.looked += 1
        mask, segments = batch.get("attention_mask"), batch.get("token_type_ids")
        dropped = []
        if isinstance(mask, Tensor) and bool((mask == 0).any()):
            dropped.append("attention_mask holds padding")
        if isinstance(segments, Tensor) and bool((segments != 0).any()):
            dropped.append("token_type_ids mark segments")
        if dropped:
            self.looked = self.LOOKS
            warnings.warn(
                f"The Hugging Face pipeline adapter passes input_ids only, but this batch's {' and its '.join(dropped)}, which the "
                "pipeline does not see (padded tokens are attended to), so it does not train as the model called with them would. "
                "Write a `pipeline_spec()` that passes them along, or train data parallel (strategy='dp_ga').",
                stacklevel=2,
            )


_padding_check = _PaddingCheck()


def _hf_labels(batch: Any, *, default_to_inputs: bool) -> Tensor:
    if isinstance(batch, Mapping):
        if "labels" in batch:
            return batch["labels"]
        if default_to_inputs:
            return batch["input_ids"]
        raise BatchFormatError(
            f"The batch has no 'labels' (keys: {sorted(map(str, batch))}).", hint="Add 'labels' to the batch or define `pipeline_loss`."
        )
    if isinstance(batch, (tuple, list)):
        return batch[1]
    if default_to_inputs:
        return batch
    raise BatchFormatError(
        f"The batch is a {type(batch).__name__}, which carries no labels.", hint="Use (input_ids, labels) batches or define `pipeline_loss`."
    )


class _GPT2Embed(nn.Module):
    # Hold exactly the sub-modules used: a layer's parameters decide which stage keeps which tensors.
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class _GPT2Block(nn.Module):
    """One GPT-2 block; the causal mask is rebuilt here exactly as ``GPT2Model.forward`` builds it."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
        )
        out = self.block(hidden, None, mask, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out


class _BertLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.layer(hidden)  # no padding mask: full bidirectional attention, as BertModel with attention_mask=None
        return out[0] if isinstance(out, tuple) else out


class _BertEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.e = embeddings

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.e(input_ids=input_ids)


class _BertPooledHead(nn.Module):
    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, hidden: Tensor) -> Tensor:
        return self.classifier(self.dropout(self.pooler(hidden)))


_HF_MODEL_MODULES = ("transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert")


@register_adapter
def huggingface_adapter(module: nn.Module) -> PipelineSpec | None:
    if not any(name in sys.modules for name in _HF_MODEL_MODULES):
        # no GPT-2/BERT model can exist before its modeling module is imported; importing them only
        # to check would cost ~0.5 s per process (most of auto_plan's set-up time for a small model)
        return None
    try:
        from transformers import BertForMaskedLM, BertForSequenceClassification, GPT2LMHeadModel
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    user_loss = _user_loss(module)
    for net in _candidates(module):
        if isinstance(net, GPT2LMHeadModel):
            t = net.transformer
            vocab = net.config.vocab_size

            def gpt2_loss(logits: Tensor, batch: Any, _net: Any = net, _vocab: int = vocab) -> Tensor:
                return _net.loss_function(logits, _hf_labels(batch, default_to_inputs=True), vocab_size=_vocab)

            layers = [_GPT2Embed(t), *(_GPT2Block(b, net.config) for b in t.h), _Chain(t.ln_f, net.lm_head)]
            return PipelineSpec(layers=layers, inputs=_hf_inputs, loss=user_loss or gpt2_loss)
        if isinstance(net, BertForMaskedLM):
            vocab = net.config.vocab_size

            def mlm_loss(logits: Tensor, batch: Any, _vocab: int = vocab) -> Tensor:
                labels = _hf_labels(batch, default_to_inputs=False)
                return F.cross_entropy(logits.view(-1, _vocab), labels.view(-1), ignore_index=-100)

            layers = [_BertEmbed(net.bert.embeddings), *(_BertLayer(l) for l in net.bert.encoder.layer), net.cls]
            return PipelineSpec(layers=layers, inputs=_hf_inputs, loss=user_loss or mlm_loss)
        if isinstance(net, BertForSequenceClassification):
            if user_loss is None and _hf_loss_not_guessed(net):
                continue  # regression / multi-label: the user must say which loss (pipeline_loss)

            def cls_loss(logits: Tensor, batch: Any) -> Tensor:
                return F.cross_entropy(logits, _hf_labels(batch, default_to_inputs=False).view(-1))

            head = _BertPooledHead(net.bert.pooler, net.dropout, net.classifier)
            layers = [_BertEmbed(net.bert.embeddings), *(_BertLayer(l) for l in net.bert.encoder.layer), head]
            return PipelineSpec(layers=layers, inputs=_hf_inputs, loss=user_loss or cls_loss)
    return None


# ---------------------------------------------------------------------------- Lightning demo Transformer


class _DemoEmbed(nn.Module):
    # Hold exactly the sub-modules used: a layer's parameters decide which stage keeps which tensors.
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embedding, self.pos_encoder, self.scale = model.embedding, model.pos_encoder, math.sqrt(model.ninp)

    def forward(self, inputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        src = self.pos_encoder(self.embedding(inputs) * self.scale)
        tgt = self.pos_encoder(self.embedding(target) * self.scale)
        return src, tgt


class _DemoEncoderLayer(nn.Module):
    """Carries ``(memory, tgt)``; ``nn.Transformer`` runs the encoder with no source mask."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        # view_as gives the passed-through tensor a graph node, so the runtime can route its gradient back
        return self.layer(src), tgt.view_as(tgt)


class _DemoDecoderLayer(nn.Module):
    """Rebuilds the causal target mask as ``Transformer.forward`` does (and ``TransformerDecoder``'s is_causal hint)."""

    def __init__(self, layer: nn.Module, model: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.causal_mask = model.generate_square_subsequent_mask  # a bound method, not a sub-module

    def forward(self, memory: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        from torch.nn.modules.transformer import _detect_is_causal_mask

        t = tgt.shape[1]
        mask = self.causal_mask(t).to(tgt.device)
        is_causal = _detect_is_causal_mask(mask, None, t)
        return memory.view_as(memory), self.layer(tgt, memory, tgt_mask=mask, tgt_is_causal=is_causal)


class _DemoEncoderNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        return self.norm(src), tgt.view_as(tgt)


class _DemoHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm, self.decoder, self.vocab_size = model.transformer.decoder.norm, model.decoder, model.vocab_size

    def forward(self, memory: Tensor, tgt: Tensor) -> Tensor:
        out = self.decoder(self.norm(tgt) if self.norm is not None else tgt)
        return F.log_softmax(out, dim=-1).view(-1, self.vocab_size)


def _demo_loss(output: Tensor, batch: Any) -> Tensor:
    return F.nll_loss(output, batch[1].reshape(-1))


@register_adapter
def demo_transformer_adapter(module: nn.Module) -> PipelineSpec | None:
    try:
        from lightning.pytorch.demos.transformer import Transformer
    except ImportError:  # pragma: no cover
        return None
    for net in _candidates(module):
        if isinstance(net, Transformer):
            enc, dec = net.transformer.encoder, net.transformer.decoder
            layers: list[nn.Module] = [_DemoEmbed(net), *(_DemoEncoderLayer(l) for l in enc.layers)]
            if enc.norm is not None:
                layers.append(_DemoEncoderNorm(enc.norm))
            layers.extend(_DemoDecoderLayer(l, net) for l in dec.layers)
            layers.append(_DemoHead(net))
            return PipelineSpec(
                layers=layers,
                inputs=lambda batch: (batch[0], batch[1]),
                loss=_user_loss(module) or _demo_loss,
            )
    return None
