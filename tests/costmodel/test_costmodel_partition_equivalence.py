"""partition_pipeline against the pure-Python loop it replaced: the same split, or the same error, on every input.

``_reference`` is that loop as it stood at e16835b (lightning_distplan/costmodel/_partition.py), kept
verbatim apart from its docstring and ``last_of_ties`` (which only shows that ties decide many of the
cases): the vectorised programme must pick the same boundaries, ties included (slowest stage, then
hand-over seconds, then the smallest first layer), and fail alike.
"""

from __future__ import annotations

import math
import random
from itertools import accumulate
from typing import Sequence

import pytest

from lightning_distplan.costmodel import partition_layers, partition_pipeline
from lightning_distplan.errors import InfeasiblePlanError, ModelSplitError


def _reference(
    layer_times: Sequence[float],
    pp: int,
    *,
    cut_times: Sequence[float],
    static_memory: Sequence[float],
    activation_memory: Sequence[float],
    cut_memory: Sequence[float],
    in_flight: Sequence[int],
    memory_cap: float | None,
    tied: Sequence[tuple[Sequence[int], float]] = (),
    no_cut: Sequence[int] = (),
    last_of_ties: bool = False,
) -> tuple[int, ...]:
    """The exact programme as a scalar loop over (stage k, end j, start i)."""
    n_layers = len(layer_times)
    partition_layers(layer_times, pp)  # the same checks of pp and the times
    lists = {"cut_times": cut_times, "static_memory": static_memory, "activation_memory": activation_memory, "cut_memory": cut_memory}
    for what, values in lists.items():
        if len(values) != n_layers or any(not math.isfinite(float(v)) or float(v) < 0 for v in values):
            raise ModelSplitError(f"`{what}` must hold {n_layers} finite non-negative numbers, one per layer.", hint="Pass one value per layer, in layer order.")
    if len(in_flight) != pp:
        raise ModelSplitError(f"`in_flight` has {len(in_flight)} entries for {pp} stages.", hint="Give one micro-batch count per stage.")
    groups = []
    for layers, nbytes in tied:
        where = sorted({int(i) for i in layers})
        if not where or where[0] < 0 or where[-1] >= n_layers or not math.isfinite(float(nbytes)) or float(nbytes) < 0:
            raise ModelSplitError(
                f"A tied group of layers {list(layers)} and {nbytes!r} bytes does not fit {n_layers} layers.",
                hint=f"Give at least one layer index in [0, {n_layers}) and bytes >= 0.",
            )
        # users[j]: how many of the group's layers lie before layer j
        users = [0, *accumulate(1 if i in where else 0 for i in range(n_layers))]
        groups.append((where[0], users, float(nbytes)))
    barred = {int(j) for j in no_cut}
    cap = math.inf if memory_cap is None else float(memory_cap)
    pt = [0.0, *accumulate(float(t) for t in layer_times)]
    ps = [0.0, *accumulate(float(x) for x in static_memory)]
    pa = [0.0, *accumulate(float(x) for x in activation_memory)]
    cuts = [float(x) for x in cut_times]
    held = [float(x) for x in cut_memory]
    inf = math.inf
    # best[j]: (slowest stage, hand-over seconds) of the best split of layers [0, j) into the stages so far
    best: list[tuple[float, float]] = [(inf, inf)] * (n_layers + 1)
    best[0] = (0.0, 0.0)
    choice: list[list[int]] = []
    for k in range(pp):
        last = k == pp - 1
        nxt: list[tuple[float, float]] = [(inf, inf)] * (n_layers + 1)
        arg = [-1] * (n_layers + 1)
        # stage k covers [i, j): at least one layer, and one layer left for each later stage
        for j in range(k + 1, n_layers - (pp - 1 - k) + 1):
            if last and j != n_layers:
                continue
            send = 0.0 if last else cuts[j - 1]
            for i in range(k, j):
                before = best[i]
                if before[0] == inf:
                    continue
                receive = cuts[i - 1] if k > 0 else 0.0
                if k > 0 and i in barred:
                    continue
                memory = ps[j] - ps[i] + in_flight[k] * (pa[j] - pa[i] + (held[i - 1] if k > 0 else 0.0))
                if groups:  # a copy of each tied group this stage uses but an earlier one holds
                    memory += sum(nbytes for first, users, nbytes in groups if first < i and users[j] > users[i])
                if memory > cap:
                    continue
                stage = pt[j] - pt[i] + receive + send
                cand = (max(before[0], stage), before[1] + send)
                if cand < nxt[j] or (last_of_ties and cand == nxt[j]):
                    nxt[j], arg[j] = cand, i
        best = nxt
        choice.append(arg)
    if best[n_layers][0] == inf:
        if barred:
            under = "" if cap == inf else f" and keeps every stage under {cap:.4g} bytes"
            raise InfeasiblePlanError(
                f"No split of {n_layers} layers into {pp} stages starts no stage at layers {sorted(barred)}{under}.",
                hint="Allow more cut points, use fewer stages or devices with more memory.",
            )
        raise InfeasiblePlanError(
            f"No split of {n_layers} layers into {pp} stages keeps every stage under {cap:.4g} bytes.",
            hint="Use more pipeline stages, a smaller micro-batch or devices with more memory.",
        )
    starts, j = [], n_layers
    for k in range(pp - 1, 0, -1):
        j = choice[k][j]
        starts.append(j)
    return tuple(reversed(starts))



