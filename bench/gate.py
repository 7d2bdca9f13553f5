"""A training process that pauses every few steps until its harness lets it go on.

``bench/gpu.py`` runs the two sides it compares (FabricModel and the plain loop, in float32
and with AMP) at the same time and lets them train in turns, one window of steps each, so
that every side meets the same moments of a machine whose speed drifts from one minute to
the next. Each process pauses after its warm-up and after every window of steps that
follows, and waits for one byte on its gate (a named pipe the harness holds open) before it
goes on. Paused, it holds its memory and CUDA context but uses no processor and no GPU.

The training script's side (this module) needs nothing but the standard library (and
``bench/opcost.py``, which imports torch only when it measures): the plain loop calls
:meth:`Gate.after_step` itself, FabricModel gets :class:`GateCallback`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from bench import opcost

# The environment the harness sets: the gate's path, the steps before the first pause (the
# warm-up) and the steps of a window.
GATE, FIRST, EVERY = "BENCH_GATE", "BENCH_GATE_FIRST", "BENCH_GATE_EVERY"
# Called before each pause: bench/phases.py writes its figures then, so that what the harness
# reads once a window is over is current, and writing costs no step any time.
BEFORE_PAUSE: list[Callable[[], None]] = []


class Gate:
    """Pauses after step ``first`` and after every ``every`` steps from there; a no-op
    when the environment names no gate."""

    def __init__(self) -> None:
        self.path = os.environ.get(GATE)
        self.first = int(os.environ.get(FIRST, "0"))
        self.every = int(os.environ.get(EVERY, "1"))
        self.fd: int | None = None

    def after_step(self, step: int) -> None:
        """``step`` counts from 1. Blocks at a window's end until the harness opens the
        next."""
        if self.path and step >= self.first and (step - self.first) % self.every == 0:
            self.wait()

    def wait(self) -> None:
        """Blocks until the harness writes a byte; a closed gate (the harness is gone)
        lets the process go on to its end."""
        if self.fd is None:
            # The harness holds the pipe open for reading and writing, so this open does not
            # wait for a writer, and a read waits for the harness's byte.
            self.fd = os.open(self.path, os.O_RDONLY)
        for before in BEFORE_PAUSE:
            before()
        os.read(self.fd, 1)


class GateCallback:
    """The gate as a FabricModel user callback: a step ends at ``on_batch_end``, after the
    runtime has logged it. Counted here, as the batch index restarts every epoch."""

    def __init__(self) -> None:
        self.gate = Gate()
        self.steps = 0

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps += 1
        opcost.after_step(self.steps, self.gate)
        self.gate.after_step(self.steps)
