"""An application's measured speed and work, read from the Pollux OSDI'21 artifact's traces.

The traces (``traces/<app>/`` in ``../shared/traces/pollux-osdi21``) give, per application:

- ``placements.csv``: the time of one training step (``step_time``, which includes gradient
  synchronisation) per placement (``"112"``: three hosts holding 1, 1 and 2 GPUs) and local
  batch size, on up to 4 hosts;
- ``scalability.csv``: the same on 6, 8, 12 and 16 hosts (``num_nodes``, ``num_replicas``);
- ``validation-<batch>.csv``: training at that global batch size until its target accuracy; the
  last row's ``iteration`` is how many steps the job needs to finish.

How a step time is looked up (``AppTrace.step_time``), for ``n`` GPUs on ``k`` hosts at global
batch ``B`` (our runtime keeps ``B`` constant at every size, so each GPU computes ``B / n``):

1. The local batch ``b = B / n``. A local batch beyond the largest one measured (the GPU's
   memory) is computed in ``m = ceil(b / b_max)`` passes of ``b / m`` (gradient accumulation):
   the step costs ``m`` times the step at ``b / m``.
2. Measured ``(k, n)``: linear interpolation in ``b`` between the two nearest measured local
   batches, the average over the placements with that many hosts and GPUs (``"112"`` and
   ``"22"``... differ only in how GPUs spread, which our placement packs anyway).
3. Unmeasured ``(k, n)`` (e.g. 5 hosts): the compute time on one GPU at ``b`` plus an
   *overhead* (synchronisation and stragglers) interpolated from the measured shapes: linearly
   in ``n`` among the measured shapes with ``k`` hosts, else linearly in ``k`` between the
   nearest measured host counts, else the nearest measured shape.

The number of steps to the target at a global batch with no validation file is interpolated
linearly in log-log between the two nearest measured batch sizes.

``AppTrace.progress_rate(..., adapt=True)`` is a what-if, not the product: the speed of a job
that may also grow its global batch (to a validated one) as it gets GPUs, as Pollux's jobs do.
"""

from __future__ import annotations

import bisect
import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# (hosts, GPUs) -> sorted [(local batch, step time s)]
Curve = list[tuple[float, float]]


def _interp(curve: Curve, x: float) -> float:
    """Piecewise-linear interpolation on a sorted curve, clamped at both ends."""
    xs = [p[0] for p in curve]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _between(points: dict[int, float], x: int) -> float:
    """Linear interpolation over integer keys, clamped to the nearest key outside them."""
    keys = sorted(points)
    return _interp([(k, points[k]) for k in keys], x)


@dataclass
class AppTrace:
    """One application's measured step times and steps to target."""

    name: str
    curves: dict[tuple[int, int], Curve]
    # Global batch size -> steps to the target accuracy.
    steps: dict[int, int]
    max_local_batch: float = field(init=False)
    min_local_batch: float = field(init=False)
    overheads: dict[tuple[int, int], float] = field(init=False)

    def __post_init__(self) -> None:
        single = self.curves[(1, 1)]
        self.max_local_batch = single[-1][0]
        self.min_local_batch = single[0][0]
        # Overhead of a shape over one GPU's compute, at the batches both were measured at.
        self.overheads = {}
        for shape, curve in self.curves.items():
            if shape == (1, 1):
                continue
            gaps = [t - _interp(single, b) for b, t in curve]
            self.overheads[shape] = max(0.0, statistics.median(gaps))
        self._by_hosts: dict[int, dict[int, float]] = defaultdict(dict)
        for (k, n), value in self.overheads.items():
            self._by_hosts[k][n] = value

    def step_time(self, n: int, k: int, batch: int) -> float:
        """Seconds per step of global ``batch`` on ``n`` GPUs over ``k`` hosts."""
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"{self.name}: no step time for {n} GPUs on {k} hosts")
        return _step_time(self, n, k, batch)

    def progress_rate(self, n: int, k: int, batch: int, adapt: bool = False) -> float:
        """Steps of global ``batch`` per second on ``n`` GPUs over ``k`` hosts.

        With ``adapt`` (a what-if: our runtime keeps the user's batch), the job may instead
        train at any larger global batch its application was validated at, as Pollux does, at
        whichever makes progress fastest: a step of batch ``B`` is worth
        ``steps_to_target(batch) / steps_to_target(B)`` steps of ``batch``."""
        if not adapt:
            return 1.0 / self.step_time(n, k, batch)
        return _adapted(self, n, k, batch)

    @property
    def max_batch(self) -> int:
        """The largest global batch validated: the most an adapted job trains at."""
        return max(self.steps)

    def overhead(self, n: int, k: int) -> float:
        """Synchronisation overhead of ``n`` GPUs on ``k`` hosts (0 for one GPU)."""
        if n == 1:
            return 0.0
        if (k, n) in self.overheads:
            return self.overheads[(k, n)]
        if k in self._by_hosts:
            return _between(self._by_hosts[k], n)
        below = max((h for h in self._by_hosts if h < k), default=None)
        above = min((h for h in self._by_hosts if h > k), default=None)
        around = {h: _between(self._by_hosts[h], n) for h in (below, above) if h is not None}
        return _between(around, k)

    def steps_to_target(self, batch: int) -> float:
        """Steps of global ``batch`` to reach the application's target accuracy."""
        if batch in self.steps:
            return float(self.steps[batch])
        logs = [(math.log(b), math.log(s)) for b, s in sorted(self.steps.items())]
        return math.exp(_interp(logs, math.log(batch)))

    def __hash__(self) -> int:
        return id(self)


