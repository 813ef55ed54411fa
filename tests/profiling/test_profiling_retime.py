"""A host stall during one size's whole-step timing is timed again instead of bending the fit."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_distplan.profiling import profile_module

# One intra-op thread, as `distplan bench --threads 1` profiles and as the other profiling test modules set it (collected
# with them, this file ran so; alone, with torch's default of one per core). Beside busy loops on 2 cores, torch's 2
# threads waited on each other at every op: steps of ~10 ms were timed at 200-1400 ms, stalls as long as this file's,
# and a 1024-wide MLP's steady m = 16 was timed at 28 ms, then again at 540 ms.
torch.set_num_threads(1)


class Wide(BoringModel):
    """BoringModel with enough work per sample that its step time grows linearly with the micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))


class StallsOnce(Wide):
    """Its first ``stalls`` forwards at micro-batch 64 (or at each size of ``at``: size -> count) sleep 250 ms (a stalled
    host). The counts live in an object of its own: profiling puts the module's plain attributes (an int, a list)
    back as they were. ``stall.log[m]``: per forward at size m, whether it slept.

    250 ms, not less: on a loaded CI host the unstalled steps took 23-45 ms (a few ms idle), and a 60 ms stall then
    lay on the line through them, so nothing was timed again (the test failed once so)."""

    def __init__(self, stalls: int = 0, at: dict[int, int] | None = None) -> None:
        super().__init__()
        left = dict(at) if at is not None else {64: stalls}
        self.stall = SimpleNamespace(left=left, log={m: [] for m in left})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m in self.stall.left:
            stalls = self.stall.left[m] > 0
            self.stall.log[m].append(stalls)
            if stalls:
                self.stall.left[m] -= 1
                time.sleep(0.25)
        return super().forward(x)


SIZES = [8, 16, 32, 64]


def _retimed(stalls: dict[int, int]) -> tuple[dict[int, float], dict[int, tuple[float, float, float]], StallsOnce, list[str]]:
    """Profile a StallsOnce stalling at ``stalls``: its step times, (first, again, kept) in ms per size timed again, the
    model (its stall log) and the progress lines."""
    model = StallsOnce(at=stalls)
    lines: list[str] = []
    profile = profile_module(
        model, model.train_dataloader(), micro_batch_sizes=SIZES, repeats=3, min_timed_s=0,
        loop_overhead=False, progress=lines.append,
    )
    step = {s.micro_batch_size: s.forward_s + s.backward_s for s in profile.step.samples}
    said = {}
    for line in lines:
        found = re.search(r"micro-batch (\d+): ([\d.]+) ms was .* timed again: ([\d.]+) ms; kept ([\d.]+) ms", line)
        if found:
            said[int(found[1])] = tuple(float(found[k]) for k in (2, 3, 4))
    return step, said, model, lines


def _undisturbed_kept(m: int, step: dict[int, float], said: dict[int, tuple[float, float, float]], model: StallsOnce, lines: list[str]) -> None:
    """Size m was timed again without a stall, and that timing kept.

    Asserted on what ran, not on wall-clock: a bound on the kept time (it was < 150 ms, "a few ms; tens on a loaded
    host") failed beside two busy loops on 2 cores, where a step of m = 64 is timed at hundreds of ms without any
    stall of this test's."""
    assert m in said, lines
    first, again, kept = said[m]
    assert first >= 250, said  # the first timing slept
    assert model.stall.left[m] == 0 and model.stall.log[m][-1] is False, model.stall.log  # the timing again did not
    assert again < first and kept == again and step[m] * 1e3 == pytest.approx(kept, abs=0.05), (said, step)


def test_a_stalled_size_is_timed_again_and_the_undisturbed_timing_kept() -> None:
    # the counting run, 3 timed whole steps and 3 hooked runs at m = 64 all stall; the re-timing does not
    step, said, model, lines = _retimed({64: 7})
    assert model.stall.log[64] == [True] * 7 + [False] * (len(model.stall.log[64]) - 7)
    _undisturbed_kept(64, step, said, model, lines)


def test_two_stalled_sizes_are_both_timed_again() -> None:
    """m = 8 and m = 64 both stalled (seen beside two busy loops on 2 cores: 435 ms at m = 8, a step of ~10 ms): the line
    through the other sizes of each went below 0 at its size, so neither counted as off it, and the two re-timings
    went to m = 16 and 32, which lay below the lines the stalls bent. A stall only adds time: only a size above the
    line through the others is timed again, and one above a line that predicts no time at all is as far off as any."""
    step, said, model, lines = _retimed({8: 7, 64: 7})
    assert sorted(said) == [8, 64], lines
    for m in (8, 64):
        _undisturbed_kept(m, step, said, model, lines)



