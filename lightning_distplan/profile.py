"""The Profile: what was measured about one model on one device, as plain versioned data.

The profiler (:mod:`lightning_distplan.profiling`) writes it; the cost model and the planner read
it. This module is pure Python (no torch, no lightning) so a saved Profile can be re-planned on a
laptop with nothing but this package installed.

Schema (version 1), all times in seconds, all sizes in bytes, "per sample" = per training example:

``model``                 import path or class name of the LightningModule
``device``                :class:`DeviceProfile`: type ("cuda"/"cpu"), name, total memory and its source, the
                          math's dtype, the ranks that profiled, and the TF32 switches of the profiled run
``micro_batch_sizes``     the sizes that were timed; ``infeasible_micro_batch_sizes`` those that ran out of memory;
                          ``rejected_micro_batch_sizes`` those the model itself refused (no plan goes that low)
``step``                  :class:`StepProfile`: the whole ``training_step`` forward / backward time fitted as
                          t(m) = α·m + β (seed 000 §III-B), measured without per-layer hooks
``layers``                list of :class:`LayerProfile`, in execution order: per-layer forward/backward fits,
                          parameter bytes, activation bytes saved for backward per sample, output (boundary)
                          bytes per sample (and how much of it the layer itself or a later layer saved, for a
                          pipeline cut after it; optional, absent in older files), FLOPs per sample
``optimizer``             :class:`OptimizerProfile`: type, state bytes, measured ``step()`` time
``memory``                :class:`MemoryProfile`: parameter/gradient/optimizer bytes, activation fit, fixed
                          overhead, measured peaks per micro-batch size (CUDA only)
``splittable``            whether a pipeline can be built (``split_reason`` says why / why not)
``links``                 list of :class:`LinkProfile`: all-reduce / p2p fitted as latency + bytes / bandwidth
``shared_parameters``     list of :class:`SharedParameters`: parameters several layers use (tied embeddings);
                          a pipeline that puts those layers on different stages all-reduces their gradient
``unused_parameters``     names of trainable parameters the profiled loss gave no gradient (``auto_plan`` then runs
                          DDP with ``find_unused_parameters=True``)
``framework``             :class:`FrameworkProfile`: the training loop's own cost per batch and per optimizer
                          step (optional; absent in older files, which then count it as zero), and the
                          pipelining runtime's own cost per micro-batch slot when measured over a process group
``profiling_time_s``      wall time the profiler spent
``versions``, ``created`` provenance; ``schema_version`` the schema's version (a file of another is refused)
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from lightning_distplan.errors import ProfileFormatError, first_line

#: the ``Trainer(precision=...)`` names ``distplan profile`` and ``distplan bench`` accept
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")

__all__ = [
    "PRECISIONS",
    "PROFILE_SCHEMA_VERSION",
    "LinearFit",
    "TimingSample",
    "LayerProfile",
    "StepProfile",
    "OptimizerProfile",
    "MemoryProfile",
    "LinkProfile",
    "DeviceProfile",
    "FrameworkProfile",
    "SharedParameters",
    "Profile",
    "pool_profiles",
    "poolable",
    "unpoolable_reason",
]

PROFILE_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LinearFit:
    """``y(x) = alpha * x + beta`` with the coefficient of determination of the fit."""

    alpha: float
    beta: float
    r2: float = 1.0

    def __call__(self, x: float) -> float:
        return self.alpha * x + self.beta

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
        """Ordinary least squares. One point gives a line through the origin (β = 0)."""
        if len(xs) != len(ys) or not xs:
            raise ValueError(
                f"LinearFit.fit needs equally many x and y values, at least one (got {len(xs)} and {len(ys)}). HINT: Pass one y per x."
            )
        n = len(xs)
        if n == 1 or len(set(xs)) == 1:
            mean_x = sum(xs) / n
            mean_y = sum(ys) / n
            return cls(alpha=mean_y / mean_x if mean_x else 0.0, beta=0.0, r2=1.0)
        mx = sum(xs) / n
        my = sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        alpha = sxy / sxx
        beta = my - alpha * mx
        ss_tot = sum((y - my) ** 2 for y in ys)
        ss_res = sum((y - (alpha * x + beta)) ** 2 for x, y in zip(xs, ys))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        return cls(alpha=alpha, beta=beta, r2=r2)

    @classmethod
    def fit_times(cls, xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
        """:meth:`fit` for measured times (all > 0), whose line must stay positive where they were measured.

        On a noisy host a slow small size can tilt the least-squares line below zero at the largest
        size, which no time can be (and which :class:`Profile` refuses). Then the line through the
        origin that fits best (``α = Σxy / Σx²``, positive) is taken, and ``r2`` says how poorly it fits.
        """
        line = cls.fit(xs, ys)
        if all(line(x) > 0 for x in xs) or not all(y > 0 for y in ys):
            return line
        alpha = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        my = sum(ys) / len(ys)
        ss_tot = sum((y - my) ** 2 for y in ys)
        ss_res = sum((y - alpha * x) ** 2 for x, y in zip(xs, ys))
        return cls(alpha=alpha, beta=0.0, r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


@dataclass(frozen=True, kw_only=True)
class TimingSample:
    micro_batch_size: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    name: str
    """Qualified module name inside the LightningModule (``"model.layers.3"``)."""
    forward: LinearFit
    """Forward seconds vs micro-batch size."""
    backward: LinearFit
    """Backward seconds vs micro-batch size."""
    param_count: int
    param_bytes: int
    activation_bytes_per_sample: float
    """Bytes saved for backward per sample (counted with saved_tensors_hooks, parameters excluded)."""
    trainable_param_bytes: int | None = None
    """Bytes of this layer's parameters with ``requires_grad``: their gradients and optimizer state are
    what a pipeline stage holding the layer adds (a frozen layer has none). None: every parameter
    trains (profiles written before the field)."""
    activation_bytes_fixed: float = 0.0
    """Saved-for-backward bytes that do not grow with the micro-batch (the fit's intercept)."""
    output_bytes_per_sample: float = 0.0
    """Bytes of this layer's output per sample: what a pipeline sends when a stage ends here."""
    output_saved_bytes_per_sample: float | None = None
    """Of :attr:`output_bytes_per_sample`, the bytes saved for backward by this layer (ReLU saves its result), an
    earlier one sharing the storage in place, or the loss after the last layer: counted in this layer's activations.
    A pipeline stage ending here keeps its output until that micro-batch's backward (torch's ``PipelineStage``
    caches it), so the rest is held there too. None: not recorded (profiles written before 2026-11-28)."""
    output_saved_later_bytes_per_sample: float | None = None
    """Of :attr:`output_bytes_per_sample`, the bytes first saved by the next layer (a Linear or LayerNorm saving its
    input) and counted in that layer's activations (a save further on is not counted here): on a stage starting after this layer that saved tensor is the
    receive buffer, held once per micro-batch anyway. None: not recorded (profiles written before 2026-11-28)."""
    flops_forward_per_sample: float = 0.0
    flops_backward_per_sample: float = 0.0
    conv_flops_forward_per_sample: float = 0.0
    """The part of ``flops_forward_per_sample`` in convolutions (0 in profiles written before 2026-11-28): cuDNN's
    TF32 switch (``DeviceProfile.tf32_conv``) is not the matmuls', so a projection needs the split."""
    conv_flops_backward_per_sample: float = 0.0
    """The part of ``flops_backward_per_sample`` in convolutions."""
    samples: tuple[TimingSample, ...] = ()

    def time(self, m: float) -> float:
        return self.forward(m) + self.backward(m)

    @property
    def trainable_bytes(self) -> int:
        """:attr:`trainable_param_bytes`, or all of :attr:`param_bytes` where it was not recorded."""
        return self.param_bytes if self.trainable_param_bytes is None else self.trainable_param_bytes


@dataclass(frozen=True, kw_only=True)
class StepProfile:
    """The whole forward (training_step incl. loss) and backward of one micro-batch."""

    forward: LinearFit
    backward: LinearFit
    samples: tuple[TimingSample, ...] = ()
    spread: float = 0.0
    """Relative standard deviation of one micro-batch's forward+backward between timed repeats (root
    mean square over the profiled sizes, the largest over ranks); 0 = not measured."""

    def time(self, m: float) -> float:
        return self.forward(m) + self.backward(m)


@dataclass(frozen=True, kw_only=True)
class OptimizerProfile:
    name: str
    """Optimizer class name as configured by the module (``"AdamW"``)."""
    state_bytes: int
    """Bytes of optimizer state after one step, for the whole model."""
    step_time_s: float
    """Measured time of one ``optimizer.step()`` + ``zero_grad()`` for the whole model."""


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation: LinearFit
    """Bytes one micro-batch adds at its peak vs micro-batch size. On CUDA measured: the step's peak
    allocated bytes minus those resident before it (saved activations, transients such as logits and
    their gradients, fresh gradients). On CPU counted: the bytes saved for backward."""
    fixed_overhead_bytes: int = 0
    """What the activation line misses at a profiled size, or the optimizer step's own peak beyond
    weights, gradients and state where that is larger (CUDA); 0 where no peak is measured."""
    activation_source: str = ""
    """How ``activation`` was obtained (measured CUDA peaks, or saved tensors counted by hooks)."""
    measured_peak_bytes: dict[int, int] = field(default_factory=dict)
    """Micro-batch size -> measured peak allocated bytes for fwd+bwd+step (CUDA only)."""
    device_total_bytes: int = 0
    device_total_source: str = ""
    """Where ``device_total_bytes`` came from: "nvml", "torch.cuda", or "host RAM (sysconf)" on CPU."""


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    kind: Literal["allreduce", "p2p"]
    backend: str
    world_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    r2: float = 1.0
    samples: tuple[tuple[int, float], ...] = ()
    """(message bytes, seconds) pairs the fit came from."""

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


# Bytes per value of the math a profile was measured in: a weight dtype, or a Lightning precision
# whose weights stay float32 while the math is 16-bit ("bf16-mixed").
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4, "32": 4, "32-true": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "16": 2, "16-mixed": 2, "bf16-mixed": 2,
    "float64": 8, "double": 8, "64-true": 8,
}


