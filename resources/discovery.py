"""GPU discovery with NVML (``nvidia-ml-py``, module ``pynvml``).

GPUs are keyed by UUID: NVML enumerates every device of the machine and ignores
``CUDA_VISIBLE_DEVICES``, so an index is only meaningful on the host that reported it. Without
an NVIDIA driver ``nvmlInit()`` raises ``NVMLError_LibraryNotFound`` (or another NVML error): the
host then reports no GPU and offers CPU slots instead (``EDT_CPU_SLOTS``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("edt.discovery")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    model: str
    memory_mb: int
    memory_used_mb: int
    utilization: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_said: set[str] = set()


def _once(level: int, message: str, *args: object) -> None:
    """Log a discovery outcome once per process: discovery runs on every heartbeat."""
    text = message % args
    if text not in _said:
        _said.add(text)
        log.log(level, text)


def discover(nvml: Any = None) -> list[GpuInfo]:
    """Every GPU NVML sees, with its current utilisation and memory; [] without NVML.

    ``nvml`` is the ``pynvml`` module (a parameter so tests can pass a fake driver)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional at import time
        except ImportError:
            _once(logging.INFO, "nvidia-ml-py is not installed: no GPUs")
            return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError_LibraryNotFound:
        _once(logging.INFO, "NVML library not found: no GPUs, CPU slots only")
        return []
    except nvml.NVMLError as exc:
        _once(logging.WARNING, "NVML could not start (%s): no GPUs, CPU slots only", exc)
        return []
    gpus: list[GpuInfo] = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    utilization = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except nvml.NVMLError:  # some devices (MIG, vGPU) report no utilisation
                    utilization = 0
                gpus.append(
                    GpuInfo(
                        index=index,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        model=_text(nvml.nvmlDeviceGetName(handle)),
                        memory_mb=int(memory.total) // (1024 * 1024),
                        memory_used_mb=int(memory.used) // (1024 * 1024),
                        utilization=utilization,
                    )
                )
            except nvml.NVMLError as exc:
                log.warning("GPU %s unreadable, skipped: %s", index, exc)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return gpus
