"""partition_layers is exact: same bottleneck as brute force, memory cap respected."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_distplan.costmodel import partition_layers
from lightning_distplan.errors import InfeasiblePlanError, ModelSplitError


def _stages(values, boundaries):
    edges = [0, *boundaries, len(values)]
    return [sum(values[a:b]) for a, b in zip(edges, edges[1:])]


def _brute_force(times, p, mems=None, cap=None):
    best = None
    for cut in itertools.combinations(range(1, len(times)), p - 1):
        if mems is not None and max(_stages(mems, cut)) > cap:
            continue
        worst = max(_stages(times, cut))
        best = worst if best is None else min(best, worst)
    return best


def test_examples():
    assert partition_layers([1, 1, 1, 3], 2) == (3,)
    assert partition_layers([5, 1, 1, 1, 1, 1], 2) == (1,)
    assert partition_layers([1, 2, 3], 1) == ()
    assert partition_layers([1, 2, 3], 3) == (1, 2)
    assert partition_layers([0, 0, 0, 0], 4) == (1, 2, 3)


def test_matches_brute_force_on_random_cases():
    rng = random.Random(42)
    for trial in range(300):
        n = rng.randint(1, 8)
        p = rng.randint(1, n)
        integer = trial % 2 == 0  # integers give many exact ties, floats the general case
        times = [rng.randint(0, 9) if integer else rng.uniform(0, 5) for _ in range(n)]
        use_mem = trial % 3 != 0
        mems = [rng.uniform(0, 10) for _ in range(n)] if use_mem else None
        cap = rng.uniform(5, 30) if use_mem else None
        expected = _brute_force(times, p, mems, cap)
        if expected is None:
            with pytest.raises(InfeasiblePlanError, match="HINT"):
                partition_layers(times, p, layer_memory=mems, memory_cap=cap)
            continue
        got = partition_layers(times, p, layer_memory=mems, memory_cap=cap)
        assert len(got) == p - 1 and list(got) == sorted(set(got)) and all(0 < b < n for b in got)
        assert max(_stages(times, got)) == pytest.approx(expected, rel=1e-12, abs=1e-12), (times, p, mems, cap, got)
        if use_mem:
            assert max(_stages(mems, got)) <= cap


def test_more_stages_than_layers_is_a_split_error():
    with pytest.raises(ModelSplitError, match=r"Cannot split 3 profiled layers into 4 pipeline stages.*HINT: Use at most 3"):
        partition_layers([1, 1, 1], 4)


def test_bad_arguments():
    with pytest.raises(ModelSplitError, match="positive integer"):
        partition_layers([1, 1], 0)
    with pytest.raises(ModelSplitError, match=r"memory_cap=None.*HINT: Pass both"):
        partition_layers([1, 1], 2, layer_memory=[1, 1])
    with pytest.raises(ModelSplitError, match=r"non-negative, got \[1.0, -1.0\].*HINT"):
        partition_layers([1, -1], 2)
    with pytest.raises(ModelSplitError, match=r"has 1 entries for 2 layers.*HINT"):
        partition_layers([1, 1], 2, layer_memory=[1], memory_cap=5)
    with pytest.raises(InfeasiblePlanError, match="Layer 1 alone needs"):
        partition_layers([1, 1, 1], 2, layer_memory=[1, 9, 1], memory_cap=5)


def test_scales_to_hundreds_of_layers():
    rng = random.Random(3)
    times = [rng.uniform(0.5, 1.5) for _ in range(300)]
    got = partition_layers(times, 8)
    stages = _stages(times, got)
    assert max(stages) <= sum(times) / 8 + 1.5  # within one layer of perfect balance
