"""The tuner's configuration space and how one configuration is priced (shared by Optuna and exhaustive search).

A configuration is (instance type, instance count, plan): the plan is one of
:func:`lightning_distplan.planner.enumerate_plans` for the world size the instances give, so every
configuration factors the global batch exactly (DESIGN §3.1). Pricing projects the profile to the
instance's GPU (:mod:`lightning_distplan.costmodel.projection`), builds a
:class:`~lightning_distplan.costmodel.Hardware` from the catalog row, and applies the cost model and
the objective C + w·T (seed 000 §IV-D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from lightning_distplan.costmodel import DEFAULT_LATENCY_S, Hardware, cost_per_step, objective, predict
from lightning_distplan.costmodel.projection import ProjectionInfo, project_profile
from lightning_distplan.errors import BatchNotFactorableError, CatalogError, DistPlanError, InfeasiblePlanError, ModelSplitError
from lightning_distplan.plan import STRATEGIES, Plan
from lightning_distplan.planner import enumerate_plans
from lightning_distplan.planner._enumerate import MAX_WORLD_SIZE
from lightning_distplan.profile import Profile, unsplittable
from lightning_distplan.tuner.catalog import Catalog, Instance

__all__ = ["ConfigSpace", "TunedConfig"]

NETWORK_LATENCY_S = DEFAULT_LATENCY_S
# source: assumption (costmodel.DEFAULT_LATENCY_S, 50 µs) - TCP between instances in one region; catalogs
# do not publish latency.
INTRA_NODE_LATENCY_S = 10e-6
# source: assumption - NCCL small-message latency between GPUs of one machine is on the order of 10 µs.


@dataclass(frozen=True, kw_only=True)
class TunedConfig:
    """One priced configuration: what to rent, how to run it, and what the model expects."""

    instance_type: str
    count: int
    """Instances rented."""
    gpu: str
    world_size: int
    plan: Plan
    step_time_s: float
    """Predicted seconds per optimizer step (central projection)."""
    step_time_band_s: tuple[float, float]
    """The projection's stated uncertainty band on ``step_time_s``."""
    cost_per_step: float
    """count · price_per_hour / 3600 · step_time_s (seed 000 §IV-D)."""
    currency: str
    objective: float
    """C + w·T (seed 000 §IV-D)."""
    price_per_hour: float
    peak_memory_bytes: int
    device_memory_bytes: int
    feasible: bool
    reason: str
    breakdown: dict[str, float] = field(default_factory=dict, compare=False)
    memory_breakdown: dict[str, int] = field(default_factory=dict, compare=False)
    trial_number: int | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        p = self.plan
        return (self.instance_type, self.count, p.strategy, p.dp, p.pp, p.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry of ``distplan tune`` (DESIGN §5 field names)."""
        p = self.plan
        return {
            "instance_type": self.instance_type,
            "count": self.count,
            "gpu": self.gpu,
            **p.layout(),
            "predicted_step_time_s": self.step_time_s,
            "predicted_step_time_band_s": list(self.step_time_band_s),
            "predicted_cost_per_step": self.cost_per_step,
            "currency": self.currency,
            "objective": self.objective,
            "price_per_hour": self.price_per_hour,
            "predicted_peak_memory_bytes": self.peak_memory_bytes,
            "device_memory_bytes": self.device_memory_bytes,
            "feasible": self.feasible,
            "reason": self.reason,
            "breakdown": dict(self.breakdown),
            "trial_number": self.trial_number,
        }

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], *, trial_number: int | None = None) -> TunedConfig:
        """Rebuild from a trial's user attributes (see :meth:`ConfigSpace.trial_attrs`)."""
        plan = Plan.from_dict(attrs["plan"])
        return cls(
            instance_type=attrs["instance_type"],
            count=int(attrs["count"]),
            gpu=attrs["gpu"],
            world_size=int(attrs["world_size"]),
            plan=plan,
            step_time_s=float(attrs["step_time_s"]),
            step_time_band_s=tuple(attrs["step_time_band_s"]),  # type: ignore[arg-type]
            cost_per_step=float(attrs["cost_per_step"]),
            currency=attrs["currency"],
            objective=float(attrs["objective"]),
            price_per_hour=float(attrs["price_per_hour"]),
            peak_memory_bytes=int(attrs["memory"]["peak_bytes"]),
            device_memory_bytes=int(attrs["memory"]["device_bytes"]),
            feasible=bool(attrs["feasible"]),
            reason=attrs["reason"],
            breakdown=dict(attrs["breakdown"]),
            memory_breakdown=dict(attrs["memory"]["breakdown"]),
            trial_number=trial_number,
        )


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


class ConfigSpace:
    """Instances × counts × plans for one profile, catalog and global batch, with cached pricing.

    Raises:
        ModelSplitError: only pipeline strategies are requested and no pipeline can train the profile (it cannot be
            split into stages, or was profiled in a precision pipelines do not run and is not projected to bf16).
    """

    def __init__(
        self,
        profile: Profile,
        catalog: Catalog,
        *,
        global_batch_size: int,
        time_weight: float,
        max_instances: int,
        strategies: Sequence[str] = STRATEGIES,
        max_pp: int | None = None,
        precision: str = "auto",
    ) -> None:
        self.profile = profile
        self.catalog = catalog
        self.global_batch_size = global_batch_size
        self.time_weight = time_weight
        self.max_instances = max_instances
        widest = max(getattr(catalog, "instances", ()), key=lambda inst: inst.world_size(max_instances), default=None)
        if widest is not None and widest.devices_per_instance > MAX_WORLD_SIZE:  # one instance is past it: the row is wrong
            raise CatalogError(
                f"Instance {widest.instance_type!r} of catalog {catalog.name!r} has {widest.devices_per_instance} GPUs, above the "
                f"{MAX_WORLD_SIZE} devices this planner handles.",
                hint="Fix that row's AcceleratorCount (GPUs per instance, e.g. 8), or leave the row out.",
            )
        if widest is not None and widest.world_size(max_instances) > MAX_WORLD_SIZE:  # the planner's limit, in this command's terms
            raise InfeasiblePlanError(
                f"--max-instances {max_instances} of {widest.instance_type} ({widest.devices_per_instance} devices each) makes "
                f"{widest.world_size(max_instances)} devices, above the {MAX_WORLD_SIZE} this planner handles.",
                hint=f"Lower --max-instances (at most {MAX_WORLD_SIZE // widest.devices_per_instance} for this catalog).",
            )
        # a float16 profile projected to bf16 trains in bf16 on the target, which pipelines run: its plans are enumerated
        # as bf16 ones (the projection still reads the measured dtype)
        self._plan_profile = profile
        if precision == "bf16" and profile.splittable and profile.pipeline_refusal:
            self._plan_profile = replace(profile, device=replace(profile.device, dtype="bfloat16"))
        refusal = self._plan_profile.pipeline_refusal
        n = len(profile.layers)
        if refusal is None and n < 2:
            refusal = unsplittable(f"the profile has only {n} layer{'' if n == 1 else 's'}")
        self.strategies = tuple(s for s in strategies if s == "dp_ga" or refusal is None)
        if not self.strategies and strategies and all(s in STRATEGIES for s in strategies):
            # Pipeline-only request on a model that cannot be cut: say so, not "no configuration factors B".
            raise ModelSplitError(
                f"No pipeline can train {profile.model!r}: {refusal}, so none of the requested strategies {list(strategies)} can run.",
                hint="Allow dp_ga (e.g. --strategy dp_ga gpipe 1f1b), or "
                + ("add a pipeline_spec() hook to the LightningModule and profile it again." if not profile.splittable or n < 2 else "project to bf16 (--precision bf16)."),
            )
        self.max_pp = max_pp
        self.precision = precision
        self._plans: dict[int, list[Plan]] = {}
        self._batch_divisors: list[int] | None = None
        self._projected: dict[str, tuple[Profile, ProjectionInfo]] = {}
        self._cache: dict[tuple[Any, ...], TunedConfig] = {}
        self.evaluations = 0

    # -- the space ----------------------------------------------------------------------------
    def plans(self, world_size: int) -> list[Plan]:
        """Every plan for ``world_size`` devices (empty when none factors the global batch)."""
        if world_size not in self._plans and not self._may_factor(world_size):
            self._plans[world_size] = []  # skip the planner, whose refusal would spend O(world) on nearest sizes
        if world_size not in self._plans:
            try:
                plans = enumerate_plans(
                    self._plan_profile, world_size=world_size, global_batch_size=self.global_batch_size, strategies=self.strategies or ("dp_ga",), max_pp=self.max_pp
                )
            except (BatchNotFactorableError, ModelSplitError):
                # No plan for this world size (the batch does not factor, or no pipeline can be cut here).
                plans = []
            self._plans[world_size] = [p for p in plans if p.strategy in self.strategies]
        return self._plans[world_size]

    def _may_factor(self, world_size: int) -> bool:
        """Whether some dp · pp = ``world_size`` has dp dividing the global batch and an allowed pp (a cheap
        necessary condition; the planner decides the rest)."""
        if self._batch_divisors is None:
            b = self.global_batch_size
            small = [d for d in range(1, math.isqrt(b) + 1) if b % d == 0]
            self._batch_divisors = sorted({*small, *(b // d for d in small)})
        pp_max = min(len(self.profile.layers), self.max_pp or world_size)
        pipelines = any(s != "dp_ga" for s in self.strategies)
        for dp in self._batch_divisors:
            if dp > world_size:
                break
            if world_size % dp == 0:
                pp = world_size // dp
                if (pp == 1 and "dp_ga" in self.strategies) or (pipelines and 2 <= pp <= pp_max):
                    return True
        return False

    def configurations(self) -> list[tuple[Instance, int, Plan]]:
        """The whole space, in a fixed order."""
        return [(inst, count, plan) for inst in self.catalog.instances for count in range(1, self.max_instances + 1) for plan in self.plans(inst.world_size(count))]

    @property
    def size(self) -> int:
        return sum(len(self.plans(inst.world_size(c))) for inst in self.catalog.instances for c in range(1, self.max_instances + 1))

    @property
    def max_pp_value(self) -> int:
        hi = len(self.profile.layers)
        if self.max_pp is not None:
            hi = min(hi, self.max_pp)
        return min(hi, max(i.world_size(self.max_instances) for i in self.catalog.instances))

    def nearest_plan(self, world_size: int, strategy: str, pp: int, micro_batch_size: int) -> Plan | None:
        """The valid plan closest (in log scale: pp first, then micro-batch size) to a sampled point.

        Samplers draw factors independently; this maps a draw onto the enumerated valid plans so every
        trial runs a configuration that factors the global batch. None when ``strategy`` has no plan
        on ``world_size`` devices.
        """
        plans = [p for p in self.plans(world_size) if p.strategy == strategy]
        if not plans:
            return None
        pps = sorted({p.pp for p in plans})
        best_pp = min(pps, key=lambda x: (abs(math.log(x) - math.log(pp)), x))
        plans = [p for p in plans if p.pp == best_pp]
        return min(plans, key=lambda p: (abs(math.log(p.micro_batch_size) - math.log(micro_batch_size)), p.micro_batch_size))

    # -- pricing ------------------------------------------------------------------------------
    def projection(self, inst: Instance) -> tuple[Profile, ProjectionInfo]:
        key = inst.instance_type
        if key not in self._projected:
            self._projected[key] = project_profile(self.profile, inst.gpu_spec(), precision=self.precision)  # type: ignore[arg-type]
        return self._projected[key]

    def hardware(self, inst: Instance, count: int, plan: Plan | None = None) -> Hardware:
        """Devices and links of ``count`` instances running ``plan``: the network between instances, NVLink/PCIe
        inside one. Across instances an instance's GPUs share its network card (``Hardware.devices_per_link``)."""
        spec = inst.gpu_spec()
        network = inst.network_gbps * 1e9 / 8
        intra = (spec.interconnect_bytes_per_s, INTRA_NODE_LATENCY_S)
        intra_source = f"intra-instance GPU link {spec.interconnect_bytes_per_s / 1e9:g} GB/s ({spec.source})"
        sharing = 1
        if count == 1 and inst.devices_per_instance > 1:
            (bw, lat), source = intra, intra_source
            p2p = intra
        else:
            # A ring or a pipeline spanning instances is bound by the slowest link: the instance network
            # (with one device per instance nothing is sent, and the value is unused).
            bw, lat = min(network, spec.interconnect_bytes_per_s), NETWORK_LATENCY_S
            burst = ", an 'up to' burst peak, not a sustained rate" if inst.network_burst else ""
            source = f"catalog network {inst.network_gbps:g} Gbit/s ({inst.network_source or inst.source}{burst})"
            p2p = (bw, lat)
            # an instance's GPUs all-reduce over its one network card: the stages of a hybrid dp×pp on one
            # instance, all-reducing at once, share it (costmodel: their bytes add up on the link)
            sharing = inst.devices_per_instance
            if sharing > 1:
                source += f", shared by the instance's {sharing} GPUs"
            if plan is not None and plan.pp > 1 and inst.devices_per_instance % plan.pp == 0:
                # A pipeline's stages are consecutive ranks (stage = rank % pp) and ranks fill one instance before
                # the next (node-major, as Lightning's launchers number them): with pp dividing the GPUs of an
                # instance, every pipeline lies inside one, and only the stages' dp all-reduce crosses the network.
                p2p = intra
                source += f"; pipeline hand-overs inside an instance: {intra_source}"
        return Hardware(
            name=f"{count}x {inst.instance_type} ({inst.gpu})",
            device_memory_bytes=int(spec.memory_bytes),
            allreduce_latency_s=lat,
            allreduce_bandwidth_bytes_per_s=bw,
            p2p_latency_s=p2p[1],
            p2p_bandwidth_bytes_per_s=p2p[0],
            link_source=source,
            devices_per_link=sharing,
        )

    def evaluate(self, inst: Instance, count: int, plan: Plan) -> TunedConfig:
        """Price one configuration (cached: the same configuration is evaluated once)."""
        key = (inst.instance_type, count, plan.strategy, plan.dp, plan.pp, plan.micro_batch_size)
        if key in self._cache:
            return self._cache[key]
        self.evaluations += 1
        projected, info = self.projection(inst)
        hw = self.hardware(inst, count, plan)
        try:
            pred = predict(projected, plan, hw)
        except DistPlanError as err:
            config = TunedConfig(
                instance_type=inst.instance_type, count=count, gpu=inst.gpu, world_size=plan.world_size, plan=plan,
                step_time_s=math.inf, step_time_band_s=(math.inf, math.inf), cost_per_step=math.inf, currency=inst.currency,
                objective=math.inf, price_per_hour=inst.price_per_hour, peak_memory_bytes=0, device_memory_bytes=hw.device_memory_bytes,
                feasible=False, reason=str(err),
            )
            self._cache[key] = config
            return config
        t = pred.step_time_s
        cost = cost_per_step(t, instances=count, price_per_hour=inst.price_per_hour)  # seed 000 §IV-D
        lo, hi = info.band
        run_plan = Plan.from_dict({**plan.to_dict(), "stage_boundaries": list(pred.stage_boundaries)}) if plan.pp > 1 else plan
        config = TunedConfig(
            instance_type=inst.instance_type,
            count=count,
            gpu=inst.gpu,
            world_size=plan.world_size,
            plan=run_plan,
            step_time_s=t,
            step_time_band_s=(t * lo, t * hi),
            cost_per_step=cost,
            currency=inst.currency,
            objective=objective(cost, t, self.time_weight),  # seed 000 §IV-D: C + w·T
            price_per_hour=inst.price_per_hour,
            peak_memory_bytes=pred.peak_memory_bytes,
            device_memory_bytes=hw.device_memory_bytes,
            feasible=pred.feasible,
            reason=pred.reason,
            breakdown=dict(pred.breakdown),
            memory_breakdown=dict(pred.memory_breakdown),
        )
        self._cache[key] = config
        return config

    def trial_attrs(self, config: TunedConfig, inst: Instance, *, requested: dict[str, Any] | None = None) -> dict[str, Any]:
        """User attributes stored on a trial: everything needed to read or rebuild the configuration."""
        _, info = self.projection(inst)
        hw = self.hardware(inst, config.count, config.plan)
        attrs: dict[str, Any] = {
            "instance_type": config.instance_type,
            "count": config.count,
            "gpu": config.gpu,
            "world_size": config.world_size,
            "plan": config.plan.to_dict(),
            **config.plan.layout(),
            "feasible": config.feasible,
            "reason": config.reason,
            "step_time_s": config.step_time_s if math.isfinite(config.step_time_s) else None,
            "step_time_band_s": list(config.step_time_band_s) if math.isfinite(config.step_time_s) else None,
            "cost_per_step": config.cost_per_step if math.isfinite(config.cost_per_step) else None,
            "objective": config.objective if math.isfinite(config.objective) else None,
            "currency": config.currency,
            "price_per_hour": config.price_per_hour,
            "breakdown": dict(config.breakdown),
            "peak_memory_bytes": config.peak_memory_bytes,
            "memory": {
                "peak_bytes": config.peak_memory_bytes,
                "device_bytes": config.device_memory_bytes,
                "usable_bytes": int(hw.usable_memory_bytes),
                "breakdown": dict(config.memory_breakdown),
            },
            "hardware": {
                "allreduce_bandwidth_bytes_per_s": hw.allreduce_bandwidth_bytes_per_s,
                "allreduce_latency_s": hw.allreduce_latency_s,
                "p2p_bandwidth_bytes_per_s": hw.p2p_bandwidth_bytes_per_s,
                "devices_per_link": hw.devices_per_link,
                "link_source": hw.link_source,
            },
            "projection": {
                "source": info.source,
                "target": info.target,
                "precision": info.precision,
                "compute_scale": info.compute_scale,
                "uncertainty_pct": info.uncertainty_pct,
                "band": list(info.band),
            },
        }
        if requested:
            attrs["requested"] = requested
        return attrs
