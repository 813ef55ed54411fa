"""discover_layers: one layer list for profiling, plans and pipeline cuts (lightning_distplan/_layers.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_distplan._layers import PipelineSpec, discover_layers, find_pipeline_spec


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)


class _WithSpec(_Plain):
    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=[self.encoder[0], self.encoder[2], self.head], inputs=lambda b: b[0], loss=lambda out, b: out.sum())


class _BadSpec(_Plain):
    def pipeline_spec(self):  # noqa: ANN201 - returns the wrong thing on purpose
        return [self.encoder, self.head]


def test_tree_walk_without_a_spec_is_not_splittable():
    found = discover_layers(_Plain())
    # the biggest expandable child is opened up; the leaves stay in execution order
    assert found.names == ("encoder.0", "encoder.1", "encoder.2", "head")
    assert found.spec is None and "_Plain defines no `pipeline_spec()`" in found.split_reason
    assert all(isinstance(m, nn.Module) for m in found.modules) and len(found.modules) == 4


def test_the_hook_defines_the_layers_and_their_names():
    model = _WithSpec()
    found = discover_layers(model)
    assert found.names == ("encoder.0", "encoder.2", "head")
    assert found.modules == (model.encoder[0], model.encoder[2], model.head)
    assert found.spec is not None and found.split_reason == "_WithSpec.pipeline_spec()"
    x = torch.ones(3, 4)
    assert found.spec.inputs((x, None)) is x


def test_a_hook_returning_something_else_is_named():
    with pytest.raises(TypeError, match=r"_BadSpec.pipeline_spec\(\) returned list, not a PipelineSpec\. HINT: return lightning_distplan.PipelineSpec"):
        find_pipeline_spec(_BadSpec())


def test_a_sequential_without_pipeline_loss_is_told_what_is_missing():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))

    found = discover_layers(Net())
    assert found.spec is None
    assert "holds an nn.Sequential (`net`) but defines no `pipeline_loss(output, batch)`" in found.split_reason

    class WithLoss(Net):
        def pipeline_loss(self, output, batch):
            return output.mean()

    assert discover_layers(WithLoss()).spec is not None
