"""GPU peak numbers for the roofline projection, each row with its source.

Pure Python (no torch). Peaks are *dense* (no structured sparsity; a datasheet's figure marked
"with sparsity" is halved). "tensor" is the BF16/FP16 tensor-core rate (FP16 where the part has no
BF16); "fp32" is the plain (non-tensor-core) FP32 rate that a float32 PyTorch matmul gets when TF32 is
off (PyTorch's default for matmuls); "tf32" is the TF32 tensor-core rate a float32 matmul or
convolution gets where TF32 is allowed (PyTorch's default for cuDNN convolutions), on Ampere and later
parts only.

The profiled device needs peaks too: the roofline ratio divides the target's bound by the source's
(DESIGN §4). :func:`source_spec` maps a CUDA profile's device name to a row, and for a CPU profile
estimates the host's peak from the profile itself (see its docstring); that estimate is coarse and
the projection says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from lightning_distplan.errors import CatalogError

if TYPE_CHECKING:
    from lightning_distplan.profile import Profile

__all__ = ["GpuSpec", "GPUS", "gpu_spec", "match_gpu_name", "source_spec", "CPU_MEMORY_BANDWIDTH_ASSUMED"]

_TB = 1e12
_GB = 1e9
_GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Peak throughput of one device (a GPU, a share of one, or an estimated CPU host)."""

    name: str
    """Canonical name (``"A100-80GB"``)."""
    tensor_flops: float
    """Dense BF16/FP16 tensor-core FLOP/s (FP16 for parts without BF16)."""
    fp32_flops: float
    """Dense non-tensor FP32 FLOP/s."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth."""
    memory_bytes: int
    """Device memory capacity."""
    interconnect_bytes_per_s: float = 16 * _GB
    """GPU-to-GPU bandwidth inside one machine, per direction (NVLink where the part has it, else PCIe)."""
    source: str = ""
    """Where the numbers come from."""
    estimate: bool = False
    """True when a number is not from a vendor datasheet (treat it as a guess)."""
    kind: Literal["gpu", "cpu"] = "gpu"
    fraction: float = 1.0
    """Share of the physical device (time-sliced / vGPU instances sell 1/12 .. 1/2 of an A10)."""
    bf16: bool = True
    """Whether the tensor cores take BF16 (T4 and V100 take FP16 only: BF16 runs at the FP32 rate there)."""
    tf32_flops: float | None = None
    """Dense TF32 tensor-core FLOP/s; None on parts without TF32 (T4, V100, a CPU), where float32 runs at ``fp32_flops``."""
    ecc_fraction: float = 0.0
    """Share of the memory a datasheet (and an instance listing) gives that ECC takes: 1/16 on GDDR parts, which run
    with ECC on; ``memory_bytes`` is already net of it."""

    def __post_init__(self) -> None:
        for name in ("tensor_flops", "fp32_flops", "memory_bandwidth_bytes_per_s", "interconnect_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise CatalogError(
                    f"GpuSpec {self.name!r}: `{name}` must be > 0, got {getattr(self, name)!r}.",
                    hint="Give the datasheet's dense peak in FLOP/s or bytes/s (e.g. 65e12 for 65 TFLOP/s), a positive number.",
                )
        if self.tf32_flops is not None and not self.tf32_flops > 0:
            raise CatalogError(
                f"GpuSpec {self.name!r}: `tf32_flops` must be > 0 or None, got {self.tf32_flops!r}.",
                hint="Give the datasheet's dense TF32 tensor-core peak in FLOP/s, or None for a part without TF32.",
            )
        if not 0 <= self.ecc_fraction < 1:
            raise CatalogError(
                f"GpuSpec {self.name!r}: `ecc_fraction` must be in [0, 1), got {self.ecc_fraction!r}.",
                hint="Use 1/16 for GDDR memory with ECC on, else 0.",
            )
        if not 0 < self.fraction <= 1:
            raise CatalogError(
                f"GpuSpec {self.name!r}: `fraction` must be in (0, 1], got {self.fraction!r}.",
                hint="Use the share of one card the instance sells, e.g. 0.5 for half a GPU, or 1 for a whole one.",
            )

    @property
    def listed_memory_gib(self) -> float:
        """The memory the datasheet (or an instance listing) gives, in GiB: ``memory_bytes`` before ECC's share."""
        return self.memory_bytes / (1 - self.ecc_fraction) / _GIB

    def peak_flops(self, precision: Literal["fp32", "tf32", "bf16", "fp16"]) -> float:
        """Peak FLOP/s for the given math: ``"fp16"`` on tensor cores, ``"bf16"`` too where they take BF16
        (else the FP32 rate: an assumption, bf16 has no faster path there), ``"tf32"`` on tensor cores where
        the part has TF32 (else the FP32 rate, as float32 runs there), ``"fp32"`` without them."""
        if precision == "fp16" or (precision == "bf16" and self.bf16):
            return self.tensor_flops
        if precision == "tf32" and self.tf32_flops is not None:
            return self.tf32_flops
        return self.fp32_flops

    def share(self, fraction: float, *, memory_bytes: int | None = None) -> GpuSpec:
        """This GPU sliced to ``fraction`` of its compute and memory bandwidth.

        Assumption (not measured): a time-sliced share gets that fraction of the peaks; the memory
        capacity is what the instance sells (``memory_bytes``), else the same fraction of the card.
        """
        if fraction >= 1:
            return self if memory_bytes is None else replace(self, memory_bytes=memory_bytes)
        return replace(
            self,
            name=f"{self.name}x{fraction:.3g}",
            tensor_flops=self.tensor_flops * fraction,
            fp32_flops=self.fp32_flops * fraction,
            tf32_flops=None if self.tf32_flops is None else self.tf32_flops * fraction,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s * fraction,
            memory_bytes=memory_bytes if memory_bytes is not None else int(self.memory_bytes * fraction),
            fraction=self.fraction * fraction,
            estimate=True,
            source=self.source + f"; shared {fraction:.3g} of the card: peaks scaled linearly (assumption)",
        )


