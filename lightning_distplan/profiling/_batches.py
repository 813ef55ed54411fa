"""Build micro-batches of exactly ``m`` samples from the batches a loader really yields.

A batch is a tensor or a nested tuple / list / dict / dataclass of them (plus per-sample lists such
as a list of strings); samples are along dim 0 of every tensor. Batches are concatenated and sliced,
so a micro-batch of 32 from a loader of batch size 8 holds the loader's first 32 samples.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence

from lightning_distplan.errors import BatchFormatError, InfeasiblePlanError
from lightning_distplan.profiling._errors import DataLoadingError, ProfilingError

__all__ = [
    "BatchSizer", "SampleBank", "batch_size_of", "concat_samples", "device_bytes", "find_batch_size", "loader_batch_size", "move_to",
    "slice_samples", "tensors_in", "uncut_part", "uncut_part_found",
]


def _is_record(x: Any) -> bool:
    """A dataclass instance (Lightning moves and collates them like dicts): its init fields are the batch's parts."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _fields_of(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if hasattr(record, f.name)}


def _rebuild_record(like: Any, items: dict[str, Any]) -> Any:
    """A copy of ``like`` with ``items`` set, as Lightning's ``apply_to_collection`` does: ``__init__`` and
    ``__post_init__`` are not run again on values they already converted (a frozen dataclass too)."""
    record = copy.copy(like)
    for name, value in items.items():
        object.__setattr__(record, name, value)
    return record


def refuse_several_loaders(loader: Any, *, hint: str, source: str = "The fit has") -> None:
    """Refuse what a ``train_dataloader()`` hook returns when it is several loaders (a dict, list or tuple of them, or a
    ``CombinedLoader``): ``training_step`` then gets their combined batch, which profiling one loader's batches would
    not give it, and one plan cannot re-chunk loaders of different batch sizes.

    ``source`` begins the sentence (the CLI names the hook that returned them).

    Raises:
        InfeasiblePlanError: ``loader`` is several loaders.
    """
    from lightning.pytorch.utilities import CombinedLoader

    if isinstance(loader, (CombinedLoader, Mapping, list, tuple)):
        raise InfeasiblePlanError(
            f"{source} a {type(loader).__name__} of train dataloaders, and planning profiles one train loader with the batches "
            "training_step gets.",
            hint=hint,
        )


def tensors_in(batch: Any) -> Iterator[Tensor]:
    """Every tensor in a (nested) tuple / list / mapping, in order."""
    for _, _, tensor in _tensors_with_paths(batch, (), False):
        yield tensor


def device_bytes(batch: Any, device: torch.device) -> int:
    """Bytes the tensors of ``batch`` hold on ``device`` (each storage once: views of one tensor share it)."""
    storages: dict[int, int] = {}
    for tensor in tensors_in(batch):
        here = tensor.device
        if here.type == device.type and (here.index is None or device.index is None or here.index == device.index):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tensors_with_paths(batch: Any, path: tuple, in_list: bool) -> Iterator[tuple[tuple, bool, Tensor]]:
    """``(path, inside a list?, tensor)`` for every tensor, in order; the path is the keys / indices to it."""
    if isinstance(batch, Tensor):
        yield path, in_list, batch
    elif isinstance(batch, Mapping) or _is_record(batch):
        for key, value in (batch.items() if isinstance(batch, Mapping) else _fields_of(batch).items()):
            yield from _tensors_with_paths(value, (*path, key), in_list)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _tensors_with_paths(value, (*path, i), in_list or isinstance(batch, list))


def _packed_size(x: PackedSequence) -> int:
    """Sequences in a ``PackedSequence``: its first time step holds one element of every sequence."""
    return int(x.batch_sizes[0]) if x.batch_sizes.numel() else 0


