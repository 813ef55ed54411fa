"""What the profiled device is: NVML on NVIDIA GPUs, ``torch.cuda`` otherwise, host RAM on CPU."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import torch

from lightning_distplan.profile import DeviceProfile

__all__ = ["device_info", "nvml_uuids", "resolve_device", "tf32_switches"]

log = logging.getLogger(__name__)


def tf32_switches() -> tuple[bool | None, bool | None]:
    """Whether this process lets float32 (matmuls, convolutions) run on TF32 tensor cores; None where it cannot tell.

    torch >= 2.9 has ``fp32_precision`` per backend ("tf32", "ieee", or "none": the older switch decides) next to the
    older ``allow_tf32``, and reading ``allow_tf32`` raises once both were used to set one: the newer is read first.
    """

    def switch(newer: object, older: object) -> bool | None:
        precision = getattr(newer, "fp32_precision", "none")
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
        try:
            return bool(older.allow_tf32)  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError):
            return None

    matmul = torch.backends.cuda.matmul
    return switch(matmul, matmul), switch(getattr(torch.backends.cudnn, "conv", None), torch.backends.cudnn)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> the current CUDA device when present, else CPU; ``"cuda"`` needs a GPU."""
    from lightning_distplan.errors import DeviceUnavailableError

    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise DeviceUnavailableError(
            f"Device {device!r} is not a device torch understands ({err}).", hint="Use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"Device {str(device)!r} was asked for but torch sees no CUDA GPU on this machine.",
                hint="Use --device cpu (or 'auto'), or run on a machine with an NVIDIA GPU and a CUDA build of torch.",
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"Device {str(device)!r} was asked for but only {torch.cuda.device_count()} CUDA device(s) exist.",
                hint=f"Use an index below {torch.cuda.device_count()}.",
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise DeviceUnavailableError(f"Device type {dev.type!r} is not supported by the profiler.", hint="Use 'cpu' or 'cuda'.")
    return dev


def device_info(device: str | torch.device | None = None) -> DeviceProfile:
    """Name and total memory of ``device``.

    On NVIDIA GPUs the numbers come from NVML (``nvidia-ml-py``), matched to the torch device by
    UUID so ``CUDA_VISIBLE_DEVICES`` remapping cannot confuse them (a MIG instance by its own UUID,
    never by the PCI bus, which names the whole GPU); without NVML, or with no NVML device of that
    UUID, from ``torch.cuda``. On CPU the total is the host RAM from ``os.sysconf`` (or the cgroup limit when
    the process runs in a smaller container), and ``memory_source`` says which.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device`` or ``None`` for auto.

    Example:
        >>> device_info("cpu").type
        'cpu'
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        return _cuda_info(dev)
    return _cpu_info()


def _cuda_info(dev: torch.device) -> DeviceProfile:
    props = torch.cuda.get_device_properties(dev)
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            handle = None
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                for name in nvml_uuids(str(uuid)):
                    try:
                        handle = pynvml.nvmlDeviceGetHandleByUUID(name)
                        break
                    except pynvml.NVMLError:
                        continue
                if handle is None:  # the PCI bus names the whole GPU, whose memory a MIG instance does not have
                    raise LookupError(f"no NVML device has the UUID {uuid} that CUDA reports")
            else:
                bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
        return DeviceProfile(type="cuda", name=name, total_memory_bytes=total, memory_source="nvml", dtype="float32")
    except Exception as err:  # NVML missing, not an NVIDIA GPU (ROCm), or a driver without the call
        log.info("NVML unavailable (%s); using torch.cuda device properties.", err)
        return DeviceProfile(type="cuda", name=props.name, total_memory_bytes=int(props.total_memory), memory_source="torch.cuda")


def nvml_uuids(uuid: str) -> tuple[str, ...]:
    """The NVML UUIDs (``nvmlDeviceGetHandleByUUID``) the CUDA device UUID ``uuid`` may stand for.

    torch prints ``cudaDeviceProp.uuid`` without NVML's prefix, and in MIG mode CUDA reports the MIG
    instance's UUID, which NVML names ``MIG-<uuid>``; a whole GPU's is ``GPU-<uuid>``.

    Example:
        >>> nvml_uuids("5f2c3c4e-0000-1111-2222-333344445555")
        ('GPU-5f2c3c4e-0000-1111-2222-333344445555', 'MIG-5f2c3c4e-0000-1111-2222-333344445555')
    """
    return (uuid,) if uuid.startswith(("GPU-", "MIG-")) else (f"GPU-{uuid}", f"MIG-{uuid}")


def _cpu_info() -> DeviceProfile:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    source = "host RAM (sysconf)"
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        total, source = limit, "cgroup memory limit"
    return DeviceProfile(type="cpu", name=_cpu_name(), total_memory_bytes=int(total), memory_source=source)


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