# source: NVIDIA CUDA C++ Best Practices Guide ("On GPUs with GDDR memory with ECC enabled the available DRAM is
# reduced by 6.25%"); assumption: ECC is on, as these data-center boards ship and as clouds run them.
GDDR_ECC_FRACTION = 1 / 16


def _row(
    name: str, tensor_tf: float, fp32_tf: float, tf32_tf: float | None, bw_gbs: float, mem_gb: float, ic_gbs: float, source: str, *,
    estimate: bool = False, bf16: bool = True, gddr: bool = False,
) -> GpuSpec:
    ecc = GDDR_ECC_FRACTION if gddr else 0.0
    return GpuSpec(
        name=name,
        tensor_flops=tensor_tf * _TB,
        fp32_flops=fp32_tf * _TB,
        tf32_flops=None if tf32_tf is None else tf32_tf * _TB,
        memory_bandwidth_bytes_per_s=bw_gbs * _GB,
        # Marketing "GB" on these datasheets is GiB-sized HBM/GDDR; torch reports e.g. 79.2 GiB usable on an 80 GB part.
        # GDDR with ECC on gives up 1/16 of it (a 16 GB T4: 15 GiB).
        memory_bytes=int(mem_gb * _GIB * (1 - ecc)),
        interconnect_bytes_per_s=ic_gbs * _GB,
        source=source,
        estimate=estimate,
        bf16=bf16,
        ecc_fraction=ecc,
    )


