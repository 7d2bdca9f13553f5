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


# -- the host's own CPU and memory ----------------------------------------------------------


@dataclass(frozen=True)
class HostUsage:
    """The whole host's CPU and memory use: what a CPU slot reports on the hosts page."""

    cpu_utilization: int  # percent of all CPUs busy since the previous sample
    memory_mb: int
    memory_used_mb: int


def _cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies from the aggregate ``cpu`` line of ``/proc/stat``."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            # idle and iowait are the time no task ran; guest time is already in user.
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values[:8])
            return total - idle, total
    raise ValueError("no aggregate cpu line in /proc/stat")


def _memory_mb(meminfo_text: str) -> tuple[int, int]:
    """(total, used) MB from ``/proc/meminfo``; used leaves out what the kernel can reclaim
    (MemAvailable), as ``free`` does."""
    fields = {}
    for line in meminfo_text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0])  # kB
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    return total // 1024, max(total - available, 0) // 1024


class HostUsageSampler:
    """CPU utilisation is a rate: each ``sample()`` measures the busy share since the previous
    one (the heartbeat interval), the way ``top`` does. The first sample covers the time since
    boot. ``proc`` is a folder holding ``stat`` and ``meminfo`` (a parameter for tests)."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._last: tuple[int, int] = (0, 0)

    def _read(self, name: str) -> str:
        with open(f"{self.proc}/{name}", encoding="ascii") as f:
            return f.read()

    def sample(self) -> HostUsage | None:
        """The usage now, or None where ``/proc`` cannot be read (not Linux)."""
        try:
            busy, total = _cpu_times(self._read("stat"))
            memory_mb, used_mb = _memory_mb(self._read("meminfo"))
        except (OSError, ValueError, IndexError) as exc:
            _once(logging.INFO, "host CPU and memory not readable (%s): not reported", exc)
            return None
        last_busy, last_total = self._last
        self._last = (busy, total)
        span = total - last_total
        percent = round(100 * (busy - last_busy) / span) if span > 0 else 0
        return HostUsage(cpu_utilization=min(max(percent, 0), 100), memory_mb=memory_mb,
                         memory_used_mb=used_mb)
