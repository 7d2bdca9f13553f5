"""What the ``goodput`` policy knows of each job: its throughput at each size it has run at,
read from its step reports (``JobMetric`` train rows carry ``samples_per_s`` and ``workers``),
the work it has left (its epochs), and the slot-time it has had (its allocations)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from jobs.models import JobMetric, SlotAllocation, TrainingJob
from scheduler.throughput import Observation, ThroughputModel, fit

# Reports older than this are not used: a job's speed drifts (data, other jobs on the host),
# and reading a long history every cycle would cost more than it tells.
WINDOW = timedelta(minutes=30)
# At most this many reports per job are read each cycle (the newest).
ROWS_PER_JOB = 400


def observations(job_ids: list[int], now: datetime, slots_per_host: int
                 ) -> dict[int, list[Observation]]:
    """Each job's median samples per second at each worker count it reported, newest reports
    first. The hosts a size spread over are not in the reports: the placement packs, so
    ``ceil(workers / slots_per_host)``."""
    per: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = (JobMetric.objects
            .filter(job_id__in=job_ids, kind=JobMetric.Kind.TRAIN, ts__gte=now - WINDOW,
                    workers__gt=0)
            .order_by("-ts").values_list("job_id", "workers", "values"))
    for job_id, workers, values in rows[:ROWS_PER_JOB * max(len(job_ids), 1)]:
        rate = values.get("samples_per_s") if isinstance(values, dict) else None
        if isinstance(rate, int | float) and rate > 0 and len(per[job_id][workers]) < 50:
            per[job_id][workers].append(float(rate))
    return {
        job_id: [Observation(n, -(-n // max(slots_per_host, 1)), statistics.median(rates))
                 for n, rates in sorted(sizes.items())]
        for job_id, sizes in per.items()
    }


def remaining_samples(job: TrainingJob, now: datetime, rate: float | None) -> float | None:
    """Samples the job has left, from its epochs and its pace so far: the time left at that
    pace (as the job page's ETA) times its current throughput. None before its first epoch
    is done or without a throughput."""
    if not rate or not job.started or not job.epochs or job.epoch <= 1:
        return None
    done = min(job.epoch - 1, job.epochs) / job.epochs
    elapsed = (now - job.started).total_seconds()
    return max(elapsed * (1 - done) / done, 0.0) * rate


@dataclass(frozen=True)
class Learned:
    """What the policy is told of one job (``JobDemand``'s ``rate``, ``remaining``,
    ``history``)."""

    rate: ThroughputModel
    remaining: float | None
    history: tuple[float, float]


def slot_seconds(job_ids: list[int], now: datetime) -> dict[int, float]:
    """Slot-seconds each job has held since it was submitted (its allocations' durations)."""
    held: dict[int, float] = defaultdict(float)
    for job_id, granted, released in SlotAllocation.objects.filter(
            job_id__in=job_ids).values_list("job_id", "granted_at", "released_at"):
        held[job_id] += max(((released or now) - granted).total_seconds(), 0.0)
    return held


def models(jobs: list[TrainingJob], now: datetime, slots_per_host: int) -> dict[int, Learned]:
    """Per job: its fitted throughput model, the samples it has left (or None), its age and
    the slot-seconds it has held."""
    ids = [j.pk for j in jobs]
    seen = observations(ids, now, slots_per_host)
    held = slot_seconds(ids, now)
    out = {}
    for job in jobs:
        mine = seen.get(job.pk, [])
        current = mine[-1].samples_per_s if mine else None
        out[job.pk] = Learned(
            rate=fit(mine, slots_per_host),
            remaining=remaining_samples(job, now, current),
            history=(max((now - job.created).total_seconds(), 0.0), held.get(job.pk, 0.0)),
        )
    return out