def _sized_leaves(batch: Any, path: tuple, in_list: bool) -> Iterator[tuple[tuple, bool, int]]:
    """``(path, inside a list?, samples)`` of every tensor that is not 0-d (its dim 0) and every ``PackedSequence`` (its
    sequences: its own tensors' first dimensions are the tokens of all of them, the steps, and two index vectors)."""
    if isinstance(batch, PackedSequence):
        yield path, in_list, _packed_size(batch)
    elif isinstance(batch, Tensor):
        if batch.dim() > 0:
            yield path, in_list, int(batch.shape[0])
    elif isinstance(batch, Mapping) or _is_record(batch):
        for key, value in (batch.items() if isinstance(batch, Mapping) else _fields_of(batch).items()):
            yield from _sized_leaves(value, (*path, key), in_list)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _sized_leaves(value, (*path, i), in_list or isinstance(batch, list))


def _sized(batch: Any) -> list[tuple[tuple, int]]:
    """``(path, dim 0)`` of the tensors that vote on the batch size: the (not 0-d) ones outside lists (a list holds
    per-sample records, a detection target's boxes say, with first dimensions of their own), a ``PackedSequence`` with
    its number of sequences. When every tensor is in a list, ``(path, length)`` of the lists that hold one record per
    sample (:func:`_sample_lists`), else every tensor."""
    found = list(_sized_leaves(batch, (), False))
    outside = [(path, n) for path, in_list, n in found if not in_list]
    return outside or list(_sample_lists(batch, ())) or [(path, n) for path, _, n in found]


def _sample_lists(batch: Any, path: tuple) -> Iterator[tuple[tuple, int]]:
    """``(path, length)`` of the outermost lists that are one record per sample, whatever the batch size: tensors alike in
    rank and dtype whose first dimensions differ (variable-length sequences a collate left unpadded), or mappings
    with the same keys. Their tensors' own first dimensions are lengths, not the batch size: a list of 4 sequences of
    lengths 5, 3, 5, 7 was read as a batch of 5, its sequences cut to the micro-batch size and glued together."""
    if isinstance(batch, PackedSequence):
        return
    if isinstance(batch, list) and batch:
        first = batch[0]
        if all(isinstance(v, Tensor) for v in batch):
            if first.dim() > 0 and all(v.dim() == first.dim() and v.dtype == first.dtype for v in batch) and len({v.shape[0] for v in batch}) > 1:
                yield path, len(batch)
                return
        elif all(isinstance(v, Mapping) for v in batch) and all(v.keys() == first.keys() for v in batch):
            yield path, len(batch)
            return
    if isinstance(batch, Mapping) or _is_record(batch):
        for key, value in (batch.items() if isinstance(batch, Mapping) else _fields_of(batch).items()):
            yield from _sample_lists(value, (*path, key))
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _sample_lists(value, (*path, i))


def _most_shared(sized: list[tuple[tuple, int]]) -> int:
    sizes = [n for _, n in sized]
    counts = Counter(sizes)
    return max(counts, key=lambda n: (counts[n], -sizes.index(n)))


def find_batch_size(batch: Any) -> int | None:
    """Samples in ``batch``: the dim 0 most of its tensors outside lists share, the first one's on a tie; None when
    it holds none.

    Most, not the first: a batch may also carry a tensor that is not per sample (class weights, a
    temperature), and a dict puts it wherever its keys do. Outside lists: tensors inside per-sample
    records (a detection target's boxes, one dict per image) have their own first dimensions. A
    stream of batches is better read by :class:`BatchSizer`, which knows the loader's batch size.
    """
    sized = _sized(batch)
    return _most_shared(sized) if sized else None


