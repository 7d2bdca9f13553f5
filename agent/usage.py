"""What each job's processes on this host use, for the job page: CPU (100 = one core busy),
resident memory, and on GPU hosts the GPU memory NVML sees them hold.

The agent samples its running children every heartbeat and publishes one ``metrics.usage``
event per job (``publish_usage``): the job page draws it beside the job's throughput, so a
user sees a job that waits on its data loader (low CPU, low samples/s) or grows towards its
memory limit. A child's processes are those of its control group when it has one (its data
loaders included), else the process itself; CPU time counts the reaped children too (``cutime``),
so a data loader that ended still counts for the time it ran.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.children import Child
from config.event_stream import publish

log = logging.getLogger("edt.execution")

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


@dataclass(frozen=True)
class ProcessUse:
    cpu_s: float  # user and system time so far, its reaped children's included
    rss_bytes: int


def process_use(pid: int, proc: str = "/proc") -> ProcessUse | None:
    """One process's CPU time and resident memory, or None when it is gone."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        with open(f"{proc}/{pid}/statm", encoding="ascii") as f:
            statm = f.read().split()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its last ")".
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ProcessUse(cpu_s=(utime + stime + cutime + cstime) / _TICKS,
                      rss_bytes=int(statm[1]) * _PAGE)


def child_pids(child: Child) -> list[int]:
    """The child's processes: its control group's, else its own pid."""
    pids = child.group.pids() if child.group is not None else []
    return pids or [child.proc.pid]


def gpu_memory_by_pid(nvml: Any = None) -> dict[int, int]:
    """Bytes of GPU memory each process holds, summed over the GPUs NVML sees; {} without NVML
    (a CPU host) or where the driver does not say (``usedGpuMemory`` None under some vGPUs).
    ``nvml`` is the ``pynvml`` module (a parameter so tests can pass a fake driver)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional at import time
        except ImportError:
            return {}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return {}
    held: dict[int, int] = defaultdict(int)
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if isinstance(p.usedGpuMemory, int):
                    held[int(p.pid)] += p.usedGpuMemory
    except nvml.NVMLError as exc:
        log.debug("GPU memory per process not readable: %s", exc)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return dict(held)


class JobUsage:
    """Per job, the use of its processes on this host since the previous ``sample``.

    CPU is a rate: each child's CPU time is remembered between samples (by its key), and a
    child seen for the first time reports from its next sample on."""

    def __init__(self, proc: str = "/proc", nvml: Any = None, clock=time.monotonic) -> None:
        self.proc, self.nvml, self.clock = proc, nvml, clock
        self._last: dict[str, tuple[float, float]] = {}  # child key -> (when, cpu seconds)

    def sample(self, children: Iterable[Child]) -> dict[int, dict[str, float]]:
        """``{job_id: {"cpu_percent", "memory_mb", "processes"[, "gpu_memory_mb"]}}``."""
        now = self.clock()
        gpu = gpu_memory_by_pid(self.nvml) if self.nvml is not False else {}
        jobs: dict[int, dict[str, float]] = {}
        seen: dict[str, tuple[float, float]] = {}
        for child in children:
            if child.job_id is None or not child.alive():
                continue
            pids = child_pids(child)
            uses = [u for u in (process_use(pid, self.proc) for pid in pids) if u is not None]
            if not uses:
                continue
            cpu_s = sum(u.cpu_s for u in uses)
            seen[child.key] = (now, cpu_s)
            totals = jobs.setdefault(child.job_id, {"cpu_percent": 0.0, "memory_mb": 0.0,
                                                    "processes": 0})
            last = self._last.get(child.key)
            if last is not None and now > last[0]:
                # A process of the group that exited unreaped takes its time with it: never
                # below zero.
                totals["cpu_percent"] += max(0.0, 100 * (cpu_s - last[1]) / (now - last[0]))
            totals["memory_mb"] += sum(u.rss_bytes for u in uses) / MIB
            totals["processes"] += len(uses)
            if gpu:
                totals["gpu_memory_mb"] = totals.get("gpu_memory_mb", 0.0) + sum(
                    gpu.get(pid, 0) for pid in pids) / MIB
        self._last = seen
        return {job: {name: round(value, 1) for name, value in totals.items()}
                for job, totals in jobs.items()}


def publish_usage(sampler: JobUsage, children: Iterable[Child], host: str) -> int:
    """One ``metrics.usage`` event per job with processes here; returns how many."""
    samples = sampler.sample(children)
    for job_id, values in samples.items():
        publish("metrics.usage", job_id, f"agent:{host}", host=host, **values)
    return len(samples)
