"""How PipelineStrategy cuts batches into micro-batches: as dp_ga and the profiler cut them.

The pure helpers are checked on one process; what a real fit does with such batches is checked in ONE launch of two
gloo ranks (a module-scoped fixture) against a single-process run of the module's own ``training_step``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning as L

sys.path.insert(0, os.path.dirname(__file__))
from _dist_utils import run_on_ranks  # noqa: E402
from _pipeline_models import TinyTransformer, token_data  # noqa: E402

from lightning_distplan._layers import PipelineSpec  # noqa: E402
from lightning_distplan.errors import BatchFormatError  # noqa: E402
from lightning_distplan.strategies._pipeline_split import StageModule, split_microbatches, split_structure  # noqa: E402

SAMPLES, BATCH, CLASSES, STEPS = 32, 8, 3, 4


def test_split_structure_cuts_the_rows_it_is_told() -> None:
    """(class_weights[3], labels[8]): read alone, the tie between 3 and 8 rows went to the first, and every micro-batch got
    a piece of the class weights and all 8 labels; told the batch's 8 rows, the labels are cut and the weights kept."""
    weights, labels = torch.ones(CLASSES), torch.arange(BATCH)
    chunks = split_structure((weights, labels), 2, size=BATCH)
    assert [tuple(c[0].shape) for c in chunks] == [(CLASSES,)] * 2
    assert [c[1].tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # four sequences of five tokens: four samples, not five
    seqs = [torch.full((5,), float(i)) for i in range(4)]
    assert [[s[0].item() for s in c] for c in split_structure(seqs, 2, size=4)] == [[0.0, 1.0], [2.0, 3.0]]


def test_inputs_without_the_batchs_rows_are_refused() -> None:
    with pytest.raises(BatchFormatError, match=r"inputs\(batch\)` holds tensors of 5 rows, but the per-replica batch holds 8 samples.*HINT"):
        split_microbatches(torch.zeros(5, 2), 2, size=8)
    assert [mb[0].shape[0] for mb in split_microbatches((torch.zeros(CLASSES), torch.zeros(8, 2)), 2, size=8)] == [3, 3]
    assert [mb[1].shape[0] for mb in split_microbatches((torch.zeros(CLASSES), torch.zeros(8, 2)), 2, size=8)] == [4, 4]


def test_a_packed_sequence_is_cut_as_targets_and_refused_as_inputs() -> None:
    """As targets, a PackedSequence is cut by its sequences (slice_samples). As the first layer's inputs it was unpacked,
    a namedtuple, into four positional tensors (data, batch_sizes and two index vectors), the index vectors cut and the
    data not: no layer takes that. Now it is refused in one sentence."""
    from torch.nn.utils.rnn import pack_sequence, unpack_sequence

    packed = pack_sequence([torch.full((k,), float(k)) for k in (5, 3, 6, 7)], enforce_sorted=False)
    chunks = split_structure({"seqs": packed, "y": torch.arange(4)}, 2, size=4)
    assert [[len(s) for s in unpack_sequence(c["seqs"])] for c in chunks] == [[5, 3], [6, 7]]
    assert [c["y"].tolist() for c in chunks] == [[0, 1], [2, 3]]
    with pytest.raises(BatchFormatError, match=r"gave the first layer a PackedSequence; .*HINT: Return the padded tensor"):
        split_microbatches(packed, 2, size=4)


@pytest.mark.parametrize("inputs", [(torch.zeros(8, 2), None), [None, torch.zeros(8, 2)], (torch.zeros(8, 2), 3), (torch.zeros(8, 2), "pad")])
def test_a_none_or_a_constant_among_the_first_layers_inputs_is_refused(inputs: Any) -> None:
    """(x, None) as the first layer's inputs, an optional mask left out: the check for non-tensors looked for the first
    non-tensor *value* with next(..., None), so a None entry read as "none found" and passed. A real 2-rank gloo fit then
    failed on both ranks at its first step with AttributeError: 'NoneType' object has no attribute 'dim'. Now None is
    refused in one sentence, as an int or a string was."""
    given = "None" if any(a is None for a in inputs) else {"int": "an int", "str": "a str"}[type(inputs[1]).__name__]
    with pytest.raises(BatchFormatError, match=rf"gave the first layer {given}; the pipeline passes only tensors .*HINT: .*None for an optional"):
        split_microbatches(inputs, 2, size=8)


# ---------------------------------------------------------------------------- real fits


class _Rows(Dataset):
    def __init__(self, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _weights_and_label_list(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """A per-batch constant before the rows, and the labels as a list of per-sample tensors (a collate of the user's)."""
    return {"class_weights": torch.tensor([1.0, 2.0, 0.5]), "x": torch.stack([x for x, _ in items]), "y": [y for _, y in items]}


class _WeightedLoss(L.LightningModule):
    """Class-weighted cross-entropy, a mean over samples (so the mean of equal micro-batches' losses is the batch's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    @staticmethod
    def loss(out: torch.Tensor, targets: tuple[torch.Tensor, list[torch.Tensor]]) -> torch.Tensor:
        weights, labels = targets
        y = torch.stack(labels)
        return (F.cross_entropy(out, y, reduction="none") * weights[y]).mean()

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.model), inputs=lambda b: b["x"], loss=self.loss,
                            targets=lambda b: (b["class_weights"], b["y"]))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.loss(self.model(batch["x"]), (batch["class_weights"], batch["y"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _reference(model: L.LightningModule, collate: Any, batch_size: int = BATCH) -> dict[str, torch.Tensor]:
    """The module's own training_step on the same batches in one process (Lightning shuffles a distributed fit's
    training data with DistributedSampler(shuffle=True, seed=0), here over one replica)."""
    opt = model.configure_optimizers()
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for i, batch in enumerate(DataLoader(_Rows(), batch_size=batch_size, sampler=order, collate_fn=collate)):
        if i == STEPS:
            break
        opt.zero_grad()
        model.training_step(batch, i).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(model: L.LightningModule, collate: Any, out: str, boundaries: Any = "auto", schedule: str = "gpipe") -> dict[str, torch.Tensor] | str:
    """The weights after a 2-stage GPipe (or ``schedule``) fit of 2 micro-batches, or the error it raised (type and first line)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    strategy = PipelineStrategy(schedule=schedule, stages=2, stage_boundaries=boundaries, n_microbatches=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    try:
        trainer.fit(model, DataLoader(_Rows(), batch_size=BATCH, collate_fn=collate))
    except Exception as err:  # noqa: BLE001 - what the test reports
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Targets:
    """The user's own object holding the labels as a tensor attribute (no tensor, mapping, sequence or dataclass)."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y


def _labels_in_an_object(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, _Targets]:
    return torch.stack([x for x, _ in items]), _Targets(torch.stack([y for _, y in items]).float())


class _ObjectTargets(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def pipeline_loss(self, out: torch.Tensor, batch: tuple[torch.Tensor, _Targets]) -> torch.Tensor:
        # [m, 1] against the object's [8, 1]: broadcast to [8, 1] when m is 1 or 8, a shape error otherwise
        return F.mse_loss(out, batch[1].y[:, None])

    def training_step(self, batch: tuple[torch.Tensor, _Targets], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.model(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DictTransformer(TinyTransformer):
    """Lightning's demo Transformer (the built-in adapter guesses its loss) fed dicts that its on_before_batch_transfer
    turns into the (inputs, target) its training_step takes."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers = 0  # batches the hook saw (a user's counter: a curriculum, a log)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.transfers += 1
        return batch["src"], batch["tgt"]


def _token_dicts(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"src": torch.stack([x for x, _ in items]), "tgt": torch.stack([y for _, y in items])}


def _hooked_fit(out: str) -> tuple[dict[str, torch.Tensor], int] | str:
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    torch.manual_seed(1234)
    model = _DictTransformer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    try:
        trainer.fit(model, DataLoader(token_data(SAMPLES), batch_size=BATCH, collate_fn=_token_dicts))
    except Exception as err:  # noqa: BLE001 - what the test reports
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.transfers


def _hooked_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    model = _DictTransformer()
    opt = model.configure_optimizers()
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for i, batch in enumerate(DataLoader(token_data(SAMPLES), batch_size=BATCH, sampler=order, collate_fn=_token_dicts)):
        if i == STEPS:
            break
        opt.zero_grad()
        model.training_step(model.on_before_batch_transfer(batch, 0), i).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _label_sets(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each sample's labels as a tensor of its own length (1 to 3), as multi-label or detection targets come."""
    return torch.stack([x for x, _ in items]), [y.repeat(int(y) + 1) for _, y in items]


class _LabelSets(_WeightedLoss):
    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.model), inputs=lambda b: b[0], loss=self.loss)

    @staticmethod
    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.stack([F.cross_entropy(o.expand(len(y), -1), y) for o, y in zip(out, batch[1])]).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model(batch[0]), batch)


def _first_layer_calls(out: str) -> tuple[int, list[str], dict[str, torch.Tensor]]:
    """Forwards of the first layer (rank 0 holds it) in a fit of STEPS steps, the warnings about shapes, the weights."""
    import warnings

    model = _LabelSets()
    calls = []
    model.model[0].register_forward_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _fit(model, _label_sets, out)
    assert not isinstance(got, str), got
    return len(calls), [str(w.message) for w in caught if "shapes" in str(w.message)], got


def _epoch_of_batches_from(batch_sampler: type, out: str) -> tuple[str, int]:
    """One gpipe epoch over 35 samples in batches of 8 drawn by ``batch_sampler``: (the refusal, or "", and the steps)."""
    from torch.utils.data import RandomSampler

    from lightning_distplan.strategies.pipeline import PipelineStrategy

    rows = _Rows(SAMPLES + 3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    loader = DataLoader(rows, batch_sampler=batch_sampler(RandomSampler(rows), batch_size=BATCH, drop_last=False),
                        collate_fn=_weights_and_label_list)
    try:
        trainer.fit(_WeightedLoss(), loader)
    except Exception as err:  # noqa: BLE001 - what the test reports
        return f"{type(err).__name__}: {str(err).splitlines()[0]}", trainer.global_step
    return "", trainer.global_step


def _short_last_batch_of_a_batch_sampler(out: str) -> tuple[str, int]:
    """35 samples in batches of 8 drawn by a batch sampler of the user's (Lightning re-creates it over its distributed
    sampler): the epoch ends with 3, which 2 micro-batches do not split."""
    from torch.utils.data import BatchSampler

    class Batches(BatchSampler):  # a bucketing or length-grouping sampler would be one
        pass

    return _epoch_of_batches_from(Batches, out)


class _MaskedFirst(nn.Module):
    """A first layer with an optional mask, which returns it along: (h, None) when there is none."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.linear(x), mask


class _Masked(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return h.relu() if mask is None else h.relu() * mask


class _OptionalMask(L.LightningModule):
    """``none_in="inputs"``: PipelineSpec.inputs gives (x, None); ``"output"``: the first layer's (h, None) crosses the
    stage boundary the automatic split puts after it (81 parameters against 1 + 52)."""

    def __init__(self, none_in: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.none_in = none_in
        self.layers = nn.ModuleList([_MaskedFirst(), _Masked(), nn.Linear(16, CLASSES)])

    def pipeline_spec(self) -> PipelineSpec:
        inputs = (lambda b: (b[0], None)) if self.none_in == "inputs" else (lambda b: b[0])
        return PipelineSpec(layers=list(self.layers), inputs=inputs, loss=lambda out, b: F.cross_entropy(out, b[1]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, masked, head = self.layers
        return F.cross_entropy(head(masked(*first(batch[0]))), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _none_refused(none_in: str, out: str) -> tuple[str, bool]:
    model = _OptionalMask(none_in)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    refused = _fit(model, None, out)
    assert isinstance(refused, str), "the fit trained"
    return refused, all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def _eval_refused(out: str) -> dict[str, tuple[str, bool]]:
    """trainer.validate / test / predict, with no fit before, of the model whose first layer's (h, None) crosses the
    stage boundary: what each raised, and whether the module kept its weights."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    got = {}
    for entry in ("validate", "test", "predict"):
        model = _OptionalMask("output")
        model.validation_step = model.test_step = lambda batch, batch_idx: None  # Lightning asks for them
        model.forward = lambda x: model.layers[2](model.layers[1](*model.layers[0](x)))
        start = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(schedule="gpipe", stages=2, n_microbatches=2),
                            logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
        try:
            getattr(trainer, entry)(model, DataLoader(_Rows(16), batch_size=BATCH))
            refused = ""
        except Exception as err:  # noqa: BLE001 - what the test reports
            refused = f"{type(err).__name__}: {err}"
        got[entry] = refused, all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    return got


class _Broken(nn.Module):
    """A first layer with a bug of the user's: it fails on every input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's layer failed")


class _StepConditions(L.LightningModule):
    """A model that fails where the check before the cut ran it, but not as the step runs it: ``"view"``, a loss written
    for its micro-batch of 8 (``out.view(8, -1)``; the check ran 4 samples); ``"penalty"``, a gradient penalty on the
    output (``torch.autograd.grad``; the check ran without gradients); ``"batchnorm"``, a BatchNorm predicting one sample
    (in eval mode, as predict runs it; the check ran the module in train mode); ``"frozen"``, the penalty with a BatchNorm
    the user keeps in eval mode (a frozen part), trained on micro-batches of one sample (a fit keeps the module's modes,
    so the check must not put it in train mode when it runs the chain again as the step does)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        norm = [nn.BatchNorm1d(16)] if kind in ("batchnorm", "frozen") else []
        self.layers = nn.ModuleList([nn.Linear(4, 16), *norm, nn.ReLU(), nn.Linear(16, CLASSES)])
        if kind == "frozen":
            self.layers[1].eval()

    def loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        if self.kind == "view":
            out = out.view(8, -1)
        loss = F.cross_entropy(out, batch[1])
        if self.kind in ("penalty", "frozen"):
            (grad,) = torch.autograd.grad(out.pow(2).sum(), out, create_graph=True)
            loss = loss + 0.01 * grad.pow(2).mean()
        return loss

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.layers), inputs=lambda b: b[0], loss=self.loss)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self(batch[0]), batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _step_conditions(out: str) -> dict[str, Any]:
    """The "view" model fitted on batches of 16 (2 micro-batches of 8), the "penalty" one on batches of 8, the "frozen"
    one on batches of 2 (the weights, or the error), and the "batchnorm" one's predictions on batches of 1 (or the error)
    with its own in eval mode."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    got: dict[str, Any] = {}
    for kind, batch_size in (("view", 16), ("penalty", BATCH), ("frozen", 2), ("batchnorm", 1)):
        model = _StepConditions(kind)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                            strategy=PipelineStrategy(schedule="gpipe", stages=2, stage_boundaries=[2], n_microbatches=2),
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
        loader = DataLoader(_Rows(16 if kind == "batchnorm" else SAMPLES), batch_size=batch_size)
        try:
            if kind == "batchnorm":
                predicted = trainer.predict(model, loader)
                with torch.no_grad():
                    got[kind] = predicted, [model.eval()(x) for x, _ in loader]
            else:
                trainer.fit(model, loader)
                got[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        except Exception as err:  # noqa: BLE001 - what the test reports
            got[kind] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return got


def _own_errors(rank: int, world: int, out: str) -> dict[str, Any]:
    """Fits (GPipe, stage boundary after layers[1]) of a model whose loss has a shape bug (``"loss"``: the last stage
    fails) or whose first layer raises (``"layer"``: the first stage fails): each rank's error, its notes, and whether
    the module kept its weights; then, in the same processes, the runs of :func:`_step_conditions` (``"conditions"``)."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    got: dict[str, Any] = {}
    for where in ("loss", "layer"):
        model = _OptionalMask("none")
        if where == "layer":
            model.layers[0] = _Broken()
        else:
            model.pipeline_spec = lambda m=model: PipelineSpec(layers=list(m.layers), inputs=lambda b: b[0],
                                                             loss=lambda out, b: F.cross_entropy(out, b[1][:, None]))
        start = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                            strategy=PipelineStrategy(schedule="gpipe", stages=2, stage_boundaries=[2], n_microbatches=2),
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
        try:
            trainer.fit(model, DataLoader(_Rows(), batch_size=BATCH))
            raised, notes = "", []
        except Exception as err:  # noqa: BLE001 - what the test reports
            raised, notes = f"{type(err).__name__}: {err}", list(getattr(err, "__notes__", []))
        got[where] = raised, notes, all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    got["conditions"] = _step_conditions(out)
    return got