# Interconnect per direction: NVLink total / 2 on SXM parts, else the PCIe slot (Gen3 x16 ≈ 16 GB/s,
# Gen4 x16 ≈ 32 GB/s, Gen5 x16 ≈ 64 GB/s per direction; source: PCI-SIG link rates).
GPUS: dict[str, GpuSpec] = {
    # source: NVIDIA T4 datasheet (65 FP16 tensor TFLOPS mixed precision, 8.1 FP32, 320 GB/s, 16 GB GDDR6, PCIe Gen3 x16); no BF16, no TF32.
    "T4": _row("T4", 65, 8.1, None, 320, 16, 16, "NVIDIA T4 datasheet", bf16=False, gddr=True),
    # source: NVIDIA A10 datasheet (125 BF16 dense / 250 sparse, 62.5 TF32 dense / 125 sparse, 31.2 FP32, 600 GB/s, 24 GB GDDR6, PCIe Gen4 x16).
    "A10": _row("A10", 125, 31.2, 62.5, 600, 24, 32, "NVIDIA A10 datasheet", gddr=True),
    # source: ESTIMATE - AWS publishes no A10G datasheet; ~70 tensor TFLOPS from vendor tables (unconfirmed),
    # TF32 half of that as on the A10, FP32 assumed equal to the A10's 31.2 (same GA102 die), 600 GB/s and 24 GB GDDR6 per AWS G5 documentation.
    "A10G": _row("A10G", 70, 31.2, 35, 600, 24, 32, "vendor tables, unconfirmed estimate", estimate=True, gddr=True),
    # source: NVIDIA L4 datasheet (242 FP16/BF16 with sparsity -> 121 dense, 120 TF32 with sparsity -> 60 dense, 30.3 FP32, 300 GB/s,
    # 24 GB GDDR6, PCIe Gen4 x16).
    "L4": _row("L4", 121, 30.3, 60, 300, 24, 32, "NVIDIA L4 datasheet", gddr=True),
    # source: NVIDIA V100 datasheet, SXM2 (125 FP16 tensor, 15.7 FP32, 900 GB/s, 16 GB, NVLink 300 GB/s total); no BF16, no TF32.
    "V100": _row("V100", 125, 15.7, None, 900, 16, 150, "NVIDIA V100 datasheet (SXM2 16 GB)", bf16=False),
    # source: NVIDIA V100 datasheet, SXM2 32 GB (the 16 GB part's peaks: 125 FP16 tensor, 15.7 FP32, 900 GB/s; NVLink 300 GB/s total);
    # SkyPilot's AWS catalog names it "V100-32GB" (p3dn.24xlarge), torch "Tesla V100-SXM2-32GB".
    "V100-32GB": _row("V100-32GB", 125, 15.7, None, 900, 32, 150, "NVIDIA V100 datasheet (SXM2 32 GB)", bf16=False),
    # source: NVIDIA V100 datasheet, PCIe (112 FP16 tensor, 14 FP32, 900 GB/s, 16 GB, PCIe Gen3 x16); no BF16, no TF32.
    "V100-PCIe": _row("V100-PCIe", 112, 14, None, 900, 16, 16, "NVIDIA V100 datasheet (PCIe 16 GB)", bf16=False),
    # source: NVIDIA V100 datasheet, PCIe 32 GB (the PCIe 16 GB part's peaks: 112 FP16 tensor, 14 FP32, 900 GB/s; 32 GB, PCIe Gen3
    # x16); torch names it "Tesla V100-PCIE-32GB". No BF16, no TF32.
    "V100-PCIe-32GB": _row("V100-PCIe-32GB", 112, 14, None, 900, 32, 16, "NVIDIA V100 datasheet (PCIe 32 GB)", bf16=False),
    # source: NVIDIA A100 datasheet, 40 GB SXM (312 BF16 dense, 156 TF32 dense, 19.5 FP32, 1,555 GB/s, NVLink 600 GB/s total).
    "A100-40GB": _row("A100-40GB", 312, 19.5, 156, 1555, 40, 300, "NVIDIA A100 datasheet (40 GB SXM)"),
    # source: NVIDIA A100 datasheet, 80 GB SXM (312 BF16 dense, 156 TF32 dense, 19.5 FP32, 2,039 GB/s, NVLink 600 GB/s total).
    "A100-80GB": _row("A100-80GB", 312, 19.5, 156, 2039, 80, 300, "NVIDIA A100 datasheet (80 GB SXM)"),
    # source: NVIDIA A100 datasheet, 40 GB PCIe (the SXM part's peaks, 1,555 GB/s, PCIe Gen4 x16; an NVLink bridge pairs two at most).
    "A100-PCIe-40GB": _row("A100-PCIe-40GB", 312, 19.5, 156, 1555, 40, 32, "NVIDIA A100 datasheet (40 GB PCIe)"),
    # source: NVIDIA A100 datasheet, 80 GB PCIe (the SXM part's peaks, 1,935 GB/s, PCIe Gen4 x16; an NVLink bridge pairs two at most).
    "A100-PCIe-80GB": _row("A100-PCIe-80GB", 312, 19.5, 156, 1935, 80, 32, "NVIDIA A100 datasheet (80 GB PCIe)"),
    # source: NVIDIA L40S datasheet (362.05 BF16 dense / 733 sparse, 183 TF32 dense / 366 sparse, 91.6 FP32, 864 GB/s, 48 GB GDDR6,
    # PCIe Gen4 x16).
    "L40S": _row("L40S", 362, 91.6, 183, 864, 48, 32, "NVIDIA L40S datasheet", gddr=True),
    # source: NVIDIA H100 datasheet, SXM5 (989 BF16 dense / 1,979 sparse, 989 TF32 with sparsity -> 494.5 dense, 67 FP32, 3.35 TB/s,
    # 80 GB, NVLink 900 GB/s total).
    "H100-SXM": _row("H100-SXM", 989, 67, 494.5, 3350, 80, 450, "NVIDIA H100 datasheet (SXM5)"),
    # source: NVIDIA H100 datasheet, PCIe (756 BF16 dense, 756 TF32 with sparsity -> 378 dense, 51 FP32, 2.0 TB/s, 80 GB, PCIe Gen5 x16).
    "H100-PCIe": _row("H100-PCIe", 756, 51, 378, 2000, 80, 64, "NVIDIA H100 datasheet (PCIe)"),
    # source: NVIDIA H100 datasheet, NVL (1,671 BF16 with sparsity -> 835.5 dense, 835 TF32 with sparsity -> 417.5 dense, 60 FP32,
    # 3.9 TB/s, 94 GB, PCIe Gen5 x16; an NVLink bridge pairs two at most).
    "H100-NVL": _row("H100-NVL", 835.5, 60, 417.5, 3900, 94, 64, "NVIDIA H100 datasheet (NVL)"),
    # source: NVIDIA H200 datasheet, SXM (989 BF16 dense, 989 TF32 with sparsity -> 494.5 dense, 67 FP32, 4.8 TB/s, 141 GB, NVLink 900 GB/s total).
    "H200": _row("H200", 989, 67, 494.5, 4800, 141, 450, "NVIDIA H200 datasheet (SXM)"),
    # source: NVIDIA H200 datasheet, NVL (1,671 BF16 with sparsity -> 835.5 dense, 835 TF32 with sparsity -> 417.5 dense, 60 FP32,
    # 4.8 TB/s, 141 GB, PCIe Gen5 x16; an NVLink bridge joins two or four at most).
    "H200-NVL": _row("H200-NVL", 835.5, 60, 417.5, 4800, 141, 64, "NVIDIA H200 datasheet (NVL)"),
}

