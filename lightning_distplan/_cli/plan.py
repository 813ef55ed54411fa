"""``distplan plan``: rank the plans for a saved profile (DESIGN §5)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from lightning_distplan.errors import InfeasiblePlanError
from lightning_distplan.plan import STRATEGIES

if TYPE_CHECKING:
    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.profile import Profile

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank data-parallel and pipeline plans for a saved profile",
        description="Rank every plan that factors the global batch over the world size, with predicted step time and memory.",
    )
    parser.add_argument("--profile", required=True, help="profile JSON written by `distplan profile`")
    parser.add_argument("--world-size", type=int, required=True, help="number of devices")
    parser.add_argument("--num-nodes", type=int, default=1,
                        help="machines the --world-size ranks are spread over, as Trainer(num_nodes=...) (default 1); for a CPU profile "
                        "each machine's RAM is shared by its world-size / num-nodes ranks, and over several machines the pipeline stages on "
                        "one machine share its link (--bandwidth-gbps) for their gradient all-reduces")
    parser.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step (kept exactly)")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="table (default) or a JSON list of candidates")
    parser.add_argument("--top", type=int, default=None, help="show only the best K candidates (table default: 10; json default: all)")
    parser.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), help="strategies to consider")
    parser.add_argument(
        "--pin", action="append", default=[], metavar="KEY=VALUE",
        help="fix part of the plan, as AutoPlanStrategy(pins=...) does (repeatable): strategy=1f1b, stages=2 (or pp), dp=2, "
        "micro_batch_size=8, accumulate_grad_batches=4, n_microbatches=8, schedule=gpipe, stage_boundaries=6,12",
    )
    parser.add_argument("--max-pp", type=int, default=None, help="most pipeline stages to consider (default: as many as the profile has layers and the world size allows)")
    parser.add_argument("--device-memory-gb", type=float, default=None, help="one device's memory in GiB (default: the profiled device's; for a CPU profile, the host's RAM shared by the ranks on one "
                        "machine, --world-size / --num-nodes)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None, help="interconnect bandwidth in Gbit/s (default: measured, else 4)")
    parser.add_argument("--latency-us", type=float, default=None, help="interconnect latency in microseconds (default: measured, else 50)")
    parser.add_argument("--compute-scale", type=float, default=1.0, help="multiply profiled compute times (e.g. 0.5 for a 2x faster device)")
    parser.add_argument("--memory-margin", type=float, default=0.9, help="usable fraction of device memory (default 0.9)")
    parser.add_argument("--price-per-hour", type=float, default=None, help="price of one device per hour: rank by C + w*T (0: free devices, ranked by step time at cost 0)")
    parser.add_argument("--time-weight", type=float, default=0.0, help="w in C + w*T (with --price-per-hour; default 0)")
    parser.set_defaults(run=run)


def parse_pins(items: list[str]) -> dict[str, object]:
    """``["strategy=1f1b", "stages=2", "stage_boundaries=6,12"]`` -> pins as ``AutoPlanStrategy(pins=...)`` takes them.

    Counts become integers and ``stage_boundaries`` a list; every other value stays text, and the planner
    judges the keys and values as it does for ``AutoPlanStrategy`` (an unknown key, an unknown strategy)."""
    from lightning_distplan.errors import InfeasiblePlanError

    counts = ("dp", "pp", "stages", "micro_batch_size", "accumulate_grad_batches", "n_microbatches")
    pins: dict[str, object] = {}
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise InfeasiblePlanError(f"--pin {item!r} is not KEY=VALUE.", hint="Pass e.g. --pin strategy=1f1b --pin micro_batch_size=8.")
        if key in pins:
            raise InfeasiblePlanError(f"--pin {key} is given twice.", hint="Pin each key once.")
        try:
            pins[key] = [int(v) for v in value.split(",")] if key == "stage_boundaries" else int(value) if key in counts else value
        except ValueError:
            what = "a comma-separated list of layer indices" if key == "stage_boundaries" else "a whole number"
            example = "the index of the first layer of each stage after the first, e.g. --pin stage_boundaries=3 (2 stages) or 2,4 (3 stages)" \
                if key == "stage_boundaries" else f"e.g. --pin {key}=4"
            raise InfeasiblePlanError(f"--pin {key}={value!r} is not {what}.", hint=f"Pass {example}.") from None
    return pins


_MAX_DEVICE_MEMORY_BYTES = 2**60
"""The most --device-memory-gb may give (1 EiB, a million times today's largest GPU): beyond it bytes are no count."""

# The options whose size can carry a prediction past what a float holds, and their defaults.
_SCALES = (("compute_scale", 1.0), ("latency_us", None), ("bandwidth_gbps", None), ("price_per_hour", None), ("time_weight", 0.0))


def _given_scales(args: argparse.Namespace) -> str:
    given = [f"--{name.replace('_', '-')} {getattr(args, name):g}" for name, default in _SCALES if getattr(args, name) != default]
    return ", ".join(given) or "this profile"


def _check_magnitudes(profile: Profile, args: argparse.Namespace, hardware: Hardware) -> None:
    """Refuse options that would carry a prediction past what a float holds, before the planner computes with them.

    The bound is every profiled time at the whole global batch on one device, scaled, plus every byte a plan could
    send over the slower link and a latency per message, with a million-fold margin (schedules add stage times
    up; costs multiply by the devices): far beyond any real plan, and far below overflow for any real option."""
    gb, n = args.global_batch_size, len(profile.layers)
    fits = [profile.step.forward, profile.step.backward] + [fit for layer in profile.layers for fit in (layer.forward, layer.backward)]
    compute = sum(abs(fit.alpha) * gb + abs(fit.beta) for fit in fits) + profile.optimizer.step_time_s
    sent = 2 * profile.memory.param_bytes + gb * sum(layer.output_bytes_per_sample for layer in profile.layers)
    bandwidth = min(hardware.allreduce_bandwidth_bytes_per_s, hardware.p2p_bandwidth_bytes_per_s)
    latency = max(hardware.allreduce_latency_s, hardware.p2p_latency_s)
    bound = 1e6 * (compute * hardware.compute_scale + 2 * sent / bandwidth + 4 * (n + 1) * gb * latency)
    cost = bound * args.world_size * (args.price_per_hour or 0.0) / 3600
    if not (math.isfinite(bound) and math.isfinite(cost) and math.isfinite(cost + args.time_weight * bound)):
        raise InfeasiblePlanError(
            f"The predicted step {'cost' if math.isfinite(bound) else 'time'} overflows what a float holds with {_given_scales(args)}.",
            hint="Pass values in a realistic range (e.g. --compute-scale 0.5, --latency-us 20, --price-per-hour 3, --time-weight 4096).",
        )


def _check_finite(candidates: list, args: argparse.Namespace) -> None:
    """Refuse a ranking whose predictions overflowed (``--compute-scale 1e308``): it would print inf, which no JSON reader takes."""
    for candidate in candidates:
        bad = _non_finite(candidate.to_dict())
        if bad is not None:
            field, value = bad
            raise InfeasiblePlanError(
                f"Plan {candidate.plan.describe()} predicts {field} = {value} with {_given_scales(args)}: the numbers "
                "overflow what a float holds.",
                hint="Pass values in a realistic range (e.g. --compute-scale 0.5, --price-per-hour 3, --time-weight 4096).",
            )


def _non_finite(value: object, field: str = "") -> tuple[str, float] | None:
    """The first (field, value) in ``value`` that is an infinite or NaN float, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (field, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite(item, key if isinstance(key, str) and not field else f"{field}.{key}" if isinstance(key, str) else f"{field}[{key}]")
        if found is not None:
            return found
    return None


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from lightning_distplan.costmodel import Hardware
    from lightning_distplan.planner import closest_to_fitting, enumerate_plans, explain, rank_plans
    from lightning_distplan.profile import Profile

    if args.top is not None and args.top < 1:
        raise InfeasiblePlanError(f"--top must be at least 1, got {args.top}.", hint="Pass --top 10, or leave it out.")
    profile = Profile.load(args.profile)
    pins = parse_pins(args.pin)
    # Validate sizes, factoring, pins and every number before building the hardware, so bad input gives
    # one error line and not a link-default warning first.
    enumerate_plans(
        profile, world_size=args.world_size, global_batch_size=args.global_batch_size, strategies=tuple(args.strategy), max_pp=args.max_pp,
        pins=pins,
    )
    if args.num_nodes < 1 or args.world_size % args.num_nodes:
        raise InfeasiblePlanError(
            f"--num-nodes {args.num_nodes} does not divide --world-size {args.world_size} into the same number of ranks per machine.",
            hint="Pass as --num-nodes the machines the ranks run on, each with the same number of ranks "
            "(--world-size = machines x ranks per machine), or leave it out for one machine.",
        )
    for flag, example in (("device_memory_gb", 16), ("bandwidth_gbps", 10), ("latency_us", 20)):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and (value > 0 or (flag == "latency_us" and value == 0))):
            at_least = "zero or more" if flag == "latency_us" else "positive"
            option = "--" + flag.replace("_", "-")
            raise InfeasiblePlanError(f"{option} must be a finite number, {at_least}, got {value}.", hint=f"Pass e.g. {option} {example}.")
    if args.device_memory_gb is not None and args.device_memory_gb * 2**30 > _MAX_DEVICE_MEMORY_BYTES:
        raise InfeasiblePlanError(
            f"--device-memory-gb {args.device_memory_gb:g} is more than any device holds (the limit here is {_MAX_DEVICE_MEMORY_BYTES // 2**30} GiB, 2**60 bytes).",
            hint="Pass the memory of one device in GiB, e.g. --device-memory-gb 80.",
        )
    if args.bandwidth_gbps is not None:
        # the largest message a plan sends: the gradients' all-reduce, or one layer's output for the whole global batch
        largest = max([1, profile.memory.param_bytes] + [layer.output_bytes_per_sample * args.global_batch_size for layer in profile.layers])
        if not math.isfinite(largest / (args.bandwidth_gbps * 1e9 / 8)):
            raise InfeasiblePlanError(
                f"--bandwidth-gbps {args.bandwidth_gbps:g} is so small that sending this model's {largest:.4g} bytes would take longer than a float can hold.",
                hint="Pass the interconnect's bandwidth in Gbit/s, e.g. --bandwidth-gbps 10.",
            )
    if not (math.isfinite(args.compute_scale) and args.compute_scale > 0):
        raise InfeasiblePlanError(f"--compute-scale must be positive, got {args.compute_scale}.", hint="Pass e.g. 0.5 for a device twice as fast.")
    if not 0 < args.memory_margin <= 1:
        raise InfeasiblePlanError(f"--memory-margin must be in (0, 1], got {args.memory_margin}.", hint="Pass e.g. 0.9 to keep 10% headroom.")
    if args.price_per_hour is not None and not (math.isfinite(args.price_per_hour) and args.price_per_hour >= 0):
        raise InfeasiblePlanError(f"--price-per-hour must be a non-negative number, got {args.price_per_hour}.", hint="Pass the hourly price of one device.")
    if not (math.isfinite(args.time_weight) and args.time_weight >= 0):
        raise InfeasiblePlanError(f"--time-weight must be a non-negative number, got {args.time_weight}.", hint="Use e.g. 0, 256, 4096 or 65536.")
    if args.time_weight and args.price_per_hour is None:
        # w only weighs time against money (C + w*T); without a price the ranking is by time and w would be silently ignored.
        raise InfeasiblePlanError(f"--time-weight {args.time_weight} was given without --price-per-hour.", hint="Add --price-per-hour, or leave --time-weight out to rank by step time.")
    ranks_per_host = args.world_size // args.num_nodes
    hardware = Hardware.from_profile(
        profile,
        device_memory_bytes=None if args.device_memory_gb is None else max(1, int(args.device_memory_gb * 2**30)),
        bandwidth_bytes_per_s=None if args.bandwidth_gbps is None else args.bandwidth_gbps * 1e9 / 8,
        latency_s=None if args.latency_us is None else args.latency_us * 1e-6,
        # a CPU profile's memory is one host's RAM, shared by the ranks on it; over several nodes the stages of a hybrid
        # dp x pp on one node cross its one link with their all-reduces at once, as auto_plan prices them (choose_plan)
        ranks_per_host=ranks_per_host, world_size=args.world_size,
    )
    hardware = replace(hardware, compute_scale=args.compute_scale, memory_margin=args.memory_margin)
    _check_magnitudes(profile, args, hardware)
    candidates = rank_plans(
        profile,
        world_size=args.world_size,
        global_batch_size=args.global_batch_size,
        hardware=hardware,
        price_per_hour=args.price_per_hour,
        time_weight=args.time_weight,
        strategies=tuple(args.strategy),
        max_pp=args.max_pp,
        pins=pins,
    )
    _check_finite(candidates, args)
    if args.format == "json":
        shown = candidates if args.top is None else candidates[: args.top]
        print(json.dumps([c.to_dict() for c in shown], indent=1, allow_nan=False))  # standard JSON: _check_finite refused inf and NaN
    else:
        print(explain(candidates, top=10 if args.top is None else args.top))
    if not any(c.prediction.feasible for c in candidates):
        # The ranking is still printed (it shows how far off each plan is), but a script must not take
        # candidate 1 for a runnable plan (DESIGN §3.4): exit non-zero.
        closest = closest_to_fitting(candidates)
        why = closest.prediction.reason.rstrip(".")
        print(
            f"distplan plan: error: no plan is feasible; the closest, {closest.plan.describe()}, fails because {why[:1].lower() + why[1:]}. "
            "HINT: use more devices, a smaller global batch, or a device with more memory (--device-memory-gb).",
            file=sys.stderr,
        )
        return 1
    return 0