# The profile dtypes of the precisions PipelineStrategy runs: '32-true', 'bf16-mixed', 'bf16-true'.
PIPELINE_DTYPES = frozenset({"float32", "float", "fp32", "32", "32-true", "bfloat16", "bf16", "bf16-true", "bf16-mixed"})


def unsplittable(reason: str | None) -> str:
    """The clause saying a model cannot be split into pipeline stages, and why (``Profile.split_reason``)."""
    return f"the model cannot be split into pipeline stages ({reason or 'no PipelineSpec'})"


def dtype_bytes(dtype: str) -> int | None:
    """Bytes per value for a profile's ``device.dtype`` (``"torch."`` prefix and case ignored), None if unknown."""
    return DTYPE_BYTES.get(str(dtype).replace("torch.", "").lower())


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    type: Literal["cuda", "cpu"]
    name: str
    total_memory_bytes: int
    memory_source: str
    dtype: str = "float32"
    count: int = 1
    """Devices (ranks) that took part in profiling."""
    tf32_matmul: bool | None = None
    """Whether float32 matmuls were allowed TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` turns on) while profiling. It describes the process, so it is
    recorded on a CPU too: the same script sets it on the GPU it is projected to. None: not recorded (profiles
    written before 2026-11-28)."""
    tf32_conv: bool | None = None
    """Whether float32 convolutions were allowed TF32 (``torch.backends.cudnn.allow_tf32``, on by PyTorch's default)."""


