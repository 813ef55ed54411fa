"""A host stall during one size's whole-step timing is timed again instead of bending the fit."""

from __future__ import annotations

import time

import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_distplan.profiling import profile_module


class Wide(BoringModel):
    """BoringModel with enough work per sample that its step time grows linearly with the micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))


class StallsOnce(Wide):
    """Its first ``stalls`` forwards at micro-batch 64 sleep 60 ms (a stalled host)."""

    def __init__(self, stalls: int) -> None:
        super().__init__()
        self.stalls = stalls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 64 and self.stalls > 0:
            self.stalls -= 1
            time.sleep(0.06)
        return super().forward(x)


SIZES = [8, 16, 32, 64]


def test_a_stalled_size_is_timed_again_and_the_undisturbed_timing_kept() -> None:
    # the counting run, 3 timed whole steps and 3 hooked runs at m = 64 all stall; the re-timing does not
    model = StallsOnce(stalls=7)
    lines: list[str] = []
    profile = profile_module(
        model, model.train_dataloader(), micro_batch_sizes=SIZES, repeats=3, min_timed_s=0,
        loop_overhead=False, progress=lines.append,
    )
    assert model.stalls == 0
    step = {s.micro_batch_size: s.forward_s + s.backward_s for s in profile.step.samples}
    assert step[64] < 0.04, step  # this step takes a few ms; every stalled timing took over 60 ms
    said = [line.split("]")[-1].strip() for line in lines if "timed again" in line]
    assert any(line.startswith("micro-batch 64:") for line in said), lines


def test_steady_sizes_are_not_timed_again() -> None:
    model = Wide()
    lines: list[str] = []
    profile_module(model, model.train_dataloader(), micro_batch_sizes=SIZES, repeats=3, loop_overhead=False, progress=lines.append)
    # its step is linear in m to well within 50%, so no size is off the line through the others by that much
    assert not [line for line in lines if "timed again" in line], lines