class BatchSizer:
    """:func:`find_batch_size` over the batches of one loader.

    The first batch names the tensors that hold its size (``expected`` rows, the loader's batch size,
    when any tensor has them; else :func:`find_batch_size`'s). A later batch's size is theirs where
    they agree; where they do not (the epoch's short last batch), the ones whose size changed are
    the per-sample ones (a per-batch constant keeps its length), and only they are read from then on.
    So a constant that happens to have the batch's length cannot stand for the batch, and constants
    cannot outvote the data in a short batch.
    """

    def __init__(self, expected: int | None = None) -> None:
        self.expected = expected
        self.first: int | None = None
        self.paths: list[tuple] = []

    def __call__(self, batch: Any) -> int | None:
        if self.paths:
            present = {path: n for path in self.paths if (n := _length_at(batch, path)) is not None}
            sizes = set(present.values())
            if len(sizes) == 1:
                return sizes.pop()
            changed = {path: n for path, n in present.items() if n != self.first}
            if len(set(changed.values())) == 1:
                self.paths = list(changed)
                return next(iter(changed.values()))
        sized = _sized(batch)
        if self.expected is not None and not any(size == self.expected for _, size in sized):
            # The vote's candidates miss the loader's batch size, which a tensor or a list elsewhere in the batch has:
            # [class_weights[10], x[8]] read as a list of 2 variable-length samples, 4 equally long sequences of 5
            # tokens read as 5 samples. Those are the batch's samples.
            sized = list(_leaves_and_lists_of(batch, (), self.expected)) or sized
        if not sized:
            return None
        n = self.expected if any(size == self.expected for _, size in sized) else _most_shared(sized)
        self.first, self.paths = n, [path for path, size in sized if size == n]
        return n


def _leaves_and_lists_of(batch: Any, path: tuple, n: int) -> Iterator[tuple[tuple, int]]:
    """``(path, n)`` of every tensor with ``n`` rows and every list of ``n`` records alike (tensors of one rank and dtype,
    or mappings with the same keys), outermost first: the candidates for a batch the loader says holds ``n`` samples."""
    if isinstance(batch, PackedSequence):
        if _packed_size(batch) == n:
            yield path, n
        return
    if isinstance(batch, Tensor):
        if batch.dim() > 0 and batch.shape[0] == n:
            yield path, n
        return
    if isinstance(batch, list) and len(batch) == n:
        first = batch[0]
        alike_tensors = all(isinstance(v, Tensor) and v.dim() > 0 and v.dim() == first.dim() and v.dtype == first.dtype for v in batch)
        alike_maps = all(isinstance(v, Mapping) for v in batch) and all(v.keys() == first.keys() for v in batch)
        if alike_tensors or alike_maps:
            yield path, n
            return
    if isinstance(batch, Mapping) or _is_record(batch):
        for key, value in (batch.items() if isinstance(batch, Mapping) else _fields_of(batch).items()):
            yield from _leaves_and_lists_of(value, (*path, key), n)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _leaves_and_lists_of(value, (*path, i), n)


def loader_batch_size(dataloader: object) -> int | None:
    """Per-rank batch size of a DataLoader (or of its batch_sampler), ``None`` when it cannot be read."""
    size = getattr(dataloader, "batch_size", None)
    if size is None:
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _length_at(batch: Any, path: tuple) -> int | None:
    """Dim 0 of the tensor at ``path``, or the length of the per-sample list there (:func:`_sample_lists`)."""
    x = _at(batch, path)
    if isinstance(x, PackedSequence):
        return _packed_size(x)
    if isinstance(x, Tensor):
        return int(x.shape[0]) if x.dim() > 0 else None
    return len(x) if isinstance(x, list) else None


def _at(batch: Any, path: tuple) -> Any:
    for key in path:
        try:
            batch = getattr(batch, key) if _is_record(batch) else batch[key]
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return batch


def batch_size_of(batch: Any) -> int:
    """:func:`find_batch_size`, for the profiler: a batch without one is a :class:`ProfilingError`."""
    size = find_batch_size(batch)
    if size is not None:
        return size
    raise ProfilingError(
        f"A batch of type {type(batch).__name__} holds no tensor with a batch dimension, so micro-batches cannot be cut from it.",
        hint="Yield tensors (or tuples / lists / dicts / dataclasses of tensors) with samples along dim 0.",
    )


def _rebuild_dict(like: Mapping, items: dict) -> Any:
    if type(like) is dict:
        return items
    try:  # OrderedDict, transformers' BatchEncoding, ...
        return type(like)(items)
    except TypeError:
        return items


