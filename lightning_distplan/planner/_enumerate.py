"""Every plan that runs the user's global batch on ``world_size`` devices (DESIGN §3.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from lightning_distplan.errors import BatchNotFactorableError, InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES, Plan, as_int, whole_indices
from lightning_distplan.profile import unsplittable

if TYPE_CHECKING:
    from lightning_distplan.profile import Profile

__all__ = ["enumerate_plans", "check_batch_before_profiling", "nearest_valid_batch_sizes", "satisfies_pins", "PIN_KEYS", "PIN_ALIASES", "MAX_WORLD_SIZE"]

PIN_KEYS = (
    "strategy",
    "schedule",
    "dp",
    "pp",
    "micro_batch_size",
    "accumulate_grad_batches",
    "n_microbatches",
    "stage_boundaries",
)
_SCHEDULE_TO_STRATEGY = {"none": "dp_ga", "gpipe": "gpipe", "1f1b": "1f1b"}
# Other names a pin may be given by: ``AutoPlanStrategy(stages=2)`` pins ``pp``; messages use the name given.
PIN_ALIASES = {"stages": "pp"}


# The largest global batch planned for: 16.7M samples, beyond any published training setup.
MAX_GLOBAL_BATCH = 1 << 24
# The most devices planned for (65,536).
MAX_WORLD_SIZE = 1 << 16


def _divisors(x: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(x) + 1) if x % d == 0]
    return sorted({*small, *(x // d for d in small)})


def _check_sizes(world_size: Any, global_batch_size: Any) -> tuple[int, int]:
    """The world size and global batch as Python ints (numpy integers taken), or refused in one sentence."""
    checked = []
    for name, value, limit in (("world_size", world_size, MAX_WORLD_SIZE), ("global_batch_size", global_batch_size, MAX_GLOBAL_BATCH)):
        count = as_int(value)
        if count is None or count < 1:
            raise InfeasiblePlanError(
                f"`{name}` must be a positive integer, got {value!r}.",
                hint="Pass the number of devices (--world-size) and the samples per optimizer step (--global-batch-size), both >= 1.",
            )
        if count > limit:
            raise InfeasiblePlanError(
                f"`{name}` {count} is above the {limit} this planner handles.",
                hint="Check the number: it counts devices (--world-size) and samples per optimizer step (--global-batch-size).",
            )
        checked.append(count)
    return checked[0], checked[1]


def _check_strategies(strategies: Iterable[str]) -> tuple[str, ...]:
    choices = ", ".join(STRATEGIES)
    # A string is iterable: "dp_ga" would be read as the strategies 'd', 'p', '_', 'g', 'a'.
    if isinstance(strategies, str):
        raise InfeasiblePlanError(f"`strategies` must be a list of strategy names, got the string {strategies!r}.",
                                  hint=f"Pass a list, e.g. strategies=[{strategies!r}] (choose from {choices}).")
    try:
        chosen = tuple(dict.fromkeys(strategies))
    except TypeError:  # None, a number, a list holding a list
        raise InfeasiblePlanError(f"`strategies` must be a list of strategy names, got {strategies!r}.",
                                  hint=f"Pass a list of some of {choices}, e.g. strategies=['dp_ga'].") from None
    if not chosen:
        raise InfeasiblePlanError("`strategies` is empty, so there is no plan to consider.", hint=f"Pass one or more of {choices}, or leave it out for all.")
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise InfeasiblePlanError(f"Unknown strategies {unknown}.", hint=f"Choose from {choices}.")
    return chosen


def _check_max_pp(max_pp: Any) -> int | None:
    if max_pp is None:
        return None
    count = as_int(max_pp)
    if count is None or count < 1:
        raise InfeasiblePlanError(f"`max_pp` must be a positive integer or None, got {max_pp!r}.", hint="Pass e.g. --max-pp 4, or leave it out.")
    return count


def _no_pipeline_reason(profile: Profile, world_size: int, max_pp: int | None) -> str | None:
    """Why no pipeline plan can exist on ``world_size`` devices whatever the batch, or None if one can."""
    if world_size < 2:
        return f"a pipeline needs at least 2 devices and the world size is {world_size}"
    if profile.pipeline_refusal:
        return profile.pipeline_refusal
    n_layers = len(profile.layers)
    limit = n_layers if max_pp is None else min(n_layers, max_pp)
    stage_counts = [pp for pp in _divisors(world_size) if pp >= 2]
    if not any(pp <= limit for pp in stage_counts):
        if max_pp is not None and max_pp < n_layers:
            bound = f"max_pp is {max_pp}"
        else:
            bound = f"the profile has only {n_layers} layer{'' if n_layers == 1 else 's'}"
        return f"every pipeline on {world_size} devices needs {stage_counts[0]} or more stages, but {bound}"
    return None


def _raw_plans(
    profile: Profile, world_size: int, global_batch_size: int, strategies: Sequence[str], max_pp: int | None
) -> list[Plan]:
    """All factorisations, unpinned. Pipelines only when the profile says the model can be split."""
    n_layers = len(profile.layers)
    names = tuple(layer.name for layer in profile.layers)
    plans: list[Plan] = []
    for pp in _divisors(world_size):
        dp = world_size // pp
        if global_batch_size % dp:
            continue
        per_replica = global_batch_size // dp
        for m in _divisors(per_replica):
            if m < profile.min_micro_batch_size:  # the model refused such micro-batches when profiled
                continue
            steps = per_replica // m
            if pp == 1:
                if "dp_ga" in strategies:
                    # DESIGN §3.1: B = dp · m · s
                    plans.append(Plan(strategy="dp_ga", dp=dp, micro_batch_size=m, accumulate_grad_batches=steps, global_batch_size=global_batch_size, layer_names=names))
                continue
            if profile.pipeline_refusal or pp > n_layers or (max_pp is not None and pp > max_pp):
                continue
            for strategy in ("gpipe", "1f1b"):
                if strategy not in strategies or (strategy == "1f1b" and steps < pp):
                    continue  # 1F1B needs at least one micro-batch per stage in flight
                # DESIGN §3.1: B = dp · m · n
                plans.append(
                    Plan(strategy=strategy, dp=dp, pp=pp, micro_batch_size=m, n_microbatches=steps, global_batch_size=global_batch_size, layer_names=names)
                )
    return plans


def nearest_valid_batch_sizes(
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    strategies: Sequence[str] = STRATEGIES,
    max_pp: int | None = None,
) -> tuple[int | None, int]:
    """The closest global batch sizes below (None if none) and above ``global_batch_size`` that some plan factors.

    Each (strategy, dp, pp) that :func:`enumerate_plans` may form is solved on its own, in
    per-replica samples r (B = dp·r): dp_ga and GPipe take any r from the smallest micro-batch the
    model accepts up (one micro-batch of r), 1F1B an r = m·n with m that large and n ≥ pp, which
    every multiple of ``need·pp`` is; so each search ends within ``need·pp`` steps, whatever the
    world size.
    """
    strategies = _check_strategies(strategies)
    need = profile.min_micro_batch_size
    options: list[tuple[int, int, str]] = []  # (dp, pp, strategy)
    for pp in _divisors(world_size):
        if pp == 1:
            options += [(world_size, 1, "dp_ga")] if "dp_ga" in strategies else []
        elif not (profile.pipeline_refusal or pp > len(profile.layers) or (max_pp is not None and pp > max_pp)):
            options += [(world_size // pp, pp, s) for s in ("gpipe", "1f1b") if s in strategies]
    if not options:
        refused = f"; the model refused micro-batches of {_samples(need - 1)} when profiled" if need > 1 else ""
        raise BatchNotFactorableError(
            f"No global batch size near {global_batch_size} can be factored for the strategies {list(strategies)} on {world_size} devices{refused}.",
            hint="Allow strategy 'dp_ga', or check that the profile is splittable for pipelines.",
        )

    def factors(r: int, pp: int, strategy: str) -> bool:
        if strategy != "1f1b":
            return r >= need
        return any(m >= need and r // m >= pp for m in _divisors(r))

    below: int | None = None
    above = None
    for dp, pp, strategy in options:
        least = need * pp if strategy == "1f1b" else need  # the fewest samples per replica it takes
        r = max(global_batch_size // dp + 1, least)
        while not factors(r, pp, strategy):
            r += 1
        above = dp * r if above is None else min(above, dp * r)
        r = (global_batch_size - 1) // dp
        while r >= least and not factors(r, pp, strategy):
            r -= 1
        if r >= least:
            below = dp * r if below is None else max(below, dp * r)
    assert above is not None  # options is not empty
    return below, above


def _samples(n: int) -> str:
    return "1 sample" if n == 1 else f"{n} samples or fewer"


def _plan_value(plan: Plan, key: str) -> Any:
    if key == "schedule":
        return plan.schedule
    return getattr(plan, key)


def _factored_plans(profile: Any, world_size: int, global_batch_size: int, strategies: Sequence[str], max_pp: int | None) -> list[Plan]:
    """:func:`_raw_plans`, refused in one sentence (BatchNotFactorableError) when there is none.

    ``profile`` is read for its ``layers`` (their names), ``pipeline_refusal`` and ``min_micro_batch_size`` only
    (:func:`check_batch_before_profiling` passes a :class:`_Shape`)."""
    plans = _raw_plans(profile, world_size, global_batch_size, strategies, max_pp)
    if not plans and "dp_ga" not in strategies:
        # Pipeline-only and no pipeline can exist at any batch size: say why, not "B does not factor".
        reason = _no_pipeline_reason(profile, world_size, max_pp)
        if reason is not None:
            raise BatchNotFactorableError(
                f"No {'/'.join(strategies)} plan exists on {world_size} devices: {reason}.",
                hint="Allow strategy 'dp_ga', or change the world size / max_pp, or give the LightningModule a `pipeline_spec()` hook.",
            )
    if not plans:
        below, above = nearest_valid_batch_sizes(
            profile, world_size=world_size, global_batch_size=global_batch_size, strategies=strategies, max_pp=max_pp
        )
        nearest = (f"{below} or " if below else "") + str(above)
        need = profile.min_micro_batch_size
        per_device = f" with at least {need} samples per device" if need > 1 else ""
        pipelines = "" if not profile.pipeline_refusal and any(s != "dp_ga" for s in strategies) else f" (data parallel only: B must be a multiple of the world size{per_device})"
        refused = f"; the model refused micro-batches of {_samples(need - 1)} when profiled (e.g. BatchNorm), so every micro-batch needs {need} or more" if need > 1 else ""
        raise BatchNotFactorableError(
            f"Global batch size {global_batch_size} cannot be factored over {world_size} devices{pipelines}{refused}.",
            hint=f"Use the nearest valid global batch size, {nearest}, or a world size that divides it.",
        )
    return plans


@dataclass(frozen=True)
class _ShapeLayer:
    name: str


@dataclass(frozen=True)
class _Shape:
    """What factoring the global batch reads of a profile, known before profiling (the smallest micro-batch is 1 until
    the profiler finds sizes the model refuses)."""

    layers: tuple[_ShapeLayer, ...]
    pipeline_refusal: str | None
    min_micro_batch_size: int = 1


def check_batch_before_profiling(
    *, world_size: int, global_batch_size: int, n_layers: int, split_reason: str | None = None, strategies: Sequence[str] = STRATEGIES
) -> None:
    """Refuse a global batch that no plan factors on ``world_size`` devices, before a profile is taken (minutes on a
    large model): with only data parallel one that is no multiple of the world size, and so also one smaller than it;
    with pipelines, one that no dp dividing both it and the world size leaves at most ``n_layers`` stages for.

    ``n_layers``: the layers the profiler will find (``discover_layers``); ``split_reason``: why the model cannot be
    split into pipeline stages, when it cannot. The profile may refuse more (micro-batches the model rejects), not fewer.

    Raises:
        BatchNotFactorableError: the message :func:`enumerate_plans` gives, with the nearest valid sizes.
        InfeasiblePlanError: a world size or global batch that is not a positive integer, or unknown strategies.
    """
    world_size, global_batch_size = _check_sizes(world_size, global_batch_size)
    strategies = _check_strategies(strategies)
    shape = _Shape(
        layers=tuple(_ShapeLayer(f"layer {i}") for i in range(max(1, n_layers))),
        pipeline_refusal=None if split_reason is None else unsplittable(split_reason),
    )
    _factored_plans(shape, world_size, global_batch_size, strategies, None)


def _pin_names(pins: dict[str, Any] | None) -> dict[str, str]:
    """The name each pin was given by, keyed by its canonical name (``{"pp": "stages"}``)."""
    return {PIN_ALIASES.get(key, key): key for key in pins or {}}


def _normalise_pins(pins: dict[str, Any] | None) -> dict[str, Any]:
    if not pins:
        return {}
    unknown = sorted(set(pins) - set(PIN_KEYS) - set(PIN_ALIASES))
    if unknown:
        named = ", ".join(f"{key} (or {alias})" if alias else key for key in PIN_KEYS
                          for alias in [next((a for a, k in PIN_ALIASES.items() if k == key), None)])
        raise InfeasiblePlanError(f"Unknown pins {unknown}.", hint=f"Pin any of {named}.")
    both = [f"{alias}/{key}" for alias, key in PIN_ALIASES.items() if alias in pins and key in pins]
    if both:
        raise InfeasiblePlanError(f"The pins {', '.join(both)} name the same thing twice.", hint="Pin it once.")
    out = {PIN_ALIASES.get(key, key): value for key, value in pins.items()}
    if "schedule" in out:
        if out["schedule"] not in _SCHEDULE_TO_STRATEGY:
            raise InfeasiblePlanError(f"Pinned schedule {out['schedule']!r} is unknown.", hint="Use 'none' (dp_ga), 'gpipe' or '1f1b'.")
    if "strategy" in out and out["strategy"] not in STRATEGIES:
        raise InfeasiblePlanError(f"Pinned strategy {out['strategy']!r} is unknown.", hint=f"Use one of {', '.join(STRATEGIES)}.")
    names = _pin_names(pins)
    for key in ("dp", "pp", "micro_batch_size", "accumulate_grad_batches", "n_microbatches"):
        if isinstance(out.get(key), bool):  # True == 1: a flag given where a count belongs
            raise InfeasiblePlanError(f"The pin {names[key]}={out[key]!r} is not a count.", hint=f"Pin {names[key]} to a positive integer.")
        if key in out and (count := as_int(out[key])) is not None:
            out[key] = count  # a numpy integer as a Python one
    if "stage_boundaries" in out:
        whole = whole_indices(out["stage_boundaries"])
        if whole is None:
            raise InfeasiblePlanError(
                f"The pin stage_boundaries={out['stage_boundaries']!r} is not a list of whole layer indices.",
                hint="Give the index of the first layer of every stage after the first, e.g. [6, 12, 18].",
            )
        out["stage_boundaries"] = whole
    return out


def _pin_reason(
    key: str, value: Any, profile: Profile, world_size: int, global_batch_size: int, strategies: Sequence[str], name: str | None = None
) -> str:
    """Why a pin that matches no plan is impossible on its own (best effort, one clause); ``name`` is what the user called it."""
    name = name or key
    n_layers = len(profile.layers)
    if key in ("strategy", "schedule"):
        strategy = value if key == "strategy" else _SCHEDULE_TO_STRATEGY[value]
        if strategy not in strategies:
            return f"strategy {strategy!r} is not among the allowed strategies {list(strategies)}"
        if strategy != "dp_ga" and profile.pipeline_refusal:
            return profile.pipeline_refusal
        if strategy != "dp_ga" and world_size < 2:
            return _NEEDS_TWO
        if strategy != "dp_ga" and n_layers < 2:
            return f"the model has only {n_layers} pipeline layer{'s' if n_layers != 1 else ''}, so no pipeline of 2 or more stages"
    if key in ("dp", "pp") and (reason := _world_size_reason(key, value, world_size, name)):
        return reason
    if key == "pp":
        if value > 1 and profile.pipeline_refusal:
            return profile.pipeline_refusal
        if value > n_layers:
            return f"the profile has only {n_layers} layer{'s' if n_layers != 1 else ''}, so at most {n_layers} stage{'s' if n_layers != 1 else ''}"
    if reason := _divisor_reason(key, value, global_batch_size):
        return reason
    if key == "stage_boundaries":
        b = value
        if not _valid_boundaries(b, n_layers):
            return f"boundaries must be strictly increasing layer indices in 1..{n_layers - 1}"
        if profile.pipeline_refusal:
            return profile.pipeline_refusal
        if reason := _world_size_reason(key, b, world_size, name):
            return reason
    return f"no plan with B={global_batch_size} on {world_size} devices has it"


def check_pins_before_profiling(
    pins: dict[str, Any] | None, *, world_size: int, split_reason: str | None = None, global_batch_size: int | None = None
) -> None:
    """Refuse the pins that no profile could make possible, before one is taken (profiling a large model takes minutes).

    What the world size alone decides: ``dp`` / ``stages`` must divide it, stage boundaries must make
    a number of stages that divides it, a pipeline needs 2 devices; and, with ``split_reason`` (why the
    model cannot be split, when it cannot), no pipeline pin at all; with ``global_batch_size``, the counts that must
    divide it (micro-batch size, accumulation, micro-batches per flush). The rest waits for the profile.

    Raises:
        InfeasiblePlanError: the pin named as the user gave it, and why (the message :func:`enumerate_plans` gives).
    """
    names = _pin_names(pins)
    pins = _normalise_pins(pins)
    pipeline = pins.get("strategy", "dp_ga") != "dp_ga" or pins.get("schedule", "none") != "none" or pins.get("pp", 1) != 1 or "stage_boundaries" in pins

    for key in ("dp", "pp", "stage_boundaries"):
        if key in pins and (reason := _world_size_reason(key, pins[key], world_size, names[key])):
            raise _impossible_pin(names[key], pins[key], reason)
    if pipeline:
        key = next(k for k in ("strategy", "schedule", "pp", "stage_boundaries") if k in pins and (k != "pp" or pins[k] != 1))
        if world_size < 2:
            raise _impossible_pin(names[key], pins[key], _NEEDS_TWO)
        if split_reason is not None:
            raise _impossible_pin(names[key], pins[key], unsplittable(split_reason))
    if global_batch_size is not None:
        for key in ("micro_batch_size", "accumulate_grad_batches", "n_microbatches"):
            if key in pins and (reason := _divisor_reason(key, pins[key], global_batch_size)):
                raise _impossible_pin(names[key], pins[key], reason)


_NEEDS_TWO = "a pipeline needs at least 2 devices"


def _divisor_reason(key: str, value: Any, global_batch_size: int) -> str | None:
    """Why a micro-batch / accumulation / micro-batches-per-flush pin cannot divide the global batch, or None."""
    if key in ("micro_batch_size", "accumulate_grad_batches", "n_microbatches") and (
        not isinstance(value, int) or value < 1 or global_batch_size % value
    ):
        return f"it must be a positive divisor of the global batch size {global_batch_size}"
    return None


def _world_size_reason(key: str, value: Any, world_size: int, name: str) -> str | None:
    """Why a ``dp`` / ``pp`` / ``stage_boundaries`` pin cannot fit ``world_size`` devices, or None."""
    if key in ("dp", "pp") and (not isinstance(value, int) or value < 1 or world_size % value):
        return f"{name} must divide world_size {world_size}"
    if key == "stage_boundaries" and world_size % (len(value) + 1):
        return f"{len(value) + 1} stages do not divide world_size {world_size}"
    return None


def _impossible_pin(name: str, value: Any, reason: str) -> InfeasiblePlanError:
    shown = list(value) if isinstance(value, tuple) else value  # stage boundaries, normalised to a tuple
    return InfeasiblePlanError(f"The pin {name}={shown!r} is impossible: {reason}.", hint="Drop or change that pin.")


def _valid_boundaries(b: tuple[int, ...], n_layers: int) -> bool:
    return bool(b) and all(0 < x < n_layers for x in b) and all(x < y for x, y in zip(b, b[1:]))


def _matches(plan: Plan, key: str, value: Any) -> bool:
    if key == "stage_boundaries":
        return plan.pp == len(value) + 1
    if key == "schedule":
        return plan.schedule == value
    return _plan_value(plan, key) == value


def satisfies_pins(plan: Plan, pins: dict[str, Any] | None) -> bool:
    """Whether a finished plan (e.g. one stored in a checkpoint) has every pinned value, stage boundaries included."""
    pins = _normalise_pins(pins)
    return all(
        plan.stage_boundaries == value if key == "stage_boundaries" else _matches(plan, key, value) for key, value in pins.items()
    )


def enumerate_plans(
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    strategies: Sequence[str] = STRATEGIES,
    max_pp: int | None = None,
    pins: dict[str, Any] | None = None,
) -> list[Plan]:
    """Every plan with dp · pp = ``world_size`` that factors ``global_batch_size`` exactly.

    ``dp_ga``: B = dp·m·s. ``gpipe``/``1f1b``: B = dp·m·n with 2 ≤ pp ≤ number of profiled layers,
    only when ``profile.splittable``; 1F1B needs n ≥ pp. Plans carry the profile's layer names;
    pipeline plans leave ``stage_boundaries`` empty (the cost model balances them) unless pinned.

    Args:
        profile: the measured profile.
        world_size: devices in total.
        global_batch_size: samples per optimizer step (the user's, never changed).
        strategies: which of ``dp_ga``, ``gpipe``, ``1f1b`` to consider.
        max_pp: the most pipeline stages to consider.
        pins: fix any of :data:`PIN_KEYS`, e.g. ``{"strategy": "1f1b", "micro_batch_size": 4}``
            (``stages`` may stand for ``pp``; messages name a pin as given).

    Raises:
        InfeasiblePlanError: bad sizes or ``max_pp``, an unknown strategy or pin, or a pin no plan satisfies (named, with why).
        BatchNotFactorableError: no plan factors the global batch (lists the nearest valid sizes), or only
            pipelines are allowed and none can exist on ``world_size`` devices (says why: the model cannot
            be split, more stages than layers, a single device).
    """
    world_size, global_batch_size = _check_sizes(world_size, global_batch_size)
    strategies = _check_strategies(strategies)
    max_pp = _check_max_pp(max_pp)
    names = _pin_names(pins)
    pins = _normalise_pins(pins)
    plans = _factored_plans(profile, world_size, global_batch_size, strategies, max_pp)
    for key, value in pins.items():
        name = names[key]
        if (key == "stage_boundaries" and not _valid_boundaries(value, len(profile.layers))) or not any(_matches(plan, key, value) for plan in plans):
            raise _impossible_pin(name, value, _pin_reason(key, value, profile, world_size, global_batch_size, strategies, name))
    chosen = [plan for plan in plans if all(_matches(plan, k, v) for k, v in pins.items())]
    if not chosen:
        pinned = ", ".join(f"{names[k]}={v!r}" for k, v in pins.items())
        raise InfeasiblePlanError(
            f"The pins {pinned} are each possible but no plan with B={global_batch_size} on {world_size} devices satisfies all of them together.",
            hint="Drop one of the pins; dp·pp must equal the world size and dp·m·(s or n) the global batch.",
        )
    if "stage_boundaries" in pins:
        chosen = [replace(plan, stage_boundaries=pins["stage_boundaries"]) for plan in chosen]
    return chosen
