"""Build micro-batches of exactly ``m`` samples from the batches a loader really yields.

A batch is a tensor or a nested tuple / list / dict of them (plus per-sample lists such as a
list of strings); samples are along dim 0 of every tensor. Batches are concatenated and sliced,
so a micro-batch of 32 from a loader of batch size 8 holds the loader's first 32 samples.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from lightning_distplan.profiling._errors import DataLoadingError, ProfilingError

__all__ = ["SampleBank", "batch_size_of", "move_to"]


def _tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its first tensor."""
    for t in _tensors(batch):
        if t.dim() == 0:
            continue
        return int(t.shape[0])
    raise ProfilingError(
        f"A batch of type {type(batch).__name__} holds no tensor with a batch dimension, so micro-batches cannot be cut from it.",
        hint="Yield tensors (or tuples / lists / dicts of tensors) with samples along dim 0.",
    )


def _rebuild_dict(like: dict, items: dict) -> dict:
    if type(like) is dict:
        return items
    try:  # OrderedDict, transformers' BatchEncoding, ...
        return type(like)(items)
    except TypeError:
        return items


def _is_structural(seq: list | tuple) -> bool:
    """A list/tuple of tensors or containers is structure; a list of scalars/strings is per-sample data."""
    return any(isinstance(v, (Tensor, dict, list, tuple)) for v in seq)


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            return first  # a scalar in the batch (e.g. a temperature) is not per-sample
        return torch.cat(parts, dim=0)
    if isinstance(first, dict):
        return _rebuild_dict(first, {k: _cat([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)) and _is_structural(first):
        items = [_cat([p[i] for p in parts]) for i in range(len(first))]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*items)
        return type(first)(items) if isinstance(first, tuple) else items
    if isinstance(first, (list, tuple)):
        out: list[Any] = []
        for p in parts:
            out.extend(p)
        return type(first)(out) if isinstance(first, tuple) else out
    return first  # a non-tensor constant (a string tag, an int): kept as is


def _slice(batch: Any, m: int) -> Any:
    if isinstance(batch, Tensor):
        return batch if batch.dim() == 0 else batch[:m]
    if isinstance(batch, dict):
        return _rebuild_dict(batch, {k: _slice(v, m) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and _is_structural(batch):
        items = [_slice(v, m) for v in batch]
        if hasattr(batch, "_fields"):
            return type(batch)(*items)
        return type(batch)(items) if isinstance(batch, tuple) else items
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch[:m]) if isinstance(batch, tuple) else list(batch[:m])
    return batch


def move_to(batch: Any, device: torch.device) -> Any:
    """Copy every tensor of ``batch`` to ``device`` (structure kept)."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=False)
    if isinstance(batch, dict):
        return _rebuild_dict(batch, {k: move_to(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and _is_structural(batch):
        items = [move_to(v, device) for v in batch]
        if hasattr(batch, "_fields"):
            return type(batch)(*items)
        return type(batch)(items) if isinstance(batch, tuple) else items
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
        self._count = 0
        self._exhausted = False
        self.repeated = False
        self.loader_batch_size = 0

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
        n = batch_size_of(batch)
        if not self._parts:
            self.loader_batch_size = n
        self._parts.append(batch)
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

    def micro_batch(self, m: int) -> Any:
        """A batch of exactly ``m`` samples (on the loader's device)."""
        self.first_batch_size()
        while self._count < m and self._pull():
            pass
        if self._count < m:
            self.repeated = True
            reps = -(-m // self._count)
            batch = _cat(self._parts * reps)
        else:
            batch = _cat(self._parts) if len(self._parts) > 1 else self._parts[0]
        return _slice(batch, m)

    def close(self) -> None:
        """Drop the iterator so loader workers shut down."""
        self._iter = None