def _carries(x: Any, n: int) -> bool:
    """Whether ``x`` holds per-sample data of a batch of ``n``: a tensor with ``n`` rows, or a container with one."""
    if isinstance(x, PackedSequence):
        return _packed_size(x) == n
    if isinstance(x, Tensor):
        return x.dim() > 0 and x.shape[0] == n
    if isinstance(x, Mapping):
        return any(_carries(v, n) for v in x.values())
    if _is_record(x):
        return any(_carries(v, n) for v in _fields_of(x).values())
    if isinstance(x, (list, tuple)):
        return _per_sample(x, n) or any(_carries(v, n) for v in x)
    return False


def _per_sample(seq: list | tuple, n: int) -> bool:
    """Whether a list / tuple of ``n`` items holds one item per sample rather than the batch's structure.

    Per sample: file names or texts (``default_collate`` makes a list of strings), records with the same
    keys (detection targets: one dict per image, however many boxes each has), a list of variable-length
    tensors alike in rank and dtype. Structure: ``[inputs, targets]`` (every item has the batch's ``n``
    rows), a namedtuple, a tuple holding tensors (``(x, y, class_weights)``), items of mixed kinds.
    """
    if hasattr(seq, "_fields") or len(seq) != n or n == 0:
        return False
    first = seq[0]
    if all(isinstance(v, Mapping) for v in seq) and all(v.keys() == first.keys() for v in seq):
        return True
    carrying = [_carries(v, n) for v in seq]
    if all(carrying):
        return False
    if isinstance(seq, tuple):  # a collate's (x, y, w): only a tuple of plain values (names) is per sample
        return not any(isinstance(v, (Tensor, Mapping, list, tuple)) for v in seq)
    if not any(carrying):
        return True
    # some items have n rows by chance: per-sample only if all are tensors of one rank and dtype (boxes [k_i, 4])
    return all(isinstance(v, Tensor) and v.dim() == first.dim() and v.dtype == first.dtype for v in seq) and isinstance(first, Tensor)


def _rebuild_seq(like: list | tuple, items: list[Any]) -> Any:
    if hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    return type(like)(items) if isinstance(like, tuple) else items