@dataclass(frozen=True, kw_only=True)
class SharedParameters:
    """Parameters used by several layers (e.g. GPT-2's token embedding, tied to its output head)."""

    layers: tuple[int, ...]
    """Indices into ``Profile.layers`` of every layer that uses them; their bytes count under the first."""
    param_bytes: int
    """Bytes of those parameters (trainable ones: their gradient is what crosses stages)."""


@dataclass(frozen=True, kw_only=True)
class FrameworkProfile:
    """What the training loop itself costs beyond the model (Lightning's hooks, closure, logging, data fetch)."""

    per_batch_s: float = 0.0
    """Seconds per training batch (one micro-batch of dp_ga; one whole step of a pipeline)."""
    per_step_s: float = 0.0
    """Seconds per optimizer step beyond ``optimizer.step()`` itself."""
    source: str = ""
    """How it was measured ("" = not measured: counted as zero)."""
    pipeline_slot_s: float | None = None
    """Seconds ``torch.distributed.pipelining`` itself adds per micro-batch slot beyond the hand-over the
    cost model charges: a two-stage 1F1B schedule of two ``Linear(8, 8)`` stages timed over the
    profiled process group (see :func:`~lightning_distplan.profiling.measure_pipeline_slot`). None = not
    measured (one process, or a file from before the field): the cost model takes
    :data:`~lightning_distplan.costmodel.PIPELINE_SLOT_S`."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    model: str
    device: DeviceProfile
    micro_batch_sizes: tuple[int, ...]
    step: StepProfile
    layers: tuple[LayerProfile, ...]
    optimizer: OptimizerProfile
    memory: MemoryProfile
    links: tuple[LinkProfile, ...] = ()
    infeasible_micro_batch_sizes: tuple[int, ...] = ()
    rejected_micro_batch_sizes: tuple[int, ...] = ()
    """Sizes the model itself refused (e.g. BatchNorm with one value per channel): no plan uses a
    micro-batch at or below the largest of them."""
    splittable: bool = False
    """True when a PipelineSpec exists for the model (its ``pipeline_spec()`` hook or a built-in adapter)."""
    split_reason: str = ""
    """Why the model can or cannot be split into pipeline stages (from ``_layers.discover_layers``)."""
    shared_parameters: tuple[SharedParameters, ...] = ()
    """Parameters several layers use (see :class:`SharedParameters`)."""
    unused_parameters: tuple[str, ...] = ()
    """Trainable parameters (names, in module order) that a profiled ``training_step``'s loss gave no gradient,
    e.g. a head only ``predict_step`` uses: DistributedDataParallel trains such a model only with
    ``find_unused_parameters=True``, which ``auto_plan`` then turns on."""
    framework: FrameworkProfile = field(default_factory=FrameworkProfile)
    """The training loop's own cost (see :class:`FrameworkProfile`)."""
    profiling_time_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    schema_version: int = PROFILE_SCHEMA_VERSION

    # -- derived ---------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return self.memory.param_bytes

    @property
    def max_feasible_micro_batch_size(self) -> int | None:
        """Smallest size that ran out of memory minus one, or None when none did."""
        if not self.infeasible_micro_batch_sizes:
            return None
        return min(self.infeasible_micro_batch_sizes) - 1

    @property
    def min_micro_batch_size(self) -> int:
        """Smallest micro-batch a plan may use (1 unless the model rejected small sizes)."""
        return max(self.rejected_micro_batch_sizes, default=0) + 1

    @property
    def pipeline_refusal(self) -> str | None:
        """Why no pipeline can train the model as profiled, or None: it cannot be split, or it was profiled in a
        precision the pipeline runtime does not run (float16, float64)."""
        if not self.splittable:
            return unsplittable(self.split_reason)
        if str(self.device.dtype).replace("torch.", "").lower() not in PIPELINE_DTYPES:
            return f"it was profiled in {self.device.dtype} and pipelines train in 32-true, bf16-mixed or bf16-true only"
        return None

    def link(self, kind: Literal["allreduce", "p2p"]) -> LinkProfile | None:
        matches = [link for link in self.links if link.kind == kind]
        return max(matches, key=lambda link: link.world_size) if matches else None

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"]["measured_peak_bytes"] = {str(k): v for k, v in self.memory.measured_peak_bytes.items()}
        return d

    def save(self, path: str | Path) -> Path:
        from lightning_distplan._files import check_output_path, write_text_atomic

        # atomic: a crash never leaves a half-written profile
        return write_text_atomic(check_output_path(path, "the profile path", example="profile.json"), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        if str(path) == "":
            raise ProfileFormatError("The profile path is empty.", hint="Pass the profile JSON file, e.g. runs/distplan/profile.json.")
        path = Path(path)
        if path.is_dir():
            raise ProfileFormatError(f"Profile path {str(path)!r} is a directory, not a file.", hint="Pass the profile JSON file itself, e.g. runs/distplan/profile.json.")
        if path.exists() and not path.is_file():
            raise ProfileFormatError(f"Profile path {str(path)!r} is not a regular file.", hint="Pass the profile JSON file itself, e.g. runs/distplan/profile.json.")
        if not path.is_file():
            raise ProfileFormatError(f"Profile file {str(path)!r} does not exist.", hint="Create one with `distplan profile package.module:ClassName --out FILE`.")
        try:
            data = json.loads(path.read_text())
        except RecursionError:  # arrays or objects nested thousands deep: no profile is
            raise ProfileFormatError(
                f"Profile file {str(path)!r} is not a profile (its JSON is nested too deeply to read).", hint="The file is corrupt; re-create it with `distplan profile`."
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ProfileFormatError(f"Profile file {str(path)!r} is not valid JSON ({err}).", hint="The file is corrupt; re-create it with `distplan profile`.") from None
        except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits(), 4300)
            raise ProfileFormatError(
                f"Profile file {str(path)!r} holds a number too long to be a profile's ({str(err).split(':')[0]}).",
                hint="The file is corrupt; re-create it with `distplan profile`.",
            ) from None
        except OSError as err:
            raise ProfileFormatError(f"Profile file {str(path)!r} cannot be read ({err.strerror or err}).", hint="Check the file's permissions.") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "profile") -> Profile:
        hint = "Re-create it with `distplan profile`."
        if not isinstance(data, dict):
            raise ProfileFormatError(f"{source!r} holds a JSON {type(data).__name__}, not a profile object.", hint=hint)
        if "layers" not in data and isinstance(data.get("plan"), dict):
            raise ProfileFormatError(f"{source!r} is a plan (auto_plan's plan.json), not a profile.", hint="Pass the profile.json beside it.")
        version = data.get("schema_version")
        if type(version) is not int or version != PROFILE_SCHEMA_VERSION:  # True == 1 == 1.0 in Python
            raise ProfileFormatError(
                f"{source!r} has profile schema version {version!r}; this lightning_distplan reads version {PROFILE_SCHEMA_VERSION}.",
                hint=hint,
            )
        try:
            profile = _build(cls, data)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as err:
            raise ProfileFormatError(f"{source!r} is not a valid profile ({type(err).__name__}: {first_line(err)}).", hint=hint) from None
        profile.validate(source)
        return profile

    def _timings(self) -> dict[str, float]:
        """Every time the cost model reads, by name (the fits' terms, links' latencies, the loop's overheads)."""
        fits = {"step.forward": self.step.forward, "step.backward": self.step.backward}
        for i, layer in enumerate(self.layers):
            fits[f"layers[{i}].forward"], fits[f"layers[{i}].backward"] = layer.forward, layer.backward
        times = _fit_terms(fits)
        times.update({f"links[{i}].latency_s": link.latency_s for i, link in enumerate(self.links)})
        times.update({"framework.per_batch_s": self.framework.per_batch_s, "framework.per_step_s": self.framework.per_step_s})
        return times

    def validate(self, source: str = "profile") -> None:
        hint = "Re-create it with `distplan profile`."
        bad = _first_non_finite(self, "")
        if bad is not None:
            raise ProfileFormatError(f"{source!r} holds a non-finite number at {bad}.", hint=hint)
        if not self.layers:
            raise ProfileFormatError(f"{source!r} has no layers.", hint=hint)
        named = next((i for i, layer in enumerate(self.layers) if not isinstance(layer.name, str)), None)
        if named is not None:  # here, not in the plan built from these names, which would blame the plan
            raise ProfileFormatError(f"{source!r} has layers[{named}].name = {self.layers[named].name!r}; a layer's name is a string.", hint=hint)
        wrong = _first_non_string(self, "")
        if wrong is not None:  # here, not where the cost model reads it ("argument of type 'int' is not iterable")
            raise ProfileFormatError(f"{source!r} has {wrong[0]} = {wrong[1]!r}; it must be a string.", hint=hint)
        if not self.micro_batch_sizes:
            raise ProfileFormatError(f"{source!r} has no profiled micro-batch sizes.", hint=hint)
        if any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in self.micro_batch_sizes):
            raise ProfileFormatError(f"{source!r} lists micro-batch sizes {list(self.micro_batch_sizes)}; each must be a positive integer.", hint=hint)
        if any(not isinstance(m, int) or m < 1 for m in (*self.infeasible_micro_batch_sizes, *self.rejected_micro_batch_sizes)):
            raise ProfileFormatError(
                f"{source!r} lists out-of-memory sizes {list(self.infeasible_micro_batch_sizes)} and refused sizes "
                f"{list(self.rejected_micro_batch_sizes)}; each must be a positive integer.",
                hint=hint,
            )
        flags = {"device.tf32_matmul": self.device.tf32_matmul, "device.tf32_conv": self.device.tf32_conv}
        odd = next((name for name, flag in flags.items() if flag is not None and not isinstance(flag, bool)), None)
        if odd is not None:
            raise ProfileFormatError(f"{source!r} has {odd} = {flags[odd]!r}; it must be true, false or null.", hint=hint)
        if any(not isinstance(name, str) for name in self.unused_parameters):
            raise ProfileFormatError(f"{source!r} lists unused parameters {list(self.unused_parameters)[:5]}; each is a parameter's name.", hint=hint)
        sizes = {
            "memory.device_total_bytes": self.memory.device_total_bytes,
            "memory.param_bytes": self.memory.param_bytes, "memory.grad_bytes": self.memory.grad_bytes,
            "memory.optimizer_state_bytes": self.memory.optimizer_state_bytes, "memory.fixed_overhead_bytes": self.memory.fixed_overhead_bytes,
            "optimizer.state_bytes": self.optimizer.state_bytes, "optimizer.step_time_s": self.optimizer.step_time_s,
        }
        for i, layer in enumerate(self.layers):
            for name in ("param_bytes", "activation_bytes_per_sample", "activation_bytes_fixed", "output_bytes_per_sample",
                         "flops_forward_per_sample", "flops_backward_per_sample", "conv_flops_forward_per_sample", "conv_flops_backward_per_sample"):
                sizes[f"layers[{i}].{name}"] = getattr(layer, name)
            for name in ("output_saved_bytes_per_sample", "output_saved_later_bytes_per_sample"):
                if getattr(layer, name) is not None:
                    sizes[f"layers[{i}].{name}"] = getattr(layer, name)
            if layer.trainable_param_bytes is not None:
                if not isinstance(layer.trainable_param_bytes, int) or isinstance(layer.trainable_param_bytes, bool):
                    raise ProfileFormatError(
                        f"{source!r} has layers[{i}].trainable_param_bytes {layer.trainable_param_bytes!r}; it must be a whole number of bytes.",
                        hint=hint,
                    )
                sizes[f"layers[{i}].trainable_param_bytes"] = layer.trainable_param_bytes
        # an exabyte, or a billion years: edited by hand. The activation line and the device's size are bytes the cost
        # model multiplies too (a 1e300 slope overflowed in the pipeline split and was blamed on its arguments).
        numbers = {
            **sizes, **self._timings(), **_fit_terms({"memory.activation": self.memory.activation}),
            "device.total_memory_bytes": self.device.total_memory_bytes,
        }
        huge = next((name for name, x in numbers.items() if isinstance(x, (int, float)) and abs(x) > 1e18), None)
        if huge is not None:
            value = numbers[huge]
            shown = f"{value:.4g}" if abs(value) >= 1e21 else repr(value)  # not the 301 digits of an integer 10**300
            raise ProfileFormatError(f"{source!r} has {huge} = {shown}, beyond any device.", hint=hint)
        if not isinstance(self.splittable, bool):
            raise ProfileFormatError(f"{source!r} has splittable = {self.splittable!r}; it must be true or false.", hint=hint)
        if self.infeasible_micro_batch_sizes and min(self.infeasible_micro_batch_sizes) <= max(self.micro_batch_sizes):
            raise ProfileFormatError(
                f"{source!r} lists micro-batch {min(self.infeasible_micro_batch_sizes)} as out of memory but profiled "
                f"{max(self.micro_batch_sizes)}; an out-of-memory size is larger than every profiled one.",
                hint=hint,
            )
        negative = next((name for name, x in sizes.items() if x < 0), None)
        if negative is not None:
            raise ProfileFormatError(f"{source!r} has a negative {negative} ({sizes[negative]!r}); sizes, FLOPs and times are never negative.", hint=hint)
        if self.memory.grad_bytes > self.memory.param_bytes:  # after the sign check: a negative param_bytes is named as such
            raise ProfileFormatError(
                f"{source!r} has more gradient bytes ({self.memory.grad_bytes}) than parameter bytes ({self.memory.param_bytes}); "
                "gradients exist only for trainable parameters.",
                hint=hint,
            )
        for i, layer in enumerate(self.layers):  # after the sign check, which names a negative param_bytes as such
            for part in ("forward", "backward"):
                conv, total = getattr(layer, f"conv_flops_{part}_per_sample"), getattr(layer, f"flops_{part}_per_sample")
                if conv > total * (1 + 1e-9):
                    raise ProfileFormatError(
                        f"{source!r} has layers[{i}].conv_flops_{part}_per_sample {conv!r} above its flops_{part}_per_sample ({total!r}); "
                        "convolutions are part of a layer's FLOPs.",
                        hint=hint,
                    )
            if layer.trainable_param_bytes is not None and layer.trainable_param_bytes > layer.param_bytes:
                raise ProfileFormatError(
                    f"{source!r} has layers[{i}].trainable_param_bytes {layer.trainable_param_bytes!r}; it must be a whole number of bytes "
                    f"no larger than that layer's param_bytes ({layer.param_bytes}).",
                    hint=hint,
                )
        if self.device.type not in ("cuda", "cpu"):
            raise ProfileFormatError(f"{source!r} has device type {self.device.type!r}; expected 'cuda' or 'cpu'.", hint=hint)
        if dtype_bytes(self.device.dtype) is None:
            raise ProfileFormatError(
                f"{source!r} has dtype {self.device.dtype!r}; expected one of {', '.join(sorted(DTYPE_BYTES))}.", hint=hint
            )
        for m in self.micro_batch_sizes:  # a fit may have a negative intercept, not a time <= 0 where it was measured
            fwd, bwd = self.step.forward.alpha * m + self.step.forward.beta, self.step.backward.alpha * m + self.step.backward.beta
            if not (fwd > 0 and bwd >= 0):
                raise ProfileFormatError(
                    f"{source!r} predicts a step forward of {fwd:.3g} s and backward of {bwd:.3g} s at its profiled micro-batch {m}; "
                    "a measured time is positive.",
                    hint=hint,
                )
        for i, layer in enumerate(self.layers):  # a noisy layer fit may dip a little below 0, not by a whole step's time
            for m in self.micro_batch_sizes:
                step = self.step.forward(m) + self.step.backward(m)
                worst = min(layer.forward(m), layer.backward(m))
                if worst < -0.5 * step:
                    raise ProfileFormatError(
                        f"{source!r} predicts {worst:.3g} s for layers[{i}] at its profiled micro-batch {m} (the whole step takes "
                        f"{step:.3g} s); a measured layer time is not negative.",
                        hint=hint,
                    )
        if self.memory.activation.alpha < 0:
            raise ProfileFormatError(f"{source!r} has activation memory falling with the micro-batch ({self.memory.activation.alpha:.3g} B per sample).", hint=hint)
        if not (isinstance(self.device.count, int) and self.device.count >= 1 and self.device.total_memory_bytes > 0):
            raise ProfileFormatError(
                f"{source!r} describes {self.device.count!r} device(s) of {self.device.total_memory_bytes!r} bytes; both must be positive.", hint=hint
            )
        counted: dict[int, int] = {}  # first user -> bytes of the shared parameters counted under it
        for group in self.shared_parameters:
            if len(group.layers) < 2 or any(not 0 <= i < len(self.layers) for i in group.layers) or group.param_bytes < 0:
                raise ProfileFormatError(
                    f"{source!r} has shared parameters over layers {list(group.layers)} ({group.param_bytes} bytes); "
                    f"they need two or more of the {len(self.layers)} layers and non-negative bytes.",
                    hint=hint,
                )
            first = min(group.layers)
            counted[first] = counted.get(first, 0) + group.param_bytes
            if counted[first] > self.layers[first].param_bytes:
                raise ProfileFormatError(
                    f"{source!r} has {counted[first]} bytes of shared parameters first used by layers[{first}], which holds "
                    f"{self.layers[first].param_bytes} bytes of parameters; shared parameters count under their first user.",
                    hint=hint,
                )
        loop = (self.framework.per_batch_s, self.framework.per_step_s, self.step.spread)
        if self.framework.pipeline_slot_s is not None:
            loop += (self.framework.pipeline_slot_s,)
        if any(not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 for x in loop):
            raise ProfileFormatError(f"{source!r} has a negative or non-finite training-loop overhead or step spread {list(loop)}.", hint=hint)
        for link in self.links:
            if link.kind not in ("allreduce", "p2p"):
                raise ProfileFormatError(f"{source!r} has a link of kind {link.kind!r}; expected 'allreduce' or 'p2p'.", hint=hint)
            if not (math.isfinite(link.bandwidth_bytes_per_s) and link.bandwidth_bytes_per_s > 0 and math.isfinite(link.latency_s) and link.latency_s >= 0):
                raise ProfileFormatError(
                    f"{source!r} has a {link.kind} link with bandwidth {link.bandwidth_bytes_per_s!r} B/s and latency {link.latency_s!r} s; "
                    "bandwidth must be positive and latency non-negative.",
                    hint=hint,
                )