def _pairs(items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """A list [inputs, targets] of two tensors alike in rank and dtype, as default_collate makes of (x, y) pairs."""
    x = torch.stack([x for x, _ in items])
    return [x, x.flip(1) * 0.5]


class _PairRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))

    def pipeline_loss(self, out: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(out, batch[1])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.model(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _auto_plan_rechunked(out: str) -> dict[str, torch.Tensor] | str:
    """auto_plan's pipeline over loader batches of 2: its loader re-chunks them into the plan's per-replica batch of 4
    (2 x 2 processes), and answers batch_size with the user's 2."""
    import lightning_distplan  # noqa: F401
    from lightning_distplan.strategies.auto_plan import AutoPlanStrategy

    model = _PairRegression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AutoPlanStrategy(strategy="gpipe", stages=2, n_microbatches=2, profile_repeats=1),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    try:
        trainer.fit(model, DataLoader(_Rows(), batch_size=2, collate_fn=_pairs))
    except Exception as err:  # noqa: BLE001 - what the test reports
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _padded_last_batch_of_a_batch_sampler(out: str) -> tuple[str, int]:
    """35 samples in batches of 8 from a batch sampler of the user's that fills its last batch from the epoch's first
    samples: every batch holds 8, which 2 micro-batches split."""
    from torch.utils.data import BatchSampler

    class Filled(BatchSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            order = list(self.sampler)
            for i in range(0, len(order), self.batch_size):
                batch = order[i:i + self.batch_size]
                yield batch + order[:self.batch_size - len(batch)]

    return _epoch_of_batches_from(Filled, out)


class _ToDict(nn.Module):
    """The hidden state and a per-sample scale (an integer tensor without gradient, as an attention mask is), or
    ``none=True``: None for the scale (an optional mask left out)."""

    def __init__(self, none: bool = False) -> None:
        super().__init__()
        self.none = none

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor | None]:
        return {"hidden": h.relu(), "scale": None if self.none else (h[:, :1] > 0).long() + 1}


class _FromDict(nn.Linear):
    def forward(self, out: dict[str, torch.Tensor | None]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(out["hidden"] if out["scale"] is None else out["hidden"] * out["scale"])


class _HeadDict(nn.Linear):
    def __init__(self, *args: Any, nested: bool = False, total: bool = False) -> None:
        super().__init__(*args)
        self.nested, self.total = nested, total

    def forward(self, h: torch.Tensor) -> dict[str, Any]:  # type: ignore[override]
        logits = super().forward(h)
        if self.total:  # a batch-wide 0-d value beside the logits
            return {"logits": logits, "total": logits.sum()}
        # the hidden state too (the loss does not read it): as a tensor, or in a tuple as Hugging Face's hidden_states
        return {"logits": logits, "hidden": (h,) if self.nested else h}


class _DictOutputs(L.LightningModule):
    """``where="stage"``: a dict between two layers of the second stage (cut at ``boundaries=[2]``, it crosses from the
    first stage to the second); ``"none"``: the same with None among its values; ``"last"``: the last layer returns a dict
    (a Hugging Face style head: the logits and the hidden state) that the loss reads ``out["logits"]`` of; ``"nested"``:
    the same with the hidden state in a tuple; ``"total"``: the logits and their 0-d sum. The stage boundary is after
    layers[0]."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        head = _HeadDict(16, CLASSES, nested=where == "nested", total=where == "total")
        tail = [_ToDict(none=where == "none"), _FromDict(16, CLASSES)] if where in ("stage", "none") else [nn.ReLU(), head]
        self.layers = nn.ModuleList([nn.Linear(4, 16), *tail])

    def loss(self, out: Any, batch: Any) -> torch.Tensor:
        return F.cross_entropy(out if self.where in ("stage", "none") else out["logits"], batch[1])

    def pipeline_spec(self) -> PipelineSpec:
        return PipelineSpec(layers=list(self.layers), inputs=lambda b: b[0], loss=self.loss)

    def forward(self, x: torch.Tensor) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self(batch[0]), batch)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _dict_outputs(out: str) -> dict[str, Any]:
    """The weights after fits of the "stage" and "last" models, the "last" one's predictions on the first 16 samples
    (and the module's own), the "nested" fit's refusal with whether it left the weights as they were, and the "total"
    model's predict's refusal; ``"between"``: the "stage" model's weights after a GPipe and a 1F1B fit with its dict
    crossing the stage boundary, and the "none" model's refusal there with whether it kept its weights."""
    from lightning_distplan.strategies.pipeline import PipelineStrategy

    nested = _DictOutputs("nested")
    start = {k: v.clone() for k, v in nested.state_dict().items()}
    refused = _fit(nested, None, out, boundaries=[1])
    assert isinstance(refused, str), "the fit trained"
    last = _DictOutputs("last")
    trained_last = _fit(last, None, out, boundaries=[1])
    strategy = PipelineStrategy(schedule="gpipe", stages=2, stage_boundaries=[1], n_microbatches=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    predicted = trainer.predict(last, DataLoader(_Rows(16), batch_size=BATCH))
    with torch.no_grad():
        own = [last(x) for x, _ in DataLoader(_Rows(16), batch_size=BATCH)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(schedule="gpipe", stages=2, stage_boundaries=[1], n_microbatches=2),
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    try:
        trainer.predict(_DictOutputs("total"), DataLoader(_Rows(16), batch_size=BATCH))
        total = ""
    except Exception as err:  # noqa: BLE001 - what the test reports
        total = f"{type(err).__name__}: {err}"
    between = {schedule: _fit(_DictOutputs("stage"), None, out, boundaries=[2], schedule=schedule) for schedule in ("gpipe", "1f1b")}
    none = _DictOutputs("none")
    none_start = {k: v.clone() for k, v in none.state_dict().items()}
    between["none"] = (_fit(none, None, out, boundaries=[2]), all(torch.equal(v, none_start[k]) for k, v in none.state_dict().items()))
    return {"total": total, "stage": _fit(_DictOutputs("stage"), None, out, boundaries=[1]), "last": trained_last, "predicted": predicted,
            "between": between,
            "own": own, "nested": (refused, all(torch.equal(v, start[k]) for k, v in nested.state_dict().items()))}


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    model = _ObjectTargets()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    refused = _fit(model, _labels_in_an_object, out)
    whole = all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    return {"weighted": _fit(_WeightedLoss(), _weights_and_label_list, out), "object": (refused, whole), "hooked": _hooked_fit(out),
            "label_sets": _first_layer_calls(out), "batch_sampler": _short_last_batch_of_a_batch_sampler(out),
            "none_in_inputs": _none_refused("inputs", out), "none_in_output": _none_refused("output", out),
            "rechunked": _auto_plan_rechunked(out), "filled": _padded_last_batch_of_a_batch_sampler(out),
            "dict_outputs": _dict_outputs(out), "eval_refused": _eval_refused(out), "own_errors": _own_errors(rank, world, out)}


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ranks = run_on_ranks(_worker, 2, str(tmp_path_factory.mktemp("pipeline_batches")), timeout=280)
    every = ("object", "batch_sampler", "none_in_inputs", "none_in_output", "hooked", "filled", "dict_outputs", "eval_refused", "own_errors")
    return {key: [rank[key] for rank in ranks] if key in every else ranks[0][key] for key in ranks[0]}


def test_a_constant_before_the_rows_and_a_list_of_labels_are_cut_as_one_process_reads_them(fits: dict[str, Any]) -> None:
    """Read by a vote over the targets alone, (class_weights[3], 8 labels in a list) had 3 rows: every micro-batch got
    pieces of the weights and all 8 labels (a shape error deep in the loss). Read as dp_ga and the profiler read the
    loader's batches, it trains as one process does."""
    got = fits["weighted"]
    assert not isinstance(got, str), got
    torch.testing.assert_close(got, _reference(_WeightedLoss(), _weights_and_label_list), rtol=1e-5, atol=1e-6)


def test_a_part_holding_the_rows_as_an_objects_attribute_is_refused_on_every_rank(fits: dict[str, Any]) -> None:
    """dp_ga and the profiler refuse it (uncut_part_found); the pipeline gave each micro-batch's loss all 8 rows of it:
    the last stage failed in the loss and the first saw only its peer gone. Now both ranks refuse it in one sentence,
    and the module keeps its weights."""
    for refused, whole in fits["object"]:
        assert refused.startswith(
            "BatchFormatError: The batch[1] is a _Targets holding the batch's 8 rows, which cannot be cut into the 2 pipeline "
            "micro-batches: the loss of each would get all 8 rows of it beside its own 4 samples. HINT: Make it a tensor"
        ), refused
        assert whole


def test_the_loss_checks_before_the_cut_see_the_batch_the_transfer_hooks_make(fits: dict[str, Any]) -> None:
    """The checks before the model is cut (is the adapter's guessed loss training_step's?) ran on the loader's raw batch,
    not on what on_before_batch_transfer / transfer_batch_to_device / on_after_batch_transfer make of it as Lightning's
    loop does: a dict the hook turns into (inputs, target) failed training_step there, and the fit was refused. Now it
    trains as one process does."""
    got = fits["hooked"][0]
    assert not isinstance(got, str), got
    torch.testing.assert_close(got[0], _hooked_reference(), rtol=1e-5, atol=2e-6)


def test_the_transfer_hooks_run_before_the_cut_leave_no_trace(fits: dict[str, Any]) -> None:
    """Run once more at setup on the first batch, the hooks' side effects stayed: a counter of the batches
    on_before_batch_transfer saw read STEPS + 1 after STEPS steps on every rank (a DDP run counts STEPS). What they
    change on the module goes back, as after the profiler's runs."""
    for got in fits["hooked"]:
        assert not isinstance(got, str), got
        assert got[1] == STEPS, got[1]


def test_targets_of_varying_shapes_build_no_new_schedule(fits: dict[str, Any]) -> None:
    """A schedule was kept per shape of every tensor in the batch, targets included, which never cross a stage: per-sample
    label sets of varying lengths built a new schedule, and ran torch's shape-inference forward once more, at every
    step. Only what the first layer receives decides the shapes crossing the stages."""
    calls, warned, weights = fits["label_sets"]
    torch.testing.assert_close(weights, _reference(_LabelSets(), _label_sets), rtol=1e-5, atol=1e-6)
    # 2 micro-batches a step, the check of the loss before the cut, and one shape-inference forward (the first step)
    assert calls == STEPS * 2 + 2, calls
    assert warned == []


def test_a_short_last_batch_a_batch_sampler_makes_is_refused_before_the_first_step(fits: dict[str, Any]) -> None:
    """Checked for a DataLoader's batch_size only, a BatchSampler's short last batch trained the epoch up to it and then
    failed there; now it is refused before the first step, as the loader's own batch size is."""
    for refused, steps in fits["batch_sampler"]:
        assert refused.startswith(
            "BatchNotFactorableError: Each epoch ends with a batch of 3 samples per replica (35 samples in batches of 8), "
            "which does not split into `n_microbatches` (2) equal micro-batches. HINT: Pass drop_last=True"
        ), refused
        assert steps == 0


def test_a_none_that_would_cross_a_stage_is_refused_before_the_cut_on_every_rank(fits: dict[str, Any]) -> None:
    """A first layer returning (h, None) (its optional mask passed along) with the stage boundary after it: torch's
    runtime failed on stage 0 alone with "PipeliningMetadataError: Stage arg[1] is None. Stage args must be tensors",
    and stage 1 with "Connection closed by peer". Now the check that runs the chain before the cut refuses it on every
    rank in one sentence, with the weights untouched; (x, None) as the first layer's inputs likewise."""
    for refused, whole in fits["none_in_output"]:
        assert refused.startswith(
            "ModelSplitError: PipelineSpec.layers[0] (_MaskedFirst) returned a tuple holding None; only tensors cross between "
            "pipeline stages"
        ), refused
        assert "HINT: Return only the tensors the next layer takes" in refused and whole
    for refused, whole in fits["none_in_inputs"]:
        assert refused.startswith("BatchFormatError: `PipelineSpec.inputs(batch)` gave the first layer None; "), refused
        assert whole


def test_validate_test_and_predict_without_a_fit_refuse_what_a_fit_refuses_on_every_rank(fits: dict[str, Any]) -> None:
    """The checks before the cut ran for fit alone: trainer.validate (test, predict) with no fit before, of a model whose
    first layer's (h, None) crosses the stage boundary, failed at its first batch on rank 0 alone (torch's runtime, or
    StageModule's "ModelSplitError: PipelineSpec.layers[0] (_MaskedFirst) returned a tuple holding None") while rank 1
    saw gloo's "Connection closed by peer". Now each runs the chain on its own loader's first samples before the cut and
    refuses on every rank in the fit's sentence, the weights untouched (predict without the loss)."""
    for got in fits["eval_refused"]:
        for entry, (refused, whole) in got.items():
            assert refused.startswith(
                "ModelSplitError: PipelineSpec.layers[0] (_MaskedFirst) returned a tuple holding None; only tensors cross "
                "between pipeline stages"
            ), (entry, refused)
            assert "HINT: Return only the tensors the next layer takes" in refused and whole, entry


def test_the_models_own_error_before_the_cut_is_raised_on_every_rank(fits: dict[str, Any]) -> None:
    """A loss with a shape bug (or a first layer that raises): the check before the cut ran the chain on every rank, saw
    the error and let it pass, so the first step raised it on the one rank whose stage holds the loss (or the layer),
    and the other rank got only gloo's "RuntimeError: Connection closed by peer". Now every rank agrees on the failure
    before the cut and raises the model's own error as it is, with a note saying where it ran; the weights are kept.
    (Run last in the fixture's launch: with the errors on one rank, the next fit in the same processes hung until the
    timeout.)"""
    expected = {"loss": "RuntimeError: 0D or 1D target tensor expected, multi-target not supported",
                "layer": "ValueError: the user's layer failed"}
    ranks = fits["own_errors"]
    for got in ranks:
        for where in expected:
            raised, notes, whole = got[where]
            assert raised == expected[where], (where, raised)
            assert any("as the first step runs them (a micro-batch of 4 sample(s) of the run's first batch, with gradients) "
                       "before the model was cut; every rank stops here" in note for note in notes), notes
            assert whole, where
    _check_step_conditions([got["conditions"] for got in ranks])


def _check_step_conditions(ranks: list[dict[str, Any]]) -> None:
    """What the fixture's launch ran after test_the_models_own_error_before_the_cut_is_raised_on_every_rank's errors (in
    the same processes, which the errors left clean): models that fail only where the check before the cut ran them. Raised from
    the check, the loss written for its micro-batch of 8 (RuntimeError: shape '[8, -1]' is invalid for input of size 12),
    the gradient penalty (element 0 of tensors does not require grad) and the BatchNorm of one sample predicting (Expected
    more than 1 value per channel when training) were each refused on both ranks, though each runs as a pipeline: the
    check now runs a failing chain again as the step does (the first micro-batch's rows, gradients in a fit, eval mode
    in predict; a fit keeps the module's modes, so the frozen BatchNorm of one sample is not put in train mode) and
    raises only what fails there too. They train (the penalty's and the frozen one's weights are one process's) and
    predict as the module does."""
    for got in ranks:
        for kind in ("view", "penalty", "frozen"):
            assert not isinstance(got[kind], str), (kind, got[kind])
        assert not isinstance(got["batchnorm"], str), got["batchnorm"]
        predicted, own = got["batchnorm"]
        torch.testing.assert_close(predicted, own)
    torch.testing.assert_close(ranks[0]["penalty"], _reference(_StepConditions("penalty"), None), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["frozen"], _reference(_StepConditions("frozen"), None, batch_size=2), rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(v).all() for v in ranks[0]["view"].values())
    assert not torch.equal(ranks[0]["view"]["layers.0.weight"], _StepConditions("view").layers[0].weight)


def test_a_dict_from_the_last_layer_trains_and_predicts_and_passes_inside_a_stage(fits: dict[str, Any]) -> None:
    """A last layer returning {"logits": ..., "hidden": ...} (the loss reading out["logits"]): torch's runtime takes only
    tensors from the last stage too, and its shape inference refused the dict ("PipeliningMetadataError: Stage args must
    be a tensor, tuple, or list of tensors, got dict"), so the fit was refused before the cut. Now the last stage passes
    the dict's tensors in key order and the strategy builds the dict again for the loss and for predict: it trains as one
    process does, and predict returns the module's own dicts. A tuple among its values is still refused before the cut on
    every rank in one sentence, the weights untouched. A dict between two layers of one stage, which torch never sees,
    trains as one process does."""
    for got in fits["dict_outputs"]:
        refused, whole = got["nested"]
        assert refused.startswith(
            "ModelSplitError: PipelineSpec.layers[2] (_HeadDict), the last layer, returned a dict holding a tuple under "
            "'hidden'; torch's pipelining runtime takes only tensors from the last stage"
        ), refused
        assert "HINT: Return only the tensors the loss needs" in refused and whole
        for key in ("stage", "last"):
            assert not isinstance(got[key], str), got[key]
        assert [list(p) for p in got["predicted"]] == [["logits", "hidden"]] * 2
        torch.testing.assert_close(got["predicted"], got["own"])
    rank0 = fits["dict_outputs"][0]
    torch.testing.assert_close(rank0["stage"], _reference(_DictOutputs("stage"), None), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rank0["last"], _reference(_DictOutputs("last"), None), rtol=1e-5, atol=1e-6)


def test_a_dict_crossing_the_stage_boundary_trains_as_one_process_with_gpipe_and_1f1b(fits: dict[str, Any]) -> None:
    """A layer returning {"hidden": h, "scale": s} (s an integer tensor without gradient, as an attention mask) where the
    first stage ends, the next layer reading both: it was refused before the cut on every rank ("PipelineSpec.layers[1]
    (_ToDict) returned a dict; only tensors cross between pipeline stages"). Now its tensors cross in key order and the
    second stage's first layer gets the dict again: GPipe and 1F1B train to the one-process training_step's weights on
    every rank. None among its values is still refused before the cut on every rank in one sentence, weights untouched."""
    reference = _reference(_DictOutputs("stage"), None)
    for got in fits["dict_outputs"]:
        for schedule in ("gpipe", "1f1b"):
            assert not isinstance(got["between"][schedule], str), (schedule, got["between"][schedule])
            torch.testing.assert_close(got["between"][schedule], reference, rtol=1e-5, atol=1e-6)
        refused, whole = got["between"]["none"]
        assert refused.startswith(
            "ModelSplitError: PipelineSpec.layers[1] (_ToDict) returned a dict holding None under 'scale'; only tensors cross "
            "between pipeline stages, so the pipeline passes a mapping's tensors and builds it again for the next stage's first layer"
        ), refused
        assert "HINT: Return only the tensors the next layer takes, as a flat dict" in refused and whole


def test_predict_of_a_last_layers_0d_value_is_refused_before_the_cut_on_every_rank(fits: dict[str, Any]) -> None:
    """A last layer returning {"logits": ..., "total": logits.sum()}: predict joins the micro-batches' outputs along dim 0
    (torch.cat), which failed on the last stage alone ("RuntimeError: zero-dimensional tensor (at position 0) cannot be
    concatenated") while the first saw gloo's "Connection closed by peer" (a [3] bias would have been joined into a [6]
    one, silently). Now predict's check before the cut refuses it on every rank in one sentence."""
    for got in fits["dict_outputs"]:
        assert got["total"].startswith(
            "ModelSplitError: PipelineSpec.layers[2] (_HeadDict), the last layer, returned a tensor of shape () under 'total' "
            "for 4 sample(s); predict joins the micro-batches' outputs along dim 0"
        ), got["total"]
        assert "HINT: Return per-sample tensors only from the last layer" in got["total"]


def test_a_packed_sequence_between_two_layers_of_one_stage_goes_whole() -> None:
    """A layer that packs padded sequences by their lengths, then nn.LSTM, in one stage: the PackedSequence (a
    namedtuple) was unpacked into four positional arguments of the LSTM, which failed with "LSTM.forward() takes from 2
    to 3 positional arguments but 5 were given". It goes whole now, and the stage computes what the module computes."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class Pack(nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> Any:
            return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)

    class LastHidden(nn.Module):
        def forward(self, output: Any, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return state[0][-1]

    torch.manual_seed(0)
    lstm = nn.LSTM(3, 5, batch_first=True)
    x, lengths = torch.randn(4, 6, 3), torch.tensor([6, 2, 4, 1])
    got = StageModule([Pack(), lstm, LastHidden()])(x, lengths)
    torch.testing.assert_close(got, lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))[1][0][-1])


def test_a_rechunking_loaders_batches_are_read_at_the_size_it_yields(fits: dict[str, Any]) -> None:
    """auto_plan's loader yields the plan's per-replica batch (4) but answers batch_size with the user's loader's (2): read
    against 2, a list [x[4, 4], y[4, 4]] was taken for 2 samples (the list's two items) and the fit refused "inputs(batch)
    holds tensors of 4 rows, but the per-replica batch holds 2 samples". Read at 4, it trains as one process does on
    batches of 4."""
    got = fits["rechunked"]
    assert not isinstance(got, str), got
    torch.testing.assert_close(got, _reference(_PairRegression(), _pairs, batch_size=4), rtol=1e-5, atol=1e-6)


def test_a_batch_sampler_that_fills_its_last_batch_is_not_refused(fits: dict[str, Any]) -> None:
    """Its length and sampler say 35 samples in batches of 8, but it fills the last batch to 8: read by its batch_size,
    drop_last and sampler alone, the fit was refused for a last batch of 3 it never yields. A batch sampler with its own
    __iter__ is left to the step; the epoch's 5 batches train."""
    for refused, steps in fits["filled"]:
        assert refused == "", refused
        assert steps == 5
