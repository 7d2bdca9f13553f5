"""``torch.profiler`` over a window of training steps, for ``bench/gpu.py``'s profile part:
where a step's host and device time goes, measured the same way on both sides (the
FabricModel worker, through a user callback, and the plain loop).

Set ``BENCH_PROFILE=<path prefix>`` in a training script's environment; :func:`from_env`
then gives a :class:`StepProfiler` whose :meth:`~StepProfiler.step` the script calls after
each training step. After ``BENCH_PROFILE_SKIP`` steps (warm-up: allocator, cuDNN's choice
of kernels) it records ``BENCH_PROFILE_STEPS`` steps and writes:

- ``<prefix>.txt``: the operators by their own host time and, on a GPU, by device time;
- ``<prefix>.json``: the reads back to the host per step (``.item()`` and the like, the
  stream and device synchronisations), the figure that says whether a step makes the host
  wait for the device, and the step's host and device time;
- ``<prefix>.trace.json.gz``: the timeline, for ``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import json
import os
from typing import Any

# Operators and CUDA calls that make the host wait for the device.
READS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
         "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


class StepProfiler:
    """Profiles steps ``skip`` to ``skip + steps`` of a training loop, then writes them."""

    def __init__(self, prefix: str, skip: int, steps: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.prefix, self.steps = prefix, steps
        self.cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities,
                             schedule=schedule(wait=max(skip - 1, 0), warmup=1, active=steps),
                             on_trace_ready=self._write)
        self._prof.start()
        self._done = False

    def step(self) -> None:
        """One training step is over (its loss read, as the loop does)."""
        if not self._done:
            self._prof.step()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._prof.stop()

    def _write(self, prof: Any) -> None:
        self._done = True
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
        if self.cuda:
            tables.append(averages.table(sort_by="self_device_time_total", row_limit=30))
        with open(self.prefix + ".txt", "w", encoding="utf-8") as f:
            f.write("\n\n".join(tables))
        with open(self.prefix + ".json", "w", encoding="utf-8") as f:
            json.dump(summary(averages, self.steps), f)
        prof.export_chrome_trace(self.prefix + ".trace.json.gz")


def _device_us(averages: Any) -> float:
    """The device's busy time: the kernels' and copies' own time. Summing every row's device
    time would count each kernel twice (the kernel's row, and again in the operator that
    launched it) and add the span of each annotated range (the profiler's step, the
    optimizer's step), gaps included: the first profiled GPU run (an H200) read 33 ms a
    step where the kernels took 7. This is the rule of the profiler's own table total."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in averages
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))


def summary(averages: Any, steps: int) -> dict[str, Any]:
    """Per step: the reads back to the host by kind, the host time (ms) of the operators'
    own work, and the time (ms) the device was busy."""
    reads = {e.key: round(e.count / steps, 2) for e in averages if e.key in READS}
    host_us = sum(e.self_cpu_time_total for e in averages)
    device_us = _device_us(averages)
    return {"steps": steps, "reads_per_step": reads,
            "host_ms_per_step": round(host_us / steps / 1000, 3),
            "device_ms_per_step": round(device_us / steps / 1000, 3)}


def from_env() -> StepProfiler | None:
    prefix = os.environ.get("BENCH_PROFILE")
    if not prefix:
        return None
    return StepProfiler(prefix, int(os.environ.get("BENCH_PROFILE_SKIP", "10")),
                        int(os.environ.get("BENCH_PROFILE_STEPS", "20")))


class ProfileCallback:
    """The profiler as a FabricModel user callback: a step ends at ``on_batch_end``. Made at
    ``on_train_begin``, which only a process that trains calls (not the driver)."""

    def __init__(self) -> None:
        self.profiler: StepProfiler | None = None

    def on_train_begin(self) -> None:
        self.profiler = from_env()

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