# Names people and catalogs use -> canonical row. SkyPilot's catalogs say "A100" for the 40 GB part and
# "A100-80GB" for the 80 GB one, and "H100" for both H100s (SXM or PCIe alike: the SXM row, unless the catalog
# parser finds "pcie" in the instance type, as in Lambda's gpu_1x_h100_pcie, and asks for "<name> PCIe");
# AWS p5 instances carry H100 SXM. torch names the PCIe parts ("NVIDIA A100 80GB PCIe", "NVIDIA H100 NVL"),
# which have rows of their own.
_ALIASES: dict[str, str] = {
    "A100": "A100-40GB",
    "A10040GB": "A100-40GB",
    "A100SXM440GB": "A100-40GB",
    "A100PCIE": "A100-PCIe-40GB",  # SkyPilot's "A100" is the 40 GB part
    "A100PCIE40GB": "A100-PCIe-40GB",
    "A10040GBPCIE": "A100-PCIe-40GB",
    "A10080GB": "A100-80GB",
    "A100SXM480GB": "A100-80GB",
    "A100PCIE80GB": "A100-PCIe-80GB",
    "A10080GBPCIE": "A100-PCIe-80GB",
    "H100": "H100-SXM",
    "H100SXM": "H100-SXM",
    "H10080GBHBM3": "H100-SXM",
    "H100SXM580GB": "H100-SXM",
    "H100PCIE": "H100-PCIe",
    "H100NVL": "H100-NVL",
    "H200": "H200",
    "H200141GBHBM3E": "H200",
    "H200NVL": "H200-NVL",
    "V100": "V100",
    "V10016GB": "V100",
    "V100SXM216GB": "V100",
    "TESLAV100SXM216GB": "V100",
    "V100SXM232GB": "V100-32GB",
    "TESLAV100SXM232GB": "V100-32GB",
    "V100PCIE": "V100-PCIe",
    "V100PCIE16GB": "V100-PCIe",
    "TESLAV100PCIE16GB": "V100-PCIe",
    "V100PCIE32GB": "V100-PCIe-32GB",
    "V10032GBPCIE": "V100-PCIe-32GB",
    "TESLAV100PCIE32GB": "V100-PCIe-32GB",
    "TESLAT4": "T4",
    "T4": "T4",
    "L4": "L4",
    "L40S": "L40S",
    "A10": "A10",
    "A10G": "A10G",
}


