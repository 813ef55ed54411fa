"""lightning_distplan.demos: deterministic synthetic data, and one-sentence errors with a HINT."""

from __future__ import annotations

import pytest
import torch

from lightning_distplan.demos import RandomImageData, RandomTokenData, TorchvisionClassifier
from lightning_distplan.errors import DemoArgumentError


def test_token_data_is_deterministic_and_shifted() -> None:
    data = RandomTokenData(vocab_size=50, block_size=8, batch_size=2, num_samples=4)
    x, y = next(iter(data.train_dataloader()))
    x2, y2 = next(iter(RandomTokenData(vocab_size=50, block_size=8, batch_size=2, num_samples=4).train_dataloader()))
    assert x.shape == (2, 8) and torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(data.dataset) == 4
    with pytest.raises(IndexError):
        data.dataset[4]


def test_image_data_is_deterministic_per_seed() -> None:
    def first(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next(iter(RandomImageData(num_classes=5, image_size=8, batch_size=3, num_samples=6, seed=seed).train_dataloader()))

    (x, y), (x2, y2), (x3, _) = first(1), first(1), first(2)
    assert x.shape == (3, 3, 8, 8) and y.shape == (3,) and int(y.max()) < 5
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: RandomTokenData(batch_size=0), r"^`batch_size` \(0\) must be a positive integer\. HINT: Pass e\.g\. batch_size=8\.$"),
        (lambda: RandomImageData(image_size=True), r"^`image_size` \(True\) must be a positive integer\. HINT:"),
        # torch refused these seeds only at the first batch, which the CLI blamed on the data loader; the per-sample
        # generators take seed * 1_000_003 + index, so the largest seed depends on num_samples
        (lambda: RandomTokenData(seed="1"), r"^`seed` \('1'\) must be an integer from -9223344366821 to 18446688733643\. HINT: Pass e\.g\. seed=0\.$"),
        (lambda: RandomImageData(seed=18446688733643 + 1, num_samples=64), r"^`seed` \(18446688733644\) must be an integer from"),
        (lambda: TorchvisionClassifier("no_such_net"), r"^Unknown torchvision classification model 'no_such_net'\. HINT: Use one of .*resnet18"),
    ],
)
def test_bad_arguments_are_demo_argument_errors(build, match) -> None:
    with pytest.raises(DemoArgumentError, match=match) as info:
        build()
    assert isinstance(info.value, ValueError)


def test_the_largest_seed_reads_every_sample() -> None:
    data = RandomTokenData(vocab_size=50, block_size=4, batch_size=2, num_samples=256, seed=18446688733643)
    data.setup("fit")
    assert data.dataset[255][0].shape == (4,)