def _rows_array(x: Any, n: int) -> bool:
    """Whether ``x`` is a numpy array of ``n`` rows (numpy is looked up, not imported: a loader that made one has)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray) and x.ndim > 0 and x.shape[0] == n


def slice_samples(batch: Any, start: int, stop: int, n: int) -> Any:
    """Samples ``start:stop`` of a batch of ``n``: tensors and numpy arrays with ``n`` rows and per-sample lists are cut,
    the rest kept."""
    if isinstance(batch, PackedSequence):  # a namedtuple of tensors that are not per sample: cut its sequences
        return pack_sequence(unpack_sequence(batch)[start:stop], enforce_sorted=False) if _packed_size(batch) == n else batch
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == n else batch
    if _rows_array(batch, n):  # a numpy array of the batch's rows (ids kept for logging, targets): cut as a tensor is
        return batch[start:stop]
    if isinstance(batch, Mapping):  # dict, OrderedDict, transformers' BatchEncoding (a UserDict)
        return _rebuild_dict(batch, {k: slice_samples(v, start, stop, n) for k, v in batch.items()})
    if _is_record(batch):
        return _rebuild_record(batch, {k: slice_samples(v, start, stop, n) for k, v in _fields_of(batch).items()})
    if isinstance(batch, (list, tuple)):
        if _per_sample(batch, n):
            return _rebuild_seq(batch, list(batch[start:stop]))
        return _rebuild_seq(batch, [slice_samples(v, start, stop, n) for v in batch])
    return batch  # a constant (a string tag, an int, an object): kept as is


def uncut_part(batch: Any, n: int, path: tuple = ()) -> tuple[tuple, Any] | None:
    """``(path, part)`` of the first part of a batch of ``n`` that :func:`slice_samples` keeps whole although it holds
    ``n`` rows (an object of the user's with tensors of ``n`` rows as attributes, an array type other than numpy's), or
    None: each micro-batch would get all ``n`` rows of it beside its own samples."""
    if isinstance(batch, (Tensor, str, bytes, int, float, bool)) or batch is None or _rows_array(batch, n):
        return None
    if isinstance(batch, Mapping) or _is_record(batch):
        items = batch.items() if isinstance(batch, Mapping) else _fields_of(batch).items()
        return next((found for key, value in items if (found := uncut_part(value, n, (*path, key))) is not None), None)
    if isinstance(batch, (list, tuple)):
        if _per_sample(batch, n):
            return None  # cut item by item
        return next((found for i, value in enumerate(batch) if (found := uncut_part(value, n, (*path, i))) is not None), None)
    shape = getattr(batch, "shape", None)
    if isinstance(shape, tuple) and shape and shape[0] == n:
        return path, batch
    attributes = getattr(batch, "__dict__", None)
    if isinstance(attributes, dict) and any(isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n for v in attributes.values()):
        return path, batch
    return None


def uncut_part_found(batch: Any, n: int, subject: str = "The training batch") -> str | None:
    """"The training batch[1] is a Targets holding the batch's 8 rows" for the part :func:`uncut_part` finds, or None;
    ``subject`` names what ``batch`` is to the user (a pipeline's "PipelineSpec.targets(batch)")."""
    found = uncut_part(batch, n)
    if found is None:
        return None
    path, part = found
    where = "".join(f"[{key!r}]" for key in path) or " itself"
    return f"{subject}{where} is a {type(part).__name__} holding the batch's {n} rows"


def concat_samples(pieces: list[Any], sizes: list[int]) -> Any:
    """The samples of ``pieces`` (batches of ``sizes[i]`` samples each, alike in structure) in order, as one batch."""
    first, n = pieces[0], sizes[0]
    if len(pieces) == 1:
        return first
    if isinstance(first, PackedSequence):
        if _packed_size(first) != n:
            return first
        return pack_sequence([seq for p in pieces for seq in unpack_sequence(p)], enforce_sorted=False)
    if isinstance(first, Tensor):
        if not (first.dim() > 0 and first.shape[0] == n):
            return first
        shapes = {tuple(p.shape[1:]) for p in pieces}
        if len(shapes) > 1:
            raise BatchFormatError(
                f"Samples of different loader batches have different shapes ({' vs '.join(str(list(x)) for x in sorted(shapes))}), "
                "so a micro-batch cannot join them (a collate that pads each batch to its own longest sequence does this).",
                hint="Use micro-batches no larger than the loader's batch (distplan profile --micro-batch-sizes, "
                "AutoPlanStrategy(profile_micro_batch_sizes=...), a micro_batch_size that divides the loader batch), or pad to a fixed length.",
            )
        return torch.cat(pieces, dim=0)
    if _rows_array(first, n):
        shapes = {tuple(p.shape[1:]) for p in pieces}
        if len(shapes) > 1:
            raise BatchFormatError(
                f"Numpy arrays of different loader batches have different shapes ({' vs '.join(str(list(x)) for x in sorted(shapes))}), "
                "so a micro-batch cannot join them.",
                hint="Use micro-batches no larger than the loader's batch (a micro_batch_size that divides it), or pad to a fixed length.",
            )
        return sys.modules["numpy"].concatenate(pieces, axis=0)
    if isinstance(first, Mapping):
        return _rebuild_dict(first, {k: concat_samples([p[k] for p in pieces], sizes) for k in first})
    if _is_record(first):
        return _rebuild_record(first, {k: concat_samples([getattr(p, k) for p in pieces], sizes) for k in _fields_of(first)})
    if isinstance(first, (list, tuple)):
        if _per_sample(first, n):
            return _rebuild_seq(first, [item for p in pieces for item in p])
        return _rebuild_seq(first, [concat_samples([p[i] for p in pieces], sizes) for i in range(len(first))])
    return first


def move_to(batch: Any, device: torch.device) -> Any:
    """Copy every tensor of ``batch`` to ``device`` (structure kept)."""
    if isinstance(batch, (Tensor, PackedSequence)):  # a PackedSequence keeps its batch_sizes on the CPU, as torch requires
        return batch.to(device, non_blocking=False)
    if isinstance(batch, Mapping):
        return _rebuild_dict(batch, {k: move_to(v, device) for k, v in batch.items()})
    if _is_record(batch):
        return _rebuild_record(batch, {k: move_to(v, device) for k, v in _fields_of(batch).items()})
    if isinstance(batch, (list, tuple)):
        return _rebuild_seq(batch, [move_to(v, device) for v in batch])
    return batch


class SampleBank:
    """Pulls real batches from a loader on demand and cuts micro-batches of any size from them.

    When the loader runs out before ``m`` samples are collected, the collected samples are
    repeated (timing and memory do not depend on which samples they are), and ``repeated`` says so.
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self._source = batches
        self._iter: Iterator[Any] | None = None
        self._parts: list[Any] = []
        self._sizes: list[int] = []
        # The loader's batch size tells the batch dimension from a per-batch constant with another first dimension
        # (class weights before the inputs), as dp_ga's re-chunking reads it, so a profiled micro-batch holds the
        # samples training's micro-batch holds; a majority vote per batch cut the constant and kept every sample.
        self._sizer = BatchSizer(loader_batch_size(batches))
        self._count = 0
        self._exhausted = False
        self.repeated = False
        self.loader_batch_size = 0
        self.start = 0
        """The first sample micro-batches are cut from (moved on past samples ``training_step`` skips)."""

    def _pull(self) -> bool:
        if self._exhausted:
            return False
        try:
            if self._iter is None:
                self._iter = iter(self._source)
            batch = next(self._iter)
        except StopIteration:
            self._exhausted = True
            self.close()
            return False
        except (ProfilingError, KeyboardInterrupt):
            raise
        except Exception as err:
            raise DataLoadingError(
                f"Reading a batch from the data loader failed with {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else '(no message)'}.",
                hint="Check that the dataset is available offline (downloads may be blocked) or pass batches that load here.",
            ) from err
        n = self._sizer(batch)
        if n is None:
            batch_size_of(batch)  # raises the ProfilingError of a batch without a batch dimension
        if not self._parts:
            self.loader_batch_size = n
            if (found := uncut_part_found(batch, n)) is not None:
                raise ProfilingError(
                    f"{found}, which cannot be cut into the micro-batches profiling times: each would get all {n} rows of it.",
                    hint="Make it a tensor (or a dict, tuple or dataclass of tensors).",
                )
        self._parts.append(batch)
        self._sizes.append(n)
        self._count += n
        return True

    def first_batch_size(self) -> int:
        """Batch size of the loader's first batch (pulls it)."""
        if not self._parts and not self._pull():
            raise ProfilingError(
                "The data loader yielded no batches, so there is nothing to profile.",
                hint="Pass a non-empty DataLoader (check the dataset length, `drop_last` and the batch size).",
            )
        return self.loader_batch_size

    def prefetch(self, n: int) -> None:
        """Pull ``n`` samples (or all the loader has) now, then let the loader's workers shut down.

        Workers left running prefetch batches while the steps are timed: on a CPU they take the cores
        the step runs on (a reviewer measured 3-5x slower steps with ``num_workers=2``).
        """
        self.first_batch_size()
        while self._count < n and self._pull():
            pass
        self.close()
        self._exhausted = True  # a larger size later repeats these samples (and says so), never restarts the loader

    def micro_batch(self, m: int) -> Any:
        """A batch of exactly ``m`` samples (on the loader's device), from sample :attr:`start` on (wrapping around)."""
        self.first_batch_size()
        while self._count < self.start + m and self._pull():
            pass
        batch = concat_samples(self._parts, self._sizes) if len(self._parts) > 1 else self._parts[0]
        n, start = self._count, self.start % self._count
        if start:
            batch = concat_samples([slice_samples(batch, start, n, n), slice_samples(batch, 0, start, n)], [n - start, start])
        total = n
        if n < m:
            self.repeated = True
            total = n * -(-m // n)
            batch = concat_samples([batch] * -(-m // n), [n] * -(-m // n))
        return slice_samples(batch, 0, m, total)

    @property
    def collected(self) -> int:
        """Samples pulled from the loader so far."""
        return self._count

    def close(self) -> None:
        """Drop the iterator so loader workers shut down."""
        self._iter = None
