"""Micro-batches are cut from the loader's real batches: exact size, nested structures, repetition."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightning_distplan.demos import RandomImageData, RandomTokenData
from lightning_distplan.profiling._batches import SampleBank, batch_size_of, device_bytes, move_to
from lightning_distplan.profiling._errors import DataLoadingError, ProfilingError

Pair = namedtuple("Pair", "x y")


def _loader(n: int = 3, b: int = 4):
    for i in range(n):
        base = torch.arange(i * b, (i + 1) * b)
        yield {"ids": base.view(b, 1).expand(b, 3).clone(), "extra": Pair(base.float(), [f"s{j}" for j in base.tolist()]), "scale": torch.tensor(2.0)}


def test_exact_sizes_across_batches_and_nesting() -> None:
    bank = SampleBank(_loader())
    assert bank.first_batch_size() == 4
    for m in (1, 3, 4, 6, 12):
        mb = bank.micro_batch(m)
        assert batch_size_of(mb) == m
        assert mb["ids"][:, 0].tolist() == list(range(m))  # the loader's first m samples, in order
        assert isinstance(mb["extra"], Pair) and mb["extra"].y == [f"s{j}" for j in range(m)]
        assert mb["scale"].dim() == 0
    assert not bank.repeated


def test_repeats_samples_when_loader_is_short() -> None:
    bank = SampleBank(_loader(n=1, b=2))
    mb = bank.micro_batch(5)
    assert batch_size_of(mb) == 5 and bank.repeated
    assert mb["ids"][:, 0].tolist() == [0, 1, 0, 1, 0]


def test_loader_errors_are_clear() -> None:
    def broken():
        raise FileNotFoundError("data/wikitext-2.txt")
        yield  # pragma: no cover

    with pytest.raises(DataLoadingError, match="FileNotFoundError.*HINT"):
        SampleBank(broken()).first_batch_size()
    with pytest.raises(ProfilingError, match="no tensor with a batch dimension"):
        SampleBank([["a", "b"]]).first_batch_size()


def test_demo_data_is_deterministic_and_shaped() -> None:
    dm = RandomTokenData(vocab_size=50, block_size=7, batch_size=3, num_samples=9)
    dm.setup("fit")
    (x, y), (x2, y2) = next(iter(dm.train_dataloader())), next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (3, 7) and x.dtype == torch.long and int(x.max()) < 50
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])  # target = inputs shifted by one
    state = torch.get_rng_state()
    img, label = next(iter(RandomImageData(num_classes=5, image_size=8, batch_size=2, num_samples=4).train_dataloader()))
    assert img.shape == (2, 3, 8, 8) and label.shape == (2,) and int(label.max()) < 5
    assert torch.equal(torch.get_rng_state(), state)  # own generators: the global RNG is untouched
    with pytest.raises(ValueError, match="batch_size.*HINT"):
        RandomTokenData(batch_size=0)


class _StampedData(torch.utils.data.Dataset):
    """Each sample read appends the time to a file: worker processes report too."""

    def __init__(self, path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        import time

        with open(self.path, "a") as f:
            f.write(f"{time.monotonic()}\n")
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(4, generator=g)


def test_loader_workers_read_nothing_while_steps_are_timed(tmp_path) -> None:
    """With num_workers > 0 the loader's workers would go on prefetching during the timed steps and take
    the cores the steps run on (3-5x slower CPU steps measured): every sample is read before the first step."""
    import time

    from lightning_distplan.profiling import profile_module

    from _profiling_models import MLP

    stamps = tmp_path / "reads.txt"
    first_step: list[float] = []

    class Stamped(MLP):
        def training_step(self, batch, batch_idx=0):
            first_step.append(first_step[0] if first_step else time.monotonic())
            return super().training_step(batch, batch_idx)

    loader = torch.utils.data.DataLoader(_StampedData(stamps), batch_size=4, num_workers=2, multiprocessing_context="fork")
    profile_module(Stamped(), loader, micro_batch_sizes=[2, 4, 8], repeats=1)
    reads = [float(line) for line in stamps.read_text().split()]
    assert first_step and reads and max(reads) < first_step[0], (len(reads), max(reads) - first_step[0])


def _detection_batch(first: int, boxes: list[int]):
    """What default_collate and a detection collate_fn give: images, file names, one target dict per image."""
    n = len(boxes)
    images = torch.arange(first, first + n).float().view(n, 1, 1, 1).expand(n, 3, 2, 2)
    targets = [{"boxes": torch.full((k, 4), float(first + i)), "labels": torch.zeros(k, dtype=torch.long)} for i, k in enumerate(boxes)]
    return {"images": images, "names": [f"img_{first + i}.png" for i in range(n)], "targets": targets, "tag": ("train", "v2")}


def test_per_sample_lists_are_cut_with_their_samples() -> None:
    """File names and per-image target dicts go with their images, a target whose number of boxes equals the
    batch size is not cut row-wise, and a constant pair of tags (2 items, batch of 4) stays whole. dp_ga's
    re-chunking and the profiler's micro-batches use the same rules."""
    from lightning_distplan.strategies.dp_ga import _rebatch

    batches = [_detection_batch(0, [2, 3, 4, 5]), _detection_batch(4, [1, 4, 1, 2])]
    for micro, firsts in ((list(_rebatch(batches, 2)), [0, 2, 4, 6]), (list(_rebatch(batches, 3)), [0, 3, 6])):
        assert [mb["names"][0] for mb in micro] == [f"img_{f}.png" for f in firsts]
        for mb in micro:
            ids = mb["images"][:, 0, 0, 0].long().tolist()
            assert mb["names"] == [f"img_{i}.png" for i in ids]
            assert [int(t["boxes"][0, 0]) for t in mb["targets"]] == ids  # each image keeps its own target
            assert mb["tag"] == ("train", "v2")
        assert [t["boxes"].shape[0] for mb in micro for t in mb["targets"]] == [2, 3, 4, 5, 1, 4, 1, 2]
    bank = SampleBank(iter(batches))
    mb = bank.micro_batch(6)
    assert mb["names"] == [f"img_{i}.png" for i in range(6)] and [t["boxes"].shape[0] for t in mb["targets"]] == [2, 3, 4, 5, 1, 4]
    assert mb["tag"] == ("train", "v2") and batch_size_of(mb) == 6


