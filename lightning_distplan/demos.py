"""Small synthetic data modules (and one model wrapper) for profiling without internet access.

* :class:`RandomTokenData` yields ``(inputs, target)`` LongTensors shaped like Lightning's WikiText2
  demo, so ``lightning.pytorch.demos.transformer.LightningTransformer`` can be profiled offline.
* :class:`RandomImageData` yields ``(images, labels)`` for ImageNet-style classifiers.
* :class:`TorchvisionClassifier` wraps a torchvision architecture (``resnet18``, ``vgg11``,
  ``mobilenet_v2``, ...) built without downloading weights.

Every sample is generated from its index with a seeded ``torch.Generator``, so the data is
deterministic, needs no memory up front, and never touches the global RNG.

Example::

    distplan profile lightning.pytorch.demos.transformer:LightningTransformer \\
        --datamodule lightning_distplan.demos:RandomTokenData --out profile.json
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_distplan.errors import DemoArgumentError

__all__ = ["RandomTokenData", "RandomImageData", "TorchvisionClassifier"]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DemoArgumentError(f"`{name}` ({value!r}) must be a positive integer.", hint=f"Pass e.g. {name}=8.")


_SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds ``torch.Generator.manual_seed`` takes (a signed or an unsigned 64-bit integer)."""


def _check_seed(seed: Any, *, scale: int = 1, samples: int = 1) -> None:
    """Refuse a seed ``manual_seed`` would refuse when the data module is built, not at its first batch (which blamed
    the data loader). The generators are seeded with ``seed * scale + index`` for ``index < samples``."""
    low, high = _SEED_RANGE
    lowest, highest = -(-low // scale), (high - (samples - 1)) // scale
    if not isinstance(seed, int) or isinstance(seed, bool) or not lowest <= seed <= highest:
        raise DemoArgumentError(f"`seed` ({seed!r}) must be an integer from {lowest} to {highest}.", hint="Pass e.g. seed=0.")


class _SeededDataset(Dataset):
    """``num_samples`` samples, each drawn from its own generator: deterministic per index, nothing held in memory."""

    SEED_SCALE = 1_000_003
    """Sample ``index`` draws from a generator seeded with ``seed * SEED_SCALE + index``."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def _sample_generator(self, index: int) -> torch.Generator:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        return torch.Generator().manual_seed(self.seed * self.SEED_SCALE + index)


class _SyntheticData(LightningDataModule):
    """A data module over one :class:`_SeededDataset` built by ``_make_dataset`` (set ``batch_size``, ``seed`` first)."""

    batch_size: int
    seed: int
    dataset: _SeededDataset | None = None

    def _make_dataset(self) -> _SeededDataset:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self.dataset = self._make_dataset()

    def train_dataloader(self) -> DataLoader:
        if self.dataset is None:
            self.setup("fit")
        # a DataLoader draws its workers' base seed from this generator, not from the global RNG
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, generator=torch.Generator().manual_seed(self.seed))


class _TokenDataset(_SeededDataset):
    def __init__(self, vocab_size: int, block_size: int, num_samples: int, seed: int) -> None:
        super().__init__(num_samples, seed)
        self.vocab_size, self.block_size = vocab_size, block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        g = self._sample_generator(index)
        # one stream of block_size + 1 tokens: target is the input shifted by one, as in WikiText2
        tokens = torch.randint(0, self.vocab_size, (self.block_size + 1,), generator=g, dtype=torch.long)
        return tokens[:-1], tokens[1:]


class RandomTokenData(_SyntheticData):
    """Random token blocks shaped like ``lightning.pytorch.demos.transformer.WikiText2``.

    Args:
        vocab_size: token ids are drawn from ``[0, vocab_size)``; 33278 matches WikiText2 and the
            default of ``LightningTransformer``.
        block_size: tokens per sample (WikiText2 demo: 35).
        batch_size: samples per batch of ``train_dataloader()``.
        num_samples: samples in the dataset.
        seed: seed of the per-sample generator.
    """

    def __init__(
        self, vocab_size: int = 33278, block_size: int = 35, batch_size: int = 8, num_samples: int = 256, seed: int = 0
    ) -> None:
        super().__init__()
        _check_positive(vocab_size=vocab_size, block_size=block_size, batch_size=batch_size, num_samples=num_samples)
        _check_seed(seed, scale=_SeededDataset.SEED_SCALE, samples=num_samples)
        self.vocab_size, self.block_size, self.batch_size, self.num_samples, self.seed = (
            vocab_size, block_size, batch_size, num_samples, seed,
        )

    def _make_dataset(self) -> _TokenDataset:
        return _TokenDataset(self.vocab_size, self.block_size, self.num_samples, self.seed)


class _ImageDataset(_SeededDataset):
    def __init__(self, num_classes: int, image_size: int, channels: int, num_samples: int, seed: int) -> None:
        super().__init__(num_samples, seed)
        self.num_classes, self.image_size, self.channels = num_classes, image_size, channels

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        g = self._sample_generator(index)
        image = torch.randn(self.channels, self.image_size, self.image_size, generator=g)
        label = torch.randint(0, self.num_classes, (), generator=g, dtype=torch.long)
        return image, label


class RandomImageData(_SyntheticData):
    """Random normalised images with integer labels, for ImageNet-style classifiers.

    Args:
        num_classes: labels are drawn from ``[0, num_classes)``.
        image_size: height = width of each image (224 for ImageNet models).
        channels: image channels.
        batch_size: samples per batch of ``train_dataloader()``.
        num_samples: samples in the dataset.
        seed: seed of the per-sample generator.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        image_size: int = 224,
        channels: int = 3,
        batch_size: int = 8,
        num_samples: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_positive(num_classes=num_classes, image_size=image_size, channels=channels, batch_size=batch_size, num_samples=num_samples)
        _check_seed(seed, scale=_SeededDataset.SEED_SCALE, samples=num_samples)
        self.num_classes, self.image_size, self.channels = num_classes, image_size, channels
        self.batch_size, self.num_samples, self.seed = batch_size, num_samples, seed

    def _make_dataset(self) -> _ImageDataset:
        return _ImageDataset(self.num_classes, self.image_size, self.channels, self.num_samples, self.seed)


class TorchvisionClassifier(LightningModule):
    """A torchvision classification architecture (random init, no download) trained with cross-entropy.

    Args:
        arch: a name from ``torchvision.models.list_models(module=torchvision.models)``, e.g. ``"resnet18"``.
        num_classes: output classes.
        lr: SGD learning rate (momentum 0.9).
        model_kwargs: extra keyword arguments for the torchvision builder.
    """

    def __init__(self, arch: str = "resnet18", num_classes: int = 1000, lr: float = 0.1, **model_kwargs: Any) -> None:
        super().__init__()
        try:
            import torchvision
        except ImportError:
            raise ImportError(
                "TorchvisionClassifier needs torchvision. HINT: pip install 'lightning_distplan[models]'."
            ) from None
        names = torchvision.models.list_models(module=torchvision.models)
        if arch not in names:
            raise DemoArgumentError(f"Unknown torchvision classification model {arch!r}.", hint=f"Use one of {', '.join(sorted(names))}.")
        self.save_hyperparameters()
        self.model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **model_kwargs)
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
