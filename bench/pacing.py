"""An accelerator's compute time, emulated on a CPU by waiting: the pace of a bench's job.

``bench/cluster_real.py`` runs eight jobs of up to four workers each on a 2-core machine. Were
their steps computed on the cores, four workers would run no faster than two, and every job's
speed would depend on what the others (and the machine's other users) were doing: nothing a
scheduler's simulator, which takes each job's speed from measurements made alone, could
predict. A GPU job's host process mostly waits for its device; here it waits a set time
instead, so a job scales as it would on its own devices, while everything else is the real
product (scheduler, host agents, runtime, gloo all-reduce of the real model's gradients).

Two knobs, read by ``bench/runtime.py``'s ``as_fabric``:

- ``BENCH_SAMPLE_MS``: milliseconds of compute per sample, paid in each micro-batch's forward
  pass (the part of a step that more workers share out);
- ``BENCH_STEP_MS``: milliseconds every worker waits at the start of every step (the part that
  more workers do not shorten: a serial input stage, a slow synchronisation), which makes a job
  scale poorly.
"""

from __future__ import annotations

import os
import time

from torch import nn

SAMPLE_MS, STEP_MS = "BENCH_SAMPLE_MS", "BENCH_STEP_MS"


class Paced(nn.Module):
    """``inner``, whose forward pass also takes ``sample_ms`` per sample of its batch."""

    def __init__(self, inner: nn.Module, sample_ms: float) -> None:
        super().__init__()
        self.inner, self.sample_s = inner, sample_ms / 1000

    def forward(self, x):  # noqa: ANN001 - whatever the inner model takes
        time.sleep(len(x) * self.sample_s)
        return self.inner(x)


class StepPause:
    """A FabricModel user callback: ``ms`` of waiting at the start of each step, on every
    worker (``on_batch_begin`` fires once per optimizer step, before its micro-batches)."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1000

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        time.sleep(self.seconds)


def from_env(model: nn.Module) -> tuple[nn.Module, list]:
    """The model and the callbacks that pace it as the environment says (unchanged and none
    when it says nothing)."""
    sample_ms = float(os.environ.get(SAMPLE_MS) or 0)
    step_ms = float(os.environ.get(STEP_MS) or 0)
    if sample_ms < 0 or step_ms < 0:
        raise ValueError(f"{SAMPLE_MS} and {STEP_MS} must be 0 or more, got {sample_ms} and "
                         f"{step_ms}")
    paced = Paced(model, sample_ms) if sample_ms else model
    return paced, [StepPause(step_ms)] if step_ms else []
