"""How fast a job trains at each size, learned from what it has measured (pure, no Django).

Our runtime keeps a job's global batch constant, so ``n`` workers each compute ``B / n``
samples per step and then synchronise. The time per sample is modelled, as Pollux does for its
step time, as compute that divides among the workers plus synchronisation that does not, and
costs more once the workers are on several hosts:

    tau(n, k) = a + b / n + [n > 1] * (c + d * (n - 2))
                + [k > 1] * (f + g * (n - 2)) + e * (k - 1)

``a``: work every worker repeats (data loading, the optimizer step); ``b / n``: the forward and
backward pass, split; ``c``, ``d``: the all-reduce within a host, which costs more with more
workers; ``f``, ``g``: what it costs more once it crosses the network (Pollux fits the
all-reduce's intercept and slope separately for one node and for several, for this reason: the
step from shared memory to the network is the big one); ``e``: each host beyond the second.
Throughput is ``1 / tau``. (With ``e`` alone for the network, linear in the hosts, the fit
could not express a large cost at the first extra host and a small one after it: on the
Pollux traces it predicted 8 GPUs over two hosts 1.4 times as fast as they were, median;
bench/results/2026-11-30-pack.md.)

The seven non-negative parameters are fitted to the shapes a job has run at (``Observation``),
by least squares on relative error, pulled gently toward a prior so that a shape never seen
gets a sensible guess: the prior assumes the job scales almost linearly, with a small cost per
worker and for the network, so a job that has only run on one slot is first given more
(optimism), and once it has measured a poor speedup at that size it stops getting them. Where
only one size is known the prior decides the shape; each new size measured replaces the guess
there.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy.optimize import nnls

# Prior parameters (a, b, c, d, e, f, g), per sample, in units of the time per sample on one
# worker.
PRIOR = (0.0, 1.0, 0.03, 0.002, 0.01, 0.01, 0.0)
# How strongly the prior holds against the observations (each weighs 1, as relative error).
PRIOR_WEIGHT = 0.05


@dataclass(frozen=True)
class Observation:
    """A job measured ``samples_per_s`` on ``workers`` workers over ``hosts`` hosts."""

    workers: int
    hosts: int
    samples_per_s: float


def _features(n: int, k: int) -> list[float]:
    multi = 1.0 if n > 1 else 0.0
    apart = 1.0 if k > 1 else 0.0
    return [1.0, 1.0 / n, multi, multi * (n - 2), float(k - 1), apart, apart * (n - 2)]


@dataclass(frozen=True)
class ThroughputModel:
    """A fitted ``tau(n, k)``; ``rate(n, k)`` is samples per second at that size."""

    params: tuple[float, ...]
    # Slots per host, to guess the hosts ``rate(n)`` is spread over (the placement packs).
    slots_per_host: int = 1
    # The measurements it was fitted to, by (workers, hosts): samples per second.
    measured: dict[tuple[int, int], float] = field(default_factory=dict, compare=False,
                                                    hash=False)

    def seconds_per_sample(self, n: int, k: int | None = None) -> float:
        if k is None:
            k = -(-n // max(self.slots_per_host, 1))
        # Plain arithmetic, not numpy: the policy asks this thousands of times per decision.
        a, b, c, d, e, f, g = self.params
        sync = c + d * (n - 2) if n > 1 else 0.0
        apart = f + g * (n - 2) if k > 1 else 0.0
        return a + b / n + sync + e * (k - 1) + apart

    def rate(self, n: int, k: int | None = None) -> float:
        """Samples per second on ``n`` workers (``k`` hosts; packed if not given)."""
        return 1.0 / max(self.seconds_per_sample(n, k), 1e-12)

    def __call__(self, n: int) -> float:
        return self.rate(n)

    def speedup(self, n: int, k: int, fewer: int) -> float:
        """How much faster ``n`` workers train on ``fewer`` hosts than on ``k``: as measured
        where the job (or its kin) ran at both shapes, else as the model predicts. The model
        can only say "no slower" or "faster" (a host never helps it); a measurement can say
        that fewer hosts were slower (a host's own bottleneck, or its neighbours')."""
        measured = self.measured_speedup(n, k, fewer)
        return measured if measured is not None else self.rate(n, fewer) / self.rate(n, k)

    def measured_speedup(self, n: int, k: int, fewer: int) -> float | None:
        """``speedup`` as measured at both shapes; None where either was not."""
        now, after = self.measured.get((n, k)), self.measured.get((n, fewer))
        return after / now if now and after else None


def fit(observations: Sequence[Observation], slots_per_host: int = 1) -> ThroughputModel:
    """Fit the model to a job's measurements; the prior alone if there are none."""
    return _fit(tuple(sorted(observations, key=lambda o: (o.workers, o.hosts))),
                max(slots_per_host, 1))


@lru_cache(maxsize=4096)
def _fit(observations: tuple[Observation, ...], slots_per_host: int) -> ThroughputModel:
    seen = [o for o in observations if o.samples_per_s > 0]
    if not seen:
        return ThroughputModel(PRIOR, slots_per_host)
    measured = {(o.workers, o.hosts): o.samples_per_s for o in seen}
    # The unit: the time per sample one worker would take if the first size seen scaled
    # perfectly. The prior is written in that unit; the fit is scaled back at the end.
    unit = min(o.workers / o.samples_per_s for o in seen)
    rows, targets = [], []
    for o in seen:
        tau = 1.0 / o.samples_per_s / unit
        # Relative error: each row divided by the value it should match.
        rows.append([f / tau for f in _features(o.workers, o.hosts)])
        targets.append(1.0)
    weight = PRIOR_WEIGHT ** 0.5
    for i, p in enumerate(PRIOR):
        row = [0.0] * len(PRIOR)
        row[i] = weight
        rows.append(row)
        targets.append(weight * p)
    params, _ = nnls(np.array(rows), np.array(targets))
    return ThroughputModel(tuple(float(p) * unit for p in params), slots_per_host, measured)


def with_kin(own: Sequence[Observation], kin: Sequence[Observation]) -> list[Observation]:
    """A job's own measurements, completed by its kin's: what earlier or concurrent jobs of the
    same model, data and global batch measured at shapes this job has not run at.

    A rerun (a retraining, a hyper-parameter search's next trial) scales as its kin did, so a
    new job need not start from the prior's guess. Its own measurement at a shape always wins;
    the kin's are scaled by how fast this job runs against them where both measured (the median
    ratio), so a job on slower hosts or with a costlier setting keeps its own level. Kin are
    used only once the job has measured a size itself: until then it is not known to be alike.
    """
    if not own:
        return []
    mine = {(o.workers, o.hosts): o.samples_per_s for o in own}
    ratios = [mine[(o.workers, o.hosts)] / o.samples_per_s for o in kin
              if (o.workers, o.hosts) in mine and o.samples_per_s > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    extra = {(o.workers, o.hosts): o.samples_per_s * scale for o in kin
             if (o.workers, o.hosts) not in mine and o.samples_per_s > 0}
    return list(own) + [Observation(n, k, v) for (n, k), v in sorted(extra.items())]