def test_pipeline_micro_batches_follow_the_same_rules() -> None:
    """The pipeline's split into n micro-batches: per-image targets go with their images (each micro-batch got all
    of them), a UserDict such as transformers' BatchEncoding is split and keeps its type (it was passed whole),
    and a 0-d field goes whole to every micro-batch (tensor_split raised on it)."""
    from collections import UserDict

    from lightning_distplan.strategies._pipeline_split import split_structure

    class Encoding(UserDict):
        pass

    batch = _detection_batch(0, [2, 3, 4, 5])
    batch["text"] = Encoding(input_ids=torch.arange(8).view(4, 2), attention_mask=torch.ones(4, 2))
    batch["temperature"] = torch.tensor(2.0)
    chunks = split_structure(batch, 2)
    assert [c["names"] for c in chunks] == [["img_0.png", "img_1.png"], ["img_2.png", "img_3.png"]]
    assert [[t["boxes"].shape[0] for t in c["targets"]] for c in chunks] == [[2, 3], [4, 5]]
    assert all(isinstance(c["text"], Encoding) for c in chunks) and chunks[1]["text"]["input_ids"].tolist() == [[4, 5], [6, 7]]
    assert all(c["temperature"].item() == 2.0 for c in chunks) and chunks[1]["tag"] == ("train", "v2")


def test_batches_padded_to_their_own_length_are_not_joined_silently_or_with_a_torch_error() -> None:
    from lightning_distplan.errors import BatchFormatError

    bank = SampleBank(iter([(torch.ones(4, 5), torch.ones(4)), (torch.ones(4, 7), torch.ones(4))]))
    assert batch_size_of(bank.micro_batch(4)) == 4  # within one loader batch: fine
    with pytest.raises(BatchFormatError, match=r"different shapes \(\[5\] vs \[7\]\).*HINT: Use micro-batches no larger than the loader's batch"):
        bank.micro_batch(8)


