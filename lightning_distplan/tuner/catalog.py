"""Cloud instance catalogs: what can be rented, with which GPUs, network and price.

Two built-in catalogs, each row citing its source and date, and user CSVs in SkyPilot's layout:

* ``alicloud-2023``: seed 000 Table III exactly (AliCloud ECS GPU instances, RMB/hour, one GPU or a
  shared fraction of one per instance), so the paper's setting can be reproduced.
* ``aws-2026``: AWS us-east-1 on-demand prices from a public price-catalog snapshot (2026-11, USD/hour);
  network bandwidth from the AWS EC2 instance-type documentation. Its "Up to N Gbps" rows are priced at the burst peak N
  (no sustained figure is sourced); they are marked (:attr:`Instance.network_burst`) and a search's result says so
  (:meth:`Catalog.caveats`).

A user CSV is parsed by header name (SkyPilot: ``InstanceType, AcceleratorName, AcceleratorCount,
vCPUs, MemoryGiB, Price, SpotPrice, Region``) plus ``NetworkGbps`` (required unless a bandwidth is
given), optional ``GpuMemoryGiB`` (per GPU; for a shared GPU, of the share) and ``Currency`` (default USD).

Prices are on-demand by default. ``pricing="spot"`` prices every instance at its ``SpotPrice`` instead
(:func:`spot_priced`): instances without one are left out. The built-in catalogs list on-demand prices only.
"""

from __future__ import annotations

import csv
import logging
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from lightning_distplan.costmodel.gpus import GPUS, GpuSpec, gpu_spec, match_gpu_name
from lightning_distplan.errors import CatalogError

__all__ = ["Instance", "Catalog", "BUILTIN_CATALOGS", "PRICINGS", "load_catalog", "parse_catalog_csv", "spot_priced", "with_bandwidth"]

log = logging.getLogger(__name__)

_GIB = 1024**3

PRICINGS = ("on-demand", "spot")
"""What an instance's ``price_per_hour`` is: the on-demand ``Price`` or the ``SpotPrice``."""