@lru_cache(maxsize=200_000)
def _step_time(app: AppTrace, n: int, k: int, batch: int) -> float:
    local = batch / n
    passes = max(1, math.ceil(local / app.max_local_batch - 1e-9))
    local /= passes
    curve = app.curves.get((k, n))
    if curve is not None:
        return passes * _interp(curve, local)
    return passes * (_interp(app.curves[(1, 1)], local) + app.overhead(n, k))


@lru_cache(maxsize=200_000)
def _adapted(app: AppTrace, n: int, k: int, batch: int) -> float:
    work = app.steps_to_target(batch)
    return max(work / app.steps_to_target(b) / _step_time(app, n, k, b)
               for b in {batch, *(b for b in app.steps if b > batch)})


def _shape(placement: str) -> tuple[int, int]:
    """``"112"`` -> (3 hosts, 4 GPUs)."""
    counts = [int(c) for c in placement.strip()]
    return len(counts), sum(counts)


def _read_curves(folder: Path) -> dict[tuple[int, int], Curve]:
    samples: dict[tuple[int, int], dict[float, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    with (folder / "placements.csv").open() as f:
        for row in csv.DictReader(f):
            samples[_shape(row["placement"])][float(row["local_bsz"])].append(
                float(row["step_time"]))
    scalability = folder / "scalability.csv"
    if scalability.exists():
        with scalability.open() as f:
            for row in csv.DictReader(f):
                shape = (int(row["num_nodes"]), int(row["num_replicas"]))
                samples[shape][float(row["local_bsz"])].append(float(row["step_time"]))
    return {
        shape: sorted((b, statistics.fmean(ts)) for b, ts in by_batch.items())
        for shape, by_batch in samples.items()
    }


def _read_steps(folder: Path) -> dict[int, int]:
    steps = {}
    for path in folder.glob("validation-*.csv"):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        if rows:
            steps[int(path.stem.split("-", 1)[1])] = int(rows[-1]["iteration"]) + 1
    return steps


def load_app(folder: Path) -> AppTrace:
    """Read one application's folder of traces."""
    curves = _read_curves(folder)
    if (1, 1) not in curves:
        raise ValueError(f"{folder}: no single-GPU measurements (placement 1)")
    steps = _read_steps(folder)
    if not steps:
        raise ValueError(f"{folder}: no validation-<batch>.csv")
    return AppTrace(folder.name, curves, steps)


def load_apps(traces: Path) -> dict[str, AppTrace]:
    """Every application under ``traces`` (one folder each)."""
    return {p.name: load_app(p) for p in sorted(traces.iterdir())
            if (p / "placements.csv").exists()}