def test_a_tuple_as_long_as_the_batch_is_structure_and_records_are_per_sample() -> None:
    """(x, y, w) on a short last batch of 3 samples is the batch's structure, whatever w is (a 0-d weight, class
    weights); a list of target dicts with the same keys is one per sample even when each has n boxes or n is 1."""
    from lightning_distplan.profiling._batches import concat_samples, slice_samples

    x, y = torch.arange(6.0).view(3, 2), torch.arange(3)
    for w in (torch.tensor(0.5), torch.ones(10)):
        part = slice_samples((x, y, w), 0, 2, 3)
        assert isinstance(part, tuple) and part[0].shape == (2, 2) and part[1].tolist() == [0, 1] and part[2] is w
    targets = [{"boxes": torch.zeros(2, 4)}, {"boxes": torch.ones(2, 4)}]  # n = 2 boxes each, batch of 2
    assert [t["boxes"].shape[0] for t in slice_samples((torch.zeros(2, 3), targets), 0, 1, 2)[1]] == [2]
    one = [(torch.zeros(1, 3), [{"boxes": torch.zeros(1, 4)}]), (torch.ones(1, 3), [{"boxes": torch.ones(3, 4)}])]  # loader batch 1
    joined = concat_samples(one, [1, 1])
    assert joined[0].shape == (2, 3) and [t["boxes"].shape[0] for t in joined[1]] == [1, 3]


def test_device_bytes_counts_what_a_micro_batch_holds_on_the_device() -> None:
    """The profiler's memory line counts the micro-batch's own input (a fit copies each one to the device)."""
    cpu = torch.device("cpu")
    mb = next(_loader(b=6))  # fresh tensors, as a copy to the device makes them
    ids, x = mb["ids"], mb["extra"].x
    assert device_bytes(mb, cpu) == ids.nbytes + x.nbytes + mb["scale"].nbytes == 6 * 3 * 8 + 6 * 4 + 4  # nested, non-tensors skipped
    assert device_bytes(move_to(SampleBank(_loader()).micro_batch(2), cpu), cpu) > 0
    assert device_bytes({"a": ids, "view": ids[:2], "t": ids.t()}, cpu) == ids.nbytes  # views share one storage
    on_meta = torch.empty(1000, device="meta")
    assert device_bytes([ids, on_meta], cpu) == ids.nbytes  # another device's tensors are not this one's
    assert device_bytes([ids], torch.device("cuda", 0)) == 0