@dataclass(frozen=True, kw_only=True)
class Instance:
    """One rentable instance type."""

    instance_type: str
    """Provider's name (``"gn6i.xlarge"``, ``"p4d.24xlarge"``)."""
    gpu: str
    """Canonical GPU row name in :data:`lightning_distplan.costmodel.gpus.GPUS`."""
    gpus_per_instance: float
    """GPUs per instance; a fraction < 1 is a shared GPU (1/6 = one sixth of a card)."""
    gpu_memory_gb: float
    """Memory of one GPU, or of the share for a fractional GPU, in GB (GiB-sized, as sold). More than twice the spec
    row's (for a share: twice that share of it) is refused as a typo."""
    vcpus: float
    memory_gb: float
    """Host memory."""
    network_gbps: float
    """Instance network bandwidth in Gbit/s (the inter-instance link)."""
    price_per_hour: float
    """Price of one instance per hour, in ``currency``: the on-demand price, or the spot price in a catalog whose
    ``pricing`` is ``"spot"``. 0 is taken (hardware you already own): its plans then cost nothing, so with a time weight of 0
    the objective cannot tell them apart; a weight above 0 ranks them by step time."""
    currency: str
    region: str = ""
    source: str = ""
    """Where the row comes from (table, snapshot, file and line)."""
    date: str = ""
    """When the price was valid / captured."""
    spot_price_per_hour: float | None = None
    network_source: str = ""
    network_burst: bool = False
    """``network_gbps`` is the provider's "up to" figure: a burst peak, not a bandwidth the instance sustains (AWS lists
    e.g. g5.xlarge as "Up to 10 Gbps"). No sustained figure is sourced for these rows, so the burst figure is what the
    search prices: a plan that spans several such instances is predicted faster and cheaper than it will run.
    ``--bandwidth-gbps`` (``bandwidth_gbps=``) or a CSV's ``NetworkGbps`` puts your own figure in its place."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_instance", "gpu_memory_gb", "network_gbps", "price_per_hour"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (value == 0 and name != "price_per_hour"):
                rule = "a number, zero or more" if name == "price_per_hour" else "a positive number"
                raise CatalogError(
                    f"Instance {self.instance_type!r}: `{name}` must be {rule}, got {value!r}.",
                    hint="Fix the catalog row.",
                )
        if self.gpus_per_instance > 1 and self.gpus_per_instance != int(self.gpus_per_instance):
            raise CatalogError(
                f"Instance {self.instance_type!r}: {self.gpus_per_instance} GPUs per instance is neither whole nor a share of one GPU.",
                hint="Use a whole number of GPUs, or a fraction below 1 for a shared GPU.",
            )
        card = gpu_spec(self.gpu).listed_memory_gib
        # A typo (800 for 80, or the instance's total) would price plans on memory no card has. The spec table
        # names one variant per GPU, and others sell more (V100 32 GB on a 16 GB row, A100 80 GB PCIe listed as an
        # "A100" in some catalogs): up to twice the row's memory passes.
        if self.gpus_per_instance < 1 and self.gpu_memory_gb > 2 * card * self.gpus_per_instance:
            # A shared GPU's memory is its share (seed 000 Table III: 4 GB for 1/6 of an A10); the card's whole memory
            # written for it ("per GPU") priced every plan on 6x the memory the share has, silently.
            share = card * self.gpus_per_instance
            raise CatalogError(
                f"Instance {self.instance_type!r}: {self.gpu_memory_gb:g} GiB of GPU memory for its {Fraction(self.gpus_per_instance).limit_denominator(64)} "
                f"share of the {self.gpu} is more than twice that share of the card ({share:.3g} of {card:g} GiB, spec table).",
                hint=f"For a shared GPU give GpuMemoryGiB of the share (e.g. {share:.3g}), or leave it empty to take that share of the spec's.",
            )
        if self.gpu_memory_gb > 2 * card:
            raise CatalogError(
                f"Instance {self.instance_type!r}: {self.gpu_memory_gb:g} GiB of GPU memory per GPU is more than twice what the "
                f"{self.gpu} has ({card:g} GiB, spec table).",
                hint="Give GpuMemoryGiB per GPU, in GiB (e.g. 80 for an 80 GB card), or leave it empty to take the spec's.",
            )

    @property
    def devices_per_instance(self) -> int:
        """Ranks per instance: one per whole GPU, one for a shared GPU."""
        return max(1, int(self.gpus_per_instance))

    def world_size(self, count: int) -> int:
        """Ranks when renting ``count`` of these instances."""
        return count * self.devices_per_instance

    def gpu_spec(self) -> GpuSpec:
        """The GPU one rank gets: the spec row, sliced for a shared GPU, with the memory the instance sells (less ECC's
        share on GDDR parts, as on the spec row: a listing gives the board's memory)."""
        spec = gpu_spec(self.gpu)
        memory = int(self.gpu_memory_gb * _GIB * (1 - spec.ecc_fraction))
        if self.gpus_per_instance < 1:
            return spec.share(self.gpus_per_instance, memory_bytes=memory)
        return spec.share(1.0, memory_bytes=memory)

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class Catalog:
    """A named list of instances priced in one currency."""

    name: str
    currency: str
    instances: tuple[Instance, ...]
    source: str = ""
    date: str = ""
    notes: tuple[str, ...] = field(default=())
    pricing: str = "on-demand"
    """``"on-demand"`` or ``"spot"`` (see :data:`PRICINGS`): which price each instance's ``price_per_hour`` is."""

    def __post_init__(self) -> None:
        if self.pricing not in PRICINGS:
            raise CatalogError(f"Catalog {self.name!r}: unknown pricing {self.pricing!r}.", hint=f"Use one of {', '.join(PRICINGS)}.")
        if not self.instances:
            raise CatalogError(f"Catalog {self.name!r} has no GPU instances.", hint="Add at least one row with an AcceleratorName.")
        currencies = {i.currency for i in self.instances}
        if currencies != {self.currency}:
            raise CatalogError(
                f"Catalog {self.name!r} mixes currencies {sorted(currencies)}; costs would not be comparable.",
                hint="Use one currency per catalog (split the file).",
            )
        names = [i.instance_type for i in self.instances]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CatalogError(f"Catalog {self.name!r} lists instance types {dupes} more than once.", hint="Keep one row per instance type.")

    def caveats(self) -> tuple[str, ...]:
        """What a search's result must say about the figures it priced: the catalog's ``notes`` and, where instances'
        network figure is an "up to" burst peak (:attr:`Instance.network_burst`), that it is one and how to replace it."""
        burst = [i for i in self.instances if i.network_burst]
        if not burst:
            return self.notes
        listed = ", ".join(f"{i.instance_type} {i.network_gbps:g}" for i in burst)
        return (
            *self.notes,
            f"The network bandwidth of {listed} Gbit/s is the provider's 'up to' burst peak, not a sustained rate (no sustained "
            "figure is sourced): a plan spanning several of these instances is predicted faster and cheaper than it will run. "
            "Pass --bandwidth-gbps N (tune(bandwidth_gbps=N)), or a CSV with your own NetworkGbps, to price another figure.",
        )

    def get(self, instance_type: str) -> Instance:
        for inst in self.instances:
            if inst.instance_type == instance_type:
                return inst
        raise CatalogError(
            f"Instance type {instance_type!r} is not in catalog {self.name!r}.",
            hint=f"Use one of {', '.join(i.instance_type for i in self.instances)}.",
        )

    @property
    def instance_types(self) -> tuple[str, ...]:
        return tuple(i.instance_type for i in self.instances)


# --------------------------------------------------------------------------------------- built-ins
_ALI_SOURCE = "seed 000 (f67cd44a8fa141d7) Table III, AliCloud ECS GPU instances"


def _ali(instance_type: str, vcpus: int, memory_gb: float, gpu: str, share: str, gpu_memory_gb: float, gbps: float, rmb: float) -> Instance:
    return Instance(
        instance_type=instance_type,
        gpu=gpu,
        gpus_per_instance=float(Fraction(share)),
        gpu_memory_gb=gpu_memory_gb,
        vcpus=vcpus,
        memory_gb=memory_gb,
        network_gbps=gbps,
        price_per_hour=rmb,
        currency="RMB",
        region="cn (not stated in the paper)",
        source=_ALI_SOURCE,
        date="2023",
        network_source="seed 000 Table III 'Bandwidth (Gbps)'",
    )


# source: seed 000 Table III (vCPU, memory GB, GPU, GPU memory GB, bandwidth Gbps, price RMB/hour), verbatim;
# "1*A10 * 1/6" is one sixth of an A10 shared between tenants. gn7e carries an 80 GB A100.
_ALICLOUD_2023 = (
    _ali("gn6i.xlarge", 4, 15, "T4", "1", 16, 4, 11.67),
    _ali("gn6i.2xlarge", 8, 31, "T4", "1", 16, 5, 14.04),
    _ali("gn7i.2xlarge", 8, 30, "A10", "1", 24, 16, 12.75),
    _ali("gn7i.4xlarge", 16, 60, "A10", "1", 24, 16, 13.50),
    _ali("vgn7i-vws.xlarge", 4, 30, "A10", "1/6", 4, 3, 3.117),
    _ali("vgn7i-vws.2xlarge", 10, 62, "A10", "1/3", 8, 5, 5.609),
    _ali("vgn7i-vws.3xlarge", 14, 93, "A10", "1/2", 12, 8, 8.102),
    _ali("sgn7i.xlarge", 4, 8, "A10", "1/12", 2, 5, 1.875),
    _ali("sgn7i.2xlarge", 8, 16, "A10", "1/6", 4, 10, 3.124),
    _ali("sgn7i.4xlarge", 16, 32, "A10", "1/3", 8, 20, 5.621),
    _ali("gn6v.2xlarge", 8, 32, "V100", "1", 16, 2.5, 26.46),
    _ali("gn7e.4xlarge", 16, 125, "A100-80GB", "1", 80, 25, 34.742),
)

_AWS_SOURCE = "AWS us-east-1 on-demand, public price-catalog snapshot (2026-11); pass your own CSV for current prices"
_AWS_NET_SOURCE = "AWS EC2 accelerated-computing instance docs, 'Network bandwidth (Gbps)'; 'up to' values are burst peaks"


def _aws(instance_type: str, gpus: int, gpu: str, gpu_memory_gb: float, vcpus: int, memory_gb: float, gbps: float, usd: float, *,
         burst: bool = False) -> Instance:
    return Instance(
        instance_type=instance_type,
        gpu=gpu,
        gpus_per_instance=float(gpus),
        gpu_memory_gb=gpu_memory_gb,
        vcpus=vcpus,
        memory_gb=memory_gb,
        network_gbps=gbps,
        price_per_hour=usd,
        currency="USD",
        region="us-east-1",
        source=_AWS_SOURCE,
        date="2026-11 (snapshot month; prices change)",
        network_source=_AWS_NET_SOURCE,
        network_burst=burst,
    )


# source: prices from a public AWS us-east-1 on-demand price-catalog snapshot (2026-11); vCPU / memory GiB / network Gbps from the AWS EC2
# instance-type documentation (G5, G6, G6e, P3, P4d/P4de, P5/P5en pages). "Up to N" is taken as N (burst=True): those
# pages give no sustained figure, and none is sourced here (FACTS.md has none), so the burst peak is priced and the
# search's result says so (see ``Instance.network_burst``) rather than a baseline being made up.
_AWS_2026 = (
    _aws("g5.xlarge", 1, "A10G", 24, 4, 16, 10, 1.006, burst=True),
    _aws("g5.48xlarge", 8, "A10G", 24, 192, 768, 100, 16.288),
    _aws("g6.xlarge", 1, "L4", 24, 4, 16, 10, 0.8048, burst=True),
    _aws("g6.48xlarge", 8, "L4", 24, 192, 768, 100, 13.3504),
    _aws("g6e.xlarge", 1, "L40S", 48, 4, 32, 20, 1.861, burst=True),
    _aws("p3.2xlarge", 1, "V100", 16, 8, 61, 10, 3.06, burst=True),
    _aws("p3.16xlarge", 8, "V100", 16, 64, 488, 25, 24.48),
    _aws("p4d.24xlarge", 8, "A100-40GB", 40, 96, 1152, 400, 32.7726),
    _aws("p4de.24xlarge", 8, "A100-80GB", 80, 96, 1152, 400, 40.96575),
    _aws("p5.48xlarge", 8, "H100-SXM", 80, 192, 2048, 3200, 98.32),
    _aws("p5en.48xlarge", 8, "H200", 141, 192, 2048, 3200, 84.8),
)

BUILTIN_CATALOGS: dict[str, Catalog] = {
    "alicloud-2023": Catalog(name="alicloud-2023", currency="RMB", instances=_ALICLOUD_2023, source=_ALI_SOURCE, date="2023"),
    "aws-2026": Catalog(
        name="aws-2026",
        currency="USD",
        instances=_AWS_2026,
        source=_AWS_SOURCE,
        date="2026-11",
        notes=("A10G peaks are an estimate (no NVIDIA datasheet).",),
    ),
}


# --------------------------------------------------------------------------------------- CSV
_REQUIRED = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price")
_OPTIONAL = ("vCPUs", "MemoryGiB", "SpotPrice", "Region", "NetworkGbps", "GpuMemoryGiB", "Currency")


def load_catalog(name_or_path: str | Path, *, bandwidth_gbps: float | None = None, pricing: str = "on-demand") -> Catalog:
    """A built-in catalog by name, or a user CSV by path.

    Args:
        name_or_path: ``"alicloud-2023"``, ``"aws-2026"`` or the path of a CSV file.
        bandwidth_gbps: network bandwidth for every instance (overrides ``NetworkGbps``; required
            for a CSV without that column).
        pricing: ``"on-demand"`` (the ``Price`` column) or ``"spot"`` (the ``SpotPrice`` column; rows without one
            are left out, and the catalog's name gets ``-spot``).

    Raises:
        CatalogError: unknown name (the message lists the valid ones), a malformed CSV, or spot pricing asked of a
            catalog without spot prices (the built-ins have none).
    """
    _check_pricing(pricing)
    key = str(name_or_path)
    if not key:
        raise CatalogError("No catalog was named (an empty name).", hint=f"Pass a built-in catalog name ({', '.join(BUILTIN_CATALOGS)}) or a CSV path.")
    if key in BUILTIN_CATALOGS:
        catalog = BUILTIN_CATALOGS[key]
        catalog = catalog if bandwidth_gbps is None else with_bandwidth(catalog, bandwidth_gbps)
        return spot_priced(catalog) if pricing == "spot" else catalog
    path = Path(key)
    if path.suffix.lower() == ".csv" or path.exists():
        return parse_catalog_csv(path, bandwidth_gbps=bandwidth_gbps, pricing=pricing)
    raise CatalogError(
        f"Unknown catalog {key!r}: it is neither a built-in catalog nor an existing CSV file.",
        hint=f"Use one of {', '.join(BUILTIN_CATALOGS)}, or the path of a SkyPilot-style CSV ({', '.join(_REQUIRED)}, NetworkGbps).",
    )


def with_bandwidth(catalog: Catalog, bandwidth_gbps: float) -> Catalog:
    """``catalog`` with every instance's network bandwidth set to ``bandwidth_gbps`` (Gbit/s).

    Raises:
        CatalogError: the bandwidth is not a positive number.
    """
    from dataclasses import replace

    _check_bandwidth(bandwidth_gbps)
    given = {"network_gbps": float(bandwidth_gbps), "network_source": "given (--bandwidth-gbps)", "network_burst": False}
    return replace(catalog, instances=tuple(replace(i, **given) for i in catalog.instances))


def spot_priced(catalog: Catalog) -> Catalog:
    """``catalog`` priced at spot prices: each instance's ``price_per_hour`` becomes its ``spot_price_per_hour``,
    instances without one are left out (a warning names them), and the name gets ``-spot`` (so a study of it is
    not one of the on-demand catalog). A catalog already spot-priced is returned as it is.

    Spot instances can be taken back by the provider at any time; the search prices a step, not the restarts.

    Raises:
        CatalogError: no instance of the catalog has a spot price.
    """
    from dataclasses import replace

    if catalog.pricing == "spot":
        return catalog
    priced = tuple(replace(i, price_per_hour=i.spot_price_per_hour) for i in catalog.instances if i.spot_price_per_hour is not None)
    if not priced:
        builtin = " (the built-in catalogs list on-demand prices only)" if catalog.name in BUILTIN_CATALOGS else ""
        raise CatalogError(
            f"Catalog {catalog.name!r} has no spot prices{builtin}, so it cannot be searched at spot prices.",
            hint="Pass a SkyPilot-style CSV with a SpotPrice column (SkyPilot's own catalogs have one), or leave out --pricing spot.",
        )
    left_out = [i.instance_type for i in catalog.instances if i.spot_price_per_hour is None]
    if left_out:
        warnings.warn(
            f"Catalog {catalog.name}: {len(left_out)} instance type{'s' if len(left_out) != 1 else ''} without a spot price left out "
            f"({', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''}); {len(priced)} searched at spot prices.",
            stacklevel=2,
        )
    return replace(catalog, name=f"{catalog.name}-spot", instances=priced, pricing="spot")


def _check_pricing(pricing: str) -> None:
    if pricing not in PRICINGS:
        raise CatalogError(f"Unknown pricing {pricing!r}.", hint=f"Use one of {', '.join(PRICINGS)} (--pricing).")


def _check_bandwidth(bandwidth_gbps: float) -> None:
    if not isinstance(bandwidth_gbps, (int, float)) or not math.isfinite(bandwidth_gbps) or bandwidth_gbps <= 0:
        raise CatalogError(f"The network bandwidth must be a positive number of Gbit/s, got {bandwidth_gbps!r}.", hint="Pass e.g. --bandwidth-gbps 25.")


def _number(value: str, *, column: str, where: str, allow_fraction: bool = False, allow_zero: bool = False) -> float:
    text = (value or "").strip()
    if not text:
        raise CatalogError(f"{where}: column {column!r} is empty.", hint=f"Fill in {column} for that row (or delete the row).")
    try:
        number = float(Fraction(text)) if allow_fraction and "/" in text else float(text)
    except (ValueError, ZeroDivisionError):
        raise CatalogError(f"{where}: column {column!r} holds {text!r}, which is not a number.", hint=f"Write {column} as a plain number.") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        rule = "a number, zero or more" if allow_zero else "a positive number"
        raise CatalogError(f"{where}: column {column!r} holds {text!r}; it must be {rule}.", hint=f"Fix {column} in that row.")
    return number


def _skipped_summary(skipped: dict[str, list[str]]) -> str:
    parts = [f"{len(lines)} row{'s' if len(lines) != 1 else ''} skipped for {why}" for why, lines in skipped.items() if lines]
    return ", ".join(parts)


def parse_catalog_csv(path: str | Path, *, bandwidth_gbps: float | None = None, name: str | None = None, pricing: str = "on-demand") -> Catalog:
    """Parse a SkyPilot-style catalog CSV (columns found by header name, any order, case-insensitive).

    Rows without an ``AcceleratorName`` (CPU-only instances in SkyPilot files) are skipped. So are,
    with one warning that counts them and names examples, rows of a GPU the spec table does not know
    (SkyPilot's files list K80s, Inferentia, Trainium...), rows without a ``Price`` (not sold
    on demand there) and accelerators priced without an ``InstanceType`` (SkyPilot's GCP file lists
    the GPUs attached to an N1 host so). A bare GPU name that both an SXM and a PCIe part go by ("H100", "A100",
    "A100-80GB", "V100") is the SXM part's row unless the ``InstanceType`` has the word ``pcie`` (Lambda's
    ``gpu_1x_h100_pcie``); write e.g. ``H100-PCIe`` or ``H100-NVL`` as the ``AcceleratorName`` to say which part an
    instance has. A row whose ``InstanceType`` repeats in another ``Region`` becomes
    ``type@region``; repeats in the same region (availability zones) keep the cheapest.

    With ``pricing="spot"`` the ``SpotPrice`` column takes ``Price``'s place: it is required, each instance is
    priced at it, rows without one are skipped (with the warning), ``Price`` may be missing, and the
    catalog's name gets ``-spot``.

    Raises:
        CatalogError: missing file or columns, a negative / non-numeric price (0 is taken: hardware you own) or count, no bandwidth, no
            usable GPU row (naming why the skipped ones were); messages carry the line number.
    """
    given = str(path)
    path = Path(path)
    _check_pricing(pricing)
    price_column = "SpotPrice" if pricing == "spot" else "Price"
    if bandwidth_gbps is not None:
        _check_bandwidth(bandwidth_gbps)
    if not path.is_file():
        what = "is a directory, not a file" if given and path.is_dir() else "does not exist"
        raise CatalogError(
            f"Catalog file {given!r} {what}.",
            hint=f"Pass an existing CSV, or a built-in catalog name ({', '.join(BUILTIN_CATALOGS)}).",
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise CatalogError(f"Catalog file {str(path)!r} cannot be read as UTF-8 text ({err}).", hint="Save it as a UTF-8 CSV.") from None
    # A quote opened and never closed makes the rest of the file one cell (the rows there were lost, and the file reported
    # as having no GPU rows, or the row as having no price): such a cell runs to the end of the file, so the last record
    # is read again strictly to tell it from a closed one. Not the whole file strictly: that also refuses what spreadsheets
    # take, such as a space after a closing quote ("g5.xlarge" ,A10G), which was read as before.
    lines = text.splitlines()
    reader = csv.reader(lines)

    def unclosed(tail: list[str]) -> bool:
        try:
            for _ in csv.reader(tail, strict=True):
                pass
        except csv.Error as err:
            return "end of data" in str(err)
        return False

    def records() -> Iterator[tuple[int, list[str]]]:
        """(the line a record starts on, its cells): a quoted cell may hold a line break, so records and lines can differ."""
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:  # a cell above csv's field size limit
                raise CatalogError(f"{path.name} line {start}: the row is not valid CSV ({err}).", hint="Check that row's quotes.") from None
            if reader.line_num == len(lines) and unclosed(lines[start - 1:]):
                raise CatalogError(
                    f"{path.name} line {start}: the row is not valid CSV (a quote opened there is never closed).",
                    hint='Check that row\'s quotes: a cell that starts with " must end with ", and a " inside it is written "".',
                )
            yield start, row

    rows_in = records()
    try:
        _, header = next(rows_in)
    except StopIteration:
        raise CatalogError(f"Catalog file {str(path)!r} is empty.", hint=f"Give a header row with {', '.join(_REQUIRED)}, NetworkGbps.") from None
    index = {h.strip().lower(): i for i, h in enumerate(header)}
    required = [price_column if c == "Price" else c for c in _REQUIRED] + ([] if bandwidth_gbps is not None else ["NetworkGbps"])
    missing = [c for c in required if c.lower() not in index]
    if missing:
        hint = f"Add the column(s) {', '.join(missing)} to the header (line 1)"
        if "NetworkGbps" in missing:
            hint += "; or state the network bandwidth for all instances with --bandwidth-gbps GBPS (bandwidth_gbps=)"
        raise CatalogError(f"Catalog file {str(path)!r} line 1: missing column(s) {missing}; found {header}.", hint=hint + ".")

    def cell(row: list[str], column: str) -> str:
        i = index.get(column.lower())
        return row[i].strip() if i is not None and i < len(row) else ""

    rows: dict[tuple[str, str], Instance] = {}
    no_price = "no spot price" if pricing == "spot" else "no price"
    skipped: dict[str, list[str]] = {"unknown GPU": [], no_price: [], "no instance type": []}
    for lineno, row in rows_in:
        if not any(c.strip() for c in row):
            continue
        where = f"{path.name} line {lineno}"
        itype = cell(row, "InstanceType")
        gpu_name = cell(row, "AcceleratorName")
        if not itype and gpu_name:
            # an accelerator priced alone: SkyPilot's GCP catalog lists the GPUs (and TPUs) attached to an N1 host so,
            # the host's price in a row of its own; there is no instance to rent by that row
            skipped["no instance type"].append(f"{where}: accelerator {gpu_name!r} without an InstanceType")
            continue
        if not itype:
            raise CatalogError(f"{where}: column 'InstanceType' is empty.", hint="Name the instance type in every row.")
        if not gpu_name:
            continue  # a CPU-only instance: nothing to plan on
        canonical = match_gpu_name(gpu_name)
        if canonical is None:
            skipped["unknown GPU"].append(f"{where}: unknown GPU {gpu_name!r} for {itype!r}")
            continue
        if "PCIE" in re.split(r"[^A-Z0-9]+", itype.upper()):
            # SkyPilot names both H100s "H100" (and the A100s and V100s by size alone), so Lambda's gpu_1x_h100_pcie was
            # priced at the SXM part's peaks (989 vs 756 TFLOP/s, 3.35 vs 2.0 TB/s); its instance type says which it is.
            canonical = match_gpu_name(f"{gpu_name} PCIe") or canonical
        if not cell(row, price_column):
            skipped[no_price].append(f"{where}: column {price_column!r} is empty for {itype!r}")
            continue
        count = _number(cell(row, "AcceleratorCount"), column="AcceleratorCount", where=where, allow_fraction=True)
        spot_text = cell(row, "SpotPrice")
        # A price of 0 is hardware already paid for, as Instance takes it (SkyPilot's on-prem vSphere catalog writes 0.0).
        spot = _number(spot_text, column="SpotPrice", where=where, allow_zero=True) if spot_text else None
        price = spot if pricing == "spot" else _number(cell(row, "Price"), column="Price", where=where, allow_zero=True)
        if bandwidth_gbps is not None:
            gbps, net_source = float(bandwidth_gbps), "given (--bandwidth-gbps)"
        else:
            gbps, net_source = _number(cell(row, "NetworkGbps"), column="NetworkGbps", where=where), f"{path.name} NetworkGbps"
        mem_text = cell(row, "GpuMemoryGiB")
        spec = gpu_spec(canonical)
        if mem_text:
            gpu_mem = _number(mem_text, column="GpuMemoryGiB", where=where)
        else:
            gpu_mem = spec.listed_memory_gib * min(count, 1.0)
        vcpus_text, mem_host_text = cell(row, "vCPUs"), cell(row, "MemoryGiB")
        region = cell(row, "Region")
        currency = cell(row, "Currency") or "USD"
        try:
            inst = Instance(
                instance_type=itype,
                gpu=canonical,
                gpus_per_instance=count,
                gpu_memory_gb=gpu_mem,
                vcpus=_number(vcpus_text, column="vCPUs", where=where) if vcpus_text else 0.0,
                memory_gb=_number(mem_host_text, column="MemoryGiB", where=where) if mem_host_text else 0.0,
                network_gbps=gbps,
                price_per_hour=price,
                currency=currency,
                region=region,
                source=f"{path} line {lineno}",
                date="",
                spot_price_per_hour=spot,
                network_source=net_source,
            )
        except CatalogError as err:
            message, _, hint = str(err).partition(" HINT: ")
            raise CatalogError(f"{where}: {message}", hint=hint or "Fix that row.") from None
        key = (itype, region)
        if key not in rows or inst.price_per_hour < rows[key].price_per_hour:
            rows[key] = inst
    known = f"the spec table knows {', '.join(GPUS)}"
    gpu_hint = "Use one of those names, or add a row with its datasheet source to lightning_distplan/costmodel/gpus.py."
    if not rows:
        if skipped["unknown GPU"]:
            raise CatalogError(f"{skipped['unknown GPU'][0]} ({_skipped_summary(skipped)}, no usable row); {known}.", hint=gpu_hint)
        if skipped[no_price]:
            raise CatalogError(f"{skipped[no_price][0]} ({_skipped_summary(skipped)}, no usable row).", hint=f"Fill in {price_column} for those rows.")
        if skipped["no instance type"]:
            raise CatalogError(f"{skipped['no instance type'][0]} ({_skipped_summary(skipped)}, no usable row).",
                               hint="Give each GPU instance a row with its InstanceType, AcceleratorName, AcceleratorCount and price.")
        raise CatalogError(f"Catalog file {str(path)!r} has no GPU instance rows.", hint="Add rows with AcceleratorName and AcceleratorCount.")
    if any(skipped.values()):
        examples = "; ".join(lines[0] for lines in skipped.values() if lines)
        warnings.warn(
            (f"Catalog {path.name}: {_skipped_summary(skipped)} (e.g. {examples}); {len(rows)} {'row is' if len(rows) == 1 else 'rows are'} used. "
             + (f"For the GPUs: {known}." if skipped["unknown GPU"] else "")).rstrip(),
            stacklevel=2,
        )
    regions_per_type: dict[str, int] = {}
    for itype, _ in rows:
        regions_per_type[itype] = regions_per_type.get(itype, 0) + 1
    from dataclasses import replace

    instances = tuple(
        replace(inst, instance_type=f"{itype}@{region}") if regions_per_type[itype] > 1 else inst for (itype, region), inst in rows.items()
    )
    currencies = sorted({i.currency for i in instances})
    if len(currencies) > 1:
        raise CatalogError(f"Catalog file {str(path)!r} mixes currencies {currencies}.", hint="Use one currency per catalog.")
    name = name or path.stem + ("-spot" if pricing == "spot" else "")
    return Catalog(name=name, currency=currencies[0], instances=instances, source=str(path), date="", pricing=pricing)