def _outcome(**kwargs):
    """The boundaries, or the error's type and message (any error: a TypeError must stay one too)."""
    try:
        return partition_pipeline(**kwargs)
    except Exception as error:
        return type(error), str(error)


def _reference_outcome(**kwargs):
    try:
        return _reference(**kwargs)
    except Exception as error:
        return type(error), str(error)


def _numbers(rng: random.Random, n: int, style: str, high: float) -> list[float]:
    if style == "zero":
        return [0.0] * n
    if style == "int":  # small integers: many splits tie exactly
        return [float(rng.randint(0, 3)) for _ in range(n)]
    if style == "dyadic":  # sums stay exact, so ties survive float addition in any order
        return [rng.randint(0, 8) / 4 for _ in range(n)]
    if style == "tenths":  # sums round: equal in exact arithmetic, the order of the additions tells them apart
        return [rng.randint(0, 9) / 10 for _ in range(n)]
    return [rng.uniform(0, high) for _ in range(n)]


def _case(rng: random.Random) -> dict:
    n = rng.choice([rng.randint(1, 8), rng.randint(1, 20), rng.randint(20, 40)])
    pp = rng.randint(1, n)
    style = rng.choice(["zero", "int", "int", "dyadic", "tenths", "tenths", "float"])
    static = _numbers(rng, n, style, 6.0)
    acts = _numbers(rng, n, style, 3.0)
    held = _numbers(rng, n, style, 2.0)
    in_flight = sorted((rng.randint(1, 4) for _ in range(pp)), reverse=rng.random() < 0.7)  # 1F1B: fewer on later stages
    # caps from loose to tight around a balanced stage's bytes: some cases fit, some do not
    even = (sum(static) + max(in_flight) * (sum(acts) + max(held, default=0.0))) / pp
    cap = None if rng.random() < 0.25 else even * rng.choice([0.5, 1.0, 1.3, 2.0, 4.0]) + rng.choice([0.0, 1.0])
    tied = [(rng.sample(range(n), rng.randint(1, min(n, 4))), rng.choice([0.0, 1.0, rng.randint(1, 9) / 10, rng.uniform(0, 5)])) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
    no_cut = rng.sample(range(1, n), rng.randint(0, n - 1)) if n > 1 and rng.random() < 0.3 else []
    case = dict(
        layer_times=_numbers(rng, n, style, 5.0), pp=pp, cut_times=_numbers(rng, n, rng.choice([style, "zero"]), 2.0),
        static_memory=static, activation_memory=acts, cut_memory=held, in_flight=in_flight, memory_cap=cap, tied=tied, no_cut=no_cut,
    )
    if rng.random() < 0.3:  # the cap at the bytes of the uncapped split's fullest stage, to the last bit
        try:
            split = _reference(**{**case, "memory_cap": None})
        except InfeasiblePlanError:
            return case
        edges = [0, *split, n]
        case["memory_cap"] = max(_stage_bytes(case, k, a, b) for k, (a, b) in enumerate(zip(edges, edges[1:])))
    return case


def _stage_bytes(case: dict, k: int, a: int, b: int) -> float:
    """Stage k's bytes over layers [a, b), added up as the scalar loop adds them."""
    ps, pa = [0.0, *accumulate(case["static_memory"])], [0.0, *accumulate(case["activation_memory"])]
    memory = ps[b] - ps[a] + case["in_flight"][k] * (pa[b] - pa[a] + (case["cut_memory"][a - 1] if k > 0 else 0.0))
    if case["tied"]:
        memory += sum(nbytes for layers, nbytes in case["tied"] if min(layers) < a and any(a <= i < b for i in layers))
    return memory


def test_the_same_split_or_error_as_the_scalar_loop_on_random_cases():
    rng = random.Random(20261125)
    kinds = {"split": 0, "infeasible": 0, "no_cut": 0, "decided by a tie": 0}
    for trial in range(1500):
        case = _case(rng)
        expected = _reference_outcome(**case)
        assert _outcome(**case) == expected, (trial, case)
        if expected and expected[0] is InfeasiblePlanError:
            kinds["no_cut" if "starts no stage" in expected[1] else "infeasible"] += 1
        else:
            kinds["split"] += 1
            kinds["decided by a tie"] += _reference(**case, last_of_ties=True) != expected
    # the cases reach every outcome, each many times, and the first-found rule often picks the split
    assert min(kinds.values()) >= 100, kinds


@pytest.mark.filterwarnings("error")  # numpy's overflow warnings: the scalar loop gave none
@pytest.mark.parametrize(
    "change",
    [
        dict(pp=0), dict(pp=7), dict(pp=2.0), dict(layer_times=[1.0, -1.0, 1.0, 1.0, 1.0, 1.0]), dict(layer_times=[1.0, math.nan, 1, 1, 1, 1]),
        dict(cut_times=[1.0] * 5), dict(static_memory=[1.0, 1.0, -2.0, 1.0, 1.0, 1.0]), dict(cut_memory=[math.inf] * 6),
        dict(in_flight=[1, 1]), dict(tied=[([], 1.0)]), dict(tied=[([0, 6], 1.0)]), dict(tied=[([1, 2], -1.0)]),
        dict(memory_cap=0.0), dict(memory_cap=-1.0), dict(memory_cap=math.nan), dict(memory_cap=math.inf),
        dict(no_cut=[1, 2, 3, 4, 5]), dict(no_cut=[1, 2, 3, 4, 5], memory_cap=None), dict(no_cut=[0, -3, 99]),
        # times summing past the float range (each one finite): partition_layers' search ran on them first
        dict(layer_times=[1e308] * 6), dict(layer_times=[1e308] * 6, pp=1, in_flight=[1], memory_cap=None), dict(layer_times=[1e308, 1e308, 0, 0, 0, 0], pp=6, in_flight=[1] * 6, memory_cap=None),
        dict(layer_times=[0, 0, 0, 1e308, 1e308, 0], memory_cap=None), dict(layer_times=[0, 0, 0, 1e308, 1e308, 0], no_cut=[4]), dict(cut_times=[1e308] * 6, layer_times=[1e308] * 6, pp=1, in_flight=[1]),
        # hand-overs and bytes past the float range
        dict(cut_times=[1.7e308] * 6, layer_times=[1.7e308, 0, 0, 0, 0, 0]), dict(static_memory=[1e308] * 6), dict(activation_memory=[1e308] * 6, in_flight=[3, 2, 1]),
        dict(in_flight=[math.inf, 1, 0]), dict(in_flight=[-1, 2, 1]), dict(in_flight=[2**80, 1, 1]),
        dict(in_flight=[1, 2**1100, 1]), dict(in_flight=["2", 1, 1]),  # what multiplying by a float raises
        # copies of three tied groups summed in their order: 0.1 + 0.4 + 0.2 is 0.7, at the cap; 0.2 + 0.4 + 0.1 is over it
        dict(static_memory=[0.0] * 6, activation_memory=[0.0] * 6, cut_memory=[0.0] * 6, tied=[([0, 5], 0.1), ([0, 5], 0.4), ([0, 5], 0.2)], memory_cap=0.7),
        # 0 micro-batches times inf bytes: nan, which the scalar loop's `memory > cap` lets through
        dict(activation_memory=[1e308, 1e308, 1, 1, 1, 1], in_flight=[0, 0, 1], tied=[]),
    ],
)
def test_the_same_split_or_error_on_edge_cases(change):
    case = dict(layer_times=[1.0, 2.0, 1.0, 2.0, 1.0, 2.0], pp=3, cut_times=[0.5] * 6, static_memory=[4.0] * 6, activation_memory=[1.0] * 6,
                cut_memory=[1.0] * 6, in_flight=[3, 2, 1], memory_cap=20.0, tied=[([0, 5], 2.0)], no_cut=[])
    case.update(change)
    expected = _reference_outcome(**case)
    assert _outcome(**case) == expected, expected


def test_the_planning_benchmark_sizes_give_the_same_split():
    """96 layers in three kinds, as benchmarks/planning_scale.py plans them, at pp up to 64."""
    times = [3e-3 * (1 + i % 3) for i in range(96)]
    for pp, in_flight in ((2, [2, 1]), (8, list(range(8, 0, -1))), (32, [32] * 32), (64, list(range(64, 0, -1)))):
        case = dict(layer_times=times, pp=pp, cut_times=[1e-4] * 96, static_memory=[16e6] * 96, activation_memory=[8e6] * 96,
                    cut_memory=[8e5] * 96, in_flight=in_flight, memory_cap=2e9, tied=[([0, 95], 4e6)], no_cut=[])
        assert _outcome(**case) == _reference_outcome(**case)