def test_micro_batches_start_where_training_step_trains_when_it_skips_the_first_samples() -> None:
    """Lightning's documented skip (training_step returns None) on the loader's first samples: the profiler cuts its
    micro-batches from the next ones instead of failing a fit DDP runs; when it skips every sample it is one
    ProfilingError that says so."""
    import lightning as L
    import torch.nn.functional as F

    from lightning_distplan.profiling import profile_module

    class SkipsMissing(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.trained_on: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            keep = ~torch.isnan(y).any(1)
            if not keep.any():
                return None
            return F.mse_loss(self.lin(x[keep]), y[keep])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    y[:4] = float("nan")  # the first samples have no target
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    profile = profile_module(SkipsMissing(), loader, repeats=1)
    assert len(profile.micro_batch_sizes) >= 3
    bank = SampleBank(loader)
    bank.start = 6  # wraps around the collected samples
    bank.prefetch(8)
    assert torch.equal(bank.micro_batch(4)[0], torch.cat([x[6:8], x[0:2]]))
    y[:] = float("nan")
    with pytest.raises(ProfilingError, match=r"training_step returned None \(Lightning's 'skip this batch'\).*HINT: .*strategy='ddp'"):
        profile_module(SkipsMissing(), loader, repeats=1)

    class SkipsAny(SkipsMissing):  # skips a whole micro-batch holding one bad sample: larger sizes hold it too
        def training_step(self, batch, batch_idx):
            return None if torch.isnan(batch[1]).any() else super().training_step(batch, batch_idx)

    y[:] = torch.randn(32, 1, generator=g)
    y[3] = float("nan")
    lines: list[str] = []
    profile = profile_module(SkipsAny(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
                             micro_batch_sizes=[2, 4, 8], repeats=1, progress=lines.append)
    assert profile.micro_batch_sizes == (2,) and profile.rejected_micro_batch_sizes == ()  # 4 and 8 train; they were not timed
    assert sum("training_step skipped it (returned None); not profiled" in line for line in lines) == 2, lines


def test_dataclass_batches_are_cut_without_running_post_init_again() -> None:
    """A dataclass batch is rebuilt as Lightning rebuilds it (copy, set fields): a __post_init__ that converted its
    fields (NHWC -> NCHW) is not run on the converted values again; frozen ones work too."""
    import dataclasses

    from lightning_distplan.profiling._batches import concat_samples, slice_samples

    @dataclasses.dataclass(frozen=True)
    class Images:
        x: torch.Tensor
        y: torch.Tensor

        def __post_init__(self) -> None:
            object.__setattr__(self, "x", self.x.permute(0, 3, 1, 2))  # NHWC from the collate -> NCHW

    batch = Images(torch.randn(8, 32, 32, 3), torch.arange(8))
    assert batch_size_of(batch) == 8
    assert move_to(batch, torch.device("cpu")).x.shape == (8, 3, 32, 32)
    half = slice_samples(batch, 0, 4, 8)
    assert half.x.shape == (4, 3, 32, 32) and torch.equal(half.y, torch.arange(4))
    assert concat_samples([half, half], [4, 4]).x.shape == (8, 3, 32, 32)


def test_a_per_batch_constant_before_the_inputs_is_kept_and_the_samples_are_cut() -> None:
    """A collate that puts 10 class weights before 8 samples: a tie of first dimensions that the majority vote gave to
    the weights, so the profiler's "micro-batch of 4" was 4 weights and all 8 samples (of 16: 16 weights, 8 samples)
    while dp_ga, reading the loader's batch size, cut the samples. Both now cut the samples."""
    from torch.utils.data import DataLoader

    from lightning_distplan.strategies.dp_ga import _rebatch_pieces, loader_batch_size

    weights = torch.arange(10.0)
    loader = DataLoader(torch.arange(32.0).view(32, 1), batch_size=8, collate_fn=lambda rows: (weights, torch.stack(rows)))
    bank = SampleBank(loader)
    assert bank.first_batch_size() == 8
    for m in (4, 16):
        w, x = bank.micro_batch(m)
        assert torch.equal(w, weights) and x[:, 0].tolist() == list(range(m))
    (w, x), _ = next(_rebatch_pieces(loader, 4, loader_batch_size(loader)))
    assert torch.equal(w, weights) and x.shape == (4, 1)  # what training's micro-batch of 4 holds


def test_a_batch_that_is_a_list_of_variable_length_sequences_is_cut_by_sequence() -> None:
    """A collate that returns the samples as they are (a list of 4 sequences of lengths 5, 3, 5, 7): the lengths voted
    on the batch size (5), so a "micro-batch of 2" was the 4 sequences cut to 2 tokens, and one of 8 was 4 sequences
    glued out of several. Now the list's length is the batch size, in the profiler and in dp_ga's re-chunking."""
    from torch.utils.data import DataLoader

    from lightning_distplan.strategies.dp_ga import _rebatch

    lengths = [5, 3, 5, 7, 2, 6, 5, 4]
    loader = DataLoader([torch.arange(k) for k in lengths], batch_size=4, collate_fn=lambda items: items)
    bank = SampleBank(loader)
    assert bank.first_batch_size() == 4
    for m in (2, 4, 8):
        assert [len(seq) for seq in bank.micro_batch(m)] == lengths[:m]
    assert [[len(seq) for seq in mb] for mb in _rebatch(loader, 3)] == [[5, 3, 5], [7, 2, 6], [5, 4]]
    # a list of equally long rows is still the batch's structure: [x, y] as default_collate returns (x, y) samples
    assert batch_size_of([torch.zeros(6, 2), torch.zeros(6, 2)]) == 6


def test_packed_sequences_are_cut_and_joined_by_sequence() -> None:
    """A collate that packs its variable-length sequences (pack_sequence): the PackedSequence was a namedtuple of
    tensors whose first dimensions are no batch size, so a "micro-batch of 2" kept all 4 sequences' data with 2 of
    its indices, and one of 8 the first batch's data with 8 indices: a GRU ran on 4 sequences either way."""
    from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence
    from torch.utils.data import DataLoader

    from lightning_distplan.strategies.dp_ga import _rebatch

    lengths = [5, 3, 6, 2, 4, 4, 3, 5]
    seqs = [torch.full((k, 3), float(i)) for i, k in enumerate(lengths)]
    loader = DataLoader(seqs, batch_size=4, collate_fn=lambda items: (pack_sequence(items, enforce_sorted=False), torch.tensor([s[0, 0] for s in items])))
    bank = SampleBank(loader)
    assert bank.first_batch_size() == 4
    for m in (2, 4, 8):
        packed, y = bank.micro_batch(m)
        assert isinstance(packed, PackedSequence) and packed.data.shape[0] == sum(lengths[:m])
        assert [int(s[0, 0]) for s in unpack_sequence(packed)] == y.long().tolist() == list(range(m))  # each with its label
    assert [sum(len(s) for s in unpack_sequence(mb[0])) for mb in _rebatch(loader, 3)] == [14, 10, 8]
    moved = move_to(bank.micro_batch(2), torch.device("cpu"))[0]
    assert isinstance(moved, PackedSequence) and moved.batch_sizes.device.type == "cpu"


def test_a_batch_part_holding_the_rows_in_a_form_that_is_not_cut_is_named_before_any_step_is_timed() -> None:
    """An object of the user's with tensors as attributes (numpy arrays were refused too; they are now cut) of the
    batch's rows went whole into every profiled micro-batch, and training_step failed with a shape error that the
    profiler blamed on training_step."""
    import numpy as np

    class Targets:
        def __init__(self, y: torch.Tensor) -> None:
            self.y = y

    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16))
    for part, name in ((Targets, "Targets"),):
        loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=lambda items, part=part: (
            torch.stack([x for x, _ in items]), part(torch.stack([y for _, y in items]))))
        with pytest.raises(ProfilingError, match=rf"batch\[1\] is a {name} holding the batch's 8 rows, which cannot be cut.*HINT: Make it a tensor"):
            SampleBank(loader).micro_batch(2)
    # constants and per-sample lists are not such parts
    bank = SampleBank(iter([{"x": torch.randn(8, 3), "names": [str(i) for i in range(8)], "temperature": 0.5, "w": np.ones(3)}]))
    assert bank.micro_batch(2)["names"] == ["0", "1"]
    # a numpy array of the rows is cut (and joined across loader batches) as a tensor is; a constant one is kept
    ids = torch.utils.data.DataLoader(list(range(12)), batch_size=4, collate_fn=lambda items: (torch.tensor(items).float(), np.array(items), np.ones(3)))
    bank = SampleBank(ids)
    x, got, w = bank.micro_batch(6)
    assert isinstance(got, np.ndarray) and got.tolist() == x.long().tolist() == [0, 1, 2, 3, 4, 5] and w.shape == (3,)


