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


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: RandomTokenData(batch_size=0), r"^`batch_size` \(0\) must be a positive integer\. HINT: Pass e\.g\. batch_size=8\.$"),
        (lambda: RandomImageData(image_size=True), r"^`image_size` \(True\) must be a positive integer\. HINT:"),
        (lambda: TorchvisionClassifier("no_such_net"), r"^Unknown torchvision classification model 'no_such_net'\. HINT: Use one of .*resnet18"),
    ],
)
def test_bad_arguments_are_demo_argument_errors(build, match) -> None:
    with pytest.raises(DemoArgumentError, match=match) as info:
        build()
    assert isinstance(info.value, ValueError)
