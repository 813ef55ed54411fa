"""lightning_distplan.bench.models: constructor arguments are checked when the object is built, one sentence and a HINT."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_distplan.bench.models import RandomVectorData, WideMLP


@pytest.mark.parametrize(
    ("build", "match"),
    [
        # an empty layer, or a negative depth built as depth 0: a model that profiled and planned without complaint
        (lambda: WideMLP(hidden=0), r"^`hidden` \(0\) must be a positive integer\. HINT: Pass e\.g\. hidden=16\.$"),
        (lambda: WideMLP(depth=-1), r"^`depth` \(-1\) must be an integer >= 0\. HINT: Pass e\.g\. depth=4\.$"),
        (lambda: WideMLP(num_classes=True), r"^`num_classes` \(True\) must be a positive integer\. HINT:"),
        # True was read as 1 feature
        (lambda: RandomVectorData(in_features=True), r"^`in_features` \(True\) must be a positive integer\. HINT:"),
        # torch refused these only at the first batch, and the CLI then blamed the data loader
        (lambda: RandomVectorData(seed="x"), r"^`seed` \('x'\) must be an integer from -9223372036854775808 to 18446744073709551615\. HINT: Pass e\.g\. seed=0\.$"),
        (lambda: RandomVectorData(seed=2**64), r"^`seed` \(18446744073709551616\) must be an integer from"),
    ],
)
def test_bad_arguments_are_refused_when_built(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_the_edges_still_build() -> None:
    assert [type(m) for m in WideMLP(in_features=4, depth=0, num_classes=3).net] == [nn.Linear]
    data = RandomVectorData(in_features=4, batch_size=2, num_samples=2, seed=2**64 - 1)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (2, 4) and y.shape == (2,)


def test_numpy_integers_build_the_same_wide_mlp() -> None:
    """WideMLP built from numpy integers before its checks, which then took only int: they are taken as ints again."""
    import numpy as np

    numpy = WideMLP(in_features=np.int64(4), hidden=np.int32(8), depth=np.int64(2), num_classes=np.int16(3))
    python = WideMLP(in_features=4, hidden=8, depth=2, num_classes=3)
    assert [tuple(p.shape) for p in numpy.parameters()] == [tuple(p.shape) for p in python.parameters()]
    assert dict(numpy.hparams) == dict(python.hparams) and all(type(v) is int for v in numpy.hparams.values())
    with pytest.raises(ValueError, match=r"^`hidden` \(np\.True_\) must be a positive integer\. HINT:"):
        WideMLP(hidden=np.True_)


@pytest.mark.parametrize("name", ["TinyGPT2LM", "BertMaskedLM"])
def test_a_missing_transformers_names_the_extra_to_install(name, monkeypatch) -> None:
    """Without transformers `distplan bench ...:TinyGPT2LM` said "Building model ... failed: ModuleNotFoundError: ...
    HINT: Pass the constructor's required arguments with --init-args JSON."."""
    import sys

    from lightning_distplan._cli.profile import _build
    from lightning_distplan.bench import models

    monkeypatch.setitem(sys.modules, "transformers", None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=rf"^{name} builds a Hugging Face model, and the optional package 'transformers' "
                       r"\(>= 4\.40\) is not installed\. HINT: Run `pip install \"lightning_distplan\[models\]\"`") as caught:
        _build(getattr(models, name), {}, "model", f"lightning_distplan.bench.models:{name}", "--init-args")
    assert "--init-args" not in str(caught.value)