def test_a_list_batch_is_read_at_the_loader_batch_size_where_the_lists_rule_misses_it() -> None:
    """A list of tensors alike in rank and dtype with differing first dimensions is a list of samples, except where the
    loader's batch size says otherwise: a collate returning [class_weights[10], x[8]] (batch_size=8) was read as 2
    samples, so the profiler's "micro-batch of 4" and dp_ga's were [w, x, w, x]; and a list of 4 equally long
    sequences (batch_size=4) is 4 samples, not 5 tokens."""
    from torch.utils.data import DataLoader

    from lightning_distplan.strategies.dp_ga import _rebatch_pieces, loader_batch_size

    weights = torch.arange(10.0)
    loader = DataLoader(torch.arange(32.0), batch_size=8, collate_fn=lambda rows: [weights, torch.stack(rows)])
    bank = SampleBank(loader)
    assert bank.first_batch_size() == 8
    for m in (4, 16):
        w, x = bank.micro_batch(m)
        assert torch.equal(w, weights) and x.tolist() == list(range(m))
    (w, x), _ = next(_rebatch_pieces(loader, 4, loader_batch_size(loader)))
    assert torch.equal(w, weights) and x.tolist() == [0.0, 1.0, 2.0, 3.0]

    lengths = [5, 5, 5, 5, 3, 6, 2, 7]
    loader = DataLoader([torch.arange(k) for k in lengths], batch_size=4, collate_fn=lambda items: items)
    bank = SampleBank(loader)
    assert bank.first_batch_size() == 4
    for m in (2, 6):
        assert [len(seq) for seq in bank.micro_batch(m)] == lengths[:m]
    assert [[len(seq) for seq in mb] for mb, _ in _rebatch_pieces(loader, 3, 4)] == [[5, 5, 5], [5, 3, 6], [2, 7]]