# Words in a device name that mark a variant clocked or built differently from the row its GPU's name would match:
# "Tesla V100-FHHL-16GB" (the full-height half-length PCIe card, with a lower power limit and clocks than the PCIe
# row's) and "Tesla V100-DGXS-16GB" (the DGX Station's V100). No datasheet figures for them are sourced here, so they
# match no row (as a MIG slice does) and a profile taken on one is refused, not scaled with the SXM2 row's peaks.
_UNLISTED_VARIANTS = frozenset({"FHHL", "DGXS"})


def _key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper().replace("NVIDIA", ""))


def match_gpu_name(name: str) -> str | None:
    """Canonical row name for a GPU name as catalogs or ``torch.cuda.get_device_name`` spell it, or None.

    Example:
        >>> match_gpu_name("NVIDIA H100 80GB HBM3"), match_gpu_name("a100-80gb"), match_gpu_name("Tesla T4")
        ('H100-SXM', 'A100-80GB', 'T4')
    """
    key = _key(name)
    for canonical in GPUS:
        if key == _key(canonical):
            return canonical
    if key in _ALIASES:
        return _ALIASES[key]
    # Device strings carry extra words ("NVIDIA A100-SXM4-80GB"): take the longest known name made of whole
    # consecutive words of it. Whole words: "L40" is not an L4, nor "GH200" an H200.
    words = [w for w in re.split(r"[^A-Z0-9]+", name.upper()) if w and w != "NVIDIA"]
    if "MIG" in words:
        # A MIG slice ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") has a fraction of the GPU's SMs and bandwidth: no row is its.
        return None
    if _UNLISTED_VARIANTS.intersection(words):
        return None
    runs = {"".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
    known = {**_ALIASES, **{_key(c): c for c in GPUS}}
    hits = [run for run in runs if run in known]
    if not hits:
        return None
    canonical = known[max(hits, key=len)]
    # A memory size in the name that the row does not have ("V100-32GB" against the 16 GB row) is another part.
    sizes = {int(m) for w in words for m in re.findall(r"^(\d+)GB$", w)}
    if sizes and round(GPUS[canonical].listed_memory_gib) not in sizes:
        return None
    return canonical


def gpu_spec(name: str) -> GpuSpec:
    """The spec row for ``name`` (any spelling :func:`match_gpu_name` knows).

    Raises:
        CatalogError: the GPU is not in the table (the message lists the known ones).
    """
    canonical = match_gpu_name(name)
    if canonical is None:
        raise CatalogError(
            f"Unknown GPU {name!r}; the spec table knows {', '.join(GPUS)}.",
            hint="Use one of those names, or add a row with its datasheet source to lightning_distplan/costmodel/gpus.py.",
        )
    return GPUS[canonical]


# source: assumption - a dual-channel DDR4/DDR5 desktop or a small cloud VM share streams ~20 GB/s; used only
# when a CPU profile has to be projected and no measured host bandwidth exists.
CPU_MEMORY_BANDWIDTH_ASSUMED = 20 * _GB


def source_spec(profile: Profile) -> tuple[GpuSpec, str]:
    """Peaks of the device the profile was measured on, and how they were obtained.

    * CUDA profile: the spec row matching ``profile.device.name``.
    * CPU profile: no datasheet applies, so the peak FLOP/s is *estimated from the profile itself*: the
      highest FLOP/s any layer reached at the largest profiled micro-batch (sum of forward+backward
      FLOPs over the fitted time). The most compute-dense layer of a model is normally a large
      matmul, which on a CPU gets close to the host's BLAS peak, but this is still a lower bound on
      the true peak: taking it as the peak assumes the target GPU runs that layer at its datasheet
      peak, so CPU-based projections lean optimistic (a large bf16 matmul reaches ~80% of peak on an
      H100: 798 TFLOP/s of 989 measured on a lent H100, 8192³). Memory bandwidth is :data:`CPU_MEMORY_BANDWIDTH_ASSUMED`. Projections from a
      CPU profile are coarse (a factor of ~3 either way, see ``projection.py``).

    Raises:
        CatalogError: a CUDA profile of a GPU the table does not know.
    """
    device = profile.device
    if device.type == "cuda":
        if match_gpu_name(device.name) is None and re.search(r"\bMIG\b", device.name.upper()):
            raise CatalogError(
                f"The profile was measured on {device.name!r}, a MIG slice, whose share of the GPU's compute and memory "
                "bandwidth the spec table does not hold, so its times cannot be scaled to the catalog's GPUs.",
                hint="Profile on a whole GPU (MIG disabled) or on the CPU (distplan profile --device cpu).",
            )
        variant = sorted(_UNLISTED_VARIANTS.intersection(re.split(r"[^A-Z0-9]+", device.name.upper())))
        if variant:
            raise CatalogError(
                f"The profile was measured on {device.name!r}: the spec table has no row for its {variant[0]} variant, whose clocks "
                "differ from the table's rows for that GPU, so its times cannot be scaled to the catalog's GPUs.",
                hint="Profile on one of the table's GPUs or on the CPU (distplan profile --device cpu), or add a row for this variant "
                "with its datasheet source to lightning_distplan/costmodel/gpus.py.",
            )
        if match_gpu_name(device.name) is None:
            raise CatalogError(
                f"The profile was measured on {device.name!r}, a GPU the spec table does not know, so its times cannot be "
                f"scaled to the catalog's GPUs (the table knows {', '.join(GPUS)}).",
                hint="Profile on one of those GPUs or on the CPU (distplan profile --device cpu), or add a row for it with its "
                "datasheet source to lightning_distplan/costmodel/gpus.py.",
            )
        spec = gpu_spec(device.name)
        return spec, f"spec table row {spec.name!r} ({spec.source})"
    m = max(profile.micro_batch_sizes)
    best = 0.0
    for layer in profile.layers:
        flops = (layer.flops_forward_per_sample + layer.flops_backward_per_sample) * m
        t = layer.time(m)
        if flops > 0 and t > 0:
            best = max(best, flops / t)
    basis = (
        f"CPU host: peak FLOP/s estimated as the best per-layer achieved rate in the profile at micro-batch {m} "
        f"({best / 1e9:.3g} GFLOP/s); memory bandwidth assumed {CPU_MEMORY_BANDWIDTH_ASSUMED / 1e9:.0f} GB/s"
    )
    if best <= 0:
        # No FLOP counts at all: fall back to a stated guess of a small multicore host.
        # source: assumption - ~100 GFLOP/s FP32, a few AVX2/AVX-512 cores running PyTorch's BLAS.
        best = 100e9
        basis = "CPU host: no per-layer FLOPs in the profile, peak assumed 100 GFLOP/s FP32; memory bandwidth assumed 20 GB/s"
    spec = GpuSpec(
        name=f"cpu:{device.name}",
        tensor_flops=best,
        fp32_flops=best,
        memory_bandwidth_bytes_per_s=CPU_MEMORY_BANDWIDTH_ASSUMED,
        memory_bytes=int(device.total_memory_bytes) or 1,
        source=basis,
        estimate=True,
        kind="cpu",
    )
    return spec, basis
