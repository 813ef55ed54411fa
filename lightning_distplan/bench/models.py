"""Small, configurable benchmark models and data (CPU-sized; real architectures written by others).

* :class:`DemoTransformerLM`: Lightning's demo ``Transformer`` (``lightning.pytorch.demos``) with
  its size as constructor arguments (the demo's ``LightningTransformer`` only exposes the vocabulary).
* :class:`TinyGPT2LM`: a Hugging Face ``GPT2LMHeadModel`` built from a ``GPT2Config`` (small by
  default; GPT-2 124M with ``vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024``).
* :class:`BertMaskedLM`: a Hugging Face ``BertForMaskedLM`` from a ``BertConfig`` (small by default;
  BERT-Large with ``hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096``).
* :class:`WideMLP`: an ``nn.Sequential`` MLP, parameter-heavy for its compute, so data-parallel
  all-reduce is expensive on a slow link while its boundary activations are tiny.
* :class:`RandomVectorData`: ``(features, label)`` batches for :class:`WideMLP`.

TinyGPT2LM and BertMaskedLM need transformers (``pip install "lightning_distplan[models]"``); without it they refuse
to build in one sentence that says so. All of them split into pipeline stages through the built-in adapters
(``lightning_distplan.strategies._adapters``). Use them with
``lightning_distplan.demos.RandomTokenData`` for the language models.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_distplan.demos import _SEED_RANGE
from lightning_distplan.errors import DistPlanError
from lightning_distplan.plan import as_int

__all__ = ["DemoTransformerLM", "TinyGPT2LM", "BertMaskedLM", "WideMLP", "RandomVectorData"]


class _MissingTransformersError(DistPlanError, ImportError):
    """transformers, from the ``models`` extra, is not installed."""


def _transformers(owner: str) -> Any:
    """The transformers package, or one sentence with the install command (the CLI's hint for a constructor that
    fails, "pass the constructor's required arguments", is no help here)."""
    try:
        import transformers
    except ImportError:
        raise _MissingTransformersError(
            f"{owner} builds a Hugging Face model, and the optional package 'transformers' (>= 4.40) is not installed.",
            hint="Run `pip install \"lightning_distplan[models]\"` (or `pip install 'transformers>=4.40'`).",
        ) from None
    return transformers


class DemoTransformerLM(LightningModule):
    """Lightning's demo encoder-decoder Transformer at a chosen size (SGD, lr 0.1, like the demo)."""

    def __init__(self, vocab_size: int = 4096, ninp: int = 128, nhead: int = 2, nhid: int = 256, nlayers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        from lightning.pytorch.demos.transformer import Transformer

        self.save_hyperparameters()
        self.model = Transformer(vocab_size=vocab_size, ninp=ninp, nhead=nhead, nhid=nhid, nlayers=nlayers, dropout=dropout)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyGPT2LM(LightningModule):
    """A small GPT-2 (Hugging Face ``GPT2LMHeadModel`` from a config; tied embeddings; AdamW)."""

    def __init__(self, vocab_size: int = 4096, n_embd: int = 128, n_layer: int = 4, n_head: int = 4, n_positions: int = 64) -> None:
        super().__init__()
        transformers = _transformers(type(self).__name__)
        self.save_hyperparameters()
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        return self.model(input_ids=inputs, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BertMaskedLM(LightningModule):
    """A BERT masked-LM (Hugging Face ``BertForMaskedLM`` from a config, no download; AdamW).

    Batches are ``(input_ids, labels)``; every position is a prediction target (the MLM head runs
    over every position either way, so the cost matches 15% masking).
    """

    def __init__(
        self, vocab_size: int = 4096, hidden_size: int = 128, num_hidden_layers: int = 4, num_attention_heads: int = 4,
        intermediate_size: int = 512, max_position_embeddings: int = 512,
    ) -> None:
        super().__init__()
        transformers = _transformers(type(self).__name__)
        self.save_hyperparameters()
        config = transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = transformers.BertForMaskedLM(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        return self.model(input_ids=inputs, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _check_counts(*, least: int = 1, example: int = 16, **values: Any) -> None:
    """Refuse sizes that would build an empty layer or be read as another number (True as 1, -1 as 0 blocks)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            what = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"`{name}` ({value!r}) must be {what}. HINT: Pass e.g. {name}={example}.")


class WideMLP(LightningModule):
    """``depth`` Linear+ReLU blocks of width ``hidden`` in an ``nn.Sequential`` (SGD with momentum)."""

    def __init__(self, in_features: int = 256, hidden: int = 1024, depth: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        # numpy integers as Python ones (they built the model before the checks below, which take int), hparams included
        in_features, hidden, depth, num_classes = (v if as_int(v) is None else as_int(v) for v in (in_features, hidden, depth, num_classes))
        _check_counts(in_features=in_features, hidden=hidden, num_classes=num_classes)
        _check_counts(least=0, example=4, depth=depth)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers.append(nn.Sequential(nn.Linear(width, hidden), nn.ReLU()))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output, batch[1])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _VectorDataset(Dataset):
    def __init__(self, in_features: int, num_classes: int, num_samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_features, generator=g)
        self.y = torch.randint(0, num_classes, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class RandomVectorData(LightningDataModule):
    """Random feature vectors with integer labels (seeded)."""

    def __init__(self, in_features: int = 256, num_classes: int = 10, batch_size: int = 16, num_samples: int = 512, seed: int = 0) -> None:
        super().__init__()
        _check_counts(in_features=in_features, num_classes=num_classes, batch_size=batch_size, num_samples=num_samples)
        low, high = _SEED_RANGE  # checked here: torch refused it only at the first batch, which blamed the data loader
        if not isinstance(seed, int) or isinstance(seed, bool) or not low <= seed <= high:
            raise ValueError(f"`seed` ({seed!r}) must be an integer from {low} to {high}. HINT: Pass e.g. seed=0.")
        self.in_features, self.num_classes, self.batch_size, self.num_samples, self.seed = in_features, num_classes, batch_size, num_samples, seed
        self.dataset: _VectorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        self.dataset = _VectorDataset(self.in_features, self.num_classes, self.num_samples, self.seed)

    def train_dataloader(self) -> DataLoader:
        if self.dataset is None:
            self.setup("fit")
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)
