"""Where a training step's time goes on the host, timed the same way inside each side.

On a GPU, ``bench/gpu.py``'s throughput part finds FabricModel's transformer steps longer
than the plain loop's, while a sampling profiler saw FabricModel's training thread spend
longer in the forward pass and less time waiting for backward than the plain loop's, for the
same kernels. A sampling profiler stops the process to read it, so this times the same thing
without stopping anything: when ``BENCH_PHASES`` names a file, both sides' model gets four
hooks, and each step is cut into

- ``forward_us``: from the model's call to its return (the host launching the forward pass);
- ``loss_us``: from the forward's return to backward reaching the model's output (the loss,
  the framework's code between, backward's start and the loss's own backward);
- ``backward_us``: from there to the gradient of the model's first parameter being stored
  (the first of ``model.parameters()``: in ``bench/models.py``'s models one backward stores
  near its end, though not always last: the transformer's position table comes just before
  its embedding's backward); the model's backward, on a GPU on autograd's own thread;
- ``rest_us``: from there to the next forward's start (the update, the next batch, reading the
  loss, the framework's own bookkeeping);
- ``step_us``: one forward's start to the next.

The file holds the median of each over the steps so far (the first ``SKIP`` left out), written
whole every ``EVERY`` steps and whenever the process pauses at its gate (``bench/gate.py``), so
a harness can read it at any moment; on a GPU also what
PyTorch's caching allocator asked of the driver a step since the first write (``cudaMalloc``
and ``cudaFree`` calls, and retries after freeing its cache, each of which waits for the
device). The hooks cost the same on both sides (a clock read each; the two backward hooks
take the interpreter's lock once a step each on autograd's thread). A component figure, for
finding where time goes; the throughput ratios stay the headline.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

PHASES = "BENCH_PHASES"
SKIP = 5  # the first steps: allocation and autotuning, not the steady state
EVERY = 50
NAMES = ("forward_us", "loss_us", "backward_us", "rest_us", "step_us")
# PyTorch's caching allocator's counters (torch.cuda.memory_stats), reported a step.
ALLOCATOR = {"num_device_alloc": "cuda_mallocs", "num_device_free": "cuda_frees",
             "num_alloc_retries": "alloc_retries"}


class Phases:
    """The hooks on one model, and the step times they take."""

    def __init__(self, model: Any, path: str) -> None:
        self.path = path
        self.times: dict[str, list[float]] = {name: [] for name in NAMES}
        self._start = self._forward_end = self._model_grad = self._backward_end = None
        self._allocator: tuple[int, dict[str, int]] | None = None  # (step, counters) then
        model.register_forward_pre_hook(self._on_forward_start)
        model.register_forward_hook(self._on_forward_end)
        first = next(p for p in model.parameters() if p.requires_grad)
        first.register_post_accumulate_grad_hook(self._on_backward_end)

    def _on_forward_start(self, *_: Any) -> None:
        now = time.perf_counter()
        if None not in (self._start, self._forward_end, self._model_grad, self._backward_end):
            self._add("forward_us", self._forward_end - self._start)
            self._add("loss_us", self._model_grad - self._forward_end)
            self._add("backward_us", self._backward_end - self._model_grad)
            self._add("rest_us", now - self._backward_end)
            self._add("step_us", now - self._start)
            if len(self.times["step_us"]) % EVERY == 0:
                self.write()
        self._start = now
        self._forward_end = self._model_grad = self._backward_end = None

    def _on_forward_end(self, _module: Any, _args: Any, output: Any) -> None:
        self._forward_end = time.perf_counter()
        node = getattr(output, "grad_fn", None)
        if node is not None:  # the model's output: where backward enters the model
            node.register_prehook(self._on_model_grad)

    def _on_model_grad(self, *_: Any) -> None:
        self._model_grad = time.perf_counter()

    def _on_backward_end(self, *_: Any) -> None:
        self._backward_end = time.perf_counter()

    def _add(self, name: str, seconds: float) -> None:
        self.times[name].append(seconds * 1e6)

    def medians(self) -> dict[str, float]:
        """Each phase's median over the steps after the first ``SKIP``, and their count."""
        out: dict[str, float] = {"steps": max(0, len(self.times["step_us"]) - SKIP)}
        for name, values in self.times.items():
            if len(values) > SKIP:
                out[name] = round(statistics.median(values[SKIP:]), 1)
        return {**out, **self._allocator_per_step()}

    def _allocator_per_step(self) -> dict[str, float]:
        """The allocator's calls to the driver a step since the first write (none on a CPU)."""
        import torch

        if not torch.cuda.is_initialized():
            return {}
        stats = torch.cuda.memory_stats()
        now = (len(self.times["step_us"]), {k: stats.get(k, 0) for k in ALLOCATOR})
        if self._allocator is None:
            self._allocator = now
            return {}
        steps = now[0] - self._allocator[0]
        return {name: round((now[1][k] - self._allocator[1][k]) / steps, 3)
                for k, name in ALLOCATOR.items()} if steps else {}

    def write(self) -> None:
        partial = f"{self.path}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(self.medians(), f)
        os.replace(partial, self.path)


def install(model: Any) -> Phases | None:
    """The hooks on ``model`` when the environment asks for them, else nothing."""
    path = os.environ.get(PHASES)
    if not path:
        return None
    from bench import gate

    phases = Phases(model, path)
    gate.BEFORE_PAUSE.append(phases.write)
    return phases
