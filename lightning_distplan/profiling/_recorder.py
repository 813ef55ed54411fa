"""Per-layer attribution of one hooked training step: time, saved-for-backward bytes, outputs, FLOPs.

Only the blocks from :func:`lightning_distplan._layers.discover_layers` are hooked (a partition
of the model), with a forward pre-hook, a forward hook, and a tensor hook on each output that
fires when the gradient w.r.t. that output is ready, i.e. when the layer's backward starts. Tensor
hooks are used instead of ``register_full_backward_hook`` because the latter wraps outputs in a
view that in-place ops after the layer (``ReLU(inplace=True)`` in torchvision models) reject.

The timeline between events is charged so that layer times add up to the whole hooked step:

* forward: from a layer's pre-hook until the next layer starts belongs to that layer, so glue code
  after a block (the loss after the last block) is charged to the block before it; code before
  the first block goes to the first block.
* backward: from the start of a layer's backward until the next layer's backward starts belongs to
  that layer (the loss' backward, which runs first, goes to the last block).

Saved tensors (``torch.autograd.graph.saved_tensors_hooks``) and FLOPs are attributed the same way.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_distplan.profiling._batches import tensors_in

__all__ = ["LayerRecorder", "RunRecord"]


class _Clock:
    """perf_counter on CPU; CUDA events on GPU (no sync inside hooks, elapsed read after one sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a


def _storage_key(t: Tensor) -> tuple[int, int]:
    """(storage address, storage bytes); tensors without storage use their own identity and size."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses, sparse)
        return id(t), t.nelement() * t.element_size()


def _span(t: Tensor) -> tuple[int, int, int]:
    """(storage key, first byte, end byte) that the view ``t`` touches inside its storage.

    Counting spans instead of whole storages matters: a micro-batch sliced from a larger batch, or
    one head of a fused projection, must count only the bytes it covers; views of one storage merge.
    """
    try:
        key = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t), 0, t.nelement() * t.element_size()
    size = t.element_size()
    if t.nelement() == 0:
        return key, 0, 0
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return key, lo, lo + extent * size


class RunRecord:
    """What one hooked step measured, per layer index."""

    def __init__(self, n: int) -> None:
        self.forward_s = [0.0] * n
        self.backward_s = [0.0] * n
        self.saved_bytes = [0] * n
        self.output_bytes = [0] * n
        self.output_saved_bytes = [0] * n
        """Bytes of each layer's output saved for backward by the layer itself (ReLU saves its result), by an
        earlier layer sharing the storage (an in-place op's input), or by glue charged to the layer (the loss after
        the last one): what a pipeline stage ending at the layer already counts of the output it keeps."""
        self.output_saved_later_bytes = [0] * n
        """Bytes of each layer's output first saved by the next layer (a Linear or LayerNorm saving its input) and
        charged there: on a stage starting after the layer, that saved tensor is the pipeline's receive buffer."""
        self.flops_forward = [0] * n
        self.flops_backward = [0] * n
        self.conv_flops_forward = [0] * n
        """The part of ``flops_forward`` in convolutions (cuDNN's TF32 switch is not the matmuls')."""
        self.conv_flops_backward = [0] * n
        self.first_call: list[int] = []
        """Layer indices in order of their first forward call."""
        self.total_saved_bytes = 0


class LayerRecorder:
    """Hooks ``modules`` (context manager); call :meth:`run` once per measured step."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        device: torch.device,
        *,
        exclude_storages: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        self.modules = list(modules)
        self.clock = _Clock(device)
        self.exclude = exclude_storages
        self._handles: list[Any] = []
        self._active = False
        self._count_saved = False
        self._flops: Any = None
        self._reset()

    # -- hooks -------------------------------------------------------------------------------
    def __enter__(self) -> LayerRecorder:
        for i, m in enumerate(self.modules):
            self._handles.append(m.register_forward_pre_hook(self._make_pre(i)))
            self._handles.append(m.register_forward_hook(self._make_post(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reset(self) -> None:
        self._fwd_events: list[tuple[Any, int, tuple[int, int]]] = []  # (clock mark, owner layer or -1, (flops, conv flops))
        self._bwd_events: list[tuple[Any, int, tuple[int, int]]] = []
        self._stack: list[int] = []
        self._last_done = -1
        self._first_call: list[int] = []
        self._seen_storages: dict[int, tuple[int, int]] = {}
        self._saved = [0] * len(self.modules)
        self._saved_before_first = 0
        self._outputs = [0] * len(self.modules)
        self._charges: dict[int, list[tuple[int, int, Any]]] = {}  # address -> (owner, bytes, storage ref) of each count, in order
        self._produced: list[tuple[int, int, int, int, Any]] = []  # (layer, address, output bytes, counts on it so far, storage ref)
        self._live: dict[int, Any] = {}  # address -> weak reference to the last output storage seen there

    def _flop_total(self) -> tuple[int, int]:
        """FLOPs counted so far: all of them, and those of convolutions."""
        if self._flops is None:
            return 0, 0
        # the counter's running totals per op (what its get_total_flops sums), read without get_flop_counts(), which
        # copies every module's counts at each of these hook events
        ops = self._flops.flop_counts["Global"]
        return sum(ops.values()), sum(n for op, n in ops.items() if "conv" in str(op))

    def _owner(self) -> int:
        if self._stack:
            return self._stack[-1]
        return self._last_done

    def _make_pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self._active:
                return
            if i not in self._first_call:
                self._first_call.append(i)
            self._stack.append(i)
            self._fwd_events.append((self.clock.mark(), i, self._flop_total()))

        return hook

    def _make_post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            if self._stack and self._stack[-1] == i:
                self._stack.pop()
            self._last_done = i
            # after this block, glue is charged to it (or to the enclosing block, if nested)
            self._fwd_events.append((self.clock.mark(), self._owner(), self._flop_total()))
            leaves = list(tensors_in(output))  # every tensor a cut after this layer sends: a mapping's too
            if self._count_saved:
                self._outputs[i] += sum(t.nelement() * t.element_size() for t in leaves)
                for t in leaves:
                    key = _span(t)[0]
                    ref = self._storage_ref(key, t)
                    self._produced.append((i, key, t.nelement() * t.element_size(), len(self._charges.get(key, ())), ref))
            bwd_hook = self._make_bwd(i)
            for t in leaves:
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(bwd_hook)

        return hook

    def _storage_ref(self, key: int, t: Tensor, *, create: bool = True) -> Any:
        """One weak reference per output storage at ``key`` (None without a storage): an address freed during the
        forward and handed to a later tensor (the allocator reuses blocks) must not pass that tensor's saves off
        as saves of the dead output."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        ref = self._live.get(key)
        if ref is not None and ref() is storage:
            return ref
        if not create:
            return False  # matches no output's reference
        ref = self._live[key] = weakref.ref(storage)
        return ref

    def _make_bwd(self, i: int) -> Callable[[Tensor], None]:
        fired = [False]  # one event per forward call: the first output whose gradient is ready starts the backward

        def hook(grad: Tensor) -> None:
            if self._active and not fired[0]:
                fired[0] = True
                self._bwd_events.append((self.clock.mark(), i, self._flop_total()))

        return hook

    def _pack(self, t: Tensor) -> Tensor:
        key, lo, hi = _span(t)
        if key in self.exclude:
            return t
        old = self._seen_storages.get(key)
        if old is None:
            added = hi - lo
            self._seen_storages[key] = (lo, hi)
        else:  # another view of a storage already saved: count only the bytes it adds to the span
            new_lo, new_hi = min(old[0], lo), max(old[1], hi)
            added = (new_hi - new_lo) - (old[1] - old[0])
            self._seen_storages[key] = (new_lo, new_hi)
        if added <= 0:
            return t
        owner = self._owner()
        self._charges.setdefault(key, []).append((owner, added, self._storage_ref(key, t, create=False)))
        if owner < 0:
            self._saved_before_first += added
        else:
            self._saved[owner] += added
        return t

    # -- one step ----------------------------------------------------------------------------
    def run(
        self,
        forward: Callable[[], Tensor],
        *,
        count_saved: bool = False,
        flop_counter: Any = None,
        synchronize: Callable[[], None] = lambda: None,
    ) -> RunRecord:
        """Run ``forward()`` (returns the loss) and its backward with the hooks live."""
        n = len(self.modules)
        self._reset()
        self._count_saved = count_saved
        self._flops = flop_counter
        rec = RunRecord(n)
        self._active = True
        try:
            synchronize()
            begin = (self.clock.mark(), -2, self._flop_total())
            if count_saved:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x):
                    loss = forward()
            else:
                loss = forward()
            end_fwd = (self.clock.mark(), -1, self._flop_total())
            bbegin = (self.clock.mark(), -2, self._flop_total())
            loss.backward()
            end_bwd = (self.clock.mark(), -1, self._flop_total())
            synchronize()
            del loss
        finally:
            self._active = False
            self._flops = None
        first = self._first_call[0] if self._first_call else 0
        self._attribute([begin, *self._fwd_events, end_fwd], first, rec.forward_s, rec.flops_forward, rec.conv_flops_forward)
        first_bwd = self._bwd_events[0][1] if self._bwd_events else (self._first_call[-1] if self._first_call else 0)
        self._attribute([bbegin, *self._bwd_events, end_bwd], first_bwd, rec.backward_s, rec.flops_backward, rec.conv_flops_backward)
        rec.first_call = list(self._first_call)
        if count_saved:
            self._saved[first] += self._saved_before_first
            rec.saved_bytes = list(self._saved)
            rec.output_bytes = list(self._outputs)
            rec.total_saved_bytes = sum(self._saved)
            for i, key, nbytes, before, ref in self._produced:
                counts = self._charges.get(key, [])
                # counted by the time the layer returned, or later but charged to it (the loss after the last layer);
                # later counts only on this very storage, not on one allocated at its address after it was freed
                after = [(o, b) for o, b, r in counts[before:] if r is ref]
                here = sum(b for _, b, _ in counts[:before]) + sum(b for o, b in after if o == i)
                # only the next layer's save: a cut after this layer subtracts it from the next stage's first layer,
                # so a save further on (a skip over a layer that saves other tensors) must not be taken for it
                later = sum(b for o, b in after if o == i + 1)
                here = min(here, nbytes)
                rec.output_saved_bytes[i] += here
                rec.output_saved_later_bytes[i] += min(later, nbytes - here)
        return rec

    def _attribute(self, events: list[tuple[Any, int, tuple[int, int]]], first: int, seconds: list[float], flops: list[int], conv: list[int]) -> None:
        owner = first
        for (mark_a, who, flop_a), (mark_b, _, flop_b) in zip(events, events[1:]):
            if who >= 0:
                owner = who
            elif who == -2:
                owner = first
            seconds[owner] += self.clock.seconds(mark_a, mark_b)
            flops[owner] += flop_b[0] - flop_a[0]
            conv[owner] += flop_b[1] - flop_a[1]
