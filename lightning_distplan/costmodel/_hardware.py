"""Hardware: the device memory, interconnect and speed a plan is priced on."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_distplan.errors import CatalogError, InfeasiblePlanError, ProfileFormatError

if TYPE_CHECKING:
    from lightning_distplan.profile import Profile

__all__ = ["Hardware", "DEFAULT_BANDWIDTH_BYTES_PER_S", "DEFAULT_LATENCY_S"]

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_BYTES_PER_S = 4e9 / 8
"""Used when the profile measured no link and none is given: 4 Gbit/s."""
# source: seed 000 Table III, AliCloud gn6i.xlarge (1×T4) "Bandwidth (Gbps) 4" — the paper's
# cheapest GPU instance, so the default errs towards slow networks rather than flattering DP.
DEFAULT_LATENCY_S = 50e-6
"""Used when the profile measured no link and none is given: 50 µs per message."""
# source: assumption, not a measurement — TCP round trips inside one cloud region are tens of
# microseconds; state the real number with ``latency_s=`` (CLI ``--latency-us``).


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One kind of device and its interconnect, as the cost model sees them.

    Example:
        >>> hw = Hardware(device_memory_bytes=16 << 30, allreduce_latency_s=50e-6,
        ...               allreduce_bandwidth_bytes_per_s=1.25e9, p2p_latency_s=50e-6,
        ...               p2p_bandwidth_bytes_per_s=1.25e9)
        >>> round(hw.usable_memory_bytes / 2**30, 1)
        14.4
    """

    name: str = "profiled"
    """Human-readable device name."""
    device_memory_bytes: int
    """Total memory of one device."""
    allreduce_latency_s: float
    """Per-step latency L of the ring all-reduce link (seed 001 eq. 5.1)."""
    allreduce_bandwidth_bytes_per_s: float
    """Bandwidth BW of the slowest link in the all-reduce ring (seed 001 eq. 5.1)."""
    p2p_latency_s: float
    """Latency of one pipeline boundary send (seed 001 eq. 6.2)."""
    p2p_bandwidth_bytes_per_s: float
    """Bandwidth of a pipeline boundary send (seed 001 eq. 6.2)."""
    compute_scale: float = 1.0
    """Multiplies every profiled compute time (1.0 = the profiled device; <1 = a faster one)."""
    memory_margin: float = 0.9
    """Usable fraction of device memory: the safety margin against fragmentation and spikes."""
    link_source: str = "given"
    """Where the link numbers came from: "measured", "given" or "default"."""
    comm_overlap: bool = True
    """Whether DDP's gradient all-reduce can run alongside the last backward (seed 000 §III-A S_over).
    True for GPUs (NCCL on its own stream); False for CPUs, where gloo reduces on the cores the
    backward is using, so nothing is hidden."""
    host_overlap: bool = True
    """Whether the training loop's host work (Lightning's per-batch cost) runs while the device
    computes (asynchronous CUDA launches): then only the part longer than the device's work shows.
    False for CPUs, where the host is the device and every loop millisecond adds up."""
    p2p_one_stream: bool = False
    """Whether a receiver's "ready" notice travels behind the data going the other way, as over
    gloo's one TCP stream per pair of ranks: then a pipeline's exchange of an activation and a
    gradient between two stages crosses one direction after the other
    (:func:`~lightning_distplan.costmodel._schedule.schedule_time`). False for NCCL, whose two
    directions the model takes as independent (assumed: no pipeline has run on a GPU yet); True
    where the profile's p2p link was measured over gloo, or, with no measured link, on a CPU."""
    devices_per_link: int = 1
    """Devices of consecutive ranks whose all-reduce traffic leaves through one link: the GPUs of an instance behind its
    network card, where the all-reduce crosses instances. A hybrid dp×pp's stages all-reduce their gradients at the same
    time, so the stages with ranks behind one link send their bytes over it together. 1: every device has a link of its
    own (one device per instance, or a ring inside one instance, whose GPUs each have their own NVLink/PCIe lanes)."""
    ddp_bucket_bytes: int | None = None
    """DDP's gradient bucket size (``DDPStrategy(bucket_cap_mb=...)`` in bytes): every bucket, the first included, as
    torch 2.14's DDP sizes them when ``bucket_cap_mb`` is given. ``None``: DDP's defaults, a 1 MiB first bucket and
    25 MiB after it (:data:`~lightning_distplan.costmodel._predict.DDP_BUCKET_BYTES`)."""

    def __post_init__(self) -> None:
        hint = "Pass positive, finite hardware numbers."
        if self.ddp_bucket_bytes is not None and (isinstance(self.ddp_bucket_bytes, bool) or not isinstance(self.ddp_bucket_bytes, int)
                                                  or self.ddp_bucket_bytes <= 0):
            raise CatalogError(f"`ddp_bucket_bytes` must be a positive integer or None, got {self.ddp_bucket_bytes!r}.",
                               hint="Pass DDPStrategy(bucket_cap_mb=...) a positive number of MiB, or leave it out.")
        if isinstance(self.devices_per_link, bool) or not isinstance(self.devices_per_link, int) or self.devices_per_link < 1:
            raise CatalogError(f"`devices_per_link` must be a positive integer, got {self.devices_per_link!r}.",
                               hint="Pass the number of devices that share one network link (e.g. the GPUs of one instance), or 1.")
        if not isinstance(self.device_memory_bytes, int) or self.device_memory_bytes <= 0:
            raise CatalogError(f"`device_memory_bytes` must be a positive integer, got {self.device_memory_bytes!r}.", hint=hint)
        for name in ("allreduce_bandwidth_bytes_per_s", "p2p_bandwidth_bytes_per_s", "compute_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise CatalogError(f"`{name}` must be positive and finite, got {value!r}.", hint=hint)
        for name in ("allreduce_latency_s", "p2p_latency_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise CatalogError(f"`{name}` must be >= 0 and finite, got {value!r}.", hint=hint)
        if not 0 < self.memory_margin <= 1:
            raise CatalogError(f"`memory_margin` must be in (0, 1], got {self.memory_margin!r}.", hint="Use e.g. 0.9 to keep 10% headroom.")

    @property
    def usable_memory_bytes(self) -> float:
        """``memory_margin · device_memory_bytes``: what a plan may use on one device."""
        return self.memory_margin * self.device_memory_bytes

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        *,
        device_memory_bytes: int | None = None,
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float | None = None,
        warn_default_links: bool = True,
        ranks_per_host: int = 1,
        world_size: int | None = None,
    ) -> Hardware:
        """The profiled device, with its measured links.

        Given numbers win over measured ones (the user describes the target cluster); links the
        profile did not measure and the user did not give fall back to
        :data:`DEFAULT_BANDWIDTH_BYTES_PER_S` / :data:`DEFAULT_LATENCY_S`, with a logged warning
        (``warn_default_links=False``: none, for a plan on one device that crosses no link).

        Args:
            profile: the measured profile.
            device_memory_bytes: override the device memory (default: the profiled device's).
            bandwidth_bytes_per_s: interconnect bandwidth for both all-reduce and p2p sends.
            latency_s: interconnect latency for both all-reduce and p2p sends.
            ranks_per_host: training processes that share one host. On a CPU profile the "device" memory
                is the host's RAM (or its cgroup limit), which every rank on the host draws from, so each
                gets its share; GPU ranks each have their own device. A given ``device_memory_bytes`` is
                taken as one rank's already.
            world_size: the job's ranks. Where they span several hosts (``1 < ranks_per_host < world_size``), the
                ranks on one host share its network link (``devices_per_link = ranks_per_host``): the stages of a
                hybrid dp×pp on one host cross it at once with their gradient all-reduces. None: one host.
        """
        # Checked before any use: NaN reached int() (a bare "cannot convert float NaN to integer"), and a NaN or negative
        # link was logged as "assuming nan Gbit/s (given)" before Hardware refused it under a field name not passed here.
        if device_memory_bytes is not None and not _is_finite_number(device_memory_bytes):
            raise InfeasiblePlanError(
                f"The device memory must be a finite number of bytes, got {device_memory_bytes!r}.",
                hint="Pass the device's memory in bytes, e.g. device_memory_bytes=16 << 30 (CLI: --device-memory-gb 16).",
            )
        if device_memory_bytes is not None and device_memory_bytes <= 0:
            raise InfeasiblePlanError(
                f"The device memory must be positive, got {device_memory_bytes!r} bytes.",
                hint="Pass the device's memory, e.g. --device-memory-gb 16 (GiB).",
            )
        if bandwidth_bytes_per_s is not None and not (_is_finite_number(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
            raise InfeasiblePlanError(
                f"`bandwidth_bytes_per_s` must be a positive, finite number, got {bandwidth_bytes_per_s!r}.",
                hint="Pass the interconnect's bandwidth in bytes/s, e.g. bandwidth_bytes_per_s=1.25e9 for 10 Gbit/s (CLI: --bandwidth-gbps 10).",
            )
        if latency_s is not None and not (_is_finite_number(latency_s) and latency_s >= 0):
            raise InfeasiblePlanError(
                f"`latency_s` must be a finite number of seconds, zero or more, got {latency_s!r}.",
                hint="Pass the interconnect's latency in seconds, e.g. latency_s=2e-5 for 20 µs (CLI: --latency-us 20).",
            )
        # a whole number: 4, or 4.0 as world_size / num_nodes gives it (taken before these checks), not 1.5
        if not (_is_finite_number(ranks_per_host) and ranks_per_host >= 1 and ranks_per_host == int(ranks_per_host)):
            raise InfeasiblePlanError(
                f"`ranks_per_host` must be a whole number, 1 or more, got {ranks_per_host!r}.",
                hint="Pass the training processes on one host (one node's share of the world size), e.g. ranks_per_host=4.",
            )
        ranks_per_host = int(ranks_per_host)
        memory = device_memory_bytes or profile.memory.device_total_bytes or profile.device.total_memory_bytes
        if not memory:
            raise ProfileFormatError(
                "The profile records no device memory and none was given.",
                hint="Pass device_memory_bytes (CLI: --device-memory-gb).",
            )
        if device_memory_bytes is None and profile.device.type == "cpu" and ranks_per_host > 1:
            memory //= ranks_per_host
        used: set[str] = set()
        defaulted: list[str] = []
        links: dict[str, tuple[float, float]] = {}
        for kind in ("allreduce", "p2p"):
            measured = profile.link(kind)
            if measured is not None and not measured.bandwidth_bytes_per_s > 0:
                measured = None
            lat, bw = latency_s, bandwidth_bytes_per_s
            if lat is None:
                lat = measured.latency_s if measured is not None else DEFAULT_LATENCY_S
                used.add("measured" if measured is not None else "default")
            if bw is None:
                bw = measured.bandwidth_bytes_per_s if measured is not None else DEFAULT_BANDWIDTH_BYTES_PER_S
                used.add("measured" if measured is not None else "default")
            links[kind] = (float(lat), float(bw))
            if measured is None and (latency_s is None or bandwidth_bytes_per_s is None):
                defaulted.append("p2p" if kind == "p2p" else "all-reduce")
        if "default" in used and warn_default_links:
            # Name the link kinds that defaulted: a profile with a measured all-reduce but no p2p is common.
            given_bw, given_lat = bandwidth_bytes_per_s is not None, latency_s is not None
            log.warning(
                "The profile measured no %s link; assuming %.3g Gbit/s%s and %.0f µs%s for it. "
                "State your cluster's numbers (CLI: --bandwidth-gbps, --latency-us).",
                " or ".join(defaulted),
                (bandwidth_bytes_per_s if given_bw else DEFAULT_BANDWIDTH_BYTES_PER_S) * 8 / 1e9,
                " (given)" if given_bw else " (seed 000 Table III, gn6i)",
                latency_s * 1e6 if given_lat else DEFAULT_LATENCY_S * 1e6,
                # seed 000 Table III lists bandwidths but no latency: the 50 µs is our assumption (see DEFAULT_LATENCY_S)
                " (given)" if given_lat else " (assumed; seed 000 lists no latency)",
            )
        source = "default" if "default" in used else ("measured" if "measured" in used else "given")
        cpu = profile.device.type == "cpu"
        p2p = profile.link("p2p")
        return cls(
            name=profile.device.name or "profiled",
            device_memory_bytes=int(memory),
            allreduce_latency_s=links["allreduce"][0],
            allreduce_bandwidth_bytes_per_s=links["allreduce"][1],
            p2p_latency_s=links["p2p"][0],
            p2p_bandwidth_bytes_per_s=links["p2p"][1],
            link_source=source,
            comm_overlap=not cpu,
            host_overlap=not cpu,
            p2p_one_stream="gloo" in p2p.backend if p2p is not None and p2p.backend else cpu,
            devices_per_link=ranks_per_host if world_size is not None and 1 < ranks_per_host < world_size else 1,
        )


def _is_finite_number(value: object) -> bool:
    """A real, finite number (a numpy scalar too), not a bool or a string."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def format_bytes(nbytes: float) -> str:
    """A memory size in the largest binary unit that keeps it at 1 or more.

    Example:
        >>> format_bytes(1000), format_bytes(3 << 19), format_bytes(5 << 30)
        ('1000 B', '1.5 MiB', '5.00 GiB')
    """
    for unit, shift, digits in (("GiB", 30, 2), ("MiB", 20, 1), ("KiB", 10, 1)):
        if abs(nbytes) >= 1 << shift:
            return f"{nbytes / (1 << shift):.{digits}f} {unit}"
    return f"{nbytes:.0f} B"