def test_a_stall_at_the_smallest_size_is_timed_again_first() -> None:
    """One stall at m = 8 tilts the line through 16, 32 and 64 so far that m = 64 lies further above the line through
    8 (stalled), 16 and 32 than the stall itself (~1.3 times it): by distance alone the first of the two re-timings
    went to the unstalled m = 64. The size whose leaving out straightens the others most (distance times
    sqrt(1 - leverage)) is the stalled one."""
    step, said, model, lines = _retimed({8: 7})
    assert said and next(iter(said)) == 8, lines  # the first re-timing; a noisy ~1 ms size may be timed again after it
    _undisturbed_kept(8, step, said, model, lines)


class Paced(BoringModel):
    """A step whose time this test sets: its forward sleeps 1 ms per sample (16-128 ms here) beside a few microseconds
    of matrix work, so its time is linear in m whatever else the host runs.

    Its step was real matrix work before (a 1024-wide MLP, 3-9 ms; Wide's 1-2 ms steps, mostly fixed per-call cost,
    came out 56% off the line on a busy CI host), and how steady that work timed was the host's: beside three busy
    loops on 2 cores a stall put a size 66-67% off the line through the others in each of three profiles (m = 64 at
    47.9 ms against 28.9 ms, m = 16 at 21.7 ms against 13.0 ms; timed again on the line, as the rule should), and the
    test failed though the rule did what it should. A sleeping process wakes ahead of busy ones, so a paced step is
    steady there too, and a rule that fired on steady sizes still fires on these."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(1e-3 * x.shape[0])
        return super().forward(x)


def _profile_paced() -> tuple[dict[int, float], list[str]]:
    model = Paced()
    lines: list[str] = []
    profile = profile_module(
        model, model.train_dataloader(), micro_batch_sizes=[16, 32, 64, 128], repeats=3, loop_overhead=False, progress=lines.append
    )
    return {s.micro_batch_size: s.forward_s + s.backward_s for s in profile.step.samples}, lines


def test_steady_sizes_are_not_timed_again() -> None:
    step, lines = _profile_paced()
    assert step[16] > 16e-3, step  # the premise: the paced 16 ms at the smallest size
    # Its step is linear in m to well within 50%, so no size is off the line through the others by
    # that much: the rule must stay quiet. A rule that fired on steady sizes would fire in every
    # profile; a host stall that put one size off the line (the rule times it again, as it should)
    # is unlikely twice running. So up to three profiles.
    for _ in range(2):
        if not [line for line in lines if "timed again" in line]:
            break
        step, lines = _profile_paced()
    assert not [line for line in lines if "timed again" in line], lines


class _SlowAtFour(nn.Linear):
    """Sleeps 20 ms in every forward of 4 samples: a layer whose times at 1, 2, 4 are ~0, ~0, 20 ms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 4:
            time.sleep(0.02)
        return super().forward(x)


class _StallsAtFour(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(_SlowAtFour(32, 32), nn.ReLU(), nn.Linear(32, 2))


def test_a_layer_line_stays_positive_where_it_was_measured(tmp_path) -> None:
    """Least squares through ~0, ~0 and 20 ms at 1, 2, 4 samples is -2.9 ms at 1: a negative layer time the planner
    summed into a stage, and a saved profile was refused for (`distplan bench` exited 2 on a loaded host)."""
    from lightning_distplan.profile import LinearFit, Profile

    for _ in range(3):
        # The premise needs ~0 ms at 1 and 2 samples: a host stall there (in the median of 3 runs) lifts the plain line
        # above 0 at 1, and the case is not the one this test is about. Beside three busy loops on 2 cores, with torch's
        # 2 threads it did in 5 profiles of 5 (+7 to +14 ms at 1); with one it did in none of 5 (-2.9 to -3.3 ms). Should
        # a stall still do it, the layer is profiled again: what the profile must do holds for every profile.
        model = _StallsAtFour()
        profile = profile_module(model, model.train_dataloader(), micro_batch_sizes=[1, 2, 4], repeats=3, loop_overhead=False)
        slow = profile.layers[0]
        sizes = [s.micro_batch_size for s in slow.samples]
        if LinearFit.fit(sizes, [s.forward_s for s in slow.samples])(1) < 0:
            break
    assert LinearFit.fit(sizes, [s.forward_s for s in slow.samples])(1) < 0, slow.samples  # the premise: the plain line dips below 0
    for layer in profile.layers:
        for m in sizes:
            assert layer.forward(m) > 0 and layer.backward(m) > 0, (layer.name, m, layer.forward, layer.backward)
    assert slow.forward(4) > 0.01  # the measured 20 ms is still there
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").layers[0].forward == slow.forward
