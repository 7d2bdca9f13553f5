"""What one operation costs the host inside a training process, measured once, right after
the warm-up, in the process itself.

``bench/gpu.py``'s throughput part finds FabricModel's steps longer than the plain loop's by
an amount that grows with the number of operations a step launches, not by a fixed cost a
step. If one side's *process* makes every operation dearer (something it set, a thread it
runs, the way it was started), the same small operations timed inside each side's process
show it; if they cost the same, the difference is in what the step does. So each side, when
``BENCH_OPCOST`` names a file, times three things there after its warm-up, on its own device,
and writes them as one JSON object:

- ``add_us``: ``x.add_(y)`` on 8 numbers, the launch of one kernel;
- ``fwd_bwd_us``: forward and backward of a 8-wide linear layer and a sum (on a GPU the
  backward runs on autograd's device thread);
- ``fwd_bwd_amp_us``: the same under autocast (float16 on a GPU, bfloat16 on a CPU).

Each is the time a call, best of 5 repeats, the device synchronised before and after each
repeat: a GPU runs kernels this small in less time than the host takes to launch them, so
it is the host's time. The sides measure one at a time, each in its turn at its gate, so that
none measures while another trains. A component figure, for finding where time goes; the
throughput ratios stay the headline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # bench.gate imports this module
    from bench.gate import Gate

OPCOST = "BENCH_OPCOST"
REPEATS = 5


def _best_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return round(best * 1e6, 3)


def measure() -> dict[str, float]:
    """The three figures, on CUDA where torch sees it (as both sides train), else the CPU."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    amp = torch.float16 if device.type == "cuda" else torch.bfloat16
    x, y = torch.ones(8, device=device), torch.full((8,), 1e-6, device=device)
    layer = torch.nn.Linear(8, 8).to(device)
    inputs = torch.ones(4, 8, device=device)

    def fwd_bwd() -> None:
        layer(inputs).sum().backward()

    def fwd_bwd_amp() -> None:
        with torch.autocast(device.type, dtype=amp):
            out = layer(inputs).sum()
        out.backward()

    return {"add_us": _best_us(lambda: x.add_(y), 2000, sync),
            "fwd_bwd_us": _best_us(fwd_bwd, 300, sync),
            "fwd_bwd_amp_us": _best_us(fwd_bwd_amp, 300, sync)}


def after_step(step: int, gate: Gate) -> None:
    """At the warm-up's last step, when the harness asked: wait for this side's turn, then
    measure and write (whole, so that the harness never reads half of it)."""
    path = os.environ.get(OPCOST)
    if not path or step != gate.first:
        return
    gate.wait()
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(measure(), f)
    os.replace(partial, path)
