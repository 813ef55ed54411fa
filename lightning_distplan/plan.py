"""The execution plan: how one optimizer step over the global batch is laid out on the devices.

A :class:`Plan` is plain, frozen data. The planner emits it, the strategies run it, checkpoints
store it. Every plan factors the user's global batch exactly (DESIGN §3.1):

* ``dp_ga``:          B = dp · micro_batch_size · accumulate_grad_batches
* ``gpipe``/``1f1b``: B = dp · micro_batch_size · n_microbatches  (dp > 1 is hybrid dp×pp)
  · accumulate_grad_batches, the flushes per optimizer step: 1 in every plan the planner makes;
  more only where a pipeline runs under ``Trainer(accumulate_grad_batches=k)``
"""

from __future__ import annotations

import json
import numbers
import operator
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from lightning_distplan.errors import InfeasiblePlanError, ProfileFormatError

__all__ = ["Plan", "STRATEGIES", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1
STRATEGIES = ("dp_ga", "gpipe", "1f1b")
StrategyName = Literal["dp_ga", "gpipe", "1f1b"]


def whole_indices(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints when it is a list (or other iterable, not a string) of whole numbers, else None."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return None
    whole = tuple(_whole(b) for b in value)  # type: ignore[attr-defined]
    return None if None in whole else whole  # type: ignore[return-value]


def as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer (a Python or numpy integer, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def as_indices(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints when it is a list, tuple or array of integers (not floats or bools), else None."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        return None
    indices = tuple(as_int(v) for v in value)  # type: ignore[attr-defined]
    return None if None in indices else indices  # type: ignore[return-value]


def _whole(value: object) -> int | None:
    """``value`` as an int when it is a whole number (an int, numpy integer or integral float), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One way to run a training step.

    Example:
        >>> Plan(strategy="1f1b", dp=1, pp=2, micro_batch_size=4, n_microbatches=8,
        ...      global_batch_size=32, stage_boundaries=(3,)).kind
        'pp'
    """

    strategy: StrategyName
    """Registered strategy that runs the plan: ``dp_ga``, ``gpipe`` or ``1f1b``."""
    global_batch_size: int
    """Samples per optimizer step over all devices; the user's, never changed by a plan."""
    micro_batch_size: int
    """Samples in one forward/backward pass on one device (one pipeline micro-batch)."""
    dp: int = 1
    """Data-parallel replicas."""
    pp: int = 1
    """Pipeline stages (1 for ``dp_ga``)."""
    accumulate_grad_batches: int = 1
    """``dp_ga``: micro-batches accumulated per replica before the all-reduce. Pipelines: flushes of
    ``n_microbatches`` per optimizer step (Lightning's ``accumulate_grad_batches`` under a pipeline
    strategy; the planner makes pipeline plans of one flush)."""
    n_microbatches: int = 1
    """Micro-batches per pipeline flush (pipelines only)."""
    stage_boundaries: tuple[int, ...] = ()
    """Index (into the profiled layer list) of the first layer of stages 1..pp-1; empty = let the strategy balance."""
    layer_names: tuple[str, ...] = field(default=(), compare=False)
    """Names of the profiled layers the boundaries index, for humans and for the pipeline splitter."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InfeasiblePlanError(
                f"Unknown strategy {self.strategy!r}.", hint=f"Use one of {', '.join(STRATEGIES)}."
            )
        for name in ("global_batch_size", "micro_batch_size", "dp", "pp", "accumulate_grad_batches", "n_microbatches"):
            value = as_int(getattr(self, name))
            if value is None or value < 1:
                raise InfeasiblePlanError(f"`{name}` must be a positive integer, got {getattr(self, name)!r}.", hint="Check the plan.")
            object.__setattr__(self, name, value)  # a numpy integer as a Python one (plan.json, checkpoints)
        boundaries = self.stage_boundaries
        whole = whole_indices(boundaries)
        if whole is None:
            raise InfeasiblePlanError(
                f"`stage_boundaries` must be a list of whole layer indices, got {boundaries!r}.",
                hint="Give the index of the first layer of every stage after the first, e.g. [6, 12, 18].",
            )
        names = self.layer_names
        if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__") or any(not isinstance(n, str) for n in names):
            raise InfeasiblePlanError(f"`layer_names` must be a list of layer names, got {names!r}.", hint="Check the plan.")
        object.__setattr__(self, "stage_boundaries", whole)
        object.__setattr__(self, "layer_names", tuple(names))
        if self.strategy == "dp_ga":
            if self.pp != 1 or self.n_microbatches != 1:
                raise InfeasiblePlanError(
                    f"A dp_ga plan has pp=1 and n_microbatches=1, got pp={self.pp}, n_microbatches={self.n_microbatches}.",
                    hint="Use strategy='gpipe' or '1f1b' for pipeline plans.",
                )
            product = self.dp * self.micro_batch_size * self.accumulate_grad_batches
            rule = f"dp ({self.dp}) * micro_batch_size ({self.micro_batch_size}) * accumulate_grad_batches ({self.accumulate_grad_batches})"
        else:
            if self.pp < 2:
                raise InfeasiblePlanError(
                    f"A {self.strategy} plan needs at least 2 pipeline stages, got pp={self.pp}.",
                    hint="Use strategy='dp_ga' for a single stage.",
                )
            if self.strategy == "1f1b" and self.n_microbatches < self.pp:
                raise InfeasiblePlanError(
                    f"`n_microbatches` ({self.n_microbatches}) must be >= the number of pipeline stages ({self.pp}) for 1F1B.",
                    hint="Raise `n_microbatches` or use strategy='gpipe'.",
                )
            k = self.accumulate_grad_batches
            product = self.dp * self.micro_batch_size * self.n_microbatches * k
            rule = f"dp ({self.dp}) * micro_batch_size ({self.micro_batch_size}) * n_microbatches ({self.n_microbatches})"
            rule += f" * accumulate_grad_batches ({k})" if k > 1 else ""
        if product != self.global_batch_size:
            raise InfeasiblePlanError(
                f"{rule} = {product} does not equal the global batch size ({self.global_batch_size}).",
                hint="A plan must factor the global batch exactly; pick factors whose product is the global batch.",
            )
        if self.stage_boundaries:
            b = self.stage_boundaries
            if len(b) != self.pp - 1 or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
                raise InfeasiblePlanError(
                    f"`stage_boundaries` {list(b)} must be {self.pp - 1} strictly increasing positive layer indices for pp={self.pp}.",
                    hint="Give the index of the first layer of every stage after the first, or leave it empty.",
                )
            if self.layer_names and b[-1] >= len(self.layer_names):
                raise InfeasiblePlanError(
                    f"`stage_boundaries` {list(b)} point past the last of {len(self.layer_names)} layers.",
                    hint="Use fewer stages or earlier boundaries.",
                )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def schedule(self) -> str:
        """``"none"`` for data parallel, else the pipeline schedule name."""
        return "none" if self.strategy == "dp_ga" else self.strategy

    @property
    def kind(self) -> str:
        """``"dp"``, ``"pp"`` or ``"hybrid"``."""
        if self.pp == 1:
            return "dp"
        return "pp" if self.dp == 1 else "hybrid"

    @property
    def steps_per_replica(self) -> int:
        """Micro-batches one replica runs per optimizer step."""
        return self.accumulate_grad_batches * (1 if self.strategy == "dp_ga" else self.n_microbatches)

    def describe(self) -> str:
        if self.strategy == "dp_ga":
            return f"dp_ga dp={self.dp} m={self.micro_batch_size} accumulate={self.accumulate_grad_batches}"
        split = f" split={list(self.stage_boundaries)}" if self.stage_boundaries else ""
        flushes = f" accumulate={self.accumulate_grad_batches}" if self.accumulate_grad_batches > 1 else ""
        return f"{self.strategy} dp={self.dp} pp={self.pp} m={self.micro_batch_size} n_microbatches={self.n_microbatches}{flushes}{split}"

    def layout(self) -> dict[str, Any]:
        """The plan's shape as flat JSON fields (DESIGN §5 names), shared by every report that lists plans."""
        return {
            "strategy": self.strategy,
            "schedule": self.schedule,
            "dp": self.dp,
            "pp": self.pp,
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "n_microbatches": self.n_microbatches,
            "accumulation": self.steps_per_replica,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "stage_boundaries": list(self.stage_boundaries),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_boundaries"] = list(self.stage_boundaries)
        d["layer_names"] = list(self.layer_names)
        d["schedule"] = self.schedule
        d["schema_version"] = PLAN_SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise ProfileFormatError(f"A plan must be a JSON object, got {type(data).__name__}.", hint="Pass a plan.json written by distplan.")
        version = data.get("schema_version", PLAN_SCHEMA_VERSION)
        if type(version) is not int or version != PLAN_SCHEMA_VERSION:  # True == 1 == 1.0 in Python; Profile refuses them too
            raise ProfileFormatError(
                f"Plan schema version {version!r} is not supported (this is version {PLAN_SCHEMA_VERSION}).",
                hint="Re-plan with this version of lightning_distplan.",
            )
        names = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING and f.default_factory is MISSING)
        if missing:
            raise ProfileFormatError(f"The plan has no {', '.join(missing)}.", hint="Pass a plan.json written by distplan.")
        plan = cls(**{k: v for k, v in data.items() if k in names})
        if "schedule" in data and data["schedule"] != plan.schedule:
            # to_dict writes the schedule for readers; the strategy decides it. An edited schedule ran the strategy's.
            raise InfeasiblePlanError(
                f"The plan's schedule {data['schedule']!r} contradicts its strategy {plan.strategy!r} (whose schedule is {plan.schedule!r}).",
                hint="Edit `strategy` (dp_ga, gpipe or 1f1b); `schedule` follows it.",
            )
        return plan

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            from lightning_distplan._files import check_output_path, write_text_atomic

            # atomic, as Profile.save: an interrupted write never leaves a half-written plan where one was
            write_text_atomic(check_output_path(path, "the plan path", example="plan.json"), text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Plan:
        """A plan from a ``plan.json`` path or from JSON text: auto_plan's record (the plan under ``"plan"``, with
        its prediction and alternatives) or the plan object itself (:meth:`to_json`).

        Raises:
            ProfileFormatError: the file is missing or unreadable, not JSON, or not a plan object.
            InfeasiblePlanError: the plan's values are inconsistent (factors, boundaries, strategy).
        """
        text = str(path_or_text)
        looks_like_path = isinstance(path_or_text, Path) or not text.lstrip().startswith(("{", "[", '"'))
        if looks_like_path:
            path = Path(path_or_text)
            if not path.is_file():
                raise ProfileFormatError(f"Plan file {text!r} does not exist or is not a file.", hint="Pass the plan.json that distplan wrote (under <default_root_dir>/distplan/).")
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise ProfileFormatError(f"Plan file {text!r} cannot be read ({err}).", hint="Check the file, or re-plan with distplan.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProfileFormatError(f"The plan is not valid JSON ({err.msg} at line {err.lineno}).", hint="Re-create it with distplan.") from None
        except RecursionError:  # arrays nested thousands deep: no plan is
            raise ProfileFormatError("The plan is not a plan (its JSON is nested too deeply to read).", hint="Re-create it with distplan.") from None
        except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
            raise ProfileFormatError(f"The plan holds a number too long to be a plan's ({str(err).split(':')[0]}).", hint="Re-create it with distplan.") from None
        if isinstance(data, dict) and "strategy" not in data and isinstance(data.get("plan"), dict):
            data = data["plan"]  # auto_plan's plan.json: the plan with its prediction and alternatives
        return cls.from_dict(data)


def require_plan(plan: object, owner: str) -> None:
    """Refuse a ``plan=`` argument of ``owner`` (a strategy's name) that is not a :class:`Plan` (None passes): a
    ``plan.json`` dict or its path raised a bare AttributeError deep inside the strategy."""
    if plan is not None and not isinstance(plan, Plan):
        from lightning_distplan.errors import InfeasiblePlanError

        raise InfeasiblePlanError(
            f"{owner}(plan=...) takes a lightning_distplan.Plan, got a {type(plan).__name__}.",
            hint="Read a saved plan with Plan.from_json('<default_root_dir>/distplan/plan.json') (a path or its JSON text), "
            "or Plan.from_dict(...) for a dict.",
        )
