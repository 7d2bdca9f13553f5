"""What a run of the simulator says: completion times, utilisation and fairness."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .engine import Result, Run
from .traces import AppTrace


@dataclass(frozen=True)
class Summary:
    """One policy on one workload."""

    policy: str
    jobs: int
    jct_mean_s: float
    jct_p99_s: float
    makespan_s: float
    utilisation: float
    # Finish-time fairness (Themis): each job's completion time over the time it would take
    # alone on 1/N of the cluster, N the jobs it shared the cluster with on average. 1: as
    # good as its fair slice; above: worse.
    ftf_mean: float
    ftf_p99: float
    rescales_per_job: float
    decisions: int
    decision_ms_mean: float


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def isolated_s(result: Result, app: AppTrace, total: int, slots_per_host: int) -> float:
    """How long the job takes alone on its fair slice: ``total / contention`` slots (at least
    1, at most its max workers), interpolating the throughput between whole slot counts."""
    job = result.job
    share = min(max(total / result.contention, 1.0), float(job.max_workers))
    lo, hi = math.floor(share), math.ceil(share)

    def speed(n: int) -> float:
        return 1.0 / app.step_time(n, -(-n // slots_per_host), job.batch)

    rate = speed(lo) + (speed(hi) - speed(lo)) * (share - lo)
    return app.steps_to_target(job.batch) / rate


def summarize(run: Run, apps: dict[str, AppTrace], total: int, slots_per_host: int) -> Summary:
    jcts = [r.jct for r in run.results]
    ftf = [r.jct / isolated_s(r, apps[r.job.app], total, slots_per_host) for r in run.results]
    return Summary(
        policy=run.policy,
        jobs=len(jcts),
        jct_mean_s=statistics.fmean(jcts),
        jct_p99_s=percentile(jcts, 0.99),
        makespan_s=run.makespan,
        utilisation=run.utilisation,
        ftf_mean=statistics.fmean(ftf),
        ftf_p99=percentile(ftf, 0.99),
        rescales_per_job=statistics.fmean(r.rescales for r in run.results),
        decisions=run.decisions,
        decision_ms_mean=1000 * run.decision_s / max(run.decisions, 1),
    )