def _fit_terms(fits: dict[str, LinearFit]) -> dict[str, float]:
    return {f"{name}.{term}": getattr(fit, term) for name, fit in fits.items() for term in ("alpha", "beta")}


def _walk(value: Any, path: str = "", is_str_field: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """``(path, value, annotated str?)`` for a profile and every field, item and entry inside it, depth first
    (paths like ``"layers[2].forward.alpha"``)."""
    yield path, value, is_str_field
    if hasattr(value, "__dataclass_fields__"):
        hints = _string_fields(type(value))
        for f in fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}" if path else f.name, f.name in hints)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]")


def _first_non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinite number in a profile's fields (``"layers[2].forward.alpha"``), None if all are finite."""
    return next((where for where, item, _ in _walk(value, path) if isinstance(item, float) and not math.isfinite(item)), None)


@functools.lru_cache(maxsize=None)
def _string_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls`` annotated ``str``."""
    import typing

    return frozenset(name for name, hint in typing.get_type_hints(cls).items() if hint is str)


def _first_non_string(value: Any, path: str) -> tuple[str, Any] | None:
    """(path, value) of the first field annotated ``str`` that holds something else (``links[1].backend = 3``), None if
    all do. JSON gives any type where the schema says string; the loader converts numbers only."""
    return next(((where, item) for where, item, is_str in _walk(value, path) if is_str and not isinstance(item, str)), None)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _pool_fit(fits: Sequence[LinearFit]) -> LinearFit:
    # The mean of lines fitted at the same sizes is the least-squares line through all their points.
    return LinearFit(alpha=_mean([f.alpha for f in fits]), beta=_mean([f.beta for f in fits]), r2=min(f.r2 for f in fits))


def _pool_link(links: Sequence[LinkProfile]) -> LinkProfile:
    # Mean time per message: latency and seconds per byte average, bandwidth is the inverse of the latter.
    first = links[0]
    return replace(
        first,
        latency_s=_mean([link.latency_s for link in links]),
        bandwidth_bytes_per_s=1.0 / _mean([1.0 / link.bandwidth_bytes_per_s for link in links]),
        r2=min(link.r2 for link in links),
        samples=tuple(x for link in links for x in link.samples),
    )


def _norm_dtype(dtype: str) -> str:
    return str(dtype).replace("torch.", "").lower()


def unpoolable_reason(a: Profile, b: Profile) -> str | None:
    """Why :func:`pool_profiles` cannot average ``a`` and ``b`` (a clause quoting both values), or None when it can."""
    da, db = a.device, b.device
    if (da.type, da.name) != (db.type, db.name):
        return f"they were measured on different devices ({db.type} {db.name!r} vs {da.type} {da.name!r})"
    if _norm_dtype(da.dtype) != _norm_dtype(db.dtype):
        return f"they were measured in different precisions ({db.dtype} vs {da.dtype})"
    if (da.tf32_matmul, da.tf32_conv) != (db.tf32_matmul, db.tf32_conv):
        return (f"they were measured with different TF32 settings (matmul {db.tf32_matmul}, conv {db.tf32_conv} vs "
                f"matmul {da.tf32_matmul}, conv {da.tf32_conv})")
    if a.model != b.model:
        return f"they are of different models ({b.model!r} vs {a.model!r})"
    if [layer.name for layer in a.layers] != [layer.name for layer in b.layers]:
        return f"they have different layers ({len(b.layers)} vs {len(a.layers)})"
    if a.micro_batch_sizes != b.micro_batch_sizes:
        return f"they timed different micro-batch sizes ({list(b.micro_batch_sizes)} vs {list(a.micro_batch_sizes)})"
    if sorted((link.kind, link.world_size) for link in a.links) != sorted((link.kind, link.world_size) for link in b.links):
        return "they measured different links"
    return None


def poolable(a: Profile, b: Profile) -> bool:
    """Whether two profiles measured the same things (device, precision, model, layers, micro-batch sizes, links), so
    :func:`pool_profiles` can average them (:func:`unpoolable_reason` says why not)."""
    return unpoolable_reason(a, b) is None


def pool_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile from several of the same model taken at different times: the mean of their timings.

    Every time the cost model reads is averaged: the step and per-layer fits (α and β: the mean of
    lines fitted at the same sizes is the least-squares line through all their points), the
    optimizer step, the training loop's overhead, each link's latency and seconds per byte, and
    the step's run-to-run spread (root mean square). Timing samples are concatenated. Sizes,
    memory and everything else come from the first profile. On a host whose speed drifts,
    profiles spread over a window predict that window's mean speed where one profile predicts the
    moment it was taken (``distplan bench`` profiles again after each pass for this).

    Raises:
        ValueError: no profiles, or profiles of different devices, precisions (dtype or TF32 settings), models,
            layers, sizes or links: a GPU's timings averaged with a CPU's, or bf16 with fp32, predict neither.
    """
    if not profiles:
        raise ValueError("pool_profiles needs at least one profile. HINT: pass the profiles to average, e.g. pool_profiles([first, second]).")
    first = profiles[0]
    if len(profiles) == 1:
        return first
    for i, other in enumerate(profiles[1:], 1):
        reason = unpoolable_reason(first, other)
        if reason is not None:
            raise ValueError(
                f"pool_profiles cannot average profile {i} with profile 0: {reason}. HINT: pool only profiles of the same model "
                "taken the same way (same device, precision, sizes and links); plan with each profile on its own otherwise."
            )
    layers = tuple(
        replace(
            layer,
            forward=_pool_fit([p.layers[i].forward for p in profiles]),
            backward=_pool_fit([p.layers[i].backward for p in profiles]),
            samples=tuple(x for p in profiles for x in p.layers[i].samples),
        )
        for i, layer in enumerate(first.layers)
    )
    step = StepProfile(
        forward=_pool_fit([p.step.forward for p in profiles]),
        backward=_pool_fit([p.step.backward for p in profiles]),
        samples=tuple(x for p in profiles for x in p.step.samples),
        spread=math.sqrt(_mean([p.step.spread**2 for p in profiles])),
    )
    links = tuple(
        _pool_link([next(x for x in p.links if (x.kind, x.world_size) == (link.kind, link.world_size)) for p in profiles])
        for link in first.links
    )
    framework = replace(
        first.framework,
        per_batch_s=_mean([p.framework.per_batch_s for p in profiles]),
        per_step_s=_mean([p.framework.per_step_s for p in profiles]),
        pipeline_slot_s=_mean(slots) if (slots := [p.framework.pipeline_slot_s for p in profiles if p.framework.pipeline_slot_s is not None]) else None,
    )
    optimizer = replace(first.optimizer, step_time_s=_mean([p.optimizer.step_time_s for p in profiles]))
    return replace(
        first,
        step=step,
        layers=layers,
        links=links,
        framework=framework,
        optimizer=optimizer,
        profiling_time_s=sum(p.profiling_time_s for p in profiles),
    )


def _build(cls: type, data: Any) -> Any:
    """Rebuild nested frozen dataclasses from ``asdict`` output."""
    import typing

    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = required - set(data)
    if missing:
        raise KeyError(f"missing {sorted(missing)} in {cls.__name__}")
    for key, value in data.items():
        if key not in names:
            continue
        kwargs[key] = _convert(hints[key], value)
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__} must be an object")
        return _build(tp, value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):  # a string "248" was read as the sizes 2, 4, 8
            raise TypeError(f"{value!r} is not a list")
        if args and args[-1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        return tuple(_convert(a, v) for a, v in zip(args, value))
    if origin is dict:
        kt, vt = args
        # JSON writes every key as a string: a whole-number key comes back as "4"
        return {(int(k) if kt is int and isinstance(k, str) else _convert(kt, k)): _convert(vt, v) for k, v in value.items()}
    if tp in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{value!r} is not a number")  # "0.1" was read as 0.1, true as 1
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number")  # never truncate 1.7 to 1 silently
        return int(value)
    if tp is float:
        return float(value)
    return value
